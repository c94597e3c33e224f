//! Paged attention on the CPU, flash style: for each (sequence, kv head,
//! tile of queries) the keys are streamed block by block straight from the
//! pool through the block table (no gathered copy of the context); scores
//! of a block go through an online softmax (running max and sum), so memory
//! stays O(tile). All query heads of a GQA group share each loaded K/V row.
//! Work items run on rayon's pool. A long decode context is split into
//! items of [`split::SPLIT_KEYS`] keys whose unnormalised results are merged after
//! (flash-decoding): a batch-1 step of few kv heads keeps every thread busy.
//! With AVX2, decode runs [`group_decode`] (head dims in the lanes; a split
//! context's items take every kv head, so each block streams whole). The
//! cache may be narrower than the queries (f16, q8_0): each block's rows
//! are widened once for the group ([`rows`]), or f16 read in place there.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::buffers::{read_f32, write_f32};
use super::{Elem, OutPtr, exp_poly};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod group_decode;
#[cfg(target_arch = "aarch64")]
mod neon;
mod rows;
mod split;
use rows::KvRows;

use crate::{Attention, AttentionMetadata, Dims, KernelError, Result};

/// Queries per work item: bounds the per-item state while amortising each
/// K/V block load over several queries in prefill.
const QUERY_TILE: usize = 16;

/// Below this many multiply-adds a call runs on the calling thread: a
/// short decode step (small heads, short contexts) is done before the pool
/// would have woken up.
const SERIAL_MAX_MACS: usize = 1 << 16;

struct PagedAttention<'a> {
    meta: &'a AttentionMetadata,
    dims: Dims,
    scale: f32,
    sinks: Option<&'a [f32]>,
}

/// Per-item state, reused by the items one worker runs.
#[derive(Default)]
struct Scratch {
    /// The item's queries, widened and pre-scaled.
    qf: Vec<f32>,
    /// Running output, max and sum of the online softmax.
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    /// Widened K/V rows of a block (f16, bf16, q8_0 caches).
    kb: Vec<f32>,
    vb: Vec<f32>,
    scores: Vec<f32>,
    /// Per lane: the online softmax's rescaling for the current block.
    #[cfg(target_arch = "x86_64")]
    corr: Vec<f32>,
}

fn refill(v: &mut Vec<f32>, len: usize, value: f32) {
    v.clear();
    v.resize(len, value);
}

