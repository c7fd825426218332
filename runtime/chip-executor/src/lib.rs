//! What a chip's worker thread runs: a loaded model over its paged KV cache, plus the
//! samplers of the sequences it serves. This is the only place an actor's plan meets
//! the device; a simulator substitutes its own `StepExecutor`.
//!
//! For disaggregation the worker also stages KV (after each layer, the blocks of the
//! sequences prefilled for a decode chip are copied into a registered memory region
//! that mirrors the cache: block b of layer l's K at `staging_offset(l, K, b)`) and
//! installs KV read from another chip's region, converting it to this cache's block
//! size, layout and dtype. An emulated chip (`emu:<kind>`) computes on the CPU and
//! declares that kind's roofline time for the step (and for each layer's staged KV) as
//! the job's model time, which its host waits out: the executor itself never sleeps to
//! pace.
//!
//! An adapter between the chip behavior (`tessera-actors`' `StepExecutor`) and the data
//! plane (`tessera-backends` devices, the `tessera-runtime` transfer engine): the only
//! crate that knows both, so it alone converts the behaviors' plain `KvRegionDesc` to the
//! transfer engine's `RegionDesc`. Behaviors never depend on it.
//!
//! It also runs a chip without actors (`local`: `tessera generate`, the model tests):
//! the chip's batcher and KV pool driving this executor in a synchronous step loop.

pub mod bench;
pub mod local;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_actors::batcher::{NewSampler, PlannedSeq, StepPlan};
use tessera_actors::chip::executor::{KvInstall, StepExecutor, stage_groups};
use tessera_actors::msg::{
    ChipInfo, KvCompat, KvEndpointDesc, KvFormatDesc, KvRegionDesc, Msg, StepOutcome, TokenLogprob,
};
use tessera_backends::config::ModelConfig;
use tessera_backends::constraint::{Allowed, Constraint, Grammars};
use tessera_backends::device::{Device, DeviceConfig, MatmulPrecision};
use tessera_backends::dtype::{DType, Quantize};
use tessera_backends::instance::{InstanceSpec, LayerHook, ShardedModel, StageSpec, StepTiming};
use tessera_backends::kv::{KvCacheConfig, PagedKvCache};
use tessera_backends::kv_format::{KvFormat, KvLayout, decode_tokens};
use tessera_backends::loader::KernelLibrary;
use tessera_backends::model::{LoadOptions, LogitsWanted, Model, SeqChunk};
use tessera_backends::sampling::{Penalties, Sampler, SamplingParams};
use tessera_backends::tokenizer::TextTokenizer;
use tessera_runtime::actor::JobCtx;
use tessera_runtime::transfer::{Assignment, Capability, EndpointDesc, Region, RegionDesc, TransferEngine};
use tessera_topology::perf::ModelShape;
use tessera_topology::{ChipKind, EmulationSpec};

/// The transfer engine's descriptor of a region as the behaviors carry it in messages.
pub fn kv_region_desc(d: RegionDesc) -> KvRegionDesc {
    let RegionDesc { endpoint: EndpointDesc { host_key, pid, tcp }, region, fd, len, capability: _ } = d;
    KvRegionDesc { endpoint: KvEndpointDesc { host_key, pid, tcp }, region, fd, len }
}

/// A region the behaviors carried, as the transfer engine reads it.
pub fn region_desc(d: &KvRegionDesc) -> RegionDesc {
    let KvRegionDesc { endpoint: KvEndpointDesc { host_key, pid, tcp }, region, fd, len } = d.clone();
    RegionDesc { endpoint: EndpointDesc { host_key, pid, tcp }, region, fd, len, capability: None }
}

/// Byte offset of block `block`'s K (`v = false`) or V of layer `layer` in a chip's
/// staging region: layers in order, each all K blocks then all V blocks.
pub fn staging_offset(format: &KvFormatDesc, block_bytes: usize, layer: usize, v: bool, block: usize) -> usize {
    ((layer * 2 + v as usize) * format.num_blocks + block) * block_bytes
}

/// The backends' view of a chip's KV format.
pub fn kv_format(desc: &KvFormatDesc) -> KvFormat {
    KvFormat {
        num_layers: desc.num_layers,
        num_kv_heads: desc.num_kv_heads,
        head_dim: desc.head_dim,
        block_size: desc.block_size,
        layout: desc.layout,
        dtype: desc.dtype,
    }
}

/// The compatibility hash and the fields behind it, in the order a mismatch is named.
fn kv_compat(c: &tessera_backends::compat::CompatInfo) -> KvCompat {
    let fields = [
        ("architecture", c.arch.hf_name().to_string()),
        ("num_layers", c.num_layers.to_string()),
        ("num_heads", c.num_heads.to_string()),
        ("num_kv_heads", c.num_kv_heads.to_string()),
        ("head_dim", c.head_dim.to_string()),
        ("hidden_size", c.hidden_size.to_string()),
        ("intermediate_size", c.intermediate_size.to_string()),
        ("vocab_size", c.vocab_size.to_string()),
        ("rms_norm_eps", c.rms_norm_eps.to_string()),
        ("rope_theta", c.rope_theta.to_string()),
        ("rope_scaling", format!("{:?}", c.rope)),
        ("qkv_bias", c.qkv_bias.to_string()),
        ("weights_fingerprint", c.weights.map_or("-".into(), |w| format!("{w:016x}"))),
    ];
    KvCompat { hash: c.hash(), fields: fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect() }
}

/// The cost shape of `model` with a KV cache of `kv_dtype`, for the performance models.
pub fn model_shape(model: &Model, kv_dtype: DType) -> ModelShape {
    model.config().cost_shape(model.weight_bytes(), kv_dtype)
}

