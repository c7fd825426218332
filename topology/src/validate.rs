//! From TOML text to a [`ClusterSpec`]: serde reads the file into spanned raw tables
//! (unknown keys refused), then every value is checked here so that each error can
//! point at the exact key that is wrong.
//!
//! Every number has a range, so that what the runtime derives from it stays finite and
//! representable: intervals and timeouts are `Duration`s an `Instant` can be advanced
//! by, counts multiplied together (sequences x context, blocks x block bytes) fit in a
//! `usize`, and an emulated chip's paced step time fits in a `Duration` (see
//! [`crate::perf`]). Given a locality test (`crate::local`), the paths of the hosts
//! that run on this machine must exist.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::net::SocketAddr;
use std::ops::{Range, RangeInclusive};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use crate::catalog::Price;
use crate::error::{self, TopologyError};
use crate::perf::{self, Bound};
use crate::{
    BUILTIN_MODELS, Backend, BusSpec, ChipKind, ChipSpec, Cipher, ClusterSpec, Confidence, DType, DisaggSpec,
    EmulationSpec, Endpoint, GatewaySpec, HostPaths, HostSpec, KvLayout, MatmulPrecision, ParallelSpec, PathReport,
    PriorityClass, Role, RouterSpec, SecurityMode, SecuritySpec, SolverSpec, SupervisorSpec, TenantLimits, TenantSpec,
    catalog,
};

