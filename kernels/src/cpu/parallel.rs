//! How the CPU kernels share a call among rayon's threads: spans of items
//! handed out by rayon's splitting, contiguous shares that threads own and
//! steal from, and the output the tasks write.

use rayon::prelude::*;

/// The output of a parallel call, which tasks write at disjoint places
/// (each kernel says which are a task's: columns, panels, rows).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr<T = f32>(pub(crate) *mut T);
// SAFETY: tasks write disjoint elements, and the borrow the pointer came
// from outlives the parallel loop, so sharing it is race-free.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// A method, so closures capture the Sync wrapper, not the raw pointer.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

impl OutPtr<f32> {
    /// Writes `rows[r]` plus the bias to row `row0 + r` of y `[.., n]`,
    /// columns `c0..`, dropping the values past column n (padding rows of a
    /// panel).
    ///
    /// # Safety
    /// y must hold rows `row0..row0 + rows.len()` of n, `c0 <= n`, and no
    /// other thread may write these elements during the call.
    #[inline]
    pub(crate) unsafe fn store_rows<const W: usize>(
        self,
        n: usize,
        row0: usize,
        c0: usize,
        rows: &[[f32; W]],
        bias: Option<&[f32]>,
    ) {
        let cols = (n - c0).min(W);
        for (r, s) in rows.iter().enumerate() {
            for (c, &v) in s.iter().enumerate().take(cols) {
                let v = match bias {
                    Some(b) => v + b[c0 + c],
                    None => v,
                };
                // SAFETY: (row0 + r) * n + c0 + c < y.len() per the caller,
                // who also owns these elements.
                unsafe { *self.0.add((row0 + r) * n + c0 + c) = v };
            }
        }
    }
}

/// y `[.., n]` for an empty inner dimension: every row is the bias, or 0.
pub(crate) fn fill_with_bias(y: &mut [f32], n: usize, bias: Option<&[f32]>) {
    for row in y.chunks_exact_mut(n) {
        match bias {
            Some(b) => row.copy_from_slice(b),
            None => row.fill(0.0),
        }
    }
}

/// Runs `f(i0, i1)` over `0..items` cut into spans on rayon's pool: about 8
/// per thread, so both cores balance, each `clamp.0..=clamp.1` items long,
/// so scheduling costs nothing next to streaming a span's weights.
pub(crate) fn for_each_span(items: usize, clamp: (usize, usize), f: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let per_task = items.div_ceil(threads * 8).clamp(clamp.0, clamp.1);
    let tasks = items.div_ceil(per_task);
    let run = |t: usize| f(t * per_task, ((t + 1) * per_task).min(items));
    if tasks == 1 || threads == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Most of a share's items its owner claims at once: about 1 MiB of
/// weights, tens of microseconds of one thread's stream (all that another
/// thread cannot take over if the owner is preempted mid-claim).
const CLAIM_BYTES: usize = 1 << 20;

/// Runs `f` over `0..items` on rayon's pool, in ranges, for decode's GEMVs:
/// each thread owns a contiguous share that it walks upwards, one linear
/// stream of weights, and a thread whose share runs out takes items one at
/// a time from the top of another's, so that all end together but for the
/// owner's last claim. `item_bytes` (the weights an item reads) caps the
/// claims.
///
/// Spans handed out by rayon's splitting (`for_each_span`) break a thread's
/// stream wherever a steal lands and leave up to a span's time of one core
/// idle at the end of every call, and decode makes ~90 calls a token.
///
/// The owner claims half of what is left of its share, up to
/// [`CLAIM_BYTES`], with one compare-exchange: a few claims a share plus
/// one per MiB. A claim per item (a 34 KB Q8_0 panel) cost about a loaded
/// memory latency each in the Zen 4 VM's fast-bandwidth phases, 3-7% of a
/// decode step (docs/perf-log.md, "Zen 4, fifth session").
pub(crate) fn for_each_owned(items: usize, item_bytes: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// A thread's share, `lo << 32 | hi`, on a line of its own: the owner
    /// claims from it, and sharing a line would slow every claim.
    #[repr(align(128))]
    struct Share(AtomicU64);
    let threads = rayon::current_num_threads().clamp(1, items.max(1));
    let items = items.min(u32::MAX as usize) as u64;
    let max_claim = (CLAIM_BYTES / item_bytes.max(1)).max(1) as u64;
    let pack = |lo: u64, hi: u64| (lo << 32) | hi;
    let bound = |t: u64| t * items / threads as u64;
    let shares: Vec<Share> = (0..threads as u64).map(|t| Share(AtomicU64::new(pack(bound(t), bound(t + 1))))).collect();
    // The owner takes from the bottom of its share, others one item from the top.
    let take = |share: &Share, from_top: bool| -> Option<std::ops::Range<usize>> {
        let mut cur = share.0.load(Ordering::Relaxed);
        loop {
            let (lo, hi) = (cur >> 32, cur & u64::from(u32::MAX));
            if lo >= hi {
                return None;
            }
            let (next, claimed) = if from_top {
                (pack(lo, hi - 1), hi - 1..hi)
            } else {
                let n = ((hi - lo) / 2).clamp(1, max_claim);
                (pack(lo + n, hi), lo..lo + n)
            };
            match share.0.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(claimed.start as usize..claimed.end as usize),
                Err(now) => cur = now,
            }
        }
    };
    let run = |t: usize| {
        while let Some(range) = take(&shares[t], false) {
            f(range);
        }
        for other in (1..threads).map(|d| &shares[(t + d) % threads]) {
            while let Some(range) = take(other, true) {
                f(range);
            }
        }
    };
    if threads == 1 {
        run(0);
    } else {
        // A thread that starts late finds its share taken: nothing is lost.
        (0..threads).into_par_iter().for_each(run);
    }
}

