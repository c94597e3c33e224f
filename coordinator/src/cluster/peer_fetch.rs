//! Peer fetch (issue 60): a request routed to a worker that lacks a
//! prefix another worker holds (in its KV pool or its second tier, ready
//! or draining) has those blocks sent over instead of recomputed, when
//! sending them is cheaper: their bytes at the transfer rate measured so
//! far, against their tokens at the receiver's measured prefill rate.
//!
//! The holder sends the blocks (`ExportKv` -> `ExportedKv` frames) and the
//! coordinator passes each frame on (`ImportKv`); the request's `Generate`
//! follows the last one on the same ordered stream, so the receiver keeps
//! the blocks in its second tier before it looks the prompt up. Both sides
//! check the blocks: the holder sends only blocks of the chain it holds,
//! the receiver keeps only blocks whose hash is their tokens' and parent's
//! and whose identity is its own. A holder that is lost, or slower than
//! the deadline, releases the request to compute its prompt itself. The
//! path does not depend on what the sender is: a worker that prefills only
//! could feed one that decodes the same way.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::protocol::CoordinatorMessage;
use common::{BlockHash, RequestId, WorkerId};

use super::{Cluster, State};

/// Fewer missing blocks than this are recomputed (a fetch's round trip
/// costs more than a block's prefill).
pub const MIN_FETCH_BLOCKS: usize = 2;
/// The transfer rate assumed before one was measured (a LAN's, through
/// the coordinator).
const ASSUMED_BYTES_PER_S: f64 = 100e6;
/// The prefill rate assumed of a worker that has not reported one.
const ASSUMED_PREFILL_TOKENS_PER_S: f64 = 1000.0;

/// A fetch in flight: the request waits for its blocks.
pub(super) struct Transfer {
    pub request: RequestId,
    pub from: WorkerId,
    pub to: WorkerId,
    pub identity: u64,
    /// The request, sent to `to` once the blocks are in (or given up on).
    pub generate: CoordinatorMessage,
    pub bytes: u64,
    pub started: Instant,
    pub deadline: Instant,
}

#[derive(Default)]
pub(super) struct Fetches {
    transfers: HashMap<u64, Transfer>,
    next_id: u64,
    /// Measured over finished transfers (a moving average).
    bytes_per_s: Option<f64>,
    pub done: u64,
    pub given_up: u64,
}

/// What a fetch would move: from whom, which blocks, and when it is late.
pub(super) struct FetchPlan {
    pub from: WorkerId,
    pub hashes: Vec<BlockHash>,
    pub expected: Duration,
}

impl Fetches {
    pub fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s.unwrap_or(ASSUMED_BYTES_PER_S)
    }

    /// Whether `blocks` blocks of `block_bytes` each, `block_size` tokens
    /// each, come faster over the wire than computed at `prefill_tokens_per_s`
    /// (0: unknown); and how long the transfer should take.
    pub fn worth_it(
        &self,
        blocks: usize,
        (block_bytes, block_size): (u64, usize),
        prefill_tokens_per_s: f64,
    ) -> Option<Duration> {
        if blocks < MIN_FETCH_BLOCKS {
            return None;
        }
        let prefill = if prefill_tokens_per_s > 0.0 { prefill_tokens_per_s } else { ASSUMED_PREFILL_TOKENS_PER_S };
        let fetch_s = (blocks as u64 * block_bytes) as f64 / self.bytes_per_s();
        let compute_s = (blocks * block_size) as f64 / prefill;
        (fetch_s < compute_s).then(|| Duration::from_secs_f64(fetch_s))
    }

    /// The id the next transfer takes (sent to the holder before `start`).
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    pub fn start(&mut self, id: u64, transfer: Transfer) {
        self.next_id = self.next_id.max(id + 1);
        self.transfers.insert(id, transfer);
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Transfer> {
        self.transfers.get_mut(&id)
    }

    /// Ends a transfer; a whole one updates the measured rate.
    pub fn finish(&mut self, id: u64, whole: bool) -> Option<Transfer> {
        let t = self.transfers.remove(&id)?;
        let took = t.started.elapsed().as_secs_f64();
        if whole && t.bytes > 0 && took > 0.0 {
            let rate = t.bytes as f64 / took;
            self.bytes_per_s = Some(self.bytes_per_s.map_or(rate, |r| 0.7 * r + 0.3 * rate));
        }
        Some(t)
    }

    /// Transfers past their deadline, or from or to a worker in `gone`.
    pub fn stale(&self, now: Instant, gone: &dyn Fn(WorkerId) -> bool) -> Vec<u64> {
        self.transfers
            .iter()
            .filter(|(_, t)| now > t.deadline || gone(t.from) || gone(t.to))
            .map(|(&id, _)| id)
            .collect()
    }
}

