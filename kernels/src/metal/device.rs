//! The Metal kernels on candle's Metal device (macOS): the sources are
//! embedded, compiled once per GPU and their pipelines cached per kernel
//! name; [`plan`](super::plan) plans every call and encodes it through
//! candle's command encoder, into candle's current command buffer as
//! candle-nn's custom ops do, so no op here waits for the GPU. Every input
//! is checked on the host (`Attention::check`, `CacheWrite::check`, the
//! plan's own limits) before anything is encoded, so a bad batch is a
//! `KernelError::Invalid`, never a stray write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::metal_backend::DeviceId;
use candle_core::{
    CpuStorage, CustomOp3, DType, Layout, MetalDevice, MetalError, MetalStorage, Shape, Storage, Tensor,
};
use candle_metal_kernels::metal::{Buffer, ComputeCommandEncoder, ComputePipeline, Library};
use objc2_metal::{MTLCompileOptions, MTLMathMode, MTLSize};

use super::plan::{
    Access, Allocator, At, AttentionBuffers, AttentionPlan, CacheWriteBuffers, CacheWritePlan, Encoder, HEAD_DIMS,
    Kernel, Source, StepCache, dtype_name,
};
use crate::{Attention, CacheWrite, KernelError, Result};

fn invalid<T>(message: String) -> Result<T> {
    Err(KernelError::Invalid(message))
}

fn metal_error(e: candle_metal_kernels::MetalKernelError) -> KernelError {
    KernelError::Candle(candle_core::Error::Metal(MetalError::from(e)))
}

/// Whether the Metal attention takes this dtype and head dim on `device`;
/// the dispatcher sends anything else to the portable path.
pub fn supports(device: &MetalDevice, dtype: DType, head_dim: usize) -> bool {
    supports_dtype(device, dtype) && HEAD_DIMS.contains(&head_dim)
}

/// Whether the Metal kernels take this dtype on `device`: f32 and f16
/// always, bf16 where the Metal language has `bfloat` (3.1, macOS 14).
pub fn supports_dtype(device: &MetalDevice, dtype: DType) -> bool {
    match dtype {
        DType::BF16 => has_bfloat(device).unwrap_or(false),
        other => dtype_name(other).is_some(),
    }
}

/// A clear error for bf16 where the kernels were built without it (the
/// sources instantiate bfloat only under `__HAVE_BFLOAT__`), instead of a
/// missing-function failure when the pipeline is made.
fn check_dtype(device: &MetalDevice, dtype: DType) -> Result<()> {
    if dtype == DType::BF16 && !has_bfloat(device)? {
        return invalid(
            "bf16 needs the Metal 3.1 language (macOS 14 or later), which this system lacks; use f16 or f32".into(),
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Compiled kernels

/// Libraries and pipeline states of one GPU, built on first use.
#[derive(Default)]
struct Compiled {
    libraries: HashMap<Source, Library>,
    pipelines: HashMap<String, ComputePipeline>,
}

/// Keyed by the GPU's registry id, not candle's per-instance DeviceId:
/// libraries and pipelines belong to the MTLDevice, which every candle
/// device on that GPU shares, so a new candle device reuses them.
fn with_compiled<T>(device: &MetalDevice, f: impl FnOnce(&mut Compiled) -> Result<T>) -> Result<T> {
    static CACHE: OnceLock<Mutex<HashMap<u64, Compiled>>> = OnceLock::new();
    // A panic while compiling leaves the maps consistent (inserts are whole),
    // so a poisoned lock is still usable.
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    f(cache.entry(device.registry_id()).or_default())
}

fn library(device: &MetalDevice, compiled: &mut Compiled, source: Source) -> Result<Library> {
    if let Some(library) = compiled.libraries.get(&source) {
        return Ok(library.clone());
    }
    // The sampler compares against -inf and reads NaN logits as -inf, which
    // fast math (Metal's default) may assume away.
    let options = (source == Source::Sample).then(|| {
        let options = MTLCompileOptions::new();
        options.setMathMode(MTLMathMode::Safe);
        options
    });
    let library =
        device.metal_device().new_library_with_source(source.code(), options.as_deref()).map_err(metal_error)?;
    compiled.libraries.insert(source, library.clone());
    Ok(library)
}

/// Whether the compiled kernels include the bf16 instantiations.
fn has_bfloat(device: &MetalDevice) -> Result<bool> {
    with_compiled(device, |compiled| {
        Ok(library(device, compiled, Source::Cache)?.get_function("reshape_and_cache_bf16", None).is_ok())
    })
}

/// The pipelines of `kernels`, compiled on first use, each checked to run
/// its threads per threadgroup.
pub(super) fn pipelines<'k>(
    device: &MetalDevice,
    kernels: impl IntoIterator<Item = &'k Kernel>,
) -> Result<HashMap<String, ComputePipeline>> {
    with_compiled(device, |compiled| {
        let mut out = HashMap::new();
        for k in kernels {
            let p = match compiled.pipelines.get(&k.name) {
                Some(p) => p.clone(),
                None => {
                    let function =
                        library(device, compiled, k.source)?.get_function(&k.name, None).map_err(metal_error)?;
                    let p = device
                        .metal_device()
                        .new_compute_pipeline_state_with_function(&function)
                        .map_err(metal_error)?;
                    compiled.pipelines.insert(k.name.clone(), p.clone());
                    p
                }
            };
            let max = p.max_total_threads_per_threadgroup();
            if max < k.threads {
                return invalid(format!(
                    "{} runs {} threads per threadgroup, this GPU allows {max}",
                    k.name, k.threads
                ));
            }
            out.insert(k.name.clone(), p);
        }
        Ok(out)
    })
}

// ---------------------------------------------------------------------------
// The planning code's traits on candle

struct CandleAllocator<'a>(&'a MetalDevice);

impl Allocator for CandleAllocator<'_> {
    type Buffer = Arc<Buffer>;

    fn upload(&mut self, bytes: &[u8]) -> Result<Arc<Buffer>> {
        // newBufferWithBytes copies at creation: no sync needed.
        Ok(self.0.new_buffer_with_data(bytes)?)
    }

    fn scratch(&mut self, len: usize) -> Result<Arc<Buffer>> {
        // Outside candle's pool: the step cache keeps it for later steps.
        Ok(self.0.new_private_buffer(len, DType::U8, "tinyvllm-scratch")?)
    }
}

