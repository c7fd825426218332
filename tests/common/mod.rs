//! Shared helpers of the model integration tests: temporary synthetic checkpoints, a
//! CPU device, token streams, and the reference forward in `reference`.
#![allow(dead_code)]

pub mod reference;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tessera_backends::device::{Device, DeviceConfig};
use tessera_backends::dtype::DType;
use tessera_backends::kv::{KvCacheConfig, PagedKvCache, SequenceKv};
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

/// A KV cache for `model`.
pub fn kv_cache(model: &Model, block_size: usize, num_blocks: usize, dtype: DType) -> PagedKvCache {
    PagedKvCache::new(model.device(), model.config(), KvCacheConfig { block_size, num_blocks, dtype })
        .expect("kv cache")
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
pub fn run_chunk(
    model: &mut Model,
    kv: &mut PagedKvCache,
    seq: &mut SequenceKv,
    toks: &[u32],
    want: LogitsWanted,
) -> Vec<f32> {
    let start_pos = seq.len();
    let slots = kv.append(seq, toks).expect("append");
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
