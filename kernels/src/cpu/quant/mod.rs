//! Quantized weights in GGML's block formats, and the matmul that streams them.
//!
//! * Q8_0: 32 weights as i8 with one f16 scale, `w = d * q`, `d = max|w| / 127`;
//!   34 bytes per 32 weights (8.5 bits), about half of f16's traffic.
//! * Q4_0: 32 weights as 4-bit codes with one f16 scale, `w = d * (q - 8)`;
//!   18 bytes per 32 weights (4.5 bits). Byte j holds weight j in its low
//!   nibble and weight j + 16 in its high nibble (GGML's order).
//!
//! Batch-1 decode is bound by the bytes of weight read per token, which is
//! what these formats cut.
//!
//! `matmul_quant` computes `y = x @ W^T` like `matmul_xwt`: x `[m, k]`, W `[n,
//! k/32]` blocks, y `[m, n]`. As in llama.cpp, each activation row is
//! quantized to Q8_0 once per call, so the inner loop is an int8 dot product
//! and no dequantized copy of the weight ever exists: per block,
//! `d_x * d_w * sum(q_x * q_w)`.
//!
//! Why it is shaped this way (AVX2): output rows are split into tasks on
//! rayon's pool; a task walks its rows 4 at a time, so each activation block
//! is loaded once for 4 weight rows, and prefetches each row ~1 KiB ahead
//! (short interleaved streams from 4 rows outrun the hardware prefetcher).
//! With m > 1 the 4 rows' blocks (<= 25 KiB for k <= 5632) stay in L1/L2
//! while every activation row passes over them. Results go straight into y
//! (each task owns its columns). Backends: AVX2 (`vpmaddubsw` of |x|, taken
//! once per activation block for all rows, with w carrying x's sign by one
//! `vpsignb` per row, then `vpmaddwd`), NEON widening multiplies (`smull`,
//! `sadalp`), and a portable scalar loop; detected once ([`super::isa`]).
//! Q8_0 codes must lie in [-127, 127], as GGML's and our quantizers write
//! them (the GGUF loader clamps a stray -128).
//!
//! The model keeps Q8_0 weights as [`PackedQ8_0`] (`matmul_packed_q8_0`):
//! the same kernel over 4-row groups stored together, so a task reads one
//! aligned stream of codes and one of scales. `matmul_quant` on GGML's
//! row-major blocks serves Q4_0 and the tests.

use half::f16;
use rayon::prelude::*;

pub use mxfp4::{BlockMxfp4, QK_MXFP4, e8m0_to_f32_half};

use super::isa::{self, Simd};
use super::{OutPtr, for_each_span};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod mxfp4;
#[cfg(target_arch = "aarch64")]
mod neon;

/// Weights per block, in every format here.
pub const QK: usize = 32;
/// Weights per Q8_0 block.
pub const QK8_0: usize = QK;
/// Weights per Q4_0 block.
pub const QK4_0: usize = QK;

/// GGML's `block_q8_0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}

/// GGML's `block_q4_0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK4_0 / 2],
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("quantized weights need the inner dimension to be a multiple of 32, got {0}")]
    NotBlockAligned(usize),
    #[error("quantized matmul: {0}")]
    Shape(String),
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::BlockQ8_0 {}
    impl Sealed for super::BlockQ4_0 {}
    impl Sealed for super::BlockMxfp4 {}
}

/// A block of 32 quantized weights with an f16 scale. Sealed: the SIMD
/// paths know the concrete layouts.
pub trait QuantBlock: sealed::Sealed + Copy + Send + Sync + std::fmt::Debug + 'static {
    /// GGML's name of the format.
    const NAME: &'static str;
    const ZERO: Self;
    /// The block's scale (`w = scale * code`).
    fn scale(&self) -> f32;
    /// The 32 integer codes, centred (`w = d * code`).
    fn codes(&self) -> [i8; QK];
    /// Quantizes 32 weights, rounding as GGML does.
    fn quantize(src: &[f32; QK]) -> Self;
    /// The 32 codes as signed bytes in one AVX register.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn codes_avx2(&self) -> std::arch::x86_64::__m256i;
    /// The scale in lane 0.
    ///
    /// # Safety
    /// AVX2 and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn scale_avx2(&self) -> std::arch::x86_64::__m128;
    /// The scales of 4 blocks, one a lane.
    ///
    /// # Safety
    /// AVX2 and F16C must be available.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn scales4_avx2(blocks: [&Self; 4]) -> std::arch::x86_64::__m128;
    /// The 32 codes as two NEON vectors of signed bytes.
    ///
    /// # Safety
    /// NEON must be available.
    #[cfg(target_arch = "aarch64")]
    #[doc(hidden)]
    unsafe fn codes_neon(&self) -> (std::arch::aarch64::int8x16_t, std::arch::aarch64::int8x16_t);
}

