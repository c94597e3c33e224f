//! The AVX2 loops (`avx2.rs`) with NEON: four keys' dot products at a time, a
//! 16-lane stretch of the output row in registers across a block's keys.

use std::arch::aarch64::*;
use std::ops::Range;

/// As `avx2::scores`, with NEON.
///
/// # Safety
/// `q.len()` a multiple of 8; those rows of `k` and `scores[keys]` in bounds.
#[inline(always)]
pub(super) unsafe fn scores(q: &[f32], k: &[f32], stride: usize, keys: Range<usize>, scores: &mut [f32]) {
    let hd = q.len();
    debug_assert!(hd.is_multiple_of(8) && keys.end <= scores.len());
    debug_assert!(keys.is_empty() || (keys.end - 1) * stride + hd <= k.len());
    // SAFETY: per the contract, every row read is inside k and every
    // score written inside scores.
    unsafe {
        let (q, k) = (q.as_ptr(), k.as_ptr());
        let mut t = keys.start;
        while t + 4 <= keys.end {
            let rows = [0, 1, 2, 3].map(|i| k.add((t + i) * stride));
            let mut acc = [vdupq_n_f32(0.0); 4];
            for c in (0..hd).step_by(4) {
                let qv = vld1q_f32(q.add(c));
                for (a, row) in acc.iter_mut().zip(rows) {
                    *a = vfmaq_f32(*a, qv, vld1q_f32(row.add(c)));
                }
            }
            // Pairwise adds: lane i ends up with key t + i's sum.
            let four = vpaddq_f32(vpaddq_f32(acc[0], acc[1]), vpaddq_f32(acc[2], acc[3]));
            vst1q_f32(scores.as_mut_ptr().add(t), four);
            t += 4;
        }
        for (t, score) in scores.iter_mut().enumerate().take(keys.end).skip(t) {
            let row = k.add(t * stride);
            let mut acc = vdupq_n_f32(0.0);
            for c in (0..hd).step_by(4) {
                acc = vfmaq_f32(acc, vld1q_f32(q.add(c)), vld1q_f32(row.add(c)));
            }
            *score = vaddvq_f32(acc);
        }
    }
}

/// As `avx2::accumulate`, with NEON.
///
/// # Safety
/// As [`scores`], with `acc.len()` the multiple of 8.
#[inline(always)]
pub(super) unsafe fn accumulate(acc: &mut [f32], w: &[f32], v: &[f32], stride: usize, keys: Range<usize>) {
    let hd = acc.len();
    debug_assert!(hd.is_multiple_of(8) && keys.end <= w.len());
    debug_assert!(keys.is_empty() || (keys.end - 1) * stride + hd <= v.len());
    // SAFETY: per the contract, as in `scores`.
    let (out, v) = (acc.as_mut_ptr(), v.as_ptr());
    // 16 lanes (4 independent FMA chains) at a time, then 8.
    let wide = hd / 16 * 16;
    // SAFETY: per the contract, columns c.. of every row are in bounds.
    unsafe {
        for c in (0..wide).step_by(16) {
            stretch::<4>(out, w, v, stride, keys.clone(), c);
        }
        for c in (wide..hd).step_by(8) {
            stretch::<2>(out, w, v, stride, keys.clone(), c);
        }
    }
}

/// [`accumulate`] for columns `c..c + 4 * N`, held in N registers
/// across the keys.
#[inline(always)]
unsafe fn stretch<const N: usize>(
    out: *mut f32,
    w: &[f32],
    v: *const f32,
    stride: usize,
    keys: Range<usize>,
    c: usize,
) {
    // SAFETY: the caller's columns and rows are in bounds.
    unsafe {
        let mut a: [float32x4_t; N] = std::array::from_fn(|o| vld1q_f32(out.add(c + 4 * o)));
        for t in keys {
            let row = v.add(t * stride + c);
            for (o, x) in a.iter_mut().enumerate() {
                *x = vfmaq_n_f32(*x, vld1q_f32(row.add(4 * o)), w[t]);
            }
        }
        for (o, x) in a.iter().enumerate() {
            vst1q_f32(out.add(c + 4 * o), *x);
        }
    }
}
