//! The solver actor, on the gateway's host. It listens to admission's telemetry
//! (arrivals, prompt and output lengths) and to every host's heartbeat (which chips are
//! up, what each does, how fast it steps, how much of its prompts came from cache),
//! re-solves when the traffic or the fleet changes and on a period, and publishes each
//! result as a [`StrategySet`] on `topic::STRATEGIES`: the Pareto set of strategies for
//! the chips up now, best first on the configured objective, each with the chips it
//! would move and how long they would take to drain.
//!
//! A strategy is applied on an operator's word (`ApplyStrategy`, which `tessera plan
//! apply` sends) or, in `auto` mode, by the solver itself with hysteresis: a new
//! strategy replaces the one in force only when it scores `min_gain_percent` better on
//! the same traffic and the one in force has run `dwell_s`, unless the one in force lost
//! a chip or serves nothing within the SLOs. Applying sends each host's supervisor the
//! changes to its chips; each chip drains what it holds before it takes its new role,
//! so no request is lost.
//!
//! The search itself (`tessera-planner`) runs as a job on the solver's own worker, so a
//! large fleet's solve never holds up the actor; in virtual time it takes no time.

use crate::host::chip_addr;
use crate::msg::{
    AppliedPlan, ChipChange, ChipReport, ChipState, Duty, Msg, PlanView, StrategySet, StrategyView, Telemetry, topic,
    well_known,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;
use tessera_actor_core::actor::WorkerState;
use tessera_actor_core::{Addr, Behavior, Effects, HostId, Job, Moment, WorkerId, WorkerSpec};
use tessera_planner::analytic::{TableCache, Tables, evaluate};
use tessera_planner::{Figures, Fleet, KindSpec, Roles, Slo, Space, Strategy, Workload};
use tessera_topology::perf::{Link, ModelShape, PerfModel, Power};
use tessera_topology::{Backend, ClusterSpec, DType, Role, SolverObjective, SolverSpec};

/// One chip as the solver knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SolverChip {
    pub id: String,
    pub addr: Addr,
    /// Its host's supervisor, which applies plans to it.
    pub supervisor: Addr,
    /// What it does in the topology as written.
    pub duty: Duty,
}

/// A cluster's chips grouped by kind (in order of first appearance), each kind as the
/// performance models cost it, and each kind's chips in topology order.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetChips {
    pub fleet: Fleet,
    pub chips: Vec<Vec<SolverChip>>,
}

/// Why a cluster's fleet cannot be costed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FleetError {
    #[error("chip kind {0:?} has no price (give its [[chip_kinds]] entry one)")]
    NoPrice(String),
    #[error("unknown chip kind {0:?}")]
    UnknownKind(String),
    #[error("{0}")]
    Instance(String),
    #[error("chip {chip}: the weights ({weights} bytes) do not fit its memory ({memory} bytes)")]
    WeightsExceedMemory { chip: String, weights: u64, memory: u64 },
}

/// How a fleet's kinds are costed: the model (its shape for a KV dtype, its weight
/// bytes), each kind's performance model and price, and the link KV crosses between a
/// prefill and a decode chip.
pub struct Costing<'a> {
    pub shape: &'a dyn Fn(DType) -> ModelShape,
    pub weight_bytes: u64,
    pub perf: &'a dyn Fn(&str) -> PerfModel,
    pub price: &'a dyn Fn(&str) -> Option<f64>,
    pub link: Link,
}

fn duty_of(role: Role) -> Duty {
    match role {
        Role::Prefill => Duty::Prefill,
        Role::Decode => Duty::Decode,
        Role::Both => Duty::Both,
    }
}

/// How a chip of `backend` is timed: an emulated chip (`emu:KIND`) as the real node
/// paces it, time scale included; any other at its kind's unscaled model.
pub fn time_scale(spec: &ClusterSpec, backend: &Backend) -> f64 {
    match backend {
        Backend::Emu(_) => spec.emulation.time_scale,
        Backend::Cpu | Backend::Plugin(_) => 1.0,
    }
}

/// The kind name of an instance shape: its stages' kinds, tensor-parallel degree and
/// layers, e.g. `nvidia-a100 tp8`, `nvidia-h100+nvidia-a100 tp4 pp[44,36]`.
fn instance_kind_name(
    par: &tessera_topology::ParallelSpec,
    stages: &[tessera_topology::perf::parallel::Stage],
) -> String {
    let mut kinds: Vec<&str> = (0..par.stages()).map(|s| par.stage(s)[0].kind.as_str()).collect();
    kinds.dedup();
    let mut name = kinds.join("+");
    if par.tp > 1 {
        name += &format!(" tp{}", par.tp);
    }
    if stages.len() > 1 {
        let layers: Vec<String> = stages.iter().map(|s| s.layers.to_string()).collect();
        name += &format!(" pp[{}]", layers.join(","));
    }
    name
}

