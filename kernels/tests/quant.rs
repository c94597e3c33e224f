//! Q8_0: quantization round trip, and the matmul against a naive reference
//! on random shapes (odd n, tails of the task split, m from 1 to 33).

use half::f16;
use kernels::cpu::quant::{
    BlockMxfp4, BlockQ4_0, BlockQ8_0, PackedQ8_0, QK8_0, QuantBlock, QuantError, dequantize_row, dequantize_row_q8_0,
    matmul_packed_q8_0, matmul_packed_q8_0_scalar, matmul_q8_0, matmul_q8_0_scalar, matmul_quant, matmul_quant_scalar,
    quantize_matrix, quantize_matrix_q8_0, quantize_row, quantize_row_q8_0,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// y = x @ W^T with x quantized and dequantized the same way the kernel does,
/// summed naively in f64.
fn reference<B: QuantBlock>(x: &[f32], m: usize, k: usize, w: &[B], n: usize) -> Vec<f32> {
    let kb = k / QK8_0;
    let mut wf = vec![0f32; n * k];
    for j in 0..n {
        dequantize_row(&w[j * kb..(j + 1) * kb], &mut wf[j * k..(j + 1) * k]);
    }
    let mut xf = vec![0f32; m * k];
    for i in 0..m {
        let mut blocks = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK8_0] }; kb];
        quantize_row_q8_0(&x[i * k..(i + 1) * k], &mut blocks).unwrap();
        dequantize_row_q8_0(&blocks, &mut xf[i * k..(i + 1) * k]);
    }
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k).map(|t| xf[i * k + t] as f64 * wf[j * k + t] as f64).sum();
            y[i * n + j] = s as f32;
        }
    }
    y
}

#[test]
fn round_trip_error_is_within_half_a_step() {
    let mut rng = StdRng::seed_from_u64(1);
    let x = random(&mut rng, 32 * 64, 3.0);
    let mut blocks = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; QK8_0] }; 64];
    quantize_row_q8_0(&x, &mut blocks).unwrap();
    let mut back = vec![0f32; x.len()];
    dequantize_row_q8_0(&blocks, &mut back);
    for (chunk, (orig, got)) in blocks.iter().zip(x.chunks(32).zip(back.chunks(32))) {
        let step = chunk.d.to_f32();
        for (a, b) in orig.iter().zip(got) {
            // Half a step, plus the f16 rounding of the scale itself.
            assert!((a - b).abs() <= 0.5 * step + 127.0 * step * 1e-3, "{a} vs {b} (step {step})");
        }
    }
    // All-zero blocks stay zero (no division by zero).
    let mut zero = [BlockQ8_0 { d: f16::ONE, qs: [1; QK8_0] }];
    quantize_row_q8_0(&[0.0; 32], &mut zero).unwrap();
    assert_eq!(zero[0].qs, [0; 32]);
}

#[test]
fn matmul_matches_the_reference_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(7);
    for &(m, n, k) in &[
        (1, 1, 32),
        (1, 5, 64),
        (2, 67, 96),
        (3, 129, 2048),
        (7, 300, 128),
        (16, 33, 256),
        (33, 17, 64),
        (1, 1000, 544),
    ] {
        let x = random(&mut rng, m * k, 2.0);
        let wf = random(&mut rng, n * k, 0.5);
        let w = quantize_matrix_q8_0(&wf, n, k).unwrap();
        let expected = reference(&x, m, k, &w, n);
        type MatmulFn = fn(&[f32], usize, usize, &[BlockQ8_0], usize, &mut [f32]) -> Result<(), QuantError>;
        let backends: [(&str, MatmulFn); 2] = [("dispatch", matmul_q8_0), ("scalar", matmul_q8_0_scalar)];
        let packed = PackedQ8_0::pack(&w, n, k / QK8_0).unwrap();
        assert_eq!(packed.unpack(), w, "pack and unpack give the blocks back");
        let packed_backends: [(&str, PackedFn); 2] =
            [("packed dispatch", matmul_packed_q8_0), ("packed scalar", matmul_packed_q8_0_scalar)];
        for (name, f) in backends {
            let mut y = vec![f32::NAN; m * n];
            f(&x, m, k, &w, n, &mut y).unwrap();
            assert_close(name, (m, n, k), &y, &expected);
        }
        for (name, f) in packed_backends {
            let mut y = vec![f32::NAN; m * n];
            f(&x, m, &packed, &mut y).unwrap();
            assert_close(name, (m, n, k), &y, &expected);
        }
    }
}