/// At least `len` values, whatever they hold: a buffer written before it is
/// read (rewriting 8 KiB of zeros per item showed in cold decode steps).
fn reserve_len(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// One unit of parallel work.
#[derive(Clone, Copy)]
struct Item {
    seq: usize,
    /// Kv heads `kv_head..kv_head + kv_heads`: one, but all of them in a
    /// split decode context's items on the [`group_decode`] path (a block's
    /// rows of every head are contiguous, read as one stream).
    kv_head: usize,
    kv_heads: usize,
    /// Query rows `row0..row0 + rows`, at positions `pos0..`.
    row0: usize,
    rows: usize,
    pos0: usize,
    /// The key positions `keys.0..keys.1` of a split decode context (its
    /// result left unnormalised for the merge); `(0, usize::MAX)`: all.
    keys: (usize, usize),
}

impl Item {
    fn is_split(&self) -> bool {
        self.keys != (0, usize::MAX)
    }

    /// The query heads of the item's kv heads, of `group` each.
    fn heads(&self, group: usize) -> usize {
        self.kv_heads * group
    }
}

impl PagedAttention<'_> {
    /// The first key position a query at `pos` sees (its sliding window).
    fn window_start(&self, pos: usize) -> usize {
        self.meta.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Keys t0..t1 of the block at position `start` (of `len` keys) that a
    /// query at `q_pos` sees.
    #[inline(always)]
    fn visible_keys(&self, q_pos: usize, start: usize, len: usize) -> (usize, usize) {
        (self.window_start(q_pos).saturating_sub(start), len.min((q_pos + 1).saturating_sub(start)))
    }

    /// Where kv head `kv_head`'s first row of pool block `block` starts,
    /// in elements of a cache whose rows are `rl` long.
    fn head_rows_start(&self, block: u32, kv_head: usize, rl: usize) -> usize {
        (block as usize * self.dims.block_size * self.dims.num_kv_heads + kv_head) * rl
    }

    /// The blocks `first..=last` of its table that `item` reads: from its
    /// first query's window start (or its share's start) to its last query
    /// (or its share's end).
    fn item_blocks(&self, item: &Item) -> (usize, usize) {
        let last_pos = item.pos0 + item.rows - 1;
        let first_key = self.window_start(item.pos0).max(item.keys.0);
        let last_key = last_pos.min(item.keys.1.saturating_sub(1));
        (first_key / self.dims.block_size, last_key / self.dims.block_size)
    }

    /// Asks for the K and V rows of `item`'s kv heads in block `b` of its
    /// table, if it reads that block (`b <= last_block`), into L2 (see
    /// [`Self::run_item_lanes`]): one range when they are every head's (a
    /// block's rows are contiguous).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch_block<C: KvRows>(&self, item: &Item, b: usize, last_block: usize, (k, v): (&[C], &[C])) {
        let Some(&block) = self.meta.block_tables[item.seq].get(b).filter(|_| b <= last_block) else { return };
        let (bs, n) = (self.dims.block_size, self.dims.num_kv_heads);
        let rl = C::row_len(self.dims.head_dim);
        let base = self.head_rows_start(block, item.kv_head, rl);
        for cache in [k, v] {
            let end = cache.as_ptr_range().end.cast::<u8>();
            let at = |e: usize| cache.as_ptr().wrapping_add(e).cast::<u8>();
            if item.kv_heads == n {
                super::prefetch_into_l2_within(at(base), bs * n * rl * size_of::<C>(), end);
                continue;
            }
            for t in 0..bs {
                super::prefetch_into_l2_within(at(base + t * n * rl), item.kv_heads * rl * size_of::<C>(), end);
            }
        }
    }

    /// Keys t0..t1 of the block at position `start` (of `len` keys) that
    /// the query at `q_pos` of `item` sees: its visible keys inside the
    /// item's share of them.
    #[inline(always)]
    fn item_keys(&self, item: &Item, q_pos: usize, start: usize, len: usize) -> (usize, usize) {
        let (t0, t1) = self.visible_keys(q_pos, start, len);
        (t0.max(item.keys.0.saturating_sub(start)), t1.min(item.keys.1.saturating_sub(start)))
    }

    /// The work items; a split decode context's items are consecutive.
    fn items(&self) -> Vec<Item> {
        let mut items = Vec::new();
        for s in 0..self.meta.num_seqs() {
            let range = self.meta.query_range(s);
            let first_pos = self.meta.context_lens[s] as usize - range.len();
            let all_heads = |keys| Item {
                seq: s,
                kv_head: 0,
                kv_heads: self.dims.num_kv_heads,
                row0: range.start,
                rows: 1,
                pos0: first_pos,
                keys,
            };
            if range.len() == 1
                && self.decodes_in_groups()
                && self.split_decode(first_pos, &mut |keys| items.push(all_heads(keys)))
            {
                continue;
            }
            for kv_head in 0..self.dims.num_kv_heads {
                let item = |row0, rows, pos0, keys| Item { seq: s, kv_head, kv_heads: 1, row0, rows, pos0, keys };
                if range.len() == 1
                    && self.split_decode(first_pos, &mut |keys| items.push(item(range.start, 1, first_pos, keys)))
                {
                    continue;
                }
                let mut i = 0;
                while i < range.len() {
                    let rows = QUERY_TILE.min(range.len() - i);
                    items.push(item(range.start + i, rows, first_pos + i, (0, usize::MAX)));
                    i += rows;
                }
            }
        }
        items
    }

    /// Whether decode items run [`Self::run_decode_group`].
    fn decodes_in_groups(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return super::isa::has_avx2_fma()
            && super::isa::features().f16c
            && self.dims.head_dim.is_multiple_of(8)
            && self.dims.group() <= group_decode::MAX_GROUP;
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Attention for one item, left in `s.acc` as [rows, group, head_dim]:
    /// with AVX2 and FMA by [`Self::run_item_lanes`], with NEON or portable
    /// loops by [`Self::run_item_with`]. The paths differ in rounding (FMA,
    /// summation order), all within the tests' tolerance of the reference.
    fn run_item<T: Elem, C: KvRows>(&self, item: Item, q: &[T], k: &[C], v: &[C], s: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if item.rows == 1 && self.decodes_in_groups() {
            // SAFETY: the CPU has AVX2, FMA and F16C; head_dim is whole 8-lane chunks.
            return unsafe { self.run_decode_group(item, q, k, v, s) };
        }
        #[cfg(target_arch = "x86_64")]
        if super::isa::has_avx2_fma() && self.dims.head_dim.is_multiple_of(8) {
            // SAFETY: the CPU has AVX2 and FMA; head_dim is whole 8-lane chunks.
            return unsafe { self.run_item_lanes(item, q, k, v, s) };
        }
        // NEON is part of the aarch64 baseline.
        #[cfg(target_arch = "aarch64")]
        if self.dims.head_dim.is_multiple_of(8) {
            return self.run_item_with::<T, C, true>(item, q, k, v, s);
        }
        self.run_item_with::<T, C, false>(item, q, k, v, s)
    }

    /// With `SIMD`, the score and value loops run as the [`simd`] kernels
    /// (the caller has checked the CPU and head_dim); without, as portable
    /// loops the compiler vectorises for the baseline.
    #[inline(always)]
    fn run_item_with<T: Elem, C: KvRows, const SIMD: bool>(
        &self,
        item: Item,
        q: &[T],
        k: &[C],
        v: &[C],
        s: &mut Scratch,
    ) {
        let d = self.dims;
        let (hd, bs, group) = (d.head_dim, d.block_size, d.group());
        let n = item.rows * group; // (query, head) pairs, index r = i * group + j
        // Widen this item's queries once, pre-scaled.
        let Scratch { qf, acc, max, sum, kb, vb, scores, .. } = s;
        refill(qf, n * hd, 0.0);
        for i in 0..item.rows {
            for j in 0..group {
                let h = item.kv_head * group + j;
                let src = &q[((item.row0 + i) * d.num_heads + h) * hd..][..hd];
                for (dst, &x) in qf[(i * group + j) * hd..][..hd].iter_mut().zip(src) {
                    *dst = x.to_f32() * self.scale;
                }
            }
        }
        refill(acc, n * hd, 0.0);
        refill(max, n, f32::NEG_INFINITY);
        refill(sum, n, 0.0);
        let last_pos = item.pos0 + item.rows - 1;
        let table = &self.meta.block_tables[item.seq];
        // Widening buffers for f16/bf16 caches.
        reserve_len(kb, bs * hd);
        reserve_len(vb, bs * hd);
        refill(scores, bs, 0.0);
        let (first_block, last_block) = self.item_blocks(&item);
        for (b, &block) in table.iter().enumerate().take(last_block + 1).skip(first_block) {
            let start = b * bs;
            let len = bs.min(last_pos + 1 - start);
            let rl = C::row_len(hd);
            let base = self.head_rows_start(block, item.kv_head, rl);
            let (kr, vr, stride) = block_rows((k, v), base, d.num_kv_heads * rl, hd, len, (kb, vb));
            for r in 0..n {
                let (t0, t1) = self.item_keys(&item, item.pos0 + r / group, start, len);
                if t0 >= t1 {
                    continue;
                }
                let qr = &qf[r * hd..][..hd];
                #[cfg(target_arch = "aarch64")]
                if SIMD {
                    // SAFETY: NEON, and head_dim % 8 == 0 (see run_item); the
                    // rows t0..t1 of kr lie inside it, `stride` apart.
                    unsafe { neon::scores(qr, kr, stride, t0..t1, scores) };
                }
                if !SIMD || cfg!(not(target_arch = "aarch64")) {
                    for t in t0..t1 {
                        scores[t] = dot(qr, &kr[t * stride..][..hd]);
                    }
                }
                let block_max = scores[t0..t1].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                // Online softmax: rescale what was accumulated to the new max.
                let new_max = max[r].max(block_max);
                let correction = exp_poly(max[r] - new_max);
                max[r] = new_max;
                let a = &mut acc[r * hd..][..hd];
                if correction != 1.0 {
                    sum[r] *= correction;
                    a.iter_mut().for_each(|x| *x *= correction);
                }
                sum[r] += exp_shifted_in_place(&mut scores[t0..t1], new_max);
                #[cfg(target_arch = "aarch64")]
                if SIMD {
                    // SAFETY: as for the scores.
                    unsafe { neon::accumulate(a, scores, vr, stride, t0..t1) };
                }
                if !SIMD || cfg!(not(target_arch = "aarch64")) {
                    for t in t0..t1 {
                        let w = scores[t];
                        for (x, &vv) in a.iter_mut().zip(&vr[t * stride..][..hd]) {
                            *x += w * vv;
                        }
                    }
                }
            }
        }
        if !item.is_split() {
            self.normalize(item, n, acc, max, sum);
        }
    }

    /// Divides each (query, head) pair's accumulated values by its softmax
    /// sum, `acc: [pairs, head_dim]`. With sinks the head's sink logit joins
    /// the sum first (the online softmax's max moves to it if larger), so
    /// the keys keep only their share of the mass.
    fn normalize(&self, item: Item, n: usize, acc: &mut [f32], max: &[f32], sum: &[f32]) {
        let (hd, group) = (self.dims.head_dim, self.dims.group());
        for r in 0..n {
            let (mut total, mut keep) = (sum[r], 1.0);
            if let Some(sinks) = self.sinks {
                let sink = sinks[item.kv_head * group + r % item.heads(group)];
                let m = max[r].max(sink);
                keep = (max[r] - m).exp();
                total = sum[r] * keep + (sink - m).exp();
            }
            let inv = if total > 0.0 { keep / total } else { 0.0 };
            acc[r * hd..][..hd].iter_mut().for_each(|x| *x *= inv);
        }
    }

    fn run<T: Elem, C: KvRows>(&self, q: &[T], k: &[C], v: &[C]) -> Vec<T> {
        let d = self.dims;
        let mut out = vec![T::from_f32(0.0); d.num_tokens * d.num_heads * d.head_dim];
        self.run_into(q, k, v, &mut out);
        out
    }

    /// Attention of every query row into `out: [T, heads, head_dim]`.
    fn run_into<T: Elem, C: KvRows>(&self, q: &[T], k: &[C], v: &[C], out: &mut [T]) {
        let d = self.dims;
        let group = d.group();
        let items = self.items();
        // q.k and p.v for every visible key, roughly (causal halves aside).
        let macs: usize =
            items.iter().map(|it| it.rows * it.heads(group) * self.meta.context_lens[it.seq] as usize).sum::<usize>()
                * 2
                * d.head_dim;
        assert_eq!(out.len(), d.num_tokens * d.num_heads * d.head_dim, "checked by the caller");
        let out = OutPtr(out.as_mut_ptr());
        // A split item's unnormalised result, [heads, head_dim] then its
        // heads' maxima and sums, in its own slot.
        let slot = items.iter().map(|it| it.heads(group)).max().unwrap_or(0) * (d.head_dim + 2);
        let mut partials = vec![0f32; if items.iter().any(Item::is_split) { items.len() * slot } else { 0 }];
        let parts = OutPtr(partials.as_mut_ptr());
        // Each item owns rows row0..row0 + rows of heads kv_head * group ..
        // (kv_head + 1) * group, or its slot of partials: the items write
        // disjoint memory.
        let work = |s: &mut Scratch, (index, item): (usize, Item)| {
            self.run_item(item, q, k, v, s);
            if item.is_split() {
                // SAFETY: slot `index` is inside partials (sized for every
                // item when any is split) and only this item writes it.
                let dst = unsafe { std::slice::from_raw_parts_mut(parts.get().add(index * slot), slot) };
                let heads = item.heads(group);
                let (acc, rest) = dst.split_at_mut(heads * d.head_dim);
                acc.copy_from_slice(&s.acc[..heads * d.head_dim]);
                rest[..heads].copy_from_slice(&s.max[..heads]);
                rest[heads..2 * heads].copy_from_slice(&s.sum[..heads]);
                return;
            }
            let heads = item.heads(group);
            for i in 0..item.rows {
                for j in 0..heads {
                    let h = item.kv_head * group + j;
                    let at = ((item.row0 + i) * d.num_heads + h) * d.head_dim;
                    // SAFETY: at + head_dim <= T * heads * head_dim = out's
                    // length (row0 + i < T, h < heads); no other item writes
                    // this (row, head).
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(at), d.head_dim) };
                    for (o, &x) in dst.iter_mut().zip(&s.acc[(i * heads + j) * d.head_dim..][..d.head_dim]) {
                        *o = T::from_f32(x);
                    }
                }
            }
        };
        // Calls come every layer of every step: each thread keeps its
        // scratch (fresh buffers per call were a malloc and a page of
        // zeroing per item, on lines the weights' stream had evicted).
        thread_local!(static SCRATCH: std::cell::RefCell<Scratch> = Default::default());
        if items.len() == 1 || macs < SERIAL_MAX_MACS {
            // Short calls (decode of small models): on the calling thread.
            SCRATCH.with_borrow_mut(|s| items.iter().copied().enumerate().for_each(|it| work(s, it)));
        } else {
            items.par_iter().copied().enumerate().for_each(|it| SCRATCH.with_borrow_mut(|s| work(s, it)));
        }
        // SAFETY: the parallel loop is over; nothing else holds `out`.
        let out = unsafe { std::slice::from_raw_parts_mut(out.get(), d.num_tokens * d.num_heads * d.head_dim) };
        self.merge_split(&items, &partials, (group, slot), out);
    }
}

