//! The cluster simulator: a scenario's topology built by the very function the real node
//! uses (`tessera_actors::host::build_host`), every host's behaviors — admission,
//! requests, router, supervisors, chips with their batchers and KV pools — spawned on
//! the actor core's deterministic virtual-time host, and each chip's executor replaced by
//! a modelled one that declares the roofline's time for a step instead of computing it
//! ([`chip`]). A seeded open-loop workload (the `tessera-workload` plan `bench serve`
//! uses) drives it; the report gives latencies, goodput against SLOs, throughput, the KV
//! blocks left held, and the simulator's own speed.
//!
//! No behavior is re-implemented here: this crate only adds what stands outside the
//! cluster (clients, the arrival process, a probe of the router's view). It depends on
//! the behaviors, the actor core, the topology, the workload model and — for a model's
//! config alone — the backends; never on the real-time host, the bus or a kernel library.
//! Same scenario and seed, same [`Report`], byte for byte: nothing here lets wall time,
//! threads or map iteration order decide anything.
#![forbid(unsafe_code)]

pub mod chip;
mod clients;
pub mod model;
pub mod report;
pub mod scenario;
pub mod solve;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_actor_core::testkit::VirtualHost;
use tessera_actor_core::{Addr, HostId, Moment};
use tessera_actors::host::{HostBuildError, build_host};
use tessera_actors::msg::{AdmitAsk, ChipReport, ChipState, Delivery, Fault, Msg, SamplingSpec};
use tessera_actors::solver::SolverConfig;
use tessera_backends::tokenizer::TextTokenizer;
use tessera_topology::TopologyError;
use tessera_topology::perf::Power;
use tessera_workload::multiturn::Conversation;
use tessera_workload::{Load, Workload, vocabulary};

use chip::{ChipModelError, Links, modelled_chip};
use clients::{Arrivals, ChatPlan, ChatStarts, Chats, Outcomes, Probe, SolverLog, SolverWatch, View};
use model::{ModelError, SimModel};
pub use report::{Report, Speed};
pub use scenario::{Scenario, load};

/// How long (virtual) the chips have to come up before the workload starts.
const STARTUP_LIMIT: Duration = Duration::from_secs(60);
/// How long (virtual) the run waits for the last requests after the last arrival.
const DRAIN_LIMIT: Duration = Duration::from_secs(3600);

/// Why a scenario could not be simulated.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Scenario(#[from] TopologyError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{topology}: {source}")]
    Build {
        topology: String,
        #[source]
        source: HostBuildError<ChipModelError>,
    },
    #[error("chips not up after {limit_s} s of simulated time: {chips}")]
    ChipsNotUp { limit_s: u64, chips: String },
    #[error("the router did not answer a query for its view")]
    RouterSilent,
    #[error("{topology}: no host runs the gateway's admission")]
    NoGateway { topology: String },
    #[error("{topology}: [solver]: {error}")]
    Solver { topology: String, error: String },
    #[error("{scenario}: [workload]: {error}")]
    Workload { scenario: String, error: String },
}

/// How to run a scenario.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// The workload's seed (default: the scenario's).
    pub seed: Option<u64>,
    /// Count events and time their handlers per message kind ([`Speed::profile`]).
    pub profile: bool,
}

/// Runs `scenario` (with `seed`, else the scenario's own).
pub fn run(scenario: &Scenario, seed: Option<u64>) -> Result<(Report, Speed), SimError> {
    run_with_progress(scenario, &RunOptions { seed, profile: false }, &mut |_, _| {})
}

