//! A chip's KV pool: the chip's cache blocks as small state machines hosted in a slab
//! (Free -> Writing -> Sealed{hash, refs} -> Cached{hash} -> Free). A block is addressed
//! by `BlockRef{chip, slot, generation}`; the generation changes every time a block is
//! freed, so a stale reference is an error, never a silent hit on someone else's KV.
//! The pool decides which device blocks a sequence uses; the chip's worker only writes
//! and reads the slots it is told.
//!
//! A full block is sealed with its chained hash (its tokens hashed with the hash of the
//! blocks before it), so equal hashes mean equal token prefixes: a sealed block can be
//! shared by reference count and found by hash (`find`, `acquire`), which is what prefix
//! reuse and KV-aware routing key on. When its last holder lets go, a sealed block stays
//! cached — its KV intact, still found by hash — until a new block needs its place: then
//! the least recently released cached block is evicted. Cached blocks count as free.
//! Invariant: a block is held (`used`) exactly when a sequence holds a reference to it,
//! so a pool whose sequences all ended has nothing in use.
//!
//! Every hash the pool starts or stops holding is an event ([`KvEvent`], numbered per
//! chip from 1): the router's cluster index replays them, and a gap in the numbers
//! tells it to resync from [`KvPool::snapshot`].

pub mod block_map;

pub use block_map::BlockMap;
use slab::Slab;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use tessera_actor_core::Addr;

/// Hash of a full block given its parent's hash (None for a sequence's first block):
/// blocks with equal hashes hold the KV of equal token prefixes.
pub fn chained_block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    // The usual block fits a buffer on the stack (no allocation per sealed block), one
    // no larger than it needs (it is zeroed first).
    match tokens.len() {
        0..=16 => hash_on_stack::<{ 9 + 4 * 16 }>(parent, tokens),
        17..=64 => hash_on_stack::<{ 9 + 4 * 64 }>(parent, tokens),
        _ => chained_block_hash_with(&mut Vec::new(), parent, tokens),
    }
}

/// [`chained_block_hash`] of at most `(N - 9) / 4` tokens.
fn hash_on_stack<const N: usize>(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; N];
    let n = block_bytes(&mut buf, parent, tokens);
    xxhash_rust::xxh3::xxh3_64(&buf[..n])
}

/// [`chained_block_hash`] with a scratch buffer the caller keeps across blocks.
fn chained_block_hash_with(bytes: &mut Vec<u8>, parent: Option<u64>, tokens: &[u32]) -> u64 {
    bytes.resize(9 + 4 * tokens.len(), 0);
    let n = block_bytes(bytes, parent, tokens);
    xxhash_rust::xxh3::xxh3_64(&bytes[..n])
}

/// Writes what a block's hash covers into `buf` (at least 9 + 4 bytes a token): a tag
/// and the parent's hash if there is one, then the tokens, little-endian. Returns the
/// length written.
fn block_bytes(buf: &mut [u8], parent: Option<u64>, tokens: &[u32]) -> usize {
    let mut n = 1;
    match parent {
        Some(p) => {
            buf[0] = 1;
            buf[1..9].copy_from_slice(&p.to_le_bytes());
            n += 8;
        }
        None => buf[0] = 0,
    }
    for (dst, t) in buf[n..n + 4 * tokens.len()].chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    n + 4 * tokens.len()
}

/// The chained hashes of the full blocks of `tokens`, in order.
pub fn prefix_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    salted_prefix_hashes(tokens, block_size, None)
}

/// [`prefix_hashes`] of a sequence whose first block chains to `salt` (its tenant's,
/// when its tenant keeps its prefix cache to itself): equal prompts of differently
/// salted sequences never share a block.
pub fn salted_prefix_hashes(tokens: &[u32], block_size: usize, salt: Option<u64>) -> Vec<u64> {
    let mut parent = salt;
    let mut bytes = Vec::with_capacity(9 + 4 * block_size);
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let h = chained_block_hash_with(&mut bytes, parent, block);
            parent = Some(h);
            h
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRef {
    pub chip: Addr,
    pub slot: u32,
    pub generation: u32,
}

/// A block's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Being filled by one sequence.
    Writing { owner: u64 },
    /// Full, its tokens hashed (chained with the blocks before it), held by `refs`
    /// sequences.
    Sealed { hash: u64, refs: u32 },
    /// Sealed and held by nobody: kept for a later prompt with the same prefix until
    /// its place is needed (`since` orders evictions, oldest first).
    Cached { hash: u64, since: u64 },
}

