//! The Llama-family decoder (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2,
//! Qwen3) over a paged KV cache, in candle's style: `new(cfg, vb)` with
//! Hugging Face weight names, shape comments, checks once at construction.
//!
//! Unlike candle-transformers' models, a forward call takes a *flattened*
//! batch: the new tokens of every scheduled sequence concatenated (varlen, no
//! padding), with their positions and the attention metadata that locates
//! each sequence's KV blocks. That is what lets one call mix prompt chunks
//! and decode tokens of many requests (vLLM v1's model runner does the same).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use kernels::AttentionMetadata;

use std::sync::{Mutex, PoisonError};

use super::config::ModelConfig;
use super::linear::{Linear, Prequantized, QuantFormat, linear};
use super::workspace::{Buffers, Workspace};
use crate::error::Result;
use crate::kv_cache::LayerKvCache;

/// cos/sin tables for every position up to `max_position_embeddings`,
/// `[max_pos, head_dim / 2]`: host slices on the CPU (read by the fused
/// in-place kernel), tensors elsewhere.
enum RotaryEmbedding {
    Host { cos: Vec<f32>, sin: Vec<f32> },
    Device { cos: Tensor, sin: Tensor },
}

impl RotaryEmbedding {
    fn new(cfg: &ModelConfig, max_positions: usize, dtype: DType, device: &Device) -> Result<Self> {
        let inv_freq = cfg.rope_inv_freq();
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for &f in &inv_freq {
                let angle = pos as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        if fused_cpu_path(dtype, device) {
            return Ok(Self::Host { cos, sin });
        }
        let cos = Tensor::from_vec(cos, (max_positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), device)?.to_dtype(dtype)?;
        Ok(Self::Device { cos, sin })
    }
}

/// A CPU step's rotation: the host tables and each row's position.
struct HostRope<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    positions: &'a [u32],
}

/// f32 activations on the CPU take the fused kernels (`kernels::cpu`);
/// other devices and dtypes compose candle ops.
fn fused_cpu_path(act: DType, device: &Device) -> bool {
    device.is_cpu() && act == DType::F32
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

/// The dtype activations (and the KV cache) use. On the CPU they stay f32
/// whatever the weights are: the linear layers widen f16/bf16 weights in
/// registers anyway, and f32 activations avoid a conversion around every op.
pub fn activation_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() { DType::F32 } else { weights }
}

/// Applies HF's `rotate_half` RoPE to x: [T, heads, head_dim].
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x = x.unsqueeze(0)?.contiguous()?; // [1, T, heads, head_dim]
    Ok(candle_nn::rotary_emb::rope_thd(&x, cos, sin)?.squeeze(0)?)
}

struct RmsNorm {
    weight: Tensor, // [dim]
    /// The weight as f32 on the host, for the fused CPU kernels.
    host: Option<Vec<f32>>,
    eps: f32,
}

impl RmsNorm {
    fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let act = activation_dtype(vb.dtype(), vb.device());
        let weight = vb.get(dim, "weight")?.to_dtype(act)?;
        let host = if fused_cpu_path(act, vb.device()) { Some(weight.to_vec1::<f32>()?) } else { None };
        Ok(Self { weight, host, eps: eps as f32 })
    }

    /// Normalises the last dimension.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)?)
    }

    /// Normalises `x` into `out` (f32 CPU buffers).
    fn forward_into(&self, x: &Tensor, out: &Tensor) -> Result<()> {
        match &self.host {
            Some(w) => kernels::cpu::rms_norm_into_op(x, w, self.eps, out)?,
            None => kernels::cpu::copy_columns(&self.forward(x)?, 0, out)?,
        }
        Ok(())
    }
}

