//! The Metal kernels' host side, free of any GPU API: what to upload, which
//! kernels to dispatch with which bindings, grid and threadgroup sizes. It
//! talks to the GPU through two small traits, [`Allocator`] (buffers) and
//! [`Encoder`] (bindings and dispatches), implemented by candle's Metal
//! device on macOS (`device.rs`) and by the CPU emulator on Linux
//! (kernels/metal-emu, driven by tests/metal.rs), so the Linux tests run
//! this exact code.
//!
//! Per-step metadata: every layer of a step calls the kernels with the same
//! [`AttentionMetadata`], so a [`StepCache`] plans and uploads it on the
//! first call of a step (one upload for the slots, one for the attention
//! metadata) and hands the same buffers to the other layers; the decode
//! scratch is kept and reused across layers and steps, grown when a step
//! needs more.

use candle_core::DType;

use crate::{AttentionMetadata, Dims, KernelError, Result};

/// Head dims with instantiated kernels: multiples of the 32-lane SIMD group,
/// so every lane holds the same share of a row.
pub const HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];
/// Keys per decode partition (`kPartitionSize` in paged_attention.metal).
pub const PARTITION_SIZE: usize = 512;

/// Query heads one decode threadgroup serves, all of one kv head
/// (`decode_max_heads` in paged_attention.metal): its K/V rows are read
/// once for them.
fn decode_heads_per_threadgroup(head_dim: usize) -> usize {
    if head_dim <= 128 { 8 } else { 4 }
}
/// Flattened (query, head) rows per prefill work item (`kRows`).
const PREFILL_ROWS: usize = 16;
/// Threads per threadgroup of the attention kernels: 4 SIMD groups of 32,
/// which the kernels assume.
pub const ATTENTION_THREADS: usize = 128;
/// Most threads per threadgroup of the cache write (one token per group).
const CACHE_WRITE_THREADS: usize = 256;
/// Bytes of the attention kernels' parameter structs at most (`DecodeParams`:
/// 6 words, the scale and `has_sinks`).
const PARAMS_BYTES: usize = 32;
/// Alignment of each region inside an upload or the scratch buffer.
const REGION_ALIGN: usize = 16;

pub use super::step_cache::StepCache;

/// The kernels' name for a dtype (f32, f16, bf16), None for the others.
pub fn dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

/// The kernels' name for activations of `x` dtype over a cache of `cache`
/// dtype: the dtype's own name when they match; `f32_kvf16` for an f16
/// cache under f32 activations; None for the others (q8_0 among them).
pub fn kernel_dtypes_name(x: DType, cache: DType) -> Option<&'static str> {
    match (x, cache) {
        (DType::F32, DType::F16) => Some("f32_kvf16"),
        _ if x == cache => dtype_name(x),
        _ => None,
    }
}

pub(super) fn invalid<T>(message: String) -> Result<T> {
    Err(KernelError::Invalid(message))
}

/// The kernels index with 32-bit integers; larger sizes are refused.
pub(super) fn to_u32(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x)
        .map_err(|_| KernelError::Invalid(format!("{what}: {x} is past the Metal kernels' 32-bit indexing")))
}

/// The kernel source files (beside this file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Cache,
    Decode,
    Prefill,
    /// The dense model step besides attention (step/).
    Model,
    /// Sampling (step/sample.rs), compiled without fast math.
    Sample,
}

impl Source {
    pub fn code(self) -> &'static str {
        match self {
            Source::Cache => include_str!("cache.metal"),
            Source::Decode => include_str!("paged_attention.metal"),
            Source::Prefill => include_str!("prefill_attention.metal"),
            Source::Model => include_str!("model.metal"),
            Source::Sample => include_str!("sample.metal"),
        }
    }
}

/// One kernel: its source, host name and threads per threadgroup.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub source: Source,
    pub name: String,
    pub threads: usize,
}