impl QuantBlock for BlockQ8_0 {
    const NAME: &'static str = "q8_0";
    const ZERO: Self = Self { d: f16::ZERO, qs: [0; QK] };
    fn scale(&self) -> f32 {
        self.d.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scale_avx2(&self) -> std::arch::x86_64::__m128 {
        // SAFETY: F16C per the caller.
        unsafe { avx2::f16_scale(self.d) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales4_avx2(blocks: [&Self; 4]) -> std::arch::x86_64::__m128 {
        // SAFETY: F16C per the caller.
        unsafe { avx2::f16_scales4(blocks.map(|b| b.d)) }
    }
    fn codes(&self) -> [i8; QK] {
        self.qs
    }
    fn quantize(src: &[f32; QK]) -> Self {
        let amax = src.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        Self { d: f16::from_f32(d), qs: src.map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: qs is 32 readable bytes; AVX per the caller.
        unsafe { std::arch::x86_64::_mm256_loadu_si256(self.qs.as_ptr().cast()) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn codes_neon(&self) -> (std::arch::aarch64::int8x16_t, std::arch::aarch64::int8x16_t) {
        use std::arch::aarch64::vld1q_s8;
        // SAFETY: qs is 32 readable bytes; NEON per the caller.
        unsafe { (vld1q_s8(self.qs.as_ptr()), vld1q_s8(self.qs.as_ptr().add(16))) }
    }
}

impl QuantBlock for BlockQ4_0 {
    const NAME: &'static str = "q4_0";
    const ZERO: Self = Self { d: f16::ZERO, qs: [0x88; QK / 2] };
    fn scale(&self) -> f32 {
        self.d.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scale_avx2(&self) -> std::arch::x86_64::__m128 {
        // SAFETY: F16C per the caller.
        unsafe { avx2::f16_scale(self.d) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn scales4_avx2(blocks: [&Self; 4]) -> std::arch::x86_64::__m128 {
        // SAFETY: F16C per the caller.
        unsafe { avx2::f16_scales4(blocks.map(|b| b.d)) }
    }
    fn codes(&self) -> [i8; QK] {
        let mut out = [0i8; QK];
        for (j, &b) in self.qs.iter().enumerate() {
            out[j] = (b & 0x0F) as i8 - 8;
            out[j + QK / 2] = (b >> 4) as i8 - 8;
        }
        out
    }
    /// GGML's rule: the signed value of largest magnitude maps to code -8,
    /// so the scale carries its sign and the full range [-8, 7] is used.
    fn quantize(src: &[f32; QK]) -> Self {
        let max = src.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let code = |v: f32| ((v * inv + 8.5) as i8).clamp(0, 15) as u8;
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = code(src[j]) | (code(src[j + QK / 2]) << 4);
        }
        Self { d: f16::from_f32(d), qs }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn codes_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: qs is 16 readable bytes; AVX2 per the caller. Low nibbles
        // are weights 0..16 (lower lane), high nibbles 16..32.
        unsafe {
            let packed = _mm_loadu_si128(self.qs.as_ptr().cast());
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8))
        }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn codes_neon(&self) -> (std::arch::aarch64::int8x16_t, std::arch::aarch64::int8x16_t) {
        use std::arch::aarch64::*;
        // SAFETY: qs is 16 readable bytes; NEON per the caller.
        unsafe {
            let packed = vld1q_u8(self.qs.as_ptr());
            let eight = vdupq_n_s8(8);
            let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0F))), eight);
            let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(packed)), eight);
            (lo, hi)
        }
    }
}

/// Quantizes `src` (a multiple of 32 long) into blocks.
pub fn quantize_row<B: QuantBlock>(src: &[f32], dst: &mut [B]) -> Result<(), QuantError> {
    if !src.len().is_multiple_of(QK) {
        return Err(QuantError::NotBlockAligned(src.len()));
    }
    if dst.len() != src.len() / QK {
        return Err(QuantError::Shape(format!("{} values into {} blocks", src.len(), dst.len())));
    }
    for (chunk, block) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let chunk: &[f32; QK] = chunk.try_into().map_err(|_| QuantError::Shape("block".into()))?;
        *block = B::quantize(chunk);
    }
    Ok(())
}

