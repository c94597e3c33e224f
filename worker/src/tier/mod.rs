//! The bytes of the prefix cache's second tier (issue 60): the KV of
//! blocks the pool evicted, in host memory (`--kv-offload-bytes`), or in
//! an SSD directory that outlives the worker (`--kv-offload-dir`). Which
//! blocks the tier holds is the engine core's decision
//! (`engine_core::kv_tier`); this store keeps their bytes, and on disk
//! moves them on its own thread (`disk`), so a step never waits on a
//! write, and a prompt whose prefix is on disk waits for its load while
//! other requests step.

mod disk;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::BlockHash;
use engine_core::Offload;

use disk::{Disk, Done, Job};
pub use disk::{FoundBlock, Identity};

use crate::error::Result;

/// `--kv-offload-bytes` and `--kv-offload-dir`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// The tier's size; 0 turns it off.
    pub bytes: u64,
    /// Keep the tier on disk here (persisted across restarts) rather than
    /// in host memory.
    pub dir: Option<PathBuf>,
}

impl TierConfig {
    pub fn enabled(&self) -> bool {
        self.bytes > 0
    }
}

/// What the store tells the engine core about its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreEvent {
    /// Written to disk and out of host memory: a hit must load it first.
    Cooled(BlockHash),
    /// Lost (a failed write: a full or failing disk): no longer held.
    Lost(BlockHash),
    /// A load finished; false when the file was damaged (and is deleted).
    Loaded(BlockHash, bool),
}

/// Bytes and times, for the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    pub bytes_offloaded: u64,
    pub bytes_restored: u64,
    pub bytes_written: u64,
    pub bytes_loaded: u64,
    pub restore_seconds: f64,
    pub offload_seconds: f64,
    pub write_failures: u64,
    pub damaged: u64,
}

pub struct TierStore {
    /// Host copies: every entry of a memory tier; on disk, those being
    /// written, loaded for a hit, or not yet cooled.
    ram: HashMap<BlockHash, Arc<[u8]>>,
    disk: Option<Disk>,
    /// Entries whose write is queued: their host copy stays until written.
    writing: HashSet<BlockHash>,
    loads_in_flight: usize,
    block_bytes: usize,
    pub stats: StoreStats,
}

impl TierStore {
    /// A tier in host memory.
    pub fn in_memory(block_bytes: usize) -> Self {
        Self {
            ram: HashMap::new(),
            disk: None,
            writing: HashSet::new(),
            loads_in_flight: 0,
            block_bytes,
            stats: StoreStats::default(),
        }
    }

    /// A tier in `root`'s directory for `identity`, with the blocks it
    /// already holds (oldest first) for the engine core to adopt.
    pub fn on_disk(root: &Path, identity: &Identity, block_bytes: usize) -> Result<(Self, Vec<FoundBlock>)> {
        let (disk, found) = Disk::open(root, identity)?;
        tracing::info!(dir = %disk.dir.display(), blocks = found.len(), "KV tier on disk: {}", identity.description);
        let store = Self { disk: Some(disk), ..Self::in_memory(block_bytes) };
        Ok((store, found))
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Keeps an evicted block's bytes (and queues its write to disk).
    pub fn offload(&mut self, offload: &Offload, bytes: Vec<u8>) {
        self.keep(offload.hash, offload.parent, &offload.tokens, bytes);
    }

    /// Keeps a block's bytes, in host memory and, for a disk tier, on disk
    /// once written (an offload, or a block a peer sent).
    pub fn keep(&mut self, hash: BlockHash, parent: Option<BlockHash>, tokens: &[u32], bytes: Vec<u8>) {
        let bytes: Arc<[u8]> = bytes.into();
        self.stats.bytes_offloaded += bytes.len() as u64;
        if let Some(disk) = &self.disk {
            self.writing.insert(hash);
            disk.send(Job::Write { hash, parent, tokens: tokens.to_vec(), bytes: bytes.clone() });
        }
        self.ram.insert(hash, bytes);
    }

    /// The bytes of a `Ready` entry.
    pub fn get(&self, hash: BlockHash) -> Option<&[u8]> {
        self.ram.get(&hash).map(|b| &b[..])
    }

    /// After a restore: on disk, the host copy goes once it is written
    /// (true: the entry is cold now).
    pub fn restored(&mut self, hash: BlockHash) -> bool {
        self.stats.bytes_restored += self.block_bytes as u64;
        if self.disk.is_some() && !self.writing.contains(&hash) {
            return self.ram.remove(&hash).is_some();
        }
        false
    }

    /// The engine core dropped the entry: its bytes go.
    pub fn drop_entry(&mut self, hash: BlockHash) {
        self.ram.remove(&hash);
        self.writing.remove(&hash);
        if let Some(disk) = &self.disk {
            disk.send(Job::Delete(hash));
        }
    }

    /// Starts loading a cold entry (reported by [`poll`](Self::poll)).
    pub fn load(&mut self, hash: BlockHash) {
        match &self.disk {
            Some(disk) => {
                self.loads_in_flight += 1;
                disk.send(Job::Load(hash));
            }
            None => tracing::error!(?hash, "KV tier: a load asked of a tier in memory"),
        }
    }

    /// What the disk thread finished, waiting up to `wait` for the first
    /// (an engine with nothing to step but loads to wait for).
    pub fn poll(&mut self, wait: Option<Duration>) -> Vec<StoreEvent> {
        let Some(disk) = &self.disk else { return Vec::new() };
        let mut done: Vec<Done> = Vec::new();
        if let Some(wait) = wait
            && let Ok(first) = disk.done.recv_timeout(wait)
        {
            done.push(first);
        }
        done.extend(disk.done.try_iter());
        let mut events = Vec::with_capacity(done.len());
        for d in done {
            match d {
                Done::Written(hash) => {
                    self.stats.bytes_written += self.block_bytes as u64;
                    // Dropped meanwhile (then deleted after it), or written again.
                    if self.writing.remove(&hash) && self.ram.remove(&hash).is_some() {
                        events.push(StoreEvent::Cooled(hash));
                    }
                }
                Done::WriteFailed(hash, error) => {
                    self.stats.write_failures += 1;
                    tracing::warn!(?hash, %error, "KV tier: a block's write failed; it is evicted instead");
                    if self.writing.remove(&hash) {
                        self.ram.remove(&hash);
                        events.push(StoreEvent::Lost(hash));
                    }
                }
                Done::Loaded(..) if self.loads_in_flight == 0 => {}
                Done::Loaded(hash, Ok(bytes)) if bytes.len() == self.block_bytes => {
                    self.loads_in_flight -= 1;
                    self.stats.bytes_loaded += bytes.len() as u64;
                    self.ram.insert(hash, bytes.into());
                    events.push(StoreEvent::Loaded(hash, true));
                }
                Done::Loaded(hash, result) => {
                    self.loads_in_flight -= 1;
                    self.stats.damaged += 1;
                    let why = result.err().unwrap_or_else(|| "a block of another size".into());
                    tracing::warn!(?hash, %why, "KV tier: a damaged block file, deleted; its tokens are recomputed");
                    events.push(StoreEvent::Loaded(hash, false));
                }
            }
        }
        events
    }

    /// Loads asked for and not yet reported.
    pub fn loads_in_flight(&self) -> usize {
        self.loads_in_flight
    }
}
