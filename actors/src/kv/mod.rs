//! A chip's KV pool: the chip's cache blocks as small state machines hosted in a slab
//! (Free -> Writing -> Sealed{hash, refs} -> Free). A block is addressed by
//! `BlockRef{chip, slot, generation}`; the generation changes every time a block is
//! freed, so a stale reference is an error, never a silent hit on someone else's KV.
//! The pool decides which device blocks a sequence uses; the chip's worker only writes
//! and reads the slots it is told.

use slab::Slab;
use tessera_actor_core::Addr;

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
}

#[derive(Debug)]
pub struct KvPool {
    chip: Addr,
    capacity: usize,
    blocks: Slab<BlockState>,
    /// Per slot, including free ones: bumped on every free.
    generations: Vec<u32>,
}

impl KvPool {
    pub fn new(chip: Addr, capacity: usize) -> KvPool {
        KvPool { chip, capacity, blocks: Slab::with_capacity(capacity), generations: vec![0; capacity] }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
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
        Some(BlockRef { chip: self.chip, slot: slot as u32, generation: self.generations[slot] })
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

    /// Writing -> Sealed: the block is full and its chained hash known.
    pub fn seal(&mut self, r: BlockRef, hash: u64) -> Result<(), KvError> {
        match self.check(r)? {
            BlockState::Writing { .. } => {
                self.blocks[r.slot as usize] = BlockState::Sealed { hash, refs: 1 };
                Ok(())
            }
            BlockState::Sealed { .. } => Err(KvError::NotWriting { chip: self.chip, slot: r.slot }),
        }
    }

    /// Drops one reference; the block goes back to Free when none is left.
    pub fn release(&mut self, r: BlockRef) -> Result<(), KvError> {
        let slot = r.slot as usize;
        match self.check(r)? {
            BlockState::Sealed { hash, refs } if refs > 1 => {
                self.blocks[slot] = BlockState::Sealed { hash, refs: refs - 1 };
            }
            _ => {
                self.blocks.remove(slot);
                self.generations[slot] = self.generations[slot].wrapping_add(1);
            }
        }
        Ok(())
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
        let mut pool = KvPool::new(chip(16), 2);
        let a = pool.alloc(7).unwrap();
        assert_eq!(pool.state(a), Ok(BlockState::Writing { owner: 7 }));
        pool.seal(a, 99).unwrap();
        assert_eq!(pool.state(a), Ok(BlockState::Sealed { hash: 99, refs: 1 }));
        assert_eq!(pool.seal(a, 1), Err(KvError::NotWriting { chip: chip(16), slot: a.slot }));
        let b = pool.alloc(8).unwrap();
        assert_eq!(pool.alloc(9), None, "capacity is a hard limit");
        assert_eq!((pool.used(), pool.free()), (2, 0));
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        assert_eq!(pool.used(), 0);
    }

    #[test]
    fn stale_and_foreign_refs_are_errors() {
        let mut pool = KvPool::new(chip(16), 1);
        let a = pool.alloc(1).unwrap();
        pool.release(a).unwrap();
        assert!(matches!(pool.release(a), Err(KvError::Stale { .. })), "double free is refused");
        let b = pool.alloc(2).unwrap();
        assert_eq!(b.slot, a.slot);
        assert_ne!(b.generation, a.generation);
        assert!(
            matches!(pool.seal(a, 5), Err(KvError::Stale { .. })),
            "the old ref cannot touch the new owner's block"
        );
        let foreign = BlockRef { chip: chip(17), ..b };
        assert!(matches!(pool.release(foreign), Err(KvError::WrongChip { .. })));
        let out_of_range = BlockRef { slot: 40, ..b };
        assert!(matches!(pool.release(out_of_range), Err(KvError::Stale { .. })));
        assert_eq!(pool.used(), 1);
    }
}
