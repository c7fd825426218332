//! The router's exact index of where KV lives: for every chip, the chained block hashes
//! its pool holds, kept from the chips' numbered [`KvEvent`]s. A gap in a chip's
//! numbers (a lost message), a new incarnation of the chip (a restart numbers from 1
//! again) or a router that starts with no history marks that chip stale: it counts as
//! holding nothing until a snapshot of its pool ([`KvPool::snapshot`]) replaces its set,
//! after which the index is exact again.
//!
//! A lookup walks a prompt's block hashes in order, keeping the chips that hold every
//! block so far: its cost is the matched depth times the chips holding those blocks,
//! independent of how many blocks the index holds.
//!
//! [`KvPool::snapshot`]: crate::kv::KvPool::snapshot

use std::collections::{BTreeMap, btree_map};

use tessera_actor_core::Addr;

use crate::kv::{BlockMap, KvEvent, block_map::Removed};

/// A chip's number in the index (its place in `ClusterIndex::addrs`): 4 bytes where an
/// address takes 16, so that the holders table, which lists every cached block of every
/// chip, stays small (at 1,000 chips its cache misses are most of a KV event's cost).
type ChipNo = u32;

/// Chips holding each hash (most hashes are on one or two, which its entries keep
/// inline): the one table an event touches. What one chip holds is found by walking
/// it, which only a chip leaving or going stale (rare) does.
type Holders = BlockMap;

/// One chip's part of the index.
#[derive(Debug, Default)]
struct ChipEntry {
    number: ChipNo,
    /// Which run of the chip the events are from (bumped by every restart).
    incarnation: u64,
    /// The number of the next event expected.
    next: u64,
    /// Waiting for a snapshot: events are ignored, nothing is reported held.
    stale: bool,
    /// How many hashes it holds.
    held: usize,
}

/// What applying a chip's events did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Every event was the next in order.
    InOrder,
    /// The chip's view is stale (a gap, a new incarnation, or never synced): ask it for
    /// a snapshot.
    NeedsSnapshot,
}

#[derive(Debug, Default)]
pub struct ClusterIndex {
    chips: BTreeMap<Addr, ChipEntry>,
    /// Each chip's number, given at first sight and kept, and each number's chip.
    numbers: BTreeMap<Addr, ChipNo>,
    addrs: Vec<Addr>,
    /// Chips holding each hash.
    holders: Holders,
    /// (chip, hash) entries in `holders`: the sum of the chips' `held`.
    pairs: usize,
    resyncs: u64,
}

impl ClusterIndex {
    pub fn new() -> ClusterIndex {
        ClusterIndex::default()
    }

    /// Applies `events` (in order) from run `incarnation` of `chip`.
    pub fn apply(&mut self, chip: Addr, incarnation: u64, events: &[KvEvent]) -> Applied {
        let entry = match self.chips.entry(chip) {
            btree_map::Entry::Occupied(e) => e.into_mut(),
            btree_map::Entry::Vacant(e) => {
                let number = number_of(&mut self.numbers, &mut self.addrs, chip);
                e.insert(ChipEntry { number, stale: true, ..ChipEntry::default() })
            }
        };
        let number = entry.number;
        if entry.incarnation != incarnation {
            entry.incarnation = incarnation;
            self.pairs -= mark_stale(entry, &mut self.holders, number);
        }
        if entry.stale {
            return Applied::NeedsSnapshot;
        }
        self.holders.warm(events.iter().map(|e| match *e {
            KvEvent::Stored { hash, .. } | KvEvent::Removed { hash, .. } => hash,
        }));
        for e in events {
            if e.seq() < entry.next {
                continue; // already in the snapshot the chip was resynced from
            }
            if e.seq() != entry.next {
                self.pairs -= mark_stale(entry, &mut self.holders, number);
                return Applied::NeedsSnapshot;
            }
            entry.next += 1;
            match *e {
                KvEvent::Stored { hash, .. } => {
                    let n = hold(&mut self.holders, hash, number);
                    entry.held += n;
                    self.pairs += n;
                }
                KvEvent::Removed { hash, .. } => {
                    let n = unhold(&mut self.holders, hash, number);
                    entry.held -= n;
                    self.pairs -= n;
                }
            }
        }
        Applied::InOrder
    }

