//! Fused element-wise steps of a decoder layer on the CPU, each one pass over
//! its data instead of the several (and the fresh buffers) that a chain of
//! tensor ops takes:
//! * [`gated_mul`]: SwiGLU, `silu(gate) * up`, or GeGLU from the fused
//!   gate/up output;
//! * [`rope_in_place`]: rotary embedding of the q and k heads inside the
//!   fused qkv output, with Qwen3's per-head RMSNorm folded in;
//! * [`add_in_place`]: the residual add, into a buffer that is dead after it;
//! * [`rms_norm`]: RMSNorm of each row, into a buffer of the caller's.
//!
//! The slice functions are the kernels; the `*_op` functions apply them to
//! candle tensors (f32 on the CPU, what activations are there), in place or
//! into a buffer of the caller's. Large inputs are split by rows over
//! rayon's pool.

use candle_core::Tensor;

use super::buffers::{read_f32, write_f32};
use super::exp_poly;
use rayon::prelude::*;

use crate::{KernelError, Result};

/// Below this many elements a call runs on the calling thread: waking the
/// pool costs more than the work.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

fn rows_per_task(row_len: usize) -> usize {
    (PARALLEL_MIN_ELEMS / 4 / row_len.max(1)).max(1)
}

/// The activation of a gated MLP's gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gate {
    /// `silu(g) = g * sigmoid(g)` (SwiGLU).
    Silu,
    /// GELU's tanh approximation (GeGLU, `gelu_pytorch_tanh`):
    /// `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`.
    GeluTanh,
    /// gpt-oss's: `(clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g)`
    /// with `g = min(gate, limit)`.
    ClampedSwiglu { limit: f32 },
}

/// `out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]`, with
/// `gate_up: [rows, 2 * inter]` and `out: [rows, inter]`.
pub fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) -> Result<()> {
    gated_mul(gate_up, inter, Gate::Silu, out)
}

/// `out[t, i] = gate(gate_up[t, i]) * gate_up[t, inter + i]`, with
/// `gate_up: [rows, 2 * inter]` and `out: [rows, inter]`.
pub fn gated_mul(gate_up: &[f32], inter: usize, gate: Gate, out: &mut [f32]) -> Result<()> {
    if inter == 0 || !gate_up.len().is_multiple_of(2 * inter) || out.len() * 2 != gate_up.len() {
        return Err(KernelError::Invalid(format!(
            "gated_mul: gate_up has {} elements, out {}, inter {inter}",
            gate_up.len(),
            out.len()
        )));
    }
    let row = |(src, dst): (&[f32], &mut [f32])| {
        let (g, up) = src.split_at(inter);
        gated_mul_row(gate, g, up, dst);
    };
    if gate_up.len() < PARALLEL_MIN_ELEMS {
        gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)).for_each(row);
    } else {
        let per = rows_per_task(2 * inter);
        gate_up.par_chunks(2 * inter * per).zip(out.par_chunks_mut(inter * per)).for_each(|(src, dst)| {
            src.chunks_exact(2 * inter).zip(dst.chunks_exact_mut(inter)).for_each(row);
        });
    }
    Ok(())
}

/// `out = act(gate) * up`: 8 lanes wide with AVX2 where the CPU has it
/// (the exp is [`exp_poly`], which vectorises, not libm's call per value).
/// GELU's tanh goes through `0.5 (1 + tanh(u)) = sigmoid(2u)`, so both
/// gates are `g * sigmoid(x)` and share the loop.
fn gated_mul_row(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[inline(always)]
    fn body<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let x = if GELU { 2.0 * (SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g)) } else { g };
            *o = g / (1.0 + exp_poly(-x)) * u;
        }
    }
    #[inline(always)]
    fn clamped(limit: f32, gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let g = g.min(limit);
            *o = (u.clamp(-limit, limit) + 1.0) * (g / (1.0 + exp_poly(-1.702 * g)));
        }
    }
    #[inline(always)]
    fn run(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
        match act {
            Gate::Silu => body::<false>(gate, up, out),
            Gate::GeluTanh => body::<true>(gate, up, out),
            Gate::ClampedSwiglu { limit } => clamped(limit, gate, up, out),
        }
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa::has_avx2_fma() {
        /// # Safety
        /// AVX2 and FMA must be available.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
            run(act, gate, up, out)
        }
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { avx2(act, gate, up, out) };
    }
    run(act, gate, up, out)
}