/// Roofline pacing of an emulated chip.
#[derive(Debug, Clone)]
pub struct Emulation {
    pub kind: ChipKind,
    pub spec: EmulationSpec,
    /// An instance's stages (their kinds, layers and tensor-parallel degrees), paced as
    /// a pipeline; empty for one chip.
    pub stages: Vec<(ChipKind, usize, usize)>,
}

/// How to bring up a model on a CPU-library (or plugin) device.
#[derive(Debug, Clone)]
pub struct ModelExecutorConfig {
    pub model_dir: PathBuf,
    /// None: the CPU kernel library built with Tessera.
    pub kernel_lib: Option<PathBuf>,
    pub threads: u32,
    pub memory_limit_bytes: Option<u64>,
    pub dtype: Option<DType>,
    pub kv_dtype: DType,
    pub kv_layout: KvLayout,
    /// Quantize float weights to this block format when loading.
    pub quantize: Option<Quantize>,
    /// A model instance across several devices (its stages, layers resolved); `None`:
    /// the whole model on this chip's device.
    pub parallel: Option<Vec<StageSpec>>,
    /// The arithmetic of prompts' linear layers.
    pub matmul_precision: MatmulPrecision,
    pub block_size: usize,
    pub max_batch_seqs: usize,
    /// The chip's id, for metrics and logs.
    pub chip_id: String,
    /// The process's KV transfer engine (None: this chip cannot take part in
    /// disaggregation).
    pub transfer: Option<Arc<TransferEngine>>,
    pub emulation: Option<Emulation>,
}

/// KV memory used when a chip has no memory limit.
const DEFAULT_KV_BYTES: u64 = 256 << 20;

/// What runs a chip's forward passes: a whole model on its device, or a model instance
/// across several (pipeline stages, tensor-parallel ranks; `tessera_backends::instance`).
// One per executor, made once and never moved on a hot path: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Engine {
    Whole { model: Model, kv: PagedKvCache },
    Sharded(ShardedModel),
}

impl Engine {
    fn config(&self) -> &ModelConfig {
        match self {
            Engine::Whole { model, .. } => model.config(),
            Engine::Sharded(m) => m.config(),
        }
    }

    fn weight_bytes(&self) -> u64 {
        match self {
            Engine::Whole { model, .. } => model.weight_bytes(),
            Engine::Sharded(m) => m.weight_bytes(),
        }
    }

    fn copy_blocks(&self, pairs: &[(u32, u32)]) -> tessera_backends::error::Result<()> {
        match self {
            Engine::Whole { model, kv } => kv.copy_blocks(model.device(), pairs),
            Engine::Sharded(m) => m.copy_blocks(pairs),
        }
    }

    fn write_tokens(&self, layer: usize, k: &[f32], v: &[f32], slots: &[i32]) -> tessera_backends::error::Result<()> {
        match self {
            Engine::Whole { model, kv } => kv.write_tokens(model.device(), layer, k, v, slots),
            Engine::Sharded(m) => m.write_tokens(layer, k, v, slots),
        }
    }
}

pub struct ModelExecutor {
    engine: Engine,
    samplers: HashMap<u64, SeqSampler>,
    /// The grammars of structured outputs, over the model's tokenizer: loaded when a
    /// sequence first asks for one.
    grammars: GrammarVocab,
    /// A logits row being masked.
    masked: Vec<f32>,
    chip_id: String,
    format: KvFormatDesc,
    transfer: Option<Arc<TransferEngine>>,
    /// Mirror of the cache that decode chips read (see the module doc).
    staging: Option<Region>,
    /// Where bytes read from another chip land before conversion; grown on demand.
    inbox: Option<Region>,
    emulation: Option<(Emulation, ModelShape)>,
    k_rows: Vec<f32>,
    v_rows: Vec<f32>,
    /// The logits row of each sampled token since `take_logits`, when kept.
    kept_logits: Option<Vec<(u64, Vec<f32>)>>,
    /// What decode chips were granted to read of `staging` (a secured cluster's).
    grants: StagingGrants,
}

/// The capabilities this chip (as P) granted, by request: its token, the blocks it
/// covers, when it was last granted. A block belongs to one request's capability at a
/// time: staging it for another takes it out of the first one's.
#[derive(Default)]
struct StagingGrants {
    by_request: HashMap<u64, (Option<Capability>, BTreeSet<u32>, Instant)>,
    owner: HashMap<u32, u64>,
}

/// One sequence's sampling on the worker.
struct SeqSampler {
    sampler: Sampler,
    /// How many top alternatives its tokens' log-probabilities list, when it asked.
    logprobs: Option<usize>,
    constraint: Option<Constraint>,
}

impl SeqSampler {
    /// Picks the next token from `row` (raw logits), within the grammar if it has one
    /// (`allowed`: its tokens, if computed already); `masked` is scratch space for the
    /// masked row.
    fn sample(&mut self, row: &[f32], allowed: Option<Allowed>, masked: &mut Vec<f32>) -> Result<u32, String> {
        let Some(constraint) = self.constraint.as_mut() else {
            return Ok(self.sampler.sample(row));
        };
        let allowed = match allowed {
            Some(allowed) => allowed,
            None => constraint.allowed().map_err(|e| e.to_string())?,
        };
        masked.clear();
        masked.extend_from_slice(row);
        constraint.apply(&allowed, masked);
        let token = self.sampler.sample(masked);
        constraint.advance(token).map_err(|e| e.to_string())?;
        let (seconds, _) = constraint.take_mask_time();
        metrics::histogram!("tessera_grammar_mask_seconds").record(seconds);
        Ok(token)
    }
}