struct CandleEncoder<'a> {
    enc: &'a ComputeCommandEncoder,
    pipelines: &'a HashMap<String, ComputePipeline>,
}

impl Encoder for CandleEncoder<'_> {
    type Buffer = Buffer;

    fn set_kernel(&mut self, kernel: &Kernel) {
        // Every kernel of the plan was compiled before encoding began.
        debug_assert!(self.pipelines.contains_key(&kernel.name), "{} not compiled", kernel.name);
        if let Some(p) = self.pipelines.get(&kernel.name) {
            self.enc.set_compute_pipeline_state(p);
        }
    }

    fn set_buffer(&mut self, index: usize, buffer: &Buffer, offset: usize, access: Access) {
        set_buffer(self.enc, index, buffer, offset, access);
    }

    fn set_bytes(&mut self, index: usize, bytes: &[u8]) {
        self.enc.set_bytes_directly(index, bytes.len(), bytes.as_ptr().cast());
    }

    fn dispatch(&mut self, threadgroups: [usize; 3], threads: [usize; 3]) {
        dispatch(self.enc, threadgroups, threads);
    }
}

/// Binds `buffer` as an input or an output: candle's encoder tells them
/// apart to put a barrier only before a dispatch that reads or rewrites
/// what an earlier one wrote.
pub(super) fn set_buffer(enc: &ComputeCommandEncoder, index: usize, buffer: &Buffer, offset: usize, access: Access) {
    match access {
        Access::Read => enc.set_input_buffer(index, Some(buffer), offset),
        Access::Write => enc.set_output_buffer(index, Some(buffer), offset),
    }
}

pub(super) fn dispatch(enc: &ComputeCommandEncoder, threadgroups: [usize; 3], threads: [usize; 3]) {
    let size = |s: [usize; 3]| MTLSize { width: s[0], height: s[1], depth: s[2] };
    enc.dispatch_thread_groups(size(threadgroups), size(threads));
}

