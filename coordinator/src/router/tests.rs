//! Exact decisions on crafted states, and index consistency against the
//! worker's real block pool.

use common::protocol::WorkerStats;
use common::{BlockHash, KvEvent, KvEventRecord, RequestId, WorkerId, hash_prompt_blocks};
use engine_core::BlockPool;
use proptest::prelude::*;

use super::*;

const BS: usize = 16;

fn stored(id: u64, hash: BlockHash, parent: Option<BlockHash>) -> KvEventRecord {
    KvEventRecord { id, event: KvEvent::Stored { hash, parent } }
}

/// Tells `router` that `worker` holds the first `blocks` blocks of `prompt`.
fn hold(router: &mut Router, worker: u64, prompt: &[u32], blocks: usize) {
    let chain = hash_prompt_blocks(prompt, BS);
    let hashes: Vec<_> = chain[..blocks].to_vec();
    router.apply_kv_snapshot(WorkerId(worker), None, hashes, []);
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

fn router(policy: Policy, workers: &[u64]) -> Router {
    let mut r = Router::new(policy, BS);
    for &w in workers {
        r.add_worker(WorkerId(w));
        r.apply_kv_snapshot(WorkerId(w), None, [], []);
    }
    r
}

fn route(r: &mut Router, p: &[u32], eligible: &[u64]) -> Decision {
    let chain = r.prompt_chain(p);
    let eligible: Vec<WorkerId> = eligible.iter().copied().map(WorkerId).collect();
    r.route(p.len(), &chain, &eligible).expect("a worker")
}

#[test]
fn prefix_aware_prefers_the_worker_holding_the_prefix() {
    let mut r = router(Policy::PrefixAware, &[0, 1, 2]);
    let p = prompt(1, 208); // 13 blocks
    hold(&mut r, 2, &p, 12);
    hold(&mut r, 1, &p, 3);
    let d = route(&mut r, &p, &[0, 1, 2]);
    assert_eq!(d, Decision { worker: WorkerId(2), predicted_cached_tokens: 192 });
}

#[test]
fn predicted_hits_leave_the_last_token_to_compute() {
    let mut r = router(Policy::PrefixAware, &[0]);
    let p = prompt(1, 64); // exactly 4 blocks, all held
    hold(&mut r, 0, &p, 4);
    assert_eq!(route(&mut r, &p, &[0]).predicted_cached_tokens, 48);
}

#[test]
fn a_loaded_holder_loses_to_an_idle_worker_once_load_outweighs_the_hit() {
    let p = prompt(7, 208); // 13 blocks, 12 reusable
    let loaded = |active_tokens: usize| {
        let mut r = router(Policy::PrefixAware, &[0, 1]);
        hold(&mut r, 0, &p, 12);
        r.on_dispatch(RequestId(100), WorkerId(0), active_tokens, &[], 0);
        r.on_tokens(RequestId(100), 0);
        r
    };
    // Holder: 2 * 1 + 25 = 27 > idle worker: 2 * 13 = 26.
    let mut r = loaded(400);
    assert_eq!(r.load(WorkerId(0)).active_blocks, 25);
    assert_eq!(route(&mut r, &p, &[0, 1]).worker, WorkerId(1));
    // Holder: 2 * 1 + 23 = 25 < 26: the hit still wins.
    let mut r = loaded(368);
    assert_eq!(route(&mut r, &p, &[0, 1]).worker, WorkerId(0));
}

#[test]
fn a_hot_prefix_spreads_as_its_requests_pile_up() {
    // 64 requests for one prefix arrive before any finishes: the first go
    // to the holder (it saves them 12 blocks of prefill each), later ones
    // spread as its ledger load grows, and every worker ends up serving it.
    let mut r = router(Policy::PrefixAware, &[0, 1, 2, 3]);
    let p = prompt(3, 208);
    hold(&mut r, 0, &p, 12);
    let mut picks = Vec::new();
    let chain = r.prompt_chain(&p);
    for i in 0..64 {
        let d = route(&mut r, &p, &[0, 1, 2, 3]);
        r.on_dispatch(RequestId(i), d.worker, p.len(), &chain, d.predicted_cached_tokens);
        picks.push(d.worker.0);
    }
    assert_eq!(picks[..2], [0, 0]);
    let mut used = picks.clone();
    used.sort();
    used.dedup();
    assert_eq!(used, vec![0, 1, 2, 3], "picks {picks:?}");
}

/// Routes `n` requests for `prompts(i)`: each one's first token comes back
/// once `window / 4` more were routed, and it finishes once `window` more
/// were (a client keeping `window` requests in flight). Returns how many
/// each worker got.
fn burst(r: &mut Router, workers: &[u64], n: u64, window: u64, prompts: &dyn Fn(u64) -> Vec<u32>) -> Vec<usize> {
    let mut counts = vec![0; workers.len()];
    let id = |i: u64| RequestId(1_000_000 + i);
    for i in 0..n + window {
        if i < n {
            let p = prompts(i);
            let d = route(r, &p, workers);
            let chain = r.prompt_chain(&p);
            r.on_dispatch(id(i), d.worker, p.len(), &chain, d.predicted_cached_tokens);
            counts[workers.iter().position(|&w| w == d.worker.0).expect("an eligible worker")] += 1;
        }
        if let Some(started) = i.checked_sub(window / 4) {
            r.on_tokens(id(started), 1);
        }
        if let Some(done) = i.checked_sub(window) {
            r.on_tokens(id(done), 31);
            r.on_finish(id(done));
        }
    }
    counts
}

#[test]
fn back_to_back_bursts_spread_evenly() {
    // Issue 31: two bursts of 70 requests over 3 workers went 70/0/0, then
    // 46/24/0: requests sharing a cached prompt were counted as if only
    // their uncached tail loaded the worker.
    let one_prompt = |_| prompt(4, 208);
    let shared_prefix = |i: u64| [prompt(4, 192), prompt(100 + i as u32, 24)].concat();
    let short = |i: u64| prompt(200 + i as u32, 6);
    type Prompts<'a> = &'a dyn Fn(u64) -> Vec<u32>;
    let cases: [(&str, Prompts); 3] =
        [("one prompt", &one_prompt), ("a shared prefix", &shared_prefix), ("short prompts", &short)];
    for (name, prompts) in cases {
        for window in [70, 12] {
            let mut r = router(Policy::PrefixAware, &[0, 1, 2]);
            // Worker 0 already caches the prompt (an earlier request).
            hold(&mut r, 0, &prompts(0), prompts(0).len() / BS);
            let first = burst(&mut r, &[0, 1, 2], 70, window, prompts);
            // Every worker now caches what it served.
            for w in 0..3 {
                hold(&mut r, w, &prompts(0), prompts(0).len() / BS);
            }
            let second = burst(&mut r, &[0, 1, 2], 70, window, prompts);
            for counts in [&first, &second] {
                assert!(
                    counts.iter().all(|&c| (18..=29).contains(&c)),
                    "{name}, {window} in flight: {first:?} then {second:?}"
                );
            }
        }
    }
}

#[test]
fn a_burst_for_a_new_prefix_follows_the_first_request() {
    // No worker holds the prefix yet and no KV event has arrived, but the
    // first request's worker is about to: the second goes there too.
    let mut r = router(Policy::PrefixAware, &[0, 1]);
    let p = prompt(9, 208);
    let first = route(&mut r, &p, &[0, 1]);
    let chain = r.prompt_chain(&p);
    r.on_dispatch(RequestId(1), first.worker, p.len(), &chain, first.predicted_cached_tokens);
    let second = route(&mut r, &p, &[0, 1]);
    assert_eq!(second, Decision { worker: first.worker, predicted_cached_tokens: 192 });
    // Once the request finishes, only what the worker reports counts.
    r.on_finish(RequestId(1));
    assert_eq!(r.index().num_pending_hashes(), 0);
    assert_eq!(route(&mut r, &p, &[0, 1]).predicted_cached_tokens, 0);
}

#[test]
fn ties_break_on_requests_then_lowest_id() {
    let mut r = router(Policy::PrefixAware, &[5, 7, 9]);
    let p = prompt(2, 40);
    assert_eq!(route(&mut r, &p, &[5, 7, 9]).worker, WorkerId(5));
    // Same cost (pending prefill is what differs... make it equal): a
    // request with zero tokens adds a request but no blocks.
    r.on_dispatch(RequestId(1), WorkerId(5), 0, &[], 0);
    assert_eq!(route(&mut r, &p, &[5, 7, 9]).worker, WorkerId(7));
}

#[test]
fn pending_prefill_counts_until_the_first_token() {
    let mut r = router(Policy::PrefixAware, &[0, 1]);
    r.on_dispatch(RequestId(1), WorkerId(0), 320, &[], 0);
    assert_eq!(r.load(WorkerId(0)), WorkerLoad { requests: 1, pending_prefill_tokens: 320, active_blocks: 0 });
    r.on_tokens(RequestId(1), 1);
    assert_eq!(r.load(WorkerId(0)), WorkerLoad { requests: 1, pending_prefill_tokens: 0, active_blocks: 21 });
    r.on_finish(RequestId(1));
    assert_eq!(r.load(WorkerId(0)), WorkerLoad::default());
    // A cached prompt's context counts at dispatch: a burst sharing it is
    // seen before any token comes back.
    r.on_dispatch(RequestId(2), WorkerId(0), 320, &[], 304);
    assert_eq!(r.load(WorkerId(0)), WorkerLoad { requests: 1, pending_prefill_tokens: 16, active_blocks: 19 });
    r.on_tokens(RequestId(2), 1);
    assert_eq!(r.load(WorkerId(0)), WorkerLoad { requests: 1, pending_prefill_tokens: 0, active_blocks: 21 });
    r.on_finish(RequestId(2));
    assert_eq!(r.load(WorkerId(0)), WorkerLoad::default());
    // Stats correct the ledger upwards (blocks it cannot see).
    r.on_stats(WorkerId(1), &WorkerStats { kv_blocks_used: 50, ..WorkerStats::default() });
    assert_eq!(r.load(WorkerId(1)).active_blocks, 50);
}

#[test]
fn round_robin_cycles_in_id_order() {
    let mut r = router(Policy::RoundRobin, &[1, 2, 3]);
    let p = prompt(1, 40);
    hold(&mut r, 3, &p, 2);
    let picks: Vec<u64> = (0..6).map(|_| route(&mut r, &p, &[1, 2, 3]).worker.0).collect();
    assert_eq!(picks, [1, 2, 3, 1, 2, 3]);
}

#[test]
fn least_load_takes_fewest_requests_then_fewest_blocks() {
    let mut r = router(Policy::LeastLoad, &[0, 1, 2]);
    r.on_dispatch(RequestId(1), WorkerId(0), 16, &[], 0);
    r.on_dispatch(RequestId(2), WorkerId(1), 160, &[], 0);
    r.on_dispatch(RequestId(3), WorkerId(2), 16, &[], 0);
    r.on_dispatch(RequestId(4), WorkerId(2), 16, &[], 0);
    let p = prompt(1, 40);
    assert_eq!(route(&mut r, &p, &[0, 1, 2]).worker, WorkerId(0));
}

#[test]
fn power_of_two_takes_the_lighter_of_its_two_draws() {
    let c = |worker, requests| Candidate {
        worker: WorkerId(worker),
        cached_blocks: 0,
        restore_blocks: 0,
        load: WorkerLoad { requests, pending_prefill_tokens: 0, active_blocks: 0 },
    };
    let cands = [c(0, 5), c(1, 1), c(2, 3), c(3, 0)];
    // draw 0: a = 0, b = 0 + 1 + 0 = 1 -> worker 1 (1 < 5).
    assert_eq!(power_of_two::choose(&cands, 0, BS), Some(1));
    // draw 2 | (1 << 32): a = 2, b = 2 + 1 + 1 = 4 % 4 = 0 -> worker 2 (3 < 5).
    assert_eq!(power_of_two::choose(&cands, 2 | (1 << 32), BS), Some(2));
    // draw 2 | (0 << 32): a = 2, b = 3 -> worker 3 (0 < 3).
    assert_eq!(power_of_two::choose(&cands, 2, BS), Some(3));
    assert_eq!(power_of_two::choose(&cands[..1], 12345, BS), Some(0));
    assert_eq!(power_of_two::choose(&[], 1, BS), None);
}

#[test]
fn no_eligible_worker_means_no_decision() {
    let mut r = router(Policy::PrefixAware, &[0]);
    assert_eq!(r.route(10, &[], &[]), None);
}

#[test]
fn policy_names_parse() {
    for p in Policy::ALL {
        assert_eq!(p.as_str().parse::<Policy>(), Ok(p));
    }
    assert!("random".parse::<Policy>().is_err());
    assert_eq!(Policy::default(), Policy::PrefixAware);
}

#[test]
fn events_are_ignored_until_the_first_snapshot() {
    let mut index = PrefixIndex::default();
    index.add_worker(WorkerId(0));
    assert!(index.is_awaiting_snapshot(WorkerId(0)));
    index.apply_events(WorkerId(0), &[stored(4, BlockHash(1), None)]);
    assert!(index.worker_hashes(WorkerId(0)).expect("worker").is_empty());
    index.apply_snapshot(WorkerId(0), Some(4), [BlockHash(1)], []);
    // Id 4 is in the snapshot already; 5 follows it.
    let outcome =
        index.apply_events(WorkerId(0), &[stored(4, BlockHash(1), None), stored(5, BlockHash(2), Some(BlockHash(1)))]);
    assert_eq!(outcome, EventOutcome::Applied);
    assert_eq!(index.worker_hashes(WorkerId(0)).expect("worker").len(), 2);
    index.check_invariants();
}

#[test]
fn an_event_gap_asks_for_a_snapshot_once() {
    let mut index = PrefixIndex::default();
    index.add_worker(WorkerId(0));
    index.apply_snapshot(WorkerId(0), None, [], []);
    assert_eq!(index.apply_events(WorkerId(0), &[stored(0, BlockHash(1), None)]), EventOutcome::Applied);
    assert_eq!(index.apply_events(WorkerId(0), &[stored(2, BlockHash(3), None)]), EventOutcome::NeedSnapshot);
    // While the snapshot is on its way, nothing is applied or asked again.
    assert_eq!(index.apply_events(WorkerId(0), &[stored(3, BlockHash(4), None)]), EventOutcome::Applied);
    assert_eq!(index.worker_hashes(WorkerId(0)).expect("worker").len(), 1);
    index.apply_snapshot(WorkerId(0), Some(3), [BlockHash(1), BlockHash(3), BlockHash(4)], []);
    assert_eq!(index.worker_hashes(WorkerId(0)).expect("worker").len(), 3);
    index.check_invariants();
}

#[test]
fn overlap_stops_at_the_first_missing_block() {
    let mut index = PrefixIndex::default();
    let chain = hash_prompt_blocks(&prompt(1, 64), BS);
    for w in [0, 1] {
        index.add_worker(WorkerId(w));
    }
    // Worker 0 holds blocks 0, 1, 3 (2 was evicted); worker 1 holds 0..4.
    index.apply_snapshot(WorkerId(0), None, [chain[0], chain[1], chain[3]], []);
    index.apply_snapshot(WorkerId(1), None, chain.clone(), []);
    assert_eq!(index.overlap(WorkerId(0), &chain), 2);
    assert_eq!(index.overlap(WorkerId(1), &chain), 4);
    index.apply_events(WorkerId(1), &[KvEventRecord { id: 0, event: KvEvent::Removed { hash: chain[0] } }]);
    assert_eq!(index.overlap(WorkerId(1), &chain), 0);
    index.apply_events(WorkerId(0), &[KvEventRecord { id: 0, event: KvEvent::Cleared }]);
    assert_eq!(index.overlap(WorkerId(0), &chain), 0);
    assert_eq!(index.num_hashes(), 3);
    index.remove_worker(WorkerId(1));
    assert_eq!(index.num_hashes(), 0);
    index.check_invariants();
}

#[test]
fn a_lost_worker_takes_its_entries_and_slot_with_it() {
    let mut r = router(Policy::PrefixAware, &[0, 1]);
    let p = prompt(4, 100);
    hold(&mut r, 0, &p, 6);
    r.on_dispatch(RequestId(1), WorkerId(0), 100, &[], 96);
    r.remove_worker(WorkerId(0));
    assert_eq!(r.index().num_hashes(), 0);
    assert_eq!(r.load(WorkerId(0)), WorkerLoad::default());
    r.add_worker(WorkerId(2)); // reuses worker 0's slot
    r.apply_kv_snapshot(WorkerId(2), None, [], []);
    assert_eq!(route(&mut r, &p, &[1, 2]), Decision { worker: WorkerId(1), predicted_cached_tokens: 0 });
    r.index().check_invariants();
}

/// One operation on a worker's real block pool.
#[derive(Clone, Debug)]
enum PoolOp {
    /// Allocate `blocks` blocks for a sequence drawn from `prefix`, cache them, free them.
    Run {
        prefix: u8,
        blocks: u8,
    },
    /// Take `n` blocks (evicting cached ones) and give them back.
    Evict {
        n: u8,
    },
    Reset,
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![
        6 => (0u8..4, 1u8..8).prop_map(|(prefix, blocks)| PoolOp::Run { prefix, blocks }),
        3 => (1u8..32).prop_map(|n| PoolOp::Evict { n }),
        1 => Just(PoolOp::Reset),
    ]
}

proptest! {
    /// Replays real block-pool events through the index with frames lost at
    /// random, answering each gap with a snapshot: after the last delivery
    /// the index agrees with the pool exactly.
    #[test]
    fn index_matches_the_pool_despite_lost_events(
        ops in proptest::collection::vec(pool_op(), 1..60),
        drops in proptest::collection::vec(any::<bool>(), 60),
    ) {
        let mut pool = BlockPool::new(24, true);
        let mut index = PrefixIndex::default();
        index.add_worker(WorkerId(9));
        let (last, hashes) = pool.snapshot();
        index.apply_snapshot(WorkerId(9), last, hashes.into_iter().map(|(h, _)| h), []);
        for (i, op) in ops.iter().enumerate() {
            match *op {
                PoolOp::Run { prefix, blocks } => {
                    let tokens: Vec<u32> = (0..blocks as u32 * BS as u32).map(|t| prefix as u32 * 7919 + t).collect();
                    let chain = hash_prompt_blocks(&tokens, BS);
                    let Some(ids) = pool.get_new_blocks(chain.len()) else { continue };
                    for (j, (&id, &hash)) in ids.iter().zip(&chain).enumerate() {
                        let parent = j.checked_sub(1).map(|p| chain[p]);
                        pool.cache_block(id, hash, parent, &tokens[j * BS..(j + 1) * BS]);
                    }
                    pool.free(ids.into_iter().rev());
                }
                PoolOp::Evict { n } => {
                    if let Some(ids) = pool.get_new_blocks(n as usize) {
                        pool.free(ids);
                    }
                }
                PoolOp::Reset => { pool.reset_prefix_cache(); }
            }
            let events = pool.drain_events();
            if drops[i] && !events.is_empty() {
                continue; // this frame is lost
            }
            if index.apply_events(WorkerId(9), &events) == EventOutcome::NeedSnapshot {
                let (last, hashes) = pool.snapshot();
                index.apply_snapshot(WorkerId(9), last, hashes.into_iter().map(|(h, _)| h), []);
            }
        }
        // One more event, delivered, exposes a trailing gap as any later event would.
        let mut ids = pool.get_new_blocks(1).expect("the pool is idle");
        let tail: Vec<u32> = (0..BS as u32).map(|t| 1_000_000 + t).collect();
        pool.cache_block(ids[0], common::hash_block_tokens(None, &tail, &[]), None, &tail);
        pool.free(ids.drain(..));
        if index.apply_events(WorkerId(9), &pool.drain_events()) == EventOutcome::NeedSnapshot {
            let (last, hashes) = pool.snapshot();
            index.apply_snapshot(WorkerId(9), last, hashes.into_iter().map(|(h, _)| h), []);
        }
        let (_, expected) = pool.snapshot();
        let expected: std::collections::HashSet<BlockHash> = expected.into_iter().map(|(h, _)| h).collect();
        prop_assert_eq!(index.worker_hashes(WorkerId(9)).expect("worker").clone(), expected);
        index.check_invariants();
    }
}

/// A worker whose second tier holds a prompt's prefix is chosen over one
/// that holds nothing, and one holding it in its KV pool over both; the
/// tier's events and snapshot keep the index's view.
#[test]
fn tier_hits_count_below_pool_hits_and_above_nothing() {
    let mut r = Router::new(Policy::PrefixAware, BS);
    for w in 0..3 {
        r.add_worker(WorkerId(w));
        r.apply_kv_snapshot(WorkerId(w), None, [], []);
    }
    let prompt: Vec<u32> = (0..200).collect();
    let chain = r.prompt_chain(&prompt);
    let offloaded: Vec<KvEventRecord> = chain
        .iter()
        .enumerate()
        .map(|(i, &hash)| KvEventRecord { id: i as u64, event: KvEvent::Offloaded { hash, parent: None } })
        .collect();
    r.apply_kv_events(WorkerId(2), &offloaded);
    let everyone = [WorkerId(0), WorkerId(1), WorkerId(2)];
    let d = r.route(prompt.len(), &chain, &everyone).unwrap();
    assert_eq!((d.worker, d.predicted_cached_tokens), (WorkerId(2), 192));
    r.apply_kv_snapshot(WorkerId(1), Some(0), chain.clone(), []);
    assert_eq!(r.route(prompt.len(), &chain, &everyone).unwrap().worker, WorkerId(1), "a pool hit is cheaper");
    // The tier drops its blocks: worker 2 holds nothing any more.
    let removed: Vec<KvEventRecord> = chain
        .iter()
        .enumerate()
        .map(|(i, &hash)| KvEventRecord { id: (chain.len() + i) as u64, event: KvEvent::OffloadRemoved { hash } })
        .collect();
    r.apply_kv_events(WorkerId(2), &removed);
    assert_eq!(r.index().overlap(WorkerId(2), &chain), 0);
    r.index().check_invariants();
    // A snapshot of a restarted worker announces its disk tier.
    r.apply_kv_snapshot(WorkerId(0), None, [], chain.clone());
    assert_eq!(r.index().overlap(WorkerId(0), &chain), chain.len());
    r.index().check_invariants();
}
