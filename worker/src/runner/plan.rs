//! A model's step as one plan of our GPU kernels (`kernels::metal::step`):
//! the weights uploaded once, the step's buffers allocated once, and each
//! step encoded into one command buffer. The model runner hands it the
//! step's flattened batch and gets the wanted rows' logits back.
//!
//! The plan is generic over the GPU ([`Gpu`]); `--device metal-emulated`
//! runs it in the CPU emulator of our Metal kernels.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use kernels::metal::step::{
    Gpu, LayerWeights, Linear, Matrix, ModelShape, ModelWeights, Readback, StepInputs, StepLimits, StepPlan,
    pad_columns, padded_head_dim,
};

use crate::error::{Result, WorkerError};
use crate::models::{ModelConfig, ModelFiles};
use crate::runner::device::PlanTarget;
use crate::runner::model_runner::BatchInputs;

/// What a model runner needs of a plan, whatever its GPU.
pub trait StepExecutor: Send {
    /// Runs a step; the logits of `rows` (`[rows, vocab]`), or nothing for no rows.
    fn logits(&mut self, batch: &BatchInputs, rows: &[u32]) -> Result<Vec<f32>>;
    /// Bytes of weights the GPU holds.
    fn weight_bytes(&self) -> usize;
    /// Bytes of the KV pools.
    fn kv_bytes(&self) -> usize;
}

struct PlanExecutor<G: Gpu> {
    gpu: G,
    plan: StepPlan<G::Buffer>,
}

impl<G> StepExecutor for PlanExecutor<G>
where
    G: Gpu + Send,
    G::Buffer: Send,
{
    fn logits(&mut self, batch: &BatchInputs, rows: &[u32]) -> Result<Vec<f32>> {
        let inputs = StepInputs {
            input_ids: &batch.input_ids,
            positions: &batch.positions,
            meta: &batch.meta,
            logit_rows: rows,
        };
        let bytes = self.plan.run(&mut self.gpu, &inputs, Readback::Logits)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    fn weight_bytes(&self) -> usize {
        self.plan.weight_bytes()
    }

    fn kv_bytes(&self) -> usize {
        self.plan.kv_bytes()
    }
}

/// Builds the plan of `files` on `target`: uploads the weights (in `dtype`)
/// and allocates the KV pools (`cache` dtype) and the step's buffers.
pub fn build(
    target: PlanTarget,
    device: &candle_core::Device,
    files: &ModelFiles,
    dtype: DType,
    cache: DType,
    limits: StepLimits,
) -> Result<Box<dyn StepExecutor>> {
    match target {
        PlanTarget::Metal => {
            #[cfg(target_os = "macos")]
            {
                let mut gpu = kernels::metal::gpu::MetalGpu::new(device.as_metal_device()?.clone())?;
                let plan = plan_for(&mut gpu, files, dtype, cache, limits)?;
                gpu.prepare(plan.kernels())?;
                Ok(Box::new(PlanExecutor { gpu, plan }))
            }
            #[cfg(not(target_os = "macos"))]
            {
                let _ = (device, files, dtype, cache, limits);
                Err(WorkerError::Unsupported("the Metal step plan runs on macOS".into()))
            }
        }
        PlanTarget::MetalEmulated => {
            #[cfg(feature = "metal-emulated")]
            {
                let _ = device;
                let mut gpu = kernels::metal::emulated::EmulatedGpu::new()?;
                let plan = plan_for(&mut gpu, files, dtype, cache, limits)?;
                gpu.prepare(plan.kernels())?;
                let counters = gpu.counters();
                tracing::info!(
                    "metal-emulated: {} buffers, {} bytes allocated at load",
                    counters.allocations,
                    counters.allocated_bytes
                );
                Ok(Box::new(PlanExecutor { gpu, plan }))
            }
            #[cfg(not(feature = "metal-emulated"))]
            {
                let _ = (device, files, dtype, cache, limits);
                Err(WorkerError::Unsupported("this build has no metal-emulated device".into()))
            }
        }
    }
}

/// The plan of `files` on `gpu`.
pub fn plan_for<G: Gpu>(
    gpu: &mut G,
    files: &ModelFiles,
    dtype: DType,
    cache: DType,
    limits: StepLimits,
) -> Result<StepPlan<G::Buffer>> {
    let cfg = &files.config;
    check_supported(cfg)?;
    let vb = crate::models::loader::host_weights(files, dtype)?;
    let weights = upload_weights(gpu, cfg, &vb, limits.max_model_len)?;
    let shape = ModelShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        eps: cfg.rms_norm_eps as f32,
        max_positions: limits.max_model_len,
    };
    Ok(StepPlan::new(gpu, shape, weights, limits, cache)?)
}

/// What the plan's kernels do not do yet, refused by name.
fn check_supported(cfg: &ModelConfig) -> Result<()> {
    let refuse = |what: &str| {
        Err(WorkerError::Unsupported(format!("the Metal step plan does not run {what} yet ({:?})", cfg.architecture)))
    };
    if !cfg.head_dim.is_multiple_of(2) || padded_head_dim(cfg.head_dim).is_none() {
        return refuse(&format!("head_dim {} (it takes even head dims up to 256)", cfg.head_dim));
    }
    Ok(())
}

