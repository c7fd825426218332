//! One model over several devices: a model instance of pipeline stages, each stage a
//! group of tensor-parallel ranks, every rank a [`Shard`] on a device of its own, run
//! by a worker thread of its own (a device's ops are issued from one thread).
//!
//! A step's sequences are cut into micro-batches (as many as there are stages, when
//! there are that many sequences) that flow through the stages in order: stage `s`
//! works on micro-batch `m + 1` while stage `s + 1` works on `m`, so a pipeline of `S`
//! stages is idle for `(S - 1) / (M + S - 1)` of a step (the bubble). Activations go
//! from a stage's rank 0 to every rank of the next as one buffer per micro-batch, in
//! memory (the ranks of one instance share a process); the ranks of a stage join their
//! partial sums through the kernel library's collectives where it has them (ABI 1.4),
//! else through Tessera's host all-reduce ([`crate::shard::group`]). Each stage keeps
//! the KV of its own layers: its KV cache has the instance's block count, so one block
//! table addresses a sequence's blocks on every stage.
//!
//! A stage on another host ([`RemoteStage`]) is loaded and run by that host's stage
//! server; here one worker thread stands for it, sending each micro-batch and its
//! activations over the stage's link ([`crate::stage_link`]) and passing the answer on.
//! The same structure serves the other end: a stage server runs its stage as a
//! *part* of an instance ([`ShardedModel::load_part`]), whose last stage answers with
//! its activations.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::compat::CompatInfo;
use crate::config::ModelConfig;
use crate::device::{Device, DeviceConfig};
use crate::dtype::DType;
use crate::error::{BackendError, Result};
use crate::kv::{KvCacheConfig, PagedKvCache};
use crate::kv_format::KvLayout;
use crate::loader::KernelLibrary;
use crate::model::{LoadOptions, Model, SeqChunk, StageInput};
use crate::shard::{AllReduce, Collectives, Shard, stage_ranges};
use crate::stage_link::{StageClient, WireChunk};
pub use tessera_perf::parallel::WeightParts;

/// One device of an instance.
#[derive(Debug, Clone)]
pub struct ShardDevice {
    /// A name for errors and logs (the chip's id).
    pub label: String,
    /// None: the CPU kernel library built with Tessera.
    pub kernel_lib: Option<PathBuf>,
    pub device: DeviceConfig,
}

/// A pipeline stage: its layers and its tensor-parallel devices (one per rank).
#[derive(Debug, Clone)]
pub struct StageSpec {
    pub layers: Range<usize>,
    pub devices: Vec<ShardDevice>,
    /// Where the stage runs when its devices are on another host; `None`: here.
    pub remote: Option<RemoteStage>,
}

/// A stage whose devices are on another host: that host's stage server loads it.
#[derive(Debug, Clone)]
pub struct RemoteStage {
    /// The stage server's address.
    pub addr: SocketAddr,
    /// The instance's id, by which the server finds the stage in its topology.
    pub instance: String,
    /// Seals the link on a secured cluster (`None`: in clear).
    pub seal: Option<std::sync::Arc<dyn crate::stage_link::LinkSeal>>,
}

/// How to bring up an instance.
#[derive(Debug, Clone)]
pub struct InstanceSpec {
    pub model_dir: PathBuf,
    pub options: LoadOptions,
    pub stages: Vec<StageSpec>,
    pub block_size: usize,
    pub kv_dtype: DType,
    pub kv_layout: KvLayout,
    /// KV memory of a shard whose device has no memory limit.
    pub default_kv_bytes: u64,
    /// No more blocks than this (what the instance's batches can use).
    pub max_blocks: usize,
    /// Which all-reduce joins each stage's ranks.
    pub collectives: Collectives,
}

impl InstanceSpec {
    /// Stages of `counts` layers each, every stage of `tp` devices made by `device(stage,
    /// rank)`.
    pub fn stages_of(counts: &[usize], tp: usize, device: impl Fn(usize, usize) -> ShardDevice) -> Vec<StageSpec> {
        stage_ranges(counts)
            .into_iter()
            .enumerate()
            .map(|(s, layers)| StageSpec { layers, devices: (0..tp).map(|r| device(s, r)).collect(), remote: None })
            .collect()
    }
}

/// A model's weight bytes as stored, by where they live in an instance (the largest
/// layer's for `layer`; the tied embedding again for `head` when there is no LM head).
pub fn weight_parts(dir: &std::path::Path) -> Result<WeightParts> {
    let config = ModelConfig::from_dir(dir)?;
    let ckpt = crate::weights::Checkpoint::open(dir)?;
    let embed = ckpt.stored_bytes("model.embed_tokens.");
    let layer = (0..config.num_layers).map(|i| ckpt.stored_bytes(&format!("model.layers.{i}."))).max().unwrap_or(0);
    let head = match ckpt.stored_bytes("lm_head.") {
        0 => embed,
        bytes => bytes,
    } + ckpt.stored_bytes("model.norm.");
    Ok(WeightParts { embed, layer, head })
}

