//! The read-bandwidth probe's loads outrun the plain `u64` fold it replaced,
//! on machines with wide vector loads. Measured in cache on one thread,
//! where the loads' width decides the rate; the best of many short passes
//! is compared, so a busy neighbour (other tests, other tenants) slows both
//! alike. (From memory, the two are set side by side by
//! `cargo run --release -p tinyvllm-kernels --example read_probe`: a
//! benchmark, not a test, as that rate moves with the host's load.)

use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};

#[test]
fn wide_loads_outrun_the_fold_in_cache() {
    let f = kernels::cpu::isa::features();
    if !(f.avx2 || f.avx512f || f.neon) {
        return;
    }
    // 128 KiB: in L2 on every machine we run on.
    let buffer = ProbeBuffer::new(128 << 10);
    let (mut wide, mut fold) = (0.0f64, 0.0f64);
    for _ in 0..2000 {
        wide = wide.max(buffer.pass_on_this_thread(ReadProbe::Wide));
        fold = fold.max(buffer.pass_on_this_thread(ReadProbe::PlainFold));
    }
    assert!(wide > 1.2 * fold, "wide {wide:.1} GB/s vs fold {fold:.1} GB/s in cache");
}