    /// A chip's heartbeat says the number of its last event: if events are missing
    /// (even the last batch, which no later event would expose), the chip is stale.
    pub fn heartbeat(&mut self, chip: Addr, incarnation: u64, last_seq: u64) -> Applied {
        if self.apply(chip, incarnation, &[]) == Applied::NeedsSnapshot {
            return Applied::NeedsSnapshot;
        }
        let Some(entry) = self.chips.get_mut(&chip) else { return Applied::NeedsSnapshot };
        if entry.next != last_seq + 1 {
            let number = entry.number;
            self.pairs -= mark_stale(entry, &mut self.holders, number);
            return Applied::NeedsSnapshot;
        }
        Applied::InOrder
    }

    /// Replaces `chip`'s set with a snapshot of run `incarnation`: `last_seq` is the
    /// number of the last event the snapshot includes.
    pub fn resync(&mut self, chip: Addr, incarnation: u64, last_seq: u64, hashes: &[u64]) {
        self.forget(chip);
        self.resyncs += 1;
        let number = number_of(&mut self.numbers, &mut self.addrs, chip);
        let mut entry = ChipEntry { number, incarnation, next: last_seq + 1, stale: false, held: 0 };
        for &h in hashes {
            entry.held += hold(&mut self.holders, h, number);
        }
        self.pairs += entry.held;
        self.chips.insert(chip, entry);
    }

    /// Drops everything known of `chip` (it left the cluster).
    pub fn forget(&mut self, chip: Addr) {
        if let Some(mut entry) = self.chips.remove(&chip) {
            let number = entry.number;
            self.pairs -= mark_stale(&mut entry, &mut self.holders, number);
        }
    }

    /// For a prompt whose full blocks hash to `hashes`, how many leading blocks each
    /// chip holds (chips holding none are left out).
    pub fn prefix_blocks(&self, hashes: &[u64]) -> BTreeMap<Addr, usize> {
        let mut depth = BTreeMap::new();
        let Some(first) = hashes.first() else { return depth };
        if !self.holders.contains_key(*first) {
            return depth;
        }
        // Each chip that holds the first block: how far its own set goes. A chip's set
        // is closed under prefixes (a pool never holds a block without the block before
        // it: see the pool's `held_hashes_are_prefix_closed`), so "holds block i" is
        // true up to the depth and false after: a binary search finds it. So is "some
        // chip holds block i", up to the deepest chip's depth; a chip holding that block
        // (the common case: a shared prefix cached whole) needs no search of its own.
        let deepest = hashes.partition_point(|h| self.holders.contains_key(*h));
        let last = hashes[deepest.saturating_sub(1)];
        for number in self.holders.numbers(*first) {
            let Some(&chip) = self.addrs.get(number as usize) else { continue };
            let n = if self.holders.contains(last, number) {
                deepest
            } else {
                if !self.chips.contains_key(&chip) {
                    continue;
                }
                hashes[..deepest].partition_point(|h| self.holders.contains(*h, number))
            };
            depth.insert(chip, n);
        }
        depth
    }

    /// The hashes the index holds for `chip` (empty while stale).
    pub fn held(&self, chip: Addr) -> Vec<u64> {
        let Some(number) = self.chips.get(&chip).map(|e| e.number) else { return Vec::new() };
        let mut v: Vec<u64> = self.holders.hashes().filter(|&h| self.holders.contains(h, number)).collect();
        v.sort_unstable();
        v
    }

    pub fn is_stale(&self, chip: Addr) -> bool {
        self.chips.get(&chip).is_none_or(|e| e.stale)
    }

    /// Distinct (chip, block) entries indexed.
    pub fn len(&self) -> usize {
        self.pairs
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Snapshots applied so far.
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }
}