/// A change in the set of block hashes a chip holds, numbered per chip (1, 2, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// The chip now holds a block of this chained hash.
    Stored { seq: u64, hash: u64 },
    /// It holds none any more.
    Removed { seq: u64, hash: u64 },
}

impl KvEvent {
    pub fn seq(&self) -> u64 {
        match self {
            KvEvent::Stored { seq, .. } | KvEvent::Removed { seq, .. } => *seq,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("block {slot} of {chip} is stale (generation {given}, now {current})")]
    Stale { chip: Addr, slot: u32, given: u32, current: u32 },
    #[error("block {slot} belongs to chip {owner}, not {chip}")]
    WrongChip { chip: Addr, owner: Addr, slot: u32 },
    #[error("block {slot} of {chip} cannot be sealed: it is not being written")]
    NotWriting { chip: Addr, slot: u32 },
    #[error("block {slot} of {chip} cannot be sealed with {tokens} tokens: a full block holds {block_size}")]
    NotFull { chip: Addr, slot: u32, tokens: usize, block_size: usize },
    #[error("block {slot} of {chip} cannot be shared: it is not sealed")]
    NotSealed { chip: Addr, slot: u32 },
    #[error("block {slot} of {chip} cannot be released: nobody holds it")]
    NotHeld { chip: Addr, slot: u32 },
}

/// Hashes the block hashes (already uniform 64-bit values) with one multiply, keyed by a
/// per-process random seed so that prompts chosen to collide cannot crowd the tables.
/// SipHash, the default, was most of a decision's time.
#[derive(Clone, Copy)]
pub struct BlockHashState(u64);

impl Default for BlockHashState {
    fn default() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        BlockHashState(*SEED.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) | 1))
    }
}

impl BuildHasher for BlockHashState {
    type Hasher = BlockHasher;

    fn build_hasher(&self) -> BlockHasher {
        BlockHasher { seed: self.0, state: 0 }
    }
}

pub struct BlockHasher {
    seed: u64,
    state: u64,
}

