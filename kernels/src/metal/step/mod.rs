//! A model's whole step on the GPU as one plan (the issue's "Metal
//! step"), free of any GPU API like [`super::plan`]: a Mac's Metal device
//! and the Linux emulator (kernels/metal-emu) run this same code through
//! the [`Gpu`] trait. A pipeline stage's plan holds its share of the layers
//! ([`ModelWeights`]): it starts from token ids or the stage before's
//! hidden states ([`StepInput`]) and hands hidden states on or ends with
//! the head ([`Readback`]).
//!
//! At load, [`StepPlan::new`] allocates every buffer once, at its exact
//! size: the weights (given), the KV pools, the activations for the step's
//! token budget, the inputs, the attention metadata and the decode scratch
//! at their bounds. A step ([`StepPlan::run`]) writes its inputs into those
//! buffers, encodes a fixed sequence of dispatches into one command buffer
//! and waits once, for the logits of the wanted rows or their sampled tokens.
//! It allocates nothing on the GPU.
//!
//! Dispatches per decoder layer (model.metal says what each fuses):
//! `rms_norm`, `matmul` (qkv, bias in its epilogue), `rope_qkv_cache` (RoPE,
//! Qwen3's head norm and the KV write), attention (one dispatch, a second for
//! the partition reduce past 512 keys and one more when a step mixes prefill
//! and decode), `matmul` (o_proj, adding into the residual stream),
//! `rms_norm`, `matmul` (gate/up with SwiGLU's product), `matmul`
//! (down_proj, adding into the residual stream): 8 at decode. A mixture of
//! experts' MLP is instead `matmul` (the router), `moe_route`, `moe_group`,
//! `matmul_id` (the chosen experts' gate/up), `matmul_id` (their down) and
//! `moe_combine` (the weighted sum into the residual stream), plus the two
//! matmuls of a shared expert: 11 dispatches a layer at decode. Per step
//! besides: the embedding, the final norm of the wanted rows, lm_head and,
//! when the step samples on the GPU, the sampler (sample.rs: one dispatch
//! for every row, whatever its parameters).

use candle_core::DType;

use super::plan::{
    Access, Allocator, At, AttentionBuffers, AttentionPlan, Encoder, HEAD_DIMS, Kernel, PARTITION_SIZE, Source, bind,
    invalid, to_u32, words,
};
use crate::{AttentionMetadata, Dims, Result};

mod encode;
mod sample;
pub use encode::dispatches_per_step;
pub use sample::{EDITS_PER_ROW, MAX_TOP_LOGPROBS, RawLogprobs, SampleRow, Sampled, Sampler, TokenEdit};

pub use super::model::{
    Experts, FeedForward, Gate, LayerWeights, Linear, Matrix, ModelShape, ModelWeights, OutputHead, Routing,
    WeightFormat, pad_columns, padded_head_dim,
};

/// Threads of the row kernels (`kRowThreads` in model.metal).
const ROW_THREADS: usize = 256;
/// SIMD groups per matmul threadgroup, output rows per SIMD group and
/// tokens per threadgroup (`kMatmulSimds`, `kMatmulRowsPerSimd`, `kMatmulTokens`).
const MATMUL_SIMDS: usize = 4;
const MATMUL_ROWS: usize = MATMUL_SIMDS * 4;
const MATMUL_TOKENS: usize = 8;
/// Rows of the attention metadata's prefill work items (`kRows` in
/// prefill_attention.metal), for the metadata's bound.
const PREFILL_ROWS: usize = 16;
const REGION_ALIGN: usize = 16;

/// A GPU the plan runs on: buffers, host access to them, command buffers.
pub trait Gpu: Allocator {
    /// One command buffer's compute encoder.
    type Commands: Encoder<Buffer = Self::Buffer>;
    /// Copies `bytes` into `buffer` at `offset` (no GPU work may be reading
    /// it: the plan writes only between its waits).
    fn write(&mut self, buffer: &Self::Buffer, offset: usize, bytes: &[u8]) -> Result<()>;
    /// Copies `out.len()` bytes of `buffer` from `offset`.
    fn read(&mut self, buffer: &Self::Buffer, offset: usize, out: &mut [u8]) -> Result<()>;
    /// A new command buffer.
    fn begin(&mut self) -> Self::Commands;
    /// Commits it and waits for the GPU to finish it.
    fn commit_and_wait(&mut self, commands: Self::Commands) -> Result<()>;
    /// Starts or stops counting the device memory dispatches touch; false
    /// where this GPU cannot (only the emulator can).
    fn count_traffic(&mut self, _on: bool) -> bool {
        false
    }
    /// Bytes of device memory touched since counting began, each byte once
    /// per dispatch; None where this GPU does not count.
    fn traffic_bytes(&self) -> Option<u64> {
        None
    }
}