type PackedFn = fn(&[f32], usize, &PackedQ8_0, &mut [f32]) -> Result<(), QuantError>;

fn assert_close(name: &str, (m, n, k): (usize, usize, usize), y: &[f32], expected: &[f32]) {
    for (idx, (a, b)) in y.iter().zip(expected).enumerate() {
        let tol = 1e-4 * (1.0 + b.abs()) + 1e-5 * k as f32;
        assert!((a - b).abs() <= tol, "{name} m{m} n{n} k{k} at {idx}: {a} vs {b}");
    }
}

/// The packed layout: groups of 4 rows, codes 64-byte aligned, the last
/// group padded with zero rows that never reach y.
#[test]
fn packed_layout_groups_four_rows() {
    let mut rng = StdRng::seed_from_u64(5);
    let (n, k) = (6, 64);
    let w = quantize_matrix_q8_0(&random(&mut rng, n * k, 1.0), n, k).unwrap();
    let packed = PackedQ8_0::pack(&w, n, 2).unwrap();
    let (codes, scales) = packed.arrays();
    assert_eq!((codes.len(), scales.len()), (4, 4), "2 groups x 2 blocks");
    assert_eq!(codes.as_ptr() as usize % 64, 0);
    // Row 5 is row 1 of group 1; block 1 of it.
    assert_eq!(codes[2 + 1].0[1], w[5 * 2 + 1].qs);
    assert_eq!(scales[2 + 1][1], w[5 * 2 + 1].d);
    assert_eq!(codes[2 + 1].0[3], [0; QK8_0], "padding row");
    assert_eq!(packed.size_in_bytes(), 8 * 2 * 34);
    let mut y = vec![f32::NAN; 2 * n + 1];
    let x = random(&mut rng, 2 * k, 1.0);
    matmul_packed_q8_0(&x, 2, &packed, &mut y[..2 * n]).unwrap();
    assert!(y[..2 * n].iter().all(|v| v.is_finite()) && y[2 * n].is_nan(), "writes exactly y");
    assert!(matches!(PackedQ8_0::pack(&w, n, 3), Err(QuantError::Shape(_))));
    assert!(matches!(matmul_packed_q8_0(&x, 1, &packed, &mut y), Err(QuantError::Shape(_))));
}

#[test]
fn close_to_the_unquantized_product() {
    // What quantization costs: relative error of a few parts in a thousand.
    let mut rng = StdRng::seed_from_u64(3);
    let (m, n, k) = (4, 64, 1024);
    let x = random(&mut rng, m * k, 1.0);
    let wf = random(&mut rng, n * k, 1.0);
    let w = quantize_matrix_q8_0(&wf, n, k).unwrap();
    let mut y = vec![0f32; m * n];
    matmul_q8_0(&x, m, k, &w, n, &mut y).unwrap();
    let (mut err, mut norm) = (0f64, 0f64);
    for i in 0..m {
        for j in 0..n {
            let exact: f64 = (0..k).map(|t| x[i * k + t] as f64 * wf[j * k + t] as f64).sum();
            err += (y[i * n + j] as f64 - exact).powi(2);
            norm += exact * exact;
        }
    }
    let rel = (err / norm).sqrt();
    assert!(rel < 0.02, "relative error {rel}");
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let w = vec![BlockQ8_0 { d: f16::ONE, qs: [0; QK8_0] }; 2];
    let mut y = vec![0f32; 2];
    assert_eq!(matmul_q8_0(&[0.0; 40], 1, 40, &w, 2, &mut y), Err(QuantError::NotBlockAligned(40)));
    assert!(matches!(matmul_q8_0(&[0.0; 31], 1, 32, &w, 2, &mut y), Err(QuantError::Shape(_))));
    assert!(matches!(quantize_matrix_q8_0(&[0.0; 64], 3, 32), Err(QuantError::Shape(_))));
}

