//! Finds a model's files and turns them into a [`CausalLm`]: a local Hugging
//! Face directory, a hub id downloaded into the standard HF cache, or a
//! `random:<preset>` with seeded random weights at a real model's shapes (for
//! benchmarks without weight files).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;
use serde::Deserialize;

use super::config::ModelConfig;
use super::llama::CausalLm;
use crate::error::{Result, WorkerError};

/// Where a model comes from, parsed from `--model`.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    Dir(PathBuf),
    /// A GGUF file (llama.cpp's format).
    Gguf(PathBuf),
    Hub(String),
    Random(String),
}

impl ModelSource {
    /// `random:<preset>`, an existing directory, or else a hub id `org/name`.
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(preset) = spec.strip_prefix("random:") {
            return Ok(Self::Random(preset.to_string()));
        }
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(Self::Dir(path.to_path_buf()));
        }
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            if path.is_file() {
                return Ok(Self::Gguf(path.to_path_buf()));
            }
            return Err(WorkerError::ModelFile { path: path.to_path_buf(), message: "no such GGUF file".into() });
        }
        let looks_like_hub_id = spec.split('/').count() == 2 && !spec.starts_with('.') && !spec.starts_with('/');
        if looks_like_hub_id {
            return Ok(Self::Hub(spec.to_string()));
        }
        Err(WorkerError::ModelFile { path: path.to_path_buf(), message: "no such model directory".into() })
    }
}

/// `generation_config.json`: only the fields the engine uses.
#[derive(Clone, Debug, Default, Deserialize)]
struct GenerationConfigJson {
    #[serde(default)]
    eos_token_id: Option<OneOrMany>,
    #[serde(default)]
    bos_token_id: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

/// A model's files on disk (or, for a random preset, none).
#[derive(Clone, Debug)]
pub struct ModelFiles {
    /// What the user asked for, for logs and the served model name.
    pub name: String,
    pub config: ModelConfig,
    pub weights: Vec<PathBuf>,
    /// Set when the weights are one GGUF file.
    pub gguf: Option<PathBuf>,
    pub tokenizer_json: Option<PathBuf>,
    pub tokenizer_config_json: Option<PathBuf>,
    /// EOS ids from generation_config.json (falling back to config.json).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// True for `random:` presets: outputs are meaningless.
    pub random_weights: bool,
    /// `common::protocol::config_hash` of config.json (of the preset name for random weights).
    pub config_hash: u64,
}

impl ModelFiles {
    /// Name and config hash, so the coordinator can refuse a worker that
    /// serves another model.
    pub fn identity(&self) -> common::protocol::ModelIdentity {
        common::protocol::ModelIdentity { name: self.name.clone(), config_hash: self.config_hash }
    }

    pub fn resolve(source: &ModelSource) -> Result<Self> {
        match source {
            ModelSource::Dir(dir) => Self::from_dir(dir, dir.display().to_string()),
            ModelSource::Hub(repo) => {
                let dir = download_from_hub(repo)?;
                Self::from_dir(&dir, repo.clone())
            }
            ModelSource::Gguf(path) => {
                let info = super::gguf::read_info(path)?;
                // A tokenizer.json beside the file serves text prompts.
                let tokenizer = path.with_file_name("tokenizer.json");
                Ok(Self {
                    name: path.display().to_string(),
                    config: info.config,
                    weights: Vec::new(),
                    gguf: Some(path.clone()),
                    tokenizer_json: tokenizer.is_file().then_some(tokenizer),
                    tokenizer_config_json: None,
                    eos_token_ids: info.eos_token_ids,
                    bos_token_id: info.bos_token_id,
                    random_weights: false,
                    config_hash: common::protocol::config_hash(info.config_json.as_bytes()),
                })
            }
            ModelSource::Random(preset) => {
                let config = random_preset(preset)?;
                Ok(Self {
                    name: format!("random:{preset}"),
                    config,
                    weights: Vec::new(),
                    gguf: None,
                    tokenizer_json: None,
                    tokenizer_config_json: None,
                    eos_token_ids: vec![2],
                    bos_token_id: Some(1),
                    random_weights: true,
                    config_hash: common::protocol::config_hash(format!("random:{preset}").as_bytes()),
                })
            }
        }
    }

