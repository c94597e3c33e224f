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
