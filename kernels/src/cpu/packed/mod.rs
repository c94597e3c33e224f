//! Dense weights packed in panels for the AVX2 matmul: `y = x @ W^T (+ bias)`
//! with W `[n, k]` stored as panels of 16 output rows, k-major inside a panel
//! (element (row, c) at `((row / 16) * k + c) * 16 + row % 16`), so that one
//! k's 16 weights are two vectors and a panel is one contiguous stream.
//!
//! Why: with W row-major, the x86 kernels of [`super::matmul`] either read
//! 4 rows as 4 interleaved streams (m = 1) or widen each K block of 6 rows
//! into an L1 buffer and broadcast from it (m >= 16), whose stores cost a
//! share of the FMA rate even in L2. Packed, every m reads W as one linear
//! stream per task and the tile converts weights straight into registers:
//! - m = 1: per panel 8 accumulators (4 k's x 2 vectors) fed by broadcasts of
//!   x, 4 KiB of software prefetch ahead; one stream per task keeps the
//!   hardware prefetcher ahead where four interleaved ones do not.
//! - m >= 2: tiles of up to 6 x rows x 16 weights (12 accumulators; per k 2
//!   conversions, 6 broadcasts, 12 FMAs) over K blocks of 256 that stay in L1
//!   for all the tile rows of the call, the same 4 KiB of prefetch ahead.
//!   Conversions run beside the FMAs: m = 16 at 89% of the FMA rate.
//!
//! With AVX-512 (checked at run time) a panel's 16 rows are one vector:
//! the tiles take 4 panels (a task's odd pair 2; the array holds an even
//! number of panels) and up to 6 x rows, 24 accumulators, so that per k 4
//! conversions and 6 broadcasts feed 24 FMAs of twice the width; the GEMV
//! takes 8 k's a step and prefetches 4 KiB ahead (L2 or non-temporal,
//! by vendor) rather than into L1.
//! `TINYVLLM_CPU_ISA=avx2` keeps the AVX2 kernels on such a machine (for
//! comparisons; see [`crate::cpu::isa`]).
//!
//! Packing happens once, at load time (`PackedWeight::pack`), and only pays
//! where the AVX2 kernels run ([`packing_pays`]); elsewhere a portable loop
//! keeps the API total.

use rayon::prelude::*;

use super::isa::packed_isa;
pub use super::isa::{Isa, supported_isas};
#[cfg(target_arch = "x86_64")]
use super::matmul::WeightDType;
use super::matmul::WeightElem;
use super::parallel::fill_with_bias;
use super::{OutPtr, WeightBuf, for_each_owned, for_each_span};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Output rows per panel: two vectors of 8 lanes.
pub const PANEL: usize = 16;

/// The furthest the kernels prefetch past what they read; the packed array
/// ends with this many bytes of zeros so that no prefetch leaves it.
const PREFETCH_BYTES: usize = 4096;

/// x rows per call of the tiles: a chunk's K block (256 rows x 1 KiB) stays
/// in L2 while the panels of a task pass over it.
const CHUNK_ROWS: usize = 256;

/// Below this many multiply-adds a call runs on the calling thread.
const SERIAL_MACS: usize = 1 << 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PackError {
    #[error("packed weight: {0}")]
    Shape(String),
    #[error("packed weight: this machine does not run {0:?}")]
    Unsupported(Isa),
}

/// A weight `[n, k]` in panels of [`PANEL`] rows (the last one padded with
/// zero rows, and a zero panel added to make their number even), then
/// [`PREFETCH_BYTES`] of zeros.
#[derive(Debug, PartialEq)]
pub struct PackedWeight<W> {
    n: usize,
    k: usize,
    data: WeightBuf<W>,
}

impl<W: Copy> Clone for PackedWeight<W> {
    fn clone(&self) -> Self {
        Self { n: self.n, k: self.k, data: self.data.clone() }
    }
}

/// Whether the packed kernels beat the row-major ones on this machine (the
/// AVX2 backend); elsewhere a weight is better left as it is.
pub fn packing_pays() -> bool {
    packed_isa() != Isa::Scalar
}