/// `spec`'s chips as a [`Fleet`] costed by `costing`; an instance is one chip of the
/// kind its shape names.
pub fn fleet_of(spec: &ClusterSpec, costing: &Costing) -> Result<FleetChips, FleetError> {
    let mut kinds: Vec<KindSpec> = Vec::new();
    let mut chips: Vec<Vec<SolverChip>> = Vec::new();
    let mut kv_dtype = None;
    for (h, host) in spec.hosts.iter().enumerate() {
        for (i, chip) in host.chips.iter().enumerate() {
            kv_dtype.get_or_insert(chip.kv_dtype);
            let known = SolverChip {
                id: chip.id.clone(),
                addr: chip_addr(h, i),
                supervisor: Addr::new(HostId(h as u16), well_known::SUPERVISOR),
                duty: duty_of(chip.role),
            };
            let (name, modelled) = match &chip.parallel {
                None => (chip.kind.clone(), None),
                Some(par) => {
                    let shape = (costing.shape)(chip.kv_dtype);
                    let modelled = tessera_topology::parallel::model_instance(spec, chip, par, &shape)
                        .map_err(FleetError::Instance)?;
                    (instance_kind_name(par, &modelled.stages), Some((par, modelled)))
                }
            };
            if let Some(k) = kinds.iter().position(|k| k.name == name) {
                kinds[k].chips += 1;
                chips[k].push(known);
                continue;
            }
            let kind = spec.chip_kind(&chip.kind).ok_or_else(|| FleetError::UnknownKind(chip.kind.clone()))?;
            let shape = (costing.shape)(chip.kv_dtype);
            let breaker = |tokens: u64| tokens * spec.router.kv_breaker_percent as u64 / 100;
            let (stages, kv_tokens, usd_per_hour, power) = match modelled {
                None => {
                    let memory = chip.memory_limit_bytes.unwrap_or(kind.memory_bytes);
                    let rest = memory.checked_sub(costing.weight_bytes).ok_or_else(|| {
                        FleetError::WeightsExceedMemory { chip: chip.id.clone(), weights: costing.weight_bytes, memory }
                    })?;
                    // As a modelled chip: an eighth of what the weights leave is step
                    // scratch. The router sends nothing new to a chip past its KV
                    // breaker, so that share is what a chip's batch can use.
                    let kv_tokens = breaker((rest - rest / 8) / shape.kv_bytes_per_token().max(1));
                    let usd = (costing.price)(&chip.kind).ok_or_else(|| FleetError::NoPrice(chip.kind.clone()))?;
                    (Vec::new(), kv_tokens, usd, Power::from_tdp(kind.tdp_w))
                }
                Some((par, modelled)) => {
                    // An instance costs what its chips cost, and draws their power.
                    let (mut usd, mut tdp) = (0.0, 0.0);
                    for c in &par.chips {
                        usd += (costing.price)(&c.kind).ok_or_else(|| FleetError::NoPrice(c.kind.clone()))?;
                        tdp += spec.chip_kind(&c.kind).ok_or_else(|| FleetError::UnknownKind(c.kind.clone()))?.tdp_w;
                    }
                    (modelled.stages, breaker(modelled.kv_tokens), usd, Power::from_tdp(tdp))
                }
            };
            kinds.push(KindSpec {
                name,
                chips: 1,
                stages,
                roof: kind.roof(),
                perf: (costing.perf)(&chip.kind),
                time_scale: time_scale(spec, &chip.backend),
                usd_per_hour,
                power,
                kv_tokens,
            });
            chips.push(vec![known]);
        }
    }
    let model = (costing.shape)(kv_dtype.unwrap_or(DType::F16));
    Ok(FleetChips { fleet: Fleet { model, kinds, link: costing.link }, chips })
}

/// What the solver runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct SolverConfig {
    pub spec: SolverSpec,
    pub fleet: FleetChips,
    /// The limits a strategy may set: at most every chip's configured ones (a chip's
    /// buffers are sized for those), and the topology's disaggregation threshold.
    pub space: Space,
}

