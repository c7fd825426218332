//! The solver's view of a scenario, and the simulator as its verifier: a scenario's
//! chips grouped by kind as a [`Fleet`], its traffic as a [`Workload`], and a
//! [`Strategy`] applied back onto the scenario's topology (roles, batch limits, the
//! disaggregation threshold; idle chips left out) to run through the production
//! behaviors like any other scenario.

use tessera_actors::solver::{Costing, FleetError, fleet_of};
use tessera_planner::{Duty, Fleet, Slo, Strategy, Workload};
use tessera_topology::perf::Link;
use tessera_topology::{ChipSpec, Role};
use tessera_workload::LengthDist;

use crate::model::SimModel;
use crate::scenario::{Scenario, TenantLoad, WorkloadRequests};

/// A scenario's fleet, with the ids of each kind's chips in topology order and what
/// each does in the topology as written.
#[derive(Debug, Clone)]
pub struct ScenarioFleet {
    pub fleet: Fleet,
    pub chips: Vec<Vec<String>>,
    pub now: Vec<Vec<Duty>>,
}

/// A chip that changes duty under a strategy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Move {
    pub chip: String,
    pub from: Duty,
    pub to: Duty,
}

impl ScenarioFleet {
    /// Every chip's id and its duty under `strategy` (see [`tessera_planner::assign`]:
    /// chips keep their duty where the counts allow).
    pub fn duties(&self, strategy: &Strategy) -> Result<Vec<(String, Duty)>, SolveError> {
        if strategy.roles.len() != self.chips.len() {
            return Err(SolveError::Mismatch { got: strategy.roles.len(), want: self.chips.len() });
        }
        let mut out = Vec::new();
        for ((roles, ids), now) in strategy.roles.iter().zip(&self.chips).zip(&self.now) {
            out.extend(ids.iter().cloned().zip(tessera_planner::assign(now, roles)));
        }
        Ok(out)
    }

    /// The chips `strategy` moves from what they do in the topology as written.
    pub fn moves(&self, strategy: &Strategy) -> Result<Vec<Move>, SolveError> {
        let now = self.chips.iter().flatten().zip(self.now.iter().flatten());
        let then = self.duties(strategy)?;
        Ok(now
            .zip(then)
            .filter(|((_, from), (_, to))| **from != *to)
            .map(|((chip, &from), (_, to))| Move { chip: chip.clone(), from, to })
            .collect())
    }
}

/// Why a scenario cannot be solved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SolveError {
    #[error("{0}")]
    Model(String),
    #[error("{0} (or in the scenario's [prices])")]
    Fleet(#[from] FleetError),
    #[error("the strategy has {got} kinds of chips, the fleet {want}")]
    Mismatch { got: usize, want: usize },
}

/// How the simulator costs `scenario`'s chips: its model, each kind's performance
/// model and price as the scenario gives them, and its network.
pub fn costing<'a>(
    scenario: &'a Scenario,
    model: &'a SimModel,
    shape: &'a dyn Fn(tessera_topology::DType) -> tessera_topology::perf::ModelShape,
    perf: &'a dyn Fn(&str) -> tessera_topology::perf::PerfModel,
    price: &'a dyn Fn(&str) -> Option<f64>,
) -> Costing<'a> {
    // Prefill and decode chips on different hosts hand KV over the network.
    let network = scenario.network;
    let link = Link { bandwidth_gbs: network.kv_bandwidth_gbs, latency_s: network.kv_latency.as_secs_f64() };
    Costing { shape, weight_bytes: model.weight_bytes, perf, price, link }
}

/// `scenario`'s chips grouped by kind (in order of first appearance), each kind's
/// figures as the simulator times it.
pub fn fleet(scenario: &Scenario) -> Result<ScenarioFleet, SolveError> {
    let model = SimModel::of(&scenario.topology, &scenario.base_dir).map_err(|e| SolveError::Model(e.to_string()))?;
    let shape = |d| model.shape(d);
    let perf = |k: &str| scenario.perf_model(k);
    let price = |k: &str| scenario.price(k);
    let chips = fleet_of(&scenario.topology, &costing(scenario, &model, &shape, &perf, &price))?;
    Ok(ScenarioFleet {
        fleet: chips.fleet,
        now: chips.chips.iter().map(|k| k.iter().map(|c| c.duty).collect()).collect(),
        chips: chips.chips.into_iter().map(|k| k.into_iter().map(|c| c.id).collect()).collect(),
    })
}

fn mean(dist: &LengthDist) -> f64 {
    match *dist {
        LengthDist::Fixed(n) => n as f64,
        LengthDist::Uniform { lo, hi } => (lo as f64 + hi as f64) / 2.0,
        LengthDist::Normal { mean, .. } => mean.max(1.0),
    }
}

