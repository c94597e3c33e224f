//! A TinyLlama-1.1B decode step's matmuls back to back, as the worker runs
//! them: 22 layers of qkv, o, gate/up and down, then lm_head (89 calls,
//! m = 1), weights in f16 panels and in Q8_0 VNNI panels (where the CPU has
//! them), in huge pages, called from a thread of the pool. Next to it, the
//! read limit the worker's `bench --profile` divides by
//! (`kernels::cpu::measure_read_bandwidth`, best pass of wide loads), and each shape's time per
//! call, whose excess over bytes / probe is what a call costs beyond
//! streaming its weights.
//!
//! `RAYON_NUM_THREADS=2 cargo bench -p tinyvllm-kernels --bench decode_step`

use std::time::Instant;

use half::f16;
use kernels::cpu::packed::{PackedWeight, matmul_packed, packing_pays};
use kernels::cpu::q8_panel::{PanelQ8_0, matmul_panel_q8_0, vnni_available};
use kernels::cpu::quant::quantize_matrix_q8_0;
use kernels::cpu::{back_with_huge_pages, measure_read_bandwidth};

/// One layer's matmuls (name, n, k), q/k/v and gate/up stacked as the
/// model stacks them; then lm_head.
const LAYER: [(&str, usize, usize); 4] =
    [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)];
const LAYERS: usize = 22;
const LM_HEAD: (usize, usize) = (32000, 2048);
const ROUNDS: usize = 5;

fn weights(n: usize, k: usize, salt: usize) -> Vec<f32> {
    (0..n * k).map(|i| (((i + salt) * 31) % 997) as f32 / 997.0 - 0.5).collect()
}

/// Times `ROUNDS` steps of `call(layer, matrix)` (matrix 4 is lm_head) and
/// prints GB/s per step and time per call of each shape.
fn run(format: &str, bytes: &[usize; 5], mut call: impl FnMut(usize, usize)) {
    let total = LAYERS * bytes[..4].iter().sum::<usize>() + bytes[4];
    let mut per_shape = [0f64; 5];
    let mut steps = Vec::new();
    let before = measure_read_bandwidth().limit_gb_s;
    for _ in 0..ROUNDS {
        let step = Instant::now();
        for l in 0..=LAYERS {
            for (j, t) in per_shape.iter_mut().enumerate() {
                // Layers 0..LAYERS run shapes 0..4; then lm_head (4) alone.
                if (l == LAYERS) != (j == 4) {
                    continue;
                }
                let c = Instant::now();
                call(l, j);
                *t += c.elapsed().as_secs_f64();
            }
        }
        steps.push(step.elapsed().as_secs_f64());
    }
    // The limit: the better of the probes before and after the steps.
    let read = before.max(measure_read_bandwidth().limit_gb_s);
    steps.sort_by(f64::total_cmp);
    let gbs = total as f64 / steps[ROUNDS / 2] / 1e9;
    println!(
        "{format:5} step: {:.2} ms, {gbs:.1} GB/s = {:.1}% of the probe's {read:.1} GB/s",
        steps[ROUNDS / 2] * 1e3,
        100.0 * gbs / read
    );
    for (j, name) in LAYER.iter().map(|l| l.0).chain(["lm_head"]).enumerate() {
        let calls = if j == 4 { ROUNDS } else { ROUNDS * LAYERS };
        let us = per_shape[j] / calls as f64 * 1e6;
        let ideal = bytes[j] as f64 / (read * 1e3);
        println!(
            "  {name:8} {us:8.1} us a call, {:5.1} GB/s, {:+6.1} us beyond bytes / probe",
            bytes[j] as f64 / us / 1e3,
            us - ideal
        );
    }
}

fn main() {
    // On a pool thread, as the worker's step loop: a call from outside the
    // pool would add two cross-thread wake-ups to every matmul.
    rayon::scope(|_| steps());
}

fn steps() {
    println!("threads: {}", rayon::current_num_threads());
    let x: Vec<f32> = (0..5632).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let shapes: Vec<(usize, usize)> = LAYER.iter().map(|&(_, n, k)| (n, k)).chain([LM_HEAD]).collect();
    let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0f32; n]).collect();
    // Layer l's matrices: the 4 of LAYER, or lm_head alone after the last.
    let parts = |l: usize| if l == LAYERS { vec![4] } else { (0..4).collect::<Vec<usize>>() };
    let pick = |l: usize, j: usize| if l == LAYERS { 0 } else { j };
    if packing_pays() {
        let w: Vec<Vec<PackedWeight<f16>>> = (0..=LAYERS)
            .map(|l| {
                parts(l)
                    .into_iter()
                    .map(|j| {
                        let (n, k) = shapes[j];
                        let h: Vec<f16> = weights(n, k, l).iter().map(|&v| f16::from_f32(v)).collect();
                        let p = PackedWeight::pack(&h, n, k).expect("shape");
                        back_with_huge_pages(p.allocation());
                        p
                    })
                    .collect()
            })
            .collect();
        let bytes =
            std::array::from_fn(|j| if j == 4 { w[LAYERS][0].size_in_bytes() } else { w[0][j].size_in_bytes() });
        run("f16", &bytes, |l, j| {
            matmul_packed(&x[..shapes[j].1], 1, &w[l][pick(l, j)], None, &mut ys[j]).expect("shapes");
        });
    }
    if vnni_available() {
        let w: Vec<Vec<PanelQ8_0>> = (0..=LAYERS)
            .map(|l| {
                parts(l)
                    .into_iter()
                    .map(|j| {
                        let (n, k) = shapes[j];
                        let q = quantize_matrix_q8_0(&weights(n, k, l), n, k).expect("aligned");
                        let p = PanelQ8_0::pack(&q, n, k / 32).expect("shape");
                        let (codes, scales) = p.allocations();
                        back_with_huge_pages(codes);
                        back_with_huge_pages(scales);
                        p
                    })
                    .collect()
            })
            .collect();
        let bytes =
            std::array::from_fn(|j| if j == 4 { w[LAYERS][0].size_in_bytes() } else { w[0][j].size_in_bytes() });
        run("q8_0v", &bytes, |l, j| {
            matmul_panel_q8_0(&x[..shapes[j].1], 1, &w[l][pick(l, j)], &mut ys[j]).expect("shapes");
        });
    }
}
