//! Dense weights packed in panels for the AVX2 matmul: `y = x @ W^T (+ bias)`
//! with W `[n, k]` stored as panels of 16 output rows, k-major inside a panel
//! (element (row, c) at `((row / 16) * k + c) * 16 + row % 16`), so that one
//! k's 16 weights are two vectors and a panel is one contiguous stream.
//!
//! Why: with W row-major, the x86 kernels of [`super::matmul`] either read
//! 4 rows as 4 interleaved streams (m = 1) or widen each K block of 6 rows
//! into an L1 buffer and broadcast from it (m >= 16), whose stores cost ~15%
//! of the FMA rate even in L2. Packed, every m reads W as one linear stream
//! per task and the tile converts weights straight into registers:
//! - m = 1: per panel 8 accumulators (4 k's x 2 vectors) fed by broadcasts of
//!   x, 1 KiB of software prefetch ahead. On Zen 3, 2 threads, f16 streamed
//!   from DRAM: 21-26 GB/s against 18-22 for the row-major kernel
//!   (alternating runs, the same minutes).
//! - m >= 2: tiles of up to 6 x rows x 16 weights (12 accumulators; per k 2
//!   conversions, 6 broadcasts, 12 FMAs) over K blocks of 256 that stay in L1
//!   for all the tile rows of the call. Conversions run beside the FMAs, so
//!   m = 16 runs at the FMA rate: 181-186 against 172 GFLOP/s.
//!
//!
//! With AVX-512 (checked at run time) a panel's 16 rows are one vector:
//! the tiles take pairs of panels (the array holds an even number of
//! panels) and up to 14 x rows, 28 accumulators, so that per k 2
//! conversions feed 28 FMAs of twice the width; the GEMV takes 8 k's a
//! step and prefetches 4 KiB ahead into L2 rather than 1 KiB into L1
//! (together +10-20% from DRAM). On a
//! 2-vCPU Xeon with AVX-512 (2 FMA ports of 16 lanes: 232 GFLOP/s a core
//! against 119 for AVX2), f16 GEMM at m = 16-256 reads 280-332 GFLOP/s
//! against 205-218 for the row-major AVX2 kernel. `TINYVLLM_CPU_ISA=avx2`
//! keeps the AVX2 kernels on such a machine (for comparisons).
//!
//! Packing happens once, at load time (`PackedWeight::pack`), and only pays
//! where the AVX2 kernels run ([`packing_pays`]); elsewhere a portable loop
//! keeps the API total.

use std::sync::LazyLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::matmul::{BACKEND, Backend, WeightDType};
use super::matmul::{OutPtr, WeightElem};
use super::{WeightBuf, for_each_owned, for_each_span};

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

/// The instruction set the packed kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F: a panel is one vector; tiles take pairs of panels.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX2 + FMA + F16C: a panel is two vectors.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The portable loop.
    Scalar,
}

/// The best instruction set of this machine, decided once per process;
/// `TINYVLLM_CPU_ISA=avx2` (or `scalar`) caps it, to compare kernels.
pub static ISA: LazyLock<Isa> = LazyLock::new(|| {
    let isas = supported_isas();
    let cap = std::env::var("TINYVLLM_CPU_ISA").unwrap_or_default().to_ascii_lowercase();
    let capped = match cap.as_str() {
        #[cfg(target_arch = "x86_64")]
        "avx2" => isas.iter().copied().find(|&isa| isa != Isa::Avx512),
        "scalar" => Some(Isa::Scalar),
        _ => None,
    };
    capped.unwrap_or(isas[0])
});

