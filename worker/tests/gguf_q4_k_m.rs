//! `export-gguf --type q4_k_m` end to end: export, load with `--model
//! file.gguf`'s path (Q4_K and Q6_K weights kept in their blocks on the
//! CPU), and compare greedy tokens with the f32 model.
//!
//! * A small Llama whose in-features are multiples of 256 (so the
//!   k-quants are really used: Q4_K, Q6_K for lm_head and half of v/down),
//!   with seeded random weights.
//! * The five tiny models of tests/models on their golden prompts. Their
//!   in-features (64, 128, ...) are not multiples of 256, so every matrix
//!   falls back to Q8_0 (as llama.cpp falls back for such rows); the
//!   figure printed is the greedy agreement of that file with f32.
//!
//! Agreement is teacher-forced, as in `quant_golden.rs`: at each position of
//! the f32 model's greedy continuation both see the same context, and we
//! compare the next greedy token.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use common::model::ModelConfig;
use support::{dequantized_copy, greedy, test_data};
use worker::models::gguf::Vocab;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig, Quantization};

fn engine(source: &str) -> Engine {
    let files = ModelFiles::resolve(&ModelSource::parse(source).unwrap(), Need::Weights).unwrap();
    let config = EngineConfig { num_blocks: Some(256), dtype: DType::F32, ..EngineConfig::default() };
    Engine::new(&files, config).unwrap()
}

/// (agreeing positions, positions) over all prompts, teacher-forced: the
/// f32 file's greedy continuation against the other file's next token.
fn agreement(f32_path: &Path, q_path: &Path, prompts: &[(Vec<u32>, usize)]) -> (usize, usize) {
    let (mut reference, mut quantized) = (engine(f32_path.to_str().unwrap()), engine(q_path.to_str().unwrap()));
    let (mut same, mut total) = (0, 0);
    for (prompt, n) in prompts {
        let want = greedy(&mut reference, prompt, *n);
        for t in 0..want.len() {
            let context: Vec<u32> = prompt.iter().chain(&want[..t]).copied().collect();
            same += usize::from(greedy(&mut quantized, &context, 1)[0] == want[t]);
            total += 1;
        }
    }
    (same, total)
}

fn export(path: &Path, cfg: &ModelConfig, tensors: &HashMap<String, candle_core::Tensor>, ty: Quantization) {
    let vocab = Vocab::from_tokenizer_json(None, cfg.vocab_size, 1, 2).unwrap();
    worker::models::gguf::write(path, cfg, tensors, ty, &vocab).unwrap();
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyvllm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn q4_k_m_small_llama_agrees_with_f32() {
    let cfg = ModelConfig::from_json(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":768,
        "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,
        "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":512,"tie_word_embeddings":false}"#,
    )
    .unwrap();
    let tensors = worker::models::loader::random_weights(&cfg, DType::F32, &Device::Cpu, 7).unwrap();
    let dir = temp_dir("q4km-llama");
    let (f32_path, q_path) = (dir.join("f32.gguf"), dir.join("q4_k_m.gguf"));
    export(&f32_path, &cfg, &tensors, Quantization::F32);
    export(&q_path, &cfg, &tensors, Quantization::Q4KM);
    // Seeded prompts of 3 to 40 tokens.
    let mut state = 1u64;
    let prompts: Vec<(Vec<u32>, usize)> =
        (0..8).map(|p| (support::seeded_ids(&mut state, 3 + 5 * p, 512), 16)).collect();
    // The block kernels on the file against dense f32 copies of the very
    // weights in it: only the activations' Q8_K rounding differs.
    let dequantized = dir.join("dequantized.gguf");
    dequantized_copy(&q_path, &dequantized);
    let (kernel, total) = agreement(&dequantized, &q_path, &prompts);
    let q4_0_path = dir.join("q4_0.gguf");
    export(&q4_0_path, &cfg, &tensors, Quantization::Q4_0);
    let (q4_0, _) = agreement(&f32_path, &q4_0_path, &prompts);
    let (same, _) = agreement(&f32_path, &q_path, &prompts);
    eprintln!(
        "small llama, teacher-forced greedy agreement: q4_k_m vs its dequantized weights {kernel}/{total}; \
         with f32: q4_k_m {same}/{total}, q4_0 {q4_0}/{total}"
    );
    assert!(kernel * 10 >= total * 9, "q4_k_m vs its own weights in f32: {kernel}/{total}");
    // Random weights give flat logits (many near-ties), the hardest case
    // for agreement with f32.
    assert!(same * 2 >= total, "q4_k_m {same}/{total}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn q4_k_m_tiny_models_agree_with_f32_on_golden_prompts() {
    let dir = temp_dir("q4km-golden");
    for model in ["stories260K", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"] {
        let files =
            ModelFiles::resolve(&ModelSource::Dir(test_data().join("models").join(model)), Need::Weights).unwrap();
        if files.config.rope_scaling.is_some() {
            eprintln!("q4_k_m {model}: skipped, export does not write RoPE scaling");
            continue;
        }
        let mut tensors = HashMap::new();
        for w in &files.weights {
            tensors.extend(candle_core::safetensors::load(w, &Device::Cpu).unwrap());
        }
        let (f32_path, q_path) = (dir.join(format!("{model}-f32.gguf")), dir.join(format!("{model}-q4km.gguf")));
        export(&f32_path, &files.config, &tensors, Quantization::F32);
        export(&q_path, &files.config, &tensors, Quantization::Q4KM);
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(test_data().join(format!("golden/{model}.json"))).unwrap())
                .unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        };
        let prompts: Vec<(Vec<u32>, usize)> = golden["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (ids(&c["prompt_ids"]), ids(&c["generated_ids"]).len()))
            .collect();
        let (same, total) = agreement(&f32_path, &q_path, &prompts);
        eprintln!("q4_k_m {model}: teacher-forced greedy agreement with f32 {same}/{total}");
        assert!(same * 10 >= total * 8, "{model}: {same}/{total}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
