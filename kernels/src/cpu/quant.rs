//! Q8_0 weights (GGML's layout) and the matmul that streams them.
//!
//! A Q8_0 block holds 32 weights as i8 with one f16 scale: `w = d * q`,
//! `d = max|w| / 127`. That is 34 bytes per 32 weights, 8.5 bits per weight,
//! about half of f16's traffic, which is what batch-1 decode is bound by.
//!
//! `matmul_q8_0` computes `y = x @ W^T` like `matmul_xwt`, shapes x `[m, k]`,
//! W `[n, k/32]` blocks, y `[m, n]`. As in llama.cpp, each activation row is
//! quantized to Q8_0 once per call, so the inner loop is an int8 dot product
//! (no dequantized copy of the weight ever exists): per block,
//! `d_x * d_w * sum(q_x * q_w)`. Output rows are split into tasks on rayon's
//! global pool; each task streams its weight rows once and dots each with
//! every activation row (m is small in decode, and x stays in cache).
//!
//! Backends: AVX2 (detected at run time: `vpsignb` + `vpmaddubsw` +
//! `vpmaddwd` on 32 bytes, the same trick as ggml), NEON `sdot` on aarch64
//! with the dotprod feature, and a portable scalar loop.

use half::f16;
use rayon::prelude::*;

/// Weights per Q8_0 block.
pub const QK8_0: usize = 32;

/// GGML's `block_q8_0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("Q8_0 needs the inner dimension to be a multiple of 32, got {0}")]
    NotBlockAligned(usize),
    #[error("Q8_0 matmul: {0}")]
    Shape(String),
}

/// Quantizes `src` (a multiple of 32 long) into blocks, rounding to nearest.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    if src.len() % QK8_0 != 0 {
        return Err(QuantError::NotBlockAligned(src.len()));
    }
    if dst.len() != src.len() / QK8_0 {
        return Err(QuantError::Shape(format!("{} values into {} blocks", src.len(), dst.len())));
    }
    for (chunk, block) in src.chunks_exact(QK8_0).zip(dst.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        block.d = f16::from_f32(d);
        for (q, &v) in block.qs.iter_mut().zip(chunk) {
            *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
    Ok(())
}

/// The weights a row of blocks stands for.
pub fn dequantize_row_q8_0(src: &[BlockQ8_0], dst: &mut [f32]) {
    for (block, out) in src.iter().zip(dst.chunks_exact_mut(QK8_0)) {
        let d = block.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&block.qs) {
            *o = d * q as f32;
        }
    }
}

/// Quantizes a whole `[rows, k]` matrix.
pub fn quantize_matrix_q8_0(src: &[f32], rows: usize, k: usize) -> Result<Vec<BlockQ8_0>, QuantError> {
    if k % QK8_0 != 0 {
        return Err(QuantError::NotBlockAligned(k));
    }
    if src.len() != rows * k {
        return Err(QuantError::Shape(format!("{} values for [{rows}, {k}]", src.len())));
    }
    let mut out = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK8_0] }; rows * k / QK8_0];
    out.par_chunks_mut(k / QK8_0).zip(src.par_chunks(k)).try_for_each(|(dst, row)| quantize_row_q8_0(row, dst))?;
    Ok(out)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
    Neon,
}

fn detect() -> Backend {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
        return Backend::Avx2;
    }
    #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
    if std::arch::is_aarch64_feature_detected!("dotprod") {
        return Backend::Neon;
    }
    Backend::Scalar
}

static BACKEND: std::sync::LazyLock<Backend> = std::sync::LazyLock::new(detect);

/// `y[m, n] = x[m, k] @ W^T` with W in Q8_0 (`n` rows of `k / 32` blocks).
pub fn matmul_q8_0(x: &[f32], m: usize, k: usize, w: &[BlockQ8_0], n: usize, y: &mut [f32]) -> Result<(), QuantError> {
    matmul_with(*BACKEND, x, m, k, w, n, y)
}

/// The portable path, for tests that compare backends.
pub fn matmul_q8_0_scalar(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[BlockQ8_0],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    matmul_with(Backend::Scalar, x, m, k, w, n, y)
}

