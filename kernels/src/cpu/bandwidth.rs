//! The memory's read-bandwidth limit, measured: the reference that every
//! "share of the limit" figure divides by (`tinyvllm-worker bench
//! --profile`, the `decode_step` bench, BENCHMARKS).
//!
//! A share is only as honest as its reference, so the probe reads as fast as
//! the machine can: the widest loads the CPU has (AVX-512, AVX2, NEON), four
//! independent accumulators so no add chain paces the loads, every thread of
//! the pool, and a buffer in huge pages far beyond the caches. Neighbours on
//! a shared host only ever slow a pass down, so the best of several passes
//! is the limit; the median is reported beside it. A plain `u64` fold
//! (the old probe) stays available for comparison: on wide machines it reads
//! well below the limit, which inflated shares above 100%.

use rayon::prelude::*;

use super::back_with_huge_pages;

/// What one measurement found, in GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadBandwidth {
    /// The best pass: the limit.
    pub limit_gb_s: f64,
    /// The median pass: what a run of the same length typically gets.
    pub median_gb_s: f64,
}

/// How a pass reads the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadProbe {
    /// The widest loads the CPU has, four accumulators.
    Wide,
    /// One `u64` fold per chunk, as compiled for baseline x86-64 (the old probe).
    PlainFold,
}

/// Far beyond any last-level cache.
const BUFFER_BYTES: usize = 1 << 30;
/// Passes per measurement: enough that one lands in a quiet moment.
const PASSES: usize = 9;
/// What one task of the pool reads at a time.
const CHUNK_WORDS: usize = (1 << 20) / 8;

/// The limit over a 1 GiB buffer with the pool's threads, best and median of
/// 9 passes of wide loads.
pub fn measure_read_bandwidth() -> ReadBandwidth {
    ProbeBuffer::new(BUFFER_BYTES).measure(ReadProbe::Wide, PASSES)
}

/// A buffer to read, in huge pages where the system has them.
pub struct ProbeBuffer {
    words: Vec<u64>,
}

impl ProbeBuffer {
    /// `bytes` rounded down to whole chunks, so every task of a pass reads
    /// as much (a buffer under one chunk, for an in-cache probe, stays as
    /// small as asked); written once so every page is backed before a pass
    /// is timed.
    pub fn new(bytes: usize) -> Self {
        let len = if bytes >= CHUNK_WORDS * 8 { bytes / 8 / CHUNK_WORDS * CHUNK_WORDS } else { (bytes / 8).max(64) };
        let words: Vec<u64> = (0..len as u64).collect();
        back_with_huge_pages(&words);
        Self { words }
    }

    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Best and median of `passes` timed passes (at least one).
    pub fn measure(&self, probe: ReadProbe, passes: usize) -> ReadBandwidth {
        let mut rates: Vec<f64> = (0..passes.max(1)).map(|_| self.pass(probe)).collect();
        rates.sort_by(f64::total_cmp);
        ReadBandwidth { limit_gb_s: rates[rates.len() - 1], median_gb_s: rates[rates.len() / 2] }
    }

    /// One pass over the whole buffer with the pool's threads, in GB/s.
    pub fn pass(&self, probe: ReadProbe) -> f64 {
        self.read_gb_s(probe, self.bytes())
    }

    /// Reads `bytes` with the pool's threads, in 1 MiB chunks
    /// ([`Self::read_slices`]), in GB/s: a pass, or a read of another
    /// length timed the same way.
    pub fn read_gb_s(&self, probe: ReadProbe, bytes: usize) -> f64 {
        let read = reader(probe);
        let slices = self.read_slices(bytes);
        let started = std::time::Instant::now();
        for words in &slices {
            let sum = words.par_chunks(CHUNK_WORDS).map(read).reduce(|| 0, u64::wrapping_add);
            std::hint::black_box(sum);
        }
        let read_bytes: usize = slices.iter().map(|s| s.len() * 8).sum();
        read_bytes as f64 / started.elapsed().as_secs_f64() / 1e9
    }

    /// Prefixes of the buffer that hold `bytes` between them, rounded up to
    /// whole chunks (at least one): whole passes, then the rest from the
    /// start again.
    fn read_slices(&self, bytes: usize) -> Vec<&[u64]> {
        let chunk = CHUNK_WORDS.min(self.words.len()).max(1);
        let mut left = (bytes / 8).div_ceil(chunk).max(1) * chunk;
        let mut slices = Vec::new();
        while left > 0 {
            let now = left.min(self.words.len());
            slices.push(&self.words[..now]);
            left -= now;
        }
        slices
    }

    /// `reps` passes on the calling thread alone, in GB/s: on a buffer that
    /// fits in cache, this measures the loads themselves, not the memory.
    pub fn pass_on_this_thread(&self, probe: ReadProbe, reps: usize) -> f64 {
        let read = reader(probe);
        let started = std::time::Instant::now();
        for _ in 0..reps {
            std::hint::black_box(read(std::hint::black_box(&self.words)));
        }
        (reps * self.bytes()) as f64 / started.elapsed().as_secs_f64() / 1e9
    }
}

