//! What the step plan ([`super::step`]) is given at load: a decoder's
//! dimensions and its weights as GPU buffers (each layer's MLP dense or a
//! mixture of experts), and the padding that lets head dims below the
//! attention kernels' smallest run on them.

use candle_core::DType;

use super::plan::HEAD_DIMS;
pub use crate::cpu::Gate;

/// How a weight matrix stores its rows: a float type, or one of GGML's
/// block formats (each row `cols / weights_per_block` blocks, as GGUF files
/// and `--quantize` lay them out). The GPU reads them as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
    /// gpt-oss's experts (GGML type 39).
    Mxfp4,
}

impl WeightFormat {
    pub fn of_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::F16 => Some(Self::F16),
            DType::BF16 => Some(Self::BF16),
            _ => None,
        }
    }

    /// The kernels' suffix (`matmul_q4_k`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
            Self::Mxfp4 => "mxfp4",
        }
    }

    /// Weights and bytes per block (a float type's block is one element).
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q8_0 => (32, 34),
            Self::Q4_0 => (32, 18),
            Self::Q4K => (256, 144),
            Self::Q6K => (256, 210),
            Self::Mxfp4 => (32, 17),
        }
    }

    pub fn is_float(self) -> bool {
        self.block().0 == 1
    }

    /// Bytes of a row of `cols` weights; None when `cols` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let (weights, bytes) = self.block();
        cols.is_multiple_of(weights).then_some(cols / weights * bytes)
    }
}

/// A weight matrix `[rows, cols]`, row-major, in `format`.
#[derive(Clone, Debug)]
pub struct Matrix<B> {
    pub buffer: B,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
}

impl<B> Matrix<B> {
    pub fn size_in_bytes(&self) -> usize {
        self.rows * self.format.row_bytes(self.cols).unwrap_or(0)
    }
}

/// A linear layer: its weight and an optional f32 bias.
#[derive(Clone, Debug)]
pub struct Linear<B> {
    pub weight: Matrix<B>,
    pub bias: Option<B>,
}

impl<B> Linear<B> {
    /// The weight and the bias, borrowed.
    pub fn parts(&self) -> (&Matrix<B>, Option<&B>) {
        (&self.weight, self.bias.as_ref())
    }
}

/// One decoder layer's weights; norms and biases are f32 vectors.
#[derive(Clone, Debug)]
pub struct LayerWeights<B> {
    pub input_norm: B,
    /// q, k and v: one stacked `[(H + 2 KVH) * D, hidden]`, or parts whose
    /// rows add up to it, each written beside the previous (a GGUF file may
    /// store v in another format than q and k).
    pub qkv: Vec<Linear<B>>,
    /// Qwen3's per-head norms of q and k, `[D]` each.
    pub head_norm: Option<(B, B)>,
    pub o_proj: Linear<B>,
    pub post_norm: B,
    pub mlp: FeedForward<B>,
    /// This layer's attention window (None: full attention).
    pub window: Option<usize>,
    /// Each query head's attention sink logit, `[heads]` (gpt-oss).
    pub sinks: Option<B>,
    /// RoPE tables of this layer's own (Gemma's local layers), else the model's.
    pub rope: Option<(B, B)>,
    /// Gemma: norms of the attention's and the MLP's outputs, before each is
    /// added to the residual stream.
    pub attn_out_norm: Option<B>,
    pub mlp_out_norm: Option<B>,
}

/// A layer's MLP.
#[derive(Clone, Debug)]
pub enum FeedForward<B> {
    /// gate and up stacked, `[2 I, hidden]`, and down, `[hidden, I]`.
    Dense {
        gate_up: Linear<B>,
        down: Linear<B>,
    },
    Experts(Experts<B>),
}

impl<B> FeedForward<B> {
    /// Every linear layer, the router's included.
    pub fn linears(&self) -> Vec<&Linear<B>> {
        match self {
            Self::Dense { gate_up, down } => vec![gate_up, down],
            Self::Experts(x) => {
                let mut all = vec![&x.router, &x.gate_up, &x.down];
                all.extend(x.shared.iter().flat_map(|(gu, d)| [gu, d]));
                all
            }
        }
    }
}

/// A mixture of experts: the router, every expert's weights stacked
/// expert-major (one buffer a projection, as GGUF's `ffn_*_exps`), and a
/// shared expert where the model has one.
#[derive(Clone, Debug)]
pub struct Experts<B> {
    /// `[experts, hidden]`, f32 (a rounded router could flip a choice).
    pub router: Linear<B>,
    /// Added to the scores for the choice only, `[experts]` (GLM-4.5's
    /// `e_score_correction_bias`).
    pub correction: Option<B>,
    /// Each expert's gate and up, `[experts * 2 I, hidden]`.
    pub gate_up: Linear<B>,
    /// `[experts * hidden, I]`.
    pub down: Linear<B>,
    /// A dense MLP every token runs too, added unweighted.
    pub shared: Option<(Linear<B>, Linear<B>)>,
    pub routing: Routing,
}

