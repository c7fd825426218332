//! The production behaviors — admission, request, router, supervisor, chips with their
//! batchers and KV pools — on the actor core's virtual-time host: two hosts, a chip on
//! each whose executor declares modelled time instead of computing, 40 requests, and
//! one host lost mid-run. Every request must complete with its full output, the
//! surviving pool must end all-free, and two runs with the same seed must produce
//! byte-identical traces.

use crate::batcher::StepPlan;
use crate::chip::executor::{ExecutorFactory, KvInstall, StepExecutor};
use crate::host::build_host;
use crate::msg::{
    AdmitAsk, ChipInfo, ChipReport, ChipState, ClientEvent, DType, Delivery, ErrorKind, Finish, KvCompat, KvFormatDesc,
    KvLayout, Msg, SamplingSpec, ServeError, StepOutcome, well_known,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_actor_core::testkit::VirtualHost;
use tessera_actor_core::{Addr, Behavior, Effects, HostId, JobCtx, Moment};

const VOCAB: u32 = 1000;

/// Samples from (last token, position) alone, so a request replayed on another chip
/// continues exactly where it was; takes 2 ms + 20 µs per token of model time.
struct ModelledExecutor;

impl StepExecutor for ModelledExecutor {
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome {
        let sampled = plan
            .seqs
            .iter()
            .flat_map(|s| {
                let last = s.tokens.last().copied().unwrap_or(0) as u64;
                let pos = (s.start_pos + s.tokens.len()) as u64;
                let token = ((last * 7919 + pos * 104_729) % VOCAB as u64) as u32;
                s.samplers().map(move |id| (id, token))
            })
            .collect();
        let model = Duration::from_micros(2_000 + 20 * plan.tokens() as u64);
        ctx.elapse(model);
        StepOutcome::sampled(step, sampled, model.as_secs_f64())
    }

    fn install(&mut self, _job: &KvInstall, _ctx: &mut dyn JobCtx<Msg>) -> Result<(), String> {
        Err("the modelled executor holds no KV to install into".into())
    }
}

fn modelled_chip() -> ExecutorFactory {
    Arc::new(|| {
        let info = ChipInfo {
            format: KvFormatDesc {
                num_layers: 2,
                num_kv_heads: 1,
                head_dim: 8,
                block_size: 16,
                num_blocks: 64,
                layout: KvLayout::TokenMajor,
                dtype: DType::F32,
            },
            compat: KvCompat { hash: 1, fields: Vec::new() },
            staging: None,
            emulated: None,
            num_blocks: 64,
            block_size: 16,
            max_context: 512,
            vocab_size: VOCAB as usize,
            eos_token_ids: Vec::new(),
        };
        Ok((Box::new(ModelledExecutor) as Box<dyn StepExecutor>, info))
    })
}

/// How a request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Done { tokens: Vec<u32>, finish: Finish },
    Failed(ServeError),
}

type Outcomes = Arc<Mutex<BTreeMap<usize, Outcome>>>;

/// One request's client: asks admission, collects every token, records the outcome.
struct Client {
    n: usize,
    ask: Option<AdmitAsk>,
    tokens: Vec<u32>,
    outcomes: Outcomes,
}

impl Client {
    fn record(&mut self, outcome: Outcome, fx: &mut dyn Effects<Msg>) {
        if let Ok(mut o) = self.outcomes.lock() {
            o.insert(self.n, outcome);
        }
        fx.stop();
    }
}

impl Behavior<Msg> for Client {
    fn name(&self) -> &'static str {
        "client"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        if let Some(ask) = self.ask.take() {
            let admission = Addr::new(HostId(0), well_known::ADMISSION);
            let _ = fx.send(admission, Msg::Admit { client: fx.me(), ask: Box::new(ask) });
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Client { event: ClientEvent::Tokens { tokens, .. } } => self.tokens.extend(tokens),
            Msg::Client { event: ClientEvent::Finished { finish, .. } } => {
                let tokens = std::mem::take(&mut self.tokens);
                self.record(Outcome::Done { tokens, finish }, fx);
            }
            Msg::Client { event: ClientEvent::Failed { error } } => self.record(Outcome::Failed(error), fx),
            _ => {}
        }
    }
}

