//! Paged attention and the KV write on Apple GPUs (macOS only), with our own
//! Metal kernels beside this file: `cache.metal` (reshape_and_cache),
//! `paged_attention.metal` (decode, partitioned like vLLM's
//! paged_attention_v2, plus its reduce) and `prefill_attention.metal`
//! (flash-attention-style chunked prefill). tools/check_metal_syntax.sh
//! parses them on any machine; Apple's compiler builds them at run time.
//!
//! The sources are embedded, compiled once per GPU and their pipelines
//! cached per (kernel, dtype, head_dim). Dispatches go into candle's current
//! command buffer, as candle-nn's custom ops do, so no op here waits for the
//! GPU. Every input is checked on the host (`Attention::check`, plus what the
//! kernels need: dtype, head dim, 32-bit index range) before anything is
//! encoded, so a bad batch is a `KernelError::Invalid`, never a stray write.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp3, DType, Layout, MetalDevice, MetalError, MetalStorage, Shape, Storage, Tensor,
};
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline, Library};
use objc2_metal::MTLSize;

use crate::{Attention, AttentionMetadata, CacheWrite, Dims, KernelError, Result};

/// Head dims with instantiated kernels: multiples of the 32-lane SIMD group,
/// so every lane holds the same share of a row.
pub const HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];
/// Keys per decode partition (`kPartitionSize` in paged_attention.metal).
pub const PARTITION_SIZE: usize = 512;
/// Flattened (query, head) rows per prefill work item (`kRows`).
const PREFILL_ROWS: usize = 16;
/// Threads per threadgroup of the attention kernels: 4 SIMD groups of 32,
/// which the kernels assume.
const ATTENTION_THREADS: usize = 128;
/// Most threads per threadgroup of the cache write (one token per group).
const CACHE_WRITE_THREADS: usize = 256;

/// Whether the Metal attention takes this dtype and head dim; the
/// dispatcher sends anything else to the portable path.
pub fn supports(dtype: DType, head_dim: usize) -> bool {
    supports_dtype(dtype) && HEAD_DIMS.contains(&head_dim)
}

/// Whether the Metal kernels take this dtype (f32, f16, bf16).
pub fn supports_dtype(dtype: DType) -> bool {
    dtype_name(dtype).is_some()
}

fn dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::F16 => Some("f16"),
        DType::BF16 => Some("bf16"),
        _ => None,
    }
}

fn invalid<T>(message: String) -> Result<T> {
    Err(KernelError::Invalid(message))
}

fn metal_error(e: candle_metal_kernels::MetalKernelError) -> KernelError {
    KernelError::Candle(candle_core::Error::Metal(MetalError::from(e)))
}

/// The kernels index with 32-bit integers; larger sizes are refused.
fn to_u32(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x)
        .map_err(|_| KernelError::Invalid(format!("{what}: {x} is past the Metal kernels' 32-bit indexing")))
}

// ---------------------------------------------------------------------------
// Compiled kernels

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    Cache,
    Decode,
    Prefill,
}

impl Source {
    fn code(self) -> &'static str {
        match self {
            Source::Cache => include_str!("cache.metal"),
            Source::Decode => include_str!("paged_attention.metal"),
            Source::Prefill => include_str!("prefill_attention.metal"),
        }
    }
}

/// Libraries and pipeline states of one GPU, built on first use.
#[derive(Default)]
struct Compiled {
    libraries: HashMap<Source, Library>,
    pipelines: HashMap<String, ComputePipeline>,
}