/// `dst += src`, element-wise.
pub fn add_in_place(dst: &mut [f32], src: &[f32]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(KernelError::Invalid(format!("add_in_place: {} vs {} elements", dst.len(), src.len())));
    }
    let add = |(d, s): (&mut [f32], &[f32])| d.iter_mut().zip(s).for_each(|(d, s)| *d += s);
    if dst.len() < PARALLEL_MIN_ELEMS {
        add((dst, src));
    } else {
        dst.par_chunks_mut(PARALLEL_MIN_ELEMS / 4).zip(src.par_chunks(PARALLEL_MIN_ELEMS / 4)).for_each(add);
    }
    Ok(())
}

/// `out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight` for each row `t`
/// of `x: [rows, weight.len()]`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let n = weight.len();
    if n == 0 || !x.len().is_multiple_of(n) || out.len() != x.len() {
        return Err(KernelError::Invalid(format!(
            "rms_norm: x has {} elements, out {}, weight {n}",
            x.len(),
            out.len()
        )));
    }
    let row = |(src, dst): (&[f32], &mut [f32])| normalise_row(src, sum_of_squares(src), weight, eps, dst);
    if x.len() < PARALLEL_MIN_ELEMS {
        x.chunks_exact(n).zip(out.chunks_exact_mut(n)).for_each(row);
    } else {
        let per = rows_per_task(n);
        x.par_chunks(n * per).zip(out.par_chunks_mut(n * per)).for_each(|(src, dst)| {
            src.chunks_exact(n).zip(dst.chunks_exact_mut(n)).for_each(row);
        });
    }
    Ok(())
}

/// `dst = src / sqrt(sum_sq / n + eps) * weight`.
#[inline(always)]
fn normalise_row(src: &[f32], sum_sq: f32, weight: &[f32], eps: f32, dst: &mut [f32]) {
    let inv = 1.0 / (sum_sq / weight.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in dst.iter_mut().zip(src).zip(weight) {
        *o = v * inv * w;
    }
}

/// `sum(x^2)` in 16 independent lanes, which the compiler vectorises (one
/// running sum is a chain of dependent adds: ~2 us for a 2048-wide row).
#[inline(always)]
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The residual add and the next RMSNorm in one pass over each row:
/// `hidden += delta`, then `out = rms_norm(hidden) * weight`, with `hidden`,
/// `delta` and `out` all `[rows, weight.len()]`.
pub fn add_rms_norm(hidden: &mut [f32], delta: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let n = weight.len();
    if n == 0 || !hidden.len().is_multiple_of(n) || delta.len() != hidden.len() || out.len() != hidden.len() {
        return Err(KernelError::Invalid(format!(
            "add_rms_norm: hidden has {} elements, delta {}, out {}, weight {n}",
            hidden.len(),
            delta.len(),
            out.len()
        )));
    }
    let row = |((h, d), o): ((&mut [f32], &[f32]), &mut [f32])| {
        h.iter_mut().zip(d).for_each(|(h, d)| *h += d);
        normalise_row(h, sum_of_squares(h), weight, eps, o);
    };
    if hidden.len() < PARALLEL_MIN_ELEMS {
        hidden.chunks_exact_mut(n).zip(delta.chunks_exact(n)).zip(out.chunks_exact_mut(n)).for_each(row);
    } else {
        let per = rows_per_task(n);
        hidden.par_chunks_mut(n * per).zip(delta.par_chunks(n * per)).zip(out.par_chunks_mut(n * per)).for_each(
            |((h, d), o)| h.chunks_exact_mut(n).zip(d.chunks_exact(n)).zip(o.chunks_exact_mut(n)).for_each(row),
        );
    }
    Ok(())
}

/// Qwen3's RMSNorm of each q and k head before the rotation.
#[derive(Clone, Copy, Debug)]
pub struct HeadNorm<'a> {
    /// Heads `0..q_heads` of a row are query heads (weight `q_weight`), the
    /// rest of the rotated heads key heads (`k_weight`).
    pub q_heads: usize,
    pub q_weight: &'a [f32], // [head_dim]
    pub k_weight: &'a [f32], // [head_dim]
    pub eps: f32,
}