fn matmul_with(
    backend: Backend,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[BlockQ8_0],
    n: usize,
    y: &mut [f32],
) -> Result<(), QuantError> {
    if k % QK8_0 != 0 {
        return Err(QuantError::NotBlockAligned(k));
    }
    let kb = k / QK8_0;
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
    // Activations: quantized once per call (small next to the weights).
    let mut xq = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK8_0] }; m * kb];
    for (row, dst) in x.chunks_exact(k).zip(xq.chunks_exact_mut(kb)) {
        quantize_row_q8_0(row, dst)?;
    }
    // Tasks of whole weight rows: enough of them for both cores, each long
    // enough (>= 16 rows) that scheduling costs nothing next to streaming.
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = n.div_ceil(threads * 4).clamp(16, 256);
    let tasks = n.div_ceil(rows_per_task);
    let results: Vec<Vec<f32>> = (0..tasks)
        .into_par_iter()
        .map(|t| {
            let (n0, n1) = (t * rows_per_task, ((t + 1) * rows_per_task).min(n));
            let mut out = vec![0f32; m * (n1 - n0)];
            for j in n0..n1 {
                let wrow = &w[j * kb..(j + 1) * kb];
                for i in 0..m {
                    out[i * (n1 - n0) + (j - n0)] = dot(backend, &xq[i * kb..(i + 1) * kb], wrow);
                }
            }
            out
        })
        .collect();
    for (t, out) in results.iter().enumerate() {
        let (n0, n1) = (t * rows_per_task, ((t + 1) * rows_per_task).min(n));
        for i in 0..m {
            y[i * n + n0..i * n + n1].copy_from_slice(&out[i * (n1 - n0)..(i + 1) * (n1 - n0)]);
        }
    }
    Ok(())
}

#[inline]
fn dot(backend: Backend, a: &[BlockQ8_0], b: &[BlockQ8_0]) -> f32 {
    match backend {
        Backend::Scalar => dot_scalar(a, b),
        // SAFETY: the backend was chosen because the CPU has these features.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => unsafe { avx2::dot(a, b) },
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Backend::Neon => unsafe { neon::dot(a, b) },
    }
}

fn dot_scalar(a: &[BlockQ8_0], b: &[BlockQ8_0]) -> f32 {
    let mut sum = 0f32;
    for (x, w) in a.iter().zip(b) {
        let q: i32 = x.qs.iter().zip(&w.qs).map(|(&p, &q)| p as i32 * q as i32).sum();
        sum += x.d.to_f32() * w.d.to_f32() * q as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::BlockQ8_0;

    /// Sum over blocks of `d_a * d_b * <q_a, q_b>`. `vpmaddubsw` multiplies
    /// unsigned by signed bytes, so |q_a| meets q_b with q_a's sign moved
    /// onto it; pairs of products fit i16 because quantized values are in
    /// [-127, 127]. Both f16 scales convert in one F16C instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(a: &[BlockQ8_0], b: &[BlockQ8_0]) -> f32 {
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut acc0 = _mm256_setzero_ps();
            let mut acc1 = _mm256_setzero_ps();
            let n = a.len().min(b.len());
            let mut i = 0;
            while i + 1 < n {
                acc0 = block(&a[i], &b[i], acc0, ones);
                acc1 = block(&a[i + 1], &b[i + 1], acc1, ones);
                i += 2;
            }
            if i < n {
                acc0 = block(&a[i], &b[i], acc0, ones);
            }
            hsum(_mm256_add_ps(acc0, acc1))
        }
    }

    #[inline(always)]
    unsafe fn block(a: &BlockQ8_0, b: &BlockQ8_0, acc: __m256, ones: __m256i) -> __m256 {
        unsafe {
            let qa = _mm256_loadu_si256(a.qs.as_ptr().cast());
            let qb = _mm256_loadu_si256(b.qs.as_ptr().cast());
            let abs_a = _mm256_sign_epi8(qa, qa);
            let signed_b = _mm256_sign_epi8(qb, qa);
            let pairs = _mm256_maddubs_epi16(abs_a, signed_b);
            let sums = _mm256_madd_epi16(pairs, ones);
            let bits = a.d.to_bits() as i32 | ((b.d.to_bits() as i32) << 16);
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            let scale = _mm256_broadcastss_ps(_mm_mul_ss(d, _mm_movehdup_ps(d)));
            _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc)
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            _mm_cvtss_f32(s)
        }
    }
}

#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
mod neon {
    use std::arch::aarch64::*;

    use super::BlockQ8_0;

    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn dot(a: &[BlockQ8_0], b: &[BlockQ8_0]) -> f32 {
        unsafe {
            let mut acc = vdupq_n_f32(0.0);
            for (x, w) in a.iter().zip(b) {
                let x0 = vld1q_s8(x.qs.as_ptr());
                let x1 = vld1q_s8(x.qs.as_ptr().add(16));
                let w0 = vld1q_s8(w.qs.as_ptr());
                let w1 = vld1q_s8(w.qs.as_ptr().add(16));
                let s = vdotq_s32(vdotq_s32(vdupq_n_s32(0), x0, w0), x1, w1);
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(s), x.d.to_f32() * w.d.to_f32());
            }
            vaddvq_f32(acc)
        }
    }
}
