//! Scenario TOML: a topology (a file, or embedded), a workload, SLOs, the network's
//! figures and a seed, validated like a topology — serde reads spanned raw tables
//! (unknown keys refused), then every value is checked here so that each error names the
//! file, line, column and dotted key (the topology crate's [`TopologyError`]).
//!
//! ```toml
//! seed = 7
//! topology = "../../topology/default.toml"   # relative to this file; or topology_toml = '''...'''
//! colocated = true        # optional: every chip runs both phases, as `tessera up --colocated`
//! [workload]
//! rate_rps = 4.0          # Poisson arrivals
//! requests = 200          # or duration_s = 60
//! isl = "uniform:64-512"  # as `tessera bench serve --isl`
//! osl = "uniform:16-128"
//! [slo]
//! ttft_ms = 500
//! tpot_ms = 50
//! [network]               # optional
//! bus_latency_us = 50     # a bus message between hosts
//! kv_bandwidth_gbs = 12.5 # a KV hand-off between hosts
//! kv_latency_us = 20
//! # Or tenants, each its own Poisson load (the [workload] then gives duration_s, and
//! # isl/osl as the tenants' defaults): the report gives each one's TTFT, TPOT and share.
//! # [[workload.tenants]]
//! # name = "chat"
//! # rate_rps = 2.0
//! # weight = 2              # fair queuing weight (default 1)
//! # priority = "interactive" # interactive, standard (default) or batch
//! # osl = "32"              # overrides the [workload]'s
//! [perf_models]           # optional: a chip kind's calibrated model (`tessera calibrate`)
//! cpu = "cpu-calibrated.toml"
//! [prices]                # optional: $ per chip-hour, instead of the catalog's
//! ascend-910b = 4.0
//! ```

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
pub use tessera_topology::perf::PerfModel;
use tessera_topology::{ClusterSpec, TopologyError};
use tessera_workload::multiturn::MultiTurn;
use tessera_workload::{LengthDist, SharedPrefix};
use toml::Spanned;

/// The most requests one scenario may plan.
pub const MAX_REQUESTS: u64 = 10_000_000;
/// Most system prompts, and most words in one, of a shared-prefix workload.
const MAX_PREFIX: i64 = 1_000_000;
/// The longest workload, in seconds (a day).
pub const MAX_DURATION_S: f64 = 86_400.0;
/// The highest arrival rate, requests per second.
pub const MAX_RATE_RPS: f64 = 1e6;

/// A validated scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Where it was read from.
    pub source: String,
    pub topology: ClusterSpec,
    /// The directory a relative model path of the topology is resolved against.
    pub base_dir: PathBuf,
    pub workload: WorkloadSpec,
    pub slo: Slo,
    pub network: Network,
    pub seed: u64,
    /// Faults to inject, in time order.
    pub faults: Vec<FaultAt>,
    /// Calibrated performance models by chip kind (`[perf_models]`): chips of these
    /// kinds are timed by them instead of the topology's flat efficiencies.
    pub perf_models: BTreeMap<String, PerfModel>,
    /// $ per chip-hour by chip kind (`[prices]`), over the catalog's.
    pub prices: BTreeMap<String, f64>,
}

impl Scenario {
    /// The scenario with Poisson or gamma arrivals at `rate_rps` instead of its own
    /// rate (a duration-sized workload then plans that rate's requests). A trace or a
    /// rate schedule keeps its own timing, so it is refused.
    pub fn at_rate(&self, rate_rps: f64) -> Result<Scenario, String> {
        if !(rate_rps > 0.0 && rate_rps <= MAX_RATE_RPS) {
            return Err(format!("a rate must be more than 0 and at most 1e6 requests/s, not {rate_rps}"));
        }
        match &self.workload.requests {
            WorkloadRequests::Synthetic { schedule: None, size, .. } => {
                if let WorkloadSize::DurationS(d) = size
                    && rate_rps * d > MAX_REQUESTS as f64
                {
                    return Err(format!("{d} s at {rate_rps} req/s is more than {MAX_REQUESTS} requests"));
                }
                let mut at = self.clone();
                at.workload.rate_rps = rate_rps;
                Ok(at)
            }
            WorkloadRequests::Synthetic { schedule: Some(_), .. } => {
                Err(format!("{}: its workload follows a rate_schedule; a rate cannot replace it", self.source))
            }
            WorkloadRequests::Trace(_) => {
                Err(format!("{}: its workload replays a trace; a rate cannot replace it", self.source))
            }
            WorkloadRequests::Tenants { .. } => {
                Err(format!("{}: each of its tenants has a rate of its own; one rate cannot replace them", self.source))
            }
            WorkloadRequests::Chats { concurrency: Some(_), .. } => {
                Err(format!("{}: its chats run a closed loop (`concurrency`); a rate cannot replace it", self.source))
            }
            WorkloadRequests::Chats { concurrency: None, shape, .. } => {
                // The rate is of chats started; the workload's is of their turns.
                let mut at = self.clone();
                at.workload.rate_rps = rate_rps * f64::from(shape.turns);
                Ok(at)
            }
        }
    }

    /// How chips of `kind` are timed: the scenario's calibrated model of it, else the
    /// topology's (`[emulation.perf_models]`), else the topology's flat efficiencies.
    pub fn perf_model(&self, kind: &str) -> PerfModel {
        self.perf_models.get(kind).copied().unwrap_or_else(|| self.topology.emulation.perf_model_of(kind))
    }