impl<W: WeightElem> PackedWeight<W> {
    /// Packs `w`, `n` rows of `k` (row-major).
    pub fn pack(w: &[W], n: usize, k: usize) -> Result<Self, PackError> {
        if w.len() != n * k {
            return Err(PackError::Shape(format!("{} values for [{n}, {k}]", w.len())));
        }
        let panel_len = k * PANEL;
        let panels = n.div_ceil(PANEL).next_multiple_of(2);
        let mut data = WeightBuf::filled(W::ZERO, panels * panel_len + PREFETCH_BYTES / size_of::<W>());
        if panel_len > 0 {
            data.par_chunks_mut(panel_len).zip(w.par_chunks(panel_len)).for_each(|(dst, rows)| {
                // The last chunks of `data` are zero padding: no rows left.
                for (c, row) in rows.chunks_exact(k).enumerate() {
                    for (kk, &v) in row.iter().enumerate() {
                        dst[kk * PANEL + c] = v;
                    }
                }
            });
        }
        Ok(Self { n, k, data })
    }

    /// Back to `[n, k]` row-major.
    pub fn unpack(&self) -> Vec<W> {
        let mut w = vec![W::ZERO; self.n * self.k];
        for (row, dst) in w.chunks_exact_mut(self.k.max(1)).enumerate().take(self.n) {
            let (p, c) = (row / PANEL, row % PANEL);
            for (kk, d) in dst.iter_mut().enumerate() {
                *d = self.data[(p * self.k + kk) * PANEL + c];
            }
        }
        w
    }

    /// `(rows, columns)`: `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The packed array, for placing it in memory (huge pages).
    pub fn as_slice(&self) -> &[W] {
        &self.data
    }

    /// The whole allocation behind the array (2 MiB pages on Linux for
    /// large weights): the range to back with huge pages.
    pub fn allocation(&self) -> &[W] {
        self.data.allocation()
    }

    /// Bytes one pass over the weight reads (padding rows included).
    pub fn size_in_bytes(&self) -> usize {
        self.n.div_ceil(PANEL) * self.k * PANEL * size_of::<W>()
    }
}

/// `y = x @ W^T (+ bias)`: x `[m, k]`, y `[m, n]` row-major f32, every
/// element of y overwritten. Errors when the lengths disagree with W's shape.
pub fn matmul_packed<W: WeightElem>(
    x: &[f32],
    m: usize,
    w: &PackedWeight<W>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), PackError> {
    // `packed_isa` is one of `supported_isas` by construction: no check
    // per call.
    matmul_with(packed_isa(), x, m, w, bias, y)
}

/// [`matmul_packed`] on a given instruction set, one of
/// [`supported_isas`] (tests and benchmarks cover each); errors otherwise.
pub fn matmul_packed_on<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedWeight<W>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), PackError> {
    if !supported_isas().contains(&isa) {
        return Err(PackError::Unsupported(isa));
    }
    matmul_with(isa, x, m, w, bias, y)
}

/// The inputs of one call, shared by its tasks.
struct Operands<'a, W> {
    x: &'a [f32],
    m: usize,
    w: &'a PackedWeight<W>,
    bias: Option<&'a [f32]>,
    y: OutPtr,
}

fn matmul_with<W: WeightElem>(
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedWeight<W>,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), PackError> {
    let (n, k) = (w.n, w.k);
    if x.len() != m * k || y.len() != m * n || bias.is_some_and(|b| b.len() != n) {
        let b = bias.map_or("none".into(), |b| b.len().to_string());
        return Err(PackError::Shape(format!("x {} (m {m}, k {k}), y {}, bias {b} (n {n})", x.len(), y.len())));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        fill_with_bias(y, n, bias);
        return Ok(());
    }
    if m > CHUNK_ROWS {
        for (xc, yc) in x.chunks(CHUNK_ROWS * k).zip(y.chunks_mut(CHUNK_ROWS * n)) {
            matmul_with(isa, xc, xc.len() / k, w, bias, yc)?;
        }
        return Ok(());
    }
    let ops = Operands { x, m, w, bias, y: OutPtr(y.as_mut_ptr()) };
    // AVX-512 tiles take panels in pairs (the array holds an even number).
    let unit = if isa.is_avx512() { 2 } else { 1 };
    let units = n.div_ceil(PANEL).div_ceil(unit);
    let run = |u0: usize, u1: usize| compute_panels(isa, &ops, u0 * unit, u1 * unit);
    if m * n * k < SERIAL_MACS {
        run(0, units);
    } else if m == 1 {
        for_each_owned(units, w.size_in_bytes() / units, |us| run(us.start, us.end));
    } else {
        // 64 output rows a task: the AVX-512 tiles take 4 panels at once.
        for_each_span(units, if unit == 2 { (2, 2) } else { (1, 4) }, run);
    }
    Ok(())
}

