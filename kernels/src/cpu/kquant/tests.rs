//! The k-quant blocks against candle's GGML decoder (same bytes, same
//! weights), the quantizers' error bounds, and every matmul path against
//! the scalar one and against an f32 product of the dequantized weights.

use candle_core::quantized::GgmlDType;
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn random(rng: &mut StdRng, len: usize) -> Vec<f32> {
    // Mostly small values with a few outliers, as in real weights.
    (0..len)
        .map(|_| {
            let v: f32 = rng.random_range(-1.0..1.0);
            if rng.random_range(0..64) == 0 { v * 8.0 } else { v * v * v.signum() }
        })
        .collect()
}

fn bytes_of<B: KBlock>(blocks: &[B]) -> Vec<u8> {
    // SAFETY: the blocks are repr(C) plain data without padding (their
    // sizes are GGML's, checked below).
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks)).to_vec() }
}

fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
    let err: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f32 = b.iter().map(|y| y * y).sum();
    (err / norm).sqrt()
}

#[test]
fn block_sizes_are_ggml_s() {
    assert_eq!(std::mem::size_of::<BlockQ4K>(), 144);
    assert_eq!(std::mem::size_of::<BlockQ6K>(), 210);
    assert_eq!(std::mem::size_of::<BlockQ8K>(), 292);
}

/// Our decoding of random bytes equals candle's port of GGML's
/// `dequantize_row_q*_K`: the layouts are GGML's.
fn decodes_like_ggml<B: KBlock>(dtype: GgmlDType, make: impl Fn(&mut StdRng) -> B) {
    let mut rng = StdRng::seed_from_u64(3);
    let blocks: Vec<B> = (0..24).map(|_| make(&mut rng)).collect();
    let mut ours = vec![0f32; blocks.len() * QK_K];
    dequantize_row(&blocks, &mut ours);
    let q = qtensor_from_ggml(dtype, &bytes_of(&blocks), vec![3, 8 * QK_K], &Device::Cpu).unwrap();
    let theirs = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(ours, theirs, "{}", B::NAME);
}

#[test]
fn q4_k_decodes_like_ggml() {
    decodes_like_ggml(GgmlDType::Q4K, |rng| BlockQ4K {
        d: f16::from_f32(rng.random_range(0.001..0.1)),
        dmin: f16::from_f32(rng.random_range(0.001..0.1)),
        scales: std::array::from_fn(|_| rng.random()),
        qs: std::array::from_fn(|_| rng.random()),
    });
}

#[test]
fn q6_k_decodes_like_ggml() {
    decodes_like_ggml(GgmlDType::Q6K, |rng| BlockQ6K {
        ql: std::array::from_fn(|_| rng.random()),
        qh: std::array::from_fn(|_| rng.random()),
        scales: std::array::from_fn(|_| rng.random()),
        d: f16::from_f32(rng.random_range(-0.1..0.1)),
    });
}

