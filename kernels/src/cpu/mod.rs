//! CPU kernels: paged attention and the KV-cache write.

mod attention;
mod buffers;
mod cache;
mod fused;
pub mod matmul;
pub mod quant;

pub use attention::{paged_attention, paged_attention_into};
pub use buffers::{copy_columns, read_f32, write_f32};
pub use cache::reshape_and_cache;
pub use fused::{
    HeadNorm, Rope, add_in_place, add_in_place_op, rms_norm, rms_norm_into_op, rope_in_place, rope_in_place_op,
    silu_mul, silu_mul_into_op,
};

use half::{bf16, f16};

/// Software-prefetches the cache lines of `at..at + len` that lie before
/// `end` (the end of the array being streamed). A prefetch never faults,
/// but one past the array may land on an unmapped page, and the failed page
/// walks cost ~20 us per matmul call; so the range is clipped, not trusted.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_within(at: *const u8, len: usize, end: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let len = len.min((end as usize).saturating_sub(at as usize));
    let mut o = 0;
    while o < len {
        // SAFETY: SSE is baseline on x86-64; a prefetch does not access memory.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(o).cast()) };
        o += 64;
    }
}

/// Element types the CPU kernels read, widened to f32 for arithmetic.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The slice itself when it already is f32, so it can be read without a copy.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Elem for f32 {
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}