/// The weights a row of blocks stands for.
pub fn dequantize_row<B: QuantBlock>(src: &[B], dst: &mut [f32]) {
    for (block, out) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = block.scale();
        for (o, q) in out.iter_mut().zip(block.codes()) {
            *o = d * q as f32;
        }
    }
}

/// Quantizes a whole `[rows, k]` matrix.
pub fn quantize_matrix<B: QuantBlock>(src: &[f32], rows: usize, k: usize) -> Result<Vec<B>, QuantError> {
    if !k.is_multiple_of(QK) {
        return Err(QuantError::NotBlockAligned(k));
    }
    if src.len() != rows * k {
        return Err(QuantError::Shape(format!("{} values for [{rows}, {k}]", src.len())));
    }
    let mut out = vec![B::ZERO; rows * k / QK];
    out.par_chunks_mut(k / QK).zip(src.par_chunks(k)).try_for_each(|(dst, row)| quantize_row(row, dst))?;
    Ok(out)
}

/// Q8_0 names kept for callers of the first version of this module.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    quantize_row(src, dst)
}
pub fn dequantize_row_q8_0(src: &[BlockQ8_0], dst: &mut [f32]) {
    dequantize_row(src, dst)
}
pub fn quantize_matrix_q8_0(src: &[f32], rows: usize, k: usize) -> Result<Vec<BlockQ8_0>, QuantError> {
    quantize_matrix(src, rows, k)
}

/// `y[m, n] = x[m, k] @ W^T` with W in a quantized format (`n` rows of `k / 32` blocks).
pub fn matmul_quant<B: QuantBlock>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[B],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_with(isa::simd(), x, m, k, w, n, y)
}

/// The portable path, for tests that compare backends.
pub fn matmul_quant_scalar<B: QuantBlock>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[B],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_with(Simd::Scalar, x, m, k, w, n, y)
}

pub fn matmul_q8_0(x: &[f32], m: usize, k: usize, w: &[BlockQ8_0], n: usize, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_quant(x, m, k, w, n, y)
}

pub fn matmul_q8_0_scalar(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[BlockQ8_0],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_quant_scalar(x, m, k, w, n, y)
}

/// Four weight rows' Q8_0 codes for one block index, 128 bytes on a cache
/// line boundary: the unit the AVX2 kernel loads.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Codes4(pub [[i8; QK]; 4]);

/// Q8_0 weights regrouped for the CPU kernels (the same bytes as GGML's
/// blocks, in another order): rows in groups of 4 (the last group padded
/// with zero rows), and per group and block index the 4 rows' codes
/// together ([`Codes4`]) and their 4 scales together in a second array.
/// The kernel then reads two linear streams with aligned loads and widens
/// 4 scales by one conversion, instead of 4 interleaved row streams with
/// a 34-byte stride (half the loads split a cache line) and a scalar
/// gather of 4 scales per block.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedQ8_0 {
    n: usize,
    kb: usize,
    /// `[n / 4 rounded up, kb]`.
    codes: Vec<Codes4>,
    /// `[n / 4 rounded up, kb]`, row r of the group in lane r.
    scales: Vec<[f16; 4]>,
}

