//! The grouped expert kernels (`kernels::cpu::moe`) against the naive
//! reference (`kernels::reference::moe_linear`): random routings over
//! dense, Q8_0 and Q4_K experts, with scattered inputs (experts nobody
//! chose, one expert taking every token, a single token, tokens in
//! shuffled order, inputs read from the middle of larger buffers).

use kernels::cpu::kquant::{self, BlockQ4K, KPanels, QK_K, matmul_kpanels};
use kernels::cpu::matmul::matmul_xwt;
use kernels::cpu::moe::{ExpertGroups, ExpertLinear, combine, gather_rows, grouped_matmul};
use kernels::cpu::quant::{PackedQ8_0, QK, dequantize_row_q8_0, matmul_packed_q8_0, quantize_matrix_q8_0};
use kernels::reference;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// An expert in one of the formats the model keeps, with its weights as
/// the kernel sees them (dequantized) for the reference.
enum Expert {
    Dense { w: Vec<f32>, n: usize, k: usize },
    Q8_0(PackedQ8_0),
    Q4K(KPanels<BlockQ4K>),
}

impl ExpertLinear for Expert {
    fn dims(&self) -> (usize, usize) {
        match self {
            Self::Dense { n, k, .. } => (*n, *k),
            Self::Q8_0(w) => (w.dims().0, w.dims().1 * QK),
            Self::Q4K(w) => (w.dims().0, w.dims().1 * QK_K),
        }
    }

    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> kernels::Result<()> {
        let err = |e: kernels::cpu::quant::QuantError| kernels::KernelError::Invalid(e.to_string());
        match self {
            Self::Dense { w, n, k } => matmul_xwt(x, m, *k, w, *n, None, y),
            Self::Q8_0(w) => matmul_packed_q8_0(x, m, w, y).map_err(err)?,
            Self::Q4K(w) => matmul_kpanels(x, m, w, y).map_err(err)?,
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum Format {
    Dense,
    Q8_0,
    Q4K,
}

/// `count` random experts `[n, k]` and their weights as the kernel sees them.
fn experts(rng: &mut StdRng, format: Format, count: usize, (n, k): (usize, usize)) -> (Vec<Expert>, Vec<Vec<f32>>) {
    (0..count)
        .map(|_| {
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0f32)).collect();
            match format {
                Format::Dense => (Expert::Dense { w: w.clone(), n, k }, w),
                Format::Q8_0 => {
                    let blocks = quantize_matrix_q8_0(&w, n, k).unwrap();
                    let mut seen = vec![0f32; n * k];
                    dequantize_row_q8_0(&blocks, &mut seen);
                    (Expert::Q8_0(PackedQ8_0::pack(&blocks, n, k / QK).unwrap()), seen)
                }
                Format::Q4K => {
                    let blocks = kquant::quantize_matrix::<BlockQ4K>(&w, n, k).unwrap();
                    let mut seen = vec![0f32; n * k];
                    kquant::dequantize_row(&blocks, &mut seen);
                    (Expert::Q4K(KPanels::pack(&blocks, n, k / QK_K).unwrap()), seen)
                }
            }
        })
        .unzip()
}

/// Each token's `per_token` distinct experts drawn from `pool` (a subset,
/// so some experts go unchosen), with positive weights.
fn routing(rng: &mut StdRng, tokens: usize, per_token: usize, pool: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut choices = Vec::new();
    for _ in 0..tokens {
        let mut p = pool.to_vec();
        p.shuffle(rng);
        choices.extend_from_slice(&p[..per_token]);
    }
    let weights = (0..choices.len()).map(|_| rng.random_range(0.05..1.0f32)).collect();
    (choices, weights)
}

/// gather, grouped matmul, combine: the kernels' whole chain, reading x
/// from the middle of a larger buffer.
fn run_chain(experts: &[Expert], groups: &ExpertGroups, x: &[f32], (n, k): (usize, usize)) -> Vec<f32> {
    let mut padded = vec![f32::NAN; x.len() + 2 * k];
    padded[k..k + x.len()].copy_from_slice(x);
    let x = &padded[k..k + x.len()];
    let mut xg = vec![f32::NAN; groups.num_pairs() * k];
    gather_rows(x, k, groups, &mut xg).unwrap();
    let mut yg = vec![f32::NAN; groups.num_pairs() * n];
    grouped_matmul(experts, groups, &xg, &mut yg).unwrap();
    let mut out = vec![f32::NAN; groups.num_tokens() * n];
    combine(&yg, n, groups, &mut out).unwrap();
    out
}

fn assert_close(got: &[f32], want: &[f32], tol: impl Fn(f32) -> f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol(*w), "{what}: element {i}: {g} vs {w}");
    }
}