/// Spawns each client at its arrival time (its own timers carry the asks).
struct Arrivals {
    asks: Vec<(Duration, AdmitAsk)>,
    outcomes: Outcomes,
    next: usize,
}

impl Behavior<Msg> for Arrivals {
    fn name(&self) -> &'static str {
        "arrivals"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        for (at, _) in &self.asks {
            fx.timer(*at, Msg::Tick);
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if msg == Msg::Tick
            && let Some((_, ask)) = self.asks.get(self.next)
        {
            let client =
                Client { n: self.next, ask: Some(ask.clone()), tokens: Vec::new(), outcomes: self.outcomes.clone() };
            fx.spawn(Box::new(client));
            self.next += 1;
        }
    }
}

/// Asks the router for its view once, keeps the answer.
struct Probe {
    view: Arc<Mutex<Option<Vec<ChipReport>>>>,
}

impl Behavior<Msg> for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        let router = Addr::new(HostId(0), well_known::ROUTER);
        let _ = fx.send(router, Msg::QueryCluster { reply_to: fx.me() });
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if let Msg::ClusterView { chips, .. } = msg {
            if let Ok(mut v) = self.view.lock() {
                *v = Some(chips);
            }
            fx.stop();
        }
    }
}

/// A deterministic pseudo-random stream (an LCG): the workload's only source of chance.
struct Lcg(u64);