impl PackedQ8_0 {
    /// Regroups `n` rows of `kb` blocks (row-major, GGML's order).
    pub fn pack(blocks: &[BlockQ8_0], n: usize, kb: usize) -> Result<Self, QuantError> {
        if blocks.len() != n * kb {
            return Err(QuantError::Shape(format!("{} blocks for {n} rows of {kb}", blocks.len())));
        }
        let groups = n.div_ceil(4);
        let mut codes = vec![Codes4([[0; QK]; 4]); groups * kb];
        let mut scales = vec![[f16::ZERO; 4]; groups * kb];
        for (row, blocks) in blocks.chunks_exact(kb.max(1)).enumerate().take(n) {
            let (g, r) = (row / 4, row % 4);
            for (b, blk) in blocks.iter().enumerate() {
                codes[g * kb + b].0[r] = blk.qs;
                scales[g * kb + b][r] = blk.d;
            }
        }
        Ok(Self { n, kb, codes, scales })
    }

    /// Back to GGML's row-major blocks.
    pub fn unpack(&self) -> Vec<BlockQ8_0> {
        (0..self.n)
            .flat_map(|row| {
                let (g, r) = (row / 4, row % 4);
                (0..self.kb).map(move |b| BlockQ8_0 {
                    d: self.scales[g * self.kb + b][r],
                    qs: self.codes[g * self.kb + b].0[r],
                })
            })
            .collect()
    }

    /// `(rows, blocks per row)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.kb)
    }

    /// The two arrays, for placing them in memory (huge pages).
    pub fn arrays(&self) -> (&[Codes4], &[[f16; 4]]) {
        (&self.codes, &self.scales)
    }

    /// Bytes of weight read per pass (padding rows included).
    pub fn size_in_bytes(&self) -> usize {
        std::mem::size_of_val(self.codes.as_slice()) + std::mem::size_of_val(self.scales.as_slice())
    }
}

/// `y = x @ W^T` for packed Q8_0 weights (x `[m, k]`, y `[m, n]`); as
/// [`matmul_quant`].
pub fn matmul_packed_q8_0(x: &[f32], m: usize, w: &PackedQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    packed_with(isa::simd(), x, m, w, y)
}

/// [`matmul_packed_q8_0`] on the portable path (for tests).
pub fn matmul_packed_q8_0_scalar(x: &[f32], m: usize, w: &PackedQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    packed_with(Simd::Scalar, x, m, w, y)
}

/// Errors unless x is `[m, kb * 32]` and y `[m, n]`: the check of the
/// kernels whose weight carries its own shape (`PackedQ8_0`, `PanelQ8_0`).
/// Ok(false) when the product is empty (m or n is 0).
pub(crate) fn check_xy(x: &[f32], m: usize, kb: usize, y: &[f32], n: usize) -> Result<bool, QuantError> {
    let k = kb * QK;
    if x.len() != m * k || y.len() != m * n {
        return Err(QuantError::Shape(format!("x {} (m {m} k {k}), y {} (n {n})", x.len(), y.len())));
    }
    Ok(m > 0 && n > 0)
}

fn packed_with(backend: Simd, x: &[f32], m: usize, w: &PackedQ8_0, y: &mut [f32]) -> Result<(), QuantError> {
    let (n, kb) = (w.n, w.kb);
    if !check_xy(x, m, kb, y, n)? {
        return Ok(());
    }
    let (xq, xd) = quantized_activations(backend, x, m * kb);
    let ops = PackedOperands { xq: &xq, xd: &xd, w, m, y: OutPtr(y.as_mut_ptr()) };
    // Groups of 4 rows, 16-256 rows per task as in `matmul_with`.
    for_each_span(n.div_ceil(4), (4, 64), |g0, g1| packed_groups(backend, &ops, g0, g1));
    Ok(())
}

struct PackedOperands<'a> {
    xq: &'a [BlockQ8_0],
    xd: &'a [f32],
    w: &'a PackedQ8_0,
    m: usize,
    y: OutPtr,
}

/// Runs one task's span `a..b` with `backend`'s body of `$kernel`: the
/// AVX2 or NEON one of that name, or `$scalar`.
macro_rules! on_backend {
    ($backend:expr, $kernel:ident, $scalar:ident, $ops:expr, $a:expr, $b:expr) => {
        match $backend {
            // SAFETY: the backend was chosen because the CPU has these features;
            // shapes were checked by the caller; this task owns these columns.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { avx2::$kernel($ops, $a, $b) },
            // SAFETY: NEON was detected (it is baseline on aarch64); shapes
            // were checked by the caller; this task owns these columns.
            #[cfg(target_arch = "aarch64")]
            Simd::Neon => unsafe { neon::$kernel($ops, $a, $b) },
            Simd::Scalar => $scalar($ops, $a, $b),
        }
    };
}

