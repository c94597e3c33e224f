//! CPU kernels: paged attention, the KV-cache write, the matmuls (dense,
//! packed, quantized) and the fused elementwise passes.

mod attention;
mod buffers;
mod cache;
mod fused;
mod huge_pages;
pub mod matmul;
pub mod packed;
pub mod quant;
pub mod vnni;
mod weight_buf;

pub use attention::{paged_attention, paged_attention_into};
pub use buffers::{copy_columns, read_f32, write_f32};
pub use cache::reshape_and_cache;
pub use fused::{
    HeadNorm, Rope, add_in_place, add_in_place_op, rms_norm, rms_norm_into_op, rope_in_place, rope_in_place_op,
    silu_mul, silu_mul_into_op,
};
pub use huge_pages::{back_with_huge_pages, measure_read_bandwidth};
pub use weight_buf::WeightBuf;

use half::{bf16, f16};
use rayon::prelude::*;

/// Runs `f(i0, i1)` over `0..items` cut into spans on rayon's pool: about 8
/// per thread, so both cores balance, each `clamp.0..=clamp.1` items long,
/// so scheduling costs nothing next to streaming a span's weights.
pub(crate) fn for_each_span(items: usize, clamp: (usize, usize), f: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let per_task = items.div_ceil(threads * 8).clamp(clamp.0, clamp.1);
    let tasks = items.div_ceil(per_task);
    let run = |t: usize| f(t * per_task, ((t + 1) * per_task).min(items));
    if tasks == 1 || threads == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Runs `f(i)` for every `i` in `0..items` on rayon's pool, for decode's
/// GEMVs: each thread owns a contiguous share that it walks upwards, one
/// linear stream of weights, and a thread whose share runs out takes items
/// from the top of another's, so all end within one item of each other.
///
/// Spans handed out by rayon's splitting (`for_each_span`) break a thread's
/// stream wherever a steal lands and leave up to a span's time of one core
/// idle at the end of every call; decode makes ~90 calls a token. TinyLlama
/// shapes in sequence from DRAM on the Xeon, 2 threads, alternating in one
/// process: Q8_0 VNNI 32.9-34.4 GB/s against 31.0-33.8, f16 35.1-35.6
/// against 33.6-34.4.
pub(crate) fn for_each_owned(items: usize, f: impl Fn(usize) + Sync) {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// A thread's share, `lo << 32 | hi`, on a line of its own: the owner
    /// claims at every item, and sharing a line would slow every claim.
    #[repr(align(128))]
    struct Share(AtomicU64);
    let threads = rayon::current_num_threads().clamp(1, items.max(1));
    let items = items.min(u32::MAX as usize) as u64;
    let pack = |lo: u64, hi: u64| (lo << 32) | hi;
    let bound = |t: u64| t * items / threads as u64;
    let shares: Vec<Share> = (0..threads as u64).map(|t| Share(AtomicU64::new(pack(bound(t), bound(t + 1))))).collect();
    // The owner takes from the bottom of its share, others from the top.
    let take = |share: &Share, from_top: bool| -> Option<usize> {
        let mut cur = share.0.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (cur >> 32, cur & u64::from(u32::MAX));
            if lo >= hi {
                return None;
            }
            let (next, item) = if from_top { (pack(lo, hi - 1), hi - 1) } else { (pack(lo + 1, hi), lo) };
            match share.0.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(item as usize),
                Err(now) => cur = now,
            }
        }
    };
    let run = |t: usize| {
        while let Some(i) = take(&shares[t], false) {
            f(i);
        }
        for other in (1..threads).map(|d| &shares[(t + d) % threads]) {
            while let Some(i) = take(other, true) {
                f(i);
            }
        }
    };
    if threads == 1 {
        run(0);
    } else {
        // A thread that starts late finds its share taken: nothing is lost.
        (0..threads).into_par_iter().for_each(run);
    }
}

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

/// Whether this CPU runs AVX2 and FMA code; detected once.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    static HAS: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    *HAS
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

#[cfg(test)]
mod tests {
    #[test]
    fn for_each_owned_runs_every_item_once() {
        use std::sync::atomic::{AtomicU32, Ordering};
        for threads in [1, 2, 3, 5] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            for items in [0, 1, 2, 3, 4, 7, 64, 1001] {
                let seen: Vec<AtomicU32> = (0..items).map(|_| AtomicU32::new(0)).collect();
                pool.install(|| {
                    super::for_each_owned(items, |i| {
                        // Uneven items, so that threads run out and take from others.
                        if i % 7 == 0 {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    })
                });
                assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{threads} threads, {items} items");
            }
        }
    }

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
