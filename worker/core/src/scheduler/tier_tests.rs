//! The second tier against a simulated KV cache: every slot holds the id
//! of the prefix whose last token it keys (what a real K/V row depends
//! on), the step's transfers move whole blocks between the pool and a
//! simulated store, and before each forward pass every position a request
//! counts as computed must hold its own prefix's id: a restored block is
//! exactly the one computing would have written.

use std::collections::{HashMap, HashSet};

use common::{BlockHash, RequestId, SamplingParams};

use super::*;
use crate::output::{SampledToken, SchedulerOutput};

const BS: usize = 16;

fn prefix_id(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3))
}

/// The pool's slots, the tier store's blocks, and which of those are on
/// "disk" only (their bytes gone from host memory until loaded).
struct SimKv {
    slots: Vec<Vec<u64>>,
    store: HashMap<BlockHash, Vec<u64>>,
    loading: Vec<BlockHash>,
    restored: u64,
}

impl SimKv {
    fn new(num_blocks: usize) -> Self {
        Self { slots: vec![vec![0; BS]; num_blocks], store: HashMap::new(), loading: Vec::new(), restored: 0 }
    }

    /// One step: loads finished last step are reported, the transfers
    /// applied in their order, the computed positions checked, the new
    /// ones written, and the next tokens drawn.
    fn step(&mut self, s: &mut Scheduler) -> (SchedulerOutput, Vec<RequestOutput>) {
        for hash in std::mem::take(&mut self.loading) {
            s.kv_cache_manager_mut().tier_loaded(hash, true);
        }
        let out = s.schedule();
        let t = &out.kv_transfers;
        for o in &t.offload {
            self.store.insert(o.hash, self.slots[o.block.0 as usize].clone());
        }
        for (hash, block) in &t.restore {
            self.slots[block.0 as usize] = self.store.get(hash).expect("a restored entry is stored").clone();
            self.restored += 1;
        }
        for hash in &t.dropped {
            self.store.remove(hash);
        }
        self.loading.extend(&t.load);
        let mut sampled = Vec::new();
        for r in &out.scheduled {
            let seq = &s.request(r.id).unwrap().token_ids;
            for p in 0..r.num_computed_tokens {
                let slot = self.slots[r.block_ids[p / BS].0 as usize][p % BS];
                assert_eq!(slot, prefix_id(&seq[..=p]), "request {:?} position {p}: stale KV", r.id);
            }
            for p in r.num_computed_tokens..r.num_computed_tokens + r.num_new_tokens {
                self.slots[r.block_ids[p / BS].0 as usize][p % BS] = prefix_id(&seq[..=p]);
            }
            if r.samples {
                let last = *seq.last().unwrap();
                sampled.push(SampledToken { token_id: (last * 31 + 7) % 50 + 3, logprobs: None });
            }
        }
        let outputs = s.update_from_output(&out, sampled);
        s.check_invariants();
        (out, outputs)
    }

    /// Drops the host copies of every stored entry, as a disk tier does
    /// once they are written: the next hits must load them first.
    fn cool_all(&mut self, s: &mut Scheduler) {
        let hashes: Vec<BlockHash> = s.kv_cache_manager().tier_snapshot().into_iter().map(|(h, _)| h).collect();
        for hash in hashes {
            s.kv_cache_manager_mut().tier_cooled(hash);
        }
    }

    fn run(&mut self, s: &mut Scheduler) -> HashMap<RequestId, Vec<u32>> {
        let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for _ in 0..100_000 {
            if !s.has_unfinished() {
                return tokens;
            }
            for o in self.step(s).1 {
                tokens.entry(o.id).or_default().extend(o.new_token_ids);
            }
        }
        panic!("requests never finished");
    }
}

fn params(max_tokens: u32) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

fn config(num_blocks: usize, tier_blocks: usize) -> SchedulerConfig {
    SchedulerConfig { tier_blocks, max_num_batched_tokens: 64, ..SchedulerConfig::new(4096, BS, num_blocks) }
}

