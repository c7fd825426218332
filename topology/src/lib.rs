//! Tessera's cluster description: the topology TOML schema, its validation into a
//! [`ClusterSpec`], the embedded default topology, the catalog of chip kinds a
//! topology may name, and the roofline perf model ([`perf`]) that paces emulated chips
//! and feeds the planner. Every error points at the file, line, column and dotted key
//! that is wrong. This crate only describes a cluster; it starts nothing and depends on
//! no other tessera crate but the shared vocabulary (`tessera-vocab`: roles, KV layouts,
//! dtypes, transports) — not on actors, the bus or the kernels — so every other crate
//! can read a topology. Beyond reading the file, [`load`] only asks the OS whether the
//! paths of the hosts that run on this machine exist (and which hosts those are).
#![forbid(unsafe_code)]

pub mod catalog;
pub mod parallel;
/// The performance models (`tessera-perf`), which chip kinds and pacing feed.
pub use tessera_perf as perf;
mod error;
#[cfg(test)]
mod fuzz_tests;
mod local;
pub mod reference;
mod render;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use catalog::{ChipKind, Confidence};
pub use error::TopologyError;

/// Whether `name` may name a host, chip or tenant: not empty, ASCII letters, digits,
/// '-', '_' and '.' only.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    match name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        Some(bad) => Err(format!("`{name}` contains {bad:?}; use ASCII letters, digits, '-', '_' and '.'")),
        None => Ok(()),
    }
}
pub use tessera_vocab::{
    Cipher, DType, DecodeOverflow, Endpoint, HostAddr, KvLayout, MatmulPrecision, PriorityClass, Quantize,
    ResolveError, Role, RouterPolicy, SecurityMode, TransportChoice, UnknownName,
};

/// The embedded default topology: on localhost, host `h0` with an emulated Ascend 910B
/// that prefills and host `h1` with an emulated MetaX C500 that decodes, their KV
/// caches in different block sizes and layouts. It doubles as the documented example
/// of the schema.
pub const DEFAULT_TOML: &str = include_str!("../default.toml");

/// The name [`default_topology`] gives as the source of the embedded file.
pub const DEFAULT_SOURCE: &str = "<embedded default topology>";

/// The builtin test models `cluster.model` may name instead of a checkpoint directory.
pub const BUILTIN_MODELS: &[&str] = &["builtin:tiny", "builtin:small", "builtin:bench"];

/// A validated cluster description.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSpec {
    /// Where the spec was read from (a path, or [`DEFAULT_SOURCE`]).
    pub source: String,
    pub name: String,
    /// One of [`BUILTIN_MODELS`], or a checkpoint directory. [`load`] resolves a relative
    /// directory against the topology file's directory; [`parse`] leaves it as written.
    pub model: String,
    /// Weights dtype override; `None` keeps the checkpoint's.
    pub dtype: Option<DType>,
    /// KV cache dtype, the default of every chip's [`ChipSpec::kv_dtype`] (default f16).
    pub kv_dtype: DType,
    /// KV block size in tokens, the default of every chip's [`ChipSpec::block_size`]
    /// (default 16, 1..=4096).
    pub block_size: usize,
    /// Chip kinds the file adds to the built-in [`catalog`] (`[[chip_kinds]]`), in file
    /// order. Their names never shadow a built-in kind.
    pub chip_kinds: Vec<ChipKind>,
    pub hosts: Vec<HostSpec>,
    pub router: RouterSpec,
    pub supervisor: SupervisorSpec,
    pub gateway: GatewaySpec,
    pub bus: BusSpec,
    pub security: SecuritySpec,
    pub emulation: EmulationSpec,
    pub disagg: DisaggSpec,
    pub solver: SolverSpec,
    /// Who shares the cluster (`[[tenants]]`), in file order. Empty: one open tenant,
    /// [`OPEN_TENANT`], with no limits and no key needed (unless `gateway.keys_file` is set).
    pub tenants: Vec<TenantSpec>,
}

