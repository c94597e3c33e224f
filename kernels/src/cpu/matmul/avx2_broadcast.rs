//! The AVX2 + FMA + F16C broadcast kernel of the dense matmul, for
//! 16 <= m <= 256 (batched decode and prompt chunks), in BLIS's shape; and
//! the transpose of x it reads. Callers must have checked those features.

use super::avx2::{KB, PF_BLOCKS, ahead_of, prefetch_ahead, widen, widen_row};
use super::{BROADCAST_CHUNK_ROWS, BROADCAST_ROWS, Problem, WeightDType, group_width};
use crate::cpu::load_avx2::Load8;
use half::f16;
use std::arch::x86_64::*;

/// Most x row groups of a call (`BROADCAST_CHUNK_ROWS` / 16).
const MAX_GROUPS: usize = BROADCAST_CHUNK_ROWS / 16;

/// Calls of at most this many groups (m <= 64, batched decode) run tile
/// by tile; larger ones K block by K block (see [`broadcast_panel`]).
const TILE_MAJOR_GROUPS: usize = 4;

/// A broadcast tile's partial sums: 6 weight rows x 16 x rows.
type TileSums = [[f32; 16]; BROADCAST_ROWS];

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
/// tile) across K blocks and reach y at the end. It comes closer to the
/// FMA peak than the 4 x 3 dot-product tile, which also pays 12
/// horizontal sums per K block.
///
/// Two loop orders, by the number of groups:
/// - few (batched decode): tile by tile, K blocks within, each block's
///   rows widened into L1 while the previous block computes. Each weight
///   row is read front to back as the hardware prefetcher likes; the
///   other order, which jumps between the task's rows every K block,
///   was slower.
/// - many (prefill): K block by K block, all the task's rows widened
///   once into an L2 buffer, then each group's x block stays in L1 while
///   the tiles stream past it. Widening then costs 1/m per weight, and x
///   comes from L2 once per task and K block, not once per tile.
///
/// # Safety
/// As [`super::avx2::panel`], with `p.xt` built by `by_row_groups` for p.x.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn broadcast_panel<T: Load8>(p: &Problem<'_, impl Sized>, w: &[T], n0: usize, n1: usize) {
    const R: usize = BROADCAST_ROWS;
    let (m, k, n) = (p.m, p.k, p.n);
    // The groups: (first row, width, offset in xt).
    let mut groups = [(0, 0, 0); MAX_GROUPS];
    let (mut rows, mut count, mut at) = (0, 0, 0);
    while rows < m {
        let g = group_width(m, rows);
        assert!(count < MAX_GROUPS, "broadcast_panel takes at most {} rows", BROADCAST_CHUNK_ROWS);
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
        // loads, conversions and stores with the FMAs, rather than in a
        // loop of its own, which other weight types and short tiles keep.
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
/// each block did. The main
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
            let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5, mut a6, mut a7, mut a8, mut a9, mut a10, mut a11] = a;
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
