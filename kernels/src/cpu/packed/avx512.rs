//! AVX-512F kernels: a panel's 16 rows are one vector. Callers must have
//! checked AVX-512F (and the AVX2 set: F16C's conversions come with it).

use super::{Operands, PANEL, WeightElem, prefetch_4k_ahead, store};
use half::{bf16, f16};
use std::arch::x86_64::*;

/// For the tiles (prefill, batches): the lines of 4 k's 1 KiB ahead into
/// L1 (into L2 the batched decode step was slower); at 91-96% of the
/// AVX-512 peak from m = 16 on (Zen 5), not retuned when the AVX2 kernels
/// moved to 4 KiB.
#[inline(always)]
fn prefetch_1k<T>(at: *const T) {
    super::prefetch_lines::<T, _MM_HINT_T0>(at, 1024);
}

/// Widens 16 consecutive weights to f32 lanes.
pub(super) trait Load16: WeightElem {
    /// # Safety
    /// `p..p+16` must be readable and the CPU must support AVX-512F.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Load16 for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: caller guarantees 64 readable bytes and AVX-512F.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Load16 for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: caller guarantees 32 readable bytes and AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

impl Load16 for bf16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        // SAFETY: caller guarantees 32 readable bytes and AVX-512F.
        // bf16 is the top half of an f32: zero-extend and shift left 16.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// Most x rows per tile: 6 rows x 4 panels, 24 accumulators, with the 4
/// widened weight vectors and a broadcast x value, 29 of the 32 vector
/// registers. Per k: 4 conversions, 6 broadcasts and 24 FMAs. The earlier
/// 14 x 2 shape did a broadcast per 2 FMAs and ran at ~72% of the FMA
/// rate on Zen 4 (double-pumped 512-bit FMAs), where 6 x 4 runs at ~93%:
/// a broadcast per 4 FMAs, as in BLIS's AVX-512 kernels.
const TILE_ROWS: usize = 6;

/// Panels per tile; a task's last, odd pair runs as a tile of 2.
const TILE_PANELS: usize = 4;

/// y[.., columns of panels p0..p1]; p0 even, p1 even or the panel count.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C must be available; the operands' shapes
/// must have been checked (x `[m, k]`, y `[m, n]`, m <= CHUNK_ROWS), p0 <=
/// p1 <= the (even) number of panels in the array, and no other thread
/// may write these columns of y.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn panels<T: Load16>(ops: &Operands<'_, T>, p0: usize, p1: usize) {
    let (m, k) = (ops.m, ops.w.k);
    let real = ops.w.n.div_ceil(PANEL);
    if m == 1 {
        let nta = crate::cpu::isa::stream_prefetch().hint() == _MM_HINT_NTA;
        for p in p0..p1.min(real) {
            // SAFETY: panel p holds k * PANEL weights; x holds k values.
            let sums = unsafe {
                let (x, w) = (ops.x.as_ptr(), ops.w.data.as_ptr().add(p * k * PANEL));
                if nta { gemv::<T, _MM_HINT_NTA>(x, w, k) } else { gemv::<T, _MM_HINT_T1>(x, w, k) }
            };
            store(ops, p, 0, &[sums]);
        }
        return;
    }
    // Groups of equal height: 8 rows run as 4 + 4, not 6 + 2.
    let groups = m.div_ceil(TILE_ROWS);
    let height = m.div_ceil(groups);
    let mut p = p0;
    while p < p1 {
        // The array holds an even number of panels: a pair is always whole.
        if p + TILE_PANELS <= p1 {
            // SAFETY: panels p..p + 4 lie in the array; as below.
            unsafe { panel_tiles::<T, TILE_PANELS>(ops, p, groups, height, real) };
            p += TILE_PANELS;
        } else {
            // SAFETY: panels p, p + 1 lie in the array (p even, p1 even or
            // the count rounded up to even); x rows of each group lie in
            // x's m; this task alone writes these columns.
            unsafe { panel_tiles::<T, 2>(ops, p, groups, height, real) };
            p += 2;
        }
    }
}

