//! One decode step of paged attention on the CPU: 16 sequences x 512
//! context, 32 heads / 4 kv heads, head_dim 64, f32, with the three
//! implementations side by side (the fused `cpu` kernel, the candle-op
//! `portable` path and the naive `reference`). The fastest of many runs
//! each, so a busy neighbour disturbs the figure least.
//!
//! `cargo bench -p tinyvllm-kernels --bench attention_step`

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

fn main() {
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
