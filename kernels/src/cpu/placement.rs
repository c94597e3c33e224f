//! Where the pool's threads sit, measured now and then: whether a cache
//! line that one of them writes and the other reads crosses between core
//! complexes.
//!
//! On the 2-vCPU Zen 4 VM of docs/perf-log.md the hypervisor moves the two
//! vCPUs between one core complex (~130 ns to hand a line over and back,
//! one link to memory) and two (~450 ns, a link each: the fast-bandwidth
//! phases). In the second placement, a buffer that one thread rewrites
//! after the other read it pays that trip per line: a decode GEMV's
//! quantized activations, written by the caller and read by both threads,
//! took 0.37-0.40 ms of a step there against 0.16-0.19 ms within one
//! complex. Handing the buffer back to memory after the call
//! ([`flush_lines`]) and asking for it writable before the next writes
//! ([`prefetch_for_write`]) brought it to 0.20-0.22 ms and the step's
//! share of the bandwidth up 0.5-1.4 points (two series of A/B runs);
//! within one complex the same flush costs the other thread its shared-L3
//! hit (1.2 points down). So the kernels ask [`threads_far_apart`] first.
//!
//! Each engine step's [`super::PoolAwake`] calls [`refresh`], which
//! re-measures the round trip every [`REFRESH_STEPS`] steps (16 round
//! trips, 2-8 us): the placement changes every few seconds on that VM, and
//! checking every 64 steps left the kernels in the wrong mode for half of
//! the steps. `TINYVLLM_PLACEMENT=near|far` fixes the answer instead, to
//! compare the two.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Round trips at or above this are two core complexes (or sockets):
/// between the ~130 ns and ~450 ns groups measured on Zen 4; Intel's mesh
/// and Apple's clusters hand lines over in well under it.
pub const FAR_ROUND_TRIP_NS: f64 = 300.0;

/// Engine steps between two measurements: placements last seconds, a step
/// tens of milliseconds.
pub const REFRESH_STEPS: u32 = 4;

/// Round trips per measurement (their median decides: the two groups lie
/// 3x apart).
const TRIPS: usize = 16;

/// How long a measurement waits for another thread to take its side: a
/// sleeping thread wakes in tens of microseconds; a busy one (another
/// engine's step) is not waited for.
const PICKUP: std::time::Duration = std::time::Duration::from_millis(1);

static FAR: AtomicBool = AtomicBool::new(false);
static STEPS: AtomicU32 = AtomicU32::new(0);

/// `TINYVLLM_PLACEMENT`: `Some(true)` for `far`, `Some(false)` for `near`,
/// `None` (measured) otherwise.
fn fixed() -> Option<bool> {
    static FIXED: OnceLock<Option<bool>> = OnceLock::new();
    *FIXED.get_or_init(|| parse_fixed(&std::env::var("TINYVLLM_PLACEMENT").unwrap_or_default()))
}

fn parse_fixed(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "far" => Some(true),
        "near" => Some(false),
        _ => None,
    }
}

/// Whether the pool's threads were on different core complexes at the
/// last measurement (false before the first, and with one thread).
pub fn threads_far_apart() -> bool {
    fixed().unwrap_or_else(|| FAR.load(Ordering::Relaxed))
}

/// Counts an engine step and, on the first and every [`REFRESH_STEPS`]th,
/// measures the round trip between two of the pool's threads. Call it on a
/// pool thread with the other threads idle (as a step starts); a
/// measurement that finds no partner leaves the answer as it was. Returns
/// the round trip when this call measured one, in ns.
pub fn refresh() -> Option<f64> {
    if fixed().is_some() || !STEPS.fetch_add(1, Ordering::Relaxed).is_multiple_of(REFRESH_STEPS) {
        return None;
    }
    let ns = super::bandwidth::cross_core_round_trip_ns_within(TRIPS, PICKUP)?;
    FAR.store(ns >= FAR_ROUND_TRIP_NS, Ordering::Relaxed);
    Some(ns)
}

