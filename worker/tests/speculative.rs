//! Speculative decoding at the engine level, n-gram and draft-model, on
//! stories260K: the sampled distribution is the target's (a chi-square test
//! over 10,000 samples per mode), and seeded sampling with penalties,
//! logprobs, stop tokens and preemption gives exactly what plain decoding
//! gives.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{RequestId, SamplingParams, Speculative};
use engine_core::{SpecDecodingStats, SpecMethod, SpeculativeConfig, TokenLogprobs};
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig};

fn engine(speculative: SpeculativeConfig, num_blocks: usize) -> Engine {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models/stories260K"));
    let files = ModelFiles::resolve(&ModelSource::Dir(dir.clone()), Need::Weights).unwrap();
    // The draft: stories260K's first 2 of 5 layers.
    let draft_model = (speculative.default_method == SpecMethod::Draft)
        .then(|| ModelFiles::resolve(&ModelSource::Dir(support::truncated_model(&dir, 2)), Need::Weights).unwrap());
    let config = EngineConfig {
        draft_model,
        num_blocks: Some(num_blocks),
        max_num_seqs: 256,
        max_num_batched_tokens: 4096,
        device: worker::runner::device::test_device(),
        speculative,
        ..EngineConfig::default()
    };
    Engine::new(&files, config).unwrap()
}

fn ngram(k: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        enabled_by_default: true,
        num_speculative_tokens: k,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
        max_batch_tokens: usize::MAX,
        ..SpeculativeConfig::default()
    }
}

fn draft(k: usize) -> SpeculativeConfig {
    SpeculativeConfig { default_method: SpecMethod::Draft, ..ngram(k) }
}

/// A story and its greedy continuation twice over (stories260K's golden
/// "once_upon" case): the model tends to repeat it, so proposals come
/// often and are accepted often but not always.
fn repetitive_prompt() -> Vec<u32> {
    let story = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337];
    [&story[..], &story[1..], &story[1..9]].concat()
}

struct Output {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
}

/// Runs every (id, params) on `prompt` to the end.
fn run(e: &mut Engine, prompt: &[u32], requests: impl IntoIterator<Item = SamplingParams>) -> Vec<Output> {
    let mut n = 0;
    for (i, params) in requests.into_iter().enumerate() {
        e.add_request(RequestId(i as u64), prompt.to_vec(), params, 0).unwrap();
        n += 1;
    }
    let mut outs: HashMap<u64, Output> = HashMap::new();
    while e.has_unfinished() {
        for o in e.step().unwrap() {
            let entry = outs.entry(o.id.0).or_insert(Output { tokens: Vec::new(), logprobs: Vec::new() });
            entry.tokens.extend(o.new_token_ids);
            entry.logprobs.extend(o.logprobs);
        }
    }
    e.scheduler().check_invariants();
    (0..n).map(|i| outs.remove(&i).unwrap()).collect()
}

