//! A cluster simulator for the router: the real `Router` (policies, prefix
//! index, ledger) routes a synthetic workload over simulated workers whose
//! KV caches are the worker's real `BlockPool` (LRU eviction, real KV
//! events). Time is simulated; only the router's decision latency is
//! measured on the wall clock.
//!
//! Worker model: prefill is compute-bound and runs one request at a time
//! (FIFO), at `prefill_ms_per_token` per *uncached* prompt token; decode is
//! batched, so each request then streams its output at `decode_ms_per_token`
//! regardless of others. A request holds its KV blocks from dispatch to its
//! last token; then they become evictable cache. If a worker's pool has no
//! room the request runs uncached (what preemption and recompute cost a
//! real worker is folded into that).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use common::protocol::WorkerStats;
use common::{BlockHash, BlockId, RequestId, WorkerId, hash_block_tokens};
use engine_core::BlockPool;

use coordinator::router::{Policy, Router};

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    pub requests: usize,
    /// Distinct shared prefixes, drawn with Zipf popularity.
    pub prefixes: usize,
    pub zipf_s: f64,
    pub prefix_blocks: usize,
    pub suffix_blocks: usize,
    pub output_tokens: usize,
    pub block_size: usize,
    /// KV capacity of each worker, in blocks.
    pub kv_blocks: usize,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    /// Offered load as a fraction of the cluster's prefill capacity with no cache hits.
    pub utilization: f64,
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 64,
            requests: 100_000,
            prefixes: 2_000,
            zipf_s: 1.1,
            prefix_blocks: 32,
            suffix_blocks: 4,
            output_tokens: 64,
            block_size: 16,
            kv_blocks: 4_096,
            prefill_ms_per_token: 0.25,
            decode_ms_per_token: 20.0,
            utilization: 0.8,
            seed: 7,
        }
    }
}

#[derive(Clone, Debug)]
pub struct SimReport {
    pub policy: Policy,
    pub workers: usize,
    pub requests: usize,
    /// Cached prompt tokens over all prompt tokens.
    pub hit_rate: f64,
    /// The best possible hit rate: every prefix computed once, anywhere.
    pub ideal_hit_rate: f64,
    /// Busiest worker's prefill work over the mean.
    pub load_imbalance: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    pub decision_p50_us: f64,
    pub decision_p99_us: f64,
}

struct SimWorker {
    pool: BlockPool,
    /// When its prefill server is next free (ms).
    free_at: f64,
    prefill_ms: f64,
}

enum Event {
    FirstToken { request: u64 },
    Finish { request: u64, worker: usize, blocks: Vec<BlockId> },
}

