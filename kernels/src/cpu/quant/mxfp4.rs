//! MXFP4 (OCP microscaling FP4), GGML's `block_mxfp4`: 32 weights as 4-bit
//! E2M1 floats sharing one E8M0 scale (a power of two), 17 bytes per 32
//! weights (4.25 bits). gpt-oss ships its experts in it.
//!
//! As in GGML, the E2M1 values are kept doubled so that they are integers
//! (`0, 1, 2, 3, 4, 6, 8, 12` and their negatives) and the scale halved:
//! `w = 2^(e - 128) * code`. The matmul is then `matmul_quant`'s int8 dot
//! against Q8_0 activations; the codes come from a 16-entry table (one
//! `vpshufb` / `tbl` per block). Byte j holds weight j in its low nibble
//! and weight j + 16 in its high nibble, as Q4_0.

use super::QK;

/// Weights per MXFP4 block.
pub const QK_MXFP4: usize = QK;

/// GGML's `kvalues_mxfp4`: each E2M1 code's value, doubled.
const VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// GGML's `block_mxfp4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockMxfp4 {
    /// The shared exponent (E8M0): the scale is `2^(e - 127)`.
    pub e: u8,
    pub qs: [u8; QK_MXFP4 / 2],
}

impl BlockMxfp4 {
    /// A block from Hugging Face's packing of the same codes (the
    /// published gpt-oss checkpoints' `*_blocks`): byte j holds weight 2j
    /// in its low nibble and weight 2j + 1 in its high nibble.
    pub fn from_hf(e: u8, packed: &[u8; QK_MXFP4 / 2]) -> Self {
        let code = |w: usize| (packed[w / 2] >> (4 * (w % 2))) & 0x0F;
        Self { e, qs: std::array::from_fn(|j| code(j) | (code(j + QK_MXFP4 / 2) << 4)) }
    }
}

/// Half of E8M0 `e`'s value, `2^(e - 128)`, as GGML's
/// `GGML_E8M0_TO_FP32_HALF` (exact: `e` 0 and 1 are subnormal floats).
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