/// What one step may hold, fixed at load: the buffers' sizes come from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens per step (the scheduler's `max_num_batched_tokens`).
    pub max_tokens: usize,
    pub max_seqs: usize,
    /// Rows of logits per step (sampled rows and prompt-logprob rows).
    pub max_logit_rows: usize,
    /// Rows a step samples on the GPU (the sampler's buffers).
    pub max_sampled_rows: usize,
    /// Longest context, for the block tables and the decode scratch.
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// One step's inputs (the model runner's flattened batch, or what the
/// pipeline stage before sent).
#[derive(Clone, Copy, Debug)]
pub struct StepInputs<'a> {
    pub input: StepInput<'a>,
    pub positions: &'a [u32],
    pub meta: &'a AttentionMetadata,
    /// The rows whose logits are wanted.
    pub logit_rows: &'a [u32],
}

/// What a step starts from: token ids (the stage holding layer 0) or the
/// stage before's hidden states.
#[derive(Clone, Copy, Debug)]
pub enum StepInput<'a> {
    Tokens(&'a [u32]),
    /// `[T, hidden]`, row-major.
    Hidden(&'a [f32]),
}

/// What a step brings back.
#[derive(Clone, Copy, Debug)]
pub enum Readback<'a> {
    /// The wanted rows' logits, `[rows, vocab]` f32.
    Logits,
    /// Each wanted row's token, drawn on the GPU with these parameters (one
    /// per wanted row).
    Sample(&'a [SampleRow<'a>]),
    /// The last layer's hidden states, `[T, hidden]` f32, for the next
    /// pipeline stage.
    Hidden,
}

/// What a step brought back.
#[derive(Clone, Debug, PartialEq)]
pub enum StepOutput {
    /// `[rows, vocab]`, row-major.
    Logits(Vec<f32>),
    Sampled(Vec<Sampled>),
    /// `[T, hidden]`, row-major.
    Hidden(Vec<f32>),
}

/// Byte offsets of the step inputs inside their buffer.
#[derive(Clone, Copy, Debug)]
struct InputLayout {
    ids: usize,
    positions: usize,
    slots: usize,
    rows: usize,
    len: usize,
}

impl InputLayout {
    fn new(limits: &StepLimits) -> Self {
        let region = |n: usize| (n.max(1) * 4).next_multiple_of(REGION_ALIGN);
        let ids = 0;
        let positions = ids + region(limits.max_tokens);
        let slots = positions + region(limits.max_tokens);
        let rows = slots + region(limits.max_tokens);
        Self { ids, positions, slots, rows, len: rows + region(limits.max_logit_rows) }
    }
}

/// The activation buffers, each for `max_tokens` rows (f32).
#[derive(Debug)]
struct Activations<B> {
    hidden: B,
    normed: B,
    qkv: B,
    q: B,
    attn: B,
    act: B,
    /// A plan with mixtures of experts.
    experts: Option<ExpertBuffers<B>>,
}

/// The buffers of the mixture-of-experts layers, for `max_tokens` tokens
/// at the largest router, top-k and expert width of the plan's layers.
#[derive(Debug)]
struct ExpertBuffers<B> {
    /// `[T, experts]` router logits.
    logits: B,
    /// `[T, top_k]` each token's experts (u32), best first, and weights.
    ids: B,
    weights: B,
    /// `[T * top_k]` pair indices grouped by expert (u32).
    order: B,
    /// `[max_tiles, 3]` (u32): expert, first index into `order`, pairs.
    tiles: B,
    /// `[T * top_k, I]` and `[T * top_k, hidden]`, a row per pair.
    act: B,
    out: B,
}

