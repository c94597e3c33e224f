//! `power_of_two`: the less loaded of two workers drawn at random (Mitzenmacher's
//! "power of two choices": nearly the balance of `least_load` without every
//! router herding onto the same worker).

use super::least_load::load_key;
use super::policy::Candidate;

/// `draw` is a fresh random u64; the router owns the (seeded) generator.
pub fn choose(candidates: &[Candidate], draw: u64, block_size: usize) -> Option<usize> {
    let n = candidates.len() as u64;
    match n {
        0 => None,
        1 => Some(0),
        _ => {
            let a = (draw % n) as usize;
            // A second, distinct index from the high half of the draw.
            let b = ((a as u64 + 1 + (draw >> 32) % (n - 1)) % n) as usize;
            Some(if load_key(&candidates[a], block_size) <= load_key(&candidates[b], block_size) { a } else { b })
        }
    }
}