/// A tensor's elements as little-endian bytes (f32, f16 or bf16).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        other => return Err(WorkerError::Unsupported(format!("{other:?} weights on the Metal step plan"))),
    })
}

fn upload_matrix<G: Gpu>(gpu: &mut G, t: &Tensor) -> Result<Matrix<G::Buffer>> {
    let (rows, cols) = t.dims2()?;
    Ok(Matrix { buffer: gpu.upload(&tensor_bytes(t)?)?, dtype: t.dtype(), rows, cols })
}

fn upload_f32<G: Gpu>(gpu: &mut G, t: &Tensor) -> Result<G::Buffer> {
    Ok(gpu.upload(&tensor_bytes(&t.to_dtype(DType::F32)?)?)?)
}

/// Linear layers reading the same input, stacked: `[sum of outs, in]`, with
/// their biases stacked when `bias`.
fn stacked<G: Gpu>(
    gpu: &mut G,
    vb: &VarBuilder,
    names: &[(&str, usize)],
    inp: usize,
    bias: bool,
) -> Result<Linear<G::Buffer>> {
    let weights =
        names.iter().map(|(n, out)| vb.pp(*n).get((*out, inp), "weight")).collect::<candle_core::Result<Vec<_>>>()?;
    let weight = upload_matrix(gpu, &Tensor::cat(&weights, 0)?)?;
    let bias = if bias {
        let biases =
            names.iter().map(|(n, out)| vb.pp(*n).get(*out, "bias")).collect::<candle_core::Result<Vec<_>>>()?;
        Some(upload_f32(gpu, &Tensor::cat(&biases, 0)?)?)
    } else {
        None
    };
    Ok(Linear { weight, bias })
}

/// o_proj with each head's columns zero-padded to the attention kernels'
/// head dim ([`padded_head_dim`]; stories260K's heads of 8 run as 32).
fn o_proj<G: Gpu>(gpu: &mut G, attn: &VarBuilder, cfg: &ModelConfig) -> Result<Linear<G::Buffer>> {
    let (h, heads, d) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim);
    let padded = padded_head_dim(d).unwrap_or(d);
    let o = attn.pp("o_proj");
    let weight = o.get((h, heads * d), "weight")?;
    let elem = weight.dtype().size_in_bytes();
    let bytes = pad_columns(&tensor_bytes(&weight)?, h, heads, d, padded, elem);
    let weight = Matrix { buffer: gpu.upload(&bytes)?, dtype: weight.dtype(), rows: h, cols: heads * padded };
    let bias = if cfg.o_bias { Some(upload_f32(gpu, &o.get(h, "bias")?)?) } else { None };
    Ok(Linear { weight, bias })
}

fn upload_weights<G: Gpu>(
    gpu: &mut G,
    cfg: &ModelConfig,
    vb: &VarBuilder,
    max_positions: usize,
) -> Result<ModelWeights<G::Buffer>> {
    let (h, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * d, cfg.num_kv_heads * d);
    let model = vb.pp("model");
    let embed = upload_matrix(gpu, &model.pp("embed_tokens").get((cfg.vocab_size, h), "weight")?)?;
    let lm_head = if cfg.tie_word_embeddings {
        embed.clone()
    } else {
        upload_matrix(gpu, &vb.pp("lm_head").get((cfg.vocab_size, h), "weight")?)?
    };
    let norm = |gpu: &mut G, vb: VarBuilder, dim: usize| upload_f32(gpu, &vb.get(dim, "weight")?);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for l in 0..cfg.num_layers {
        let layer = model.pp(format!("layers.{l}"));
        let attn = layer.pp("self_attn");
        let mlp = layer.pp("mlp");
        let head_norm =
            if cfg.qk_norm { Some((norm(gpu, attn.pp("q_norm"), d)?, norm(gpu, attn.pp("k_norm"), d)?)) } else { None };
        layers.push(LayerWeights {
            input_norm: norm(gpu, layer.pp("input_layernorm"), h)?,
            qkv: stacked(gpu, &attn, &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)], h, cfg.qkv_bias)?,
            head_norm,
            o_proj: o_proj(gpu, &attn, cfg)?,
            post_norm: norm(gpu, layer.pp("post_attention_layernorm"), h)?,
            gate_up: stacked(gpu, &mlp, &[("gate_proj", i), ("up_proj", i)], h, cfg.mlp_bias)?,
            down: stacked(gpu, &mlp, &[("down_proj", h)], i, cfg.mlp_bias)?,
        });
    }
    let final_norm = norm(gpu, model.pp("norm"), h)?;
    // The same tables as the CPU path's (`RotaryEmbedding`), in f32.
    let inv_freq = cfg.rope_inv_freq();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..max_positions {
        for &f in &inv_freq {
            let angle = pos as f64 * f;
            cos.extend((angle.cos() as f32).to_le_bytes());
            sin.extend((angle.sin() as f32).to_le_bytes());
        }
    }
    let rope_cos = gpu.upload(&cos)?;
    let rope_sin = gpu.upload(&sin)?;
    Ok(ModelWeights { embed, layers, final_norm, lm_head, rope_cos, rope_sin })
}