/// What [`rope_in_place`] rotates, and by which angles.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    pub head_dim: usize,
    /// The leading dims of each head that rotate (even, at most
    /// `head_dim`; partial rotary, as GLM's); the rest pass through.
    pub rotary_dim: usize,
    /// Heads rotated at the start of each row (q heads then k heads in a
    /// fused qkv row); whatever follows them (v) is left alone.
    pub heads: usize,
    /// Elements per row.
    pub row_len: usize,
    /// Position of each row.
    pub positions: &'a [u32],
    /// `[max_positions, rotary_dim / 2]` tables.
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub head_norm: Option<HeadNorm<'a>>,
}

impl Rope<'_> {
    fn check(&self, len: usize) -> Result<()> {
        let half = self.rotary_dim / 2;
        let bad = |what: String| Err(KernelError::Invalid(format!("rope_in_place: {what}")));
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return bad(format!("rotary_dim {} must be even, > 0 and <= head_dim {}", self.rotary_dim, self.head_dim));
        }
        if self.heads * self.head_dim > self.row_len || len != self.positions.len() * self.row_len {
            return bad(format!(
                "{} rows of {} elements do not hold {} heads of {} in {len} elements",
                self.positions.len(),
                self.row_len,
                self.heads,
                self.head_dim
            ));
        }
        if self.cos.len() != self.sin.len() || !self.cos.len().is_multiple_of(half) {
            return bad("cos and sin tables must be [max_positions, rotary_dim / 2]".into());
        }
        let max_pos = self.cos.len() / half;
        if let Some(&p) = self.positions.iter().find(|&&p| p as usize >= max_pos) {
            return bad(format!("position {p} is beyond the {max_pos} positions of the tables"));
        }
        if let Some(n) = self.head_norm
            && (n.q_heads > self.heads || n.q_weight.len() != self.head_dim || n.k_weight.len() != self.head_dim)
        {
            return bad("head norm weights must be [head_dim] and q_heads <= heads".into());
        }
        Ok(())
    }

    /// One row: normalise (optionally) and rotate each head.
    fn row(&self, x: &mut [f32], pos: u32) {
        let (hd, half) = (self.head_dim, self.rotary_dim / 2);
        let cos = &self.cos[pos as usize * half..][..half];
        let sin = &self.sin[pos as usize * half..][..half];
        for (h, head) in x[..self.heads * hd].chunks_exact_mut(hd).enumerate() {
            if let Some(n) = self.head_norm {
                let w = if h < n.q_heads { n.q_weight } else { n.k_weight };
                let ms = head.iter().map(|v| v * v).sum::<f32>() / hd as f32;
                let inv = 1.0 / (ms + n.eps).sqrt();
                head.iter_mut().zip(w).for_each(|(v, w)| *v *= inv * w);
            }
            // HF's rotate_half within the rotated dims:
            // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
            let (x1, x2) = head[..2 * half].split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// Rotates (and optionally head-normalises) the first `rope.heads` heads of
/// every row of `x` in place.
pub fn rope_in_place(x: &mut [f32], rope: &Rope<'_>) -> Result<()> {
    rope.check(x.len())?;
    let n = rope.row_len;
    if x.len() < PARALLEL_MIN_ELEMS {
        x.chunks_exact_mut(n).zip(rope.positions).for_each(|(r, &p)| rope.row(r, p));
    } else {
        let per = rows_per_task(n);
        x.par_chunks_mut(n * per).zip(rope.positions.par_chunks(per)).for_each(|(rows, pos)| {
            rows.chunks_exact_mut(n).zip(pos).for_each(|(r, &p)| rope.row(r, p));
        });
    }
    Ok(())
}

/// `dst += src` for same-shaped f32 CPU tensors (or views) that do not
/// share storage; every view of `dst`'s storage sees the change.
pub fn add_in_place_op(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() {
        return Err(KernelError::Invalid(format!("add_in_place: {:?} vs {:?}", dst.shape(), src.shape())));
    }
    Ok(read_f32(&src.contiguous()?, |s| write_f32(dst, &|d| add_in_place(d, s).map_err(candle_core::Error::wrap)))?)
}

/// [`rope_in_place`] on a contiguous `[rows, row_len]` f32 CPU tensor (or
/// view); every view of its storage sees the change.
pub fn rope_in_place_op(x: &Tensor, rope: Rope<'_>) -> Result<()> {
    let (rows, row_len) = x.dims2()?;
    if rows != rope.positions.len() || row_len != rope.row_len {
        return Err(KernelError::Invalid(format!(
            "rope_in_place: tensor [{rows}, {row_len}] vs {} positions of {}",
            rope.positions.len(),
            rope.row_len
        )));
    }
    Ok(write_f32(x, &|d| rope_in_place(d, &rope).map_err(candle_core::Error::wrap))?)
}

/// [`rms_norm`] of `x: [rows, dim]` into `out` (same shape), both f32 CPU
/// tensors not sharing storage.
pub fn rms_norm_into_op(x: &Tensor, weight: &[f32], eps: f32, out: &Tensor) -> Result<()> {
    if x.shape() != out.shape() {
        return Err(KernelError::Invalid(format!("rms_norm: {:?} into {:?}", x.shape(), out.shape())));
    }
    Ok(read_f32(x, |x| write_f32(out, &|o| rms_norm(x, weight, eps, o).map_err(candle_core::Error::wrap)))?)
}

/// [`add_rms_norm`] on f32 CPU tensors of one shape, none sharing storage.
pub fn add_rms_norm_op(hidden: &Tensor, delta: &Tensor, weight: &[f32], eps: f32, out: &Tensor) -> Result<()> {
    if hidden.shape() != delta.shape() || hidden.shape() != out.shape() {
        return Err(KernelError::Invalid(format!(
            "add_rms_norm: {:?} + {:?} into {:?}",
            hidden.shape(),
            delta.shape(),
            out.shape()
        )));
    }
    Ok(read_f32(&delta.contiguous()?, |d| {
        write_f32(hidden, &|h| {
            // The inner closure is `Fn`: it borrows `hidden` through a cell.
            let h = std::cell::RefCell::new(h);
            write_f32(out, &|o| add_rms_norm(&mut h.borrow_mut(), d, weight, eps, o).map_err(candle_core::Error::wrap))
        })
    })?)
}

/// [`silu_mul`] of `gate_up: [rows, 2 * inter]` into `out: [rows, inter]`,
/// both f32 CPU tensors not sharing storage.
pub fn silu_mul_into_op(gate_up: &Tensor, out: &Tensor) -> Result<()> {
    gated_mul_into_op(gate_up, Gate::Silu, out)
}

/// [`gated_mul`] of `gate_up: [rows, 2 * inter]` into `out: [rows, inter]`,
/// f32 CPU tensors not sharing storage.
pub fn gated_mul_into_op(gate_up: &Tensor, gate: Gate, out: &Tensor) -> Result<()> {
    let (rows, width) = gate_up.dims2()?;
    let (out_rows, inter) = out.dims2()?;
    if rows != out_rows || width != 2 * inter {
        return Err(KernelError::Invalid(format!("gated_mul: [{rows}, {width}] into [{out_rows}, {inter}]")));
    }
    Ok(read_f32(gate_up, |g| write_f32(out, &|o| gated_mul(g, inter, gate, o).map_err(candle_core::Error::wrap)))?)
}
