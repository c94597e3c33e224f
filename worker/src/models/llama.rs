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

/// cos/sin tables for every position up to `max_position_embeddings`.
struct RotaryEmbedding {
    cos: Tensor, // [max_pos, head_dim / 2]
    sin: Tensor, // [max_pos, head_dim / 2]
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
        let cos = Tensor::from_vec(cos, (max_positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), device)?.to_dtype(dtype)?;
        Ok(Self { cos, sin })
    }

    /// The tables at `positions` ([T] u32): ([T, head_dim/2], [T, head_dim/2]).
    fn at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.cos.index_select(positions, 0)?, self.sin.index_select(positions, 0)?))
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
    eps: f32,
}

impl RmsNorm {
    fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let act = activation_dtype(vb.dtype(), vb.device());
        Ok(Self { weight: vb.get(dim, "weight")?.to_dtype(act)?, eps: eps as f32 })
    }

    /// Normalises the last dimension.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)?)
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
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
            q_proj: linear(h, q_dim, cfg.qkv_bias, vb.pp("q_proj"), pre)?,
            k_proj: linear(h, kv_dim, cfg.qkv_bias, vb.pp("k_proj"), pre)?,
            v_proj: linear(h, kv_dim, cfg.qkv_bias, vb.pp("v_proj"), pre)?,
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
        cos: &Tensor,
        sin: &Tensor,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        // 1. Project: q [T, H, D], k/v [T, KVH, D].
        let q = self.q_proj.forward(x)?.reshape((t, self.num_heads, self.head_dim))?;
        let k = self.k_proj.forward(x)?.reshape((t, self.num_kv_heads, self.head_dim))?;
        let v = self.v_proj.forward(x)?.reshape((t, self.num_kv_heads, self.head_dim))?.contiguous()?;
        // 2. Qwen3 normalises each head before RoPE.
        let q = match &self.q_norm {
            Some(n) => n.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k)?,
            None => k,
        };
        // 3. Rotate by absolute position.
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        // 4. One batched write of this step's K/V into their slots, then
        //    attention over each sequence's blocks (cached prefix + new).
        let out = {
            let _t = crate::profile::scope(crate::profile::Section::Attention);
            kernels::reshape_and_cache(&k, &v, &kv.k, &kv.v, &meta.slot_mapping)?;
            kernels::paged_attention(&q, &kv.k, &kv.v, meta, self.scale)? // [T, H, D]
        };
        Ok(self.o_proj.forward(&out.reshape((t, self.num_heads * self.head_dim))?)?)
    }
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: linear(h, i, cfg.mlp_bias, vb.pp("gate_proj"), pre)?,
            up_proj: linear(h, i, cfg.mlp_bias, vb.pp("up_proj"), pre)?,
            down_proj: linear(i, h, cfg.mlp_bias, vb.pp("down_proj"), pre)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        Ok(self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)?)
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
            linears.extend([&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj]);
            linears.extend([&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj]);
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
        let (cos, sin) = self.rotary.at(positions)?;
        let mut x = self.embed_tokens.forward(input_ids)?.to_dtype(self.act)?; // [T, hidden]
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            let residual = &x;
            let h = layer.self_attn.forward(&layer.input_layernorm.forward(&x)?, &cos, &sin, kv, meta)?;
            let x_mid = (residual + h)?;
            let h = layer.mlp.forward(&layer.post_attention_layernorm.forward(&x_mid)?)?;
            x = (x_mid + h)?;
        }
        // Only the rows that sample go through the final norm and lm_head:
        // for a 2,000-token prompt that is 1 row instead of 2,000.
        let x = x.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [S, vocab]
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }
}