/// The tenant of a cluster without `[[tenants]]`.
pub const OPEN_TENANT: &str = "default";

/// One tenant of a shared cluster: its share, class and limits. Its API keys are in the
/// keys file (`gateway.keys_file`), each naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantSpec {
    pub name: String,
    /// Its share of the cluster when tenants compete (default 1, 1..=1000).
    pub weight: u32,
    pub priority: PriorityClass,
    /// The served model names its keys may ask for; `None`: any.
    pub models: Option<Vec<String>>,
    /// Its prompts may reuse cached blocks of other tenants that share too (default
    /// false: its prefix cache is its own, so no tenant can time another's prompts).
    pub share_prefix_cache: bool,
    pub limits: TenantLimits,
}

/// A tenant's quotas over the whole cluster (`[tenants.limits]`); `None`: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantLimits {
    /// Requests admitted in any 60 s (a request with `n` sequences counts `n`).
    pub requests_per_min: Option<u64>,
    /// Prompt plus output tokens in any 60 s; a request reserves its prompt and its
    /// `max_tokens` when admitted, and what it did not use is given back when it ends.
    pub tokens_per_min: Option<u64>,
    /// Sequences in flight at once.
    pub max_concurrent: Option<usize>,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens: Option<usize>,
}

/// One host (one process of the runtime) and the chips it drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    pub name: String,
    /// The host's ZeroMQ ROUTER socket. Its host part (an IP address or a DNS name) is
    /// the host's for every socket that defaults next to it.
    pub bus: Endpoint,
    /// The host's ZeroMQ PUB socket (default: the bus port + 1).
    pub events: Endpoint,
    /// The host's KV transfer listener (default: the bus port + 2).
    pub transfer: Endpoint,
    /// The host's stage server (default: the bus port + 3): set where the host holds a
    /// pipeline stage of an instance that runs on another host, else `None`.
    pub stages: Option<Endpoint>,
    /// The host's public key (X25519, 32 bytes), when the topology lists it inline
    /// (`public_key`, hex) rather than in `security.keys_dir`.
    pub public_key: Option<[u8; 32]>,
    pub chips: Vec<ChipSpec>,
}

/// One chip of a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChipSpec {
    /// Unique across the cluster.
    pub id: String,
    /// A built-in [`catalog`] kind or one of [`ClusterSpec::chip_kinds`]; find its
    /// figures with [`ClusterSpec::chip_kind`]. For an [`Backend::Emu`] chip it is the
    /// emulated kind.
    pub kind: String,
    pub backend: Backend,
    pub role: Role,
    /// 1 byte..=1 PiB when set.
    pub memory_limit_bytes: Option<u64>,
    /// Worker threads (default 1, 1..=1024).
    pub threads: usize,
    /// Most tokens in one batch (default 512, 1..=1_048_576).
    pub max_batch_tokens: usize,
    /// Most sequences in one batch (default 64, 1..=65_536).
    pub max_batch_seqs: usize,
    /// Stall-free batching: a step that carries decode tokens is planned to take at most
    /// this many milliseconds (1..=3_600_000), the prompt chunks in it cut to fit at the
    /// chip's observed pace, so prompts arriving do not stretch the running streams'
    /// time per token (`None`, the default: the token budget alone decides).
    pub max_mixed_step_ms: Option<u64>,
    /// KV block size in tokens (default: [`ClusterSpec::block_size`]).
    pub block_size: usize,
    /// KV cache dtype (default: [`ClusterSpec::kv_dtype`]).
    pub kv_dtype: DType,
    /// How the chip lays out a KV block (default head-major).
    pub kv_layout: KvLayout,
    /// The block format the chip quantizes float weights to when it loads them (`None`:
    /// as stored). Chips that exchange KV must load the same weights, so every
    /// prefill and decode chip of a file agrees on it.
    pub quantize: Option<Quantize>,
    /// The arithmetic of the chip's linear layers on prompts (default f32; `bf16`
    /// needs a chip with bf16 dot products).
    pub matmul_precision: MatmulPrecision,
    /// A model instance across several chips (`[[instances]]`): this chip stands for
    /// them in the cluster (router, supervisor, metrics), and its fields are the
    /// instance's (its kind and backend its first chip's, its memory and threads the
    /// chips' sums). `None`: one chip holding the whole model.
    pub parallel: Option<ParallelSpec>,
}

