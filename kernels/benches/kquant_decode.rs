//! The k-quant GEMVs against Q8_0's, in GB/s of weight bytes streamed:
//! batch-1 decode on TinyLlama's shapes with the weights rotated through
//! more than 512 MiB (so they come from DRAM), then a prefill-sized matmul
//! in GFLOP/s. The formats run in turns, round after round, so the
//! machine's bandwidth drift hits all of them alike.
//!
//! `cargo bench -p tinyvllm-kernels --bench kquant_decode`
//! (`RAYON_NUM_THREADS` sets the thread count; default: all cores).
//! `-- experts`: the panels at 1 to 16 rows on Qwen3-30B-A3B's expert
//! shapes, weights in cache (an expert's rows at a batched decode step).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kernels::cpu::kquant::{
    BlockQ4K, BlockQ6K, KPanel, KPanels, QK_K, best_backend, best_panel_backend, matmul_kpanels, matmul_kquant_with,
    quantize_matrix,
};
use kernels::cpu::measure_read_bandwidth;
use kernels::cpu::q8_panel::{PanelQ8_0, matmul_panel_q8_0, vnni_available};
use kernels::cpu::quant::{BlockQ8_0, PackedQ8_0, QK8_0, matmul_packed_q8_0, quantize_matrix_q8_0};

/// (name, n, k): TinyLlama's ffn_down and gate/up, and its lm_head.
const SHAPES: [(&str, usize, usize); 3] =
    [("down 2048x5632", 2048, 5632), ("gate/up 5632x2048", 5632, 2048), ("lm_head 32000x2048", 32000, 2048)];
const ROTATE_BYTES: usize = 640 << 20;
const ROUNDS: usize = 3;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median time of `f(copy)` over the copies in turn (one warm-up pass).
fn time_rotating(copies: usize, mut f: impl FnMut(usize)) -> Duration {
    for c in 0..copies {
        f(c);
    }
    let times = (0..(copies * 3).max(30))
        .map(|it| {
            let t = Instant::now();
            f(it % copies);
            t.elapsed()
        })
        .collect();
    median(times)
}

/// A weight in each format under test, `copies` times over.
enum Format {
    Q8_0Panels(Vec<PanelQ8_0>),
    Q8_0Packed(Vec<PackedQ8_0>),
    Q4KRows(Vec<Vec<BlockQ4K>>),
    Q4KPanels(Vec<KPanels<BlockQ4K>>),
    Q6KRows(Vec<Vec<BlockQ6K>>),
    Q6KPanels(Vec<KPanels<BlockQ6K>>),
}

fn copies_of<T: Clone>(w: T, bytes: usize) -> Vec<T> {
    vec![w; ROTATE_BYTES.div_ceil(bytes)]
}

fn panels<B: KPanel>(w: &[B], n: usize, k: usize) -> (KPanels<B>, usize) {
    let p = KPanels::pack(w, n, k / QK_K).expect("shape");
    let bytes = p.size_in_bytes();
    (p, bytes)
}

impl Format {
    fn all(base: &[f32], n: usize, k: usize) -> Vec<(&'static str, usize, Format)> {
        let q8 = quantize_matrix_q8_0(base, n, k).expect("aligned");
        let q8_bytes = n * k / QK8_0 * size_of::<BlockQ8_0>();
        let q8 = if vnni_available() {
            let v = PanelQ8_0::pack(&q8, n, k / QK8_0).expect("shape");
            ("q8_0 vnni", q8_bytes, Format::Q8_0Panels(copies_of(v, q8_bytes)))
        } else {
            let p = PackedQ8_0::pack(&q8, n, k / QK8_0).expect("shape");
            ("q8_0 packed", q8_bytes, Format::Q8_0Packed(copies_of(p, q8_bytes)))
        };
        let q4: Vec<BlockQ4K> = quantize_matrix(base, n, k).expect("aligned");
        let q6: Vec<BlockQ6K> = quantize_matrix(base, n, k).expect("aligned");
        let (q4_bytes, q6_bytes) = (size_of_val(q4.as_slice()), size_of_val(q6.as_slice()));
        let (q4p, q4p_bytes) = panels(&q4, n, k);
        let (q6p, q6p_bytes) = panels(&q6, n, k);
        vec![
            q8,
            ("q4_K rows", q4_bytes, Format::Q4KRows(copies_of(q4, q4_bytes))),
            ("q4_K panels", q4p_bytes, Format::Q4KPanels(copies_of(q4p, q4p_bytes))),
            ("q6_K rows", q6_bytes, Format::Q6KRows(copies_of(q6, q6_bytes))),
            ("q6_K panels", q6p_bytes, Format::Q6KPanels(copies_of(q6p, q6p_bytes))),
        ]
    }