/// Called on each worker of a stage right after model layer `layer` (the shard's
/// `local`) of a step has its K and V in the shard's cache, which holds the rank's KV
/// heads `kv_heads`: e.g. to stage them for a decode chip.
pub type LayerHook = dyn Fn(usize, usize, Range<usize>, &Device, &PagedKvCache) -> Result<()> + Send + Sync;

enum Cmd {
    /// `spent`: the stages before's compute time for this micro-batch.
    Forward {
        step: u64,
        mb: usize,
        batch: Arc<Vec<WireChunk>>,
        input: Option<Arc<Vec<f32>>>,
        spent: Duration,
        hook: Option<Arc<LayerHook>>,
    },
    MakeKv {
        config: KvCacheConfig,
        layout: KvLayout,
        reply: Sender<Result<()>>,
    },
    CopyBlocks {
        pairs: Vec<(u32, u32)>,
        reply: Sender<Result<()>>,
    },
    /// f32 rows of every KV head; each rank writes its own heads.
    WriteTokens {
        layer: usize,
        k_rows: Arc<Vec<f32>>,
        v_rows: Arc<Vec<f32>>,
        slots: Arc<Vec<i32>>,
        reply: Sender<Result<()>>,
    },
}

/// What the workers tell the instance.
enum Event {
    /// A micro-batch's logits rows, from the last stage's rank 0, or why it failed.
    Done { step: u64, mb: usize, result: Result<Vec<f32>>, compute: Duration },
    /// The step's layer hook ran for model layer `layer`.
    Layer { step: u64, layer: usize },
}

/// What a worker reports once its shard is loaded.
struct Loaded {
    weight_bytes: u64,
    /// The most KV blocks its device holds beside its weights.
    max_blocks: usize,
    compat: CompatInfo,
    weight_format: String,
}

/// How a worker sizes its KV cache: what its device's memory limit leaves after its
/// weights (an eighth kept for step buffers), or `default_bytes` without a limit.
#[derive(Debug, Clone, Copy)]
struct KvSizing {
    block_size: usize,
    dtype: DType,
    default_bytes: u64,
}

struct Worker {
    tx: Sender<Cmd>,
    thread: Option<JoinHandle<()>>,
}

/// A model instance across devices (see the module doc).
pub struct ShardedModel {
    config: ModelConfig,
    stages: Vec<Range<usize>>,
    tp: Vec<usize>,
    /// Each stage's all-reduce: "library", "host", "none" (one rank), or "remote" (run
    /// on another host).
    all_reduce: Vec<&'static str>,
    /// The first stage that runs on another host, if any.
    first_remote: Option<usize>,
    /// `[stage][rank]`.
    workers: Vec<Vec<Worker>>,
    events: Receiver<Event>,
    step: u64,
    kv: KvCacheConfig,
    kv_layout: KvLayout,
    weight_bytes: u64,
    compat: CompatInfo,
    weight_format: String,
    timing: StepTiming,
}

/// Where the time of an instance's steps went, summed over steps.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    pub steps: u64,
    pub wall_s: f64,
    /// Time inside forward passes, summed over the stages (each stage's rank 0): a
    /// pipeline of `S` stages kept busy would show `S * wall_s`.
    pub compute_s: f64,
    pub microbatches: u64,
    /// Activation bytes sent stage to stage (to each rank of the next stage).
    pub activation_bytes: u64,
}

impl StepTiming {
    /// The share of the stages' time not spent computing: the pipeline bubble, the
    /// activation hand-offs and the all-reduce waits, `1 - compute / (stages * wall)`.
    pub fn idle_share(&self, stages: usize) -> f64 {
        if self.wall_s <= 0.0 {
            return 0.0;
        }
        (1.0 - self.compute_s / (stages as f64 * self.wall_s)).max(0.0)
    }
}

impl ShardedModel {
    /// Loads every shard on its own worker thread, then sizes one KV cache per shard to
    /// the block count all of them can hold: what each device's memory limit leaves
    /// after its weights (an eighth kept for step buffers), or `default_kv_bytes`.
    pub fn load(spec: &InstanceSpec) -> Result<ShardedModel> {
        let (mut model, num_blocks) = Self::start(spec, false)?;
        model.make_kv(num_blocks)?;
        Ok(model)
    }

