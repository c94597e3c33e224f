//! Q8_0 matmul on this machine: the 4-row tiles (`quant::PackedQ8_0`)
//! beside the 16-row panels (`q8_panel::PanelQ8_0`), at the m of decode,
//! batched decode and prefill, on a Qwen3-30B-A3B expert's gate/up and
//! down and a dense gate/up; then batch-1 decode alternated 30 times over
//! copies that miss every cache, in GB/s of weights (min/median/max).
//!
//! `cargo bench -p tinyvllm-kernels --bench q8_gemm` (`RAYON_NUM_THREADS`
//! sets the threads). The loader picks the panels where
//! `q8_panel::panels_pay()` (AVX2 or AVX-512 VNNI).

use std::time::Instant;

use kernels::cpu::q8_panel::{PanelQ8_0, matmul_panel_q8_0};
use kernels::cpu::quant::{PackedQ8_0, matmul_packed_q8_0, quantize_matrix_q8_0};

fn best(mut f: impl FnMut()) -> f64 {
    f();
    (0..8)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn weights(n: usize, k: usize) -> Vec<kernels::cpu::quant::BlockQ8_0> {
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 997) as f32 / 997.0 - 0.5).collect();
    quantize_matrix_q8_0(&w, n, k).expect("k is a multiple of 32")
}

fn main() {
    println!("threads: {}", rayon::current_num_threads());
    for (name, n, k) in [("expert gate/up", 1536, 2048), ("expert down", 2048, 768), ("dense gate/up", 11264, 2048)] {
        let q = weights(n, k);
        let groups = PackedQ8_0::pack(&q, n, k / 32).expect("consistent");
        let panels = PanelQ8_0::pack(&q, n, k / 32).expect("consistent");
        for m in [1usize, 2, 8, 32, 128, 512] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let mut y = vec![0f32; m * n];
            let rate = |t: f64| (m * n * k) as f64 / t / 1e9;
            let a = best(|| matmul_packed_q8_0(&x, m, &groups, &mut y).expect("shapes"));
            let b = best(|| matmul_panel_q8_0(&x, m, &panels, &mut y).expect("shapes"));
            println!("{name:15} [{n}x{k}] m {m:4}: 4-row tiles {:6.1}  panels {:6.1} GMAC/s", rate(a), rate(b));
        }
    }
    let (n, k, copies) = (11264, 2048, 8);
    let q = weights(n, k);
    let groups: Vec<_> = (0..copies).map(|_| PackedQ8_0::pack(&q, n, k / 32).expect("consistent")).collect();
    let panels: Vec<_> = (0..copies).map(|_| PanelQ8_0::pack(&q, n, k / 32).expect("consistent")).collect();
    let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut y = vec![0f32; n];
    let bytes = (groups[0].size_in_bytes() * copies) as f64;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let t = Instant::now();
        groups.iter().for_each(|w| matmul_packed_q8_0(&x, 1, w, &mut y).expect("shapes"));
        a.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        panels.iter().for_each(|w| matmul_panel_q8_0(&x, 1, w, &mut y).expect("shapes"));
        b.push(bytes / t.elapsed().as_secs_f64() / 1e9);
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    println!(
        "decode GB/s (min/median/max of 30, alternating): 4-row tiles {:.1}/{:.1}/{:.1}  panels {:.1}/{:.1}/{:.1}",
        a[0], a[15], a[29], b[0], b[15], b[29]
    );
}
