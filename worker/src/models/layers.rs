//! The layers of a Llama-family decoder, in candle's style (`new(cfg, vb)`
//! with Hugging Face weight names, checks once at construction): RMSNorm,
//! rotary embeddings, attention over the paged KV cache, the SwiGLU MLP, and
//! the stacked projections both use.
//!
//! Each layer has two paths ([`ExecutionPath`], chosen once per model).
//! `forward` composes candle ops and the device's kernels (GPUs, and
//! non-f32 activations). `forward_into` / `forward_cpu` run f32
//! activations on the CPU through the fused kernels of
//! `kernels::cpu`, reading and writing the reused buffers of
//! [`super::workspace::Workspace`] so a step allocates no activation.
//! Shapes: `T` new tokens in the step's flattened batch, `H` query heads,
//! `KVH` key/value heads, `D` head dim, `I` the MLP's intermediate size.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use kernels::AttentionMetadata;

use super::config::ModelConfig;
use super::linear::Prequantized;
use super::linear::{Linear, linear};
use super::workspace::Buffers;
use crate::error::Result;
use crate::runner::kv_cache::LayerKvCache;
use common::model::Activation;
use kernels::cpu::Gate;

/// The dtype activations (and the KV cache) use. On the CPU they stay f32
/// whatever the weights are: the linear layers widen f16/bf16 weights in
/// registers anyway, and f32 activations avoid a conversion around every op.
pub fn activation_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() { DType::F32 } else { weights }
}

/// How a model's step runs, chosen once when the model is built and handed
/// to every layer that keeps something for one path only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutionPath {
    /// f32 activations on the CPU through the fused kernels of
    /// `kernels::cpu`, into the workspace's reused buffers.
    FusedCpu,
    /// candle ops and the device's kernels (GPUs, non-f32 activations).
    Composed,
}

impl ExecutionPath {
    /// The path for activations of dtype `act` on `device`.
    pub fn of(act: DType, device: &Device) -> Self {
        if device.is_cpu() && act == DType::F32 { Self::FusedCpu } else { Self::Composed }
    }
}

/// RMSNorm over the last dimension: `x / rms(x) * weight`.
pub struct RmsNorm {
    weight: Tensor, // [dim]
    /// The weight as f32 on the host, on the fused CPU path (empty elsewhere).
    host: Vec<f32>,
    path: ExecutionPath,
    eps: f32,
}

impl RmsNorm {
    /// A norm of the model `cfg` over `dim`: Gemma's weights are stored
    /// around 0 and multiply by `1 + w` (added in f32, as transformers does).
    pub fn of_model(cfg: &ModelConfig, dim: usize, path: ExecutionPath, vb: VarBuilder) -> Result<Self> {
        Self::with_offset(
            dim,
            cfg.rms_norm_eps,
            if cfg.gemma_norms && !cfg.norm_weights_include_one { 1.0 } else { 0.0 },
            path,
            vb,
        )
    }

    fn with_offset(dim: usize, eps: f64, offset: f64, path: ExecutionPath, vb: VarBuilder) -> Result<Self> {
        let act = activation_dtype(vb.dtype(), vb.device());
        let weight = (vb.get(dim, "weight")?.to_dtype(DType::F32)? + offset)?.to_dtype(act)?;
        let host = match path {
            ExecutionPath::FusedCpu => weight.to_vec1::<f32>()?,
            ExecutionPath::Composed => Vec::new(),
        };
        Ok(Self { weight, host, path, eps: eps as f32 })
    }

    /// Bytes of weight one pass reads.
    pub fn size_in_bytes(&self) -> usize {
        self.weight.elem_count() * self.weight.dtype().size_in_bytes()
    }