/// Tiles of at most `MATMUL_TOKENS` pairs that `pairs` (token, expert)
/// pairs over `experts` experts can need: each active expert's last tile
/// may be partial.
fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(MATMUL_TOKENS) + experts.min(pairs)
}

/// Most experts a router may score (`kMaxExperts` in model.metal).
pub const MAX_EXPERTS: usize = 512;

/// The head's buffers (a plan holding the last layer): the wanted rows
/// normed, their logits, and the sampler.
#[derive(Debug)]
struct HeadBuffers<B> {
    head_in: B,
    logits: B,
    sampler: Sampler<B>,
}

/// The model's step on a GPU: its buffers and kernels, built once.
#[derive(Debug)]
pub struct StepPlan<B> {
    shape: ModelShape,
    limits: StepLimits,
    weights: ModelWeights<B>,
    /// Each layer's K and V pools, `[num_blocks, block_size, KVH, D]`.
    kv: Vec<(B, B)>,
    cache_dtype: DType,
    inputs: B,
    layout: InputLayout,
    acts: Activations<B>,
    meta: B,
    meta_capacity: usize,
    scratch: Option<B>,
    scratch_capacity: usize,
    head: Option<HeadBuffers<B>>,
    kernels: Kernels,
}

#[derive(Debug)]
struct Kernels {
    /// The attention kernels a step may dispatch (decode, reduce, prefill).
    attention: Vec<Kernel>,
    embed: Option<Kernel>,
    norm: Kernel,
    matmuls: Vec<(WeightFormat, Kernel)>,
    rope: Kernel,
    /// A plan with mixtures of experts: moe_route, moe_group, moe_combine
    /// and a matmul_id per expert weight format.
    experts: Option<ExpertKernels>,
}

#[derive(Debug)]
struct ExpertKernels {
    route: Kernel,
    group: Kernel,
    combine: Kernel,
    matmuls: Vec<(WeightFormat, Kernel)>,
}

fn by_format(kernels: &[(WeightFormat, Kernel)], format: WeightFormat) -> &Kernel {
    &kernels.iter().find(|(f, _)| *f == format).expect("every weight's matmul is planned at load").1
}

impl Kernels {
    fn matmul(&self, format: WeightFormat) -> &Kernel {
        by_format(&self.matmuls, format)
    }
}

fn model_kernel(name: String, threads: usize) -> Kernel {
    Kernel { source: Source::Model, name, threads }
}

/// Bytes of the attention metadata upload at most (see `AttentionPlan::new`).
fn meta_bound(shape: &ModelShape, limits: &StepLimits) -> usize {
    let region = |n: usize| (n.max(1) * 4).next_multiple_of(REGION_ALIGN);
    let seqs = limits.max_seqs;
    let max_blocks = limits.max_model_len.div_ceil(limits.block_size).max(1);
    let group = shape.heads / shape.kv_heads.max(1);
    let items = 2 * (limits.max_tokens * group / PREFILL_ROWS + seqs);
    region(seqs + 1) + region(seqs) + region(seqs * max_blocks) + region(seqs) + region(items)
}

/// Bytes of decode scratch at most: every sequence at the longest context.
fn scratch_bound(shape: &ModelShape, limits: &StepLimits) -> usize {
    if limits.max_model_len <= PARTITION_SIZE {
        return 0;
    }
    let rows = limits.max_seqs * shape.heads * limits.max_model_len.div_ceil(PARTITION_SIZE);
    let f32_bytes = |n: usize| (n * 4).next_multiple_of(REGION_ALIGN);
    let head_dim = padded_head_dim(shape.head_dim).unwrap_or(shape.head_dim);
    f32_bytes(rows * head_dim) + 2 * f32_bytes(rows)
}

