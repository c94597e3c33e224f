//! CPU matmul `y = x @ W^T (+ bias)` for LLM inference: x, y in f32, W streamed
//! in its stored dtype (f32, f16, bf16) and widened to f32 in registers.
//!
//! Shapes: x `[m, k]`, W `[n, k]` (Hugging Face `Linear` layout, row-major,
//! n = out features), bias `[n]`, y `[m, n]`; all row-major and contiguous.
//!
//! Why it is shaped this way:
//! - Decode (m = 1) is memory-bandwidth bound: every weight byte is read once
//!   per call. Output rows n are split into tasks of 16-64 rows on rayon's
//!   global pool, so both cores stream different rows. Each core reads 4 rows
//!   at a time, one cache line per row per step, 2 FMA chains per row, and
//!   software-prefetches the 4-row span 16 KiB ahead (worth 20-30% on Zen).
//! - Larger m is compute bound. Each tile of weight rows is widened to f32 one
//!   K block (256) at a time into an L1 buffer and reused by every x row, so
//!   conversion costs 1/m per weight rather than 1/3 (vcvtph2ps alone capped
//!   f16 at ~50 GFLOP/s), and W comes from DRAM once per chunk of x rows (64,
//!   or 256 for the broadcast kernel). For m < 16 the x rows pass over it in
//!   4x3 dot-product tiles (12 accumulators of 8 lanes, summed horizontally
//!   per K block). From m = 16, in BLIS's shape: x is transposed once per
//!   call into groups of 16 rows, and 6 weight rows x 16 x rows make 12
//!   accumulators fed by 2 vector loads and 6 broadcast weights per k, with
//!   no horizontal sums (on Zen 3: 97% of the FMA peak in isolation against
//!   88% for the 4x3 tile). Batched decode overlaps the widening of the next
//!   K block with the FMAs; prefill chunks run K block by K block so that
//!   each group's x stays in L1 (see `avx2::broadcast_panel`).
//! - Backends: AVX2+FMA+F16C on x86-64 (detected once at run time), NEON on
//!   aarch64, and a portable chunked scalar loop that LLVM can auto-vectorise.
//!   The NEON and scalar paths use plain register tiles (8x1 for m = 1, 4x3
//!   otherwise) without the widening buffer or prefetch.
//!
//! Accumulation is in f32 with 8 (AVX2, scalar) or 4 (NEON) lanes per chain,
//! so results differ from a sequential sum only by rounding order.

use half::{bf16, f16};
use rayon::prelude::*;
use std::sync::LazyLock;

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

impl WeightElem for f16 {
    const DTYPE: WeightDType = WeightDType::F16;
    const ZERO: Self = f16::ZERO;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

impl WeightElem for bf16 {
    const DTYPE: WeightDType = WeightDType::BF16;
    const ZERO: Self = bf16::ZERO;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

/// Which inner kernels this machine runs; decided once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "aarch64")]
    Neon,
    Scalar,
}

pub(crate) static BACKEND: LazyLock<Backend> = LazyLock::new(detect_backend);

fn detect_backend() -> Backend {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Backend::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Backend::Neon;
        }
    }
    Backend::Scalar
}

/// Below this many multiply-adds a call runs on the calling thread: rayon's
/// wake-up costs more than the work.
const SERIAL_MACS: usize = 1 << 16;

/// `y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])`.
///
/// x is `[m, k]` f32, w is `[n, k]` in `W`, bias is `[n]`, y is `[m, n]` f32, all
/// row-major. Every element of y is overwritten.
///
/// # Panics
/// Only if the slice lengths disagree with `m`, `k`, `n` (`x.len() != m * k`,
/// `w.len() != n * k`, `y.len() != m * n`, `bias.len() != n`). Callers check
/// shapes once at construction; this is the last line of defence that keeps the
/// unsafe inner loops in bounds.
pub fn matmul_xwt<W: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    matmul_with_backend(*BACKEND, x, m, k, w, n, bias, y);
}

/// The portable path, exposed so tests cover it on machines with SIMD.
#[cfg(test)]
pub(crate) fn matmul_xwt_scalar<W: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    matmul_with_backend(Backend::Scalar, x, m, k, w, n, bias, y);
}

/// Same contract as [`matmul_xwt`], naive, f64 accumulation; for tests.
pub fn reference_matmul_xwt<W: WeightElem>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    check_shapes(x.len(), m, k, w.len(), n, bias.map(<[f32]>::len), y.len());
    for mi in 0..m {
        for ni in 0..n {
            let mut s = 0f64;
            for ki in 0..k {
                s += x[mi * k + ki] as f64 * w[ni * k + ki].to_f32() as f64;
            }
            if let Some(b) = bias {
                s += b[ni] as f64;
            }
            y[mi * n + ni] = s as f32;
        }
    }
}

fn check_shapes(x_len: usize, m: usize, k: usize, w_len: usize, n: usize, bias_len: Option<usize>, y_len: usize) {
    assert_eq!(x_len, m * k, "matmul_xwt: x.len() != m * k");
    assert_eq!(w_len, n * k, "matmul_xwt: w.len() != n * k");
    assert_eq!(y_len, m * n, "matmul_xwt: y.len() != m * n");
    if let Some(b) = bias_len {
        assert_eq!(b, n, "matmul_xwt: bias.len() != n");
    }
}

/// A raw pointer to y that tasks share; each task writes a disjoint set of
/// columns `n0..n1` of every row.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements of y (distinct column ranges), and the
// borrow of y outlives the parallel loop, so sharing the pointer is race-free.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// The shapes and inputs of one call, shared by all tasks.
struct Problem<'a, W> {
    x: &'a [f32],
    /// x transposed in groups of rows for the AVX2 broadcast kernel
    /// ([`by_row_groups`]); empty when that kernel is not used.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    xt: &'a [f32],
    m: usize,
    k: usize,
    w: &'a [W],
    n: usize,
    bias: Option<&'a [f32]>,
    y: OutPtr,
}

