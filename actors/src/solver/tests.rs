use super::*;
use crate::msg::{ChipReport, Heartbeat};
use crate::test_fx::TestFx;
use std::sync::Arc;
use tessera_actor_core::testkit::run_job;
use tessera_topology::perf::ModelShape;

/// builtin:tiny's shape with a KV cache of `kv`.
fn tiny(kv: DType) -> ModelShape {
    ModelShape { kv_bytes_per_elem: kv.size_bytes(), ..tessera_topology::perf::BUILTIN_TINY }
}

fn config_of(spec: &ClusterSpec) -> SolverConfig {
    let shape = |d| tiny(d);
    let perf = |k: &str| spec.emulation.perf_model_of(k);
    let price = |k: &str| spec.chip_kind(k).and_then(|kind| kind.price.as_ref()).map(|p| p.usd_per_hour);
    let costing =
        Costing { shape: &shape, weight_bytes: 4_002_304, perf: &perf, price: &price, link: Link::ETHERNET_100G };
    match solver_config(spec, &costing) {
        Ok(config) => config,
        Err(e) => panic!("{e}"),
    }
}

const SOLVER: Addr = Addr { host: HostId(0), actor: well_known::SOLVER };

/// Three chips of one kind on two hosts: one prefills, two decode.
const THREE: &str = r#"
[cluster]
model = "builtin:tiny"
[emulation]
time_scale = 5000.0
[solver]
min_gain_percent = 10
dwell_s = 120
[[hosts]]
name = "a"
bus = "127.0.0.1:7000"
[[hosts.chips]]
id = "p"
backend = "emu:metax-c500"
role = "prefill"
[[hosts]]
name = "b"
bus = "127.0.0.1:7010"
[[hosts.chips]]
id = "d0"
backend = "emu:metax-c500"
role = "decode"
[[hosts.chips]]
id = "d1"
backend = "emu:metax-c500"
role = "decode"
"#;

fn spec_of(text: &str) -> ClusterSpec {
    match tessera_topology::parse(text, "t.toml") {
        Ok(spec) => spec,
        Err(e) => panic!("{e}"),
    }
}

fn beat(config: &SolverConfig, state: impl Fn(&str) -> ChipState) -> Msg {
    let chips = config
        .fleet
        .chips
        .iter()
        .flatten()
        .map(|c| {
            let role = match c.duty {
                Duty::Prefill => Role::Prefill,
                Duty::Decode => Role::Decode,
                Duty::Both | Duty::Idle => Role::Both,
            };
            ChipReport { state: state(&c.id), ..ChipReport::starting(c.addr, c.id.as_str(), "h", role) }
        })
        .collect();
    Msg::Heartbeat { beat: Arc::new(Heartbeat { host: HostId(0), host_name: "a".into(), seq: 1, chips }) }
}

/// A 5 s window of `rate` arrivals a second, prompts of `isl` tokens, outputs of `osl`.
fn window(rate: f64, isl: u64, osl: u64) -> Msg {
    let n = (rate * 5.0).round() as u64;
    let telemetry = Telemetry {
        window_s: 5.0,
        admitted: n,
        prompt_tokens: n * isl,
        ended: n,
        output_tokens: n * osl,
        ..Telemetry::default()
    };
    Msg::Telemetry { telemetry: Box::new(telemetry) }
}

thread_local! {
    /// The solver worker's state, as a real worker keeps it between jobs (one per test).
    static WORKER: std::cell::RefCell<TableCache> = std::cell::RefCell::new(TableCache::default());
}

/// Runs the solve job the solver submitted, on this test's worker state, and hands the
/// solver the result.
fn finish_solve(s: &mut Solver, fx: &mut TestFx) -> StrategySet {
    assert_eq!(fx.jobs.len(), 1, "one solve in flight");
    let job = fx.jobs.remove(0);
    let result = WORKER.with(|cache| run_job(job, &mut *cache.borrow_mut()).result);
    let Msg::Solved { result: Ok(set) } = &result else { panic!("{result:?}") };
    let set = (**set).clone();
    s.handle(result, fx);
    set
}

fn started(text: &str) -> (Solver, TestFx, SolverConfig) {
    let config = config_of(&spec_of(text));
    let mut fx = TestFx::new(SOLVER);
    let mut s = Solver::new(config.clone());
    s.on_start(&mut fx);
    assert_eq!(fx.subscribed, vec![topic::HEARTBEAT.to_string(), topic::TELEMETRY.to_string()]);
    s.handle(beat(&config, |_| ChipState::Up), &mut fx);
    (s, fx, config)
}

