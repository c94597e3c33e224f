//! Quantized weights on the Metal step plan, run whole in the CPU emulator
//! (`--device metal-emulated`): a GGUF file's Q8_0, Q4_K and Q6_K blocks
//! and `--quantize` stay in their blocks on the GPU (resident weights about
//! the file's size), and give the CPU path's tokens on the same weights.
//!
//! "The same weights" is the file dequantized to f32 (candle's GGML
//! decoding) run on the CPU: the GPU kernels widen each block to f32 and
//! multiply f32 activations, as that path does. (The CPU's own block
//! kernels also round the activations to 8 bits, so they are not the
//! reference here.) Agreement is teacher-forced over seeded prompts.

mod support;

use std::path::Path;

use candle_core::{DType, Device};
use common::model::ModelConfig;
use common::{RequestId, SamplingParams, StructuredOutput};
use support::{dequantized_copy, greedy};
use worker::models::gguf::Vocab;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::runner::device::test_plan;
use worker::{Engine, EngineConfig, Quantization};

/// An engine on the step plan (`on_plan`: the GPU, or its emulator; see
/// `test_plan`) or on the CPU.
fn engine(source: &str, on_plan: bool, quantization: Option<Quantization>) -> Engine {
    let files = ModelFiles::resolve(&ModelSource::parse(source).unwrap(), Need::Weights).unwrap();
    let (plan, device) = match on_plan {
        true => {
            let (target, device) = test_plan();
            (Some(target), device)
        }
        false => (None, Device::Cpu),
    };
    let config = EngineConfig {
        num_blocks: Some(128),
        dtype: DType::F32,
        plan,
        device,
        quantization,
        ..EngineConfig::default()
    };
    Engine::new(&files, config).unwrap()
}

/// (agreeing positions, positions): `reference`'s greedy continuation of
/// each prompt against `other`'s next token on the same context.
fn agreement(reference: &mut Engine, other: &mut Engine, prompts: &[Vec<u32>], n: usize) -> (usize, usize) {
    let (mut same, mut total) = (0, 0);
    for prompt in prompts {
        let want = greedy(reference, prompt, n);
        for t in 0..want.len() {
            let context: Vec<u32> = prompt.iter().chain(&want[..t]).copied().collect();
            same += usize::from(greedy(other, &context, 1)[0] == want[t]);
            total += 1;
        }
    }
    (same, total)
}

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut state = 3u64;
    (0..6).map(|p| support::seeded_ids(&mut state, 4 + 6 * p, vocab)).collect()
}

#[test]
fn gguf_blocks_stay_quantized_and_give_the_cpu_tokens_on_metal_emulated() {
    // In-features of 256: the k-quants are really used (Q4_K, Q6_K).
    gguf_blocks_on_the_plan(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":384,
        "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":256,"tie_word_embeddings":false}"#,
    );
}

/// A mixture of experts' stacked experts (`ffn_*_exps`) stay in their
/// blocks too, and the grouped matmuls over them give the CPU's tokens.
#[test]
fn gguf_expert_blocks_stay_quantized_and_give_the_cpu_tokens_on_metal_emulated() {
    gguf_blocks_on_the_plan(
        r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":256,"intermediate_size":512,
        "moe_intermediate_size":256,"num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"vocab_size":384,
        "rms_norm_eps":1e-6,"rope_theta":10000.0,"max_position_embeddings":256,"tie_word_embeddings":false}"#,
    );
}