    fn from_dir(dir: &Path, name: String) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config_text = read_file(&config_path)?;
        let config = ModelConfig::from_json(&config_text)
            .map_err(|e| WorkerError::ModelFile { path: config_path.clone(), message: e.to_string() })?;
        let weights = find_weight_files(dir)?;
        let optional = |file: &str| Some(dir.join(file)).filter(|p| p.is_file());
        let generation: GenerationConfigJson = match optional("generation_config.json") {
            Some(path) => parse_json(&path)?,
            None => GenerationConfigJson::default(),
        };
        let from_config: GenerationConfigJson = parse_json(&config_path)?;
        let eos = generation.eos_token_id.or(from_config.eos_token_id);
        let eos_token_ids = match eos {
            Some(OneOrMany::One(id)) => vec![id],
            Some(OneOrMany::Many(ids)) => ids,
            None => Vec::new(),
        };
        Ok(Self {
            name,
            config,
            weights,
            gguf: None,
            tokenizer_json: optional("tokenizer.json"),
            tokenizer_config_json: optional("tokenizer_config.json"),
            eos_token_ids,
            bos_token_id: generation.bos_token_id.or(from_config.bos_token_id),
            random_weights: false,
            config_hash: common::protocol::config_hash(config_text.as_bytes()),
        })
    }

    /// Builds the model in `dtype` on `device`. Safetensors files are
    /// memory-mapped; each tensor is read once into its device buffer.
    pub fn load(&self, dtype: DType, device: &Device) -> Result<CausalLm> {
        if let Some(path) = &self.gguf {
            return super::gguf::load(path, dtype, device);
        }
        if self.random_weights {
            let vb = VarBuilder::from_tensors(random_weights(&self.config, dtype, device, 0)?, dtype, device);
            return CausalLm::new(&self.config, vb);
        }
        let source_desc = self.weights.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
        // SAFETY: the files are mapped read-only; like every mmap-based
        // loader (candle, transformers) we assume nobody truncates them while
        // the model loads.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&self.weights, dtype, device) }
            .map_err(|error| WorkerError::Weights { source_desc: source_desc.clone(), error })?;
        CausalLm::new(&self.config, vb).map_err(|e| match e {
            WorkerError::Candle(error) => WorkerError::Weights { source_desc, error },
            other => other,
        })
    }
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| WorkerError::ModelFile { path: path.to_path_buf(), message: e.to_string() })
}

fn parse_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    serde_json::from_str(&read_file(path)?)
        .map_err(|e| WorkerError::ModelFile { path: path.to_path_buf(), message: e.to_string() })
}

/// `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
fn find_weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.is_file() {
        return Err(WorkerError::ModelFile {
            path: dir.to_path_buf(),
            message: "neither model.safetensors nor model.safetensors.index.json found".into(),
        });
    }
    #[derive(Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let index: Index = parse_json(&index_path)?;
    let mut shards: Vec<String> = index.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    shards
        .into_iter()
        .map(|shard| {
            let path = dir.join(&shard);
            if path.is_file() {
                Ok(path)
            } else {
                Err(WorkerError::ModelFile {
                    path,
                    message: format!("shard listed in {} is missing", index_path.display()),
                })
            }
        })
        .collect()
}

/// Downloads a hub model's files into the standard HF cache (honouring
/// HF_HOME and HF_TOKEN), with a progress bar, and returns the snapshot dir.
fn download_from_hub(repo_id: &str) -> Result<PathBuf> {
    let hub_err = |message: String| WorkerError::Hub { repo: repo_id.to_string(), message };
    let api =
        hf_hub::api::sync::ApiBuilder::from_env().with_progress(true).build().map_err(|e| hub_err(e.to_string()))?;
    let repo = api.model(repo_id.to_string());
    let config = repo.get("config.json").map_err(|e| hub_err(format!("config.json: {e}")))?;
    for optional in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        let _ = repo.get(optional);
    }
    match repo.get("model.safetensors") {
        Ok(_) => {}
        Err(_) => {
            let index = repo
                .get("model.safetensors.index.json")
                .map_err(|e| hub_err(format!("no safetensors weights: {e}")))?;
            let text = read_file(&index)?;
            let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| hub_err(e.to_string()))?;
            let mut shards: Vec<String> = value["weight_map"]
                .as_object()
                .map(|m| m.values().filter_map(|v| v.as_str().map(String::from)).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for shard in shards {
                repo.get(&shard).map_err(|e| hub_err(format!("{shard}: {e}")))?;
            }
        }
    }
    config.parent().map(Path::to_path_buf).ok_or_else(|| hub_err("bad cache path".into()))
}

/// Configs of real models, for `random:<preset>`.
pub fn random_preset(name: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(random_preset_json(name)?)
}

