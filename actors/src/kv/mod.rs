//! A chip's KV pool: the chip's cache blocks as small state machines hosted in a slab
//! (Free -> Writing -> Sealed{hash, refs} -> Free). A block is addressed by
//! `BlockRef{chip, slot, generation}`; the generation changes every time a block is
//! freed, so a stale reference is an error, never a silent hit on someone else's KV.
//! The pool decides which device blocks a sequence uses; the chip's worker only writes
//! and reads the slots it is told.
//!
//! A full block is sealed with its chained hash (its tokens hashed with the hash of the
//! blocks before it), so equal hashes mean equal token prefixes: a sealed block can be
//! shared by reference count and found by hash (`find`), which is what prefix reuse
//! and KV-aware routing key on. Invariant: a block is free exactly when no sequence
//! holds a reference to it, so a pool whose sequences all ended is all-free.

use slab::Slab;
use std::collections::HashMap;
use tessera_actor_core::Addr;

/// Hash of a full block given its parent's hash (None for a sequence's first block):
/// blocks with equal hashes hold the KV of equal token prefixes.
pub fn chained_block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(9 + tokens.len() * 4);
    match parent {
        Some(p) => {
            bytes.push(1);
            bytes.extend_from_slice(&p.to_le_bytes());
        }
        None => bytes.push(0),
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
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
    /// Full, its tokens hashed (chained with the blocks before it).
    Sealed { hash: u64, refs: u32 },
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
}

#[derive(Debug)]
pub struct KvPool {
    chip: Addr,
    capacity: usize,
    block_size: usize,
    blocks: Slab<BlockState>,
    /// Per slot, including free ones: bumped on every free.
    generations: Vec<u32>,
    /// Sealed blocks by chained hash, oldest seal first (equal prompts not yet sharing
    /// their prefix seal equal hashes in several blocks).
    by_hash: HashMap<u64, Vec<u32>>,
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
            by_hash: HashMap::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn used(&self) -> usize {
        self.blocks.len()
    }

    pub fn free(&self) -> usize {
        self.capacity - self.blocks.len()
    }

    /// A free block, now Writing for `owner`; None when the pool is full.
    pub fn alloc(&mut self, owner: u64) -> Option<BlockRef> {
        if self.blocks.len() >= self.capacity {
            return None;
        }
        let slot = self.blocks.insert(BlockState::Writing { owner });
        Some(self.block_ref(slot))
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
        match self.check(r)? {
            BlockState::Writing { .. } if tokens.len() != self.block_size => Err(KvError::NotFull {
                chip: self.chip,
                slot: r.slot,
                tokens: tokens.len(),
                block_size: self.block_size,
            }),
            BlockState::Writing { .. } => {
                let hash = chained_block_hash(parent, tokens);
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: 1 };
                self.by_hash.entry(hash).or_default().push(r.slot);
                Ok(hash)
            }
            BlockState::Sealed { .. } => Err(KvError::NotWriting { chip: self.chip, slot: r.slot }),
        }
    }

    /// One more holder of a sealed block (a sequence reusing that prefix).
    pub fn share(&mut self, r: BlockRef) -> Result<(), KvError> {
        match self.check(r)? {
            BlockState::Sealed { hash, refs } => {
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: refs + 1 };
                Ok(())
            }
            BlockState::Writing { .. } => Err(KvError::NotSealed { chip: self.chip, slot: r.slot }),
        }
    }

    /// The oldest sealed block with chained hash `hash`, if one is held.
    pub fn find(&self, hash: u64) -> Option<BlockRef> {
        let slot = *self.by_hash.get(&hash)?.first()?;
        Some(self.block_ref(slot as usize))
    }

    /// Drops one reference; the block goes back to Free when none is left.
    pub fn release(&mut self, r: BlockRef) -> Result<(), KvError> {
        let slot = r.slot as usize;
        match self.check(r)? {
            BlockState::Sealed { hash, refs } if refs > 1 => {
                self.blocks[slot] = BlockState::Sealed { hash, refs: refs - 1 };
            }
            state => {
                if let BlockState::Sealed { hash, .. } = state {
                    self.unindex(hash, r.slot);
                }
                self.blocks.remove(slot);
                self.generations[slot] = self.generations[slot].wrapping_add(1);
            }
        }
        Ok(())
    }

    fn unindex(&mut self, hash: u64, slot: u32) {
        if let Some(slots) = self.by_hash.get_mut(&hash) {
            slots.retain(|&s| s != slot);
            if slots.is_empty() {
                self.by_hash.remove(&hash);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!((pool.used(), pool.find(hash)), (0, None), "the last release frees it and forgets its hash");
        assert!(matches!(pool.state(a), Err(KvError::Stale { .. })));
        assert!(matches!(pool.share(a), Err(KvError::Stale { .. })), "a freed block cannot be shared");
    }

    #[test]
    fn find_returns_the_oldest_live_block_of_a_hash() {
        let mut pool = KvPool::new(chip(16), 3, 2);
        let (a, b) = (pool.alloc(1).unwrap(), pool.alloc(2).unwrap());
        let h = pool.seal(a, None, &[7, 7]).unwrap();
        assert_eq!(pool.seal(b, None, &[7, 7]), Ok(h), "equal prefixes, equal hashes");
        assert_eq!(pool.find(h), Some(a));
        pool.release(a).unwrap();
        assert_eq!(pool.find(h), Some(b), "the other block of that prefix is still found");
        // The freed slot's next owner is never mistaken for the old block.
        let c = pool.alloc(3).unwrap();
        assert_eq!(c.slot, a.slot);
        pool.seal(c, None, &[8, 8]).unwrap();
        assert_eq!(pool.find(h), Some(b));
        pool.release(b).unwrap();
        pool.release(c).unwrap();
        assert_eq!((pool.used(), pool.find(h)), (0, None));
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
}
