//! Shared helpers of the model integration tests: temporary synthetic checkpoints, a
//! CPU device, a KV cache whose blocks a chip's KV pool hands out, token streams, and
//! the reference forward in `reference`.
#![allow(dead_code)]

pub mod reference;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tessera_actors::kv::{BlockRef, KvPool};
use tessera_backends::device::{Device, DeviceConfig};
use tessera_backends::dtype::DType;
use tessera_backends::kv::{KvCacheConfig, PagedKvCache, slot_of};
use tessera_backends::kv_format::KvLayout;
use tessera_backends::loader::KernelLibrary;
use tessera_backends::model::{LogitsWanted, Model, SeqChunk};
use tessera_backends::synth::{Preset, SynthArch, SynthSpec, write_checkpoint};

/// A checkpoint directory under the system temp dir, removed on drop.
pub struct TempCkpt {
    pub dir: PathBuf,
}

impl TempCkpt {
    /// Writes the tiny synthetic checkpoint of `arch` (seed `seed`, weights `dtype`,
    /// `shards` files) into a directory unique to this process and call.
    pub fn tiny(name: &str, arch: SynthArch, seed: u64, dtype: Option<DType>, shards: usize) -> TempCkpt {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tessera-model-test-{}-{name}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spec = SynthSpec { preset: Preset::Tiny, arch, seed, dtype, shards };
        write_checkpoint(&dir, &spec).unwrap_or_else(|e| panic!("writing {}: {e}", dir.display()));
        TempCkpt { dir }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TempCkpt {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The CPU device with 2 worker threads.
pub fn device() -> Device {
    let lib = KernelLibrary::load_default().expect("CPU kernel library (built by `cargo test`)");
    Device::open(&lib, &DeviceConfig { threads: 2, ..Default::default() }).expect("open CPU device")
}

pub fn load(dir: &Path, dtype: Option<DType>) -> Model {
    Model::load(dir, device(), dtype).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// A chip's KV storage and the pool that decides which of its blocks a sequence holds,
/// for tests that run the model step by step themselves (a chip's batcher does this
/// when serving). Dereferences to the cache.
pub struct Kv {
    pub cache: PagedKvCache,
    pub pool: KvPool,
}

/// One sequence's blocks in a [`Kv`] and how many tokens they hold.
#[derive(Debug, Default)]
pub struct SeqKv {
    blocks: Vec<BlockRef>,
    table: Vec<u32>,
    len: usize,
}

impl SeqKv {
    pub fn block_table(&self) -> &[u32] {
        &self.table
    }

    /// Tokens whose K/V are (or are being) written to the cache.
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Kv {
    /// Reserves blocks for `tokens` after what `seq` holds and returns their slots.
    pub fn append(&mut self, seq: &mut SeqKv, tokens: &[u32]) -> Vec<i32> {
        let bs = self.pool.block_size();
        let end = seq.len + tokens.len();
        while seq.table.len() < end.div_ceil(bs) {
            let block = self.pool.alloc(0).expect("a free KV block");
            seq.blocks.push(block);
            seq.table.push(block.slot);
        }
        let slots = (seq.len..end).map(|pos| slot_of(&seq.table, bs, pos).expect("a slot")).collect();
        seq.len = end;
        slots
    }

    /// Returns every block of `seq` to the pool.
    pub fn release(&mut self, seq: &mut SeqKv) {
        for block in seq.blocks.drain(..) {
            self.pool.release(block).expect("a held block");
        }
        seq.table.clear();
        seq.len = 0;
    }

    pub fn used_blocks(&self) -> usize {
        self.pool.used()
    }
}

impl std::ops::Deref for Kv {
    type Target = PagedKvCache;

    fn deref(&self) -> &PagedKvCache {
        &self.cache
    }
}

/// A head-major KV cache for `model`.
pub fn kv_cache(model: &Model, block_size: usize, num_blocks: usize, dtype: DType) -> Kv {
    kv_cache_in(model, block_size, num_blocks, dtype, KvLayout::HeadMajor)
}

/// A KV cache for `model` in `layout`.
pub fn kv_cache_in(model: &Model, block_size: usize, num_blocks: usize, dtype: DType, layout: KvLayout) -> Kv {
    let config = KvCacheConfig { block_size, num_blocks, dtype };
    let cache = PagedKvCache::with_layout(model.device(), model.config(), config, layout).expect("kv cache");
    let chip = tessera_actor_core::Addr::new(tessera_actor_core::HostId(0), 1);
    Kv { cache, pool: KvPool::new(chip, num_blocks, block_size) }
}

/// `n` pseudo-random token ids in `0..vocab` (deterministic in `seed`).
pub fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// Largest |a - b| over two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Largest |x| (the scale relative tolerances refer to).
pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Appends `toks` to `seq` and runs them as one chunk, returning the rows `want` asks for.
pub fn run_chunk(model: &mut Model, kv: &mut Kv, seq: &mut SeqKv, toks: &[u32], want: LogitsWanted) -> Vec<f32> {
    let start_pos = seq.len();
    let slots = kv.append(seq, toks);
    let chunk = SeqChunk { tokens: toks, start_pos, block_table: seq.block_table(), slots: &slots, logits: want };
    model.forward(kv, &[chunk]).expect("forward")
}

/// Asserts two logits blocks agree within `tol` (max abs), naming the worst row.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], vocab: usize, tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: {} logits, expected {}", got.len(), want.len());
    assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite logits");
    let (mut worst, mut worst_row) = (0.0f32, 0);
    for (r, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let d = max_abs_diff(g, w);
        if d > worst {
            worst = d;
            worst_row = r;
        }
    }
    if std::env::var_os("TESSERA_TEST_VERBOSE").is_some() {
        eprintln!("{what}: max abs diff {worst} at row {worst_row}");
    }
    assert!(worst <= tol, "{what}: max abs diff {worst} at row {worst_row} exceeds {tol}");
}