/// `scenario`'s traffic: its mean rate and mean prompt and output lengths (a shared
/// system prompt counted in the prompt).
pub fn workload(scenario: &Scenario) -> Workload {
    let rate_rps = scenario.workload.rate_rps;
    match &scenario.workload.requests {
        WorkloadRequests::Synthetic { isl, osl, shared, .. } => {
            Workload { rate_rps, isl: mean(isl) + shared.as_ref().map_or(0.0, |s| s.words as f64), osl: mean(osl) }
        }
        WorkloadRequests::Tenants { loads, .. } => {
            // Means over all the tenants' requests: each tenant's weighted by its rate.
            let mean_of = |f: &dyn Fn(&TenantLoad) -> f64| {
                loads.iter().map(|l| l.rate_rps * f(l)).sum::<f64>() / rate_rps.max(f64::MIN_POSITIVE)
            };
            Workload { rate_rps, isl: mean_of(&|l| mean(&l.isl)), osl: mean_of(&|l| mean(&l.osl)) }
        }
        WorkloadRequests::Chats { shape, isl, osl, shared, .. } => {
            // The mean turn's prompt: the system prompt, half the chat's user messages
            // and answers so far (turn k holds k messages and k - 1 answers).
            let turns = f64::from(shape.turns);
            let system = shared.as_ref().map_or(0.0, |s| s.words as f64);
            let isl = system + mean(isl) * (turns + 1.0) / 2.0 + mean(osl) * (turns - 1.0) / 2.0;
            Workload { rate_rps, isl, osl: mean(osl) }
        }
        WorkloadRequests::Trace(requests) => {
            let n = requests.len().max(1) as f64;
            Workload {
                rate_rps,
                isl: requests.iter().map(|r| r.input_length as f64).sum::<f64>() / n,
                osl: requests.iter().map(|r| r.output_length as f64).sum::<f64>() / n,
            }
        }
    }
}

/// The scenario's SLOs.
pub fn slo(scenario: &Scenario) -> Slo {
    Slo { ttft_s: scenario.slo.ttft_ms / 1e3, tpot_s: scenario.slo.tpot_ms / 1e3 }
}

/// The role of every chip `strategy` keeps, by id.
fn roles_of(
    fleet: &ScenarioFleet,
    strategy: &Strategy,
) -> Result<std::collections::BTreeMap<String, Role>, SolveError> {
    Ok(fleet
        .duties(strategy)?
        .into_iter()
        .filter_map(|(id, duty)| match duty {
            Duty::Prefill => Some((id, Role::Prefill)),
            Duty::Decode => Some((id, Role::Decode)),
            Duty::Both => Some((id, Role::Both)),
            Duty::Idle => None,
        })
        .collect())
}

/// `scenario` with `strategy` applied: each kind's chips take its roles, keeping what
/// they do today where the counts allow ([`ScenarioFleet::duties`]); idle chips are left
/// out; every chip that stays takes the strategy's batch limits.
pub fn apply(scenario: &Scenario, fleet: &ScenarioFleet, strategy: &Strategy) -> Result<Scenario, SolveError> {
    let role_of = roles_of(fleet, strategy)?;
    let mut out = scenario.clone();
    let spec = &mut out.topology;
    spec.disagg.min_prompt_tokens = strategy.min_prompt_tokens as usize;
    for host in &mut spec.hosts {
        host.chips.retain(|c: &ChipSpec| role_of.contains_key(&c.id));
        for chip in &mut host.chips {
            if let Some(&role) = role_of.get(&chip.id) {
                chip.role = role;
            }
            chip.max_batch_tokens = strategy.prefill_budget as usize;
            chip.max_batch_seqs = strategy.decode_cap as usize;
        }
    }
    Ok(out)
}

/// A strategy's figures as the simulator measured them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Simulated {
    /// The offered rate times the share of requests within both SLOs.
    pub goodput_rps: f64,
    pub ttft_p90_s: f64,
    pub tpot_p90_s: f64,
    pub usd_per_million_tokens: Option<f64>,
    pub joules_per_request: Option<f64>,
    /// Requests within both SLOs per $, at the offered rate.
    pub goodput_per_usd: Option<f64>,
    pub failed: usize,
    pub kv_blocks_leaked: usize,
}

/// Runs `scenario` with `strategy` applied, in the simulator.
pub fn verify(scenario: &Scenario, fleet: &ScenarioFleet, strategy: &Strategy) -> Result<Simulated, String> {
    let applied = apply(scenario, fleet, strategy).map_err(|e| e.to_string())?;
    let (report, _) = crate::run(&applied, None).map_err(|e| e.to_string())?;
    Ok(simulated_of(&report))
}