/// The pipeline of kernel `name` from `source`, compiling it on first use.
fn pipeline(device: &MetalDevice, source: Source, name: String) -> Result<ComputePipeline> {
    // Keyed by the GPU's registry id, not candle's per-instance DeviceId:
    // libraries and pipelines belong to the MTLDevice, which every candle
    // device on that GPU shares, so a new candle device reuses them.
    static CACHE: OnceLock<Mutex<HashMap<u64, Compiled>>> = OnceLock::new();
    // A panic while compiling leaves the maps consistent (inserts are whole),
    // so a poisoned lock is still usable.
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let compiled = cache.entry(device.registry_id()).or_default();
    if let Some(p) = compiled.pipelines.get(&name) {
        return Ok(p.clone());
    }
    let library = match compiled.libraries.get(&source) {
        Some(library) => library.clone(),
        None => {
            let library = device.metal_device().new_library_with_source(source.code(), None).map_err(metal_error)?;
            compiled.libraries.insert(source, library.clone());
            library
        }
    };
    let function = library.get_function(&name, None).map_err(metal_error)?;
    let p = device.metal_device().new_compute_pipeline_state_with_function(&function).map_err(metal_error)?;
    compiled.pipelines.insert(name, p.clone());
    Ok(p)
}

/// A pipeline that can run `threads` threads per threadgroup.
fn pipeline_for(device: &MetalDevice, source: Source, name: String, threads: usize) -> Result<ComputePipeline> {
    let p = pipeline(device, source, name.clone())?;
    let max = p.max_total_threads_per_threadgroup();
    if max < threads {
        return invalid(format!("{name} runs {threads} threads per threadgroup, this GPU allows {max}"));
    }
    Ok(p)
}

fn size(width: usize, height: usize, depth: usize) -> MTLSize {
    MTLSize { width, height, depth }
}

/// A contiguous tensor's buffer and the byte range of its elements.
struct Region<'a> {
    buffer: &'a Buffer,
    start: usize,
    end: usize,
}

impl<'a> Region<'a> {
    fn of(storage: &'a MetalStorage, layout: &Layout, what: &str) -> candle_core::Result<Self> {
        let Some((first, last)) = layout.contiguous_offsets() else {
            candle_core::bail!("metal kernels: {what} must be contiguous");
        };
        let elem = storage.dtype().size_in_bytes();
        Ok(Self { buffer: storage.buffer(), start: first * elem, end: last * elem })
    }

    fn overlaps(&self, other: &Region) -> bool {
        self.buffer == other.buffer && self.start < other.end && other.start < self.end
    }
}

fn bind_in(enc: &ComputeCommandEncoder, index: usize, buffer: &Buffer, offset: usize) {
    enc.set_input_buffer(index, Some(buffer), offset);
}

fn bind_out(enc: &ComputeCommandEncoder, index: usize, buffer: &Buffer, offset: usize) {
    enc.set_output_buffer(index, Some(buffer), offset);
}

// ---------------------------------------------------------------------------
// KV write

/// `CacheWriteParams` in cache.metal.
#[repr(C)]
#[allow(dead_code)] // the fields are read by the GPU only
struct CacheWriteParams {
    row: u32,
    num_slots: u32,
}

