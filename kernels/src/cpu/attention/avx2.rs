//! [`PagedAttention::run_item_lanes`] and its lane-wise loops (AVX2, FMA):
//! the item's (query row, head) pairs are the lanes, `nl` of them, a
//! multiple of 8 (padding lanes compute harmless values nobody reads).

use std::arch::x86_64::*;

use super::rows::KvRows;
use super::{Elem, Item, PagedAttention, Scratch, block_rows, refill, reserve_len};

impl PagedAttention<'_> {
    /// [`Self::run_item_with`] with AVX2, the item's (query row, head) pairs
    /// in the lanes of 8-wide vectors: a K/V row is loaded once for all of
    /// them and the per-key work has no horizontal sums. Per block, scores
    /// come from 8 keys at a time against the transposed queries, the online
    /// softmax runs lane-wise, and values accumulate in tiles of 4 pairs x
    /// 16 dims (8 FMA chains). That halves the time of a pair at a time
    /// with 4-key dot products (the NEON path's shape) in prefill; decode
    /// of groups up to 8 heads runs [`Self::run_decode_group`] instead.
    ///
    /// # Safety
    /// AVX2 and FMA must be available and head_dim a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_item_lanes<T: Elem, C: KvRows>(
        &self,
        item: Item,
        q: &[T],
        k: &[C],
        v: &[C],
        s: &mut Scratch,
    ) {
        let d = self.dims;
        let (hd, bs, group) = (d.head_dim, d.block_size, d.group());
        let n = item.rows * group; // pairs, lane r = i * group + j
        let nl = n.next_multiple_of(8);
        let last_pos = item.pos0 + item.rows - 1;
        let table = &self.meta.block_tables[item.seq];
        let rl = C::row_len(hd);
        let row_stride = d.num_kv_heads * rl;
        let (first_block, last_block) = self.item_blocks(&item);
        // The pool's blocks lie anywhere and a block's rows for one kv head
        // are `row_stride` apart, which the hardware prefetchers do not
        // follow: the first block's rows are asked for before the queries
        // are read, and each next block's while this one computes. Into L2,
        // not L1: in the worker that made decode attention 7-20% faster
        // (Zen 4). K and V rows of one head of a block (256 B at a 1 KiB
        // stride for TinyLlama) fall into 16 of L1's 64 sets, where the next
        // block's rows can evict the block being read; a harness of the
        // kernel alone had L1 ahead, so see docs/kernel-notes.md.
        self.prefetch_block(&item, first_block, last_block, (k, v));
        let Scratch { qf, acc, max, sum, kb, vb, scores, corr } = s;
        // The queries transposed, [head_dim, nl], pre-scaled; padding lanes 0.
        refill(qf, hd * nl, 0.0);
        for i in 0..item.rows {
            for j in 0..group {
                let (r, h) = (i * group + j, item.kv_head * group + j);
                let src = &q[((item.row0 + i) * d.num_heads + h) * hd..][..hd];
                for (c, &x) in src.iter().enumerate() {
                    qf[c * nl + r] = x.to_f32() * self.scale;
                }
            }
        }
        refill(acc, nl * hd, 0.0);
        refill(max, nl, f32::NEG_INFINITY);
        refill(sum, nl, 0.0);
        refill(corr, nl, 0.0);
        refill(scores, bs * nl, 0.0);
        reserve_len(kb, bs * hd);
        reserve_len(vb, bs * hd);
        let visible = |r: usize, start: usize, len: usize| self.item_keys(&item, item.pos0 + r / group, start, len);
        for (b, &block) in table.iter().enumerate().take(last_block + 1).skip(first_block) {
            let start = b * bs;
            let len = bs.min(last_pos + 1 - start);
            let base = self.head_rows_start(block, item.kv_head, rl);
            self.prefetch_block(&item, b + 1, last_block, (k, v));
            let (kr, vr, stride) = block_rows((k, v), base, row_stride, hd, len, (kb, vb));
            // SAFETY: AVX2 and FMA per the caller (here and in the two calls
            // below); qf is [hd, nl], rows 0..len of kr lie inside it
            // `stride` apart, scores holds len x nl.
            unsafe { self::scores(qf, nl, kr, stride, hd, len, scores) };
            // Keys a pair does not see (the causal diagonal of a prompt,
            // a window's edge) drop out as -inf; decode sees the whole block.
            if (0..n).any(|r| visible(r, start, len) != (0, len)) {
                for r in 0..nl {
                    let (t0, t1) = if r < n { visible(r, start, len) } else { (0, len) };
                    for t in (0..len).filter(|t| !(t0..t1).contains(t)) {
                        scores[t * nl + r] = f32::NEG_INFINITY;
                    }
                }
            }
            // SAFETY: scores holds len x nl, max/sum/corr nl.
            unsafe { softmax(scores, nl, len, max, sum, corr) };
            // SAFETY: acc holds nl x hd, rows 0..len of vr lie inside it
            // `stride` apart, scores len x nl, corr nl.
            unsafe { accumulate(acc, hd, n, scores, nl, len, vr, stride, corr) };
        }
        if !item.is_split() {
            self.normalize(item, n, acc, max, sum);
        }
    }
}

