//! Turns a model's files ([`ModelFiles`], found by `common::model`) into a
//! [`CausalLm`]: memory-mapped safetensors, a GGUF file, or seeded random
//! weights at a real model's shapes for `random:<preset>` (benchmarks
//! without weight files).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use common::model::{Architecture, ModelConfig, ModelFiles, RouterScoring};
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

/// How a random tensor starts.
#[derive(Clone, Copy)]
enum Init {
    /// Norm weights (`x * w`).
    Ones,
    /// Gemma's norm weights, stored around 0 (`x * (1 + w)`).
    Zeros,
    /// Uniform with this std.
    Uniform(f32),
}

/// Seeded random weights under HF names at `cfg`'s shapes (each family's
/// names and layouts, as the model reads them). Linear weights are uniform
/// with std 1/sqrt(fan_in) so activations stay O(1) through the layers;
/// norms are the identity; embeddings and biases have std 0.02 as in HF's
/// initialiser. Tensors are seeded by their place in the list, so a
/// model's first N layers are the same whatever N.
pub fn random_weights(cfg: &ModelConfig, dtype: DType, device: &Device, seed: u64) -> Result<HashMap<String, Tensor>> {
    let h = cfg.hidden_size;
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let norm = if cfg.gemma_norms { Init::Zeros } else { Init::Ones };
    let mut specs: Vec<(String, Vec<usize>, Init)> = vec![
        ("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], Init::Uniform(0.02)),
        ("model.norm.weight".into(), vec![h], norm),
    ];
    if !cfg.tie_word_embeddings {
        specs.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], Init::Uniform(1.0 / (h as f32).sqrt())));
    }
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        let lin = |name: &str, out: usize, inp: usize| {
            (format!("{p}.{name}.weight"), vec![out, inp], Init::Uniform(1.0 / (inp as f32).sqrt()))
        };
        let bias = |name: &str, n: usize| (format!("{p}.{name}"), vec![n], Init::Uniform(0.02));
        specs.extend([
            lin("self_attn.q_proj", q, h),
            lin("self_attn.k_proj", kv, h),
            lin("self_attn.v_proj", kv, h),
            lin("self_attn.o_proj", h, q),
        ]);
        specs.extend(mlp_specs(cfg, l, &p));
        specs.extend([
            (format!("{p}.input_layernorm.weight"), vec![h], norm),
            (format!("{p}.post_attention_layernorm.weight"), vec![h], norm),
        ]);
        if cfg.qkv_bias {
            specs.extend([bias("self_attn.q_proj.bias", q), bias("self_attn.k_proj.bias", kv)]);
            specs.push(bias("self_attn.v_proj.bias", kv));
        }
        if cfg.qk_norm {
            specs.push((format!("{p}.self_attn.q_norm.weight"), vec![cfg.head_dim], norm));
            specs.push((format!("{p}.self_attn.k_norm.weight"), vec![cfg.head_dim], norm));
        }
        if cfg.o_bias {
            specs.push(bias("self_attn.o_proj.bias", h));
        }
        if cfg.attention_sinks {
            specs.push((format!("{p}.self_attn.sinks"), vec![cfg.num_heads], Init::Uniform(1.0)));
        }
        if cfg.gemma_norms {
            specs.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h], norm));
            specs.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h], norm));
        }
    }
    specs
        .into_par_iter()
        .enumerate()
        .map(|(index, (name, shape, init))| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = match init {
                Init::Ones => vec![1.0; n],
                Init::Zeros => vec![0.0; n],
                Init::Uniform(std) => {
                    // Uniform on [-a, a] has std a/sqrt(3).
                    let a = std * 3f32.sqrt();
                    let mut state = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    (0..n).map(|_| (unit_uniform(&mut state) * 2.0 - 1.0) * a).collect()
                }
            };
            let tensor = Tensor::from_vec(values, shape, device)?.to_dtype(dtype)?;
            Ok((name, tensor))
        })
        .collect()
}

