//! Events a worker's block pool emits as blocks enter and leave its prefix
//! cache. The coordinator's router replays them to know which worker holds
//! which prefix; ids are monotonic per worker so a gap is detectable.

use serde::{Deserialize, Serialize};

use crate::BlockHash;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEvent {
    /// A full block became reusable under `hash` (chained from `parent`).
    Stored { hash: BlockHash, parent: Option<BlockHash> },
    /// The block with `hash` was evicted and its KV overwritten.
    Removed { hash: BlockHash },
    /// The block with `hash` is in the worker's second tier (host memory or
    /// disk): a hit there is copied back rather than recomputed.
    Offloaded { hash: BlockHash, parent: Option<BlockHash> },
    /// The second tier dropped the block with `hash`.
    OffloadRemoved { hash: BlockHash },
    /// Every cached block was dropped, in both tiers.
    Cleared,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventRecord {
    pub id: u64,
    pub event: KvEvent,
}
