//! Loads of 8 weights widened to f32 lanes, for the AVX2 kernels that
//! stream f32, f16 or bf16 weights (the dense and the packed matmuls), and
//! the horizontal maximum the activation quantizers take.

use super::matmul::WeightElem;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// Widens 8 consecutive weights at `p` to f32 lanes.
pub(crate) trait Load8: WeightElem {
    /// # Safety
    /// `p..p+8` must be readable and the CPU must support AVX2, FMA, F16C.
    unsafe fn load8(p: *const Self) -> __m256;

    /// As [`Load8::load8`], letting the compiler fold the load into the
    /// conversion: one instruction fewer for loops bound by issue width
    /// rather than by the conversion's throughput (the packed tiles).
    ///
    /// # Safety
    /// As [`Load8::load8`].
    #[inline(always)]
    unsafe fn load8_folded(p: *const Self) -> __m256 {
        // SAFETY: forwarded from the caller.
        unsafe { Self::load8(p) }
    }
}

impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: caller guarantees 8 readable f32 and AVX support.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Load8 for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes and F16C support.
        // The load and the conversion stay two instructions: LLVM folds
        // them into `vcvtph2ps ymm, m128`, which on Zen 1 issues less
        // often than the register form after a load.
        unsafe { cvtph_ps_register(_mm_loadu_si128(p.cast())) }
    }

    #[inline(always)]
    unsafe fn load8_folded(p: *const Self) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes and F16C support.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// `vcvtph2ps ymm, xmm` from a register, never folded with its load.
///
/// # Safety
/// The CPU must support AVX and F16C.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn cvtph_ps_register(h: __m128i) -> __m256 {
    let w: __m256;
    // SAFETY: a register-to-register conversion; features per the caller.
    unsafe {
        std::arch::asm!(
            "vcvtph2ps {w}, {h}",
            w = lateout(ymm_reg) w,
            h = in(xmm_reg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    w
}

impl Load8 for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: caller guarantees 16 readable bytes and AVX2 support.
        // bf16 is the top half of an f32: zero-extend and shift left 16.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

/// The largest of 8 lanes. `max_ps` returns its second operand when the
/// first is NaN, so a running maximum kept there skips NaN like `f32::max`.
///
/// # Safety
/// AVX must be available.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn hmax(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}
