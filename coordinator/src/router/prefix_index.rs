//! The cluster-wide prefix index: which worker holds which cached block,
//! rebuilt from the workers' KV events.
//!
//! Block hashes are chained (each one covers its parent's), so a flat map
//! from hash to holders is equivalent to a radix tree over hash chains: the
//! prefix a worker can reuse for a prompt is the run of the prompt's hash
//! chain, from the first block on, that the worker holds. A worker may hold
//! a child whose parent was evicted; the walk stops at the first miss,
//! exactly as the worker's own lookup does.
//!
//! Besides what the events report, the index counts blocks a worker is
//! about to hold: the chain of every request routed to it and not yet
//! finished (SGLang's router inserts on routing for the same reason). A
//! burst of requests for one new prefix then follows the first request to
//! its worker instead of scattering before the first KV event arrives; and
//! while a request runs, its blocks cannot be evicted, so the claim holds.
//!
//! Event ids are consecutive per worker. When one is skipped (a lost frame,
//! a restarted engine) the index stops trusting that worker's entries and
//! asks for a snapshot; events that arrive before the snapshot are ignored,
//! because the snapshot reflects them.

use std::collections::HashSet;
use std::hash::BuildHasherDefault;

use common::{BlockHash, KvEvent, KvEventRecord, WorkerId};

use super::u64map::{U64Hasher, U64Map};

type HashSetU64<T> = HashSet<T, BuildHasherDefault<U64Hasher>>;

/// What the caller must do after feeding events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventOutcome {
    Applied,
    /// An event id was skipped: request a snapshot from this worker.
    NeedSnapshot,
}

struct WorkerBlocks {
    /// Dense index into the per-call overlap scratch.
    slot: usize,
    hashes: HashSetU64<BlockHash>,
    /// Blocks in its second tier: reusable, at the cost of a copy back.
    offloaded: HashSetU64<BlockHash>,
    last_event_id: Option<u64>,
    awaiting_snapshot: bool,
}

#[derive(Default)]
pub struct PrefixIndex {
    holders: U64Map<BlockHash, Vec<usize>>,
    /// The same for the workers' second tiers.
    tier_holders: U64Map<BlockHash, Vec<usize>>,
    /// Blocks of in-flight requests, by worker slot, with a count of the
    /// requests claiming each.
    pending: U64Map<BlockHash, Vec<(usize, u32)>>,
    workers: U64Map<WorkerId, WorkerBlocks>,
    slot_owner: Vec<Option<WorkerId>>,
    /// Reused by `overlaps` so a routing decision allocates nothing: each
    /// slot's leading blocks, and how many of them only its tier holds.
    scratch: Vec<usize>,
    restore_scratch: Vec<usize>,
}

