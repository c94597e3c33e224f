//! The paged KV cache's tensors: per layer, one K and one V block pool.
//!
//! Layout `[num_blocks, block_size, num_kv_heads, head_dim]`: one token's
//! key for one kv head is a contiguous `head_dim` vector (what the attention
//! kernels dot with a query), one block is one contiguous chunk (streamed by
//! the CPU kernel block by block), and the whole pool can be viewed as
//! `[num_slots, num_kv_heads * head_dim]` so a step's new K/V land in their
//! slots with one scatter (slot = block * block_size + offset). The pools
//! are stored as `--kv-cache-dtype` says ([`KvCacheDtype`]): the
//! activations' float type, f16, or q8_0 (u8 rows of `head_dim + 4`), so a
//! block's bytes, and the blocks a budget holds, follow the format.
//! Which block belongs to whom is decided by `engine_core::kv_cache_manager`; this
//! module only owns memory.

use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Storage, Tensor};
use kernels::{Attention, AttentionMetadata, CacheWrite, KvCacheDtype};

use crate::error::{Result, WorkerError};
use crate::models::ModelConfig;
use common::pipeline::LayerRange;

pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// One layer's K and V block pools.
pub struct LayerKvCache {
    pub k: Tensor, // [num_blocks, block_size, num_kv_heads, row_len(head_dim)]
    pub v: Tensor, // [num_blocks, block_size, num_kv_heads, row_len(head_dim)]
}

impl LayerKvCache {
    /// The write of a step's new k/v `[T, kv_heads, head_dim]` into this
    /// layer's pools, at the step's slots.
    pub fn write<'a>(&'a self, k: &'a Tensor, v: &'a Tensor, meta: &'a AttentionMetadata) -> CacheWrite<'a> {
        CacheWrite { k, v, k_cache: &self.k, v_cache: &self.v, slot_mapping: &meta.slot_mapping }
    }

    /// Attention of q `[T, heads, head_dim]` over this layer's pools (with
    /// one sink logit per head where the model has them).
    pub fn attention<'a>(
        &'a self,
        q: &'a Tensor,
        meta: &'a AttentionMetadata,
        scale: f32,
        sinks: Option<&'a [f32]>,
    ) -> Attention<'a> {
        Attention { q, k_cache: &self.k, v_cache: &self.v, meta, scale, sinks }
    }
}

impl LayerKvCache {
    /// Appends block `block`'s K then V, as stored, to `out` (the second
    /// tier's offload; CPU pools only).
    pub fn read_block(&self, block: usize, out: &mut Vec<u8>) -> Result<()> {
        for pool in [&self.k, &self.v] {
            let (storage, layout) = pool.storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                return Err(WorkerError::Unsupported("the KV tier copies CPU block pools only".into()));
            };
            let range = block_range(pool, layout, block)?;
            match cpu {
                CpuStorage::F32(d) => out.extend_from_slice(as_bytes(&d[range])),
                CpuStorage::F16(d) => out.extend_from_slice(as_bytes(&d[range])),
                CpuStorage::BF16(d) => out.extend_from_slice(as_bytes(&d[range])),
                CpuStorage::U8(d) => out.extend_from_slice(&d[range]),
                _ => return Err(WorkerError::KvCache(format!("a {:?} KV pool", pool.dtype()))),
            }
        }
        Ok(())
    }

    /// Writes `bytes` (K then V, as [`read_block`](Self::read_block) gave
    /// them) into block `block`: the tier's restore.
    pub fn write_block(&self, block: usize, bytes: &[u8]) -> Result<()> {
        let half = bytes.len() / 2;
        self.k.inplace_op1(&WriteBlock { block, bytes: &bytes[..half] })?;
        self.v.inplace_op1(&WriteBlock { block, bytes: &bytes[half..] })?;
        Ok(())
    }
}

/// The elements of block `block` of a `[num_blocks, ...]` pool.
fn block_range(pool: &Tensor, layout: &Layout, block: usize) -> Result<std::ops::Range<usize>> {
    let per_block = pool.elem_count() / pool.dim(0)?.max(1);
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(WorkerError::KvCache("a KV pool that is not contiguous".into()));
    };
    let range = start + block * per_block..start + (block + 1) * per_block;
    if range.end > end {
        return Err(WorkerError::KvCache(format!("block {block} past the pool's {} blocks", pool.dim(0)?)));
    }
    Ok(range)
}