    /// Normalises the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)?)
    }

    /// `hidden += delta`, then normalises `hidden` into `out` (f32 CPU
    /// buffers): one pass where the fused kernels run.
    pub fn add_forward_into(&self, hidden: &Tensor, delta: &Tensor, out: &Tensor) -> Result<()> {
        match self.path {
            ExecutionPath::FusedCpu => kernels::cpu::add_rms_norm_op(hidden, delta, &self.host, self.eps, out)?,
            ExecutionPath::Composed => {
                kernels::cpu::add_in_place_op(hidden, delta)?;
                self.forward_into(hidden, out)?;
            }
        }
        Ok(())
    }

    /// Normalises `x` into `out` (f32 CPU buffers).
    pub fn forward_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        match self.path {
            ExecutionPath::FusedCpu => kernels::cpu::rms_norm_into_op(x, &self.host, self.eps, out)?,
            ExecutionPath::Composed => kernels::cpu::copy_columns(&self.forward(x)?, 0, out)?,
        }
        Ok(())
    }
}

/// cos/sin tables for every position up to `max_position_embeddings`,
/// `[max_pos, rotary_dim / 2]`: host slices on the fused CPU path (read by
/// the fused in-place kernel), tensors on the composed one.
pub enum RotaryEmbedding {
    Host { cos: Vec<f32>, sin: Vec<f32> },
    Device { cos: Tensor, sin: Tensor },
}

impl RotaryEmbedding {
    pub fn new(
        cfg: &ModelConfig,
        max_positions: usize,
        dtype: DType,
        device: &Device,
        path: ExecutionPath,
    ) -> Result<Self> {
        let (cos, sin) = rope_tables(cfg, max_positions);
        let half = cos.len() / max_positions.max(1);
        if path == ExecutionPath::FusedCpu {
            return Ok(Self::Host { cos, sin });
        }
        let cos = Tensor::from_vec(cos, (max_positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), device)?.to_dtype(dtype)?;
        Ok(Self::Device { cos, sin })
    }
}

/// cos and sin of every position's angle for every rotation pair,
/// `[max_positions, rotary_dim / 2]` in f32: the tables every device's RoPE
/// reads (the CPU's, candle's, the Metal step plan's).
pub fn rope_tables(cfg: &ModelConfig, max_positions: usize) -> (Vec<f32>, Vec<f32>) {
    let inv_freq = cfg.rope_inv_freq();
    // YaRN scales q·k through cos and sin, as transformers does.
    let scale = cfg.rope_attention_factor();
    let mut cos = Vec::with_capacity(max_positions * inv_freq.len());
    let mut sin = Vec::with_capacity(max_positions * inv_freq.len());
    for pos in 0..max_positions {
        for &f in &inv_freq {
            let angle = pos as f64 * f;
            cos.push((angle.cos() * scale) as f32);
            sin.push((angle.sin() * scale) as f32);
        }
    }
    (cos, sin)
}

/// A CPU step's rotation: the host tables and each row's position.
pub struct HostRope<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// `[T]`, each row's absolute position.
    pub positions: &'a [u32],
}

/// Applies HF's `rotate_half` RoPE to the first `2 * cos.dim(1)` dims of
/// each head of x: [T, heads, head_dim] (the rest pass through).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (rotary_dim, head_dim) = (2 * cos.dim(1)?, x.dim(2)?);
    let rotated = x.narrow(2, 0, rotary_dim)?.unsqueeze(0)?.contiguous()?; // [1, T, heads, rotary_dim]
    let rotated = candle_nn::rotary_emb::rope_thd(&rotated, cos, sin)?.squeeze(0)?;
    if rotary_dim == head_dim {
        return Ok(rotated);
    }
    Ok(Tensor::cat(&[&rotated, &x.narrow(2, rotary_dim, head_dim - rotary_dim)?], 2)?)
}

/// Linear layers that read the same input, stacked into one when their
/// weights allow (q/k/v, gate/up); the output is always their outputs side
/// by side, `[T, out_a + out_b + …]`.
enum Projection {
    Stacked(Linear),
    Separate(Vec<Linear>),
}