/// `v[i] = exp(v[i] - shift)` for `v[i] <= shift`, returning the sum, by
/// [`exp_poly`] (libm's scalar `expf` per score was a third of a short
/// decode step's attention).
#[inline(always)]
fn exp_shifted_in_place(v: &mut [f32], shift: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let exp = |x: &mut f32| -> f32 {
        *x = exp_poly(*x - shift);
        *x
    };
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *l += exp(x);
        }
    }
    let tail: f32 = chunks.into_remainder().iter_mut().map(exp).sum();
    lanes.iter().sum::<f32>() + tail
}

/// The first `len` K and V rows of a block for one kv head, from `base`
/// (rows `row_stride` apart) as `(k rows, v rows, their stride)`: f32 caches
/// are read in place, others widened once into `bufs` for all the group's
/// query heads (rows `hd` apart).
#[inline(always)]
fn block_rows<'a, C: KvRows>(
    (k, v): (&'a [C], &'a [C]),
    base: usize,
    row_stride: usize,
    hd: usize,
    len: usize,
    (kb, vb): (&'a mut [f32], &'a mut [f32]),
) -> (&'a [f32], &'a [f32], usize) {
    if let (Some(kr), Some(vr)) = (C::as_f32(&k[base..]), C::as_f32(&v[base..])) {
        return (kr, vr, row_stride);
    }
    let rl = C::row_len(hd);
    for t in 0..len {
        C::widen_row(&k[base + t * row_stride..][..rl], &mut kb[t * hd..][..hd]);
        C::widen_row(&v[base + t * row_stride..][..rl], &mut vb[t * hd..][..hd]);
    }
    (kb, vb, hd)
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes let the compiler vectorise the reduction.
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

fn slice<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("paged attention: {what} must be contiguous"),
    }
}