/// The solver of `spec`, its fleet costed by `costing`.
pub fn solver_config(spec: &ClusterSpec, costing: &Costing) -> Result<SolverConfig, FleetError> {
    let fleet = fleet_of(spec, costing)?;
    let chips = || spec.chips().map(|(_, _, c)| c);
    let most_tokens = chips().map(|c| c.max_batch_tokens).min().unwrap_or(1) as u32;
    let most_seqs = chips().map(|c| c.max_batch_seqs).min().unwrap_or(1) as u32;
    let within = |values: Vec<u32>, most: u32| {
        let mut v: Vec<u32> = values.into_iter().filter(|&x| x <= most).chain([most]).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let d = Space::default();
    let space = Space {
        prefill_budgets: within(d.prefill_budgets, most_tokens),
        decode_caps: within(d.decode_caps, most_seqs),
        min_prompt_tokens: vec![u32::try_from(spec.disagg.min_prompt_tokens).unwrap_or(u32::MAX)],
    };
    Ok(SolverConfig { spec: spec.solver, fleet, space })
}

/// Telemetry windows (of `telemetry_interval_ms`, 5 s by default) the traffic is
/// estimated over: at most this many.
const HORIZON_WINDOWS: f64 = 12.0;
/// The newest windows are tested against the older ones for a change of rate over at
/// least this many ...
const RECENT_WINDOWS: f64 = 2.0;
/// ... with the older ones covering at least this many ...
const BASE_WINDOWS: f64 = 2.0;
/// ... and a change counts when the recent arrivals are this many standard deviations
/// (Poisson) off what the older rate predicts.
const CHANGE_SIGMAS: f64 = 3.0;
/// The first solve waits for this many windows of telemetry (unless asked): the
/// requests that end first are the short ones, so an earlier estimate of output
/// lengths would be biased short.
const FIRST_SOLVE_WINDOWS: f64 = 6.0;
/// Strategies a set publishes.
const PUBLISHED: usize = 64;

/// A mean length on a grid of 2% steps (within 1% of it): lengths measured a little
/// apart from one solve to the next give the same step-time tables, which the next
/// solve then reuses.
fn on_grid(length: f64) -> f64 {
    const STEP: f64 = 0.02;
    if length <= 1.0 { 1.0 } else { ((length.ln() / STEP).round() * STEP).exp() }
}

/// A chip as its host last reported it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    state: ChipState,
    duty: Duty,
    prefix: (u64, u64),
}

impl Seen {
    fn of(r: &ChipReport) -> Seen {
        let duty = if r.parked { Duty::Idle } else { duty_of(r.role) };
        Seen { state: r.state, duty, prefix: (r.prefix_prompt_tokens, r.prefix_reused_tokens) }
    }
}

/// What a solve is run on.
struct SolveInput {
    seq: u64,
    at_s: f64,
    reason: String,
    objective: SolverObjective,
    /// The fleet's kinds with only their up chips counted, and those chips (id, duty
    /// in force) per kind.
    fleet: Fleet,
    up: Vec<Vec<(String, Duty)>>,
    chips_total: usize,
    observed_rate_rps: f64,
    prefix_hit_rate: Option<f64>,
    workload: Workload,
    slo: Slo,
    space: Space,
    /// The strategy in force over the up chips, and its id.
    current: (Strategy, String),
}

/// The objective's value of `figures` (higher is better).
fn score(objective: SolverObjective, figures: &Figures) -> f64 {
    match objective {
        SolverObjective::GoodputPerUsd => figures.goodput_per_usd(),
        SolverObjective::Goodput => figures.goodput_rps,
    }
}

/// The chips `strategy` gives each duty, keeping chips in their duty where it can.
fn duties_under(up: &[Vec<(String, Duty)>], strategy: &Strategy) -> Vec<(String, Duty)> {
    let mut out = Vec::new();
    for (chips, roles) in up.iter().zip(&strategy.roles) {
        let now: Vec<Duty> = chips.iter().map(|(_, d)| *d).collect();
        out.extend(chips.iter().map(|(id, _)| id.clone()).zip(tessera_planner::assign(&now, roles)));
    }
    out
}

/// A strategy as published.
fn view(input: &SolveInput, id: String, strategy: &Strategy, figures: Figures, now: Option<&Figures>) -> StrategyView {
    let duties = duties_under(&input.up, strategy);
    let moves: Vec<(String, Duty, Duty)> = input
        .up
        .iter()
        .flatten()
        .zip(&duties)
        .filter(|((_, from), (_, to))| from != to)
        .map(|((chip, from), (_, to))| (chip.clone(), *from, *to))
        .collect();
    let drain_s = tessera_planner::drain_estimate(moves.iter().map(|m| m.1), input.workload.osl, now);
    StrategyView {
        id,
        summary: strategy.describe(&input.fleet),
        duties,
        max_batch_tokens: strategy.prefill_budget,
        max_batch_seqs: strategy.decode_cap,
        figures,
        score: score(input.objective, &figures),
        moves,
        drain_s: drain_s.unwrap_or(0.0),
    }
}