/// Every instruction set this machine runs the packed kernels on, best
/// first (tests check each against the reference).
pub fn supported_isas() -> Vec<Isa> {
    let mut isas = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if *BACKEND == Backend::Avx2 {
        if std::arch::is_x86_feature_detected!("avx512f") {
            isas.push(Isa::Avx512);
        }
        isas.push(Isa::Avx2);
    }
    isas.push(Isa::Scalar);
    isas
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
    *ISA != Isa::Scalar
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
    // ISA is one of `supported_isas` by construction: no check per call.
    matmul_with(*ISA, x, m, w, bias, y)
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
        for row in y.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
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
    let unit = if is_avx512(isa) { 2 } else { 1 };
    let units = n.div_ceil(PANEL).div_ceil(unit);
    let run = |u0: usize, u1: usize| compute_panels(isa, &ops, u0 * unit, u1 * unit);
    if m * n * k < SERIAL_MACS {
        run(0, units);
    } else if m == 1 {
        for_each_owned(units, |u| run(u, u + 1));
    } else {
        // At most 64 rows a task.
        for_each_span(units, (1, 4 / unit), run);
    }
    Ok(())
}

fn is_avx512(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa == Isa::Avx512;
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// y[.., columns of panels p0..p1] (for AVX-512, p0 and p1 even; p1 may be
/// the padding panel's end).
fn compute_panels<W: WeightElem>(isa: Isa, ops: &Operands<'_, W>, p0: usize, p1: usize) {
    match isa {
        // SAFETY (all arms): `supported_isas` only lists Avx2 after
        // detecting AVX2, FMA and F16C, and Avx512 after AVX-512F too;
        // DTYPE names W's concrete type (the trait is sealed), so each cast
        // is an identity; the caller checked the shapes, and this task alone
        // writes the columns of panels p0..p1.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => match W::DTYPE {
            WeightDType::F32 => unsafe { avx512::panels::<f32>(&cast(ops), p0, p1) },
            WeightDType::F16 => unsafe { avx512::panels::<half::f16>(&cast(ops), p0, p1) },
            WeightDType::BF16 => unsafe { avx512::panels::<half::bf16>(&cast(ops), p0, p1) },
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => match W::DTYPE {
            WeightDType::F32 => unsafe { avx2::panels::<f32>(&cast(ops), p0, p1) },
            WeightDType::F16 => unsafe { avx2::panels::<half::f16>(&cast(ops), p0, p1) },
            WeightDType::BF16 => unsafe { avx2::panels::<half::bf16>(&cast(ops), p0, p1) },
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
    let n = ops.w.n;
    let c0 = p * PANEL;
    let cols = (n - c0).min(PANEL);
    for (r, s) in sums.iter().enumerate() {
        for (c, &v) in s.iter().enumerate().take(cols) {
            let v = v + ops.bias.map_or(0.0, |b| b[c0 + c]);
            // SAFETY: (row0 + r) * n + c0 + c < m * n = y.len() (rows and
            // columns in range); this task alone writes panel p's columns.
            unsafe { *ops.y.0.add((row0 + r) * n + c0 + c) = v };
        }
    }
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C kernels. Callers must have checked those features.
    use super::{Operands, PANEL, store};
    use crate::cpu::matmul::avx2::Load8;
    use std::arch::x86_64::*;

    /// K elements per block in the tiles: a panel's block (8 KiB in f16)
    /// stays in L1 while every tile row group of the call passes over it.
    const KB: usize = 256;

    /// x rows per tile: 6 x 2 accumulators, 2 widened weights and a
    /// broadcast x value fill 15 of the 16 vector registers.
    const TILE_ROWS: usize = 6;

    /// Most tile row groups of a call (`CHUNK_ROWS` rows).
    const MAX_GROUPS: usize = super::CHUNK_ROWS.div_ceil(TILE_ROWS);

    /// Prefetches the `size_of::<T>()` cache lines that 4 k's of a panel
    /// span, 1 KiB past `at`, into L1 (measured on Zen 3).
    #[inline(always)]
    fn prefetch_4k<T>(at: *const T) {
        super::prefetch_lines::<T, _MM_HINT_T0>(at, 1024);
    }

    /// y[.., columns of panels p0..p1].
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; the operands' shapes must have
    /// been checked (x `[m, k]`, y `[m, n]`, m <= CHUNK_ROWS), p0 <= p1 <=
    /// the panel count, and no other thread may write these columns of y.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panels<T: Load8>(ops: &Operands<'_, T>, p0: usize, p1: usize) {
        let (m, k) = (ops.m, ops.w.k);
        if m == 1 {
            for p in p0..p1 {
                // SAFETY: panel p holds k * PANEL weights; x holds k values.
                let sums = unsafe { gemv(ops.x.as_ptr(), ops.w.data.as_ptr().add(p * k * PANEL), k) };
                store(ops, p, 0, &[sums]);
            }
            return;
        }
        let groups = m.div_ceil(TILE_ROWS);
        assert!(groups <= MAX_GROUPS, "packed tiles take at most {} rows", super::CHUNK_ROWS);
        let mut sums = [[[0f32; PANEL]; TILE_ROWS]; MAX_GROUPS];
        // One group: nothing to reuse a block for, so no blocking.
        let kb = if groups == 1 { k } else { KB };
        for p in p0..p1 {
            let panel = ops.w.data[p * k * PANEL..].as_ptr();
            sums[..groups].iter_mut().for_each(|s| *s = [[0.0; PANEL]; TILE_ROWS]);
            let mut k0 = 0;
            while k0 < k {
                let len = kb.min(k - k0);
                for (g, s) in sums[..groups].iter_mut().enumerate() {
                    let rows = (m - g * TILE_ROWS).min(TILE_ROWS);
                    // SAFETY: x holds rows g * 6.. + rows of k, read at
                    // k0..k0 + len; the panel holds k * PANEL weights, read
                    // at k0 * PANEL.. for len k's.
                    unsafe {
                        let x = ops.x.as_ptr().add(g * TILE_ROWS * k + k0);
                        let w = panel.add(k0 * PANEL);
                        match rows {
                            6 => tile::<T, 6>(x, k, w, len, s),
                            5 => tile::<T, 5>(x, k, w, len, s),
                            4 => tile::<T, 4>(x, k, w, len, s),
                            3 => tile::<T, 3>(x, k, w, len, s),
                            2 => tile::<T, 2>(x, k, w, len, s),
                            _ => tile::<T, 1>(x, k, w, len, s),
                        }
                    }
                }
                k0 += len;
            }
            for (g, s) in sums[..groups].iter().enumerate() {
                let rows = (m - g * TILE_ROWS).min(TILE_ROWS);
                store(ops, p, g * TILE_ROWS, &s[..rows]);
            }
        }
    }

    /// One panel's 16 dot products with x over k: 4 k's per step, each with
    /// its own 2 accumulators, so that 8 FMA chains hide their latency.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` must hold k values and `w`
    /// a panel of k * PANEL weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv<T: Load8>(x: *const f32, w: *const T, k: usize) -> [f32; PANEL] {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut i = 0;
        // SAFETY (both loops): i + s < k, so x[i + s] and the panel's k-th
        // row of PANEL weights at (i + s) * PANEL are in bounds.
        unsafe {
            while i + 4 <= k {
                prefetch_4k(w.add(i * PANEL));
                for (s, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(&*x.add(i + s));
                    let wk = w.add((i + s) * PANEL);
                    acc[0] = _mm256_fmadd_ps(xv, T::load8_folded(wk), acc[0]);
                    acc[1] = _mm256_fmadd_ps(xv, T::load8_folded(wk.add(8)), acc[1]);
                }
                i += 4;
            }
            while i < k {
                let xv = _mm256_broadcast_ss(&*x.add(i));
                let wk = w.add(i * PANEL);
                acc[0][0] = _mm256_fmadd_ps(xv, T::load8_folded(wk), acc[0][0]);
                acc[0][1] = _mm256_fmadd_ps(xv, T::load8_folded(wk.add(8)), acc[0][1]);
                i += 1;
            }
        }
        let mut out = [0f32; PANEL];
        for (h, half) in out.chunks_exact_mut(8).enumerate() {
            let s = _mm256_add_ps(_mm256_add_ps(acc[0][h], acc[1][h]), _mm256_add_ps(acc[2][h], acc[3][h]));
            // SAFETY: each half holds 8 floats.
            unsafe { _mm256_storeu_ps(half.as_mut_ptr(), s) };
        }
        out
    }

    /// Adds R x rows (stride ldx) times a panel block (`len` k's of PANEL
    /// weights at `w`) to `sums[..R]`: per k, 2 widened weight vectors, R
    /// broadcast x values and 2R FMAs into accumulators held in registers.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; x rows 0..R must hold `len`
    /// values from `x` and `w` must hold len * PANEL weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<T: Load8, const R: usize>(
        x: *const f32,
        ldx: usize,
        w: *const T,
        len: usize,
        sums: &mut [[f32; PANEL]; TILE_ROWS],
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        // SAFETY: sums rows hold 16 floats each and R <= TILE_ROWS; x and w
        // reads stay within the bounds the caller gave (i < len).
        unsafe {
            for (a, s) in acc.iter_mut().zip(sums.iter()) {
                *a = [_mm256_loadu_ps(s.as_ptr()), _mm256_loadu_ps(s.as_ptr().add(8))];
            }
            let rows: [*const f32; R] = std::array::from_fn(|r| x.add(r * ldx));
            for i in 0..len {
                if i % 4 == 0 {
                    prefetch_4k(w.add(i * PANEL));
                }
                let w0 = T::load8_folded(w.add(i * PANEL));
                let w1 = T::load8_folded(w.add(i * PANEL + 8));
                for (a, row) in acc.iter_mut().zip(&rows) {
                    let xv = _mm256_broadcast_ss(&*row.add(i));
                    a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                    a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm256_storeu_ps(s.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(s.as_mut_ptr().add(8), a[1]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! AVX-512F kernels: a panel's 16 rows are one vector. Callers must have
    //! checked AVX-512F (and the AVX2 set: F16C's conversions come with it).
    use super::{Operands, PANEL, WeightElem, store};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// For the GEMV (decode): prefetches the `size_of::<T>()` cache lines
    /// that 4 k's of a panel span, 4 KiB past `at`, into L2. From DRAM on
    /// the Xeon, alternating builds, 29.6-31.7 GB/s against 25.3-30.1 for
    /// 1 KiB into L1.
    #[inline(always)]
    fn prefetch_4k_l2<T>(at: *const T) {
        super::prefetch_lines::<T, _MM_HINT_T1>(at, super::PREFETCH_BYTES);
    }

    /// For the tiles (prefill, batches): the same lines 1 KiB ahead into
    /// L1, the AVX2 kernels' rule. Into L2 the 16-sequence decode step took
    /// 140-146 ms against 137-138.
    #[inline(always)]
    fn prefetch_4k<T>(at: *const T) {
        super::prefetch_lines::<T, _MM_HINT_T0>(at, 1024);
    }

    /// Widens 16 consecutive weights to f32 lanes.
    pub(super) trait Load16: WeightElem {
        /// # Safety
        /// `p..p+16` must be readable and the CPU must support AVX-512F.
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Load16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: caller guarantees 64 readable bytes and AVX-512F.
            unsafe { _mm512_loadu_ps(p) }
        }
    }

    impl Load16 for f16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: caller guarantees 32 readable bytes and AVX-512F.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
    }

    impl Load16 for bf16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: caller guarantees 32 readable bytes and AVX-512F.
            // bf16 is the top half of an f32: zero-extend and shift left 16.
            unsafe {
                let h = _mm256_loadu_si256(p.cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    /// K elements per block in the tiles: a pair of panels' block (16 KiB
    /// in f16) stays in L1 while every row group of the call passes over it.
    const KB: usize = 256;

    /// Most x rows per tile: 14 x 2 accumulators, 2 widened weights and a
    /// broadcast x value fill 31 of the 32 vector registers.
    const TILE_ROWS: usize = 14;

    /// Most row groups of a call (`CHUNK_ROWS` rows).
    const MAX_GROUPS: usize = super::CHUNK_ROWS.div_ceil(TILE_ROWS);

    /// A group's sums: row, then panel of the pair.
    type Sums = [[[f32; PANEL]; 2]; TILE_ROWS];

    /// y[.., columns of panels p0..p1]; p0 even, p1 even or the panel count.
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA and F16C must be available; the operands' shapes
    /// must have been checked (x `[m, k]`, y `[m, n]`, m <= CHUNK_ROWS), p0 <=
    /// p1 <= the (even) number of panels in the array, and no other thread
    /// may write these columns of y.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn panels<T: Load16>(ops: &Operands<'_, T>, p0: usize, p1: usize) {
        let (m, k) = (ops.m, ops.w.k);
        let real = ops.w.n.div_ceil(PANEL);
        if m == 1 {
            for p in p0..p1.min(real) {
                // SAFETY: panel p holds k * PANEL weights; x holds k values.
                let sums = unsafe { gemv(ops.x.as_ptr(), ops.w.data.as_ptr().add(p * k * PANEL), k) };
                store(ops, p, 0, &[sums]);
            }
            return;
        }
        // Groups of equal height: 16 rows run as 8 + 8, not 14 + 2.
        let groups = m.div_ceil(TILE_ROWS);
        let height = m.div_ceil(groups);
        assert!(groups <= MAX_GROUPS, "packed tiles take at most {} rows", super::CHUNK_ROWS);
        let mut sums = [[[[0f32; PANEL]; 2]; TILE_ROWS]; MAX_GROUPS];
        // One group: nothing to reuse a block for, so no blocking.
        let kb = if groups == 1 { k } else { KB };
        for p in (p0..p1).step_by(2) {
            let w0 = ops.w.data[p * k * PANEL..].as_ptr();
            let w1 = ops.w.data[(p + 1) * k * PANEL..].as_ptr();
            sums[..groups].iter_mut().for_each(|s| *s = [[[0.0; PANEL]; 2]; TILE_ROWS]);
            let mut k0 = 0;
            while k0 < k {
                let len = kb.min(k - k0);
                for (g, s) in sums[..groups].iter_mut().enumerate() {
                    let rows = (m - g * height).min(height);
                    // SAFETY: x holds rows g * height.. + rows of k, read at
                    // k0..k0 + len; panels p and p + 1 hold k * PANEL
                    // weights each, read at k0 * PANEL.. for len k's.
                    unsafe {
                        let x = ops.x.as_ptr().add(g * height * k + k0);
                        let (a, b) = (w0.add(k0 * PANEL), w1.add(k0 * PANEL));
                        match rows {
                            14 => tile::<T, 14>(x, k, a, b, len, s),
                            13 => tile::<T, 13>(x, k, a, b, len, s),
                            12 => tile::<T, 12>(x, k, a, b, len, s),
                            11 => tile::<T, 11>(x, k, a, b, len, s),
                            10 => tile::<T, 10>(x, k, a, b, len, s),
                            9 => tile::<T, 9>(x, k, a, b, len, s),
                            8 => tile::<T, 8>(x, k, a, b, len, s),
                            7 => tile::<T, 7>(x, k, a, b, len, s),
                            6 => tile::<T, 6>(x, k, a, b, len, s),
                            5 => tile::<T, 5>(x, k, a, b, len, s),
                            4 => tile::<T, 4>(x, k, a, b, len, s),
                            3 => tile::<T, 3>(x, k, a, b, len, s),
                            2 => tile::<T, 2>(x, k, a, b, len, s),
                            _ => tile::<T, 1>(x, k, a, b, len, s),
                        }
                    }
                }
                k0 += len;
            }
            for (g, s) in sums[..groups].iter().enumerate() {
                let rows = (m - g * height).min(height);
                for half in 0..2 {
                    // The pair's second panel may be the padding one.
                    if p + half < real {
                        let mut panel = [[0f32; PANEL]; TILE_ROWS];
                        panel.iter_mut().zip(s).for_each(|(d, s)| *d = s[half]);
                        store(ops, p + half, g * height, &panel[..rows]);
                    }
                }
            }
        }
    }

    /// One panel's 16 dot products with x over k: 8 k's per step, each with
    /// its own accumulator, so that the FMA chains hide their latency.
    ///
    /// 8 k's rather than 4: from DRAM on the Xeon, with the same prefetch,
    /// 4 k's streamed f16 at 30.3-31.7 GB/s and 8 at 33.0-35.1, alternating
    /// in one process (the probe read 34-37).
    ///
    /// # Safety
    /// AVX-512F must be available; `x` must hold k values and `w` a panel of
    /// k * PANEL weights.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn gemv<T: Load16>(x: *const f32, w: *const T, k: usize) -> [f32; PANEL] {
        const STEP: usize = 8;
        let mut acc = [_mm512_setzero_ps(); STEP];
        let mut i = 0;
        // SAFETY (both loops): i + s < k, so x[i + s] and the panel's k-th
        // row of PANEL weights at (i + s) * PANEL are in bounds.
        unsafe {
            while i + STEP <= k {
                prefetch_4k_l2(w.add(i * PANEL));
                prefetch_4k_l2(w.add((i + 4) * PANEL));
                for (s, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(*x.add(i + s));
                    *acc = _mm512_fmadd_ps(xv, T::load16(w.add((i + s) * PANEL)), *acc);
                }
                i += STEP;
            }
            while i < k {
                acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(i)), T::load16(w.add(i * PANEL)), acc[0]);
                i += 1;
            }
        }
        let s = acc.iter().fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
        let mut out = [0f32; PANEL];
        // SAFETY: out holds 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
        out
    }

    /// Adds R x rows (stride ldx) times a block of two panels (`len` k's of
    /// PANEL weights at `w0` and at `w1`) to `sums[..R]`: per k, 2 widened
    /// weight vectors, R broadcast x values and 2R FMAs into accumulators
    /// held in registers.
    ///
    /// # Safety
    /// AVX-512F must be available; x rows 0..R must hold `len` values from
    /// `x`, and `w0` and `w1` len * PANEL weights each.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn tile<T: Load16, const R: usize>(
        x: *const f32,
        ldx: usize,
        w0: *const T,
        w1: *const T,
        len: usize,
        sums: &mut Sums,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        // SAFETY: sums rows hold 2 x 16 floats each and R <= TILE_ROWS; x
        // and w reads stay within the bounds the caller gave (i < len).
        unsafe {
            for (a, s) in acc.iter_mut().zip(sums.iter()) {
                *a = [_mm512_loadu_ps(s[0].as_ptr()), _mm512_loadu_ps(s[1].as_ptr())];
            }
            let rows: [*const f32; R] = std::array::from_fn(|r| x.add(r * ldx));
            for i in 0..len {
                if i % 4 == 0 {
                    prefetch_4k(w0.add(i * PANEL));
                    prefetch_4k(w1.add(i * PANEL));
                }
                let a = T::load16(w0.add(i * PANEL));
                let b = T::load16(w1.add(i * PANEL));
                for (acc, row) in acc.iter_mut().zip(&rows) {
                    let xv = _mm512_set1_ps(*row.add(i));
                    acc[0] = _mm512_fmadd_ps(xv, a, acc[0]);
                    acc[1] = _mm512_fmadd_ps(xv, b, acc[1]);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm512_storeu_ps(s[0].as_mut_ptr(), a[0]);
                _mm512_storeu_ps(s[1].as_mut_ptr(), a[1]);
            }
        }
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
    /// tile heights (6 for AVX2; up to 14 in equal groups for AVX-512), the
    /// GEMV steps (4 k's for AVX2, 8 for AVX-512) and the K block (256),
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
        assert!(isas.contains(&*ISA));
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && *BACKEND == Backend::Avx2 {
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