impl CustomOp3 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let shape = Shape::from((self.dims.num_tokens, self.dims.num_heads, self.dims.head_dim));
        let (q, k, v) = (s1, s2, s3);
        // f32 queries (the CPU's activations) read any cache format; f16 and
        // bf16 queries their own.
        let storage = match (q, k, v) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                CpuStorage::F32(self.run(slice(q, l1, "q")?, slice(k, l2, "k_cache")?, slice(v, l3, "v_cache")?))
            }
            (CpuStorage::F32(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F32(self.run(slice(q, l1, "q")?, slice(k, l2, "k_cache")?, slice(v, l3, "v_cache")?))
            }
            (CpuStorage::F32(q), CpuStorage::U8(k), CpuStorage::U8(v)) => {
                CpuStorage::F32(self.run(slice(q, l1, "q")?, slice(k, l2, "k_cache")?, slice(v, l3, "v_cache")?))
            }
            (CpuStorage::F16(q), CpuStorage::F16(k), CpuStorage::F16(v)) => {
                CpuStorage::F16(self.run(slice(q, l1, "q")?, slice(k, l2, "k_cache")?, slice(v, l3, "v_cache")?))
            }
            (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                CpuStorage::BF16(self.run(slice(q, l1, "q")?, slice(k, l2, "k_cache")?, slice(v, l3, "v_cache")?))
            }
            _ => candle_core::bail!("paged attention: unsupported or mismatched dtypes"),
        };
        Ok((storage, shape))
    }
}

