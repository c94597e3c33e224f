//! An open-loop load generator for a running cluster (`tinyvllm-bench
//! workload`): G groups of queries share a prefix of P tokens each, Q
//! queries per group with distinct suffixes, arriving as a Poisson process
//! at rate R, interleaved across groups. Each query streams from
//! `/v1/completions`; the report has throughput, TTFT and ITL percentiles,
//! and the cluster's prefix hit rate against the best possible.

use std::io::BufRead;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The workload, as `tinyvllm-bench workload` takes it on the command line.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkloadConfig {
    /// The coordinator's HTTP base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long)]
    pub model: Option<String>,
    /// G: groups, each with its own shared prefix.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// P: shared prefix length in tokens.
    #[arg(long, default_value_t = 512)]
    pub prefix_tokens: usize,
    /// Q: queries per group.
    #[arg(long = "queries", value_name = "QUERIES", default_value_t = 8)]
    pub queries_per_group: usize,
    /// Distinct suffix length per query, in tokens.
    #[arg(long, default_value_t = 32)]
    pub suffix_tokens: usize,
    /// R: mean arrivals per second (Poisson).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Token ids are drawn below this (the model's vocabulary size).
    #[arg(long, default_value_t = 512)]
    pub vocab_size: u32,
    /// And from this up (skips special tokens).
    #[arg(long, default_value_t = 3)]
    pub first_token: u32,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, env = "TINYVLLM_API_KEY")]
    pub api_key: Option<String>,
}

/// One streamed request, as the client saw it.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub ttft: f64,
    pub itls: Vec<f64>,
    pub e2e: f64,
    pub output_tokens: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub worker: String,
    pub error: Option<String>,
}

impl WorkloadConfig {
    /// Every flag at its default (for other benchmarks' requests).
    pub fn defaults() -> Self {
        use clap::{Args, FromArgMatches};
        let matches = Self::augment_args(clap::Command::new("defaults")).get_matches_from(["defaults"]);
        Self::from_arg_matches(&matches).expect("the defaults parse")
    }
}

#[derive(Clone, Debug)]
pub struct WorkloadReport {
    pub requests: usize,
    pub errors: usize,
    pub duration_s: f64,
    pub output_tok_per_s: f64,
    pub requests_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub hit_rate: f64,
    pub ideal_hit_rate: f64,
    /// Requests served per worker, by name.
    pub per_worker: Vec<(String, usize)>,
}

impl WorkloadReport {
    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.requests, "errors": self.errors, "duration_s": self.duration_s,
            "output_tok_per_s": self.output_tok_per_s, "requests_per_s": self.requests_per_s,
            "ttft_p50_ms": self.ttft_p50_ms, "ttft_p99_ms": self.ttft_p99_ms, "ttft_mean_ms": self.ttft_mean_ms,
            "itl_p50_ms": self.itl_p50_ms, "itl_p99_ms": self.itl_p99_ms,
            "hit_rate": self.hit_rate, "ideal_hit_rate": self.ideal_hit_rate,
            "per_worker": self.per_worker.iter().map(|(w, n)| json!({"worker": w, "requests": n})).collect::<Vec<_>>(),
        })
    }
}

