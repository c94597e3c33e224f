//! The chained hash of a full KV block, defined once for the whole cluster.
//!
//! Workers key their prefix cache by it and report it in KV events; the
//! coordinator recomputes it over incoming prompts to find which worker holds
//! which prefix. Both sides must therefore agree bit for bit, across
//! machines, Rust releases and endianness: xxh3-64 with a fixed seed, over the
//! parent hash and then every token as u32 little-endian (the scheme of
//! Dynamo's kv-router). The golden test below pins the values.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

/// Fixed seed of the block hash ("tinyvllm" in ASCII). Changing it changes
/// every hash in the cluster: never do so without a protocol version bump.
pub const BLOCK_HASH_SEED: u64 = 0x7469_6e79_766c_6c6d;

/// Hash of one full block, chained from its parent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockHash(pub u64);

/// `hash(parent, tokens, extra_keys)`: the hash of a block whose tokens are
/// `tokens`, following the block whose hash is `parent` (`None` for the first
/// block of a sequence). `extra_keys` distinguishes blocks whose tokens are
/// equal but whose KV differs (for example another LoRA adapter); empty today.
pub fn hash_block_tokens(parent: Option<BlockHash>, tokens: &[u32], extra_keys: &[u64]) -> BlockHash {
    let mut hasher = Xxh3::with_seed(BLOCK_HASH_SEED);
    // A root block hashes a marker byte instead of a parent, so a root can
    // never collide with a child whose parent hash happens to be 0.
    match parent {
        Some(BlockHash(p)) => {
            hasher.update(&[1u8]);
            hasher.update(&p.to_le_bytes());
        }
        None => hasher.update(&[0u8]),
    }
    for token in tokens {
        hasher.update(&token.to_le_bytes());
    }
    for key in extra_keys {
        hasher.update(&key.to_le_bytes());
    }
    BlockHash(hasher.digest())
}

/// The hash chain of every *full* block of `tokens`; a trailing partial block
/// has no hash (it can still change).
pub fn hash_prompt_blocks(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let hash = hash_block_tokens(parent, block, &[]);
            parent = Some(hash);
            hash
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned values: the coordinator and every worker build must produce
    /// exactly these. If this test fails, the cluster's prefix routing breaks.
    #[test]
    fn golden_values_are_pinned() {
        let root = hash_block_tokens(None, &[1, 2, 3, 4], &[]);
        let child = hash_block_tokens(Some(root), &[5, 6, 7, 8], &[]);
        assert_eq!(root, BlockHash(GOLDEN_ROOT));
        assert_eq!(child, BlockHash(GOLDEN_CHILD));
        let chain = hash_prompt_blocks(&(0..40).collect::<Vec<u32>>(), 16);
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[1], BlockHash(GOLDEN_CHAIN_1));
    }

    // Computed independently with Python's `xxhash.xxh3_64_intdigest(bytes, seed=BLOCK_HASH_SEED)`.
    const GOLDEN_ROOT: u64 = 0x586a_eec0_3bd5_360f;
    const GOLDEN_CHILD: u64 = 0x865b_c3d2_42e7_e1d1;
    const GOLDEN_CHAIN_1: u64 = 0x72d9_c31a_0235_653f;

    #[test]
    fn chain_depends_on_parent_and_tokens() {
        let a = hash_block_tokens(None, &[1, 2], &[]);
        assert_ne!(a, hash_block_tokens(None, &[2, 1], &[]));
        assert_ne!(hash_block_tokens(Some(a), &[1, 2], &[]), a);
        assert_ne!(hash_block_tokens(None, &[1, 2], &[7]), a);
        assert_ne!(hash_block_tokens(Some(BlockHash(0)), &[1, 2], &[]), a);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(hash_prompt_blocks(&[1; 15], 16).len(), 0);
        assert_eq!(hash_prompt_blocks(&[1; 33], 16).len(), 2);
    }
}
