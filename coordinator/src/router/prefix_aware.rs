//! `prefix_aware`: the worker with the lowest cost, in KV blocks of work
//! (the shape of Dynamo's KV-router cost, with the request's own prefill
//! weighted separately):
//!
//! ```text
//! cost = NEW_PREFILL_WEIGHT * (new_prefill_blocks + RESTORE_COST * restore_blocks)
//!        + pending_prefill_blocks + active_blocks
//! ```
//!
//! - `restore_blocks`: blocks of the overlap that only the worker's second
//!   tier holds (host memory or disk): a hit, but one copied back first;
//! - `new_prefill_blocks`: blocks of this prompt the worker neither holds
//!   nor is computing for an earlier request (prompt blocks minus overlap):
//!   what this request would add to the cluster's compute;
//! - `pending_prefill_blocks`: prefill already routed there and not done,
//!   which this request's first token would wait behind;
//! - `active_blocks`: KV held by its requests past prefill (decode load).
//!
//! `NEW_PREFILL_WEIGHT` = 2 counts a block this request would compute twice:
//! once as cluster work that a hit avoids entirely, once as its own wait.
//! So the holder of a prefix wins while its queue and decode load are less
//! than twice the prefill it saves; past that, the prefix spreads to another
//! worker (which then holds it too). A popular prefix stays on one worker at
//! light load and spreads as load grows, instead of melting one worker.
//! Ties break on fewer requests in flight, then the lowest worker id: never
//! at random, so a decision can be replayed.

use super::policy::Candidate;

pub const NEW_PREFILL_WEIGHT: f64 = 2.0;

/// A block copied back from a second tier, in blocks of prefill: a copy
/// from host memory or an SSD of a block's KV takes a few percent of
/// computing it (docs/kv-tier.md measures it); 0.1 keeps a pool hit ahead
/// of a tier hit, and any hit far ahead of recomputing.
pub const RESTORE_COST: f64 = 0.1;

pub fn choose(candidates: &[Candidate], prompt_blocks: usize, block_size: usize) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (i, cost(c, prompt_blocks, block_size), c.load.requests, c.worker))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)))
        .map(|(i, ..)| i)
}

pub fn cost(c: &Candidate, prompt_blocks: usize, block_size: usize) -> f64 {
    let new_prefill = prompt_blocks.saturating_sub(c.cached_blocks) as f64;
    let restore = RESTORE_COST * c.restore_blocks as f64;
    let pending_prefill = c.load.pending_prefill_tokens.div_ceil(block_size.max(1) as u64) as f64;
    NEW_PREFILL_WEIGHT * (new_prefill + restore) + pending_prefill + c.load.active_blocks as f64
}
