//! The element types the CPU kernels read: f32, f16 and bf16, widened to
//! f32 for arithmetic. [`WeightElem`] is the public face (the weights a
//! matmul streams), `Elem` the crate's (activations and KV caches, which
//! are also written back).

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// The stored weight formats we know how to widen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDType {
    F32,
    F16,
    BF16,
}

/// Weight element types we stream; widened to f32 in registers.
///
/// Sealed: the SIMD dispatch reinterprets `&[Self]` as the concrete type named
/// by [`WeightElem::DTYPE`], which is only sound for the three impls here.
pub trait WeightElem: sealed::Sealed + Copy + Send + Sync + 'static {
    const DTYPE: WeightDType;
    const ZERO: Self;
    fn to_f32(self) -> f32;
    /// Widens `src` into `dst` (same length).
    fn widen_slice(src: &[Self], dst: &mut [f32]);
}

/// Element types the CPU kernels read, widened to f32 for arithmetic.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl WeightElem for f32 {
    const DTYPE: WeightDType = WeightDType::F32;
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// Both traits for a 16-bit float type of `half`.
macro_rules! half_elem {
    ($t:ident, $dtype:ident) => {
        impl WeightElem for $t {
            const DTYPE: WeightDType = WeightDType::$dtype;
            const ZERO: Self = $t::ZERO;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst);
            }
        }

        impl Elem for $t {
            #[inline(always)]
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
            #[inline(always)]
            fn from_f32(x: f32) -> Self {
                $t::from_f32(x)
            }
        }
    };
}

half_elem!(f16, F16);
half_elem!(bf16, BF16);
