//! The pool of KV blocks: reference counts, the prefix cache (hash -> block)
//! and the free queue in LRU order (vLLM v1's `BlockPool`).
//!
//! A block with `ref_cnt == 0` sits in the free queue. If it holds a hash it
//! is still a cache entry: a new request can revive it (`touch`) until the
//! pool hands it out again, at which point its hash is evicted. The queue is
//! an intrusive doubly-linked list over block indices, so reviving a block
//! from the middle is O(1), with no `Rc<RefCell>` (mistral.rs's lesson).

use std::collections::HashMap;

use common::{BlockHash, BlockId, KvEvent, KvEventRecord};

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct BlockMeta {
    ref_cnt: u32,
    /// Set while the block is a prefix-cache entry.
    cached: Option<CachedKey>,
    prev: u32,
    next: u32,
    in_free_queue: bool,
}

/// What a cached block holds: checked on every hit, so a 64-bit hash
/// collision can never hand out another sequence's KV.
#[derive(Clone, Debug, PartialEq)]
struct CachedKey {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
}

pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    free_head: u32,
    free_tail: u32,
    num_free: usize,
    cache: HashMap<BlockHash, BlockId>,
    enable_caching: bool,
    events: Vec<KvEventRecord>,
    next_event_id: u64,
    /// Cache entries evicted since the last `take_evicted`, with the block
    /// that held them, while a second tier wants them (`record_evictions`).
    evicted: Option<Vec<EvictedBlock>>,
}

