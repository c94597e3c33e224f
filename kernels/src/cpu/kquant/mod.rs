//! GGML's k-quants Q4_K and Q6_K (super-blocks of 256 weights), kept in
//! their blocks, and the matmul that dots them with activations quantized
//! to Q8_K, as llama.cpp does for k-quants.
//!
//! * Q4_K (144 bytes, 4.5 bits per weight): f16 `d` and `dmin`, 8
//!   sub-blocks of 32 with a 6-bit scale and a 6-bit min each (packed in 12
//!   bytes), and 4-bit codes: `w = d * sc_j * q - dmin * m_j`. Bytes
//!   32c..32c+32 of `qs` hold weights 64c..64c+32 in their low nibbles and
//!   64c+32..64c+64 in their high nibbles.
//! * Q6_K (210 bytes, 6.56 bits per weight): 6-bit codes split into the low
//!   4 bits (`ql`) and the high 2 (`qh`), an i8 scale per 16 weights and an
//!   f16 `d`: `w = d * sc_g * (q - 32)`.
//! * Q8_K: 256 activations as i8 with an f32 scale and the sums of each 16
//!   codes, so a weight block's offset term (`dmin * m`, or Q6_K's `32`)
//!   costs one multiply per 16 weights instead of one per weight.
//!
//! Both weight formats reduce to one form: unsigned codes `q` (0..15 or
//! 0..63), a scale and an offset per 16 weights, and two f32 factors.
//! Per block, `dot = d_x * (d * sum_g sc_g * sum(q * x) - dm * sum_g mn_g *
//! bsum_g)`, with all the inner sums exact in i32. The SIMD paths (AVX2
//! `vpmaddubsw`/`vpmaddwd`, or AVX-512 VNNI `vpdpbusd`, in [`x86`]) unpack
//! a block's codes into registers once and dot them with every activation
//! row; the scalar path is the reference for both. `matmul_kquant` is
//! `y = x @ W^T` as [`super::quant::matmul_quant`].

use half::f16;

#[cfg(target_arch = "x86_64")]
use super::isa::{self, Simd};
use super::quant::QuantError;
use super::{OutPtr, for_each_span};

mod panel;
#[cfg(target_arch = "x86_64")]
mod panel_x86;
mod quantize;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use panel::{
    KPanel, KPanels, PANEL, PanelBackend, Q4KPanel, Q6KPanel, best_panel_backend, matmul_kpanels, matmul_kpanels_with,
    panel_backends,
};

/// Weights per k-quant super-block.
pub const QK_K: usize = 256;
/// Weights per scale group (Q6_K's scales; Q8_K's block sums).
const GROUP: usize = 16;
const GROUPS: usize = QK_K / GROUP;

/// GGML's `block_q4_K`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// GGML's `block_q6_K`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; GROUPS],
    pub d: f16,
}

/// GGML's `block_q8_K`: the activations' side.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; GROUPS],
}

impl BlockQ8K {
    const ZERO: Self = Self { d: 0.0, qs: [0; QK_K], bsums: [0; GROUPS] };

