//! The Llama-family decoder (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2,
//! Qwen3) over a paged KV cache, in candle's style: `new(cfg, vb)` with
//! Hugging Face weight names, shape comments, checks once at construction.
//! Its layers live in [`super::layers`].
//!
//! The families differ only in flags of [`ModelConfig`], read from
//! `config.json` (as vLLM's `qwen2.py` and `mistral` reuse `llama.py`):
//! - Llama 2/3, TinyLlama, SmolLM: the base; Llama 3's `rope_scaling`
//!   changes the RoPE frequencies; `attention_bias` / `mlp_bias` add biases;
//! - Mistral: a sliding attention window (`sliding_window`);
//! - Qwen2: a bias on the q/k/v projections (`qkv_bias`);
//! - Qwen3: a per-head RMSNorm of q and k before RoPE (`qk_norm`).
//!
//! Unlike candle-transformers' models, a forward call takes a *flattened*
//! batch: the new tokens of every scheduled sequence concatenated (varlen, no
//! padding), with their positions and the attention metadata that locates
//! each sequence's KV blocks. That is what lets one call mix prompt chunks
//! and decode tokens of many requests (vLLM v1's model runner does the same).

use std::sync::{Mutex, PoisonError};

use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, VarBuilder};
use kernels::AttentionMetadata;

use super::config::ModelConfig;
use super::layers::{Attention, HostRope, Mlp, RmsNorm, RotaryEmbedding, activation_dtype, embed_into};
use super::linear::{Linear, linear};
use super::quant::{Prequantized, Quantization};
use super::workspace::{Buffers, Workspace};
use crate::error::Result;
use crate::runner::kv_cache::LayerKvCache;

/// Pre-norm attention then pre-norm MLP, each added to the residual stream.
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

    /// The composed step (GPUs): `x: [T, hidden]` -> `[T, hidden]`.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor, // [T, head_dim / 2], this step's rows
        sin: &Tensor,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
    ) -> Result<Tensor> {
        let h = self.self_attn.forward(&self.input_layernorm.forward(x)?, cos, sin, kv, meta)?;
        let x = (x + h)?;
        let h = self.mlp.forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((&x + h)?)
    }

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

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears = self.self_attn.linears_mut();
        linears.extend(self.mlp.linears_mut());
        linears
    }

    /// Bytes of weight one pass reads.
    fn size_in_bytes(&self) -> usize {
        self.input_layernorm.size_in_bytes()
            + self.post_attention_layernorm.size_in_bytes()
            + self.self_attn.size_in_bytes()
            + self.mlp.size_in_bytes()
    }
}

/// A causal language model: embeddings, decoder layers, final norm, lm_head.
pub struct CausalLm {
    embed_tokens: Embedding, // [vocab, hidden]
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear, // [vocab, hidden]
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

    /// Every linear layer with a weight of its own, in order: a tied
    /// lm_head shares the embedding table and is left out.
    fn own_linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears: Vec<&mut Linear> = self.layers.iter_mut().flat_map(DecoderLayer::linears_mut).collect();
        if !self.cfg.tie_word_embeddings {
            linears.push(&mut self.lm_head);
        }
        linears
    }

    /// Quantizes every linear layer whose input dimension allows it in
    /// place (a tied lm_head stays; layers that already are quantized stay
    /// as they are). Returns (quantized now, total) layer counts.
    pub fn quantize(&mut self, format: Quantization) -> Result<(usize, usize)> {
        let linears = self.own_linears_mut();
        let total = linears.len();
        let mut quantized = 0;
        for linear in linears {
            quantized += usize::from(linear.quantize(format)?);
        }
        Ok((quantized, total))
    }

    /// Packs every f16/bf16 linear weight for the CPU kernels where that
    /// pays (`Linear::pack`; a tied lm_head stays). Returns how many it packed.
    pub fn pack_weights(&mut self) -> Result<usize> {
        let mut packed = 0;
        for linear in self.own_linears_mut() {
            packed += usize::from(linear.pack()?);
        }
        Ok(packed)
    }

    /// Backs every linear weight with huge pages (on the CPU, where decode
    /// streams them all each step; see `kernels::cpu::back_with_huge_pages`).
    pub fn place_weights_in_huge_pages(&mut self) {
        self.layers.iter_mut().flat_map(DecoderLayer::linears_mut).for_each(|l| l.place_in_huge_pages());
        self.lm_head.place_in_huge_pages();
    }

    /// Bytes of weights one decode step reads: every layer's projections and
    /// norms and the lm_head (of the embedding table, one row per token).
    pub fn weight_bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(DecoderLayer::size_in_bytes).sum();
        self.norm.size_in_bytes() + self.lm_head.size_in_bytes() + layers
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
            x = layer.forward(&x, &cos, &sin, kv, meta)?;
        }
        self.logits(&x, logits_indices)
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
        self.logits(&b.hidden, logits_indices)
    }

    /// The next-token logits of rows `logits_indices` of the last hidden
    /// states `[T, hidden]`, `[S, vocab]` in f32. Only the rows that sample
    /// go through the final norm and lm_head: for a 2,000-token prompt that
    /// is 1 row instead of 2,000.
    fn logits(&self, hidden: &Tensor, logits_indices: &Tensor) -> Result<Tensor> {
        let x = hidden.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?; // [S, vocab]
        Ok(logits.to_dtype(DType::F32)?.contiguous()?)
    }

    /// Rows the CPU step's activation buffers hold (0 before the first step).
    pub fn workspace_rows(&self) -> usize {
        self.workspace.lock().unwrap_or_else(PoisonError::into_inner).capacity()
    }
}
