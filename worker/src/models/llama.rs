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
use super::format::Quantization;
use super::layers::{Attention, ExecutionPath, HostRope, RmsNorm, RotaryEmbedding, activation_dtype, embed_into};
use super::linear::Prequantized;
use super::linear::{Linear, linear};
use super::moe::FeedForward;
use super::workspace::{Buffers, Workspace};
use crate::error::{Result, WorkerError};
use crate::runner::kv_cache::LayerKvCache;
use common::pipeline::LayerRange;

/// What a pipeline stage starts from.
pub enum StageInput<'a> {
    /// `[T]` u32 token ids: the first stage embeds them.
    Tokens(&'a Tensor),
    /// `[T, hidden]`: the previous stage's output.
    Hidden(&'a Tensor),
}

/// What a pipeline stage ends with.
pub enum StageOutput {
    /// `[S, vocab]` f32: the last stage's logits of the wanted rows.
    Logits(Tensor),
    /// `[T, hidden]` in the activation dtype, for the next stage.
    Hidden(Tensor),
}

/// Pre-norm attention then pre-norm MLP, each added to the residual stream.
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
}

impl DecoderLayer {
    fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder, pre: &Prequantized, path: ExecutionPath) -> Result<Self> {
        let norm = |name: &str| RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, path, vb.pp(name));
        let mlp = FeedForward::new(cfg, layer, &vb, pre)?;
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"), pre, path)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            mlp,
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

    /// One layer of the CPU step, in place on `b.hidden`, with `b.normed`
    /// holding this layer's input norm of it; the residual add at the end
    /// goes with the next layer's input norm (`next`) where there is one.
    fn forward_cpu(
        &self,
        b: &Buffers,
        rope: &HostRope,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
        next: Option<&RmsNorm>,
    ) -> Result<()> {
        self.self_attn.forward_cpu(b, rope, kv, meta)?;
        self.post_attention_layernorm.add_forward_into(&b.hidden, &b.proj, &b.normed)?;
        self.mlp.forward_cpu(b)?;
        match next {
            Some(norm) => norm.add_forward_into(&b.hidden, &b.proj, &b.normed)?,
            None => kernels::cpu::add_in_place_op(&b.hidden, &b.proj)?,
        }
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
/// A pipeline stage holds only its range of layers: the embeddings on the
/// first stage, the final norm and lm_head on the last.
pub struct CausalLm {
    embed_tokens: Option<Embedding>, // [vocab, hidden]
    layers: Vec<DecoderLayer>,
    /// The final norm and lm_head (`[vocab, hidden]`), on the last stage.
    head: Option<(RmsNorm, Linear)>,
    range: LayerRange,
    /// Fused CPU kernels or composed ops, chosen at construction.
    path: ExecutionPath,
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
        Self::stage(cfg, vb, pre, LayerRange::full(cfg.num_layers))
    }

    /// The pipeline stage holding decoder layers `range`: only their
    /// tensors are read from `vb` (plus the embeddings on the first stage,
    /// the final norm and lm_head on the last; with tied embeddings the
    /// last stage reads the embedding table as its lm_head).
    pub fn stage(cfg: &ModelConfig, vb: VarBuilder, pre: &Prequantized, range: LayerRange) -> Result<Self> {
        if range.total != cfg.num_layers || range.is_empty() || range.end > range.total {
            return Err(WorkerError::Unsupported(format!(
                "layers {range} of a model with {} layers (each stage needs at least one)",
                cfg.num_layers
            )));
        }
        let device = vb.device().clone();
        let act = activation_dtype(vb.dtype(), &device);
        let path = ExecutionPath::of(act, &device);
        let model = vb.pp("model");
        let embed_weight = || model.pp("embed_tokens").get((cfg.vocab_size, cfg.hidden_size), "weight");
        let embed_tokens = if range.is_first() { Some(Embedding::new(embed_weight()?, cfg.hidden_size)) } else { None };
        let layers = (range.start..range.end)
            .map(|i| DecoderLayer::new(cfg, i, model.pp(format!("layers.{i}")), pre, path))
            .collect::<Result<Vec<_>>>()?;
        let head = if range.is_last() {
            let norm = RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, path, model.pp("norm"))?;
            let lm_head = match (&embed_tokens, cfg.tie_word_embeddings) {
                (Some(embed), true) => Linear::new(embed.embeddings().clone(), None)?,
                (None, true) => Linear::new(embed_weight()?, None)?,
                (_, false) => linear(cfg.hidden_size, cfg.vocab_size, false, vb.pp("lm_head"), pre)?,
            };
            Some((norm, lm_head))
        } else {
            None
        };
        let rotary = RotaryEmbedding::new(cfg, cfg.max_position_embeddings, act, &device, path)?;
        let workspace = Mutex::new(Workspace::default());
        Ok(Self { embed_tokens, layers, head, range, path, rotary, cfg: cfg.clone(), act, workspace })
    }

    /// The decoder layers this model (or pipeline stage) holds.
    pub fn layer_range(&self) -> LayerRange {
        self.range
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Every linear layer with a weight of its own, in order: a tied
    /// lm_head shares the embedding table and is left out.
    fn own_linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears: Vec<&mut Linear> = self.layers.iter_mut().flat_map(DecoderLayer::linears_mut).collect();
        if let Some((_, lm_head)) = self.head.as_mut().filter(|_| !self.cfg.tie_word_embeddings) {
            linears.push(lm_head);
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
        if let Some((_, lm_head)) = &mut self.head {
            lm_head.place_in_huge_pages();
        }
    }

    /// Bytes of weights one decode step reads: every layer's projections and
    /// norms and the lm_head (of the embedding table, one row per token).
    pub fn weight_bytes_per_token(&self) -> usize {
        let layers: usize = self.layers.iter().map(DecoderLayer::size_in_bytes).sum();
        let head = self.head.as_ref().map_or(0, |(norm, lm_head)| norm.size_in_bytes() + lm_head.size_in_bytes());
        head + layers
    }

    /// Bytes of weights this model (or stage) holds: what
    /// `weight_bytes_per_token` streams, plus an embedding table not shared
    /// with the lm_head.
    pub fn resident_weight_bytes(&self) -> usize {
        let embed = self
            .embed_tokens
            .as_ref()
            .map_or(0, |e| e.embeddings().elem_count() * e.embeddings().dtype().size_in_bytes());
        let shared = self.cfg.tie_word_embeddings && self.range.is_full();
        self.weight_bytes_per_token() + if shared { 0 } else { embed }
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
        match self.forward_stage(StageInput::Tokens(input_ids), positions, kv_caches, meta, logits_indices)? {
            StageOutput::Logits(logits) => Ok(logits),
            StageOutput::Hidden(_) => Err(WorkerError::Unsupported(format!(
                "layers {} are not the whole model: run them as a pipeline stage",
                self.range
            ))),
        }
    }

    /// One step of this pipeline stage: from token ids (first stage) or the
    /// previous stage's hidden states `[T, hidden]`, through this stage's
    /// layers, to the logits of `logits_indices` (last stage) or the hidden
    /// states `[T, hidden]` in the activation dtype for the next stage.
    pub fn forward_stage(
        &self,
        input: StageInput,
        positions: &Tensor,
        kv_caches: &[LayerKvCache],
        meta: &AttentionMetadata,
        logits_indices: &Tensor,
    ) -> Result<StageOutput> {
        let (cos, sin) = match (self.path, &self.rotary) {
            (ExecutionPath::FusedCpu, RotaryEmbedding::Host { cos, sin }) => {
                let positions = positions.to_vec1::<u32>()?;
                let rope = HostRope { cos, sin, positions: &positions };
                return self.forward_cpu(input, &rope, kv_caches, meta, logits_indices);
            }
            (ExecutionPath::Composed, RotaryEmbedding::Device { cos, sin }) => {
                (cos.index_select(positions, 0)?, sin.index_select(positions, 0)?)
            }
            _ => unreachable!("RotaryEmbedding::new builds the tables of the model's path"),
        };
        let mut x = match (input, &self.embed_tokens) {
            (StageInput::Tokens(ids), Some(embed)) => embed.forward(ids)?.to_dtype(self.act)?, // [T, hidden]
            (StageInput::Hidden(hidden), None) => hidden.to_dtype(self.act)?,
            _ => return Err(self.wrong_input()),
        };
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            x = layer.forward(&x, &cos, &sin, kv, meta)?;
        }
        self.stage_output(&x, logits_indices)
    }

    /// The CPU step (f32 activations): every activation lives in the
    /// workspace's buffers, reused across layers and steps, so a step
    /// allocates only its `[S, vocab]` logits and small per-row vectors
    /// (and, on a pipeline stage, the hidden states it hands on).
    fn forward_cpu(
        &self,
        input: StageInput,
        rope: &HostRope,
        kv_caches: &[LayerKvCache],
        meta: &AttentionMetadata,
        logits_indices: &Tensor,
    ) -> Result<StageOutput> {
        // A panic elsewhere cannot leave the buffers half-valid in a way that
        // matters: every step overwrites what it reads.
        let mut workspace = self.workspace.lock().unwrap_or_else(PoisonError::into_inner);
        let _awake = kernels::cpu::PoolAwake::new();
        let b = workspace.rows(rope.positions.len(), &self.cfg)?;
        match (input, &self.embed_tokens) {
            (StageInput::Tokens(input_ids), Some(embed)) => {
                embed_into(embed.embeddings(), &input_ids.to_vec1::<u32>()?, &b.hidden)?;
            }
            (StageInput::Hidden(hidden), None) => {
                let values = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                kernels::cpu::write_f32(&b.hidden, &|out| {
                    if out.len() != values.len() {
                        candle_core::bail!("hidden states of {} values for {} rows", values.len(), b.hidden.dims()[0]);
                    }
                    out.copy_from_slice(&values);
                    Ok(())
                })?;
            }
            _ => return Err(self.wrong_input()),
        }
        if let Some(first) = self.layers.first() {
            first.input_layernorm.forward_into(&b.hidden, &b.normed)?;
        }
        for (i, (layer, kv)) in self.layers.iter().zip(kv_caches).enumerate() {
            let next = self.layers.get(i + 1).map(|l| &l.input_layernorm);
            layer.forward_cpu(&b, rope, kv, meta, next)?;
        }
        self.stage_output(&b.hidden, logits_indices)
    }

    /// The last stage's logits of rows `logits_indices` of the last hidden
    /// states `[T, hidden]`, `[S, vocab]` in f32 (only the rows that sample
    /// go through the final norm and lm_head: for a 2,000-token prompt that
    /// is 1 row instead of 2,000); any other stage's hidden states, copied
    /// out of the workspace.
    fn stage_output(&self, hidden: &Tensor, logits_indices: &Tensor) -> Result<StageOutput> {
        let Some((norm, lm_head)) = &self.head else { return Ok(StageOutput::Hidden(hidden.copy()?)) };
        let x = hidden.index_select(logits_indices, 0)?; // [S, hidden]
        let logits = lm_head.forward(&norm.forward(&x)?)?; // [S, vocab]
        Ok(StageOutput::Logits(logits.to_dtype(DType::F32)?.contiguous()?))
    }

    fn wrong_input(&self) -> WorkerError {
        let wanted = if self.range.is_first() { "token ids" } else { "hidden states" };
        WorkerError::Unsupported(format!("layers {} take {wanted} as input", self.range))
    }

    /// Rows the CPU step's activation buffers hold (0 before the first step).
    pub fn workspace_rows(&self) -> usize {
        self.workspace.lock().unwrap_or_else(PoisonError::into_inner).capacity()
    }
}