/// One solve: the Pareto set for the input's traffic over its up chips, best first,
/// with the step-time tables of earlier solves reused from `cache`.
fn solve(input: SolveInput, cache: &mut TableCache) -> Result<StrategySet, String> {
    let (built, reused) = (cache.built, cache.reused);
    let set = tessera_planner::search::solve_with(&input.fleet, &input.workload, &input.slo, &input.space, cache)
        .map_err(|e| e.to_string())?;
    let (tables_built, tables_reused) = (cache.built - built, cache.reused - reused);
    let (current, current_id) = &input.current;
    let tables = Tables::new(&input.fleet, &input.workload, current.prefill_budget, current.decode_cap);
    let now = evaluate(&input.fleet, &tables, current, &input.workload, &input.slo);
    // Best on the objective; of equals, the cheaper, then the one that moves fewer chips
    // (counted once per strategy, not per comparison).
    let moved = |s: &Strategy| {
        let duties = duties_under(&input.up, s);
        input.up.iter().flatten().zip(&duties).filter(|((_, a), (_, b))| a != b).count()
    };
    let mut ranked: Vec<_> =
        set.into_iter().map(|c| (score(input.objective, &c.figures), moved(&c.strategy), c)).collect();
    ranked.sort_by(|(a, m, x), (b, n, y)| {
        b.total_cmp(a)
            .then(x.figures.usd_per_hour.total_cmp(&y.figures.usd_per_hour))
            .then(m.cmp(n))
            .then(x.strategy.cmp(&y.strategy))
    });
    let strategies: Vec<StrategyView> = ranked
        .iter()
        .take(PUBLISHED)
        .enumerate()
        .map(|(row, (_, _, c))| {
            view(&input, format!("s{}-{}", input.seq, row + 1), &c.strategy, c.figures, now.as_ref())
        })
        .collect();
    let observed = Workload { rate_rps: input.observed_rate_rps, ..input.workload };
    let keeps_up = evaluate(&input.fleet, &tables, current, &observed, &input.slo).is_some();
    let current = now.map(|figures| view(&input, current_id.clone(), current, figures, None));
    Ok(StrategySet {
        seq: input.seq,
        at_s: input.at_s,
        reason: input.reason,
        observed_rate_rps: input.observed_rate_rps,
        prefix_hit_rate: input.prefix_hit_rate,
        workload: input.workload,
        slo: input.slo,
        objective: input.objective.to_string(),
        chips_up: input.up.iter().map(Vec::len).sum(),
        chips_total: input.chips_total,
        strategies,
        current,
        current_keeps_up: keeps_up,
        figures_from: "analytic".into(),
        tables_built,
        tables_reused,
    })
}

/// The solver actor (see the module's comment).
pub struct Solver {
    config: SolverConfig,
    worker: Option<WorkerId>,
    started: Moment,
    /// Telemetry windows, oldest first, within [`HORIZON_WINDOWS`].
    windows: VecDeque<Telemetry>,
    chips: BTreeMap<Addr, Seen>,
    /// The chips up when the last solve was started.
    solved_up: Option<BTreeSet<Addr>>,
    solving: bool,
    /// Why to solve again once the solve in flight is done.
    again: Option<String>,
    seq: u64,
    latest: Option<StrategySet>,
    applied: Option<AppliedPlan>,
    applied_at: Moment,
    applies: u64,
    /// Operator assignments applied so far (their ids are `manual-N`).
    manual: u64,
}

impl Solver {
    pub fn new(config: SolverConfig) -> Solver {
        Solver {
            config,
            worker: None,
            started: Moment::default(),
            windows: VecDeque::new(),
            chips: BTreeMap::new(),
            solved_up: None,
            solving: false,
            again: None,
            seq: 0,
            latest: None,
            applied: None,
            applied_at: Moment::default(),
            applies: 0,
            manual: 0,
        }
    }

    /// One telemetry window's nominal length, s (a little under: a window measured a
    /// hair short still counts).
    fn window_s(&self) -> f64 {
        self.config.spec.telemetry_interval_ms as f64 / 1e3 * 0.99
    }

    /// The step limits chips run with before any plan: the most the space allows.
    fn configured_limits(&self) -> (u32, u32) {
        let space = &self.config.space;
        (space.prefill_budgets.last().copied().unwrap_or(1), space.decode_caps.last().copied().unwrap_or(1))
    }

    fn known_chips(&self) -> impl Iterator<Item = &SolverChip> {
        self.config.fleet.chips.iter().flatten()
    }