    fn copies(&self) -> usize {
        match self {
            Self::Q8_0Panels(w) => w.len(),
            Self::Q8_0Packed(w) => w.len(),
            Self::Q4KRows(w) => w.len(),
            Self::Q4KPanels(w) => w.len(),
            Self::Q6KRows(w) => w.len(),
            Self::Q6KPanels(w) => w.len(),
        }
    }

    /// `y = x @ W^T` with copy c, `m = x.len() / k` rows.
    fn run(&self, c: usize, x: &[f32], k: usize, n: usize, y: &mut [f32]) {
        let m = x.len() / k;
        match self {
            Self::Q8_0Panels(w) => matmul_panel_q8_0(x, m, &w[c], y),
            Self::Q8_0Packed(w) => matmul_packed_q8_0(x, m, &w[c], y),
            Self::Q4KRows(w) => matmul_kquant_with(best_backend(), x, m, k, &w[c], n, y),
            Self::Q4KPanels(w) => matmul_kpanels(x, m, &w[c], y),
            Self::Q6KRows(w) => matmul_kquant_with(best_backend(), x, m, k, &w[c], n, y),
            Self::Q6KPanels(w) => matmul_kpanels(x, m, &w[c], y),
        }
        .expect("shapes");
    }
}

/// Qwen3-30B-A3B's expert projections: gate/up stacked, and down.
const EXPERT_SHAPES: [(&str, usize, usize); 2] =
    [("expert gate/up 1536x2048", 1536, 2048), ("expert down 2048x768", 2048, 768)];

/// Microseconds per call of the Q4_K and Q6_K panels at small m.
fn experts() {
    for (name, n, k) in EXPERT_SHAPES {
        let base: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 997) as f32 / 997.0 - 0.5).collect();
        let q4 =
            KPanels::pack(&quantize_matrix::<BlockQ4K>(&base, n, k).expect("aligned"), n, k / QK_K).expect("panels");
        let q6 =
            KPanels::pack(&quantize_matrix::<BlockQ6K>(&base, n, k).expect("aligned"), n, k / QK_K).expect("panels");
        for round in 0..ROUNDS {
            let mut line = format!("{name} round {round} (us per call):");
            for m in [1, 2, 3, 4, 8, 16] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
                let mut y = vec![0f32; m * n];
                let t4 = time_rotating(1, |_| matmul_kpanels(&x, m, &q4, &mut y).expect("shapes"));
                let t6 = time_rotating(1, |_| matmul_kpanels(&x, m, &q6, &mut y).expect("shapes"));
                line += &format!("  m={m} q4_K {:.0} q6_K {:.0}", t4.as_secs_f64() * 1e6, t6.as_secs_f64() * 1e6);
                black_box(&y);
            }
            println!("{line}");
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "experts") {
        return experts();
    }
    println!("threads: {}", rayon::current_num_threads());
    println!("row-major k-quant path {:?}, panel path {:?}", best_backend(), best_panel_backend());
    let bw = measure_read_bandwidth();
    println!("read bandwidth: {bw:?}");
    for (name, n, k) in SHAPES {
        let base: Vec<f32> = (0..n * k).map(|i| ((i * 31) % 997) as f32 / 997.0 - 0.5).collect();
        let formats = Format::all(&base, n, k);
        drop(base);
        let x: Vec<f32> = (0..k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut y = vec![0f32; n];
        println!("{name}, m = 1, weights from DRAM (GB/s of weight bytes; ms per call)");
        for round in 0..ROUNDS {
            let mut line = format!("  round {round}:");
            for (fname, bytes, f) in &formats {
                let d = time_rotating(f.copies(), |c| f.run(c, &x, k, n, &mut y));
                let gbs = *bytes as f64 / d.as_secs_f64() / 1e9;
                line += &format!("  {fname} {gbs:5.1} ({:.3})", d.as_secs_f64() * 1e3);
            }
            println!("{line}");
        }
        black_box(&y);
        if n > 8192 {
            continue;
        }
        let m = 64;
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let mut y = vec![0f32; m * n];
        let mut line = format!("{name}, m = {m} (GFLOP/s):");
        for (fname, _, f) in &formats {
            let d = time_rotating(1, |_| f.run(0, &x, k, n, &mut y));
            line += &format!("  {fname} {:5.1}", (2 * m * n * k) as f64 / d.as_secs_f64() / 1e9);
        }
        println!("{line}");
    }
}
