//! Decode-shaped CPU kernel benchmark: memory read bandwidth (the limit for
//! batch-1 decode) and `x[1, k] @ W[n, k]^T` per weight format, with weights
//! rotated through more than 512 MiB so they come from DRAM, not cache.
//!
//! Last, the same GEMVs on weights that stay in cache: the kernels' compute
//! ceiling on this CPU.
//!
//! `cargo bench -p tinyvllm-kernels --bench cpu_decode`
//! (`RAYON_NUM_THREADS` sets the thread count; default: all cores).

use std::hint::black_box;
use std::time::{Duration, Instant};

use half::f16;
use kernels::cpu::matmul::matmul_xwt;
use kernels::cpu::packed::{PackedWeight, matmul_packed, packing_pays};
use kernels::cpu::q8_panel::{PanelQ8_0, matmul_panel_q8_0, vnni_available};
use kernels::cpu::quant::{BlockQ8_0, PackedQ8_0, QK8_0, matmul_packed_q8_0, matmul_q8_0, quantize_matrix_q8_0};
use rayon::prelude::*;

/// TinyLlama-1.1B's decode matmuls: (name, n, k).
const SHAPES: [(&str, usize, usize); 4] = [
    ("q/o 2048x2048", 2048, 2048),
    ("k/v 256x2048", 256, 2048),
    ("gate/up 5632x2048", 5632, 2048),
    ("down 2048x5632", 2048, 5632),
];
/// One decoder layer's matmuls in the order the model runs them.
const LAYER: [usize; 7] = [0, 1, 1, 0, 2, 2, 3];
const ROTATE_BYTES: usize = 768 << 20;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn read_bandwidth() -> f64 {
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = buf.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b))).sum();
        black_box(s);
        times.push(t.elapsed());
    }
    (words * 8) as f64 / median(times).as_secs_f64() / 1e9
}

/// Times `f(copy)` over enough weight copies to defeat the caches; returns
/// (median time per call, GB/s of weight bytes).
fn time_rotating(copies: usize, bytes: usize, mut f: impl FnMut(usize)) -> (Duration, f64) {
    for c in 0..copies {
        f(c);
    }
    let mut times = Vec::new();
    for it in 0..(copies * 4).max(40) {
        let t = Instant::now();
        f(it % copies);
        times.push(t.elapsed());
    }
    let d = median(times);
    (d, bytes as f64 / d.as_secs_f64() / 1e9)
}

fn main() {
    println!("threads: {}", rayon::current_num_threads());
    println!("read bandwidth: {:.1} GB/s", read_bandwidth());
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("thread pool");
    println!("read bandwidth, 1 thread: {:.1} GB/s", one.install(read_bandwidth));
    for (name, n, k) in SHAPES {
        let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut y = vec![0f32; n];
        let base: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 997) as f32 / 997.0 - 0.5).collect();

        let bytes = n * k * 2;
        let copies = ROTATE_BYTES.div_ceil(bytes);
        let base16: Vec<f16> = base.iter().map(|&v| f16::from_f32(v)).collect();
        let w16: Vec<Vec<f16>> = (0..copies).map(|_| base16.clone()).collect();
        let (d, gbs) = time_rotating(copies, bytes, |c| matmul_xwt(&x, 1, k, &w16[c], n, None, &mut y));
        println!("{name:20} f16   {:7.3} ms  {gbs:5.1} GB/s", d.as_secs_f64() * 1e3);
        if packing_pays() {
            let wp: Vec<PackedWeight<f16>> = w16.iter().map(|w| PackedWeight::pack(w, n, k).expect("shape")).collect();
            drop(w16);
            let (d, gbs) =
                time_rotating(copies, bytes, |c| matmul_packed(&x, 1, &wp[c], None, &mut y).expect("shapes"));
            println!("{name:20} f16p  {:7.3} ms  {gbs:5.1} GB/s", d.as_secs_f64() * 1e3);
        }

        let bytes = n * k / QK8_0 * size_of::<BlockQ8_0>();
        let copies = ROTATE_BYTES.div_ceil(bytes);
        let q = quantize_matrix_q8_0(&base, n, k).expect("aligned");
        let wq: Vec<Vec<BlockQ8_0>> = (0..copies).map(|_| q.clone()).collect();
        let (d, gbs) = time_rotating(copies, bytes, |c| matmul_q8_0(&x, 1, k, &wq[c], n, &mut y).expect("shapes"));
        println!("{name:20} q8_0  {:7.3} ms  {gbs:5.1} GB/s", d.as_secs_f64() * 1e3);
        drop(wq);
        let wp: Vec<PackedQ8_0> = (0..copies).map(|_| PackedQ8_0::pack(&q, n, k / QK8_0).expect("shape")).collect();
        let (d, gbs) = time_rotating(copies, bytes, |c| matmul_packed_q8_0(&x, 1, &wp[c], &mut y).expect("shapes"));
        println!("{name:20} q8_0p {:7.3} ms  {gbs:5.1} GB/s", d.as_secs_f64() * 1e3);
        drop(wp);
        if vnni_available() {
            let wv: Vec<PanelQ8_0> = (0..copies).map(|_| PanelQ8_0::pack(&q, n, k / QK8_0).expect("shape")).collect();
            let (d, gbs) = time_rotating(copies, bytes, |c| matmul_panel_q8_0(&x, 1, &wv[c], &mut y).expect("shapes"));
            println!("{name:20} q8_0v {:7.3} ms  {gbs:5.1} GB/s", d.as_secs_f64() * 1e3);
        }
    }
    layer_sequence();
    cache_resident();
}