/// Round trip of random weights: relative RMS error within what 4 and 6
/// bits give, and better than candle's plain quantizer (Q4_K: fitted
/// scales and mins beat its min/max search).
#[test]
fn quantizers_round_trip_within_bounds() {
    let mut rng = StdRng::seed_from_u64(11);
    let (rows, k) = (16, 4 * QK_K);
    let w = random(&mut rng, rows * k);
    let t = Tensor::from_vec(w.clone(), (rows, k), &Device::Cpu).unwrap();
    for (name, bound, ours, dtype) in [
        ("q4_K", 0.12, round_trip::<BlockQ4K>(&w, rows, k), GgmlDType::Q4K),
        ("q6_K", 0.03, round_trip::<BlockQ6K>(&w, rows, k), GgmlDType::Q6K),
    ] {
        let err = rel_rms(&ours, &w);
        let theirs = candle_core::quantized::QTensor::quantize(&t, dtype).unwrap();
        let theirs = theirs.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let candle_err = rel_rms(&theirs, &w);
        eprintln!("{name}: relative RMS error {err}, candle's quantizer {candle_err}");
        assert!(err < bound, "{name}: relative RMS error {err}");
        assert!(err <= candle_err * 1.01, "{name}: ours {err}, candle's {candle_err}");
    }
    // Uniform weights (what random:<preset> models hold): Q4_K against Q4_0.
    let u: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let q40 = crate::cpu::quant::quantize_matrix::<crate::cpu::quant::BlockQ4_0>(&u, rows, k).unwrap();
    let mut u40 = vec![0f32; u.len()];
    crate::cpu::quant::dequantize_row(&q40, &mut u40);
    let (e4k, e40) = (rel_rms(&round_trip::<BlockQ4K>(&u, rows, k), &u), rel_rms(&u40, &u));
    eprintln!("uniform weights: q4_K relative RMS error {e4k}, q4_0 {e40}");
    assert!(e4k < e40, "q4_K {e4k} vs q4_0 {e40}");
    // Constant and zero blocks survive exactly enough.
    for v in [0.0f32, 0.5, -2.0] {
        let src = [v; QK_K];
        let mut out = [0f32; QK_K];
        BlockQ4K::quantize(&src).unpack().dequantize(&mut out);
        assert!(out.iter().all(|o| (o - v).abs() <= 0.01 * v.abs() + 1e-6), "q4_K {v}: {:?}", &out[..4]);
        BlockQ6K::quantize(&src).unpack().dequantize(&mut out);
        assert!(out.iter().all(|o| (o - v).abs() <= 0.01 * v.abs() + 1e-6), "q6_K {v}: {:?}", &out[..4]);
    }
}

fn round_trip<B: KBlock>(w: &[f32], rows: usize, k: usize) -> Vec<f32> {
    let q = quantize_matrix::<B>(w, rows, k).unwrap();
    let mut out = vec![0f32; w.len()];
    dequantize_row(&q, &mut out);
    out
}

/// The f32 products of the Q8_K-rounded activations `x` ([m, k]) with the
/// dequantized weights `w` ([n, k]), each with its sum of |products| (the
/// scale of float-order error).
pub(super) fn reference_products<B: KBlock>(x: &[f32], m: usize, k: usize, w: &[B], n: usize) -> Vec<(f32, f32)> {
    let mut wf = vec![0f32; n * k];
    dequantize_row(w, &mut wf);
    let xf: Vec<f32> = quantize_activations(x).iter().flat_map(|b| b.qs.map(|q| b.d * q as f32)).collect();
    (0..m * n)
        .map(|o| {
            let (i, j) = (o / n, o % n);
            let pairs = xf[i * k..(i + 1) * k].iter().zip(&wf[j * k..(j + 1) * k]);
            pairs.fold((0.0, 0.0), |(s, a), (x, w)| (s + x * w, a + (x * w).abs()))
        })
        .collect()
}