/// A simulation's report as a strategy's figures.
fn simulated_of(report: &crate::Report) -> Simulated {
    let p90 = |l: Option<crate::report::Latency>| l.map_or(f64::INFINITY, |l| l.p90_ms / 1e3);
    // As the analytic figure: the offered rate times the share of requests within the
    // SLOs (the report's own goodput divides by the run's span, drain included).
    let share = if report.requests > 0 { report.slo_met as f64 / report.requests as f64 } else { 0.0 };
    let goodput_rps = report.rate_rps * share;
    let per_usd = report.usd_per_hour.filter(|&usd| usd > 0.0);
    Simulated {
        goodput_rps,
        ttft_p90_s: p90(report.ttft),
        tpot_p90_s: p90(report.tpot),
        usd_per_million_tokens: per_usd.filter(|_| goodput_rps > 0.0 && report.completed > 0).map(|usd| {
            let outputs = report.output_tokens as f64 / report.completed as f64;
            usd / (goodput_rps * outputs * 3600.0) * 1e6
        }),
        // kWh per 10,000 requests -> J per request.
        joules_per_request: report.kwh_per_10k_requests.map(|kwh| kwh * 3.6e6 / 1e4),
        goodput_per_usd: per_usd.map(|usd| goodput_rps * 3600.0 / usd),
        failed: report.failed + report.unfinished,
        kv_blocks_leaked: report.kv_blocks_used_at_end,
    }
}

/// Whether `strategy` mixes kinds of chips or splits the phases between chips: not a
/// cluster of one kind with every chip doing both.
pub fn is_mix(strategy: &Strategy) -> bool {
    strategy.roles.iter().filter(|r| r.active() > 0).count() > 1
        || strategy.roles.iter().any(|r| r.prefill > 0 || r.decode > 0)
}

/// One strategy of the published set: its analytic figures, and the simulator's when
/// it was verified.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Published {
    pub id: usize,
    pub strategy: Strategy,
    pub describe: String,
    pub analytic: tessera_planner::Figures,
    pub simulated: Option<Simulated>,
    /// Why the simulator could not run it.
    pub verify_error: Option<String>,
    /// The chips it moves from what they do in the topology as written.
    pub moves: Vec<Move>,
}

/// The topology as written, scored as a strategy (every chip at the first chip's
/// limits): what the chosen strategy would replace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Current {
    pub strategy: Strategy,
    pub describe: String,
    /// `None` when it cannot keep up with the offered rate (the analytic model's view).
    pub analytic: Option<tessera_planner::Figures>,
    pub simulated: Option<Simulated>,
    pub verify_error: Option<String>,
}

/// The solve of a scenario: the Pareto set, and the strategy chosen by goodput per $
/// (the simulated figure where verified).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Solution {
    pub scenario: String,
    pub workload: Workload,
    pub slo: Slo,
    /// How the space was searched.
    pub search: tessera_planner::search::Mode,
    pub strategies: Vec<Published>,
    /// Per kind, the best cluster of that kind alone with every chip doing both phases
    /// (by analytic goodput per $), verified alongside: what a mix has to beat.
    pub baselines: Vec<Published>,
    /// The id of the verified strategy or baseline with the most goodput per $.
    pub chosen: Option<usize>,
    pub current: Current,
    /// Going from the topology as written to the chosen strategy: how long its moving
    /// chips take to drain, at most — a decode (or both) chip its running requests'
    /// output at the current strategy's TPOT p90, a prefill chip its TTFT p90; `None`
    /// when the current strategy does not keep up (its queues set the time) or nothing moves.
    pub drain_s: Option<f64>,
}