/// `chip`'s number, given now (the next free one) if it has none.
fn number_of(numbers: &mut BTreeMap<Addr, ChipNo>, addrs: &mut Vec<Addr>, chip: Addr) -> ChipNo {
    *numbers.entry(chip).or_insert_with(|| {
        addrs.push(chip);
        (addrs.len() - 1) as ChipNo
    })
}

/// The chip's set can no longer be trusted: it holds nothing until a snapshot. Returns
/// how many hashes it held.
fn mark_stale(entry: &mut ChipEntry, holders: &mut Holders, chip: ChipNo) -> usize {
    entry.stale = true;
    let held = entry.held;
    if held > 0 {
        holders.remove_everywhere(chip);
        entry.held = 0;
    }
    held
}

/// `chip` holds `hash`: 1 if that is news, else 0.
fn hold(holders: &mut Holders, hash: u64, chip: ChipNo) -> usize {
    usize::from(holders.insert(hash, chip))
}

/// `chip` no longer holds `hash`: 1 if it did, else 0.
fn unhold(holders: &mut Holders, hash: u64, chip: ChipNo) -> usize {
    usize::from(holders.remove(hash, chip) != Removed::Nothing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{BlockRef, KvPool, prefix_hashes};
    use proptest::prelude::*;
    use tessera_actor_core::HostId;

    fn chip(n: u64) -> Addr {
        Addr::new(HostId(n as u16), 16)
    }

    /// What a chip's pool does: requests of prompts drawn from a few shared prefixes
    /// start (reusing what the pool holds), seal their blocks and end.
    #[derive(Debug, Clone)]
    enum Op {
        /// A request on chip `c` with prompt family `family` of `blocks` full blocks.
        Run { c: usize, family: u8, blocks: usize },
        /// Chip `c`'s next batch of events is lost on the way.
        Drop { c: usize },
        /// Chip `c` restarts: a new, empty pool.
        Restart { c: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..3usize, 0..4u8, 1..6usize).prop_map(|(c, family, blocks)| Op::Run { c, family, blocks }),
            1 => (0..3usize).prop_map(|c| Op::Drop { c }),
            1 => (0..3usize).prop_map(|c| Op::Restart { c }),
        ]
    }

    struct Chip {
        pool: KvPool,
        incarnation: u64,
        drop_next: bool,
    }

    fn run(pool: &mut KvPool, family: u8, blocks: usize) {
        let bs = pool.block_size();
        let tokens: Vec<u32> = (0..blocks * bs).map(|i| family as u32 * 1000 + (i as u32 % 7)).collect();
        let mut held: Vec<BlockRef> = Vec::new();
        let mut parent = None;
        for (i, h) in prefix_hashes(&tokens, bs).into_iter().enumerate() {
            let b = match pool.acquire(h) {
                Some(b) => b,
                None => {
                    let Some(b) = pool.alloc(1) else { break };
                    pool.seal(b, parent, &tokens[i * bs..(i + 1) * bs]).unwrap();
                    b
                }
            };
            held.push(b);
            parent = Some(h);
        }
        // Last first, as a batcher releases a sequence's blocks.
        for b in held.into_iter().rev() {
            pool.release(b).unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the order of runs, lost batches and restarts, after each round of
        /// events and heartbeats (and the snapshots they ask for) the index holds
        /// exactly what each pool holds.
        #[test]
        fn the_index_converges_to_the_pools_contents(ops in proptest::collection::vec(op(), 1..60)) {
            let mut chips: Vec<Chip> = (0..3).map(|i| Chip { pool: KvPool::new(chip(i), 6, 2), incarnation: 0, drop_next: false }).collect();
            let mut index = ClusterIndex::new();
            let sync = |index: &mut ClusterIndex, i: usize, c: &mut Chip| {
                let events = c.pool.take_events();
                let id = chip(i as u64);
                let (last, hashes) = c.pool.snapshot();
                let mut applied = Applied::InOrder;
                if c.drop_next && !events.is_empty() {
                    c.drop_next = false; // this batch is lost
                } else {
                    applied = index.apply(id, c.incarnation, &events);
                }
                // Then the chip's heartbeat, with the number of its last event.
                if applied == Applied::NeedsSnapshot || index.heartbeat(id, c.incarnation, last) == Applied::NeedsSnapshot {
                    index.resync(id, c.incarnation, last, &hashes);
                }
            };
            for op in ops {
                match op {
                    Op::Run { c, family, blocks } => run(&mut chips[c].pool, family, blocks),
                    Op::Drop { c } => chips[c].drop_next = true,
                    Op::Restart { c } => {
                        chips[c].pool = KvPool::new(chip(c as u64), 6, 2);
                        chips[c].incarnation += 1;
                    }
                }
                for (i, c) in chips.iter_mut().enumerate() {
                    sync(&mut index, i, c);
                }
            }
            let mut entries = 0;
            for (i, c) in chips.iter_mut().enumerate() {
                let (_, mut truth) = c.pool.snapshot();
                truth.sort_unstable();
                prop_assert!(!index.is_stale(chip(i as u64)));
                entries += truth.len();
                prop_assert_eq!(index.held(chip(i as u64)), truth);
            }
            prop_assert_eq!(index.len(), entries, "the running count of entries");
            // Lookups (a binary search per chip) count what a walk block by block counts.
            for family in 0..4u8 {
                let tokens: Vec<u32> = (0..8).map(|i| family as u32 * 1000 + (i as u32 % 7)).collect();
                let hashes = prefix_hashes(&tokens, 2);
                let walked: BTreeMap<Addr, usize> = chips.iter().enumerate().filter_map(|(i, c)| {
                    let (_, held) = c.pool.snapshot();
                    let n = hashes.iter().take_while(|h| held.contains(h)).count();
                    (n > 0).then_some((chip(i as u64), n))
                }).collect();
                prop_assert_eq!(index.prefix_blocks(&hashes), walked);
            }
        }
    }

    #[test]
    fn lookups_count_leading_blocks_per_chip() {
        let mut index = ClusterIndex::new();
        let (a, b) = (chip(1), chip(2));
        index.resync(a, 0, 0, &[1, 2, 3]);
        index.resync(b, 0, 0, &[1, 5]);
        assert_eq!(index.prefix_blocks(&[1, 2, 3, 4]), BTreeMap::from([(a, 3), (b, 1)]));
        assert_eq!(index.prefix_blocks(&[9, 1]), BTreeMap::new(), "prefixes only");
        // In-order events update the sets; a gap empties the chip until a resync.
        let ev = [KvEvent::Stored { seq: 1, hash: 2 }, KvEvent::Removed { seq: 2, hash: 1 }];
        assert_eq!(index.apply(b, 0, &ev), Applied::InOrder);
        assert_eq!(index.prefix_blocks(&[1, 2]), BTreeMap::from([(a, 2)]));
        assert_eq!(index.apply(b, 0, &[KvEvent::Stored { seq: 4, hash: 7 }]), Applied::NeedsSnapshot);
        assert!(index.is_stale(b) && index.held(b).is_empty());
        assert_eq!(index.apply(b, 0, &[]), Applied::NeedsSnapshot, "stays stale until a snapshot");
        // A lost last batch shows in the next heartbeat.
        index.resync(b, 0, 4, &[7]);
        assert_eq!(index.heartbeat(b, 0, 4), Applied::InOrder);
        assert_eq!(index.heartbeat(b, 0, 6), Applied::NeedsSnapshot);
        index.resync(b, 0, 6, &[]);
        // A restarted chip numbers from 1 again: its old set is not trusted.
        assert_eq!(index.apply(a, 1, &[KvEvent::Stored { seq: 1, hash: 5 }]), Applied::NeedsSnapshot);
        assert_eq!(index.len(), 0, "neither stale chip counts as holding anything");
        index.resync(a, 1, 1, &[5]);
        assert_eq!((index.len(), index.resyncs()), (1, 5));
        index.forget(a);
        assert!(index.is_empty());
    }
}
