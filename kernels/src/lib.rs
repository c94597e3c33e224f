//! Hot paths of the worker, each with a naive reference it is tested against.
//!
//! Paged attention (vLLM v1 style) over a flattened varlen batch: every
//! sequence brings `q_len >= 1` new tokens (a whole prompt, a prompt chunk
//! on top of a cached prefix, or one decode token) and attends causally to
//! its context through its block table. Three implementations share one API:
//! * [`reference`](mod@reference): naive host loops, obviously right;
//! * [`cpu`]: multi-threaded, online softmax, reads K/V in place block by block;
//! * [`portable`]: candle ops only (gather, matmul, softmax), any device.
//!
//! KV layout, per layer: `k_cache`, `v_cache`: `[num_blocks, block_size,
//! num_kv_heads, head_dim]`. One token's key for one kv head is a contiguous
//! `head_dim` vector (what a query is dotted with), one block is one
//! contiguous chunk (what the CPU kernel streams), and the pool viewed as
//! `[num_slots, num_kv_heads * head_dim]` is what the portable path gathers
//! from and scatters into (slot = block * block_size + offset). A cache may
//! be stored narrower than the queries (f16, or q8_0 with the last dimension
//! `head_dim + 4`: see [`kv_dtype`]); the write narrows and attention widens.

use candle_core::{DType, Device, Tensor};

pub mod cpu;
pub mod kv_dtype;
pub mod metal;
pub mod portable;
pub mod reference;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("invalid attention input: {0}")]
    Invalid(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, KernelError>;

pub use kv_dtype::KvCacheDtype;

/// Where each sequence's queries, context and new slots are. It travels
/// whole between pipeline stages (serde), and one check ([`Self::check`])
/// guards every kernel and every stage that receives it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AttentionMetadata {
    /// Prefix sums of new-token counts, len num_seqs + 1: sequence s's query
    /// rows are `query_start_loc[s]..query_start_loc[s + 1]`.
    pub query_start_loc: Vec<u32>,
    /// Per sequence: tokens in the cache after this step's write (cached
    /// prefix + new tokens). New tokens sit at positions `context_len - q_len..context_len`.
    pub context_lens: Vec<u32>,
    /// Per sequence: physical blocks covering positions `0..context_len`.
    pub block_tables: Vec<Vec<u32>>,
    /// Per new token: slot = block_id * block_size + offset_in_block.
    pub slot_mapping: Vec<u32>,
    pub block_size: usize,
    /// Mistral-style window: a query at position p sees keys at positions
    /// > p - window. `None` is full causal attention.
    pub sliding_window: Option<usize>,
}

impl AttentionMetadata {
    /// Checks the metadata against `num_tokens` query rows and a pool of
    /// `num_blocks` blocks, so no kernel indexes out of bounds: sequence
    /// boundaries that run over the rows in order, contexts that hold
    /// their new tokens, and block tables that cover each context with
    /// blocks of the pool. Every kernel's check runs it, and a pipeline
    /// stage runs it once on each step it receives.
    pub fn check(&self, num_tokens: usize, num_blocks: usize) -> Result<()> {
        let bad = |m: String| Err(KernelError::Invalid(m));
        let block_size = self.block_size;
        if block_size == 0 {
            return bad("a block size of 0".into());
        }
        if self.sliding_window == Some(0) {
            return bad("a sliding window of 0 hides every key".into());
        }
        let n = self.num_seqs();
        if self.query_start_loc.len() != n + 1 || self.block_tables.len() != n {
            return bad("query_start_loc / block_tables do not match context_lens".into());
        }
        if self.query_start_loc.first() != Some(&0) || *self.query_start_loc.last().unwrap_or(&0) as usize != num_tokens
        {
            return bad(format!("query_start_loc must run from 0 to {num_tokens}"));
        }
        for s in 0..n {
            let (start, end) = (self.query_start_loc[s], self.query_start_loc[s + 1]);
            if end < start {
                return bad(format!("query_start_loc decreases at sequence {s}"));
            }
            let (q_len, ctx) = ((end - start) as usize, self.context_lens[s] as usize);
            if q_len > ctx {
                return bad(format!("sequence {s}: {q_len} new tokens but context length {ctx}"));
            }
            let table = &self.block_tables[s];
            if table.len() * block_size < ctx {
                return bad(format!("sequence {s}: {} blocks cannot hold {ctx} tokens", table.len()));
            }
            if let Some(&b) = table[..ctx.div_ceil(block_size)].iter().find(|&&b| b as usize >= num_blocks) {
                return bad(format!("sequence {s}: block {b} out of range ({num_blocks} blocks)"));
            }
        }
        Ok(())
    }

