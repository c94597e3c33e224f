//! `round_robin`: the next worker in id order, whatever it holds.

use super::policy::Candidate;

/// `turn` counts decisions made so far.
pub fn choose(candidates: &[Candidate], turn: u64) -> Option<usize> {
    (!candidates.is_empty()).then(|| (turn % candidates.len() as u64) as usize)
}
