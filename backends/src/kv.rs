//! The paged KV cache of one chip: per-layer K/V block arrays on the device, a slab of
//! block records (which block is free, who holds it, its chained prefix hash), and the
//! per-sequence block tables that map token positions to cache slots.
//!
//! Invariant: a block is either free or held by at least one sequence; when every
//! sequence is released the allocator is back to all-free (`used_blocks() == 0`).

use slab::Slab;

use crate::config::ModelConfig;
use crate::device::{Buffer, Device, KvCacheView};
use crate::dtype::DType;
use crate::error::{BackendError, Result};

/// Default tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Largest tokens per KV block.
pub const MAX_BLOCK_SIZE: usize = 4096;

/// Shape and size of a chip's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: DType,
}

/// Hash of a full block given its parent's hash: blocks with equal hashes hold the KV
/// of equal token prefixes, which is what prefix sharing and KV-aware routing key on.
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

#[derive(Debug, Clone, Default)]
struct BlockRecord {
    refs: u32,
    hash: Option<u64>,
}

/// Hands out block ids `0..capacity`; a block's id is its slab key.
#[derive(Debug)]
pub struct BlockAllocator {
    blocks: Slab<BlockRecord>,
    capacity: usize,
}

impl BlockAllocator {
    pub fn new(capacity: usize) -> Self {
        BlockAllocator { blocks: Slab::with_capacity(capacity), capacity }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn used_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.capacity - self.blocks.len()
    }

    fn alloc(&mut self) -> Option<u32> {
        if self.blocks.len() >= self.capacity {
            return None;
        }
        let id = self.blocks.insert(BlockRecord { refs: 1, hash: None });
        debug_assert!(id < self.capacity, "slab reuses freed keys before growing");
        Some(id as u32)
    }

    fn release(&mut self, id: u32) {
        let Some(rec) = self.blocks.get_mut(id as usize) else {
            return;
        };
        rec.refs -= 1;
        if rec.refs == 0 {
            self.blocks.remove(id as usize);
        }
    }

    fn seal(&mut self, id: u32, hash: u64) {
        if let Some(rec) = self.blocks.get_mut(id as usize) {
            rec.hash = Some(hash);
        }
    }

    /// The chained hash a full block was sealed with.
    pub fn block_hash(&self, id: u32) -> Option<u64> {
        self.blocks.get(id as usize).and_then(|r| r.hash)
    }
}

/// One sequence's view of the cache: its block table and the tokens it has cached.
/// Not `Clone`: two copies releasing the same blocks would free another sequence's KV.
#[derive(Debug, Default)]
pub struct SequenceKv {
    block_table: Vec<u32>,
    tokens: Vec<u32>,
    block_hashes: Vec<u64>,
}

impl SequenceKv {
    pub fn block_table(&self) -> &[u32] {
        &self.block_table
    }

    /// Tokens whose K/V are (or are being) written to the cache.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Chained hashes of the full blocks, in order.
    pub fn block_hashes(&self) -> &[u64] {
        &self.block_hashes
    }
}

/// A chip's KV cache: device memory plus its allocator.
pub struct PagedKvCache {
    config: KvCacheConfig,
    num_kv_heads: usize,
    head_dim: usize,
    layers: Vec<(Buffer, Buffer)>,
    allocator: BlockAllocator,
}