/// q: `[T, heads, head_dim]`; caches `[blocks, block_size, kv_heads, head_dim]`.
pub fn paged_attention(a: &Attention) -> Result<Tensor> {
    let Attention { q, k_cache, v_cache, meta, scale, sinks } = *a;
    let dims = a.check()?;
    let op = PagedAttention { meta, dims, scale, sinks };
    Ok(q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)?)
}

/// [`paged_attention`] into `out` (the shape of `q`), for contiguous f32
/// CPU queries and output over an f32, f16 or q8_0 cache, none sharing
/// storage with `out`: nothing is allocated for the output.
pub fn paged_attention_into(a: &Attention, out: &Tensor) -> Result<()> {
    let Attention { q, k_cache, v_cache, meta, scale, sinks } = *a;
    let dims = a.check()?;
    if out.dims() != q.dims() {
        return Err(KernelError::Invalid(format!("paged attention: q is {:?}, out {:?}", q.dims(), out.dims())));
    }
    let op = PagedAttention { meta, dims, scale, sinks };
    let (ks, kl) = k_cache.storage_and_layout();
    let (vs, vl) = v_cache.storage_and_layout();
    read_f32(q, |q| {
        write_f32(out, &|o| {
            // Every query row belongs to a sequence, but a reused buffer
            // must not leak stale rows if one did not.
            o.fill(0.0);
            match (&*ks, &*vs) {
                (Storage::Cpu(CpuStorage::F32(k)), Storage::Cpu(CpuStorage::F32(v))) => {
                    op.run_into(q, slice(k, kl, "k_cache")?, slice(v, vl, "v_cache")?, o)
                }
                (Storage::Cpu(CpuStorage::F16(k)), Storage::Cpu(CpuStorage::F16(v))) => {
                    op.run_into(q, slice(k, kl, "k_cache")?, slice(v, vl, "v_cache")?, o)
                }
                (Storage::Cpu(CpuStorage::U8(k)), Storage::Cpu(CpuStorage::U8(v))) => {
                    op.run_into(q, slice(k, kl, "k_cache")?, slice(v, vl, "v_cache")?, o)
                }
                _ => candle_core::bail!("paged attention into f32: an f32, f16 or q8_0 CPU cache"),
            }
            Ok(())
        })
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_tile_every_query_row_once_per_kv_head() {
        // Sequence 0: a 40-token chunk at positions 60..100; sequence 1: one decode token.
        let meta = AttentionMetadata {
            query_start_loc: vec![0, 40, 41],
            context_lens: vec![100, 7],
            block_tables: vec![vec![0; 7], vec![0]],
            slot_mapping: vec![0; 41],
            block_size: 16,
            sliding_window: None,
        };
        let dims = Dims { num_tokens: 41, num_heads: 4, num_kv_heads: 2, head_dim: 8, num_blocks: 1, block_size: 16 };
        let items = PagedAttention { meta: &meta, dims, scale: 1.0, sinks: None }.items();
        let spans: Vec<_> = items.iter().map(|i| (i.seq, i.kv_head, i.row0, i.rows, i.pos0)).collect();
        assert_eq!(
            spans,
            [
                (0, 0, 0, 16, 60),
                (0, 0, 16, 16, 76),
                (0, 0, 32, 8, 92),
                (0, 1, 0, 16, 60),
                (0, 1, 16, 16, 76),
                (0, 1, 32, 8, 92),
                (1, 0, 40, 1, 6),
                (1, 1, 40, 1, 6),
            ]
        );
    }

    #[test]
    fn exp_matches_libm() {
        for n in [1, 7, 8, 9, 64, 67] {
            let xs: Vec<f32> = (0..n).map(|i| -(i as f32) * 1.37 - 0.001 * i as f32).collect();
            let mut got = xs.clone();
            let sum = exp_shifted_in_place(&mut got, 0.5);
            let want: Vec<f64> = xs.iter().map(|&x| ((x - 0.5) as f64).exp()).collect();
            for (g, w) in got.iter().zip(&want) {
                assert!(((*g as f64) - w).abs() <= 3e-7 * w.max(1e-30), "{g} vs {w}");
            }
            assert!((sum as f64 - want.iter().sum::<f64>()).abs() < 1e-6);
        }
        let mut far = [-200.0f32, -87.5, 0.0];
        exp_shifted_in_place(&mut far, 0.0);
        assert_eq!(far[0], far[1]);
        assert!(far[0] < 1e-37 && far[2] == 1.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn lane_exp_matches_the_scalar_one() {
        use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps};
        if !crate::cpu::isa::has_avx2_fma() {
            return;
        }
        let xs: Vec<f32> = (0..400).map(|i| -90.0 + i as f32 * 0.4537).chain([f32::NEG_INFINITY, -1e-7, 0.0]).collect();
        for c in xs.chunks(8) {
            let mut x = [0f32; 8];
            x[..c.len()].copy_from_slice(c);
            let mut got = [0f32; 8];
            // SAFETY: AVX2 and FMA were detected; both arrays hold 8 floats.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(x.as_ptr()))) };
            for (&x, &g) in x.iter().zip(&got) {
                let want = exp_poly(x);
                assert!((g - want).abs() <= 4e-7 * want, "exp({x}): {g} vs {want}");
            }
        }
    }

    #[test]
    fn dot_handles_lengths_off_the_lane_width() {
        for n in [1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.5).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() <= 1e-3 * want.abs().max(1.0), "n {n}");
        }
    }
}
