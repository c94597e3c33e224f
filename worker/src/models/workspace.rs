//! The activation buffers of a CPU decoder step, reused by every layer and
//! every step: a step allocates no activation tensor, only its logits.
//!
//! Each buffer is its own tensor (`[rows, width]` f32), because kernels
//! read one while they write another and a tensor's storage is locked for
//! the write. They grow to the largest step seen (a power of two of rows,
//! at most `max_num_batched_tokens` in practice) and are never shrunk, as
//! vLLM sizes its buffers for the largest batch up front.

use candle_core::{DType, Device, Tensor};

use super::config::ModelConfig;
use crate::error::Result;

/// One tensor per activation of a layer, all with the same rows.
pub struct Buffers {
    /// The residual stream.
    pub hidden: Tensor,
    /// RMSNorm of `hidden`, input of the projections.
    pub normed: Tensor,
    /// `[q | k | v]` from the stacked projection, rotated in place.
    pub qkv: Tensor,
    /// q, k and v each on their own, as attention and the cache write take them.
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// Attention output, `[rows, heads * head_dim]`.
    pub attn: Tensor,
    /// Output of o_proj and of down_proj, added into `hidden`.
    pub proj: Tensor,
    /// Gemma: the norm of `proj` that is added instead.
    pub scratch: Tensor,
    pub gate_up: Tensor,
    /// SwiGLU of `gate_up`.
    pub act: Tensor,
}

impl Buffers {
    fn zeros(rows: usize, cfg: &ModelConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv, i) = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size);
        let buf = |width: usize| Tensor::zeros((rows, width), DType::F32, &Device::Cpu);
        Ok(Self {
            hidden: buf(h)?,
            normed: buf(h)?,
            qkv: buf(q + 2 * kv)?,
            q: buf(q)?,
            k: buf(kv)?,
            v: buf(kv)?,
            attn: buf(q)?,
            proj: buf(h)?,
            scratch: buf(h)?,
            gate_up: buf(2 * i)?,
            act: buf(i)?,
        })
    }

    /// Views of the first `t` rows (sharing the storage).
    fn rows(&self, t: usize) -> Result<Self> {
        let view = |b: &Tensor| b.narrow(0, 0, t);
        Ok(Self {
            hidden: view(&self.hidden)?,
            normed: view(&self.normed)?,
            qkv: view(&self.qkv)?,
            q: view(&self.q)?,
            k: view(&self.k)?,
            v: view(&self.v)?,
            attn: view(&self.attn)?,
            proj: view(&self.proj)?,
            scratch: view(&self.scratch)?,
            gate_up: view(&self.gate_up)?,
            act: view(&self.act)?,
        })
    }
}

#[derive(Default)]
pub struct Workspace {
    rows: usize,
    buffers: Option<Buffers>,
}

impl Workspace {
    /// Views of `t` rows of every buffer, growing them first if needed.
    pub fn rows(&mut self, t: usize, cfg: &ModelConfig) -> Result<Buffers> {
        let buffers = match self.buffers.take() {
            Some(b) if t <= self.rows => b,
            old => {
                drop(old); // before allocating the larger ones
                self.rows = t.next_power_of_two().max(16);
                Buffers::zeros(self.rows, cfg)?
            }
        };
        let views = buffers.rows(t);
        self.buffers = Some(buffers);
        views
    }

    /// Rows the buffers hold now (0 before the first step).
    pub fn capacity(&self) -> usize {
        self.rows
    }
}