#[test]
fn the_first_solve_waits_for_30_s_of_traffic_then_publishes_a_pareto_set_best_first() {
    let (mut s, mut fx, _) = started(THREE);
    for _ in 0..5 {
        s.handle(window(4.0, 300, 100), &mut fx);
    }
    assert!(fx.jobs.is_empty(), "solved on 25 s of traffic");
    s.handle(window(4.0, 300, 100), &mut fx);
    let set = finish_solve(&mut s, &mut fx);
    assert_eq!((set.seq, set.reason.as_str(), set.chips_up, set.chips_total), (1, "first traffic", 3, 3));
    assert_eq!(set.prefix_hit_rate, None, "no prompt reported yet");
    assert!((set.observed_rate_rps - 4.0).abs() < 1e-9 && (set.workload.rate_rps - 4.8).abs() < 1e-9, "{set:?}");
    // Lengths on a 2% grid, within 1% of the measured means.
    assert!((set.workload.isl / 300.0 - 1.0).abs() <= 0.01 && (set.workload.osl / 100.0 - 1.0).abs() <= 0.01);
    assert!(set.tables_built > 0 && set.tables_reused == 0, "{} built, {} reused", set.tables_built, set.tables_reused);
    assert!(!set.strategies.is_empty());
    // Best first on goodput per $; ids name the set and the row.
    assert!(set.strategies.windows(2).all(|w| w[0].score >= w[1].score), "{set:?}");
    assert_eq!(set.strategies[0].id, "s1-1");
    // Every strategy gives each chip up a duty, and moves only chips whose duty changes.
    for v in &set.strategies {
        assert_eq!(v.duties.len(), 3, "{v:?}");
        for (chip, from, to) in &v.moves {
            assert_ne!(from, to);
            assert!(v.duties.contains(&(chip.clone(), *to)), "{v:?}");
        }
        assert!(v.max_batch_tokens <= 512 && v.max_batch_seqs <= 64, "beyond the chips' configured limits: {v:?}");
    }
    // No two published strategies where one is at least as good on every objective.
    for a in &set.strategies {
        for b in &set.strategies {
            let (x, y) = (&a.figures, &b.figures);
            let dominates = x.goodput_rps >= y.goodput_rps * 1.01
                && x.ttft_p90_s * 1.01 <= y.ttft_p90_s
                && x.tpot_p90_s * 1.01 <= y.tpot_p90_s
                && x.usd_per_million_tokens * 1.01 <= y.usd_per_million_tokens
                && x.joules_per_request * 1.01 <= y.joules_per_request;
            assert!(!dominates, "{} dominates {}", a.id, b.id);
        }
    }
    let published: Vec<&str> = fx.published.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(published, vec![topic::STRATEGIES]);
    // Not auto: nothing applied.
    assert!(fx.take_sent().is_empty());
}

#[test]
fn an_operator_applies_a_strategy_through_the_supervisors_and_unknown_ids_are_refused() {
    let (mut s, mut fx, config) = started(THREE);
    for _ in 0..6 {
        s.handle(window(4.0, 300, 100), &mut fx);
    }
    let set = finish_solve(&mut s, &mut fx);
    let operator = Addr::new(HostId(0), 99);
    s.handle(Msg::ApplyStrategy { id: "s9-9".into(), reply_to: operator }, &mut fx);
    let sent = fx.take_sent();
    let [(to, Msg::PlanApplied { result: Err(why) })] = &sent[..] else { panic!("{sent:?}") };
    assert_eq!(*to, operator);
    assert!(why.contains("s9-9") && why.contains("s1-1"), "{why}");
    // A strategy that moves a decode chip to prefill, if the set has one; else its best.
    let pick = set
        .strategies
        .iter()
        .find(|v| v.moves.iter().any(|(_, from, to)| *from == Duty::Decode && *to == Duty::Prefill))
        .unwrap_or(&set.strategies[0]);
    s.handle(Msg::ApplyStrategy { id: pick.id.clone(), reply_to: operator }, &mut fx);
    let sent = fx.take_sent();
    let supervisor = |h| Addr::new(HostId(h), well_known::SUPERVISOR);
    let mut told = BTreeMap::new();
    for (to, msg) in &sent {
        match msg {
            Msg::ApplyPlan { changes } => {
                assert!(to.actor == well_known::SUPERVISOR, "{to}");
                for c in changes {
                    assert_eq!(c.chip.host, to.host, "a supervisor is told only of its own chips");
                    assert_eq!((c.max_batch_tokens, c.max_batch_seqs), (pick.max_batch_tokens, pick.max_batch_seqs));
                    told.insert(c.chip, c.duty);
                }
            }
            Msg::PlanApplied { result: Ok(plan) } => assert_eq!(plan.id, pick.id),
            other => panic!("{other:?}"),
        }
    }
    assert!(sent.iter().any(|(to, _)| *to == supervisor(0)) && sent.iter().any(|(to, _)| *to == supervisor(1)));
    // Exactly the chips that move are given a duty.
    let chips = &config.fleet.chips[0];
    for (chip, from, to) in &pick.moves {
        let addr = chips.iter().find(|c| c.id == *chip).map(|c| c.addr);
        assert_eq!(addr.and_then(|a| told.get(&a).copied()), Some(Some(*to)), "{chip} {from} -> {to}");
    }
    assert_eq!(told.values().filter(|d| d.is_some()).count(), pick.moves.len());
    s.handle(Msg::QueryPlan { reply_to: operator }, &mut fx);
    let sent = fx.take_sent();
    let [(_, Msg::Plan { view })] = &sent[..] else { panic!("{sent:?}") };
    assert_eq!(view.applied.as_ref().map(|p| (p.id.as_str(), p.by.as_str())), Some((pick.id.as_str(), "operator")));
    assert_eq!((view.applies, view.latest.as_ref().map(|l| l.seq)), (1, Some(1)));
}