fn as_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: T is a plain float type (f32, f16, bf16): every byte of it
    // is initialised, and u8 has no alignment to keep.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

fn as_bytes_mut<T: Copy>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; and every bit pattern is a valid f32, f16
    // or bf16, so any bytes written leave valid values.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

struct WriteBlock<'a> {
    block: usize,
    bytes: &'a [u8],
}

impl InplaceOp1 for WriteBlock<'_> {
    fn name(&self) -> &'static str {
        "kv-write-block"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let elems = layout.shape().elem_count();
        let per_block = elems / layout.dims().first().copied().unwrap_or(1).max(1);
        let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("a KV pool not contiguous") };
        let range = start + self.block * per_block..start + (self.block + 1) * per_block;
        if range.end > end {
            candle_core::bail!("block {} past the pool", self.block);
        }
        let dst = match storage {
            CpuStorage::F32(d) => as_bytes_mut(&mut d[range]),
            CpuStorage::F16(d) => as_bytes_mut(&mut d[range]),
            CpuStorage::BF16(d) => as_bytes_mut(&mut d[range]),
            CpuStorage::U8(d) => &mut d[range],
            _ => candle_core::bail!("a KV pool of another dtype"),
        };
        if dst.len() != self.bytes.len() {
            candle_core::bail!("a KV block of {} bytes into one of {}", self.bytes.len(), dst.len());
        }
        dst.copy_from_slice(self.bytes);
        Ok(())
    }
}

/// How much memory the KV cache may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    Bytes(u64),
    /// A fraction of the memory available when the worker starts.
    FractionOfAvailable(f64),
}

/// Bytes one block takes across all layers, K and V.
pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, format: KvCacheDtype) -> u64 {
    (2 * cfg.num_layers * cfg.num_kv_heads * format.row_bytes(cfg.head_dim) * block_size) as u64
}

/// Number of blocks that fit in `budget`, capped at `max_useful` (more than
/// every sequence at full length, twice over, only wastes memory).
pub fn num_blocks_for_budget(
    cfg: &ModelConfig,
    block_size: usize,
    format: KvCacheDtype,
    budget: KvBudget,
    max_useful: usize,
) -> Result<usize> {
    let bytes = match budget {
        KvBudget::Bytes(b) => b,
        KvBudget::FractionOfAvailable(f) => {
            let available = available_memory_bytes().unwrap_or(4 << 30);
            (available as f64 * f) as u64
        }
    };
    let blocks = (bytes / bytes_per_block(cfg, block_size, format)) as usize;
    if blocks == 0 {
        return Err(WorkerError::KvCache(format!(
            "a budget of {bytes} bytes holds no block ({} bytes each)",
            bytes_per_block(cfg, block_size, format)
        )));
    }
    Ok(blocks.min(max_useful))
}

/// Allocates zeroed block pools for every layer.
pub fn allocate(
    cfg: &ModelConfig,
    num_blocks: usize,
    block_size: usize,
    format: KvCacheDtype,
    device: &Device,
) -> Result<Vec<LayerKvCache>> {
    let shape = (num_blocks, block_size, cfg.num_kv_heads, format.row_len(cfg.head_dim));
    let dtype = format.storage_dtype();
    (0..cfg.num_layers)
        .map(|_| Ok(LayerKvCache { k: Tensor::zeros(shape, dtype, device)?, v: Tensor::zeros(shape, dtype, device)? }))
        .collect()
}

/// The cache format `--kv-cache-dtype` asks for (`None`: auto, the
/// activations' own dtype) on `device`: q8_0 runs on the CPU only.
pub fn resolve_format(
    asked: Option<KvCacheDtype>,
    activations: candle_core::DType,
    device: &Device,
) -> Result<KvCacheDtype> {
    let auto = KvCacheDtype::float(activations)
        .ok_or_else(|| WorkerError::KvCache(format!("no KV cache format for {activations:?} activations")))?;
    match asked {
        None => Ok(auto),
        Some(KvCacheDtype::Q8_0) if !device.is_cpu() => {
            Err(WorkerError::Unsupported("--kv-cache-dtype q8_0 runs on the CPU only; use f16 or auto".into()))
        }
        Some(f @ (KvCacheDtype::F16 | KvCacheDtype::Q8_0)) => Ok(f),
        Some(f) if f == auto => Ok(f),
        Some(f) => Err(WorkerError::Unsupported(format!("a {f} KV cache under {activations:?} activations"))),
    }
}