/// y[.., columns of panels p0..p1] (for AVX-512, p0 and p1 even; p1 may be
/// the padding panel's end).
fn compute_panels<W: WeightElem>(isa: Isa, ops: &Operands<'_, W>, p0: usize, p1: usize) {
    match isa {
        // SAFETY: `supported_isas` only lists Avx512 after detecting
        // AVX-512F besides AVX2, FMA and F16C; DTYPE names W's concrete type
        // (the trait is sealed), so each cast is an identity; the caller
        // checked the shapes, and this task alone writes the columns of
        // panels p0..p1.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            match W::DTYPE {
                WeightDType::F32 => avx512::panels::<f32>(&cast(ops), p0, p1),
                WeightDType::F16 => avx512::panels::<half::f16>(&cast(ops), p0, p1),
                WeightDType::BF16 => avx512::panels::<half::bf16>(&cast(ops), p0, p1),
            }
        },
        // SAFETY: as above, Avx2 is only listed after detecting AVX2, FMA
        // and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe {
            match W::DTYPE {
                WeightDType::F32 => avx2::panels::<f32>(&cast(ops), p0, p1),
                WeightDType::F16 => avx2::panels::<half::f16>(&cast(ops), p0, p1),
                WeightDType::BF16 => avx2::panels::<half::bf16>(&cast(ops), p0, p1),
            }
        },
        Isa::Scalar => scalar_panels(ops, p0, p1),
    }
}

/// The operands with W viewed as the concrete type `T`.
///
/// # Safety
/// `T` must be the type `W` is, i.e. the one `W::DTYPE` names.
#[cfg(target_arch = "x86_64")]
unsafe fn cast<'a, W: WeightElem, T>(ops: &Operands<'a, W>) -> Operands<'a, T> {
    debug_assert_eq!(size_of::<W>(), size_of::<T>());
    // SAFETY: same type per the caller, so same layout.
    let w = unsafe { &*std::ptr::from_ref(ops.w).cast::<PackedWeight<T>>() };
    Operands { x: ops.x, m: ops.m, w, bias: ops.bias, y: ops.y }
}

/// Writes a panel's sums (`sums[r]` for x row `row0 + r`) to y, adding the
/// bias; columns past n (padding rows of the panel) are dropped.
fn store<W>(ops: &Operands<'_, W>, p: usize, row0: usize, sums: &[[f32; PANEL]]) {
    // SAFETY: the kernels pass rows row0.. of x's m and a panel p < n / 16
    // rounded up, so the rows and columns are within y; this task alone
    // writes panel p's columns.
    unsafe { ops.y.store_rows(ops.w.n, row0, p * PANEL, sums, ops.bias) };
}

/// Portable path: one x row at a time over a panel, 16 lanes LLVM vectorises.
fn scalar_panels<W: WeightElem>(ops: &Operands<'_, W>, p0: usize, p1: usize) {
    let k = ops.w.k;
    for p in p0..p1 {
        let panel = &ops.w.data[p * k * PANEL..(p + 1) * k * PANEL];
        for (mi, x) in ops.x.chunks_exact(k).enumerate().take(ops.m) {
            let mut acc = [0f32; PANEL];
            for (&xv, ws) in x.iter().zip(panel.chunks_exact(PANEL)) {
                for (a, w) in acc.iter_mut().zip(ws) {
                    *a += xv * w.to_f32();
                }
            }
            store(ops, p, mi, &[acc]);
        }
    }
}

/// Prefetches, with hint `HINT`, the `size_of::<T>()` cache lines that 4
/// k's of a panel span, [`PREFETCH_BYTES`] (4 KiB) past `at`. The AVX-512
/// GEMV takes the vendor's hint ([`crate::cpu::isa::StreamPrefetch`]: from
/// DRAM, more bandwidth than into L1). The AVX2 kernels prefetch into L1:
/// 1 KiB, tuned on a Zen 3, was short of a miss on a Zen 5 held to AVX2;
/// with m x rows a KiB of weights lasts m times the GEMV's time (gate/up
/// 11264 x 2048 at m = 16: 209 -> 232 GFLOP/s, m = 8 167 -> 202), and at
/// m = 1 the f16 decode step read 84-87% of the paired probe in fast
/// phases against 94-98% at 4 KiB.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_4k_ahead<T, const HINT: i32>(at: *const T) {
    prefetch_lines::<T, HINT>(at, PREFETCH_BYTES);
}

