//! The panels on AVX2 (no VNNI): per 4 k's, one activation quad broadcast
//! to every lane meets 8 rows' codes in one 256-bit vector, so a panel
//! block of 16 rows costs 4 integer instructions per 8 rows and 4 k's and
//! no horizontal sum, against ~6.5 per 4 k's of one row pair in the 4-row
//! tiles of `quant::avx2` (half the int8 rate there: ~37 GMAC/s against
//! ~64 for the Q4_K panels on 2 Zen 3 cores).
//!
//! `vpmaddubsw` takes unsigned times signed bytes and saturates its pair
//! sums at i16: the stored `w + 128` times x would overflow, so the codes
//! are flipped back to w (one xor per vector) and, as in `quant::avx2`,
//! |x| meets w carrying x's sign (`vpsignb`): pairs of at most 2 * 127 *
//! 127 fit. `vpmaddwd` by ones then gives each row's 4-k sum in its i32
//! lane, exact; per block the 8 sums per row are converted and scaled.

use std::arch::x86_64::*;

use super::{Operands, PANEL, PanelBlock, QK, store};
use crate::cpu::quant::BlockQ8_0;

/// Most x rows per tile: 2 rows x 2 halves of i32 sums and f32
/// accumulators, 2 weight vectors, the broadcasts and the constants fill
/// the 16 vector registers.
const TILE_ROWS: usize = 4;

/// How far ahead the first row group prefetches a panel's codes.
const PF_BYTES: usize = 2 << 10;

/// y[.., columns of panels p0..p1].
///
/// # Safety
/// AVX2, FMA and F16C must be available; the operands' shapes must have
/// been checked; no other thread may write these columns of y.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panels(ops: &Operands<'_>, p0: usize, p1: usize) {
    let m = ops.m;
    for p in p0..p1 {
        let mut i0 = 0;
        while i0 < m {
            let rows = (m - i0).min(TILE_ROWS);
            let mut sums = [[0f32; PANEL]; TILE_ROWS];
            // SAFETY: rows i0..i0 + rows < m; panel p < panels; the first
            // row group of the panel prefetches its codes.
            unsafe {
                match rows {
                    4 => tile::<4>(ops, p, i0, i0 == 0, &mut sums),
                    3 => tile::<3>(ops, p, i0, i0 == 0, &mut sums),
                    2 => tile::<2>(ops, p, i0, i0 == 0, &mut sums),
                    _ => tile::<1>(ops, p, i0, i0 == 0, &mut sums),
                }
            }
            for (r, s) in sums.iter().enumerate().take(rows) {
                store(ops, p, i0 + r, s);
            }
            i0 += rows;
        }
    }
}

/// Panel p's 16 dot products with x rows i0..i0 + R, into `sums[..R]`.
///
/// # Safety
/// As [`panels`]; rows i0..i0 + R < m, p < the panel count.
#[inline(always)]
unsafe fn tile<const R: usize>(
    ops: &Operands<'_>,
    p: usize,
    i0: usize,
    prefetch: bool,
    sums: &mut [[f32; PANEL]; TILE_ROWS],
) {
    let kb = ops.w.kb;
    // SAFETY: every block index is < kb in panel p's span of the codes and
    // scales, every activation index in rows i0..i0 + R; prefetches are
    // hints and stay within the codes array.
    unsafe {
        let codes = ops.w.codes.as_ptr().add(p * kb);
        let scales = ops.w.scales.as_ptr().add(p * kb);
        let end = ops.w.codes.as_ptr_range().end.cast::<u8>();
        let xq: [*const BlockQ8_0; R] = std::array::from_fn(|r| ops.xq.as_ptr().add((i0 + r) * kb));
        let xd: [*const f32; R] = std::array::from_fn(|r| ops.xd.as_ptr().add((i0 + r) * kb));
        let flip = _mm256_set1_epi8(i8::MIN);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..kb {
            let blk: *const PanelBlock = codes.add(b);
            let mut dots = [[_mm256_setzero_si256(); 2]; R];
            for t in 0..QK / 4 {
                if prefetch {
                    crate::cpu::prefetch_within(blk.cast::<u8>().wrapping_add(PF_BYTES + 64 * t), 64, end);
                }
                // Rows 0-7 and 8-15 of quad t, back to signed codes.
                let quad = (*blk).0[t].as_ptr().cast::<__m256i>();
                let w = [
                    _mm256_xor_si256(_mm256_load_si256(quad), flip),
                    _mm256_xor_si256(_mm256_load_si256(quad.add(1)), flip),
                ];
                for (d, x) in dots.iter_mut().zip(&xq) {
                    let xv = _mm256_set1_epi32((*x.add(b)).qs.as_ptr().add(4 * t).cast::<i32>().read_unaligned());
                    let x_abs = _mm256_sign_epi8(xv, xv);
                    for (d, &w) in d.iter_mut().zip(&w) {
                        let pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(w, xv));
                        *d = _mm256_add_epi32(*d, _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            let s = scales.add(b).cast::<__m128i>();
            let dw = [_mm256_cvtph_ps(_mm_loadu_si128(s)), _mm256_cvtph_ps(_mm_loadu_si128(s.add(1)))];
            for ((a, d), x) in acc.iter_mut().zip(&dots).zip(&xd) {
                let dx = _mm256_set1_ps(*x.add(b));
                for h in 0..2 {
                    a[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h]), _mm256_mul_ps(dw[h], dx), a[h]);
                }
            }
        }
        for (a, s) in acc.iter().zip(sums.iter_mut()) {
            _mm256_storeu_ps(s.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(s.as_mut_ptr().add(8), a[1]);
        }
    }
}
