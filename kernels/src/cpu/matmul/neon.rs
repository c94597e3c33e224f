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
