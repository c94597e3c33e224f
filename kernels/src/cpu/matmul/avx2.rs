//! AVX2 + FMA + F16C tiles of the dense matmul for m < 16 (m = 1 in
//! [`gemv`]), and the K-block widening the broadcast kernel
//! ([`super::avx2_broadcast`]) shares. Callers must have checked those
//! features.

use super::Problem;
use crate::cpu::load_avx2::Load8;
use crate::cpu::prefetch_within;
use std::arch::x86_64::*;

/// K elements per block: the 4 widened weight rows (4 KiB) and
/// x[.., block] for 3 x rows (3 KiB) stay in L1.
pub(super) const KB: usize = 256;

/// How many K blocks ahead to prefetch each weight row (4 x 512 B for
/// f16): the best of 1, 2, 4 and 8; 1 or 2 leave small m waiting on DRAM.
pub(super) const PF_BLOCKS: usize = 4;

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
        unsafe { super::avx2_broadcast::broadcast_panel(p, w, n0, n1) };
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

/// How far ahead of use [`gemv`] prefetches its weights, in bytes: the
/// best of 2-32 KiB, the distance at which the GEMV reaches the machine's
/// read bandwidth.
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
pub(super) unsafe fn widen_row<T: Load8>(
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
pub(super) fn prefetch_ahead<T>(w: &[T], k: usize, row: usize, k0: usize, blocks: usize, tile_rows: usize, len: usize) {
    let pf = ahead_of(k, row, k0, blocks, tile_rows);
    let w_end = w.as_ptr_range().end.cast::<u8>();
    prefetch_within(w.as_ptr().wrapping_add(pf).cast(), len * size_of::<T>(), w_end);
}

/// Index of the weights that row `row` (rows of k) needs `blocks` K
/// blocks after `k0`, or past its end the same row of the next tile,
/// `tile_rows` on: linear in `row`, so a tile's rows share one stride.
pub(super) fn ahead_of(k: usize, row: usize, k0: usize, blocks: usize, tile_rows: usize) -> usize {
    let ahead = k0 + blocks * KB;
    if ahead < k { row * k + ahead } else { (row + tile_rows) * k + ahead - k }
}

/// Widens `src` into `dst` (same length).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn widen<T: Load8>(src: &[T], dst: &mut [f32]) {
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
