//! What the step plan ([`super::step`]) is given at load: a dense decoder's
//! dimensions and its weights as GPU buffers, and the padding that lets head
//! dims below the attention kernels' smallest run on them.

use candle_core::DType;

use super::plan::HEAD_DIMS;

/// A weight matrix `[rows, cols]`, row-major, in the checkpoint's dtype.
#[derive(Clone, Debug)]
pub struct Matrix<B> {
    pub buffer: B,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl<B> Matrix<B> {
    pub fn size_in_bytes(&self) -> usize {
        self.rows * self.cols * self.dtype.size_in_bytes()
    }
}

/// A linear layer: its weight and an optional f32 bias.
#[derive(Clone, Debug)]
pub struct Linear<B> {
    pub weight: Matrix<B>,
    pub bias: Option<B>,
}

/// One decoder layer's weights; norms and biases are f32 vectors.
#[derive(Clone, Debug)]
pub struct LayerWeights<B> {
    pub input_norm: B,
    /// q, k and v stacked: `[(H + 2 KVH) * D, hidden]`.
    pub qkv: Linear<B>,
    /// Qwen3's per-head norms of q and k, `[D]` each.
    pub head_norm: Option<(B, B)>,
    pub o_proj: Linear<B>,
    pub post_norm: B,
    /// gate and up stacked: `[2 I, hidden]`.
    pub gate_up: Linear<B>,
    pub down: Linear<B>,
}

/// The model's weights on the GPU.
#[derive(Clone, Debug)]
pub struct ModelWeights<B> {
    /// `[vocab, hidden]`.
    pub embed: Matrix<B>,
    pub layers: Vec<LayerWeights<B>>,
    pub final_norm: B,
    /// `[vocab, hidden]` (the embedding's buffer when tied).
    pub lm_head: Matrix<B>,
    /// RoPE tables `[max_positions, D / 2]`, f32.
    pub rope_cos: B,
    pub rope_sin: B,
}

/// The attention kernels' head dim for a model's `head_dim`: the smallest
/// of [`HEAD_DIMS`] at least as large. Below it, q and the KV cache rows are
/// zero-padded, and o_proj's weight must come with matching zero columns
/// (`[hidden, heads * padded]`; see [`pad_columns`]).
pub fn padded_head_dim(head_dim: usize) -> Option<usize> {
    HEAD_DIMS.iter().copied().find(|&d| d >= head_dim)
}

/// A row-major `[rows, heads * head_dim]` matrix of `elem`-byte elements
/// with each head's columns zero-padded to `padded` (o_proj's weight under
/// [`padded_head_dim`]).
pub fn pad_columns(bytes: &[u8], rows: usize, heads: usize, head_dim: usize, padded: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * heads * padded * elem];
    for r in 0..rows {
        for h in 0..heads {
            let src = &bytes[((r * heads + h) * head_dim) * elem..][..head_dim * elem];
            out[((r * heads + h) * padded) * elem..][..head_dim * elem].copy_from_slice(src);
        }
    }
    out
}

/// The model's dimensions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    pub max_positions: usize,
}
