//! Turns a model's files ([`ModelFiles`], found by `common::model`) into a
//! [`CausalLm`]: memory-mapped safetensors, a GGUF file, or seeded random
//! weights at a real model's shapes for `random:<preset>` (benchmarks
//! without weight files).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::model::{ModelConfig, ModelFiles};
pub use common::model::{random_preset, random_preset_json};
use common::pipeline::LayerRange;
use rayon::prelude::*;

use super::linear::Prequantized;
use super::llama::CausalLm;
use crate::error::{Result, WorkerError};

/// Builds the model of `files` in `dtype` on `device`. Safetensors files are
/// memory-mapped; each tensor is read once into its device buffer.
pub fn load(files: &ModelFiles, dtype: DType, device: &Device) -> Result<CausalLm> {
    load_stage(files, dtype, device, LayerRange::full(files.config.num_layers))
}

/// As [`load`], for the pipeline stage holding decoder layers `range`: only
/// the tensors that stage uses are read (see [`LayerRange::holds_tensor`]).
pub fn load_stage(files: &ModelFiles, dtype: DType, device: &Device, range: LayerRange) -> Result<CausalLm> {
    if let Some(path) = &files.gguf {
        return super::gguf::load(path, dtype, device, range);
    }
    let pre = Prequantized::default();
    if files.random_weights {
        let mut weights = random_weights(&files.config, dtype, device, 0)?;
        weights.retain(|name, _| range.holds_tensor(name, files.config.tie_word_embeddings));
        let vb = VarBuilder::from_tensors(weights, dtype, device);
        return CausalLm::stage(&files.config, vb, &pre, range);
    }
    let source_desc = files.weights.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    // SAFETY: the files are mapped read-only; like every mmap-based
    // loader (candle, transformers) we assume nobody truncates them while
    // the model loads.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, device) }
        .map_err(|error| WorkerError::Weights { source_desc: source_desc.clone(), error })?;
    CausalLm::stage(&files.config, vb, &pre, range).map_err(|e| match e {
        WorkerError::Candle(error) => WorkerError::Weights { source_desc, error },
        other => other,
    })
}

/// The weights of `files` under Hugging Face names, in `dtype` on the CPU,
/// read lazily (safetensors stay memory-mapped): what the Metal step plan
/// uploads from. GGUF files are not read this way.
pub fn host_weights(files: &ModelFiles, dtype: DType) -> Result<VarBuilder<'static>> {
    if files.gguf.is_some() {
        return Err(WorkerError::Unsupported(format!(
            "{}: GGUF weights do not run on the Metal step plan yet (use the safetensors checkpoint)",
            files.name
        )));
    }
    if files.random_weights {
        let weights = random_weights(&files.config, dtype, &Device::Cpu, 0)?;
        return Ok(VarBuilder::from_tensors(weights, dtype, &Device::Cpu));
    }
    let source_desc = files.weights.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    // SAFETY: as in `load_stage`: mapped read-only, nobody truncates them.
    unsafe { VarBuilder::from_mmaped_safetensors(&files.weights, dtype, &Device::Cpu) }
        .map_err(|error| WorkerError::Weights { source_desc, error })
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
    fn random_weights_are_seeded_and_shaped() {
        let cfg = random_preset("smollm-135m").unwrap();
        let cfg = ModelConfig { num_layers: 1, vocab_size: 64, ..cfg };
        let a = random_weights(&cfg, DType::F32, &Device::Cpu, 7).unwrap();
        let b = random_weights(&cfg, DType::F32, &Device::Cpu, 7).unwrap();
        let q = "model.layers.0.self_attn.q_proj.weight";
        assert_eq!(a[q].dims(), [cfg.num_heads * cfg.head_dim, cfg.hidden_size]);
        let (x, y) = (
            a[q].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b[q].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(x, y);
        assert!(!a.contains_key("lm_head.weight"), "tied embeddings have no lm_head");
    }
}
