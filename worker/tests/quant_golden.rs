//! Q8_0 quality on the real stories260K: greedy tokens against the f32
//! model on every golden case, and the top-1 logprob difference.
//!
//! stories260K is 64 wide with an FFN of 172, so the layers whose input is
//! 64 wide (q/k/v/o, gate, up) quantize and down_proj (172 in) stays f32.

use std::path::PathBuf;

use common::{RequestId, SamplingParams};
use worker::models::{ModelFiles, ModelSource};
use worker::{Engine, EngineConfig, Quantization};

fn shared() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared")
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

#[test]
fn q8_0_agrees_with_f32_on_the_golden_prompts() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shared().join("golden/stories260K.json")).expect("golden file"))
            .unwrap();
    let files = ModelFiles::resolve(&ModelSource::Dir(shared().join("models/stories260K"))).unwrap();
    let config = |quantization| EngineConfig { num_blocks: Some(256), quantization, ..EngineConfig::default() };
    let mut f32_engine = Engine::new(&files, config(None)).unwrap();
    let mut q8_engine = Engine::new(&files, config(Some(Quantization::Q8_0))).unwrap();
    let (mut agree, mut total, mut lp_diff, mut lp_n) = (0usize, 0usize, 0f64, 0usize);
    for case in golden["cases"].as_array().unwrap() {
        let prompt: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let n = case["generated_ids"].as_array().unwrap().len();
        let (a, la) = greedy(&mut f32_engine, &prompt, n);
        let (b, lb) = greedy(&mut q8_engine, &prompt, n);
        // Tokens agree position by position up to the first divergence (after
        // it the two continue from different texts, so later matches would be luck).
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        agree += same;
        total += n;
        for (x, y) in la.iter().zip(&lb).take(same) {
            lp_diff += (x - y).abs() as f64;
            lp_n += 1;
        }
    }
    let rate = agree as f64 / total as f64;
    let mean_lp = lp_diff / lp_n.max(1) as f64;
    eprintln!(
        "Q8_0 vs f32 on stories260K: {agree}/{total} greedy tokens agree ({:.1}%), mean |Δ top-1 logprob| {mean_lp:.4}",
        rate * 100.0
    );
    assert!(rate >= 0.95, "only {:.1}% of greedy tokens agree", rate * 100.0);
}
