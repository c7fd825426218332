//! The production behaviors — admission, request, router, supervisor, chips with their
//! batchers and KV pools — on the actor core's virtual-time host: two hosts, a chip on
//! each whose executor declares modelled time instead of computing, 40 requests, and
//! one host lost mid-run. Every request must complete with its full output, the
//! surviving pool must end all-free, and two runs with the same seed must produce
//! byte-identical traces.

use crate::admission::{Admission, AdmissionConfig};
use crate::batcher::StepPlan;
use crate::chip::executor::{ExecutorFactory, KvInstall, StepExecutor};
use crate::chip::{Chip, ChipConfig};
use crate::msg::{
    AdmitAsk, ChipInfo, ChipReport, ChipState, ClientEvent, DType, Finish, KvCompat, KvFormatDesc, KvLayout, Msg, Role,
    SamplingSpec, StepOutcome, well_known,
};
use crate::request::RetryPolicy;
use crate::router::Router;
use crate::supervisor::{Supervisor, SupervisorConfig};
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
            .filter(|s| s.sample)
            .map(|s| {
                let last = s.tokens.last().copied().unwrap_or(0) as u64;
                let pos = (s.start_pos + s.tokens.len()) as u64;
                (s.request_id, ((last * 7919 + pos * 104_729) % VOCAB as u64) as u32)
            })
            .collect();
        let model = Duration::from_micros(2_000 + 20 * plan.tokens() as u64);
        ctx.elapse(model);
        StepOutcome { step, sampled, error: None, elapsed_s: model.as_secs_f64() }
    }

    fn install(&mut self, _job: &KvInstall) -> Result<(), String> {
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
    Failed(String),
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
            let _ = fx.send(admission, Msg::Admit { client: fx.me(), ask });
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Client { event: ClientEvent::Tokens { tokens } } => self.tokens.extend(tokens),
            Msg::Client { event: ClientEvent::Finished { finish, .. } } => {
                let tokens = std::mem::take(&mut self.tokens);
                self.record(Outcome::Done { tokens, finish }, fx);
            }
            Msg::Client { event: ClientEvent::Failed { error } } => self.record(Outcome::Failed(error.message), fx),
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

fn run(seed: u64) -> Run {
    let hosts = [HostId(0), HostId(1)];
    let chip = |h: HostId| Addr::new(h, well_known::CHIP_BASE);
    let supervisor = |h: HostId| Addr::new(h, well_known::SUPERVISOR);
    let router = Addr::new(HostId(0), well_known::ROUTER);
    let mut vh: VirtualHost<Msg> = VirtualHost::new(Duration::from_micros(200));

    let reports =
        hosts.iter().map(|&h| ChipReport::starting(chip(h), format!("c{}", h.0), format!("h{}", h.0), Role::Both));
    vh.spawn_at(router, Box::new(Router::new(reports.collect(), 1000)));
    let retry = RetryPolicy::default();
    let admission = AdmissionConfig { max_inflight: 64, router, retry, id_base: 1 };
    vh.spawn_at(Addr::new(HostId(0), well_known::ADMISSION), Box::new(Admission::new(admission)));
    for &h in &hosts {
        let peers = hosts.iter().filter(|&&p| p != h).map(|&p| (p, format!("h{}", p.0))).collect();
        let config = SupervisorConfig {
            host: h,
            host_name: format!("h{}", h.0),
            peers,
            router: (h == HostId(0)).then_some(router),
            heartbeat_interval: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(500),
            max_restarts: 3,
            restart_window: Duration::from_secs(60),
            restart_backoff: Duration::from_millis(200),
        };
        vh.spawn_at(supervisor(h), Box::new(Supervisor::new(config)));
        let chip_config = ChipConfig {
            id: format!("c{}", h.0),
            host_name: format!("h{}", h.0),
            role: Role::Both,
            max_batch_tokens: 64,
            max_batch_seqs: 8,
            supervisor: supervisor(h),
            kv_lease: Duration::from_secs(5),
        };
        vh.spawn_at(chip(h), Box::new(Chip::new(chip_config, modelled_chip())));
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
        asks.push((at, AdmitAsk { prompt, max_tokens, sampling: SamplingSpec::greedy() }));
    }
    let outcomes: Outcomes = Arc::default();
    vh.spawn(HostId(0), Box::new(Arrivals { asks, outcomes: outcomes.clone(), next: 0 }));

    // Host 1 (its chip and supervisor) is lost while requests run on it.
    vh.run_until(Moment(700_000_000));
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

#[test]
fn forty_requests_survive_a_lost_host_in_virtual_time_deterministically() {
    let first = run(7);
    for (n, outcome) in &first.outcomes {
        match outcome {
            Outcome::Done { tokens, finish } => {
                assert_eq!(*finish, Finish::Length, "request {n}");
                assert_eq!(tokens.len(), first.asked[*n], "request {n} got all its tokens");
            }
            Outcome::Failed(why) => panic!("request {n} failed: {why}"),
        }
    }
    let survivor = first.view.iter().find(|c| c.id == "c0").expect("c0 in the view");
    assert_eq!(survivor.state, ChipState::Up);
    assert_eq!((survivor.kv_blocks_used, survivor.running, survivor.waiting), (0, 0, 0), "{survivor:?}");
    assert!(survivor.kv_blocks_total > 0);
    let lost = first.view.iter().find(|c| c.id == "c1").expect("c1 in the view");
    assert_ne!(lost.state, ChipState::Up, "{lost:?}");
    // The lost host really had work: some requests were re-routed from it.
    let rerouted = first.trace.iter().filter(|l| l.contains(" chip_lost ")).count();
    assert!(rerouted > 0, "no request was running on the lost host");

    let second = run(7);
    assert_eq!(first.trace.len(), second.trace.len());
    assert!(first.trace == second.trace, "same seed, different traces");
    let other = run(8);
    assert!(first.trace != other.trace, "the seed does not matter?");
}
