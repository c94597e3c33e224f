//! The read-bandwidth probe's loads outrun the plain `u64` fold it replaced,
//! on machines with wide vector loads. Measured in cache on one thread,
//! where the loads' width decides the rate; the best of many short runs
//! is compared, so a busy neighbour (other tests, other tenants) slows both
//! alike. (From memory, the two are set side by side by
//! `cargo run --release -p tinyvllm-kernels --example read_probe`: a
//! benchmark, not a test, as that rate moves with the host's load.)
//!
//! A timing, so it runs in release builds only:
//! `cargo test --release -p tinyvllm-kernels --test bandwidth`.

use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};

#[test]
#[cfg_attr(debug_assertions, ignore = "timing: run with --release")]
fn wide_loads_outrun_the_fold_in_cache() {
    // On x86 the fold compiles to 16-byte SSE2 loads, against 32 or 64 for
    // the probe; NEON's loads are as wide as the fold's vectorised ones.
    let f = kernels::cpu::isa::features();
    if !(f.avx2 || f.avx512f) {
        return;
    }
    // 16 KiB: in L1 on every machine we run on, where two loads a cycle
    // of twice or four times the width show at once.
    let buffer = ProbeBuffer::new(16 << 10);
    let (mut wide, mut fold) = (0.0f64, 0.0f64);
    for _ in 0..500 {
        wide = wide.max(buffer.pass_on_this_thread(ReadProbe::Wide, 32));
        fold = fold.max(buffer.pass_on_this_thread(ReadProbe::PlainFold, 32));
    }
    assert!(wide > 1.2 * fold, "wide {wide:.1} GB/s vs fold {fold:.1} GB/s in cache");
}
