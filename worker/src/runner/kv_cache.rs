//! The paged KV cache's tensors: per layer, one K and one V block pool.
//!
//! Layout `[num_blocks, block_size, num_kv_heads, head_dim]`: one token's
//! key for one kv head is a contiguous `head_dim` vector (what the attention
//! kernels dot with a query), one block is one contiguous chunk (streamed by
//! the CPU kernel block by block), and the whole pool can be viewed as
//! `[num_slots, num_kv_heads * head_dim]` so a step's new K/V land in their
//! slots with one scatter (slot = block * block_size + offset).
//! Which block belongs to whom is decided by `engine_core::kv_cache_manager`; this
//! module only owns memory.

use candle_core::{DType, Device, Tensor};
use kernels::{Attention, AttentionMetadata, CacheWrite};

use crate::error::{Result, WorkerError};
use crate::models::ModelConfig;

pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// One layer's K and V block pools.
pub struct LayerKvCache {
    pub k: Tensor, // [num_blocks, block_size, num_kv_heads, head_dim]
    pub v: Tensor, // [num_blocks, block_size, num_kv_heads, head_dim]
}

impl LayerKvCache {
    /// The write of a step's new k/v `[T, kv_heads, head_dim]` into this
    /// layer's pools, at the step's slots.
    pub fn write<'a>(&'a self, k: &'a Tensor, v: &'a Tensor, meta: &'a AttentionMetadata) -> CacheWrite<'a> {
        CacheWrite { k, v, k_cache: &self.k, v_cache: &self.v, slot_mapping: &meta.slot_mapping }
    }

    /// Attention of q `[T, heads, head_dim]` over this layer's pools.
    pub fn attention<'a>(&'a self, q: &'a Tensor, meta: &'a AttentionMetadata, scale: f32) -> Attention<'a> {
        Attention { q, k_cache: &self.k, v_cache: &self.v, meta, scale }
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
pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize, dtype: DType) -> u64 {
    (cfg.kv_bytes_per_token(dtype.size_in_bytes()) * block_size) as u64
}

/// Number of blocks that fit in `budget`, capped at `max_useful` (more than
/// every sequence at full length, twice over, only wastes memory).
pub fn num_blocks_for_budget(
    cfg: &ModelConfig,
    block_size: usize,
    dtype: DType,
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
    let blocks = (bytes / bytes_per_block(cfg, block_size, dtype)) as usize;
    if blocks == 0 {
        return Err(WorkerError::KvCache(format!(
            "a budget of {bytes} bytes holds no block ({} bytes each)",
            bytes_per_block(cfg, block_size, dtype)
        )));
    }
    Ok(blocks.min(max_useful))
}

/// Allocates zeroed block pools for every layer.
pub fn allocate(
    cfg: &ModelConfig,
    num_blocks: usize,
    block_size: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<LayerKvCache>> {
    let shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim);
    (0..cfg.num_layers)
        .map(|_| Ok(LayerKvCache { k: Tensor::zeros(shape, dtype, device)?, v: Tensor::zeros(shape, dtype, device)? }))
        .collect()
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