/// Where a worker's grammars come from.
enum GrammarVocab {
    /// Not loaded yet: the tokenizer of this model directory (or GGUF file).
    From(PathBuf),
    Loaded(Arc<Grammars>),
    /// Loading failed, or the executor has no tokenizer: why.
    Unavailable(String),
}

impl GrammarVocab {
    fn get(&mut self) -> Result<Arc<Grammars>, String> {
        if let GrammarVocab::From(dir) = self {
            let loaded = TextTokenizer::from_dir(dir).and_then(|tok| Grammars::new(&tok));
            *self = match loaded {
                Ok(g) => GrammarVocab::Loaded(g),
                Err(e) => GrammarVocab::Unavailable(e.to_string()),
            };
        }
        match self {
            GrammarVocab::Loaded(g) => Ok(g.clone()),
            GrammarVocab::Unavailable(why) => Err(why.clone()),
            GrammarVocab::From(_) => Err("the grammars were not loaded".into()),
        }
    }
}

/// What a chip's executor is attached to beyond its model and cache.
struct Attachments {
    chip_id: String,
    /// The model's tokenizer, for structured outputs.
    tokenizer: Option<PathBuf>,
    transfer: Option<Arc<TransferEngine>>,
    emulation: Option<Emulation>,
}

impl ModelExecutorConfig {
    /// The instance this chip stands for, if it is one: its stages (each stage's layers
    /// and devices) over the model, with the chip's dtypes, KV format and batch limits.
    pub fn instance_spec(&self) -> Result<Option<InstanceSpec>, String> {
        let Some(stages) = &self.parallel else { return Ok(None) };
        let mc = ModelConfig::from_dir(&self.model_dir).map_err(|e| e.to_string())?;
        Ok(Some(InstanceSpec {
            model_dir: self.model_dir.clone(),
            options: LoadOptions { dtype: self.dtype, quantize: self.quantize },
            stages: stages.clone(),
            block_size: self.block_size,
            kv_dtype: self.kv_dtype,
            kv_layout: self.kv_layout,
            default_kv_bytes: DEFAULT_KV_BYTES,
            max_blocks: (self.max_batch_seqs * mc.max_context).div_ceil(self.block_size),
            collectives: Default::default(),
        }))
    }
}

impl ModelExecutor {
    /// Opens the device on the calling thread (the worker), loads the model and sizes
    /// the KV cache: what the memory limit leaves after the weights, or a default.
    pub fn load(config: &ModelExecutorConfig) -> Result<(ModelExecutor, ChipInfo), String> {
        let attach = Attachments {
            chip_id: config.chip_id.clone(),
            tokenizer: Some(config.model_dir.clone()),
            transfer: config.transfer.clone(),
            emulation: config.emulation.clone(),
        };
        if let Some(spec) = config.instance_spec()? {
            let sharded = ShardedModel::load(&spec).map_err(|e| e.to_string())?;
            return Self::build(Engine::Sharded(sharded), attach);
        }
        let lib = match &config.kernel_lib {
            Some(path) => KernelLibrary::load(path),
            None => KernelLibrary::load_default(),
        }
        .map_err(|e| e.to_string())?;
        let device_config = DeviceConfig {
            threads: config.threads,
            memory_limit_bytes: config.memory_limit_bytes.unwrap_or(0),
            matmul_precision: config.matmul_precision,
            ..Default::default()
        };
        let device = Device::open(&lib, &device_config).map_err(|e| e.to_string())?;
        let options = LoadOptions { dtype: config.dtype, quantize: config.quantize };
        let model = Model::load_with(&config.model_dir, device, options).map_err(|e| e.to_string())?;
        let mc = model.config().clone();
        let kv_bytes = match config.memory_limit_bytes {
            // Leave an eighth of what remains for step scratch buffers.
            Some(limit) => {
                let rest = limit.checked_sub(model.weight_bytes()).ok_or_else(|| {
                    format!(
                        "the memory limit ({limit} bytes) is smaller than the model's weights ({} bytes)",
                        model.weight_bytes()
                    )
                })?;
                rest - rest / 8
            }
            None => DEFAULT_KV_BYTES,
        };
        let most_useful = (config.max_batch_seqs * mc.max_context).div_ceil(config.block_size);
        let num_blocks =
            PagedKvCache::blocks_for_bytes(&mc, config.block_size, config.kv_dtype, kv_bytes).min(most_useful);
        if num_blocks == 0 {
            return Err(format!("no memory is left for even one KV block of {} tokens", config.block_size));
        }
        let kv = KvCacheConfig { block_size: config.block_size, num_blocks, dtype: config.kv_dtype };
        Self::build(Self::whole(model, kv, config.kv_layout)?, attach)
    }

    /// An executor over `model`, already loaded, with a head-major cache of `kv`: a chip
    /// of its own, with no transfer engine and no emulation (the local engine's).
    pub fn local(model: Model, kv: KvCacheConfig) -> Result<(ModelExecutor, ChipInfo), String> {
        let attach = Attachments { chip_id: "local".into(), tokenizer: None, transfer: None, emulation: None };
        Self::build(Self::whole(model, kv, KvLayout::HeadMajor)?, attach)
    }

    /// An executor over a model instance across several devices (each stage's KV on its
    /// own devices), with no transfer engine and no emulation: `tessera generate` over
    /// an instance, the model-parallelism tests.
    pub fn instance(spec: &InstanceSpec, chip_id: &str) -> Result<(ModelExecutor, ChipInfo), String> {
        let sharded = ShardedModel::load(spec).map_err(|e| e.to_string())?;
        let attach = Attachments {
            chip_id: chip_id.to_string(),
            tokenizer: Some(spec.model_dir.clone()),
            transfer: None,
            emulation: None,
        };
        Self::build(Engine::Sharded(sharded), attach)
    }