/// [`run`] with `options`, calling `progress(ended, requests)` each time another
/// request ends.
///
/// The solver runs in a simulation when the topology sets `[solver] auto = true`: only
/// then does it change what the cluster does.
pub fn run_with_progress(
    scenario: &Scenario,
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Report, Speed), SimError> {
    let wall = Instant::now();
    let spec = &scenario.topology;
    let seed = options.seed.unwrap_or(scenario.seed);
    let model = SimModel::of(spec, &scenario.base_dir)?;
    let links = Arc::new(Links::new(spec, scenario.network));
    let numbers: BTreeMap<&str, usize> = spec.chips().enumerate().map(|(i, (_, _, c))| (c.id.as_str(), i)).collect();

    let mut vh: VirtualHost<Msg> =
        VirtualHost::new(scenario.network.bus_latency).with_trace(false).with_profile(options.profile);
    let (mut admission, mut router, mut chip_addrs) = (None, None, BTreeMap::new());
    let solver = solver_config(scenario, &model)?;
    let served = model.shape(spec.kv_dtype);
    for host in &spec.hosts {
        // The very builder the real node uses, with modelled executors.
        let built = build_host(spec, &host.name, 1, solver.clone(), Some(&served), |h, c| {
            let n = numbers.get(c.id.as_str()).copied().unwrap_or(0);
            let perf = scenario.perf_model(&c.kind);
            modelled_chip(spec, c, n, &h.name, &model, perf, links.clone()).map(|(factory, _)| factory)
        })
        .map_err(|source| SimError::Build { topology: spec.source.clone(), source })?;
        for (actor, behavior) in built.actors {
            vh.spawn_at(Addr::new(built.host, actor), behavior);
        }
        admission = admission.or(built.admission);
        router = Some(built.router);
        chip_addrs = built.chips;
    }
    let (Some(admission), Some(router)) = (admission, router) else {
        // A validated topology names a gateway host among its hosts.
        return Err(SimError::NoGateway { topology: spec.source.clone() });
    };

    // Start the workload once the router sees every chip up.
    loop {
        let view = probe(&mut vh, router)?;
        let down: Vec<String> = view
            .iter()
            .filter(|c| c.state != ChipState::Up)
            .map(|c| match &c.error {
                Some(e) => format!("{} ({:?}: {e})", c.id, c.state),
                None => format!("{} ({:?})", c.id, c.state),
            })
            .collect();
        if down.is_empty() {
            break;
        }
        if vh.now() >= Moment(0).after(STARTUP_LIMIT) {
            return Err(SimError::ChipsNotUp { limit_s: STARTUP_LIMIT.as_secs(), chips: down.join(", ") });
        }
        let next = vh.now().after(Duration::from_millis(10));
        vh.run_until(next);
    }

    let w = &scenario.workload;
    let vocab = model.config.vocab_size.max(1) as u64;
    let tokenizer = model::tokenizer(spec, &scenario.base_dir).map(Arc::new);
    // Every request as (arrival in s, tenant, prompt ids, output length), in arrival order;
    // or chats, whose turns are sent as the answers come.
    let mut chats: Option<(VecDeque<ChatPlan>, ChatStarts)> = None;
    let (planned, requests, last_arrival_s): (Planned, usize, f64) = match &w.requests {
        scenario::WorkloadRequests::Synthetic { size, isl, osl, shared, cv, schedule } => {
            let load = Load::Poisson { rate_rps: w.rate_rps };
            let workload = Workload { isl: *isl, osl: *osl, load, seed, shared: *shared };
            let arrivals_s = arrivals(&workload, *size, w.rate_rps, *cv, schedule.as_deref());
            let prompts = prompt_stream(&workload, tokenizer, vocab);
            let (n, last) = (arrivals_s.len(), arrivals_s.last().copied().unwrap_or(0.0));
            (Box::new(prompts.zip(arrivals_s).map(|((p, osl), at)| (at, 0, p, osl))), n, last)
        }
        scenario::WorkloadRequests::Trace(trace) => {
            let (planned, arrivals_s) =
                tessera_workload::trace::replay(trace, tessera_workload::trace::TRACE_BLOCK_TOKENS);
            let prompts = planned.into_iter().map(move |p| (prompt_ids(tokenizer.as_deref(), &p.prompt, vocab), p.osl));
            let (n, last) = (arrivals_s.len(), arrivals_s.last().copied().unwrap_or(0.0));
            (Box::new(prompts.zip(arrivals_s).map(|((p, osl), at)| (at, 0, p, osl))), n, last)
        }
        scenario::WorkloadRequests::Tenants { duration_s, loads } => {
            let mut streams = Vec::with_capacity(loads.len());
            let (mut n, mut last) = (0, 0.0_f64);
            for (t, l) in loads.iter().enumerate() {
                // Each tenant's own stream: its seed apart from the others'.
                let load = Load::Poisson { rate_rps: l.rate_rps };
                let seed = seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let workload = Workload { isl: l.isl, osl: l.osl, load, seed, shared: None };
                let arrivals_s =
                    arrivals(&workload, scenario::WorkloadSize::DurationS(*duration_s), l.rate_rps, None, None);
                n += arrivals_s.len();
                last = last.max(arrivals_s.last().copied().unwrap_or(0.0));
                let prompts = prompt_stream(&workload, tokenizer.clone(), vocab);
                let tenant = t as u32;
                let planned: Planned =
                    Box::new(prompts.zip(arrivals_s).map(move |((p, osl), at)| (at, tenant, p, osl)));
                streams.push(planned.peekable());
            }
            (Box::new(Merged { streams }), n, last)
        }
        scenario::WorkloadRequests::Chats { shape, concurrency, isl, osl, shared } => {
            let n = shape.conversations as usize;
            let load = match concurrency {
                Some(c) => Load::Closed { concurrency: *c as usize },
                None => Load::Poisson { rate_rps: w.rate_rps / f64::from(shape.turns) },
            };
            let workload = Workload { isl: *isl, osl: *osl, load, seed, shared: *shared };
            let conversations = workload
                .conversations(*shape)
                .map_err(|e| SimError::Workload { scenario: scenario.source.clone(), error: e.0 })?;
            let plans = conversations.iter().map(|c| chat_plan(c, tokenizer.as_deref(), vocab)).collect();
            let (starts, last) = match concurrency {
                Some(c) => (ChatStarts::Closed { concurrency: *c as usize }, 0.0),
                None => {
                    let at_s = workload.arrivals_s(n);
                    let last = at_s.last().copied().unwrap_or(0.0);
                    (ChatStarts::At(at_s.iter().map(|s| (s * 1e9).round() as u64).collect()), last)
                }
            };
            chats = Some((plans, starts));
            (Box::new(std::iter::empty()), n * shape.turns as usize, last)
        }
    };
    let last_arrival = (last_arrival_s * 1e9).round() as u64;
    let asks: Box<dyn Iterator<Item = (u64, AdmitAsk)> + Send> =
        Box::new(planned.map(|(at_s, tenant, prompt, osl)| {
            let ask = AdmitAsk {
                prompt,
                max_tokens: osl as usize,
                sampling: SamplingSpec::greedy(),
                // The clients time the first token and the end: the rest need not travel
                // token by token (TPOT is their mean gap).
                delivery: Delivery::Whole,
                forks: Vec::new(),
                tenant,
            };
            ((at_s * 1e9).round() as u64, ask)
        }));
    let outcomes: Outcomes = Arc::default();
    let t0 = vh.now();
    let solver_log: SolverLog = Arc::default();
    if solver.is_some() {
        vh.spawn(admission.host, Box::new(SolverWatch { log: solver_log.clone() }));
    }
    match chats {
        Some((plans, starts)) => {
            let chats = Chats { admission, plans, starts, outcomes: outcomes.clone(), next_request: 0, started: t0 };
            vh.spawn(admission.host, Box::new(chats));
        }
        None => {
            let asks = asks.peekable();
            let arrivals = Arrivals { admission, asks, outcomes: outcomes.clone(), next: 0, started: t0 };
            vh.spawn(admission.host, Box::new(arrivals));
        }
    }
    let at = |s: f64| t0.after(Duration::from_secs_f64(s));
    let limit = t0.after(Duration::from_nanos(last_arrival)).after(DRAIN_LIMIT);
    let mut ended = 0;
    let mut all_ended = |_: &VirtualHost<Msg>| {
        let now = outcomes.lock().map_or(0, |o| o.len());
        if now != ended {
            ended = now;
            progress(ended, requests);
        }
        ended == requests
    };
    // Each fault at its time, as a drill (`POST /admin/faults`), a dead host process or a
    // degraded network would strike a real cluster.
    let host_index = |name: &str| spec.hosts.iter().position(|h| h.name == name);
    for f in &scenario.faults {
        vh.run_while(at(f.at_s).min(limit), &mut all_ended);
        let drill = |chip: &String, fault: Fault| chip_addrs.get(chip).map(|a| (*a, Msg::InjectFault { fault }));
        let inject = match &f.fault {
            scenario::FaultKind::ChipCrash { chip } => drill(chip, Fault::WorkerPanic),
            scenario::FaultKind::ChipDown { chip } => drill(chip, Fault::Offline),
            scenario::FaultKind::ChipUp { chip } => drill(chip, Fault::Online),
            scenario::FaultKind::HostDown { host } => {
                if let Some(i) = host_index(host) {
                    vh.kill_host(HostId(i as u16));
                }
                None
            }
            scenario::FaultKind::LinkSlow { host, factor } => {
                if let Some(i) = host_index(host) {
                    links.slow_down(i, *factor);
                }
                None
            }
        };
        if let Some((chip, msg)) = inject {
            // At its time, not at the last event before it.
            let when = at(f.at_s).min(limit).max(vh.now());
            vh.send_at(when, chip, msg);
        }
    }
    // With tenants, what the chips served each while the load still arrived (every
    // backlogged tenant then competes for the chips; afterwards backlogs drain).
    let arriving = if spec.tenants.is_empty() {
        None
    } else {
        vh.run_while(t0.after(Duration::from_nanos(last_arrival)).min(limit), &mut all_ended);
        Some(probe(&mut vh, router)?)
    };
    vh.run_while(limit, &mut all_ended);
    let end = vh.now();

    // A few heartbeats later every chip's last report has reached the router.
    let settle = end.after(Duration::from_millis(spec.supervisor.heartbeat_interval_ms.saturating_mul(3)));
    vh.run_until(settle);
    let view = probe(&mut vh, router)?;
    let outcomes = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    let mut report = report(scenario, seed, &model, requests, &outcomes, end.since(t0), vh.delivered(), &view);
    report.tenants = tenant_ends(scenario, &outcomes, &view, arriving.as_deref());
    report.solver = solver_marks(&solver_log, t0);
    report.timeline = report::timeline(outcomes.values().map(|o| {
        let ok = o.error.is_none();
        let ttft_s = o.first_token.filter(|_| ok).map(|f| f.since(o.sent).as_secs_f64());
        let e2e_s = ok.then(|| o.ended.since(o.sent).as_secs_f64());
        (o.sent.since(t0).as_secs_f64(), ttft_s, e2e_s)
    }));
    let mut speed = Speed::of(&report, wall.elapsed().as_secs_f64());
    if let Some(profile) = vh.profile() {
        let mut kinds: Vec<report::KindSpeed> = profile
            .iter()
            .map(|(kind, p)| report::KindSpeed {
                kind: (*kind).to_owned(),
                events: p.delivered,
                wall_s: p.wall.as_secs_f64(),
            })
            .collect();
        kinds.sort_by(|a, b| b.wall_s.total_cmp(&a.wall_s));
        speed.profile = kinds;
    }
    Ok((report, speed))
}

