//! [`BlockMap`]: chained block hashes to short ordered lists of small numbers (a pool's
//! slots holding a hash, the index's chips holding it), in one open-addressing table
//! whose entry keeps the hash and its first two numbers together in 16 bytes.
//!
//! At 1,000 simulated chips these tables hold millions of hashes and every access
//! misses the cache: a general hash map touches two cache lines per insert or removal
//! (its control bytes, then the bucket), this table one (the entry, found by linear
//! probing from the hash's home, four entries to a line). A hash with more than two
//! numbers keeps the rest in a side map, rarely used.

use std::collections::HashMap;

use super::BlockHashState;

/// One entry: the hash, and its first two numbers, each stored plus one (0: none), so
/// that an empty entry is all zeros and a new table is zeroed memory.
type Entry = [u64; 2];

/// A table is grown when more than this share of its entries is taken.
const MAX_LOAD: (usize, usize) = (3, 4);

/// What [`BlockMap::remove`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// The hash did not have that number.
    Nothing,
    /// The number is gone; the hash has others.
    Number,
    /// The number was the hash's last: the hash is gone too.
    Hash,
}

#[derive(Debug)]
pub struct BlockMap {
    /// A power of two entries (or none yet).
    entries: Vec<Entry>,
    /// Hashes held.
    len: usize,
    /// `64 - log2(entries.len())`: a hash's home is the top bits of its mix.
    shift: u32,
    /// Mixed into every hash before it picks a home, so that chosen hashes cannot pile
    /// onto one run of entries.
    seed: u64,
    /// A hash's numbers past its first two, in order.
    more: HashMap<u64, Vec<u32>, BlockHashState>,
}

impl Default for BlockMap {
    fn default() -> Self {
        BlockMap { entries: Vec::new(), len: 0, shift: 64, seed: BlockHashState::default().0, more: HashMap::default() }
    }
}

/// The two stored numbers of an entry (0: none).
fn numbers(e: &Entry) -> (u32, u32) {
    (e[1] as u32, (e[1] >> 32) as u32)
}

fn pack(first: u32, second: u32) -> u64 {
    u64::from(first) | u64::from(second) << 32
}

/// A number as stored: plus one, so that 0 means none.
fn stored(n: u32) -> u32 {
    assert!(n != u32::MAX, "a block map holds numbers below u32::MAX");
    n + 1
}

impl BlockMap {
    pub fn new() -> BlockMap {
        BlockMap::default()
    }

