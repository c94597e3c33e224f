//! The fused element-wise kernels against their naive references, on random
//! inputs: odd widths, scattered positions, sizes on both sides of the
//! parallel threshold, and through the candle tensor bindings.

use candle_core::{Device, Tensor};
use kernels::cpu::{
    Gate, HeadNorm, Rope, add_in_place, add_in_place_op, add_rms_norm, add_rms_norm_op, gated_mul, rms_norm,
    rms_norm_into_op, rope_in_place, rope_in_place_op, silu_mul, silu_mul_into_op,
};
use kernels::reference;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rng: &mut StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}: element {i}: {g} vs {w}");
    }
}

#[test]
fn silu_mul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    // Small (one thread) and large (split over the pool) inputs.
    for (rows, inter) in [(1, 1), (1, 7), (3, 33), (17, 5632), (64, 1000)] {
        let gate_up = random(&mut rng, rows * 2 * inter, 6.0);
        let mut out = vec![0f32; rows * inter];
        silu_mul(&gate_up, inter, &mut out).unwrap();
        assert_close(&out, &reference::silu_mul(&gate_up, inter), 1e-5, &format!("{rows}x{inter}"));
    }
    // Far tails, where exp(-g) under- or overflows f32 (the kernel's
    // polynomial exp clamps its argument to [-87, 88]).
    let gate = [-1e4f32, -100.0, -88.9, -88.0, -87.2, -30.0, -1e-3, 0.0, 1e-3, 30.0, 87.2, 88.0, 88.9, 100.0, 1e4];
    let gate_up: Vec<f32> = gate.iter().copied().chain(gate.iter().map(|g| 1.0 + g.abs().min(3.0))).collect();
    let mut out = vec![f32::NAN; gate.len()];
    silu_mul(&gate_up, gate.len(), &mut out).unwrap();
    assert_close(&out, &reference::silu_mul(&gate_up, gate.len()), 1e-6, "tails");
}

#[test]
fn gelu_tanh_mul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for (rows, inter) in [(1, 1), (2, 9), (5, 256), (40, 2000)] {
        let gate_up = random(&mut rng, rows * 2 * inter, 6.0);
        let mut out = vec![f32::NAN; rows * inter];
        gated_mul(&gate_up, inter, Gate::GeluTanh, &mut out).unwrap();
        assert_close(&out, &reference::gelu_tanh_mul(&gate_up, inter), 1e-5, &format!("{rows}x{inter}"));
    }
    // Tails: GELU is ~0 far left and ~g far right; the cubic overflows exp's range there.
    let gate = [-1e4f32, -100.0, -12.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 12.0, 100.0, 1e4];
    let gate_up: Vec<f32> = gate.iter().copied().chain(gate.iter().map(|g| 0.5 + g.abs().min(2.0))).collect();
    let mut out = vec![f32::NAN; gate.len()];
    gated_mul(&gate_up, gate.len(), Gate::GeluTanh, &mut out).unwrap();
    assert_close(&out, &reference::gelu_tanh_mul(&gate_up, gate.len()), 1e-6, "tails");
}

#[test]
fn clamped_swiglu_mul_matches_reference() {
    let mut rng = StdRng::seed_from_u64(12);
    let gate = Gate::ClampedSwiglu { limit: 7.0 };
    for (rows, inter) in [(1, 1), (3, 17), (40, 2000)] {
        // Values to +-12: both clamps bite.
        let gate_up = random(&mut rng, rows * 2 * inter, 12.0);
        let mut out = vec![f32::NAN; rows * inter];
        gated_mul(&gate_up, inter, gate, &mut out).unwrap();
        assert_close(&out, &reference::clamped_swiglu_mul(&gate_up, inter, 7.0), 1e-5, &format!("{rows}x{inter}"));
    }
    let g = [-1e4f32, -100.0, -7.5, -1e-3, 0.0, 6.99, 7.0, 7.01, 100.0, 1e4];
    let gate_up: Vec<f32> = g.iter().copied().chain(g.iter().rev().copied()).collect();
    let mut out = vec![f32::NAN; g.len()];
    gated_mul(&gate_up, g.len(), gate, &mut out).unwrap();
    assert_close(&out, &reference::clamped_swiglu_mul(&gate_up, g.len(), 7.0), 1e-6, "tails");
}