/// Arrival times in seconds (Poisson at a rate or a rate schedule, or gamma with gaps of
/// `cv`): `requests` of them, or every one within `duration_s`.
fn arrivals(
    workload: &Workload,
    size: scenario::WorkloadSize,
    rate_rps: f64,
    cv: Option<f64>,
    schedule: Option<&[(f64, f64)]>,
) -> Vec<f64> {
    let times = |n: usize| match (cv, schedule) {
        (_, Some(steps)) => workload.scheduled_arrivals_s(n, steps),
        (Some(cv), None) => workload.gamma_arrivals_s(n, rate_rps, cv),
        (None, None) => workload.arrivals_s(n),
    };
    match size {
        scenario::WorkloadSize::Requests(n) => times(n),
        scenario::WorkloadSize::DurationS(d) => {
            // The plan is a prefix-stable stream: draw more until one falls past the end.
            let mut n = (rate_rps * d * 1.25) as usize + 16;
            loop {
                let mut drawn = times(n);
                if drawn.last().is_some_and(|&t| t >= d) || n as u64 >= scenario::MAX_REQUESTS {
                    drawn.retain(|&t| t < d);
                    return drawn;
                }
                n = n.saturating_mul(2).min(scenario::MAX_REQUESTS as usize);
            }
        }
    }
}

