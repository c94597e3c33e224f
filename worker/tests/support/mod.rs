//! Helpers shared by the worker's integration tests. Each test binary
//! compiles this module and uses part of it, hence `allow(dead_code)`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{RequestId, SamplingParams};
use worker::Engine;

/// The test models and golden outputs (the repository's `tests/`).
pub fn test_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests")
}

/// `n` greedy tokens after `prompt` (EOS ignored), as request 0.
pub fn greedy(engine: &mut Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n as u32) };
    engine.add_request(RequestId(0), prompt.to_vec(), params, 0).unwrap();
    let mut ids = Vec::new();
    while engine.has_unfinished() {
        for out in engine.step().unwrap() {
            ids.extend(&out.new_token_ids);
        }
    }
    ids
}

/// A draft model for speculative decoding made from a real one: its first
/// `layers` decoder layers, with its embeddings, final norm and lm_head (a
/// layer-skipping self-draft). Written to a new temporary directory: a
/// config.json with fewer layers beside links to the same weights and
/// tokenizer files (the loader reads only the tensors the config names).
pub fn truncated_model(dir: &Path, layers: usize) -> PathBuf {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    model_with_config(dir, &format!("draft-{name}-{layers}"), |config| {
        assert!(config["num_hidden_layers"].as_u64().unwrap() > layers as u64, "{name} has too few layers");
        common::model::truncate_layers(config, layers);
    })
}

/// The model in `dir` with its config.json changed by `edit`, in a new
/// temporary directory (named after `tag`): the edited config beside links
/// to the same weights and tokenizer files.
pub fn model_with_config(dir: &Path, tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("tinyvllm-{tag}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap();
        if file != "config.json" && path.is_file() {
            let link = out.join(file);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(std::fs::canonicalize(&path).unwrap(), link).unwrap();
        }
    }
    out
}

/// A copy of a GGUF file with every tensor dequantized to f32 by candle
/// (GGML's reference decoding), names and metadata unchanged.
pub fn dequantized_copy(src: &Path, dst: &Path) {
    use candle_core::Device;
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
    let mut reader = std::io::BufReader::new(std::fs::File::open(src).unwrap());
    let content = gguf_file::Content::read(&mut reader).unwrap();
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let q = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
            let t = q.dequantize(&Device::Cpu).unwrap();
            (name.clone(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let md: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(dst).unwrap(), &md, &ts).unwrap();
}

/// `len` token ids below `vocab` from a seeded stream (an LCG on `state`).
pub fn seeded_ids(state: &mut u64, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|_| {
            *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*state >> 33) as u32 % vocab
        })
        .collect()
}