/// Solves `scenario` over `space`, then verifies in the simulator the `verify`
/// strategies of the set with the best analytic goodput per $.
pub fn solve(scenario: &Scenario, space: &tessera_planner::Space, verify_top: usize) -> Result<Solution, String> {
    if let WorkloadRequests::Chats { concurrency: Some(_), .. } = scenario.workload.requests {
        return Err(format!(
            "{}: its chats run a closed loop (`concurrency`), which has no arrival rate to solve for: give `rate_rps`",
            scenario.source
        ));
    }
    let fleet = fleet(scenario).map_err(|e| format!("{}: {e}", scenario.source))?;
    let (work, slo) = (workload(scenario), slo(scenario));
    let search = tessera_planner::search::mode(&fleet.fleet, &work, space).map_err(|e| e.to_string())?;
    let set = tessera_planner::search::solve(&fleet.fleet, &work, &slo, space).map_err(|e| e.to_string())?;
    if set.is_empty() {
        return Err(format!(
            "{}: no strategy serves any request within the SLOs at {} req/s (the analytic model's view); try a lower --rate",
            scenario.source, work.rate_rps
        ));
    }
    let published = |id: usize, c: tessera_planner::pareto::Candidate| Published {
        id,
        describe: c.strategy.describe(&fleet.fleet),
        analytic: c.figures,
        simulated: None,
        verify_error: None,
        moves: fleet.moves(&c.strategy).unwrap_or_default(),
        strategy: c.strategy,
    };
    let mut strategies: Vec<Published> = set.into_iter().enumerate().map(|(i, c)| published(i + 1, c)).collect();
    let mut order: Vec<usize> = (0..strategies.len()).collect();
    order.sort_by(|&a, &b| {
        strategies[b].analytic.goodput_per_usd().total_cmp(&strategies[a].analytic.goodput_per_usd()).then(a.cmp(&b))
    });
    let check = |p: &mut Published| match verify(scenario, &fleet, &p.strategy) {
        Ok(s) => p.simulated = Some(s),
        Err(e) => p.verify_error = Some(e),
    };
    for &i in order.iter().take(verify_top) {
        check(&mut strategies[i]);
    }
    // What a mix does is the question: the best mix by analytic goodput per $, and the
    // best disaggregated strategy, are verified too when none of the best was one.
    let disaggregated = |s: &Strategy| s.roles.iter().any(|r| r.prefill > 0);
    let families: [&dyn Fn(&Strategy) -> bool; 2] = [&is_mix, &disaggregated];
    for family in families {
        let verified = strategies.iter().any(|p| p.simulated.is_some() && family(&p.strategy));
        if verify_top > 0
            && !verified
            && let Some(&i) = order.iter().find(|&&i| family(&strategies[i].strategy))
        {
            check(&mut strategies[i]);
        }
    }
    let mut baselines = Vec::new();
    for c in tessera_planner::search::best_single_kinds(&fleet.fleet, &work, &slo, space).into_iter().flatten() {
        let mut p = published(strategies.len() + baselines.len() + 1, c);
        if verify_top > 0 {
            check(&mut p);
        }
        baselines.push(p);
    }
    let score = |p: &Published| match p.simulated {
        Some(s) if s.failed == 0 => s.goodput_per_usd.unwrap_or(0.0),
        Some(_) => 0.0,
        None if verify_top == 0 => p.analytic.goodput_per_usd(),
        None => f64::NEG_INFINITY,
    };
    let chosen = strategies
        .iter()
        .chain(&baselines)
        .filter(|p| score(p) > f64::NEG_INFINITY)
        .max_by(|a, b| score(a).total_cmp(&score(b)).then(b.id.cmp(&a.id)))
        .map(|p| p.id);
    let current = current(scenario, &fleet, &work, &slo, verify_top > 0);
    let drain_s = chosen.and_then(|id| {
        let moves = &strategies.iter().chain(&baselines).find(|p| p.id == id)?.moves;
        tessera_planner::drain_estimate(moves.iter().map(|m| m.from), work.osl, current.analytic.as_ref())
    });
    Ok(Solution {
        scenario: scenario.source.clone(),
        workload: work,
        slo,
        search,
        strategies,
        baselines,
        chosen,
        current,
        drain_s,
    })
}

/// The topology as written as a strategy, scored (and verified when `verify`).
fn current(scenario: &Scenario, fleet: &ScenarioFleet, work: &Workload, slo: &Slo, verify_it: bool) -> Current {
    let roles = fleet.now.iter().map(|duties| tessera_planner::Roles::of(duties)).collect();
    let first = scenario.topology.chips().next().map(|(_, _, c)| c);
    let strategy = Strategy {
        roles,
        prefill_budget: first.map_or(0, |c| c.max_batch_tokens as u32),
        decode_cap: first.map_or(0, |c| c.max_batch_seqs as u32),
        min_prompt_tokens: u32::try_from(scenario.topology.disagg.min_prompt_tokens).unwrap_or(u32::MAX),
    };
    let tables =
        tessera_planner::analytic::Tables::new(&fleet.fleet, work, strategy.prefill_budget, strategy.decode_cap);
    let analytic = tessera_planner::analytic::evaluate(&fleet.fleet, &tables, &strategy, work, slo);
    let (mut simulated, mut verify_error) = (None, None);
    if verify_it {
        match crate::run(scenario, None) {
            Ok((report, _)) => simulated = Some(simulated_of(&report)),
            Err(e) => verify_error = Some(e.to_string()),
        }
    }
    Current { describe: strategy.describe(&fleet.fleet), strategy, analytic, simulated, verify_error }
}