#[allow(clippy::too_many_arguments)]
fn matmul_with_backend<W: WeightElem>(
    backend: Backend,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    check_shapes(x.len(), m, k, w.len(), n, bias.map(<[f32]>::len), y.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for row in y.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return;
    }
    // A prompt's x goes in chunks of rows: a chunk's x stays in cache while
    // the weights stream past it, for one more read of the weights per chunk.
    let broadcast = uses_broadcast(backend, m);
    let chunk = if broadcast { BROADCAST_CHUNK_ROWS } else { DOT_CHUNK_ROWS };
    if m > chunk {
        for (xc, yc) in x.chunks(chunk * k).zip(y.chunks_mut(chunk * n)) {
            matmul_with_backend(backend, xc, xc.len() / k, k, w, n, bias, yc);
        }
        return;
    }
    let mut xt = if broadcast { TRANSPOSED_X.take() } else { Vec::new() };
    let xt_start = if broadcast { by_row_groups(x, m, k, &mut xt) } else { 0 };
    let p = Problem { x, xt: &xt[xt_start..], m, k, w, n, bias, y: OutPtr(y.as_mut_ptr()) };
    let threads = rayon::current_num_threads().max(1);
    // About 8 tasks per thread so a slow core does not leave the other idle at
    // the end, but at least 16 rows so each task streams enough to amortise it;
    // whole tiles of weight rows (6 for the broadcast kernel, else 4 or 8).
    let tile = if broadcast { BROADCAST_ROWS } else { 8 };
    let rows = n.div_ceil(8 * threads).clamp(16, 64).next_multiple_of(tile);
    let tasks = n.div_ceil(rows);
    let run = |t: usize| {
        let n0 = t * rows;
        let n1 = (n0 + rows).min(n);
        compute_rows(backend, &p, n0, n1);
    };
    if tasks == 1 || threads == 1 || m * n * k < SERIAL_MACS {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
    if broadcast {
        TRANSPOSED_X.set(xt);
    }
}

/// From this many x rows on, the AVX2 path multiplies with the broadcast
/// kernel (`avx2::broadcast_panel`); below, its 16-row groups are partly
/// padding and the dot-product tiles do better (Zen 3, 2 threads: at m = 12
/// 99 against 86 GFLOP/s, at m = 16 120 against 129 on gate/up).
const BROADCAST_MIN_M: usize = 16;
/// Weight rows per broadcast tile.
const BROADCAST_ROWS: usize = 6;
/// x rows per call of the broadcast kernel (16 groups of 16): with
/// TinyLlama's shapes on Zen 3, 256 against 128 or 192 rows and against
/// the whole prompt (m = 1,648: 145-151 -> 162-176 GFLOP/s, 2 threads).
const BROADCAST_CHUNK_ROWS: usize = 256;
/// x rows per call of the dot-product tiles, which pass every x row over
/// each widened weight tile: 64 rows (at most 256 KiB at k = 1,024) stay in
/// L2 where a long prompt would stream from memory for every tile.
const DOT_CHUNK_ROWS: usize = 64;

fn uses_broadcast(backend: Backend, m: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    let has_kernel = backend == Backend::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let has_kernel = {
        let _ = backend;
        false
    };
    has_kernel && m >= BROADCAST_MIN_M
}

thread_local! {
    /// The transposed x of the caller's last call, kept so a decode or
    /// prefill step does not allocate it anew per matmul.
    static TRANSPOSED_X: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// From this many x elements on, [`by_row_groups`] transposes on all
/// threads (a 256-row prompt chunk: 0.5-1.4 M elements, a few % of its GEMM).
const PARALLEL_TRANSPOSE_MIN: usize = 1 << 18;

/// Width of the x row group starting at row `m0` of `m`: 16 rows, or 8 for
/// a last group of at most 8.
fn group_width(m: usize, m0: usize) -> usize {
    if m - m0 > 8 { 16 } else { 8 }
}

/// x `[m, k]` transposed per group of rows ([`group_width`]): a group of
/// width g is `[k, g]`, so one k's g values are one or two vectors; rows
/// past m are zero. Groups follow each other from `out[start..]`, the
/// returned start being 64-byte aligned so that no vector load of a group
/// splits a cache line.
fn by_row_groups(x: &[f32], m: usize, k: usize, out: &mut Vec<f32>) -> usize {
    let full = m / 16 * 16;
    let total = k * (full + if full < m { group_width(m, full) } else { 0 });
    out.clear();
    out.resize(total + 15, 0.0);
    // align_offset may decline (usize::MAX); then the groups stay unaligned.
    let start = out.as_ptr().align_offset(64).min(15);
    let transpose = |(gi, dst): (usize, &mut [f32])| {
        let (m0, g) = (gi * 16, dst.len() / k);
        let rows = g.min(m - m0);
        let src = &x[m0 * k..(m0 + rows) * k];
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut r0 = 0;
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx2_fma() {
            while r0 + 8 <= rows {
                // SAFETY: AVX is available; src holds 8 rows of k from r0 on
                // and dst[r0..] holds k - 1 strides of g plus 8 (r0 <= g - 8).
                unsafe { avx2::transpose8(&src[r0 * k..(r0 + 8) * k], k, &mut dst[r0..], g) };
                r0 += 8;
            }
        }
        for (ki, dst) in dst.chunks_exact_mut(g).enumerate() {
            for (r, d) in dst[..rows].iter_mut().enumerate().skip(r0) {
                *d = src[r * k + ki];
            }
        }
    };
    let groups = &mut out[start..start + total];
    if m * k < PARALLEL_TRANSPOSE_MIN {
        groups.chunks_mut(16 * k).enumerate().for_each(transpose);
    } else {
        groups.par_chunks_mut(16 * k).enumerate().for_each(transpose);
    }
    start
}

/// Computes y[.., n0..n1] for all m rows.
fn compute_rows<W: WeightElem>(backend: Backend, p: &Problem<'_, W>, n0: usize, n1: usize) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        // SAFETY (all Avx2 arms): BACKEND only picks Avx2 after detecting
        // AVX2, FMA and F16C; DTYPE names W's concrete type (the trait is
        // sealed), so each cast is an identity; shapes were checked by the
        // caller and this task alone owns columns n0..n1.
        Backend::Avx2 => match W::DTYPE {
            WeightDType::F32 => unsafe { avx2::panel::<f32>(p, cast_weights(p.w), n0, n1) },
            WeightDType::F16 => unsafe { avx2::panel::<f16>(p, cast_weights(p.w), n0, n1) },
            WeightDType::BF16 => unsafe { avx2::panel::<bf16>(p, cast_weights(p.w), n0, n1) },
        },
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => drive(p, n0, n1, |x, ldx, w, r, c| neon::tile(x, ldx, w, r, c, p.k)),
        Backend::Scalar => drive(p, n0, n1, |x, ldx, w, r, c| scalar_tile(x, ldx, w, r, c, p.k)),
    }
}

/// Reinterprets the weights as the concrete type `T`.
///
/// # Safety
/// `T` must be the type `W` is, i.e. the one `W::DTYPE` names.
#[cfg(target_arch = "x86_64")]
unsafe fn cast_weights<W: WeightElem, T>(w: &[W]) -> &[T] {
    debug_assert_eq!(size_of::<W>(), size_of::<T>());
    // SAFETY: same type per the caller, so same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), w.len()) }
}

/// Largest tile: 8 weight rows for m = 1, 4 weight rows x 3 x rows otherwise.
const MAX_R: usize = 8;
const MAX_C: usize = 3;
type Sums = [[f32; MAX_C]; MAX_R];

/// Walks rows n0..n1 in tiles and writes y. `tile(x, ldx, w, r, c)` returns the
/// dot products of `r` weight rows starting at `w` (row stride k) with `c` x
/// rows starting at `x` (row stride `ldx` = k) in `sums[0..r][0..c]`.
fn drive<W: WeightElem>(
    p: &Problem<'_, W>,
    n0: usize,
    n1: usize,
    tile: impl Fn(&[f32], usize, &[W], usize, usize) -> Sums,
) {
    let (m, k, n) = (p.m, p.k, p.n);
    // m = 1 is bandwidth bound: more rows in flight. m > 1: reuse each weight
    // vector across up to 3 x rows.
    let r_full = if m == 1 { 8 } else { 4 };
    let mut nr = n0;
    while nr < n1 {
        let r = if n1 - nr >= r_full { r_full } else { 1 };
        let w = &p.w[nr * k..(nr + r) * k];
        let mut mr = 0;
        while mr < m {
            let c = (m - mr).min(MAX_C);
            let x = &p.x[mr * k..(mr + c) * k];
            let sums = tile(x, k, w, r, c);
            for (ri, row) in sums.iter().enumerate().take(r) {
                let b = p.bias.map_or(0.0, |b| b[nr + ri]);
                for (ci, s) in row.iter().enumerate().take(c) {
                    let idx = (mr + ci) * n + nr + ri;
                    // SAFETY: idx < m * n = y.len() (mr + ci < m, nr + ri < n1
                    // <= n), and only this task writes columns n0..n1.
                    unsafe { *p.y.0.add(idx) = s + b };
                }
            }
            mr += c;
        }
        nr += r;
    }
}

/// Portable tile: 8 independent lanes per dot product so LLVM can vectorise it
/// with whatever SIMD the target was compiled for.
fn scalar_tile<W: WeightElem>(x: &[f32], ldx: usize, w: &[W], r: usize, c: usize, k: usize) -> Sums {
    const L: usize = 8;
    let mut sums = [[0f32; MAX_C]; MAX_R];
    let k8 = k - k % L;
    for ri in 0..r {
        let wr = &w[ri * k..(ri + 1) * k];
        for ci in 0..c {
            let xr = &x[ci * ldx..ci * ldx + k];
            let mut acc = [0f32; L];
            for (xc, wc) in xr[..k8].chunks_exact(L).zip(wr[..k8].chunks_exact(L)) {
                for l in 0..L {
                    acc[l] += xc[l] * wc[l].to_f32();
                }
            }
            let mut s = acc.iter().sum::<f32>();
            for i in k8..k {
                s += xr[i] * wr[i].to_f32();
            }
            sums[ri][ci] = s;
        }
    }
    sums
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    //! AVX2 + FMA + F16C tiles. Callers must have checked those features.
    use super::{Problem, WeightDType, WeightElem};
    use crate::cpu::prefetch_within;
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
            // them into `vcvtph2ps ymm, m128`, which on Zen 1 issues once per
            // 3.1 cycles against 2.7 for the register form after a load.
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

    /// K elements per block: the 4 widened weight rows (4 KiB) and
    /// x[.., block] for 3 x rows (3 KiB) stay in L1.
    const KB: usize = 256;

    /// How many K blocks ahead to prefetch each weight row (4 x 512 B for f16):
    /// measured best of 1, 2, 4, 8 on Zen; 1 or 2 lose 20-50% at small m.
    const PF_BLOCKS: usize = 4;

    #[repr(C, align(32))]
    struct PanelBuf([f32; 4 * KB]);

    /// y[.., n0..n1] (m = 1 goes to [`gemv`]). Each tile of 4 weight rows is
    /// widened a K block at a time into an L1 buffer and reused by every x
    /// row in 4x3 register tiles, so f16/bf16 conversion costs 1/m per weight,
    /// not 1/3 (vcvtph2ps is slow enough on Zen to cap m >= 4 otherwise).
    /// Partial sums over K blocks accumulate in y, which only this task writes.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available, `w` must be `p.w` viewed as its
    /// concrete type, shapes must have been checked and n0 <= n1 <= p.n, and
    /// no other thread may touch y[.., n0..n1] during the call.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panel<T: Load8>(p: &Problem<'_, impl Sized>, w: &[T], n0: usize, n1: usize) {
        let (m, k, n) = (p.m, p.k, p.n);
        if m == 1 {
            // SAFETY: forwarded from the caller.
            unsafe { gemv(p, w, n0, n1) };
            return;
        }
        if !p.xt.is_empty() {
            // SAFETY: forwarded from the caller; xt was built for these shapes.
            unsafe { broadcast_panel(p, w, n0, n1) };
            return;
        }
        let mut buf = PanelBuf([0.0; 4 * KB]);
        let mut nr = n0;
        while nr < n1 {
            let r = (n1 - nr).min(4);
            let mut k0 = 0;
            while k0 < k {
                let len = KB.min(k - k0);
                for ri in 0..4 {
                    let dst = &mut buf.0[ri * KB..ri * KB + len];
                    if ri < r {
                        // SAFETY: features are enabled on this function.
                        unsafe { widen_row(w, k, nr + ri, k0, PF_BLOCKS, 4, dst) };
                    } else {
                        // Rows past the end of the task: zeros, never stored.
                        dst.fill(0.0);
                    }
                }
                let mut mr = 0;
                while mr < m {
                    let c = (m - mr).min(3);
                    let x = &p.x[mr * k + k0..(mr + c - 1) * k + k0 + len];
                    // SAFETY: x holds c rows of stride k with len readable
                    // elements each (sliced above); buf holds 4 rows of len.
                    let sums = unsafe {
                        match c {
                            3 => tile4::<3>(x.as_ptr(), k, &buf, len),
                            2 => tile4::<2>(x.as_ptr(), k, &buf, len),
                            _ => tile4::<1>(x.as_ptr(), k, &buf, len),
                        }
                    };
                    for (ci, s) in sums.iter().enumerate().take(c) {
                        let row = (mr + ci) * n + nr;
                        // SAFETY: row + r <= (m - 1) * n + n1 <= y.len(), and
                        // columns nr..nr + r belong to this task only.
                        unsafe { accumulate(p.y.0.add(row), *s, r, k0 == 0, p.bias.map(|b| &b[nr..nr + r])) };
                    }
                    mr += c;
                }
                k0 += len;
            }
            nr += r;
        }
    }

    /// Most x row groups of a call (`BROADCAST_CHUNK_ROWS` / 16).
    const MAX_GROUPS: usize = super::BROADCAST_CHUNK_ROWS / 16;

    /// Calls of at most this many groups (m <= 64, batched decode) run tile
    /// by tile; larger ones K block by K block (see [`broadcast_panel`]).
    const TILE_MAJOR_GROUPS: usize = 4;

    /// A broadcast tile's partial sums: 6 weight rows x 16 x rows.
    type TileSums = [[f32; 16]; super::BROADCAST_ROWS];

    thread_local! {
        /// Widened weights (one tile's or all the task's rows for a K block,
        /// stride KB) and partial sums per (x group, tile), kept per thread
        /// so that no call allocates them.
        static BROADCAST_SCRATCH: std::cell::Cell<(Vec<f32>, Vec<TileSums>)> =
            const { std::cell::Cell::new((Vec::new(), Vec::new())) };
    }

    /// y[.., n0..n1] for BROADCAST_MIN_M <= m <= BROADCAST_CHUNK_ROWS, in
    /// BLIS's shape: tiles of 6 weight rows are widened a K block at a time,
    /// and each group of 16 x rows (`p.xt`, transposed so that a k's 16
    /// values are two vectors) passes over a tile with 6 x 2 accumulators:
    /// per k, two vector loads, 6 broadcast weights and 12 FMAs, and no
    /// horizontal sums. Partial sums stay in a small tile per (group, weight
    /// tile) across K blocks and reach y at the end. On Zen 3 this tile runs
    /// at ~97% of the FMA peak against ~88% for the 4 x 3 dot-product tile,
    /// which also pays 12 horizontal sums per K block.
    ///
    /// Two loop orders, by the number of groups:
    /// - few (batched decode): tile by tile, K blocks within, each block's
    ///   rows widened into L1 while the previous block computes. Each weight
    ///   row is read front to back as the hardware prefetcher likes; the
    ///   other order, which jumps between the task's rows every K block,
    ///   measured 15% slower at m = 16.
    /// - many (prefill): K block by K block, all the task's rows widened
    ///   once into an L2 buffer, then each group's x block stays in L1 while
    ///   the tiles stream past it. Widening then costs 1/m per weight, and x
    ///   comes from L2 once per task and K block, not once per tile: 2-5%
    ///   faster at m = 256 and 1,024.
    ///
    /// # Safety
    /// As [`panel`], with `p.xt` built by `by_row_groups` for p.x.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn broadcast_panel<T: Load8>(p: &Problem<'_, impl Sized>, w: &[T], n0: usize, n1: usize) {
        const R: usize = super::BROADCAST_ROWS;
        let (m, k, n) = (p.m, p.k, p.n);
        // The groups: (first row, width, offset in xt).
        let mut groups = [(0, 0, 0); MAX_GROUPS];
        let (mut rows, mut count, mut at) = (0, 0, 0);
        while rows < m {
            let g = super::group_width(m, rows);
            assert!(count < MAX_GROUPS, "broadcast_panel takes at most {} rows", super::BROADCAST_CHUNK_ROWS);
            groups[count] = (rows, g, at);
            (rows, count, at) = (rows + g, count + 1, at + k * g);
        }
        let groups = &groups[..count];
        let span = n1 - n0;
        let tiles = span.div_ceil(R);
        let (mut wide_buf, mut sums) = BROADCAST_SCRATCH.take();
        // Tile by tile: two tiles' rows; else all the task's. 64-byte
        // aligned, so that no widened vector straddles two cache lines.
        let tile_major = count <= TILE_MAJOR_GROUPS;
        let wide_len = if tile_major { 2 * R * KB } else { span.next_multiple_of(R) * KB };
        wide_buf.resize(wide_len + 15, 0.0);
        let start = wide_buf.as_ptr().align_offset(64).min(15);
        let wide = &mut wide_buf[start..start + wide_len];
        sums.clear();
        sums.resize(count * tiles, [[0.0; 16]; R]);
        // Adds tile t's products over K block k0.. (len) for group gi, with
        // the tile's widened rows at `b`.
        let tile = |gi: usize, t: usize, k0: usize, len: usize, b: *const f32, sums: &mut [TileSums]| {
            let (_, g, at) = groups[gi];
            let r = (span - t * R).min(R);
            // SAFETY: the group holds k rows of g values (by_row_groups), of
            // which k0..k0 + len are read; b holds r rows of len.
            unsafe { broadcast_tile_rg(r, g, p.xt.as_ptr().add(at + k0 * g), b, len, &mut sums[gi * tiles + t]) };
        };
        if tile_major {
            // Blocks (tile t, K block k0) in order, widened into alternate
            // halves of `wide`. For f16 and full tiles, the next block is
            // widened inside this block's first group's kernel, one vector
            // per row every 8 k's, where out-of-order execution overlaps its
            // loads, conversions and stores with the FMAs: at m = 16 on two
            // threads 90-93 -> 118-134 GFLOP/s against a loop of its own,
            // which other weight types and short tiles keep.
            let next = |t: usize, k0: usize| match () {
                _ if k0 + KB < k => Some((t, k0 + KB)),
                _ if t + 1 < tiles => Some((t + 1, 0)),
                _ => None,
            };
            let rows_of = |t: usize| (span - t * R).min(R);
            let (mut cur, mut other) = wide.split_at_mut(R * KB);
            for ri in 0..rows_of(0) {
                // SAFETY: features are enabled on this function.
                unsafe { widen_row(w, k, n0 + ri, 0, PF_BLOCKS, R, &mut cur[ri * KB..ri * KB + KB.min(k)]) };
            }
            let (mut t, mut k0) = (0, 0);
            loop {
                let len = KB.min(k - k0);
                let after = next(t, k0);
                let mut first_done = false;
                if let Some((nt, nk0)) = after {
                    let (first, nlen) = (n0 + nt * R, KB.min(k - nk0));
                    let (_, g, at) = groups[0];
                    if T::DTYPE == WeightDType::F16 && rows_of(t) == R && rows_of(nt) == R && g == 16 {
                        let src = &w[first * k + nk0..(first + R - 1) * k + nk0 + nlen];
                        // SAFETY: x holds len k's of the group from k0 (as
                        // in `tile`), cur R rows of len; src (f16, per
                        // DTYPE) holds R rows of nlen at stride k, and
                        // `other` R rows of KB.
                        unsafe {
                            let x = p.xt.as_ptr().add(at + k0 * 16);
                            let (src, dst) = (src.as_ptr().cast::<f16>(), other.as_mut_ptr());
                            let pf = w.as_ptr().wrapping_add(ahead_of(k, first, nk0, PF_BLOCKS, R)).cast::<f16>();
                            broadcast_tile_6x16_widening(x, cur.as_ptr(), len, &mut sums[t], src, k, dst, nlen, pf);
                        }
                        first_done = true;
                    } else {
                        for ri in 0..rows_of(nt) {
                            prefetch_ahead(w, k, first + ri, nk0, PF_BLOCKS, R, nlen);
                            let src = &w[(first + ri) * k + nk0..(first + ri) * k + nk0 + nlen];
                            // SAFETY: features are enabled on this function.
                            unsafe { widen(src, &mut other[ri * KB..ri * KB + nlen]) };
                        }
                    }
                }
                for gi in usize::from(first_done)..count {
                    tile(gi, t, k0, len, cur.as_ptr(), &mut sums);
                }
                let Some((nt, nk0)) = after else { break };
                (t, k0) = (nt, nk0);
                std::mem::swap(&mut cur, &mut other);
            }
        } else {
            let mut k0 = 0;
            while k0 < k {
                let len = KB.min(k - k0);
                for ri in 0..span {
                    let dst = &mut wide[ri * KB..ri * KB + len];
                    // Prefetches the row's next K block (after the last, the
                    // rows that follow the task's).
                    // SAFETY: features are enabled on this function.
                    unsafe { widen_row(w, k, n0 + ri, k0, 1, span, dst) };
                }
                for gi in 0..count {
                    for t in 0..tiles {
                        // SAFETY: t * R * KB < wide.len().
                        tile(gi, t, k0, len, unsafe { wide.as_ptr().add(t * R * KB) }, &mut sums);
                    }
                }
                k0 += len;
            }
        }
        for (gi, &(first, g, _)) in groups.iter().enumerate() {
            for (t, s) in sums[gi * tiles..(gi + 1) * tiles].iter().enumerate() {
                let nr = n0 + t * R;
                for mi in 0..g.min(m - first) {
                    for (ri, s) in s.iter().enumerate().take((n1 - nr).min(R)) {
                        let v = s[mi] + p.bias.map_or(0.0, |b| b[nr + ri]);
                        // SAFETY: (first + mi) * n + nr + ri < m * n; this
                        // task owns columns n0..n1.
                        unsafe { *p.y.0.add((first + mi) * n + nr + ri) = v };
                    }
                }
            }
        }
        BROADCAST_SCRATCH.set((wide_buf, sums));
    }

    /// `dst[ki * g + r] = src[r * k + ki]` for 8 rows r of k: 8 x 8 blocks
    /// transposed in registers, the last k % 8 one by one.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn transpose8(src: &[f32], k: usize, dst: &mut [f32], g: usize) {
        assert!(src.len() == 8 * k && g >= 8 && (k == 0 || dst.len() >= (k - 1) * g + 8));
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut k0 = 0;
        while k0 + 8 <= k {
            // SAFETY: rows r < 8 hold k0 + 8 <= k values; column k0 + j goes
            // to d[(k0 + j) * g..][..8], within dst per the assert.
            unsafe {
                // A loop, not a closure: closures do not inherit the target
                // features and would call each intrinsic out of line.
                let mut r = [_mm256_setzero_ps(); 8];
                for (i, r) in r.iter_mut().enumerate() {
                    *r = _mm256_loadu_ps(s.add(i * k + k0));
                }
                let (t0, t1) = (_mm256_unpacklo_ps(r[0], r[1]), _mm256_unpackhi_ps(r[0], r[1]));
                let (t2, t3) = (_mm256_unpacklo_ps(r[2], r[3]), _mm256_unpackhi_ps(r[2], r[3]));
                let (t4, t5) = (_mm256_unpacklo_ps(r[4], r[5]), _mm256_unpackhi_ps(r[4], r[5]));
                let (t6, t7) = (_mm256_unpacklo_ps(r[6], r[7]), _mm256_unpackhi_ps(r[6], r[7]));
                // Rows 0-3 (and 4-7) of columns j and j + 4, for j = 0..4.
                let lo = [
                    _mm256_shuffle_ps::<0x44>(t0, t2),
                    _mm256_shuffle_ps::<0xEE>(t0, t2),
                    _mm256_shuffle_ps::<0x44>(t1, t3),
                    _mm256_shuffle_ps::<0xEE>(t1, t3),
                ];
                let hi = [
                    _mm256_shuffle_ps::<0x44>(t4, t6),
                    _mm256_shuffle_ps::<0xEE>(t4, t6),
                    _mm256_shuffle_ps::<0x44>(t5, t7),
                    _mm256_shuffle_ps::<0xEE>(t5, t7),
                ];
                for j in 0..4 {
                    _mm256_storeu_ps(d.add((k0 + j) * g), _mm256_permute2f128_ps::<0x20>(lo[j], hi[j]));
                    _mm256_storeu_ps(d.add((k0 + j + 4) * g), _mm256_permute2f128_ps::<0x31>(lo[j], hi[j]));
                }
            }
            k0 += 8;
        }
        for ki in k0..k {
            for r in 0..8 {
                dst[ki * g + r] = src[r * k + ki];
            }
        }
    }

    /// [`broadcast_tile`] for r weight rows (1..=6) and a group of g x rows
    /// (8 or 16).
    ///
    /// # Safety
    /// As [`broadcast_tile`].
    #[inline(always)]
    unsafe fn broadcast_tile_rg(r: usize, g: usize, x: *const f32, b: *const f32, len: usize, s: &mut TileSums) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (r, g) {
                (6, 16) => broadcast_tile::<6, 2>(x, b, len, s),
                (6, _) => broadcast_tile::<6, 1>(x, b, len, s),
                (5, 16) => broadcast_tile::<5, 2>(x, b, len, s),
                (5, _) => broadcast_tile::<5, 1>(x, b, len, s),
                (4, 16) => broadcast_tile::<4, 2>(x, b, len, s),
                (4, _) => broadcast_tile::<4, 1>(x, b, len, s),
                (3, 16) => broadcast_tile::<3, 2>(x, b, len, s),
                (3, _) => broadcast_tile::<3, 1>(x, b, len, s),
                (2, 16) => broadcast_tile::<2, 2>(x, b, len, s),
                (2, _) => broadcast_tile::<2, 1>(x, b, len, s),
                (_, 16) => broadcast_tile::<1, 2>(x, b, len, s),
                _ => broadcast_tile::<1, 1>(x, b, len, s),
            }
        }
    }

    /// [`broadcast_tile`] for 6 f16 weight rows and 16 x rows that meanwhile
    /// widens 6 rows of `wlen` f16 weights at `src` (row stride `stride`)
    /// into `dst` (row stride KB): one vector per row every 8 k's. Every 32
    /// k's it also prefetches a cache line of each of the 6 rows at `pf`
    /// (same stride), the block `PF_BLOCKS` on: spread over the loop, these
    /// no longer stall on full miss buffers as a burst of 48 lines before
    /// each block did (m = 16, 2 threads: 128 -> 133 GFLOP/s on gate/up,
    /// 141 -> 147 on qkv, medians of 8 alternating runs). The main
    /// loop is assembly because it needs all 16 vector registers (12
    /// accumulators, 2 x vectors, a broadcast weight and a widened one), and
    /// LLVM spilled accumulators when it was written with intrinsics.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; x must hold `len * 16` floats,
    /// buf 6 rows of `len` (stride KB); src 6 rows of `wlen` at `stride`,
    /// dst 6 rows of KB >= wlen, not overlapping buf. `pf` may point
    /// anywhere: a prefetch never faults.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn broadcast_tile_6x16_widening(
        x: *const f32,
        buf: *const f32,
        len: usize,
        sums: &mut TileSums,
        src: *const f16,
        stride: usize,
        dst: *mut f32,
        wlen: usize,
        pf: *const f16,
    ) {
        let n8 = len.min(wlen) / 8;
        // SAFETY: the loop reads x[..n8 * 128], buf rows [..n8 * 8], src rows
        // [..n8 * 8] and writes dst rows [..n8 * 8], all within the caller's
        // ranges; the tails go through the checked helpers.
        unsafe {
            if n8 > 0 {
                let s = sums.as_mut_ptr().cast::<f32>();
                let mut a = [_mm256_setzero_ps(); 12];
                for (o, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(s.add(o * 8));
                }
                let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8, mut a9, mut a10, mut a11] =
                    a;
                std::arch::asm!(
                "2:",
                "vmovups {x0}, ymmword ptr [{x} + 0]",
                "vmovups {x1}, ymmword ptr [{x} + 32]",
                "vbroadcastss {w}, dword ptr [{b} + 0]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1024]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2048]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3072]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4096]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5120]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vmovups {x0}, ymmword ptr [{x} + 64]",
                "vmovups {x1}, ymmword ptr [{x} + 96]",
                "vbroadcastss {w}, dword ptr [{b} + 4]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1028]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2052]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3076]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4100]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5124]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vcvtph2ps {t}, xmmword ptr [{src}]",
                "vmovups ymmword ptr [{dst} + 0], {t}",
                "vcvtph2ps {t}, xmmword ptr [{src} + {s}]",
                "vmovups ymmword ptr [{dst} + 1024], {t}",
                "vmovups {x0}, ymmword ptr [{x} + 128]",
                "vmovups {x1}, ymmword ptr [{x} + 160]",
                "vbroadcastss {w}, dword ptr [{b} + 8]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1032]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2056]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3080]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4104]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5128]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vmovups {x0}, ymmword ptr [{x} + 192]",
                "vmovups {x1}, ymmword ptr [{x} + 224]",
                "vbroadcastss {w}, dword ptr [{b} + 12]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1036]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2060]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3084]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4108]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5132]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vcvtph2ps {t}, xmmword ptr [{src} + 2*{s}]",
                "vmovups ymmword ptr [{dst} + 2048], {t}",
                "vcvtph2ps {t}, xmmword ptr [{src3}]",
                "vmovups ymmword ptr [{dst} + 3072], {t}",
                "test {n}, 3",
                "jnz 3f",
                "prefetcht0 byte ptr [{pf}]",
                "prefetcht0 byte ptr [{pf} + {s}]",
                "prefetcht0 byte ptr [{pf} + 2*{s}]",
                "prefetcht0 byte ptr [{pf3}]",
                "prefetcht0 byte ptr [{pf3} + {s}]",
                "prefetcht0 byte ptr [{pf3} + 2*{s}]",
                "3:",
                "vmovups {x0}, ymmword ptr [{x} + 256]",
                "vmovups {x1}, ymmword ptr [{x} + 288]",
                "vbroadcastss {w}, dword ptr [{b} + 16]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1040]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2064]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3088]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4112]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5136]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vmovups {x0}, ymmword ptr [{x} + 320]",
                "vmovups {x1}, ymmword ptr [{x} + 352]",
                "vbroadcastss {w}, dword ptr [{b} + 20]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1044]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2068]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3092]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4116]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5140]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vcvtph2ps {t}, xmmword ptr [{src3} + {s}]",
                "vmovups ymmword ptr [{dst} + 4096], {t}",
                "vmovups {x0}, ymmword ptr [{x} + 384]",
                "vmovups {x1}, ymmword ptr [{x} + 416]",
                "vbroadcastss {w}, dword ptr [{b} + 24]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1048]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2072]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3096]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4120]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5144]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vmovups {x0}, ymmword ptr [{x} + 448]",
                "vmovups {x1}, ymmword ptr [{x} + 480]",
                "vbroadcastss {w}, dword ptr [{b} + 28]",
                "vfmadd231ps {a0}, {w}, {x0}",
                "vfmadd231ps {a1}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 1052]",
                "vfmadd231ps {a2}, {w}, {x0}",
                "vfmadd231ps {a3}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 2076]",
                "vfmadd231ps {a4}, {w}, {x0}",
                "vfmadd231ps {a5}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 3100]",
                "vfmadd231ps {a6}, {w}, {x0}",
                "vfmadd231ps {a7}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 4124]",
                "vfmadd231ps {a8}, {w}, {x0}",
                "vfmadd231ps {a9}, {w}, {x1}",
                "vbroadcastss {w}, dword ptr [{b} + 5148]",
                "vfmadd231ps {a10}, {w}, {x0}",
                "vfmadd231ps {a11}, {w}, {x1}",
                "vcvtph2ps {t}, xmmword ptr [{src3} + 2*{s}]",
                "vmovups ymmword ptr [{dst} + 5120], {t}",
                "add {x}, 512",
                "add {b}, 32",
                "add {src}, 16",
                "add {src3}, 16",
                "add {pf}, 16",
                "add {pf3}, 16",
                "add {dst}, 32",
                "dec {n}",
                "jnz 2b",
                    x = inout(reg) x => _,
                    b = inout(reg) buf => _,
                    src = inout(reg) src => _,
                    src3 = inout(reg) src.add(3 * stride) => _,
                    pf = inout(reg) pf => _,
                    pf3 = inout(reg) pf.wrapping_add(3 * stride) => _,
                    s = in(reg) stride * 2,
                    dst = inout(reg) dst => _,
                    n = inout(reg) n8 => _,
                    a0 = inout(ymm_reg) a0, a1 = inout(ymm_reg) a1, a2 = inout(ymm_reg) a2, a3 = inout(ymm_reg) a3,
                    a4 = inout(ymm_reg) a4, a5 = inout(ymm_reg) a5, a6 = inout(ymm_reg) a6, a7 = inout(ymm_reg) a7,
                    a8 = inout(ymm_reg) a8, a9 = inout(ymm_reg) a9, a10 = inout(ymm_reg) a10, a11 = inout(ymm_reg) a11,
                    x0 = out(ymm_reg) _, x1 = out(ymm_reg) _, w = out(ymm_reg) _, t = out(ymm_reg) _,
                    options(nostack),
                );
                for (o, a) in [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11].into_iter().enumerate() {
                    _mm256_storeu_ps(s.add(o * 8), a);
                }
            }
            let done = n8 * 8;
            if done < len {
                broadcast_tile::<6, 2>(x.add(done * 16), buf.add(done), len - done, sums);
            }
            for r in 0..6 {
                let row = std::slice::from_raw_parts(src.add(r * stride + done), wlen - done);
                widen(row, std::slice::from_raw_parts_mut(dst.add(r * KB + done), wlen - done));
            }
        }
    }

    /// Adds to `sums` the products of `R` widened weight rows (buf, stride
    /// KB) with a group of `8 * V` x rows (x: `len` k's of 8V values):
    /// sums[r][i] += weight row r . x row i of the group, over `len` k's.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; x must hold `len * 8 * V` floats and
    /// buf R rows of `len`.
    #[inline(always)]
    unsafe fn broadcast_tile<const R: usize, const V: usize>(
        x: *const f32,
        buf: *const f32,
        len: usize,
        sums: &mut TileSums,
    ) {
        // SAFETY: reads stay within len k's of x and buf (caller); sums rows
        // hold 16 floats.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); V]; R];
            for (acc_r, s) in acc.iter_mut().zip(sums.iter()) {
                for (v, a) in acc_r.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(s.as_ptr().add(v * 8));
                }
            }
            for i in 0..len {
                let mut xv = [_mm256_setzero_ps(); V];
                for (v, xv) in xv.iter_mut().enumerate() {
                    *xv = _mm256_loadu_ps(x.add((i * V + v) * 8));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let wv = _mm256_broadcast_ss(&*buf.add(r * KB + i));
                    for (a, xv) in acc_r.iter_mut().zip(xv.iter()) {
                        *a = _mm256_fmadd_ps(wv, *xv, *a);
                    }
                }
            }
            for (acc_r, s) in acc.iter().zip(sums.iter_mut()) {
                for (v, a) in acc_r.iter().enumerate() {
                    _mm256_storeu_ps(s.as_mut_ptr().add(v * 8), *a);
                }
            }
        }
    }

    /// How far ahead of use [`gemv`] prefetches its weights, in bytes:
    /// measured best of 2-32 KiB on the 2-vCPU EPYC (Zen 1) (16 KiB: 17-18 GB/s, about the
    /// machine's read bandwidth; 2 KiB per row: 14-15 GB/s).
    const GEMV_PF_BYTES: usize = 16 << 10;

    /// y[0, n0..n1] for m = 1: 4 weight rows at a time, widened straight into
    /// FMAs with 2 accumulator chains per row, one cache line per row per step,
    /// the 4-row span prefetched GEMV_PF_BYTES ahead as one stream.
    ///
    /// # Safety
    /// As [`panel`], with p.m == 1.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemv<T: Load8>(p: &Problem<'_, impl Sized>, w: &[T], n0: usize, n1: usize) {
        let k = p.k;
        let line = 64 / size_of::<T>();
        let kl = k - k % line;
        let x = p.x.as_ptr();
        let w_end = w.as_ptr_range().end.cast::<u8>();
        let mut nr = n0;
        while nr + 4 <= n1 {
            let rows = [nr * k, (nr + 1) * k, (nr + 2) * k, (nr + 3) * k];
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            let mut i = 0;
            // Rows nr..nr + 4 are one contiguous span read as 4 interleaved
            // streams; prefetch it as one linear stream running ahead (into
            // the next tile), 4 lines per step as 4 lines are consumed.
            let span = w.as_ptr().wrapping_add(nr * k).cast::<u8>();
            while i < kl {
                let at = span.wrapping_add(GEMV_PF_BYTES + 4 * i * size_of::<T>());
                prefetch_within(at, 4 * 64, w_end);
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let mut j = 0;
                    while j < line {
                        // SAFETY: rows[r] + i + j + 8 <= (nr + r + 1) * k <=
                        // w.len(), and i + j + 8 <= k = x.len() (m = 1).
                        unsafe {
                            let wv = T::load8(w.as_ptr().add(rows[r] + i + j));
                            let xv = _mm256_loadu_ps(x.add(i + j));
                            acc_r[(j / 8) % 2] = _mm256_fmadd_ps(wv, xv, acc_r[(j / 8) % 2]);
                        }
                        j += 8;
                    }
                }
                i += line;
            }
            let mut tail = [0f32; 4];
            for (r, t) in tail.iter_mut().enumerate() {
                for j in kl..k {
                    *t += p.x[j] * w[rows[r] + j].to_f32();
                }
            }
            let [a0, a1, a2, a3] = acc.map(|[a, b]| _mm256_add_ps(a, b));
            // SAFETY: AVX is enabled on this function; tail is 4 floats.
            let s = unsafe { _mm_add_ps(reduce4(a0, a1, a2, a3), _mm_loadu_ps(tail.as_ptr())) };
            // SAFETY: nr + 4 <= n1 <= n = y.len() (m = 1); this task owns
            // columns n0..n1.
            unsafe { accumulate(p.y.0.add(nr), s, 4, true, p.bias.map(|b| &b[nr..nr + 4])) };
            nr += 4;
        }
        for row in nr..n1 {
            let wr = &w[row * k..(row + 1) * k];
            let s: f32 = p.x.iter().zip(wr).map(|(a, b)| a * b.to_f32()).sum();
            // SAFETY: row < n1 <= y.len(); this task owns the column.
            unsafe { *p.y.0.add(row) = s + p.bias.map_or(0.0, |b| b[row]) };
        }
    }

    /// y[0..r] = (first ? bias or 0 : y[0..r]) + s[0..r].
    ///
    /// # Safety
    /// `y..y + r` must be writable and r <= 4.
    #[inline(always)]
    unsafe fn accumulate(y: *mut f32, s: __m128, r: usize, first: bool, bias: Option<&[f32]>) {
        // SAFETY: r <= 4 elements at y are writable (caller); SSE is baseline.
        unsafe {
            if r == 4 {
                let base = match (first, bias) {
                    (false, _) => _mm_loadu_ps(y),
                    (true, Some(b)) => _mm_loadu_ps(b.as_ptr()),
                    (true, None) => _mm_setzero_ps(),
                };
                _mm_storeu_ps(y, _mm_add_ps(base, s));
            } else {
                let mut lanes = [0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), s);
                for (i, v) in lanes.iter().enumerate().take(r) {
                    let base = match (first, bias) {
                        (false, _) => *y.add(i),
                        (true, Some(b)) => b[i],
                        (true, None) => 0.0,
                    };
                    *y.add(i) = base + v;
                }
            }
        }
    }

    /// Widens weights `k0..k0 + dst.len()` of row `row` (rows of k) into
    /// dst, and prefetches as [`prefetch_ahead`].
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_row<T: Load8>(
        w: &[T],
        k: usize,
        row: usize,
        k0: usize,
        blocks: usize,
        tile_rows: usize,
        dst: &mut [f32],
    ) {
        let start = row * k + k0;
        prefetch_ahead(w, k, row, k0, blocks, tile_rows, dst.len());
        // SAFETY: features per the caller.
        unsafe { widen(&w[start..start + dst.len()], dst) };
    }

    /// Short bursts from a tile's rows outrun the hardware prefetcher, so
    /// this asks for the `len` weights that row `row` (rows of k) needs
    /// `blocks` K blocks after `k0` (past its end: the same row of the next
    /// tile, `tile_rows` on).
    fn prefetch_ahead<T>(w: &[T], k: usize, row: usize, k0: usize, blocks: usize, tile_rows: usize, len: usize) {
        let pf = ahead_of(k, row, k0, blocks, tile_rows);
        let w_end = w.as_ptr_range().end.cast::<u8>();
        prefetch_within(w.as_ptr().wrapping_add(pf).cast(), len * size_of::<T>(), w_end);
    }

    /// Index of the weights that row `row` (rows of k) needs `blocks` K
    /// blocks after `k0`, or past its end the same row of the next tile,
    /// `tile_rows` on: linear in `row`, so a tile's rows share one stride.
    fn ahead_of(k: usize, row: usize, k0: usize, blocks: usize, tile_rows: usize) -> usize {
        let ahead = k0 + blocks * KB;
        if ahead < k { row * k + ahead } else { (row + tile_rows) * k + ahead - k }
    }

    /// Widens `src` into `dst` (same length).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen<T: Load8>(src: &[T], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let len8 = src.len() & !7;
        let mut i = 0;
        while i < len8 {
            // SAFETY: i + 8 <= len of both slices.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), T::load8(src.as_ptr().add(i))) };
            i += 8;
        }
        for j in len8..src.len() {
            dst[j] = src[j].to_f32();
        }
    }

    /// Sums of 4 widened weight rows (buf, stride KB) with C x rows (stride
    /// ldx) over `len` elements; lane r of result c is row r times x row c.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; x rows must have `len` readable f32.
    #[inline(always)]
    unsafe fn tile4<const C: usize>(x: *const f32, ldx: usize, buf: &PanelBuf, len: usize) -> [__m128; 3] {
        let w = buf.0.as_ptr();
        let len8 = len & !7;
        // SAFETY: indices stay below len (x, caller) and below KB (buf).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); C]; 4];
            let mut i = 0;
            while i < len8 {
                let mut xv = [_mm256_setzero_ps(); C];
                for (c, v) in xv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(x.add(c * ldx + i));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let wv = _mm256_load_ps(w.add(r * KB + i));
                    for (a, xc) in acc_r.iter_mut().zip(xv.iter()) {
                        *a = _mm256_fmadd_ps(wv, *xc, *a);
                    }
                }
                i += 8;
            }
            let mut out = [_mm_setzero_ps(); 3];
            for c in 0..C {
                let mut s = reduce4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]);
                if len8 < len {
                    let mut tail = [0f32; 4];
                    for (r, t) in tail.iter_mut().enumerate() {
                        for j in len8..len {
                            *t += *x.add(c * ldx + j) * *w.add(r * KB + j);
                        }
                    }
                    s = _mm_add_ps(s, _mm_loadu_ps(tail.as_ptr()));
                }
                out[c] = s;
            }
            out
        }
    }

    /// Horizontal sums of 4 vectors, one per lane.
    #[inline(always)]
    unsafe fn reduce4(a0: __m256, a1: __m256, a2: __m256, a3: __m256) -> __m128 {
        // SAFETY: AVX is available (callers are avx2 target_feature fns).
        unsafe {
            let t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    //! NEON tiles. f32 weights are read in place; f16/bf16 are widened a block
    //! at a time into a stack buffer (stable Rust has no f16 NEON intrinsics).
    use super::{MAX_C, MAX_R, Sums, WeightDType, WeightElem};
    use std::arch::aarch64::*;

    /// Weights widened per block; 8 rows x 256 x 4 B = 8 KiB on the stack.
    const KB: usize = 256;

    pub(super) fn tile<W: WeightElem>(x: &[f32], ldx: usize, w: &[W], r: usize, c: usize, k: usize) -> Sums {
        assert!(r <= MAX_R && c <= MAX_C && w.len() >= r * k && x.len() >= (c - 1) * ldx + k);
        if W::DTYPE == WeightDType::F32 {
            // SAFETY: DTYPE == F32 means W is f32 (sealed trait); lengths were
            // asserted above; NEON is baseline on aarch64.
            return unsafe { tile_f32(x.as_ptr(), ldx, w.as_ptr().cast(), k, r, c, k) };
        }
        let mut buf = [0f32; MAX_R * KB];
        let mut sums = [[0f32; MAX_C]; MAX_R];
        let mut k0 = 0;
        while k0 < k {
            let len = KB.min(k - k0);
            for ri in 0..r {
                W::widen_slice(&w[ri * k + k0..ri * k + k0 + len], &mut buf[ri * KB..ri * KB + len]);
            }
            // SAFETY: buf holds r rows of `len` widened weights at stride KB; x
            // rows have k - k0 >= len readable elements from k0 (asserted above).
            let part = unsafe { tile_f32(x.as_ptr().add(k0), ldx, buf.as_ptr(), KB, r, c, len) };
            for ri in 0..r {
                for ci in 0..c {
                    sums[ri][ci] += part[ri][ci];
                }
            }
            k0 += len;
        }
        sums
    }

    /// Dot products over `len` elements of r weight rows (stride ldw) with c x
    /// rows (stride ldx).
    ///
    /// # Safety
    /// The rows must be readable for `len` elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_f32(x: *const f32, ldx: usize, w: *const f32, ldw: usize, r: usize, c: usize, len: usize) -> Sums {
        // SAFETY: forwarded from the caller; shapes dispatch to fixed tiles.
        unsafe {
            match (r, c) {
                (8, 1) => tile_rc::<8, 1>(x, ldx, w, ldw, len),
                (4, 1) => tile_rc::<4, 1>(x, ldx, w, ldw, len),
                (4, 2) => tile_rc::<4, 2>(x, ldx, w, ldw, len),
                (4, 3) => tile_rc::<4, 3>(x, ldx, w, ldw, len),
                (1, 1) => tile_rc::<1, 1>(x, ldx, w, ldw, len),
                (1, 2) => tile_rc::<1, 2>(x, ldx, w, ldw, len),
                (1, 3) => tile_rc::<1, 3>(x, ldx, w, ldw, len),
                _ => unreachable!("tile shape {r}x{c}"),
            }
        }
    }

    #[inline(always)]
    unsafe fn tile_rc<const R: usize, const C: usize>(
        x: *const f32,
        ldx: usize,
        w: *const f32,
        ldw: usize,
        len: usize,
    ) -> Sums {
        // SAFETY: all indices are < len within rows the caller guarantees.
        unsafe {
            let mut acc = [[vdupq_n_f32(0.0); C]; R];
            let l4 = len & !3;
            let mut i = 0;
            while i < l4 {
                let mut xv = [vdupq_n_f32(0.0); C];
                for (ci, v) in xv.iter_mut().enumerate() {
                    *v = vld1q_f32(x.add(ci * ldx + i));
                }
                for (ri, acc_r) in acc.iter_mut().enumerate() {
                    let wv = vld1q_f32(w.add(ri * ldw + i));
                    for (a, xc) in acc_r.iter_mut().zip(xv.iter()) {
                        *a = vfmaq_f32(*a, wv, *xc);
                    }
                }
                i += 4;
            }
            let mut sums = [[0f32; MAX_C]; MAX_R];
            for ri in 0..R {
                for ci in 0..C {
                    let mut s = vaddvq_f32(acc[ri][ci]);
                    for j in l4..len {
                        s += *x.add(ci * ldx + j) * *w.add(ri * ldw + j);
                    }
                    sums[ri][ci] = s;
                }
            }
            sums
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const SHAPES: &[(usize, usize, usize)] = &[
        (1, 1, 1),
        (1, 7, 3),
        (1, 8, 8),
        (1, 33, 17),
        (2, 64, 5),
        (3, 129, 67),
        (4, 16, 9),
        (5, 256, 130),
        (7, 31, 70),
        (16, 2048, 64),
        (32, 100, 33),
        (64, 72, 20),
        (17, 300, 13),
        (24, 513, 31),
        (70, 40, 25),
        (130, 260, 7),
        // Chunks of 256 rows: a parallel transpose and a 44-row tail; a
        // 1-row tail and tasks that end in short tiles.
        (300, 900, 20),
        (257, 33, 140),
        (1, 2048, 4097),
        (3, 0, 5),
    ];

    type MatmulFn<W> = fn(&[f32], usize, usize, &[W], usize, Option<&[f32]>, &mut [f32]);

    fn random_vec(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn check<W: WeightElem>(f: MatmulFn<W>, from_f32: fn(f32) -> W) {
        let mut rng = StdRng::seed_from_u64(7);
        for &(m, k, n) in SHAPES {
            for with_bias in [false, true] {
                let x = random_vec(&mut rng, m * k);
                let w: Vec<W> = random_vec(&mut rng, n * k).into_iter().map(from_f32).collect();
                let bias = with_bias.then(|| random_vec(&mut rng, n));
                let mut y = vec![f32::NAN; m * n];
                let mut want = vec![f32::NAN; m * n];
                f(&x, m, k, &w, n, bias.as_deref(), &mut y);
                reference_matmul_xwt(&x, m, k, &w, n, bias.as_deref(), &mut want);
                for mi in 0..m {
                    for ni in 0..n {
                        let mag: f32 = (0..k).map(|ki| (x[mi * k + ki] * w[ni * k + ki].to_f32()).abs()).sum();
                        let (got, exp) = (y[mi * n + ni], want[mi * n + ni]);
                        assert!(
                            (got - exp).abs() <= 1e-5 * mag + 1e-6,
                            "{:?} m={m} k={k} n={n} bias={with_bias} at [{mi},{ni}]: {got} vs {exp}",
                            W::DTYPE
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn f32_matches_reference() {
        check::<f32>(matmul_xwt, |v| v);
    }

    #[test]
    fn f16_matches_reference() {
        check::<f16>(matmul_xwt, f16::from_f32);
    }

    #[test]
    fn bf16_matches_reference() {
        check::<bf16>(matmul_xwt, bf16::from_f32);
    }

    #[test]
    fn scalar_fallback_matches_reference() {
        check::<f32>(matmul_xwt_scalar, |v| v);
        check::<f16>(matmul_xwt_scalar, f16::from_f32);
        check::<bf16>(matmul_xwt_scalar, bf16::from_f32);
    }

    #[test]
    fn exact_on_small_integers() {
        // Integer-valued inputs sum exactly in any order.
        let (m, k, n) = (3, 19, 10);
        let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32((i % 5) as f32 - 2.0)).collect();
        let bias: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut y = vec![0.0; m * n];
        let mut want = vec![0.0; m * n];
        matmul_xwt(&x, m, k, &w, n, Some(&bias), &mut y);
        reference_matmul_xwt(&x, m, k, &w, n, Some(&bias), &mut want);
        assert_eq!(y, want);
    }

    #[test]
    #[should_panic(expected = "w.len() != n * k")]
    fn inconsistent_lengths_panic() {
        let mut y = vec![0.0; 2];
        matmul_xwt(&[0.0; 4], 1, 4, &[0.0f32; 7], 2, None, &mut y);
    }
}