/// The config.json text of a preset (HF field names).
pub fn random_preset_json(name: &str) -> Result<&'static str> {
    Ok(match name {
        // HuggingFaceTB/SmolLM-135M
        "smollm-135m" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":true}"#
        }
        // TinyLlama/TinyLlama-1.1B-Chat-v1.0
        "tinyllama-1.1b" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":5632,
            "num_hidden_layers":22,"num_attention_heads":32,"num_key_value_heads":4,"vocab_size":32000,
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":false}"#
        }
        // Qwen/Qwen3-0.6B
        "qwen3-0.6b" => {
            r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":1024,"intermediate_size":3072,
            "num_hidden_layers":28,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,
            "rms_norm_eps":1e-6,"rope_theta":1000000.0,"max_position_embeddings":40960,"tie_word_embeddings":true}"#
        }
        // meta-llama/Llama-3.2-1B
        "llama-3.2-1b" => {
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
            "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"vocab_size":128256,
            "rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":131072,"tie_word_embeddings":true,
            "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192}}"#
        }
        other => return Err(WorkerError::UnknownPreset(other.to_string())),
    })
}

/// Seeded random weights under HF names at `cfg`'s shapes. Linear weights are
/// uniform with std 1/sqrt(fan_in) so activations stay O(1) through the
/// layers; norms are 1; embeddings have std 0.02 as in HF's initialiser.
pub fn random_weights(cfg: &ModelConfig, dtype: DType, device: &Device, seed: u64) -> Result<HashMap<String, Tensor>> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    // (name, shape, std); std 0 means "all ones" (norm weights).
    let mut specs: Vec<(String, Vec<usize>, f32)> = vec![
        ("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], 0.02),
        ("model.norm.weight".into(), vec![h], 0.0),
    ];
    if !cfg.tie_word_embeddings {
        specs.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], 1.0 / (h as f32).sqrt()));
    }
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let lin = |name: &str, out: usize, inp: usize| {
            (format!("{p}.{name}.weight"), vec![out, inp], 1.0 / (inp as f32).sqrt())
        };
        specs.extend([
            lin("self_attn.q_proj", q, h),
            lin("self_attn.k_proj", kv, h),
            lin("self_attn.v_proj", kv, h),
            lin("self_attn.o_proj", h, q),
            lin("mlp.gate_proj", i, h),
            lin("mlp.up_proj", i, h),
            lin("mlp.down_proj", h, i),
            (format!("{p}.input_layernorm.weight"), vec![h], 0.0),
            (format!("{p}.post_attention_layernorm.weight"), vec![h], 0.0),
        ]);
        if cfg.qkv_bias {
            for name in ["q_proj", "k_proj", "v_proj"] {
                let n = if name == "q_proj" { q } else { kv };
                specs.push((format!("{p}.self_attn.{name}.bias"), vec![n], 0.02));
            }
        }
        if cfg.qk_norm {
            specs.push((format!("{p}.self_attn.q_norm.weight"), vec![cfg.head_dim], 0.0));
            specs.push((format!("{p}.self_attn.k_norm.weight"), vec![cfg.head_dim], 0.0));
        }
    }
    specs
        .into_par_iter()
        .enumerate()
        .map(|(index, (name, shape, std))| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if std == 0.0 {
                vec![1.0; n]
            } else {
                // Uniform on [-a, a] has std a/sqrt(3).
                let a = std * 3f32.sqrt();
                let mut state = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (0..n).map(|_| (unit_uniform(&mut state) * 2.0 - 1.0) * a).collect()
            };
            let tensor = Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?;
            Ok((name, tensor))
        })
        .collect()
}

/// SplitMix64 step mapped to [0, 1).
fn unit_uniform(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_real_shapes() {
        let tl = random_preset("tinyllama-1.1b").unwrap();
        assert_eq!((tl.num_layers, tl.num_kv_heads, tl.head_dim), (22, 4, 64));
        let q3 = random_preset("qwen3-0.6b").unwrap();
        assert!(q3.qk_norm && q3.tie_word_embeddings);
        assert!(random_preset("gpt-5").is_err());
    }

    #[test]
    fn missing_files_are_named() {
        let dir = std::env::temp_dir().join(format!("tinyvllm-missing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = ModelFiles::resolve(&ModelSource::Dir(dir.clone())).unwrap_err().to_string();
        assert!(err.contains("config.json"), "{err}");
        std::fs::copy(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/models/stories260K/config.json"),
            dir.join("config.json"),
        )
        .unwrap();
        let err = ModelFiles::resolve(&ModelSource::Dir(dir.clone())).unwrap_err().to_string();
        assert!(err.contains("model.safetensors"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
