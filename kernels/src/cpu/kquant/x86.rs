//! The k-quant dot products on x86: a weight block's codes are unpacked
//! into 8 registers of 32 unsigned bytes once, then dotted with each
//! activation row's Q8_K block. Byte products summed 4 to an i32 lane come
//! from `vpmaddubsw` + `vpmaddwd` (AVX2) or one `vpdpbusd` (AVX-512 VNNI);
//! lane t of chunk c covers weights 32c + 4t..32c + 4t + 4, so lanes 0-3
//! are group 2c and lanes 4-7 group 2c + 1, and one `vpmulld` applies
//! both groups' scales. Exact in i32: |q| <= 63, |x| <= 127.

use std::arch::x86_64::*;

use super::{BlockQ4K, BlockQ6K, BlockQ8K, GROUP, KBlock, QK_K};
use crate::cpu::load_avx2::hmax;

/// Sums of 4 adjacent byte products (unsigned `q` times signed `x`) per i32 lane.
trait ByteDot {
    /// # Safety
    /// The instruction set of the implementation must be available.
    unsafe fn dot(q: __m256i, x: __m256i) -> __m256i;
}

struct Avx2;
impl ByteDot for Avx2 {
    #[inline(always)]
    unsafe fn dot(q: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 per the caller. Pairs fit i16: 2 * 63 * 127 < 2^15.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)) }
    }
}

struct Vnni;
impl ByteDot for Vnni {
    #[inline(always)]
    unsafe fn dot(q: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI and VL per the caller.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x) }
    }
}

/// Q4_K's codes in registers, 32 weights each (see [`KBlock::codes_x86`]).
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn q4k_codes(blk: &BlockQ4K) -> [__m256i; 8] {
    // SAFETY: AVX2 per the caller; qs holds 4 * 32 bytes.
    unsafe {
        let low = _mm256_set1_epi8(0x0F);
        let mut out = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let q = _mm256_loadu_si256(blk.qs.as_ptr().add(32 * c).cast());
            out[2 * c] = _mm256_and_si256(q, low);
            out[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low);
        }
        out
    }
}

/// Q6_K's codes in registers, 32 weights each.
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
pub(super) unsafe fn q6k_codes(blk: &BlockQ6K) -> [__m256i; 8] {
    // SAFETY: AVX2 per the caller; ql holds 2 * 64 bytes and qh 2 * 32.
    unsafe {
        let (low, two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
        // The high 2 bits (already shifted down to bits 0-1) moved to bits 4-5.
        // (A macro, not a closure: closures do not inherit target features.)
        macro_rules! high {
            ($v:expr) => {
                _mm256_slli_epi16::<4>(_mm256_and_si256($v, two))
            };
        }
        let mut out = [_mm256_setzero_si256(); 8];
        for half in 0..2 {
            let a = _mm256_loadu_si256(blk.ql.as_ptr().add(64 * half).cast());
            let b = _mm256_loadu_si256(blk.ql.as_ptr().add(64 * half + 32).cast());
            let h = _mm256_loadu_si256(blk.qh.as_ptr().add(32 * half).cast());
            let o = &mut out[4 * half..];
            o[0] = _mm256_or_si256(_mm256_and_si256(a, low), high!(h));
            o[1] = _mm256_or_si256(_mm256_and_si256(b, low), high!(_mm256_srli_epi16::<2>(h)));
            o[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(a), low), high!(_mm256_srli_epi16::<4>(h)));
            o[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b), low), high!(_mm256_srli_epi16::<6>(h)));
        }
        out
    }
}