    /// What each chip does now: as the plan in force says (chips drain into it), else
    /// as its host reports, else as the topology says.
    fn duty_now(&self, chip: &SolverChip) -> Duty {
        match &self.applied {
            // A chip the plan does not name was down when it was made: it has no duty.
            Some(plan) => plan.duties.iter().find(|(id, _)| *id == chip.id).map_or(Duty::Idle, |(_, duty)| *duty),
            None => self.chips.get(&chip.addr).map_or(chip.duty, |s| s.duty),
        }
    }

    /// The cluster's prefix hit rate since its chips started: prompt positions whose KV
    /// came from a prefix cache over all prompt positions (`None` before any prompt).
    fn prefix_hit_rate(&self) -> Option<f64> {
        let (prompt, reused) = self.chips.values().fold((0u64, 0u64), |(p, r), s| (p + s.prefix.0, r + s.prefix.1));
        (prompt > 0).then(|| reused as f64 / prompt as f64)
    }

    fn is_up(&self, chip: &SolverChip) -> bool {
        self.chips.get(&chip.addr).is_some_and(|s| s.state == ChipState::Up)
    }

    fn up_set(&self) -> BTreeSet<Addr> {
        self.known_chips().filter(|c| self.is_up(c)).map(|c| c.addr).collect()
    }

    /// The traffic over the windows kept: `None` until a request has both arrived and
    /// ended (its output length is what decode costs).
    fn workload(&self) -> Option<Workload> {
        let span: f64 = self.windows.iter().map(|w| w.window_s).sum();
        let sum = |f: fn(&Telemetry) -> u64| self.windows.iter().map(f).sum::<u64>() as f64;
        let (admitted, ended) = (sum(|w| w.admitted), sum(|w| w.ended));
        if span <= 0.0 || admitted == 0.0 || ended == 0.0 {
            return None;
        }
        Some(Workload {
            rate_rps: admitted / span,
            isl: on_grid(sum(|w| w.prompt_tokens) / admitted),
            osl: on_grid((sum(|w| w.output_tokens) / ended).max(1.0)),
        })
    }

    /// Folds in a telemetry window. When the newest windows' arrivals are far off what
    /// the older ones predict (a change of rate, not noise), the older ones are
    /// dropped, so the estimate is of the new rate alone: the newest window alone when
    /// it shows the change by itself, else the newest [`RECENT_WINDOWS`].
    fn observe(&mut self, telemetry: Telemetry) -> bool {
        self.windows.push_back(telemetry);
        let window_s = self.window_s();
        let mut span: f64 = self.windows.iter().map(|w| w.window_s).sum();
        while span > HORIZON_WINDOWS * window_s && self.windows.len() > 1 {
            span -= self.windows.pop_front().map_or(0.0, |w| w.window_s);
        }
        let threshold = self.config.spec.rate_change_percent as f64 / 100.0;
        // Whether the windows from `split` on differ from those before it.
        let differs = |windows: &VecDeque<Telemetry>, split: usize| {
            let (mut base_s, mut base_n, mut recent_s, mut recent_n) = (0.0, 0u64, 0.0, 0u64);
            for (i, w) in windows.iter().enumerate() {
                if i < split {
                    (base_s, base_n) = (base_s + w.window_s, base_n + w.admitted);
                } else {
                    (recent_s, recent_n) = (recent_s + w.window_s, recent_n + w.admitted);
                }
            }
            if base_s < BASE_WINDOWS * window_s || recent_s <= 0.0 {
                return false;
            }
            let expected = base_n as f64 / base_s * recent_s;
            let gap = (recent_n as f64 - expected).abs();
            gap > CHANGE_SIGMAS * expected.max(1.0).sqrt() && gap >= threshold * expected.max(1.0)
        };
        let newest = self.windows.len().saturating_sub(1);
        let (mut recent_s, mut split) = (0.0, self.windows.len());
        while split > 0 && recent_s < RECENT_WINDOWS * window_s {
            split -= 1;
            recent_s += self.windows[split].window_s;
        }
        let cut = if differs(&self.windows, newest) {
            newest
        } else if recent_s >= RECENT_WINDOWS * window_s && differs(&self.windows, split) {
            split
        } else {
            return false;
        };
        self.windows.drain(..cut);
        true
    }