/// Sessions of an agent: each turn re-sends the history so far and adds a little.
fn session_turns(session: u32, turns: usize) -> Vec<Vec<u32>> {
    let mut history: Vec<u32> = (0..90).map(|t| (t * (session + 3) + session) % 47 + 3).collect();
    (0..turns)
        .map(|turn| {
            history.extend((0..(20 + turn as u32 * 3)).map(|t| (t + session * 7) % 41 + 3));
            history.clone()
        })
        .collect()
}

/// Every session's turns, interleaved, on a pool holding about one
/// session: `tier_blocks` of tier, its entries cooled between rounds when
/// `cold`. Returns each turn's tokens and the scheduler.
fn agent_rounds(tier_blocks: usize, cold: bool) -> (Vec<Vec<u32>>, Scheduler, u64) {
    let (sessions, turns) = (4, 4);
    let all: Vec<Vec<Vec<u32>>> = (0..sessions).map(|s| session_turns(s, turns)).collect();
    let mut s = Scheduler::new(config(14, tier_blocks));
    let mut kv = SimKv::new(14);
    let mut outputs = Vec::new();
    for turn in 0..turns {
        for (i, session) in all.iter().enumerate() {
            let id = RequestId((turn * 100 + i) as u64);
            s.add_request(Request::new(id, session[turn].clone(), params(6), 0, 0)).unwrap();
            outputs.push(kv.run(&mut s).remove(&id).unwrap());
            if cold {
                kv.cool_all(&mut s);
            }
        }
    }
    (outputs, s, kv.restored)
}

#[test]
fn restored_blocks_hold_what_computing_them_would_write() {
    let (reference, plain, _) = agent_rounds(0, false);
    assert_eq!(plain.stats().tier, TierStats::default());
    for cold in [false, true] {
        let (outputs, s, restored) = agent_rounds(64, cold);
        assert_eq!(outputs, reference, "cold {cold}");
        let stats = s.stats().tier;
        assert!(restored > 10 && stats.restored == restored, "{stats:?}");
        assert!(stats.hit_tokens >= restored * BS as u64, "{stats:?}");
        assert!(s.stats().prefix_cache.hits < stats.hit_tokens, "most of the reuse came from the tier");
        if cold {
            assert!(stats.loads > 10, "{stats:?}");
        }
    }
}

#[test]
fn a_small_tier_drops_the_least_recently_used_and_stays_exact() {
    let (reference, ..) = agent_rounds(0, false);
    for blocks in [1, 3, 9] {
        let (outputs, s, _) = agent_rounds(blocks, false);
        assert_eq!(outputs, reference, "{blocks} blocks of tier");
        assert!(s.stats().tier.blocks <= blocks);
    }
}

#[test]
fn a_failed_load_is_recomputed() {
    let turns = session_turns(1, 2);
    let mut s = Scheduler::new(config(14, 64));
    let mut kv = SimKv::new(14);
    s.add_request(Request::new(RequestId(1), turns[0].clone(), params(4), 0, 0)).unwrap();
    kv.run(&mut s);
    // Another session takes the whole pool: the first one's blocks go to the tier.
    let other: Vec<u32> = (0..200).map(|t| t % 37 + 5).collect();
    s.add_request(Request::new(RequestId(2), other, params(4), 0, 0)).unwrap();
    kv.run(&mut s);
    assert!(s.stats().tier.offloaded > 0);
    kv.cool_all(&mut s);
    s.add_request(Request::new(RequestId(3), turns[1].clone(), params(4), 0, 0)).unwrap();
    let out = s.schedule();
    assert!(out.scheduled.is_empty(), "it waits for its prefix to load");
    assert!(!out.kv_transfers.load.is_empty());
    // The loads fail (a corrupt file): the entries go and the prompt is computed.
    let failed: HashSet<BlockHash> = out.kv_transfers.load.iter().copied().collect();
    for &hash in &failed {
        s.kv_cache_manager_mut().tier_loaded(hash, false);
    }
    let out = s.schedule();
    assert_eq!(out.scheduled.len(), 1);
    assert!(out.kv_transfers.restore.iter().all(|(h, _)| !failed.contains(h)));
    assert_eq!(s.stats().tier.load_failures, failed.len() as u64);
}