/// Writes k/v `[T, kv_heads, head_dim]` into their slots of the pools
/// `[num_blocks, block_size, kv_heads, head_dim]`, K and V in one dispatch.
pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    let num_slots = w.check()?;
    let (t, kv_heads, head_dim) = k.dims3()?;
    let Some(name) = dtype_name(k.dtype()) else {
        return invalid(format!("Metal reshape_and_cache takes f32, f16 or bf16, not {:?}", k.dtype()));
    };
    let row = kv_heads * head_dim;
    if t == 0 || row == 0 {
        return Ok(());
    }
    let params =
        CacheWriteParams { row: to_u32(row, "kv row elements")?, num_slots: to_u32(num_slots, "cache slots")? };
    to_u32(num_slots * row, "cache elements")?;
    to_u32(t * row, "new k/v elements")?;
    let device = k.device().as_metal_device()?;
    let threads = CACHE_WRITE_THREADS.min(row.next_multiple_of(32));
    let p = pipeline_for(device, Source::Cache, format!("reshape_and_cache_{name}"), threads)?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let slots = device.new_buffer_with_data(slot_mapping)?;

    // candle has no in-place op with two destinations, so the pools are
    // reached through read guards and written by the GPU, as an InplaceOp's
    // metal_fwd would: the write is ordered on candle's queue like any op,
    // and no host memory is touched.
    let (k_guard, kl) = k.storage_and_layout();
    let (v_guard, vl) = v.storage_and_layout();
    let (kc_guard, kcl) = k_cache.storage_and_layout();
    let (vc_guard, vcl) = v_cache.storage_and_layout();
    let (Storage::Metal(ks), Storage::Metal(vs), Storage::Metal(kcs), Storage::Metal(vcs)) =
        (&*k_guard, &*v_guard, &*kc_guard, &*vc_guard)
    else {
        return invalid("Metal reshape_and_cache needs all four tensors on the Metal device".into());
    };
    let src_k = Region::of(ks, kl, "k")?;
    let src_v = Region::of(vs, vl, "v")?;
    let dst_k = Region::of(kcs, kcl, "k_cache")?;
    let dst_v = Region::of(vcs, vcl, "v_cache")?;
    // One dispatch writes both pools while reading k and v: overlapping
    // memory would make the result depend on thread order.
    if dst_k.overlaps(&dst_v) {
        return invalid("k_cache and v_cache share memory".into());
    }
    if [&src_k, &src_v].iter().any(|s| s.overlaps(&dst_k) || s.overlaps(&dst_v)) {
        return invalid("new k/v share memory with the cache they are written into".into());
    }

    let guard = device.command_encoder()?;
    let enc: &ComputeCommandEncoder = guard.as_ref();
    enc.set_compute_pipeline_state(&p);
    bind_in(enc, 0, src_k.buffer, src_k.start);
    bind_in(enc, 1, src_v.buffer, src_v.start);
    bind_out(enc, 2, dst_k.buffer, dst_k.start);
    bind_out(enc, 3, dst_v.buffer, dst_v.start);
    bind_in(enc, 4, &slots, 0);
    enc.set_bytes(5, &params);
    enc.dispatch_thread_groups(size(t, 1, 1), size(threads, 1, 1));
    Ok(())
}

// ---------------------------------------------------------------------------
// Attention

/// `DecodeParams` in paged_attention.metal.
#[repr(C)]
#[allow(dead_code)] // the fields are read by the GPU only
struct DecodeParams {
    num_heads: u32,
    num_kv_heads: u32,
    block_size: u32,
    max_blocks: u32,
    sliding_window: u32,
    max_partitions: u32,
    scale: f32,
}

/// `PrefillParams` in prefill_attention.metal.
#[repr(C)]
#[allow(dead_code)] // the fields are read by the GPU only
struct PrefillParams {
    num_heads: u32,
    num_kv_heads: u32,
    block_size: u32,
    max_blocks: u32,
    sliding_window: u32,
    scale: f32,
}

/// The decode sequences (q_len 1), their parameters and pipelines.
struct DecodePlan {
    seqs: Vec<u32>,
    /// Partitions per (sequence, head) in the scratch buffers; 0 when every
    /// context fits one partition and a single pass writes the output.
    max_partitions: usize,
    params: DecodeParams,
    decode: ComputePipeline,
    reduce: Option<ComputePipeline>,
}

/// The prefill work items, their parameters and pipeline.
struct PrefillPlan {
    /// `[n, 2]`: (sequence, first flattened row), rows `PREFILL_ROWS` apart.
    items: Vec<u32>,
    params: PrefillParams,
    prefill: ComputePipeline,
}

/// Everything the dispatches need besides the tensors, checked and built on
/// the host before anything is encoded.
struct MetalAttention {
    dims: Dims,
    dtype: DType,
    query_start_loc: Vec<u32>,
    context_lens: Vec<u32>,
    /// `[S, max_blocks]`: each table cut to the blocks its context uses (all
    /// checked to be in range), padded with 0.
    block_tables: Vec<u32>,
    decode: Option<DecodePlan>,
    prefill: Option<PrefillPlan>,
}

