//! The engine on a real model (stories260K): batching, prefix caching,
//! preemption and aborts never change what a request produces.

use std::collections::HashMap;
use std::path::PathBuf;

use common::{RequestId, SamplingParams};
use engine_core::{FinishReason, SchedulingPolicy};
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig};

fn model() -> ModelFiles {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models/stories260K"));
    ModelFiles::resolve(&ModelSource::Dir(dir), Need::Weights).unwrap()
}

fn engine(config: EngineConfig) -> Engine {
    Engine::new(&model(), config).unwrap()
}

fn default_engine() -> Engine {
    engine(EngineConfig { num_blocks: Some(1024), ..EngineConfig::default() })
}

/// Runs requests to completion; returns each one's tokens and finish reason.
fn run(engine: &mut Engine, requests: &[(Vec<u32>, SamplingParams)]) -> HashMap<u64, (Vec<u32>, Option<FinishReason>)> {
    for (i, (prompt, params)) in requests.iter().enumerate() {
        engine.add_request(RequestId(i as u64), prompt.clone(), params.clone(), 0).unwrap();
    }
    let mut out: HashMap<u64, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let e = out.entry(o.id.0).or_default();
            e.0.extend(o.new_token_ids);
            e.1 = o.finish_reason;
        }
    }
    engine.scheduler().check_invariants();
    out
}

/// 16 prompts of different lengths (a TinyStories-like vocabulary slice).
fn prompts() -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|i| std::iter::once(1).chain((0..(3 + i * 9)).map(|t| 260 + (t * 7 + i * 13) % 240)).collect())
        .collect()
}

/// Seeded sampling with top-p and top-k, 24 tokens.
fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    }
}

#[test]
fn concurrent_requests_match_each_alone_greedy() {
    let requests: Vec<_> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10 + 3 * i as u32) }))
        .collect();
    let together = run(&mut default_engine(), &requests);
    for (i, request) in requests.iter().enumerate() {
        let alone = run(&mut default_engine(), std::slice::from_ref(request));
        assert_eq!(together[&(i as u64)], alone[&0], "request {i}");
        assert_eq!(alone[&0].0.len(), 10 + 3 * i);
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_the_batch() {
    let sampled = seeded;
    let mut requests: Vec<_> = prompts().into_iter().enumerate().map(|(i, p)| (p, sampled(i as u64))).collect();
    // Mix in greedy and differently parametrised neighbours.
    requests[3].1 = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(30) };
    requests[5].1.repetition_penalty = 1.3;
    let together = run(&mut default_engine(), &requests);
    for i in [0, 1, 7, 15] {
        let alone = run(&mut default_engine(), &[requests[i].clone()]);
        assert_eq!(together[&(i as u64)], alone[&0], "request {i}");
    }
    // Same seed, same output; another seed, another output.
    let again = run(&mut default_engine(), &[requests[0].clone()]);
    assert_eq!(together[&0], again[&0]);
    let other = run(&mut default_engine(), &[(requests[0].0.clone(), sampled(12345))]);
    assert_ne!(together[&0].0, other[&0].0);
}

#[test]
fn shared_prefix_is_cached_and_changes_nothing() {
    let prefix: Vec<u32> = std::iter::once(1).chain((0..99).map(|t| 260 + (t * 11) % 240)).collect();
    let with_suffix = |s: &[u32]| -> Vec<u32> { prefix.iter().chain(s).copied().collect() };
    let params = SamplingParams { ignore_eos: true, logprobs: Some(2), ..SamplingParams::greedy(16) };
    let first = (with_suffix(&[300, 301, 302]), params.clone());
    let second = (with_suffix(&[400, 401]), params.clone());

    let mut cached = default_engine();
    run(&mut cached, std::slice::from_ref(&first));
    cached.add_request(RequestId(7), second.0.clone(), second.1.clone(), 0).unwrap();
    let mut tokens = Vec::new();
    let mut num_cached = 0;
    while cached.has_unfinished() {
        for o in cached.step().unwrap() {
            tokens.extend(o.new_token_ids);
            num_cached = o.num_cached_tokens;
        }
    }
    assert!(num_cached >= 96, "cached {num_cached} prompt tokens");
    assert!(cached.stats().prefix_cache.hits >= 96);

    let mut uncached =
        engine(EngineConfig { num_blocks: Some(1024), enable_prefix_caching: false, ..EngineConfig::default() });
    let reference = run(&mut uncached, &[second]);
    assert_eq!(tokens, reference[&0].0);
}

