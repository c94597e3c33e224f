//! CPU kernels: paged attention, the KV-cache write, the matmuls (dense,
//! packed, quantized) and the fused elementwise passes, with what they
//! share: the instruction sets ([`isa`]), element types, the split of a
//! call among threads, prefetches and the polynomial exp.

mod attention;
pub mod bandwidth;
mod buffers;
mod cache;
mod elem;
mod fused;
mod huge_pages;
pub mod isa;
pub mod kquant;
#[cfg(target_arch = "x86_64")]
mod load_avx2;
pub mod matmul;
pub mod moe;
pub mod packed;
mod parallel;
pub mod placement;
pub mod q8_panel;
pub mod quant;
mod weight_buf;

pub use attention::{paged_attention, paged_attention_into};
pub use bandwidth::{ReadBandwidth, measure_read_bandwidth};
pub use buffers::{copy_columns, read_f32, write_f32};
pub use cache::reshape_and_cache;
pub use fused::{
    Gate, HeadNorm, Rope, add_in_place, add_in_place_op, add_rms_norm, add_rms_norm_op, gated_mul, gated_mul_into_op,
    rms_norm, rms_norm_into_op, rope_in_place, rope_in_place_op, silu_mul, silu_mul_into_op,
};
pub use huge_pages::back_with_huge_pages;
pub use parallel::PoolAwake;
pub use weight_buf::WeightBuf;

pub(crate) use elem::Elem;
pub(crate) use parallel::{OutPtr, for_each_owned, for_each_span};

/// Software-prefetches the cache lines of `at..at + len` that lie before
/// `end` (the end of the array being streamed). A prefetch never faults,
/// but one past the array may land on an unmapped page, whose failed page
/// walk costs far more than a prefetch gains; so the range is clipped, not
/// trusted.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_within(at: *const u8, len: usize, end: *const u8) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(at, len, end);
}

/// [`prefetch_within`] into L2 and the levels below, not L1 (`prefetcht1`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_into_l2_within(at: *const u8, len: usize, end: *const u8) {
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(at, len, end);
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32>(at: *const u8, len: usize, end: *const u8) {
    let len = len.min((end as usize).saturating_sub(at as usize));
    let mut o = 0;
    while o < len {
        // SAFETY: SSE is baseline on x86-64; a prefetch does not access memory.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(at.wrapping_add(o).cast()) };
        o += 64;
    }
}

/// `exp(x)` as a polynomial the compiler vectorises (libm's `expf` is a
/// call per value): Cephes' degree-6 form on the reduced argument, 2^n put
/// in the exponent bits. Relative error below 3e-7 for x in [-87, 88];
/// below that it gives 0, above it exp(88) (f32 overflows at 88.7).
#[inline(always)]
pub(crate) fn exp_poly(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x0 = x.clamp(-87.0, 88.0);
    let t = x0 * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = x0 - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n sits in t's low mantissa bits; put n + 127 into the exponent.
    let bits = (t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127)) << 23;
    e * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_poly_is_within_3e_7_of_exp_and_clamps_its_tails() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (got, want) = (super::exp_poly(x) as f64, (x as f64).exp());
            assert!((got - want).abs() <= 3e-7 * want, "exp({x}): {got} vs {want}");
            x += 0.0137;
        }
        assert!(super::exp_poly(-1e4) < 2e-38 && super::exp_poly(-1e4) >= 0.0);
        assert_eq!(super::exp_poly(1e4), super::exp_poly(88.0));
        assert!(super::exp_poly(1e4).is_finite());
    }
}
