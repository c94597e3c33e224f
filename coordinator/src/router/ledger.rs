//! The coordinator's own ledger of the load it has put on each worker:
//! requests in flight, prompt tokens still to prefill, and the context each
//! request decodes over. It is updated at dispatch, first token and finish,
//! so a burst of requests is counted the moment it is routed (not a stats
//! interval later), and corrected by the workers' stats, which see what the
//! ledger cannot: preemption, other clients.
//!
//! A request's whole context counts from its dispatch, cached prefix
//! included: a shared prefix is stored once, but every request attends over
//! all of it at every decode step, and occupies a slot of the batch. (When
//! only the uncached tail counted, a burst of requests sharing a cached
//! prompt looked almost free, and 70 of them went to one worker.)

use common::protocol::WorkerStats;
use common::{RequestId, WorkerId};

use super::u64map::U64Map;

/// A worker's load as the router scores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    pub requests: u32,
    /// Prompt tokens dispatched but not yet prefilled (no first token yet).
    pub pending_prefill_tokens: u64,
    /// The context (prompt and output so far) of the requests dispatched
    /// to it, in blocks, counted from dispatch (a prompt's uncached part
    /// once it is prefilled: until then it is pending prefill); or the
    /// worker's last report of blocks in use, if that is larger.
    pub active_blocks: u64,
}

#[derive(Default)]
struct WorkerLedger {
    requests: u32,
    pending_prefill_tokens: u64,
    active_tokens: u64,
    reported_used_blocks: u64,
}

struct Entry {
    worker: WorkerId,
    prefill_tokens: u64,
    tokens: u64,
    started: bool,
}

pub struct Ledger {
    block_size: usize,
    workers: U64Map<WorkerId, WorkerLedger>,
    requests: U64Map<RequestId, Entry>,
}

impl Ledger {
    pub fn new(block_size: usize) -> Self {
        Self { block_size: block_size.max(1), workers: U64Map::default(), requests: U64Map::default() }
    }

    pub fn add_worker(&mut self, worker: WorkerId) {
        self.workers.insert(worker, WorkerLedger::default());
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
        self.requests.retain(|_, e| e.worker != worker);
    }

    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        let Some(w) = self.workers.get(&worker) else { return WorkerLoad::default() };
        WorkerLoad {
            requests: w.requests,
            pending_prefill_tokens: w.pending_prefill_tokens,
            active_blocks: w.active_tokens.div_ceil(self.block_size as u64).max(w.reported_used_blocks),
        }
    }

    /// A request was sent to `worker` with `prompt_tokens`, of which the
    /// router expects `cached_tokens` to be found in its prefix cache: only
    /// the rest is prefill still to do, but all of it is context to decode over.
    pub fn on_dispatch(&mut self, request: RequestId, worker: WorkerId, prompt_tokens: u64, cached_tokens: u64) {
        self.on_finish(request);
        let prefill_tokens = prompt_tokens.saturating_sub(cached_tokens);
        // The prefill part joins the active context once it is computed, so
        // no token is counted twice.
        if let Some(w) = self.workers.get_mut(&worker) {
            w.requests += 1;
            w.pending_prefill_tokens += prefill_tokens;
            w.active_tokens += prompt_tokens - prefill_tokens;
        }
        self.requests.insert(request, Entry { worker, prefill_tokens, tokens: prompt_tokens, started: false });
    }

    /// `new_tokens` arrived for `request`; the first delivery ends its prefill.
    pub fn on_tokens(&mut self, request: RequestId, new_tokens: u64) {
        let Some(e) = self.requests.get_mut(&request) else { return };
        let Some(w) = self.workers.get_mut(&e.worker) else { return };
        if !e.started {
            e.started = true;
            w.pending_prefill_tokens = w.pending_prefill_tokens.saturating_sub(e.prefill_tokens);
            w.active_tokens += e.prefill_tokens;
        }
        e.tokens += new_tokens;
        w.active_tokens += new_tokens;
    }

    pub fn on_finish(&mut self, request: RequestId) {
        let Some(e) = self.requests.remove(&request) else { return };
        let Some(w) = self.workers.get_mut(&e.worker) else { return };
        w.requests = w.requests.saturating_sub(1);
        if e.started {
            w.active_tokens = w.active_tokens.saturating_sub(e.tokens);
        } else {
            w.pending_prefill_tokens = w.pending_prefill_tokens.saturating_sub(e.prefill_tokens);
            w.active_tokens = w.active_tokens.saturating_sub(e.tokens - e.prefill_tokens);
        }
    }

    pub fn on_stats(&mut self, worker: WorkerId, stats: &WorkerStats) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.reported_used_blocks = stats.kv_blocks_used;
        }
    }
}
