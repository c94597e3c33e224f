//! Quantization quality on the real stories260K: greedy tokens against the
//! f32 model on every golden case (teacher-forced), and the top-1 logprob
//! difference.
//!
//! stories260K is 64 wide with an FFN of 172, so the layers whose input is
//! 64 wide (q/k/v/o, gate, up) quantize and down_proj (172 in) stays f32.

use std::path::PathBuf;

use common::{RequestId, SamplingParams};
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig, Quantization};

fn test_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests")
}

/// Greedy generation of `n` tokens: ids and the chosen token's logprob at each step.
fn greedy(engine: &mut Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let params = SamplingParams {
        max_tokens: n as u32,
        temperature: 0.0,
        ignore_eos: true,
        logprobs: Some(1),
        ..SamplingParams::default()
    };
    engine.add_request(RequestId(0), prompt.to_vec(), params, 0).unwrap();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    while engine.has_unfinished() {
        for out in engine.step().unwrap() {
            ids.extend(&out.new_token_ids);
            lps.extend(out.logprobs.iter().map(|l| l.logprob));
        }
    }
    (ids, lps)
}

/// Teacher-forced comparison of a quantized engine with f32 on every golden
/// prompt: at each position of f32's greedy continuation, both see the same
/// context, and we compare the next greedy token (and its logprob). A flip
/// at a near-tie then costs one position, not the rest of the sequence.
/// Returns (agreeing positions, positions, mean |Δ top-1 logprob| where they agree).
fn teacher_forced(quantization: Quantization) -> (usize, usize, f64) {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(test_data().join("golden/stories260K.json")).expect("golden file"),
    )
    .unwrap();
    let files = ModelFiles::resolve(&ModelSource::Dir(test_data().join("models/stories260K")), Need::Weights).unwrap();
    let config = |quantization| EngineConfig { num_blocks: Some(512), quantization, ..EngineConfig::default() };
    let mut f32_engine = Engine::new(&files, config(None)).unwrap();
    let mut q_engine = Engine::new(&files, config(Some(quantization))).unwrap();
    let (mut agree, mut total, mut lp_diff) = (0usize, 0usize, 0f64);
    for case in golden["cases"].as_array().unwrap() {
        let prompt: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let n = case["generated_ids"].as_array().unwrap().len();
        let (reference, ref_lps) = greedy(&mut f32_engine, &prompt, n);
        for t in 0..n {
            let context: Vec<u32> = prompt.iter().chain(&reference[..t]).copied().collect();
            let (next, lp) = greedy(&mut q_engine, &context, 1);
            total += 1;
            if next[0] == reference[t] {
                agree += 1;
                lp_diff += (lp[0] - ref_lps[t]).abs() as f64;
            }
        }
    }
    (agree, total, lp_diff / agree.max(1) as f64)
}

/// Runs [`teacher_forced`] for `quantization`, reports it, and checks that
/// at least `min_rate` of the greedy tokens agree.
fn check_agreement(quantization: Quantization, min_rate: f64) {
    let (agree, total, mean_lp) = teacher_forced(quantization);
    let rate = agree as f64 / total as f64;
    eprintln!(
        "{quantization:?} vs f32 on stories260K (teacher-forced): {agree}/{total} greedy tokens agree ({:.1}%), \
         mean |Δ top-1 logprob| {mean_lp:.4}",
        rate * 100.0
    );
    assert!(rate >= min_rate, "only {:.1}% of greedy tokens agree", rate * 100.0);
}

#[test]
fn q8_0_agrees_with_f32_on_the_golden_prompts() {
    check_agreement(Quantization::Q8_0, 0.95);
}

#[test]
fn q4_0_stays_close_to_f32_on_the_golden_prompts() {
    // 4.5 bits per weight on a 260K-parameter model: recorded, and held to
    // a looser bar than Q8_0.
    check_agreement(Quantization::Q4_0, 0.75);
}