impl Projection {
    fn new(parts: Vec<Linear>) -> Result<Self> {
        Ok(match Linear::stack(parts)? {
            Ok(stacked) => Self::Stacked(stacked),
            Err(parts) => Self::Separate(parts),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Stacked(l) => l.forward(x)?,
            Self::Separate(parts) => {
                let outs = parts.iter().map(|l| l.forward(x)).collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&outs, 1)?
            }
        })
    }

    /// As `forward`, into `out` (f32, on the CPU).
    fn forward_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        match self {
            Self::Stacked(l) => l.forward_into(x, out)?,
            // Parts that could not be stacked (mixed formats): computed apart.
            Self::Separate(_) => {
                let y = self.forward(x)?.to_dtype(DType::F32)?;
                kernels::cpu::copy_columns(&y, 0, out)?;
            }
        }
        Ok(())
    }

    fn size_in_bytes(&self) -> usize {
        match self {
            Self::Stacked(l) => l.size_in_bytes(),
            Self::Separate(parts) => parts.iter().map(Linear::size_in_bytes).sum(),
        }
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Self::Stacked(l) => vec![l],
            Self::Separate(parts) => parts.iter_mut().collect(),
        }
    }
}

/// Attention with grouped key/value heads (GQA) over the paged KV cache.
pub struct Attention {
    /// q, k and v projections: `[T, (heads + 2 kv_heads) * head_dim]`.
    qkv_proj: Projection,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    scale: f32,
    /// gpt-oss: each head's sink logit, `[heads]`.
    sinks: Option<Vec<f32>>,
}

impl Attention {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized, path: ExecutionPath) -> Result<Self> {
        let (h, q_dim, kv_dim) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(RmsNorm::of_model(cfg, cfg.head_dim, path, vb.pp("q_norm"))?),
                Some(RmsNorm::of_model(cfg, cfg.head_dim, path, vb.pp("k_norm"))?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            qkv_proj: Projection::new(vec![
                linear(h, q_dim, cfg.qkv_bias, vb.pp("q_proj"), pre)?,
                linear(h, kv_dim, cfg.qkv_bias, vb.pp("k_proj"), pre)?,
                linear(h, kv_dim, cfg.qkv_bias, vb.pp("v_proj"), pre)?,
            ])?,
            o_proj: linear(q_dim, h, cfg.o_bias, vb.pp("o_proj"), pre)?,
            q_norm,
            k_norm,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            rotary_dim: cfg.rotary_dim,
            scale: (1.0 / cfg.query_pre_attn_scalar.sqrt()) as f32,
            sinks: match cfg.attention_sinks {
                true => Some(vb.get(cfg.num_heads, "sinks")?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
                false => None,
            },
        })
    }

    /// Its linear layers: the q/k/v projection (one, or three where they
    /// could not be stacked), then o_proj.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears = self.qkv_proj.linears_mut();
        linears.push(&mut self.o_proj);
        linears
    }

    /// Bytes of weight one pass reads.
    pub fn size_in_bytes(&self) -> usize {
        let norms = self.q_norm.iter().chain(&self.k_norm).map(RmsNorm::size_in_bytes).sum::<usize>();
        let sinks = self.sinks.as_ref().map_or(0, |s| std::mem::size_of_val(s.as_slice()));
        norms + sinks + self.qkv_proj.size_in_bytes() + self.o_proj.size_in_bytes()
    }

    /// The composed step (GPUs): candle ops and the device's kernels.
    pub fn forward(
        &self,
        x: &Tensor,   // [T, hidden]
        cos: &Tensor, // [T, rotary_dim / 2], this step's rows
        sin: &Tensor,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. Project: one [T, (H + 2 KVH) * D] output, q then k then v.
        let qkv = self.qkv_proj.forward(x)?;
        // 2. Rotate q and k by absolute position (Qwen3 normalises each head first).
        let q = qkv.narrow(1, 0, h * d)?.reshape((t, h, d))?;
        let k = qkv.narrow(1, h * d, kvh * d)?.reshape((t, kvh, d))?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k)?,
            None => k,
        };
        let (q, k) = (apply_rope(&q, cos, sin)?, apply_rope(&k, cos, sin)?);
        let v = qkv.narrow(1, (h + kvh) * d, kvh * d)?.reshape((t, kvh, d))?;
        // 3. One batched write of this step's K/V into their slots, then
        //    attention over each sequence's blocks (cached prefix + new).
        let out = {
            let _t = crate::profile::scope(crate::profile::Section::Attention);
            kernels::reshape_and_cache(&kv.write(&k, &v, meta))?;
            kernels::paged_attention(&kv.attention(&q, meta, self.scale, self.sinks.as_deref()))? // [T, H, D]
        };
        Ok(self.o_proj.forward(&out.reshape((t, h * d))?)?)
    }
}

