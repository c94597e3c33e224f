//! `prefix_aware`: the worker with the lowest cost, where cost is the work a
//! request would add there, in KV blocks (Dynamo's KV router uses the same
//! shape of formula):
//!
//! ```text
//! cost = PREFILL_WEIGHT * (new_prefill_blocks + pending_prefill_blocks) + active_blocks
//! ```
//!
//! - `new_prefill_blocks`: blocks of this prompt the worker does not hold
//!   (prompt blocks minus its overlap), i.e. what it would compute;
//! - `pending_prefill_blocks`: prefill already dispatched there and not done;
//! - `active_blocks`: KV held by its running requests (decode load).
//!
//! A cache hit lowers the first term by the blocks it saves, so a worker
//! holding a prefix wins until its load exceeds another's by more than the
//! prefill it would save. A popular prefix therefore stays on one worker at
//! light load and spreads to more workers as their load grows, instead of
//! melting one. `PREFILL_WEIGHT` = 1 prices a prefill block like a block of
//! decode load held for the request's lifetime; raise it to favour hits.
//! Ties break on fewer requests in flight, then the lowest worker id: never
//! at random, so a decision can be replayed.

use super::Candidate;

pub const PREFILL_WEIGHT: f64 = 1.0;

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
    let pending_prefill = c.load.pending_prefill_tokens.div_ceil(block_size.max(1) as u64) as f64;
    PREFILL_WEIGHT * (new_prefill + pending_prefill) + c.load.active_blocks as f64
}
