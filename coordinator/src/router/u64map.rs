//! Hash maps keyed by one u64-like key, for the router's hot lookups.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hash maps keyed by one u64 (block hashes, worker and request ids): a
/// Fibonacci multiply instead of SipHash, since block hashes are already
/// uniform and ids need only spreading. Routing does hundreds of lookups per
/// decision at 256 workers; this keeps them cheap.
pub(crate) type U64Map<K, V> = HashMap<K, V, BuildHasherDefault<U64Hasher>>;

#[derive(Default)]
pub(crate) struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