    /// Symmetric i8 codes in [-127, 127] (never -128, so the AVX2 path's
    /// signed-by-unsigned byte products cannot overflow), exactly as
    /// llama.cpp's `quantize_row_q8_K_ref` writes them (what its x86 build
    /// runs): the value of largest magnitude maps to -127, the others round
    /// half to even, and the scale is the reciprocal of that multiplier. Its
    /// k-quant matmuls then see the activations llama.cpp's do (NaN, which
    /// llama.cpp leaves undefined, becomes 0).
    pub fn quantize(src: &[f32; QK_K]) -> Self {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in src {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        if amax == 0.0 {
            return Self::ZERO;
        }
        let iscale = -127.0 / max;
        let mut out = Self { d: 1.0 / iscale, ..Self::ZERO };
        for (q, &v) in out.qs.iter_mut().zip(src) {
            *q = nearest_even(iscale * v).clamp(-127, 127) as i8;
        }
        for (g, sum) in out.bsums.iter_mut().enumerate() {
            *sum = out.qs[g * GROUP..(g + 1) * GROUP].iter().map(|&q| q as i16).sum();
        }
        out
    }
}

/// A block's codes and per-group factors, in the common form above.
#[derive(Clone, Debug, PartialEq)]
pub struct Unpacked {
    /// Unsigned codes in weight order.
    pub q: [u8; QK_K],
    /// Scale of each group of 16.
    pub sc: [i16; GROUPS],
    /// Offset of each group of 16, in units of `dm`.
    pub mn: [i16; GROUPS],
    pub d: f32,
    pub dm: f32,
}

impl Unpacked {
    /// The 256 weights.
    pub fn dequantize(&self, out: &mut [f32; QK_K]) {
        for (l, o) in out.iter_mut().enumerate() {
            let g = l / GROUP;
            *o = self.d * self.sc[g] as f32 * self.q[l] as f32 - self.dm * self.mn[g] as f32;
        }
    }

    /// Dot product with an activation block (the portable path).
    fn dot(&self, x: &BlockQ8K) -> f32 {
        let mut isum = 0i32;
        let mut msum = 0i32;
        for g in 0..GROUPS {
            let r = g * GROUP..(g + 1) * GROUP;
            let s: i32 = self.q[r.clone()].iter().zip(&x.qs[r]).map(|(&q, &v)| q as i32 * v as i32).sum();
            isum += self.sc[g] as i32 * s;
            msum += self.mn[g] as i32 * x.bsums[g] as i32;
        }
        x.d * (self.d * isum as f32 - self.dm * msum as f32)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::BlockQ4K {}
    impl Sealed for super::BlockQ6K {}
}

/// A k-quant weight block. Sealed: the SIMD paths know the layouts.
pub trait KBlock: sealed::Sealed + Copy + Send + Sync + std::fmt::Debug + 'static {
    /// GGML's name of the format.
    const NAME: &'static str;
    const ZERO: Self;
    /// Codes and factors in the common form (the reference decoding).
    fn unpack(&self) -> Unpacked;
    /// Scales, offsets and the two factors alone, for the SIMD paths.
    fn factors(&self) -> ([i16; GROUPS], [i16; GROUPS], f32, f32);
    /// Quantizes 256 weights, minimising the error per group as llama.cpp.
    fn quantize(src: &[f32; QK_K]) -> Self;
    /// The 256 unsigned codes in 8 registers, in weight order.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn codes_x86(&self) -> [std::arch::x86_64::__m256i; 8];
}

impl BlockQ4K {
    /// Scale and min of sub-block j (0..8) from the 12 packed bytes.
    pub fn scale_min(&self, j: usize) -> (u8, u8) {
        let s = &self.scales;
        if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
        }
    }
}

impl KBlock for BlockQ4K {
    const NAME: &'static str = "q4_K";
    const ZERO: Self = Self { d: f16::ZERO, dmin: f16::ZERO, scales: [0; 12], qs: [0; QK_K / 2] };

    fn unpack(&self) -> Unpacked {
        let (sc, mn, d, dm) = self.factors();
        let mut q = [0u8; QK_K];
        for c in 0..4 {
            for l in 0..32 {
                let b = self.qs[32 * c + l];
                q[64 * c + l] = b & 0x0F;
                q[64 * c + 32 + l] = b >> 4;
            }
        }
        Unpacked { q, sc, mn, d, dm }
    }

    fn factors(&self) -> ([i16; GROUPS], [i16; GROUPS], f32, f32) {
        let (mut sc, mut mn) = ([0i16; GROUPS], [0i16; GROUPS]);
        for j in 0..8 {
            let (s, m) = self.scale_min(j);
            (sc[2 * j], sc[2 * j + 1], mn[2 * j], mn[2 * j + 1]) = (s as i16, s as i16, m as i16, m as i16);
        }
        (sc, mn, self.d.to_f32(), self.dmin.to_f32())
    }