    /// A part of an instance: consecutive stages (all of them here) that need not start
    /// at layer 0 or end at the model's last, as a stage server runs a stage of an
    /// instance on another host. Its first stage takes activations, its last answers
    /// with them (or with logits, if it is the model's last). No KV cache is made yet:
    /// the most blocks every shard can hold is returned, for [`make_kv`](Self::make_kv)
    /// with the whole instance's count.
    pub fn load_part(spec: &InstanceSpec) -> Result<(ShardedModel, usize)> {
        if let Some(s) = spec.stages.iter().position(|s| s.remote.is_some()) {
            return Err(BackendError::Shard(format!("stage {s} of a part is on another host; a part runs here")));
        }
        Self::start(spec, true)
    }

    /// Loads the shards and starts their workers; the KV cache is made by `make_kv`.
    fn start(spec: &InstanceSpec, part: bool) -> Result<(ShardedModel, usize)> {
        let config = ModelConfig::from_dir(&spec.model_dir)?;
        check_stages(&config, spec, part)?;
        let sizing =
            KvSizing { block_size: spec.block_size, dtype: spec.kv_dtype, default_bytes: spec.default_kv_bytes };
        let (events_tx, events) = mpsc::channel();
        let mut workers: Vec<Vec<Worker>> = Vec::new();
        let mut loading = Vec::new();
        // Built from the last stage back, so each stage knows the next one's workers.
        let mut next: Vec<Sender<Cmd>> = Vec::new();
        // One load per library file, so every rank of a stage shares its library (and
        // so may share its communicator).
        let mut libs: Vec<(Option<PathBuf>, Arc<KernelLibrary>)> = Vec::new();
        let mut all_reduce = Vec::new();
        for (s, stage) in spec.stages.iter().enumerate().rev() {
            if let Some(remote) = &stage.remote {
                let (tx, rx) = mpsc::channel();
                let (ready_tx, ready_rx) = mpsc::channel();
                let label = format!("stage {s} on {}", remote.addr);
                let job = RemoteJob {
                    remote: remote.clone(),
                    stage: s,
                    layers: stage.layers.clone(),
                    label: label.clone(),
                    next: next.clone(),
                    events: events_tx.clone(),
                };
                let thread = std::thread::Builder::new()
                    .name(format!("stage-link-{s}"))
                    .spawn(move || job.run(rx, ready_tx))
                    .map_err(|e| BackendError::Shard(format!("cannot start the link of {label}: {e}")))?;
                next = vec![tx.clone()];
                workers.push(vec![Worker { tx, thread: Some(thread) }]);
                all_reduce.push("remote");
                loading.push((label, ready_rx));
                continue;
            }
            let mut stage_libs = Vec::new();
            for dev in &stage.devices {
                let lib = match libs.iter().find(|(p, _)| *p == dev.kernel_lib) {
                    Some((_, lib)) => lib.clone(),
                    None => {
                        let lib = match &dev.kernel_lib {
                            Some(path) => KernelLibrary::load(path),
                            None => KernelLibrary::load_default(),
                        }
                        .map_err(|e| BackendError::Shard(format!("{}: {e}", dev.label)))?;
                        libs.push((dev.kernel_lib.clone(), lib.clone()));
                        lib
                    }
                };
                stage_libs.push(lib);
            }
            let shared = stage_libs.iter().all(|l| Arc::ptr_eq(l, &stage_libs[0])).then(|| &stage_libs[0]);
            let (groups, kind) = crate::shard::group(shared, stage.devices.len(), spec.collectives)?;
            all_reduce.push(if stage.devices.len() > 1 { kind } else { "none" });
            let mut row = Vec::new();
            for (rank, ((dev, group), lib)) in stage.devices.iter().zip(groups).zip(stage_libs).enumerate() {
                let (tx, rx) = mpsc::channel();
                let (ready_tx, ready_rx) = mpsc::channel();
                let shard = Shard { layers: stage.layers.clone(), tp_rank: rank, tp_size: stage.devices.len() };
                let job = WorkerJob {
                    lib,
                    model_dir: spec.model_dir.clone(),
                    options: spec.options,
                    device: dev.clone(),
                    shard,
                    sizing,
                    group: (stage.devices.len() > 1).then_some(group),
                    next: if rank == 0 { next.clone() } else { Vec::new() },
                    events: events_tx.clone(),
                };
                let thread = std::thread::Builder::new()
                    .name(format!("shard-{}", dev.label))
                    .spawn(move || job.run(rx, ready_tx))
                    .map_err(|e| BackendError::Shard(format!("cannot start the worker of {}: {e}", dev.label)))?;
                row.push(Worker { tx, thread: Some(thread) });
                loading.push((dev.label.clone(), ready_rx));
            }
            next = row.iter().map(|w| w.tx.clone()).collect();
            workers.push(row);
        }
        workers.reverse();
        all_reduce.reverse();
        // In stage order, so the first stage's shard speaks for the instance.
        loading.reverse();
        let mut loaded = Vec::new();
        for (label, ready) in loading {
            let shard = ready
                .recv()
                .map_err(|_| BackendError::Shard(format!("the worker of {label} stopped while loading")))?
                .map_err(|e| BackendError::Shard(format!("{label}: {e}")))?;
            loaded.push(shard);
        }
        let num_blocks = loaded.iter().map(|l| l.max_blocks).fold(spec.max_blocks.max(1), usize::min);
        let first = &loaded[0];
        let model = ShardedModel {
            stages: spec.stages.iter().map(|s| s.layers.clone()).collect(),
            tp: spec.stages.iter().map(|s| s.devices.len()).collect(),
            all_reduce,
            first_remote: spec.stages.iter().position(|s| s.remote.is_some()),
            weight_bytes: loaded.iter().map(|l| l.weight_bytes).sum(),
            compat: first.compat.clone(),
            weight_format: first.weight_format.clone(),
            config,
            workers,
            events,
            step: 0,
            kv: KvCacheConfig { block_size: spec.block_size, num_blocks: 0, dtype: spec.kv_dtype },
            kv_layout: spec.kv_layout,
            timing: StepTiming::default(),
        };
        Ok((model, num_blocks))
    }