#[test]
fn a_rate_change_beyond_noise_sets_off_a_solve_and_noise_does_not() {
    let (mut s, mut fx, _) = started(THREE);
    for _ in 0..6 {
        s.handle(window(4.0, 300, 100), &mut fx);
    }
    finish_solve(&mut s, &mut fx);
    // Poisson-like noise around 4 req/s: no solve.
    for rate in [4.6, 3.4, 4.4, 3.8, 4.2, 3.6, 4.4, 4.0] {
        s.handle(window(rate, 300, 100), &mut fx);
        assert!(fx.jobs.is_empty(), "solved on noise at {rate}");
    }
    // Doubled: a solve within two windows, of the new rate alone.
    s.handle(window(8.0, 300, 100), &mut fx);
    s.handle(window(8.0, 300, 100), &mut fx);
    let set = finish_solve(&mut s, &mut fx);
    assert_eq!(set.reason, "rate changed");
    assert!((set.observed_rate_rps - 8.0).abs() < 1e-9, "{}", set.observed_rate_rps);
    // Incremental: the same kinds and lengths, so every step-time table is reused.
    assert!(set.tables_built == 0 && set.tables_reused > 0, "{} built, {} reused", set.tables_built, set.tables_reused);
}

#[test]
fn auto_mode_applies_once_keeps_it_through_its_dwell_and_replans_at_once_for_a_lost_chip() {
    let text = THREE.replace("[solver]", "[solver]\nauto = true");
    let (mut s, mut fx, config) = started(&text);
    for _ in 0..6 {
        s.handle(window(4.0, 300, 100), &mut fx);
    }
    finish_solve(&mut s, &mut fx);
    let applied = |fx: &mut TestFx| fx.published.iter().filter(|(t, _)| t == topic::PLANS).count();
    assert_eq!(applied(&mut fx), 1, "the best strategy is applied once solved");
    // The period's re-solves at the same traffic change nothing.
    for _ in 0..3 {
        fx.advance(Duration::from_secs(60), &mut s);
        finish_solve(&mut s, &mut fx);
    }
    assert_eq!(applied(&mut fx), 1, "re-applied at the same traffic");
    // A chip the plan uses goes down: a solve at once, applied at once (no dwell).
    let Some(plan) = s.applied.clone() else { panic!("nothing in force") };
    let Some((used, _)) = plan.duties.iter().find(|(_, d)| *d != Duty::Idle) else { panic!("{plan:?}") };
    let used = used.clone();
    s.handle(beat(&config, |id| if id == used { ChipState::Failed } else { ChipState::Up }), &mut fx);
    let set = finish_solve(&mut s, &mut fx);
    assert_eq!((set.reason.as_str(), set.chips_up), ("chips changed", 2));
    assert_eq!(applied(&mut fx), 2);
    let Some(now) = &s.applied else { panic!() };
    assert!(!now.duties.iter().any(|(id, _)| *id == used), "the dead chip kept a duty: {now:?}");
}

/// An instance is one chip of the kind its shape names, at its chips' price; two
/// instances of one shape are one kind of two, a lone chip of the same kind its own.
#[test]
fn instances_are_kinds_of_their_shape_at_their_chips_price() {
    let mut text =
        String::from("[cluster]\nmodel = \"builtin:tiny\"\n[[hosts]]\nname = \"a\"\nbus = \"127.0.0.1:7000\"\n");
    for id in ["a0", "a1", "a2", "a3", "lone"] {
        text += &format!("[[hosts.chips]]\nid = \"{id}\"\nbackend = \"emu:metax-c500\"\n");
    }
    text += "[[instances]]\nid = \"tp-0\"\nchips = [\"a0\", \"a1\"]\ntp = 2\n";
    text += "[[instances]]\nid = \"tp-1\"\nchips = [\"a2\", \"a3\"]\ntp = 2\n";
    let config = config_of(&spec_of(&text));
    let kinds: Vec<(&str, u32)> = config.fleet.fleet.kinds.iter().map(|k| (k.name.as_str(), k.chips)).collect();
    assert_eq!(kinds, [("metax-c500 tp2", 2), ("metax-c500", 1)]);
    let (tp, one) = (&config.fleet.fleet.kinds[0], &config.fleet.fleet.kinds[1]);
    assert!((tp.usd_per_hour - 2.0 * one.usd_per_hour).abs() < 1e-9, "{} vs {}", tp.usd_per_hour, one.usd_per_hour);
    assert_eq!(tp.stages.len(), 1);
    assert!(tp.kv_tokens > one.kv_tokens, "two chips' memory hold more KV");
    let ids: Vec<Vec<&str>> = config.fleet.chips.iter().map(|k| k.iter().map(|c| c.id.as_str()).collect()).collect();
    assert_eq!(ids, [vec!["tp-0", "tp-1"], vec!["lone"]]);
}