    /// Hashes held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    fn home(&self, hash: u64) -> usize {
        ((hash ^ self.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// The index of `hash`'s entry, if it is held.
    fn find(&self, hash: u64) -> Option<usize> {
        if self.entries.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(hash);
        loop {
            let e = &self.entries[i];
            if e[1] == 0 {
                return None;
            }
            if e[0] == hash {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    pub fn contains_key(&self, hash: u64) -> bool {
        self.find(hash).is_some()
    }

    /// The first number `hash` got (and still has).
    pub fn first(&self, hash: u64) -> Option<u32> {
        self.find(hash).map(|i| numbers(&self.entries[i]).0 - 1)
    }

    /// `hash`'s numbers, oldest first (none if it is not held).
    pub fn numbers(&self, hash: u64) -> impl Iterator<Item = u32> + '_ {
        let (a, b) = self.find(hash).map_or((0, 0), |i| numbers(&self.entries[i]));
        let rest = if b == 0 { &[][..] } else { self.more.get(&hash).map_or(&[][..], Vec::as_slice) };
        [a, b].into_iter().filter(|&n| n != 0).map(|n| n - 1).chain(rest.iter().copied())
    }

    /// Whether `hash` has number `n`.
    pub fn contains(&self, hash: u64, n: u32) -> bool {
        self.numbers(hash).any(|m| m == n)
    }

    /// Every hash held, in no particular order.
    pub fn hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.entries.iter().filter(|e| e[1] != 0).map(|e| e[0])
    }

    /// Reads the home entry of each of `hashes`. The reads do not wait on one another,
    /// so a run of lookups that would each miss the cache (a step's sealed blocks, a
    /// batch of KV events) pays for about one miss, not one per hash: their entries are
    /// in cache when the run's inserts and removals come to them.
    pub fn warm(&self, hashes: impl IntoIterator<Item = u64>) {
        if self.entries.is_empty() {
            return;
        }
        let sum = hashes.into_iter().fold(0u64, |sum, h| sum.wrapping_add(self.entries[self.home(h)][1]));
        std::hint::black_box(sum);
    }

    /// Gives `hash` number `n` after those it has; true when `hash` is new. (`n` may
    /// already be among them: see [`insert`](Self::insert) for a set.)
    pub fn push(&mut self, hash: u64, n: u32) -> bool {
        let n = stored(n);
        self.reserve_one();
        let mask = self.mask();
        let mut i = self.home(hash);
        loop {
            let e = &mut self.entries[i];
            if e[1] == 0 {
                *e = [hash, pack(n, 0)];
                self.len += 1;
                return true;
            }
            if e[0] == hash {
                let (a, b) = numbers(e);
                if b == 0 {
                    e[1] = pack(a, n);
                } else {
                    self.more.entry(hash).or_default().push(n - 1);
                }
                return false;
            }
            i = (i + 1) & mask;
        }
    }

    /// Gives `hash` number `n` unless it has it already: true when `n` is new to it.
    pub fn insert(&mut self, hash: u64, n: u32) -> bool {
        if self.contains(hash, n) {
            return false;
        }
        self.push(hash, n);
        true
    }

    /// Takes number `n` from `hash`; the hash goes with its last number.
    pub fn remove(&mut self, hash: u64, n: u32) -> Removed {
        let Some(i) = self.find(hash).filter(|_| n != u32::MAX) else { return Removed::Nothing };
        let (a, b) = numbers(&self.entries[i]);
        let s = stored(n);
        if s != a && s != b {
            let Some(rest) = self.more.get_mut(&hash) else { return Removed::Nothing };
            let Some(at) = rest.iter().position(|&m| m == n) else { return Removed::Nothing };
            rest.remove(at);
            if rest.is_empty() {
                self.more.remove(&hash);
            }
            return Removed::Number;
        }
        // The numbers after `n` move up one place; the first of the side map's, if
        // any, becomes the second.
        let kept = if s == a { b } else { a };
        let next = if b == 0 { None } else { self.take_first_more(hash) };
        if kept == 0 {
            self.delete_at(i);
            return Removed::Hash;
        }
        self.entries[i][1] = pack(kept, next.unwrap_or(0));
        Removed::Number
    }

    /// Takes the first of `hash`'s numbers in the side map, stored (plus one).
    fn take_first_more(&mut self, hash: u64) -> Option<u32> {
        let rest = self.more.get_mut(&hash)?;
        let n = rest.remove(0);
        if rest.is_empty() {
            self.more.remove(&hash);
        }
        Some(n + 1)
    }

    /// Takes number `n` from every hash that has it: how many had it.
    pub fn remove_everywhere(&mut self, n: u32) -> usize {
        let having: Vec<u64> = self.hashes().filter(|&h| self.contains(h, n)).collect();
        for &h in &having {
            self.remove(h, n);
        }
        having.len()
    }

    pub fn clear(&mut self) {
        *self = BlockMap { seed: self.seed, ..BlockMap::default() };
    }

    /// Empties entry `i`, moving later entries of its run back so that every hash stays
    /// reachable from its home without crossing an empty entry.
    fn delete_at(&mut self, i: usize) {
        let mask = self.mask();
        let mut hole = i;
        let mut j = (i + 1) & mask;
        while self.entries[j][1] != 0 {
            let home = self.home(self.entries[j][0]);
            // The entry at j may fill the hole when the hole lies between its home and
            // j (going forward, wrapping).
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.entries[hole] = self.entries[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.entries[hole] = [0, 0];
        self.len -= 1;
    }

    /// Room for one more hash: doubles the table when it would pass its load limit.
    fn reserve_one(&mut self) {
        let cap = self.entries.len();
        if (self.len + 1) * MAX_LOAD.1 <= cap * MAX_LOAD.0 {
            return;
        }
        let new_cap = (cap * 2).max(16);
        let old = std::mem::replace(&mut self.entries, vec![[0, 0]; new_cap]);
        self.shift = 64 - new_cap.trailing_zeros();
        let mask = self.mask();
        for e in old.into_iter().filter(|e| e[1] != 0) {
            let mut i = self.home(e[0]);
            while self.entries[i][1] != 0 {
                i = (i + 1) & mask;
            }
            self.entries[i] = e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn numbers_keep_their_order_past_the_two_inline() {
        let mut m = BlockMap::new();
        assert!(m.push(7, 3));
        for n in [1, 9, 4] {
            assert!(!m.push(7, n));
        }
        assert_eq!(m.numbers(7).collect::<Vec<_>>(), [3, 1, 9, 4]);
        assert_eq!(m.first(7), Some(3));
        assert_eq!(m.remove(7, 3), Removed::Number);
        assert_eq!(m.numbers(7).collect::<Vec<_>>(), [1, 9, 4], "the side map's first moves inline");
        assert_eq!(m.remove(7, 9), Removed::Number);
        assert_eq!(m.remove(7, 9), Removed::Nothing);
        assert_eq!(m.numbers(7).collect::<Vec<_>>(), [1, 4]);
        assert!(m.more.is_empty(), "nothing left past the inline two");
        assert_eq!(m.remove(7, 1), Removed::Number);
        assert_eq!(m.remove(7, 4), Removed::Hash);
        assert_eq!((m.len(), m.first(7), m.contains_key(7)), (0, None, false));
    }

    #[test]
    fn insert_keeps_a_set_and_zero_is_a_number_and_a_hash() {
        let mut m = BlockMap::new();
        assert!(m.insert(0, 0));
        assert!(!m.insert(0, 0));
        assert!(m.insert(0, 5));
        assert_eq!(m.numbers(0).collect::<Vec<_>>(), [0, 5]);
        assert_eq!(m.remove_everywhere(0), 1);
        assert_eq!(m.numbers(0).collect::<Vec<_>>(), [5]);
    }

    #[test]
    #[should_panic(expected = "below u32::MAX")]
    fn the_largest_number_is_refused() {
        BlockMap::new().push(1, u32::MAX);
    }

    proptest! {
        /// Any sequence of pushes, set inserts and removals, over few hashes (so runs
        /// collide and wrap) and many (so the table grows), agrees with a plain map of
        /// vectors, and every hash stays reachable after the deletions moved entries.
        #[test]
        fn agrees_with_a_map_of_lists(
            ops in proptest::collection::vec((0..4u8, 0..300u64, 0..6u32), 1..600),
        ) {
            let mut m = BlockMap::new();
            let mut model: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            for (op, hash, n) in ops {
                // Hashes spread over the whole range as well as small ones.
                let hash = if hash % 2 == 0 { hash } else { hash.wrapping_mul(0x2545_f491_4f6c_dd1d) };
                match op {
                    0 => {
                        let list = model.entry(hash).or_default();
                        prop_assert_eq!(m.push(hash, n), list.is_empty());
                        list.push(n);
                    }
                    1 => {
                        let list = model.entry(hash).or_default();
                        let new = !list.contains(&n);
                        prop_assert_eq!(m.insert(hash, n), new);
                        if new {
                            list.push(n);
                        }
                    }
                    _ => {
                        let list = model.entry(hash).or_default();
                        let expect = match list.iter().position(|&x| x == n) {
                            None => Removed::Nothing,
                            Some(at) => {
                                list.remove(at);
                                if list.is_empty() { Removed::Hash } else { Removed::Number }
                            }
                        };
                        prop_assert_eq!(m.remove(hash, n), expect);
                    }
                }
                model.retain(|_, l| !l.is_empty());
                prop_assert_eq!(m.len(), model.len());
            }
            for (h, list) in &model {
                prop_assert_eq!(&m.numbers(*h).collect::<Vec<_>>(), list);
            }
            let mut hashes: Vec<u64> = m.hashes().collect();
            hashes.sort_unstable();
            prop_assert_eq!(hashes, model.keys().copied().collect::<Vec<_>>());
        }
    }
}