/// Runs `f` on `device`'s step cache. Keyed by candle's DeviceId: the cached
/// scratch is ordered by that device's command queue only.
fn with_step_cache<T>(
    device: &MetalDevice,
    f: impl FnOnce(&mut StepCache<Arc<Buffer>>, &mut CandleAllocator) -> Result<T>,
) -> Result<T> {
    static STEPS: OnceLock<Mutex<HashMap<DeviceId, StepCache<Arc<Buffer>>>>> = OnceLock::new();
    let mut steps = STEPS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    f(steps.entry(device.id()).or_default(), &mut CandleAllocator(device))
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

    fn at(&self) -> At<'a, Buffer> {
        At { buffer: self.buffer, offset: self.start }
    }

    fn overlaps(&self, other: &Region) -> bool {
        self.buffer == other.buffer && self.start < other.end && other.start < self.end
    }
}

// ---------------------------------------------------------------------------
// KV write

/// Writes k/v `[T, kv_heads, head_dim]` into their slots of the pools
/// `[num_blocks, block_size, kv_heads, head_dim]`, K and V in one dispatch.
pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    let CacheWrite { k, v, k_cache, v_cache, slot_mapping } = *w;
    let num_slots = w.check()?;
    let (t, kv_heads, head_dim) = k.dims3()?;
    let Some(plan) = CacheWritePlan::new(t, kv_heads, head_dim, num_slots, (k.dtype(), k_cache.dtype()))? else {
        return Ok(());
    };
    let device = k.device().as_metal_device()?;
    check_dtype(device, k.dtype())?;
    let pipelines = pipelines(device, [plan.kernel()])?;
    let slots = with_step_cache(device, |cache, alloc| cache.slots(alloc, slot_mapping))?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);

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
    let mut enc = CandleEncoder { enc: guard.as_ref(), pipelines: &pipelines };
    plan.encode(
        &mut enc,
        CacheWriteBuffers {
            k: src_k.at(),
            v: src_v.at(),
            k_cache: dst_k.at(),
            v_cache: dst_v.at(),
            slots: At { buffer: &*slots, offset: 0 },
        },
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Attention

/// A planned attention call with its step's buffers and compiled pipelines.
struct MetalAttention {
    plan: Arc<AttentionPlan>,
    meta: Arc<Buffer>,
    scratch: Option<Arc<Buffer>>,
    /// Each head's sink logit (gpt-oss), f32.
    sinks: Option<Arc<Buffer>>,
    pipelines: HashMap<String, ComputePipeline>,
    dtype: DType,
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
        let device = qs.device();
        let (q, k, v) = (Region::of(qs, ql, "q")?, Region::of(ks, kl, "k_cache")?, Region::of(vs, vl, "v_cache")?);
        let elems = self.plan.out_elems();
        // Every output row belongs to a decode or a prefill sequence, so the
        // kernels write all of it: no need to zero it.
        let out = device.new_buffer(elems, self.dtype, "paged-attention")?;
        let guard = device.command_encoder()?;
        let mut enc = CandleEncoder { enc: guard.as_ref(), pipelines: &self.pipelines };
        self.plan.encode(
            &mut enc,
            AttentionBuffers {
                q: q.at(),
                k_cache: k.at(),
                v_cache: v.at(),
                out: At { buffer: &*out, offset: 0 },
                meta: &*self.meta,
                scratch: self.scratch.as_deref(),
                sinks: self.sinks.as_deref().map(|buffer| At { buffer, offset: 0 }),
            },
        );
        drop(guard);
        let d = ql.dims();
        Ok((MetalStorage::new(out, device.clone(), elems, self.dtype), Shape::from(d)))
    }
}

/// q: `[T, heads, head_dim]`; caches `[blocks, block_size, kv_heads,
/// head_dim]` -> `[T, heads, head_dim]`, all on one Metal device.
pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    let Attention { q, k_cache, v_cache, meta, scale, sinks } = *a;
    let dims = a.check()?;
    let device = q.device().as_metal_device()?;
    let (plan, upload, scratch, sinks) = with_step_cache(device, |cache, alloc| {
        let (plan, upload, scratch) = cache.attention(alloc, meta, dims, (q.dtype(), k_cache.dtype()), scale)?;
        let sinks = match sinks {
            Some(s) => Some(alloc.upload(&s.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())?),
            None => None,
        };
        Ok((plan, upload, scratch, sinks))
    })?;
    if dims.num_tokens == 0 {
        return Ok(Tensor::zeros((0, dims.num_heads, dims.head_dim), q.dtype(), q.device())?);
    }
    check_dtype(device, q.dtype())?;
    let pipelines = pipelines(device, plan.kernels())?;
    let op = MetalAttention { plan, meta: upload, scratch, sinks, pipelines, dtype: q.dtype() };
    Ok(q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)?)
}
