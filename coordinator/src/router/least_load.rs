//! `least_load`: fewest requests in flight, then fewest KV blocks (pending
//! prefill counted as blocks), then lowest worker id.

use common::WorkerId;

use super::policy::Candidate;

pub fn choose(candidates: &[Candidate], block_size: usize) -> Option<usize> {
    candidates.iter().enumerate().min_by_key(|(_, c)| load_key(c, block_size)).map(|(i, _)| i)
}

/// The order both `least_load` and `power_of_two` compare workers by.
pub fn load_key(c: &Candidate, block_size: usize) -> (u32, u64, WorkerId) {
    let blocks = c.load.active_blocks + c.load.pending_prefill_tokens.div_ceil(block_size.max(1) as u64);
    (c.load.requests, blocks, c.worker)
}