impl Solution {
    /// The Pareto table: analytic figures, and simulated ones under them where verified;
    /// the first `rows` strategies and every verified one.
    pub fn table(&self, rows: usize) -> String {
        let w = &self.workload;
        let mut out = format!(
            "scenario   {}\nworkload   {} req/s, {:.0} prompt / {:.0} output tokens (means); SLO TTFT {:.0} ms, TPOT {:.0} ms (p90)\n\
             search     {}\n\
             set        {} strategies on the Pareto front (analytic); {} verified in the simulator\n\n",
            self.scenario,
            w.rate_rps,
            w.isl,
            w.osl,
            self.slo.ttft_s * 1e3,
            self.slo.tpot_s * 1e3,
            self.search,
            self.strategies.len(),
            self.strategies.iter().filter(|p| p.simulated.is_some()).count(),
        );
        out += &format!(
            "{:>4} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10}  strategy\n",
            "id", "goodput", "TTFT p90", "TPOT p90", "$/Mtok", "J/req", "req/$"
        );
        let row = |tag: &str, g: f64, ttft: f64, tpot: f64, usd: Option<f64>, j: Option<f64>, per: Option<f64>| {
            let opt = |x: Option<f64>, p: usize| x.map_or("-".to_string(), |x| format!("{x:.p$}"));
            format!(
                "{tag:>4} {g:>9.2} {:>9.1} {:>9.2} {:>9} {:>9} {:>10}",
                ttft * 1e3,
                tpot * 1e3,
                opt(usd, 3),
                opt(j, 1),
                opt(per, 1)
            )
        };
        let analytic_row = |tag: &str, a: &tessera_planner::Figures| {
            row(
                tag,
                a.goodput_rps,
                a.ttft_p90_s,
                a.tpot_p90_s,
                Some(a.usd_per_million_tokens),
                Some(a.joules_per_request),
                Some(a.goodput_per_usd()),
            )
        };
        // The simulator's figures under the analytic ones, or why it could not run.
        let verified = |simulated: &Option<Simulated>, error: &Option<String>| {
            let mut out = String::new();
            if let Some(s) = simulated {
                out += &row(
                    "sim",
                    s.goodput_rps,
                    s.ttft_p90_s,
                    s.tpot_p90_s,
                    s.usd_per_million_tokens,
                    s.joules_per_request,
                    s.goodput_per_usd,
                );
                out += &format!("  simulated: {} failed, {} KV blocks leaked\n", s.failed, s.kv_blocks_leaked);
            }
            if let Some(e) = error {
                out += &format!("     simulator: {e}\n");
            }
            out
        };
        let entry = |p: &Published| {
            let mark = if self.chosen == Some(p.id) { "  <- chosen" } else { "" };
            let mut out = analytic_row(&p.id.to_string(), &p.analytic);
            out += &format!("  {}{mark}\n", p.describe);
            out + &verified(&p.simulated, &p.verify_error)
        };
        for (i, p) in self.strategies.iter().enumerate() {
            if i < rows || p.simulated.is_some() || p.verify_error.is_some() {
                out += &entry(p);
            }
        }
        let hidden =
            self.strategies.iter().skip(rows).filter(|p| p.simulated.is_none() && p.verify_error.is_none()).count();
        if hidden > 0 {
            out += &format!("   ... {hidden} more (--rows, or --json for all)\n");
        }
        if !self.baselines.is_empty() {
            out += "\nsingle-kind clusters, every chip doing both phases (the best count and limits of each kind):\n";
            for p in &self.baselines {
                out += &entry(p);
            }
        }
        if self.baselines.is_empty() {
            out += &format!(
                "\nno cluster of one kind of these chips keeps up with {} req/s within the SLOs (analytic)\n",
                w.rate_rps
            );
        }
        let c = &self.current;
        out += &format!("\nthe topology as written ({}):\n", c.describe);
        match &c.analytic {
            Some(a) => out += &(analytic_row("now", a) + "\n"),
            None => out += "     does not keep up with the offered rate (analytic)\n",
        }
        out += &verified(&c.simulated, &c.verify_error);
        if let Some(chosen) = self.strategies.iter().chain(&self.baselines).find(|p| Some(p.id) == self.chosen) {
            if chosen.moves.is_empty() {
                out += &format!("chosen {} moves no chip from it (limits aside)\n", chosen.id);
            } else {
                // Grouped by what they go from and to, a few ids each.
                let mut groups: Vec<((Duty, Duty), Vec<&str>)> = Vec::new();
                for m in &chosen.moves {
                    match groups.iter_mut().find(|(k, _)| *k == (m.from, m.to)) {
                        Some((_, ids)) => ids.push(&m.chip),
                        None => groups.push(((m.from, m.to), vec![&m.chip])),
                    }
                }
                let moves: Vec<String> = groups
                    .iter()
                    .map(|((from, to), ids)| {
                        let more = if ids.len() > 3 { format!(", ... {} more", ids.len() - 3) } else { String::new() };
                        let shown: Vec<&str> = ids.iter().take(3).copied().collect();
                        format!("{} {from} -> {to} ({}{more})", ids.len(), shown.join(", "))
                    })
                    .collect();
                let drain = self.drain_s.map_or(String::new(), |s| format!("; they drain in at most ~{s:.1} s first"));
                out += &format!(
                    "chosen {} moves {} chip(s) from it: {}{drain}\n",
                    chosen.id,
                    chosen.moves.len(),
                    moves.join("; ")
                );
            }
        }
        if let Some(line) = self.against_baselines() {
            out += &format!("\n{line}\n");
        }
        out += "\ngoodput in req/s within both SLOs; TTFT and TPOT p90 in ms; req/$: requests within SLO per $\n";
        out
    }

