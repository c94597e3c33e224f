//! The prefix cache's second tier (SGLang's hierarchical cache, vLLM's
//! offloading connector): a block evicted from the KV pool keeps its
//! contents in a bounded host tier (RAM, or an SSD directory), and a later
//! prompt whose prefix hashes hit the tier has them copied back instead of
//! recomputed.
//!
//! This is the tier's integer side: which block hashes it holds (with the
//! parent and tokens every hit is checked against, as the pool does), in
//! LRU order, and whether each can be copied back now (`Ready`: its bytes
//! are in host memory) or must first be loaded from disk (`Cold`). The
//! bytes live in the worker's store; what a step must move is handed to it
//! with the step ([`KvTransfers`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use common::{BlockHash, BlockId};

/// Where a tier entry's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierState {
    /// In host memory: a step can copy it into a block.
    Ready,
    /// On disk only: it must be loaded (and its checksum checked) first.
    Cold,
    /// Being loaded from disk.
    Loading,
}

#[derive(Clone, Debug)]
struct Entry {
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
    state: TierState,
    last_use: u64,
}

/// The hashes the tier holds, at most `capacity`, least recently used first out.
#[derive(Clone, Debug)]
pub struct KvTier {
    capacity: usize,
    entries: HashMap<BlockHash, Entry>,
    by_use: BTreeMap<u64, BlockHash>,
    clock: u64,
    pinned: HashSet<BlockHash>,
}

impl KvTier {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, entries: HashMap::new(), by_use: BTreeMap::new(), clock: 0, pinned: HashSet::new() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The state of the entry for `hash`, if it holds exactly `tokens` after `parent`.
    pub fn lookup(&self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> Option<TierState> {
        let entry = self.entries.get(&hash)?;
        (entry.parent == parent && entry.tokens == tokens).then_some(entry.state)
    }

    /// The entry for `hash`: its parent, tokens and state.
    pub fn entry(&self, hash: BlockHash) -> Option<(Option<BlockHash>, &[u32], TierState)> {
        self.entries.get(&hash).map(|e| (e.parent, e.tokens.as_slice(), e.state))
    }

    /// The state of the entry for `hash`, unchecked (the store's own reports).
    pub fn lookup_state(&self, hash: BlockHash) -> Option<TierState> {
        self.entries.get(&hash).map(|e| e.state)
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Marks `hash` as just used (a hit, or the pool evicting it again).
    pub fn touch(&mut self, hash: BlockHash) {
        self.clock += 1;
        if let Some(entry) = self.entries.get_mut(&hash) {
            self.by_use.remove(&entry.last_use);
            entry.last_use = self.clock;
            self.by_use.insert(self.clock, hash);
        }
    }

    /// Adds `hash` in `state`, dropping the least recently used entries to
    /// make room; returns the dropped hashes, `hash` itself among them when
    /// it could not be kept. `hash` must not be held yet.
    pub fn insert(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        state: TierState,
    ) -> Vec<BlockHash> {
        debug_assert!(!self.entries.contains_key(&hash));
        let mut dropped = Vec::new();
        while self.entries.len() >= self.capacity {
            let Some(oldest) = self.oldest_droppable() else { break };
            self.remove(oldest);
            dropped.push(oldest);
        }
        if self.entries.len() >= self.capacity {
            // No capacity, or every entry pinned: the new one is not kept.
            dropped.push(hash);
            return dropped;
        }
        self.clock += 1;
        self.entries.insert(hash, Entry { parent, tokens: tokens.to_vec(), state, last_use: self.clock });
        self.by_use.insert(self.clock, hash);
        dropped
    }

    /// The least recently used entry neither being loaded (a load in
    /// flight writes its entry when done) nor pinned.
    fn oldest_droppable(&self) -> Option<BlockHash> {
        self.by_use
            .values()
            .copied()
            .find(|h| !self.pinned.contains(h) && self.entries.get(h).is_some_and(|e| e.state != TierState::Loading))
    }

    /// Keeps `hash` from being dropped for room until [`unpin_all`](Self::unpin_all):
    /// a step restores it after the step's offloads are in.
    pub fn pin(&mut self, hash: BlockHash) {
        self.pinned.insert(hash);
    }

    pub fn unpin_all(&mut self) {
        self.pinned.clear();
    }

    /// Sets the state of `hash`; false when it is not held.
    pub fn set_state(&mut self, hash: BlockHash, state: TierState) -> bool {
        match self.entries.get_mut(&hash) {
            Some(entry) => {
                entry.state = state;
                true
            }
            None => false,
        }
    }

    pub fn remove(&mut self, hash: BlockHash) -> bool {
        match self.entries.remove(&hash) {
            Some(entry) => {
                self.by_use.remove(&entry.last_use);
                true
            }
            None => false,
        }
    }

    /// Drops every entry; returns their hashes.
    pub fn clear(&mut self) -> Vec<BlockHash> {
        self.by_use.clear();
        self.entries.drain().map(|(hash, _)| hash).collect()
    }

    /// Every held (hash, parent), least recently used first.
    pub fn snapshot(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.by_use.values().map(|h| (*h, self.entries[h].parent)).collect()
    }

    /// Panics if the LRU order and the entries disagree.
    pub fn check_invariants(&self) {
        assert_eq!(self.by_use.len(), self.entries.len(), "LRU order vs entries");
        assert!(self.capacity == 0 || self.entries.len() <= self.capacity, "over capacity");
        for (used, hash) in &self.by_use {
            assert_eq!(self.entries.get(hash).map(|e| e.last_use), Some(*used), "{hash:?}");
        }
    }
}

/// An evicted block whose KV goes to the tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offload {
    pub block: BlockId,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

/// What a step must move between the KV pool and the tier before its
/// forward pass, in this order: every `offload` (the blocks' old contents,
/// before anything writes them), then every `restore` (a tier entry into
/// a block), so an entry offloaded and restored in one step arrives whole.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvTransfers {
    pub offload: Vec<Offload>,
    pub restore: Vec<(BlockHash, BlockId)>,
    /// Entries the tier dropped (for room, or failed): their bytes can go.
    pub dropped: Vec<BlockHash>,
    /// Cold entries to load from disk, reported back with
    /// [`Scheduler::tier_loaded`](crate::Scheduler::tier_loaded).
    pub load: Vec<BlockHash>,
}

impl KvTransfers {
    pub fn is_empty(&self) -> bool {
        self.offload.is_empty() && self.restore.is_empty() && self.dropped.is_empty() && self.load.is_empty()
    }

