//! AVX2 + FMA + F16C kernels of the packed matmul: a panel's 16 rows are
//! two vectors. Callers must have checked those features.

use super::{Operands, PANEL, prefetch_4k_ahead, store};
use crate::cpu::load_avx2::Load8;
use std::arch::x86_64::*;

/// K elements per block in the tiles: a panel's block (8 KiB in f16)
/// stays in L1 while every tile row group of the call passes over it.
const KB: usize = 256;

/// x rows per tile: 6 x 2 accumulators, 2 widened weights and a
/// broadcast x value fill 15 of the 16 vector registers.
const TILE_ROWS: usize = 6;

/// Most tile row groups of a call (`CHUNK_ROWS` rows).
const MAX_GROUPS: usize = super::CHUNK_ROWS.div_ceil(TILE_ROWS);

/// y[.., columns of panels p0..p1].
///
/// # Safety
/// AVX2, FMA and F16C must be available; the operands' shapes must have
/// been checked (x `[m, k]`, y `[m, n]`, m <= CHUNK_ROWS), p0 <= p1 <=
/// the panel count, and no other thread may write these columns of y.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panels<T: Load8>(ops: &Operands<'_, T>, p0: usize, p1: usize) {
    let (m, k) = (ops.m, ops.w.k);
    if m == 1 {
        for p in p0..p1 {
            // SAFETY: panel p holds k * PANEL weights; x holds k values.
            let sums = unsafe { gemv(ops.x.as_ptr(), ops.w.data.as_ptr().add(p * k * PANEL), k) };
            store(ops, p, 0, &[sums]);
        }
        return;
    }
    let groups = m.div_ceil(TILE_ROWS);
    assert!(groups <= MAX_GROUPS, "packed tiles take at most {} rows", super::CHUNK_ROWS);
    let mut sums = [[[0f32; PANEL]; TILE_ROWS]; MAX_GROUPS];
    // One group: nothing to reuse a block for, so no blocking.
    let kb = if groups == 1 { k } else { KB };
    for p in p0..p1 {
        let panel = ops.w.data[p * k * PANEL..].as_ptr();
        sums[..groups].iter_mut().for_each(|s| *s = [[0.0; PANEL]; TILE_ROWS]);
        let mut k0 = 0;
        while k0 < k {
            let len = kb.min(k - k0);
            for (g, s) in sums[..groups].iter_mut().enumerate() {
                let rows = (m - g * TILE_ROWS).min(TILE_ROWS);
                // SAFETY: x holds rows g * 6.. + rows of k, read at
                // k0..k0 + len; the panel holds k * PANEL weights, read
                // at k0 * PANEL.. for len k's.
                unsafe {
                    let x = ops.x.as_ptr().add(g * TILE_ROWS * k + k0);
                    let w = panel.add(k0 * PANEL);
                    match rows {
                        6 => tile::<T, 6>(x, k, w, len, s),
                        5 => tile::<T, 5>(x, k, w, len, s),
                        4 => tile::<T, 4>(x, k, w, len, s),
                        3 => tile::<T, 3>(x, k, w, len, s),
                        2 => tile::<T, 2>(x, k, w, len, s),
                        _ => tile::<T, 1>(x, k, w, len, s),
                    }
                }
            }
            k0 += len;
        }
        for (g, s) in sums[..groups].iter().enumerate() {
            let rows = (m - g * TILE_ROWS).min(TILE_ROWS);
            store(ops, p, g * TILE_ROWS, &s[..rows]);
        }
    }
}

/// One panel's 16 dot products with x over k: 4 k's per step, each with
/// its own 2 accumulators, so that 8 FMA chains hide their latency.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `x` must hold k values and `w`
/// a panel of k * PANEL weights.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<T: Load8>(x: *const f32, w: *const T, k: usize) -> [f32; PANEL] {
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let mut i = 0;
    // SAFETY: in both loops i + s < k, so x[i + s] and the panel's k-th
    // row of PANEL weights at (i + s) * PANEL are in bounds.
    unsafe {
        while i + 4 <= k {
            prefetch_4k_ahead::<T, _MM_HINT_T0>(w.add(i * PANEL));
            for (s, acc) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*x.add(i + s));
                let wk = w.add((i + s) * PANEL);
                acc[0] = _mm256_fmadd_ps(xv, T::load8_folded(wk), acc[0]);
                acc[1] = _mm256_fmadd_ps(xv, T::load8_folded(wk.add(8)), acc[1]);
            }
            i += 4;
        }
        while i < k {
            let xv = _mm256_broadcast_ss(&*x.add(i));
            let wk = w.add(i * PANEL);
            acc[0][0] = _mm256_fmadd_ps(xv, T::load8_folded(wk), acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(xv, T::load8_folded(wk.add(8)), acc[0][1]);
            i += 1;
        }
    }
    let mut out = [0f32; PANEL];
    for (h, half) in out.chunks_exact_mut(8).enumerate() {
        let s = _mm256_add_ps(_mm256_add_ps(acc[0][h], acc[1][h]), _mm256_add_ps(acc[2][h], acc[3][h]));
        // SAFETY: each half holds 8 floats.
        unsafe { _mm256_storeu_ps(half.as_mut_ptr(), s) };
    }
    out
}

/// Adds R x rows (stride ldx) times a panel block (`len` k's of PANEL
/// weights at `w`) to `sums[..R]`: per k, 2 widened weight vectors, R
/// broadcast x values and 2R FMAs into accumulators held in registers.
///
/// # Safety
/// AVX2, FMA and F16C must be available; x rows 0..R must hold `len`
/// values from `x` and `w` must hold len * PANEL weights.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<T: Load8, const R: usize>(
    x: *const f32,
    ldx: usize,
    w: *const T,
    len: usize,
    sums: &mut [[f32; PANEL]; TILE_ROWS],
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: sums rows hold 16 floats each and R <= TILE_ROWS; x and w
    // reads stay within the bounds the caller gave (i < len).
    unsafe {
        for (a, s) in acc.iter_mut().zip(sums.iter()) {
            *a = [_mm256_loadu_ps(s.as_ptr()), _mm256_loadu_ps(s.as_ptr().add(8))];
        }
        let rows: [*const f32; R] = std::array::from_fn(|r| x.add(r * ldx));
        for i in 0..len {
            if i % 4 == 0 {
                prefetch_4k_ahead::<T, _MM_HINT_T0>(w.add(i * PANEL));
            }
            let w0 = T::load8_folded(w.add(i * PANEL));
            let w1 = T::load8_folded(w.add(i * PANEL + 8));
            for (a, row) in acc.iter_mut().zip(&rows) {
                let xv = _mm256_broadcast_ss(&*row.add(i));
                a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
            }
        }
        for (a, s) in acc.iter().zip(sums.iter_mut()) {
            _mm256_storeu_ps(s.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(s.as_mut_ptr().add(8), a[1]);
        }
    }
}