/// The router's view of the chips, now.
fn probe(vh: &mut VirtualHost<Msg>, router: Addr) -> Result<Vec<ChipReport>, SimError> {
    let view: View = Arc::default();
    vh.spawn(router.host, Box::new(Probe { router, view: view.clone() }));
    let answered = |_: &VirtualHost<Msg>| view.lock().is_ok_and(|v| v.is_some());
    vh.run_while(vh.now().after(Duration::from_secs(10)), answered);
    let answer = view.lock().ok().and_then(|mut v| v.take());
    answer.ok_or(SimError::RouterSilent)
}

/// Each tenant's requests, latencies and service, from what its clients saw and what
/// the chips report having served it; none without tenants.
fn tenant_ends(
    scenario: &Scenario,
    outcomes: &BTreeMap<usize, clients::Outcome>,
    view: &[ChipReport],
    arriving: Option<&[ChipReport]>,
) -> Vec<report::TenantEnd> {
    let served = |chips: &[ChipReport], t: usize| {
        chips.iter().map(|c| c.tenant_service_s.get(t).copied().unwrap_or(0.0)).sum::<f64>()
    };
    let tenants = 0..scenario.topology.tenants.len();
    let service = |t: usize| served(view, t);
    let total: f64 = tenants.clone().map(service).sum();
    let arriving = arriving.unwrap_or_default();
    let total_arriving: f64 = tenants.map(|t| served(arriving, t)).sum();
    let share = |part: f64, of: f64| if of > 0.0 { part / of } else { 0.0 };
    let mut ends = Vec::with_capacity(scenario.topology.tenants.len());
    for (t, spec) in scenario.topology.tenants.iter().enumerate() {
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        let (mut ended, mut completed, mut output_tokens) = (0, 0, 0u64);
        for o in outcomes.values().filter(|o| o.tenant as usize == t) {
            ended += 1;
            if o.error.is_some() {
                continue;
            }
            completed += 1;
            output_tokens += o.tokens as u64;
            if let Some(first) = o.first_token {
                ttft.push(first.since(o.sent).as_secs_f64());
                if o.tokens > 1 {
                    tpot.push(o.ended.since(first).as_secs_f64() / (o.tokens - 1) as f64);
                }
            }
        }
        let service_s = service(t);
        ends.push(report::TenantEnd {
            name: spec.name.clone(),
            weight: spec.weight,
            priority: spec.priority.to_string(),
            ended,
            completed,
            failed: ended - completed,
            ttft: report::Latency::from_seconds(&ttft),
            tpot: report::Latency::from_seconds(&tpot),
            output_tokens,
            service_s,
            service_share: share(service_s, total),
            arriving_service_s: served(arriving, t),
            arriving_service_share: share(served(arriving, t), total_arriving),
        });
    }
    ends
}

