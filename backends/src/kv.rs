//! The paged KV cache of one chip: per-layer K/V block arrays on the device, which the
//! kernels write and read at the slots they are given. It is storage only: which blocks
//! a sequence holds (and so which slots its tokens take) is the chip's KV pool's
//! decision (`tessera-actors`), made outside this crate; `slot_of` is how a block table
//! maps a position to a slot.
//!
//! For prefill/decode disaggregation it also moves KV in and out of the device: a
//! prefill chip stages whole blocks in their native bytes (`read_blocks`), a decode chip
//! installs token rows decoded from another chip's format (`write_tokens`, converted by
//! the `fill_kv_cache` kernel) or, when both formats are equal, whole blocks as they are
//! (`write_blocks`). See `kv_format` for the byte format.

use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::device::{Buffer, Device, KvCacheView};
use crate::dtype::DType;
use crate::error::{BackendError, Result};
use crate::kv_format::{KvFormat, KvLayout};

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

/// The cache slot of position `pos` of a sequence whose blocks are `block_table`, in
/// order: offset `pos % block_size` of its block `pos / block_size`. None past the
/// table's end.
pub fn slot_of(block_table: &[u32], block_size: usize, pos: usize) -> Option<i32> {
    let block = *block_table.get(pos / block_size)? as usize;
    i32::try_from(block * block_size + pos % block_size).ok()
}

/// Device buffers `write_tokens` uploads rows and slots into, kept and grown so that
/// installing KV layer by layer does not allocate per call.
#[derive(Default)]
struct InstallScratch {
    k: Option<Buffer>,
    v: Option<Buffer>,
    slots: Option<Buffer>,
}

/// Makes `slot` hold at least `bytes`, growing geometrically.
fn grow(device: &Device, slot: &mut Option<Buffer>, bytes: usize) -> Result<()> {
    let have = slot.as_ref().map_or(0, |b| b.len_bytes());
    if have < bytes {
        *slot = None;
        *slot = Some(device.alloc(bytes.max(have * 3 / 2))?);
    }
    Ok(())
}

/// A chip's KV cache: its blocks' device memory.
pub struct PagedKvCache {
    config: KvCacheConfig,
    layout: KvLayout,
    num_kv_heads: usize,
    head_dim: usize,
    layers: Vec<(Buffer, Buffer)>,
    // A Mutex rather than a RefCell only so the cache stays `Sync`; it is never contended
    // (ops on a device are issued from one thread).
    install: Mutex<InstallScratch>,
}

impl PagedKvCache {
    /// Allocates `config.num_blocks` head-major blocks for every layer of `model` on
    /// `device`.
    pub fn new(device: &Device, model: &ModelConfig, config: KvCacheConfig) -> Result<Self> {
        Self::with_layout(device, model, config, KvLayout::HeadMajor)
    }

    /// Allocates `config.num_blocks` blocks in `layout` for every layer of `model` on
    /// `device`.
    pub fn with_layout(device: &Device, model: &ModelConfig, config: KvCacheConfig, layout: KvLayout) -> Result<Self> {
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
            layout,
            num_kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            layers,
            install: Mutex::new(InstallScratch::default()),
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

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The byte format of this cache's blocks, as announced to a peer chip.
    pub fn format(&self) -> KvFormat {
        KvFormat {
            num_layers: self.layers.len(),
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.config.block_size,
            layout: self.layout,
            dtype: self.config.dtype,
        }
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
            layout: self.layout,
        }
    }

    /// Layer `layer`'s K and V buffers, or an error naming the layer.
    fn layer(&self, layer: usize) -> Result<&(Buffer, Buffer)> {
        self.layers.get(layer).ok_or_else(|| {
            BackendError::KvCache(format!("layer {layer} does not exist (the cache has {})", self.layers.len()))
        })
    }