/// Q4_0 codes are 4-bit, weight j in the low nibble of byte j and weight
/// j + 16 in its high nibble; the largest-magnitude weight maps to code 0.
#[test]
fn q4_0_round_trip_and_layout() {
    let mut rng = StdRng::seed_from_u64(11);
    let x = random(&mut rng, 32 * 16, 2.0);
    let mut blocks = vec![BlockQ4_0::ZERO; 16];
    quantize_row(&x, &mut blocks).unwrap();
    let mut back = vec![0f32; x.len()];
    dequantize_row(&blocks, &mut back);
    for (block, (orig, got)) in blocks.iter().zip(x.chunks(32).zip(back.chunks(32))) {
        let step = block.d.to_f32().abs();
        for (a, b) in orig.iter().zip(got) {
            // Half a step, except next to -max (the side with only 7 codes,
            // clamped as in GGML): up to a whole step.
            assert!((a - b).abs() <= step * 1.01 + 1e-6, "{a} vs {b} (step {step})");
        }
    }
    let mut ramp = [0f32; 32];
    ramp[0] = -8.0;
    ramp[17] = 3.0;
    let b = BlockQ4_0::quantize(&ramp);
    assert_eq!(b.d.to_f32(), 1.0);
    assert_eq!(b.qs[0] & 0x0F, 0, "weight 0 = -8 -> code 0");
    assert_eq!(b.qs[1] >> 4, 11, "weight 17 = 3 -> code 11");
}

#[test]
fn q4_0_matmul_matches_the_reference_on_random_shapes() {
    let mut rng = StdRng::seed_from_u64(17);
    for &(m, n, k) in
        &[(1, 1, 32), (1, 7, 64), (2, 67, 96), (3, 130, 2048), (5, 301, 160), (16, 33, 256), (1, 1000, 544)]
    {
        let x = random(&mut rng, m * k, 2.0);
        let wf = random(&mut rng, n * k, 0.5);
        let w: Vec<BlockQ4_0> = quantize_matrix(&wf, n, k).unwrap();
        let expected = reference(&x, m, k, &w, n);
        type MatmulFn = fn(&[f32], usize, usize, &[BlockQ4_0], usize, &mut [f32]) -> Result<(), QuantError>;
        let backends: [(&str, MatmulFn); 2] = [("dispatch", matmul_quant), ("scalar", matmul_quant_scalar)];
        for (name, f) in backends {
            let mut y = vec![f32::NAN; m * n];
            f(&x, m, k, &w, n, &mut y).unwrap();
            for (idx, (a, b)) in y.iter().zip(&expected).enumerate() {
                let tol = 1e-4 * (1.0 + b.abs()) + 1e-5 * k as f32;
                assert!((a - b).abs() <= tol, "{name} m{m} n{n} k{k} at {idx}: {a} vs {b}");
            }
        }
    }
}

/// MXFP4 (gpt-oss's experts): random codes under exponents far outside
/// f16's range (2^-40 .. 2^40), weights and activations read from the
/// middle of NaN-filled buffers; every backend against the f64 reference.
#[test]
fn mxfp4_matmul_matches_the_reference_on_scattered_inputs() {
    let mut rng = StdRng::seed_from_u64(39);
    for &(m, n, k) in &[(1, 1, 32), (1, 9, 64), (2, 67, 96), (3, 130, 2880), (5, 37, 160), (16, 33, 256), (1, 700, 544)]
    {
        let kb = k / 32;
        let base = rng.random_range(88..168u8);
        let mut blocks = vec![BlockMxfp4 { e: 0xFF, qs: [0xFF; 16] }; n * kb + 7];
        for b in &mut blocks[3..3 + n * kb] {
            *b = BlockMxfp4 { e: base + rng.random_range(0..8u8), qs: std::array::from_fn(|_| rng.random()) };
        }
        let w = &blocks[3..3 + n * kb];
        let mut xs = vec![f32::NAN; m * k + 11];
        xs[5..5 + m * k].copy_from_slice(&random(&mut rng, m * k, 2.0));
        let x = &xs[5..5 + m * k];
        let expected = reference(x, m, k, w, n);
        type MatmulFn = fn(&[f32], usize, usize, &[BlockMxfp4], usize, &mut [f32]) -> Result<(), QuantError>;
        let backends: [(&str, MatmulFn); 2] = [("dispatch", matmul_quant), ("scalar", matmul_quant_scalar)];
        for (name, f) in backends {
            let mut y = vec![f32::NAN; m * n];
            f(x, m, k, w, n, &mut y).unwrap();
            for (idx, (a, b)) in y.iter().zip(&expected).enumerate() {
                let row_scale = w[(idx % n) * kb..][..kb].iter().map(|b| b.scale()).fold(0f32, f32::max);
                let tol = (1e-4 * b.abs()).max(1e-5 * k as f32 * row_scale);
                assert!((a - b).abs() <= tol, "{name} m{m} n{n} k{k} at {idx}: {a} vs {b}");
            }
        }
    }
}