    /// Starts a solve now, or once the one in flight is done.
    fn solve(&mut self, reason: &str, fx: &mut dyn Effects<Msg>) {
        if self.solving {
            self.again.get_or_insert_with(|| reason.to_string());
            return;
        }
        let (Some(worker), Some(workload)) = (self.worker, self.workload()) else { return };
        let mut fleet = self.config.fleet.fleet.clone();
        let mut up = Vec::new();
        let mut current_roles = Vec::new();
        for (kind, chips) in fleet.kinds.iter_mut().zip(&self.config.fleet.chips) {
            let live: Vec<(String, Duty)> =
                chips.iter().filter(|c| self.is_up(c)).map(|c| (c.id.clone(), self.duty_now(c))).collect();
            kind.chips = live.len() as u32;
            let duties: Vec<Duty> = live.iter().map(|(_, d)| *d).collect();
            current_roles.push(Roles::of(&duties));
            up.push(live);
        }
        if up.iter().all(Vec::is_empty) {
            return;
        }
        let space = &self.config.space;
        let (budget, cap) = match &self.applied {
            Some(plan) => (plan.max_batch_tokens, plan.max_batch_seqs),
            None => self.configured_limits(),
        };
        let current = Strategy {
            roles: current_roles,
            prefill_budget: budget,
            decode_cap: cap,
            min_prompt_tokens: space.min_prompt_tokens.first().copied().unwrap_or(0),
        };
        let current_id = self.applied.as_ref().map_or_else(|| "as-written".to_string(), |p| p.id.clone());
        self.seq += 1;
        let spec = &self.config.spec;
        // Planned for the rate plus the change that would set off the next solve, so the
        // strategy chosen holds until then.
        let headroom = 1.0 + spec.rate_change_percent as f64 / 100.0;
        let planned = Workload { rate_rps: workload.rate_rps * headroom, ..workload };
        let input = SolveInput {
            seq: self.seq,
            at_s: fx.now().since(self.started).as_secs_f64(),
            reason: reason.to_string(),
            objective: spec.objective,
            fleet,
            up,
            chips_total: self.known_chips().count(),
            observed_rate_rps: workload.rate_rps,
            prefix_hit_rate: self.prefix_hit_rate(),
            workload: planned,
            slo: Slo { ttft_s: spec.ttft_ms as f64 / 1e3, tpot_s: spec.tpot_ms as f64 / 1e3 },
            space: space.clone(),
            current: (current, current_id),
        };
        self.solved_up = Some(self.up_set());
        let job = Job {
            label: "solve",
            run: Box::new(move |state: &mut dyn std::any::Any, _: &mut dyn tessera_actor_core::JobCtx<Msg>| {
                let result = match state.downcast_mut::<TableCache>() {
                    Some(cache) => solve(input, cache),
                    None => solve(input, &mut TableCache::default()),
                };
                Msg::Solved { result: result.map(Box::new) }
            }),
        };
        match fx.submit(worker, job) {
            Ok(()) => self.solving = true,
            Err(e) => tracing::warn!(error = %e, "solver: cannot start a solve"),
        }
    }

    fn solved(&mut self, result: Result<Box<StrategySet>, String>, fx: &mut dyn Effects<Msg>) {
        self.solving = false;
        match result {
            Ok(set) => {
                metrics::counter!("tessera_solver_solves_total").increment(1);
                metrics::gauge!("tessera_solver_strategies").set(set.strategies.len() as f64);
                tracing::info!(
                    set = set.seq,
                    reason = %set.reason,
                    rate_rps = set.workload.rate_rps,
                    strategies = set.strategies.len(),
                    best = set.strategies.first().map_or("none", |s| s.summary.as_str()),
                    "solver: strategies published"
                );
                fx.publish(topic::STRATEGIES, Msg::Strategies { set: set.clone() });
                self.latest = Some(*set);
                if self.config.spec.auto {
                    self.auto_apply(fx);
                }
            }
            Err(error) => {
                metrics::counter!("tessera_solver_failures_total").increment(1);
                tracing::warn!(%error, "solver: the solve failed");
            }
        }
        if let Some(reason) = self.again.take() {
            self.solve(&reason, fx);
        }
    }

    /// Whether a chip the plan in force (else the topology as written) gives work has
    /// gone down.
    fn lost_a_chip(&self) -> bool {
        let down = |c: &SolverChip| {
            self.chips.get(&c.addr).is_some_and(|s| matches!(s.state, ChipState::Down | ChipState::Failed))
        };
        self.known_chips().any(|c| self.duty_now(c) != Duty::Idle && down(c))
    }

    /// `auto`: applies the latest set's best strategy when it wins by the configured
    /// margin after the dwell, or at once when the plan in force lost a chip or serves
    /// nothing within the SLOs.
    fn auto_apply(&mut self, fx: &mut dyn Effects<Msg>) {
        let Some(set) = &self.latest else { return };
        let Some(best) = set.strategies.first() else { return };
        let limits_now = match &self.applied {
            Some(plan) => (plan.max_batch_tokens, plan.max_batch_seqs),
            None => self.configured_limits(),
        };
        if best.moves.is_empty() && (best.max_batch_tokens, best.max_batch_seqs) == limits_now {
            return; // the best is what runs
        }
        let spec = &self.config.spec;
        let now_score = set.current.as_ref().map_or(0.0, |c| c.score);
        let urgent = self.lost_a_chip() || !set.current_keeps_up;
        let dwelt = self.applied.is_none() || fx.now().since(self.applied_at) >= Duration::from_secs(spec.dwell_s);
        let wins = best.score > now_score * (1.0 + spec.min_gain_percent as f64 / 100.0);
        if wins && (urgent || dwelt) {
            let id = best.id.clone();
            if let Err(error) = self.apply(&id, "auto", fx) {
                tracing::warn!(%error, "solver: auto apply failed");
            }
        }
    }

