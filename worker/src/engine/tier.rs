//! The engine's side of the prefix cache's second tier: opening the store
//! (and adopting what a disk tier already holds), moving a step's blocks
//! between the KV pool and the store before its forward pass, and telling
//! the engine core what the store's disk thread finished.

use std::time::{Duration, Instant};

use engine_core::KvTransfers;

use super::{Engine, EngineConfig};
use crate::error::{Result, WorkerError};
use crate::models::ModelFiles;
use crate::tier::{Identity, StoreEvent, TierStore};
use common::protocol::{KV_EXPORT_FRAME_BYTES, KvBlock};
use common::{BlockHash, hash_block_tokens};

/// How long a step with nothing to compute waits for a disk load.
const LOAD_WAIT: Duration = Duration::from_millis(20);

/// The identity of this engine's KV blocks: what must match for a block
/// written here to be read by another engine (after a restart, or a peer).
pub(super) fn identity(files: &ModelFiles, config: &EngineConfig, block_bytes: usize) -> Result<Identity> {
    let parts = format!(
        "{} cache, blocks of {} tokens and {block_bytes} bytes, {} layers",
        crate::runner::kv_cache::resolve_format(config.kv_cache_dtype, config.dtype, &config.device)?,
        config.block_size,
        files.config.num_layers
    );
    let mut weights = files.weights.clone();
    weights.extend(files.gguf.clone());
    Identity::new(files.config_hash, &weights, &parts)
}

/// The store for `config.kv_tier`, its size in blocks, and the blocks a
/// disk tier already holds; `None` without a tier.
pub(super) fn open(
    identity: &Identity,
    config: &EngineConfig,
    full_model: bool,
    block_bytes: usize,
) -> Result<Option<(TierStore, usize, Vec<crate::tier::FoundBlock>)>> {
    let tier = &config.kv_tier;
    if !tier.enabled() {
        return Ok(None);
    }
    let refuse = |why: &str| Err(WorkerError::Unsupported(format!("--kv-offload-bytes {why}")));
    if !config.enable_prefix_caching {
        return refuse("needs the prefix cache (drop --no-prefix-caching)");
    }
    if !full_model {
        return refuse("on a pipeline stage (each stage would keep its own layers' part)");
    }
    if config.draft_model.is_some() {
        return refuse("with a draft model (its KV is not kept in the tier)");
    }
    if config.plan.is_none() && !config.device.is_cpu() {
        return refuse("on candle's GPU ops (use the CPU, or the Metal step plan)");
    }
    let blocks = usize::try_from(tier.bytes / block_bytes.max(1) as u64).unwrap_or(usize::MAX);
    if blocks == 0 {
        return refuse(&format!("of {} holds no block of {block_bytes} bytes", tier.bytes));
    }
    Ok(Some(match &tier.dir {
        None => (TierStore::in_memory(block_bytes), blocks, Vec::new()),
        Some(dir) => {
            let (store, found) = TierStore::on_disk(dir, identity, block_bytes)?;
            (store, blocks, found)
        }
    }))
}

impl Engine {
    /// Every block hash the second tier holds (a restarted worker's
    /// snapshot announces them to the router).
    pub fn tier_snapshot(&self) -> Vec<common::BlockHash> {
        self.scheduler.kv_cache_manager().tier_snapshot().into_iter().map(|(hash, _)| hash).collect()
    }

    /// The second tier's bytes and times, when there is one.
    pub fn tier_store_stats(&self) -> Option<crate::tier::StoreStats> {
        self.tier.as_ref().map(|store| store.stats)
    }

    /// Adopts the blocks a disk tier found at start (oldest first, so the
    /// newest are kept when they do not all fit); those not kept are deleted.
    pub(super) fn adopt_tier_blocks(&mut self, found: Vec<crate::tier::FoundBlock>) {
        let Some(store) = &mut self.tier else { return };
        let kv = self.scheduler.kv_cache_manager_mut();
        let mut adopted = 0;
        for block in found {
            if kv.tier_adopt(block.hash, block.parent, &block.tokens) {
                adopted += 1;
            } else {
                store.drop_entry(block.hash);
            }
        }
        // Room made for newer blocks dropped older ones: their files go.
        for hash in kv.take_transfers().dropped {
            store.drop_entry(hash);
        }
        if adopted > 0 {
            tracing::info!(blocks = adopted, "KV tier: blocks kept from before the restart");
        }
    }

    /// Tells the engine core what the store finished; waits up to
    /// `LOAD_WAIT` for it when `idle` and loads are in flight.
    pub(super) fn poll_tier(&mut self, idle: bool) {
        let Some(store) = &mut self.tier else { return };
        let wait = (idle && store.loads_in_flight() > 0).then_some(LOAD_WAIT);
        let kv = self.scheduler.kv_cache_manager_mut();
        for event in store.poll(wait) {
            match event {
                StoreEvent::Cooled(hash) => kv.tier_cooled(hash),
                StoreEvent::Lost(hash) => kv.tier_dropped(hash),
                StoreEvent::Loaded(hash, ok) => {
                    kv.tier_loaded(hash, ok);
                    if ok && !kv.tier().is_some_and(|t| t.contains(hash)) {
                        store.drop_entry(hash); // cleared while it loaded
                    }
                }
            }
        }
    }