#[test]
fn preemption_under_a_tiny_kv_budget_keeps_outputs() {
    let requests: Vec<_> = prompts()
        .into_iter()
        .take(8)
        .map(|p| (p, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) }))
        .collect();
    let reference = run(&mut default_engine(), &requests);
    // 8 requests need up to 8 blocks each; 24 blocks make them take turns.
    let mut small = engine(EngineConfig { num_blocks: Some(24), ..EngineConfig::default() });
    let out = run(&mut small, &requests);
    assert!(small.stats().num_preemptions > 0, "no preemption happened");
    assert_eq!(out, reference);
    assert_eq!(small.stats().kv_blocks_used, 0);
}

/// Prompt logprobs score a text as decoding would have: scoring each
/// prompt plus its greedy continuation gives, at the continuation's
/// positions, the logprobs decoding reported (1e-4), the same top tokens,
/// and one entry per prompt token after the first, whatever the batch,
/// the chunking, preemption or where the sampling runs.
#[test]
fn prompt_logprobs_equal_the_decode_logprobs() {
    let continuation = 12;
    let decode: Vec<_> = prompts()
        .into_iter()
        .take(8)
        .map(|p| (p, SamplingParams { ignore_eos: true, logprobs: Some(3), ..SamplingParams::greedy(continuation) }))
        .collect();
    let mut decoded = Vec::new(); // per request: tokens and their logprobs
    let mut e = default_engine();
    for (i, (prompt, params)) in decode.iter().enumerate() {
        e.add_request(RequestId(i as u64), prompt.clone(), params.clone(), 0).unwrap();
    }
    let mut outputs: HashMap<u64, (Vec<u32>, Vec<engine_core::TokenLogprobs>)> = HashMap::new();
    while e.has_unfinished() {
        for o in e.step().unwrap() {
            let entry = outputs.entry(o.id.0).or_default();
            entry.0.extend(o.new_token_ids);
            entry.1.extend(o.logprobs);
        }
    }
    for i in 0..decode.len() {
        decoded.push(outputs.remove(&(i as u64)).unwrap());
    }
    let scoring: Vec<_> = decode
        .iter()
        .zip(&decoded)
        .map(|((prompt, _), (tokens, _))| {
            let text: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
            (text, SamplingParams { prompt_logprobs: Some(3), ..SamplingParams::greedy(1) })
        })
        .collect();
    let configs = [
        ("one batch", EngineConfig { num_blocks: Some(1024), ..EngineConfig::default() }),
        (
            "chunks of 16",
            EngineConfig { num_blocks: Some(1024), max_num_batched_tokens: 16, ..EngineConfig::default() },
        ),
        ("preempted", EngineConfig { num_blocks: Some(24), max_num_batched_tokens: 48, ..EngineConfig::default() }),
        (
            "device sampling",
            EngineConfig { num_blocks: Some(1024), device_sampling: Some(true), ..EngineConfig::default() },
        ),
    ];
    for (what, config) in configs {
        let mut e = engine(config);
        // Twice: the second pass would hit the prefix cache if prompt
        // logprobs did not bypass it.
        for pass in 0..2 {
            for (i, (text, params)) in scoring.iter().enumerate() {
                e.add_request(RequestId((pass * 100 + i) as u64), text.clone(), params.clone(), 0).unwrap();
                if what == "preempted" {
                    // Decodes growing beside the scoring requests take their blocks.
                    let (prompt, params) = &decode[i];
                    let params = SamplingParams { max_tokens: 40, ..params.clone() };
                    e.add_request(RequestId((pass * 100 + 50 + i) as u64), prompt.clone(), params, 0).unwrap();
                }
            }
            let mut scored: HashMap<u64, Vec<engine_core::TokenLogprobs>> = HashMap::new();
            while e.has_unfinished() {
                for o in e.step().unwrap() {
                    let scores = o.id.0 % 100 < 50;
                    assert!(!scores || o.num_cached_tokens == 0, "{what}: a cache hit");
                    scored.entry(o.id.0).or_default().extend(o.prompt_logprobs);
                }
            }
            e.scheduler().check_invariants();
            for (i, ((text, _), (_, decode_lps))) in scoring.iter().zip(&decoded).enumerate() {
                let lps = &scored[&((pass * 100 + i) as u64)];
                assert_eq!(lps.len(), text.len() - 1, "{what} request {i}");
                let tail = &lps[lps.len() - continuation as usize..];
                for (step, (got, want)) in tail.iter().zip(decode_lps).enumerate() {
                    let close = (got.logprob - want.logprob).abs() < 1e-4;
                    let same_top = got.top.iter().map(|t| t.0).eq(want.top.iter().map(|t| t.0));
                    assert!(close && same_top, "{what} request {i} step {step}: {got:?} vs decode {want:?}");
                }
            }
        }
        if what == "preempted" {
            assert!(e.stats().num_preemptions > 0, "no preemption happened");
        }
    }
}

