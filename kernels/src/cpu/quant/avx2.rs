//! AVX2 + FMA + F16C kernels of the quantized matmuls, and the activation
//! quantizer. Callers must have checked those features.

use std::arch::x86_64::*;

use super::{BlockQ8_0, Codes4, Operands, PackedOperands, QK, QuantBlock};
use crate::cpu::load_avx2::hmax;
use crate::cpu::prefetch_within;
use half::f16;

/// See [`super::quantize_activations`].
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize_activations(x: &[f32], xq: &mut [BlockQ8_0], xd: &mut [f32]) {
    let sign = _mm256_set1_ps(-0.0);
    // The largest float below 0.5: s + copysign(it, s) truncates to
    // round-half-away-from-zero(s) for |s| < 2^22 (ties land on the
    // next integer, everything else below it).
    let half = _mm256_set1_ps(0.499_999_97);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for ((src, block), d_out) in x.chunks_exact(QK).zip(xq.iter_mut()).zip(xd.iter_mut()) {
        // SAFETY: src holds 32 floats; AVX2 is enabled on this function.
        let v = [0, 8, 16, 24].map(|o| unsafe { _mm256_loadu_ps(src.as_ptr().add(o)) });
        // max |v| ignoring NaN like f32::max: max_ps returns its second
        // operand, the running maximum, when the first is NaN.
        let m = v.iter().fold(_mm256_setzero_ps(), |m, &x| _mm256_max_ps(_mm256_andnot_ps(sign, x), m));
        // SAFETY: AVX2 is enabled on this function.
        let amax = unsafe { hmax(m) };
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let q = v.map(|x| {
            let s = _mm256_mul_ps(x, inv);
            let s = _mm256_and_ps(s, _mm256_cmp_ps::<_CMP_ORD_Q>(s, s)); // NaN -> 0
            let r = _mm256_add_ps(s, _mm256_or_ps(half, _mm256_and_ps(s, sign)));
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(r);
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        // i32 -> i8 packs work per 128-bit lane: restore the order of
        // the 8 groups of 4 bytes afterwards.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        // SAFETY: qs is 32 writable bytes.
        unsafe { _mm256_storeu_si256(block.qs.as_mut_ptr().cast(), bytes) };
        block.d = f16::from_f32(d);
        *d_out = block.d.to_f32();
    }
}

/// An f16 scale widened, in lane 0.
///
/// # Safety
/// F16C must be available.
#[inline(always)]
pub(super) unsafe fn f16_scale(d: f16) -> __m128 {
    // SAFETY: F16C per the caller.
    unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(d.to_bits() as i32)) }
}

/// Four f16 scales widened by one conversion.
///
/// # Safety
/// F16C must be available.
#[inline(always)]
pub(super) unsafe fn f16_scales4(d: [f16; 4]) -> __m128 {
    let bits = d.iter().enumerate().fold(0u64, |a, (r, d)| a | (d.to_bits() as u64) << (16 * r));
    // SAFETY: F16C per the caller.
    unsafe { _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64)) }
}

/// How far ahead of use the weights are prefetched, in bytes: the best of
/// 1-64 KiB (shorter distances leave the four row streams waiting on DRAM).
const PF_BYTES: usize = 16 << 10;
/// The same for packed weights, one stream per task: 4-32 KiB read the
/// same on the big shapes, and 8 KiB is best on the smallest (k/v).
const PACKED_PF_BYTES: usize = 8 << 10;

/// y[.., n0..n1], 4 weight rows at a time (then single rows).
///
/// # Safety
/// AVX2, FMA and F16C must be available; operand shapes must be
/// consistent (checked by the caller); no other thread writes columns
/// n0..n1 of y during the call.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows<B: QuantBlock>(ops: &Operands<'_, B>, n0: usize, n1: usize) {
    let mut j = n0;
    while j + 4 <= n1 {
        for i in 0..ops.m {
            // SAFETY: forwarded; rows j..j + 4 < n1 <= n.
            let s = unsafe { tile4(ops, j, i) };
            for (r, v) in s.iter().enumerate() {
                // SAFETY: i * n + j + r < m * n; this task owns column j + r.
                unsafe { *ops.y.0.add(i * ops.n + j + r) = *v };
            }
        }
        j += 4;
    }
    while j < n1 {
        for i in 0..ops.m {
            // SAFETY: as above, one row.
            let s = unsafe { tile::<B, 1>(ops, j, i) };
            // SAFETY: as above.
            unsafe { *ops.y.0.add(i * ops.n + j) = s[0] };
        }
        j += 1;
    }
}