    /// Makes every shard's KV cache, of `num_blocks` blocks (at most what
    /// [`load_part`](Self::load_part) said each shard can hold).
    pub fn make_kv(&mut self, num_blocks: usize) -> Result<()> {
        let kv = KvCacheConfig { num_blocks, ..self.kv };
        let mut replies = Vec::new();
        for w in self.workers.iter().flatten() {
            let (reply, rx) = mpsc::channel();
            send(&w.tx, Cmd::MakeKv { config: kv, layout: self.kv_layout, reply })?;
            replies.push(rx);
        }
        wait_all(replies)?;
        self.kv = kv;
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Each stage's layers, in order.
    pub fn stages(&self) -> &[Range<usize>] {
        &self.stages
    }

    /// Each stage's tensor-parallel degree.
    pub fn tp_degrees(&self) -> &[usize] {
        &self.tp
    }

    /// Each stage's all-reduce: `"library"` (the kernel library's collectives),
    /// `"host"` (Tessera's), or `"none"` (a stage of one rank).
    pub fn all_reduce(&self) -> &[&'static str] {
        &self.all_reduce
    }

    /// The KV cache every shard holds (its block count is the instance's).
    pub fn kv_config(&self) -> &KvCacheConfig {
        &self.kv
    }

    pub fn kv_layout(&self) -> KvLayout {
        self.kv_layout
    }

    /// Weight bytes over all shards.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// What a peer chip must match to exchange KV with this instance: the whole model's.
    pub fn compat_info(&self) -> CompatInfo {
        self.compat.clone()
    }

    pub fn weight_format(&self) -> &str {
        &self.weight_format
    }

    /// Where the time of the steps so far went.
    pub fn timing(&self) -> StepTiming {
        self.timing
    }

    /// One forward step of the whole model over `batch`: the logits rows wanted, in
    /// batch order, `vocab_size` floats each (as [`Model::forward`]).
    pub fn forward(&mut self, batch: &[SeqChunk<'_>]) -> Result<Vec<f32>> {
        self.forward_observed(batch, None, &mut |_| Ok(()))
    }

    /// [`forward`](Self::forward), running `hook` on every worker of a stage right after
    /// each of its layers has this step's KV, then `on_layer(layer)` here once every
    /// rank of the stage has, in layer order. A hooked step is one micro-batch (each
    /// layer's KV is whole when the hook runs).
    pub fn forward_observed(
        &mut self,
        batch: &[SeqChunk<'_>],
        hook: Option<Arc<LayerHook>>,
        on_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Vec<f32>> {
        if hook.is_some()
            && let Some(s) = self.first_remote
        {
            return Err(BackendError::Shard(format!(
                "stage {s} is on another host, which cannot stage its layers' KV for a decode chip: a prefill \
                 instance keeps its stages on one host"
            )));
        }
        let parts = if hook.is_some() { 1 } else { self.stages.len() };
        self.step_with(batch, None, parts, hook, on_layer)
    }

    /// One step of a part ([`load_part`](Self::load_part)) over one micro-batch: its
    /// first stage takes `input` (the activations of the stage before, `hidden_size`
    /// values a token; `None` where the part begins at layer 0), and the rows its last
    /// stage ends with come back: activations, or logits rows wanted.
    pub fn forward_part(&mut self, batch: &[SeqChunk<'_>], input: Option<&[f32]>) -> Result<Vec<f32>> {
        let tokens: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let first = self.stages.first().map_or(0, |r| r.start);
        match input {
            Some(hidden) if hidden.len() != tokens * self.config.hidden_size => {
                return Err(BackendError::Request(format!(
                    "{} activation values for {tokens} tokens of hidden size {}",
                    hidden.len(),
                    self.config.hidden_size
                )));
            }
            None if first != 0 => {
                return Err(BackendError::Request(format!("a part from layer {first} needs activations")));
            }
            Some(_) if first == 0 => {
                return Err(BackendError::Request("a part from layer 0 takes tokens, not activations".into()));
            }
            _ => {}
        }
        self.step_with(batch, input, 1, None, &mut |_| Ok(()))
    }

    fn step_with(
        &mut self,
        batch: &[SeqChunk<'_>],
        input: Option<&[f32]>,
        parts: usize,
        hook: Option<Arc<LayerHook>>,
        on_layer: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<Vec<f32>> {
        if batch.is_empty() {
            return Err(BackendError::Request("a forward step needs at least one token".into()));
        }
        let started = Instant::now();
        self.step += 1;
        let step = self.step;
        let parts = microbatches(batch, parts);
        let input = input.map(|hidden| Arc::new(hidden.to_vec()));
        for (mb, part) in parts.iter().enumerate() {
            let chunks = Arc::new(part.iter().map(WireChunk::of).collect::<Vec<_>>());
            for w in &self.workers[0] {
                let (hook, input) = (hook.clone(), input.clone());
                send(&w.tx, Cmd::Forward { step, mb, batch: chunks.clone(), input, spent: Duration::ZERO, hook })?;
            }
        }
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; parts.len()];
        // Ranks that ran the hook, per layer: a layer is done when its stage's all have.
        let mut hooked = vec![0usize; self.config.num_layers];
        let mut compute = Duration::ZERO;
        let mut left = parts.len();
        // A hooked step also waits for every rank's hook of every layer: another rank's
        // last layer may report after the rank that returns the logits is done.
        let mut layers_left = if hook.is_some() { self.config.num_layers } else { 0 };
        while left > 0 || layers_left > 0 {
            // A worker that stopped drops its senders; every worker holds one, so a
            // timeout also bounds a wedged one.
            let event = self
                .events
                .recv_timeout(crate::shard::ALL_REDUCE_TIMEOUT * 2)
                .map_err(|_| BackendError::Shard("the instance's workers stopped answering".into()))?;
            match event {
                Event::Done { step: s, .. } | Event::Layer { step: s, .. } if s != step => continue, // a failed step's straggler
                Event::Layer { layer, .. } => {
                    let ranks = self.tp[self.stage_of(layer)?];
                    hooked[layer] += 1;
                    if hooked[layer] == ranks {
                        layers_left -= 1;
                        on_layer(layer)?;
                    }
                }
                Event::Done { mb, result, compute: c, .. } => {
                    rows[mb] = Some(result?);
                    compute += c;
                    left -= 1;
                }
            }
        }
        let tokens: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let hops: usize = self.tp[1..].iter().sum();
        let t = &mut self.timing;
        t.steps += 1;
        t.wall_s += started.elapsed().as_secs_f64();
        t.compute_s += compute.as_secs_f64();
        t.microbatches += parts.len() as u64;
        t.activation_bytes += (tokens * self.config.hidden_size * 4 * hops) as u64;
        Ok(rows.into_iter().flatten().flatten().collect())
    }

    /// Copies whole blocks, `(source, destination)` pairs, in every layer of every shard.
    pub fn copy_blocks(&self, pairs: &[(u32, u32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let mut replies = Vec::new();
        for w in self.workers.iter().flatten() {
            let (reply, rx) = mpsc::channel();
            send(&w.tx, Cmd::CopyBlocks { pairs: pairs.to_vec(), reply })?;
            replies.push(rx);
        }
        wait_all(replies)
    }

    /// Writes f32 K and V rows (`[slots][num_kv_heads][head_dim]`, every head of the
    /// model) of layer `layer` at `slots` on the stage that owns the layer, each rank its
    /// own heads (see [`PagedKvCache::write_tokens`]).
    pub fn write_tokens(&self, layer: usize, k_rows: &[f32], v_rows: &[f32], slots: &[i32]) -> Result<()> {
        let stage = self.stage_of(layer)?;
        let (k_rows, v_rows, slots) = (Arc::new(k_rows.to_vec()), Arc::new(v_rows.to_vec()), Arc::new(slots.to_vec()));
        let mut replies = Vec::new();
        for w in &self.workers[stage] {
            let (reply, rx) = mpsc::channel();
            let (k_rows, v_rows, slots) = (k_rows.clone(), v_rows.clone(), slots.clone());
            send(&w.tx, Cmd::WriteTokens { layer, k_rows, v_rows, slots, reply })?;
            replies.push(rx);
        }
        wait_all(replies)
    }

    /// The stage holding model layer `layer`.
    pub fn stage_of(&self, layer: usize) -> Result<usize> {
        self.stages.iter().position(|r| r.contains(&layer)).ok_or_else(|| {
            BackendError::KvCache(format!("layer {layer} does not exist (the model has {})", self.config.num_layers))
        })
    }
}

impl Drop for ShardedModel {
    fn drop(&mut self) {
        // Dropping the senders ends each worker's loop.
        let threads: Vec<_> = self.workers.iter_mut().flatten().filter_map(|w| w.thread.take()).collect();
        self.workers.clear();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// The stages must cover the model's layers in order (a part: some of them, from any
/// layer), each with one device or more; an instance's first stage runs here.
fn check_stages(config: &ModelConfig, spec: &InstanceSpec, part: bool) -> Result<()> {
    let begin = if part { spec.stages.first().map_or(0, |s| s.layers.start) } else { 0 };
    let mut at = begin;
    for (i, s) in spec.stages.iter().enumerate() {
        if s.layers.start != at || s.layers.is_empty() || s.devices.is_empty() {
            return Err(BackendError::Shard(format!(
                "stage {i} (layers {:?}, {} devices) does not continue the stages before it at layer {at} \
                 with one device or more",
                s.layers,
                s.devices.len()
            )));
        }
        at = s.layers.end;
    }
    let covered = if part { at <= config.num_layers } else { at == config.num_layers };
    if !covered || spec.stages.is_empty() {
        return Err(BackendError::Shard(format!(
            "the stages cover layers {begin}..{at} of a {}-layer model",
            config.num_layers
        )));
    }
    if let Some(remote) = spec.stages.first().and_then(|s| s.remote.as_ref()) {
        return Err(BackendError::Shard(format!(
            "the first stage is on another host ({}): an instance runs on the host of its first stage",
            remote.addr
        )));
    }
    Ok(())
}

/// `batch` cut into at most `parts` contiguous groups of whole sequences, of about equal
/// tokens each, in batch order (so their logits rows concatenate in batch order).
fn microbatches<'a, 'b>(batch: &'b [SeqChunk<'a>], parts: usize) -> Vec<&'b [SeqChunk<'a>]> {
    let parts = parts.clamp(1, batch.len().max(1));
    let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut seen) = (0, 0);
    for (i, s) in batch.iter().enumerate() {
        seen += s.tokens.len();
        let left_seqs = batch.len() - i - 1;
        let left_parts = parts - out.len() - 1;
        // Close a group once it holds its share of tokens, keeping a sequence for every
        // group still to come.
        let share = seen * parts >= total * (out.len() + 1) && left_seqs >= left_parts;
        if left_parts > 0 && (share || left_seqs == left_parts) {
            out.push(&batch[start..=i]);
            start = i + 1;
        }
    }
    if start < batch.len() {
        out.push(&batch[start..]);
    }
    out
}

fn send(tx: &Sender<Cmd>, cmd: Cmd) -> Result<()> {
    tx.send(cmd).map_err(|_| BackendError::Shard("a worker of the instance has stopped".into()))
}

fn wait_all(replies: Vec<Receiver<Result<()>>>) -> Result<()> {
    for rx in replies {
        rx.recv().map_err(|_| BackendError::Shard("a worker of the instance has stopped".into()))??;
    }
    Ok(())
}

/// What a stage's rank 0 ends a micro-batch with.
struct StageOutput {
    step: u64,
    mb: usize,
    batch: Arc<Vec<WireChunk>>,
    /// Activations, or logits rows after the model's last layer.
    rows: Vec<f32>,
    /// Compute time of this micro-batch so far, over the stages.
    compute: Duration,
    hook: Option<Arc<LayerHook>>,
}

impl StageOutput {
    /// To every rank of the next stage; after the last stage (of the model, or of a
    /// part), back to the instance.
    fn pass_on(self, next: &[Sender<Cmd>], events: &Sender<Event>) {
        let StageOutput { step, mb, batch, rows, compute, hook } = self;
        if next.is_empty() {
            let _ = events.send(Event::Done { step, mb, result: Ok(rows), compute });
            return;
        }
        let hidden = Arc::new(rows);
        for tx in next {
            let input = Some(hidden.clone());
            let cmd = Cmd::Forward { step, mb, batch: batch.clone(), input, spent: compute, hook: hook.clone() };
            if tx.send(cmd).is_err() {
                let e = BackendError::Shard("the next stage's worker has stopped".into());
                let _ = events.send(Event::Done { step, mb, result: Err(e), compute });
            }
        }
    }
}

/// The worker that stands for a stage on another host: each command goes over the
/// stage's link. A broken link (or a failed step there) fails the step and ends this
/// worker, so the instance is down, as when a local worker panics.
struct RemoteJob {
    remote: RemoteStage,
    stage: usize,
    layers: Range<usize>,
    label: String,
    next: Vec<Sender<Cmd>>,
    events: Sender<Event>,
}

impl RemoteJob {
    fn run(self, rx: Receiver<Cmd>, ready: Sender<Result<Loaded>>) {
        let timeout = crate::shard::ALL_REDUCE_TIMEOUT * 2;
        let connected = StageClient::connect(
            self.remote.addr,
            &self.remote.instance,
            self.stage,
            self.layers.clone(),
            timeout,
            self.remote.seal.as_deref(),
        );
        let mut link = match connected {
            Ok((link, l)) => {
                let loaded = Loaded {
                    weight_bytes: l.weight_bytes,
                    max_blocks: l.max_blocks,
                    compat: l.compat,
                    weight_format: l.weight_format,
                };
                if ready.send(Ok(loaded)).is_err() {
                    return;
                }
                link
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::MakeKv { config, reply, .. } => {
                    let _ = reply.send(link.make_kv(config.num_blocks));
                }
                Cmd::CopyBlocks { pairs, reply } => {
                    let _ = reply.send(link.copy_blocks(&pairs));
                }
                Cmd::WriteTokens { layer, k_rows, v_rows, slots, reply } => {
                    let _ = reply.send(link.write_tokens(layer, &k_rows, &v_rows, &slots));
                }
                Cmd::Forward { step, mb, batch, input, spent, hook } => {
                    let ran = link.forward(batch.to_vec(), input.as_deref().map(Vec::as_slice));
                    match ran {
                        Ok((rows, compute)) => {
                            let out = StageOutput { step, mb, batch, rows, compute: spent + compute, hook };
                            out.pass_on(&self.next, &self.events);
                        }
                        Err(e) => {
                            let e = BackendError::Shard(format!("{}: {e}", self.label));
                            let _ = self.events.send(Event::Done { step, mb, result: Err(e), compute: spent });
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// What one worker thread is given.
struct WorkerJob {
    lib: Arc<KernelLibrary>,
    model_dir: PathBuf,
    options: LoadOptions,
    device: ShardDevice,
    shard: Shard,
    sizing: KvSizing,
    group: Option<Box<dyn AllReduce + Send>>,
    /// The next stage's workers (rank 0 forwards its activations to them); none after
    /// the last stage of a part, which answers with its activations.
    next: Vec<Sender<Cmd>>,
    events: Sender<Event>,
}

impl WorkerJob {
    fn run(mut self, rx: Receiver<Cmd>, ready: Sender<Result<Loaded>>) {
        let mut model = match self.open() {
            Ok(model) => model,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let loaded = self.max_blocks(&model).map(|max_blocks| Loaded {
            weight_bytes: model.weight_bytes(),
            max_blocks,
            compat: model.compat_info(),
            weight_format: model.weight_format().to_string(),
        });
        if ready.send(loaded).is_err() {
            return;
        }
        let mut kv: Option<PagedKvCache> = None;
        let no_kv = || BackendError::KvCache("the shard's KV cache is not made yet".into());
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::MakeKv { config, layout, reply } => {
                    let made = PagedKvCache::with_layout(model.device(), model.shard_config(), config, layout);
                    let _ = reply.send(made.map(|c| kv = Some(c)));
                }
                Cmd::CopyBlocks { pairs, reply } => {
                    let done = kv.as_ref().ok_or_else(no_kv).and_then(|kv| kv.copy_blocks(model.device(), &pairs));
                    let _ = reply.send(done);
                }
                Cmd::WriteTokens { layer, k_rows, v_rows, slots, reply } => {
                    let done = kv
                        .as_ref()
                        .ok_or_else(no_kv)
                        .and_then(|kv| self.write_tokens(&model, kv, layer, &k_rows, &v_rows, &slots));
                    let _ = reply.send(done);
                }
                Cmd::Forward { step, mb, batch, input, spent, hook } => {
                    let started = Instant::now();
                    let chunks: Vec<SeqChunk<'_>> = batch.iter().map(WireChunk::view).collect();
                    let input = match &input {
                        Some(hidden) => StageInput::Hidden(hidden),
                        None => StageInput::Tokens,
                    };
                    let reduce = self.group.as_deref_mut().map(|g| g as &mut dyn AllReduce);
                    let first = self.shard.layers.start;
                    let kv_heads = self.shard.heads(model.config()).kv;
                    let events = &self.events;
                    // A panic on this worker fails the step at once (the group's other
                    // ranks and the lead stop waiting) and ends the worker: the instance
                    // is down, and its chip restarts it.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match kv.as_ref() {
                        Some(kv) => {
                            let mut on_layer = |local: usize, dev: &Device| -> Result<()> {
                                if let Some(hook) = &hook {
                                    hook(first + local, local, kv_heads.clone(), dev, kv)?;
                                    let _ = events.send(Event::Layer { step, layer: first + local });
                                }
                                Ok(())
                            };
                            model.forward_stage(kv, &chunks, input, &mut on_layer, reduce)
                        }
                        None => Err(no_kv()),
                    }));
                    let (result, panicked) = match ran {
                        Ok(result) => (result, false),
                        Err(payload) => {
                            let why = payload
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| payload.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a panic".into());
                            (Err(BackendError::Shard(format!("the worker panicked: {why}"))), true)
                        }
                    };
                    let compute = spent + started.elapsed();
                    match result {
                        Err(e) => {
                            if let Some(g) = &self.group {
                                g.abort(&e.to_string());
                            }
                            let e = BackendError::Shard(format!("{}: {e}", self.device.label));
                            let _ = self.events.send(Event::Done { step, mb, result: Err(e), compute });
                            if panicked {
                                return;
                            }
                        }
                        Ok(_) if self.shard.tp_rank != 0 => {}
                        Ok(rows) => {
                            let out = StageOutput { step, mb, batch, rows, compute, hook };
                            out.pass_on(&self.next, &self.events);
                        }
                    }
                }
            }
        }
    }

    /// The most KV blocks this shard's device holds beside its weights.
    fn max_blocks(&self, model: &Model) -> Result<usize> {
        let KvSizing { block_size, dtype, default_bytes } = self.sizing;
        let weights = model.weight_bytes();
        let kv_bytes = match self.device.device.memory_limit_bytes {
            0 => default_bytes,
            limit => {
                let rest = limit.checked_sub(weights).ok_or_else(|| {
                    BackendError::Shard(format!(
                        "its memory limit ({limit} bytes) is smaller than its shard's weights ({weights} bytes)"
                    ))
                })?;
                rest - rest / 8
            }
        };
        match PagedKvCache::blocks_for_bytes(model.shard_config(), block_size, dtype, kv_bytes) {
            0 => Err(BackendError::Shard(format!("no memory is left for even one KV block of {block_size} tokens"))),
            blocks => Ok(blocks),
        }
    }

    /// Opens this shard's device on this thread and loads the shard onto it.
    fn open(&self) -> Result<Model> {
        let device = Device::open(&self.lib, &self.device.device)?;
        Model::load_shard(&self.model_dir, device, self.options, Some(self.shard.clone()))
    }

    /// This rank's heads of every row, written at `slots` of the shard's layer.
    fn write_tokens(
        &self,
        model: &Model,
        kv: &PagedKvCache,
        layer: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        slots: &[i32],
    ) -> Result<()> {
        let local = layer - self.shard.layers.start;
        if self.shard.tp_size == 1 {
            return kv.write_tokens(model.device(), local, k_rows, v_rows, slots);
        }
        let c = model.config();
        let heads = self.shard.heads(c).kv;
        let (row, hd) = (c.num_kv_heads * c.head_dim, c.head_dim);
        let mine = |rows: &[f32]| -> Vec<f32> {
            rows.chunks_exact(row).flat_map(|r| &r[heads.start * hd..heads.end * hd]).copied().collect()
        };
        if k_rows.len() != slots.len() * row || v_rows.len() != slots.len() * row {
            return Err(BackendError::KvCache(format!(
                "{} slots need {} K and V values, got {} and {}",
                slots.len(),
                slots.len() * row,
                k_rows.len(),
                v_rows.len()
            )));
        }
        kv.write_tokens(model.device(), local, &mine(k_rows), &mine(v_rows), slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LogitsWanted;

    fn chunk(tokens: &[u32]) -> SeqChunk<'_> {
        SeqChunk { tokens, start_pos: 0, block_table: &[], slots: &[], logits: LogitsWanted::Last }
    }

    #[test]
    fn microbatches_are_contiguous_balanced_and_never_empty() {
        let (a, b, c, d) = ([1u32; 10], [1u32; 1], [1u32; 1], [1u32; 8]);
        let batch = [chunk(&a), chunk(&b), chunk(&c), chunk(&d)];
        let sizes = |parts| microbatches(&batch, parts).iter().map(|p| p.len()).collect::<Vec<_>>();
        for (parts, want) in
            [(1, vec![4]), (2, vec![1, 3]), (3, vec![1, 2, 1]), (4, vec![1, 1, 1, 1]), (9, vec![1, 1, 1, 1])]
        {
            assert_eq!(sizes(parts), want, "{parts} parts");
        }
        let one = [chunk(&a)];
        assert_eq!(microbatches(&one, 3).len(), 1);
    }
}