    /// Appends `other`'s transfers after this one's.
    pub fn extend(&mut self, other: KvTransfers) {
        self.offload.extend(other.offload);
        self.restore.extend(other.restore);
        self.dropped.extend(other.dropped);
        self.load.extend(other.load);
    }
}

/// Tier counters, in blocks (the metrics' `vllm:external_prefix_cache_*`
/// count tokens: blocks times the block size).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    pub offloaded: u64,
    pub restored: u64,
    /// Prompt tokens looked up in the tier (past the pool's hits).
    pub queried_tokens: u64,
    pub hit_tokens: u64,
    pub loads: u64,
    pub load_failures: u64,
    pub dropped: u64,
    /// Blocks a peer sent (a fetched prefix).
    pub imported: u64,
    pub blocks: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn drops_the_least_recently_used_and_checks_tokens() {
        let mut tier = KvTier::new(2);
        assert!(tier.insert(h(1), None, &[1], TierState::Ready).is_empty());
        assert!(tier.insert(h(2), Some(h(1)), &[2], TierState::Cold).is_empty());
        tier.touch(h(1));
        assert_eq!(tier.insert(h(3), None, &[3], TierState::Ready), vec![h(2)]);
        assert_eq!(tier.lookup(h(1), None, &[1]), Some(TierState::Ready));
        assert_eq!(tier.lookup(h(1), None, &[9]), None, "another block's tokens under the same hash");
        assert_eq!(tier.lookup(h(2), Some(h(1)), &[2]), None);
        tier.check_invariants();
        assert_eq!(tier.snapshot(), vec![(h(1), None), (h(3), None)]);
    }

    #[test]
    fn a_pinned_entry_is_not_dropped_for_room() {
        let mut tier = KvTier::new(2);
        tier.insert(h(1), None, &[1], TierState::Ready);
        tier.insert(h(2), None, &[2], TierState::Ready);
        tier.pin(h(1));
        assert_eq!(tier.insert(h(3), None, &[3], TierState::Ready), vec![h(2)]);
        tier.unpin_all();
        assert_eq!(tier.insert(h(4), None, &[4], TierState::Ready), vec![h(1)]);
    }

    #[test]
    fn an_entry_being_loaded_is_not_dropped_for_room() {
        let mut tier = KvTier::new(1);
        tier.insert(h(1), None, &[1], TierState::Cold);
        tier.set_state(h(1), TierState::Loading);
        assert_eq!(tier.insert(h(2), None, &[2], TierState::Ready), vec![h(2)], "refused, not kept");
        assert!(tier.contains(h(1)) && !tier.contains(h(2)));
        tier.set_state(h(1), TierState::Ready);
        assert_eq!(tier.insert(h(2), None, &[2], TierState::Ready), vec![h(1)]);
        tier.check_invariants();
    }

    #[test]
    fn no_capacity_holds_nothing() {
        let mut tier = KvTier::new(0);
        assert_eq!(tier.insert(h(1), None, &[1], TierState::Ready), vec![h(1)]);
        assert!(tier.is_empty());
    }
}