/// The model of `config` with seeded random weights, written as Q8_0 and
/// Q4_K_M GGUF files: on the plan, about the file's size resident and the
/// tokens of the CPU on the same weights dequantized.
fn gguf_blocks_on_the_plan(config: &str) {
    let cfg = ModelConfig::from_json(config).unwrap();
    let tensors = worker::models::loader::random_weights(&cfg, DType::F32, &Device::Cpu, 11).unwrap();
    let dir = std::env::temp_dir().join(format!("tinyvllm-metal-plan-{}-{:?}", std::process::id(), cfg.architecture));
    std::fs::create_dir_all(&dir).unwrap();
    let vocab = Vocab::from_tokenizer_json(None, cfg.vocab_size, 1, 2).unwrap();
    for ty in [Quantization::Q8_0, Quantization::Q4KM] {
        let path = dir.join(format!("{ty:?}.gguf"));
        worker::models::gguf::write(&path, &cfg, &tensors, ty, &vocab).unwrap();
        let f32_copy = dir.join(format!("{ty:?}-dequantized.gguf"));
        dequantized_copy(&path, &f32_copy);
        let as_str = |p: &Path| p.to_str().unwrap().to_string();
        let mut gpu = engine(&as_str(&path), true, None);
        let mut cpu = engine(&as_str(&f32_copy), false, None);
        let file = std::fs::metadata(&path).unwrap().len() as f64;
        let resident = gpu.resident_weight_bytes() as f64;
        eprintln!("{ty:?}: file {file} bytes, resident on the plan {resident} bytes");
        // The embedding is dequantized to f32 for its row gather (f16 in a
        // Q8_0 file, Q4_K in a Q4_K_M one); everything else stays as stored.
        let embedding = (cfg.vocab_size * cfg.hidden_size * 4) as f64;
        assert!(resident <= 1.05 * file + embedding, "{ty:?}: {resident} bytes resident for a file of {file}");
        let (same, total) = agreement(&mut cpu, &mut gpu, &prompts(cfg.vocab_size as u32), 12);
        eprintln!("{ty:?}: teacher-forced agreement with the CPU on the same weights {same}/{total}");
        assert!(same * 1000 >= total * 995, "{ty:?}: {same}/{total}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_at_load_keeps_blocks_on_metal_emulated() {
    let model = support::test_data().join("models/tiny-qwen2");
    let model = model.to_str().unwrap();
    let dense = engine(model, true, None).resident_weight_bytes();
    for (q, ratio) in [(Quantization::Q8_0, 34.0 / 128.0), (Quantization::Q4_0, 18.0 / 128.0)] {
        let mut e = engine(model, true, Some(q));
        let resident = e.resident_weight_bytes();
        // The linear layers shrink by the block format's ratio; the tied
        // lm_head (the embedding) and the norms stay f32.
        let cfg = e.model_config().clone();
        let head = cfg.vocab_size * cfg.hidden_size * 4;
        let expected = (dense - head) as f64 * ratio + head as f64;
        eprintln!("{q:?}: {resident} bytes resident, f32 {dense}");
        assert!((resident as f64) < expected * 1.1, "{q:?}: {resident} bytes, expected about {expected}");
        assert_eq!(greedy(&mut e, &[1, 2, 3], 8).len(), 8);
    }
}

/// Seeded sampling through the engine on the plan (the draws on the GPU,
/// in the step's command buffer) gives the CPU engine's tokens and
/// logprobs: every sampling parameter, grammars, and rows batched with
/// each other. The CPU's logits differ from the GPU's in the last bits
/// (other sums), which moves a seeded draw only at a boundary.
#[test]
fn seeded_sampling_on_metal_emulated_gives_the_cpu_tokens() {
    let model = support::test_data().join("models/tiny-llama3");
    let model = model.to_str().unwrap();
    let seeded = |seed, p: SamplingParams| SamplingParams { seed: Some(seed), max_tokens: 24, ..p };
    let base = SamplingParams::default();
    let requests: Vec<SamplingParams> = vec![
        seeded(1, SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, logprobs: Some(3), ..base.clone() }),
        seeded(2, SamplingParams { min_p: 0.05, temperature: 1.3, ..base.clone() }),
        seeded(
            3,
            SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.4, presence_penalty: 0.2, ..base.clone() },
        ),
        seeded(4, SamplingParams { logit_bias: vec![(7, 3.0), (40, -50.0)], min_tokens: 10, ..base.clone() }),
        seeded(5, SamplingParams { logprobs: Some(5), ..SamplingParams::greedy(24) }),
        seeded(
            6,
            SamplingParams {
                structured_output: Some(StructuredOutput::Regex("[a-e]{3,8}".into())),
                temperature: 1.0,
                ..base.clone()
            },
        ),
        seeded(
            7,
            SamplingParams {
                structured_output: Some(StructuredOutput::Choice(vec!["one".into(), "two three".into()])),
                ..base
            },
        ),
    ];
    let run = |engine: &mut Engine| {
        for (i, params) in requests.iter().enumerate() {
            let prompt: Vec<u32> = (0..6 + i as u32).map(|t| 3 + (t * 31 + i as u32) % 500).collect();
            engine.add_request(RequestId(i as u64), prompt, params.clone(), 0).unwrap();
        }
        let mut out: Vec<(Vec<u32>, Vec<f32>)> = vec![Default::default(); requests.len()];
        let mut drawn_on_plan = 0;
        while engine.has_unfinished() {
            for o in engine.step().unwrap() {
                let entry = &mut out[o.id.0 as usize];
                entry.0.extend(&o.new_token_ids);
                entry.1.extend(o.logprobs.iter().map(|l| l.logprob));
            }
            drawn_on_plan += engine.last_step().drawn_on_plan;
        }
        (out, drawn_on_plan)
    };
    let (on_gpu, drawn) = run(&mut engine(model, true, None));
    let (on_cpu, _) = run(&mut engine(model, false, None));
    let tokens: usize = on_gpu.iter().map(|o| o.0.len()).sum();
    assert_eq!(drawn, tokens, "every token drawn by the plan's GPU sampler");
    for (i, (gpu, cpu)) in on_gpu.iter().zip(&on_cpu).enumerate() {
        assert_eq!(gpu.0, cpu.0, "request {i} ({:?})", requests[i]);
        assert_eq!(gpu.1.len(), cpu.1.len(), "request {i}: logprobs");
        for (a, b) in gpu.1.iter().zip(&cpu.1) {
            assert!((a - b).abs() < 1e-3, "request {i}: logprob {a} vs {b}");
        }
    }
}