    pub fn num_seqs(&self) -> usize {
        self.context_lens.len()
    }

    /// Query rows of sequence `s`.
    pub fn query_range(&self, s: usize) -> std::ops::Range<usize> {
        self.query_start_loc[s] as usize..self.query_start_loc[s + 1] as usize
    }

    /// Whether a query at `q_pos` sees the key at `k_pos`.
    #[inline]
    pub fn visible(&self, q_pos: usize, k_pos: usize) -> bool {
        k_pos <= q_pos && self.sliding_window.is_none_or(|w| k_pos + w > q_pos)
    }
}

/// Shapes of one attention call, checked once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub num_tokens: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl Dims {
    /// Query heads per kv head (GQA's group; 1 for MHA).
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// One paged-attention call: q `[T, heads, head_dim]` against the paged
/// caches `[blocks, block_size, kv_heads, head_dim]`, scores scaled by `scale`.
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    pub q: &'a Tensor,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub meta: &'a AttentionMetadata,
    pub scale: f32,
    /// gpt-oss: one logit per query head that joins each softmax (its
    /// share of the mass is dropped), `[heads]`.
    pub sinks: Option<&'a [f32]>,
}

/// One KV write: a step's new k/v `[T, kv_heads, head_dim]` into their slots
/// of the caches `[blocks, block_size, kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct CacheWrite<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    pub slot_mapping: &'a [u32],
}

impl Attention<'_> {
    /// Validates shapes and metadata so no implementation can index out of bounds.
    pub fn check(&self) -> Result<Dims> {
        let Attention { q, k_cache, v_cache, meta, sinks, .. } = *self;
        let bad = |m: String| Err(KernelError::Invalid(m));
        let (num_tokens, num_heads, head_dim) = q.dims3()?;
        let (num_blocks, block_size, num_kv_heads, kd) = k_cache.dims4()?;
        if v_cache.dims() != k_cache.dims() {
            return bad(format!("v_cache {:?} differs from k_cache {:?}", v_cache.dims(), k_cache.dims()));
        }
        if v_cache.dtype() != k_cache.dtype() {
            return bad(format!("k_cache is {:?}, v_cache {:?}", k_cache.dtype(), v_cache.dtype()));
        }
        let format = cache_format(q.dtype(), k_cache.dtype())?;
        if kd != format.row_len(head_dim) {
            return bad(format!("head_dim {head_dim} of q does not fit {format} cache rows of {kd}"));
        }
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return bad(format!("{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"));
        }
        if block_size != meta.block_size {
            return bad(format!("cache block size {block_size} != metadata block size {}", meta.block_size));
        }
        check_pool(q, k_cache, v_cache)?;
        meta.check(num_tokens, num_blocks)?;
        if let Some(sinks) = sinks.filter(|s| s.len() != num_heads) {
            return bad(format!("{} attention sinks for {num_heads} heads", sinks.len()));
        }
        Ok(Dims { num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size })
    }
}

/// The format of a cache of `cache` dtype read with (or written from)
/// activations of `x` dtype: the cache's own float type, or a narrower one
/// (f16, q8_0).
fn cache_format(x: DType, cache: DType) -> Result<KvCacheDtype> {
    match KvCacheDtype::of(cache) {
        Some(f)
            if KvCacheDtype::float(x).is_some()
                && (cache == x || matches!(f, KvCacheDtype::F16 | KvCacheDtype::Q8_0)) =>
        {
            Ok(f)
        }
        _ => Err(KernelError::Invalid(format!("a {cache:?} KV cache with {x:?} activations"))),
    }
}