/// Prefetches, with hint `HINT`, the `size_of::<T>()` cache lines that 4
/// k's of a panel span, `ahead` bytes (at most [`PREFETCH_BYTES`]) past `at`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<T, const HINT: i32>(at: *const T, ahead: usize) {
    let at = at.cast::<u8>().wrapping_add(ahead);
    for line in 0..size_of::<T>() {
        // SAFETY: SSE is baseline on x86-64; a prefetch does not access
        // memory, and the packed array's zero tail keeps it in bounds.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(at.wrapping_add(64 * line).cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::reference_matmul_xwt;
    use half::{bf16, f16};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random_vec(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Random shapes around the panel width (and odd panel counts), the
    /// tile heights (6 for AVX2 and AVX-512, in equal groups), AVX-512's
    /// tiles of 4 panels and a task's last pair (n of 200: 13 panels), the
    /// GEMV steps (4 k's for AVX2, 8 for AVX-512) and AVX2's K block (256),
    /// with and without bias,
    /// on every instruction set this machine has.
    fn check<W: WeightElem + PartialEq + std::fmt::Debug>(isa: Isa, from_f32: fn(f32) -> W) {
        let mut rng = StdRng::seed_from_u64(7);
        let shapes = [
            (1, 1, 1),
            (1, 64, 16),
            (1, 67, 33),
            (1, 300, 48),
            (1, 13, 35),
            (2, 7, 17),
            (3, 256, 31),
            (5, 513, 16),
            (6, 64, 1),
            (7, 255, 40),
            (13, 100, 50),
            (16, 260, 70),
            (11, 40, 47),
            (14, 70, 33),
            (15, 260, 16),
            (17, 33, 15),
            (29, 64, 80),
            (40, 300, 24),
            (64, 96, 20),
            (257, 40, 20),
            (300, 19, 35),
            (9, 64, 200),
            (70, 130, 150),
            // Decode across enough panels that a thread claims several at once.
            (1, 160, 520),
        ];
        for (i, &(m, k, n)) in shapes.iter().enumerate() {
            let x = random_vec(&mut rng, m * k);
            let w: Vec<W> = random_vec(&mut rng, n * k).into_iter().map(from_f32).collect();
            let bias = (i % 2 == 0).then(|| random_vec(&mut rng, n));
            let packed = PackedWeight::pack(&w, n, k).expect("consistent shape");
            assert_eq!(packed.unpack(), w, "unpack(pack(w)) for [{n}, {k}]");
            let mut want = vec![0f32; m * n];
            reference_matmul_xwt(&x, m, k, &w, n, bias.as_deref(), &mut want);
            let mut got = vec![f32::NAN; m * n];
            matmul_packed_on(isa, &x, m, &packed, bias.as_deref(), &mut got).expect("consistent shapes");
            for (j, (g, r)) in got.iter().zip(&want).enumerate() {
                let tol = 1e-4 * (k as f32).sqrt() + 1e-5;
                assert!((g - r).abs() <= tol, "{isa:?} m={m} k={k} n={n} at {j}: {g} vs {r}");
            }
        }
    }

    #[test]
    fn f32_matches_reference() {
        for isa in supported_isas() {
            check::<f32>(isa, |v| v);
        }
    }

    #[test]
    fn f16_matches_reference() {
        for isa in supported_isas() {
            check::<f16>(isa, f16::from_f32);
        }
    }

    #[test]
    fn bf16_matches_reference() {
        for isa in supported_isas() {
            check::<bf16>(isa, bf16::from_f32);
        }
    }

    #[test]
    fn every_isa_is_listed_once_and_the_portable_one_last() {
        let isas = supported_isas();
        assert_eq!(isas.last(), Some(&Isa::Scalar));
        assert!(isas.contains(&packed_isa()));
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::isa::features().avx512f && crate::cpu::isa::features().avx2_fma_f16c() {
            assert_eq!(isas[0], Isa::Avx512);
        }
    }

    #[test]
    fn empty_inner_dimension_gives_the_bias() {
        let w = PackedWeight::<f16>::pack(&[], 3, 0).expect("empty weight");
        let mut y = [f32::NAN; 6];
        matmul_packed(&[], 2, &w, Some(&[1.0, 2.0, 3.0]), &mut y).expect("shapes agree");
        assert_eq!(y, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    fn inconsistent_lengths_are_errors() {
        assert!(PackedWeight::<f32>::pack(&[0.0; 5], 2, 3).is_err());
        let w = PackedWeight::<f32>::pack(&[0.0; 6], 2, 3).expect("consistent");
        let mut y = [0f32; 2];
        assert!(matmul_packed(&[0.0; 4], 1, &w, None, &mut y).is_err());
        assert!(matmul_packed(&[0.0; 3], 1, &w, None, &mut y[..1]).is_err());
        assert!(matmul_packed(&[0.0; 3], 1, &w, Some(&[0.0]), &mut y).is_err());
        assert!(matmul_packed(&[0.0; 3], 1, &w, None, &mut y).is_ok());
    }
}