#[test]
fn aborts_free_every_block() {
    let mut e = default_engine();
    for (i, p) in prompts().into_iter().enumerate() {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(50) };
        e.add_request(RequestId(i as u64), p, params, 0).unwrap();
    }
    for _ in 0..5 {
        e.step().unwrap();
    }
    assert!(e.stats().kv_blocks_used > 0);
    for i in 0..16 {
        let out = e.abort(RequestId(i)).unwrap();
        assert_eq!(out.finish_reason, Some(FinishReason::Abort));
    }
    assert!(!e.has_unfinished());
    assert_eq!(e.stats().kv_blocks_used, 0);
    e.scheduler().check_invariants();
}

#[test]
fn abort_all_stops_every_request_and_frees_every_block() {
    let mut e = default_engine();
    for (i, p) in prompts().into_iter().enumerate() {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(50) };
        e.add_request(RequestId(i as u64), p, params, 0).unwrap();
    }
    for _ in 0..3 {
        e.step().unwrap();
    }
    assert!(e.stats().kv_blocks_used > 0);
    let outputs = e.abort_all();
    let ids: Vec<u64> = outputs.iter().map(|o| o.id.0).collect();
    assert_eq!(ids, (0..prompts().len() as u64).collect::<Vec<_>>(), "every request, in id order");
    assert!(outputs.iter().all(|o| o.finish_reason == Some(FinishReason::Abort)));
    assert!(!e.has_unfinished());
    assert_eq!(e.stats().kv_blocks_used, 0);
    e.scheduler().check_invariants();
    assert!(e.abort_all().is_empty());
}

/// Under `--scheduling-policy priority` a late urgent request overtakes the
/// ones waiting before it; under fcfs it waits its turn.
#[test]
fn a_late_urgent_request_overtakes_under_the_priority_policy() {
    let finish_order = |policy: SchedulingPolicy| {
        let mut e = engine(EngineConfig { num_blocks: Some(1024), max_num_seqs: 1, policy, ..EngineConfig::default() });
        let params = |n| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
        e.add_request(RequestId(0), vec![1, 403, 407], params(20), 0).unwrap();
        e.step().unwrap(); // request 0 runs; one sequence at a time
        e.add_request(RequestId(1), vec![1, 261, 378], params(20), 0).unwrap();
        e.add_request(RequestId(2), vec![1, 432, 383], params(5), -10).unwrap(); // late, urgent
        let mut order = Vec::new();
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                if o.finish_reason.is_some() {
                    order.push(o.id.0);
                }
            }
        }
        order
    };
    assert_eq!(finish_order(SchedulingPolicy::Priority), [0, 2, 1]);
    assert_eq!(finish_order(SchedulingPolicy::Fcfs), [0, 1, 2]);
}