/// Dot products of weight rows j..j + 4 with activation row i: as
/// [`tile`], but the 4 rows' f16 scales of a block are gathered into one
/// register and widened by one conversion, and the 4 rows' integer block
/// sums are folded into one register (lane r of each half: row r) before
/// a single int-to-float conversion and FMA with those scales. Per row,
/// that saves a conversion, an FMA and a scale broadcast per block, which
/// counts in a kernel that is compute-bound (Q8_0 decode is).
#[inline(always)]
unsafe fn tile4<B: QuantBlock>(ops: &Operands<'_, B>, j: usize, i: usize) -> [f32; 4] {
    let kb = ops.kb;
    let pf = PF_BYTES;
    // SAFETY: every index below is < kb within rows j..j + 4 < n (weights)
    // or row i < m (activations); prefetches are hints and never fault.
    unsafe {
        let w = ops.w.as_ptr().add(j * kb);
        let x = ops.xq.as_ptr().add(i * kb);
        let xd = ops.xd.as_ptr().add(i * kb);
        let mut acc = _mm256_setzero_ps();
        let span = w.cast::<u8>();
        let w_end = ops.w.as_ptr_range().end.cast::<u8>();
        let step = 4 * size_of::<B>();
        for b in 0..kb {
            if i == 0 {
                prefetch_within(span.wrapping_add(pf + b * step), step, w_end);
            }
            let blocks = [&*w.add(b), &*w.add(kb + b), &*w.add(2 * kb + b), &*w.add(3 * kb + b)];
            let d4 = _mm_mul_ps(B::scales4_avx2(blocks), _mm_broadcast_ss(&*xd.add(b)));
            let xv = _mm256_loadu_si256((*x.add(b)).qs.as_ptr().cast());
            acc = fma_block4(acc, d4, xv, blocks);
        }
        sum_halves(acc)
    }
}

/// `acc + [d4, d4] * s`, s the exact i32 block sums of 4 weight rows'
/// codes `w` with the activation block `xv`, folded into one register
/// (lane r of each 128-bit half: half of row r's sum) so that they are
/// converted and scaled once. As in `tile`: |x| (once for the 4 rows)
/// times w with x's sign, pairs summed to i32.
///
/// Loops and plain functions only, here and in the callers: closures do
/// not inherit the caller's target features, and the intrinsics in them
/// would become calls.
#[inline(always)]
unsafe fn fma_block4(acc: __m256, d4: __m128, xv: __m256i, w: impl FourRows) -> __m256 {
    // SAFETY: AVX2 and FMA are enabled in every caller; w's rows are readable.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let x_abs = _mm256_sign_epi8(xv, xv);
        let mut sums = [_mm256_setzero_si256(); 4];
        for (r, s) in sums.iter_mut().enumerate() {
            // Loaded here, one row at a time: loading all four first
            // made the GGML-layout tile slower.
            *s = _mm256_madd_epi16(_mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(w.codes(r), xv)), ones);
        }
        // Exact in i32 (|sum| <= 32 * 127 * 127).
        let s = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
        _mm256_fmadd_ps(_mm256_set_m128(d4, d4), _mm256_cvtepi32_ps(s), acc)
    }
}

/// Four weight rows' codes at one block index.
trait FourRows {
    /// # Safety
    /// AVX2 must be available; r < 4.
    unsafe fn codes(&self, r: usize) -> __m256i;
}

/// GGML's blocks, one per row.
impl<B: QuantBlock> FourRows for [&B; 4] {
    #[inline(always)]
    unsafe fn codes(&self, r: usize) -> __m256i {
        // SAFETY: per the trait.
        unsafe { self[r].codes_avx2() }
    }
}

/// Packed rows: aligned, adjacent.
impl FourRows for &Codes4 {
    #[inline(always)]
    unsafe fn codes(&self, r: usize) -> __m256i {
        // SAFETY: per the trait; Codes4 is 64-byte aligned, rows 32 bytes.
        unsafe { _mm256_load_si256(self.0[r].as_ptr().cast()) }
    }
}

/// The 4 row sums of a [`fma_block4`] accumulator.
#[inline(always)]
unsafe fn sum_halves(acc: __m256) -> [f32; 4] {
    let mut out = [0f32; 4];
    // SAFETY: AVX is enabled in every caller; out holds 4 floats.
    unsafe {
        _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc)))
    };
    out
}