/// How the router picks and weighs a token's experts (`moe_route` in
/// model.metal): scores by softmax or sigmoid, the `top_k` best kept (by
/// score plus the correction, from the best `groups_kept` of `groups`
/// groups), weighted by score, renormalised when `norm_topk`, times `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub sigmoid: bool,
    pub norm_topk: bool,
    pub groups: usize,
    pub groups_kept: usize,
    pub scale: f32,
}

/// The model's weights on the GPU: all of them, or a pipeline stage's (its
/// layers; the embedding on the first stage, the head on the last).
#[derive(Clone, Debug)]
pub struct ModelWeights<B> {
    /// `[vocab, hidden]`, on the stage that holds layer 0.
    pub embed: Option<Matrix<B>>,
    pub layers: Vec<LayerWeights<B>>,
    /// On the stage that holds the last layer.
    pub head: Option<OutputHead<B>>,
    /// RoPE tables `[max_positions, D / 2]`, f32.
    pub rope_cos: B,
    pub rope_sin: B,
}

/// The final norm and lm_head.
#[derive(Clone, Debug)]
pub struct OutputHead<B> {
    pub final_norm: B,
    /// `[vocab, hidden]` (the embedding's buffer when tied).
    pub lm_head: Matrix<B>,
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
    /// The leading dims of a head RoPE turns (`head_dim`, or less).
    pub rotary_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    /// The scale of q.k (1/sqrt(head_dim), or Gemma's `query_pre_attn_scalar`'s).
    pub attention_scale: f32,
    /// The embeddings' scale (Gemma's sqrt(hidden); 1 for the others).
    pub embed_scale: f32,
    /// Every gated MLP's gate, the experts' included.
    pub activation: Gate,
    pub max_positions: usize,
}

/// The attention kernels' head dim for a model's `head_dim`: the smallest
/// of [`HEAD_DIMS`] at least as large (an even head dim below it runs
/// zero-padded: q and the cache rows get zeros, o_proj's weight zero
/// columns). None for an odd head dim or one past the largest.
pub fn padded_head_dim(head_dim: usize) -> Option<usize> {
    if !head_dim.is_multiple_of(2) {
        return None;
    }
    HEAD_DIMS.iter().copied().find(|&d| d >= head_dim)
}

/// `[rows, cols]` f32 weights quantized to a block `format`, as GGML's bytes
/// (what a GGUF file stores and the GPU reads), with the weights they
/// dequantize to (for references and checks).
pub fn quantize(format: WeightFormat, w: &[f32], rows: usize, cols: usize) -> crate::Result<(Vec<u8>, Vec<f32>)> {
    use crate::cpu::{kquant, quant};
    let err = |e: quant::QuantError| crate::KernelError::Invalid(format!("quantizing to {format:?}: {e}"));
    let mut back = vec![0f32; rows * cols];
    let bytes = match format {
        WeightFormat::Q8_0 => {
            let blocks = quant::quantize_matrix::<quant::BlockQ8_0>(w, rows, cols).map_err(err)?;
            quant::dequantize_row(&blocks, &mut back);
            blocks.iter().flat_map(|b| b.d.to_le_bytes().into_iter().chain(b.qs.iter().map(|&q| q as u8))).collect()
        }
        WeightFormat::Q4_0 => {
            let blocks = quant::quantize_matrix::<quant::BlockQ4_0>(w, rows, cols).map_err(err)?;
            quant::dequantize_row(&blocks, &mut back);
            blocks.iter().flat_map(|b| b.d.to_le_bytes().into_iter().chain(b.qs)).collect()
        }
        WeightFormat::Q4K => {
            let blocks = kquant::quantize_matrix::<kquant::BlockQ4K>(w, rows, cols).map_err(err)?;
            kquant::dequantize_row(&blocks, &mut back);
            let bytes = |b: &kquant::BlockQ4K| {
                let mut v = Vec::with_capacity(144);
                v.extend(b.d.to_le_bytes());
                v.extend(b.dmin.to_le_bytes());
                v.extend(b.scales);
                v.extend(b.qs);
                v
            };
            blocks.iter().flat_map(bytes).collect()
        }
        WeightFormat::Mxfp4 => {
            let blocks = quant::quantize_matrix::<quant::BlockMxfp4>(w, rows, cols).map_err(err)?;
            quant::dequantize_row(&blocks, &mut back);
            blocks.iter().flat_map(|b| std::iter::once(b.e).chain(b.qs)).collect()
        }
        WeightFormat::Q6K => {
            let blocks = kquant::quantize_matrix::<kquant::BlockQ6K>(w, rows, cols).map_err(err)?;
            kquant::dequantize_row(&blocks, &mut back);
            let bytes = |b: &kquant::BlockQ6K| {
                let mut v = Vec::with_capacity(210);
                v.extend(b.ql);
                v.extend(b.qh);
                v.extend(b.scales.iter().map(|&s| s as u8));
                v.extend(b.d.to_le_bytes());
                v
            };
            blocks.iter().flat_map(bytes).collect()
        }
        float => return Err(crate::KernelError::Invalid(format!("{float:?} is not a block format"))),
    };
    Ok((bytes, back))
}