    /// $ per hour of a chip of `kind`: the scenario's price, else the catalog's (or the
    /// topology's `[[chip_kinds]]` entry's); `None` when neither has one.
    pub fn price(&self, kind: &str) -> Option<f64> {
        self.prices
            .get(kind)
            .copied()
            .or_else(|| self.topology.chip_kind(kind).and_then(|k| k.price.as_ref()).map(|p| p.usd_per_hour))
    }
}

/// A fault at `at_s` seconds after the workload starts (`[[faults]]`).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultAt {
    pub at_s: f64,
    pub fault: FaultKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// The chip's worker dies (`kind = "chip_crash"`, `chip = ID`); its supervisor
    /// restarts it as it would a real one.
    ChipCrash { chip: String },
    /// The chip goes offline (`kind = "chip_down"`, `chip = ID`): its requests re-route
    /// and it stays down, with no restart, until a `chip_up`.
    ChipDown { chip: String },
    /// A chip taken down by `chip_down` is back (`kind = "chip_up"`, `chip = ID`) and
    /// starts afresh.
    ChipUp { chip: String },
    /// The host stops (`kind = "host_down"`, `host = NAME`): its chips and supervisor are
    /// gone for the rest of the run.
    HostDown { host: String },
    /// KV hand-offs over the network into or out of the host take `factor` times as
    /// long (`kind = "link_slow"`, `host = NAME`, `factor = F`, from 1 to 10,000; 1
    /// restores the link). Within a host, chips' own links are unaffected.
    LinkSlow { host: String, factor: f64 },
}

impl FaultKind {
    /// What happened, for the report's fault marks.
    pub fn describe(&self) -> String {
        match self {
            FaultKind::ChipCrash { chip } => format!("chip {chip} crashed"),
            FaultKind::ChipDown { chip } => format!("chip {chip} down"),
            FaultKind::ChipUp { chip } => format!("chip {chip} up"),
            FaultKind::HostDown { host } => format!("host {host} down"),
            FaultKind::LinkSlow { host, factor } if *factor == 1.0 => format!("host {host}'s link restored"),
            FaultKind::LinkSlow { host, factor } => format!("host {host}'s link {factor}x slower"),
        }
    }
}

/// The requests of a run, and their mean arrival rate.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub rate_rps: f64,
    pub requests: WorkloadRequests,
}

/// Where the requests come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadRequests {
    /// Open-loop Poisson arrivals at `rate_rps` of requests of these lengths.
    Synthetic {
        size: WorkloadSize,
        /// Gamma arrivals with gaps of this coefficient of variation (`arrivals =
        /// "gamma"`, `cv`); `None`: Poisson.
        cv: Option<f64>,
        /// Poisson arrivals whose rate steps over time (`rate_schedule`); `None`: at
        /// `rate_rps` throughout.
        schedule: Option<Vec<(f64, f64)>>,
        isl: LengthDist,
        osl: LengthDist,
        /// Requests in groups sharing a system prompt (`prefix_groups` of
        /// `prefix_words` words, before each request's own `isl` words), as
        /// `bench serve --prefix-groups`.
        shared: Option<SharedPrefix>,
    },
    /// Several tenants' loads, each open-loop Poisson arrivals of its own, over one
    /// duration (`[[workload.tenants]]`); the topology's tenants are theirs.
    Tenants { duration_s: f64, loads: Vec<TenantLoad> },
    /// A trace in Mooncake's JSONL format (`[workload] trace = "FILE"`), replayed as
    /// `bench serve --trace` does: its arrival times, lengths and shared blocks.
    Trace(Vec<tessera_workload::trace::TraceRequest>),
    /// Multi-turn chats, as `bench serve --multi-turn` sends them: each turn once the
    /// last is answered, its prompt the last prompt, its answer and a user message of
    /// `isl` words; every answer `osl` tokens; each chat opening with its group's system
    /// prompt when `shared`. `concurrency` chats are under way at once (a new one starts
    /// as one ends), or, without it, chats start as Poisson arrivals at the workload's
    /// `rate_rps` (then chats a second).
    Chats { shape: MultiTurn, concurrency: Option<u32>, isl: LengthDist, osl: LengthDist, shared: Option<SharedPrefix> },
}

/// One tenant's load in a multi-tenant workload.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLoad {
    /// Its name, weight and class, as a topology's `[[tenants]]` gives them.
    pub tenant: tessera_topology::TenantSpec,
    pub rate_rps: f64,
    pub isl: LengthDist,
    pub osl: LengthDist,
}

/// How many requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WorkloadSize {
    Requests(usize),
    /// Every arrival within this many seconds.
    DurationS(f64),
}

/// The service level a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// What the topology does not say about the network between hosts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// A bus message from one host to another.
    pub bus_latency: Duration,
    /// KV hand-offs between chips of different hosts.
    pub kv_bandwidth_gbs: f64,
    pub kv_latency: Duration,
}