/// How long a cache line takes to go from one of the pool's threads to
/// another and back, in ns: the median over `trips` round trips of two
/// lines (one written by each side), or `None` where the pool has one
/// thread or no other thread picked up its side within 10 ms.
///
/// It tells where a VM's vCPUs sit, which the bandwidth alone does not: on
/// the 2-vCPU Zen 4 VM of docs/perf-log.md, ~45 ns is two threads of one
/// core (~23 GB/s read), ~100 ns two cores that share an L3 (~30 GB/s),
/// and ~400 ns two core complexes, each with its own link to memory (55-72
/// GB/s, the "fast phases"), where every line that one thread hands to the
/// other (a matmul's input, half its output, a latch) costs that much.
pub fn cross_core_round_trip_ns(trips: usize) -> Option<f64> {
    cross_core_round_trip_ns_within(trips, std::time::Duration::from_millis(10))
}

/// [`cross_core_round_trip_ns`], giving up when no other thread picks up
/// its side within `pickup`.
pub(crate) fn cross_core_round_trip_ns_within(trips: usize, pickup: std::time::Duration) -> Option<f64> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Instant;
    /// Each side writes its own line and reads the other's.
    #[repr(align(128))]
    struct Line(AtomicU64);
    const DONE: u64 = u64::MAX;
    if rayon::current_num_threads() < 2 || trips == 0 {
        return None;
    }
    let (ping, pong) = (Line(AtomicU64::new(0)), Line(AtomicU64::new(0)));
    let started = AtomicBool::new(false);
    let pinger = || {
        let wait = Instant::now();
        while !started.load(Ordering::Acquire) {
            if wait.elapsed() > pickup {
                // Whenever the other side starts, it finds DONE and returns.
                ping.0.store(DONE, Ordering::Release);
                return None;
            }
            std::hint::spin_loop();
        }
        let mut times: Vec<u64> = Vec::with_capacity(trips);
        for trip in 1..=trips as u64 {
            let t = Instant::now();
            ping.0.store(trip, Ordering::Release);
            while pong.0.load(Ordering::Acquire) != trip {
                std::hint::spin_loop();
            }
            times.push(t.elapsed().as_nanos() as u64);
        }
        ping.0.store(DONE, Ordering::Release);
        times.sort_unstable();
        Some(times[times.len() / 2] as f64)
    };
    // Run by another thread of the pool, or by this one once the pinger
    // has given up (then it returns at once).
    let ponger = || {
        started.store(true, Ordering::Release);
        let mut last = 0;
        loop {
            let trip = ping.0.load(Ordering::Acquire);
            if trip == DONE {
                return;
            }
            if trip != last {
                pong.0.store(trip, Ordering::Release);
                last = trip;
            }
            std::hint::spin_loop();
        }
    };
    rayon::join(pinger, ponger).0
}

fn reader(probe: ReadProbe) -> fn(&[u64]) -> u64 {
    match probe {
        ReadProbe::Wide => wide_reader(),
        ReadProbe::PlainFold => plain_fold,
    }
}

