//! Decode with AVX2 for GQA groups of up to 8 query heads (MHA's 1, Gemma
//! 3 4B's 2, SmolLM's 3, Llama 3's and Mistral's 4, Qwen2.5-7B's 7,
//! TinyLlama's and gpt-oss's 8): the head dims are the lanes.
//! [`super::avx2`]'s lanes hold (query, head) pairs, so a decode group of 3
//! filled 3 of 8 and its score loop did eight lanes' work for three; at
//! long contexts that was most of a step (SmolLM at 16K: 42.5 -> 32.2 ms a
//! step's attention with an f32 cache; TinyLlama's group of 8 61 -> 47 ms).
//! Here each head's scores come 8 keys at a time from 8 accumulators
//! reduced by one transpose-and-add, its softmax runs over the keys, and
//! values accumulate in tiles of up to 3 heads x 32 dims (each V row
//! loaded once for the tile's heads). f32 and f16 caches are read in
//! place (F16C widens 8 values a load); others are widened a block at a
//! time first.

use std::arch::x86_64::*;

use super::avx2::exp8;
use super::rows::KvRows;
use super::{Elem, Item, PagedAttention, Scratch, block_rows, refill, reserve_len};
use crate::cpu::exp_poly;

/// Decode groups of at most this many query heads take this path (larger
/// ones, unmeasured, stay on [`super::avx2`]'s lanes, which they fill).
pub(super) const MAX_GROUP: usize = 8;

/// Heads of a value tile.
const TILE_HEADS: usize = 3;

impl PagedAttention<'_> {
    /// Attention of a decode item (one query row, groups of at most
    /// [`MAX_GROUP`] heads), left in `s.acc` as `[heads, head_dim]` with
    /// `s.max`/`s.sum` per head, as [`Self::run_item_lanes`] leaves it. Its
    /// kv heads are done block by block: an item of every head reads each
    /// block's rows as one stream.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available and head_dim a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run_decode_group<T: Elem, C: KvRows>(
        &self,
        item: Item,
        q: &[T],
        k: &[C],
        v: &[C],
        s: &mut Scratch,
    ) {
        let d = self.dims;
        let (hd, bs, group) = (d.head_dim, d.block_size, d.group());
        let heads = item.heads(group);
        debug_assert!(item.rows == 1 && group <= MAX_GROUP && hd.is_multiple_of(8));
        let pos = item.pos0;
        let table = &self.meta.block_tables[item.seq];
        let rl = C::row_len(hd);
        let row_stride = d.num_kv_heads * rl;
        let (first_block, last_block) = self.item_blocks(&item);
        self.prefetch_block(&item, first_block, last_block, (k, v));
        let Scratch { qf, acc, max, sum, kb, vb, scores, corr } = s;
        refill(qf, heads * hd, 0.0);
        let first_head = item.row0 * d.num_heads + item.kv_head * group;
        for (dst, &x) in qf.iter_mut().zip(&q[first_head * hd..][..heads * hd]) {
            *dst = x.to_f32() * self.scale;
        }
        refill(acc, heads * hd, 0.0);
        refill(max, heads, f32::NEG_INFINITY);
        refill(sum, heads, 0.0);
        refill(corr, heads, 1.0);
        reserve_len(scores, group * bs);
        reserve_len(kb, bs * hd);
        reserve_len(vb, bs * hd);
        for (b, &block) in table.iter().enumerate().take(last_block + 1).skip(first_block) {
            let start = b * bs;
            let len = bs.min(pos + 1 - start);
            let (t0, t1) = self.item_keys(&item, pos, start, len);
            if t0 >= t1 {
                continue;
            }
            self.prefetch_block(&item, b + 1, last_block, (k, v));
            let one = Block { heads: group, hd, bs, keys: (t0, t1) };
            for h in 0..item.kv_heads {
                let base = self.head_rows_start(block, item.kv_head + h, rl);
                let qh = &qf[h * group * hd..];
                let state =
                    (&mut acc[h * group * hd..], &mut max[h * group..], &mut sum[h * group..], &mut corr[h * group..]);
                // In the four arms: AVX2, FMA and F16C per the caller; the
                // rows t0..t1 handed over lie in their slices (`Block::run`
                // checks), qf, scores, acc and the softmax state are sized
                // above.
                match (C::as_f32(&k[base..]), C::as_f16(&k[base..])) {
                    (Some(kr), _) => {
                        let vr = C::as_f32(&v[base..]).expect("one format");
                        // SAFETY: see above.
                        unsafe { one.run(qh, (kr, vr, row_stride), scores, state) }
                    }
                    (None, Some(kr)) if group <= TILE_HEADS => {
                        let vr = C::as_f16(&v[base..]).expect("one format");
                        // SAFETY: see above.
                        unsafe { one.run(qh, (kr, vr, row_stride), scores, state) }
                    }
                    (None, Some(kr)) => {
                        // More heads than a value tile read each row again:
                        // widened once, the rows stay in L1 for all of them.
                        let vr = C::as_f16(&v[base..]).expect("one format");
                        // SAFETY: see above.
                        unsafe {
                            widen_f16((kr, vr), row_stride, hd, (t0, t1), (kb, vb));
                            one.run(qh, (&kb[..], &vb[..], hd), scores, state)
                        }
                    }
                    _ => {
                        let (kr, vr, stride) = block_rows((k, v), base, row_stride, hd, len, (kb, vb));
                        // SAFETY: see above.
                        unsafe { one.run(qh, (kr, vr, stride), scores, state) }
                    }
                }
            }
        }
        if !item.is_split() {
            self.normalize(item, heads, acc, max, sum);
        }
    }
}