/// Each request's prompt ids and output length, in arrival order.
type Prompts = Box<dyn Iterator<Item = (Vec<u32>, u32)> + Send>;

/// Each request's arrival (s), tenant, prompt ids and output length, in arrival order.
type Planned = Box<dyn Iterator<Item = (f64, u32, Vec<u32>, u32)> + Send>;

/// `workload`'s prompts as ids: the model's tokenizer's, else one id a word.
fn prompt_stream(workload: &Workload, tokenizer: Option<Arc<TextTokenizer>>, vocab: u64) -> Prompts {
    match tokenizer {
        Some(t) => Box::new(workload.stream().map(move |p| (prompt_ids(Some(&t), &p.prompt, vocab), p.osl))),
        None => {
            // The ids `prompt_ids` gives each word, looked up rather than hashed.
            let ids: Vec<u32> = vocabulary().iter().map(|w| word_id(w.as_bytes(), vocab)).collect();
            let prompts = workload
                .stream_words()
                .map(move |(words, osl)| (words.iter().map(|&w| ids[usize::from(w)]).collect(), osl));
            Box::new(prompts)
        }
    }
}

/// Several tenants' planned requests merged in arrival order (ties: the lower tenant).
struct Merged {
    streams: Vec<std::iter::Peekable<Planned>>,
}

