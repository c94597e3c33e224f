//! The read-bandwidth probe reaches further than the plain `u64` fold it
//! replaced, on machines with wide vector loads: in cache, where the loads'
//! width decides the rate, and from memory, where the fold's single chain
//! left bandwidth unread. Best passes of interleaved runs are compared, so
//! a noisy neighbour slows both probes alike.

use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};

fn wide_loads() -> bool {
    let f = kernels::cpu::isa::features();
    f.avx2 || f.avx512f || f.neon
}

/// Best rate of each probe over `rounds` interleaved passes.
fn best_of(buffer: &ProbeBuffer, rounds: usize) -> (f64, f64) {
    (0..rounds).fold((0.0f64, 0.0f64), |(wide, fold), _| {
        (wide.max(buffer.pass(ReadProbe::Wide)), fold.max(buffer.pass(ReadProbe::PlainFold)))
    })
}

#[test]
fn wide_loads_outrun_the_fold_in_cache() {
    if !wide_loads() {
        return;
    }
    // One chunk (1 MiB) per pass: it stays in L2/L3, so load width decides.
    let buffer = ProbeBuffer::new(1 << 20);
    let (wide, fold) = best_of(&buffer, 200);
    assert!(wide > 1.2 * fold, "wide {wide:.1} GB/s vs fold {fold:.1} GB/s in cache");
}

#[test]
fn wide_loads_read_memory_at_least_as_fast_as_the_fold() {
    if !wide_loads() {
        return;
    }
    let buffer = ProbeBuffer::new(256 << 20);
    let (wide, fold) = best_of(&buffer, 7);
    assert!(wide >= 0.97 * fold, "wide {wide:.1} GB/s vs fold {fold:.1} GB/s from memory");
}