impl Default for Network {
    /// A 100 Gb/s Ethernet fabric: 12.5 GB/s, 20 us per transfer, 50 us per bus message.
    fn default() -> Self {
        let fabric = tessera_topology::perf::Link::ETHERNET_100G;
        Network {
            bus_latency: Duration::from_micros(50),
            kv_bandwidth_gbs: fabric.bandwidth_gbs,
            kv_latency: Duration::from_secs_f64(fabric.latency_s),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    #[serde(default)]
    seed: Option<Spanned<i64>>,
    #[serde(default)]
    topology: Option<Spanned<String>>,
    #[serde(default)]
    topology_toml: Option<Spanned<String>>,
    #[serde(default)]
    colocated: bool,
    workload: Spanned<RawWorkload>,
    slo: Spanned<RawSlo>,
    #[serde(default)]
    network: Option<Spanned<RawNetwork>>,
    #[serde(default)]
    faults: Vec<Spanned<RawFault>>,
    #[serde(default)]
    perf_models: BTreeMap<String, Spanned<String>>,
    #[serde(default)]
    prices: BTreeMap<String, Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFault {
    at_s: Spanned<toml::Value>,
    kind: Spanned<String>,
    #[serde(default)]
    chip: Option<Spanned<String>>,
    #[serde(default)]
    host: Option<Spanned<String>>,
    #[serde(default)]
    factor: Option<Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkload {
    #[serde(default)]
    arrivals: Option<Spanned<String>>,
    #[serde(default)]
    rate_rps: Option<Spanned<toml::Value>>,
    #[serde(default)]
    requests: Option<Spanned<i64>>,
    #[serde(default)]
    duration_s: Option<Spanned<toml::Value>>,
    #[serde(default)]
    isl: Option<Spanned<String>>,
    #[serde(default)]
    osl: Option<Spanned<String>>,
    #[serde(default)]
    trace: Option<Spanned<String>>,
    #[serde(default)]
    cv: Option<Spanned<toml::Value>>,
    #[serde(default)]
    rate_schedule: Option<Spanned<toml::Value>>,
    #[serde(default)]
    prefix_groups: Option<Spanned<i64>>,
    #[serde(default)]
    prefix_words: Option<Spanned<i64>>,
    #[serde(default)]
    conversations: Option<Spanned<i64>>,
    #[serde(default)]
    turns: Option<Spanned<i64>>,
    #[serde(default)]
    concurrency: Option<Spanned<i64>>,
    #[serde(default)]
    tenants: Vec<Spanned<RawTenantLoad>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenantLoad {
    name: Spanned<String>,
    rate_rps: Spanned<toml::Value>,
    #[serde(default)]
    weight: Option<Spanned<i64>>,
    #[serde(default)]
    priority: Option<Spanned<String>>,
    #[serde(default)]
    isl: Option<Spanned<String>>,
    #[serde(default)]
    osl: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlo {
    ttft_ms: Spanned<toml::Value>,
    tpot_ms: Spanned<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    #[serde(default)]
    bus_latency_us: Option<Spanned<toml::Value>>,
    #[serde(default)]
    kv_bandwidth_gbs: Option<Spanned<toml::Value>>,
    #[serde(default)]
    kv_latency_us: Option<Spanned<toml::Value>>,
}

/// Reads and validates the scenario at `path`; a relative `topology` path is read from
/// the scenario's directory.
pub fn load(path: &Path) -> Result<Scenario, TopologyError> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TopologyError::file(&source, format!("cannot read the scenario file: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    parse(&text, &source, &dir)
}

/// Reads and validates a workload file (a scenario without a topology: `[workload]`,
/// `[slo]` and the rest) and runs it on the topology at `topology`. A workload file that
/// names a topology of its own is refused, naming the key.
pub fn load_with_topology(workload: &Path, topology: &Path) -> Result<Scenario, TopologyError> {
    let source = workload.display().to_string();
    let text = std::fs::read_to_string(workload)
        .map_err(|e| TopologyError::file(&source, format!("cannot read the workload file: {e}")))?;
    let dir = workload.parent().unwrap_or(Path::new(""));
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let spec = tessera_topology::load(topology)?;
    parse_on(&text, &source, &dir, Some(spec))
}

/// Parses and validates scenario `text` (named `source` in errors); relative paths are
/// resolved against `dir`.
pub fn parse(text: &str, source: &str, dir: &Path) -> Result<Scenario, TopologyError> {
    parse_on(text, source, dir, None)
}

/// [`parse`], on `given` instead of a topology of the text's own when one is given.
fn parse_on(text: &str, source: &str, dir: &Path, given: Option<ClusterSpec>) -> Result<Scenario, TopologyError> {
    let raw: RawScenario = toml::from_str(text).map_err(|e| TopologyError::from_toml(source, text, &e))?;
    let at =
        |span: Range<usize>, key: &str, message: String| TopologyError::at(source, text, span, key.into(), message);

    let seed = match raw.seed {
        Some(s) if *s.get_ref() < 0 => {
            return Err(at(s.span(), "seed", format!("must be 0 or more, got {}", s.get_ref())));
        }
        Some(s) => *s.get_ref() as u64,
        None => 0,
    };

    let refuse = "a workload file names no topology: `--topology` gives it";
    let topology = match (given, &raw.topology, &raw.topology_toml) {
        (Some(_), Some(path), _) => return Err(at(path.span(), "topology", refuse.into())),
        (Some(_), None, Some(inline)) => return Err(at(inline.span(), "topology_toml", refuse.into())),
        (Some(spec), None, None) => spec,
        (None, Some(path), None) => {
            let file = dir.join(path.get_ref());
            match tessera_topology::load(&file) {
                Ok(spec) => spec,
                // The file itself is missing or unreadable: the scenario's key is wrong.
                Err(e) if e.line == 0 => return Err(at(path.span(), "topology", e.to_string())),
                Err(e) => return Err(e),
            }
        }
        (None, None, Some(inline)) => embedded_topology(source, text, inline, dir)?,
        (None, Some(_), Some(inline)) => {
            return Err(at(
                inline.span(),
                "topology_toml",
                "give `topology` (a file) or `topology_toml`, not both".into(),
            ));
        }
        (None, None, None) => {
            return Err(TopologyError::at(
                source,
                text,
                0..0,
                "topology".into(),
                "missing: give `topology = \"FILE\"` or `topology_toml = '''...'''`".into(),
            ));
        }
    };

    let mut topology = topology;
    if raw.colocated {
        // As `tessera up --colocated`: the same chips, every one running both phases.
        for chip in topology.hosts.iter_mut().flat_map(|h| h.chips.iter_mut()) {
            chip.role = tessera_topology::Role::Both;
        }
    }

    let workload = workload(raw.workload.get_ref(), raw.workload.span(), dir, &at)?;
    if let WorkloadRequests::Tenants { loads, .. } = &workload.requests {
        if !topology.tenants.is_empty() {
            let why = "the topology lists [[tenants]] and the workload too: give them in one place".into();
            return Err(at(raw.workload.span(), "workload.tenants", why));
        }
        topology.tenants = loads.iter().map(|l| l.tenant.clone()).collect();
    }

    let positive_ms = |x: f64| x > 0.0 && x <= 86_400_000.0;
    let slo = Slo {
        ttft_ms: number(
            &raw.slo.get_ref().ttft_ms,
            "slo.ttft_ms",
            positive_ms,
            "more than 0 and at most 86400000",
            &at,
        )?,
        tpot_ms: number(
            &raw.slo.get_ref().tpot_ms,
            "slo.tpot_ms",
            positive_ms,
            "more than 0 and at most 86400000",
            &at,
        )?,
    };

    let mut network = Network::default();
    if let Some(n) = &raw.network {
        let n = n.get_ref();
        let us = |x: f64| (0.0..=1e6).contains(&x);
        if let Some(v) = &n.bus_latency_us {
            let x = number(v, "network.bus_latency_us", us, "0..=1000000", &at)?;
            network.bus_latency = Duration::from_secs_f64(x / 1e6);
        }
        if let Some(v) = &n.kv_bandwidth_gbs {
            network.kv_bandwidth_gbs =
                number(v, "network.kv_bandwidth_gbs", |x| (0.01..=1e5).contains(&x), "0.01..=100000", &at)?;
        }
        if let Some(v) = &n.kv_latency_us {
            let x = number(v, "network.kv_latency_us", us, "0..=1000000", &at)?;
            network.kv_latency = Duration::from_secs_f64(x / 1e6);
        }
    }
    let faults = faults(&raw.faults, &topology, &at)?;
    let known_kind = |kind: &str, key: &str, span: Range<usize>| match topology.chip_kind(kind) {
        Some(_) => Ok(()),
        None => {
            let kinds = tessera_topology::catalog::names_with(&topology.chip_kinds);
            Err(at(span, key, format!("no chip kind `{kind}`; kinds: {kinds}")))
        }
    };
    let mut perf_models = BTreeMap::new();
    for (kind, file) in &raw.perf_models {
        let key = format!("perf_models.{kind}");
        known_kind(kind, &key, file.span())?;
        let model =
            tessera_topology::read_perf_model(&dir.join(file.get_ref())).map_err(|why| at(file.span(), &key, why))?;
        perf_models.insert(kind.clone(), model);
    }
    let mut prices = BTreeMap::new();
    for (kind, price) in &raw.prices {
        let key = format!("prices.{kind}");
        known_kind(kind, &key, price.span())?;
        let range = tessera_topology::catalog::PRICE_USD_PER_HOUR_RANGE;
        let usd = number(price, &key, |x| range.contains(&x), "a price from 0.0001 to 100000 $/h", &at)?;
        prices.insert(kind.clone(), usd);
    }
    Ok(Scenario {
        source: source.into(),
        topology,
        base_dir: dir.to_path_buf(),
        workload,
        slo,
        network,
        seed,
        faults,
        perf_models,
        prices,
    })
}

/// The `[workload]` table (`span`): a trace file's requests (relative to `dir`), or
/// Poisson arrivals of synthetic requests.
fn workload(
    w: &RawWorkload,
    span: Range<usize>,
    dir: &Path,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<WorkloadSpec, TopologyError> {
    if let Some(path) = &w.trace {
        return traced(w, path, dir, at);
    }
    if !w.tenants.is_empty() {
        return tenant_loads(w, span, at);
    }
    if w.conversations.is_some() || w.turns.is_some() || w.concurrency.is_some() {
        return chats(w, span, at);
    }
    let missing = |key: &str| at(span.clone(), "workload", format!("missing `{key}` (or give a `trace` file)"));
    let isl = w.isl.as_ref().ok_or_else(|| missing("isl"))?;
    let osl = w.osl.as_ref().ok_or_else(|| missing("osl"))?;
    let gamma = match (w.arrivals.as_ref().map(|a| (a.get_ref().as_str(), a.span())), &w.cv) {
        (None | Some(("poisson", _)), None) => false,
        (Some(("gamma", _)), Some(_)) => true,
        (Some(("gamma", span)), None) => {
            return Err(at(
                span,
                "workload.cv",
                "gamma arrivals need `cv`, their gaps' coefficient of variation".into(),
            ));
        }
        (None | Some(("poisson", _)), Some(cv)) => {
            let why = "`cv` shapes gamma arrivals: give `arrivals = \"gamma\"` with it".into();
            return Err(at(cv.span(), "workload.cv", why));
        }
        (Some((other, span)), _) => {
            let why = format!("unknown arrival process {other:?}; expected \"poisson\" or \"gamma\"");
            return Err(at(span, "workload.arrivals", why));
        }
    };
    let cv = match (&w.cv, gamma) {
        (Some(cv), true) => {
            Some(number(cv, "workload.cv", |x| x > 0.0 && x <= 10.0, "more than 0 and at most 10", at)?)
        }
        _ => None,
    };
    let schedule = match &w.rate_schedule {
        Some(s) => Some(steps(s, at)?),
        None => None,
    };
    let rate_rps = match (&w.rate_rps, &schedule) {
        (Some(r), None) => {
            number(r, "workload.rate_rps", |x| x > 0.0 && x <= MAX_RATE_RPS, "more than 0 and at most 1e6", &at)?
        }
        // The peak for now (it bounds the requests); the mean over the run below.
        (None, Some(steps)) => steps.iter().map(|s| s.1).fold(0.0, f64::max),
        (Some(r), Some(_)) => {
            let why = "give `rate_rps` or `rate_schedule`, not both".into();
            return Err(at(r.span(), "workload.rate_rps", why));
        }
        (None, None) => return Err(missing("rate_rps")),
    };
    if let (Some(s), true) = (&w.rate_schedule, gamma) {
        return Err(at(s.span(), "workload.rate_schedule", "a rate schedule's arrivals are Poisson".into()));
    }
    if let (Some(n), Some(_)) = (&w.requests, &schedule) {
        let why = "a rate schedule runs for `duration_s`, not a number of requests".into();
        return Err(at(n.span(), "workload.requests", why));
    }
    let size = match (&w.requests, &w.duration_s) {
        (Some(n), None) => {
            let v = *n.get_ref();
            if !(1..=MAX_REQUESTS as i64).contains(&v) {
                return Err(at(n.span(), "workload.requests", format!("must be 1..={MAX_REQUESTS}, got {v}")));
            }
            WorkloadSize::Requests(v as usize)
        }
        (None, Some(d)) => {
            let s = number(
                d,
                "workload.duration_s",
                |x| x > 0.0 && x <= MAX_DURATION_S,
                "more than 0 and at most 86400",
                &at,
            )?;
            if rate_rps * s > MAX_REQUESTS as f64 {
                let why = format!("{s} s at {rate_rps} req/s is more than {MAX_REQUESTS} requests");
                return Err(at(d.span(), "workload.duration_s", why));
            }
            WorkloadSize::DurationS(s)
        }
        (Some(_), Some(d)) => {
            return Err(at(d.span(), "workload.duration_s", "give `requests` or `duration_s`, not both".into()));
        }
        (None, None) => {
            let why = "give `requests` (how many) or `duration_s` (arrivals within that many seconds)".into();
            return Err(at(span.clone(), "workload", why));
        }
    };
    let dist = |s: &Spanned<String>, key: &str| {
        s.get_ref().parse::<LengthDist>().map_err(|e| at(s.span(), key, e.to_string()))
    };
    let shared = shared_prefix(w, at)?;
    let rate_rps = match (&schedule, size) {
        (Some(steps), WorkloadSize::DurationS(d)) => mean_rate(steps, d),
        _ => rate_rps,
    };
    let requests = WorkloadRequests::Synthetic {
        size,
        isl: dist(isl, "workload.isl")?,
        osl: dist(osl, "workload.osl")?,
        shared,
        cv,
        schedule,
    };
    Ok(WorkloadSpec { rate_rps, requests })
}

/// `prefix_groups` system prompts of `prefix_words` words, if given (both or neither).
fn shared_prefix(
    w: &RawWorkload,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<Option<SharedPrefix>, TopologyError> {
    let count = |v: &Spanned<i64>, key: &str| {
        let n = *v.get_ref();
        if (1..=MAX_PREFIX).contains(&n) {
            Ok(n as u32)
        } else {
            Err(at(v.span(), key, format!("must be 1..={MAX_PREFIX}, got {n}")))
        }
    };
    match (&w.prefix_groups, &w.prefix_words) {
        (Some(groups), Some(words)) => Ok(Some(SharedPrefix {
            groups: count(groups, "workload.prefix_groups")?,
            words: count(words, "workload.prefix_words")?,
        })),
        (None, None) => Ok(None),
        (Some(v), None) | (None, Some(v)) => {
            Err(at(v.span(), "workload", "give `prefix_groups` and `prefix_words` together".into()))
        }
    }
}

/// Most turns of one chat.
const MAX_TURNS: i64 = 1000;

/// Multi-turn chats: `conversations` of `turns` turns, `concurrency` under way at once
/// or started at `rate_rps` a second, user messages of `isl` words and answers of `osl`
/// tokens, optionally opening with `prefix_groups` system prompts.
fn chats(
    w: &RawWorkload,
    span: Range<usize>,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<WorkloadSpec, TopologyError> {
    let others = [
        ("arrivals", w.arrivals.as_ref().map(Spanned::span)),
        ("cv", w.cv.as_ref().map(Spanned::span)),
        ("rate_schedule", w.rate_schedule.as_ref().map(Spanned::span)),
        ("requests", w.requests.as_ref().map(Spanned::span)),
        ("duration_s", w.duration_s.as_ref().map(Spanned::span)),
    ];
    if let Some((key, Some(v))) = others.into_iter().find(|(_, v)| v.is_some()) {
        let why = format!(
            "multi-turn chats are `conversations` of `turns`, started `concurrency` at a time or at `rate_rps`; \
             `{key}` describes another workload"
        );
        return Err(at(v, &format!("workload.{key}"), why));
    }
    let missing = |key: &str, why: &str| at(span.clone(), &format!("workload.{key}"), why.to_string());
    let bounded = |v: &Spanned<i64>, key: &str, max: i64| {
        let n = *v.get_ref();
        if (1..=max).contains(&n) {
            Ok(n as u32)
        } else {
            Err(at(v.span(), &format!("workload.{key}"), format!("must be 1..={max}, got {n}")))
        }
    };
    let n = w.conversations.as_ref().ok_or_else(|| missing("conversations", "chats need `conversations`, how many"))?;
    let t = w.turns.as_ref().ok_or_else(|| missing("turns", "chats need `turns`, how many each has"))?;
    let shape = MultiTurn {
        conversations: bounded(n, "conversations", MAX_REQUESTS as i64)?,
        turns: bounded(t, "turns", MAX_TURNS)?,
    };
    if u64::from(shape.conversations) * u64::from(shape.turns) > MAX_REQUESTS {
        let why =
            format!("{} chats of {} turns are more than {MAX_REQUESTS} requests", shape.conversations, shape.turns);
        return Err(at(t.span(), "workload.turns", why));
    }
    let (concurrency, rate_rps) = match (&w.concurrency, &w.rate_rps) {
        (Some(c), None) => (Some(bounded(c, "concurrency", i64::from(shape.conversations))?), 0.0),
        (None, Some(r)) => {
            let rate =
                number(r, "workload.rate_rps", |x| x > 0.0 && x <= MAX_RATE_RPS, "more than 0 and at most 1e6", at)?;
            // A chat a second is `turns` requests a second, as the turns come.
            (None, rate * f64::from(shape.turns))
        }
        (Some(c), Some(_)) => {
            let why = "give `concurrency` (chats under way at once) or `rate_rps` (chats started a second), not both";
            return Err(at(c.span(), "workload.concurrency", why.into()));
        }
        (None, None) => {
            let why = "chats need `concurrency` (how many under way at once) or `rate_rps` (started a second)";
            return Err(missing("concurrency", why));
        }
    };
    let dist = |s: Option<&Spanned<String>>, key: &str| {
        let s = s.ok_or_else(|| missing(key, &format!("missing `{key}`")))?;
        s.get_ref().parse::<LengthDist>().map_err(|e| at(s.span(), &format!("workload.{key}"), e.to_string()))
    };
    let (isl, osl) = (dist(w.isl.as_ref(), "isl")?, dist(w.osl.as_ref(), "osl")?);
    let requests = WorkloadRequests::Chats { shape, concurrency, isl, osl, shared: shared_prefix(w, at)? };
    Ok(WorkloadSpec { rate_rps, requests })
}

/// Most tenants one workload may name.
const MAX_TENANTS: usize = 1024;

/// `[[workload.tenants]]`: each tenant's Poisson load over the `[workload]`'s
/// `duration_s`, its lengths the `[workload]`'s unless it gives its own.
fn tenant_loads(
    w: &RawWorkload,
    span: Range<usize>,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<WorkloadSpec, TopologyError> {
    let not_with = |key: &str, v: Range<usize>| {
        let why = format!("each of [[workload.tenants]] has its own load: `{key}` goes in them, or not at all");
        at(v, &format!("workload.{key}"), why)
    };
    let spans = [
        ("rate_rps", w.rate_rps.as_ref().map(Spanned::span)),
        ("requests", w.requests.as_ref().map(Spanned::span)),
        ("arrivals", w.arrivals.as_ref().map(Spanned::span)),
        ("cv", w.cv.as_ref().map(Spanned::span)),
        ("rate_schedule", w.rate_schedule.as_ref().map(Spanned::span)),
        ("prefix_groups", w.prefix_groups.as_ref().map(Spanned::span)),
        ("conversations", w.conversations.as_ref().map(Spanned::span)),
        ("turns", w.turns.as_ref().map(Spanned::span)),
        ("concurrency", w.concurrency.as_ref().map(Spanned::span)),
    ];
    if let Some((key, Some(v))) = spans.into_iter().find(|(_, v)| v.is_some()) {
        return Err(not_with(key, v));
    }
    if w.tenants.len() > MAX_TENANTS {
        return Err(at(span, "workload.tenants", format!("at most {MAX_TENANTS} tenants")));
    }
    let Some(d) = &w.duration_s else {
        return Err(at(span, "workload.duration_s", "tenants' loads run for `duration_s` seconds: give it".into()));
    };
    let duration_s =
        number(d, "workload.duration_s", |x| x > 0.0 && x <= MAX_DURATION_S, "more than 0 and at most 86400", at)?;
    let dist = |s: &Spanned<String>, key: &str| {
        s.get_ref().parse::<LengthDist>().map_err(|e| at(s.span(), key, e.to_string()))
    };
    let mut loads: Vec<TenantLoad> = Vec::with_capacity(w.tenants.len());
    for (i, t) in w.tenants.iter().enumerate() {
        let (t, tspan) = (t.get_ref(), t.span());
        let key = |k: &str| format!("workload.tenants[{i}].{k}");
        let name = t.name.get_ref().clone();
        if let Err(why) = tessera_topology::check_name(&name) {
            return Err(at(t.name.span(), &key("name"), why));
        }
        if loads.iter().any(|l| l.tenant.name == name) {
            return Err(at(t.name.span(), &key("name"), format!("tenant `{name}` is listed twice")));
        }
        let rate_rps =
            number(&t.rate_rps, &key("rate_rps"), |x| x > 0.0 && x <= MAX_RATE_RPS, "more than 0 and at most 1e6", at)?;
        let weight = match &t.weight {
            Some(v) if !(1..=1000).contains(v.get_ref()) => {
                return Err(at(v.span(), &key("weight"), format!("must be 1..=1000, got {}", v.get_ref())));
            }
            Some(v) => *v.get_ref() as u32,
            None => 1,
        };
        let priority = match &t.priority {
            Some(v) => v
                .get_ref()
                .parse()
                .map_err(|e: tessera_topology::UnknownName| at(v.span(), &key("priority"), e.to_string()))?,
            None => tessera_topology::PriorityClass::Standard,
        };
        let length = |own: &Option<Spanned<String>>, shared: &Option<Spanned<String>>, k: &str| match (own, shared) {
            (Some(v), _) => dist(v, &key(k)),
            (None, Some(v)) => dist(v, &format!("workload.{k}")),
            (None, None) => Err(at(tspan.clone(), &key(k), format!("missing `{k}` (here or in [workload])"))),
        };
        let (isl, osl) = (length(&t.isl, &w.isl, "isl")?, length(&t.osl, &w.osl, "osl")?);
        let tenant = tessera_topology::TenantSpec {
            name,
            weight,
            priority,
            models: None,
            share_prefix_cache: false,
            limits: Default::default(),
        };
        loads.push(TenantLoad { tenant, rate_rps, isl, osl });
    }
    let rate_rps: f64 = loads.iter().map(|l| l.rate_rps).sum();
    if rate_rps * duration_s > MAX_REQUESTS as f64 {
        let why = format!("{duration_s} s at {rate_rps} req/s in all is more than {MAX_REQUESTS} requests");
        return Err(at(d.span(), "workload.duration_s", why));
    }
    Ok(WorkloadSpec { rate_rps, requests: WorkloadRequests::Tenants { duration_s, loads } })
}

/// `rate_schedule = [[0, R0], [T1, R1], ...]`: (from second, requests per second) steps,
/// the first from 0, times rising, rates more than 0.
fn steps(
    v: &Spanned<toml::Value>,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<Vec<(f64, f64)>, TopologyError> {
    let bad = |why: String| at(v.span(), "workload.rate_schedule", why);
    let form = "a list of [from second, requests per second] pairs, e.g. [[0, 2.0], [60, 8.0]]";
    let Some(items) = v.get_ref().as_array() else { return Err(bad(format!("must be {form}"))) };
    let number = |x: &toml::Value| x.as_float().or_else(|| x.as_integer().map(|i| i as f64));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let pair = item.as_array().filter(|p| p.len() == 2);
        let Some((from, rate)) = pair.and_then(|p| Some((number(&p[0])?, number(&p[1])?))) else {
            return Err(bad(format!("entry {i} is not a [second, rate] pair of numbers; expected {form}")));
        };
        let previous = out.last().map(|s| s.0);
        if !(from.is_finite() && previous.map_or(from == 0.0, |p| from > p) && from <= MAX_DURATION_S) {
            return Err(bad(format!(
                "entry {i} starts at {from} s: the first at 0, each later than the last, at most 86400"
            )));
        }
        if !(rate > 0.0 && rate <= MAX_RATE_RPS) {
            return Err(bad(format!("entry {i} has rate {rate}: more than 0 and at most 1e6")));
        }
        out.push((from, rate));
    }
    if out.is_empty() {
        return Err(bad(format!("is empty; expected {form}")));
    }
    Ok(out)
}

/// The time-weighted mean rate of `steps` over the first `d` seconds.
fn mean_rate(steps: &[(f64, f64)], d: f64) -> f64 {
    let area: f64 = steps
        .iter()
        .enumerate()
        .map(|(i, &(from, rate))| {
            let to = steps.get(i + 1).map_or(d, |s| s.0).min(d);
            rate * (to - from).max(0.0)
        })
        .sum();
    area / d
}

/// A workload replaying the Mooncake-format trace at `path`: its arrival times, lengths
/// and shared blocks. Every key that would describe another workload is refused.
fn traced(
    w: &RawWorkload,
    path: &Spanned<String>,
    dir: &Path,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<WorkloadSpec, TopologyError> {
    let others = [
        ("arrivals", w.arrivals.as_ref().map(Spanned::span)),
        ("cv", w.cv.as_ref().map(Spanned::span)),
        ("rate_rps", w.rate_rps.as_ref().map(Spanned::span)),
        ("rate_schedule", w.rate_schedule.as_ref().map(Spanned::span)),
        ("requests", w.requests.as_ref().map(Spanned::span)),
        ("duration_s", w.duration_s.as_ref().map(Spanned::span)),
        ("isl", w.isl.as_ref().map(Spanned::span)),
        ("osl", w.osl.as_ref().map(Spanned::span)),
        ("prefix_groups", w.prefix_groups.as_ref().map(Spanned::span)),
        ("prefix_words", w.prefix_words.as_ref().map(Spanned::span)),
        ("conversations", w.conversations.as_ref().map(Spanned::span)),
        ("turns", w.turns.as_ref().map(Spanned::span)),
        ("concurrency", w.concurrency.as_ref().map(Spanned::span)),
        ("tenants", w.tenants.first().map(Spanned::span)),
    ];
    if let Some((key, Some(span))) = others.into_iter().find(|(_, span)| span.is_some()) {
        let why = "not with `trace`: the trace gives the arrivals and lengths".to_string();
        return Err(at(span, &format!("workload.{key}"), why));
    }
    let file = dir.join(path.get_ref());
    let fail = |why: String| at(path.span(), "workload.trace", format!("{}: {why}", file.display()));
    let text = std::fs::read_to_string(&file).map_err(|e| fail(format!("cannot read the trace: {e}")))?;
    let trace = tessera_workload::trace::parse(&text).map_err(|e| fail(e.0))?;
    if trace.is_empty() || trace.len() as u64 > MAX_REQUESTS {
        return Err(fail(format!("{} requests; a trace holds 1..={MAX_REQUESTS}", trace.len())));
    }
    let span_s = trace.iter().map(|r| r.timestamp).fold(0.0, f64::max) / 1000.0;
    let rate_rps = if span_s > 0.0 { trace.len() as f64 / span_s } else { trace.len() as f64 };
    Ok(WorkloadSpec { rate_rps, requests: WorkloadRequests::Trace(trace) })
}

/// The `[[faults]]`: each at a time after the workload starts, on a chip or host of
/// `topology`; sorted by time.
fn faults(
    raw: &[Spanned<RawFault>],
    topology: &ClusterSpec,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<Vec<FaultAt>, TopologyError> {
    let mut out = Vec::with_capacity(raw.len());
    for (i, f) in raw.iter().enumerate() {
        let key = |k: &str| format!("faults[{i}].{k}");
        let f = f.get_ref();
        let at_s = number(&f.at_s, &key("at_s"), |x| (0.0..=MAX_DURATION_S).contains(&x), "0 to 86400", at)?;
        let name = |v: &Option<Spanned<String>>, k: &str, known: Vec<&str>| match v {
            Some(v) if known.contains(&v.get_ref().as_str()) => Ok(v.get_ref().clone()),
            Some(v) => Err(at(v.span(), &key(k), format!("no {k} `{}`; {k}s: {}", v.get_ref(), known.join(", ")))),
            None => Err(at(f.kind.span(), &key(k), format!("a `{}` fault names its `{k}`", f.kind.get_ref()))),
        };
        let chips = || topology.chips().map(|(_, _, c)| c.id.as_str()).collect();
        let hosts = || topology.hosts.iter().map(|h| h.name.as_str()).collect::<Vec<_>>();
        let fault = match f.kind.get_ref().as_str() {
            "chip_crash" => FaultKind::ChipCrash { chip: name(&f.chip, "chip", chips())? },
            "chip_down" => FaultKind::ChipDown { chip: name(&f.chip, "chip", chips())? },
            "chip_up" => FaultKind::ChipUp { chip: name(&f.chip, "chip", chips())? },
            "host_down" => {
                let others = hosts().into_iter().filter(|h| *h != topology.gateway.host).collect();
                FaultKind::HostDown { host: name(&f.host, "host", others)? }
            }
            "link_slow" => {
                let host = name(&f.host, "host", hosts())?;
                let factor = match &f.factor {
                    Some(v) => number(v, &key("factor"), |x| (1.0..=10_000.0).contains(&x), "1 to 10000", at)?,
                    None => {
                        return Err(at(f.kind.span(), &key("factor"), "a `link_slow` fault names its `factor`".into()));
                    }
                };
                FaultKind::LinkSlow { host, factor }
            }
            other => {
                let why = format!(
                    "unknown fault {other:?}; expected one of chip_crash, chip_down, chip_up, host_down, link_slow"
                );
                return Err(at(f.kind.span(), &key("kind"), why));
            }
        };
        if f.factor.is_some() && !matches!(fault, FaultKind::LinkSlow { .. }) {
            let span = f.factor.as_ref().map_or(f.kind.span(), |v| v.span());
            return Err(at(span, &key("factor"), format!("a `{}` fault takes no `factor`", f.kind.get_ref())));
        }
        out.push((i, FaultAt { at_s, fault }));
    }
    out.sort_by(|(_, a), (_, b)| a.at_s.total_cmp(&b.at_s));
    // A chip comes up only after going down.
    let mut down: Vec<&str> = Vec::new();
    for (i, f) in &out {
        match &f.fault {
            FaultKind::ChipDown { chip } => down.push(chip),
            FaultKind::ChipUp { chip } => match down.iter().position(|c| c == chip) {
                Some(i) => drop(down.swap_remove(i)),
                None => {
                    let why = format!("chip `{chip}` comes up at {} s without a `chip_down` before it", f.at_s);
                    return Err(at(raw[*i].get_ref().kind.span(), &format!("faults[{i}].kind"), why));
                }
            },
            _ => {}
        }
    }
    Ok(out.into_iter().map(|(_, f)| f).collect())
}

/// A number (integer or float) within `ok`, or an error naming `key`.
fn number(
    v: &Spanned<toml::Value>,
    key: &str,
    ok: impl Fn(f64) -> bool,
    range: &str,
    at: &impl Fn(Range<usize>, &str, String) -> TopologyError,
) -> Result<f64, TopologyError> {
    let x = match v.get_ref() {
        toml::Value::Integer(i) => *i as f64,
        toml::Value::Float(f) => *f,
        other => return Err(at(v.span(), key, format!("must be a number, got {}", other.type_str()))),
    };
    if !x.is_finite() || !ok(x) {
        return Err(at(v.span(), key, format!("must be {range}, got {x}")));
    }
    Ok(x)
}

/// The topology written inside the scenario as a string. Its errors are moved to the
/// scenario file's lines (exact for a `'''` literal string, which has no escapes) and
/// their keys prefixed with `topology_toml.`.
fn embedded_topology(
    source: &str,
    text: &str,
    inline: &Spanned<String>,
    dir: &Path,
) -> Result<ClusterSpec, TopologyError> {
    tessera_topology::parse_in(inline.get_ref(), source, dir).map_err(|mut e| {
        let span = inline.span();
        let literal = &text[span.clone()];
        let delimiter = if literal.starts_with("'''") || literal.starts_with("\"\"\"") { 3 } else { 1 };
        let mut start = span.start + delimiter;
        // A newline right after a multi-line opening delimiter is not part of the string.
        if delimiter == 3 {
            if text[start..].starts_with("\r\n") {
                start += 2;
            } else if text[start..].starts_with('\n') {
                start += 1;
            }
        }
        let before = &text[..start.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
        if e.line > 0 {
            if e.line == 1 {
                e.column += column - 1;
            }
            e.line += line - 1;
        } else {
            (e.line, e.column) = (line, column);
        }
        e.key = if e.key.is_empty() { "topology_toml".into() } else { format!("topology_toml.{}", e.key) };
        e
    })
}