    /// Moves a step's blocks before its forward pass: offloads (the
    /// evicted blocks' contents, before anything writes them), restores,
    /// then drops and loads.
    pub(super) fn apply_transfers(&mut self, transfers: &KvTransfers) -> Result<()> {
        let Some(store) = &mut self.tier else { return Ok(()) };
        if transfers.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        for offload in &transfers.offload {
            let mut bytes = Vec::with_capacity(store.block_bytes());
            self.runner.read_kv_block(offload.block.0 as usize, &mut bytes)?;
            store.offload(offload, bytes);
        }
        let offloaded = Instant::now();
        store.stats.offload_seconds += (offloaded - started).as_secs_f64();
        for &(hash, block) in &transfers.restore {
            let bytes = store
                .get(hash)
                .ok_or_else(|| WorkerError::KvCache(format!("the KV tier lost block {hash:?} that a step restores")))?;
            self.runner.write_kv_block(block.0 as usize, bytes)?;
            if store.restored(hash) {
                self.scheduler.kv_cache_manager_mut().tier_cooled(hash);
            }
        }
        store.stats.restore_seconds += offloaded.elapsed().as_secs_f64();
        for &hash in &transfers.dropped {
            store.drop_entry(hash);
        }
        for &hash in &transfers.load {
            store.load(hash);
        }
        Ok(())
    }

    /// This engine's KV identity (peers exchange blocks under one only).
    pub fn kv_identity(&self) -> u64 {
        self.kv_identity
    }

    /// Bytes of one KV block, every layer's K and V.
    pub fn kv_block_bytes(&self) -> usize {
        self.runner.kv_block_bytes()
    }

    /// Whether blocks a peer sends are kept (a second tier is on).
    pub fn takes_kv_imports(&self) -> bool {
        self.tier.is_some()
    }

    /// The blocks this engine could send a peer, up to `max_bytes`: its
    /// pool's cached blocks, then its tier's most recently used (in host
    /// memory): a draining worker's handoff.
    pub fn export_all_kv_blocks(&mut self, max_bytes: usize) -> Result<Vec<KvBlock>> {
        let kv = self.scheduler.kv_cache_manager();
        let mut hashes: Vec<BlockHash> = kv.kv_snapshot().1.into_iter().map(|(hash, _)| hash).collect();
        hashes.extend(kv.tier_snapshot().into_iter().rev().map(|(hash, _)| hash));
        hashes.truncate(max_bytes / self.runner.kv_block_bytes().max(1));
        self.export_kv_blocks(&hashes)
    }

    /// The blocks of `hashes` this engine holds in its pool or its tier's
    /// host memory, for a peer (those it lacks, or too large for a frame,
    /// are skipped).
    pub fn export_kv_blocks(&mut self, hashes: &[BlockHash]) -> Result<Vec<KvBlock>> {
        let mut out = Vec::new();
        for &hash in hashes {
            let kv = self.scheduler.kv_cache_manager();
            let block = if let Some((block, parent, tokens)) = kv.pool().cached_block(hash) {
                let (parent, tokens) = (parent, tokens.to_vec());
                let mut bytes = Vec::with_capacity(self.runner.kv_block_bytes());
                self.runner.read_kv_block(block.0 as usize, &mut bytes)?;
                KvBlock { hash, parent, tokens, bytes }
            } else {
                let entry = kv.tier().and_then(|t| t.entry(hash));
                let bytes = self.tier.as_ref().and_then(|store| store.get(hash));
                match (entry, bytes) {
                    (Some((parent, tokens, _)), Some(bytes)) => {
                        KvBlock { hash, parent, tokens: tokens.to_vec(), bytes: bytes.to_vec() }
                    }
                    _ => continue,
                }
            };
            if block.bytes.len() > KV_EXPORT_FRAME_BYTES {
                continue;
            }
            out.push(block);
        }
        Ok(out)
    }

    /// Keeps blocks a peer sent in the tier, each checked first: its hash
    /// is its parent's and tokens' (so it can only ever serve the prefix it
    /// names), it is one block of this engine's size, and `identity` is this
    /// engine's. Returns how many were kept.
    pub fn import_kv_blocks(&mut self, identity: u64, blocks: Vec<KvBlock>) -> usize {
        let Some(store) = &mut self.tier else { return 0 };
        if identity != self.kv_identity {
            tracing::warn!("KV blocks of another identity ({identity:016x}) refused");
            return 0;
        }
        let block_size = self.scheduler.config().block_size;
        let kv = self.scheduler.kv_cache_manager_mut();
        let mut kept = 0;
        for block in blocks {
            let sound = block.tokens.len() == block_size
                && block.bytes.len() == store.block_bytes()
                && hash_block_tokens(block.parent, &block.tokens, &[]) == block.hash;
            if !sound {
                tracing::warn!(hash = ?block.hash, "a peer's KV block refused: it is not what its hash says");
                continue;
            }
            if kv.tier_import(block.hash, block.parent, &block.tokens) {
                store.keep(block.hash, block.parent, &block.tokens, block.bytes);
                kept += 1;
            }
        }
        for hash in kv.take_transfers().dropped {
            store.drop_entry(hash);
        }
        kept
    }
}