#[test]
fn stop_tokens_end_a_request_and_bad_requests_are_refused() {
    let mut e = default_engine();
    // stories260K (llama2.c) ends a story with BOS (1), not EOS.
    let params = SamplingParams { stop_token_ids: vec![1], ..SamplingParams::greedy(400) };
    let out = run(&mut e, &[(vec![1], params)]);
    let (tokens, reason) = &out[&0];
    assert_eq!(reason, &Some(FinishReason::Stop), "{tokens:?}");
    assert_eq!(tokens.last(), Some(&1));
    assert!(tokens.len() < 400);

    let too_long = vec![1; 600];
    let err = e.add_request(RequestId(1), too_long, SamplingParams::greedy(4), 0).unwrap_err().to_string();
    assert!(err.contains("maximum context length"), "{err}");
    let err = e.add_request(RequestId(2), vec![1, 9999], SamplingParams::greedy(4), 0).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    assert!(!e.has_unfinished());
}

#[test]
fn half_precision_weights_follow_the_f32_model() {
    // f16/bf16 weights with f32 activations: the first tokens of a story
    // (large logit margins) must equal the f32 run.
    let prompt = vec![1, 403, 407, 261, 378]; // "Once upon a time"
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) };
    let reference = run(&mut default_engine(), &[(prompt.clone(), params.clone())]);
    for dtype in [candle_core::DType::F16, candle_core::DType::BF16] {
        let mut e = engine(EngineConfig { num_blocks: Some(256), dtype, ..EngineConfig::default() });
        let out = run(&mut e, &[(prompt.clone(), params.clone())]);
        assert_eq!(out[&0].0, reference[&0].0, "{dtype:?}");
    }
}

/// Device sampling (what a GPU worker does), forced on the CPU device: the
/// same guarantees as the host sampler, and greedy rows with penalties,
/// `min_tokens` or logprobs give exactly what the host gives.
#[test]
fn device_sampling_keeps_the_guarantees() {
    let device_engine =
        || engine(EngineConfig { num_blocks: Some(1024), device_sampling: Some(true), ..EngineConfig::default() });
    let sampled = |seed| SamplingParams { min_p: 0.01, ..seeded(seed) };
    let mut requests: Vec<_> = prompts().into_iter().enumerate().map(|(i, p)| (p, sampled(i as u64))).collect();
    requests[3].1 = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(30) };
    requests[5].1 = SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.4, ..requests[3].1.clone() };
    requests[6].1 = SamplingParams { logprobs: Some(3), presence_penalty: 0.5, ..requests[3].1.clone() };
    requests[7].1 = SamplingParams { min_tokens: 20, ignore_eos: false, ..SamplingParams::greedy(30) };
    requests[8].1.logprobs = Some(2);
    // Every fourth token from 300 up pushed by +100, under a repetition penalty.
    let bias: Vec<(u32, f32)> = (300..512).step_by(4).map(|t| (t, 100.0)).collect();
    requests[10].1 = SamplingParams { logit_bias: bias, repetition_penalty: 1.3, ..requests[3].1.clone() };
    let together = run(&mut device_engine(), &requests);
    for i in [0, 1, 15] {
        let alone = run(&mut device_engine(), &[requests[i].clone()]);
        assert_eq!(together[&(i as u64)], alone[&0], "request {i}");
        assert_eq!(alone[&0].0.len(), 24);
    }
    // Greedy rows are the argmax of the same adjusted logits on either path.
    let host = run(&mut default_engine(), &requests);
    for i in [3, 5, 6, 7, 10] {
        assert_eq!(together[&(i as u64)], host[&(i as u64)], "request {i}");
    }
    // The bias changed what request 10 says, and every token it chose is biased.
    let unbiased = SamplingParams { repetition_penalty: 1.3, ..requests[3].1.clone() };
    let plain = run(&mut default_engine(), &[(requests[10].0.clone(), unbiased)]);
    assert_ne!(host[&10].0, plain[&0].0);
    assert!(host[&10].0.iter().all(|&t| t >= 300 && t % 4 == 0), "{:?}", host[&10].0);
    // Seeds still matter.
    let other = run(&mut device_engine(), &[(requests[0].0.clone(), sampled(12345))]);
    assert_ne!(together[&0].0, other[&0].0);
}