/// How a dispatch uses a bound buffer; candle orders dispatches by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// Records dispatches: a compute command encoder.
pub trait Encoder {
    type Buffer: ?Sized;
    fn set_kernel(&mut self, kernel: &Kernel);
    fn set_buffer(&mut self, index: usize, buffer: &Self::Buffer, offset: usize, access: Access);
    fn set_bytes(&mut self, index: usize, bytes: &[u8]);
    fn dispatch(&mut self, threadgroups: [usize; 3], threads: [usize; 3]);
}

/// Makes buffers: every allocation the planning code does goes through here.
pub trait Allocator {
    type Buffer: Clone;
    /// A new buffer holding `bytes`.
    fn upload(&mut self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// A new buffer of `len` bytes that only the GPU reads and writes.
    fn scratch(&mut self, len: usize) -> Result<Self::Buffer>;
}

/// A buffer and a byte offset into it.
pub struct At<'a, B: ?Sized> {
    pub buffer: &'a B,
    pub offset: usize,
}

impl<B: ?Sized> Clone for At<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: ?Sized> Copy for At<'_, B> {}

pub(super) fn bind<E: Encoder>(enc: &mut E, index: usize, at: At<'_, E::Buffer>, access: Access) {
    enc.set_buffer(index, at.buffer, at.offset, access);
}

/// Little-endian words, as the kernels' parameter structs lay them out.
pub(super) fn words(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|w| w.to_le_bytes()).collect()
}

// ---------------------------------------------------------------------------
// KV write

/// One reshape_and_cache dispatch: a threadgroup per new token.
#[derive(Debug)]
pub struct CacheWritePlan {
    kernel: Kernel,
    tokens: usize,
    /// `CacheWriteParams` in cache.metal: row, num_slots.
    params: [u32; 2],
}

impl CacheWritePlan {
    /// None when there is nothing to write.
    pub fn new(
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        num_slots: usize,
        (dtype, cache): (DType, DType),
    ) -> Result<Option<Self>> {
        let Some(name) = kernel_dtypes_name(dtype, cache) else {
            return invalid(format!(
                "Metal reshape_and_cache writes f32, f16 or bf16 into a cache of the same dtype or f32 into f16, not \
                 {dtype:?} into {cache:?}"
            ));
        };
        let row = kv_heads * head_dim;
        if tokens == 0 || row == 0 {
            return Ok(None);
        }
        to_u32(num_slots * row, "cache elements")?;
        to_u32(tokens * row, "new k/v elements")?;
        let threads = CACHE_WRITE_THREADS.min(row.next_multiple_of(32));
        let kernel = Kernel { source: Source::Cache, name: format!("reshape_and_cache_{name}"), threads };
        Ok(Some(Self { kernel, tokens, params: [to_u32(row, "kv row elements")?, to_u32(num_slots, "cache slots")?] }))
    }

    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// K and V into their pools, in one dispatch.
    pub fn encode<E: Encoder>(&self, enc: &mut E, b: CacheWriteBuffers<'_, E::Buffer>) {
        enc.set_kernel(&self.kernel);
        bind(enc, 0, b.k, Access::Read);
        bind(enc, 1, b.v, Access::Read);
        bind(enc, 2, b.k_cache, Access::Write);
        bind(enc, 3, b.v_cache, Access::Write);
        bind(enc, 4, b.slots, Access::Read);
        enc.set_bytes(5, &words(&self.params));
        enc.dispatch([self.tokens, 1, 1], [self.kernel.threads, 1, 1]);
    }
}

/// The buffers of one KV write.
pub struct CacheWriteBuffers<'a, B: ?Sized> {
    pub k: At<'a, B>,
    pub v: At<'a, B>,
    pub k_cache: At<'a, B>,
    pub v_cache: At<'a, B>,
    pub slots: At<'a, B>,
}

// ---------------------------------------------------------------------------
// Attention

/// Byte offsets of the metadata arrays inside the step's upload.
#[derive(Clone, Copy, Debug, Default)]
struct MetaLayout {
    query_start_loc: usize,
    context_lens: usize,
    block_tables: usize,
    decode_seqs: usize,
    items: usize,
}

