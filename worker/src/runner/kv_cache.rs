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

use candle_core::{Device, Tensor};
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