impl Attention {
    /// RoPE of the q and k heads of a fused qkv row, with Qwen3's head norm.
    fn host_rope<'a>(&'a self, rope: &HostRope<'a>) -> kernels::cpu::Rope<'a> {
        let HostRope { cos, sin, positions } = *rope;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // The fused path's norms hold their host weights (`RmsNorm::new`).
        let head_norm = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => {
                debug_assert!(qn.path == ExecutionPath::FusedCpu && kn.path == ExecutionPath::FusedCpu);
                Some(kernels::cpu::HeadNorm { q_heads: h, q_weight: &qn.host, k_weight: &kn.host, eps: qn.eps })
            }
            _ => None,
        };
        let row_len = (h + 2 * kvh) * d;
        let rotary_dim = self.rotary_dim;
        kernels::cpu::Rope { head_dim: d, rotary_dim, heads: h + kvh, row_len, positions, cos, sin, head_norm }
    }

    /// The CPU step in the workspace: `b.normed` -> `b.proj`.
    pub fn forward_cpu(&self, b: &Buffers, rope: &HostRope, kv: &LayerKvCache, meta: &AttentionMetadata) -> Result<()> {
        let t = b.qkv.dim(0)?;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        self.qkv_proj.forward_into(&b.normed, &b.qkv)?;
        kernels::cpu::rope_in_place_op(&b.qkv, self.host_rope(rope))?;
        kernels::cpu::copy_columns(&b.qkv, 0, &b.q)?;
        kernels::cpu::copy_columns(&b.qkv, h * d, &b.k)?;
        kernels::cpu::copy_columns(&b.qkv, (h + kvh) * d, &b.v)?;
        {
            let _t = crate::profile::scope(crate::profile::Section::Attention);
            let (k, v) = (b.k.reshape((t, kvh, d))?, b.v.reshape((t, kvh, d))?);
            kernels::reshape_and_cache(&kv.write(&k, &v, meta))?;
            let (q, out) = (b.q.reshape((t, h, d))?, b.attn.reshape((t, h, d))?);
            let attention = kv.attention(&q, meta, self.scale, self.sinks.as_deref());
            kernels::cpu::paged_attention_into(&attention, &out)?;
        }
        self.o_proj.forward_into(&b.attn, &b.proj)?;
        Ok(())
    }
}

/// The gated MLP: `down(act(gate(x)) * up(x))`, SwiGLU or GeGLU (or
/// gpt-oss's clamped SwiGLU).
pub struct Mlp {
    /// gate and up projections: `[T, 2 * intermediate]`.
    gate_up_proj: Projection,
    down_proj: Linear,
    intermediate: usize,
    gate: Gate,
}

impl Mlp {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let dims = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Self::with_names(cfg, dims, vb, pre, ["gate_proj", "up_proj", "down_proj"])
    }

    /// An MLP of `cfg`'s activation, `hidden -> intermediate -> hidden`
    /// (with biases or not), whose gate, up and down projections are named
    /// `names` under `vb`.
    pub fn with_names(
        cfg: &ModelConfig,
        (h, i, bias): (usize, usize, bool),
        vb: VarBuilder,
        pre: &Prequantized,
        [gate, up, down]: [&str; 3],
    ) -> Result<Self> {
        let parts = [linear(h, i, bias, vb.pp(gate), pre)?, linear(h, i, bias, vb.pp(up), pre)?];
        Self::from_linears(cfg.activation, parts, linear(i, h, bias, vb.pp(down), pre)?)
    }

    /// An MLP of `activation` over its gate and up projections (`[I, H]`
    /// each) and down projection (`[H, I]`).
    pub fn from_linears(activation: Activation, [gate, up]: [Linear; 2], down: Linear) -> Result<Self> {
        let intermediate = down.dims()?.1;
        let gate_fn = gate_of(activation);
        Ok(Self { gate_up_proj: Projection::new(vec![gate, up])?, down_proj: down, intermediate, gate: gate_fn })
    }

    /// Its linear layers: gate/up (one, or two where they could not be
    /// stacked), then down_proj.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears = self.gate_up_proj.linears_mut();
        linears.push(&mut self.down_proj);
        linears
    }

    /// Bytes of weight one pass reads.
    pub fn size_in_bytes(&self) -> usize {
        self.gate_up_proj.size_in_bytes() + self.down_proj.size_in_bytes()
    }

    /// The composed step (GPUs).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate_up = self.gate_up_proj.forward(x)?; // [T, 2 * I]
        let i = self.intermediate;
        let gate = gate_up.narrow(1, 0, i)?;
        let up = gate_up.narrow(1, i, i)?;
        let act = match self.gate {
            Gate::Silu => (candle_nn::ops::silu(&gate)? * up)?,
            // candle's `gelu` is the tanh approximation.
            Gate::GeluTanh => (gate.gelu()? * up)?,
            Gate::ClampedSwiglu { limit } => {
                let (limit, alpha) = (f64::from(limit), 1.702);
                let gate = gate.minimum(limit)?;
                let up = up.clamp(-limit, limit)?;
                let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * alpha)?)?)?;
                ((up + 1.0)? * glu)?
            }
        };
        Ok(self.down_proj.forward(&act)?)
    }
}