/// A cache entry the pool evicted, and the block whose contents (until
/// the step writes it) are that entry's KV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedBlock {
    pub block: BlockId,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize, enable_caching: bool) -> Self {
        let mut pool = Self {
            blocks: vec![
                BlockMeta { ref_cnt: 0, cached: None, prev: NIL, next: NIL, in_free_queue: false };
                num_blocks
            ],
            free_head: NIL,
            free_tail: NIL,
            num_free: 0,
            cache: HashMap::new(),
            enable_caching,
            events: Vec::new(),
            next_event_id: 0,
            evicted: None,
        };
        for i in 0..num_blocks as u32 {
            pool.push_free_tail(i);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (free, cached or not).
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks that hold a reusable prefix (in use or not).
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }

    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.blocks[block.0 as usize].ref_cnt
    }

    /// Takes `n` blocks from the LRU end of the free queue, evicting their
    /// cache entries. `None` (and nothing changes) when fewer are free.
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free_head;
            debug_assert_ne!(id, NIL);
            self.unlink_free(id);
            self.evict(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(BlockId(id));
        }
        Some(out)
    }

    /// Keeps every evicted cache entry for [`take_evicted`](Self::take_evicted).
    pub fn record_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The entries evicted since the last call, in eviction order.
    pub fn take_evicted(&mut self) -> Vec<EvictedBlock> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The cached block for `hash`, if it holds exactly `tokens` after `parent`.
    pub fn lookup(&self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> Option<BlockId> {
        let &block = self.cache.get(&hash)?;
        let key = self.blocks[block.0 as usize].cached.as_ref()?;
        (key.parent == parent && key.tokens == tokens).then_some(block)
    }

    /// The block caching `hash`, with its parent and tokens (a peer's export).
    pub fn cached_block(&self, hash: BlockHash) -> Option<(BlockId, Option<BlockHash>, &[u32])> {
        let &block = self.cache.get(&hash)?;
        let key = self.blocks[block.0 as usize].cached.as_ref()?;
        Some((block, key.parent, &key.tokens))
    }

    /// Takes a reference on cache hits, reviving blocks from the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &BlockId(id) in blocks {
            if self.blocks[id as usize].in_free_queue {
                self.unlink_free(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Drops a reference on each block, in order; blocks reaching zero join
    /// the queue's MRU end in that order, so callers pass a sequence's
    /// blocks tail first to have its tail evicted before its shared prefix.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for BlockId(id) in blocks {
            let meta = &mut self.blocks[id as usize];
            debug_assert!(meta.ref_cnt > 0, "double free of block {id}");
            meta.ref_cnt = meta.ref_cnt.saturating_sub(1);
            if meta.ref_cnt == 0 {
                self.push_free_tail(id);
            }
        }
    }

    /// Makes a full block reusable under `hash`. If another block already
    /// holds that hash this one stays private (and is simply freed later).
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) {
        if !self.enable_caching || self.cache.contains_key(&hash) {
            return;
        }
        let meta = &mut self.blocks[block.0 as usize];
        debug_assert!(meta.cached.is_none());
        meta.cached = Some(CachedKey { hash, parent, tokens: tokens.to_vec() });
        self.cache.insert(hash, block);
        self.emit(KvEvent::Stored { hash, parent });
    }

    /// Drops every cache entry; only when no block is in use (else false).
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.blocks.len() {
            return false;
        }
        for meta in &mut self.blocks {
            meta.cached = None;
        }
        self.cache.clear();
        self.emit(KvEvent::Cleared);
        true
    }

    /// Every cached (hash, parent) and the id of the last event emitted
    /// (`None` before the first): what a router needs to rebuild its view
    /// of this cache after it missed events.
    pub fn snapshot(&self) -> (Option<u64>, Vec<(BlockHash, Option<BlockHash>)>) {
        let hashes =
            self.blocks.iter().filter_map(|meta| meta.cached.as_ref()).map(|key| (key.hash, key.parent)).collect();
        (self.next_event_id.checked_sub(1), hashes)
    }

    /// Events since the last drain, ids increasing by one.
    pub fn drain_events(&mut self) -> Vec<KvEventRecord> {
        std::mem::take(&mut self.events)
    }

    /// Panics with a description if the pool's bookkeeping is inconsistent:
    /// every block is either referenced and out of the free queue, or
    /// unreferenced and in it; the queue links agree with the count; the
    /// cache map and the blocks' keys agree.
    pub fn check_invariants(&self) {
        let mut seen = 0;
        let mut prev = NIL;
        let mut cur = self.free_head;
        while cur != NIL {
            let meta = &self.blocks[cur as usize];
            assert!(meta.in_free_queue && meta.ref_cnt == 0, "block {cur} in free queue with ref_cnt {}", meta.ref_cnt);
            assert_eq!(meta.prev, prev, "broken back link at block {cur}");
            seen += 1;
            assert!(seen <= self.blocks.len(), "cycle in free queue");
            prev = cur;
            cur = meta.next;
        }
        assert_eq!(prev, self.free_tail);
        assert_eq!(seen, self.num_free, "free count");
        for (i, meta) in self.blocks.iter().enumerate() {
            assert_eq!(
                meta.in_free_queue,
                meta.ref_cnt == 0,
                "block {i}: ref_cnt {} in_free {}",
                meta.ref_cnt,
                meta.in_free_queue
            );
            if let Some(key) = &meta.cached {
                assert_eq!(self.cache.get(&key.hash), Some(&BlockId(i as u32)), "block {i} cached but not in map");
            }
        }
        for (hash, block) in &self.cache {
            assert_eq!(self.blocks[block.0 as usize].cached.as_ref().map(|k| k.hash), Some(*hash));
        }
    }

    fn evict(&mut self, id: u32) {
        if let Some(key) = self.blocks[id as usize].cached.take() {
            self.cache.remove(&key.hash);
            self.emit(KvEvent::Removed { hash: key.hash });
            if let Some(evicted) = &mut self.evicted {
                evicted.push(EvictedBlock {
                    block: BlockId(id),
                    hash: key.hash,
                    parent: key.parent,
                    tokens: key.tokens,
                });
            }
        }
    }

    /// Adds `event` to this pool's numbered stream (the second tier's
    /// events share it, so a router sees one order).
    pub fn emit(&mut self, event: KvEvent) {
        self.events.push(KvEventRecord { id: self.next_event_id, event });
        self.next_event_id += 1;
    }

    fn push_free_tail(&mut self, id: u32) {
        let tail = self.free_tail;
        let meta = &mut self.blocks[id as usize];
        meta.prev = tail;
        meta.next = NIL;
        meta.in_free_queue = true;
        if tail == NIL {
            self.free_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.free_tail = id;
        self.num_free += 1;
    }

    fn unlink_free(&mut self, id: u32) {
        let (prev, next) = {
            let meta = &self.blocks[id as usize];
            debug_assert!(meta.in_free_queue);
            (meta.prev, meta.next)
        };
        if prev == NIL {
            self.free_head = next
        } else {
            self.blocks[prev as usize].next = next
        }
        if next == NIL {
            self.free_tail = prev
        } else {
            self.blocks[next as usize].prev = prev
        }
        let meta = &mut self.blocks[id as usize];
        meta.prev = NIL;
        meta.next = NIL;
        meta.in_free_queue = false;
        self.num_free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::hash_block_tokens;

    #[test]
    fn allocates_frees_and_evicts_in_lru_order() {
        let mut pool = BlockPool::new(4, true);
        let a = pool.get_new_blocks(2).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1)]);
        assert_eq!(pool.num_free(), 2);
        let h = hash_block_tokens(None, &[1, 2], &[]);
        pool.cache_block(a[0], h, None, &[1, 2]);
        pool.free(a.iter().rev().copied());
        pool.check_invariants();
        // Queue is now 2, 3, 1, 0: block 0 (cached) is evicted last.
        let b = pool.get_new_blocks(3).unwrap();
        assert_eq!(b, vec![BlockId(2), BlockId(3), BlockId(1)]);
        assert_eq!(pool.lookup(h, None, &[1, 2]), Some(BlockId(0)));
        let c = pool.get_new_blocks(1).unwrap();
        assert_eq!(c, vec![BlockId(0)]);
        assert_eq!(pool.lookup(h, None, &[1, 2]), None);
        let events: Vec<_> = pool.drain_events().into_iter().map(|r| (r.id, r.event)).collect();
        assert_eq!(events, vec![(0, KvEvent::Stored { hash: h, parent: None }), (1, KvEvent::Removed { hash: h })]);
        assert!(pool.get_new_blocks(1).is_none());
        pool.check_invariants();
    }

    #[test]
    fn touch_revives_a_cached_free_block_from_the_middle() {
        let mut pool = BlockPool::new(3, true);
        let blocks = pool.get_new_blocks(3).unwrap();
        let h = hash_block_tokens(None, &[7], &[]);
        pool.cache_block(blocks[1], h, None, &[7]);
        pool.free(blocks.clone());
        let hit = pool.lookup(h, None, &[7]).unwrap();
        pool.touch(&[hit]);
        assert_eq!(pool.ref_cnt(hit), 1);
        assert_eq!(pool.num_free(), 2);
        pool.check_invariants();
    }

    #[test]
    fn a_hash_hit_with_other_tokens_is_refused() {
        let mut pool = BlockPool::new(2, true);
        let b = pool.get_new_blocks(1).unwrap();
        let h = hash_block_tokens(None, &[1, 2], &[]);
        pool.cache_block(b[0], h, None, &[1, 2]);
        // Same hash, different tokens: a forged collision must miss.
        assert_eq!(pool.lookup(h, None, &[9, 9]), None);
        assert_eq!(pool.lookup(h, Some(h), &[1, 2]), None);
    }

    #[test]
    fn reset_only_when_idle() {
        let mut pool = BlockPool::new(2, true);
        let b = pool.get_new_blocks(1).unwrap();
        pool.cache_block(b[0], BlockHash(5), None, &[1]);
        assert!(!pool.reset_prefix_cache());
        pool.free(b);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.num_cached(), 0);
        pool.check_invariants();
    }
}