impl Iterator for Merged {
    type Item = (f64, u32, Vec<u32>, u32);

    fn next(&mut self) -> Option<Self::Item> {
        let mut first: Option<(usize, f64)> = None;
        for (i, s) in self.streams.iter_mut().enumerate() {
            if let Some(&(at, ..)) = s.peek()
                && first.is_none_or(|(_, f)| at < f)
            {
                first = Some((i, at));
            }
        }
        self.streams[first?.0].next()
    }
}

/// A completion prompt's token ids as the gateway makes them (the model's tokenizer,
/// BOS as the model asks); without a tokenizer, one id a word (`bench serve`'s words
/// are about one token each), hashed into the vocabulary.
fn prompt_ids(tokenizer: Option<&TextTokenizer>, prompt: &str, vocab: u64) -> Vec<u32> {
    let words = || prompt.split(' ').map(|w| word_id(w.as_bytes(), vocab)).collect();
    match tokenizer {
        Some(t) => t.encode(prompt, true).unwrap_or_else(|_| words()),
        None => words(),
    }
}

/// A chat's turns as ids: its opening prompt as a completion's (the tokenizer's, BOS
/// included), each later message as it continues a prompt (no BOS; a leading space).
fn chat_plan(chat: &Conversation, tokenizer: Option<&TextTokenizer>, vocab: u64) -> ChatPlan {
    let opening = chat.next_request().map_or_else(Vec::new, |r| prompt_ids(tokenizer, &r.prompt, vocab));
    let continued = |text: &str| match tokenizer {
        Some(t) => t.encode(text, false).unwrap_or_default(),
        None => text.split(' ').filter(|w| !w.is_empty()).map(|w| word_id(w.as_bytes(), vocab)).collect(),
    };
    let turns = chat.planned();
    ChatPlan {
        opening,
        messages: turns.iter().skip(1).map(|t| continued(&format!(" {}", t.user))).collect(),
        osl: turns.iter().map(|t| t.osl).collect(),
    }
}

/// A word's token id without a tokenizer: its FNV-1a hash into the vocabulary.
fn word_id(word: &[u8], vocab: u64) -> u32 {
    let h = word.iter().fold(FNV_OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME));
    (h % vocab) as u32
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