/// The kernels index the pools as flat slices and write them in place, so
/// both must be contiguous (a start offset is fine) and on `x`'s device.
fn check_pool(x: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<()> {
    if !k_cache.is_contiguous() || !v_cache.is_contiguous() {
        return Err(KernelError::Invalid("k_cache and v_cache must be contiguous".into()));
    }
    if !x.device().same_device(k_cache.device()) || !x.device().same_device(v_cache.device()) {
        return Err(KernelError::Invalid("inputs and caches are on different devices".into()));
    }
    Ok(())
}

impl CacheWrite<'_> {
    /// Validates the write so no implementation can index out of bounds
    /// or write one slot twice (which of two rows lands would depend on the
    /// order threads run in); returns the number of slots in each cache.
    pub fn check(&self) -> Result<usize> {
        let CacheWrite { k, v, k_cache, v_cache, slot_mapping: slots } = *self;
        let bad = |m: String| Err(KernelError::Invalid(m));
        let (t, kvh, d) = k.dims3()?;
        let (nb, bs, ckvh, cd) = k_cache.dims4()?;
        if v.dims() != k.dims() || v_cache.dims() != k_cache.dims() {
            return bad("k/v or k_cache/v_cache shapes differ".into());
        }
        if v.dtype() != k.dtype() || v_cache.dtype() != k_cache.dtype() {
            return bad("k/v or k_cache/v_cache dtypes differ".into());
        }
        let format = cache_format(k.dtype(), k_cache.dtype())?;
        if (ckvh, cd) != (kvh, format.row_len(d)) {
            return bad(format!("new k/v [{t}, {kvh}, {d}] do not fit the {format} cache [{nb}, {bs}, {ckvh}, {cd}]"));
        }
        check_pool(k, k_cache, v_cache)?;
        if slots.len() != t {
            return bad(format!("{} slots for {t} tokens", slots.len()));
        }
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= nb * bs) {
            return bad(format!("slot {s} out of range ({} slots)", nb * bs));
        }
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("slot {} appears twice in slot_mapping", w[0]));
        }
        Ok(nb * bs)
    }
}

/// Paged attention with the implementation suited to the device.
/// q: `[T, heads, head_dim]` -> `[T, heads, head_dim]`.
pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    match a.q.device() {
        Device::Cpu => cpu::paged_attention(a),
        // Head dims and cache formats without a Metal kernel (q8_0) take
        // the portable path.
        #[cfg(target_os = "macos")]
        Device::Metal(m)
            if metal::plan::kernel_dtypes_name(a.q.dtype(), a.k_cache.dtype()).is_some()
                && metal::supports(m, a.q.dtype(), a.q.dims().last().copied().unwrap_or(0)) =>
        {
            metal::paged_attention(a)
        }
        _ => portable::paged_attention(a),
    }
}

/// Writes a step's new K/V into their slots, in place, in one batched write
/// per tensor.
pub fn reshape_and_cache(w: &CacheWrite) -> Result<()> {
    match w.k.device() {
        Device::Cpu => cpu::reshape_and_cache(w),
        #[cfg(target_os = "macos")]
        Device::Metal(m)
            if metal::plan::kernel_dtypes_name(w.k.dtype(), w.k_cache.dtype()).is_some()
                && metal::supports_dtype(m, w.k.dtype()) =>
        {
            metal::reshape_and_cache(w)
        }
        _ => portable::reshape_and_cache(w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_is_causal_and_windowed() {
        let mut meta = AttentionMetadata::default();
        assert!(meta.visible(5, 0) && meta.visible(5, 5) && !meta.visible(5, 6));
        meta.sliding_window = Some(3); // position 5 sees 3, 4, 5
        let seen: Vec<usize> = (0..8).filter(|&k| meta.visible(5, k)).collect();
        assert_eq!(seen, [3, 4, 5]);
    }

    #[test]
    fn check_accepts_a_consistent_batch_and_rejects_a_zero_block_size() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((3, 4, 8), candle_core::DType::F32, &dev)?;
        let cache = Tensor::zeros((4, 2, 2, 8), candle_core::DType::F32, &dev)?;
        let meta = AttentionMetadata {
            query_start_loc: vec![0, 1, 3],
            context_lens: vec![3, 2],
            block_tables: vec![vec![3, 0], vec![1]],
            slot_mapping: vec![2, 2, 3],
            block_size: 2,
            sliding_window: None,
        };
        let d = Attention { q: &q, k_cache: &cache, v_cache: &cache, meta: &meta, scale: 1.0, sinks: None }.check()?;
        assert_eq!((d.num_tokens, d.num_heads, d.num_kv_heads, d.head_dim, d.num_blocks), (3, 4, 2, 8, 4));
        let empty = Tensor::zeros((4, 0, 2, 8), candle_core::DType::F32, &dev)?;
        let meta0 = AttentionMetadata { block_size: 0, ..meta };
        assert!(
            Attention { q: &q, k_cache: &empty, v_cache: &empty, meta: &meta0, scale: 1.0, sinks: None }
                .check()
                .is_err()
        );
        Ok(())
    }
}