/// The keys of one block that a decode item sees, for its group's heads.
struct Block {
    heads: usize,
    hd: usize,
    bs: usize,
    keys: (usize, usize),
}

impl Block {
    /// Scores, softmax and values of the block's keys for every head:
    /// `rows` are its K and V rows (`stride` apart, from the block's first
    /// slot), `scores` scratch of heads x bs, the softmax state
    /// `(acc [heads, hd], max, sum, corr)`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available, F16C for f16 rows.
    #[inline(always)]
    unsafe fn run<R: Lane>(
        &self,
        qf: &[f32],
        (k, v, stride): (&[R], &[R], usize),
        scores: &mut [f32],
        (acc, max, sum, corr): (&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
    ) {
        let Self { heads, hd, bs, keys: (t0, t1) } = *self;
        assert!(hd.is_multiple_of(8) && t0 < t1 && t1 <= bs && (t1 - 1) * stride + hd <= k.len().min(v.len()));
        assert!(qf.len() >= heads * hd && scores.len() >= heads * bs && acc.len() >= heads * hd);
        assert!(max.len() >= heads && sum.len() >= heads && corr.len() >= heads);
        // SAFETY: in bounds per the asserts; the features per the caller.
        unsafe {
            for j in 0..heads {
                let sj = &mut scores[j * bs..][..bs];
                dot_keys(qf[j * hd..].as_ptr(), hd, k.as_ptr(), stride, (t0, t1), sj.as_mut_ptr());
                corr[j] = softmax_keys(&mut sj[t0..t1], &mut max[j], &mut sum[j]);
            }
            let a = Accumulation {
                acc: acc.as_mut_ptr(),
                hd,
                p: scores.as_ptr(),
                bs,
                keys: (t0, t1),
                v: v.as_ptr(),
                stride,
                corr: corr.as_ptr(),
            };
            let mut j = 0;
            while j < heads {
                match heads - j {
                    1 => a.heads::<1>(j),
                    2 => a.heads::<2>(j),
                    _ => a.heads::<TILE_HEADS>(j),
                }
                j += TILE_HEADS.min(heads - j);
            }
        }
    }
}

/// Rows t0..t1 of `k` and `v` (`stride` apart) into `kb` and `vb` (`hd`
/// apart, at the same row indices) as f32.
///
/// # Safety
/// AVX2 and F16C must be available.
#[inline(always)]
unsafe fn widen_f16(
    (k, v): (&[half::f16], &[half::f16]),
    stride: usize,
    hd: usize,
    (t0, t1): (usize, usize),
    (kb, vb): (&mut [f32], &mut [f32]),
) {
    assert!(hd.is_multiple_of(8) && t0 < t1 && (t1 - 1) * stride + hd <= k.len().min(v.len()));
    assert!(t1 * hd <= kb.len().min(vb.len()));
    for (src, dst) in [(k, kb), (v, vb)] {
        for t in t0..t1 {
            for c in (0..hd).step_by(8) {
                // SAFETY: in bounds per the asserts; F16C per the caller.
                unsafe {
                    _mm256_storeu_ps(
                        dst.as_mut_ptr().add(t * hd + c),
                        half::f16::load8(src.as_ptr().add(t * stride + c)),
                    )
                };
            }
        }
    }
}

/// A cache value the lanes read in place: 8 of them load as f32 lanes.
trait Lane: Copy {
    /// # Safety
    /// AVX2 (F16C for f16) must be available and 8 values at `p` readable.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Lane for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the trait.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Lane for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the trait.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// `s[t] = q . k[t * stride..][..hd]` for keys t0..t1: 8 keys at a time in
/// 8 independent FMA chains over the head dims, reduced to one vector.
///
/// # Safety
/// AVX2 and FMA (F16C for f16) must be available; hd a multiple of 8, q
/// hd long, rows t0..t1 of k readable, s at least t1 long.
#[inline(always)]
unsafe fn dot_keys<R: Lane>(
    q: *const f32,
    hd: usize,
    k: *const R,
    stride: usize,
    (t0, t1): (usize, usize),
    s: *mut f32,
) {
    let mut t = t0;
    // SAFETY: keys t..t + 8 <= t1 and dims c..c + 8 <= hd, per the caller.
    unsafe {
        while t + 8 <= t1 {
            let mut a = [_mm256_setzero_ps(); 8];
            for c in (0..hd).step_by(8) {
                let qv = _mm256_loadu_ps(q.add(c));
                for (u, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, R::load8(k.add((t + u) * stride + c)), *a);
                }
            }
            _mm256_storeu_ps(s.add(t), sum_each(a));
            t += 8;
        }
        while t < t1 {
            let mut a = _mm256_setzero_ps();
            for c in (0..hd).step_by(8) {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), R::load8(k.add(t * stride + c)), a);
            }
            *s.add(t) = sum(a);
            t += 1;
        }
    }
}

