//! Decode steps of the Metal paged-attention kernel on the GPU: 16
//! sequences x 512 context and 4 x 4096 (the partitioned path), 32 heads /
//! 4 kv heads, head_dim 128, f16, with the K/V bytes a step must read per
//! second. macOS only (the macOS workflow runs it); elsewhere it says so.
//!
//! `cargo bench -p tinyvllm-kernels --bench metal_decode`

#[cfg(target_os = "macos")]
#[path = "../tests/common/mod.rs"]
mod common;

#[cfg(target_os = "macos")]
fn main() {
    use std::time::Instant;

    use candle_core::{DType, Device};
    use common::{Geometry, make_case};
    use kernels::metal;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    let dev = match std::panic::catch_unwind(|| Device::new_metal(0)) {
        Ok(Ok(dev)) => dev,
        Ok(Err(e)) => panic!("no Metal device: {e}"),
        Err(_) => panic!("no Metal device (candle panicked opening it)"),
    };
    let mut rng = StdRng::seed_from_u64(1);
    for (seqs, ctx) in [(16, 512), (4, 4096)] {
        let g = Geometry { dtype: DType::F16, ..Geometry::new(32, 4, 128, 16) };
        let m = make_case(&mut rng, &vec![(1, ctx); seqs], g).to_device(&dev);
        let run = || metal::paged_attention(&m.attention(0.088)).expect("metal paged attention");
        run();
        dev.synchronize().expect("synchronize");
        let iters = 50;
        let start = Instant::now();
        for _ in 0..iters {
            run();
        }
        dev.synchronize().expect("synchronize");
        let per = start.elapsed() / iters;
        let bytes = 2 * seqs * ctx * 4 * 128 * 2; // K and V read once per kv head
        let gbs = bytes as f64 / per.as_secs_f64() / 1e9;
        println!("{seqs:>3} x {ctx:>5}: {per:?} per decode step, {gbs:.0} GB/s of K/V");
    }
}

#[cfg(not(target_os = "macos"))]
fn main() {
    println!("metal_decode: Metal timing needs an Apple GPU (macOS); nothing to time here");
}