impl super::QuantBlock for BlockMxfp4 {
    const NAME: &'static str = "mxfp4";
    const ZERO: Self = Self { e: 0, qs: [0; QK / 2] };
    fn scale(&self) -> f32 {
        e8m0_to_f32_half(self.e)
    }
    fn codes(&self) -> [i8; QK] {
        let mut out = [0i8; QK];
        for (j, &b) in self.qs.iter().enumerate() {
            out[j] = VALUES[usize::from(b & 0x0F)];
            out[j + QK / 2] = VALUES[usize::from(b >> 4)];
        }
        out
    }
    /// GGML's `quantize_row_mxfp4_ref`: the exponent puts the largest
    /// magnitude in [4, 8) (the top codes 8 and 12, halved scale), each
    /// weight takes the nearest code (the first on ties).
    fn quantize(src: &[f32; QK]) -> Self {
        let amax = src.iter().fold(0f32, |a, &v| if a < v.abs() { v.abs() } else { a });
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as u8 } else { 0 };
        let d = e8m0_to_f32_half(e);
        let nearest = |x: f32| -> u8 {
            let mut best = (0u8, (f32::from(VALUES[0]) * d - x).abs());
            for (i, &v) in VALUES.iter().enumerate().skip(1) {
                let err = (f32::from(v) * d - x).abs();
                if err < best.1 {
                    best = (i as u8, err);
                }
            }
            best.0
        };
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = nearest(src[j]) | (nearest(src[j + QK / 2]) << 4);
        }
        Self { e, qs }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: qs is 16 readable bytes, VALUES 16; AVX2 per the caller.
        // Low nibbles are weights 0..16 (lower lane), high nibbles 16..32;
        // vpshufb looks each nibble up in its lane's copy of the table.
        unsafe {
            let table = _mm_loadu_si128(VALUES.as_ptr().cast());
            let packed = _mm_loadu_si128(self.qs.as_ptr().cast());
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            let nibbles = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
            _mm256_shuffle_epi8(_mm256_set_m128i(table, table), nibbles)
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scale_avx2(&self) -> std::arch::x86_64::__m128 {
        // SAFETY: SSE is part of x86_64.
        unsafe { std::arch::x86_64::_mm_set_ss(self.scale()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales4_avx2(blocks: [&Self; 4]) -> std::arch::x86_64::__m128 {
        let [a, b, c, d] = blocks.map(|b| b.scale());
        // SAFETY: SSE is part of x86_64.
        unsafe { std::arch::x86_64::_mm_setr_ps(a, b, c, d) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn codes_neon(&self) -> (std::arch::aarch64::int8x16_t, std::arch::aarch64::int8x16_t) {
        use std::arch::aarch64::*;
        // SAFETY: qs is 16 readable bytes, VALUES 16; NEON per the caller.
        unsafe {
            let table = vld1q_s8(VALUES.as_ptr());
            let packed = vld1q_u8(self.qs.as_ptr());
            (vqtbl1q_s8(table, vandq_u8(packed, vdupq_n_u8(0x0F))), vqtbl1q_s8(table, vshrq_n_u8::<4>(packed)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{QuantBlock, dequantize_row, quantize_row};
    use super::*;

    #[test]
    fn e8m0_halves_are_powers_of_two_down_to_subnormals() {
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(254), 2f32.powi(126));
    }

    /// Every code decodes to its E2M1 value times the scale, nibble order
    /// as Q4_0's.
    #[test]
    fn codes_decode_to_e2m1_values() {
        let block = BlockMxfp4 { e: 129, qs: std::array::from_fn(|j| (j as u8) | ((15 - j as u8) << 4)) };
        let mut w = [0f32; QK];
        dequantize_row(&[block], &mut w);
        let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for j in 0..16 {
            // The scale 2^(129 - 127) = 4 on the undoubled values.
            assert_eq!(w[j], 4.0 * e2m1[j], "weight {j}");
            assert_eq!(w[j + 16], 4.0 * e2m1[15 - j], "weight {}", j + 16);
        }
    }

    /// Hugging Face's packing (weights 2j, 2j + 1 in byte j) decodes to
    /// the same weights as GGML's once repacked.
    #[test]
    fn hugging_face_packing_repacks_to_the_same_weights() {
        let packed: [u8; 16] = std::array::from_fn(|j| (j as u8).wrapping_mul(37) ^ 0x5A);
        let block = BlockMxfp4::from_hf(125, &packed);
        let mut w = [0f32; QK];
        dequantize_row(&[block], &mut w);
        let d = e8m0_to_f32_half(125);
        for (j, byte) in packed.iter().enumerate() {
            assert_eq!(w[2 * j], f32::from(VALUES[usize::from(byte & 0x0F)]) * d, "weight {}", 2 * j);
            assert_eq!(w[2 * j + 1], f32::from(VALUES[usize::from(byte >> 4)]) * d, "weight {}", 2 * j + 1);
        }
    }

    /// Values on the grid quantize to themselves; others to the nearest
    /// grid value.
    #[test]
    fn quantizing_keeps_grid_values_and_rounds_to_the_nearest() {
        let grid: [f32; QK] = std::array::from_fn(|j| f32::from(VALUES[j % 16]) * 0.25);
        let mut blocks = [BlockMxfp4::ZERO];
        quantize_row(&grid, &mut blocks).unwrap();
        let mut back = [0f32; QK];
        dequantize_row(&blocks, &mut back);
        assert_eq!(back, grid);
        let src: [f32; QK] = std::array::from_fn(|j| (j as f32 - 15.5) * 0.37);
        quantize_row(&src, &mut blocks).unwrap();
        dequantize_row(&blocks, &mut back);
        let d = blocks[0].scale();
        for (x, w) in src.iter().zip(back) {
            let best = VALUES.iter().map(|&v| (f32::from(v) * d - x).abs()).fold(f32::INFINITY, f32::min);
            assert_eq!((w - x).abs(), best, "{x} -> {w}");
        }
    }
}