/// The lane sums of 8 vectors, as one vector (a transpose and add).
#[inline(always)]
unsafe fn sum_each(a: [__m256; 8]) -> __m256 {
    // SAFETY: AVX per the callers.
    unsafe {
        // [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67], ...
        let (h01, h23) = (_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let (h45, h67) = (_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        // [a0 0-3, a1 0-3, a2 0-3, a3 0-3 | a0 4-7, a1 4-7, a2 4-7, a3 4-7]
        let (h03, h47) = (_mm256_hadd_ps(h01, h23), _mm256_hadd_ps(h45, h67));
        let low = _mm256_permute2f128_ps::<0x20>(h03, h47);
        let high = _mm256_permute2f128_ps::<0x31>(h03, h47);
        _mm256_add_ps(low, high)
    }
}

/// The sum of one vector's lanes.
#[inline(always)]
unsafe fn sum(a: __m256) -> f32 {
    // SAFETY: AVX per the callers.
    unsafe {
        let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }
}

/// One block of a head's online softmax over its keys: `s` becomes
/// exp(s - new max), `max` and `sum` move on, and the factor that
/// rescales what earlier blocks accumulated is returned.
///
/// # Safety
/// AVX2 and FMA must be available.
#[inline(always)]
unsafe fn softmax_keys(s: &mut [f32], max: &mut f32, sum: &mut f32) -> f32 {
    let n = s.len();
    let p = s.as_mut_ptr();
    // SAFETY: chunks i..i + 8 <= n of s.
    unsafe {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= n {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let block_max = s[i..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let new_max = max.max(block_max);
        let correction = if *max == f32::NEG_INFINITY { 0.0 } else { exp_poly(*max - new_max) };
        let shift = _mm256_set1_ps(new_max);
        let mut total = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), shift));
            _mm256_storeu_ps(p.add(i), e);
            total = _mm256_add_ps(total, e);
            i += 8;
        }
        let mut tail = 0.0;
        for x in &mut s[i..] {
            *x = exp_poly(*x - new_max);
            tail += *x;
        }
        *sum = *sum * correction + self::sum(total) + tail;
        *max = new_max;
        correction
    }
}

/// The value pass of [`Block::run`]: `acc[j] = acc[j] * corr[j] + sum
/// over its keys t of p[j * bs + t] * v[t * stride..][..hd]`, in tiles.
struct Accumulation<R> {
    acc: *mut f32,
    hd: usize,
    p: *const f32,
    bs: usize,
    keys: (usize, usize),
    v: *const R,
    stride: usize,
    corr: *const f32,
}

impl<R: Lane> Accumulation<R> {
    /// Heads j..j + P, every dim, in tiles of 32, 16 and 8 dims.
    #[inline(always)]
    unsafe fn heads<const P: usize>(&self, j: usize) {
        let mut c = 0;
        // SAFETY: in bounds per `Block::run`.
        unsafe {
            while c + 32 <= self.hd {
                self.tile::<P, 4>(j, c);
                c += 32;
            }
            if c + 16 <= self.hd {
                self.tile::<P, 2>(j, c);
                c += 16;
            }
            if c < self.hd {
                self.tile::<P, 1>(j, c);
            }
        }
    }

    /// Heads j..j + P, dims c..c + 8 * DV, across the keys.
    #[inline(always)]
    unsafe fn tile<const P: usize, const DV: usize>(&self, j: usize, c: usize) {
        let Self { acc, hd, p, bs, keys, v, stride, corr } = *self;
        // SAFETY: in bounds per `Block::run`.
        unsafe {
            let mut a = [[_mm256_setzero_ps(); DV]; P];
            for (i, row) in a.iter_mut().enumerate() {
                let f = _mm256_broadcast_ss(&*corr.add(j + i));
                for (o, x) in row.iter_mut().enumerate() {
                    *x = _mm256_mul_ps(_mm256_loadu_ps(acc.add((j + i) * hd + c + 8 * o)), f);
                }
            }
            for t in keys.0..keys.1 {
                let mut vv = [_mm256_setzero_ps(); DV];
                for (o, x) in vv.iter_mut().enumerate() {
                    *x = R::load8(v.add(t * stride + c + 8 * o));
                }
                for (i, row) in a.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*p.add((j + i) * bs + t));
                    for (x, vv) in row.iter_mut().zip(vv) {
                        *x = _mm256_fmadd_ps(w, vv, *x);
                    }
                }
            }
            for (i, row) in a.iter().enumerate() {
                for (o, x) in row.iter().enumerate() {
                    _mm256_storeu_ps(acc.add((j + i) * hd + c + 8 * o), *x);
                }
            }
        }
    }
}