/// How far an output may be from the f64 reference. The quantized kernels
/// round the activations to 8 bits too (steps of |x|max / 127 = 0.016
/// here), which moves a dot product of k terms by about 0.005 sqrt(k) per
/// unit of routing weight; a wrong row or expert moves it by its whole
/// size (about sqrt(k) / 2).
fn tolerance(format: Format, k: usize, weights: f32) -> impl Fn(f32) -> f32 {
    move |want: f32| match format {
        Format::Dense => 1e-4 * (1.0 + want.abs()),
        Format::Q8_0 | Format::Q4K => 0.02 * (k as f32).sqrt() * weights,
    }
}

#[test]
fn grouped_experts_match_the_reference_for_every_routing() {
    let mut rng = StdRng::seed_from_u64(55);
    for format in [Format::Dense, Format::Q8_0, Format::Q4K] {
        let (n, k) = match format {
            Format::Q4K => (48, 512),
            _ => (40, 96),
        };
        let num = 12;
        let (exps, seen) = experts(&mut rng, format, num, (n, k));
        let everyone: Vec<u32> = (0..num as u32).collect();
        // (tokens, per token, the experts they may choose)
        let cases: Vec<(usize, usize, Vec<u32>)> = vec![
            (1, 1, everyone.clone()),         // one token, one expert: a GEMV
            (1, 4, everyone.clone()),         // batch-1 decode, top 4
            (16, 4, vec![2, 5, 7, 11]),       // every token on the same 4 experts
            (37, 3, vec![0, 1, 3, 8, 9, 10]), // half the experts never chosen
            (64, 8, everyone.clone()),        // prefill: many rows per expert
            (5, 12, everyone.clone()),        // every expert, every token
        ];
        for (tokens, per, pool) in cases {
            let (choices, weights) = routing(&mut rng, tokens, per, &pool);
            let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-2.0..2.0f32)).collect();
            let groups = ExpertGroups::new(num, per, &choices, &weights).unwrap();
            let got = run_chain(&exps, &groups, &x, (n, k));
            let want = reference::moe_linear(&x, (n, k), &seen, per, &choices, &weights);
            let what = format!("{format:?}, {tokens} tokens x {per} of {pool:?}");
            assert_close(&got, &want, tolerance(format, k, per as f32), &what);
        }
    }
}

/// Grouping is a rearrangement: each expert's rows give exactly what its
/// own matmul gives on them, and the sum adds them in expert order.
#[test]
fn grouped_experts_equal_one_matmul_per_expert_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(56);
    let (n, k, num, per, tokens) = (64, 128, 8, 2, 29);
    let (exps, _) = experts(&mut rng, Format::Q8_0, num, (n, k));
    let everyone: Vec<u32> = (0..num as u32).collect();
    let (choices, weights) = routing(&mut rng, tokens, per, &everyone);
    let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-1.0..1.0f32)).collect();
    let groups = ExpertGroups::new(num, per, &choices, &weights).unwrap();
    let got = run_chain(&exps, &groups, &x, (n, k));
    let mut want = vec![0f32; tokens * n];
    for (e, expert) in exps.iter().enumerate() {
        let rows: Vec<usize> = (0..tokens).filter(|t| choices[t * per..][..per].contains(&(e as u32))).collect();
        let xe: Vec<f32> = rows.iter().flat_map(|&t| x[t * k..][..k].to_vec()).collect();
        let mut ye = vec![0f32; rows.len() * n];
        expert.matmul(&xe, rows.len(), &mut ye).unwrap();
        for (r, &t) in rows.iter().enumerate() {
            let c = choices[t * per..][..per].iter().position(|&c| c == e as u32).unwrap();
            let w = weights[t * per + c];
            want[t * n..][..n].iter_mut().zip(&ye[r * n..][..n]).for_each(|(o, &y)| *o += w * y);
        }
    }
    assert_eq!(got, want);
}

#[test]
fn grouped_matmul_refuses_mismatched_shapes() {
    let mut rng = StdRng::seed_from_u64(57);
    let (exps, _) = experts(&mut rng, Format::Dense, 3, (8, 16));
    let groups = ExpertGroups::new(3, 1, &[0, 2], &[1.0, 1.0]).unwrap();
    let xg = vec![0f32; 2 * 16];
    assert!(grouped_matmul(&exps, &groups, &xg, &mut [0f32; 2 * 7]).is_err(), "short output");
    assert!(grouped_matmul(&exps, &groups, &xg[..16], &mut [0f32; 2 * 8]).is_err(), "short input");
    let four = ExpertGroups::new(4, 1, &[0, 3], &[1.0, 1.0]).unwrap();
    assert!(grouped_matmul(&exps, &four, &xg, &mut [0f32; 2 * 8]).is_err(), "routing over more experts");
    let mut out = vec![0f32; 2 * 8];
    assert!(combine(&[0f32; 3 * 8], 8, &groups, &mut out).is_err(), "pairs and outputs disagree");
}