#[test]
fn silu_mul_rejects_bad_shapes() {
    let mut out = vec![0f32; 3];
    assert!(silu_mul(&[0.0; 7], 3, &mut out).is_err());
    assert!(silu_mul(&[0.0; 6], 0, &mut out).is_err());
    assert!(silu_mul(&[0.0; 12], 3, &mut out).is_err());
}

#[test]
fn add_in_place_adds() {
    let mut rng = StdRng::seed_from_u64(2);
    for len in [1, 9, 70_001] {
        let (a, b) = (random(&mut rng, len, 3.0), random(&mut rng, len, 3.0));
        let mut got = a.clone();
        add_in_place(&mut got, &b).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_eq!(got, want);
    }
    assert!(add_in_place(&mut [0.0; 2], &[0.0; 3]).is_err());
}

fn inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)).collect()
}

/// cos/sin tables as the model builds them.
fn tables(max_pos: usize, inv_freq: &[f64]) -> (Vec<f32>, Vec<f32>) {
    let angles = (0..max_pos).flat_map(|p| inv_freq.iter().map(move |f| p as f64 * f));
    let angles: Vec<f64> = angles.collect();
    (angles.iter().map(|a| a.cos() as f32).collect(), angles.iter().map(|a| a.sin() as f32).collect())
}

#[test]
fn rope_matches_reference_on_scattered_positions() {
    let mut rng = StdRng::seed_from_u64(3);
    // (rows, q heads, kv heads, head_dim): fused qkv rows hold q, k, then v.
    // (rows, q heads, kv heads, head_dim, rotary_dim): partial rotary too.
    let shapes = [(1, 4, 2, 8, 8), (5, 3, 1, 64, 64), (33, 32, 4, 64, 32), (300, 16, 8, 128, 128), (7, 2, 2, 2, 2)];
    for (rows, qh, kvh, hd, rd) in shapes.into_iter().chain([(9, 4, 2, 32, 16), (40, 2, 1, 64, 2)]) {
        let row_len = (qh + 2 * kvh) * hd;
        let freq = inv_freq(rd, 10_000.0);
        let (cos, sin) = tables(4096, &freq);
        let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..4096)).collect();
        let x = random(&mut rng, rows * row_len, 2.0);
        for with_norm in [false, true] {
            let (qw, kw) = (random(&mut rng, hd, 1.5), random(&mut rng, hd, 1.5));
            let head_norm = with_norm.then_some(HeadNorm { q_heads: qh, q_weight: &qw, k_weight: &kw, eps: 1e-6 });
            let (positions, cos, sin) = (&positions, &cos, &sin);
            let rope = Rope { head_dim: hd, rotary_dim: rd, heads: qh + kvh, row_len, positions, cos, sin, head_norm };
            let mut got = x.clone();
            rope_in_place(&mut got, &rope).unwrap();
            let norm = with_norm.then_some((qh, &qw[..], &kw[..], 1e-6));
            let want = reference::rope(&x, row_len, qh + kvh, hd, positions, &freq, norm);
            assert_close(&got, &want, 2e-4, &format!("rows {rows} heads {qh}/{kvh} hd {hd}/{rd} norm {with_norm}"));
            // v, after the rotated heads, is untouched.
            for r in 0..rows {
                let v = (r * row_len + (qh + kvh) * hd)..(r + 1) * row_len;
                assert_eq!(got[v.clone()], x[v]);
            }
        }
    }
}

#[test]
fn rope_rejects_bad_input() {
    let (cos, sin) = tables(8, &inv_freq(4, 10_000.0));
    let rope = |positions, heads, head_dim| Rope {
        head_dim,
        rotary_dim: head_dim,
        heads,
        row_len: 8,
        positions,
        cos: &cos,
        sin: &sin,
        head_norm: None,
    };
    let mut x = vec![0f32; 16];
    assert!(rope_in_place(&mut x, &rope(&[0, 8], 2, 4)).is_err(), "position past the tables");
    assert!(rope_in_place(&mut x, &rope(&[0, 1], 3, 4)).is_err(), "more heads than the row holds");
    assert!(rope_in_place(&mut x, &rope(&[0], 2, 4)).is_err(), "rows and positions disagree");
    assert!(rope_in_place(&mut x, &rope(&[0, 1], 2, 3)).is_err(), "odd head_dim");
    assert!(rope_in_place(&mut x, &rope(&[0, 7], 2, 4)).is_ok());
    let wider = Rope { rotary_dim: 6, ..rope(&[0, 1], 2, 4) };
    assert!(rope_in_place(&mut x, &wider).is_err(), "more rotated dims than the head has");
}