const MAX_BLOCK_SIZE: usize = 4096;
const MAX_THREADS: usize = 1024;
const MAX_TCP_STREAMS: usize = 64;
/// 64 MiB: a bigger chunk only delays the first bytes of a transfer.
const MAX_CHUNK_KIB: usize = 65536;
/// One day, the longest interval, timeout or lease in milliseconds: a `Duration` that an
/// `Instant` can be advanced by many times over (the restart backoff grows it 32-fold).
const MAX_MS: u64 = 86_400_000;
/// One day, in seconds.
const MAX_S: u64 = 86_400;
/// Tokens of one batch: 2^20, so that tokens x context (at most 2^24, the longest a
/// checkpoint may declare) fits in 2^44.
const MAX_BATCH_TOKENS: usize = 1 << 20;
/// Sequences of one batch: 2^16, so that sequences x context fits in 2^40 and a
/// chip's KV blocks stay countable.
const MAX_BATCH_SEQS: usize = 1 << 16;
/// An hour, in milliseconds.
const MAX_STEP_MS: u64 = 3_600_000;
/// The longest context a checkpoint may declare (`max_position_embeddings`).
const MAX_CONTEXT: usize = 1 << 24;
/// Requests queued by the router or in flight at the gateway.
const MAX_REQUESTS: usize = 1 << 20;
const MAX_RESTARTS: u32 = 10_000;
/// 1 PiB: more memory than any chip has, and far from overflowing a `u64` of bytes.
const MAX_MEMORY_BYTES: u64 = 1 << 50;
/// A step modelled at 1 us is paced at 1 s at most.
const MAX_TIME_SCALE: f64 = 1e6;
/// Below 1% of peak no real step runs; a smaller fraction only makes the pace absurd.
const MIN_EFFICIENCY: f64 = 0.01;
const MAX_CONNECTIONS: usize = 65_536;
/// Gateway and bus timeouts: 100 ms to 10 minutes.
const MIN_TIMEOUT_MS: u64 = 100;
const MAX_TIMEOUT_MS: u64 = 600_000;
const MAX_PROMPT_BYTES: usize = 1 << 30;
/// Bus frames: 4 KiB (a heartbeat fits) to 1 GiB.
const MIN_FRAME_BYTES: usize = 4096;
const MAX_FRAME_BYTES: usize = 1 << 30;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDoc {
    cluster: Spanned<RawCluster>,
    #[serde(default)]
    router: Option<Spanned<RawRouter>>,
    #[serde(default)]
    supervisor: Option<Spanned<RawSupervisor>>,
    #[serde(default)]
    solver: Option<Spanned<RawSolver>>,
    #[serde(default)]
    gateway: Option<Spanned<RawGateway>>,
    #[serde(default)]
    bus: Option<Spanned<RawBus>>,
    #[serde(default)]
    security: Option<Spanned<RawSecurity>>,
    #[serde(default)]
    emulation: Option<Spanned<RawEmulation>>,
    #[serde(default)]
    disagg: Option<Spanned<RawDisagg>>,
    #[serde(default)]
    chip_kinds: Vec<Spanned<RawChipKind>>,
    #[serde(default)]
    hosts: Vec<Spanned<RawHost>>,
    #[serde(default)]
    instances: Vec<Spanned<RawInstance>>,
    #[serde(default)]
    tenants: Vec<Spanned<RawTenant>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: Spanned<String>,
    #[serde(default)]
    weight: Option<Spanned<u32>>,
    #[serde(default)]
    priority: Option<Spanned<String>>,
    #[serde(default)]
    models: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default)]
    share_prefix_cache: Option<Spanned<bool>>,
    #[serde(default)]
    limits: Option<Spanned<RawTenantLimits>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenantLimits {
    #[serde(default)]
    requests_per_min: Option<Spanned<u64>>,
    #[serde(default)]
    tokens_per_min: Option<Spanned<u64>>,
    #[serde(default)]
    max_concurrent: Option<Spanned<usize>>,
    #[serde(default)]
    max_tokens: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInstance {
    id: Spanned<String>,
    chips: Spanned<Vec<Spanned<String>>>,
    #[serde(default)]
    tp: Option<Spanned<usize>>,
    #[serde(default)]
    split: Option<Spanned<toml::Value>>,
    #[serde(default)]
    role: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEmulation {
    #[serde(default)]
    time_scale: Option<Spanned<f64>>,
    #[serde(default)]
    compute_efficiency: Option<Spanned<f64>>,
    #[serde(default)]
    memory_efficiency: Option<Spanned<f64>>,
    #[serde(default)]
    perf_models: BTreeMap<String, Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDisagg {
    #[serde(default)]
    min_prompt_tokens: Option<Spanned<usize>>,
    #[serde(default)]
    lease_ms: Option<Spanned<u64>>,
    #[serde(default)]
    transport: Option<Spanned<String>>,
    #[serde(default)]
    tcp_streams: Option<Spanned<usize>>,
    #[serde(default)]
    chunk_kib: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChipKind {
    name: Spanned<String>,
    #[serde(default)]
    vendor: Option<Spanned<String>>,
    #[serde(default)]
    product: Option<Spanned<String>>,
    fp16_tflops: Spanned<f64>,
    memory: Spanned<toml::Value>,
    memory_bw_gbs: Spanned<f64>,
    link_bw_gbs: Spanned<f64>,
    tdp_w: Spanned<f64>,
    #[serde(default)]
    confidence: Option<Spanned<String>>,
    source: Spanned<String>,
    #[serde(default)]
    price_per_hour: Option<Spanned<f64>>,
    #[serde(default)]
    price_confidence: Option<Spanned<String>>,
    #[serde(default)]
    price_source: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    name: Option<Spanned<String>>,
    model: Spanned<String>,
    #[serde(default)]
    dtype: Option<Spanned<String>>,
    #[serde(default)]
    kv_dtype: Option<Spanned<String>>,
    #[serde(default)]
    block_size: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouter {
    #[serde(default)]
    policy: Option<Spanned<String>>,
    #[serde(default)]
    max_queued_requests: Option<Spanned<usize>>,
    #[serde(default)]
    kv_breaker_percent: Option<Spanned<u32>>,
    #[serde(default)]
    max_queued_prompt_ms: Option<Spanned<u64>>,
    #[serde(default)]
    max_waiting_requests: Option<Spanned<usize>>,
    #[serde(default)]
    queue_timeout_ms: Option<Spanned<u64>>,
    #[serde(default)]
    decode_overflow: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSupervisor {
    #[serde(default)]
    heartbeat_interval_ms: Option<Spanned<u64>>,
    #[serde(default)]
    heartbeat_timeout_ms: Option<Spanned<u64>>,
    #[serde(default)]
    max_restarts: Option<Spanned<u32>>,
    #[serde(default)]
    restart_window_s: Option<Spanned<u64>>,
    #[serde(default)]
    restart_backoff_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSolver {
    #[serde(default)]
    enabled: Option<Spanned<bool>>,
    #[serde(default)]
    auto: Option<Spanned<bool>>,
    #[serde(default)]
    objective: Option<Spanned<String>>,
    #[serde(default)]
    ttft_ms: Option<Spanned<u64>>,
    #[serde(default)]
    tpot_ms: Option<Spanned<u64>>,
    #[serde(default)]
    period_s: Option<Spanned<u64>>,
    #[serde(default)]
    telemetry_interval_ms: Option<Spanned<u64>>,
    #[serde(default)]
    rate_change_percent: Option<Spanned<u32>>,
    #[serde(default)]
    min_gain_percent: Option<Spanned<u32>>,
    #[serde(default)]
    dwell_s: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGateway {
    #[serde(default)]
    host: Option<Spanned<String>>,
    #[serde(default)]
    listen: Option<Spanned<String>>,
    #[serde(default)]
    served_model_name: Option<Spanned<String>>,
    #[serde(default)]
    max_inflight_requests: Option<Spanned<usize>>,
    #[serde(default)]
    max_connections: Option<Spanned<usize>>,
    #[serde(default)]
    header_read_timeout_ms: Option<Spanned<u64>>,
    #[serde(default)]
    max_prompt_bytes: Option<Spanned<usize>>,
    #[serde(default)]
    keys_file: Option<Spanned<String>>,
    #[serde(default)]
    audit_log: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBus {
    #[serde(default)]
    max_frame_bytes: Option<Spanned<usize>>,
    #[serde(default)]
    handshake_timeout_ms: Option<Spanned<u64>>,
    #[serde(default)]
    resolve_timeout_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecurity {
    #[serde(default)]
    mode: Option<Spanned<String>>,
    #[serde(default)]
    cipher: Option<Spanned<String>>,
    #[serde(default)]
    keys_dir: Option<Spanned<String>>,
    #[serde(default)]
    at_rest_key_file: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: Spanned<String>,
    bus: Spanned<String>,
    #[serde(default)]
    public_key: Option<Spanned<String>>,
    #[serde(default)]
    events: Option<Spanned<String>>,
    #[serde(default)]
    transfer: Option<Spanned<String>>,
    #[serde(default)]
    stages: Option<Spanned<String>>,
    #[serde(default)]
    chips: Vec<Spanned<RawChip>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChip {
    id: Spanned<String>,
    /// Required unless the backend is `emu:KIND`.
    #[serde(default)]
    kind: Option<Spanned<String>>,
    backend: Spanned<String>,
    #[serde(default)]
    role: Option<Spanned<String>>,
    #[serde(default)]
    memory_limit: Option<Spanned<toml::Value>>,
    #[serde(default)]
    threads: Option<Spanned<usize>>,
    #[serde(default)]
    max_batch_tokens: Option<Spanned<usize>>,
    #[serde(default)]
    max_batch_seqs: Option<Spanned<usize>>,
    #[serde(default)]
    max_mixed_step_ms: Option<Spanned<u64>>,
    #[serde(default)]
    block_size: Option<Spanned<usize>>,
    #[serde(default)]
    kv_dtype: Option<Spanned<String>>,
    #[serde(default)]
    kv_layout: Option<Spanned<String>>,
    #[serde(default)]
    quantize: Option<Spanned<String>>,
    #[serde(default)]
    matmul_precision: Option<Spanned<String>>,
}

/// What every chip of the file may refer to or inherits.
struct ChipContext<'a> {
    /// The file's `[[chip_kinds]]`.
    kinds: &'a [ChipKind],
    block_size: usize,
    kv_dtype: DType,
}

impl ChipContext<'_> {
    fn resolves(&self, kind: &str) -> bool {
        self.kind(kind).is_some()
    }

    fn kind(&self, name: &str) -> Option<&ChipKind> {
        self.kinds.iter().find(|known| known.name == name).or_else(|| catalog::lookup(name))
    }

    fn known_kinds(&self) -> String {
        catalog::names_with(self.kinds)
    }
}

/// Whether an IP address belongs to this machine (see `crate::local`).
pub(crate) type IsLocal = dyn Fn(&Endpoint) -> bool;

/// The file being checked: builds errors that point into it.
struct Checker<'a> {
    text: &'a str,
    source: &'a str,
    /// Directory relative paths are resolved against; `None` keeps them as written.
    base: Option<&'a Path>,
    /// Directory relative performance model files are read from when `base` is `None`
    /// (a topology inside another file); `None`: the current directory.
    data_dir: Option<&'a Path>,
    /// Tells the hosts that run on this machine, whose paths must exist; `None` checks
    /// no path.
    is_local: Option<&'a IsLocal>,
}

impl Checker<'_> {
    fn err(&self, span: Range<usize>, key: impl Into<String>, message: impl Into<String>) -> TopologyError {
        TopologyError::at(self.source, self.text, span, key.into(), message.into())
    }

    fn line_of(&self, span: &Range<usize>) -> usize {
        error::line_column(self.text, span.start).0
    }

    fn resolve(&self, path: &str) -> PathBuf {
        match self.base {
            Some(base) if Path::new(path).is_relative() => base.join(path),
            _ => PathBuf::from(path),
        }
    }

    /// `value` if set, after `check`; `default` otherwise.
    fn field<T: Copy>(
        &self,
        value: &Option<Spanned<T>>,
        key: &str,
        default: T,
        check: impl Fn(T) -> Result<(), String>,
    ) -> Result<T, TopologyError> {
        match value {
            None => Ok(default),
            Some(value) => {
                let inner = *value.get_ref();
                check(inner).map_err(|message| self.err(value.span(), key, message))?;
                Ok(inner)
            }
        }
    }

    /// An address this process binds: an IP address (0.0.0.0 for every interface).
    fn bind_address(&self, value: &Spanned<String>, key: &str) -> Result<SocketAddr, TopologyError> {
        let endpoint = self.address(value, key)?;
        match endpoint.ip() {
            Some(ip) => Ok(SocketAddr::new(ip, endpoint.port)),
            None => Err(self.err(
                value.span(),
                key,
                format!(
                    "`{}` names a host; this socket is bound, so give an IP address (\"0.0.0.0:{}\" for every interface)",
                    value.get_ref(),
                    endpoint.port
                ),
            )),
        }
    }

    fn address(&self, value: &Spanned<String>, key: &str) -> Result<Endpoint, TopologyError> {
        Endpoint::parse(value.get_ref()).map_err(|message| self.err(value.span(), key, message))
    }

    /// `value` read with `FromStr` (the vocabulary enums name their choices), `default`
    /// when it is not set.
    fn named<T: std::str::FromStr<Err = crate::UnknownName>>(
        &self,
        value: &Option<Spanned<String>>,
        key: &str,
        default: T,
    ) -> Result<T, TopologyError> {
        value.as_ref().map_or(Ok(default), |value| self.parse(value, key))
    }

    /// `value` read with `FromStr`; an unknown name is an error at its span that lists
    /// the accepted ones.
    fn parse<T: std::str::FromStr<Err = crate::UnknownName>>(
        &self,
        value: &Spanned<String>,
        key: &str,
    ) -> Result<T, TopologyError> {
        value.get_ref().parse().map_err(|e: crate::UnknownName| self.err(value.span(), key, e.to_string()))
    }
}

/// 32 bytes from 64 hex digits.
fn parse_key(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut key = [0u8; 32];
    for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
        let digits = std::str::from_utf8(pair).ok()?;
        key[i] = u8::from_str_radix(digits, 16).ok()?;
    }
    Some(key)
}

/// A float as a message shows it: `1e300`, not 301 digits.
fn show(value: f64) -> String {
    if value.is_finite() && value != 0.0 && !(1e-4..1e9).contains(&value.abs()) {
        format!("{value:e}")
    } else {
        format!("{value}")
    }
}

fn time_scale(value: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 && value <= MAX_TIME_SCALE {
        Ok(())
    } else {
        Err(format!(
            "{} is out of range: more than 0 and at most {} (a step is paced at its modelled time x time_scale)",
            show(value),
            show(MAX_TIME_SCALE)
        ))
    }
}

fn fraction(value: f64) -> Result<(), String> {
    if (MIN_EFFICIENCY..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(format!("{} must be a fraction of peak: at least {MIN_EFFICIENCY} and at most 1", show(value)))
    }
}

fn in_range<T: PartialOrd + Display + Copy>(low: T, high: T) -> impl Fn(T) -> Result<(), String> {
    move |value| {
        if low <= value && value <= high { Ok(()) } else { Err(format!("{value} is out of range {low}..={high}")) }
    }
}

/// Milliseconds from `low` to one day.
fn millis(low: u64) -> impl Fn(u64) -> Result<(), String> {
    move |value| in_range(low, MAX_MS)(value).map_err(|message| format!("{message} (ms; at most one day)"))
}

/// Parses and validates `text`. With `is_local`, the paths of the hosts that run on this
/// machine must exist; the report says which hosts those are.
pub(crate) fn parse(
    text: &str,
    source: &str,
    base: Option<&Path>,
    is_local: Option<&IsLocal>,
    data_dir: Option<&Path>,
) -> Result<(ClusterSpec, PathReport), TopologyError> {
    let raw: RawDoc = toml::from_str(text).map_err(|e| error::from_toml(source, text, &e))?;
    let checker = Checker { text, source, base, data_dir, is_local };
    checker.cluster(raw)
}

impl Checker<'_> {
    fn cluster(&self, raw: RawDoc) -> Result<(ClusterSpec, PathReport), TopologyError> {
        let cluster_span = raw.cluster.span();
        let cluster = raw.cluster.into_inner();

        let name = match &cluster.name {
            Some(name) => self.name(name, "cluster.name")?,
            None => "default".to_owned(),
        };
        let model = self.model(&cluster.model)?;
        let dtype = cluster.dtype.as_ref().map(|dtype| self.parse(dtype, "cluster.dtype")).transpose()?;
        let kv_dtype = self.named(&cluster.kv_dtype, "cluster.kv_dtype", DType::F16)?;
        let block_size = self.field(&cluster.block_size, "cluster.block_size", 16, in_range(1, MAX_BLOCK_SIZE))?;

        let router = self.router(raw.router.as_ref().map(Spanned::get_ref))?;
        let supervisor = self.supervisor(raw.supervisor.as_ref().map(Spanned::get_ref))?;
        let solver = self.solver(raw.solver.as_ref().map(Spanned::get_ref))?;
        let mut emulation = self.emulation(raw.emulation.as_ref().map(Spanned::get_ref))?;
        let disagg = self.disagg(raw.disagg.as_ref().map(Spanned::get_ref))?;
        let chip_kinds = self.chip_kinds(&raw.chip_kinds)?;

        if raw.hosts.is_empty() {
            return Err(self.err(
                cluster_span,
                "hosts",
                "the cluster has no hosts: add a [[hosts]] table with at least one [[hosts.chips]]",
            ));
        }
        let context = ChipContext { kinds: &chip_kinds, block_size, kv_dtype };
        let hosts = self.hosts(&raw.hosts, &context)?;
        emulation.perf_models = self.perf_models(raw.emulation.as_ref().map(Spanned::get_ref), &context, &hosts)?;
        let gateway = self.gateway(raw.gateway.as_ref().map(Spanned::get_ref), &hosts)?;
        let bus = self.bus(raw.bus.as_ref().map(Spanned::get_ref))?;
        let security = self.security(raw.security.as_ref(), &hosts)?;
        self.sockets_are_distinct(&raw.hosts, &hosts, raw.gateway.as_ref().map(Spanned::get_ref), &gateway)?;
        self.some_chip_decodes(&raw.hosts, &hosts)?;
        self.kv_peers_quantize_alike(&raw.hosts, &hosts)?;
        self.emulated_steps_fit(&raw.hosts, &hosts, &context, &emulation)?;
        // Last: the one check that depends on the machine, not on the file.
        let paths = self.local_paths(&cluster.model, &model, &raw.hosts, &hosts)?;
        // After every per-chip check, which pairs each raw chip with its spec.
        let hosts = self.instances(&raw.instances, hosts)?;
        let hosts = self.stage_servers(&raw.hosts, hosts, &gateway)?;
        let tenants = self.tenants(&raw.tenants, raw.gateway.as_ref().map(Spanned::get_ref), &gateway)?;

        let spec = ClusterSpec {
            source: self.source.to_owned(),
            name,
            model,
            dtype,
            kv_dtype,
            block_size,
            chip_kinds,
            hosts,
            router,
            supervisor,
            gateway,
            bus,
            security,
            emulation,
            disagg,
            solver,
            tenants,
        };
        Ok((spec, paths))
    }

    /// An emulated chip sleeps for its step's roofline time x `time_scale`. The model's
    /// shape is not known here, so [`perf::reference_step`] stands for it: its pace must
    /// stay under [`perf::MAX_STEP_S`], or every step of a real model would be paced
    /// absurdly long (and [`perf::roofline`] would cut it to a day).
    fn emulated_steps_fit(
        &self,
        raw_hosts: &[Spanned<RawHost>],
        hosts: &[HostSpec],
        context: &ChipContext,
        emulation: &EmulationSpec,
    ) -> Result<(), TopologyError> {
        for (h, (raw_host, host)) in raw_hosts.iter().zip(hosts).enumerate() {
            for (c, (raw_chip, chip)) in raw_host.get_ref().chips.iter().zip(&host.chips).enumerate() {
                let Some(kind) = chip.backend.emulated_kind().and_then(|name| context.kind(name)) else { continue };
                let step = emulation.reference_step(kind);
                let paced_s = step.unscaled_s * emulation.time_scale;
                if paced_s <= perf::MAX_STEP_S {
                    continue;
                }
                let roof = match step.bound {
                    Bound::Compute => format!(
                        "{} TFLOPS x compute_efficiency {}",
                        show(kind.fp16_tflops),
                        show(emulation.compute_efficiency)
                    ),
                    Bound::Memory => format!(
                        "{} GB/s x memory_efficiency {}",
                        show(kind.memory_bw_gbs),
                        show(emulation.memory_efficiency)
                    ),
                };
                return Err(self.err(
                    raw_chip.get_ref().backend.span(),
                    format!("hosts[{h}].chips[{c}].backend"),
                    format!(
                        "`{}` paces too slowly: at {roof}, times emulation.time_scale {}, one decode step of a \
                         7B-parameter model at {} tokens of context would take {:.0} s, more than a day ({} s); lower \
                         emulation.time_scale or raise the efficiencies or the figures of chip kind `{}`",
                        chip.backend,
                        show(emulation.time_scale),
                        perf::REFERENCE_CONTEXT,
                        paced_s,
                        perf::MAX_STEP_S,
                        kind.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The paths every host needs, checked for the hosts that run on this machine: the
    /// model directory (shared by all hosts: checked once) and each chip's kernel library.
    fn local_paths(
        &self,
        raw_model: &Spanned<String>,
        model: &str,
        raw_hosts: &[Spanned<RawHost>],
        hosts: &[HostSpec],
    ) -> Result<PathReport, TopologyError> {
        let model_dir = (!model.starts_with("builtin:")).then(|| PathBuf::from(model));
        let mut report = PathReport { hosts: Vec::with_capacity(hosts.len()) };
        let mut model_checked = false;
        for (h, (raw_host, host)) in raw_hosts.iter().zip(hosts).enumerate() {
            let local = self.is_local.is_some_and(|is_local| is_local(&host.bus));
            let mut paths: Vec<PathBuf> = model_dir.iter().cloned().collect();
            if let Some(dir) = &model_dir
                && local
                && !model_checked
            {
                model_checked = true;
                let builtins =
                    format!("the model is a checkpoint directory, a GGUF file or one of {}", BUILTIN_MODELS.join(", "));
                if let Some(problem) = unusable(dir, PathKind::Model, "model", &builtins, host) {
                    return Err(self.err(raw_model.span(), "cluster.model", problem));
                }
            }
            for (c, (raw_chip, chip)) in raw_host.get_ref().chips.iter().zip(&host.chips).enumerate() {
                let Backend::Plugin(library) = &chip.backend else { continue };
                paths.push(library.clone());
                if !local {
                    continue;
                }
                let hint = "`plugin:` needs the path of a kernel library";
                if let Some(problem) = unusable(library, PathKind::File, "kernel library", hint, host) {
                    return Err(self.err(
                        raw_chip.get_ref().backend.span(),
                        format!("hosts[{h}].chips[{c}].backend"),
                        problem,
                    ));
                }
            }
            report.hosts.push(HostPaths { host: host.name.clone(), bus: host.bus.clone(), local, paths });
        }
        Ok(report)
    }

    fn emulation(&self, raw: Option<&RawEmulation>) -> Result<EmulationSpec, TopologyError> {
        let defaults = EmulationSpec::default();
        let Some(raw) = raw else { return Ok(defaults) };
        Ok(EmulationSpec {
            time_scale: self.field(&raw.time_scale, "emulation.time_scale", defaults.time_scale, time_scale)?,
            compute_efficiency: self.field(
                &raw.compute_efficiency,
                "emulation.compute_efficiency",
                defaults.compute_efficiency,
                fraction,
            )?,
            memory_efficiency: self.field(
                &raw.memory_efficiency,
                "emulation.memory_efficiency",
                defaults.memory_efficiency,
                fraction,
            )?,
            perf_models: BTreeMap::new(),
        })
    }

    /// `[emulation.perf_models]`: each a known chip kind and a performance model file
    /// (relative to the topology file). A file is read and checked where a chip of its
    /// kind runs on this machine (always, when there is no telling which hosts run here).
    fn perf_models(
        &self,
        raw: Option<&RawEmulation>,
        context: &ChipContext,
        hosts: &[HostSpec],
    ) -> Result<BTreeMap<String, perf::PerfModel>, TopologyError> {
        let mut out = BTreeMap::new();
        let Some(raw) = raw else { return Ok(out) };
        for (kind, file) in &raw.perf_models {
            let key = format!("emulation.perf_models.{kind}");
            if !context.resolves(kind) {
                let why = format!("no chip kind `{kind}`; known kinds: {}", context.known_kinds());
                return Err(self.err(file.span(), key, why));
            }
            let needed = match self.is_local {
                None => true,
                Some(is_local) => hosts.iter().any(|h| is_local(&h.bus) && h.chips.iter().any(|c| &c.kind == kind)),
            };
            if !needed {
                continue;
            }
            let path = match (self.base, self.data_dir) {
                (None, Some(dir)) => dir.join(file.get_ref()),
                _ => self.resolve(file.get_ref()),
            };
            let model = crate::read_perf_model(&path).map_err(|why| self.err(file.span(), key, why))?;
            out.insert(kind.clone(), model);
        }
        Ok(out)
    }

    fn disagg(&self, raw: Option<&RawDisagg>) -> Result<DisaggSpec, TopologyError> {
        let defaults = DisaggSpec::default();
        let Some(raw) = raw else { return Ok(defaults) };
        Ok(DisaggSpec {
            min_prompt_tokens: self.field(
                &raw.min_prompt_tokens,
                "disagg.min_prompt_tokens",
                defaults.min_prompt_tokens,
                |tokens| {
                    if tokens < 2 {
                        Err(format!("{tokens} is below 2: a one-token prompt has no KV worth moving to a decode chip"))
                    } else {
                        in_range(2, MAX_CONTEXT)(tokens)
                            .map_err(|message| format!("{message}: no model has a longer context"))
                    }
                },
            )?,
            lease_ms: self.field(&raw.lease_ms, "disagg.lease_ms", defaults.lease_ms, millis(1))?,
            transport: self.named(&raw.transport, "disagg.transport", defaults.transport)?,
            tcp_streams: self.field(
                &raw.tcp_streams,
                "disagg.tcp_streams",
                defaults.tcp_streams,
                in_range(1, MAX_TCP_STREAMS),
            )?,
            chunk_kib: self.field(
                &raw.chunk_kib,
                "disagg.chunk_kib",
                defaults.chunk_kib,
                in_range(1, MAX_CHUNK_KIB),
            )?,
        })
    }

    /// Operator kinds may not reuse a built-in name: a kind name means the same figures
    /// in every topology file, so plans and logs from two clusters compare.
    fn chip_kinds(&self, raw: &[Spanned<RawChipKind>]) -> Result<Vec<ChipKind>, TopologyError> {
        let mut kinds: Vec<ChipKind> = Vec::with_capacity(raw.len());
        let mut first_lines: Vec<usize> = Vec::with_capacity(raw.len());
        for (k, raw_kind) in raw.iter().enumerate() {
            let raw_kind = raw_kind.get_ref();
            let key = format!("chip_kinds[{k}]");
            let name = self.name(&raw_kind.name, &format!("{key}.name"))?;
            if catalog::lookup(&name).is_some() {
                return Err(self.err(
                    raw_kind.name.span(),
                    format!("{key}.name"),
                    format!(
                        "`{name}` is a built-in chip kind and keeps its catalog figures; give yours another name, \
                         e.g. `{name}-custom`"
                    ),
                ));
            }
            if let Some(first) = kinds.iter().position(|kind| kind.name == name) {
                return Err(self.err(
                    raw_kind.name.span(),
                    format!("{key}.name"),
                    format!(
                        "chip kind `{name}` is already defined by chip_kinds[{first}] (line {})",
                        first_lines[first]
                    ),
                ));
            }
            let text = |value: &Option<Spanned<String>>, field: &str, default: &str| match value {
                Some(value) if value.get_ref().trim().is_empty() => {
                    Err(self.err(value.span(), format!("{key}.{field}"), "must not be empty"))
                }
                Some(value) => Ok(value.get_ref().clone()),
                None => Ok(default.to_owned()),
            };
            // Within the range of real chips (see `catalog`), so that the roofline stays finite.
            let figure = |value: &Spanned<f64>, field: &str, range: RangeInclusive<f64>, unit: &str| {
                let figure = *value.get_ref();
                let problem = if !(figure.is_finite() && figure > 0.0) {
                    format!("{} must be a number greater than 0", show(figure))
                } else if !range.contains(&figure) {
                    format!(
                        "{} {unit} is outside {}..={} {unit}, the range of real chips",
                        show(figure),
                        show(*range.start()),
                        show(*range.end())
                    )
                } else {
                    return Ok(figure);
                };
                Err(self.err(value.span(), format!("{key}.{field}"), problem))
            };
            kinds.push(ChipKind {
                vendor: text(&raw_kind.vendor, "vendor", "operator-defined")?,
                product: text(&raw_kind.product, "product", &name)?,
                fp16_tflops: figure(&raw_kind.fp16_tflops, "fp16_tflops", catalog::FP16_TFLOPS_RANGE, "TFLOPS")?,
                memory_bytes: self.memory(
                    &raw_kind.memory,
                    &format!("{key}.memory"),
                    "a chip has some memory",
                    catalog::MEMORY_BYTES_RANGE,
                )?,
                memory_bw_gbs: figure(&raw_kind.memory_bw_gbs, "memory_bw_gbs", catalog::MEMORY_BW_GBS_RANGE, "GB/s")?,
                link_bw_gbs: figure(&raw_kind.link_bw_gbs, "link_bw_gbs", catalog::LINK_BW_GBS_RANGE, "GB/s")?,
                tdp_w: figure(&raw_kind.tdp_w, "tdp_w", catalog::TDP_W_RANGE, "W")?,
                confidence: self.named(&raw_kind.confidence, &format!("{key}.confidence"), Confidence::Unconfirmed)?,
                source: text(&Some(raw_kind.source.clone()), "source", "")?,
                price: match (&raw_kind.price_per_hour, &raw_kind.price_source) {
                    (None, None) => {
                        if let Some(confidence) = &raw_kind.price_confidence {
                            return Err(self.err(
                                confidence.span(),
                                format!("{key}.price_confidence"),
                                "is set without price_per_hour",
                            ));
                        }
                        None
                    }
                    (Some(price), Some(source)) => Some(Price {
                        usd_per_hour: figure(price, "price_per_hour", catalog::PRICE_USD_PER_HOUR_RANGE, "$/h")?,
                        confidence: self.named(
                            &raw_kind.price_confidence,
                            &format!("{key}.price_confidence"),
                            Confidence::Unconfirmed,
                        )?,
                        source: text(&Some(source.clone()), "price_source", "")?,
                    }),
                    (Some(price), None) => {
                        return Err(self.err(
                            price.span(),
                            format!("{key}.price_per_hour"),
                            "needs price_source: where the price comes from (a quote, a contract, or \"estimate\")",
                        ));
                    }
                    (None, Some(source)) => {
                        return Err(self.err(
                            source.span(),
                            format!("{key}.price_source"),
                            "is set without price_per_hour",
                        ));
                    }
                },
                name,
            });
            first_lines.push(self.line_of(&raw_kind.name.span()));
        }
        Ok(kinds)
    }

    /// Host names and chip ids end up in bus identities and metric labels.
    fn name(&self, value: &Spanned<String>, key: &str) -> Result<String, TopologyError> {
        let name = value.get_ref();
        crate::check_name(name).map_err(|why| self.err(value.span(), key, why))?;
        Ok(name.clone())
    }

    fn model(&self, value: &Spanned<String>) -> Result<String, TopologyError> {
        let model = value.get_ref();
        if model.is_empty() {
            return Err(self.err(
                value.span(),
                "cluster.model",
                format!("must name a checkpoint directory or one of {}", BUILTIN_MODELS.join(", ")),
            ));
        }
        if model.starts_with("builtin:") {
            if BUILTIN_MODELS.contains(&model.as_str()) {
                return Ok(model.clone());
            }
            return Err(self.err(
                value.span(),
                "cluster.model",
                format!("unknown builtin model `{model}`; builtin models: {}", BUILTIN_MODELS.join(", ")),
            ));
        }
        Ok(self.resolve(model).display().to_string())
    }

    fn router(&self, raw: Option<&RawRouter>) -> Result<RouterSpec, TopologyError> {
        let d = RouterSpec::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(RouterSpec {
            policy: self.named(&raw.policy, "router.policy", d.policy)?,
            max_queued_requests: self.field(
                &raw.max_queued_requests,
                "router.max_queued_requests",
                d.max_queued_requests,
                in_range(1, MAX_REQUESTS),
            )?,
            kv_breaker_percent: self.field(
                &raw.kv_breaker_percent,
                "router.kv_breaker_percent",
                d.kv_breaker_percent,
                in_range(1, 100),
            )?,
            max_queued_prompt_ms: self.field(
                &raw.max_queued_prompt_ms,
                "router.max_queued_prompt_ms",
                d.max_queued_prompt_ms,
                in_range(1, 3_600_000),
            )?,
            max_waiting_requests: self.field(
                &raw.max_waiting_requests,
                "router.max_waiting_requests",
                d.max_waiting_requests,
                in_range(0, MAX_REQUESTS),
            )?,
            queue_timeout_ms: self.field(
                &raw.queue_timeout_ms,
                "router.queue_timeout_ms",
                d.queue_timeout_ms,
                millis(1),
            )?,
            decode_overflow: self.named(&raw.decode_overflow, "router.decode_overflow", d.decode_overflow)?,
        })
    }

    fn solver(&self, raw: Option<&RawSolver>) -> Result<SolverSpec, TopologyError> {
        let d = SolverSpec::default();
        let Some(raw) = raw else { return Ok(d) };
        let seconds =
            |low| move |s| in_range(low, MAX_S)(s).map_err(|message| format!("{message} (s; at most one day)"));
        Ok(SolverSpec {
            enabled: self.field(&raw.enabled, "solver.enabled", d.enabled, |_| Ok(()))?,
            auto: self.field(&raw.auto, "solver.auto", d.auto, |_| Ok(()))?,
            objective: self.named(&raw.objective, "solver.objective", d.objective)?,
            ttft_ms: self.field(&raw.ttft_ms, "solver.ttft_ms", d.ttft_ms, millis(1))?,
            tpot_ms: self.field(&raw.tpot_ms, "solver.tpot_ms", d.tpot_ms, millis(1))?,
            period_s: self.field(&raw.period_s, "solver.period_s", d.period_s, seconds(1))?,
            telemetry_interval_ms: self.field(
                &raw.telemetry_interval_ms,
                "solver.telemetry_interval_ms",
                d.telemetry_interval_ms,
                millis(10),
            )?,
            rate_change_percent: self.field(
                &raw.rate_change_percent,
                "solver.rate_change_percent",
                d.rate_change_percent,
                in_range(1, 1000),
            )?,
            min_gain_percent: self.field(
                &raw.min_gain_percent,
                "solver.min_gain_percent",
                d.min_gain_percent,
                in_range(0, 1000),
            )?,
            dwell_s: self.field(&raw.dwell_s, "solver.dwell_s", d.dwell_s, seconds(0))?,
        })
    }

    fn supervisor(&self, raw: Option<&RawSupervisor>) -> Result<SupervisorSpec, TopologyError> {
        let defaults = SupervisorSpec {
            heartbeat_interval_ms: 100,
            heartbeat_timeout_ms: 1000,
            max_restarts: 3,
            restart_window_s: 60,
            restart_backoff_ms: 200,
        };
        let Some(raw) = raw else { return Ok(defaults) };
        let spec = SupervisorSpec {
            heartbeat_interval_ms: self.field(
                &raw.heartbeat_interval_ms,
                "supervisor.heartbeat_interval_ms",
                defaults.heartbeat_interval_ms,
                millis(1),
            )?,
            heartbeat_timeout_ms: self.field(
                &raw.heartbeat_timeout_ms,
                "supervisor.heartbeat_timeout_ms",
                defaults.heartbeat_timeout_ms,
                millis(1),
            )?,
            max_restarts: self.field(
                &raw.max_restarts,
                "supervisor.max_restarts",
                defaults.max_restarts,
                in_range(0, MAX_RESTARTS),
            )?,
            restart_window_s: self.field(
                &raw.restart_window_s,
                "supervisor.restart_window_s",
                defaults.restart_window_s,
                |seconds| in_range(1, MAX_S)(seconds).map_err(|message| format!("{message} (s; at most one day)")),
            )?,
            restart_backoff_ms: self.field(
                &raw.restart_backoff_ms,
                "supervisor.restart_backoff_ms",
                defaults.restart_backoff_ms,
                millis(0),
            )?,
        };
        if spec.heartbeat_timeout_ms <= spec.heartbeat_interval_ms {
            // Point at whichever of the two the file sets, the timeout first.
            let (span, key) = match (&raw.heartbeat_timeout_ms, &raw.heartbeat_interval_ms) {
                (Some(timeout), _) => (timeout.span(), "supervisor.heartbeat_timeout_ms"),
                (None, Some(interval)) => (interval.span(), "supervisor.heartbeat_interval_ms"),
                (None, None) => (0..0, "supervisor.heartbeat_timeout_ms"),
            };
            return Err(self.err(
                span,
                key,
                format!(
                    "heartbeat_timeout_ms ({}) must be greater than heartbeat_interval_ms ({}), \
                     or every chip would be declared dead between two heartbeats",
                    spec.heartbeat_timeout_ms, spec.heartbeat_interval_ms
                ),
            ));
        }
        Ok(spec)
    }

    fn hosts(&self, raw: &[Spanned<RawHost>], context: &ChipContext) -> Result<Vec<HostSpec>, TopologyError> {
        let mut host_names: HashMap<&str, (usize, Range<usize>)> = HashMap::new();
        let mut chip_ids: HashMap<&str, (String, Range<usize>)> = HashMap::new();
        let mut hosts = Vec::with_capacity(raw.len());
        for (h, raw_host) in raw.iter().enumerate() {
            let host = raw_host.get_ref();
            let key = format!("hosts[{h}]");
            let name = self.name(&host.name, &format!("{key}.name"))?;
            if let Some((first, first_span)) = host_names.get(host.name.get_ref().as_str()) {
                return Err(self.err(
                    host.name.span(),
                    format!("{key}.name"),
                    format!("host name `{name}` is already used by hosts[{first}] (line {})", self.line_of(first_span)),
                ));
            }
            host_names.insert(host.name.get_ref(), (h, host.name.span()));

            let bus = self.address(&host.bus, &format!("{key}.bus"))?;
            let events = self.next_to_bus(&host.events, &host.bus, &bus, &key, "events", 1)?;
            let transfer = self.next_to_bus(&host.transfer, &host.bus, &bus, &key, "transfer", 2)?;

            if host.chips.is_empty() {
                return Err(self.err(
                    raw_host.span(),
                    format!("{key}.chips"),
                    format!("host `{name}` has no chips: add a [[hosts.chips]] table after its [[hosts]]"),
                ));
            }
            let mut chips = Vec::with_capacity(host.chips.len());
            for (c, raw_chip) in host.chips.iter().enumerate() {
                let chip_key = format!("{key}.chips[{c}]");
                let chip = self.chip(raw_chip, &chip_key, context)?;
                let id = raw_chip.get_ref().id.get_ref().as_str();
                if let Some((first, first_span)) = chip_ids.get(id) {
                    return Err(self.err(
                        raw_chip.get_ref().id.span(),
                        format!("{chip_key}.id"),
                        format!("chip id `{id}` is already used by {first} (line {})", self.line_of(first_span)),
                    ));
                }
                chip_ids.insert(id, (chip_key, raw_chip.get_ref().id.span()));
                chips.push(chip);
            }
            let stages = match &host.stages {
                Some(value) => Some(self.address(value, &format!("{key}.stages"))?),
                None => None,
            };
            let public_key = match &host.public_key {
                Some(value) => Some(parse_key(value.get_ref()).ok_or_else(|| {
                    self.err(
                        value.span(),
                        format!("{key}.public_key"),
                        "must be a host's public key: 64 hex digits, as `tessera keys gen-host` prints",
                    )
                })?),
                None => None,
            };
            hosts.push(HostSpec { name, bus, events, transfer, stages, public_key, chips });
        }
        Ok(hosts)
    }

    /// The host's `field` socket, by default on the bus port + `offset`.
    fn next_to_bus(
        &self,
        value: &Option<Spanned<String>>,
        raw_bus: &Spanned<String>,
        bus: &Endpoint,
        host_key: &str,
        field: &str,
        offset: u16,
    ) -> Result<Endpoint, TopologyError> {
        if let Some(value) = value {
            return self.address(value, &format!("{host_key}.{field}"));
        }
        match bus.port.checked_add(offset) {
            Some(port) => Ok(bus.with_port(port)),
            None => Err(self.err(
                raw_bus.span(),
                format!("{host_key}.bus"),
                format!(
                    "`{field}` defaults to the bus port + {offset}, which does not exist for port {}; \
                     set `{host_key}.{field}`",
                    bus.port
                ),
            )),
        }
    }

    /// Folds each `[[instances]]` entry's chips into one chip standing for the instance,
    /// where its first chip was on its host.
    fn instances(
        &self,
        raw: &[Spanned<RawInstance>],
        mut hosts: Vec<HostSpec>,
    ) -> Result<Vec<HostSpec>, TopologyError> {
        let mut taken: HashMap<String, String> = HashMap::new();
        for (i, spanned) in raw.iter().enumerate() {
            let inst = spanned.get_ref();
            let key = format!("instances[{i}]");
            let id = self.name(&inst.id, &format!("{key}.id"))?;
            let clash = hosts.iter().flat_map(|h| &h.chips).any(|c| c.id == id) || taken.values().any(|v| *v == id);
            if clash {
                return Err(self.err(
                    inst.id.span(),
                    format!("{key}.id"),
                    format!("`{id}` is already the id of a chip or another instance"),
                ));
            }
            let names = inst.chips.get_ref();
            if names.len() < 2 {
                return Err(self.err(
                    inst.chips.span(),
                    format!("{key}.chips"),
                    "an instance spans two chips or more (one chip holding the whole model needs no instance)",
                ));
            }
            let mut members = Vec::with_capacity(names.len());
            for (c, name) in names.iter().enumerate() {
                let ckey = format!("{key}.chips[{c}]");
                let chip_id = name.get_ref();
                if let Some(other) = taken.get(chip_id) {
                    return Err(self.err(
                        name.span(),
                        ckey,
                        format!("chip `{chip_id}` is already in instance `{other}`"),
                    ));
                }
                let Some(h) = hosts.iter().position(|h| h.chips.iter().any(|x| x.id == *chip_id)) else {
                    return Err(self.err(name.span(), ckey, format!("no chip has the id `{chip_id}`")));
                };
                taken.insert(chip_id.clone(), id.clone());
                let at = hosts[h].chips.iter().position(|x| x.id == *chip_id).unwrap_or(0);
                members.push((h, at, name));
            }
            let h = members[0].0;
            let tp = self.field(&inst.tp, &format!("{key}.tp"), 1, in_range(1, 64))?;
            if names.len() % tp != 0 {
                let span = inst.tp.as_ref().map_or(inst.chips.span(), Spanned::span);
                return Err(self.err(
                    span,
                    format!("{key}.tp"),
                    format!("{} chips do not make stages of {tp} (tp): give a multiple of {tp} chips", names.len()),
                ));
            }
            let stages = names.len() / tp;
            let split = match &inst.split {
                None => None,
                Some(v) => match v.get_ref() {
                    toml::Value::String(s) if s == "auto" => None,
                    toml::Value::Array(items) => {
                        let counts: Option<Vec<usize>> = items
                            .iter()
                            .map(|x| x.as_integer().and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0))
                            .collect();
                        match counts {
                            Some(counts) if counts.len() == stages => Some(counts),
                            _ => {
                                return Err(self.err(
                                    v.span(),
                                    format!("{key}.split"),
                                    format!("expected {stages} positive layer counts, one per stage, or \"auto\""),
                                ));
                            }
                        }
                    }
                    _ => {
                        return Err(self.err(
                            v.span(),
                            format!("{key}.split"),
                            "expected \"auto\" or a list of layers per stage, e.g. [10, 20]",
                        ));
                    }
                },
            };
            let chips: Vec<ChipSpec> = members.iter().map(|(mh, at, _)| hosts[*mh].chips[*at].clone()).collect();
            let first = &chips[0];
            for ((_, _, name), chip) in members.iter().zip(&chips).skip(1) {
                let differs = [
                    ("block_size", chip.block_size != first.block_size),
                    ("kv_dtype", chip.kv_dtype != first.kv_dtype),
                    ("kv_layout", chip.kv_layout != first.kv_layout),
                    ("quantize", chip.quantize != first.quantize),
                    ("matmul_precision", chip.matmul_precision != first.matmul_precision),
                ];
                if let Some((what, _)) = differs.iter().find(|(_, d)| *d) {
                    return Err(self.err(
                        name.span(),
                        format!("{key}.chips"),
                        format!(
                            "chip `{}` has another {what} than `{}`: the chips of an instance hold one KV cache \
                             and one set of weights",
                            chip.id, first.id
                        ),
                    ));
                }
            }
            let mut stage_hosts = Vec::with_capacity(stages);
            for s in 0..stages {
                let stage = &chips[s * tp..(s + 1) * tp];
                let stage_members = &members[s * tp..(s + 1) * tp];
                if let Some((oh, _, name)) = stage_members.iter().find(|(mh, _, _)| *mh != stage_members[0].0) {
                    return Err(self.err(
                        name.span(),
                        format!("{key}.chips"),
                        format!(
                            "stage {s} has `{}` on host `{}` and `{}` on `{}`: the tensor-parallel chips of a stage \
                             share one host (stages may be on different hosts)",
                            stage[0].id,
                            hosts[stage_members[0].0].name,
                            name.get_ref(),
                            hosts[*oh].name
                        ),
                    ));
                }
                stage_hosts.push(hosts[stage_members[0].0].name.clone());
                if let Some(odd) = stage.iter().find(|c| c.kind != stage[0].kind) {
                    return Err(self.err(
                        inst.chips.span(),
                        format!("{key}.chips"),
                        format!(
                            "stage {s} mixes `{}` ({}) and `{}` ({}): tensor-parallel chips are of one kind",
                            stage[0].id, stage[0].kind, odd.id, odd.kind
                        ),
                    ));
                }
            }
            let role = self.named(&inst.role, &format!("{key}.role"), first.role)?;
            let spans_hosts = stage_hosts.iter().any(|n| *n != stage_hosts[0]);
            if spans_hosts && role == Role::Prefill {
                let span = inst.role.as_ref().map_or(inst.chips.span(), Spanned::span);
                return Err(self.err(
                    span,
                    format!("{key}.role"),
                    format!(
                        "instance `{id}` has stages on hosts {}: a stage on another host cannot stage its layers' \
                         KV for a decode chip, so a prefill instance keeps its stages on one host (role \
                         \"decode\" or \"both\" may span hosts)",
                        stage_hosts.join(", ")
                    ),
                ));
            }
            let instance = ChipSpec::instance(id, role, ParallelSpec { tp, split, chips, stage_hosts });
            // Where its first chip was on the first stage's host; its chips leave every host.
            let at = members.iter().filter(|(mh, _, _)| *mh == h).map(|(_, at, _)| *at).min().unwrap_or(0);
            for (hi, host) in hosts.iter_mut().enumerate() {
                let mut folded = Vec::with_capacity(host.chips.len());
                for (c, chip) in host.chips.drain(..).enumerate() {
                    if hi == h && c == at {
                        folded.push(instance.clone());
                    }
                    if !members.iter().any(|(mh, m, _)| *mh == hi && *m == c) {
                        folded.push(chip);
                    }
                }
                host.chips = folded;
            }
        }
        Ok(hosts)
    }

    /// Each host that holds a stage of an instance running on another host gets its
    /// stage server's address (its `stages`, or the bus port + 3), distinct from every
    /// other socket of the cluster.
    fn stage_servers(
        &self,
        raw: &[Spanned<RawHost>],
        mut hosts: Vec<HostSpec>,
        gateway: &GatewaySpec,
    ) -> Result<Vec<HostSpec>, TopologyError> {
        let serving: Vec<bool> = hosts
            .iter()
            .map(|h| {
                hosts
                    .iter()
                    .flat_map(|o| &o.chips)
                    .filter_map(|c| c.parallel.as_ref())
                    .any(|p| p.stage_hosts.contains(&h.name) && p.stage_hosts[0] != h.name)
            })
            .collect();
        for (i, (raw_host, host)) in raw.iter().zip(hosts.iter_mut()).enumerate() {
            if !serving[i] {
                continue;
            }
            let r = raw_host.get_ref();
            let key = format!("hosts[{i}]");
            host.stages = Some(self.next_to_bus(&r.stages, &r.bus, &host.bus, &key, "stages", 3)?);
        }
        let mut others: Vec<(Endpoint, String)> = vec![(gateway.listen.into(), "gateway.listen".into())];
        for (i, h) in hosts.iter().enumerate() {
            for (a, f) in [(&h.bus, "bus"), (&h.events, "events"), (&h.transfer, "transfer")] {
                others.push((a.clone(), format!("hosts[{i}].{f}")));
            }
        }
        for (i, (raw_host, host)) in raw.iter().zip(&hosts).enumerate() {
            let Some(addr) = &host.stages else { continue };
            let clash = others.iter().find(|(a, _)| a == addr).map(|(_, k)| k.clone()).or_else(|| {
                hosts[..i].iter().position(|o| o.stages.as_ref() == Some(addr)).map(|j| format!("hosts[{j}].stages"))
            });
            if let Some(other) = clash {
                let r = raw_host.get_ref();
                let (span, note) = match &r.stages {
                    Some(v) => (v.span(), ""),
                    None => (r.bus.span(), " (by default: the bus port + 3)"),
                };
                return Err(self.err(
                    span,
                    format!("hosts[{i}].stages"),
                    format!(
                        "the stage server's address {addr}{note} is also {other}; give `hosts[{i}].stages` another"
                    ),
                ));
            }
        }
        Ok(hosts)
    }

    fn chip(&self, spanned: &Spanned<RawChip>, key: &str, context: &ChipContext) -> Result<ChipSpec, TopologyError> {
        let raw = spanned.get_ref();
        let id = self.name(&raw.id, &format!("{key}.id"))?;
        if let Some(kind) = &raw.kind
            && !context.resolves(kind.get_ref())
        {
            return Err(self.err(
                kind.span(),
                format!("{key}.kind"),
                format!("unknown chip kind `{}`; known kinds: {}", kind.get_ref(), context.known_kinds()),
            ));
        }
        let backend = self.backend(&raw.backend, &format!("{key}.backend"), context)?;
        let kind = match (&raw.kind, backend.emulated_kind()) {
            (Some(kind), Some(emulated)) if kind.get_ref() != emulated => {
                return Err(self.err(
                    kind.span(),
                    format!("{key}.kind"),
                    format!(
                        "kind `{}` differs from the kind the backend emulates (`emu:{emulated}`); \
                         make them equal or leave `kind` out",
                        kind.get_ref()
                    ),
                ));
            }
            (Some(kind), _) => kind.get_ref().clone(),
            (None, Some(emulated)) => emulated.to_owned(),
            (None, None) => {
                return Err(self.err(
                    spanned.span(),
                    format!("{key}.kind"),
                    "missing field `kind` (it may be left out only when the backend is \"emu:KIND\")",
                ));
            }
        };
        let role = self.named(&raw.role, &format!("{key}.role"), Role::Both)?;
        let memory_limit_bytes = raw
            .memory_limit
            .as_ref()
            .map(|limit| {
                self.memory(limit, &format!("{key}.memory_limit"), "leave it out for no limit", 1..=MAX_MEMORY_BYTES)
            })
            .transpose()?;
        let kv_dtype = self.named(&raw.kv_dtype, &format!("{key}.kv_dtype"), context.kv_dtype)?;
        Ok(ChipSpec {
            id,
            kind,
            backend,
            role,
            memory_limit_bytes,
            threads: self.field(&raw.threads, &format!("{key}.threads"), 1, in_range(1, MAX_THREADS))?,
            max_batch_tokens: self.field(
                &raw.max_batch_tokens,
                &format!("{key}.max_batch_tokens"),
                512,
                in_range(1, MAX_BATCH_TOKENS),
            )?,
            max_batch_seqs: self.field(
                &raw.max_batch_seqs,
                &format!("{key}.max_batch_seqs"),
                64,
                in_range(1, MAX_BATCH_SEQS),
            )?,
            max_mixed_step_ms: raw
                .max_mixed_step_ms
                .as_ref()
                .map(|ms| {
                    let key = format!("{key}.max_mixed_step_ms");
                    self.field(&Some(ms.clone()), &key, 0, in_range(1, MAX_STEP_MS))
                })
                .transpose()?,
            block_size: self.field(
                &raw.block_size,
                &format!("{key}.block_size"),
                context.block_size,
                in_range(1, MAX_BLOCK_SIZE),
            )?,
            kv_dtype,
            kv_layout: self.named(&raw.kv_layout, &format!("{key}.kv_layout"), KvLayout::HeadMajor)?,
            quantize: raw.quantize.as_ref().map(|q| self.parse(q, &format!("{key}.quantize"))).transpose()?,
            parallel: None,
            matmul_precision: self.named(
                &raw.matmul_precision,
                &format!("{key}.matmul_precision"),
                MatmulPrecision::F32,
            )?,
        })
    }

    fn backend(&self, value: &Spanned<String>, key: &str, context: &ChipContext) -> Result<Backend, TopologyError> {
        let backend = value.get_ref().as_str();
        let refuse = |message: String| Err(self.err(value.span(), key, message));
        if backend == "cpu" {
            return Ok(Backend::Cpu);
        }
        if let Some(path) = backend.strip_prefix("plugin:") {
            if path.trim().is_empty() {
                return refuse("`plugin:` needs the path of a kernel library, e.g. \"plugin:/opt/lib.so\"".to_owned());
            }
            return Ok(Backend::Plugin(self.resolve(path)));
        }
        if let Some(kind) = backend.strip_prefix("emu:") {
            if context.resolves(kind) {
                return Ok(Backend::Emu(kind.to_owned()));
            }
            return refuse(format!(
                "backend `{backend}` emulates an unknown chip kind `{kind}`; known kinds: {}",
                context.known_kinds()
            ));
        }
        if backend == "sim" {
            return refuse(
                "backend `sim` is not available yet in a topology; use \"cpu\", \"emu:KIND\" or \"plugin:PATH\""
                    .to_owned(),
            );
        }
        refuse(format!("unknown backend `{backend}`; expected \"cpu\", \"emu:KIND\" or \"plugin:PATH\""))
    }

    /// A memory size at `key`, within `range`; `zero_hint` says what to do instead of
    /// writing 0.
    fn memory(
        &self,
        value: &Spanned<toml::Value>,
        key: &str,
        zero_hint: &str,
        range: RangeInclusive<u64>,
    ) -> Result<u64, TopologyError> {
        let bytes = match value.get_ref() {
            toml::Value::Integer(bytes) => u64::try_from(*bytes).map_err(|_| format!("{bytes} is negative")),
            toml::Value::String(text) => parse_memory_size(text),
            other => {
                Err(format!("expected bytes as an integer or a string like \"512MiB\", found a {}", other.type_str()))
            }
        };
        match bytes {
            Ok(0) => Err(self.err(value.span(), key, format!("must be more than 0 bytes; {zero_hint}"))),
            Ok(bytes) if !range.contains(&bytes) => Err(self.err(
                value.span(),
                key,
                format!(
                    "{bytes} bytes is out of range: from {} to {}",
                    binary_size(*range.start()),
                    binary_size(*range.end())
                ),
            )),
            Ok(bytes) => Ok(bytes),
            Err(message) => Err(self.err(value.span(), key, message)),
        }
    }

    fn gateway(&self, raw: Option<&RawGateway>, hosts: &[HostSpec]) -> Result<GatewaySpec, TopologyError> {
        let defaults = GatewaySpec {
            host: hosts.first().map(|host| host.name.clone()).unwrap_or_default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            served_model_name: None,
            max_inflight_requests: 256,
            max_connections: 1024,
            header_read_timeout_ms: 10_000,
            max_prompt_bytes: None,
            keys_file: None,
            audit_log: None,
        };
        let Some(raw) = raw else { return Ok(defaults) };
        let host = match &raw.host {
            None => defaults.host,
            Some(host) => {
                if !hosts.iter().any(|known| &known.name == host.get_ref()) {
                    let names: Vec<&str> = hosts.iter().map(|host| host.name.as_str()).collect();
                    return Err(self.err(
                        host.span(),
                        "gateway.host",
                        format!("`{}` is not a host of this cluster; hosts: {}", host.get_ref(), names.join(", ")),
                    ));
                }
                host.get_ref().clone()
            }
        };
        let listen = match &raw.listen {
            None => defaults.listen,
            Some(listen) => self.bind_address(listen, "gateway.listen")?,
        };
        let served_model_name = match &raw.served_model_name {
            Some(name) if name.get_ref().trim().is_empty() => {
                return Err(self.err(name.span(), "gateway.served_model_name", "must not be empty"));
            }
            other => other.as_ref().map(|name| name.get_ref().clone()),
        };
        let max_inflight_requests = self.field(
            &raw.max_inflight_requests,
            "gateway.max_inflight_requests",
            defaults.max_inflight_requests,
            in_range(1, MAX_REQUESTS),
        )?;
        let max_connections = self.field(
            &raw.max_connections,
            "gateway.max_connections",
            defaults.max_connections,
            in_range(1, MAX_CONNECTIONS),
        )?;
        let header_read_timeout_ms = self.field(
            &raw.header_read_timeout_ms,
            "gateway.header_read_timeout_ms",
            defaults.header_read_timeout_ms,
            in_range(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS),
        )?;
        // No default: unset, the gateway derives it from the model.
        let max_prompt_bytes = raw
            .max_prompt_bytes
            .is_some()
            .then(|| self.field(&raw.max_prompt_bytes, "gateway.max_prompt_bytes", 0, in_range(1, MAX_PROMPT_BYTES)))
            .transpose()?;
        let path = |value: &Option<Spanned<String>>, key: &str| match value {
            Some(path) if path.get_ref().trim().is_empty() => Err(self.err(path.span(), key, "must not be empty")),
            other => Ok(other.as_ref().map(|path| self.resolve(path.get_ref()))),
        };
        Ok(GatewaySpec {
            host,
            listen,
            served_model_name,
            max_inflight_requests,
            max_connections,
            header_read_timeout_ms,
            max_prompt_bytes,
            keys_file: path(&raw.keys_file, "gateway.keys_file")?,
            audit_log: path(&raw.audit_log, "gateway.audit_log")?,
        })
    }

    /// `[[tenants]]`: distinct names, and keys to tell them apart.
    fn tenants(
        &self,
        raw: &[Spanned<RawTenant>],
        raw_gateway: Option<&RawGateway>,
        gateway: &GatewaySpec,
    ) -> Result<Vec<TenantSpec>, TopologyError> {
        let Some(first) = raw.first() else { return Ok(Vec::new()) };
        if gateway.keys_file.is_none() {
            let span = raw_gateway.map_or_else(|| first.span(), |_| first.get_ref().name.span());
            return Err(self.err(
                span,
                "tenants",
                "tenants are told apart by their API keys: set gateway.keys_file and add keys with `tessera keys add --file FILE --tenant NAME`",
            ));
        }
        let mut tenants: Vec<TenantSpec> = Vec::with_capacity(raw.len());
        for (i, tenant) in raw.iter().enumerate() {
            let tenant = tenant.get_ref();
            let key = |k: &str| format!("tenants[{i}].{k}");
            let name = self.name(&tenant.name, &key("name"))?;
            if name.len() > 64 {
                return Err(self.err(tenant.name.span(), key("name"), "is longer than 64 characters"));
            }
            if tenants.iter().any(|t| t.name == name) {
                return Err(self.err(tenant.name.span(), key("name"), format!("tenant `{name}` is listed twice")));
            }
            let models = match &tenant.models {
                None => None,
                Some(models) if models.get_ref().is_empty() => {
                    return Err(self.err(
                        models.span(),
                        key("models"),
                        "an empty list lets the tenant use no model; leave it out to allow every model",
                    ));
                }
                Some(models) => Some(models.get_ref().iter().map(|m| m.get_ref().clone()).collect()),
            };
            let limits = match tenant.limits.as_ref().map(Spanned::get_ref) {
                None => TenantLimits::default(),
                Some(limits) => {
                    let positive = |value: &Option<Spanned<u64>>, k: &str| {
                        value
                            .is_some()
                            .then(|| self.field(value, &key(&format!("limits.{k}")), 0, in_range(1, 1 << 40)))
                            .transpose()
                    };
                    let count = |value: &Option<Spanned<usize>>, k: &str| {
                        value
                            .is_some()
                            .then(|| self.field(value, &key(&format!("limits.{k}")), 0, in_range(1, MAX_REQUESTS)))
                            .transpose()
                    };
                    TenantLimits {
                        requests_per_min: positive(&limits.requests_per_min, "requests_per_min")?,
                        tokens_per_min: positive(&limits.tokens_per_min, "tokens_per_min")?,
                        max_concurrent: count(&limits.max_concurrent, "max_concurrent")?,
                        max_tokens: count(&limits.max_tokens, "max_tokens")?,
                    }
                }
            };
            let weight = self.field(&tenant.weight, &key("weight"), 1, in_range(1, 1000))?;
            let priority = self.named(&tenant.priority, &key("priority"), PriorityClass::Standard)?;
            tenants.push(TenantSpec {
                name,
                weight,
                priority,
                models,
                share_prefix_cache: tenant.share_prefix_cache.as_ref().is_some_and(|s| *s.get_ref()),
                limits,
            });
        }
        Ok(tenants)
    }

    fn bus(&self, raw: Option<&RawBus>) -> Result<BusSpec, TopologyError> {
        let defaults = BusSpec::default();
        let Some(raw) = raw else { return Ok(defaults) };
        Ok(BusSpec {
            max_frame_bytes: self.field(
                &raw.max_frame_bytes,
                "bus.max_frame_bytes",
                defaults.max_frame_bytes,
                in_range(MIN_FRAME_BYTES, MAX_FRAME_BYTES),
            )?,
            handshake_timeout_ms: self.field(
                &raw.handshake_timeout_ms,
                "bus.handshake_timeout_ms",
                defaults.handshake_timeout_ms,
                in_range(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS),
            )?,
            resolve_timeout_ms: self.field(
                &raw.resolve_timeout_ms,
                "bus.resolve_timeout_ms",
                defaults.resolve_timeout_ms,
                in_range(0, 3_600_000),
            )?,
        })
    }

    /// `[security]`: the mode defaults to `encrypt` as soon as one host address is not
    /// loopback. Keys are checked where they are used: a node refuses to start a secured
    /// mode without them (a simulated scenario's hosts need none).
    fn security(&self, raw: Option<&Spanned<RawSecurity>>, hosts: &[HostSpec]) -> Result<SecuritySpec, TopologyError> {
        let all_loopback = hosts.iter().all(|h| {
            [Some(&h.bus), Some(&h.events), Some(&h.transfer), h.stages.as_ref()]
                .into_iter()
                .flatten()
                .all(Endpoint::is_loopback)
        });
        let default_mode = if all_loopback { SecurityMode::Off } else { SecurityMode::Encrypt };
        let Some(spanned) = raw else {
            return Ok(SecuritySpec { mode: default_mode, ..SecuritySpec::default() });
        };
        let raw_ref = spanned.get_ref();
        let mode = self.named(&raw_ref.mode, "security.mode", default_mode)?;
        let cipher = self.named(&raw_ref.cipher, "security.cipher", Cipher::default())?;
        let path = |value: &Option<Spanned<String>>, key: &str| match value {
            Some(path) if path.get_ref().trim().is_empty() => Err(self.err(path.span(), key, "must not be empty")),
            other => Ok(other.as_ref().map(|path| self.resolve(path.get_ref()))),
        };
        let keys_dir = path(&raw_ref.keys_dir, "security.keys_dir")?;
        let at_rest_key_file = path(&raw_ref.at_rest_key_file, "security.at_rest_key_file")?;
        Ok(SecuritySpec { mode, cipher, keys_dir, at_rest_key_file })
    }

    /// Two sockets bound to one address would fail at start-up, on some host, late.
    fn sockets_are_distinct(
        &self,
        raw_hosts: &[Spanned<RawHost>],
        hosts: &[HostSpec],
        raw_gateway: Option<&RawGateway>,
        gateway: &GatewaySpec,
    ) -> Result<(), TopologyError> {
        // (address, key, span, note for a defaulted address)
        let mut sockets: Vec<(Endpoint, String, Range<usize>, &str)> = Vec::new();
        for (h, (raw, host)) in raw_hosts.iter().zip(hosts).enumerate() {
            let raw = raw.get_ref();
            sockets.push((host.bus.clone(), format!("hosts[{h}].bus"), raw.bus.span(), ""));
            let defaults = [
                (host.events.clone(), "events", &raw.events, " (by default: the bus port + 1)"),
                (host.transfer.clone(), "transfer", &raw.transfer, " (by default: the bus port + 2)"),
            ];
            for (address, field, value, note) in defaults {
                let key = format!("hosts[{h}].{field}");
                match value {
                    Some(value) => sockets.push((address, key, value.span(), "")),
                    None => sockets.push((address, key, raw.bus.span(), note)),
                }
            }
        }
        let gateway_span = raw_gateway.and_then(|raw| raw.listen.as_ref()).map_or(0..0, Spanned::span);
        let gateway_note = if raw_gateway.is_some_and(|raw| raw.listen.is_some()) { "" } else { " (by default)" };
        sockets.push((gateway.listen.into(), "gateway.listen".to_owned(), gateway_span, gateway_note));

        let mut seen: HashMap<&Endpoint, usize> = HashMap::new();
        for (i, (address, key, span, note)) in sockets.iter().enumerate() {
            if let Some(&first) = seen.get(address) {
                let (_, first_key, first_span, first_note) = &sockets[first];
                return Err(self.err(
                    span.clone(),
                    key.clone(),
                    format!(
                        "address {address}{note} is already taken by `{first_key}`{first_note} (line {}); \
                         every socket needs its own address",
                        self.line_of(first_span)
                    ),
                ));
            }
            seen.insert(address, i);
        }
        Ok(())
    }

    /// Every request ends on a chip that decodes, so a cluster needs one. It needs no
    /// chip with role "prefill" or "both", though: a decode chip prefills prompts shorter
    /// than `disagg.min_prompt_tokens` itself (conditional disaggregation), and every
    /// prompt while no chip that prefills is up, so a cluster of decode chips serves
    /// like a colocated one.
    fn some_chip_decodes(&self, raw_hosts: &[Spanned<RawHost>], hosts: &[HostSpec]) -> Result<(), TopologyError> {
        if hosts.iter().flat_map(|host| &host.chips).any(|chip| chip.role.decodes()) {
            return Ok(());
        }
        // Every chip is a prefill chip, so its role is written: point at the first.
        let (span, key) = match raw_hosts.first().and_then(|host| host.get_ref().chips.first()) {
            Some(chip) => match &chip.get_ref().role {
                Some(role) => (role.span(), "hosts[0].chips[0].role"),
                None => (chip.span(), "hosts[0].chips[0]"),
            },
            None => (0..0, "hosts"),
        };
        Err(self.err(
            span,
            key,
            "no chip can decode: every chip has role = \"prefill\", so no request could finish; \
             give at least one chip role = \"decode\" or \"both\"",
        ))
    }
}

impl Checker<'_> {
    /// A prefill chip hands its KV to decode chips, which continue with their own
    /// weights: every chip of those roles must load the same ones (the KV compatibility
    /// hash would refuse the pair at run time; this says so before anything starts).
    fn kv_peers_quantize_alike(&self, raw_hosts: &[Spanned<RawHost>], hosts: &[HostSpec]) -> Result<(), TopologyError> {
        let mut first: Option<(String, Option<crate::Quantize>)> = None;
        for (h, (raw_host, host)) in raw_hosts.iter().zip(hosts).enumerate() {
            for (c, (raw_chip, chip)) in raw_host.get_ref().chips.iter().zip(&host.chips).enumerate() {
                if chip.role == Role::Both {
                    continue;
                }
                let Some((first_id, q)) = &first else {
                    first = Some((chip.id.clone(), chip.quantize));
                    continue;
                };
                if *q != chip.quantize {
                    let span = raw_chip.get_ref().quantize.as_ref().map_or(raw_chip.span(), |q| q.span());
                    let name = |q: Option<crate::Quantize>| q.map_or("none".to_owned(), |q| q.to_string());
                    return Err(self.err(
                        span,
                        format!("hosts[{h}].chips[{c}].quantize"),
                        format!(
                            "chip {:?} quantizes to {} but {first_id:?} to {}: prefill and decode chips exchange \
                             KV and must load the same weights; give them the same `quantize`",
                            chip.id,
                            name(chip.quantize),
                            name(*q)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

enum PathKind {
    File,
    /// A checkpoint directory or a single-file (GGUF) model.
    Model,
}

/// Why `path`, the `what` that `host` (which runs here) needs, is unusable: missing, not
/// a `kind` (then `hint` says what is expected), or unreadable; `None` when usable.
fn unusable(path: &Path, kind: PathKind, what: &str, hint: &str, host: &HostSpec) -> Option<String> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Some(format!(
                "{what} `{}` does not exist on this machine, where host `{}` runs (bus {} is local)",
                path.display(),
                host.name,
                host.bus
            ));
        }
        Err(e) => return Some(format!("cannot read {what} `{}`: {e}", path.display())),
    };
    let (usable, noun) = match kind {
        PathKind::File => (meta.is_file(), "file"),
        PathKind::Model => {
            (meta.is_dir() || (meta.is_file() && has_gguf_magic(path)), "checkpoint directory nor a GGUF file")
        }
    };
    (!usable).then(|| match kind {
        PathKind::Model => format!("`{}` is neither a {noun}; {hint}", path.display()),
        PathKind::File => format!("`{}` is not a {noun}; {hint}", path.display()),
    })
}

/// Does the file start like a GGUF model?
fn has_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && &magic == b"GGUF"
}

/// `bytes` in the largest binary unit that divides it: `1 MiB`, `1 PiB`, `3 bytes`.
fn binary_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] =
        [("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    match UNITS.iter().find(|(_, size)| bytes >= *size && bytes.is_multiple_of(*size)) {
        Some((unit, size)) => format!("{} {unit}", bytes / size),
        None if bytes == 1 => "1 byte".to_owned(),
        None => format!("{bytes} bytes"),
    }
}

/// Bytes in `"512MiB"`, `"2 GB"`, `"4096"`: an integer and an optional unit, B, KB,
/// MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), any case.
pub(crate) fn parse_memory_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let bad = || format!("`{text}` is not a memory size such as \"512MiB\", \"2GB\" or 1048576 (bytes)");
    if digits.is_empty() {
        return Err(bad());
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|count| count.checked_mul(multiplier))
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// Each table of the schema (dotted path, empty for the top level) with the keys serde
/// reads into it, for the reference's completeness test (`crate::reference`).
#[cfg(test)]
pub(crate) fn schema_tables() -> Vec<(&'static str, &'static [&'static str])> {
    use crate::reference::introspect::fields_of;
    vec![
        ("", fields_of::<RawDoc>()),
        ("cluster", fields_of::<RawCluster>()),
        ("router", fields_of::<RawRouter>()),
        ("supervisor", fields_of::<RawSupervisor>()),
        ("solver", fields_of::<RawSolver>()),
        ("gateway", fields_of::<RawGateway>()),
        ("bus", fields_of::<RawBus>()),
        ("security", fields_of::<RawSecurity>()),
        ("emulation", fields_of::<RawEmulation>()),
        ("disagg", fields_of::<RawDisagg>()),
        ("chip_kinds", fields_of::<RawChipKind>()),
        ("hosts", fields_of::<RawHost>()),
        ("hosts.chips", fields_of::<RawChip>()),
        ("instances", fields_of::<RawInstance>()),
        ("tenants", fields_of::<RawTenant>()),
        ("tenants.limits", fields_of::<RawTenantLimits>()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes() {
        let table: &[(&str, Option<u64>)] = &[
            ("4096", Some(4096)),
            ("512B", Some(512)),
            ("1KB", Some(1000)),
            ("1kib", Some(1024)),
            ("512MiB", Some(512 << 20)),
            ("512 MiB", Some(512 << 20)),
            ("3mb", Some(3_000_000)),
            ("2GB", Some(2_000_000_000)),
            ("2GiB", Some(2 << 30)),
            ("1TiB", Some(1 << 40)),
            ("0", Some(0)),
            ("", None),
            ("MiB", None),
            ("1.5GiB", None),
            ("-1", None),
            ("12 parsecs", None),
            ("99999999999TiB", None),
        ];
        for (text, expected) in table {
            assert_eq!(parse_memory_size(text).ok(), *expected, "{text:?}");
        }
    }
}
