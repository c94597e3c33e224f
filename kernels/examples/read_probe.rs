//! Prints the read probe's limit and median beside the old plain fold's,
//! interleaved, in cache (1 MiB) and from memory (1 GiB).
//!
//! `RAYON_NUM_THREADS=2 cargo run --release -p tinyvllm-kernels --example read_probe`

use kernels::cpu::bandwidth::{ProbeBuffer, ReadProbe};

fn main() {
    for (name, bytes, passes) in [("in cache", 1 << 20, 200), ("from memory", 1 << 30, 5)] {
        let buffer = ProbeBuffer::new(bytes);
        for _ in 0..3 {
            let w = buffer.measure(ReadProbe::Wide, passes);
            let f = buffer.measure(ReadProbe::PlainFold, passes);
            println!(
                "{name:11}: wide loads {:6.1} GB/s best, {:6.1} median; plain fold {:6.1} best, {:6.1} median",
                w.limit_gb_s, w.median_gb_s, f.limit_gb_s, f.median_gb_s
            );
        }
    }
}
