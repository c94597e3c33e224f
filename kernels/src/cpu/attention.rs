//! Paged attention on the CPU, flash style: for each (sequence, kv head,
//! tile of queries) the keys are streamed block by block straight from the
//! pool through the block table (no gathered copy of the context); scores
//! of a block go through an online softmax (running max and sum), so memory
//! stays O(tile). All query heads of a GQA group share each loaded K/V row.
//! Work items run on rayon's pool.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::Elem;
use crate::{AttentionMetadata, Dims, Result, check};

/// Queries per work item: bounds the per-item state while amortising each
/// K/V block load over several queries in prefill.
const QUERY_TILE: usize = 16;

struct PagedAttention<'a> {
    meta: &'a AttentionMetadata,
    dims: Dims,
    scale: f32,
}

/// One unit of parallel work.
#[derive(Clone, Copy)]
struct Item {
    seq: usize,
    kv_head: usize,
    /// Query rows `row0..row0 + rows`, at positions `pos0..`.
    row0: usize,
    rows: usize,
    pos0: usize,
}

impl PagedAttention<'_> {
    fn items(&self) -> Vec<Item> {
        let mut items = Vec::new();
        for s in 0..self.meta.num_seqs() {
            let range = self.meta.query_range(s);
            let first_pos = self.meta.context_lens[s] as usize - range.len();
            for kv_head in 0..self.dims.num_kv_heads {
                let mut i = 0;
                while i < range.len() {
                    let rows = QUERY_TILE.min(range.len() - i);
                    items.push(Item { seq: s, kv_head, row0: range.start + i, rows, pos0: first_pos + i });
                    i += rows;
                }
            }
        }
        items
    }

    /// Attention for one item; returns [rows, group, head_dim] in f32.
    fn run_item<T: Elem>(&self, item: Item, q: &[T], k: &[T], v: &[T]) -> Vec<f32> {
        let d = self.dims;
        let (hd, bs, group) = (d.head_dim, d.block_size, d.num_heads / d.num_kv_heads);
        let n = item.rows * group; // (query, head) pairs, index r = i * group + j
        // Widen this item's queries once, pre-scaled.
        let mut qf = vec![0f32; n * hd];
        for i in 0..item.rows {
            for j in 0..group {
                let h = item.kv_head * group + j;
                let src = &q[((item.row0 + i) * d.num_heads + h) * hd..][..hd];
                for (dst, &x) in qf[(i * group + j) * hd..][..hd].iter_mut().zip(src) {
                    *dst = x.to_f32() * self.scale;
                }
            }
        }
        let mut acc = vec![0f32; n * hd];
        let mut max = vec![f32::NEG_INFINITY; n];
        let mut sum = vec![0f32; n];
        let last_pos = item.pos0 + item.rows - 1;
        let table = &self.meta.block_tables[item.seq];
        let mut kb = vec![0f32; bs * hd];
        let mut vb = vec![0f32; bs * hd];
        let mut scores = vec![0f32; n * bs];
        let first_key = match self.meta.sliding_window {
            Some(w) => (item.pos0 + 1).saturating_sub(w),
            None => 0,
        };
        for b in first_key / bs..=last_pos / bs {
            let block = table[b] as usize;
            let start = b * bs;
            let len = bs.min(last_pos + 1 - start);
            // Widen this block's K and V rows for our kv head.
            for t in 0..len {
                let src = ((block * bs + t) * d.num_kv_heads + item.kv_head) * hd;
                for (dst, &x) in kb[t * hd..][..hd].iter_mut().zip(&k[src..src + hd]) {
                    *dst = x.to_f32();
                }
                for (dst, &x) in vb[t * hd..][..hd].iter_mut().zip(&v[src..src + hd]) {
                    *dst = x.to_f32();
                }
            }
            for r in 0..n {
                let q_pos = item.pos0 + r / group;
                let qr = &qf[r * hd..][..hd];
                let mut block_max = f32::NEG_INFINITY;
                for t in 0..len {
                    let s = if self.meta.visible(q_pos, start + t) { dot(qr, &kb[t * hd..][..hd]) } else { f32::NEG_INFINITY };
                    scores[r * bs + t] = s;
                    block_max = block_max.max(s);
                }
                if block_max == f32::NEG_INFINITY {
                    continue;
                }
                // Online softmax: rescale what was accumulated to the new max.
                let new_max = max[r].max(block_max);
                let correction = (max[r] - new_max).exp();
                max[r] = new_max;
                let a = &mut acc[r * hd..][..hd];
                if correction != 1.0 {
                    sum[r] *= correction;
                    a.iter_mut().for_each(|x| *x *= correction);
                }
                for t in 0..len {
                    let w = (scores[r * bs + t] - new_max).exp();
                    if w == 0.0 {
                        continue;
                    }
                    sum[r] += w;
                    for (x, &vv) in a.iter_mut().zip(&vb[t * hd..][..hd]) {
                        *x += w * vv;
                    }
                }
            }
        }
        for r in 0..n {
            let inv = if sum[r] > 0.0 { 1.0 / sum[r] } else { 0.0 };
            acc[r * hd..][..hd].iter_mut().for_each(|x| *x *= inv);
        }
        acc
    }

    fn run<T: Elem>(&self, q: &[T], k: &[T], v: &[T]) -> Vec<T> {
        let d = self.dims;
        let group = d.num_heads / d.num_kv_heads;
        let items = self.items();
        let results: Vec<(Item, Vec<f32>)> = items.par_iter().map(|&item| (item, self.run_item(item, q, k, v))).collect();
        let mut out = vec![T::from_f32(0.0); d.num_tokens * d.num_heads * d.head_dim];
        for (item, acc) in results {
            for i in 0..item.rows {
                for j in 0..group {
                    let h = item.kv_head * group + j;
                    let dst = &mut out[((item.row0 + i) * d.num_heads + h) * d.head_dim..][..d.head_dim];
                    for (o, &x) in dst.iter_mut().zip(&acc[(i * group + j) * d.head_dim..][..d.head_dim]) {
                        *o = T::from_f32(x);
                    }
                }
            }
        }
        out
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes let the compiler vectorise the reduction.
    let mut lanes = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for i in chunks * 8..a.len() {
        total += a[i] * b[i];
    }
    total
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
        let storage = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
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
pub fn paged_attention(q: &Tensor, k_cache: &Tensor, v_cache: &Tensor, meta: &AttentionMetadata, scale: f32) -> Result<Tensor> {
    let dims = check(q, k_cache, v_cache, meta)?;
    let op = PagedAttention { meta, dims, scale };
    Ok(q.contiguous()?.apply_op3_no_bwd(k_cache, v_cache, &op)?)
}