impl MetalAttention {
    fn new(device: &MetalDevice, meta: &AttentionMetadata, dims: Dims, dtype: DType, scale: f32) -> Result<Self> {
        let Some(name) = dtype_name(dtype) else {
            return invalid(format!("Metal paged attention takes f32, f16 or bf16, not {dtype:?}"));
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
        let mut block_tables = vec![0u32; n * max_blocks];
        for s in 0..n {
            let used = ctx(s).div_ceil(bs);
            block_tables[s * max_blocks..][..used].copy_from_slice(&meta.block_tables[s][..used]);
        }

        let group = dims.num_heads / dims.num_kv_heads;
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

        // A window at least as long as every context hides nothing; passing
        // it as 0 keeps the kernels' window arithmetic in range.
        let max_ctx = (0..n).map(ctx).max().unwrap_or(0);
        let window = match meta.sliding_window {
            Some(w) if w < max_ctx => to_u32(w, "sliding window")?,
            _ => 0,
        };
        let (num_heads, num_kv_heads) = (to_u32(dims.num_heads, "heads")?, to_u32(dims.num_kv_heads, "kv heads")?);
        let (block_size, max_blocks) = (to_u32(bs, "block size")?, to_u32(max_blocks, "blocks per sequence")?);

        let decode = if decode_seqs.is_empty() {
            None
        } else {
            let max_partitions =
                if max_decode_ctx > PARTITION_SIZE { max_decode_ctx.div_ceil(PARTITION_SIZE) } else { 0 };
            to_u32(decode_seqs.len() * dims.num_heads * max_partitions * hd, "decode scratch elements")?;
            let kernel =
                |k: &str| pipeline_for(device, Source::Decode, format!("{k}_{name}_hd{hd}"), ATTENTION_THREADS);
            let params = DecodeParams {
                num_heads,
                num_kv_heads,
                block_size,
                max_blocks,
                sliding_window: window,
                max_partitions: to_u32(max_partitions, "partitions")?,
                scale,
            };
            Some(DecodePlan {
                seqs: decode_seqs,
                max_partitions,
                params,
                decode: kernel("paged_attention_decode")?,
                reduce: if max_partitions > 0 { Some(kernel("paged_attention_reduce")?) } else { None },
            })
        };
        let prefill = if items.is_empty() {
            None
        } else {
            let params =
                PrefillParams { num_heads, num_kv_heads, block_size, max_blocks, sliding_window: window, scale };
            let name = format!("paged_attention_prefill_{name}_hd{hd}");
            Some(PrefillPlan {
                items,
                params,
                prefill: pipeline_for(device, Source::Prefill, name, ATTENTION_THREADS)?,
            })
        };

        Ok(Self {
            dims,
            dtype,
            query_start_loc: meta.query_start_loc.clone(),
            context_lens: meta.context_lens.clone(),
            block_tables,
            decode,
            prefill,
        })
    }
}

impl CustomOp3 for MetalAttention {
    fn name(&self) -> &'static str {
        "metal-paged-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the Metal paged attention runs on Metal tensors only")
    }

    fn metal_fwd(
        &self,
        qs: &MetalStorage,
        ql: &Layout,
        ks: &MetalStorage,
        kl: &Layout,
        vs: &MetalStorage,
        vl: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        let d = self.dims;
        let device = qs.device();
        let (q, k, v) = (Region::of(qs, ql, "q")?, Region::of(ks, kl, "k_cache")?, Region::of(vs, vl, "v_cache")?);
        let elems = d.num_tokens * d.num_heads * d.head_dim;
        // Every output row belongs to a decode or a prefill sequence, so the
        // kernels write all of it: no need to zero it.
        let out = device.new_buffer(elems, self.dtype, "paged-attention")?;
        // Uploads copy at creation (newBufferWithBytes): no sync needed.
        let query_start_loc = device.new_buffer_with_data(&self.query_start_loc)?;
        let context_lens = device.new_buffer_with_data(&self.context_lens)?;
        let block_tables = device.new_buffer_with_data(&self.block_tables)?;

        // Decode scratch, allocated before the encoder is taken.
        let decode = match &self.decode {
            Some(plan) => {
                let seqs = device.new_buffer_with_data(&plan.seqs)?;
                let scratch = if plan.max_partitions > 0 {
                    let rows = plan.seqs.len() * d.num_heads * plan.max_partitions;
                    Some((
                        device.new_buffer(rows * d.head_dim, DType::F32, "pa-partial-acc")?,
                        device.new_buffer(rows, DType::F32, "pa-partial-max")?,
                        device.new_buffer(rows, DType::F32, "pa-partial-sum")?,
                    ))
                } else {
                    None
                };
                Some((plan, seqs, scratch))
            }
            None => None,
        };
        let items = match &self.prefill {
            Some(plan) => Some((plan, device.new_buffer_with_data(&plan.items)?)),
            None => None,
        };

        let guard = device.command_encoder()?;
        let enc: &ComputeCommandEncoder = guard.as_ref();
        let bind_common = |enc: &ComputeCommandEncoder| {
            bind_in(enc, 0, q.buffer, q.start);
            bind_in(enc, 1, k.buffer, k.start);
            bind_in(enc, 2, v.buffer, v.start);
            bind_in(enc, 3, &query_start_loc, 0);
            bind_in(enc, 4, &context_lens, 0);
            bind_in(enc, 5, &block_tables, 0);
        };

        if let Some((plan, seqs, scratch)) = &decode {
            enc.set_compute_pipeline_state(&plan.decode);
            bind_common(enc);
            bind_in(enc, 6, seqs, 0);
            bind_out(enc, 7, &out, 0);
            match scratch {
                Some((acc, max, sum)) => {
                    bind_out(enc, 8, acc, 0);
                    bind_out(enc, 9, max, 0);
                    bind_out(enc, 10, sum, 0);
                }
                // Unused in a single pass; bound so that no argument is missing.
                None => (8..=10).for_each(|i| bind_out(enc, i, &out, 0)),
            }
            enc.set_bytes(11, &plan.params);
            let parts = plan.max_partitions.max(1);
            enc.dispatch_thread_groups(size(d.num_heads, plan.seqs.len(), parts), size(ATTENTION_THREADS, 1, 1));

            if let (Some(reduce), Some((acc, max, sum))) = (&plan.reduce, scratch) {
                // Reading the scratch makes candle's encoder put a barrier
                // between the two dispatches.
                enc.set_compute_pipeline_state(reduce);
                bind_in(enc, 0, acc, 0);
                bind_in(enc, 1, max, 0);
                bind_in(enc, 2, sum, 0);
                bind_in(enc, 3, &query_start_loc, 0);
                bind_in(enc, 4, &context_lens, 0);
                bind_in(enc, 5, seqs, 0);
                bind_out(enc, 6, &out, 0);
                enc.set_bytes(7, &plan.params);
                enc.dispatch_thread_groups(size(d.num_heads, plan.seqs.len(), 1), size(ATTENTION_THREADS, 1, 1));
            }
        }

        if let Some((plan, items)) = &items {
            enc.set_compute_pipeline_state(&plan.prefill);
            bind_common(enc);
            bind_in(enc, 6, items, 0);
            bind_out(enc, 7, &out, 0);
            enc.set_bytes(8, &plan.params);
            let num_items = plan.items.len() / 2;
            enc.dispatch_thread_groups(size(num_items, d.num_kv_heads, 1), size(ATTENTION_THREADS, 1, 1));
        }
        drop(guard);

        let shape = Shape::from((d.num_tokens, d.num_heads, d.head_dim));
        Ok((MetalStorage::new(out, device.clone(), elems, self.dtype), shape))
    }
}

/// q: `[T, heads, head_dim]`; caches `[blocks, block_size, kv_heads,
/// head_dim]` -> `[T, heads, head_dim]`, all on one Metal device.
pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    let Attention { q, k_cache, v_cache, meta, scale } = *a;
    let dims = a.check()?;
    let device = q.device().as_metal_device()?;
    let op = MetalAttention::new(device, meta, dims, q.dtype(), scale)?;
    if dims.num_tokens == 0 {
        return Ok(Tensor::zeros((0, dims.num_heads, dims.head_dim), q.dtype(), q.device())?);
    }
    Ok(q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)?)
}
