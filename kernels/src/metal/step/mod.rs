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
mod experts;
mod load;
mod sample;
pub use encode::dispatches_per_step;
pub use experts::MAX_EXPERTS;
use experts::{ExpertBuffers, ExpertKernels};
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

impl<B: Clone> StepPlan<B> {
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

    /// Bytes of one KV block in one layer's K (or V) pool.
    fn kv_block_bytes_per_pool(&self) -> usize {
        self.limits.block_size * self.shape.kv_heads * self.padded() * self.cache_dtype.size_in_bytes()
    }

    /// Bytes of one KV block across every layer, K and V: what
    /// [`read_kv_block`](Self::read_kv_block) gives.
    pub fn kv_block_bytes(&self) -> usize {
        2 * self.kv.len() * self.kv_block_bytes_per_pool()
    }

    /// Appends block `block`'s K and V, layer by layer, to `out` (between
    /// steps: no GPU work is writing them).
    pub fn read_kv_block<G: Gpu<Buffer = B>>(&self, gpu: &mut G, block: usize, out: &mut Vec<u8>) -> Result<()> {
        let n = self.kv_block_bytes_per_pool();
        for (k, v) in &self.kv {
            for pool in [k, v] {
                let at = out.len();
                out.resize(at + n, 0);
                gpu.read(pool, block * n, &mut out[at..])?;
            }
        }
        Ok(())
    }

    /// Writes `bytes` (as [`read_kv_block`](Self::read_kv_block) gave
    /// them) into block `block`.
    pub fn write_kv_block<G: Gpu<Buffer = B>>(&self, gpu: &mut G, block: usize, bytes: &[u8]) -> Result<()> {
        let n = self.kv_block_bytes_per_pool();
        if bytes.len() != self.kv_block_bytes() || block >= self.limits.num_blocks {
            return Err(crate::KernelError::Invalid(format!(
                "a KV block of {} bytes into block {block} (blocks of {} bytes, {} of them)",
                bytes.len(),
                self.kv_block_bytes(),
                self.limits.num_blocks
            )));
        }
        for ((k, v), layer) in self.kv.iter().zip(bytes.chunks_exact(2 * n)) {
            gpu.write(k, block * n, &layer[..n])?;
            gpu.write(v, block * n, &layer[n..])?;
        }
        Ok(())
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