    /// The text of `scenario`'s topology file with strategy `id` of the set applied
    /// ([`apply_to_topology_text`]; `chosen` names the chosen one), and what was applied
    /// to which file.
    pub fn applied_topology(&self, scenario: &Scenario, id: &str) -> Result<(String, String), String> {
        let wanted = match id {
            "chosen" => self.chosen.ok_or("no strategy was chosen (none verified without a loss)")?,
            id => id.parse().map_err(|_| format!("--apply takes a strategy's id or `chosen`, not `{id}`"))?,
        };
        let all = self.strategies.len() + self.baselines.len();
        let published = self
            .strategies
            .iter()
            .chain(&self.baselines)
            .find(|p| p.id == wanted)
            .ok_or_else(|| format!("no strategy {wanted} in the set (ids 1 to {all})"))?;
        if scenario.topology.source == scenario.source {
            return Err(format!(
                "{}: its topology is written inside the scenario; put it in a file and solve with --topology FILE --workload W to apply a strategy to it",
                scenario.source
            ));
        }
        let source = std::path::Path::new(&scenario.topology.source);
        let text = std::fs::read_to_string(source)
            .map_err(|e| format!("cannot read the topology {}: {e}", source.display()))?;
        let fleet = fleet(scenario).map_err(|e| e.to_string())?;
        let dir = source.parent().unwrap_or(std::path::Path::new(""));
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        let applied = apply_to_topology_text(&text, &dir, &fleet, &published.strategy)
            .map_err(|e| format!("{}: {e}", source.display()))?;
        let what = format!("strategy {} ({}) applied to {}", published.id, published.describe, source.display());
        Ok((applied, what))
    }

    /// How the best verified mix (chips of several kinds, or disaggregated) compares
    /// with the best verified cluster of one kind with every chip doing both phases,
    /// by simulated goodput per $.
    pub fn against_baselines(&self) -> Option<String> {
        let per_usd = |p: &Published| p.simulated.filter(|s| s.failed == 0).and_then(|s| s.goodput_per_usd);
        let single = |p: &Published| !is_mix(&p.strategy);
        let best = |mix: bool| {
            self.strategies
                .iter()
                .chain(&self.baselines)
                .filter(|p| single(p) != mix)
                .filter_map(|p| per_usd(p).map(|v| (p, v)))
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.id.cmp(&a.0.id)))
        };
        let (one, v1) = best(false)?;
        let Some((mix, v2)) = best(true) else {
            return Some(format!(
                "best verified: {} ({}) at {v1:.1} req/$; no mix of kinds or roles was verified",
                one.id, one.describe
            ));
        };
        Some(format!(
            "best verified mix: {} ({}) at {v2:.1} req/$; best single-kind cluster: {} ({}) at {v1:.1}: the mix {:+.1}%",
            mix.id,
            mix.describe,
            one.id,
            one.describe,
            (v2 / v1 - 1.0) * 100.0
        ))
    }

    /// The frontier drawn as goodput per $ against TTFT p90 (simulated where verified,
    /// analytic otherwise, hollow), the chosen strategy marked.
    pub fn svg(&self) -> String {
        const W: f64 = 800.0;
        const H: f64 = 450.0;
        const M: f64 = 60.0;
        let points: Vec<(usize, f64, f64, bool)> = self
            .strategies
            .iter()
            .chain(&self.baselines)
            .map(|p| match &p.simulated {
                Some(s) => (p.id, s.ttft_p90_s * 1e3, s.goodput_per_usd.unwrap_or(0.0), true),
                None => (p.id, p.analytic.ttft_p90_s * 1e3, p.analytic.goodput_per_usd(), false),
            })
            .filter(|p| p.1.is_finite() && p.2.is_finite())
            .collect();
        let x_top = points.iter().map(|p| p.1).fold(1e-9, f64::max) * 1.1;
        let y_top = points.iter().map(|p| p.2).fold(1e-9, f64::max) * 1.1;
        let x = |ms: f64| M + (W - 2.0 * M) * ms / x_top;
        let y = |v: f64| H - M - (H - 2.0 * M) * v / y_top;
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>\n\
             <text x=\"{M}\" y=\"20\">{}: strategies, goodput per $ against TTFT p90 (filled: simulated)</text>\n\
             <line x1=\"{M}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <line x1=\"{M}\" y1=\"{M}\" x2=\"{M}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <text x=\"{r}\" y=\"{t}\" text-anchor=\"end\">TTFT p90, {x_top:.0} ms</text>\n\
             <text x=\"5\" y=\"{M}\">{y_top:.0} req/$</text>\n",
            crate::report::xml(&self.scenario),
            b = H - M,
            r = W - M,
            t = H - M + 20.0,
        );
        for &(id, ms, v, simulated) in &points {
            let fill = if simulated { "steelblue" } else { "none" };
            svg += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{fill}\" stroke=\"steelblue\"><title>{id}</title></circle>\n",
                x(ms),
                y(v)
            );
            if self.chosen == Some(id) {
                svg += &format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"9\" fill=\"none\" stroke=\"crimson\" stroke-width=\"2\"/>\n\
                     <text x=\"{:.1}\" y=\"{:.1}\" fill=\"crimson\">chosen: {id}</text>\n",
                    x(ms),
                    y(v),
                    x(ms) + 12.0,
                    y(v) - 6.0
                );
            }
        }
        svg += "</svg>\n";
        svg
    }
}

