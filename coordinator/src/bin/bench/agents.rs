//! `tinyvllm-bench agents`: coding-agent sessions against a running
//! cluster (issue 60). Each session re-sends its whole history every
//! turn, as an agent does: it starts at `start_tokens` and grows by
//! `turn_tokens` (the tool results and the next instruction) a turn, for
//! `turns` turns, one turn after the other; `sessions` run at once. What
//! decides a turn's TTFT is whether its history's KV is still cached, in a
//! worker's KV pool or its second tier. `--unique` draws every turn's
//! history afresh: nothing can be reused, which prices the tier's
//! bookkeeping when it never hits.

use serde_json::{Value, json};

use crate::loadgen::{self, Outcome, WorkloadConfig};

#[derive(Clone, Debug, clap::Args)]
pub struct AgentsConfig {
    /// The coordinator's HTTP base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    /// The history's length at the first turn.
    #[arg(long, default_value_t = 8192)]
    pub start_tokens: usize,
    /// Tokens each turn adds to the history.
    #[arg(long, default_value_t = 500)]
    pub turn_tokens: usize,
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// Tokens each turn generates.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Every turn a fresh history (nothing to reuse).
    #[arg(long)]
    pub unique: bool,
    #[arg(long, default_value_t = 512)]
    pub vocab_size: u32,
    #[arg(long, default_value_t = 3)]
    pub first_token: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, env = "TINYVLLM_API_KEY")]
    pub api_key: Option<String>,
}

#[derive(Clone, Debug)]
pub struct AgentsReport {
    pub turns: usize,
    pub errors: usize,
    pub duration_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    /// The same over turns after each session's first (those that can reuse).
    pub later_ttft_mean_ms: f64,
    pub output_tok_per_s: f64,
    pub prompt_tok_per_s: f64,
    pub cached_fraction: f64,
}

impl AgentsReport {
    pub fn to_json(&self) -> Value {
        json!({
            "turns": self.turns, "errors": self.errors, "duration_s": self.duration_s,
            "ttft_p50_ms": self.ttft_p50_ms, "ttft_p99_ms": self.ttft_p99_ms, "ttft_mean_ms": self.ttft_mean_ms,
            "later_ttft_mean_ms": self.later_ttft_mean_ms, "output_tok_per_s": self.output_tok_per_s,
            "prompt_tok_per_s": self.prompt_tok_per_s, "cached_fraction": self.cached_fraction,
        })
    }
}

/// Runs every session to its last turn.
pub fn run(cfg: &AgentsConfig) -> AgentsReport {
    let request = WorkloadConfig {
        url: cfg.url.clone(),
        model: cfg.model.clone(),
        max_tokens: cfg.max_tokens,
        api_key: cfg.api_key.clone(),
        ..WorkloadConfig::defaults()
    };
    let started = std::time::Instant::now();
    let sessions: Vec<_> = (0..cfg.sessions)
        .map(|s| {
            let (cfg, request) = (cfg.clone(), request.clone());
            std::thread::spawn(move || session(&cfg, &request, s as u64))
        })
        .collect();
    let turns: Vec<(usize, Outcome)> = sessions.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect();
    let duration_s = started.elapsed().as_secs_f64();
    if let Some(e) = turns.iter().find_map(|(_, o)| o.error.as_ref()) {
        eprintln!("first error: {e}");
    }
    let ok: Vec<&(usize, Outcome)> = turns.iter().filter(|(_, o)| o.error.is_none()).collect();
    let mut ttfts: Vec<f64> = ok.iter().map(|(_, o)| o.ttft * 1e3).collect();
    let later: Vec<f64> = ok.iter().filter(|(t, _)| *t > 0).map(|(_, o)| o.ttft * 1e3).collect();
    let sum = |f: fn(&Outcome) -> usize| ok.iter().map(|(_, o)| f(o)).sum::<usize>() as f64;
    let (prompt, cached) = (sum(|o| o.prompt_tokens), sum(|o| o.cached_tokens));
    AgentsReport {
        turns: turns.len(),
        errors: turns.len() - ok.len(),
        duration_s,
        ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_p50_ms: crate::sim::percentile(&mut ttfts, 0.5),
        ttft_p99_ms: crate::sim::percentile(&mut ttfts, 0.99),
        later_ttft_mean_ms: later.iter().sum::<f64>() / later.len().max(1) as f64,
        output_tok_per_s: sum(|o| o.output_tokens) / duration_s,
        prompt_tok_per_s: prompt / duration_s,
        cached_fraction: cached / prompt.max(1.0),
    }
}

/// One session's turns, in order: (turn, outcome).
fn session(cfg: &AgentsConfig, request: &WorkloadConfig, index: u64) -> Vec<(usize, Outcome)> {
    let mut rng = crate::sim::SplitMix(cfg.seed.wrapping_mul(0x9e37_79b9).wrapping_add(index));
    let span = u64::from(cfg.vocab_size.saturating_sub(cfg.first_token).max(1));
    let mut draw = |n: usize| -> Vec<u32> { (0..n).map(|_| cfg.first_token + (rng.next() % span) as u32).collect() };
    let mut history = draw(cfg.start_tokens);
    let mut out = Vec::with_capacity(cfg.turns);
    for turn in 0..cfg.turns {
        if turn > 0 {
            if cfg.unique {
                history = draw(history.len() + cfg.turn_tokens);
            } else {
                history.extend(draw(cfg.turn_tokens));
            }
        }
        out.push((turn, loadgen::one_request(request, &history)));
    }
    out
}