    fn whole(model: Model, kv_config: KvCacheConfig, kv_layout: KvLayout) -> Result<Engine, String> {
        let kv = PagedKvCache::with_layout(model.device(), model.shard_config(), kv_config, kv_layout)
            .map_err(|e| e.to_string())?;
        Ok(Engine::Whole { model, kv })
    }

    fn build(engine: Engine, attach: Attachments) -> Result<(ModelExecutor, ChipInfo), String> {
        let Attachments { chip_id, tokenizer, transfer, emulation } = attach;
        let mc = engine.config().clone();
        let (kv_config, kv_layout, block_bytes, compat) = match &engine {
            Engine::Whole { model, kv } => (*kv.config(), kv.layout(), kv.format().block_bytes(), model.compat_info()),
            Engine::Sharded(m) => {
                let format = KvFormat {
                    num_layers: mc.num_layers,
                    num_kv_heads: mc.num_kv_heads,
                    head_dim: mc.head_dim,
                    block_size: m.kv_config().block_size,
                    layout: m.kv_layout(),
                    dtype: m.kv_config().dtype,
                };
                (*m.kv_config(), m.kv_layout(), format.block_bytes(), m.compat_info())
            }
        };
        let KvCacheConfig { block_size, num_blocks, dtype: kv_dtype } = kv_config;
        let format = KvFormatDesc {
            num_layers: mc.num_layers,
            num_kv_heads: mc.num_kv_heads,
            head_dim: mc.head_dim,
            block_size,
            num_blocks,
            layout: kv_layout,
            dtype: kv_dtype,
        };
        let compat = kv_compat(&compat);
        let staging = match &transfer {
            Some(engine) => {
                let bytes = 2 * mc.num_layers * num_blocks * block_bytes;
                Some(engine.register(bytes).map_err(|e| format!("cannot register a KV staging region: {e}"))?)
            }
            None => None,
        };
        let emulation = emulation.map(|emu| {
            let shape = mc.cost_shape(engine.weight_bytes(), kv_dtype);
            let labels = [("chip", chip_id.clone()), ("kind", emu.kind.name.clone())];
            metrics::gauge!("tessera_emu_time_scale", &labels).set(emu.spec.time_scale);
            tracing::warn!(
                chip = %chip_id,
                kind = %emu.kind.name,
                time_scale = emu.spec.time_scale,
                compute_efficiency = emu.spec.compute_efficiency,
                memory_efficiency = emu.spec.memory_efficiency,
                "EMULATED chip: computes on the CPU, paced to the roofline of a {} ({} TFLOPS, {} GB/s), not real hardware",
                emu.kind.product,
                emu.kind.fp16_tflops,
                emu.kind.memory_bw_gbs
            );
            (emu, shape)
        });
        let info = ChipInfo {
            staging: match (&transfer, &staging) {
                (Some(engine), Some(region)) => Some(kv_region_desc(engine.describe(region))),
                _ => None,
            },
            emulated: emulation.as_ref().map(|(e, _)| format!("{} x{}", e.kind.name, e.spec.time_scale)),
            format: format.clone(),
            compat,
            num_blocks,
            block_size,
            max_context: mc.max_context,
            vocab_size: mc.vocab_size,
            eos_token_ids: mc.eos_token_ids.clone(),
        };
        let exec = ModelExecutor {
            engine,
            samplers: HashMap::new(),
            grammars: match tokenizer {
                Some(dir) => GrammarVocab::From(dir),
                None => GrammarVocab::Unavailable("this executor has no tokenizer".into()),
            },
            masked: Vec::new(),
            chip_id,
            format,
            transfer,
            staging,
            inbox: None,
            emulation,
            k_rows: Vec::new(),
            v_rows: Vec::new(),
            kept_logits: None,
            grants: StagingGrants::default(),
        };
        Ok((exec, info))
    }

    /// The model, when it is whole on this chip's device (not an instance across several).
    pub fn model(&self) -> Option<&Model> {
        match &self.engine {
            Engine::Whole { model, .. } => Some(model),
            Engine::Sharded(_) => None,
        }
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        self.engine.config()
    }

    /// An instance across several devices: where its steps' time went, and its stages.
    pub fn instance_timing(&self) -> Option<(StepTiming, usize)> {
        match &self.engine {
            Engine::Whole { .. } => None,
            Engine::Sharded(m) => Some((m.timing(), m.stages().len())),
        }
    }

    /// The cost shape of the model with this chip's KV cache, for the performance models.
    pub fn cost_shape(&self) -> ModelShape {
        self.engine.config().cost_shape(self.engine.weight_bytes(), self.format.dtype)
    }

    /// Keeps (from the next step on) the logits row each token is sampled from, for
    /// [`take_logits`](Self::take_logits); off by default.
    pub fn keep_logits(&mut self, keep: bool) {
        self.kept_logits = keep.then(Vec::new);
    }