impl<B: Clone> StepPlan<B> {
    /// Checks the weights against `shape` and allocates the KV pools and
    /// every per-step buffer, at their bounds under `limits`.
    pub fn new<A: Allocator<Buffer = B>>(
        alloc: &mut A,
        shape: ModelShape,
        weights: ModelWeights<B>,
        limits: StepLimits,
        cache_dtype: DType,
    ) -> Result<Self> {
        let ModelShape { hidden, intermediate, heads, kv_heads, head_dim, vocab, .. } = shape;
        let Some(padded) = padded_head_dim(head_dim) else {
            return invalid(format!(
                "the Metal step has no attention kernel for head_dim {head_dim} (it takes even head dims up to {})",
                HEAD_DIMS[HEAD_DIMS.len() - 1]
            ));
        };
        if shape.rotary_dim == 0 || !shape.rotary_dim.is_multiple_of(2) || shape.rotary_dim > head_dim {
            return invalid(format!("a rotary dim of {} in heads of {head_dim}", shape.rotary_dim));
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            return invalid(format!("{heads} query heads are not a multiple of {kv_heads} kv heads"));
        }
        let cache_name = match cache_dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            other => return invalid(format!("the Metal step's KV cache is f32 or f16, not {other:?}")),
        };
        let qkv_rows = (heads + 2 * kv_heads) * head_dim;
        let check = |m: &Matrix<B>, rows: usize, cols: usize, what: &str| -> Result<()> {
            if (m.rows, m.cols) != (rows, cols) {
                return invalid(format!("{what} is [{}, {}], the model needs [{rows}, {cols}]", m.rows, m.cols));
            }
            // Block rows are read by 32-weight chunks.
            if m.format.row_bytes(cols).is_none() || (!m.format.is_float() && !cols.is_multiple_of(32)) {
                return invalid(format!("{what}: rows of {cols} weights are not whole {:?} blocks", m.format));
            }
            to_u32(rows * cols, what).map(|_| ())
        };
        if let Some(embed) = &weights.embed {
            if !embed.format.is_float() {
                return invalid(format!("the embedding is {:?}; the Metal step reads f32, f16 or bf16", embed.format));
            }
            check(embed, vocab, hidden, "the embedding")?;
        }
        if let Some(head) = &weights.head {
            check(&head.lm_head, vocab, hidden, "lm_head")?;
        }
        for (l, layer) in weights.layers.iter().enumerate() {
            for part in &layer.qkv {
                check(&part.weight, part.weight.rows, hidden, &format!("layer {l}'s qkv projection"))?;
            }
            let rows: usize = layer.qkv.iter().map(|p| p.weight.rows).sum();
            if rows != qkv_rows {
                return invalid(format!("layer {l}'s q, k and v have {rows} rows, the model needs {qkv_rows}"));
            }
            check(&layer.o_proj.weight, hidden, heads * padded, &format!("layer {l}'s o_proj (padded heads)"))?;
            if layer.window == Some(0) {
                return invalid(format!("layer {l}: a sliding window of 0 hides every key"));
            }
            if layer.mlp_out_norm.is_some() && matches!(layer.mlp, FeedForward::Experts(_)) {
                return invalid(format!("layer {l}: a norm of the experts' output (no model has one)"));
            }
            let mlp = |gate_up: &Linear<B>, down: &Linear<B>, width: usize, what: &str| -> Result<()> {
                check(&gate_up.weight, 2 * width, hidden, &format!("layer {l}'s {what}gate/up projection"))?;
                check(&down.weight, hidden, width, &format!("layer {l}'s {what}down_proj"))
            };
            match &layer.mlp {
                FeedForward::Dense { gate_up, down } => mlp(gate_up, down, intermediate, "")?,
                FeedForward::Experts(x) => {
                    let Routing { experts, top_k, expert_intermediate: width, groups, groups_kept, .. } = x.routing;
                    if top_k == 0 || top_k > experts || experts > MAX_EXPERTS {
                        return invalid(format!(
                            "layer {l}: {top_k} of {experts} experts a token (the Metal step routes 1 to at most \
                             {MAX_EXPERTS})"
                        ));
                    }
                    if groups == 0 || !experts.is_multiple_of(groups) || groups_kept == 0 || groups_kept > groups {
                        return invalid(format!("layer {l}: {experts} experts in {groups} groups, {groups_kept} kept"));
                    }
                    if x.router.weight.format != WeightFormat::F32 {
                        return invalid(format!(
                            "layer {l}'s router is {:?}; the Metal step reads f32",
                            x.router.weight.format
                        ));
                    }
                    check(&x.router.weight, experts, hidden, &format!("layer {l}'s router"))?;
                    check(&x.gate_up.weight, experts * 2 * width, hidden, &format!("layer {l}'s experts' gate/up"))?;
                    check(&x.down.weight, experts * hidden, width, &format!("layer {l}'s experts' down_proj"))?;
                    if let Some((gate_up, down)) = &x.shared {
                        mlp(gate_up, down, down.weight.cols, "shared expert's ")?;
                    }
                }
            }
        }
        let StepLimits { max_tokens, max_logit_rows, num_blocks, block_size, .. } = limits;
        if max_tokens == 0 || (weights.head.is_some() && max_logit_rows == 0) || limits.max_seqs == 0 || block_size == 0
        {
            return invalid(format!("a step plan needs room for a token, a row and a sequence: {limits:?}"));
        }
        let f32s = |alloc: &mut A, n: usize| alloc.scratch(n.max(1) * 4);
        let row = kv_heads * padded;
        // The widest dense MLP (a shared expert's included) and the largest
        // router, top-k and expert of the mixtures of experts.
        let mut dense_width = 0;
        let (mut max_experts, mut max_top_k, mut max_expert_width) = (0, 0, 0);
        for layer in &weights.layers {
            match &layer.mlp {
                FeedForward::Dense { down, .. } => dense_width = dense_width.max(down.weight.cols),
                FeedForward::Experts(x) => {
                    let r = x.routing;
                    max_experts = max_experts.max(r.experts);
                    max_top_k = max_top_k.max(r.top_k);
                    max_expert_width = max_expert_width.max(r.expert_intermediate);
                    dense_width = dense_width.max(x.shared.as_ref().map_or(0, |(_, d)| d.weight.cols));
                    to_u32(x.gate_up.weight.rows * x.gate_up.weight.cols, "the experts' gate/up elements")?;
                }
            }
        }
        let pairs = max_tokens * max_top_k;
        to_u32(num_blocks * block_size * row, "KV cache elements")?;
        to_u32(max_tokens * qkv_rows.max(2 * dense_width), "activation elements")?;
        to_u32(pairs * hidden.max(max_expert_width) + max_tokens * max_experts, "expert activation elements")?;
        if weights.head.is_some() {
            to_u32(max_logit_rows * vocab, "logits")?;
        }
        let kv = (0..weights.layers.len())
            .map(|_| {
                let bytes = num_blocks * block_size * row * cache_dtype.size_in_bytes();
                Ok((alloc.scratch(bytes.max(1))?, alloc.scratch(bytes.max(1))?))
            })
            .collect::<Result<Vec<_>>>()?;
        let acts = Activations {
            hidden: f32s(alloc, max_tokens * hidden)?,
            normed: f32s(alloc, max_tokens * hidden)?,
            qkv: f32s(alloc, max_tokens * qkv_rows)?,
            q: f32s(alloc, max_tokens * heads * padded)?,
            attn: f32s(alloc, max_tokens * heads * padded)?,
            act: f32s(alloc, max_tokens * dense_width)?,
            experts: match max_top_k {
                0 => None,
                _ => Some(ExpertBuffers {
                    logits: f32s(alloc, max_tokens * max_experts)?,
                    ids: f32s(alloc, pairs)?,
                    weights: f32s(alloc, pairs)?,
                    order: f32s(alloc, pairs)?,
                    tiles: f32s(alloc, 3 * max_tiles(pairs, max_experts))?,
                    act: f32s(alloc, pairs * max_expert_width)?,
                    out: f32s(alloc, pairs * hidden)?,
                }),
            },
        };
        let head = match weights.head {
            Some(_) => Some(HeadBuffers {
                head_in: f32s(alloc, max_logit_rows * hidden)?,
                logits: f32s(alloc, max_logit_rows * vocab)?,
                sampler: Sampler::new(alloc, vocab, limits.max_sampled_rows.clamp(1, max_logit_rows))?,
            }),
            None => None,
        };
        let layout = InputLayout::new(&limits);
        let inputs = alloc.scratch(layout.len)?;
        let meta_capacity = meta_bound(&shape, &limits);
        let meta = alloc.scratch(meta_capacity)?;
        let scratch_capacity = scratch_bound(&shape, &limits);
        let scratch = if scratch_capacity == 0 { None } else { Some(alloc.scratch(scratch_capacity)?) };