    /// Checks block ids and that `k`/`v` hold exactly one block each per id.
    fn check_blocks(&self, blocks: &[u32], k_len: usize, v_len: usize) -> Result<usize> {
        let block_bytes = self.format().block_bytes();
        if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= self.config.num_blocks) {
            return Err(BackendError::KvCache(format!(
                "block {bad} does not exist (the cache has {})",
                self.config.num_blocks
            )));
        }
        let want = blocks.len() * block_bytes;
        if k_len != want || v_len != want {
            return Err(BackendError::KvCache(format!(
                "{} blocks of {block_bytes} bytes need {want}-byte K and V buffers, got {k_len} and {v_len}",
                blocks.len()
            )));
        }
        Ok(block_bytes)
    }

    /// Copies the native bytes (this cache's layout and dtype) of `blocks` of layer
    /// `layer` into `k_out` and `v_out`, block after block in the given order, each
    /// `format().block_bytes()` long. Runs of consecutive block ids move in one device
    /// copy each. The staging buffers are the caller's (e.g. a slice of a registered
    /// transfer region), so no intermediate copy is made.
    pub fn read_blocks(
        &self,
        device: &Device,
        layer: usize,
        blocks: &[u32],
        k_out: &mut [u8],
        v_out: &mut [u8],
    ) -> Result<()> {
        let (k, v) = self.layer(layer)?;
        let block_bytes = self.check_blocks(blocks, k_out.len(), v_out.len())?;
        for run in contiguous_runs(blocks) {
            let src = run.first_block as usize * block_bytes;
            let dst = run.index * block_bytes..(run.index + run.len) * block_bytes;
            device.read(k.at(src), &mut k_out[dst.clone()])?;
            device.read(v.at(src), &mut v_out[dst])?;
        }
        Ok(())
    }

    /// Writes whole blocks of layer `layer` from bytes already in this cache's format
    /// (the mirror of [`read_blocks`](Self::read_blocks)): the fast path when sender and
    /// receiver formats are equal, which skips the f32 round trip of `write_tokens`.
    pub fn write_blocks(&self, device: &Device, layer: usize, blocks: &[u32], k_in: &[u8], v_in: &[u8]) -> Result<()> {
        let (k, v) = self.layer(layer)?;
        let block_bytes = self.check_blocks(blocks, k_in.len(), v_in.len())?;
        for run in contiguous_runs(blocks) {
            let dst = run.first_block as usize * block_bytes;
            let src = run.index * block_bytes..(run.index + run.len) * block_bytes;
            device.write(k.at(dst), &k_in[src.clone()])?;
            device.write(v.at(dst), &v_in[src])?;
        }
        Ok(())
    }

    /// Copies whole blocks, `(source, destination)` pairs, in every layer: a forked
    /// sequence's own copy of the block it shares with its parent and writes into
    /// (copy-on-write). The bytes pass through host memory, one layer at a time.
    pub fn copy_blocks(&self, device: &Device, pairs: &[(u32, u32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (src, dst): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        let bytes = pairs.len() * self.format().block_bytes();
        let (mut k, mut v) = (vec![0u8; bytes], vec![0u8; bytes]);
        for layer in 0..self.layers.len() {
            self.read_blocks(device, layer, &src, &mut k, &mut v)?;
            self.write_blocks(device, layer, &dst, &k, &v)?;
        }
        Ok(())
    }

    /// Writes f32 K and V rows (`[slots.len()][num_kv_heads][head_dim]`, e.g. from
    /// `kv_format::decode_tokens`) of layer `layer` at `slots` with the `fill_kv_cache`
    /// kernel, which rounds to this cache's dtype and places them in its layout. A
    /// negative slot skips its row, as in the kernel ABI.
    pub fn write_tokens(
        &self,
        device: &Device,
        layer: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        slots: &[i32],
    ) -> Result<()> {
        self.layer(layer)?;
        let row = self.num_kv_heads * self.head_dim;
        let n = slots.len();
        if k_rows.len() != n * row || v_rows.len() != n * row {
            return Err(BackendError::KvCache(format!(
                "{n} slots need {} K and V values ({} kv heads x {} dims each), got {} and {}",
                n * row,
                self.num_kv_heads,
                self.head_dim,
                k_rows.len(),
                v_rows.len()
            )));
        }
        let capacity = self.config.num_blocks * self.config.block_size;
        if let Some(bad) = slots.iter().find(|&&s| s >= 0 && s as usize >= capacity) {
            return Err(BackendError::KvCache(format!("slot {bad} is outside the cache's {capacity} slots")));
        }
        if n == 0 {
            return Ok(());
        }
        let n32 =
            u32::try_from(n).map_err(|_| BackendError::KvCache(format!("{n} tokens do not fit one kernel call")))?;
        let mut scratch = self.install.lock().unwrap_or_else(|e| e.into_inner());
        let InstallScratch { k, v, slots: s } = &mut *scratch;
        grow(device, k, 4 * n * row)?;
        grow(device, v, 4 * n * row)?;
        grow(device, s, 4 * n)?;
        let (Some(k), Some(v), Some(s)) = (k.as_ref(), v.as_ref(), s.as_ref()) else {
            return Err(BackendError::KvCache("install buffers were not allocated".into()));
        };
        device.write(k.view(), k_rows)?;
        device.write(v.view(), v_rows)?;
        device.write(s.view(), slots)?;
        device.fill_kv_cache(&self.layer_view(layer), k.view(), v.view(), s.view(), n32)
    }
}

/// A run of consecutive block ids: `len` blocks from `first_block`, found at
/// `blocks[index..index + len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockRun {
    index: usize,
    first_block: u32,
    len: usize,
}

/// Splits `blocks` into maximal runs of consecutive ids, in order.
fn contiguous_runs(blocks: &[u32]) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.first_block.checked_add(r.len as u32) == Some(b) => r.len += 1,
            _ => runs.push(BlockRun { index: i, first_block: b, len: 1 }),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_consecutive_block_ids() {
        let r = |index, first_block, len| BlockRun { index, first_block, len };
        assert_eq!(contiguous_runs(&[]), vec![]);
        assert_eq!(contiguous_runs(&[4, 5, 6, 2, 3, 9, 8]), vec![r(0, 4, 3), r(3, 2, 2), r(5, 9, 1), r(6, 8, 1)]);
        assert_eq!(contiguous_runs(&[7, 7]), vec![r(0, 7, 1), r(1, 7, 1)]);
        assert_eq!(contiguous_runs(&[u32::MAX, 0]), vec![r(0, u32::MAX, 1), r(1, 0, 1)]);
    }

    #[test]
    fn slots_follow_the_block_table() {
        let table = [5, 2, 9];
        let slots: Vec<Option<i32>> = (0..7).map(|pos| slot_of(&table, 2, pos)).collect();
        assert_eq!(slots, vec![Some(10), Some(11), Some(4), Some(5), Some(18), Some(19), None]);
        assert_eq!(slot_of(&[], 16, 0), None);
        assert_eq!(slot_of(&[u32::MAX], 4096, 0), None, "beyond what the kernel ABI addresses");
    }
}