/// How long a spinner waits for work: far longer than the gaps between a
/// step's parallel calls (norms, attention: tens of microseconds).
const IDLE_EXIT: std::time::Duration = std::time::Duration::from_millis(2);

/// Keeps the pool's other threads awake and looking for work while it
/// lives: for a model step, whose ~110 parallel calls are split by
/// single-threaded gaps (norms, RoPE, quantizing activations). Left alone,
/// an idle rayon thread yields for some microseconds and then sleeps; the
/// next call then waits for a futex wake-up (tens of microseconds on a
/// virtual machine) before the sleeper starts its share, so each call
/// loses part of a core. Each of the other threads runs a job that takes
/// whatever work appears in the pool (`rayon::yield_now`) and otherwise
/// spins, until the guard drops.
///
/// Created on a pool thread (the engine's step loop runs on one); outside
/// the pool, or with one thread, it does nothing. A spinner also ends
/// after `IDLE_EXIT` without work, so that no thread is held for longer
/// than that by a step that has stopped calling the pool (a thread that
/// took another engine's spinner while waiting inside a job, say).
///
/// It also counts the step for [`super::placement::refresh`], which
/// re-measures now and then where the pool's threads sit.
pub struct PoolAwake {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PoolAwake {
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let owner = rayon::current_thread_index();
        if owner.is_some() {
            // Before any spinner runs: the measurement needs another thread.
            let _ = super::placement::refresh();
        }
        if owner.is_some() && awake_wanted() {
            for _ in 1..rayon::current_num_threads() {
                let stop = stop.clone();
                rayon::spawn(move || {
                    // The owner itself may take a spinner off its own queue
                    // while it waits in a join: spinning there would wait
                    // for the owner, i.e. forever.
                    if rayon::current_thread_index() == owner {
                        return;
                    }
                    let mut last_work = std::time::Instant::now();
                    while !stop.load(Ordering::Acquire) {
                        if rayon::yield_now() == Some(rayon::Yield::Executed) {
                            last_work = std::time::Instant::now();
                        } else if last_work.elapsed() > IDLE_EXIT {
                            return;
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
        }
        Self { stop }
    }
}

impl Default for PoolAwake {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PoolAwake {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
    }
}

fn awake_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("TINYVLLM_POOL_AWAKE").map_or(true, |v| v != "0"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn for_each_owned_runs_every_item_once() {
        use std::sync::atomic::{AtomicU32, Ordering};
        for threads in [1, 2, 3, 5] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            for items in [0, 1, 2, 3, 4, 7, 64, 1001] {
                for item_bytes in [0, 1 << 16, super::CLAIM_BYTES, 4 << 20] {
                    let seen: Vec<AtomicU32> = (0..items).map(|_| AtomicU32::new(0)).collect();
                    pool.install(|| {
                        super::for_each_owned(items, item_bytes, |range| {
                            assert!(
                                range.len() <= (super::CLAIM_BYTES / item_bytes.max(1)).max(1),
                                "claims are capped"
                            );
                            for i in range {
                                // Uneven items, so that threads run out and take from others.
                                if i % 7 == 0 {
                                    std::thread::sleep(std::time::Duration::from_micros(50));
                                }
                                seen[i].fetch_add(1, Ordering::Relaxed);
                            }
                        })
                    });
                    let counts: Vec<u32> = seen.iter().map(|c| c.load(Ordering::Relaxed)).collect();
                    assert!(counts.iter().all(|&c| c == 1), "{threads} threads, {items} items of {item_bytes} B");
                }
            }
        }
    }

    /// Steps with the pool kept awake, as the model runs them: every call's
    /// items run once, the spinners end with each step (none is left to
    /// hold a thread), and a guard outside the pool does nothing.
    #[test]
    fn pool_awake_steps_finish() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let _outside = super::PoolAwake::new();
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            pool.install(|| {
                for _step in 0..200 {
                    let _awake = super::PoolAwake::new();
                    for items in [1, 5, 64] {
                        let seen: Vec<AtomicU32> = (0..items).map(|_| AtomicU32::new(0)).collect();
                        super::for_each_owned(items, 1 << 15, |range| {
                            range.for_each(|i| {
                                seen[i].fetch_add(1, Ordering::Relaxed);
                            })
                        });
                        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
                    }
                }
            });
            // A spinner still running would keep this job from starting on a
            // one-thread-short pool for ever; every thread must take one.
            let ran = AtomicU32::new(0);
            pool.broadcast(|_| ran.fetch_add(1, Ordering::Relaxed));
            assert_eq!(ran.load(Ordering::Relaxed), threads as u32);
        }
    }

    /// Two step loops sharing one pool (two engines in one process), each
    /// keeping it awake, with nested parallel work (rayon's recursive
    /// splitting) as attention has: each thread may run the other loop's
    /// spinner, and both loops must still finish.
    #[test]
    fn two_step_loops_share_a_pool() {
        use rayon::prelude::*;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let step_loop = || {
            for _step in 0..100 {
                let _awake = super::PoolAwake::new();
                let sum: usize = (0..4096usize).into_par_iter().with_max_len(64).map(|i| i * i).sum();
                assert_eq!(sum, (0..4096usize).map(|i| i * i).sum::<usize>());
                super::for_each_owned(16, 1 << 15, |_| std::hint::black_box(()));
            }
        };
        pool.scope(|s| {
            s.spawn(|_| step_loop());
            s.spawn(|_| step_loop());
        });
    }
}