/// The kernels' compute ceiling: the same GEMV on weights that stay in
/// cache (256 rows x 2048 per thread: 1 MiB in f16, L2 plus the shared L3),
/// so no DRAM traffic bounds it, and calls long enough (~80 us) that their
/// fixed cost (waking the pool, quantizing x) stays small. Where this is
/// not well above the read bandwidth, decode is bound by instruction
/// throughput (f16 widening, int8 multiply-adds), not by memory.
fn cache_resident() {
    let all = rayon::current_num_threads();
    for threads in [1, all] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
        let (n, k) = (256 * threads, 2048);
        let base: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 997) as f32 / 997.0 - 0.5).collect();
        let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut y = vec![0f32; n];
        let w16: Vec<f16> = base.iter().map(|&v| f16::from_f32(v)).collect();
        let q = quantize_matrix_q8_0(&base, n, k).expect("aligned");
        pool.install(|| {
            let (_, gbs) = time_rotating(1, n * k * 2, |_| matmul_xwt(&x, 1, k, &w16, n, None, &mut y));
            println!("{:20} f16   {gbs:5.1} GB/s  ({threads} thread(s))", "weights in cache");
            let bytes = n * k / QK8_0 * size_of::<BlockQ8_0>();
            let (_, gbs) = time_rotating(1, bytes, |_| matmul_q8_0(&x, 1, k, &q, n, &mut y).expect("shapes"));
            println!("{:20} q8_0  {gbs:5.1} GB/s  ({threads} thread(s))", "weights in cache");
            let p = PackedQ8_0::pack(&q, n, k / QK8_0).expect("shape");
            let (_, gbs) = time_rotating(1, bytes, |_| matmul_packed_q8_0(&x, 1, &p, &mut y).expect("shapes"));
            println!("{:20} q8_0p {gbs:5.1} GB/s  ({threads} thread(s))", "weights in cache");
            if vnni_available() {
                let v = PanelQ8_0::pack(&q, n, k / QK8_0).expect("shape");
                let (_, gbs) = time_rotating(1, bytes, |_| matmul_panel_q8_0(&x, 1, &v, &mut y).expect("shapes"));
                println!("{:20} q8_0v {gbs:5.1} GB/s  ({threads} thread(s))", "weights in cache");
            }
        });
    }
}

/// A whole layer's f16 matmuls back to back, as in a decode step: the
/// difference from the per-shape figures is per-call overhead (thread
/// wake-up, prefetch ramp-up on small weights).
fn layer_sequence() {
    let weights: Vec<(usize, usize, Vec<f16>)> = SHAPES
        .iter()
        .map(|&(_, n, k)| (n, k, (0..n * k).map(|i| f16::from_f32((i % 97) as f32 / 97.0)).collect()))
        .collect();
    let bytes: usize = LAYER.iter().map(|&i| weights[i].0 * weights[i].1 * 2).sum();
    let copies = ROTATE_BYTES.div_ceil(bytes);
    let layers: Vec<Vec<(usize, usize, Vec<f16>)>> = (0..copies).map(|_| weights.clone()).collect();
    let x = vec![0.5f32; 5632];
    let mut y = vec![0f32; 5632];
    let (d, gbs) = time_rotating(copies, bytes, |c| {
        for &i in &LAYER {
            let (n, k, w) = &layers[c][i];
            matmul_xwt(&x[..*k], 1, *k, w, *n, None, &mut y[..*n]);
        }
    });
    println!("{:20} f16   {:7.3} ms  {gbs:5.1} GB/s", "layer (7 matmuls)", d.as_secs_f64() * 1e3);
}