/// What the step plan cannot run is refused by name, not run wrong: a
/// router of more experts than its routing kernel holds, a head dim past
/// its attention kernels.
#[test]
fn the_plan_refuses_what_it_cannot_run_by_name() {
    let models = support::test_data().join("models");
    let experts = support::model_with_config(&models.join("tiny-qwen3-moe"), "refused-experts", |c| {
        c["num_experts"] = 600.into();
    });
    let heads = support::model_with_config(&models.join("tiny-llama3"), "refused-head-dim", |c| {
        c["head_dim"] = 320.into();
    });
    let cases = [(experts, "routers of 600 experts"), (heads, "head_dim 320")];
    for (model, what) in cases {
        let files = ModelFiles::resolve(&ModelSource::parse(model.to_str().unwrap()).unwrap(), Need::Weights).unwrap();
        let (target, device) = test_plan();
        let config = EngineConfig { num_blocks: Some(16), plan: Some(target), device, ..EngineConfig::default() };
        let err = Engine::new(&files, config).err().expect("refused");
        assert!(err.to_string().contains(what), "{err}");
    }
}

/// gpt-oss's MXFP4 experts on the plan: a published-layout checkpoint
/// (`*_blocks`/`*_scales`, gate and up rows interleaved) and llama.cpp's
/// conversion of it load into the same blocks (the same greedy tokens on
/// every golden prompt) and stay 4.25 bits a weight; llama-quantize's
/// MXFP4_MOE file (experts MXFP4, the rest Q8_0) gives llama.cpp's own
/// next tokens, teacher-forced, at >= 85% of positions (371 of 432; the
/// CPU, whose kernels round the activations to 8 bits as llama.cpp's do,
/// 394: worker/tests/gguf.rs; the plan multiplies f32 activations).
#[test]
fn mxfp4_experts_on_metal_emulated_load_as_llama_cpp_s_and_give_its_tokens() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let as_str = |p: std::path::PathBuf| p.to_str().unwrap().to_string();
    let mut hf = engine(&as_str(data.join("tiny-gpt-oss-mxfp4")), true, None);
    let mut gguf = engine(&as_str(data.join("llamacpp/tiny-gpt-oss-mxfp4-hf.gguf")), true, None);
    let dense = engine(&as_str(support::test_data().join("models/tiny-gpt-oss")), true, None);
    let expert_weights = 4 * 8 * 3 * 64 * 64;
    let widest = dense.resident_weight_bytes() - expert_weights * 4 + expert_weights * 17 / 32;
    assert!(hf.resident_weight_bytes() <= widest, "{} > {widest}", hf.resident_weight_bytes());
    let read = |path: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let golden = read(support::test_data().join("golden/tiny-gpt-oss.json"));
    for case in golden["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        assert_eq!(greedy(&mut hf, &prompt, 16), greedy(&mut gguf, &prompt, 16), "case {}", case["id"]);
    }
    let mut quantized = engine(&as_str(data.join("llamacpp/tiny-gpt-oss-mxfp4.gguf")), true, None);
    let llama_cpp = read(data.join("llamacpp/tiny-gpt-oss-mxfp4.llama-cpp.json"));
    let (mut same, mut total) = (0, 0);
    for (case, theirs) in golden["cases"].as_array().unwrap().iter().zip(llama_cpp["cases"].as_array().unwrap()) {
        let (prompt, want, theirs) = (ids(&case["prompt_ids"]), ids(&case["generated_ids"]), ids(&theirs["next_ids"]));
        for t in 0..want.len() {
            let context: Vec<u32> = prompt.iter().chain(&want[..t]).copied().collect();
            same += usize::from(greedy(&mut quantized, &context, 1)[0] == theirs[t]);
            total += 1;
        }
    }
    eprintln!("MXFP4 tiny-gpt-oss on the plan, teacher-forced: llama.cpp's next token at {same} of {total} positions");
    assert!(same * 100 >= total * 85, "{same}/{total} positions as llama.cpp");
}