/// A model instance across chips: pipeline stages in order, each of `tp` like chips of
/// one host (tensor parallel), each stage holding a contiguous range of layers. The
/// instance runs on its first stage's host; a stage on another host is served there by
/// that host's stage server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelSpec {
    /// Chips per stage (1..=64).
    pub tp: usize,
    /// Layers of each stage, in order; `None` (`split = "auto"`): sized to each
    /// stage's speed and memory once the model is known.
    pub split: Option<Vec<usize>>,
    /// The member chips, stage-major: stage `s` is `chips[s * tp..(s + 1) * tp]`.
    pub chips: Vec<ChipSpec>,
    /// The host of each stage's chips, by name.
    pub stage_hosts: Vec<String>,
}

impl ChipSpec {
    /// The chip an instance of `par`'s chips stands for, as `[[instances]]` folds them:
    /// the first chip's settings, the chips' memory and threads together.
    pub fn instance(id: String, role: Role, par: ParallelSpec) -> ChipSpec {
        let first = par.chips[0].clone();
        ChipSpec {
            id,
            role,
            memory_limit_bytes: par.chips.iter().map(|c| c.memory_limit_bytes).sum::<Option<u64>>(),
            threads: par.chips.iter().map(|c| c.threads).sum(),
            parallel: Some(par),
            ..first
        }
    }
}

impl ParallelSpec {
    /// Pipeline stages.
    pub fn stages(&self) -> usize {
        self.chips.len() / self.tp.max(1)
    }

    /// The chips of stage `s`.
    pub fn stage(&self, s: usize) -> &[ChipSpec] {
        &self.chips[s * self.tp..(s + 1) * self.tp]
    }
}

/// Which kernels run a chip.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The reference CPU kernel library.
    Cpu,
    /// The reference CPU kernel library computing for real, with each step's completion
    /// paced to what the [`perf`] model predicts for this chip kind (`emu:KIND`), scaled
    /// by [`EmulationSpec::time_scale`]. The kind resolves with [`ClusterSpec::chip_kind`].
    Emu(String),
    /// A kernel library loaded from this path (resolved by [`load`] against the
    /// topology file's directory when written relative).
    Plugin(PathBuf),
}

impl Backend {
    /// The emulated chip kind of an [`Backend::Emu`] backend.
    pub fn emulated_kind(&self) -> Option<&str> {
        match self {
            Backend::Emu(kind) => Some(kind),
            Backend::Cpu | Backend::Plugin(_) => None,
        }
    }
}

/// As the topology file writes it: `cpu`, `emu:KIND`, `plugin:PATH`.
impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Cpu => f.write_str("cpu"),
            Backend::Emu(kind) => write!(f, "emu:{kind}"),
            Backend::Plugin(path) => write!(f, "plugin:{}", path.display()),
        }
    }
}

/// How emulated chips ([`Backend::Emu`]) are paced; `[emulation]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EmulationSpec {
    /// Modeled step time is multiplied by this (0 < x <= 1e6, default 1.0), so that a
    /// tiny model computed on a CPU takes as long as a big model would on the real chip.
    /// Validation also bounds it with each emulated kind's figures: the
    /// [`perf::reference_step`] must be paced under [`perf::MAX_STEP_S`].
    pub time_scale: f64,
    /// Fraction of peak FLOPS a step achieves (MFU), 0.01 <= x <= 1 (default 0.5).
    pub compute_efficiency: f64,
    /// Fraction of peak memory bandwidth a step achieves (MBU), 0.01 <= x <= 1 (default 0.8).
    pub memory_efficiency: f64,
    /// Calibrated performance models by chip kind (`[emulation.perf_models]`, files
    /// `tessera calibrate --out` writes): chips of these kinds are paced by them instead
    /// of the flat efficiencies above. A host loads only those its own chips need.
    pub perf_models: BTreeMap<String, perf::PerfModel>,
}