/// Byte offsets of the decode partials inside the scratch buffer.
#[derive(Clone, Copy, Debug, Default)]
struct ScratchLayout {
    acc: usize,
    max: usize,
    sum: usize,
    len: usize,
}

/// A whole attention call, planned on the host: the metadata to upload,
/// the dispatches with their parameters, grids and scratch.
#[derive(Debug)]
pub struct AttentionPlan {
    dims: Dims,
    /// Every metadata array, each region 16-byte aligned (`layout`).
    upload: Vec<u8>,
    layout: MetaLayout,
    decode: Option<DecodePlan>,
    prefill: Option<PrefillPlan>,
}

#[derive(Debug)]
struct DecodePlan {
    seqs: usize,
    /// Partitions per (sequence, head) in the scratch; 0 when every context
    /// fits one partition and a single pass writes the output.
    max_partitions: usize,
    scratch: ScratchLayout,
    /// `DecodeParams` in paged_attention.metal, without `has_sinks`
    /// (appended at encoding).
    params: Vec<u8>,
    decode: Kernel,
    reduce: Option<Kernel>,
}

#[derive(Debug)]
struct PrefillPlan {
    items: usize,
    /// `PrefillParams` in prefill_attention.metal, without `has_sinks`.
    params: Vec<u8>,
    prefill: Kernel,
}

/// The buffers of one attention call besides the plan's own.
pub struct AttentionBuffers<'a, B: ?Sized> {
    pub q: At<'a, B>,
    pub k_cache: At<'a, B>,
    pub v_cache: At<'a, B>,
    /// `[T, heads, head_dim]`, written whole.
    pub out: At<'a, B>,
    /// The plan's upload, from [`StepCache::attention`].
    pub meta: &'a B,
    /// At least [`AttentionPlan::scratch_len`] bytes, when that is not 0.
    pub scratch: Option<&'a B>,
    /// Each query head's sink logit, f32 (gpt-oss), joining its softmax.
    pub sinks: Option<At<'a, B>>,
}

fn push_region(upload: &mut Vec<u8>, values: &[u32]) -> usize {
    let at = upload.len();
    upload.extend(values.iter().flat_map(|w| w.to_le_bytes()));
    // Never empty, so every region is a valid binding offset.
    upload.resize(upload.len().max(at + 4).next_multiple_of(REGION_ALIGN), 0);
    at
}