/// `s[t * nl + r] = q[.., r] . k[t * stride..][..hd]` for keys t < len,
/// with q `[hd, nl]`.
///
/// # Safety
/// AVX2 and FMA must be available; q must hold hd x nl, s len x nl, and
/// rows 0..len of k be in bounds.
#[inline(always)]
pub(super) unsafe fn scores(q: &[f32], nl: usize, k: &[f32], stride: usize, hd: usize, len: usize, s: &mut [f32]) {
    assert!(nl.is_multiple_of(8) && q.len() >= hd * nl && s.len() >= len * nl);
    assert!(len == 0 || (len - 1) * stride + hd <= k.len());
    let (q, k, s) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
    let mut t = 0;
    // SAFETY: the asserts cover keys t.. of each call.
    unsafe {
        while t + 8 <= len {
            keys::<8>(q, nl, k, stride, hd, t, s);
            t += 8;
        }
        if t + 4 <= len {
            keys::<4>(q, nl, k, stride, hd, t, s);
            t += 4;
        }
        while t < len {
            keys::<1>(q, nl, k, stride, hd, t, s);
            t += 1;
        }
    }
}

/// [`scores`] of keys t..t + KT: KT independent FMA chains, each key's
/// value broadcast against a vector of 8 pairs' queries.
#[inline(always)]
unsafe fn keys<const KT: usize>(
    q: *const f32,
    nl: usize,
    k: *const f32,
    stride: usize,
    hd: usize,
    t: usize,
    s: *mut f32,
) {
    // SAFETY: in bounds per `scores`.
    unsafe {
        for v in (0..nl).step_by(8) {
            let mut a = [_mm256_setzero_ps(); KT];
            for c in 0..hd {
                let qv = _mm256_loadu_ps(q.add(c * nl + v));
                for (j, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_broadcast_ss(&*k.add((t + j) * stride + c)), qv, *a);
                }
            }
            for (j, a) in a.iter().enumerate() {
                _mm256_storeu_ps(s.add((t + j) * nl + v), *a);
            }
        }
    }
}

/// One block of the online softmax, lane by lane: `s` (len x nl) becomes
/// exp(s - new max); `corr` gets the factor that rescales what earlier
/// blocks summed (also applied to `sum` here, to the outputs by
/// [`accumulate`]).
///
/// # Safety
/// AVX2 and FMA must be available; s holds len x nl, the others nl.
#[inline(always)]
pub(super) unsafe fn softmax(s: &mut [f32], nl: usize, len: usize, max: &mut [f32], sum: &mut [f32], corr: &mut [f32]) {
    assert!(nl.is_multiple_of(8) && s.len() >= len * nl && max.len() >= nl && sum.len() >= nl && corr.len() >= nl);
    let sp = s.as_mut_ptr();
    // SAFETY: in bounds per the assert.
    unsafe {
        for v in (0..nl).step_by(8) {
            let old = _mm256_loadu_ps(max.as_ptr().add(v));
            let mut m = old;
            for t in 0..len {
                m = _mm256_max_ps(m, _mm256_loadu_ps(sp.add(t * nl + v)));
            }
            // A lane that has seen no visible key keeps max -inf: shift it
            // by 0, so its exps come out ~0 rather than NaN.
            let unseen = _mm256_cmp_ps::<_CMP_EQ_OQ>(m, _mm256_set1_ps(f32::NEG_INFINITY));
            let shift = _mm256_blendv_ps(m, _mm256_setzero_ps(), unseen);
            let c = exp8(_mm256_sub_ps(old, shift));
            let mut total = _mm256_mul_ps(_mm256_loadu_ps(sum.as_ptr().add(v)), c);
            for t in 0..len {
                let p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(t * nl + v)), shift));
                _mm256_storeu_ps(sp.add(t * nl + v), p);
                total = _mm256_add_ps(total, p);
            }
            _mm256_storeu_ps(max.as_mut_ptr().add(v), m);
            _mm256_storeu_ps(sum.as_mut_ptr().add(v), total);
            _mm256_storeu_ps(corr.as_mut_ptr().add(v), c);
        }
    }
}