impl EmulationSpec {
    /// The efficiencies as a flat performance model (no curves, no overhead).
    pub fn perf_model(&self) -> perf::PerfModel {
        perf::PerfModel::flat(self.compute_efficiency, self.memory_efficiency)
    }

    /// How chips of `kind` are paced: its calibrated model, else [`Self::perf_model`].
    pub fn perf_model_of(&self, kind: &str) -> perf::PerfModel {
        self.perf_models.get(kind).copied().unwrap_or_else(|| self.perf_model())
    }

    /// How an emulated `kind` chip paces `step` of `model`: its roofline under its
    /// performance model, times `time_scale`.
    pub fn roofline(&self, kind: &ChipKind, model: &perf::ModelShape, step: &perf::StepShape) -> perf::Roofline {
        perf::roofline(kind.roof(), model, step, &self.perf_model_of(&kind.name), self.time_scale)
    }

    /// How an emulated instance paces `step` of `model`: its stages (a chip kind, its
    /// layers and tensor-parallel degree each) pipelined over one micro-batch per stage
    /// ([`perf::parallel::pipeline_step_s`]), times `time_scale`. Activations and
    /// all-reduces cross each kind's chip-to-chip link.
    pub fn instance_step_s(
        &self,
        stages: &[(&ChipKind, usize, usize)],
        model: &perf::ModelShape,
        step: &perf::StepShape,
    ) -> f64 {
        let stages: Vec<perf::parallel::Stage> = stages
            .iter()
            .map(|(kind, layers, tp)| perf::parallel::Stage {
                roof: kind.roof(),
                perf: self.perf_model_of(&kind.name),
                layers: *layers,
                tp: *tp,
                link: kind.chip_link(),
            })
            .collect();
        let s = perf::parallel::instance_step_s(model, &stages, step) * self.time_scale;
        s.min(perf::MAX_STEP_S)
    }

    /// [`perf::reference_step`] on an emulated `kind` chip.
    pub fn reference_step(&self, kind: &ChipKind) -> perf::Roofline {
        perf::reference_step(kind.roof(), &self.perf_model_of(&kind.name), self.time_scale)
    }
}

impl Default for EmulationSpec {
    fn default() -> Self {
        EmulationSpec { time_scale: 1.0, compute_efficiency: 0.5, memory_efficiency: 0.8, perf_models: BTreeMap::new() }
    }
}

/// A performance model file, as `tessera calibrate --out` writes it, read and checked;
/// the error names the file.
pub fn read_perf_model(path: &Path) -> Result<perf::PerfModel, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read performance model {}: {e}", path.display()))?;
    let model: perf::PerfModel =
        toml::from_str(&text).map_err(|e| format!("{}: not a performance model: {}", path.display(), e.message()))?;
    model.check().map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(model)
}

/// Prefill/decode disaggregation; `[disagg]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisaggSpec {
    /// Prompts shorter than this run entirely on a decode chip (conditional
    /// disaggregation: moving their KV would cost more than computing it);
    /// 2..=16_777_216, default 32.
    pub min_prompt_tokens: usize,
    /// KV a prefill chip holds for a decode chip is freed if the decode chip has not
    /// claimed it within this long (1..=86_400_000, default 5000), so a dead decode chip
    /// leaks no blocks.
    pub lease_ms: u64,
    /// How KV blocks travel between chips. TOML: `"auto"` (default), `"shm"`, `"tcp"`.
    pub transport: TransportChoice,
    /// Parallel TCP streams per transfer, 1..=64 (default 4).
    pub tcp_streams: usize,
    /// Bytes sent per chunk of a transfer, in KiB, 1..=65536 (default 1024).
    pub chunk_kib: usize,
}