impl Hasher for BlockHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.state = (self.state ^ x ^ self.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

/// Events kept for a reader that does not drain them.
const MAX_PENDING_EVENTS: usize = 1 << 16;

#[derive(Debug)]
pub struct KvPool {
    chip: Addr,
    capacity: usize,
    block_size: usize,
    blocks: Slab<BlockState>,
    /// Per slot, including free ones: bumped on every free.
    generations: Vec<u32>,
    /// Sealed and cached blocks by chained hash, oldest seal first (equal prompts not
    /// yet sharing their prefix seal equal hashes in several blocks).
    by_hash: BlockMap,
    /// Cached blocks by release time, (time, slot): the first is evicted first. An entry
    /// whose block was taken again since (it is no longer cached at that time) is stale:
    /// skipped when met and swept out when they outnumber the cached blocks, so a
    /// release and a reuse cost O(1) instead of a tree's insert and remove.
    lru: VecDeque<(u64, u32)>,
    /// Cached blocks (the live entries of `lru`).
    cached: usize,
    clock: u64,
    /// Events since the last `take_events`, and the number of the last one.
    events: Vec<KvEvent>,
    event_seq: u64,
}

impl KvPool {
    /// A pool of `capacity` free blocks of `block_size` tokens each.
    pub fn new(chip: Addr, capacity: usize, block_size: usize) -> KvPool {
        KvPool {
            chip,
            capacity,
            block_size,
            blocks: Slab::with_capacity(capacity),
            generations: vec![0; capacity],
            by_hash: BlockMap::new(),
            lru: VecDeque::new(),
            cached: 0,
            clock: 0,
            events: Vec::new(),
            event_seq: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks held by sequences (being written, or sealed and referenced).
    pub fn used(&self) -> usize {
        self.blocks.len() - self.cached
    }

    /// Blocks a sequence can take: never-used or freed ones, and cached ones.
    pub fn free(&self) -> usize {
        self.capacity - self.used()
    }

    /// Cached blocks: sealed, held by nobody, kept for reuse.
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// A free block, now Writing for `owner` (evicting the least recently released
    /// cached block when no block is unused); None when every block is held.
    pub fn alloc(&mut self, owner: u64) -> Option<BlockRef> {
        if self.blocks.len() < self.capacity {
            let slot = self.blocks.insert(BlockState::Writing { owner });
            return Some(self.block_ref(slot));
        }
        let (slot, hash) = self.evict_oldest()?;
        self.unindex(hash, slot);
        let slot = slot as usize;
        self.generations[slot] = self.generations[slot].wrapping_add(1);
        self.blocks[slot] = BlockState::Writing { owner };
        Some(self.block_ref(slot))
    }

    /// [`alloc`](Self::alloc) `n` times, pushing the blocks to `out`: false when the pool
    /// ran out first (`out` has those it got). The evicted blocks' table entries are
    /// fetched together first.
    pub fn alloc_run(&mut self, owner: u64, n: usize, out: &mut Vec<BlockRef>) -> bool {
        let evictions = n.saturating_sub(self.capacity - self.blocks.len());
        if evictions > 1 {
            let next: SmallVec<[u64; 64]> = (self.lru.iter().take(evictions))
                .filter_map(|&(_, slot)| match self.blocks.get(slot as usize) {
                    Some(&BlockState::Cached { hash, .. }) => Some(hash),
                    _ => None,
                })
                .collect();
            self.by_hash.warm(next);
        }
        out.reserve(n);
        for _ in 0..n {
            match self.alloc(owner) {
                Some(b) => out.push(b),
                None => return false,
            }
        }
        true
    }

    /// Takes the least recently released cached block out of the LRU order: its slot
    /// and hash (it stays Cached; the caller reuses or frees it).
    fn evict_oldest(&mut self) -> Option<(u32, u64)> {
        while let Some((since, slot)) = self.lru.pop_front() {
            if let Some(&BlockState::Cached { hash, since: at }) = self.blocks.get(slot as usize)
                && at == since
            {
                self.cached -= 1;
                return Some((slot, hash));
            }
        }
        None
    }

    /// Puts `slot`, just cached at `since`, last in the LRU order.
    fn cache(&mut self, since: u64, slot: u32) {
        self.lru.push_back((since, slot));
        self.cached += 1;
        if self.lru.len() > 2 * self.cached + 64 {
            let blocks = &self.blocks;
            self.lru.retain(|&(since, slot)| {
                matches!(blocks.get(slot as usize), Some(&BlockState::Cached { since: at, .. }) if at == since)
            });
        }
    }

    fn block_ref(&self, slot: usize) -> BlockRef {
        BlockRef { chip: self.chip, slot: slot as u32, generation: self.generations[slot] }
    }

    fn check(&self, r: BlockRef) -> Result<BlockState, KvError> {
        if r.chip != self.chip {
            return Err(KvError::WrongChip { chip: self.chip, owner: r.chip, slot: r.slot });
        }
        let current = self.generations.get(r.slot as usize).copied().unwrap_or(u32::MAX);
        match self.blocks.get(r.slot as usize) {
            Some(state) if current == r.generation => Ok(*state),
            _ => Err(KvError::Stale { chip: self.chip, slot: r.slot, given: r.generation, current }),
        }
    }

    pub fn state(&self, r: BlockRef) -> Result<BlockState, KvError> {
        self.check(r)
    }

    /// Writing -> Sealed: the block holds `tokens`, a full block, whose chained hash
    /// (with `parent`, the hash of the block before it) the pool computes, records and
    /// returns.
    pub fn seal(&mut self, r: BlockRef, parent: Option<u64>, tokens: &[u32]) -> Result<u64, KvError> {
        self.seal_hashed(r, tokens, chained_block_hash(parent, tokens))
    }

    /// [`seal`](Self::seal) with the chained hash of `tokens` already computed.
    fn seal_hashed(&mut self, r: BlockRef, tokens: &[u32], hash: u64) -> Result<u64, KvError> {
        match self.check(r)? {
            BlockState::Writing { .. } if tokens.len() != self.block_size => Err(KvError::NotFull {
                chip: self.chip,
                slot: r.slot,
                tokens: tokens.len(),
                block_size: self.block_size,
            }),
            BlockState::Writing { .. } => {
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: 1 };
                if self.by_hash.push(hash, r.slot) {
                    self.event(|seq| KvEvent::Stored { seq, hash });
                }
                Ok(hash)
            }
            BlockState::Sealed { .. } | BlockState::Cached { .. } => {
                Err(KvError::NotWriting { chip: self.chip, slot: r.slot })
            }
        }
    }

    /// [`seal`](Self::seal) for consecutive full blocks of one sequence: `tokens` fills
    /// `blocks` in order, the first chained to `parent`. Pushes every block's hash to
    /// `hashes` (a block whose seal failed too: the chain goes on past it) and returns
    /// the failures. The blocks' table entries are fetched together first.
    pub fn seal_run(
        &mut self,
        blocks: &[BlockRef],
        mut parent: Option<u64>,
        tokens: &[u32],
        hashes: &mut Vec<u64>,
    ) -> Vec<KvError> {
        let from = hashes.len();
        for chunk in tokens.chunks(self.block_size).take(blocks.len()) {
            let hash = chained_block_hash(parent, chunk);
            hashes.push(hash);
            parent = Some(hash);
        }
        self.by_hash.warm(hashes[from..].iter().copied());
        let mut failed = Vec::new();
        for ((&r, chunk), &hash) in blocks.iter().zip(tokens.chunks(self.block_size)).zip(&hashes[from..]) {
            if let Err(e) = self.seal_hashed(r, chunk, hash) {
                failed.push(e);
            }
        }
        failed
    }

    /// One more holder of a sealed or cached block (a sequence reusing that prefix).
    pub fn share(&mut self, r: BlockRef) -> Result<(), KvError> {
        match self.check(r)? {
            BlockState::Sealed { hash, refs } => {
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: refs + 1 };
                Ok(())
            }
            BlockState::Cached { hash, .. } => {
                // Its LRU entry is stale from now on.
                self.cached -= 1;
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: 1 };
                Ok(())
            }
            BlockState::Writing { .. } => Err(KvError::NotSealed { chip: self.chip, slot: r.slot }),
        }
    }

    /// The oldest sealed or cached block with chained hash `hash`, if one is here.
    pub fn find(&self, hash: u64) -> Option<BlockRef> {
        let slot = self.by_hash.first(hash)?;
        Some(self.block_ref(slot as usize))
    }

    /// [`find`](Self::find) and [`share`](Self::share): a reference to a block holding
    /// the prefix of `hash`, for a sequence that will read it instead of computing it.
    pub fn acquire(&mut self, hash: u64) -> Option<BlockRef> {
        let r = self.find(hash)?;
        self.share(r).ok()?;
        Some(r)
    }

    /// Drops one reference. A sealed block's last release caches it; a block being
    /// written goes back to Free.
    pub fn release(&mut self, r: BlockRef) -> Result<(), KvError> {
        let slot = r.slot as usize;
        match self.check(r)? {
            BlockState::Sealed { hash, refs } if refs > 1 => {
                self.blocks[slot] = BlockState::Sealed { hash, refs: refs - 1 };
            }
            BlockState::Sealed { hash, .. } => {
                self.clock += 1;
                self.blocks[slot] = BlockState::Cached { hash, since: self.clock };
                self.cache(self.clock, r.slot);
            }
            BlockState::Cached { .. } => return Err(KvError::NotHeld { chip: self.chip, slot: r.slot }),
            BlockState::Writing { .. } => {
                self.blocks.remove(slot);
                self.generations[slot] = self.generations[slot].wrapping_add(1);
            }
        }
        Ok(())
    }

    /// Frees every cached block (a chip that drops its cache, e.g. on a model change).
    pub fn drop_cached(&mut self) {
        while let Some((slot, hash)) = self.evict_oldest() {
            self.blocks.remove(slot as usize);
            self.unindex(hash, slot);
            self.generations[slot as usize] = self.generations[slot as usize].wrapping_add(1);
        }
    }

    /// The number of the last event.
    pub fn snapshot_seq(&self) -> u64 {
        self.event_seq
    }

    /// The events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every hash held now and the number of the last event that got it there: a
    /// resynchronising index starts from this and applies later events only.
    pub fn snapshot(&self) -> (u64, Vec<u64>) {
        let mut hashes: Vec<u64> = self.by_hash.hashes().collect();
        hashes.sort_unstable();
        (self.event_seq, hashes)
    }

    fn event(&mut self, make: impl FnOnce(u64) -> KvEvent) {
        self.event_seq += 1;
        if self.events.len() >= MAX_PENDING_EVENTS {
            // Nobody is draining them: drop the older half. A reader then sees a gap in
            // the numbers and resyncs from a snapshot.
            self.events.drain(..MAX_PENDING_EVENTS / 2);
        }
        self.events.push(make(self.event_seq));
    }

    fn unindex(&mut self, hash: u64, slot: u32) {
        if self.by_hash.remove(hash, slot) == block_map::Removed::Hash {
            self.event(|seq| KvEvent::Removed { seq, hash });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use tessera_actor_core::HostId;

    fn chip(n: u64) -> Addr {
        Addr::new(HostId(0), n)
    }

    #[test]
    fn blocks_cycle_free_writing_sealed_free() {
        let mut pool = KvPool::new(chip(16), 2, 2);
        let a = pool.alloc(7).unwrap();
        assert_eq!(pool.state(a), Ok(BlockState::Writing { owner: 7 }));
        let hash = pool.seal(a, None, &[4, 5]).unwrap();
        assert_eq!(hash, chained_block_hash(None, &[4, 5]));
        assert_eq!(pool.state(a), Ok(BlockState::Sealed { hash, refs: 1 }));
        assert_eq!(pool.seal(a, None, &[4, 5]), Err(KvError::NotWriting { chip: chip(16), slot: a.slot }));
        let b = pool.alloc(8).unwrap();
        assert_eq!(pool.alloc(9), None, "capacity is a hard limit");
        assert_eq!((pool.used(), pool.free()), (2, 0));
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn only_a_full_block_is_sealed() {
        let mut pool = KvPool::new(chip(16), 1, 4);
        let a = pool.alloc(1).unwrap();
        let err = KvError::NotFull { chip: chip(16), slot: a.slot, tokens: 3, block_size: 4 };
        assert_eq!(pool.seal(a, None, &[1, 2, 3]), Err(err));
        assert_eq!(pool.state(a), Ok(BlockState::Writing { owner: 1 }), "a refused seal changes nothing");
        assert_eq!(pool.find(chained_block_hash(None, &[1, 2, 3])), None);
    }

    #[test]
    fn chained_hash_depends_on_parent_and_tokens() {
        let a = chained_block_hash(None, &[1, 2, 3]);
        assert_eq!(a, chained_block_hash(None, &[1, 2, 3]));
        assert_ne!(a, chained_block_hash(None, &[1, 2, 4]));
        assert_ne!(chained_block_hash(Some(a), &[5]), chained_block_hash(Some(a ^ 1), &[5]));
        assert_ne!(chained_block_hash(None, &[5]), chained_block_hash(Some(0), &[5]));
    }

    /// A block hashed on the stack and one hashed through a buffer (more than 64
    /// tokens) hash the same bytes: the hash does not depend on the block's size class.
    #[test]
    fn the_stack_and_buffer_paths_hash_alike() {
        for n in [0, 1, 16, 17, 64, 65, 200] {
            let tokens: Vec<u32> = (0..n as u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
            for parent in [None, Some(7), Some(u64::MAX)] {
                let mut buf = Vec::new();
                assert_eq!(chained_block_hash(parent, &tokens), chained_block_hash_with(&mut buf, parent, &tokens));
            }
        }
    }

    /// Sealing chains: the second block's hash is of its tokens and the first block's
    /// hash, so equal second blocks after different first blocks differ.
    #[test]
    fn sealing_chains_each_block_to_the_blocks_before_it() {
        let mut pool = KvPool::new(chip(16), 4, 2);
        let seal_prompt = |pool: &mut KvPool, prompt: &[u32]| -> Vec<u64> {
            let mut parent = None;
            prompt
                .chunks(2)
                .map(|tokens| {
                    let b = pool.alloc(1).unwrap();
                    let h = pool.seal(b, parent, tokens).unwrap();
                    parent = Some(h);
                    h
                })
                .collect()
        };
        let x = seal_prompt(&mut pool, &[1, 2, 3, 4]);
        let y = seal_prompt(&mut pool, &[9, 2, 3, 4]);
        assert_eq!(x[1], chained_block_hash(Some(x[0]), &[3, 4]));
        assert_ne!(x[0], y[0]);
        assert_ne!(x[1], y[1], "same tokens after another prefix: another hash");
    }

    #[test]
    fn a_shared_sealed_block_is_freed_by_its_last_holder() {
        let mut pool = KvPool::new(chip(16), 2, 2);
        let a = pool.alloc(1).unwrap();
        assert_eq!(pool.share(a), Err(KvError::NotSealed { chip: chip(16), slot: a.slot }), "not while written");
        let hash = pool.seal(a, None, &[1, 2]).unwrap();
        assert_eq!(pool.find(hash), Some(a));
        pool.share(a).unwrap();
        pool.share(a).unwrap();
        assert_eq!(pool.state(a), Ok(BlockState::Sealed { hash, refs: 3 }));
        for left in [2, 1] {
            pool.release(a).unwrap();
            assert_eq!(pool.state(a), Ok(BlockState::Sealed { hash, refs: left }));
            assert_eq!((pool.used(), pool.find(hash)), (1, Some(a)), "still held, still found");
        }
        pool.release(a).unwrap();
        assert_eq!((pool.used(), pool.cached(), pool.free()), (0, 1, 2), "the last release caches it");
        assert_eq!(pool.find(hash), Some(a), "a cached block is still found");
        assert_eq!(pool.release(a), Err(KvError::NotHeld { chip: chip(16), slot: a.slot }), "nobody holds it");
        assert_eq!(pool.acquire(hash), Some(a), "and taken again");
        assert_eq!(pool.state(a), Ok(BlockState::Sealed { hash, refs: 1 }));
        pool.release(a).unwrap();
        pool.drop_cached();
        assert_eq!((pool.used(), pool.cached(), pool.find(hash)), (0, 0, None));
        assert!(matches!(pool.state(a), Err(KvError::Stale { .. })));
        assert!(matches!(pool.share(a), Err(KvError::Stale { .. })), "a freed block cannot be shared");
    }

    /// A run of allocations and seals (one step's blocks) does what the same calls one
    /// at a time do: the same blocks evicted, hashes, events and failures.
    #[test]
    fn runs_of_allocations_and_seals_match_one_at_a_time() {
        let one_by_one = |pool: &mut KvPool, n: usize, tokens: &[u32]| {
            let blocks: Vec<BlockRef> = (0..n).map_while(|_| pool.alloc(5)).collect();
            let mut parent = None;
            let hashes: Vec<u64> = (blocks.iter().zip(tokens.chunks(2)))
                .map(|(&b, t)| {
                    let h = pool.seal(b, parent, t).unwrap_or_else(|_| chained_block_hash(parent, t));
                    parent = Some(h);
                    h
                })
                .collect();
            (blocks, hashes)
        };
        let in_runs = |pool: &mut KvPool, n: usize, tokens: &[u32]| {
            let mut blocks = Vec::new();
            let all = pool.alloc_run(5, n, &mut blocks);
            assert_eq!(all, blocks.len() == n);
            let mut hashes = Vec::new();
            let failed = pool.seal_run(&blocks, None, &tokens[..(2 * blocks.len()).min(tokens.len())], &mut hashes);
            assert!(failed.is_empty());
            (blocks, hashes)
        };
        let (mut a, mut b) = (KvPool::new(chip(16), 6, 2), KvPool::new(chip(16), 6, 2));
        // Fill both, cache everything, then take more than is free: the runs evict.
        for (n, tokens) in [(4, vec![1, 2, 3, 4, 5, 6, 7, 8]), (5, vec![9; 10]), (7, vec![3; 14])] {
            let (x, y) = (one_by_one(&mut a, n, &tokens), in_runs(&mut b, n, &tokens));
            assert_eq!(x, y);
            assert_eq!(a.take_events(), b.take_events());
            for r in x.0 {
                a.release(r).unwrap();
                b.release(r).unwrap();
            }
        }
        assert_eq!(a.snapshot(), b.snapshot());
        // A block sealed twice is a failure the run reports, and its hash still chains.
        let mut blocks = Vec::new();
        assert!(b.alloc_run(5, 2, &mut blocks));
        b.seal(blocks[0], None, &[1, 1]).unwrap();
        let mut hashes = Vec::new();
        let failed = b.seal_run(&blocks, None, &[1, 1, 2, 2], &mut hashes);
        assert_eq!(failed, vec![KvError::NotWriting { chip: chip(16), slot: blocks[0].slot }]);
        assert_eq!(hashes[1], chained_block_hash(Some(hashes[0]), &[2, 2]));
        assert_eq!(b.find(hashes[1]), Some(blocks[1]));
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_released_first() {
        let mut pool = KvPool::new(chip(16), 3, 1);
        let refs: Vec<BlockRef> = (0..3).map(|i| pool.alloc(i).unwrap()).collect();
        let hashes: Vec<u64> =
            refs.iter().zip([10u32, 20, 30]).map(|(&r, t)| pool.seal(r, None, &[t]).unwrap()).collect();
        // Released in the order 1, 0, 2: block 1 is the first to go.
        for i in [1, 0, 2] {
            pool.release(refs[i]).unwrap();
        }
        assert_eq!((pool.used(), pool.free(), pool.cached()), (0, 3, 3));
        let fresh = pool.alloc(9).unwrap();
        assert_eq!(fresh.slot, refs[1].slot);
        assert_ne!(fresh.generation, refs[1].generation, "the evicted block's refs go stale");
        assert_eq!(pool.find(hashes[1]), None);
        assert_eq!(pool.acquire(hashes[0]), Some(refs[0]), "a revived block leaves the eviction order");
        let next = pool.alloc(9).unwrap();
        assert_eq!(next.slot, refs[2].slot);
        assert_eq!(pool.alloc(9), None, "every block is held");
        let (seq, held) = pool.snapshot();
        assert_eq!(held, vec![hashes[0]]);
        let events = pool.take_events();
        assert_eq!(events.last().map(KvEvent::seq), Some(seq));
        let stored: Vec<u64> =
            events.iter().filter(|&e| matches!(e, KvEvent::Stored { .. })).map(|e| e.seq()).collect();
        assert_eq!(stored, vec![1, 2, 3]);
        assert_eq!(
            events[3..],
            [KvEvent::Removed { seq: 4, hash: hashes[1] }, KvEvent::Removed { seq: 5, hash: hashes[2] }]
        );
        assert!(pool.take_events().is_empty());
    }

    proptest::proptest! {
        /// Under any mix of writes, releases and reuses, eviction takes the cached block
        /// released longest ago (checked against each block's last release time), and
        /// the order's stale entries stay bounded.
        #[test]
        fn eviction_follows_release_order(ops in proptest::collection::vec((0..3u8, 0..64usize), 1..400)) {
            let mut pool = KvPool::new(chip(16), 8, 1);
            let (mut held, mut sealed): (Vec<BlockRef>, Vec<u64>) = (Vec::new(), Vec::new());
            // Per slot: when it was last released into the cache (None: not cached).
            let mut released: BTreeMap<u32, u64> = BTreeMap::new();
            let mut clock = 0u64;
            for (token, (kind, n)) in ops.into_iter().enumerate() {
                match kind {
                    0 => {
                        let oldest = released.iter().min_by_key(|(_, t)| **t).map(|(s, _)| *s);
                        let full = pool.blocks.len() == pool.capacity;
                        let Some(r) = pool.alloc(0) else {
                            proptest::prop_assert!(released.is_empty());
                            continue;
                        };
                        if full {
                            proptest::prop_assert_eq!(Some(r.slot), oldest);
                            released.remove(&r.slot);
                        }
                        sealed.push(pool.seal(r, None, &[token as u32]).expect("a written block seals"));
                        held.push(r);
                    }
                    1 if !held.is_empty() => {
                        let r = held.swap_remove(n % held.len());
                        pool.release(r).expect("a held block releases");
                        if matches!(pool.state(r), Ok(BlockState::Cached { .. })) {
                            clock += 1;
                            released.insert(r.slot, clock);
                        }
                    }
                    2 if !sealed.is_empty() => {
                        if let Some(r) = pool.acquire(sealed[n % sealed.len()]) {
                            released.remove(&r.slot);
                            held.push(r);
                        }
                    }
                    _ => {}
                }
                proptest::prop_assert_eq!(pool.cached(), released.len());
                proptest::prop_assert!(pool.lru.len() <= 2 * pool.cached() + 64);
            }
        }
    }

    #[test]
    fn find_returns_the_oldest_live_block_of_a_hash() {
        let mut pool = KvPool::new(chip(16), 3, 2);
        let (a, b) = (pool.alloc(1).unwrap(), pool.alloc(2).unwrap());
        let h = pool.seal(a, None, &[7, 7]).unwrap();
        assert_eq!(pool.seal(b, None, &[7, 7]), Ok(h), "equal prefixes, equal hashes");
        assert_eq!(pool.find(h), Some(a));
        pool.release(a).unwrap();
        pool.drop_cached();
        assert_eq!(pool.find(h), Some(b), "the other block of that prefix is still found");
        // The freed slot's next owner is never mistaken for the old block.
        let c = pool.alloc(3).unwrap();
        assert_eq!(c.slot, a.slot);
        pool.seal(c, None, &[8, 8]).unwrap();
        assert_eq!(pool.find(h), Some(b));
        pool.release(b).unwrap();
        pool.release(c).unwrap();
        assert_eq!((pool.used(), pool.find(h)), (0, Some(b)), "cached, still found");
    }

    #[test]
    fn stale_and_foreign_refs_are_errors() {
        let mut pool = KvPool::new(chip(16), 1, 1);
        let a = pool.alloc(1).unwrap();
        pool.release(a).unwrap();
        assert!(matches!(pool.release(a), Err(KvError::Stale { .. })), "double free is refused");
        let b = pool.alloc(2).unwrap();
        assert_eq!(b.slot, a.slot);
        assert_ne!(b.generation, a.generation);
        assert!(
            matches!(pool.seal(a, None, &[5]), Err(KvError::Stale { .. })),
            "the old ref cannot touch the new owner's block"
        );
        let foreign = BlockRef { chip: chip(17), ..b };
        assert!(matches!(pool.release(foreign), Err(KvError::WrongChip { .. })));
        let out_of_range = BlockRef { slot: 40, ..b };
        assert!(matches!(pool.release(out_of_range), Err(KvError::Stale { .. })));
        assert_eq!(pool.used(), 1);
    }

    mod prefix_closed {
        use super::*;
        use proptest::prelude::*;
        use std::collections::BTreeSet;

        /// What a sequence does to the pool.
        #[derive(Debug, Clone)]
        enum Op {
            /// Start a sequence of `blocks` full blocks, each token from a 2-letter
            /// alphabet picked by `bits` (so prompts share prefixes often): it reuses the
            /// blocks the pool holds, as the batcher does, and writes the rest.
            Start { blocks: usize, bits: u32 },
            /// The `n`-th running sequence ends: its blocks are released, last first.
            End { n: usize },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (1..5usize, any::<u32>()).prop_map(|(blocks, bits)| Op::Start { blocks, bits }),
                (0..8usize).prop_map(|n| Op::End { n }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            /// The hashes a pool holds are closed under prefixes: whenever it holds a
            /// block's hash it holds the hash of the block before it (a sequence seals its
            /// blocks in order and releases them last first, so a chain's head is never
            /// released before, nor evicted before, its tail). The router's index relies
            /// on it to find a prompt's cached depth by binary search.
            #[test]
            fn held_hashes_are_prefix_closed(ops in prop::collection::vec(op(), 1..80)) {
                const BS: usize = 2;
                let mut pool = KvPool::new(Addr::new(tessera_actor_core::HostId(0), 16), 12, BS);
                let mut parent_of: BTreeMap<u64, Option<u64>> = BTreeMap::new();
                let mut running: Vec<Vec<BlockRef>> = Vec::new();
                for (owner, op) in ops.into_iter().enumerate() {
                    match op {
                        Op::Start { blocks, bits } => {
                            let tokens: Vec<u32> = (0..blocks * BS).map(|i| (bits >> (i % 32)) & 1).collect();
                            let hashes = prefix_hashes(&tokens, BS);
                            let mut held = Vec::new();
                            let mut ok = true;
                            for (i, &h) in hashes.iter().enumerate() {
                                parent_of.insert(h, i.checked_sub(1).map(|p| hashes[p]));
                                if ok && held.len() == i && let Some(r) = pool.acquire(h) {
                                    held.push(r);
                                    continue;
                                }
                                ok = false;
                                let Some(r) = pool.alloc(owner as u64) else { break };
                                let parent = i.checked_sub(1).map(|p| hashes[p]);
                                pool.seal(r, parent, &tokens[i * BS..(i + 1) * BS]).expect("a written block seals");
                                held.push(r);
                            }
                            running.push(held);
                        }
                        Op::End { n } if !running.is_empty() => {
                            let held = running.remove(n % running.len());
                            for r in held.into_iter().rev() {
                                pool.release(r).expect("a held block releases");
                            }
                        }
                        Op::End { .. } => {}
                    }
                    let (_, hashes) = pool.snapshot();
                    let held: BTreeSet<u64> = hashes.into_iter().collect();
                    for h in &held {
                        if let Some(Some(parent)) = parent_of.get(h) {
                            prop_assert!(held.contains(parent), "{h:x} held without its parent {parent:x}");
                        }
                    }
                }
            }
        }
    }
}
