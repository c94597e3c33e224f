//! The worker against Hugging Face transformers: every golden case of every
//! model in tests/golden must give the same 48 greedy tokens, and the
//! same top-5 logits (1e-3) at the recorded steps; alone, all cases of a
//! model in one batch, with prompts prefilled in chunks of 32 tokens, and
//! in a KV cache so small that requests are preempted and recomputed;
//! and all of that again with n-gram and with draft-model speculative
//! decoding, which must not change a token. The same cases run again on the
//! Metal step plan in the CPU emulator (`--device metal-emulated`): every
//! dispatch of every step executes the kernels and plan code a Mac runs,
//! with prefix-cache hits, chunked prefill, preemption and speculation.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{RequestId, SamplingParams};
use engine_core::{SpecMethod, SpeculativeConfig};
use serde::Deserialize;
use support::test_data;
use worker::engine::LogprobsMode;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::runner::device::test_plan;
use worker::{Engine, EngineConfig};

#[derive(Deserialize)]
struct Golden {
    model: String,
    cases: Vec<Case>,
}

#[derive(Deserialize, Clone)]
struct Case {
    id: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    top_logits: Vec<TopLogits>,
}

#[derive(Deserialize, Clone)]
struct TopLogits {
    step: usize,
    ids: Vec<u32>,
    logits: Vec<f32>,
}