/// MemAvailable on Linux; total memory on macOS (unified memory); None elsewhere.
pub fn available_memory_bytes() -> Option<u64> {
    if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
        let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        return Some(kib * 1024);
    }
    let out = std::process::Command::new("sysctl").args(["-n", "hw.memsize"]).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// The config a stage's KV cache is sized and allocated from: its own
/// layers only.
pub fn stage_kv_config(cfg: &ModelConfig, layers: LayerRange) -> ModelConfig {
    ModelConfig { num_layers: layers.len(), ..cfg.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same budget holds 2x the tokens of f32 in f16 and 3.76x in q8_0
    /// (TinyLlama: head_dim 64, rows of 68 bytes against 256).
    #[test]
    fn a_budget_holds_more_blocks_in_narrower_formats() -> Result<()> {
        let cfg = common::model::random_preset("tinyllama-1.1b").expect("a preset");
        let budget = KvBudget::Bytes(1 << 30);
        let blocks = |f| num_blocks_for_budget(&cfg, 16, f, budget, usize::MAX);
        let (f32, f16, q8) = (blocks(KvCacheDtype::F32)?, blocks(KvCacheDtype::F16)?, blocks(KvCacheDtype::Q8_0)?);
        assert_eq!(bytes_per_block(&cfg, 16, KvCacheDtype::F32), 16 * cfg.kv_bytes_per_token(4) as u64);
        assert_eq!(f16, 2 * f32);
        assert!((q8 as f64 / f32 as f64 - 256.0 / 68.0).abs() < 0.01, "{q8} vs {f32}");
        Ok(())
    }

    /// A block read out and written into another block of another pool
    /// holds the same K and V, in every format.
    #[test]
    fn a_block_copied_out_and_back_is_the_same() -> Result<()> {
        use candle_core::DType;
        let cfg = common::model::random_preset("smollm-135m").expect("a preset");
        for format in [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Q8_0] {
            let cpu = Device::Cpu;
            let a = allocate(&cfg, 3, 16, format, &cpu)?;
            let b = allocate(&cfg, 3, 16, format, &cpu)?;
            let shape = a[0].k.dims().to_vec();
            let noise = Tensor::rand(0f32, 100f32, shape.as_slice(), &cpu)?.to_dtype(format.storage_dtype())?;
            a[0].k.slice_set(&noise, 0, 0)?;
            a[0].v.slice_set(&noise.affine(0.5, 1.0)?, 0, 0)?;
            let mut bytes = Vec::new();
            a[0].read_block(1, &mut bytes)?;
            assert_eq!(bytes.len() as u64, bytes_per_block(&cfg, 16, format) / cfg.num_layers as u64);
            b[0].write_block(2, &bytes)?;
            for (x, y) in [(&a[0].k, &b[0].k), (&a[0].v, &b[0].v)] {
                let (x, y) = (x.narrow(0, 1, 1)?.to_dtype(DType::F32)?, y.narrow(0, 2, 1)?.to_dtype(DType::F32)?);
                assert_eq!(x.flatten_all()?.to_vec1::<f32>()?, y.flatten_all()?.to_vec1::<f32>()?, "{format}");
            }
            assert_eq!(b[0].k.narrow(0, 0, 2)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?, 0.0);
        }
        Ok(())
    }

    #[test]
    fn q8_0_is_refused_off_the_cpu_and_auto_follows_the_activations() -> Result<()> {
        use candle_core::DType;
        let cpu = Device::Cpu;
        assert_eq!(resolve_format(None, DType::F32, &cpu)?, KvCacheDtype::F32);
        assert_eq!(resolve_format(None, DType::F16, &cpu)?, KvCacheDtype::F16);
        assert_eq!(resolve_format(Some(KvCacheDtype::Q8_0), DType::F32, &cpu)?, KvCacheDtype::Q8_0);
        assert!(resolve_format(Some(KvCacheDtype::BF16), DType::F32, &cpu).is_err());
        let caches =
            allocate(&common::model::random_preset("smollm-135m").expect("a preset"), 2, 16, KvCacheDtype::Q8_0, &cpu)?;
        assert_eq!(caches[0].k.dims(), [2, 16, 3, 64 + kernels::kv_dtype::Q8_PARAM_BYTES]);
        Ok(())
    }
}