#[allow(clippy::too_many_arguments)]
fn report(
    scenario: &Scenario,
    seed: u64,
    model: &SimModel,
    requests: usize,
    outcomes: &BTreeMap<usize, clients::Outcome>,
    span: Duration,
    events: u64,
    view: &[ChipReport],
) -> Report {
    let slo = scenario.slo;
    let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut completed, mut slo_met, mut output_tokens, mut prompt_tokens) = (0, 0, 0u64, 0u64);
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes.values() {
        if let Some(error) = &o.error {
            *failures.entry(error.clone()).or_default() += 1;
            continue;
        }
        completed += 1;
        output_tokens += o.tokens as u64;
        prompt_tokens += o.prompt_tokens as u64;
        let e2e_s = o.ended.since(o.sent).as_secs_f64();
        e2e.push(e2e_s);
        let Some(first) = o.first_token else { continue };
        let ttft_s = first.since(o.sent).as_secs_f64();
        ttft.push(ttft_s);
        let tpot_s = (o.tokens > 1).then(|| o.ended.since(first).as_secs_f64() / (o.tokens - 1) as f64);
        if let Some(t) = tpot_s {
            tpot.push(t);
        }
        if ttft_s * 1e3 <= slo.ttft_ms && tpot_s.is_none_or(|t| t * 1e3 <= slo.tpot_ms) {
            slo_met += 1;
        }
    }
    let failed = failures.values().sum();
    let span_s = span.as_secs_f64();
    let per_s = |x: f64| if span_s > 0.0 { x / span_s } else { 0.0 };
    // An instance draws its chips' power and costs their price.
    let kinds = |c: &tessera_topology::ChipSpec| -> Vec<String> {
        c.parallel.as_ref().map_or_else(|| vec![c.kind.clone()], |p| p.chips.iter().map(|m| m.kind.clone()).collect())
    };
    let spec_of = |id: &str| scenario.topology.chips().find(|(_, _, c)| c.id == id).map(|(_, _, c)| c);
    let chip_price = |c: &tessera_topology::ChipSpec| kinds(c).iter().map(|k| scenario.price(k)).sum::<Option<f64>>();
    let power = |id: &str| {
        let tdp: Option<f64> =
            kinds(spec_of(id)?).iter().map(|k| scenario.topology.chip_kind(k).map(|k| k.tdp_w)).sum();
        tdp.map(Power::from_tdp)
    };
    let price = |id: &str| chip_price(spec_of(id)?);
    let share = |s: f64| if span_s > 0.0 { (s / span_s).min(1.0) } else { 0.0 };
    let chips: Vec<report::ChipEnd> = view
        .iter()
        .map(|c| report::ChipEnd {
            id: c.id.to_string(),
            host: c.host_name.to_string(),
            role: c.role.to_string(),
            state: format!("{:?}", c.state).to_lowercase(),
            modelled_as: c.emulated.as_deref().map(str::to_owned),
            steps: c.steps,
            kv_blocks_total: c.kv_blocks_total,
            kv_blocks_used: c.kv_blocks_used,
            handoffs_open: c.handoffs,
            prefix_prompt_tokens: c.prefix_prompt_tokens,
            prefix_reused_tokens: c.prefix_reused_tokens,
            busy_prefill: share(c.busy_prefill_s),
            busy_decode: share(c.busy_decode_s),
            energy_j: power(&c.id).map(|p| p.energy_j(c.busy_prefill_s, c.busy_decode_s, span_s)),
            usd: price(&c.id).map(|usd_per_hour| usd_per_hour * span_s / 3600.0),
        })
        .collect();
    let energy_j: Option<f64> = chips.iter().map(|c| c.energy_j).sum();
    let kwh_per_10k_requests = energy_j.filter(|_| completed > 0).map(|j| j / 3.6e6 * 1e4 / completed as f64);
    // Every chip of the topology is paid for, whether or not the router saw it at the end.
    let usd_per_hour: Option<f64> = scenario.topology.chips().map(|(_, _, c)| chip_price(c)).sum();
    let usd = usd_per_hour.map(|h| h * span_s / 3600.0).filter(|usd| *usd > 0.0);
    Report {
        scenario: scenario.source.clone(),
        seed,
        cluster: scenario.topology.name.clone(),
        model: model.name.clone(),
        // A closed loop (chats `concurrency` at a time) has no rate of its own: the one it reached.
        rate_rps: match scenario.workload.requests {
            scenario::WorkloadRequests::Chats { concurrency: Some(_), .. } => completed as f64 / span_s.max(1e-9),
            _ => scenario.workload.rate_rps,
        },
        requests,
        completed,
        failed,
        unfinished: requests - completed - failed,
        failures,
        ttft: report::Latency::from_seconds(&ttft),
        tpot: report::Latency::from_seconds(&tpot),
        e2e: report::Latency::from_seconds(&e2e),
        slo_ttft_ms: slo.ttft_ms,
        slo_tpot_ms: slo.tpot_ms,
        slo_met,
        goodput_rps: per_s(slo_met as f64),
        prompt_tokens,
        output_tokens,
        output_tokens_per_s: per_s(output_tokens as f64),
        simulated_s: span_s,
        events,
        kv_blocks_used_at_end: view.iter().map(|c| c.kv_blocks_used).sum(),
        prefix_hit_rate: report::hit_rate(&chips),
        kwh_per_10k_requests,
        usd_per_hour,
        usd_per_million_output_tokens: usd.filter(|_| output_tokens > 0).map(|usd| usd / output_tokens as f64 * 1e6),
        slo_met_per_usd: usd.map(|usd| slo_met as f64 / usd),
        timeline: Vec::new(),
        tenants: Vec::new(),
        faults: scenario.faults.iter().map(|f| report::FaultMark { at_s: f.at_s, what: f.fault.describe() }).collect(),
        solver: Vec::new(),
        chips,
    }
}