impl PagedKvCache {
    /// Allocates `config.num_blocks` blocks for every layer of `model` on `device`.
    pub fn new(device: &Device, model: &ModelConfig, config: KvCacheConfig) -> Result<Self> {
        if !(1..=MAX_BLOCK_SIZE).contains(&config.block_size) || config.num_blocks == 0 {
            return Err(BackendError::KvCache(format!(
                "block size ({}) must be in 1..={MAX_BLOCK_SIZE} and block count ({}) positive",
                config.block_size, config.num_blocks
            )));
        }
        // Slots are i32 in the kernel ABI; byte sizes must not overflow.
        let too_big = || {
            BackendError::KvCache(format!(
                "{} blocks of {} tokens exceed what the kernel ABI can address",
                config.num_blocks, config.block_size
            ))
        };
        let slots = config.num_blocks.checked_mul(config.block_size).filter(|&n| n <= i32::MAX as usize);
        let layer_bytes = [model.num_kv_heads, model.head_dim, config.dtype.size_bytes()]
            .iter()
            .try_fold(slots.ok_or_else(too_big)?, |acc, &d| acc.checked_mul(d))
            .ok_or_else(too_big)?;
        let layers = (0..model.num_layers)
            .map(|_| Ok((device.alloc(layer_bytes)?, device.alloc(layer_bytes)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedKvCache {
            config,
            num_kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            layers,
            allocator: BlockAllocator::new(config.num_blocks),
        })
    }

    /// Blocks that `bytes` of device memory hold for `model`.
    pub fn blocks_for_bytes(model: &ModelConfig, block_size: usize, dtype: DType, bytes: u64) -> usize {
        let per_block = (block_size * model.kv_bytes_per_token(dtype.size_bytes())) as u64;
        (bytes / per_block.max(1)) as usize
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocator
    }

    /// Layer `layer`'s cache as the kernels take it.
    pub fn layer_view(&self, layer: usize) -> KvCacheView<'_> {
        let (k, v) = &self.layers[layer];
        KvCacheView {
            k: k.view(),
            v: v.view(),
            dtype: self.config.dtype,
            num_blocks: self.config.num_blocks as u32,
            block_size: self.config.block_size as u32,
            num_kv_heads: self.num_kv_heads as u32,
            head_dim: self.head_dim as u32,
        }
    }

    /// Blocks needed to grow `seq` by `extra` tokens.
    pub fn blocks_needed(&self, seq: &SequenceKv, extra: usize) -> usize {
        let bs = self.config.block_size;
        (seq.len() + extra).div_ceil(bs).saturating_sub(seq.block_table.len())
    }

    /// Reserves room for `tokens` after what `seq` holds, returns their cache slots, and
    /// seals every block the new tokens fill. All-or-nothing: on failure `seq` is unchanged.
    pub fn append(&mut self, seq: &mut SequenceKv, tokens: &[u32]) -> Result<Vec<i32>> {
        let need = self.blocks_needed(seq, tokens.len());
        if need > self.allocator.free_blocks() {
            return Err(BackendError::KvCache(format!(
                "out of KV blocks: need {need}, {} free of {}",
                self.allocator.free_blocks(),
                self.allocator.capacity()
            )));
        }
        for _ in 0..need {
            // Cannot fail: free blocks were counted above.
            if let Some(id) = self.allocator.alloc() {
                seq.block_table.push(id);
            }
        }
        let bs = self.config.block_size;
        let start = seq.tokens.len();
        seq.tokens.extend_from_slice(tokens);
        let slots =
            (start..seq.tokens.len()).map(|pos| (seq.block_table[pos / bs] as usize * bs + pos % bs) as i32).collect();
        while seq.block_hashes.len() < seq.tokens.len() / bs {
            let i = seq.block_hashes.len();
            let hash = chained_block_hash(seq.block_hashes.last().copied(), &seq.tokens[i * bs..(i + 1) * bs]);
            self.allocator.seal(seq.block_table[i], hash);
            seq.block_hashes.push(hash);
        }
        Ok(slots)
    }

    /// Returns every block of `seq` to the pool.
    pub fn release(&mut self, seq: &mut SequenceKv) {
        for id in seq.block_table.drain(..) {
            self.allocator.release(id);
        }
        seq.tokens.clear();
        seq.block_hashes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_reuses_ids_and_drains_to_free() {
        let mut a = BlockAllocator::new(3);
        let ids: Vec<u32> = (0..3).filter_map(|_| a.alloc()).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(a.alloc(), None);
        a.release(1);
        assert_eq!(a.alloc(), Some(1));
        for id in [0, 1, 2] {
            a.release(id);
        }
        assert_eq!(a.used_blocks(), 0);
    }

    #[test]
    fn chained_hash_depends_on_parent_and_tokens() {
        let a = chained_block_hash(None, &[1, 2, 3]);
        assert_eq!(a, chained_block_hash(None, &[1, 2, 3]));
        assert_ne!(a, chained_block_hash(None, &[1, 2, 4]));
        assert_ne!(chained_block_hash(Some(a), &[5]), chained_block_hash(Some(a ^ 1), &[5]));
        assert_ne!(chained_block_hash(None, &[5]), chained_block_hash(Some(0), &[5]));
    }
}