impl AttentionPlan {
    /// Plans a checked call (`Attention::check`'s dims).
    pub fn new(meta: &AttentionMetadata, dims: Dims, (dtype, cache): (DType, DType), scale: f32) -> Result<Self> {
        let (Some(name), Some(kv_name)) = (dtype_name(dtype), kernel_dtypes_name(dtype, cache)) else {
            return invalid(format!(
                "Metal paged attention takes f32, f16 or bf16 over a cache of the same dtype, or f32 over f16, not \
                 {dtype:?} over {cache:?}"
            ));
        };
        let hd = dims.head_dim;
        if !HEAD_DIMS.contains(&hd) {
            return invalid(format!("Metal paged attention has no kernel for head_dim {hd} (has {HEAD_DIMS:?})"));
        }
        to_u32(dims.num_tokens * dims.num_heads * hd, "q elements")?;
        to_u32(dims.num_blocks * dims.block_size * dims.num_kv_heads * hd, "cache elements")?;

        let n = meta.num_seqs();
        let bs = dims.block_size;
        let ctx = |s: usize| meta.context_lens[s] as usize;
        let max_blocks = (0..n).map(|s| ctx(s).div_ceil(bs)).max().unwrap_or(0).max(1);
        to_u32(n * max_blocks, "block table entries")?;
        // Each table cut to the blocks its context uses (checked in range),
        // padded with 0.
        let mut block_tables = vec![0u32; n * max_blocks];
        for s in 0..n {
            let used = ctx(s).div_ceil(bs);
            block_tables[s * max_blocks..][..used].copy_from_slice(&meta.block_tables[s][..used]);
        }

        let group = dims.group();
        let (mut decode_seqs, mut items, mut max_decode_ctx) = (Vec::new(), Vec::new(), 0);
        for s in 0..n {
            match meta.query_range(s).len() {
                0 => {}
                1 => {
                    decode_seqs.push(s as u32);
                    max_decode_ctx = max_decode_ctx.max(ctx(s));
                }
                q_len => {
                    for r0 in (0..q_len * group).step_by(PREFILL_ROWS) {
                        items.extend([s as u32, to_u32(r0, "prefill rows")?]);
                    }
                }
            }
        }

        let mut upload = Vec::new();
        let layout = MetaLayout {
            query_start_loc: push_region(&mut upload, &meta.query_start_loc),
            context_lens: push_region(&mut upload, &meta.context_lens),
            block_tables: push_region(&mut upload, &block_tables),
            decode_seqs: push_region(&mut upload, &decode_seqs),
            items: push_region(&mut upload, &items),
        };

        // A window at least as long as every context hides nothing; passing
        // it as 0 keeps the kernels' window arithmetic in range.
        let max_ctx = (0..n).map(ctx).max().unwrap_or(0);
        let window = match meta.sliding_window {
            Some(w) if w < max_ctx => to_u32(w, "sliding window")?,
            _ => 0,
        };
        let (heads, kv_heads) = (to_u32(dims.num_heads, "heads")?, to_u32(dims.num_kv_heads, "kv heads")?);
        let (block_size, max_blocks) = (to_u32(bs, "block size")?, to_u32(max_blocks, "blocks per sequence")?);
        // The kernels that read the cache are named for both dtypes; the
        // reduce of partitions sees only the output's.
        let kernel = |source, k: &str, name: &str| Kernel {
            source,
            name: format!("{k}_{name}_hd{hd}"),
            threads: ATTENTION_THREADS,
        };

        let decode = if decode_seqs.is_empty() {
            None
        } else {
            let max_partitions =
                if max_decode_ctx > PARTITION_SIZE { max_decode_ctx.div_ceil(PARTITION_SIZE) } else { 0 };
            let rows = decode_seqs.len() * dims.num_heads * max_partitions;
            to_u32(rows * hd, "decode scratch elements")?;
            let mut params =
                words(&[heads, kv_heads, block_size, max_blocks, window, to_u32(max_partitions, "partitions")?]);
            params.extend(scale.to_le_bytes());
            let f32_bytes = |n: usize| (n * 4).next_multiple_of(REGION_ALIGN);
            let scratch = ScratchLayout {
                acc: 0,
                max: f32_bytes(rows * hd),
                sum: f32_bytes(rows * hd) + f32_bytes(rows),
                len: if rows == 0 { 0 } else { f32_bytes(rows * hd) + 2 * f32_bytes(rows) },
            };
            Some(DecodePlan {
                seqs: decode_seqs.len(),
                max_partitions,
                scratch,
                params,
                decode: kernel(Source::Decode, "paged_attention_decode", kv_name),
                reduce: (max_partitions > 0).then(|| kernel(Source::Decode, "paged_attention_reduce", name)),
            })
        };
        let prefill = if items.is_empty() {
            None
        } else {
            let mut params = words(&[heads, kv_heads, block_size, max_blocks, window]);
            params.extend(scale.to_le_bytes());
            Some(PrefillPlan {
                items: items.len() / 2,
                params,
                prefill: kernel(Source::Prefill, "paged_attention_prefill", kv_name),
            })
        };
        Ok(Self { dims, upload, layout, decode, prefill })
    }

    /// The kernels the call dispatches (to compile before encoding).
    pub fn kernels(&self) -> Vec<&Kernel> {
        let decode = self.decode.iter().flat_map(|d| std::iter::once(&d.decode).chain(&d.reduce));
        decode.chain(self.prefill.iter().map(|p| &p.prefill)).collect()
    }