    /// Applies strategy `id` of the latest set.
    fn apply(&mut self, id: &str, by: &str, fx: &mut dyn Effects<Msg>) -> Result<AppliedPlan, String> {
        let Some(set) = &self.latest else {
            return Err("no strategy set yet: the solver solves once traffic has arrived and a request ended".into());
        };
        let Some(strategy) = set.strategies.iter().find(|s| s.id == id) else {
            let ids = match (set.strategies.first(), set.strategies.last()) {
                (Some(a), Some(b)) => format!("{}..{}", a.id, b.id),
                _ => "none".into(),
            };
            return Err(format!("no strategy {id:?} in the latest set (set {}: {ids})", set.seq));
        };
        let (id, summary, duties) = (strategy.id.clone(), strategy.summary.clone(), strategy.duties.clone());
        let limits = (strategy.max_batch_tokens, strategy.max_batch_seqs);
        Ok(self.put_in_force(id, summary, duties, limits, by, fx))
    }

    /// Applies an operator's own assignment: these chips take these duties, the others
    /// keep theirs, the step limits stay.
    fn apply_roles(&mut self, roles: &[(String, Duty)], fx: &mut dyn Effects<Msg>) -> Result<AppliedPlan, String> {
        if roles.is_empty() {
            return Err("no chip named: give one or more chip = duty".into());
        }
        if let Some((unknown, _)) = roles.iter().find(|(id, _)| !self.known_chips().any(|c| c.id == *id)) {
            let known: Vec<&str> = self.known_chips().map(|c| c.id.as_str()).collect();
            return Err(format!("unknown chip {unknown:?}; chips: {}", known.join(", ")));
        }
        let duty_of = |c: &SolverChip| roles.iter().rfind(|(id, _)| *id == c.id).map_or(self.duty_now(c), |(_, d)| *d);
        let duties: Vec<(String, Duty)> = self.known_chips().map(|c| (c.id.clone(), duty_of(c))).collect();
        if !self.known_chips().any(|c| matches!(duty_of(c), Duty::Decode | Duty::Both)) {
            return Err("no chip would decode: every request needs a decode (or both) chip".into());
        }
        let limits = match &self.applied {
            Some(plan) => (plan.max_batch_tokens, plan.max_batch_seqs),
            None => self.configured_limits(),
        };
        let roles: Vec<Roles> = self
            .config
            .fleet
            .chips
            .iter()
            .map(|kind| Roles::of(&kind.iter().map(&duty_of).collect::<Vec<_>>()))
            .collect();
        let strategy = Strategy {
            roles,
            prefill_budget: limits.0,
            decode_cap: limits.1,
            min_prompt_tokens: self.config.space.min_prompt_tokens.first().copied().unwrap_or(0),
        };
        self.manual += 1;
        let summary = strategy.describe(&self.config.fleet.fleet);
        Ok(self.put_in_force(format!("manual-{}", self.manual), summary, duties, limits, "operator", fx))
    }