impl DisaggSpec {
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_kib * 1024
    }
}

impl Default for DisaggSpec {
    fn default() -> Self {
        DisaggSpec {
            min_prompt_tokens: 32,
            lease_ms: 5000,
            transport: TransportChoice::Auto,
            tcp_streams: 4,
            chunk_kib: 1024,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterSpec {
    pub policy: RouterPolicy,
    /// Requests placed on chips and not finished before new ones wait in the router's
    /// queue (default 256, 1..=1_048_576).
    pub max_queued_requests: usize,
    /// A chip whose KV pool is this full (percent of its blocks held by running
    /// requests) takes no new requests (default 90, 1..=100).
    pub kv_breaker_percent: u32,
    /// A chip whose queued prompts (placed, not yet computed) would take this long at
    /// its pace takes no new requests: the rest wait in the router's queue, where
    /// priority and fair order apply across the cluster (default 500, 1..=3_600_000).
    pub max_queued_prompt_ms: u64,
    /// Requests that may wait for a chip; further ones are refused with 429 at once
    /// (default 256, 0..=1_048_576).
    pub max_waiting_requests: usize,
    /// How long a request waits for a chip before a 429 with `Retry-After` (default
    /// 5000, 1..=86_400_000).
    pub queue_timeout_ms: u64,
    /// Where a request goes when every decoding chip is full (default
    /// `prefill-chips`; see [`DecodeOverflow`]).
    pub decode_overflow: DecodeOverflow,
}

impl Default for RouterSpec {
    fn default() -> Self {
        RouterSpec {
            policy: RouterPolicy::default(),
            max_queued_requests: 256,
            kv_breaker_percent: 90,
            max_queued_prompt_ms: 500,
            max_waiting_requests: 256,
            queue_timeout_ms: 5000,
            decode_overflow: DecodeOverflow::default(),
        }
    }
}

/// The solver actor on the gateway's host (`[solver]`): what it optimises, how often it
/// re-solves, and whether it applies its choice itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SolverSpec {
    /// Run the solver at all (default true).
    pub enabled: bool,
    /// Apply the best strategy for `objective` without an operator (default false:
    /// strategies are published, and `tessera plan apply` applies one).
    pub auto: bool,
    /// What `auto` and the published set's first row maximise (default goodput per $).
    pub objective: SolverObjective,
    /// The SLOs goodput counts against, at p90 (defaults 2000 and 200 ms).
    pub ttft_ms: u64,
    pub tpot_ms: u64,
    /// Re-solve at least this often while traffic flows (default 60, 1..=86_400 s).
    pub period_s: u64,
    /// How often admission publishes telemetry (default 5000 ms).
    pub telemetry_interval_ms: u64,
    /// Re-solve at once when the arrival rate moves this much (default 20, 1..=1000 %).
    pub rate_change_percent: u32,
    /// In `auto`, a new strategy replaces the applied one only when it scores this much
    /// better on the objective (default 10, 0..=1000 %)...
    pub min_gain_percent: u32,
    /// ... and the applied one has run this long (default 120, 0..=86_400 s), unless it
    /// lost a chip.
    pub dwell_s: u64,
}

impl Default for SolverSpec {
    fn default() -> Self {
        SolverSpec {
            enabled: true,
            auto: false,
            objective: SolverObjective::GoodputPerUsd,
            ttft_ms: 2000,
            tpot_ms: 200,
            period_s: 60,
            telemetry_interval_ms: 5000,
            rate_change_percent: 20,
            min_gain_percent: 10,
            dwell_s: 120,
        }
    }
}

/// The figure the solver ranks strategies by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SolverObjective {
    /// Requests within the SLOs per dollar.
    #[default]
    GoodputPerUsd,
    /// Requests per second within the SLOs, whatever they cost.
    Goodput,
}

impl SolverObjective {
    pub const NAMES: &[&str] = &["goodput_per_usd", "goodput"];

