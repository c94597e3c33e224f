//! The read-bandwidth probe's wide loads beside the plain `u64` fold it
//! replaced, in cache on one thread, where the loads' width decides the
//! rate (on x86 the fold compiles to 16-byte SSE2 loads, against 32 or 64
//! for the probe). The best of many short runs each, so a busy neighbour
//! slows both alike. From memory, the two are set side by side by
//! `cargo run --release -p tinyvllm-kernels --example read_probe`.
//!
//! `cargo bench -p tinyvllm-kernels --bench read_probe_in_cache`

use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};

fn main() {
    // 16 KiB: in L1 on every machine we run on.
    let buffer = ProbeBuffer::new(16 << 10);
    let (mut wide, mut fold) = (0.0f64, 0.0f64);
    for _ in 0..500 {
        wide = wide.max(buffer.pass_on_this_thread(ReadProbe::Wide, 32));
        fold = fold.max(buffer.pass_on_this_thread(ReadProbe::PlainFold, 32));
    }
    println!(
        "in L1, one thread ({}): wide loads {wide:.1} GB/s, plain fold {fold:.1} GB/s ({:.2}x)",
        kernels::cpu::isa::describe(),
        wide / fold
    );
}