/// The fetch worth making for a prompt of hash chain `chain` routed to
/// `to`: the longest run past what `to` holds that one worker of its
/// identity holds (pool or tier, not merely claimed by a request in
/// flight), if moving it beats computing it.
pub(super) fn plan(state: &State, to: WorkerId, chain: &[BlockHash], block_size: usize) -> Option<FetchPlan> {
    let target = state.registry.get(to)?;
    if !target.kv_tier || chain.len() < MIN_FETCH_BLOCKS {
        return None;
    }
    let index = state.router.index();
    let own = index.held_overlap(to, chain);
    let (from, held) = state
        .registry
        .all()
        .filter(|&(id, w)| id != to && w.kv_identity == target.kv_identity)
        .map(|(id, _)| (id, index.held_overlap(id, chain)))
        .max_by_key(|&(id, held)| (held, std::cmp::Reverse(id)))?;
    let missing = held.checked_sub(own)?;
    let expected =
        state.fetches.worth_it(missing, (target.kv_block_bytes, block_size), target.prefill_tokens_per_s())?;
    Some(FetchPlan { from, hashes: chain[own..held].to_vec(), expected })
}

impl Cluster {
    /// A frame of blocks from a holder: passed on to the waiting worker;
    /// after the last, the request goes to it.
    pub(super) fn on_exported_kv(
        &self,
        state: &mut State,
        from: WorkerId,
        transfer: u64,
        blocks: Vec<common::protocol::KvBlock>,
        last: bool,
    ) {
        if transfer == common::protocol::KV_HANDOFF {
            return self.on_handoff(state, from, blocks, last);
        }
        let Some(t) = state.fetches.get_mut(transfer) else { return }; // late: given up on
        if t.from != from {
            return;
        }
        t.bytes += blocks.iter().map(|b| b.bytes.len() as u64).sum::<u64>();
        let (to, identity) = (t.to, t.identity);
        if !blocks.is_empty()
            && let Some(w) = state.registry.get(to)
        {
            w.send(CoordinatorMessage::ImportKv { identity, blocks });
        }
        if last {
            self.release_fetch(state, transfer, true);
        }
    }

    /// A draining worker's blocks: passed to the least loaded ready peer of
    /// its identity that keeps a peer's blocks (dropped when there is none);
    /// the last frame is confirmed, so the worker may close.
    fn on_handoff(&self, state: &mut State, from: WorkerId, blocks: Vec<common::protocol::KvBlock>, last: bool) {
        let Some(identity) = state.registry.get(from).map(|w| w.kv_identity) else { return };
        let ready = state.registry.ready_except(Some(from));
        let target = ready
            .into_iter()
            .filter_map(|id| state.registry.get(id).map(|w| (id, w)))
            .filter(|(_, w)| w.kv_tier && w.kv_identity == identity)
            .min_by_key(|(id, w)| (w.in_flight, *id))
            .map(|(id, _)| id);
        if let Some(target) = target.and_then(|id| state.registry.get(id))
            && !blocks.is_empty()
        {
            target.send(CoordinatorMessage::ImportKv { identity, blocks });
        }
        if last {
            tracing::info!("worker {}'s KV handoff passed on", state.registry.label(from));
            if let Some(w) = state.registry.get(from) {
                w.send(CoordinatorMessage::HandedOff);
            }
        }
    }

    /// Sends the waiting request on, with its blocks (`whole`) or without.
    pub(super) fn release_fetch(&self, state: &mut State, transfer: u64, whole: bool) {
        let Some(t) = state.fetches.finish(transfer, whole) else { return };
        if whole {
            state.fetches.done += 1;
        } else {
            state.fetches.given_up += 1;
            tracing::info!("request {}: its prefix fetch was given up; the prompt is computed", t.request);
        }
        // The request may have ended or moved meanwhile (a lost worker's
        // requests are dispatched again; that dispatch sent its own).
        if state.requests.get(&t.request).is_some_and(|r| r.worker == t.to)
            && let Some(w) = state.registry.get(t.to)
        {
            w.send(t.generate);
        }
    }

    /// Gives up on fetches that are late or whose holder or receiver left.
    pub(super) fn expire_fetches(&self, state: &mut State, now: Instant) {
        let registry = &state.registry;
        let stale = state.fetches.stale(now, &|id| registry.get(id).is_none());
        for id in stale {
            self.release_fetch(state, id, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fetch_is_made_when_moving_bytes_beats_computing_tokens() {
        let mut f = Fetches::default();
        // 100 MB/s assumed; blocks of 16 tokens and 1 MB: 10 ms a block to move.
        let block = (1_000_000, 16);
        assert!(f.worth_it(10, block, 1000.0).is_some(), "16 ms a block to compute at 1000 tok/s");
        assert!(f.worth_it(10, block, 5000.0).is_none(), "3.2 ms a block to compute");
        assert!(f.worth_it(1, block, 10.0).is_none(), "too few blocks");
        assert!(f.worth_it(10, block, 0.0).is_some(), "an unknown rate is assumed at 1000 tok/s");
        // A measured slow link (1 MB/s) makes computing the better choice.
        let t = Transfer {
            request: RequestId(1),
            from: WorkerId(0),
            to: WorkerId(1),
            identity: 7,
            generate: CoordinatorMessage::Drain,
            bytes: 1_000_000,
            started: Instant::now() - Duration::from_secs(1),
            deadline: Instant::now(),
        };
        let id = f.next_id();
        f.start(id, t);
        assert!(f.finish(id, true).is_some());
        assert!((f.bytes_per_s() - 1e6).abs() < 1e5, "{}", f.bytes_per_s());
        assert!(f.worth_it(10, block, 1000.0).is_none());
    }
}