    /// The metadata to upload (or write) before encoding, every region
    /// 16-byte aligned.
    pub fn upload_bytes(&self) -> &[u8] {
        &self.upload
    }

    /// Bytes of decode scratch the call needs (0: none).
    pub fn scratch_len(&self) -> usize {
        self.decode.as_ref().map_or(0, |d| d.scratch.len)
    }

    /// Elements of the output, `[T, heads, head_dim]`.
    pub fn out_elems(&self) -> usize {
        self.dims.num_tokens * self.dims.num_heads * self.dims.head_dim
    }

    /// The dispatches, ordered so that independent ones need no barrier
    /// between them: the partitioned decode writes only the scratch, so the
    /// prefill (writing `out`) runs beside it; the reduce, which reads the
    /// scratch, comes last. A single-pass decode also writes `out`, and
    /// candle's encoder, which tracks whole buffers, puts a barrier before it.
    pub fn encode<E: Encoder>(&self, enc: &mut E, b: AttentionBuffers<'_, E::Buffer>) {
        let d = &self.dims;
        // The kernels read the sinks only under has_sinks; q stands in.
        let sinks = b.sinks.unwrap_or(b.q);
        // The params with `has_sinks` after them, on the stack (the encode
        // runs for every layer of every step).
        let has_sinks = u32::from(b.sinks.is_some()).to_le_bytes();
        let with_sinks = |params: &[u8]| {
            let mut p = [0u8; PARAMS_BYTES];
            p[..params.len()].copy_from_slice(params);
            p[params.len()..params.len() + 4].copy_from_slice(&has_sinks);
            (p, params.len() + 4)
        };
        let meta = |offset| At { buffer: b.meta, offset };
        let bind_common = |enc: &mut E| {
            bind(enc, 0, b.q, Access::Read);
            bind(enc, 1, b.k_cache, Access::Read);
            bind(enc, 2, b.v_cache, Access::Read);
            bind(enc, 3, meta(self.layout.query_start_loc), Access::Read);
            bind(enc, 4, meta(self.layout.context_lens), Access::Read);
            bind(enc, 5, meta(self.layout.block_tables), Access::Read);
        };
        let threads = [ATTENTION_THREADS, 1, 1];
        let partitioned = self.decode.as_ref().filter(|p| p.max_partitions > 0);
        debug_assert!(partitioned.is_none() || b.scratch.is_some(), "a partitioned decode without scratch");
        let partitioned = partitioned.zip(b.scratch);
        // One threadgroup per kv head (and slice of its group's query heads).
        let group = d.group();
        let slices = group.div_ceil(decode_heads_per_threadgroup(d.head_dim));
        let decode_grid = |p: &DecodePlan| [d.num_kv_heads * slices, p.seqs, p.max_partitions.max(1)];

        if let Some((plan, scratch)) = partitioned {
            let part = |offset| At { buffer: scratch, offset };
            enc.set_kernel(&plan.decode);
            bind_common(enc);
            bind(enc, 6, meta(self.layout.decode_seqs), Access::Read);
            // Unused when partitioned; bound to the scratch so the dispatch
            // does not touch `out`.
            bind(enc, 7, part(plan.scratch.acc), Access::Write);
            bind(enc, 8, part(plan.scratch.acc), Access::Write);
            bind(enc, 9, part(plan.scratch.max), Access::Write);
            bind(enc, 10, part(plan.scratch.sum), Access::Write);
            let (p, n) = with_sinks(&plan.params);
            enc.set_bytes(11, &p[..n]);
            bind(enc, 12, sinks, Access::Read);
            enc.dispatch(decode_grid(plan), threads);
        }

        if let Some(plan) = &self.prefill {
            enc.set_kernel(&plan.prefill);
            bind_common(enc);
            bind(enc, 6, meta(self.layout.items), Access::Read);
            bind(enc, 7, b.out, Access::Write);
            let (p, n) = with_sinks(&plan.params);
            enc.set_bytes(8, &p[..n]);
            bind(enc, 9, sinks, Access::Read);
            enc.dispatch([plan.items, d.num_kv_heads, 1], threads);
        }

        match (&self.decode, partitioned) {
            (_, Some((plan, scratch))) => {
                let part = |offset| At { buffer: scratch, offset };
                if let Some(reduce) = &plan.reduce {
                    enc.set_kernel(reduce);
                    bind(enc, 0, part(plan.scratch.acc), Access::Read);
                    bind(enc, 1, part(plan.scratch.max), Access::Read);
                    bind(enc, 2, part(plan.scratch.sum), Access::Read);
                    bind(enc, 3, meta(self.layout.query_start_loc), Access::Read);
                    bind(enc, 4, meta(self.layout.context_lens), Access::Read);
                    bind(enc, 5, meta(self.layout.decode_seqs), Access::Read);
                    bind(enc, 6, b.out, Access::Write);
                    let (p, n) = with_sinks(&plan.params);
                    enc.set_bytes(7, &p[..n]);
                    bind(enc, 8, sinks, Access::Read);
                    enc.dispatch([d.num_heads, plan.seqs, 1], threads);
                }
            }
            (Some(plan), None) if plan.max_partitions == 0 => {
                enc.set_kernel(&plan.decode);
                bind_common(enc);
                bind(enc, 6, meta(self.layout.decode_seqs), Access::Read);
                // 8-10 are unused in a single pass; bound so none is missing.
                for index in 7..=10 {
                    bind(enc, index, b.out, Access::Write);
                }
                let (p, n) = with_sinks(&plan.params);
                enc.set_bytes(11, &p[..n]);
                bind(enc, 12, sinks, Access::Read);
                enc.dispatch(decode_grid(plan), threads);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the grids of the dispatches encoded.
    #[derive(Default)]
    struct Grids(Vec<(String, [usize; 3])>, Option<String>);

    impl Encoder for Grids {
        type Buffer = ();
        fn set_kernel(&mut self, kernel: &Kernel) {
            self.1 = Some(kernel.name.clone());
        }
        fn set_buffer(&mut self, _: usize, _: &(), _: usize, _: Access) {}
        fn set_bytes(&mut self, _: usize, _: &[u8]) {}
        fn dispatch(&mut self, threadgroups: [usize; 3], _: [usize; 3]) {
            self.0.push((self.1.clone().unwrap_or_default(), threadgroups));
        }
    }

    /// Under GQA a decode threadgroup serves the query heads of one kv head
    /// (up to 8, 4 at head dim 256), so each K/V row is read once for them.
    #[test]
    fn decode_has_a_threadgroup_per_kv_head_not_per_query_head() {
        for (heads, kv_heads, head_dim, want_x) in
            [(32, 8, 128, 8), (16, 8, 64, 8), (8, 1, 64, 1), (16, 1, 64, 2), (12, 2, 256, 4), (4, 4, 32, 4)]
        {
            let meta = AttentionMetadata {
                query_start_loc: vec![0, 1, 2],
                context_lens: vec![5, 600],
                block_tables: vec![vec![0], (1..40).collect()],
                block_size: 16,
                slot_mapping: vec![4, 16 * 38 + 7],
                sliding_window: None,
            };
            let dims = Dims {
                num_tokens: 2,
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim,
                num_blocks: 40,
                block_size: 16,
            };
            let plan = AttentionPlan::new(&meta, dims, (DType::F32, DType::F32), 0.125).unwrap();
            let mut grids = Grids::default();
            let at = At { buffer: &(), offset: 0 };
            let b = AttentionBuffers {
                q: at,
                k_cache: at,
                v_cache: at,
                out: at,
                meta: &(),
                scratch: Some(&()),
                sinks: None,
            };
            plan.encode(&mut grids, b);
            let decode = grids.0.iter().find(|(name, _)| name.starts_with("paged_attention_decode")).unwrap();
            assert_eq!(decode.1, [want_x, 2, 2], "{heads}/{kv_heads} hd {head_dim}");
        }
    }
}