    /// Puts a plan in force: each host's supervisor gets the changes to its chips
    /// (the chips whose duty changes drain first), and the plan is published.
    fn put_in_force(
        &mut self,
        id: String,
        summary: String,
        duties: Vec<(String, Duty)>,
        (max_batch_tokens, max_batch_seqs): (u32, u32),
        by: &str,
        fx: &mut dyn Effects<Msg>,
    ) -> AppliedPlan {
        let mut by_supervisor: BTreeMap<Addr, Vec<ChipChange>> = BTreeMap::new();
        let mut moves = Vec::new();
        for chip in self.known_chips() {
            let Some((_, duty)) = duties.iter().find(|(c, _)| *c == chip.id) else { continue };
            let now = self.duty_now(chip);
            let reported = self.chips.get(&chip.addr).map_or(chip.duty, |s| s.duty);
            if *duty != now {
                moves.push((chip.id.clone(), now, *duty));
            }
            let change = ChipChange {
                chip: chip.addr,
                duty: (*duty != now || *duty != reported).then_some(*duty),
                max_batch_tokens,
                max_batch_seqs,
            };
            by_supervisor.entry(chip.supervisor).or_default().push(change);
        }
        for (supervisor, changes) in by_supervisor {
            if let Err(e) = fx.send(supervisor, Msg::ApplyPlan { changes }) {
                tracing::warn!(%supervisor, error = %e, "solver: a plan could not reach a supervisor");
            }
        }
        for (chip, duty) in &duties {
            for d in [Duty::Prefill, Duty::Decode, Duty::Both, Duty::Idle] {
                let labels = [("chip", chip.clone()), ("duty", d.to_string())];
                metrics::gauge!("tessera_solver_chip_duty", &labels).set(f64::from(u8::from(*duty == d)));
            }
        }
        metrics::counter!("tessera_solver_plans_applied_total", "by" => by.to_string()).increment(1);
        let plan = AppliedPlan {
            id,
            summary,
            duties,
            max_batch_tokens,
            max_batch_seqs,
            at_s: fx.now().since(self.started).as_secs_f64(),
            by: by.to_string(),
            moves,
        };
        tracing::info!(id = %plan.id, by, plan = %plan.summary, moves = plan.moves.len(), "solver: strategy applied");
        fx.publish(topic::PLANS, Msg::PlanApplied { result: Ok(Box::new(plan.clone())) });
        self.applied = Some(plan.clone());
        self.applied_at = fx.now();
        self.applies += 1;
        plan
    }

    fn view(&self) -> PlanView {
        PlanView {
            auto: self.config.spec.auto,
            objective: self.config.spec.objective.to_string(),
            chips: self
                .known_chips()
                .map(|c| {
                    let duty = self.chips.get(&c.addr).map_or(c.duty, |s| s.duty);
                    (c.id.clone(), duty)
                })
                .collect(),
            applied: self.applied.clone(),
            latest: self.latest.clone(),
            solving: self.solving,
            applies: self.applies,
        }
    }

    fn heartbeat(&mut self, reports: &[ChipReport], fx: &mut dyn Effects<Msg>) {
        for r in reports {
            self.chips.insert(r.chip, Seen::of(r));
        }
        let up = self.up_set();
        if self.solved_up.as_ref().is_some_and(|solved| *solved != up) {
            self.solve("chips changed", fx);
        }
    }
}

impl Behavior<Msg> for Solver {
    fn name(&self) -> &'static str {
        "solver"
    }

    // The worker's init never fails; its type is the chip's, whose error is a message.
    #[allow(clippy::result_large_err)]
    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.started = fx.now();
        fx.subscribe(topic::HEARTBEAT);
        fx.subscribe(topic::TELEMETRY);
        let spec = WorkerSpec {
            name: "solver".into(),
            // The worker keeps the step-time tables from one solve to the next.
            init: Box::new(|| Ok((Box::new(TableCache::default()) as WorkerState, Msg::Tick))),
            on_panic: Box::new(|error| Msg::Solved { result: Err(format!("the solve panicked: {error}")) }),
        };
        self.worker = Some(fx.start_worker(spec));
        fx.timer(Duration::from_secs(self.config.spec.period_s), Msg::Solve { reason: "period".into() });
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Telemetry { telemetry } => {
                let changed = self.observe(*telemetry);
                let span: f64 = self.windows.iter().map(|w| w.window_s).sum();
                match self.latest {
                    None if !self.solving && span >= FIRST_SOLVE_WINDOWS * self.window_s() => {
                        self.solve("first traffic", fx)
                    }
                    None => {}
                    Some(_) if changed => self.solve("rate changed", fx),
                    Some(_) => {}
                }
            }
            Msg::Heartbeat { beat } => self.heartbeat(&beat.chips, fx),
            Msg::Solve { reason } => {
                if reason == "period" {
                    fx.timer(Duration::from_secs(self.config.spec.period_s), Msg::Solve { reason: "period".into() });
                }
                self.solve(&reason, fx);
            }
            Msg::Solved { result } => self.solved(result, fx),
            Msg::QueryPlan { reply_to } => {
                let _ = fx.send(reply_to, Msg::Plan { view: Box::new(self.view()) });
            }
            Msg::ApplyStrategy { id, reply_to } => {
                let result = self.apply(&id, "operator", fx).map(Box::new);
                let _ = fx.send(reply_to, Msg::PlanApplied { result });
            }
            Msg::ApplyRoles { roles, reply_to } => {
                let result = self.apply_roles(&roles, fx).map(Box::new);
                let _ = fx.send(reply_to, Msg::PlanApplied { result });
            }
            Msg::Tick => {} // the worker is ready
            other => tracing::debug!(kind = ?other, "solver: unexpected message"),
        }
    }
}

#[cfg(test)]
mod tests;
