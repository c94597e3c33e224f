//! Picks the worker for each request.
//!
//! The router is plain synchronous state (no I/O, no clock), so the cluster
//! calls it under its lock and the simulator (`tinyvllm-bench simulate`)
//! runs the very same code against thousands of simulated workers. It keeps
//! the prefix index (from the workers' KV events) and the load ledger; the
//! policies, one per file, only compare candidates.

mod least_load;
pub mod ledger;
mod policy;
mod power_of_two;
mod prefix_aware;
pub mod prefix_index;
mod round_robin;
mod u64map;

use common::protocol::WorkerStats;
use common::{BlockHash, KvEventRecord, RequestId, WorkerId, hash_prompt_blocks};

pub use ledger::{Ledger, WorkerLoad};
pub use policy::{Candidate, Policy};
pub use prefix_aware::NEW_PREFILL_WEIGHT;
pub use prefix_index::{EventOutcome, PrefixIndex};
use u64map::U64Map;

/// The router's choice for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub worker: WorkerId,
    /// Prompt tokens the chosen worker should find cached.
    pub predicted_cached_tokens: u32,
}

pub struct Router {
    policy: Policy,
    block_size: usize,
    index: PrefixIndex,
    ledger: Ledger,
    turn: u64,
    rng: u64,
    candidates: Vec<Candidate>,
    /// The worker and block chain of each routed, unfinished request.
    in_flight: U64Map<RequestId, (WorkerId, Vec<BlockHash>)>,
}

impl Router {
    pub fn new(policy: Policy, block_size: usize) -> Self {
        Self::with_seed(policy, block_size, 0x9e37_79b9_7f4a_7c15)
    }

    /// `seed` drives `power_of_two`'s draws (fixed, so runs are repeatable).
    pub fn with_seed(policy: Policy, block_size: usize, seed: u64) -> Self {
        Self {
            policy,
            block_size: block_size.max(1),
            index: PrefixIndex::default(),
            ledger: Ledger::new(block_size),
            turn: 0,
            rng: seed | 1,
            candidates: Vec::new(),
            in_flight: U64Map::default(),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.ledger.load(worker)
    }

    /// A worker joined. Request its KV snapshot: until it arrives the index
    /// treats its cache as empty.
    pub fn add_worker(&mut self, worker: WorkerId) {
        self.index.add_worker(worker);
        self.ledger.add_worker(worker);
    }

    /// A worker was lost: its index entries and ledger go with it.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.ledger.remove_worker(worker);
        self.in_flight.retain(|_, (w, _)| *w != worker);
    }

    pub fn apply_kv_events(&mut self, worker: WorkerId, events: &[KvEventRecord]) -> EventOutcome {
        self.index.apply_events(worker, events)
    }

    pub fn apply_kv_snapshot(
        &mut self,
        worker: WorkerId,
        last_event_id: Option<u64>,
        hashes: impl IntoIterator<Item = BlockHash>,
        offloaded: impl IntoIterator<Item = BlockHash>,
    ) {
        self.index.apply_snapshot(worker, last_event_id, hashes, offloaded);
    }

    pub fn on_stats(&mut self, worker: WorkerId, stats: &WorkerStats) {
        self.ledger.on_stats(worker, stats);
    }

    /// The block-hash chain the router matches a prompt by: the same
    /// function, over the same token ids, that the workers' caches use.
    pub fn prompt_chain(&self, prompt: &[u32]) -> Vec<BlockHash> {
        hash_prompt_blocks(prompt, self.block_size)
    }

    /// Chooses among `eligible` workers (ascending ids, each added before)
    /// for a prompt whose hash chain is `chain`. Does not record the
    /// dispatch: call `on_dispatch` once the request is really sent.
    pub fn route(&mut self, prompt_len: usize, chain: &[BlockHash], eligible: &[WorkerId]) -> Option<Decision> {
        self.candidates.clear();
        for &worker in eligible {
            self.candidates.push(Candidate {
                worker,
                cached_blocks: 0,
                restore_blocks: 0,
                load: self.ledger.load(worker),
            });
        }
        if self.candidates.is_empty() {
            return None;
        }
        // A fully cached prompt still recomputes its last token (the worker
        // needs its logits), so at most (len - 1) / block_size blocks hit.
        let usable = chain.len().min(prompt_len.saturating_sub(1) / self.block_size);
        let chain = &chain[..usable];
        if self.policy == Policy::PrefixAware {
            let candidates = &mut self.candidates;
            self.index.overlaps(chain, |worker, blocks, restored| {
                if let Ok(i) = candidates.binary_search_by_key(&worker, |c| c.worker) {
                    candidates[i].cached_blocks = blocks;
                    candidates[i].restore_blocks = restored;
                }
            });
        }
        let prompt_blocks = prompt_len.div_ceil(self.block_size);
        let chosen = match self.policy {
            Policy::RoundRobin => round_robin::choose(&self.candidates, self.turn),
            Policy::LeastLoad => least_load::choose(&self.candidates, self.block_size),
            Policy::PowerOfTwo => {
                let draw = self.next_random();
                power_of_two::choose(&self.candidates, draw, self.block_size)
            }
            Policy::PrefixAware => prefix_aware::choose(&self.candidates, prompt_blocks, self.block_size),
        }?;
        self.turn += 1;
        let c = self.candidates[chosen];
        // Other policies ignore the cache, but their hits are still predicted (for the metrics).
        let cached_blocks =
            if self.policy == Policy::PrefixAware { c.cached_blocks } else { self.index.overlap(c.worker, chain) };
        Some(Decision { worker: c.worker, predicted_cached_tokens: (cached_blocks * self.block_size) as u32 })
    }

    /// The request went to `worker`. `chain` is its prompt's block chain:
    /// the worker counts as holding it until the request finishes.
    pub fn on_dispatch(
        &mut self,
        request: RequestId,
        worker: WorkerId,
        prompt_len: usize,
        chain: &[BlockHash],
        predicted_cached_tokens: u32,
    ) {
        self.on_finish(request);
        self.ledger.on_dispatch(request, worker, prompt_len as u64, predicted_cached_tokens as u64);
        self.index.add_pending(worker, chain);
        self.in_flight.insert(request, (worker, chain.to_vec()));
    }

    pub fn on_tokens(&mut self, request: RequestId, new_tokens: usize) {
        self.ledger.on_tokens(request, new_tokens as u64);
    }

    pub fn on_finish(&mut self, request: RequestId) {
        self.ledger.on_finish(request);
        if let Some((worker, chain)) = self.in_flight.remove(&request) {
            self.index.remove_pending(worker, &chain);
        }
    }

    /// xorshift64*: cheap, seeded, good enough to spread two-choice draws.
    fn next_random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[cfg(test)]
mod tests;