struct Attention {
    /// q, k and v projections: `[T, (heads + 2 kv_heads) * head_dim]`.
    qkv_proj: Projection,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl Attention {
    fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let (h, q_dim, kv_dim) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(RmsNorm::new(cfg.head_dim, cfg.rms_norm_eps, vb.pp("q_norm"))?),
                Some(RmsNorm::new(cfg.head_dim, cfg.rms_norm_eps, vb.pp("k_norm"))?),
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
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        })
    }

    /// The composed step (GPUs): candle ops and the device's kernels.
    fn forward(
        &self,
        x: &Tensor,   // [T, hidden]
        cos: &Tensor, // [T, head_dim / 2], this step's rows
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
            kernels::reshape_and_cache(&k, &v, &kv.k, &kv.v, &meta.slot_mapping)?;
            kernels::paged_attention(&q, &kv.k, &kv.v, meta, self.scale)? // [T, H, D]
        };
        Ok(self.o_proj.forward(&out.reshape((t, h * d))?)?)
    }
}

impl Attention {
    /// RoPE of the q and k heads of a fused qkv row, with Qwen3's head norm.
    fn host_rope<'a>(&'a self, rope: &HostRope<'a>) -> kernels::cpu::Rope<'a> {
        let HostRope { cos, sin, positions } = *rope;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let head_norm = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => match (&qn.host, &kn.host) {
                (Some(qw), Some(kw)) => {
                    Some(kernels::cpu::HeadNorm { q_heads: h, q_weight: qw, k_weight: kw, eps: qn.eps })
                }
                _ => None,
            },
            _ => None,
        };
        let row_len = (h + 2 * kvh) * d;
        kernels::cpu::Rope { head_dim: d, heads: h + kvh, row_len, positions, cos, sin, head_norm }
    }

    /// The CPU step in the workspace: `b.normed` -> `b.proj`.
    fn forward_cpu(&self, b: &Buffers, rope: &HostRope, kv: &LayerKvCache, meta: &AttentionMetadata) -> Result<()> {
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
            kernels::reshape_and_cache(&k, &v, &kv.k, &kv.v, &meta.slot_mapping)?;
            let (q, out) = (b.q.reshape((t, h, d))?, b.attn.reshape((t, h, d))?);
            kernels::cpu::paged_attention_into(&q, &kv.k, &kv.v, meta, self.scale, &out)?;
        }
        self.o_proj.forward_into(&b.attn, &b.proj)?;
        Ok(())
    }
}

struct Mlp {
    /// gate and up projections: `[T, 2 * intermediate]`.
    gate_up_proj: Projection,
    down_proj: Linear,
    intermediate: usize,
}

impl Mlp {
    fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up_proj: Projection::new(vec![
                linear(h, i, cfg.mlp_bias, vb.pp("gate_proj"), pre)?,
                linear(h, i, cfg.mlp_bias, vb.pp("up_proj"), pre)?,
            ])?,
            down_proj: linear(i, h, cfg.mlp_bias, vb.pp("down_proj"), pre)?,
            intermediate: i,
        })
    }

    /// The composed step (GPUs).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate_up = self.gate_up_proj.forward(x)?; // [T, 2 * I]
        let i = self.intermediate;
        let act = (candle_nn::ops::silu(&gate_up.narrow(1, 0, i)?)? * gate_up.narrow(1, i, i)?)?;
        Ok(self.down_proj.forward(&act)?)
    }
}

impl Mlp {
    /// The CPU step in the workspace: `b.normed` -> `b.proj`.
    fn forward_cpu(&self, b: &Buffers) -> Result<()> {
        self.gate_up_proj.forward_into(&b.normed, &b.gate_up)?;
        kernels::cpu::silu_mul_into_op(&b.gate_up, &b.act)?;
        self.down_proj.forward_into(&b.act, &b.proj)?;
        Ok(())
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"), pre)?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"), pre)?,
        })
    }
}

impl DecoderLayer {
    /// One layer of the CPU step, in place on `b.hidden`.
    fn forward_cpu(&self, b: &Buffers, rope: &HostRope, kv: &LayerKvCache, meta: &AttentionMetadata) -> Result<()> {
        self.input_layernorm.forward_into(&b.hidden, &b.normed)?;
        self.self_attn.forward_cpu(b, rope, kv, meta)?;
        kernels::cpu::add_in_place_op(&b.hidden, &b.proj)?;
        self.post_attention_layernorm.forward_into(&b.hidden, &b.normed)?;
        self.mlp.forward_cpu(b)?;
        kernels::cpu::add_in_place_op(&b.hidden, &b.proj)?;
        Ok(())
    }
}