    fn quantize(src: &[f32; QK_K]) -> Self {
        quantize::q4_k(src)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_x86(&self) -> [std::arch::x86_64::__m256i; 8] {
        // SAFETY: AVX2 per the caller.
        unsafe { x86::q4k_codes(self) }
    }
}

impl KBlock for BlockQ6K {
    const NAME: &'static str = "q6_K";
    const ZERO: Self = Self { ql: [0; QK_K / 2], qh: [0; QK_K / 4], scales: [0; GROUPS], d: f16::ZERO };

    fn unpack(&self) -> Unpacked {
        let (sc, mn, d, dm) = self.factors();
        let mut q = [0u8; QK_K];
        for h in 0..2 {
            let (ql, qh) = (&self.ql[64 * h..], &self.qh[32 * h..]);
            for l in 0..32 {
                let y = &mut q[128 * h..];
                y[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                y[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        Unpacked { q, sc, mn, d, dm }
    }

    /// `d * sc * (q - 32)`: the offset of a group is `32 * sc` in units of `d`.
    fn factors(&self) -> ([i16; GROUPS], [i16; GROUPS], f32, f32) {
        let sc = self.scales.map(|s| s as i16);
        let d = self.d.to_f32();
        (sc, sc.map(|s| 32 * s), d, d)
    }

    fn quantize(src: &[f32; QK_K]) -> Self {
        quantize::q6_k(src)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_x86(&self) -> [std::arch::x86_64::__m256i; 8] {
        // SAFETY: AVX2 per the caller.
        unsafe { x86::q6k_codes(self) }
    }
}

/// The weights a row of blocks stands for (the naive reference).
pub fn dequantize_row<B: KBlock>(src: &[B], dst: &mut [f32]) {
    for (block, out) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let out: &mut [f32; QK_K] = out.try_into().expect("chunks_exact(QK_K)");
        block.unpack().dequantize(out);
    }
}

/// Quantizes a whole `[rows, k]` matrix (k a multiple of 256).
pub fn quantize_matrix<B: KBlock>(src: &[f32], rows: usize, k: usize) -> Result<Vec<B>, QuantError> {
    use rayon::prelude::*;
    if !k.is_multiple_of(QK_K) {
        return Err(QuantError::Shape(format!("k-quants need k to be a multiple of 256, got {k}")));
    }
    if src.len() != rows * k {
        return Err(QuantError::Shape(format!("{} values for [{rows}, {k}]", src.len())));
    }
    Ok(src.par_chunks(QK_K).map(|c| B::quantize(c.try_into().expect("chunks of QK_K"))).collect())
}

/// `x` rounded half to even, as llama.cpp's `nearest_int` (adding 1.5 *
/// 2^23 leaves the integer in the mantissa), without a libm call; exact
/// for |x| < 2^22, which the callers' |x| <= 127 keeps. NaN gives 0.
fn nearest_even(x: f32) -> i32 {
    if x.is_nan() {
        return 0;
    }
    ((x + 12_582_912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Activation rows quantized to Q8_K (`x.len()` a multiple of 256), in
/// SIMD where the CPU has it ([`BlockQ8K::quantize`] is the reference).
pub fn quantize_activations(x: &[f32]) -> Vec<BlockQ8K> {
    let blocks = x.chunks_exact(QK_K).map(|c| <&[f32; QK_K]>::try_from(c).expect("chunks_exact(QK_K)"));
    #[cfg(target_arch = "x86_64")]
    if isa::simd() == Simd::Avx2 {
        // SAFETY: AVX2 is available (checked above).
        return blocks.map(|c| unsafe { x86::quantize_q8k(c) }).collect();
    }
    blocks.map(BlockQ8K::quantize).collect()
}

/// The code path a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KBackend {
    Scalar,
    /// `vpmaddubsw` + `vpmaddwd`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// `vpdpbusd` on 256-bit vectors (AVX-512 VNNI + VL).
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

/// The best path this CPU has (`TINYVLLM_CPU_ISA` caps VNNI as it does for Q8_0).
pub fn best_backend() -> KBackend {
    #[cfg(target_arch = "x86_64")]
    {
        if isa::vnni() && std::arch::is_x86_feature_detected!("avx512vl") && isa::simd() == Simd::Avx2 {
            return KBackend::Vnni;
        }
        if isa::simd() == Simd::Avx2 {
            return KBackend::Avx2;
        }
    }
    KBackend::Scalar
}

/// Every path this CPU can run, for tests that compare them.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
pub fn available_backends() -> Vec<KBackend> {
    let mut all = vec![KBackend::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if isa::simd() == Simd::Avx2 {
            all.push(KBackend::Avx2);
        }
        if best_backend() == KBackend::Vnni {
            all.push(KBackend::Vnni);
        }
    }
    all
}

/// `y[m, n] = x[m, k] @ W^T`, W `n` rows of `k / 256` k-quant blocks.
pub fn matmul_kquant<B: KBlock>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[B],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_kquant_with(best_backend(), x, m, k, w, n, y)
}

/// Activation rows per pass over a task's weight rows: their Q8_K blocks
/// (~1.1 MB at k = 2048) stay in L2 while the weights stream by.
const CHUNK_ROWS: usize = 64;

/// [`matmul_kquant`] on a chosen path (tests and benchmarks).
pub fn matmul_kquant_with<B: KBlock>(
    backend: KBackend,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[B],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    if !k.is_multiple_of(QK_K) {
        return Err(QuantError::Shape(format!("k-quants need k to be a multiple of 256, got {k}")));
    }
    let kb = k / QK_K;
    if x.len() != m * k || w.len() != n * kb || y.len() != m * n {
        return Err(QuantError::Shape(format!(
            "x {} (m {m} k {k}), w {} blocks (n {n}), y {}",
            x.len(),
            w.len(),
            y.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let xq = quantize_activations(x);
    let out = OutPtr(y.as_mut_ptr());
    for i0 in (0..m).step_by(CHUNK_ROWS) {
        let rows = CHUNK_ROWS.min(m - i0);
        let xs = &xq[i0 * kb..(i0 + rows) * kb];
        for_each_span(n, (16, 256), |j0, j1| {
            // 8 partial sums per activation row (the SIMD lanes).
            let mut acc = vec![0f32; 8 * rows];
            for j in j0..j1 {
                acc.fill(0.0);
                let wrow = &w[j * kb..(j + 1) * kb];
                match backend {
                    // SAFETY: the path was offered because the CPU has its features.
                    #[cfg(target_arch = "x86_64")]
                    KBackend::Avx2 => unsafe { x86::row_avx2(wrow, xs, kb, &mut acc) },
                    // SAFETY: as above.
                    #[cfg(target_arch = "x86_64")]
                    KBackend::Vnni => unsafe { x86::row_vnni(wrow, xs, kb, &mut acc) },
                    KBackend::Scalar => row_scalar(wrow, xs, kb, &mut acc),
                }
                for (i, v) in acc.chunks_exact(8).map(|l| l.iter().sum::<f32>()).enumerate() {
                    // SAFETY: (i0 + i) * n + j < m * n = y.len(); this task owns column j.
                    unsafe { store(&out, (i0 + i) * n + j, v) };
                }
            }
        });
    }
    Ok(())
}

/// # Safety
/// `idx` is inside the output and no other thread writes it.
unsafe fn store(out: &OutPtr, idx: usize, v: f32) {
    // SAFETY: per the contract.
    unsafe { *out.0.add(idx) = v };
}

/// One weight row against `acc.len() / 8` activation rows of `kb` blocks
/// (into the first of each row's 8 partial sums).
fn row_scalar<B: KBlock>(wrow: &[B], xs: &[BlockQ8K], kb: usize, acc: &mut [f32]) {
    for (b, blk) in wrow.iter().enumerate() {
        let u = blk.unpack();
        for (i, a) in acc.chunks_exact_mut(8).enumerate() {
            a[0] += u.dot(&xs[i * kb + b]);
        }
    }
}

#[cfg(test)]
mod tests;