/// y[.., rows of groups g0..g1].
fn packed_groups(backend: Simd, ops: &PackedOperands<'_>, g0: usize, g1: usize) {
    on_backend!(backend, packed_groups, scalar_packed_groups, ops, g0, g1)
}

fn scalar_packed_groups(ops: &PackedOperands<'_>, g0: usize, g1: usize) {
    let (n, kb) = (ops.w.n, ops.w.kb);
    for g in g0..g1 {
        for r in 0..4.min(n - 4 * g) {
            let j = 4 * g + r;
            for i in 0..ops.m {
                let mut sum = 0f32;
                for b in 0..kb {
                    let q = int_dot(&ops.xq[i * kb + b].qs, &ops.w.codes[g * kb + b].0[r]);
                    sum += ops.xd[i * kb + b] * ops.w.scales[g * kb + b][r].to_f32() * q as f32;
                }
                // SAFETY: i * n + j < m * n = y.len(); this task owns column j.
                unsafe { *ops.y.0.add(i * n + j) = sum };
            }
        }
    }
}

/// One call's operands: activations quantized to Q8_0 (`m` rows of `kb`
/// blocks) with their scales widened once, and the weights.
struct Operands<'a, B> {
    xq: &'a [BlockQ8_0],
    xd: &'a [f32],
    w: &'a [B],
    m: usize,
    kb: usize,
    n: usize,
    y: OutPtr,
}

fn matmul_with<B: QuantBlock>(
    backend: Simd,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[B],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    if !k.is_multiple_of(QK) {
        return Err(QuantError::NotBlockAligned(k));
    }
    let kb = k / QK;
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
    let (xq, xd) = quantized_activations(backend, x, m * kb);
    let ops = Operands { xq: &xq, xd: &xd, w, m, kb, n, y: OutPtr(y.as_mut_ptr()) };
    // Whole 4-row tiles per task: 16-256 rows.
    let groups = n.div_ceil(4);
    for_each_span(groups, (4, 64), |g0, g1| rows(backend, &ops, 4 * g0, (4 * g1).min(n)));
    Ok(())
}

/// Activations quantized once per call (small next to the weights):
/// `blocks` Q8_0 blocks of `x` and their scales widened.
fn quantized_activations(backend: Simd, x: &[f32], blocks: usize) -> (Vec<BlockQ8_0>, Vec<f32>) {
    let mut xq = vec![BlockQ8_0::ZERO; blocks];
    let mut xd = vec![0f32; blocks];
    quantize_activations(backend, x, &mut xq, &mut xd);
    (xq, xd)
}

/// [`quantized_activations`] on this machine's quantizer, for the other
/// Q8_0 layouts' kernels.
pub(crate) fn quantize_activations_q8_0(x: &[f32], blocks: usize) -> (Vec<BlockQ8_0>, Vec<f32>) {
    quantized_activations(isa::simd(), x, blocks)
}

/// [`quantize_activations_q8_0`] into buffers the caller keeps
/// (`x.len() == 32 * xq.len() == 32 * xd.len()`).
pub(crate) fn quantize_activations_q8_0_into(x: &[f32], xq: &mut [BlockQ8_0], xd: &mut [f32]) {
    quantize_activations(isa::simd(), x, xq, xd);
}

