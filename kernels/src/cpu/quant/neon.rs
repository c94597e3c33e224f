//! NEON kernels of the quantized matmuls (NEON is baseline on aarch64).

use std::arch::aarch64::*;

use super::{Operands, PackedOperands, QuantBlock};

/// i32 lanes summing to the dot product of an activation block with the
/// 32 codes `(w0, w1)`. i8 x i8 fits i16; pairwise widening adds into
/// i32 lanes (sdot would be one instruction, but is not in stable Rust
/// yet).
#[inline(always)]
unsafe fn block_dot(x: &[i8; 32], (w0, w1): (int8x16_t, int8x16_t)) -> int32x4_t {
    // SAFETY: x is 32 readable bytes; NEON per the caller.
    unsafe {
        let (x0, x1) = (vld1q_s8(x.as_ptr()), vld1q_s8(x.as_ptr().add(16)));
        let mut s = vpaddlq_s16(vmull_s8(vget_low_s8(x0), vget_low_s8(w0)));
        s = vpadalq_s16(s, vmull_high_s8(x0, w0));
        s = vpadalq_s16(s, vmull_s8(vget_low_s8(x1), vget_low_s8(w1)));
        vpadalq_s16(s, vmull_high_s8(x1, w1))
    }
}

/// y[.., rows of groups g0..g1] for packed Q8_0 weights, one weight row
/// at a time.
///
/// # Safety
/// NEON must be available; shapes consistent; this task owns these
/// columns of y.
#[target_feature(enable = "neon")]
pub(super) unsafe fn packed_groups(ops: &PackedOperands<'_>, g0: usize, g1: usize) {
    let (n, kb) = (ops.w.n, ops.w.kb);
    for g in g0..g1 {
        for r in 0..4.min(n - 4 * g) {
            for i in 0..ops.m {
                // SAFETY: indices < kb within group g and row i < m.
                unsafe {
                    let mut acc = vdupq_n_f32(0.0);
                    for b in 0..kb {
                        let codes = &ops.w.codes[g * kb + b].0[r];
                        let w = (vld1q_s8(codes.as_ptr()), vld1q_s8(codes.as_ptr().add(16)));
                        let s = block_dot(&ops.xq[i * kb + b].qs, w);
                        let d = ops.xd[i * kb + b] * ops.w.scales[g * kb + b][r].to_f32();
                        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), d);
                    }
                    *ops.y.0.add(i * n + 4 * g + r) = vaddvq_f32(acc);
                }
            }
        }
    }
}

/// y[.., n0..n1], one weight row at a time.
///
/// # Safety
/// NEON must be available; shapes consistent; this task owns columns
/// n0..n1 of y.
#[target_feature(enable = "neon")]
pub(super) unsafe fn rows<B: QuantBlock>(ops: &Operands<'_, B>, n0: usize, n1: usize) {
    let kb = ops.kb;
    for j in n0..n1 {
        for i in 0..ops.m {
            // SAFETY: indices < kb within row j < n and row i < m.
            unsafe {
                let mut acc = vdupq_n_f32(0.0);
                for b in 0..kb {
                    let blk = &ops.w[j * kb + b];
                    let s = block_dot(&ops.xq[i * kb + b].qs, blk.codes_neon());
                    acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), ops.xd[i * kb + b] * blk.scale());
                }
                *ops.y.0.add(i * ops.n + j) = vaddvq_f32(acc);
            }
        }
    }
}