#[test]
fn tensor_bindings_agree_with_slices() {
    let mut rng = StdRng::seed_from_u64(4);
    let dev = Device::Cpu;
    let gate_up = random(&mut rng, 3 * 2 * 40, 4.0);
    let t = Tensor::from_vec(gate_up.clone(), (3, 80), &dev).unwrap();
    let out = Tensor::zeros((3, 40), candle_core::DType::F32, &dev).unwrap();
    silu_mul_into_op(&t, &out).unwrap();
    let got: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
    assert_close(&got, &reference::silu_mul(&gate_up, 40), 1e-5, "silu_mul_into_op");

    let (a, b) = (random(&mut rng, 12, 1.0), random(&mut rng, 12, 1.0));
    let dst = Tensor::from_vec(a.clone(), (3, 4), &dev).unwrap();
    add_in_place_op(&dst, &Tensor::from_vec(b.clone(), (3, 4), &dev).unwrap()).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(dst.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    assert!(add_in_place_op(&dst, &Tensor::zeros((4, 3), candle_core::DType::F32, &dev).unwrap()).is_err());

    let freq = inv_freq(8, 10_000.0);
    let (cos, sin) = tables(64, &freq);
    let x = random(&mut rng, 2 * 24, 1.0);
    let t = Tensor::from_vec(x.clone(), (2, 24), &dev).unwrap();
    let positions = [5u32, 63];
    let rope = Rope {
        head_dim: 8,
        rotary_dim: 8,
        heads: 2,
        row_len: 24,
        positions: &positions,
        cos: &cos,
        sin: &sin,
        head_norm: None,
    };
    rope_in_place_op(&t, rope).unwrap();
    let want = reference::rope(&x, 24, 2, 8, &positions, &freq, None);
    assert_close(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &want, 1e-5, "rope_in_place_op");
}

#[test]
fn rms_norm_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for (rows, dim) in [(1, 1), (1, 7), (3, 64), (17, 2048), (64, 1000)] {
        let x = random(&mut rng, rows * dim, 4.0);
        let w = random(&mut rng, dim, 2.0);
        let mut out = vec![0f32; rows * dim];
        rms_norm(&x, &w, 1e-5, &mut out).unwrap();
        assert_close(&out, &reference::rms_norm(&x, &w, 1e-5), 1e-5, &format!("{rows}x{dim}"));
    }
    let mut out = vec![0f32; 6];
    assert!(rms_norm(&[0.0; 6], &[], 1e-5, &mut out).is_err());
    assert!(rms_norm(&[0.0; 6], &[1.0; 4], 1e-5, &mut out).is_err());
    assert!(rms_norm(&[0.0; 6], &[1.0; 3], 1e-5, &mut out[..3]).is_err());
}