/// Every linear layer of `layers`, in order.
fn layer_linears(layers: &mut [DecoderLayer]) -> Vec<&mut Linear> {
    let mut linears = Vec::new();
    for layer in layers {
        let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
        linears.extend(a.qkv_proj.linears_mut());
        linears.push(&mut a.o_proj);
        linears.extend(m.gate_up_proj.linears_mut());
        linears.push(&mut m.down_proj);
    }
    linears
}

/// Rows `ids` of the embedding table `[vocab, hidden]` (f32, f16 or bf16
/// on the CPU), widened into `out: [ids.len(), hidden]`.
fn embed_into(table: &Tensor, ids: &[u32], out: &Tensor) -> Result<()> {
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

/// A causal language model: embeddings, decoder layers, final norm, lm_head.
pub struct CausalLm {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: RotaryEmbedding,
    cfg: ModelConfig,
    /// Dtype of activations and of the KV cache.
    act: DType,
    /// Activation buffers of the CPU step.
    workspace: Mutex<Workspace>,
}

impl CausalLm {
    /// Builds the model from weights under Hugging Face names
    /// (`model.layers.N.self_attn.q_proj.weight`, ...). A missing tensor or a
    /// shape mismatch fails here, naming the tensor.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        Self::with_prequantized(cfg, vb, &Prequantized::default())
    }

    /// As [`CausalLm::new`], taking linear weights found in `pre` (already
    /// quantized, from a GGUF file) instead of from `vb`.
    pub fn with_prequantized(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let device = vb.device().clone();
        let act = activation_dtype(vb.dtype(), &device);
        let model = vb.pp("model");
        let embed_weight = model.pp("embed_tokens").get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let embed_tokens = Embedding::new(embed_weight.clone(), cfg.hidden_size);
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::new(cfg, model.pp(format!("layers.{i}")), pre))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, model.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_weight, None)?
        } else {
            linear(cfg.hidden_size, cfg.vocab_size, false, vb.pp("lm_head"), pre)?
        };
        let rotary = RotaryEmbedding::new(cfg, cfg.max_position_embeddings, act, &device)?;
        let workspace = Mutex::new(Workspace::default());
        Ok(Self { embed_tokens, layers, norm, lm_head, rotary, cfg: cfg.clone(), act, workspace })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Quantizes every linear layer whose input dimension allows it in
    /// place (a tied lm_head shares the embedding table and stays; layers
    /// that already are quantized stay as they are). Returns (quantized now,
    /// total) layer counts.
    pub fn quantize(&mut self, format: QuantFormat) -> Result<(usize, usize)> {
        let mut linears = layer_linears(&mut self.layers);
        if !self.cfg.tie_word_embeddings {
            linears.push(&mut self.lm_head);
        }
        let total = linears.len();
        let mut quantized = 0;
        for linear in linears {
            quantized += usize::from(linear.quantize(format)?);
        }
        Ok((quantized, total))
    }

    /// Packs every f16/bf16 linear weight for the CPU kernels where that
    /// pays (`Linear::pack`; a tied lm_head shares the embedding table and
    /// stays). Returns how many it packed.
    pub fn pack_weights(&mut self) -> Result<usize> {
        let mut linears = layer_linears(&mut self.layers);
        if !self.cfg.tie_word_embeddings {
            linears.push(&mut self.lm_head);
        }
        let mut packed = 0;
        for linear in linears {
            packed += usize::from(linear.pack()?);
        }
        Ok(packed)
    }

    /// Backs every linear weight with huge pages (on the CPU, where decode
    /// streams them all each step; see `kernels::cpu::back_with_huge_pages`).
    pub fn place_weights_in_huge_pages(&mut self) {
        layer_linears(&mut self.layers).into_iter().for_each(|l| l.place_in_huge_pages());
        self.lm_head.place_in_huge_pages();
    }

    /// Bytes of weights one decode step reads: every layer's projections and
    /// norms and the lm_head (of the embedding table, one row per token).
    pub fn weight_bytes_per_token(&self) -> usize {
        let norm = |n: &RmsNorm| n.weight.elem_count() * n.weight.dtype().size_in_bytes();
        let mut bytes = norm(&self.norm) + self.lm_head.size_in_bytes();
        for layer in &self.layers {
            bytes += norm(&layer.input_layernorm) + norm(&layer.post_attention_layernorm);
            bytes += layer.self_attn.q_norm.as_ref().map_or(0, norm) + layer.self_attn.k_norm.as_ref().map_or(0, norm);
            let (a, m) = (&layer.self_attn, &layer.mlp);
            bytes += a.qkv_proj.size_in_bytes() + m.gate_up_proj.size_in_bytes();
            bytes += a.o_proj.size_in_bytes() + m.down_proj.size_in_bytes();
        }
        bytes
    }

    /// Dtype of activations, and so of the KV cache this model needs.
    pub fn activation_dtype(&self) -> DType {
        self.act
    }

    /// One step over a flattened batch.
    ///
    /// * `input_ids`, `positions`: [T] u32, the new tokens of all sequences;
    /// * `kv_caches`: one block pool per layer;
    /// * `meta`: where each sequence's queries, context and slots are;
    /// * `logits_indices`: [S] u32, rows of T whose next-token logits are
    ///   wanted (the last new token of each sequence that will sample).
    ///
    /// Returns the logits of those rows, [S, vocab] in f32.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        kv_caches: &[LayerKvCache],
        meta: &AttentionMetadata,
        logits_indices: &Tensor,
    ) -> Result<Tensor> {
        let (cos, sin) = match &self.rotary {
            RotaryEmbedding::Host { cos, sin } => {
                let positions = positions.to_vec1::<u32>()?;
                let rope = HostRope { cos, sin, positions: &positions };
                return self.forward_cpu(input_ids, &rope, kv_caches, meta, logits_indices);
            }
            RotaryEmbedding::Device { cos, sin } => (cos.index_select(positions, 0)?, sin.index_select(positions, 0)?),
        };
        let mut x = self.embed_tokens.forward(input_ids)?.to_dtype(self.act)?; // [T, hidden]
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            let h = layer.self_attn.forward(&layer.input_layernorm.forward(&x)?, &cos, &sin, kv, meta)?;
            let x_mid = (&x + h)?;
            let h = layer.mlp.forward(&layer.post_attention_layernorm.forward(&x_mid)?)?;
            x = (&x_mid + h)?;
        }
        // Only the rows that sample go through the final norm and lm_head:
        // for a 2,000-token prompt that is 1 row instead of 2,000.
        let x = x.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [S, vocab]
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }

    /// The CPU step (f32 activations): every activation lives in the
    /// workspace's buffers, reused across layers and steps, so a step
    /// allocates only its `[S, vocab]` logits and small per-row vectors.
    fn forward_cpu(
        &self,
        input_ids: &Tensor,
        rope: &HostRope,
        kv_caches: &[LayerKvCache],
        meta: &AttentionMetadata,
        logits_indices: &Tensor,
    ) -> Result<Tensor> {
        let ids = input_ids.to_vec1::<u32>()?;
        // A panic elsewhere cannot leave the buffers half-valid in a way that
        // matters: every step overwrites what it reads.
        let mut workspace = self.workspace.lock().unwrap_or_else(PoisonError::into_inner);
        let b = workspace.rows(ids.len(), &self.cfg)?;
        embed_into(self.embed_tokens.embeddings(), &ids, &b.hidden)?;
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            layer.forward_cpu(&b, rope, kv, meta)?;
        }
        // Only the rows that sample go through the final norm and lm_head.
        let x = b.hidden.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [S, vocab]
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }

    /// Rows the CPU step's activation buffers hold (0 before the first step).
    pub fn workspace_rows(&self) -> usize {
        self.workspace.lock().unwrap_or_else(PoisonError::into_inner).capacity()
    }
}