/// `acc[r] = acc[r] * corr[r] + sum over t < len of p[t * nl + r] *
/// v[t * stride..][..hd]` for pairs r < n, acc `[nl, hd]`: tiles of 4
/// pairs x 16 dims (8 accumulators) across the block's keys.
///
/// # Safety
/// AVX2 and FMA must be available; hd a multiple of 8, n <= nl, acc
/// nl x hd, p len x nl, corr nl, rows 0..len of v in bounds.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate(
    acc: &mut [f32],
    hd: usize,
    n: usize,
    p: &[f32],
    nl: usize,
    len: usize,
    v: &[f32],
    stride: usize,
    corr: &[f32],
) {
    assert!(hd.is_multiple_of(8) && nl.is_multiple_of(8) && n <= nl && acc.len() >= nl * hd);
    assert!(p.len() >= len * nl && corr.len() >= nl && (len == 0 || (len - 1) * stride + hd <= v.len()));
    let (a, p, v, corr) = (acc.as_mut_ptr(), p.as_ptr(), v.as_ptr(), corr.as_ptr());
    // SAFETY: pairs r..r + 4 <= nl and dims c..c + 8 * DV <= hd of each
    // tile are in bounds per the asserts.
    unsafe {
        for r in (0..n).step_by(4) {
            let mut c = 0;
            while c + 16 <= hd {
                tile::<2>(a, hd, p, nl, len, v, stride, corr, r, c);
                c += 16;
            }
            if c < hd {
                tile::<1>(a, hd, p, nl, len, v, stride, corr, r, c);
            }
        }
    }
}

/// [`accumulate`] for pairs r..r + 4 and dims c..c + 8 * DV.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const DV: usize>(
    acc: *mut f32,
    hd: usize,
    p: *const f32,
    nl: usize,
    len: usize,
    v: *const f32,
    stride: usize,
    corr: *const f32,
    r: usize,
    c: usize,
) {
    // SAFETY: in bounds per `accumulate`. (Loops, not closures: a closure
    // would not inherit the target features.)
    unsafe {
        let mut a = [[_mm256_setzero_ps(); DV]; 4];
        for (i, row) in a.iter_mut().enumerate() {
            let f = _mm256_broadcast_ss(&*corr.add(r + i));
            for (o, x) in row.iter_mut().enumerate() {
                *x = _mm256_mul_ps(_mm256_loadu_ps(acc.add((r + i) * hd + c + 8 * o)), f);
            }
        }
        for t in 0..len {
            let mut vv = [_mm256_setzero_ps(); DV];
            for (o, x) in vv.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(v.add(t * stride + c + 8 * o));
            }
            for (i, row) in a.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*p.add(t * nl + r + i));
                for (x, vv) in row.iter_mut().zip(vv) {
                    *x = _mm256_fmadd_ps(w, vv, *x);
                }
            }
        }
        for (i, row) in a.iter().enumerate() {
            for (o, x) in row.iter().enumerate() {
                _mm256_storeu_ps(acc.add((r + i) * hd + c + 8 * o), *x);
            }
        }
    }
}

/// [`crate::cpu::exp_poly`] on 8 lanes.
///
/// # Safety
/// AVX2 and FMA must be available.
#[inline(always)]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: AVX2 and FMA per the callers.
    unsafe {
        let x0 = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(88.0));
        let t = _mm256_fmadd_ps(x0, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(ROUND));
        let n = _mm256_sub_ps(t, _mm256_set1_ps(ROUND));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x0);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0));
        let bits = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(_mm256_set1_ps(ROUND)));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(bits, _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(scale))
    }
}