fn load_golden(file: &str) -> Golden {
    let path = test_data().join("golden").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn engine(model: &str, max_num_batched_tokens: usize) -> Engine {
    engine_with(model, max_num_batched_tokens, SpeculativeConfig::default())
}

/// n-gram speculation on every request, eager to propose (1-token
/// matches), so that many proposals are made and many rejected.
fn speculative() -> SpeculativeConfig {
    SpeculativeConfig {
        enabled_by_default: true,
        num_speculative_tokens: 4,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
        max_batch_tokens: usize::MAX,
        ..SpeculativeConfig::default()
    }
}

/// Draft-model speculation on every request. The draft is the model's own
/// first layers (`support::truncated_model`): right often, not always.
fn drafting() -> SpeculativeConfig {
    SpeculativeConfig { default_method: SpecMethod::Draft, ..speculative() }
}

fn engine_with(model: &str, max_num_batched_tokens: usize, speculative: SpeculativeConfig) -> Engine {
    engine_on(model, max_num_batched_tokens, speculative, false, 512)
}

fn engine_on(
    model: &str,
    max_num_batched_tokens: usize,
    speculative: SpeculativeConfig,
    on_plan: bool,
    num_blocks: usize,
) -> Engine {
    let (plan, device) = match on_plan {
        true => {
            let (target, device) = test_plan();
            (Some(target), device)
        }
        false => (None, worker::runner::device::test_device()),
    };
    let (dir, source) = model_source(model);
    let files = ModelFiles::resolve(&source, Need::Weights).unwrap();
    let draft_model = (speculative.enabled_by_default && speculative.default_method == SpecMethod::Draft).then(|| {
        let layers = files.config.num_layers.div_ceil(2) - 1;
        ModelFiles::resolve(&ModelSource::Dir(draft_dir(&dir, layers)), Need::Weights).unwrap()
    });
    let config = EngineConfig {
        draft_model,
        num_blocks: Some(num_blocks),
        max_num_batched_tokens,
        logprobs_mode: LogprobsMode::RawLogits,
        device,
        speculative,
        plan,
        ..EngineConfig::default()
    };
    Engine::new(&files, config).unwrap()
}

/// A golden model's directory in tests/, and where the engine loads it
/// from: that directory, or for `NAME-f32.gguf` the file llama.cpp's
/// converter made of it (`tests/data/llamacpp`, see `tests/gguf.rs`).
fn model_source(model: &str) -> (PathBuf, ModelSource) {
    match model.strip_suffix("-f32.gguf") {
        Some(name) => {
            let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/llamacpp").join(model);
            (test_data().join("models").join(name), ModelSource::Gguf(file))
        }
        None => (test_data().join("models").join(model), ModelSource::Dir(test_data().join("models").join(model))),
    }
}

/// One truncated copy per model and layer count for the whole test binary.
fn draft_dir(dir: &Path, layers: usize) -> PathBuf {
    static DRAFTS: std::sync::Mutex<Vec<(PathBuf, usize, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut drafts = DRAFTS.lock().unwrap();
    if let Some((_, _, out)) = drafts.iter().find(|(d, l, _)| d == dir && *l == layers) {
        return out.clone();
    }
    let out = support::truncated_model(dir, layers.max(1));
    drafts.push((dir.to_path_buf(), layers, out.clone()));
    out
}

/// Per request: generated ids and, per step, the top-20 (id, logit) pairs.
type Run = HashMap<u64, (Vec<u32>, Vec<Vec<(u32, f32)>>)>;

fn run_cases(engine: &mut Engine, cases: &[Case]) -> Run {
    for (i, case) in cases.iter().enumerate() {
        let params = SamplingParams {
            max_tokens: case.generated_ids.len() as u32,
            ignore_eos: true,
            logprobs: Some(20),
            ..SamplingParams::greedy(0)
        };
        engine.add_request(RequestId(i as u64), case.prompt_ids.clone(), params, 0).unwrap();
    }
    let mut run: Run = HashMap::new();
    while engine.has_unfinished() {
        for out in engine.step().unwrap() {
            let entry = run.entry(out.id.0).or_default();
            entry.0.extend(&out.new_token_ids);
            entry.1.extend(out.logprobs.iter().map(|lp| lp.top.clone()));
        }
    }
    engine.scheduler().check_invariants();
    run
}

fn check(model: &str, what: &str, cases: &[Case], run: &Run) {
    for (i, case) in cases.iter().enumerate() {
        let (ids, tops) = &run[&(i as u64)];
        assert_eq!(ids, &case.generated_ids, "{model} {what} case {}: greedy tokens differ", case.id);
        for expected in &case.top_logits {
            let ours = &tops[expected.step];
            for (id, logit) in expected.ids.iter().zip(&expected.logits) {
                let found = ours.iter().find(|(o, _)| o == id).map(|&(_, l)| l);
                let Some(got) = found else {
                    panic!("{model} {what} case {} step {}: token {id} not in our top 20", case.id, expected.step)
                };
                assert!(
                    (got - logit).abs() < 1e-3,
                    "{model} {what} case {} step {} token {id}: logit {got} vs reference {logit}",
                    case.id,
                    expected.step
                );
            }
        }
    }
}

fn check_model(golden_file: &str) {
    check_model_with(golden_file, SpeculativeConfig::default());
}

fn check_model_with(golden_file: &str, spec: SpeculativeConfig) {
    check_model_from(golden_file, None, spec);
}

/// Every mode of [`check_model_with`] with the model loaded from the GGUF
/// file llama.cpp's converter made of it.
fn check_gguf_model(golden_file: &str, spec: SpeculativeConfig) {
    let name = golden_file.trim_end_matches(".json");
    check_model_from(golden_file, Some(&format!("{name}-f32.gguf")), spec);
}

fn check_model_from(golden_file: &str, source: Option<&str>, spec: SpeculativeConfig) {
    let golden = load_golden(golden_file);
    let model = source.map_or(golden.model.clone(), str::to_string);
    let mut proposals = Vec::new();
    // Each case alone.
    let mut e = engine_with(&model, 2048, spec.clone());
    for case in &golden.cases {
        let run = run_cases(&mut e, std::slice::from_ref(case));
        check(&model, "alone", std::slice::from_ref(case), &run);
    }
    proposals.push(e.stats().spec_decoding);
    // All cases of the model as one batch (shared prefixes hit the cache).
    let mut e = engine_with(&model, 2048, spec.clone());
    let run = run_cases(&mut e, &golden.cases);
    check(&model, "batched", &golden.cases, &run);
    proposals.push(e.stats().spec_decoding);
    // Prompts prefilled in chunks of 32 tokens, alone and batched.
    let mut e = engine_with(&model, 32, spec.clone());
    let longest = golden.cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap().clone();
    assert!(longest.prompt_ids.len() > 32);
    let run = run_cases(&mut e, std::slice::from_ref(&longest));
    check(&model, "chunked", std::slice::from_ref(&longest), &run);
    let run = run_cases(&mut e, &golden.cases);
    check(&model, "chunked batch", &golden.cases, &run);
    proposals.push(e.stats().spec_decoding);
    // All cases in a cache that holds only the longest: preemption and recompute.
    let blocks_of = |c: &Case| (c.prompt_ids.len() + c.generated_ids.len()).div_ceil(16);
    let longest_blocks = golden.cases.iter().map(blocks_of).max().unwrap();
    let mut e = engine_on(&model, 2048, spec.clone(), false, longest_blocks + 2);
    let run = run_cases(&mut e, &golden.cases);
    check(&model, "preempted", &golden.cases, &run);
    assert!(e.stats().num_preemptions > 0, "{model}: nothing was preempted");
    if spec.enabled_by_default {
        // Exactness is only shown if guesses were verified, right and wrong.
        for (what, p) in ["alone", "batched", "chunked"].iter().zip(&proposals) {
            assert!(p.num_drafts > 0, "{model} {what}: no proposal was made");
            assert!(p.num_accepted_tokens < p.num_draft_tokens, "{model} {what}: no proposal was rejected");
        }
        let accepted: u64 = proposals.iter().map(|p| p.num_accepted_tokens).sum();
        assert!(accepted > 0, "{model}: no proposal was accepted");
    }
}

#[test]
fn stories260k_matches_transformers() {
    check_model("stories260K.json");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check_model("tiny-qwen3.json");
}

/// Mixtral: 8 experts, the top 2 of a softmax router, renormalised.
#[test]
fn tiny_mixtral_matches_transformers() {
    check_model("tiny-mixtral.json");
}

/// Qwen3-MoE: 16 experts, the top 4 (`norm_topk_prob`), q/k norms.
#[test]
fn tiny_qwen3_moe_matches_transformers() {
    check_model("tiny-qwen3-moe.json");
}

/// GLM-4.5: a dense first layer, then sigmoid routing with a correction
/// bias, routed scaling and a shared expert; q/k/v biases, half the head
/// dims rotated.
#[test]
fn tiny_glm4_moe_matches_transformers() {
    check_model("tiny-glm4-moe.json");
}

/// Gemma 3: sliding (16 keys) and global layers with their own RoPE,
/// `(1 + w)` norms around each sublayer, GeGLU, scaled embeddings,
/// `query_pre_attn_scalar`.
#[test]
fn tiny_gemma3_matches_transformers() {
    check_model("tiny-gemma3.json");
}

/// gpt-oss: attention sinks, sliding (16 keys) and full layers
/// alternating, YaRN, biases everywhere, experts with a clamped SwiGLU over
/// interleaved gate/up columns, the router's softmax over its top 4.
#[test]
fn tiny_gpt_oss_matches_transformers() {
    check_model("tiny-gpt-oss.json");
}

/// The six new families from GGUF, as llama.cpp's converter writes them:
/// every mode above (alone, batched with cache hits, chunked, preempted,
/// speculating).
#[test]
fn the_mixtures_of_experts_from_gguf_match_transformers() {
    check_gguf_model("tiny-mixtral.json", speculative());
    check_gguf_model("tiny-qwen3-moe.json", speculative());
    check_gguf_model("tiny-glm4-moe.json", speculative());
}

#[test]
fn gemma3_gpt_oss_and_yarn_from_gguf_match_transformers() {
    check_gguf_model("tiny-gemma3.json", speculative());
    check_gguf_model("tiny-gpt-oss.json", drafting());
    check_gguf_model("tiny-qwen3-yarn.json", speculative());
}

/// Qwen3 with YaRN ×4 (its long-context setting): the frequencies ramped
/// between interpolation and extrapolation, cos and sin scaled.
#[test]
fn tiny_qwen3_yarn_matches_transformers() {
    check_model("tiny-qwen3-yarn.json");
}

#[test]
fn tiny_qwen3_chat_prompts_match_transformers() {
    check_model("tiny-qwen3-chat.json");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check_model("tiny-qwen2.json");
}

#[test]
fn tiny_llama3_matches_transformers() {
    check_model("tiny-llama3.json");
}

#[test]
fn tiny_mistral_matches_transformers() {
    check_model("tiny-mistral.json");
}

#[test]
fn stories260k_matches_transformers_with_ngram_speculation() {
    check_model_with("stories260K.json", speculative());
}

#[test]
fn tiny_qwen3_matches_transformers_with_ngram_speculation() {
    check_model_with("tiny-qwen3.json", speculative());
    check_model_with("tiny-qwen3-chat.json", speculative());
    check_model_with("tiny-qwen3-yarn.json", speculative());
    check_model_with("tiny-mixtral.json", speculative());
    check_model_with("tiny-qwen3-moe.json", speculative());
    check_model_with("tiny-glm4-moe.json", speculative());
    check_model_with("tiny-gemma3.json", speculative());
}

/// gpt-oss's greedy continuations of random weights do not repeat the way
/// n-gram proposals need: its speculation is checked with a draft model
/// (its own first layer), whose guesses are accepted and rejected.
#[test]
fn tiny_gpt_oss_matches_transformers_with_draft_speculation() {
    check_model_with("tiny-gpt-oss.json", drafting());
}

#[test]
fn tiny_qwen2_matches_transformers_with_ngram_speculation() {
    check_model_with("tiny-qwen2.json", speculative());
}

#[test]
fn tiny_llama3_matches_transformers_with_ngram_speculation() {
    check_model_with("tiny-llama3.json", speculative());
}

#[test]
fn tiny_mistral_matches_transformers_with_ngram_speculation() {
    check_model_with("tiny-mistral.json", speculative());
}

#[test]
fn stories260k_matches_transformers_with_draft_speculation() {
    check_model_with("stories260K.json", drafting());
}

#[test]
fn tiny_qwen3_matches_transformers_with_draft_speculation() {
    check_model_with("tiny-qwen3.json", drafting());
    check_model_with("tiny-qwen3-chat.json", drafting());
}

#[test]
fn tiny_qwen2_matches_transformers_with_draft_speculation() {
    check_model_with("tiny-qwen2.json", drafting());
}

#[test]
fn tiny_llama3_matches_transformers_with_draft_speculation() {
    check_model_with("tiny-llama3.json", drafting());
}

#[test]
fn tiny_mistral_matches_transformers_with_draft_speculation() {
    check_model_with("tiny-mistral.json", drafting());
}

/// Prompt logprobs (`prompt_logprobs`, raw logits here) against the same
/// reference: each case's prompt plus its first 5 greedy tokens as one
/// prompt, whose last 5 positions must carry transformers' top-5 logits
/// (1e-3), with the whole prompt computed at once and in chunks of 32.
fn check_prompt_logprobs(golden_file: &str) {
    let golden = load_golden(golden_file);
    for max_num_batched_tokens in [2048, 32] {
        let mut e = engine(&golden.model, max_num_batched_tokens);
        for (i, case) in golden.cases.iter().enumerate() {
            let mut prompt = case.prompt_ids.clone();
            prompt.extend(&case.generated_ids[..5]);
            let params = SamplingParams { prompt_logprobs: Some(20), ..SamplingParams::greedy(1) };
            e.add_request(RequestId(i as u64), prompt, params, 0).unwrap();
        }
        let mut prompt_logprobs: HashMap<u64, Vec<engine_core::TokenLogprobs>> = HashMap::new();
        while e.has_unfinished() {
            for out in e.step().unwrap() {
                prompt_logprobs.entry(out.id.0).or_default().extend(out.prompt_logprobs);
            }
        }
        for (i, case) in golden.cases.iter().enumerate() {
            let what = format!("{} case {} chunk {max_num_batched_tokens}", golden.model, case.id);
            let lps = &prompt_logprobs[&(i as u64)];
            // One entry per prompt token after the first.
            assert_eq!(lps.len(), case.prompt_ids.len() + 5 - 1, "{what}");
            for expected in case.top_logits.iter().filter(|t| t.step < 5) {
                // The entry of prompt position p comes from the logits at p - 1.
                let entry = &lps[case.prompt_ids.len() - 1 + expected.step];
                assert!((entry.logprob - expected.logits[0]).abs() < 1e-3, "{what} step {}", expected.step);
                for (id, logit) in expected.ids.iter().zip(&expected.logits) {
                    let got = entry.top.iter().find(|(t, _)| t == id).map(|&(_, l)| l);
                    assert!(
                        got.is_some_and(|g| (g - logit).abs() < 1e-3),
                        "{what} step {} token {id}: {got:?} vs reference {logit}",
                        expected.step
                    );
                }
            }
        }
    }
}

#[test]
fn prompt_logprobs_match_transformers() {
    for file in ["stories260K.json", "tiny-qwen3.json", "tiny-llama3.json", "tiny-mistral.json", "tiny-qwen2.json"] {
        check_prompt_logprobs(file);
    }
}

/// A narrow KV cache against the f32 one, whose greedy tokens are the
/// golden ones (the tests above): each case's prompt and its 48 tokens go
/// in as one prompt, prefilled in chunks of 16 so later chunks read the
/// earlier ones from the narrow cache, and at every position the top-1 of
/// the narrow-cache logits (its prompt logprobs' first entry) must be the
/// token the f32 cache chose. Returns (agreeing, total) over every case of
/// every golden file, teacher-forced so one flip does not derail the rest.
fn top1_agreement(format: kernels::KvCacheDtype) -> (usize, usize) {
    let (mut agree, mut total) = (0, 0);
    for file in GOLDEN_FILES {
        let golden = load_golden(file);
        let dir = test_data().join("models").join(&golden.model);
        let files = ModelFiles::resolve(&ModelSource::Dir(dir), Need::Weights).unwrap();
        let config = EngineConfig {
            num_blocks: Some(512),
            max_num_batched_tokens: 16,
            device: worker::runner::device::test_device(),
            kv_cache_dtype: Some(format),
            ..EngineConfig::default()
        };
        let mut e = Engine::new(&files, config).unwrap();
        assert_eq!(e.kv_cache_dtype(), format);
        for (i, case) in golden.cases.iter().enumerate() {
            let mut prompt = case.prompt_ids.clone();
            prompt.extend(&case.generated_ids);
            let params = SamplingParams { prompt_logprobs: Some(1), ..SamplingParams::greedy(1) };
            e.add_request(RequestId(i as u64), prompt, params, 0).unwrap();
        }
        let mut prompt_logprobs: HashMap<u64, Vec<engine_core::TokenLogprobs>> = HashMap::new();
        while e.has_unfinished() {
            for out in e.step().unwrap() {
                prompt_logprobs.entry(out.id.0).or_default().extend(out.prompt_logprobs);
            }
        }
        let (mut file_agree, mut file_total) = (0, 0);
        for (i, case) in golden.cases.iter().enumerate() {
            let lps = &prompt_logprobs[&(i as u64)];
            // Entry p - 1 holds the distribution that predicts prompt position p.
            let first = case.prompt_ids.len() - 1;
            for (entry, &want) in lps[first..].iter().zip(&case.generated_ids) {
                file_agree += usize::from(entry.top.first().map(|&(id, _)| id) == Some(want));
                file_total += 1;
            }
        }
        println!("{format} KV cache, {file}: {file_agree}/{file_total}");
        (agree, total) = (agree + file_agree, total + file_total);
    }
    (agree, total)
}

const GOLDEN_FILES: [&str; 6] = [
    "stories260K.json",
    "tiny-qwen3.json",
    "tiny-qwen3-chat.json",
    "tiny-qwen2.json",
    "tiny-llama3.json",
    "tiny-mistral.json",
];

/// Both keep the 99% of the f32 cache's greedy tokens: f16 99.96%,
/// q8_0 99.5% (its asymmetric rows; the symmetric max |x| / 127 ones kept
/// 98.8%). Every token they flip is a near-tie of these tiny models' flat
/// distributions (see docs/kv-cache-dtype.md).
#[test]
fn f16_and_q8_kv_caches_agree_with_f32_on_greedy_tokens() {
    for format in [kernels::KvCacheDtype::F16, kernels::KvCacheDtype::Q8_0] {
        let bar = 0.99;
        let (agree, total) = top1_agreement(format);
        let share = agree as f64 / total as f64;
        println!("{format} KV cache: greedy top-1 agreement with f32 {agree}/{total} = {:.2}%", 100.0 * share);
        assert!(total >= 6 * 48 && share >= bar, "{format}: {agree}/{total}");
    }
}

/// Which passes over a golden file run on the emulator besides the batch.
#[derive(Clone, Copy)]
struct Passes {
    /// In steps of 32 tokens: chunked prefill beside decodes.
    chunked: bool,
    /// In a cache too small for every case at once: preemption and recompute.
    preempted: bool,
}

const BATCH_ONLY: Passes = Passes { chunked: false, preempted: false };

/// Every case of `golden_file` on the Metal step plan in the emulator, as
/// one batch (prefix-cache hits among the cases), then in the `passes`
/// asked. The emulator is slow (tiny-qwen3's 32k-token lm_head most of
/// all), so each case runs in these batches rather than alone too, as on
/// the CPU, and chunking and preemption each run on two families (the CPU
/// runs them on all).
fn check_model_emulated(golden_file: &str, spec: SpeculativeConfig, passes: Passes) {
    check_model_emulated_from(golden_file, None, spec, passes)
}

/// [`check_model_emulated`] of the model's files in `source` (a GGUF file
/// llama.cpp's converter wrote), or of its safetensors.
fn check_model_emulated_from(golden_file: &str, source: Option<&str>, spec: SpeculativeConfig, passes: Passes) {
    let golden = load_golden(golden_file);
    let model = source.unwrap_or(golden.model.as_str());
    let mut e = engine_on(model, 2048, spec.clone(), true, 512);
    let run = run_cases(&mut e, &golden.cases);
    check(model, "batched", &golden.cases, &run);
    if spec.enabled_by_default {
        let p = e.stats().spec_decoding;
        assert!(p.num_drafts > 0 && p.num_accepted_tokens > 0, "{model}: no proposal made or accepted");
        assert!(p.num_accepted_tokens < p.num_draft_tokens, "{model}: no proposal was rejected");
        return;
    }
    if passes.chunked {
        let mut e = engine_on(model, 32, spec.clone(), true, 512);
        assert!(golden.cases.iter().any(|c| c.prompt_ids.len() > 32));
        let run = run_cases(&mut e, &golden.cases);
        check(model, "chunked batch", &golden.cases, &run);
    }
    if !passes.preempted {
        return;
    }
    let blocks_of = |c: &Case| (c.prompt_ids.len() + c.generated_ids.len()).div_ceil(16);
    let longest = golden.cases.iter().map(blocks_of).max().unwrap();
    let mut e = engine_on(model, 2048, spec, true, longest + 2);
    let run = run_cases(&mut e, &golden.cases);
    check(model, "preempted", &golden.cases, &run);
    assert!(e.stats().num_preemptions > 0, "{model}: nothing was preempted");
}

#[test]
fn stories260k_matches_transformers_on_metal_emulated() {
    check_model_emulated("stories260K.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: true });
}

#[test]
fn tiny_qwen3_matches_transformers_on_metal_emulated() {
    check_model_emulated("tiny-qwen3.json", SpeculativeConfig::default(), BATCH_ONLY);
    check_model_emulated("tiny-qwen3-chat.json", SpeculativeConfig::default(), BATCH_ONLY);
    check_model_emulated("tiny-qwen3-yarn.json", SpeculativeConfig::default(), BATCH_ONLY);
}

#[test]
fn tiny_qwen2_matches_transformers_on_metal_emulated() {
    check_model_emulated("tiny-qwen2.json", SpeculativeConfig::default(), Passes { chunked: false, preempted: true });
}

#[test]
fn tiny_llama3_matches_transformers_on_metal_emulated() {
    check_model_emulated("tiny-llama3.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: false });
}

#[test]
fn tiny_mistral_matches_transformers_on_metal_emulated() {
    check_model_emulated("tiny-mistral.json", SpeculativeConfig::default(), BATCH_ONLY);
}

/// Mixtures of experts on the step plan: the router, the chosen experts'
/// grouped matmuls and their weighted sum on the GPU (Mixtral's and
/// Qwen3-MoE's softmax routers, GLM-4.5's sigmoid router with its
/// correction bias, scale, shared expert, dense first layer and partial
/// rotary embeddings).
#[test]
fn mixtures_of_experts_match_transformers_on_metal_emulated() {
    check_model_emulated("tiny-mixtral.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: false });
    check_model_emulated(
        "tiny-qwen3-moe.json",
        SpeculativeConfig::default(),
        Passes { chunked: false, preempted: true },
    );
    check_model_emulated("tiny-glm4-moe.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: true });
}

/// gpt-oss (attention sinks, sliding and full layers, YaRN, biased router
/// and experts, its clamped SwiGLU) and Gemma 3 (output norms, GeGLU,
/// scaled embeddings, q/k norms, `query_pre_attn_scalar`, local layers with
/// their own window and RoPE base) on the step plan.
#[test]
fn gpt_oss_and_gemma3_match_transformers_on_metal_emulated() {
    check_model_emulated("tiny-gpt-oss.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: true });
    check_model_emulated("tiny-gemma3.json", SpeculativeConfig::default(), Passes { chunked: true, preempted: true });
}

/// The same from the GGUF files llama.cpp's converter wrote (stacked
/// experts split per expert at load, GLM-4.5's shared expert and score
/// correction under their GGUF names).
#[test]
fn mixtures_of_experts_from_gguf_match_transformers_on_metal_emulated() {
    for name in ["tiny-mixtral", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-gpt-oss", "tiny-gemma3"] {
        let (golden, gguf) = (format!("{name}.json"), format!("{name}-f32.gguf"));
        check_model_emulated_from(&golden, Some(&gguf), SpeculativeConfig::default(), BATCH_ONLY);
    }
}

#[test]
fn speculation_is_exact_on_metal_emulated() {
    check_model_emulated("tiny-qwen2.json", speculative(), BATCH_ONLY);
    check_model_emulated("stories260K.json", drafting(), BATCH_ONLY);
}

/// f16 weights on the Metal step plan (f32 activations, as the plan always
/// runs): every golden case teacher-forced, each position's context (the
/// prompt and the reference tokens before it) asking for one greedy token.
/// Any difference from transformers' f32 tokens is f16's rounding of the
/// weights; the agreement must be at least 99.5%. Two families here (the
/// emulator is slow): stories260K (padded head dim, GQA) and tiny-qwen2
/// (biases); with tiny-llama3 and tiny-mistral too it was 1727/1728.
#[test]
fn f16_weights_on_metal_emulated_agree_with_transformers() {
    let (mut same, mut total) = (0, 0);
    for file in ["stories260K.json", "tiny-qwen2.json"] {
        let golden = load_golden(file);
        let files =
            ModelFiles::resolve(&ModelSource::Dir(test_data().join("models").join(&golden.model)), Need::Weights)
                .unwrap();
        let (target, device) = test_plan();
        let config = EngineConfig {
            dtype: candle_core::DType::F16,
            num_blocks: Some(1024),
            plan: Some(target),
            device,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(&files, config).unwrap();
        let mut expected = HashMap::new();
        for case in &golden.cases {
            for t in 0..case.generated_ids.len() {
                let id = RequestId(expected.len() as u64);
                let context: Vec<u32> = case.prompt_ids.iter().chain(&case.generated_ids[..t]).copied().collect();
                let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) };
                e.add_request(id, context, params, 0).unwrap();
                expected.insert(id.0, case.generated_ids[t]);
            }
        }
        let (mut model_same, model_total) = (0, expected.len());
        while e.has_unfinished() {
            for out in e.step().unwrap() {
                if let Some(&token) = out.new_token_ids.first() {
                    model_same += usize::from(token == expected[&out.id.0]);
                }
            }
        }
        eprintln!("{}: f16 weights, teacher-forced top-1 agreement {model_same}/{model_total}", golden.model);
        same += model_same;
        total += model_total;
    }
    eprintln!("f16 weights on metal-emulated: {same}/{total}");
    assert!(same * 1000 >= total * 995, "f16 agreement {same}/{total} is under 99.5%");
}