    pub fn as_str(self) -> &'static str {
        match self {
            SolverObjective::GoodputPerUsd => "goodput_per_usd",
            SolverObjective::Goodput => "goodput",
        }
    }
}

impl std::fmt::Display for SolverObjective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SolverObjective {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "goodput_per_usd" => Ok(SolverObjective::GoodputPerUsd),
            "goodput" => Ok(SolverObjective::Goodput),
            _ => Err(UnknownName::new("solver objective", s, Self::NAMES)),
        }
    }
}

/// Every duration here is at most one day, so that it is a `Duration` that an
/// `Instant` can be advanced by (and the 32-fold restart backoff, too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SupervisorSpec {
    /// Default 100, 1..=86_400_000.
    pub heartbeat_interval_ms: u64,
    /// Default 1000, 1..=86_400_000; always greater than the interval.
    pub heartbeat_timeout_ms: u64,
    /// Restarts allowed within `restart_window_s` before giving up (default 3, 0..=10_000).
    pub max_restarts: u32,
    /// Default 60, 1..=86_400.
    pub restart_window_s: u64,
    /// Default 200, 0..=86_400_000.
    pub restart_backoff_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySpec {
    /// The host that runs the HTTP gateway (default: the first host); names a host.
    pub host: String,
    /// Default 127.0.0.1:8000.
    pub listen: SocketAddr,
    /// The model name clients send; `None`: derived from `cluster.model` by the gateway.
    pub served_model_name: Option<String>,
    /// Default 256, 1..=1_048_576.
    pub max_inflight_requests: usize,
    /// Open client connections at most (default 1024, 1..=65_536).
    pub max_connections: usize,
    /// How long a client may take to send a request's headers (default 10_000,
    /// 100..=600_000).
    pub header_read_timeout_ms: u64,
    /// Largest prompt accepted, in bytes (1..=1 GiB); `None`: derived from the model by
    /// the gateway.
    pub max_prompt_bytes: Option<usize>,
    /// The API keys file (`tessera keys add`), resolved against the topology's directory.
    /// Set: every `/v1/*` request needs a key, and `/admin/*` an operator's or admin's.
    /// `None`: `/v1/*` is open (no `[[tenants]]` allowed) and `tessera up` makes an admin
    /// token for `/admin/*`.
    pub keys_file: Option<PathBuf>,
    /// The audit log; `None`: `audit.log` beside the keys file, or under `$TESSERA_HOME`
    /// without one.
    pub audit_log: Option<PathBuf>,
}

/// The host-to-host message bus; `[bus]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusSpec {
    /// Largest frame a host accepts from another (default 16 MiB, 4 KiB..=1 GiB).
    pub max_frame_bytes: usize,
    /// How long a connecting host may take to complete its handshake (default 5000,
    /// 100..=600_000).
    pub handshake_timeout_ms: u64,
    /// How long a starting host keeps retrying a host name that does not resolve (its
    /// own or a peer's) before it gives up with an error (default 60000, 0..=3_600_000):
    /// pods that start together publish their DNS names a few seconds apart.
    pub resolve_timeout_ms: u64,
}

/// How the planes between hosts are secured; `[security]`. See
/// docs/how-to/secure-cluster.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecuritySpec {
    /// Default: `off` when every host address is loopback, else `encrypt`.
    pub mode: SecurityMode,
    pub cipher: Cipher,
    /// Where each host finds its own private key (`<host>.key`) and the hosts' public
    /// keys (`<host>.pub`, unless listed inline); required unless `mode` is `off`.
    pub keys_dir: Option<PathBuf>,
    /// The key (64 hex digits, owner-only file) that seals the keys file and the audit
    /// log at rest; `None`: `TESSERA_AT_REST_KEY(_FILE)` if set, else they are plain.
    pub at_rest_key_file: Option<PathBuf>,
}

impl Default for SecuritySpec {
    fn default() -> Self {
        SecuritySpec { mode: SecurityMode::Off, cipher: Cipher::default(), keys_dir: None, at_rest_key_file: None }
    }
}