/// Writes back and evicts the lines of `bytes` from every cache
/// (`clflushopt`), so that the next writer finds them in memory rather
/// than in another core complex's cache; a no-op where the CPU lacks the
/// instruction.
#[inline]
pub(crate) fn flush_lines<T>(bytes: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa::features().clflushopt {
        for line in lines(bytes) {
            // SAFETY: the CPU has CLFLUSHOPT; the line lies within `bytes`,
            // which this thread may read; flushing changes no value.
            unsafe { std::arch::asm!("clflushopt [{}]", in(reg) line, options(nostack, preserves_flags)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Asks for the lines of `bytes` in a writable state (`prefetchw`), so
/// that the writes right after do not each wait for one; a no-op where the
/// CPU lacks the instruction.
#[inline]
pub(crate) fn prefetch_for_write<T>(bytes: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa::features().prefetchw {
        for line in lines(bytes) {
            // SAFETY: the CPU has PREFETCHW; a prefetch reads no value and
            // never faults.
            unsafe { std::arch::asm!("prefetchw [{}]", in(reg) line, options(nostack, preserves_flags, readonly)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The address of one byte in each 64-byte line that `bytes` touches.
#[cfg(target_arch = "x86_64")]
fn lines<T>(bytes: &[T]) -> impl Iterator<Item = *const u8> {
    let start = bytes.as_ptr().cast::<u8>();
    let len = std::mem::size_of_val(bytes);
    let first = start as usize & !63;
    // An empty slice touches no line, even at an unaligned address.
    let end = if len == 0 { first } else { start as usize + len };
    // Offsets from `start` (not bare addresses) keep the pointers' provenance.
    (first..end).step_by(64).map(move |line| start.wrapping_add(line.max(start as usize) - start as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_near_and_far_fix_the_answer() {
        assert_eq!(parse_fixed("far"), Some(true));
        assert_eq!(parse_fixed("NEAR"), Some(false));
        assert_eq!(parse_fixed(""), None);
        assert_eq!(parse_fixed("auto"), None);
    }

    /// A full refresh period on a two-thread pool returns promptly, and
    /// what it measured is a round trip, whatever the placement.
    #[test]
    fn refreshing_on_a_pool_measures_and_returns() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        let started = std::time::Instant::now();
        let measured: Vec<f64> = pool.install(|| (0..REFRESH_STEPS).filter_map(|_| refresh()).collect());
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "a few 16-trip measurements, not a hang");
        // Nothing where the other thread did not pick up within `PICKUP` (a
        // busy machine) or other tests' pools took this period's turn.
        assert!(measured.iter().all(|ns| ns.is_finite() && *ns > 0.0), "{measured:?} ns");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_line_of_a_buffer_is_visited_once() {
        let buf = vec![0u8; 1000];
        for (start, len) in [(0, 0), (0, 1), (5, 64), (63, 2), (64, 64), (1, 999), (100, 300)] {
            let part = &buf[start..start + len];
            let base = part.as_ptr() as usize;
            let got: Vec<usize> = lines(part).map(|p| p as usize).collect();
            let want_lines = if len == 0 { 0 } else { (base + len - 1) / 64 - base / 64 + 1 };
            assert_eq!(got.len(), want_lines, "start {start}, len {len}");
            for (i, &p) in got.iter().enumerate() {
                assert!(p >= base && p < base + len, "inside the buffer");
                assert_eq!(p / 64, base / 64 + i, "one per line, in order");
            }
        }
    }

    #[test]
    fn flushing_and_prefetching_change_no_value() {
        let mut buf: Vec<u32> = (0..4099).collect();
        prefetch_for_write(&buf);
        buf[17] = 7;
        flush_lines(&buf);
        flush_lines(&buf[..0]);
        assert_eq!(buf[17], 7);
        assert!(buf.iter().enumerate().all(|(i, &v)| i == 17 || v == i as u32));
    }
}