/// Runs `cfg`'s workload through `policy` and reports what happened.
pub fn simulate(cfg: &SimConfig, policy: Policy) -> SimReport {
    let bs = cfg.block_size;
    let mut rng = SplitMix(cfg.seed);
    let zipf = Zipf::new(cfg.prefixes, cfg.zipf_s);
    let mut router = Router::with_seed(policy, bs, cfg.seed);
    let mut workers: Vec<SimWorker> = (0..cfg.workers)
        .map(|w| {
            router.add_worker(WorkerId(w as u64));
            router.apply_kv_snapshot(WorkerId(w as u64), None, [], []);
            SimWorker { pool: BlockPool::new(cfg.kv_blocks, true), free_at: 0.0, prefill_ms: 0.0 }
        })
        .collect();
    let eligible: Vec<WorkerId> = (0..cfg.workers as u64).map(WorkerId).collect();
    let prompt_tokens = (cfg.prefix_blocks + cfg.suffix_blocks) * bs;
    // Arrival rate for the target utilization of the cluster's uncached prefill capacity.
    let service_ms = prompt_tokens as f64 * cfg.prefill_ms_per_token;
    let rate_per_ms = cfg.utilization * cfg.workers as f64 / service_ms;

    let mut events: BinaryHeap<Reverse<(OrdF64, u64, usize)>> = BinaryHeap::new();
    let mut pending: std::collections::HashMap<u64, Event> = std::collections::HashMap::new();
    let mut next_event = 0u64;
    let mut now = 0.0;
    let mut seen_prefix = vec![false; cfg.prefixes];
    let (mut hit_tokens, mut ideal_hits, mut total_tokens) = (0u64, 0u64, 0u64);
    let mut ttfts = Vec::with_capacity(cfg.requests);
    let mut decisions = Vec::with_capacity(cfg.requests);
    let mut stats_at = 0.0;

    for request in 0..cfg.requests as u64 {
        now += -rng.unit().max(1e-12).ln() / rate_per_ms;
        // Deliver everything that happened before this arrival.
        while let Some(&Reverse((OrdF64(t), id, _))) = events.peek() {
            if t > now {
                break;
            }
            events.pop();
            match pending.remove(&id) {
                Some(Event::FirstToken { request, .. }) => router.on_tokens(RequestId(request), 1),
                Some(Event::Finish { request, worker, blocks }) => {
                    workers[worker].pool.free(blocks.into_iter().rev());
                    router.on_finish(RequestId(request));
                    publish(&mut router, &mut workers[worker].pool, worker);
                }
                None => {}
            }
        }
        if now - stats_at >= 1000.0 {
            stats_at = now;
            for (w, sw) in workers.iter().enumerate() {
                let used = (sw.pool.num_blocks() - sw.pool.num_free()) as u64;
                router.on_stats(WorkerId(w as u64), &WorkerStats { kv_blocks_used: used, ..WorkerStats::default() });
            }
        }
        let prefix = zipf.sample(&mut rng);
        let tokens = request_tokens(prefix, request, cfg);
        let chain = router.prompt_chain(&tokens);
        let started = Instant::now();
        let decision = router.route(tokens.len(), &chain, &eligible).expect("workers exist");
        decisions.push(started.elapsed().as_secs_f64() * 1e6);
        let w = decision.worker.0 as usize;
        router.on_dispatch(RequestId(request), decision.worker, tokens.len(), &chain, decision.predicted_cached_tokens);

        let (blocks, cached_blocks) = admit(&mut workers[w].pool, &tokens, &chain, bs);
        publish(&mut router, &mut workers[w].pool, w);
        let cached = cached_blocks * bs;
        hit_tokens += cached as u64;
        total_tokens += tokens.len() as u64;
        if std::mem::replace(&mut seen_prefix[prefix], true) {
            ideal_hits += (cfg.prefix_blocks * bs) as u64;
        }
        let worker = &mut workers[w];
        let prefill = (tokens.len() - cached) as f64 * cfg.prefill_ms_per_token;
        let start = worker.free_at.max(now);
        worker.free_at = start + prefill;
        worker.prefill_ms += prefill;
        let first_token = start + prefill;
        ttfts.push(first_token - now);
        let finish = first_token + cfg.output_tokens as f64 * cfg.decode_ms_per_token;
        for (t, event) in
            [(first_token, Event::FirstToken { request }), (finish, Event::Finish { request, worker: w, blocks })]
        {
            pending.insert(next_event, event);
            events.push(Reverse((OrdF64(t), next_event, w)));
            next_event += 1;
        }
    }

    let loads: Vec<f64> = workers.iter().map(|w| w.prefill_ms).collect();
    let mean_load = loads.iter().sum::<f64>() / loads.len() as f64;
    let max_load = loads.iter().cloned().fold(0.0, f64::max);
    SimReport {
        policy,
        workers: cfg.workers,
        requests: cfg.requests,
        hit_rate: hit_tokens as f64 / total_tokens.max(1) as f64,
        ideal_hit_rate: ideal_hits as f64 / total_tokens.max(1) as f64,
        load_imbalance: if mean_load > 0.0 { max_load / mean_load } else { 1.0 },
        ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_p99_ms: percentile(&mut ttfts, 0.99),
        decision_p50_us: percentile(&mut decisions.clone(), 0.50),
        decision_p99_us: percentile(&mut decisions, 0.99),
    }
}