/// Runs the workload to completion.
pub fn run(cfg: &WorkloadConfig) -> WorkloadReport {
    let mut rng = crate::sim::SplitMix(cfg.seed);
    let span = cfg.vocab_size.saturating_sub(cfg.first_token).max(1) as u64;
    let draw = |n: usize, rng: &mut crate::sim::SplitMix| -> Vec<u32> {
        (0..n).map(|_| cfg.first_token + (rng.next() % span) as u32).collect()
    };
    let prefixes: Vec<Vec<u32>> = (0..cfg.groups).map(|_| draw(cfg.prefix_tokens, &mut rng)).collect();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for q in 0..cfg.queries_per_group {
        for prefix in &prefixes {
            let _ = q;
            let mut p = prefix.clone();
            p.extend(draw(cfg.suffix_tokens, &mut rng));
            prompts.push(p);
        }
    }
    // Interleave groups but not in lockstep: a seeded shuffle.
    for i in (1..prompts.len()).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        prompts.swap(i, j);
    }

    let started = Instant::now();
    let mut handles = Vec::with_capacity(prompts.len());
    let mut at = 0.0f64;
    for prompt in prompts {
        at += -rng.unit().max(1e-12).ln() / cfg.rate;
        let wait = Duration::from_secs_f64(at).saturating_sub(started.elapsed());
        std::thread::sleep(wait);
        let cfg = cfg.clone();
        handles.push(std::thread::spawn(move || one_request(&cfg, &prompt)));
    }
    let outcomes: Vec<Outcome> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|_| Outcome { error: Some("panicked".into()), ..Outcome::default() }))
        .collect();
    let duration_s = started.elapsed().as_secs_f64();

    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    if let Some(e) = outcomes.iter().find_map(|o| o.error.as_ref()) {
        eprintln!("first error: {e}");
    }
    let mut ttfts: Vec<f64> = ok.iter().map(|o| o.ttft * 1e3).collect();
    let mut itls: Vec<f64> = ok.iter().flat_map(|o| o.itls.iter().map(|x| x * 1e3)).collect();
    let output: usize = ok.iter().map(|o| o.output_tokens).sum();
    let prompt_tokens: usize = ok.iter().map(|o| o.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|o| o.cached_tokens).sum();
    // Best case: each group's prefix computed once; its full blocks reused by the rest.
    let reusable = cfg.prefix_tokens.min(cfg.prefix_tokens + cfg.suffix_tokens - 1) / cfg.block_size * cfg.block_size;
    let ideal = cfg.groups * cfg.queries_per_group.saturating_sub(1) * reusable;
    let mut per_worker: std::collections::BTreeMap<String, usize> = Default::default();
    for o in &ok {
        *per_worker.entry(o.worker.clone()).or_default() += 1;
    }
    WorkloadReport {
        requests: outcomes.len(),
        errors: outcomes.len() - ok.len(),
        duration_s,
        output_tok_per_s: output as f64 / duration_s,
        requests_per_s: ok.len() as f64 / duration_s,
        ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_p50_ms: crate::sim::percentile(&mut ttfts, 0.5),
        ttft_p99_ms: crate::sim::percentile(&mut ttfts, 0.99),
        itl_p50_ms: crate::sim::percentile(&mut itls, 0.5),
        itl_p99_ms: crate::sim::percentile(&mut itls, 0.99),
        hit_rate: cached as f64 / prompt_tokens.max(1) as f64,
        ideal_hit_rate: ideal as f64
            / (cfg.groups * cfg.queries_per_group * (cfg.prefix_tokens + cfg.suffix_tokens)).max(1) as f64,
        per_worker: per_worker.into_iter().collect(),
    }
}

/// Streams `prompt` from `/v1/completions`, greedy, timing each token.
pub fn one_request(cfg: &WorkloadConfig, prompt: &[u32]) -> Outcome {
    let mut body = json!({
        "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true},
    });
    if let Some(model) = &cfg.model {
        body["model"] = json!(model);
    }
    let mut request = ureq::post(&format!("{}/v1/completions", cfg.url.trim_end_matches('/')));
    if let Some(key) = &cfg.api_key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let sent = Instant::now();
    let mut out = Outcome { prompt_tokens: prompt.len(), ..Outcome::default() };
    let response = match request.send_json(body) {
        Ok(r) => r,
        Err(e) => return Outcome { error: Some(e.to_string()), ..out },
    };
    let mut last: Option<Instant> = None;
    for line in std::io::BufReader::new(response.into_reader()).lines() {
        let Ok(line) = line else { return Outcome { error: Some("stream broken".into()), ..out } };
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else { continue };
        if let Some(e) = event.get("error") {
            return Outcome { error: Some(e.to_string()), ..out };
        }
        if let Some(usage) = event.get("usage").filter(|u| !u.is_null()) {
            out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
            out.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
        let Some(choice) = event["choices"].get(0) else { continue };
        if let Some(worker) = choice["worker"].as_str() {
            out.worker = worker.to_string();
        }
        if choice["text"].as_str().is_some_and(|t| !t.is_empty()) {
            let now = Instant::now();
            match last {
                None => out.ttft = (now - sent).as_secs_f64(),
                Some(prev) => out.itls.push((now - prev).as_secs_f64()),
            }
            last = Some(now);
        }
    }
    out.e2e = sent.elapsed().as_secs_f64();
    if out.output_tokens == 0 {
        // A server without usage in its stream (llama.cpp's): count chunks.
        out.output_tokens = out.itls.len() + usize::from(last.is_some());
    }
    if last.is_none() {
        out.error = Some("no tokens streamed".into());
    }
    out
}