/// `topology`, the text of a topology file in directory `dir`, with `strategy` applied
/// as [`apply`] does: each chip's role and batch limits set, idle chips removed (and
/// hosts left without chips; the gateway moves to the first host left when its own
/// goes), and `[disagg] min_prompt_tokens` set. Relative paths (the model, performance
/// model files, `plugin:` libraries) become `dir`'s, so the file can be written anywhere.
/// Comments and everything else stay as written.
pub fn apply_to_topology_text(
    topology: &str,
    dir: &std::path::Path,
    fleet: &ScenarioFleet,
    strategy: &Strategy,
) -> Result<String, String> {
    use toml_edit::{DocumentMut, Item, Table, value};
    let role_of = roles_of(fleet, strategy).map_err(|e| e.to_string())?;
    let mut doc: DocumentMut = topology.parse().map_err(|e| format!("not a TOML file: {e}"))?;
    let hosts = doc.get_mut("hosts").and_then(Item::as_array_of_tables_mut).ok_or("the topology has no [[hosts]]")?;
    let mut names_left = Vec::new();
    for host in hosts.iter_mut() {
        let name = host.get("name").and_then(Item::as_str).unwrap_or_default().to_string();
        let Some(chips) = host.get_mut("chips").and_then(Item::as_array_of_tables_mut) else { continue };
        chips.retain(|chip| chip.get("id").and_then(Item::as_str).is_some_and(|id| role_of.contains_key(id)));
        for chip in chips.iter_mut() {
            let id = chip.get("id").and_then(Item::as_str).unwrap_or_default().to_string();
            let Some(role) = role_of.get(id.as_str()) else { continue };
            chip["role"] = value(role.to_string());
            chip["max_batch_tokens"] = value(i64::from(strategy.prefill_budget));
            chip["max_batch_seqs"] = value(i64::from(strategy.decode_cap));
        }
        if !chips.is_empty() {
            names_left.push(name);
        }
    }
    hosts.retain(|host| host.get("chips").and_then(Item::as_array_of_tables).is_some_and(|chips| !chips.is_empty()));
    let first = names_left.first().ok_or("the strategy leaves no chip")?.clone();
    if let Some(gateway) = doc.get_mut("gateway").and_then(Item::as_table_mut) {
        let host = gateway.get("host").and_then(Item::as_str).map(str::to_string);
        if host.is_some_and(|h| !names_left.contains(&h)) {
            gateway["host"] = value(first);
        }
    }
    // Relative paths, resolved against the file's own directory.
    let absolute = |path: &str| -> Option<String> {
        let p = std::path::Path::new(path);
        p.is_relative().then(|| dir.join(p).display().to_string())
    };
    if let Some(model) = doc.get("cluster").and_then(|c| c.get("model")).and_then(Item::as_str)
        && !model.starts_with("builtin:")
        && let Some(path) = absolute(model)
    {
        doc["cluster"]["model"] = value(path);
    }
    if let Some(models) =
        doc.get_mut("emulation").and_then(|e| e.get_mut("perf_models")).and_then(Item::as_table_like_mut)
    {
        for (_, file) in models.iter_mut() {
            if let Some(path) = file.as_str().and_then(absolute) {
                *file = value(path);
            }
        }
    }
    for host in doc.get_mut("hosts").and_then(Item::as_array_of_tables_mut).into_iter().flat_map(|h| h.iter_mut()) {
        let chips = host.get_mut("chips").and_then(Item::as_array_of_tables_mut);
        for chip in chips.into_iter().flat_map(|c| c.iter_mut()) {
            let plugin = chip.get("backend").and_then(Item::as_str).and_then(|b| b.strip_prefix("plugin:"));
            if let Some(path) = plugin.and_then(absolute) {
                chip["backend"] = value(format!("plugin:{path}"));
            }
        }
    }
    if doc.get("disagg").is_none() {
        doc["disagg"] = Item::Table(Table::new());
    }
    doc["disagg"]["min_prompt_tokens"] = value(i64::from(strategy.min_prompt_tokens));
    Ok(doc.to_string())
}

