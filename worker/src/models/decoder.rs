//! One decoder layer of the Llama family (and Gemma 3's variant of it), and
//! the attention metadata each layer of a step sees.

use candle_core::Tensor;
use candle_nn::VarBuilder;
use kernels::AttentionMetadata;

use super::config::ModelConfig;
use super::layers::{Attention, ExecutionPath, HostRope, RmsNorm};
use super::linear::{Linear, Prequantized};
use super::moe::FeedForward;
use super::workspace::Buffers;
use crate::error::Result;
use crate::runner::kv_cache::LayerKvCache;

/// Pre-norm attention then pre-norm MLP, each added to the residual stream
/// (Gemma normalises each one's output too, before the add).
pub(super) struct DecoderLayer {
    pub(super) input_layernorm: RmsNorm,
    self_attn: Attention,
    /// Gemma's `post_attention_layernorm`, of the attention's output.
    attn_output_norm: Option<RmsNorm>,
    /// The MLP's input norm: `post_attention_layernorm` in Llama's naming,
    /// `pre_feedforward_layernorm` in Gemma's.
    mlp_input_norm: RmsNorm,
    mlp: FeedForward,
    /// Gemma's `post_feedforward_layernorm`, of the MLP's output.
    mlp_output_norm: Option<RmsNorm>,
    /// This layer's attention window (None: full).
    window: Option<usize>,
    /// Which of the model's RoPE tables this layer rotates with.
    pub(super) rope: usize,
}

impl DecoderLayer {
    pub(super) fn new(
        cfg: &ModelConfig,
        layer: usize,
        vb: VarBuilder,
        pre: &Prequantized,
        path: ExecutionPath,
        rope: usize,
    ) -> Result<Self> {
        let norm = |name: &str| RmsNorm::of_model(cfg, cfg.hidden_size, path, vb.pp(name));
        let mlp = FeedForward::new(cfg, layer, &vb, pre)?;
        let (attn_output_norm, mlp_input_norm, mlp_output_norm) = match cfg.gemma_norms {
            true => (
                Some(norm("post_attention_layernorm")?),
                norm("pre_feedforward_layernorm")?,
                Some(norm("post_feedforward_layernorm")?),
            ),
            false => (None, norm("post_attention_layernorm")?, None),
        };
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::new(cfg, vb.pp("self_attn"), pre, path)?,
            attn_output_norm,
            mlp_input_norm,
            mlp,
            mlp_output_norm,
            window: cfg.layer_window(layer),
            rope,
        })
    }

    /// The composed step (GPUs): `x: [T, hidden]` -> `[T, hidden]`.
    pub(super) fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor, // [T, rotary_dim / 2], this step's rows
        sin: &Tensor,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
    ) -> Result<Tensor> {
        let mut h = self.self_attn.forward(&self.input_layernorm.forward(x)?, cos, sin, kv, meta)?;
        if let Some(norm) = &self.attn_output_norm {
            h = norm.forward(&h)?;
        }
        let x = (x + h)?;
        let mut h = self.mlp.forward(&self.mlp_input_norm.forward(&x)?)?;
        if let Some(norm) = &self.mlp_output_norm {
            h = norm.forward(&h)?;
        }
        Ok((&x + h)?)
    }

    /// One layer of the CPU step, in place on `b.hidden`, with `b.normed`
    /// holding this layer's input norm of it; the residual add at the end
    /// goes with the next layer's input norm (`next`) where there is one.
    pub(super) fn forward_cpu(
        &self,
        b: &Buffers,
        rope: &HostRope,
        kv: &LayerKvCache,
        meta: &AttentionMetadata,
        next: Option<&RmsNorm>,
    ) -> Result<()> {
        // `b.proj`, or Gemma's norm of it in `b.scratch`: what is added.
        let output = |norm: &Option<RmsNorm>| -> Result<&Tensor> {
            match norm {
                Some(norm) => {
                    norm.forward_into(&b.proj, &b.scratch)?;
                    Ok(&b.scratch)
                }
                None => Ok(&b.proj),
            }
        };
        self.self_attn.forward_cpu(b, rope, kv, meta)?;
        self.mlp_input_norm.add_forward_into(&b.hidden, output(&self.attn_output_norm)?, &b.normed)?;
        self.mlp.forward_cpu(b)?;
        let delta = output(&self.mlp_output_norm)?;
        match next {
            Some(norm) => norm.add_forward_into(&b.hidden, delta, &b.normed)?,
            None => kernels::cpu::add_in_place_op(&b.hidden, delta)?,
        }
        Ok(())
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut linears = self.self_attn.linears_mut();
        linears.extend(self.mlp.linears_mut());
        linears
    }

    /// Bytes of weight one pass reads.
    pub(super) fn size_in_bytes(&self) -> usize {
        let norms = [Some(&self.input_layernorm), self.attn_output_norm.as_ref(), Some(&self.mlp_input_norm)];
        let norms = norms.into_iter().chain([self.mlp_output_norm.as_ref()]).flatten();
        norms.map(RmsNorm::size_in_bytes).sum::<usize>() + self.self_attn.size_in_bytes() + self.mlp.size_in_bytes()
    }

    /// Bytes of weight it holds: what a pass reads, with every expert of a
    /// mixture (a token reads only its chosen ones).
    pub(super) fn resident_bytes(&self) -> usize {
        self.size_in_bytes() - self.mlp.size_in_bytes() + self.mlp.resident_bytes()
    }
}

/// A step's attention metadata for each layer: the step's own, or a copy
/// with the layer's window where that differs (Gemma 3 and gpt-oss mix
/// sliding and full layers), one copy per distinct window.
pub(super) struct LayerWindows<'a> {
    step: &'a AttentionMetadata,
    others: Vec<AttentionMetadata>,
}

impl<'a> LayerWindows<'a> {
    pub(super) fn new(step: &'a AttentionMetadata, layers: &[DecoderLayer]) -> Self {
        let mut others: Vec<AttentionMetadata> = Vec::new();
        for layer in layers {
            let window = layer.window;
            if window != step.sliding_window && !others.iter().any(|m| m.sliding_window == window) {
                others.push(AttentionMetadata { sliding_window: window, ..step.clone() });
            }
        }
        Self { step, others }
    }

    pub(super) fn of(&self, layer: &DecoderLayer) -> &AttentionMetadata {
        self.others.iter().find(|m| m.sliding_window == layer.window).unwrap_or(self.step)
    }
}