impl PrefixIndex {
    /// Starts tracking a worker. Its cache is unknown until its first
    /// snapshot (it may be a restarted worker with a warm cache), so events
    /// are ignored until then.
    pub fn add_worker(&mut self, worker: WorkerId) {
        self.remove_worker(worker);
        let slot = match self.slot_owner.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slot_owner.push(None);
                self.scratch.push(0);
                self.restore_scratch.push(0);
                self.slot_owner.len() - 1
            }
        };
        self.slot_owner[slot] = Some(worker);
        self.workers.insert(
            worker,
            WorkerBlocks {
                slot,
                hashes: HashSetU64::default(),
                offloaded: HashSetU64::default(),
                last_event_id: None,
                awaiting_snapshot: true,
            },
        );
    }

    /// Forgets a lost worker's entries.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let Some(w) = self.workers.remove(&worker) else { return };
        for hash in &w.hashes {
            Self::drop_holder(&mut self.holders, *hash, w.slot);
        }
        for hash in &w.offloaded {
            Self::drop_holder(&mut self.tier_holders, *hash, w.slot);
        }
        self.pending.retain(|_, slots| {
            slots.retain(|&(slot, _)| slot != w.slot);
            !slots.is_empty()
        });
        self.slot_owner[w.slot] = None;
    }

    /// A request with block chain `chain` was routed to `worker`.
    pub fn add_pending(&mut self, worker: WorkerId, chain: &[BlockHash]) {
        let Some(w) = self.workers.get(&worker) else { return };
        for &hash in chain {
            let slots = self.pending.entry(hash).or_default();
            match slots.iter_mut().find(|(slot, _)| *slot == w.slot) {
                Some((_, count)) => *count += 1,
                None => slots.push((w.slot, 1)),
            }
        }
    }

    /// That request finished (or moved): its claim goes; what it left cached
    /// is known from the worker's events.
    pub fn remove_pending(&mut self, worker: WorkerId, chain: &[BlockHash]) {
        let Some(w) = self.workers.get(&worker) else { return };
        for hash in chain {
            let Some(slots) = self.pending.get_mut(hash) else { continue };
            if let Some(i) = slots.iter().position(|(slot, _)| *slot == w.slot) {
                slots[i].1 -= 1;
                if slots[i].1 == 0 {
                    slots.swap_remove(i);
                }
            }
            if slots.is_empty() {
                self.pending.remove(hash);
            }
        }
    }

    pub fn apply_events(&mut self, worker: WorkerId, events: &[KvEventRecord]) -> EventOutcome {
        let Some(w) = self.workers.get_mut(&worker) else { return EventOutcome::Applied };
        for record in events {
            if w.awaiting_snapshot {
                return EventOutcome::Applied;
            }
            let expected = w.last_event_id.map_or(0, |last| last + 1);
            if record.id < expected {
                continue; // already reflected by a snapshot
            }
            if record.id > expected {
                w.awaiting_snapshot = true;
                return EventOutcome::NeedSnapshot;
            }
            w.last_event_id = Some(record.id);
            match record.event {
                KvEvent::Stored { hash, .. } => {
                    if w.hashes.insert(hash) {
                        self.holders.entry(hash).or_default().push(w.slot);
                    }
                }
                KvEvent::Removed { hash } => {
                    if w.hashes.remove(&hash) {
                        Self::drop_holder(&mut self.holders, hash, w.slot);
                    }
                }
                KvEvent::Offloaded { hash, .. } => {
                    if w.offloaded.insert(hash) {
                        self.tier_holders.entry(hash).or_default().push(w.slot);
                    }
                }
                KvEvent::OffloadRemoved { hash } => {
                    if w.offloaded.remove(&hash) {
                        Self::drop_holder(&mut self.tier_holders, hash, w.slot);
                    }
                }
                KvEvent::Cleared => {
                    for hash in w.hashes.drain() {
                        Self::drop_holder(&mut self.holders, hash, w.slot);
                    }
                    for hash in w.offloaded.drain() {
                        Self::drop_holder(&mut self.tier_holders, hash, w.slot);
                    }
                }
            }
        }
        EventOutcome::Applied
    }

    /// Replaces a worker's entries with a full snapshot taken after event
    /// `last_event_id` (`None`: before its first event): `hashes` in its
    /// KV pool, `offloaded` in its second tier.
    pub fn apply_snapshot(
        &mut self,
        worker: WorkerId,
        last_event_id: Option<u64>,
        hashes: impl IntoIterator<Item = BlockHash>,
        offloaded: impl IntoIterator<Item = BlockHash>,
    ) {
        let Some(w) = self.workers.get_mut(&worker) else { return };
        for hash in w.hashes.drain() {
            Self::drop_holder(&mut self.holders, hash, w.slot);
        }
        for hash in w.offloaded.drain() {
            Self::drop_holder(&mut self.tier_holders, hash, w.slot);
        }
        for hash in hashes {
            if w.hashes.insert(hash) {
                self.holders.entry(hash).or_default().push(w.slot);
            }
        }
        for hash in offloaded {
            if w.offloaded.insert(hash) {
                self.tier_holders.entry(hash).or_default().push(w.slot);
            }
        }
        w.last_event_id = last_event_id;
        w.awaiting_snapshot = false;
    }

    /// Calls `f(worker, blocks, restored)` for every worker holding at
    /// least the first block of `chain`, with the number of leading blocks
    /// it holds in either tier, and how many of those only its second tier
    /// holds (a copy back each, rather than a free hit).
    pub fn overlaps(&mut self, chain: &[BlockHash], mut f: impl FnMut(WorkerId, usize, usize)) {
        self.scratch.iter_mut().for_each(|n| *n = 0);
        self.restore_scratch.iter_mut().for_each(|n| *n = 0);
        let mut reached = 0;
        for (i, hash) in chain.iter().enumerate() {
            let cached = self.holders.get(hash).map_or(&[][..], Vec::as_slice);
            let pending = self.pending.get(hash).map_or(&[][..], Vec::as_slice);
            let mut advanced = false;
            for slot in cached.iter().copied().chain(pending.iter().map(|&(slot, _)| slot)) {
                if self.scratch[slot] == i {
                    self.scratch[slot] = i + 1;
                    advanced = true;
                }
            }
            for &slot in self.tier_holders.get(hash).map_or(&[][..], Vec::as_slice) {
                if self.scratch[slot] == i {
                    self.scratch[slot] = i + 1;
                    self.restore_scratch[slot] += 1;
                    advanced = true;
                }
            }
            if !advanced {
                break;
            }
            reached = i + 1;
        }
        if reached == 0 {
            return;
        }
        for (slot, &blocks) in self.scratch.iter().enumerate() {
            if let (true, Some(worker)) = (blocks > 0, self.slot_owner[slot]) {
                f(worker, blocks, self.restore_scratch[slot]);
            }
        }
    }

    /// The number of leading blocks of `chain` that `worker` holds in
    /// either tier (or is computing for a request in flight).
    pub fn overlap(&self, worker: WorkerId, chain: &[BlockHash]) -> usize {
        let Some(slot) = self.workers.get(&worker).map(|w| w.slot) else { return 0 };
        chain
            .iter()
            .take_while(|hash| {
                self.holders.get(hash).is_some_and(|slots| slots.contains(&slot))
                    || self.tier_holders.get(hash).is_some_and(|slots| slots.contains(&slot))
                    || self.pending.get(hash).is_some_and(|slots| slots.iter().any(|&(s, _)| s == slot))
            })
            .count()
    }

    /// The number of leading blocks of `chain` that `worker` holds in
    /// either tier (what it could send a peer; claims of requests in
    /// flight do not count).
    pub fn held_overlap(&self, worker: WorkerId, chain: &[BlockHash]) -> usize {
        let Some(w) = self.workers.get(&worker) else { return 0 };
        chain.iter().take_while(|hash| w.hashes.contains(hash) || w.offloaded.contains(hash)).count()
    }

    /// The hashes the index believes `worker` holds (for tests and debugging).
    pub fn worker_hashes(&self, worker: WorkerId) -> Option<HashSet<BlockHash>> {
        self.workers.get(&worker).map(|w| w.hashes.iter().copied().collect())
    }

    pub fn is_awaiting_snapshot(&self, worker: WorkerId) -> bool {
        self.workers.get(&worker).is_some_and(|w| w.awaiting_snapshot)
    }

    /// Distinct hashes held anywhere.
    pub fn num_hashes(&self) -> usize {
        self.holders.len()
    }

    /// Distinct hashes claimed by in-flight requests.
    pub fn num_pending_hashes(&self) -> usize {
        self.pending.len()
    }

    fn drop_holder(holders: &mut U64Map<BlockHash, Vec<usize>>, hash: BlockHash, slot: usize) {
        if let Some(slots) = holders.get_mut(&hash) {
            slots.retain(|&s| s != slot);
            if slots.is_empty() {
                holders.remove(&hash);
            }
        }
    }

    /// Panics if the holder map and the per-worker sets disagree.
    pub fn check_invariants(&self) {
        let mut counted = 0;
        for (hash, slots) in &self.holders {
            assert!(!slots.is_empty(), "empty holder list for {hash:?}");
            for &slot in slots {
                let worker = self.slot_owner[slot].expect("holder slot has an owner");
                assert!(self.workers[&worker].hashes.contains(hash), "worker {worker} listed for {hash:?}");
                counted += 1;
            }
        }
        let total: usize = self.workers.values().map(|w| w.hashes.len()).sum();
        assert_eq!(counted, total, "holder entries vs per-worker sets");
        let mut counted = 0;
        for (hash, slots) in &self.tier_holders {
            for &slot in slots {
                let worker = self.slot_owner[slot].expect("holder slot has an owner");
                assert!(
                    self.workers[&worker].offloaded.contains(hash),
                    "worker {worker} listed in a tier for {hash:?}"
                );
                counted += 1;
            }
        }
        let total: usize = self.workers.values().map(|w| w.offloaded.len()).sum();
        assert_eq!(counted, total, "tier holder entries vs per-worker sets");
    }
}
