//! The Llama-family decoder (Llama 2/3, TinyLlama, SmolLM, Mistral, Qwen2,
//! Qwen3, the mixtures of experts, Gemma 3) over a paged KV cache, in
//! candle's style: `new(cfg, vb)` with Hugging Face weight names, shape
//! comments, checks once at construction. Its layers live in
//! [`super::decoder`], [`super::layers`] and [`super::moe`].
//!
//! The families differ only in flags of [`ModelConfig`], read from
//! `config.json` (as vLLM's `qwen2.py` and `mistral` reuse `llama.py`):
//! - Llama 2/3, TinyLlama, SmolLM: the base; Llama 3's `rope_scaling`
//!   changes the RoPE frequencies; `attention_bias` / `mlp_bias` add biases;
//! - Mistral: a sliding attention window (`sliding_window`);
//! - Qwen2: a bias on the q/k/v projections (`qkv_bias`);
//! - Qwen3: a per-head RMSNorm of q and k before RoPE (`qk_norm`);
//! - Mixtral, Qwen3-MoE, GLM-4.5: mixtures of experts (`moe`), GLM with
//!   partial rotary (`rotary_dim`);
//! - Gemma 3: `(1 + w)` norms around each sublayer, GeGLU, scaled
//!   embeddings, sliding and global layers with their own RoPE tables.
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
use super::decoder::{DecoderLayer, LayerWindows};
use super::format::Quantization;
use super::layers::{ExecutionPath, HostRope, RmsNorm, RotaryEmbedding, activation_dtype, embed_into};
use super::linear::Prequantized;
use super::linear::{Linear, linear};
use super::workspace::Workspace;
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
    /// The model's RoPE tables, then (Gemma 3) the sliding layers' own.
    rotary: Vec<RotaryEmbedding>,
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
        // One table per distinct RoPE among the layers (Gemma 3's sliding
        // layers have their own), the model's first.
        let mut ropes: Vec<std::borrow::Cow<ModelConfig>> = vec![std::borrow::Cow::Borrowed(cfg)];
        let mut layers = Vec::with_capacity(range.len());
        for i in range.start..range.end {
            let rope = cfg.layer_rope(i);
            let table = match ropes.iter().position(|r| r.as_ref() == rope.as_ref()) {
                Some(t) => t,
                None => {
                    ropes.push(rope);
                    ropes.len() - 1
                }
            };
            layers.push(DecoderLayer::new(cfg, i, model.pp(format!("layers.{i}")), pre, path, table)?);
        }
        let head = if range.is_last() {
            let norm = RmsNorm::of_model(cfg, cfg.hidden_size, path, model.pp("norm"))?;
            let lm_head = match (&embed_tokens, cfg.tie_word_embeddings) {
                (Some(embed), true) => Linear::new(embed.embeddings().clone(), None)?,
                (None, true) => Linear::new(embed_weight()?, None)?,
                (_, false) => linear(cfg.hidden_size, cfg.vocab_size, false, vb.pp("lm_head"), pre)?,
            };
            Some((norm, lm_head))
        } else {
            None
        };
        let rotary = ropes
            .iter()
            .map(|rope| RotaryEmbedding::new(rope, cfg.max_position_embeddings, act, &device, path))
            .collect::<Result<Vec<_>>>()?;
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

    /// Bytes of weights this model (or stage) holds: its layers (all of a
    /// mixture's experts), the final norm and lm_head, and an embedding
    /// table not shared with the lm_head.
    pub fn resident_weight_bytes(&self) -> usize {
        let embed = self
            .embed_tokens
            .as_ref()
            .map_or(0, |e| e.embeddings().elem_count() * e.embeddings().dtype().size_in_bytes());
        let shared = self.cfg.tie_word_embeddings && self.range.is_full();
        let layers: usize = self.layers.iter().map(DecoderLayer::resident_bytes).sum();
        let head = self.head.as_ref().map_or(0, |(norm, lm_head)| norm.size_in_bytes() + lm_head.size_in_bytes());
        layers + head + if shared { 0 } else { embed }
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
        let windows = LayerWindows::new(meta, &self.layers);
        if self.path == ExecutionPath::FusedCpu {
            let positions = positions.to_vec1::<u32>()?;
            let ropes = self
                .rotary
                .iter()
                .map(|table| match table {
                    RotaryEmbedding::Host { cos, sin } => HostRope { cos, sin, positions: &positions },
                    RotaryEmbedding::Device { .. } => {
                        unreachable!("RotaryEmbedding::new builds host tables on the CPU")
                    }
                })
                .collect::<Vec<_>>();
            return self.forward_cpu(input, &ropes, kv_caches, &windows, logits_indices);
        }
        let tables = self
            .rotary
            .iter()
            .map(|table| match table {
                RotaryEmbedding::Device { cos, sin } => {
                    Ok((cos.index_select(positions, 0)?, sin.index_select(positions, 0)?))
                }
                RotaryEmbedding::Host { .. } => unreachable!("RotaryEmbedding::new builds device tables off the CPU"),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut x = match (input, &self.embed_tokens) {
            (StageInput::Tokens(ids), Some(embed)) => {
                let x = embed.forward(ids)?.to_dtype(self.act)?; // [T, hidden]
                match self.embed_scale() {
                    Some(scale) => (x * f64::from(scale))?,
                    None => x,
                }
            }
            (StageInput::Hidden(hidden), None) => hidden.to_dtype(self.act)?,
            _ => return Err(self.wrong_input()),
        };
        for (layer, kv) in self.layers.iter().zip(kv_caches) {
            let (cos, sin) = &tables[layer.rope];
            x = layer.forward(&x, cos, sin, kv, windows.of(layer))?;
        }
        self.stage_output(&x, logits_indices)
    }

    /// Gemma's scale of the input embeddings, sqrt(hidden) in f32.
    fn embed_scale(&self) -> Option<f32> {
        self.cfg.gemma_norms.then(|| (self.cfg.hidden_size as f32).sqrt())
    }

    /// The CPU step (f32 activations): every activation lives in the
    /// workspace's buffers, reused across layers and steps, so a step
    /// allocates only its `[S, vocab]` logits and small per-row vectors
    /// (and, on a pipeline stage, the hidden states it hands on).
    fn forward_cpu(
        &self,
        input: StageInput,
        ropes: &[HostRope],
        kv_caches: &[LayerKvCache],
        windows: &LayerWindows,
        logits_indices: &Tensor,
    ) -> Result<StageOutput> {
        // A panic elsewhere cannot leave the buffers half-valid in a way that
        // matters: every step overwrites what it reads.
        let mut workspace = self.workspace.lock().unwrap_or_else(PoisonError::into_inner);
        let _awake = kernels::cpu::PoolAwake::new();
        let b = workspace.rows(input_rows(&input)?, &self.cfg)?;
        match (input, &self.embed_tokens) {
            (StageInput::Tokens(input_ids), Some(embed)) => {
                embed_into(embed.embeddings(), &input_ids.to_vec1::<u32>()?, &b.hidden)?;
                if let Some(scale) = self.embed_scale() {
                    kernels::cpu::write_f32(&b.hidden, &|h| {
                        h.iter_mut().for_each(|v| *v *= scale);
                        Ok(())
                    })?;
                }
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
            layer.forward_cpu(&b, &ropes[layer.rope], kv, windows.of(layer), next)?;
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

/// Rows of a stage's input: token ids `[T]` or hidden states `[T, hidden]`.
fn input_rows(input: &StageInput) -> Result<usize> {
    Ok(match input {
        StageInput::Tokens(ids) => ids.dim(0)?,
        StageInput::Hidden(hidden) => hidden.dim(0)?,
    })
}
