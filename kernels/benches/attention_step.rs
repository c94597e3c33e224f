//! One decode step of paged attention on the CPU: 16 sequences x 512
//! context, 32 heads / 4 kv heads, head_dim 64, f32, with the three
//! implementations side by side (the fused `cpu` kernel, the candle-op
//! `portable` path and the naive `reference`). The fastest of many runs
//! each, so a busy neighbour disturbs the figure least.
//!
//! `cargo bench -p tinyvllm-kernels --bench attention_step`
//!
//! With `-- long [CONTEXT [HEADS KV_HEADS LAYERS]]`: a batch-1 decode step
//! at a long context (default 16384) of SmolLM-135M's attention (9 heads /
//! 3 kv heads, 30 layers; TinyLlama's is `32 4 22`), head_dim 64, each
//! layer its own pool (so the step reads its K/V from memory as a worker's
//! does), f32 and f16 caches; the `cpu` kernel only.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use kernels::{cpu, portable, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

#[path = "../tests/common/mod.rs"]
mod common;
use common::{Geometry, make_case};

/// The fastest of `iters` runs of `f`, after a warm-up (thread pool, caches).
fn best_of(name: &str, iters: u32, f: &dyn Fn() -> Tensor) -> Duration {
    f();
    let per = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap_or_default();
    println!("{name:>9}: {per:?} per decode step (best of {iters})");
    per
}

/// A batch-1 decode step over `layers` layers at `context` keys.
fn long_decode(context: usize, (heads, kv_heads, layers): (usize, usize, usize)) {
    for dtype in [candle_core::DType::F32, candle_core::DType::F16] {
        let mut rng = StdRng::seed_from_u64(2);
        let mut g = Geometry::new(heads, kv_heads, 64, 16);
        g.dtype = dtype;
        let cases: Vec<_> = (0..layers).map(|_| make_case(&mut rng, &[(1, context)], g)).collect();
        let step = || {
            let mut last = None;
            for c in &cases {
                last = Some(cpu::paged_attention(&c.attention(0.125)).expect("cpu"));
            }
            last.expect("layers")
        };
        let per = best_of(&format!("{dtype:?}"), 20, &step);
        let bytes = (layers * 2 * kv_heads * 64 * context * dtype.size_in_bytes()) as f64;
        println!("  context {context}: {:.1} GB/s of K/V", bytes / per.as_secs_f64() / 1e9);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "long") {
        let arg = |j: usize, default: usize| args.get(i + j).and_then(|s| s.parse().ok()).unwrap_or(default);
        return long_decode(arg(1, 16384), (arg(2, 9), arg(3, 3), arg(4, 30)));
    }
    let mut rng = StdRng::seed_from_u64(1);
    let case = make_case(&mut rng, &[(1, 512); 16], Geometry::new(32, 4, 64, 16));
    let scale = 0.125;
    let c = &case;
    let fused = best_of("cpu", 200, &|| cpu::paged_attention(&c.attention(scale)).expect("cpu"));
    let composed = best_of("portable", 20, &|| portable::paged_attention(&c.attention(scale)).expect("portable"));
    let naive = best_of("reference", 3, &|| reference::paged_attention(&c.attention(scale)).expect("reference"));
    println!(
        "cpu is {:.0}x reference, {:.1}x portable ({} rayon threads)",
        naive.as_secs_f64() / fused.as_secs_f64(),
        composed.as_secs_f64() / fused.as_secs_f64(),
        rayon::current_num_threads()
    );
}