/// What a re-solve after a small change costs (`tessera solve --resolve`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Resolve {
    /// What changed: the first kind one chip short, the rate 20% up.
    pub change: String,
    /// Wall seconds: the first solve; the re-solve with the first one's step-time
    /// tables; the same re-solve from scratch.
    pub first_s: f64,
    pub reused_s: f64,
    pub fresh_s: f64,
    pub tables_reused: u64,
    /// The two re-solves found the same set.
    pub same: bool,
}

/// Times `scenario`'s analytic solve, then a re-solve after a small change — its first
/// kind one chip short and the rate 20% up — with the first solve's step-time tables and
/// from scratch (the measurement behind the live solver's incremental re-solves).
pub fn resolve(scenario: &Scenario, space: &tessera_planner::Space) -> Result<Resolve, String> {
    use std::time::Instant;
    use tessera_planner::search::{solve, solve_with};
    let fleet = fleet(scenario).map_err(|e| format!("{}: {e}", scenario.source))?.fleet;
    let (work, slo) = (workload(scenario), slo(scenario));
    let mut cache = tessera_planner::analytic::TableCache::default();
    let t = Instant::now();
    solve_with(&fleet, &work, &slo, space, &mut cache).map_err(|e| e.to_string())?;
    let first_s = t.elapsed().as_secs_f64();
    let mut smaller = fleet.clone();
    let kind = smaller.kinds.first_mut().ok_or("the scenario has no chips")?;
    kind.chips = kind.chips.saturating_sub(1);
    let change = format!("one {} chip down, the rate 20% up", kind.name);
    let faster = Workload { rate_rps: work.rate_rps * 1.2, ..work };
    let reused_before = cache.reused;
    let t = Instant::now();
    let reused = solve_with(&smaller, &faster, &slo, space, &mut cache).map_err(|e| e.to_string())?;
    let reused_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let fresh = solve(&smaller, &faster, &slo, space).map_err(|e| e.to_string())?;
    let fresh_s = t.elapsed().as_secs_f64();
    Ok(Resolve {
        change,
        first_s,
        reused_s,
        fresh_s,
        tables_reused: cache.reused - reused_before,
        same: reused == fresh,
    })
}

/// The chip kinds of `scenario`'s chips (an instance's members counted by their own
/// kind), in order of first appearance.
pub fn physical_kinds(scenario: &Scenario) -> Vec<String> {
    let mut kinds: Vec<String> = Vec::new();
    for (_, _, chip) in scenario.topology.chips() {
        let members = chip.parallel.as_ref().map_or_else(|| vec![chip.clone()], |p| p.chips.clone());
        for m in members {
            if !kinds.contains(&m.kind) {
                kinds.push(m.kind);
            }
        }
    }
    kinds
}

/// `scenario` with its chips regrouped into instance shapes: on every host, the chips of
/// kind `kinds[k]` (instances taken apart into their chips) form instances of `tps[k]`
/// chips each, one stage at `tp = tps[k]`, in topology order; `tps[k] = 1` leaves them
/// single chips. A host's chips of a kind beyond a multiple of its `tp` are left out
/// (idle); each instance takes its first chip's role. Returns the chips left out.
pub fn reshape(scenario: &Scenario, kinds: &[String], tps: &[usize]) -> Result<(Scenario, usize), String> {
    let mut out = scenario.clone();
    let mut left_out = 0;
    for host in &mut out.topology.hosts {
        let chips: Vec<ChipSpec> = host
            .chips
            .drain(..)
            .flat_map(|c| match c.parallel {
                Some(p) => p.chips.into_iter().map(|m| ChipSpec { role: c.role, ..m }).collect(),
                None => vec![c],
            })
            .collect();
        let mut regrouped = Vec::new();
        for (kind, &tp) in kinds.iter().zip(tps) {
            let of_kind: Vec<&ChipSpec> = chips.iter().filter(|c| &c.kind == kind).collect();
            if tp <= 1 {
                regrouped.extend(of_kind.into_iter().cloned());
                continue;
            }
            left_out += of_kind.len() % tp;
            for group in of_kind.chunks_exact(tp) {
                let members: Vec<ChipSpec> = group.iter().map(|c| (*c).clone()).collect();
                let id = format!("{}-tp{tp}", members[0].id);
                let stage_hosts = vec![host.name.clone()];
                let par = tessera_topology::ParallelSpec { tp, split: None, chips: members, stage_hosts };
                let role = par.chips[0].role;
                regrouped.push(ChipSpec::instance(id, role, par));
            }
        }
        regrouped.extend(chips.into_iter().filter(|c| !kinds.contains(&c.kind)));
        host.chips = regrouped;
    }
    if out.topology.chips().next().is_none() {
        return Err(format!("no chips left in instances of {tps:?} chips"));
    }
    Ok((out, left_out))
}