/// y[.., columns of panels p..p + P] for every group of `height` x rows:
/// each group's tile reads the P panels over all of k (the first group
/// from memory, the others from L2, where P panels of k weights fit).
///
/// # Safety
/// As [`panels`]; panels p..p + P lie in the array.
#[inline(always)]
unsafe fn panel_tiles<T: Load16, const P: usize>(
    ops: &Operands<'_, T>,
    p: usize,
    groups: usize,
    height: usize,
    real: usize,
) {
    let (m, k) = (ops.m, ops.w.k);
    // SAFETY: panel p + j holds k * PANEL weights from (p + j) * k * PANEL.
    let w: [*const T; P] = std::array::from_fn(|j| unsafe { ops.w.data.as_ptr().add((p + j) * k * PANEL) });
    for g in 0..groups {
        let rows = (m - g * height).min(height);
        // Panel, then row: each panel's rows as `store` takes them.
        let mut sums = [[[0f32; PANEL]; TILE_ROWS]; P];
        // SAFETY: x holds rows g * height.. + rows of k; the panels hold k
        // k's each.
        unsafe {
            let x = ops.x.as_ptr().add(g * height * k);
            match rows {
                6 => tile::<T, P, 6>(x, k, w, &mut sums),
                5 => tile::<T, P, 5>(x, k, w, &mut sums),
                4 => tile::<T, P, 4>(x, k, w, &mut sums),
                3 => tile::<T, P, 3>(x, k, w, &mut sums),
                2 => tile::<T, P, 2>(x, k, w, &mut sums),
                _ => tile::<T, P, 1>(x, k, w, &mut sums),
            }
        }
        // The last panel may be the padding one.
        for (j, panel) in sums.iter().enumerate().take(real - p) {
            store(ops, p + j, g * height, &panel[..rows]);
        }
    }
}

/// One panel's 16 dot products with x over k: 8 k's per step, each with
/// its own accumulator, so that the FMA chains hide their latency.
///
/// 8 k's rather than 4: from DRAM, with the same prefetch, 8 streams f16
/// at close to the machine's read bandwidth and 4 falls short of it.
///
/// # Safety
/// AVX-512F must be available; `x` must hold k values and `w` a panel of
/// k * PANEL weights.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn gemv<T: Load16, const HINT: i32>(x: *const f32, w: *const T, k: usize) -> [f32; PANEL] {
    const STEP: usize = 8;
    let mut acc = [_mm512_setzero_ps(); STEP];
    let mut i = 0;
    // SAFETY: in both loops i + s < k, so x[i + s] and the panel's k-th
    // row of PANEL weights at (i + s) * PANEL are in bounds.
    unsafe {
        while i + STEP <= k {
            prefetch_4k_ahead::<T, HINT>(w.add(i * PANEL));
            prefetch_4k_ahead::<T, HINT>(w.add((i + 4) * PANEL));
            for (s, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(i + s));
                *acc = _mm512_fmadd_ps(xv, T::load16(w.add((i + s) * PANEL)), *acc);
            }
            i += STEP;
        }
        while i < k {
            acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(i)), T::load16(w.add(i * PANEL)), acc[0]);
            i += 1;
        }
    }
    let s = acc.iter().fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
    let mut out = [0f32; PANEL];
    // SAFETY: out holds 16 floats.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// R x rows (stride ldx) times P panels (`ldx` k's of PANEL weights at
/// each of `w`) into `sums[..R]`: per k, P widened weight vectors, R
/// broadcast x values and R * P FMAs into accumulators held in registers;
/// `sums[j][r]` gets panel j's dot products with row r.
/// Each sum runs over k in order, as in the GEMV and the portable loop.
///
/// # Safety
/// AVX-512F must be available; x rows 0..R must hold ldx values from `x`,
/// and each of `w` ldx * PANEL weights.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tile<T: Load16, const P: usize, const R: usize>(
    x: *const f32,
    ldx: usize,
    w: [*const T; P],
    sums: &mut [[[f32; PANEL]; TILE_ROWS]; P],
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // SAFETY: i < ldx, so x rows' i-th values and each panel's i-th PANEL
    // weights are in bounds; prefetches are hints (the array ends with
    // PREFETCH_BYTES of padding).
    unsafe {
        let rows: [*const f32; R] = std::array::from_fn(|r| x.add(r * ldx));
        for i in 0..ldx {
            if i % 4 == 0 {
                w.iter().for_each(|w| prefetch_1k(w.add(i * PANEL)));
            }
            let wv: [__m512; P] = std::array::from_fn(|j| T::load16(w[j].add(i * PANEL)));
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let xv = _mm512_set1_ps(*row.add(i));
                for (a, wv) in acc.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, *wv, *a);
                }
            }
        }
        for (j, panel) in sums.iter_mut().enumerate() {
            for (a, s) in acc.iter().zip(panel.iter_mut()) {
                _mm512_storeu_ps(s.as_mut_ptr(), a[j]);
            }
        }
    }
}
