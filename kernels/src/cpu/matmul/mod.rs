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
//!   software-prefetches the 4-row span 16 KiB ahead (the hardware
//!   prefetcher alone falls behind four short streams).
//! - Larger m is compute bound. Each tile of weight rows is widened to f32 one
//!   K block (256) at a time into an L1 buffer and reused by every x row, so
//!   conversion costs 1/m per weight rather than 1/3 (vcvtph2ps's throughput
//!   would cap f16 otherwise), and W comes from DRAM once per chunk of x rows (64,
//!   or 256 for the broadcast kernel). For m < 16 the x rows pass over it in
//!   4x3 dot-product tiles (12 accumulators of 8 lanes, summed horizontally
//!   per K block). From m = 16, in BLIS's shape: x is transposed once per
//!   call into groups of 16 rows, and 6 weight rows x 16 x rows make 12
//!   accumulators fed by 2 vector loads and 6 broadcast weights per k, with
//!   no horizontal sums. Batched decode overlaps the widening of the next
//!   K block with the FMAs; prefill chunks run K block by K block so that
//!   each group's x stays in L1 (see `avx2_broadcast::broadcast_panel`).
//! - Backends: AVX2+FMA+F16C on x86-64 (detected once, [`crate::cpu::isa`]), NEON on
//!   aarch64, and a portable chunked scalar loop that LLVM can auto-vectorise.
//!   The NEON and scalar paths use plain register tiles (8x1 for m = 1, 4x3
//!   otherwise) without the widening buffer or prefetch.
//!
//! Accumulation is in f32 with 8 (AVX2, scalar) or 4 (NEON) lanes per chain,
//! so results differ from a sequential sum only by rounding order.
//!
//! Files: this one has the API, the task split and the portable tile;
//! `avx2` the tiles for m < 16 and the GEMV, `avx2_broadcast` the kernel
//! for m >= 16, `neon` the aarch64 tiles.

#[cfg(target_arch = "x86_64")]
use half::{bf16, f16};
use rayon::prelude::*;

pub use super::elem::{WeightDType, WeightElem};
use super::isa::{self, Simd};
use super::parallel::{OutPtr, fill_with_bias};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_broadcast;
#[cfg(target_arch = "aarch64")]
mod neon;

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
    matmul_with_backend(isa::simd(), x, m, k, w, n, bias, y);
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
    matmul_with_backend(Simd::Scalar, x, m, k, w, n, bias, y);
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
    backend: Simd,
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
        fill_with_bias(y, n, bias);
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
/// kernel (`avx2_broadcast::broadcast_panel`); below, its 16-row groups are
/// partly padding and the dot-product tiles do better.
const BROADCAST_MIN_M: usize = 16;
/// Weight rows per broadcast tile.
const BROADCAST_ROWS: usize = 6;
/// x rows per call of the broadcast kernel (16 groups of 16): the best of
/// 128, 192, 256 and the whole prompt on TinyLlama's shapes.
const BROADCAST_CHUNK_ROWS: usize = 256;
/// x rows per call of the dot-product tiles, which pass every x row over
/// each widened weight tile: 64 rows (at most 256 KiB at k = 1,024) stay in
/// L2 where a long prompt would stream from memory for every tile.
const DOT_CHUNK_ROWS: usize = 64;

fn uses_broadcast(backend: Simd, m: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    let has_kernel = backend == Simd::Avx2;
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
        if isa::has_avx2_fma() {
            while r0 + 8 <= rows {
                // SAFETY: AVX is available; src holds 8 rows of k from r0 on
                // and dst[r0..] holds k - 1 strides of g plus 8 (r0 <= g - 8).
                unsafe { avx2_broadcast::transpose8(&src[r0 * k..(r0 + 8) * k], k, &mut dst[r0..], g) };
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
fn compute_rows<W: WeightElem>(backend: Simd, p: &Problem<'_, W>, n0: usize, n1: usize) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa::simd` only picks Avx2 after detecting
        // AVX2, FMA and F16C; DTYPE names W's concrete type (the trait is
        // sealed), so each cast is an identity; shapes were checked by the
        // caller and this task alone owns columns n0..n1.
        Simd::Avx2 => unsafe {
            match W::DTYPE {
                WeightDType::F32 => avx2::panel::<f32>(p, cast_weights(p.w), n0, n1),
                WeightDType::F16 => avx2::panel::<f16>(p, cast_weights(p.w), n0, n1),
                WeightDType::BF16 => avx2::panel::<bf16>(p, cast_weights(p.w), n0, n1),
            }
        },
        #[cfg(target_arch = "aarch64")]
        Simd::Neon => drive(p, n0, n1, |x, ldx, w, r, c| neon::tile(x, ldx, w, r, c, p.k)),
        Simd::Scalar => drive(p, n0, n1, |x, ldx, w, r, c| scalar_tile(x, ldx, w, r, c, p.k)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
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