/// One weight row against `acc.len() / 8` activation rows of `kb` blocks,
/// summed into 8 lanes per activation row (`acc[8i..8i + 8]`, added up by
/// the caller once per row: no horizontal sum per block).
///
/// # Safety
/// AVX2 (and for `D = Vnni`, AVX-512 VNNI and VL) must be available;
/// `wrow.len() == kb` and `xs.len() * 8 == acc.len() * kb`.
#[inline(always)]
unsafe fn row<B: KBlock, D: ByteDot>(wrow: &[B], xs: &[BlockQ8K], kb: usize, acc: &mut [f32]) {
    debug_assert!(wrow.len() == kb && xs.len() * 8 == acc.len() * kb);
    // SAFETY: the features per the caller; every load reads inside a block
    // (qs 8 * 32 bytes, bsums and mn 16 i16).
    unsafe {
        for (b, blk) in wrow.iter().enumerate() {
            let codes = blk.codes_x86();
            let (sc, mn, d, dm) = blk.factors();
            let mut scales = [_mm256_setzero_si256(); 8];
            for (c, s) in scales.iter_mut().enumerate() {
                let (s0, s1) = (sc[2 * c] as i32, sc[2 * c + 1] as i32);
                *s = _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1);
            }
            let mins = _mm256_loadu_si256(mn.as_ptr().cast());
            for (i, a) in acc.chunks_exact_mut(8).enumerate() {
                let x = &xs[i * kb + b];
                let mut isum = _mm256_setzero_si256();
                for c in 0..8 {
                    let xv = _mm256_loadu_si256(x.qs.as_ptr().add(32 * c).cast());
                    isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(D::dot(codes[c], xv), scales[c]));
                }
                let msum = _mm256_madd_epi16(mins, _mm256_loadu_si256(x.bsums.as_ptr().cast()));
                let v = _mm256_loadu_ps(a.as_ptr());
                let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x.d * d), v);
                let v = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(x.d * dm), v);
                _mm256_storeu_ps(a.as_mut_ptr(), v);
            }
        }
    }
}

/// See [`row`].
///
/// # Safety
/// AVX2, FMA and F16C must be available; shapes as [`row`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_avx2<B: KBlock>(wrow: &[B], xs: &[BlockQ8K], kb: usize, acc: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { row::<B, Avx2>(wrow, xs, kb, acc) }
}

/// See [`row`].
///
/// # Safety
/// AVX2, AVX-512 VNNI and VL must be available; shapes as [`row`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_vnni<B: KBlock>(wrow: &[B], xs: &[BlockQ8K], kb: usize, acc: &mut [f32]) {
    // SAFETY: forwarded.
    unsafe { row::<B, Vnni>(wrow, xs, kb, acc) }
}

/// [`BlockQ8K::quantize`] in 8 lanes: the same codes, scale and sums, bit
/// for bit (it runs on one thread before every k-quant matmul, ~2% of a
/// Q4_K_M decode step as a scalar loop).
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_q8k(src: &[f32; QK_K]) -> BlockQ8K {
    const CHUNKS: usize = QK_K / 8;
    // SAFETY: AVX2 per the caller; every load reads 8 of src's 256 floats.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let load = |c: usize| _mm256_loadu_ps(src.as_ptr().add(8 * c));
        // The largest magnitude, NaN skipped as the scalar loop skips it:
        // max_ps returns its second operand, the running maximum, when the
        // first is NaN.
        let mut m = _mm256_setzero_ps();
        for c in 0..CHUNKS {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, load(c)), m);
        }
        let amax = hmax(m);
        if amax == 0.0 {
            return BlockQ8K::ZERO;
        }
        // The first value of that magnitude, the one the scalar loop keeps.
        let splat = _mm256_set1_ps(amax);
        let mut first = 0;
        for c in 0..CHUNKS {
            let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, load(c)), splat));
            if hits != 0 {
                first = 8 * c + hits.trailing_zeros() as usize;
                break;
            }
        }
        let iscale = -127.0 / src[first];
        let mut out = BlockQ8K { d: 1.0 / iscale, ..BlockQ8K::ZERO };
        let (scale, lo, hi) = (_mm256_set1_ps(iscale), _mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (c4, qs) in out.qs.chunks_exact_mut(32).enumerate() {
            let q = [0, 1, 2, 3].map(|j| {
                let s = _mm256_mul_ps(load(4 * c4 + j), scale);
                let s = _mm256_and_ps(s, _mm256_cmp_ps::<_CMP_ORD_Q>(s, s)); // NaN -> 0
                // Ties to even, as the scalar magic-number rounding.
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(s);
                _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            // i32 -> i8 packs work per 128-bit lane: the 8 groups of 4
            // bytes put back in order afterwards.
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256(qs.as_mut_ptr().cast(), _mm256_permutevar8x32_epi32(bytes, order));
        }
        for (g, sum) in out.bsums.iter_mut().enumerate() {
            *sum = out.qs[g * GROUP..(g + 1) * GROUP].iter().map(|&q| q as i16).sum();
        }
        out
    }
}