impl Lcg {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct Run {
    outcomes: BTreeMap<usize, Outcome>,
    view: Vec<ChipReport>,
    trace: Vec<String>,
    asked: Vec<usize>,
}

const REQUESTS: usize = 40;

/// The cluster, as an operator would write it: the gateway's host and one more, a
/// chip on each.
const TOPOLOGY: &str = r#"
[cluster]
name = "virtual"
model = "builtin:tiny"

[router]
max_queued_requests = 1000

[supervisor]
heartbeat_interval_ms = 100
heartbeat_timeout_ms = 500
max_restarts = 3
restart_window_s = 60
restart_backoff_ms = 200

[gateway]
host = "h0"
max_inflight_requests = 64

[disagg]
lease_ms = 5000

[[hosts]]
name = "h0"
bus = "127.0.0.1:7400"
[[hosts.chips]]
id = "c0"
kind = "cpu"
backend = "cpu"
role = "both"
max_batch_tokens = 64
max_batch_seqs = 8

[[hosts]]
name = "h1"
bus = "127.0.0.1:7410"
[[hosts.chips]]
id = "c1"
kind = "cpu"
backend = "cpu"
role = "both"
max_batch_tokens = 64
max_batch_seqs = 8
"#;

fn run(seed: u64, recorder: Arc<dyn metrics::Recorder + Send + Sync>) -> Run {
    let spec = tessera_topology::parse(TOPOLOGY, "virtual.toml").expect("the test topology is valid");
    let mut vh: VirtualHost<Msg> = VirtualHost::new(Duration::from_micros(200)).with_recorder(recorder);
    // The very builder the real node uses, with modelled executors.
    for host in &spec.hosts {
        let built =
            build_host(&spec, &host.name, 1, None, None, |_, _| Ok::<_, String>(modelled_chip())).expect("build");
        for (actor, behavior) in built.actors {
            vh.spawn_at(Addr::new(built.host, actor), behavior);
        }
    }

    // Poisson arrivals, 40 per second, from t = 0.3 s (the chips are up by then).
    let mut rng = Lcg(seed);
    let mut at = Duration::from_millis(300);
    let mut asks = Vec::new();
    let mut asked = Vec::new();
    for n in 0..REQUESTS {
        at += Duration::from_secs_f64(-(1.0 - rng.next_f64()).ln() / 40.0);
        let prompt: Vec<u32> = (0..8 + (rng.next_f64() * 56.0) as u32).map(|i| (i * 13 + n as u32) % VOCAB).collect();
        let max_tokens = 16 + (rng.next_f64() * 48.0) as usize;
        asked.push(max_tokens);
        asks.push((
            at,
            AdmitAsk {
                prompt,
                max_tokens,
                sampling: SamplingSpec::greedy(),
                delivery: Delivery::Stream,
                forks: Vec::new(),
                tenant: 0,
            },
        ));
    }
    let outcomes: Outcomes = Arc::default();
    vh.spawn(HostId(0), Box::new(Arrivals { asks, outcomes: outcomes.clone(), next: 0 }));

    // Host 1 (its chip and supervisor) is lost while requests run on it: after 0.7 s,
    // as soon as a request is placed there.
    vh.run_until(Moment(700_000_000));
    let placed_on_1 = |vh: &VirtualHost<Msg>| {
        vh.trace().last().is_some_and(|l| l.contains(" routed ") && l.contains("chip: Addr { host: HostId(1)"))
    };
    assert!(vh.run_while(Moment(5_000_000_000), placed_on_1), "no request went to host 1");
    vh.kill_host(HostId(1));
    let all_done = |_: &VirtualHost<Msg>| outcomes.lock().is_ok_and(|o| o.len() == REQUESTS);
    assert!(vh.run_while(Moment(120_000_000_000), all_done), "requests still open after 120 s of virtual time");

    // A heartbeat later, the router's view of the surviving chip is current.
    let settle = vh.now().after(Duration::from_millis(300));
    vh.run_until(settle);
    let view = Arc::new(Mutex::new(None));
    vh.spawn(HostId(0), Box::new(Probe { view: view.clone() }));
    let answered = |_: &VirtualHost<Msg>| view.lock().is_ok_and(|v| v.is_some());
    assert!(vh.run_while(vh.now().after(Duration::from_secs(1)), answered), "the router did not answer");
    let view = view.lock().ok().and_then(|mut v| v.take()).unwrap_or_default();
    let outcomes = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    Run { outcomes, view, trace: vh.trace().to_vec(), asked }
}

/// A recorder of its own per simulated cluster.
fn recorder() -> (Arc<DebuggingRecorder>, Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    (Arc::new(recorder), snapshotter)
}

/// Router decisions counted in a recorder, over all placements.
fn decisions(snapshotter: &Snapshotter) -> u64 {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "tessera_router_decisions_total")
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

#[test]
fn forty_requests_survive_a_lost_host_in_virtual_time_deterministically() {
    let (first_recorder, first_metrics) = recorder();
    let first = run(7, first_recorder);
    for (n, outcome) in &first.outcomes {
        match outcome {
            Outcome::Done { tokens, finish } => {
                assert_eq!(*finish, Finish::Length, "request {n}");
                assert_eq!(tokens.len(), first.asked[*n], "request {n} got all its tokens");
            }
            Outcome::Failed(why) => panic!("request {n} failed: {why:?}"),
        }
    }
    let survivor = first.view.iter().find(|c| &*c.id == "c0").expect("c0 in the view");
    assert_eq!(survivor.state, ChipState::Up);
    assert_eq!((survivor.kv_blocks_used, survivor.running, survivor.waiting), (0, 0, 0), "{survivor:?}");
    assert!(survivor.kv_blocks_total > 0);
    let lost = first.view.iter().find(|c| &*c.id == "c1").expect("c1 in the view");
    assert_ne!(lost.state, ChipState::Up, "{lost:?}");
    // The lost host really had work: some requests were re-routed from it.
    let rerouted = first.trace.iter().filter(|l| l.contains(" chip_lost ")).count();
    assert!(rerouted > 0, "no request was running on the lost host");

    let second = run(7, Arc::new(metrics::NoopRecorder));
    assert_eq!(first.trace.len(), second.trace.len());
    assert!(first.trace == second.trace, "same seed, different traces");
    let (other_recorder, other_metrics) = recorder();
    let other = run(8, other_recorder);
    assert!(first.trace != other.trace, "the seed does not matter?");

    // Each cluster's metrics went to its own recorder, and only there: one decision per
    // placement its own trace shows.
    let placed = |run: &Run| run.trace.iter().filter(|l| l.contains(" routed ")).count() as u64;
    assert!(placed(&first) >= REQUESTS as u64);
    assert_eq!(decisions(&first_metrics), placed(&first));
    assert_eq!(decisions(&other_metrics), placed(&other));
}

/// The virtual cluster of two chips under an offered load of about three times what it
/// serves, then a light one: past capacity, requests wait in the router's queue and
/// are refused with 429 (`Overloaded` with a `Retry-After`) when the queue is full or
/// their deadline passes — never a timeout, a crash or a partial answer; once the load
/// drops every request completes, and the pools end all-free.
#[test]
fn three_times_capacity_gives_429s_with_retry_after_and_full_recovery() {
    let topology = TOPOLOGY
        .replace(
            "max_queued_requests = 1000",
            "max_queued_requests = 16\nmax_waiting_requests = 32\nqueue_timeout_ms = 500",
        )
        .replace("max_inflight_requests = 64", "max_inflight_requests = 96");
    let spec = tessera_topology::parse(&topology, "overload.toml").expect("the test topology is valid");
    let mut vh: VirtualHost<Msg> = VirtualHost::new(Duration::from_micros(200));
    for host in &spec.hosts {
        let built =
            build_host(&spec, &host.name, 1, None, None, |_, _| Ok::<_, String>(modelled_chip())).expect("build");
        for (actor, behavior) in built.actors {
            vh.spawn_at(Addr::new(built.host, actor), behavior);
        }
    }
    // Each request: 32 prompt tokens, 48 new ones. Two chips of 8 sequences at about
    // 2.8 ms a step serve some 120 requests/s; 2 s at 360/s, then 2 s at 20/s.
    let mut asks = Vec::new();
    let mut at = Duration::from_millis(300);
    let mut overload = 0;
    for n in 0..760usize {
        let heavy = n < 720;
        at += Duration::from_secs_f64(if heavy { 1.0 / 360.0 } else { 1.0 / 20.0 });
        overload += usize::from(heavy);
        let prompt: Vec<u32> = (0..32).map(|i| (i * 13 + n as u32) % VOCAB).collect();
        asks.push((
            at,
            AdmitAsk {
                prompt,
                max_tokens: 48,
                sampling: SamplingSpec::greedy(),
                delivery: Delivery::Stream,
                forks: Vec::new(),
                tenant: 0,
            },
        ));
    }
    let total = asks.len();
    let outcomes: Outcomes = Arc::default();
    vh.spawn(HostId(0), Box::new(Arrivals { asks, outcomes: outcomes.clone(), next: 0 }));
    let all_done = |_: &VirtualHost<Msg>| outcomes.lock().is_ok_and(|o| o.len() == total);
    assert!(vh.run_while(Moment(60_000_000_000), all_done), "requests still open after 60 s of virtual time");
    let settle = vh.now().after(Duration::from_millis(300));
    vh.run_until(settle);

    let outcomes = outcomes.lock().map(|o| o.clone()).unwrap_or_default();
    let mut refused = 0;
    for (n, outcome) in &outcomes {
        match outcome {
            Outcome::Done { tokens, finish } => {
                assert_eq!((tokens.len(), *finish), (48, Finish::Length), "request {n} answered in full")
            }
            Outcome::Failed(error) => {
                assert_eq!(error.kind, ErrorKind::Overloaded, "request {n}: {error:?}");
                assert!(error.retry_after_s.is_some_and(|s| s >= 1), "request {n} says when to retry: {error:?}");
                assert!(*n < overload, "request {n} came after the load dropped, and was refused: {error:?}");
                refused += 1;
            }
        }
    }
    assert!(refused > overload / 3, "three times capacity refuses many: {refused} of {overload}");
    assert!(refused < overload, "and serves some: {refused} of {overload}");

    let view = Arc::new(Mutex::new(None));
    vh.spawn(HostId(0), Box::new(Probe { view: view.clone() }));
    let answered = |_: &VirtualHost<Msg>| view.lock().is_ok_and(|v| v.is_some());
    assert!(vh.run_while(vh.now().after(Duration::from_secs(1)), answered), "the router did not answer");
    let view = view.lock().ok().and_then(|mut v| v.take()).unwrap_or_default();
    assert_eq!(view.len(), 2);
    for chip in &view {
        assert_eq!(chip.state, ChipState::Up, "{chip:?}");
        assert_eq!((chip.kv_blocks_used, chip.running, chip.waiting), (0, 0, 0), "pools all-free: {chip:?}");
    }
}