    /// The (request id, logits row) of every token sampled since the last call, in
    /// sampling order, when keeping them.
    pub fn take_logits(&mut self) -> Vec<(u64, Vec<f32>)> {
        self.kept_logits.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Forgets every sampler (their sequences were dropped without a plan saying so).
    pub fn forget_samplers(&mut self) {
        self.samplers.clear();
    }

    /// The roofline time of `plan` on the emulated chip, if this chip emulates one.
    fn paced_time(&self, plan: &StepPlan) -> Option<Duration> {
        let (emu, shape) = self.emulation.as_ref()?;
        if !emu.stages.is_empty() {
            let stages: Vec<(&ChipKind, usize, usize)> = emu.stages.iter().map(|(k, l, t)| (k, *l, *t)).collect();
            return Some(Duration::from_secs_f64(emu.spec.instance_step_s(&stages, shape, &plan.shape())));
        }
        let r = emu.spec.roofline(&emu.kind, shape, &plan.shape());
        Some(Duration::from_secs_f64(r.time_s))
    }
}

impl Drop for ModelExecutor {
    fn drop(&mut self) {
        if let (Some(engine), Some(region)) = (&self.transfer, &self.staging) {
            engine.unregister(region);
        }
        if let (Some(engine), Some(region)) = (&self.transfer, &self.inbox) {
            engine.unregister(region);
        }
    }
}

impl ModelExecutor {
    /// On a secured cluster, grants each staged sequence's decode chip the blocks of the
    /// staging region its KV is in (every layer, K and V), and takes blocks staged for
    /// one sequence out of any other's grant: the capabilities to send with `KvStaged`.
    fn grant_staged(&mut self, plan: &StepPlan) -> Result<Vec<(u64, Capability)>, String> {
        let (Some(engine), Some(staging)) = (&self.transfer, &self.staging) else { return Ok(Vec::new()) };
        if !engine.config().require_capability() {
            return Ok(Vec::new());
        }
        let (bb, bs, layers) = (kv_format(&self.format).block_bytes(), self.format.block_size, self.format.num_layers);
        let format = &self.format;
        let ranges = |blocks: &BTreeSet<u32>| -> Vec<std::ops::Range<u64>> {
            let mut out = Vec::with_capacity(blocks.len() * layers * 2);
            for &b in blocks {
                for layer in 0..layers {
                    for v in [false, true] {
                        let at = staging_offset(format, bb, layer, v, b as usize) as u64;
                        out.push(at..at + bb as u64);
                    }
                }
            }
            out
        };
        let grants = &mut self.grants;
        let (now, ttl) = (Instant::now(), engine.config().capability_ttl);
        // Grants not renewed within their lifetime are gone from the engine already.
        let expired: Vec<u64> =
            grants.by_request.iter().filter(|(_, (_, _, at))| now.duration_since(*at) > ttl).map(|(r, _)| *r).collect();
        for request in expired {
            grants.by_request.remove(&request);
            grants.owner.retain(|_, owner| *owner != request);
        }
        let mut out = Vec::new();
        let mut losers = BTreeSet::new();
        for s in plan.seqs.iter().filter(|s| s.stage) {
            let end = (s.start_pos + s.tokens.len()).div_ceil(bs).min(s.block_table.len());
            for &b in &s.block_table[..end] {
                if let Some(previous) = grants.owner.insert(b, s.request_id)
                    && previous != s.request_id
                    && let Some((_, blocks, _)) = grants.by_request.get_mut(&previous)
                {
                    blocks.remove(&b);
                    losers.insert(previous);
                }
            }
            let entry = grants.by_request.entry(s.request_id).or_insert_with(|| (None, BTreeSet::new(), now));
            entry.1.extend(s.block_table[..end].iter().copied());
            let token = engine.grant(entry.0, staging, ranges(&entry.1)).map_err(|e| e.to_string())?;
            (entry.0, entry.2) = (Some(token), now);
            out.push((s.request_id, token));
        }
        for request in losers.difference(&out.iter().map(|(r, _)| *r).collect()) {
            let Some((Some(token), blocks, _)) = grants.by_request.get(request) else { continue };
            if blocks.is_empty() {
                engine.revoke(token);
                grants.by_request.remove(request);
            } else {
                engine.grant(Some(*token), staging, ranges(blocks)).map_err(|e| e.to_string())?;
            }
        }
        Ok(out)
    }
}

/// Copies model layer `layer`'s blocks (layer `kv_layer` of `kv`, which holds a stage's
/// layers) of the staged sequences of `plan` into `staging`. Each run of consecutive
/// blocks is borrowed from the region on its own, so a decode chip reading other blocks
/// of the region over tcp meanwhile is never refused as busy. A tensor-parallel rank's
/// cache holds its KV heads alone (`heads`): it writes those heads' part of each block.
#[allow(clippy::too_many_arguments)]
fn stage_layer(
    kv: &PagedKvCache,
    dev: &Device,
    staging: &Region,
    format: &KvFormatDesc,
    plan: &StepPlan,
    kv_layer: usize,
    layer: usize,
    heads: Option<std::ops::Range<usize>>,
) -> tessera_backends::error::Result<()> {
    let full = kv_format(format);
    let bb = full.block_bytes();
    let bs = format.block_size;
    let heads = heads.filter(|h| h.len() != format.num_kv_heads);
    let region_error = |e: tessera_runtime::transfer::TransferError| {
        tessera_backends::error::BackendError::KvCache(format!("staging region: {e}"))
    };
    let (mut k_part, mut v_part) = (Vec::new(), Vec::new());
    for s in plan.seqs.iter().filter(|s| s.stage) {
        let end = s.start_pos + s.tokens.len();
        let blocks = &s.block_table[s.stage_from.min(s.start_pos) / bs..end.div_ceil(bs)];
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            let (b0, len) = (blocks[i] as usize, (j - i) * bb);
            let k_at = staging_offset(format, bb, layer, false, b0);
            let v_at = staging_offset(format, bb, layer, true, b0);
            match &heads {
                None => staging
                    .with_mut(k_at, len, |k| {
                        staging
                            .with_mut(v_at, len, |v| kv.read_blocks(dev, kv_layer, &blocks[i..j], k, v))
                            .map_err(region_error)
                    })
                    .map_err(region_error)???,
                Some(heads) => {
                    let part = kv.format().block_bytes() * (j - i);
                    k_part.resize(part, 0);
                    v_part.resize(part, 0);
                    kv.read_blocks(dev, kv_layer, &blocks[i..j], &mut k_part, &mut v_part)?;
                    // Only this rank's bytes of each block are borrowed: the stage's other
                    // ranks write theirs into the same blocks meanwhile.
                    for (at, src) in [(k_at, &k_part), (v_at, &v_part)] {
                        for (offset, from) in head_parts(&full, heads, j - i) {
                            let bytes = &src[from.clone()];
                            staging
                                .with_mut(at + offset, bytes.len(), |dst| dst.copy_from_slice(bytes))
                                .map_err(region_error)?;
                        }
                    }
                }
            }
            i = j;
        }
    }
    Ok(())
}