/// The solver of `scenario` when it applies strategies itself (`[solver] auto`), costed
/// as the simulator times the chips, aiming at the scenario's `[slo]`.
fn solver_config(scenario: &Scenario, model: &SimModel) -> Result<Option<SolverConfig>, SimError> {
    let solver = &scenario.topology.solver;
    if !(solver.enabled && solver.auto) {
        return Ok(None);
    }
    let shape = |d| model.shape(d);
    let perf = |k: &str| scenario.perf_model(k);
    let price = |k: &str| scenario.price(k);
    let costing = solve::costing(scenario, model, &shape, &perf, &price);
    let mut config = tessera_actors::solver::solver_config(&scenario.topology, &costing)
        .map_err(|e| SimError::Solver { topology: scenario.topology.source.clone(), error: e.to_string() })?;
    // The solver aims at the SLOs the run is judged by.
    config.spec.ttft_ms = scenario.slo.ttft_ms.round().max(1.0) as u64;
    config.spec.tpot_ms = scenario.slo.tpot_ms.round().max(1.0) as u64;
    Ok(Some(config))
}

/// The solver's log as report lines, times from the workload's start.
fn solver_marks(log: &SolverLog, t0: Moment) -> Vec<report::SolverMark> {
    let log = log.lock().map(|l| l.clone()).unwrap_or_default();
    let at = |m: Moment| (m.since(t0).as_secs_f64() * 1e3).round() / 1e3;
    log.into_iter()
        .filter_map(|(when, msg)| match msg {
            Msg::Strategies { set } => Some(report::SolverMark {
                at_s: at(when),
                event: "strategies".into(),
                id: set.seq.to_string(),
                what: format!(
                    "{} at {:.2} req/s, {} of {} chips up: best {}",
                    set.reason,
                    set.observed_rate_rps,
                    set.chips_up,
                    set.chips_total,
                    set.strategies.first().map_or("none", |s| s.summary.as_str())
                ),
            }),
            Msg::PlanApplied { result: Ok(plan) } => {
                let moves: Vec<String> = plan.moves.iter().map(|(c, a, b)| format!("{c} {a}->{b}")).collect();
                Some(report::SolverMark {
                    at_s: at(when),
                    event: "applied".into(),
                    id: plan.id.clone(),
                    what: format!(
                        "{} (by {}; moves: {})",
                        plan.summary,
                        plan.by,
                        if moves.is_empty() { "none".into() } else { moves.join(", ") }
                    ),
                })
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_the_tokenizers_ids_when_the_model_has_one() {
        let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let Ok(tokenizer) = TextTokenizer::from_dir(&gguf) else { panic!("the shared model's tokenizer") };
        let prompt = "the people of the world";
        let ids = prompt_ids(Some(&tokenizer), prompt, 49152);
        assert_eq!(Some(&ids), tokenizer.encode(prompt, true).ok().as_ref());
        // Without a tokenizer: one id a word, within the vocabulary, the same word the same id.
        let words = prompt_ids(None, prompt, 1024);
        assert_eq!(words.len(), 5);
        assert!(words.iter().all(|&id| id < 1024) && words[0] == words[3]);
        assert_ne!(ids, words);
    }
}
