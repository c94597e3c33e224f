//! The KV cache formats CPU attention reads (f32, f16, bf16, q8_0; see
//! [`crate::kv_dtype`]) and how one (slot, kv head) row of each becomes
//! f32 for the score and value loops: f32 rows are read in place, the
//! others widened (f16 with F16C, q8_0 codes zero-extended, scaled and
//! offset with AVX2
//! where the CPU has them) into a block-sized buffer that stays in L1 while
//! every query head of the group reads it.

use half::{bf16, f16};

use crate::kv_dtype::{Q8_PARAM_BYTES, q8_params};

/// A cache's storage unit: `f32`, `f16`, `bf16`, or `u8` (q8_0 rows).
pub(super) trait KvRows: Copy + Send + Sync + 'static {
    /// Units per row of `hd` values.
    fn row_len(hd: usize) -> usize {
        hd
    }
    /// The rows themselves, when they are f32 already.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The rows themselves, when they are f16 (read in place with F16C by
    /// the x86-64 decode path; NEON widens them).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn as_f16(_: &[Self]) -> Option<&[f16]> {
        None
    }
    /// Widens one row (`row_len(dst.len())` units) into `dst`.
    fn widen_row(src: &[Self], dst: &mut [f32]);
}

impl KvRows for f32 {
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn widen_row(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(&src[..dst.len()]);
    }
}

macro_rules! half_rows {
    ($t:ty, $as_f16:expr) => {
        impl KvRows for $t {
            fn as_f16(s: &[Self]) -> Option<&[f16]> {
                $as_f16(s)
            }
            #[inline(always)]
            fn widen_row(src: &[Self], dst: &mut [f32]) {
                // half converts with F16C (x86-64) or NEON when the CPU has it.
                use half::slice::HalfFloatSliceExt;
                src[..dst.len()].convert_to_f32_slice(dst);
            }
        }
    };
}
half_rows!(f16, Some);
half_rows!(bf16, |_| None);

impl KvRows for u8 {
    fn row_len(hd: usize) -> usize {
        hd + Q8_PARAM_BYTES
    }
    #[inline(always)]
    fn widen_row(src: &[Self], dst: &mut [f32]) {
        let hd = dst.len();
        let (step, min) = q8_params(src, hd);
        #[cfg(target_arch = "x86_64")]
        if super::super::isa::has_avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { dequantize_avx2(&src[..hd], step, min, dst) };
        }
        dequantize(&src[..hd], step, min, dst);
    }
}

/// `dst[i] = src[i] * step + min`: a loop the compiler vectorises. (A
/// `mul_add` here would call libm's software fma on CPUs without FMA.)
#[inline(always)]
fn dequantize(src: &[u8], step: f32, min: f32, dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = b as f32 * step + min;
    }
}

/// [`dequantize`] with AVX2: 8 values per zero-extend, convert and FMA.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequantize_avx2(src: &[u8], step: f32, min: f32, dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = (b as f32).mul_add(step, min);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_rows_dequantize_to_code_times_step_plus_min() {
        let hd = 40; // not a multiple of the vector widths
        let mut row: Vec<u8> = (0..hd).map(|i| (i * 6) as u8).collect();
        row.extend_from_slice(&half::bf16::from_f32(0.5).to_le_bytes());
        row.extend_from_slice(&half::bf16::from_f32(-20.0).to_le_bytes());
        assert_eq!(<u8 as KvRows>::row_len(hd), row.len());
        let mut out = vec![0f32; hd];
        u8::widen_row(&row, &mut out);
        let want: Vec<f32> = (0..hd).map(|i| (i * 6) as f32 * 0.5 - 20.0).collect();
        assert_eq!(out, want);
    }
}