/// The tensors of layer `l`'s MLP under prefix `p`: dense, or each
/// family's experts (Mixtral's `block_sparse_moe`, per-expert matrices,
/// gpt-oss's stacked ones) with its router and shared experts.
fn mlp_specs(cfg: &ModelConfig, l: usize, p: &str) -> Vec<(String, Vec<usize>, Init)> {
    let h = cfg.hidden_size;
    let weight =
        |name: String, shape: Vec<usize>, fan_in: usize| (name, shape, Init::Uniform(1.0 / (fan_in as f32).sqrt()));
    let gated = |prefix: &str, i: usize, [g, u, d]: [&str; 3]| {
        vec![
            weight(format!("{prefix}.{g}.weight"), vec![i, h], h),
            weight(format!("{prefix}.{u}.weight"), vec![i, h], h),
            weight(format!("{prefix}.{d}.weight"), vec![h, i], i),
        ]
    };
    const NAMES: [&str; 3] = super::moe::MLP_PROJECTIONS;
    let m = &cfg.moe;
    if !m.is_moe_layer(l) {
        return gated(&format!("{p}.mlp"), cfg.intermediate_size, NAMES);
    }
    let (e, i) = (m.num_experts, m.expert_intermediate_size);
    let small = Init::Uniform(0.02);
    match cfg.architecture {
        Architecture::GptOss => vec![
            weight(format!("{p}.mlp.router.weight"), vec![e, h], h),
            (format!("{p}.mlp.router.bias"), vec![e], small),
            weight(format!("{p}.mlp.experts.gate_up_proj"), vec![e, h, 2 * i], h),
            (format!("{p}.mlp.experts.gate_up_proj_bias"), vec![e, 2 * i], small),
            weight(format!("{p}.mlp.experts.down_proj"), vec![e, i, h], i),
            (format!("{p}.mlp.experts.down_proj_bias"), vec![e, h], small),
        ],
        arch => {
            let names = super::moe::ExpertNames::of(arch);
            let (moe, names) = (format!("{p}.{}", names.module), names.projections);
            let mut specs = vec![weight(format!("{moe}.gate.weight"), vec![e, h], h)];
            if m.scoring == RouterScoring::SigmoidWithCorrection {
                specs.push((format!("{moe}.gate.e_score_correction_bias"), vec![e], small));
            }
            specs.extend((0..e).flat_map(|x| gated(&format!("{moe}.experts.{x}"), i, names)));
            if m.shared_intermediate_size > 0 {
                specs.extend(gated(&format!("{moe}.shared_experts"), m.shared_intermediate_size, NAMES));
            }
            specs
        }
    }
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

    /// Every preset's random weights carry the names and shapes its family's
    /// model reads (at a shrunk width, two layers, a few experts).
    #[test]
    fn every_presets_random_weights_build_its_model() {
        for name in common::model::presets::PRESETS {
            let cfg = random_preset(name).unwrap();
            let mut moe = cfg.moe.clone();
            if moe.num_experts > 0 {
                moe.num_experts = 8;
                moe.experts_per_token = moe.experts_per_token.min(2);
                moe.expert_intermediate_size = 16;
                moe.shared_intermediate_size = moe.shared_intermediate_size.min(16);
            }
            let cfg = ModelConfig {
                num_layers: 2,
                layer_types: cfg.layer_types[..2].to_vec(),
                hidden_size: 64,
                intermediate_size: 32,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                rotary_dim: 16,
                query_pre_attn_scalar: 16.0,
                vocab_size: 64,
                moe,
                ..cfg
            };
            let weights = random_weights(&cfg, DType::F32, &Device::Cpu, 1).unwrap();
            let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
            let model = CausalLm::new(&cfg, vb).unwrap_or_else(|e| panic!("{name}: {e}"));
            // Every expert is resident, where a token reads a few of them.
            assert_eq!(model.resident_weight_bytes() as u64, 4 * cfg.parameter_count(), "{name}");
            if cfg.moe.num_experts > 0 {
                assert!(model.weight_bytes_per_token() < model.resident_weight_bytes(), "{name}");
            }
        }
    }
}