        // The formats of the plain matmuls, and of the experts' (matmul_id).
        let (mut formats, mut expert_formats) = (Vec::new(), Vec::new());
        let add = |list: &mut Vec<WeightFormat>, f: WeightFormat| {
            if !list.contains(&f) {
                list.push(f);
            }
        };
        if let Some(head) = &weights.head {
            add(&mut formats, head.lm_head.format);
        }
        for layer in &weights.layers {
            for part in layer.qkv.iter().chain([&layer.o_proj]) {
                add(&mut formats, part.weight.format);
            }
            match &layer.mlp {
                FeedForward::Dense { gate_up, down } => {
                    add(&mut formats, gate_up.weight.format);
                    add(&mut formats, down.weight.format);
                }
                FeedForward::Experts(x) => {
                    add(&mut formats, x.router.weight.format);
                    if let Some((gate_up, down)) = &x.shared {
                        add(&mut formats, gate_up.weight.format);
                        add(&mut formats, down.weight.format);
                    }
                    add(&mut expert_formats, x.gate_up.weight.format);
                    add(&mut expert_formats, x.down.weight.format);
                }
            }
        }
        let matmuls_named = |prefix: &str, formats: &[WeightFormat]| -> Vec<(WeightFormat, Kernel)> {
            let kernel = |f: WeightFormat| model_kernel(format!("{prefix}_{}", f.name()), MATMUL_SIMDS * 32);
            formats.iter().map(|&f| (f, kernel(f))).collect()
        };
        let matmuls = matmuls_named("matmul", &formats);
        let experts = (!expert_formats.is_empty()).then(|| ExpertKernels {
            route: model_kernel("moe_route".into(), 32),
            group: model_kernel("moe_group".into(), ROW_THREADS),
            combine: model_kernel("moe_combine".into(), ROW_THREADS),
            matmuls: matmuls_named("matmul_id", &expert_formats),
        });
        let attention_kernel = |source, name: &str, dtypes: &str| Kernel {
            source,
            name: format!("{name}_{dtypes}_hd{padded}"),
            threads: super::plan::ATTENTION_THREADS,
        };
        let kv_name = if cache_dtype == DType::F16 { "f32_kvf16" } else { "f32" };
        let kernels = Kernels {
            attention: vec![
                attention_kernel(Source::Decode, "paged_attention_decode", kv_name),
                attention_kernel(Source::Decode, "paged_attention_reduce", "f32"),
                attention_kernel(Source::Prefill, "paged_attention_prefill", kv_name),
            ],
            embed: weights.embed.as_ref().map(|e| model_kernel(format!("embed_rows_{}", e.format.name()), ROW_THREADS)),
            norm: model_kernel("rms_norm".into(), ROW_THREADS),
            matmuls,
            rope: model_kernel(format!("rope_qkv_cache_{cache_name}"), 32),
            experts,
        };
        Ok(Self {
            shape,
            limits,
            weights,
            kv,
            cache_dtype,
            inputs,
            layout,
            acts,
            meta,
            meta_capacity,
            scratch,
            scratch_capacity,
            head,
            kernels,
        })
    }

    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    pub fn limits(&self) -> &StepLimits {
        &self.limits
    }

    /// Every kernel a step may dispatch (to compile at load).
    pub fn kernels(&self) -> Vec<&Kernel> {
        let k = &self.kernels;
        let mut all = vec![&k.norm, &k.rope];
        all.extend(&k.embed);
        all.extend(self.head.as_ref().map(|h| h.sampler.kernel()));
        all.extend(k.matmuls.iter().map(|(_, m)| m));
        all.extend(&k.attention);
        if let Some(x) = &k.experts {
            all.extend([&x.route, &x.group, &x.combine]);
            all.extend(x.matmuls.iter().map(|(_, m)| m));
        }
        all
    }

    /// Bytes of the weights: what a dense model's step reads (every matrix
    /// and vector once); a mixture of experts' step reads fewer.
    pub fn weight_bytes(&self) -> usize {
        let w = &self.weights;
        let s = &self.shape;
        let linear = |l: &Linear<B>| l.weight.size_in_bytes() + l.bias.as_ref().map_or(0, |_| l.weight.rows * 4);
        let per_layer: usize = w
            .layers
            .iter()
            .map(|l| {
                l.qkv.iter().map(linear).sum::<usize>()
                    + linear(&l.o_proj)
                    + l.mlp.linears().into_iter().map(linear).sum::<usize>()
                    + 2 * s.hidden * 4
                    + l.head_norm.as_ref().map_or(0, |_| 2 * s.head_dim * 4)
            })
            .sum();
        per_layer + w.head.as_ref().map_or(0, |h| h.lm_head.size_in_bytes() + s.hidden * 4)
    }

    /// The attention kernels' head dim (the model's, or padded).
    fn padded(&self) -> usize {
        padded_head_dim(self.shape.head_dim).unwrap_or(self.shape.head_dim)
    }

    /// Bytes of K and V a step over `meta` must read: every context's
    /// tokens, in every layer.
    pub fn kv_read_bytes(&self, meta: &AttentionMetadata) -> usize {
        let tokens: usize = meta.context_lens.iter().map(|&c| c as usize).sum();
        2 * self.kv.len() * tokens * self.shape.kv_heads * self.padded() * self.cache_dtype.size_in_bytes()
    }

    /// Bytes of the KV pools.
    /// Whether a step may sample `rows` on the GPU (see [`Sampler::fits`]):
    /// only a plan holding the head samples.
    pub fn samples(&self, rows: &[SampleRow]) -> bool {
        self.head.as_ref().is_some_and(|h| h.sampler.fits(rows))
    }

    pub fn kv_bytes(&self) -> usize {
        let l = &self.limits;
        2 * self.kv.len()
            * l.num_blocks
            * l.block_size
            * self.shape.kv_heads
            * self.padded()
            * self.cache_dtype.size_in_bytes()
    }

    /// Runs one step: writes its inputs, encodes every dispatch into one
    /// command buffer, waits, and reads back the wanted rows' logits or
    /// their sampled tokens.
    pub fn run<G: Gpu<Buffer = B>>(&self, gpu: &mut G, step: &StepInputs, readback: Readback) -> Result<StepOutput> {
        let t = step.positions.len();
        let rows = step.logit_rows.len();
        let (s, l) = (&self.shape, &self.limits);
        if t == 0 || t > l.max_tokens {
            return invalid(format!("a step of {t} tokens (this plan holds 1 to {})", l.max_tokens));
        }
        if rows > l.max_logit_rows {
            return invalid(format!("{rows} rows of logits (this plan holds {})", l.max_logit_rows));
        }
        if step.meta.slot_mapping.len() != t {
            return invalid(format!("{t} tokens with {} slots", step.meta.slot_mapping.len()));
        }
        match (step.input, self.kernels.embed.is_some()) {
            (StepInput::Tokens(ids), true) => {
                if ids.len() != t {
                    return invalid(format!("{} token ids for {t} positions", ids.len()));
                }
                if let Some(id) = ids.iter().find(|&&id| id as usize >= s.vocab) {
                    return invalid(format!("token id {id} is outside the vocabulary of {}", s.vocab));
                }
            }
            (StepInput::Hidden(h), false) => {
                if h.len() != t * s.hidden {
                    return invalid(format!("{} hidden values for {t} tokens of {}", h.len(), s.hidden));
                }
            }
            (StepInput::Tokens(_), false) => return invalid("this stage starts from hidden states, not tokens".into()),
            (StepInput::Hidden(_), true) => {
                return invalid("this plan starts from token ids, not hidden states".into());
            }
        }
        let wants_rows = !matches!(readback, Readback::Hidden);
        if wants_rows && self.head.is_none() {
            return invalid("this stage has no head: it hands hidden states on".into());
        }
        if !wants_rows && !step.logit_rows.is_empty() {
            return invalid(format!("{rows} rows of logits from a step that hands hidden states on"));
        }
        if let Some(p) = step.positions.iter().find(|&&p| p as usize >= s.max_positions) {
            return invalid(format!("position {p} is past the model's {} positions", s.max_positions));
        }
        if let Some(r) = step.logit_rows.iter().find(|&&r| r as usize >= t) {
            return invalid(format!("logits row {r} of a step of {t} tokens"));
        }
        let num_slots = l.num_blocks * l.block_size;
        if let Some(slot) = step.meta.slot_mapping.iter().find(|&&x| x as usize >= num_slots) {
            return invalid(format!("slot {slot} is past the cache's {num_slots} slots"));
        }
        if step.meta.num_seqs() > l.max_seqs {
            return invalid(format!("{} sequences (this plan holds {})", step.meta.num_seqs(), l.max_seqs));
        }
        if let Some(ctx) = step.meta.context_lens.iter().find(|&&c| c as usize > l.max_model_len) {
            return invalid(format!("a context of {ctx} tokens (this plan holds {})", l.max_model_len));
        }
        step.meta.check(t, l.num_blocks)?;
        let dims = Dims {
            num_tokens: t,
            num_heads: s.heads,
            num_kv_heads: s.kv_heads,
            head_dim: self.padded(),
            num_blocks: l.num_blocks,
            block_size: l.block_size,
        };
        // A plan per distinct layer window; their metadata uploads are the
        // same (the window is a kernel parameter), so one serves them all.
        let dtypes = (DType::F32, self.cache_dtype);
        let first = AttentionPlan::new(step.meta, dims, dtypes, s.attention_scale)?;
        let mut attention = vec![(step.meta.sliding_window, first)];
        for layer in &self.weights.layers {
            if attention.iter().all(|(w, _)| *w != layer.window) {
                let meta = AttentionMetadata { sliding_window: layer.window, ..step.meta.clone() };
                attention.push((layer.window, AttentionPlan::new(&meta, dims, dtypes, s.attention_scale)?));
            }
        }
        let upload = attention[0].1.upload_bytes();
        let scratch = attention.iter().map(|(_, p)| p.scratch_len()).max().unwrap_or(0);
        if upload.len() > self.meta_capacity || scratch > self.scratch_capacity {
            return invalid(format!(
                "the step's attention needs {} bytes of metadata and {scratch} of scratch, over the plan's {} and {}",
                upload.len(),
                self.meta_capacity,
                self.scratch_capacity
            ));
        }

        if let Readback::Sample(params) = readback
            && params.len() != rows
        {
            return invalid(format!("{} sampling rows for {rows} wanted rows", params.len()));
        }
        let lay = self.layout;
        if let (Readback::Sample(params), Some(head)) = (readback, &self.head) {
            head.sampler.write(gpu, params)?;
        }
        match step.input {
            StepInput::Tokens(ids) => gpu.write(&self.inputs, lay.ids, &words(ids))?,
            StepInput::Hidden(h) => {
                let bytes: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
                gpu.write(&self.acts.hidden, 0, &bytes)?;
            }
        }
        gpu.write(&self.inputs, lay.positions, &words(step.positions))?;
        gpu.write(&self.inputs, lay.slots, &words(&step.meta.slot_mapping))?;
        gpu.write(&self.inputs, lay.rows, &words(step.logit_rows))?;
        gpu.write(&self.meta, 0, upload)?;

        let mut enc = gpu.begin();
        self.encode(&mut enc, t, rows, &attention, readback)?;
        gpu.commit_and_wait(enc)?;

        let floats = |gpu: &mut G, buffer: &B, n: usize| -> Result<Vec<f32>> {
            let mut bytes = vec![0u8; n * 4];
            if n > 0 {
                gpu.read(buffer, 0, &mut bytes)?;
            }
            Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        };
        match (readback, &self.head) {
            (Readback::Hidden, _) => Ok(StepOutput::Hidden(floats(gpu, &self.acts.hidden, t * s.hidden)?)),
            (Readback::Logits, Some(head)) => Ok(StepOutput::Logits(floats(gpu, &head.logits, rows * s.vocab)?)),
            (Readback::Sample(params), Some(head)) => Ok(StepOutput::Sampled(head.sampler.read(gpu, params)?)),
            (_, None) => invalid("this stage has no head".into()),
        }
    }
}