/// The sum of the words, wrapping: what every reader computes, so a test
/// can check each against the others.
fn plain_fold(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// The widest reader this CPU runs.
fn wide_reader() -> fn(&[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let features = super::isa::features();
        if features.avx512f {
            return |w| {
                // SAFETY: AVX-512F was detected at run time.
                unsafe { x86::sum_avx512(w) }
            };
        }
        if features.avx2 {
            return |w| {
                // SAFETY: AVX2 was detected at run time.
                unsafe { x86::sum_avx2(w) }
            };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if super::isa::features().neon {
        return |w| {
            // SAFETY: NEON was detected at run time.
            unsafe { arm::sum_neon(w) }
        };
    }
    sum_four_chains
}

/// Four independent `u64` chains: the portable fallback.
fn sum_four_chains(words: &[u64]) -> u64 {
    let mut acc = [0u64; 4];
    let mut quads = words.chunks_exact(4);
    for q in &mut quads {
        for (a, &w) in acc.iter_mut().zip(q) {
            *a = a.wrapping_add(w);
        }
    }
    let tail = plain_fold(quads.remainder());
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

// The readers step a pointer by whole rounds (`wrapping_add`, which debug
// builds do not check per load, so tests measure what release runs) and
// fold the tail like the plain fold.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::plain_fold;

    /// Four 512-bit accumulators: 256 bytes a round.
    #[target_feature(enable = "avx512f")]
    pub(super) fn sum_avx512(words: &[u64]) -> u64 {
        const ROUND: usize = 32;
        let whole = words.len() / ROUND * ROUND;
        let (mut p, end) = (words.as_ptr(), words.as_ptr().wrapping_add(whole));
        let mut acc = [_mm512_setzero_si512(); 4];
        while p < end {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: p + 8j + 8 <= p + ROUND <= end, inside `words`; unaligned loads are allowed.
                *a = _mm512_add_epi64(*a, unsafe { _mm512_loadu_si512(p.wrapping_add(8 * j).cast()) });
            }
            p = p.wrapping_add(ROUND);
        }
        let sum = _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3]));
        let mut lanes = [0u64; 8];
        // SAFETY: `lanes` is 64 bytes, the width of the store.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), sum) };
        lanes.iter().fold(plain_fold(&words[whole..]), |s, &l| s.wrapping_add(l))
    }

    /// Four 256-bit accumulators: 128 bytes a round.
    #[target_feature(enable = "avx2")]
    pub(super) fn sum_avx2(words: &[u64]) -> u64 {
        const ROUND: usize = 16;
        let whole = words.len() / ROUND * ROUND;
        let (mut p, end) = (words.as_ptr(), words.as_ptr().wrapping_add(whole));
        let mut acc = [_mm256_setzero_si256(); 4];
        while p < end {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: p + 4j + 4 <= p + ROUND <= end, inside `words`; unaligned loads are allowed.
                *a = _mm256_add_epi64(*a, unsafe { _mm256_loadu_si256(p.wrapping_add(4 * j).cast()) });
            }
            p = p.wrapping_add(ROUND);
        }
        let sum = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]), _mm256_add_epi64(acc[2], acc[3]));
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` is 32 bytes, the width of the store.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), sum) };
        lanes.iter().fold(plain_fold(&words[whole..]), |s, &l| s.wrapping_add(l))
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::plain_fold;

    /// Four 128-bit accumulators: 64 bytes a round.
    #[target_feature(enable = "neon")]
    pub(super) fn sum_neon(words: &[u64]) -> u64 {
        const ROUND: usize = 8;
        let whole = words.len() / ROUND * ROUND;
        let (mut p, end) = (words.as_ptr(), words.as_ptr().wrapping_add(whole));
        let mut acc = [vdupq_n_u64(0); 4];
        while p < end {
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: p + 2j + 2 <= p + ROUND <= end, inside `words`.
                *a = vaddq_u64(*a, unsafe { vld1q_u64(p.wrapping_add(2 * j)) });
            }
            p = p.wrapping_add(ROUND);
        }
        let sum = vaddq_u64(vaddq_u64(acc[0], acc[1]), vaddq_u64(acc[2], acc[3]));
        let lanes = vgetq_lane_u64::<0>(sum).wrapping_add(vgetq_lane_u64::<1>(sum));
        lanes.wrapping_add(plain_fold(&words[whole..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reader_sums_like_the_fold() {
        // Lengths around each reader's round, so every tail path runs.
        for len in [0, 1, 7, 8, 15, 16, 31, 32, 33, 63, 64, 1000, 4099] {
            let words: Vec<u64> = (0..len as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
            let want = plain_fold(&words);
            assert_eq!(sum_four_chains(&words), want, "len {len}");
            assert_eq!(wide_reader()(&words), want, "len {len}");
        }
    }

    #[test]
    fn a_read_covers_the_bytes_asked_in_whole_chunks() {
        let buffer = ProbeBuffer::new(3 * CHUNK_WORDS * 8);
        let chunk = CHUNK_WORDS * 8;
        for (bytes, want) in
            [(0, chunk), (1, chunk), (chunk, chunk), (5 * chunk / 2, 3 * chunk), (7 * chunk, 7 * chunk)]
        {
            let slices = buffer.read_slices(bytes);
            assert_eq!(slices.iter().map(|s| s.len() * 8).sum::<usize>(), want, "{bytes} bytes");
            assert!(slices.iter().all(|s| s.as_ptr() == buffer.words.as_ptr() && s.len() <= buffer.words.len()));
        }
        // A buffer under one chunk (an in-cache probe) is read whole.
        let small = ProbeBuffer::new(4096);
        assert_eq!(small.read_slices(10_000).iter().map(|s| s.len()).sum::<usize>(), 3 * small.words.len());
        assert!(buffer.read_gb_s(ReadProbe::Wide, 2 * chunk) > 0.0);
    }

    #[test]
    fn a_round_trip_needs_two_threads() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            // From outside the pool and from one of its threads.
            let outside = pool.install(|| super::cross_core_round_trip_ns(200));
            let inside = pool.install(|| rayon::join(|| super::cross_core_round_trip_ns(50), || ()).0);
            for ns in [outside, inside] {
                match threads {
                    1 => assert_eq!(ns, None),
                    // A loaded CI host may leave the other side unscheduled
                    // for 10 ms: then None, never a hang or a bogus time.
                    _ => assert!(ns.is_none_or(|ns| ns > 0.0 && ns < 1e7), "{ns:?}"),
                }
            }
        }
    }

    #[test]
    fn a_measurement_reports_best_above_median() {
        let buffer = ProbeBuffer::new(8 << 20);
        let r = buffer.measure(ReadProbe::Wide, 3);
        assert!(r.limit_gb_s >= r.median_gb_s && r.median_gb_s > 0.0, "{r:?}");
    }
}