impl Default for BusSpec {
    fn default() -> Self {
        BusSpec { max_frame_bytes: 16 << 20, handshake_timeout_ms: 5000, resolve_timeout_ms: 60_000 }
    }
}

/// Which local paths [`load_with_report`] checked: per host, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathReport {
    pub hosts: Vec<HostPaths>,
}

/// The paths one host needs: the model directory (unless the model is builtin) and
/// its chips' `plugin:` kernel libraries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPaths {
    pub host: String,
    /// The host's bus address, which tells whether it runs here.
    pub bus: Endpoint,
    /// The host runs on this machine (its bus address is one this machine can bind:
    /// loopback, unspecified or an address of one of its interfaces), so its paths were
    /// checked and exist; otherwise they could not be checked here.
    pub local: bool,
    pub paths: Vec<PathBuf>,
}

impl PathReport {
    /// A human-readable summary (the end of what `tessera topology check` prints).
    pub fn render(&self) -> String {
        render::render_paths(self)
    }
}

impl ClusterSpec {
    /// Index in [`ClusterSpec::hosts`] of the host named `name`.
    pub fn host_index(&self, name: &str) -> Option<usize> {
        self.hosts.iter().position(|host| host.name == name)
    }

    /// The figures of chip kind `name`: one of [`ClusterSpec::chip_kinds`], else a
    /// built-in [`catalog`] kind.
    pub fn chip_kind(&self, name: &str) -> Option<&ChipKind> {
        self.chip_kinds.iter().find(|kind| kind.name == name).or_else(|| catalog::lookup(name))
    }

    /// Every chip with its host's index and host, in file order.
    pub fn chips(&self) -> impl Iterator<Item = (usize, &HostSpec, &ChipSpec)> {
        self.hosts.iter().enumerate().flat_map(|(index, host)| host.chips.iter().map(move |chip| (index, host, chip)))
    }

    /// A human-readable summary (what `tessera topology check` prints).
    pub fn render(&self) -> String {
        render::render(self)
    }
}

/// Reads and validates the topology file at `path`. Relative model and plugin paths
/// are resolved against the file's directory. The paths of every host that runs on this
/// machine (see [`HostPaths::local`]) must exist: the model directory and its chips'
/// `plugin:` kernel libraries; those of other hosts are left to the machines they run
/// on. A file that cannot be read gives an error with line 0 (see [`TopologyError`]).
pub fn load(path: &Path) -> Result<ClusterSpec, TopologyError> {
    load_with_report(path).map(|(spec, _)| spec)
}

/// [`load`], and which hosts' paths it checked.
pub fn load_with_report(path: &Path) -> Result<(ClusterSpec, PathReport), TopologyError> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TopologyError::file(&source, format!("cannot read the topology file: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    // Absolute, so that the spec means the same thing to a process with another cwd.
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    validate::parse(&text, &source, Some(&dir), Some(&local::endpoint_is_local), None)
}

/// Parses and validates topology `text`; `source` names it in error messages. Relative
/// model and plugin paths are kept as written, and no path is checked; performance model
/// files (`[emulation.perf_models]`) are read, relative to the current directory.
pub fn parse(text: &str, source: &str) -> Result<ClusterSpec, TopologyError> {
    validate::parse(text, source, None, None, None).map(|(spec, _)| spec)
}

/// [`parse`] for a topology written inside another file in `dir` (a simulator
/// scenario): performance model files are read relative to `dir`.
pub fn parse_in(text: &str, source: &str, dir: &Path) -> Result<ClusterSpec, TopologyError> {
    validate::parse(text, source, None, None, Some(dir)).map(|(spec, _)| spec)
}

/// The embedded default topology ([`DEFAULT_TOML`]).
pub fn default_topology() -> ClusterSpec {
    match parse(DEFAULT_TOML, DEFAULT_SOURCE) {
        Ok(spec) => spec,
        // The file is part of this crate and a unit test parses it.
        Err(e) => panic!("the embedded default topology is invalid: {e}"),
    }
}
