//! Compute-bound CPU matmul: `x[m, k] @ W[n, k]^T` with f16 weights for the
//! m of prefill chunks and batched decode, on TinyLlama-1.1B's stacked
//! shapes, in GFLOP/s (best of 5 calls), row-major (`matmul_xwt`) and, where
//! the machine packs weights, in panels (`matmul_packed`). Compare with the
//! FMA peak (an AVX2 core: 2 FMAs of 8 lanes per cycle, ~99 GFLOP/s at
//! 3.1 GHz; AVX-512 doubles the lanes).
//!
//! `cargo bench -p tinyvllm-kernels --bench cpu_gemm [-- M...]`
//! (default m = 1 4 16 64; `RAYON_NUM_THREADS` sets the thread count).

use std::time::Instant;

use half::f16;
use kernels::cpu::back_with_huge_pages;
use kernels::cpu::matmul::matmul_xwt;
use kernels::cpu::packed::{PackedWeight, matmul_packed, packing_pays};

/// (name, n, k): fused q/k/v, fused gate/up, down.
const SHAPES: [(&str, usize, usize); 3] =
    [("qkv 2560x2048", 2560, 2048), ("gate/up 11264x2048", 11264, 2048), ("down 2048x5632", 2048, 5632)];

/// Best of 5 timed calls after one warm-up, in seconds.
fn best_of_5(mut call: impl FnMut()) -> f64 {
    call();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            call();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let ms: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let ms = if ms.is_empty() { vec![1, 4, 16, 64] } else { ms };
    println!("threads: {}", rayon::current_num_threads());
    for (name, n, k) in SHAPES {
        let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i * 31) % 997) as f32 / 997.0 - 0.5)).collect();
        let packed = packing_pays().then(|| PackedWeight::pack(&w, n, k).expect("consistent shape"));
        // As the worker places its weights (transparent huge pages where the kernel has them).
        back_with_huge_pages(&w);
        if let Some(p) = &packed {
            back_with_huge_pages(p.allocation());
        }
        for &m in &ms {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let mut y = vec![0f32; m * n];
            let flop = 2.0 * (m * n * k) as f64;
            let t = best_of_5(|| matmul_xwt(&x, m, k, &w, n, None, &mut y));
            print!("{name:20} m {m:3}  row-major {:8.3} ms {:6.1} GFLOP/s", t * 1e3, flop / t / 1e9);
            if let Some(p) = &packed {
                let t = best_of_5(|| matmul_packed(&x, m, p, None, &mut y).expect("consistent shapes"));
                print!("  packed {:8.3} ms {:6.1} GFLOP/s", t * 1e3, flop / t / 1e9);
            }
            println!();
        }
    }
}