/// Every path on random shapes (n not a multiple of anything, m across
/// the 64-row chunks) against the f32 product of the dequantized weights
/// and the dequantized Q8_K activations, up to float order.
fn matmul_matches_reference<B: KBlock>() {
    let mut rng = StdRng::seed_from_u64(5);
    for (m, n, kb) in [(1, 1, 1), (1, 37, 3), (2, 17, 2), (5, 100, 1), (70, 23, 2), (3, 9, 8)] {
        let k = kb * QK_K;
        let w = quantize_matrix::<B>(&random(&mut rng, n * k), n, k).unwrap();
        let x = random(&mut rng, m * k);
        let exact = reference_products(&x, m, k, &w, n);
        for backend in available_backends() {
            let mut y = vec![f32::NAN; m * n];
            matmul_kquant_with(backend, &x, m, k, &w, n, &mut y).unwrap();
            for (a, (b, mag)) in y.iter().zip(&exact) {
                assert!((a - b).abs() <= 1e-4 * mag, "{} {backend:?} m {m} n {n} k {k}: {a} vs {b}", B::NAME);
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512vnni") && std::env::var_os("TINYVLLM_CPU_ISA").is_none() {
        assert!(available_backends().len() == 3, "VNNI is not tested: {:?}", available_backends());
    }
}

#[test]
fn q4_k_matmul_matches_reference() {
    matmul_matches_reference::<BlockQ4K>();
}

#[test]
fn q6_k_matmul_matches_reference() {
    matmul_matches_reference::<BlockQ6K>();
}

#[test]
fn shapes_are_checked() {
    let w = vec![BlockQ4K::ZERO; 2];
    let mut y = vec![0f32; 2];
    assert!(matmul_kquant(&[0f32; 128], 1, 128, &w, 2, &mut y).is_err());
    assert!(matmul_kquant(&[0f32; 256], 1, 256, &w, 3, &mut y).is_err());
    assert!(matmul_kquant(&[0f32; 256], 1, 256, &w, 2, &mut y).is_ok());
}

/// Activations quantize as llama.cpp's `quantize_row_q8_K_ref`: the value
/// of largest magnitude to -127 (the scale carries its sign), halves to
/// even, the scale the multiplier's reciprocal; an all-zero block stays 0.
#[test]
fn q8_k_activations_round_as_llama_cpp() {
    let mut x = [0f32; QK_K];
    x[..6].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -3.5, -126.5]);
    let b = BlockQ8K::quantize(&x);
    assert_eq!(b.qs[..6], [-127, 0, -2, -2, 4, 126]);
    assert_eq!(b.d.to_bits(), (1.0f32 / (-127.0f32 / 127.0)).to_bits());
    assert_eq!(b.bsums[0], -127 - 2 - 2 + 4 + 126);
    assert_eq!(BlockQ8K::quantize(&[0.0; QK_K]).qs, [0; QK_K]);
}

/// The SIMD quantizer behind `quantize_activations` writes the scalar
/// reference's blocks bit for bit: random rows, exact halves (ties to
/// even), equal magnitudes of both signs (the first one sets the sign),
/// zeros, NaN and infinities, and values that land just past 127.
#[test]
fn q8_k_activations_simd_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut rows: Vec<Vec<f32>> = (0..64).map(|_| random(&mut rng, QK_K)).collect();
    let halves: Vec<f32> = (0..QK_K).map(|i| (i as f32 - 128.0) + 0.5).collect();
    rows.push(halves);
    let mut both_signs = random(&mut rng, QK_K);
    (both_signs[40], both_signs[7]) = (3.0, -3.0);
    rows.push(both_signs.clone());
    (both_signs[7], both_signs[40]) = (3.0, -3.0);
    rows.push(both_signs);
    rows.push(vec![0.0; QK_K]);
    rows.push((0..QK_K).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }).collect());
    let mut specials = random(&mut rng, QK_K);
    (specials[3], specials[100], specials[255]) = (f32::NAN, f32::INFINITY, -f32::INFINITY);
    rows.push(specials);
    let mut nan_first = random(&mut rng, QK_K);
    nan_first[0] = f32::NAN;
    rows.push(nan_first);
    rows.push((0..QK_K).map(|i| 1.0 + i as f32 * 1e-7).collect());
    for (i, row) in rows.iter().enumerate() {
        let theirs = BlockQ8K::quantize(row.as_slice().try_into().unwrap());
        let ours = quantize_activations(row);
        assert_eq!(ours.len(), 1);
        assert_eq!(ours[0].qs, theirs.qs, "row {i}");
        assert_eq!(ours[0].bsums, theirs.bsums, "row {i}");
        assert_eq!(ours[0].d.to_bits(), theirs.d.to_bits(), "row {i}");
    }
    // Several blocks in one call, each on its own scale.
    let x = random(&mut rng, 7 * QK_K);
    let many = quantize_activations(&x);
    for (b, chunk) in many.iter().zip(x.chunks_exact(QK_K)) {
        assert_eq!(*b, BlockQ8K::quantize(chunk.try_into().unwrap()));
    }
}