/// A CPU step keeps its activations in one workspace: it grows to the
/// largest step (a power of two of rows), then decode steps and smaller
/// prompts reuse it; outputs do not depend on what it held before.
#[test]
fn cpu_steps_reuse_one_activation_workspace() {
    let mut e = default_engine();
    assert_eq!(e.activation_workspace_rows(), 0);
    let long: Vec<u32> = std::iter::once(1).chain((0..39).map(|t| 260 + t * 3 % 200)).collect(); // 40 tokens
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    e.add_request(RequestId(0), long.clone(), params.clone(), 0).unwrap();
    e.step().unwrap(); // the 40-token prefill
    assert_eq!(e.activation_workspace_rows(), 64);
    while e.has_unfinished() {
        e.step().unwrap();
        assert_eq!(e.activation_workspace_rows(), 64, "decode steps reuse the buffers");
    }
    let short = prompts()[2].clone();
    let before = run(&mut e, &[(short.clone(), params.clone())]);
    assert_eq!(e.activation_workspace_rows(), 64);
    // A fresh engine (fresh buffers) gives the same tokens.
    assert_eq!(before, run(&mut default_engine(), &[(short, params)]));
}

/// A request resumed after k of its tokens (as after a worker loss, with
/// those tokens as its output) continues exactly as the uninterrupted run,
/// for seeded sampling and for greedy with every penalty; and the resumed
/// prompt and output are served from the prefix cache where they are there.
#[test]
fn a_resumed_request_continues_exactly() {
    let penalized = SamplingParams {
        frequency_penalty: 0.7,
        presence_penalty: 0.4,
        repetition_penalty: 1.3,
        min_tokens: 30,
        ignore_eos: false,
        ..SamplingParams::greedy(40)
    };
    let sampled = SamplingParams { max_tokens: 40, min_tokens: 10, frequency_penalty: 0.3, ..seeded(11) };
    let prompt = prompts()[5].clone();
    for params in [penalized, sampled, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) }] {
        let mut e = default_engine();
        let full = run(&mut e, &[(prompt.clone(), params.clone())]).remove(&0).unwrap();
        assert_eq!(full.0.len(), 40, "{params:?}");
        for k in [1, 7, 16, 39] {
            // A fresh engine (another worker), and the same one (its cache warm).
            for (warm, e) in [(false, &mut default_engine()), (true, &mut e)] {
                e.resume_request(RequestId(100 + k as u64), prompt.clone(), &full.0[..k], params.clone(), 0).unwrap();
                let mut rest = Vec::new();
                let mut reason = None;
                let mut cached = 0;
                while e.has_unfinished() {
                    for o in e.step().unwrap() {
                        rest.extend(o.new_token_ids);
                        reason = o.finish_reason;
                        cached = o.num_cached_tokens;
                    }
                }
                assert_eq!(rest, full.0[k..], "{params:?} resumed after {k}");
                assert_eq!(reason, full.1);
                // Every full block of prompt + output is a hit on the warm engine.
                let expected = if warm { (prompt.len() + k - 1) / 16 * 16 } else { 0 };
                assert_eq!(cached, expected, "cached tokens, warm: {warm}, k {k}");
            }
        }
        // Resuming with all the tokens already made is refused, not run past max_tokens.
        assert!(e.resume_request(RequestId(999), prompt.clone(), &full.0, params.clone(), 0).is_err());
    }
}