fn sampled(seed: u64, max_tokens: u32) -> SamplingParams {
    SamplingParams { temperature: 1.0, seed: Some(seed), max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

fn assert_mixed_acceptance(s: &SpecDecodingStats) {
    assert!(s.num_drafts > 0, "no proposal was made: {s:?}");
    assert!(s.num_accepted_tokens > 0 && s.num_accepted_tokens < s.num_draft_tokens, "{s:?}");
}

/// Pearson's chi-square test of homogeneity of two samples' counts;
/// categories with fewer than 5 expected in either are pooled. Returns
/// (statistic, critical value at p = 0.001).
fn chi_square<K: std::hash::Hash + Eq + Clone>(a: &[K], b: &[K]) -> (f64, f64) {
    let mut counts: HashMap<K, (f64, f64)> = HashMap::new();
    for k in a {
        counts.entry(k.clone()).or_default().0 += 1.0;
    }
    for k in b {
        counts.entry(k.clone()).or_default().1 += 1.0;
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let share = |(x, y): (f64, f64)| (x + y) / (na + nb);
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for &c in counts.values() {
        if share(c) * na.min(nb) < 5.0 {
            pooled = (pooled.0 + c.0, pooled.1 + c.1);
        } else {
            cells.push(c);
        }
    }
    if pooled.0 + pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let stat: f64 = cells
        .iter()
        .map(|&c| {
            let (ea, eb) = (share(c) * na, share(c) * nb);
            (c.0 - ea).powi(2) / ea + (c.1 - eb).powi(2) / eb
        })
        .sum();
    // Wilson-Hilferty: the chi-square quantile from the normal's (z = 3.09).
    let df = (cells.len() - 1).max(1) as f64;
    let critical = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat, critical)
}

/// 10,000 samples with and 10,000 without speculation (different seeds,
/// so the samples are independent) come from the same distribution: the
/// first token (from the prompt's pass), the second (the first one a
/// proposal is verified against) and the pairs after it (the tokens of
/// one verification).
#[test]
fn speculative_sampling_keeps_the_target_distribution() {
    const N: u64 = 10_000;
    let prompt = repetitive_prompt();
    let mut plain = engine(SpeculativeConfig::default(), 4096);
    let base = run(&mut plain, &prompt, (0..N).map(|s| sampled(s, 4)));
    let at = |outs: &[Output], i: usize| outs.iter().map(|o| o.tokens[i]).collect::<Vec<_>>();
    let pairs = |outs: &[Output], i: usize| outs.iter().map(|o| (o.tokens[i], o.tokens[i + 1])).collect::<Vec<_>>();
    for (method, config, seeds) in [("n-gram", ngram(4), N..2 * N), ("draft", draft(4), 2 * N..3 * N)] {
        let mut spec = engine(config, 4096);
        let with = run(&mut spec, &prompt, seeds.map(|s| sampled(s, 4)));
        assert_mixed_acceptance(&spec.stats().spec_decoding);
        for (what, (stat, critical)) in [
            ("first token", chi_square(&at(&base, 0), &at(&with, 0))),
            ("second token", chi_square(&at(&base, 1), &at(&with, 1))),
            ("second and third", chi_square(&pairs(&base, 1), &pairs(&with, 1))),
            ("third and fourth", chi_square(&pairs(&base, 2), &pairs(&with, 2))),
        ] {
            eprintln!("{method}, {what}: chi-square {stat:.1}, critical {critical:.1}");
            assert!(stat < critical, "{method}, {what}: chi-square {stat:.1} >= {critical:.1} (p = 0.001)");
        }
        eprintln!("{method} proposals: {:?}", spec.stats().spec_decoding);
    }
    // The test can tell distributions apart: a hotter target fails it.
    let mut hot = engine(SpeculativeConfig::default(), 4096);
    let hotter = run(&mut hot, &prompt, (N..2 * N).map(|s| SamplingParams { temperature: 1.3, ..sampled(s, 4) }));
    let (stat, critical) = chi_square(&pairs(&base, 1), &pairs(&hotter, 1));
    eprintln!("temperature 1.3 vs 1.0: chi-square {stat:.1}, critical {critical:.1}");
    assert!(stat > critical, "temperature 1.3 vs 1.0 not detected: {stat:.1} < {critical:.1}");
}

/// The same seeds give the same tokens and the target's logprobs with and
/// without speculation, with penalties, top-k/top-p/min-p, stop tokens,
/// requests that opt out, and a pool small enough to preempt.
#[test]
fn seeded_sampling_is_exactly_plain_decoding() {
    let prompt = repetitive_prompt();
    let params = |i: u64| {
        let mut p = SamplingParams { logprobs: Some(2), ..sampled(i, 40) };
        match i % 5 {
            0 => p.temperature = 0.0,
            1 => (p.repetition_penalty, p.frequency_penalty) = (1.2, 0.3),
            2 => (p.top_k, p.top_p, p.min_p) = (20, 0.9, 0.05),
            3 => (p.stop_token_ids, p.temperature) = (vec![426], 0.7),
            _ => p.speculative = Some(Speculative::Off),
        }
        p
    };
    let mut plain = engine(SpeculativeConfig::default(), 4096);
    let reference = run(&mut plain, &prompt, (0..20).map(params));
    for (config, num_blocks) in [(ngram(4), 4096), (ngram(4), 24), (draft(4), 4096), (draft(3), 24)] {
        let mut spec = engine(config, num_blocks);
        let got = run(&mut spec, &prompt, (0..20).map(params));
        let stats = spec.stats();
        assert_mixed_acceptance(&stats.spec_decoding);
        if num_blocks == 24 {
            assert!(stats.num_preemptions > 0);
        }
        for (i, (a, b)) in reference.iter().zip(&got).enumerate() {
            assert_eq!(a.tokens, b.tokens, "request {i}, {num_blocks} blocks");
            assert_eq!(a.logprobs.len(), b.logprobs.len());
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x.logprob - y.logprob).abs() < 1e-3, "request {i}: logprob {} vs {}", x.logprob, y.logprob);
                assert_eq!(
                    x.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                    y.top.iter().map(|t| t.0).collect::<Vec<_>>()
                );
            }
        }
    }
}
