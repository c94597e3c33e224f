//! Which blocks each request holds (vLLM v1's `KVCacheManager`):
//! `get_computed_blocks` finds a prompt's cached prefix, `allocate_slots`
//! grows a request's block table for the tokens it is about to compute and
//! registers its newly full blocks in the prefix cache, `free` returns them.
//!
//! With a sliding window on every layer, a request's leading blocks that
//! no later query can see are handed back as it advances (vLLM's
//! `SlidingWindowManager`). Their ids stay in its block table, so positions
//! still index it, but they are no longer its: the attention kernels start
//! each query at its window and never read them, and new tokens are
//! written past them. `released` counts them; they are never freed twice.

use std::collections::{HashMap, HashSet};

use common::{BlockHash, BlockId, KvEvent, KvEventRecord, RequestId};

use crate::block_pool::BlockPool;
use crate::kv_tier::{KvTier, KvTransfers, Offload, TierState, TierStats};
use crate::request::Request;

/// A prompt's computed prefix: the pool's blocks, then the tier's entries
/// to copy back after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedPrefix {
    pub blocks: Vec<BlockId>,
    /// Tier entries, in position order after `blocks`.
    pub restore: Vec<BlockHash>,
    /// Tokens the two cover.
    pub num_tokens: usize,
    /// More of the prefix is being loaded from disk: admitting the request
    /// now would recompute it.
    pub loading: bool,
}

/// Prefix-cache counters, in tokens (vLLM's `prefix_cache_queries/hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub queries: u64,
    pub hits: u64,
}

pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    enable_caching: bool,
    /// Each request's block table, in position order.
    req_blocks: HashMap<RequestId, Vec<BlockId>>,
    /// How many leading blocks of each request are already in the cache.
    num_cached_blocks: HashMap<RequestId, usize>,
    /// The window of every layer, if all slide.
    sliding_window: Option<usize>,
    /// How many leading blocks of each request went back to the pool as
    /// its window moved past them.
    released: HashMap<RequestId, usize>,
    pub prefix_stats: PrefixCacheStats,
    /// The second tier, when one is configured.
    tier: Option<KvTier>,
    /// What this step must move between the pool and the tier.
    transfers: KvTransfers,
    /// Blocks registered in the cache since `begin_step`: their KV is
    /// computed by the coming forward pass, so one evicted before it holds
    /// nothing to keep.
    fresh: HashSet<BlockId>,
    pub tier_stats: TierStats,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_caching: bool) -> Self {
        Self {
            pool: BlockPool::new(num_blocks, enable_caching),
            block_size,
            enable_caching,
            req_blocks: HashMap::new(),
            num_cached_blocks: HashMap::new(),
            sliding_window: None,
            released: HashMap::new(),
            prefix_stats: PrefixCacheStats::default(),
            tier: None,
            transfers: KvTransfers::default(),
            fresh: HashSet::new(),
            tier_stats: TierStats::default(),
        }
    }

    /// Keeps up to `capacity` evicted blocks in a second tier (0: none).
    pub fn with_tier(mut self, capacity: usize) -> Self {
        if capacity > 0 && self.enable_caching {
            self.pool.record_evictions();
            self.tier = Some(KvTier::new(capacity));
        }
        self
    }

    pub fn tier(&self) -> Option<&KvTier> {
        self.tier.as_ref()
    }

    /// Starts a step's bookkeeping: blocks registered from now on are not
    /// computed until its forward pass.
    pub fn begin_step(&mut self) {
        self.fresh.clear();
    }

    /// What the step scheduled since `begin_step` must move, in order.
    pub fn take_transfers(&mut self) -> KvTransfers {
        if let Some(tier) = &mut self.tier {
            tier.unpin_all();
        }
        std::mem::take(&mut self.transfers)
    }

    /// Adds to the tier a block restored from disk by a worker that
    /// started again (its store found it), as `Cold`.
    pub fn tier_adopt(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> bool {
        let Some(tier) = &mut self.tier else { return false };
        if tier.contains(hash) {
            return true;
        }
        let dropped = tier.insert(hash, parent, tokens, TierState::Cold);
        let kept = !dropped.contains(&hash);
        self.note_dropped(dropped.into_iter().filter(|&h| h != hash).collect());
        if kept {
            self.pool.emit(KvEvent::Offloaded { hash, parent });
        }
        kept
    }

    /// Adds a block a peer sent, its bytes in host memory (`Ready`); false
    /// when the pool or the tier holds it already, or it is not kept.
    pub fn tier_import(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> bool {
        let Some(tier) = &mut self.tier else { return false };
        if tier.contains(hash) || self.pool.cached_block(hash).is_some() {
            return false;
        }
        let dropped = tier.insert(hash, parent, tokens, TierState::Ready);
        let kept = !dropped.contains(&hash);
        self.note_dropped(dropped.into_iter().filter(|&h| h != hash).collect());
        if kept {
            self.tier_stats.imported += 1;
            self.pool.emit(KvEvent::Offloaded { hash, parent });
        }
        kept
    }

    /// A load from disk finished: the entry can be copied back (`ok`), or
    /// it was unreadable and is dropped.
    pub fn tier_loaded(&mut self, hash: BlockHash, ok: bool) {
        let Some(tier) = &mut self.tier else { return };
        if ok {
            tier.set_state(hash, TierState::Ready);
        } else {
            self.tier_stats.load_failures += 1;
            self.tier_dropped(hash);
        }
    }

    /// The store lost an entry (a failed write, a full disk): it is no longer held.
    pub fn tier_dropped(&mut self, hash: BlockHash) {
        let Some(tier) = &mut self.tier else { return };
        if tier.remove(hash) {
            self.tier_stats.dropped += 1;
            self.pool.emit(KvEvent::OffloadRemoved { hash });
        }
    }

    /// The store wrote an entry to disk and let its host copy go.
    pub fn tier_cooled(&mut self, hash: BlockHash) {
        if let Some(tier) = &mut self.tier
            && tier.lookup_state(hash) == Some(TierState::Ready)
        {
            tier.set_state(hash, TierState::Cold);
        }
    }

    /// Sends the pool's evicted entries to the tier (those whose KV is
    /// computed and not already there).
    fn offload_evicted(&mut self) {
        let Some(tier) = &mut self.tier else { return };
        let mut dropped = Vec::new();
        for evicted in self.pool.take_evicted() {
            if self.fresh.contains(&evicted.block) {
                continue;
            }
            if tier.contains(evicted.hash) {
                tier.touch(evicted.hash);
                continue;
            }
            let lost = tier.insert(evicted.hash, evicted.parent, &evicted.tokens, TierState::Ready);
            if lost.contains(&evicted.hash) {
                dropped.extend(lost.into_iter().filter(|&h| h != evicted.hash));
                continue;
            }
            // An entry dropped earlier in this step and offloaded again is kept.
            self.transfers.dropped.retain(|&h| h != evicted.hash);
            dropped.extend(lost);
            self.tier_stats.offloaded += 1;
            self.pool.emit(KvEvent::Offloaded { hash: evicted.hash, parent: evicted.parent });
            self.transfers.offload.push(Offload {
                block: evicted.block,
                hash: evicted.hash,
                parent: evicted.parent,
                tokens: evicted.tokens,
            });
        }
        self.note_dropped(dropped);
    }

    fn note_dropped(&mut self, dropped: Vec<BlockHash>) {
        for hash in dropped {
            self.tier_stats.dropped += 1;
            self.pool.emit(KvEvent::OffloadRemoved { hash });
            self.transfers.dropped.push(hash);
        }
    }

    /// Hands back blocks outside a window every layer shares (see the
    /// module's doc); `None` keeps every block.
    pub fn with_sliding_window(mut self, window: Option<usize>) -> Self {
        self.sliding_window = window.filter(|&w| w > 0);
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks referenced by at least one request.
    pub fn num_used_blocks(&self) -> usize {
        self.pool.num_blocks() - self.pool.num_free()
    }

    pub fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.req_blocks.get(&id).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The longest cached prefix of `req` in whole blocks: the pool's
    /// hits, then the tier's (the caller records the query in
    /// `prefix_stats` once the request is admitted). At least one token is
    /// always left to compute, because the last one's logits are needed.
    /// Disk entries on the path start loading (`ComputedPrefix::loading`).
    /// `req.block_hashes` must be up to date.
    pub fn get_computed_blocks(&mut self, req: &Request) -> ComputedPrefix {
        let mut prefix = ComputedPrefix::default();
        // A request owing prompt logprobs computes its whole prompt (vLLM
        // does the same): a hit would skip the positions it asks about.
        if !self.enable_caching || req.owes_prompt_logprobs() {
            return prefix;
        }
        let max_hit_blocks = (req.num_tokens() - 1) / self.block_size;
        let key = |i: usize| {
            let parent = i.checked_sub(1).map(|p| req.block_hashes[p]);
            (req.block_hashes[i], parent, &req.token_ids[i * self.block_size..(i + 1) * self.block_size])
        };
        let wanted = req.block_hashes.len().min(max_hit_blocks);
        let mut i = 0;
        while i < wanted {
            let (hash, parent, tokens) = key(i);
            match self.pool.lookup(hash, parent, tokens) {
                Some(block) => prefix.blocks.push(block),
                None => break,
            }
            i += 1;
        }
        if let Some(tier) = &mut self.tier {
            while i < wanted {
                let (hash, parent, tokens) = key(i);
                match tier.lookup(hash, parent, tokens) {
                    Some(TierState::Ready) if !prefix.loading => prefix.restore.push(hash),
                    Some(TierState::Ready | TierState::Loading) => prefix.loading = true,
                    Some(TierState::Cold) => {
                        tier.set_state(hash, TierState::Loading);
                        self.transfers.load.push(hash);
                        self.tier_stats.loads += 1;
                        prefix.loading = true;
                    }
                    None => break,
                }
                i += 1;
            }
        }
        prefix.num_tokens = (prefix.blocks.len() + prefix.restore.len()) * self.block_size;
        prefix
    }

    /// Gives `req` blocks for `num_new_tokens` more tokens on top of its
    /// computed ones and of `new_computed` (cache hits found just now).
    /// `None` if the pool is short, with nothing changed but the release
    /// of blocks its window has left (no later step reads them either way).
    ///
    /// `restore` (tier hits after `new_computed`) take the first of the new
    /// blocks; the step copies them back before its forward pass.
    pub fn allocate_slots(
        &mut self,
        req: &Request,
        num_new_tokens: usize,
        new_computed: &[BlockId],
        restore: &[BlockHash],
    ) -> Option<()> {
        let bs = self.block_size;
        let hits = new_computed.len() + restore.len();
        self.release_outside_window(req.id, req.num_computed_tokens + hits * bs);
        let held = self.req_blocks.get(&req.id).map_or(0, Vec::len);
        let total_tokens = req.num_computed_tokens + hits * bs + num_new_tokens;
        let needed = total_tokens.div_ceil(bs).saturating_sub(held + new_computed.len());
        // Reviving a cache hit that sits in the free queue also uses a free block.
        let revived = new_computed.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if needed + revived > self.pool.num_free() {
            return None;
        }
        self.pool.touch(new_computed);
        if let Some(tier) = &mut self.tier {
            // Copied back after this step's offloads, which must not push them out.
            for &hash in restore {
                tier.touch(hash);
                tier.pin(hash);
            }
        }
        let new_blocks = self.pool.get_new_blocks(needed)?;
        self.offload_evicted();
        for (&hash, &block) in restore.iter().zip(&new_blocks) {
            self.transfers.restore.push((hash, block));
        }
        self.tier_stats.restored += restore.len() as u64;
        self.tier_stats.hit_tokens += (restore.len() * bs) as u64;
        let blocks = self.req_blocks.entry(req.id).or_default();
        blocks.extend_from_slice(new_computed);
        blocks.extend(new_blocks);
        // Hits only come before a request's first block, and are cached already.
        debug_assert!(new_computed.is_empty() || held == 0);
        debug_assert!(restore.is_empty() || held == 0);
        *self.num_cached_blocks.entry(req.id).or_insert(0) += new_computed.len();
        if self.enable_caching {
            self.cache_full_blocks(req, total_tokens, restore.len());
        }
        Some(())
    }

    /// Hands back the leading blocks of `id` that no query from position
    /// `computed` on can see: a query at q sees keys from q + 1 - window,
    /// so blocks wholly before `computed + 1 - window` are done with.
    fn release_outside_window(&mut self, id: RequestId, computed: usize) {
        let Some(window) = self.sliding_window else { return };
        let Some(blocks) = self.req_blocks.get(&id) else { return };
        let done = ((computed + 1).saturating_sub(window) / self.block_size).min(blocks.len());
        let released = self.released.entry(id).or_insert(0);
        if done > *released {
            // Tail first, as `free` does: the older block is evicted last.
            self.pool.free(blocks[*released..done].iter().rev().copied());
            *released = done;
        }
    }

    /// Leading blocks of `id` already handed back (its window moved on).
    pub fn num_released_blocks(&self, id: RequestId) -> usize {
        self.released.get(&id).copied().unwrap_or(0)
    }

    /// Registers every block of `req` that is full once `num_tokens` tokens
    /// are computed (their hashes only depend on known tokens). All but
    /// the first `restored` new ones are computed by the coming step (the
    /// restored ones are copied in before it).
    fn cache_full_blocks(&mut self, req: &Request, num_tokens: usize, restored: usize) {
        let full = (num_tokens / self.block_size).min(req.block_hashes.len());
        // A released block may be another request's by now: never registered from here.
        let start = self.num_cached_blocks.get(&req.id).copied().unwrap_or(0).max(self.num_released_blocks(req.id));
        let Some(blocks) = self.req_blocks.get(&req.id) else { return };
        for (i, &block) in blocks.iter().enumerate().take(full).skip(start) {
            let parent = i.checked_sub(1).map(|p| req.block_hashes[p]);
            let tokens = &req.token_ids[i * self.block_size..(i + 1) * self.block_size];
            self.pool.cache_block(block, req.block_hashes[i], parent, tokens);
            if i >= start + restored {
                self.fresh.insert(block);
            }
        }
        if full > start {
            self.num_cached_blocks.insert(req.id, full);
        }
    }

    /// Returns the blocks of `id` past those that hold its first
    /// `num_tokens` tokens (slots of rejected speculative tokens), tail
    /// first. None of them is in the prefix cache: only full blocks of
    /// known tokens are hashed, and these hold none.
    pub fn free_blocks_past(&mut self, id: RequestId, num_tokens: usize) {
        // (Released blocks lie before any rolled-back slot.)
        let keep = num_tokens.div_ceil(self.block_size).max(self.num_released_blocks(id));
        let Some(blocks) = self.req_blocks.get_mut(&id) else { return };
        if blocks.len() <= keep {
            return;
        }
        debug_assert!(self.num_cached_blocks.get(&id).copied().unwrap_or(0) <= keep);
        let tail = blocks.split_off(keep);
        self.pool.free(tail.into_iter().rev());
    }

    /// Returns all of a request's blocks, tail first so that its own tail is
    /// evicted before the prefix it may share with others.
    pub fn free(&mut self, id: RequestId) {
        let released = self.released.remove(&id).unwrap_or(0);
        if let Some(blocks) = self.req_blocks.remove(&id) {
            self.pool.free(blocks.into_iter().skip(released).rev());
        }
        self.num_cached_blocks.remove(&id);
    }

    pub fn drain_events(&mut self) -> Vec<KvEventRecord> {
        self.pool.drain_events()
    }

    pub fn kv_snapshot(&self) -> (Option<u64>, Vec<(BlockHash, Option<BlockHash>)>) {
        self.pool.snapshot()
    }

    /// Every (hash, parent) the second tier holds.
    pub fn tier_snapshot(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.tier.as_ref().map(KvTier::snapshot).unwrap_or_default()
    }

    /// Drops every cache entry, the tier's too (their bytes go with the
    /// step's transfers); only when no block is in use (else false).
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.pool.reset_prefix_cache() {
            return false;
        }
        if let Some(tier) = &mut self.tier {
            let dropped = tier.clear();
            self.tier_stats.dropped += dropped.len() as u64;
            self.transfers.dropped.extend(dropped);
        }
        true
    }

    /// Pool invariants plus: the reference counts equal the number of block
    /// tables naming each block. With no request alive, every block is free
    /// (cached or not) with ref_cnt 0.
    pub fn check_invariants(&self) {
        self.pool.check_invariants();
        if let Some(tier) = &self.tier {
            tier.check_invariants();
        }
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for (id, blocks) in &self.req_blocks {
            for b in &blocks[self.num_released_blocks(*id)..] {
                refs[b.0 as usize] += 1;
            }
        }
        for (i, &r) in refs.iter().enumerate() {
            assert_eq!(self.pool.ref_cnt(BlockId(i as u32)), r, "block {i}: ref_cnt vs block tables");
        }
    }
}