impl Mlp {
    /// Its stacked gate/up projection, down projection and gate, for the
    /// grouped expert kernels; `None` where gate and up could not be
    /// stacked (different formats).
    pub fn fused_parts(&self) -> Option<(&Linear, &Linear, Gate)> {
        match &self.gate_up_proj {
            Projection::Stacked(gate_up) => Some((gate_up, &self.down_proj, self.gate)),
            Projection::Separate(_) => None,
        }
    }

    /// The CPU step in the workspace: `b.normed` -> `b.proj`.
    pub fn forward_cpu(&self, b: &Buffers) -> Result<()> {
        self.gate_up_proj.forward_into(&b.normed, &b.gate_up)?;
        kernels::cpu::gated_mul_into_op(&b.gate_up, self.gate, &b.act)?;
        self.down_proj.forward_into(&b.act, &b.proj)?;
        Ok(())
    }
}

/// Rows `ids` of the embedding table `[vocab, hidden]` (f32, f16 or bf16
/// on the CPU), widened into `out: [ids.len(), hidden]`.
pub fn embed_into(table: &Tensor, ids: &[u32], out: &Tensor) -> Result<()> {
    use candle_core::{CpuStorage, Storage};
    let (vocab, hidden) = table.dims2()?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(candle_core::Error::Msg(format!("token id {id} is outside the vocabulary of {vocab}")).into());
    }
    let (storage, layout) = table.storage_and_layout();
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(candle_core::Error::Msg("embedding table must be contiguous".into()).into());
    };
    fn gather<T: Copy>(table: &[T], ids: &[u32], hidden: usize, out: &mut [f32], widen: impl Fn(T) -> f32) {
        for (row, &id) in out.chunks_exact_mut(hidden).zip(ids) {
            let src = &table[id as usize * hidden..][..hidden];
            row.iter_mut().zip(src).for_each(|(o, &x)| *o = widen(x));
        }
    }
    kernels::cpu::write_f32(out, &|o| {
        match &*storage {
            Storage::Cpu(CpuStorage::F32(t)) => gather(&t[start..], ids, hidden, o, |x| x),
            Storage::Cpu(CpuStorage::F16(t)) => gather(&t[start..], ids, hidden, o, half::f16::to_f32),
            Storage::Cpu(CpuStorage::BF16(t)) => gather(&t[start..], ids, hidden, o, half::bf16::to_f32),
            _ => candle_core::bail!("embedding table: unsupported {:?} storage", table.dtype()),
        }
        Ok(())
    })?;
    Ok(())
}

/// The kernels' gate of a model's MLP activation.
pub fn gate_of(activation: Activation) -> Gate {
    match activation {
        Activation::Silu => Gate::Silu,
        Activation::GeluTanh => Gate::GeluTanh,
        Activation::ClampedSwiglu { limit } => Gate::ClampedSwiglu { limit },
    }
}