/// Quantizes activation rows (`x.len() == 32 * xq.len()`) to Q8_0 and
/// widens each block's scale into `xd`. Every backend gives the blocks
/// [`QuantBlock::quantize`] gives: the AVX2 path repeats its arithmetic
/// (scale, reciprocal, round half away from zero, NaN to 0) lane by lane.
/// Run per matmul call, so it has to be cheap: scalar `round` is a libm
/// call per value on baseline x86-64, a visible share of a Q8_0 decode
/// step.
fn quantize_activations(backend: Simd, x: &[f32], xq: &mut [BlockQ8_0], xd: &mut [f32]) {
    debug_assert!(x.len() == xq.len() * QK && xd.len() == xq.len());
    match backend {
        // SAFETY: the backend was chosen because the CPU has AVX2, FMA, F16C.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { avx2::quantize_activations(x, xq, xd) },
        _ => {
            for ((src, block), d) in x.chunks_exact(QK).zip(xq.iter_mut()).zip(xd.iter_mut()) {
                let src: &[f32; QK] = src.try_into().expect("chunks_exact(QK)");
                *block = BlockQ8_0::quantize(src);
                *d = block.d.to_f32();
            }
        }
    }
}

/// y[.., n0..n1].
fn rows<B: QuantBlock>(backend: Simd, ops: &Operands<'_, B>, n0: usize, n1: usize) {
    on_backend!(backend, rows, scalar_rows, ops, n0, n1)
}

fn scalar_rows<B: QuantBlock>(ops: &Operands<'_, B>, n0: usize, n1: usize) {
    let kb = ops.kb;
    for j in n0..n1 {
        let wrow = &ops.w[j * kb..(j + 1) * kb];
        for i in 0..ops.m {
            let mut sum = 0f32;
            for (b, wb) in wrow.iter().enumerate() {
                let q = int_dot(&ops.xq[i * kb + b].qs, &wb.codes());
                sum += ops.xd[i * kb + b] * wb.scale() * q as f32;
            }
            // SAFETY: i * n + j < m * n = y.len(); this task owns column j.
            unsafe { *ops.y.0.add(i * ops.n + j) = sum };
        }
    }
}

/// Exact dot product of two blocks of codes (portable path).
fn int_dot(x: &[i8; QK], w: &[i8; QK]) -> i32 {
    x.iter().zip(w).map(|(&a, &b)| a as i32 * b as i32).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Every backend quantizes activations exactly as `BlockQ8_0::quantize`:
    /// random scales, exact ties at x.5 (amax 127 makes the scale 1), the
    /// largest float below a tie, signed zeros, NaN, infinities, subnormals.
    #[test]
    fn activation_quantization_matches_the_scalar_quantizer_exactly() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut x = Vec::new();
        for block in 0..400 {
            let scale = 10f32.powi(rng.random_range(-6..6));
            let mut v: Vec<f32> = (0..QK).map(|_| rng.random_range(-1.0..1.0f32) * scale).collect();
            match block % 5 {
                1 => {
                    v[0] = 127.0;
                    for (i, t) in
                        [0.5f32, -0.5, 1.5, -2.5, 126.5, -126.5, 0.499_999_97, -0.499_999_97, 2.499_999_8, 63.5]
                            .into_iter()
                            .enumerate()
                    {
                        v[1 + i] = t;
                    }
                    v[12] = -0.0;
                    v[13] = 0.0;
                }
                2 => {
                    v[3] = f32::NAN;
                    v[9] = -f32::NAN;
                }
                3 => v[rng.random_range(0..QK)] = if rng.random() { f32::INFINITY } else { f32::NEG_INFINITY },
                4 => v.iter_mut().for_each(|e| *e *= 1e-40),
                _ => {}
            }
            x.extend(v);
        }
        let blocks = x.len() / QK;
        let expected: Vec<BlockQ8_0> =
            x.chunks_exact(QK).map(|c| BlockQ8_0::quantize(c.try_into().expect("32"))).collect();
        for backend in [Simd::Scalar, isa::simd()] {
            let mut xq = vec![BlockQ8_0::ZERO; blocks];
            let mut xd = vec![0f32; blocks];
            quantize_activations(backend, &x, &mut xq, &mut xd);
            for (b, (got, want)) in xq.iter().zip(&expected).enumerate() {
                assert_eq!(got.qs, want.qs, "{backend:?} block {b}: {:?}", &x[b * QK..(b + 1) * QK]);
                assert_eq!(got.d.to_bits(), want.d.to_bits(), "{backend:?} block {b}");
                assert_eq!(xd[b].to_bits(), want.d.to_f32().to_bits(), "{backend:?} block {b}");
            }
        }
    }
}
