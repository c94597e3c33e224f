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

use super::config::ModelConfig;
use super::linear::{Linear, Prequantized, QuantFormat, linear};
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

/// Where the rotation of a step comes from: host tables and positions for
/// the fused CPU kernel, or the step's gathered table rows for candle's op.
enum StepRope<'a> {
    Host { cos: &'a [f32], sin: &'a [f32], positions: Vec<u32> },
    Device { cos: Tensor, sin: Tensor }, // [T, head_dim / 2] each
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

    fn for_each_linear(&self, f: impl Fn(&Linear)) {
        match self {
            Self::Stacked(l) => f(l),
            Self::Separate(parts) => parts.iter().for_each(f),
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

/// `residual + h`; on the CPU added into `h` (a fresh layer output that
/// nothing else holds) instead of into a new buffer.
fn residual_add(h: Tensor, residual: &Tensor, fused: bool) -> Result<Tensor> {
    if fused {
        kernels::cpu::add_in_place_op(&h, residual)?;
        Ok(h)
    } else {
        Ok((residual + h)?)
    }
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

    fn forward(
        &self,
        x: &Tensor, // [T, hidden]
        rope: &StepRope,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // 1. Project: one [T, (H + 2 KVH) * D] output, q then k then v.
        let qkv = self.qkv_proj.forward(x)?;
        // 2. Rotate q and k by absolute position (Qwen3 normalises each head
        //    first): in place in the qkv buffer on the CPU.
        let (q, k) = match rope {
            StepRope::Host { cos, sin, positions } => {
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
                let rope = kernels::cpu::Rope { head_dim: d, heads: h + kvh, row_len, positions, cos, sin, head_norm };
                kernels::cpu::rope_in_place_op(&qkv, rope)?;
                (qkv.narrow(1, 0, h * d)?.reshape((t, h, d))?, qkv.narrow(1, h * d, kvh * d)?.reshape((t, kvh, d))?)
            }
            StepRope::Device { cos, sin } => {
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
                (apply_rope(&q, cos, sin)?, apply_rope(&k, cos, sin)?)
            }
        };
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

    fn forward(&self, x: &Tensor, fused: bool) -> Result<Tensor> {
        let gate_up = self.gate_up_proj.forward(x)?; // [T, 2 * I]
        let act = if fused {
            kernels::cpu::silu_mul_op(&gate_up)? // SwiGLU in one pass
        } else {
            let i = self.intermediate;
            (candle_nn::ops::silu(&gate_up.narrow(1, 0, i)?)? * gate_up.narrow(1, i, i)?)?
        };
        Ok(self.down_proj.forward(&act)?)
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
        Ok(Self { embed_tokens, layers, norm, lm_head, rotary, cfg: cfg.clone(), act })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Quantizes every linear layer whose input dimension allows it in
    /// place (a tied lm_head shares the embedding table and stays; layers
    /// that already are quantized stay as they are). Returns (quantized now,
    /// total) layer counts.
    pub fn quantize(&mut self, format: QuantFormat) -> Result<(usize, usize)> {
        let mut linears: Vec<&mut Linear> = Vec::new();
        for layer in &mut self.layers {
            let (a, m) = (&mut layer.self_attn, &mut layer.mlp);
            linears.extend(a.qkv_proj.linears_mut());
            linears.push(&mut a.o_proj);
            linears.extend(m.gate_up_proj.linears_mut());
            linears.push(&mut m.down_proj);
        }
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

    /// Backs every linear weight with huge pages (on the CPU, where decode
    /// streams them all each step; see `placement`).
    pub fn place_weights_in_huge_pages(&self) {
        for layer in &self.layers {
            let (a, m) = (&layer.self_attn, &layer.mlp);
            a.qkv_proj.for_each_linear(|l| l.place_in_huge_pages());
            m.gate_up_proj.for_each_linear(|l| l.place_in_huge_pages());
            a.o_proj.place_in_huge_pages();
            m.down_proj.place_in_huge_pages();
        }
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
        let fused = fused_cpu_path(self.act, positions.device());
        let rope = match &self.rotary {
            RotaryEmbedding::Host { cos, sin } => StepRope::Host { cos, sin, positions: positions.to_vec1::<u32>()? },
            RotaryEmbedding::Device { cos, sin } => {
                StepRope::Device { cos: cos.index_select(positions, 0)?, sin: sin.index_select(positions, 0)? }
            }
        };
        let mut x = self.embed_tokens.forward(input_ids)?.to_dtype(self.act)?; // [T, hidden]
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            let h = layer.self_attn.forward(&layer.input_layernorm.forward(&x)?, &rope, kv, meta)?;
            let x_mid = residual_add(h, &x, fused)?;
            let h = layer.mlp.forward(&layer.post_attention_layernorm.forward(&x_mid)?, fused)?;
            x = residual_add(h, &x_mid, fused)?;
        }
        // Only the rows that sample go through the final norm and lm_head:
        // for a 2,000-token prompt that is 1 row instead of 2,000.
        let x = x.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [S, vocab]
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }
}