/// y[.., rows of groups g0..g1] for packed Q8_0 weights.
///
/// # Safety
/// AVX2, FMA and F16C must be available; shapes consistent (checked by
/// the caller); no other thread writes these columns of y.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn packed_groups(ops: &PackedOperands<'_>, g0: usize, g1: usize) {
    let n = ops.w.n;
    for g in g0..g1 {
        for i in 0..ops.m {
            // SAFETY: forwarded; group g < n / 4 rounded up, row i < m.
            let s = unsafe { packed_tile(ops, g, i) };
            for (r, v) in s.iter().enumerate().take(n - 4 * g) {
                // SAFETY: i * n + 4g + r < m * n; this task owns the column.
                unsafe { *ops.y.0.add(i * n + 4 * g + r) = *v };
            }
        }
    }
}

/// Dot products of group g's 4 weight rows with activation row i.
#[inline(always)]
unsafe fn packed_tile(ops: &PackedOperands<'_>, g: usize, i: usize) -> [f32; 4] {
    let kb = ops.w.kb;
    // SAFETY: every index below is < kb within group g or row i < m;
    // prefetches are hints and never fault.
    unsafe {
        let codes = ops.w.codes.as_ptr().add(g * kb);
        let scales = ops.w.scales.as_ptr().add(g * kb);
        let x = ops.xq.as_ptr().add(i * kb);
        let xd = ops.xd.as_ptr().add(i * kb);
        let mut acc = _mm256_setzero_ps();
        let end = ops.w.codes.as_ptr_range().end.cast::<u8>();
        let step = size_of::<Codes4>();
        for b in 0..kb {
            if i == 0 {
                prefetch_within(codes.cast::<u8>().wrapping_add(PACKED_PF_BYTES + b * step), step, end);
            }
            let d4 = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(scales.add(b).cast())), _mm_broadcast_ss(&*xd.add(b)));
            let xv = _mm256_loadu_si256((*x.add(b)).qs.as_ptr().cast());
            acc = fma_block4(acc, d4, xv, &*codes.add(b));
        }
        sum_halves(acc)
    }
}

/// Dot products of weight rows j..j + R with activation row i.
#[inline(always)]
unsafe fn tile<B: QuantBlock, const R: usize>(ops: &Operands<'_, B>, j: usize, i: usize) -> [f32; R] {
    let kb = ops.kb;
    let pf = PF_BYTES;
    // SAFETY: every index below is < kb within rows j..j + R < n (weights)
    // or row i < m (activations); prefetches are hints and never fault.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let w = ops.w.as_ptr().add(j * kb);
        let x = ops.xq.as_ptr().add(i * kb);
        let xd = ops.xd.as_ptr().add(i * kb);
        let mut acc = [_mm256_setzero_ps(); R];
        // Rows j..j + R are one contiguous span, read as R interleaved
        // streams; prefetch it as one linear stream running ahead into
        // the next tile (R * size_of::<B>() bytes consumed per block).
        let span = w.cast::<u8>();
        let w_end = ops.w.as_ptr_range().end.cast::<u8>();
        let step = R * size_of::<B>();
        for b in 0..kb {
            if i == 0 {
                prefetch_within(span.wrapping_add(pf + b * step), step, w_end);
            }
            let xv = _mm256_loadu_si256((*x.add(b)).qs.as_ptr().cast());
            let x_abs = _mm256_sign_epi8(xv, xv); // shared by the R rows
            let dx = _mm_set_ss(*xd.add(b));
            for (r, a) in acc.iter_mut().enumerate() {
                let blk = &*w.add(r * kb + b);
                let wv = blk.codes_avx2();
                // vpmaddubsw takes unsigned x signed bytes: |x| (once
                // per block, for all rows) meets w with x's sign moved
                // onto it, one vpsignb per row. Pairs fit i16 because
                // |x| <= 127 and |w| <= 127 (codes of -128 are clamped
                // at load: negating one would overflow).
                let pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(wv, xv));
                let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                let dw = blk.scale_avx2();
                let d = _mm256_broadcastss_ps(_mm_mul_ss(dw, dx));
                *a = _mm256_fmadd_ps(d, sums, *a);
            }
        }
        acc.map(|a| hsum(a))
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }
}