/// Where `blocks` blocks holding KV heads `heads` alone (in `full`'s layout and dtype)
/// go in whole blocks of `full`'s format: (offset in the whole blocks, range of the
/// part), one piece per block (head-major) or per token (token-major).
fn head_parts(full: &KvFormat, heads: &std::ops::Range<usize>, blocks: usize) -> Vec<(usize, std::ops::Range<usize>)> {
    let es = full.dtype.size_bytes();
    let (bs, hd, nkv, nl) = (full.block_size, full.head_dim, full.num_kv_heads, heads.len());
    let (part_block, whole_block) = (nl * bs * hd * es, full.block_bytes());
    let mut out = Vec::new();
    for b in 0..blocks {
        let (whole, part) = (b * whole_block, b * part_block);
        match full.layout {
            KvLayout::HeadMajor => out.push((whole + heads.start * bs * hd * es, part..part + part_block)),
            KvLayout::TokenMajor => {
                let row = nl * hd * es;
                for t in 0..bs {
                    out.push((whole + (t * nkv + heads.start) * hd * es, part + t * row..part + (t + 1) * row));
                }
            }
        }
    }
    out
}

/// Whether a read failed only because the bytes were being written at that moment.
fn busy(e: &tessera_runtime::transfer::TransferError) -> bool {
    use tessera_runtime::transfer::{RemoteStatus, TransferError};
    matches!(e, TransferError::RangeBusy { .. } | TransferError::Refused { status: RemoteStatus::Busy, .. })
}

/// The sampler `new` describes, its grammar moved past the tokens it generated
/// elsewhere; or why its grammar cannot be had.
fn seq_sampler(new: &NewSampler, grammars: &mut GrammarVocab) -> Result<SeqSampler, String> {
    let constraint = match &new.spec.grammar {
        Some(g) => {
            let unavailable = |e: String| format!("structured output: {e}");
            let mut c = grammars.get().map_err(unavailable)?.compile(g.kind, &g.source).map_err(|e| e.to_string())?;
            c.replay(&new.output).map_err(|e| e.to_string())?;
            Some(c)
        }
        None => None,
    };
    Ok(SeqSampler { sampler: sampler(new), logprobs: new.spec.logprobs, constraint })
}

fn sampler(new: &NewSampler) -> Sampler {
    let spec = &new.spec;
    let penalties = Penalties {
        presence: spec.presence_penalty,
        frequency: spec.frequency_penalty,
        repetition: spec.repetition_penalty,
        logit_bias: spec.logit_bias.clone(),
        min_tokens: spec.min_tokens,
        suppress: spec.stop_token_ids.clone(),
    };
    let params = SamplingParams {
        temperature: spec.temperature,
        top_k: spec.top_k,
        top_p: spec.top_p,
        seed: spec.seed,
        max_tokens: 1,
        stop_token_ids: Vec::new(),
        ignore_eos: spec.ignore_eos,
        penalties,
    };
    let mut sampler = Sampler::with_history(params, &new.prompt, &new.output);
    sampler.skip(new.skip);
    sampler
}