/// The residual add fused with the next norm: `hidden` ends as the sum,
/// `out` as its norm, on sizes on both sides of the parallel threshold and
/// widths that are not whole vectors.
#[test]
fn add_rms_norm_matches_add_then_reference_norm() {
    let mut rng = StdRng::seed_from_u64(13);
    for (rows, dim) in [(1, 1), (1, 7), (3, 64), (1, 2048), (17, 2048), (64, 1000), (5, 4099)] {
        let hidden = random(&mut rng, rows * dim, 4.0);
        let delta = random(&mut rng, rows * dim, 4.0);
        let w = random(&mut rng, dim, 2.0);
        let sum: Vec<f32> = hidden.iter().zip(&delta).map(|(h, d)| h + d).collect();
        let mut got_hidden = hidden.clone();
        let mut out = vec![9f32; rows * dim];
        add_rms_norm(&mut got_hidden, &delta, &w, 1e-5, &mut out).unwrap();
        assert_eq!(got_hidden, sum, "{rows}x{dim}: the residual sum");
        assert_close(&out, &reference::rms_norm(&sum, &w, 1e-5), 1e-5, &format!("{rows}x{dim}"));
    }
    let mut out = vec![0f32; 6];
    assert!(add_rms_norm(&mut [0.0; 6], &[0.0; 6], &[], 1e-5, &mut out).is_err());
    assert!(add_rms_norm(&mut [0.0; 6], &[0.0; 4], &[1.0; 3], 1e-5, &mut out).is_err());
    assert!(add_rms_norm(&mut [0.0; 6], &[0.0; 6], &[1.0; 3], 1e-5, &mut out[..3]).is_err());

    // Through the tensor binding, into a view of a reused buffer.
    let dev = Device::Cpu;
    let (rows, dim) = (5, 96);
    let h_data = random(&mut rng, rows * dim, 3.0);
    let d_data = random(&mut rng, rows * dim, 3.0);
    let w = random(&mut rng, dim, 1.0);
    let hidden = Tensor::from_vec(h_data.clone(), (rows, dim), &dev).unwrap();
    let delta = Tensor::from_vec(d_data.clone(), (rows, dim), &dev).unwrap();
    let buffer = Tensor::full(9f32, (rows + 2, dim), &dev).unwrap();
    let view = buffer.narrow(0, 0, rows).unwrap();
    add_rms_norm_op(&hidden, &delta, &w, 1e-6, &view).unwrap();
    let sum: Vec<f32> = h_data.iter().zip(&d_data).map(|(h, d)| h + d).collect();
    assert_eq!(hidden.flatten_all().unwrap().to_vec1::<f32>().unwrap(), sum);
    let got: Vec<f32> = view.flatten_all().unwrap().to_vec1().unwrap();
    assert_close(&got, &reference::rms_norm(&sum, &w, 1e-6), 1e-5, "add_rms_norm_op");
    let rest: Vec<f32> = buffer.narrow(0, rows, 2).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert!(rest.iter().all(|&v| v == 9.0));
    assert!(add_rms_norm_op(&hidden, &delta, &w, 1e-6, &buffer).is_err(), "shapes differ");
}

/// The `_into` bindings write into views of reused buffers (garbage in,
/// rows past the view untouched) what the slice kernels compute.
#[test]
fn into_bindings_fill_views_of_reused_buffers() {
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(12);
    for rows in [1, 5, 40] {
        let (dim, inter) = (96, 70);
        let x = Tensor::from_vec(random(&mut rng, rows * dim, 3.0), (rows, dim), &dev).unwrap();
        let w = random(&mut rng, dim, 1.0);
        let buffer = Tensor::full(9f32, (rows + 2, dim), &dev).unwrap();
        let view = buffer.narrow(0, 0, rows).unwrap();
        rms_norm_into_op(&x, &w, 1e-6, &view).unwrap();
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let got: Vec<f32> = view.flatten_all().unwrap().to_vec1().unwrap();
        assert_close(&got, &reference::rms_norm(&xs, &w, 1e-6), 1e-5, "rms_norm_into_op");
        let rest: Vec<f32> = buffer.narrow(0, rows, 2).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert!(rest.iter().all(|&v| v == 9.0));

        let gate_up_data = random(&mut rng, rows * 2 * inter, 5.0);
        let gate_up = Tensor::from_vec(gate_up_data.clone(), (rows, 2 * inter), &dev).unwrap();
        let buffer = Tensor::full(9f32, (rows + 2, inter), &dev).unwrap();
        let view = buffer.narrow(0, 0, rows).unwrap();
        silu_mul_into_op(&gate_up, &view).unwrap();
        let mut want = vec![0f32; rows * inter];
        silu_mul(&gate_up_data, inter, &mut want).unwrap();
        assert_eq!(view.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        let rest: Vec<f32> = buffer.narrow(0, rows, 2).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert!(rest.iter().all(|&v| v == 9.0));
        assert!(silu_mul_into_op(&gate_up, &buffer).is_err(), "row counts differ");
        assert!(rms_norm_into_op(&x, &w, 1e-6, &buffer).is_err(), "shapes differ");
    }
}
