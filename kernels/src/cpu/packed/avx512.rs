//! AVX-512F kernels: a panel's 16 rows are one vector. Callers must have
//! checked AVX-512F (and the AVX2 set: F16C's conversions come with it).

use super::{Operands, PANEL, WeightElem, store};
use half::{bf16, f16};
use std::arch::x86_64::*;

/// For the GEMV (decode): prefetches the `size_of::<T>()` cache lines
/// that 4 k's of a panel span, 4 KiB past `at`, with hint `HINT` (the
/// vendor's [`crate::cpu::isa::StreamPrefetch`]): from DRAM, more bandwidth
/// than 1 KiB into L1.
#[inline(always)]
fn prefetch_4k_ahead<T, const HINT: i32>(at: *const T) {
    super::prefetch_lines::<T, HINT>(at, super::PREFETCH_BYTES);
}

/// For the tiles (prefill, batches): the same lines 1 KiB ahead into
/// L1, the AVX2 kernels' rule: into L2 the batched decode step was slower.
#[inline(always)]
fn prefetch_4k<T>(at: *const T) {
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

/// K elements per block in the tiles: a pair of panels' block (16 KiB
/// in f16) stays in L1 while every row group of the call passes over it.
const KB: usize = 256;

/// Most x rows per tile: 14 x 2 accumulators, 2 widened weights and a
/// broadcast x value fill 31 of the 32 vector registers.
const TILE_ROWS: usize = 14;

/// Most row groups of a call (`CHUNK_ROWS` rows).
const MAX_GROUPS: usize = super::CHUNK_ROWS.div_ceil(TILE_ROWS);

/// A group's sums: row, then panel of the pair.
type Sums = [[[f32; PANEL]; 2]; TILE_ROWS];

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
    // Groups of equal height: 16 rows run as 8 + 8, not 14 + 2.
    let groups = m.div_ceil(TILE_ROWS);
    let height = m.div_ceil(groups);
    assert!(groups <= MAX_GROUPS, "packed tiles take at most {} rows", super::CHUNK_ROWS);
    let mut sums = [[[[0f32; PANEL]; 2]; TILE_ROWS]; MAX_GROUPS];
    // One group: nothing to reuse a block for, so no blocking.
    let kb = if groups == 1 { k } else { KB };
    for p in (p0..p1).step_by(2) {
        let w0 = ops.w.data[p * k * PANEL..].as_ptr();
        let w1 = ops.w.data[(p + 1) * k * PANEL..].as_ptr();
        sums[..groups].iter_mut().for_each(|s| *s = [[[0.0; PANEL]; 2]; TILE_ROWS]);
        let mut k0 = 0;
        while k0 < k {
            let len = kb.min(k - k0);
            for (g, s) in sums[..groups].iter_mut().enumerate() {
                let rows = (m - g * height).min(height);
                // SAFETY: x holds rows g * height.. + rows of k, read at
                // k0..k0 + len; panels p and p + 1 hold k * PANEL
                // weights each, read at k0 * PANEL.. for len k's.
                unsafe {
                    let x = ops.x.as_ptr().add(g * height * k + k0);
                    let (a, b) = (w0.add(k0 * PANEL), w1.add(k0 * PANEL));
                    match rows {
                        14 => tile::<T, 14>(x, k, a, b, len, s),
                        13 => tile::<T, 13>(x, k, a, b, len, s),
                        12 => tile::<T, 12>(x, k, a, b, len, s),
                        11 => tile::<T, 11>(x, k, a, b, len, s),
                        10 => tile::<T, 10>(x, k, a, b, len, s),
                        9 => tile::<T, 9>(x, k, a, b, len, s),
                        8 => tile::<T, 8>(x, k, a, b, len, s),
                        7 => tile::<T, 7>(x, k, a, b, len, s),
                        6 => tile::<T, 6>(x, k, a, b, len, s),
                        5 => tile::<T, 5>(x, k, a, b, len, s),
                        4 => tile::<T, 4>(x, k, a, b, len, s),
                        3 => tile::<T, 3>(x, k, a, b, len, s),
                        2 => tile::<T, 2>(x, k, a, b, len, s),
                        _ => tile::<T, 1>(x, k, a, b, len, s),
                    }
                }
            }
            k0 += len;
        }
        for (g, s) in sums[..groups].iter().enumerate() {
            let rows = (m - g * height).min(height);
            for half in 0..2 {
                // The pair's second panel may be the padding one.
                if p + half < real {
                    let mut panel = [[0f32; PANEL]; TILE_ROWS];
                    panel.iter_mut().zip(s).for_each(|(d, s)| *d = s[half]);
                    store(ops, p + half, g * height, &panel[..rows]);
                }
            }
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

/// Adds R x rows (stride ldx) times a block of two panels (`len` k's of
/// PANEL weights at `w0` and at `w1`) to `sums[..R]`: per k, 2 widened
/// weight vectors, R broadcast x values and 2R FMAs into accumulators
/// held in registers.
///
/// # Safety
/// AVX-512F must be available; x rows 0..R must hold `len` values from
/// `x`, and `w0` and `w1` len * PANEL weights each.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tile<T: Load16, const R: usize>(
    x: *const f32,
    ldx: usize,
    w0: *const T,
    w1: *const T,
    len: usize,
    sums: &mut Sums,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: sums rows hold 2 x 16 floats each and R <= TILE_ROWS; x
    // and w reads stay within the bounds the caller gave (i < len).
    unsafe {
        for (a, s) in acc.iter_mut().zip(sums.iter()) {
            *a = [_mm512_loadu_ps(s[0].as_ptr()), _mm512_loadu_ps(s[1].as_ptr())];
        }
        let rows: [*const f32; R] = std::array::from_fn(|r| x.add(r * ldx));
        for i in 0..len {
            if i % 4 == 0 {
                prefetch_4k(w0.add(i * PANEL));
                prefetch_4k(w1.add(i * PANEL));
            }
            let a = T::load16(w0.add(i * PANEL));
            let b = T::load16(w1.add(i * PANEL));
            for (acc, row) in acc.iter_mut().zip(&rows) {
                let xv = _mm512_set1_ps(*row.add(i));
                acc[0] = _mm512_fmadd_ps(xv, a, acc[0]);
                acc[1] = _mm512_fmadd_ps(xv, b, acc[1]);
            }
        }
        for (a, s) in acc.iter().zip(sums.iter_mut()) {
            _mm512_storeu_ps(s[0].as_mut_ptr(), a[0]);
            _mm512_storeu_ps(s[1].as_mut_ptr(), a[1]);
        }
    }
}
