//! Hashers for the maps on the I/O path: a cheap one for ids keelfs
//! allocates, and a seeded one for keys a guest chooses.

/// A hasher for integer ids that keelfs allocates itself (inode numbers,
/// handle ids): one rotate, xor and multiply instead of SipHash, which
/// showed up at 4% of the CPU of small direct writes. Never for keys a guest
/// chooses (names, file offsets): a weak hash there invites collisions.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the golden ratio spreads consecutive ids evenly
        // over the high bits, which hashbrown uses for its control bytes
        // (FxHash's constant, near 1/pi, bunched them).
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by ids keelfs allocates; see [`IdHasher`].
pub type IdMap<V> = IdMapBy<u64, V>;

/// [`IdMap`] for a typed id (an inode number, a handle): any key that
/// hashes as the one u64 it wraps.
pub type IdMapBy<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// A hasher for integer keys a guest chooses (file offsets in the page
/// cache): a folded 64x64->128-bit multiply per word, as foldhash does,
/// keyed by a seed drawn at random once per process. A guest cannot
/// compute colliding offsets without the seed, which it never sees, and the
/// cost is a few cycles instead of SipHash's (15% of a 1-byte buffered
/// write's CPU went to hashing page keys).
#[derive(Clone, Copy, Debug)]
pub struct SeededHasher {
    acc: u64,
    multiplier: u64,
}

fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

impl std::hash::Hasher for SeededHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.acc = folded_multiply(self.acc ^ n, self.multiplier);
    }
    fn finish(&self) -> u64 {
        // One more round so that the last word reaches the high bits
        // (hashbrown's control bytes) through the seed too.
        folded_multiply(self.acc, self.multiplier.rotate_left(32))
    }
}

/// Builds [`SeededHasher`]s from this process's seed.
#[derive(Clone, Copy, Debug)]
pub struct SeededState {
    seed: u64,
    multiplier: u64,
}

impl Default for SeededState {
    fn default() -> Self {
        static SEED: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();
        let &(seed, multiplier) = SEED.get_or_init(|| {
            // std's RandomState is keyed from the OS's random source.
            use std::hash::BuildHasher;
            let random = std::collections::hash_map::RandomState::new();
            (random.hash_one(0x6b65_656c_u64), random.hash_one(0x6673_u64) | 1)
        });
        Self { seed, multiplier }
    }
}

impl std::hash::BuildHasher for SeededState {
    type Hasher = SeededHasher;
    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { acc: self.seed, multiplier: self.multiplier }
    }
}

/// Keys the map tests insert. Miri interprets every probe, and 10,000
/// inserts took over a minute there; 1,000 still grow the table through
/// several resizes, which is what the test is after.
#[cfg(test)]
const MAP_KEYS: u64 = if cfg!(miri) { 1_000 } else { 10_000 };

#[cfg(test)]
mod seeded_hasher_tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn page_keys_spread_and_differ() {
        let state = SeededState::default();
        let tops: std::collections::HashSet<u64> = (0..128u64).map(|p| state.hash_one((7u64, p)) >> 57).collect();
        assert!(tops.len() > 64, "only {} distinct top-7-bit values for 128 pages", tops.len());
        let low: std::collections::HashSet<u64> =
            (0..4096u64).map(|p| state.hash_one((7u64, p * 4096)) & 4095).collect();
        assert!(low.len() > 2000, "page-aligned keys crowd the low bits: {} of 4096", low.len());
        assert_ne!(state.hash_one((1u64, 2u64)), state.hash_one((2u64, 1u64)));
        let mut m: std::collections::HashMap<(u64, u64), u64, SeededState> = Default::default();
        for i in 0..MAP_KEYS {
            m.insert((i % 7, i), i);
        }
        assert!((0..MAP_KEYS).all(|i| m[&(i % 7, i)] == i));
    }
}

#[cfg(test)]
mod id_hasher_tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_over_the_high_bits() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let b = BuildHasherDefault::<IdHasher>::default();
        let tops: std::collections::HashSet<u64> = (1..=128u64).map(|i| b.hash_one(i) >> 57).collect();
        assert!(tops.len() > 64, "only {} distinct top-7-bit values for 128 ids", tops.len());
        let mut m: IdMap<u64> = IdMap::default();
        for i in 0..MAP_KEYS {
            m.insert(i, i * 2);
        }
        assert!((0..MAP_KEYS).all(|i| m[&i] == i * 2));
    }
}