impl StepExecutor for ModelExecutor {
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome {
        let started = Instant::now();
        let paced = self.paced_time(plan);
        for id in &plan.drop_samplers {
            self.samplers.remove(id);
        }
        let mut failed = Vec::new();
        let forks = plan.seqs.iter().flat_map(|s| s.forks.iter().map(|f| (f.request_id, Some(&f.new_sampler))));
        let news = plan.seqs.iter().map(|s| (s.request_id, s.new_sampler.as_deref())).chain(forks);
        for (id, new) in news {
            if let Some(new) = new {
                match seq_sampler(new, &mut self.grammars) {
                    Ok(sampler) => {
                        self.samplers.insert(id, sampler);
                    }
                    Err(why) => failed.push((id, why)),
                }
            }
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .seqs
            .iter()
            .map(|s| SeqChunk {
                tokens: &s.tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
                slots: &s.slots,
                logits: match (&s.score, s.sample) {
                    (Some(_), _) => LogitsWanted::All,
                    (None, true) => LogitsWanted::Last,
                    (None, false) => LogitsWanted::None,
                },
            })
            .collect();
        let mut outcome = StepOutcome {
            step,
            sampled: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            failed,
            error: None,
            elapsed_s: 0.0,
        };
        let layers = self.engine.config().num_layers;
        let stage = plan.seqs.iter().any(|s| s.stage);
        // Told to the chip when a group's last layer is staged.
        let mut groups = stage_groups(layers).peekable();
        if stage && self.staging.is_none() {
            outcome.error =
                Some("a sequence is prefilled for a decode chip but this chip has no staging region".into());
            return outcome;
        }
        let staged_seqs: Vec<(u64, usize)> =
            plan.seqs.iter().filter(|s| s.stage).map(|s| (s.request_id, s.start_pos + s.tokens.len())).collect();
        let capabilities = if stage {
            match self.grant_staged(plan) {
                Ok(caps) => caps,
                Err(e) => {
                    outcome.error = Some(format!("cannot grant the staged KV to its decode chip: {e}"));
                    return outcome;
                }
            }
        } else {
            Vec::new()
        };
        let (staging, format) = (self.staging.as_ref(), &self.format);
        // Host time the job was held back to post a layer at its model time, not computing.
        let mut held = Duration::ZERO;
        // Once layer `layer` is staged: the chip hears of each group's last layer.
        let mut staged = |layer: usize| -> tessera_backends::error::Result<()> {
            let Some(group) = groups.next_if(|g| g.end == layer + 1) else { return Ok(()) };
            // An emulated chip stages layer l at (l+1)/L of its step's model time.
            let due = match paced {
                Some(paced) => paced.mul_f64((layer + 1) as f64 / layers as f64),
                None => started.elapsed(),
            };
            let before = started.elapsed();
            let staged =
                Msg::KvStaged { step, layers: group, staged: staged_seqs.clone(), capabilities: capabilities.clone() };
            ctx.notify_at(due, staged);
            held += started.elapsed().saturating_sub(before);
            Ok(())
        };
        // The grammars' masks of this step's samples, on a second thread while the
        // forward pass runs (they depend on the tokens before, not on the logits).
        let constrained: Vec<u64> = plan
            .seqs
            .iter()
            .flat_map(PlannedSeq::samplers)
            .filter(|id| self.samplers.get(id).is_some_and(|x| x.constraint.is_some()))
            .collect();
        let samplers = &mut self.samplers;
        let (forward, mut masks) = std::thread::scope(|scope| {
            let masker = (!constrained.is_empty()).then(|| {
                scope.spawn(|| {
                    let mut masks = HashMap::new();
                    for id in &constrained {
                        if let Some(c) = samplers.get_mut(id).and_then(|s| s.constraint.as_mut()) {
                            masks.insert(*id, c.allowed().map_err(|e| e.to_string()));
                        }
                    }
                    masks
                })
            });
            let forward = match (&mut self.engine, staging) {
                (Engine::Whole { model, kv }, Some(staging)) if stage => {
                    let mut on_layer = |layer: usize, dev: &Device| {
                        stage_layer(kv, dev, staging, format, plan, layer, layer, None)?;
                        staged(layer)
                    };
                    model.forward_observed(kv, &chunks, &mut on_layer)
                }
                (Engine::Whole { model, kv }, _) => model.forward_observed(kv, &chunks, &mut |_, _| Ok(())),
                (Engine::Sharded(m), Some(staging)) if stage => {
                    // Each stage's worker stages its own layers, straight from its cache.
                    let (staging, format, plan) = (staging.clone(), format.clone(), plan.clone());
                    let hook: Arc<LayerHook> = Arc::new(move |layer, local, heads, dev: &Device, kv: &PagedKvCache| {
                        stage_layer(kv, dev, &staging, &format, &plan, local, layer, Some(heads))
                    });
                    m.forward_observed(&chunks, Some(hook), &mut staged)
                }
                (Engine::Sharded(m), _) => m.forward(&chunks),
            };
            // A panic in the masker leaves the masks to be computed when sampling.
            (forward, masker.and_then(|h| h.join().ok()).unwrap_or_default())
        });
        // Forks' copies of their parent's partial last block, now that it is written.
        let forward = forward.and_then(|logits| {
            self.engine.copy_blocks(&plan.copies)?;
            Ok(logits)
        });
        match forward {
            Ok(logits) => {
                let vocab = self.engine.config().vocab_size;
                let mut any_logprobs = false;
                let mut rows = logits.chunks_exact(vocab);
                for s in &plan.seqs {
                    // A scored chunk has a row per token: its prompt targets' first, the
                    // sampling row last.
                    if let Some(score) = &s.score {
                        let scored = rows.by_ref().take(score.targets.len());
                        let logprobs: Vec<TokenLogprob> = scored
                            .zip(&score.targets)
                            .map(|(row, &token)| {
                                let (logprob, top) = tessera_backends::sampling::logprobs(row, token, score.k);
                                TokenLogprob { token, logprob, top }
                            })
                            .collect();
                        for &(id, req) in &score.forks {
                            outcome.prompt_logprobs.push((id, req, s.start_pos + 1, logprobs.clone()));
                        }
                        outcome.prompt_logprobs.push((s.request_id, score.req, s.start_pos + 1, logprobs));
                        let rest = s.tokens.len() - score.targets.len();
                        let skip = rest.saturating_sub(usize::from(s.sample));
                        rows.by_ref().take(skip).for_each(drop);
                    }
                    if !s.sample {
                        continue;
                    }
                    let Some(row) = rows.next() else { break };
                    // The sequence, then its forks: each with its own sampler, one row.
                    for id in s.samplers() {
                        if outcome.failed.iter().any(|(failed, _)| *failed == id) {
                            continue;
                        }
                        let allowed = match masks.remove(&id) {
                            Some(Err(why)) => {
                                self.samplers.remove(&id);
                                outcome.failed.push((id, why));
                                continue;
                            }
                            Some(Ok(allowed)) => Some(allowed),
                            None => None,
                        };
                        let (token, k) = match self.samplers.get_mut(&id) {
                            Some(sampler) => match sampler.sample(row, allowed, &mut self.masked) {
                                Ok(token) => (token, sampler.logprobs),
                                Err(why) => {
                                    self.samplers.remove(&id);
                                    outcome.failed.push((id, why));
                                    continue;
                                }
                            },
                            None => (tessera_backends::sampling::argmax(row), None),
                        };
                        outcome.sampled.push((id, token));
                        let logprob = k.map(|k| {
                            let (logprob, top) = tessera_backends::sampling::logprobs(row, token, k);
                            TokenLogprob { token, logprob, top }
                        });
                        any_logprobs |= logprob.is_some();
                        outcome.logprobs.push(logprob);
                        if let Some(kept) = self.kept_logits.as_mut() {
                            kept.push((id, row.to_vec()));
                        }
                    }
                }
                if !any_logprobs {
                    outcome.logprobs.clear(); // none asked: nothing to carry
                }
            }
            Err(e) => outcome.error = Some(e.to_string()),
        }
        let computed = started.elapsed().saturating_sub(held);
        outcome.elapsed_s = computed.as_secs_f64();
        if let Some(paced) = paced {
            // The host completes the step at its model time; this step took the longer.
            ctx.elapse(paced);
            outcome.elapsed_s = paced.max(computed).as_secs_f64();
            if computed > paced {
                // The CPU, not the emulated chip, set this step's time.
                metrics::counter!("tessera_emu_overrun_total", "chip" => self.chip_id.clone()).increment(1);
            }
            metrics::histogram!("tessera_emu_step_paced_seconds", "chip" => self.chip_id.clone())
                .record(paced.as_secs_f64());
            metrics::histogram!("tessera_emu_step_compute_seconds", "chip" => self.chip_id.clone())
                .record(computed.as_secs_f64());
        }
        outcome
    }

    // The read itself takes the time: nothing to declare.
    fn install(&mut self, job: &KvInstall, _ctx: &mut dyn JobCtx<Msg>) -> Result<(), String> {
        let engine = self.transfer.as_ref().ok_or("this chip has no KV transfer engine")?;
        let src = kv_format(&job.format);
        let bb = src.block_bytes();
        let n = job.src_blocks().len();
        if job.dst_slots().len() != job.positions.len() {
            return Err(format!("the hand-off's {} slots do not cover positions {:?}", job.slots.len(), job.positions));
        }
        if job.layers.is_empty() || job.layers.end > job.format.num_layers {
            return Err(format!("layers {:?} of a {}-layer model", job.layers, job.format.num_layers));
        }
        // One layer at a time, through an inbox of one layer's K and V blocks: a group of
        // layers needs no more memory than one.
        let need = 2 * n * bb;
        if self.inbox.as_ref().is_none_or(|r| r.len() < need) {
            if let Some(old) = self.inbox.take() {
                engine.unregister(&old);
            }
            let region = engine.register(need.next_power_of_two()).map_err(|e| e.to_string())?;
            self.inbox = Some(region);
        }
        let Some(inbox) = self.inbox.as_ref() else { return Err("no inbox region".into()) };
        let mut remote = region_desc(&job.region);
        remote.capability = job.capability;
        for layer in job.layers.clone() {
            // K blocks to inbox[0..n), V blocks to inbox[n..2n); runs of consecutive
            // source blocks become one assignment.
            let mut batch: Vec<Assignment> = Vec::new();
            for (v, base) in [(false, 0), (true, n * bb)] {
                for (i, &b) in job.src_blocks().iter().enumerate() {
                    if b as usize >= job.format.num_blocks {
                        return Err(format!("block {b} is outside the source pool of {}", job.format.num_blocks));
                    }
                    let src_offset = staging_offset(&job.format, bb, layer, v, b as usize) as u64;
                    let dst_offset = (base + i * bb) as u64;
                    match batch.last_mut() {
                        Some(a) if a.src_offset + a.len == src_offset && a.dst_offset + a.len == dst_offset => {
                            a.len += bb as u64
                        }
                        _ => batch.push(Assignment { src_offset, dst_offset, len: bb as u64 }),
                    }
                }
            }
            // A block being re-staged (a later chunk filling it) is busy for microseconds.
            let mut tries = 0;
            while let Err(e) = engine.read(&remote, inbox, &batch) {
                tries += 1;
                if !busy(&e) || tries >= 200 {
                    return Err(e.to_string());
                }
                std::thread::sleep(Duration::from_micros(250));
            }
            self.k_rows.clear();
            self.v_rows.clear();
            let (k_rows, v_rows) = (&mut self.k_rows, &mut self.v_rows);
            inbox
                .with_ref(0, need, |buf| {
                    let (k, v) = buf.split_at(n * bb);
                    decode_tokens(&src, k, job.first_pos, job.positions.clone(), k_rows)?;
                    decode_tokens(&src, v, job.first_pos, job.positions.clone(), v_rows)
                })
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            self.engine.write_tokens(layer, &self.k_rows, &self.v_rows, job.dst_slots()).map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The behaviors' descriptor and the engine's are one wire shape: a region described by
    /// either side reads the same on the bus, and converting there and back loses nothing.
    #[test]
    fn region_descriptors_convert_losslessly_and_serialize_alike() {
        let engine = RegionDesc {
            endpoint: EndpointDesc { host_key: "boot:host".into(), pid: 41, tcp: "127.0.0.1:7000".parse().unwrap() },
            region: 3,
            fd: 9,
            len: 1 << 20,
            capability: None,
        };
        let kv = kv_region_desc(engine.clone());
        assert_eq!(region_desc(&kv), engine);
        assert_eq!(serde_json::to_string(&kv).unwrap(), serde_json::to_string(&engine).unwrap());
    }
}