/// The prompt of request `request`: `prefix`'s blocks, then blocks of its own.
fn request_tokens(prefix: usize, request: u64, cfg: &SimConfig) -> Vec<u32> {
    let mut tokens = Vec::with_capacity((cfg.prefix_blocks + cfg.suffix_blocks) * cfg.block_size);
    for i in 0..cfg.prefix_blocks * cfg.block_size {
        tokens.push((prefix as u32).wrapping_mul(2_654_435_761) ^ i as u32);
    }
    for i in 0..cfg.suffix_blocks * cfg.block_size {
        tokens.push(((request as u32).wrapping_mul(40_503) ^ (i as u32) << 24) | 1);
    }
    tokens
}

/// What the worker's KV cache manager does for a new request: reuse the
/// cached prefix, allocate the rest (evicting LRU blocks), cache full blocks.
/// Returns the blocks held and how many were hits; no room = run uncached.
fn admit(pool: &mut BlockPool, tokens: &[u32], chain: &[BlockHash], bs: usize) -> (Vec<BlockId>, usize) {
    let max_hits = (tokens.len() - 1) / bs;
    let mut hits = Vec::new();
    for (i, &hash) in chain.iter().take(max_hits).enumerate() {
        let parent = i.checked_sub(1).map(|p| chain[p]);
        match pool.lookup(hash, parent, &tokens[i * bs..(i + 1) * bs]) {
            Some(block) => hits.push(block),
            None => break,
        }
    }
    pool.touch(&hits);
    let needed = chain.len() - hits.len();
    let Some(new) = pool.get_new_blocks(needed) else {
        pool.free(hits.into_iter().rev());
        return (Vec::new(), 0);
    };
    let n_hits = hits.len();
    for (j, &block) in new.iter().enumerate() {
        let i = n_hits + j;
        let parent = i.checked_sub(1).map(|p| chain[p]);
        debug_assert_eq!(chain[i], hash_block_tokens(parent, &tokens[i * bs..(i + 1) * bs], &[]));
        pool.cache_block(block, chain[i], parent, &tokens[i * bs..(i + 1) * bs]);
    }
    hits.extend(new);
    (hits, n_hits)
}

/// Sends a worker's new KV events to the router, as the QUIC link would.
fn publish(router: &mut Router, pool: &mut BlockPool, worker: usize) {
    let events = pool.drain_events();
    if !events.is_empty() {
        router.apply_kv_events(WorkerId(worker as u64), &events);
    }
}

pub(crate) fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}

#[derive(Clone, Copy, PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// SplitMix64: small, seeded, reproducible.
pub(crate) struct SplitMix(pub(crate) u64);
impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf over `0..n` by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}
impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(n);
        let mut total = 0.0;
        for k in 1..=n.max(1) {
            total += 1.0 / (k as f64).powf(s);
            cdf.push(total);
        }
        cdf.iter_mut().for_each(|c| *c /= total);
        Self { cdf }
    }
    fn sample(&self, rng: &mut SplitMix) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        SimConfig { workers: 8, requests: 3_000, prefixes: 100, kv_blocks: 512, ..SimConfig::default() }
    }

    #[test]
    fn prefix_aware_beats_round_robin_on_hits_and_ttft() {
        let rr = simulate(&small(), Policy::RoundRobin);
        let pa = simulate(&small(), Policy::PrefixAware);
        assert!(pa.hit_rate > rr.hit_rate, "{pa:?} vs {rr:?}");
        assert!(pa.ttft_mean_ms < rr.ttft_mean_ms, "{pa:?} vs {rr:?}");
        assert!(pa.hit_rate <= pa.ideal_hit_rate + 1e-9);
    }

    #[test]
    fn the_simulation_is_deterministic_but_for_timing() {
        let a = simulate(&small(), Policy::PowerOfTwo);
        let b = simulate(&small(), Policy::PowerOfTwo);
        assert_eq!((a.hit_rate, a.ttft_mean_ms, a.load_imbalance), (b.hit_rate, b.ttft_mean_ms, b.load_imbalance));
    }
}
