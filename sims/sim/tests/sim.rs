//! The simulator end to end: scenarios parsed and validated, the real behaviors run in
//! virtual time, reports checked for determinism, completeness and leaks.

use std::path::{Path, PathBuf};

use tessera_sim::scenario::{self, Scenario};
use tessera_sim::{Report, run};

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The default topology (disaggregated: 910B prefill on h0, C500 decode on h1).
const DISAGGREGATED: &str = r#"
seed = 3
topology = "../../topology/default.toml"

[workload]
rate_rps = 2.0
requests = 60
isl = "uniform:8-300"
osl = "uniform:1-64"

[slo]
ttft_ms = 500
tpot_ms = 50
"#;

/// Two hosts, two colocated chips each; written inside the scenario.
const COLOCATED: &str = r#"
seed = 11
topology_toml = '''
[cluster]
model = "builtin:tiny"
[emulation]
time_scale = 2000.0
[[hosts]]
name = "a"
bus = "10.0.0.1:7400"
[[hosts.chips]]
id = "a0"
backend = "emu:nvidia-a100"
[[hosts.chips]]
id = "a1"
backend = "emu:nvidia-a100"
max_batch_seqs = 8
[[hosts]]
name = "b"
bus = "10.0.0.2:7400"
[[hosts.chips]]
id = "b0"
backend = "emu:ascend-910b"
kv_dtype = "f16"
[[hosts.chips]]
id = "b1"
kind = "metax-c500"
backend = "cpu"
'''

[workload]
rate_rps = 20
duration_s = 5
isl = "normal:100,40"
osl = "uniform:4-40"

[slo]
ttft_ms = 200
tpot_ms = 30

[network]
bus_latency_us = 100

"#;

fn parse(text: &str) -> Scenario {
    match scenario::parse(text, "test.toml", &here()) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    }
}

fn simulate(s: &Scenario, seed: Option<u64>) -> Report {
    match run(s, seed) {
        Ok((report, _)) => report,
        Err(e) => panic!("{e}"),
    }
}

#[track_caller]
fn all_served_and_all_free(r: &Report) {
    assert!(r.requests > 0);
    assert_eq!((r.completed, r.failed, r.unfinished), (r.requests, 0, 0), "{:?}", r.failures);
    assert_eq!(r.kv_blocks_used_at_end, 0);
    for c in &r.chips {
        assert_eq!((c.state.as_str(), c.kv_blocks_used, c.handoffs_open), ("up", 0, 0), "{c:?}");
        assert!(c.kv_blocks_total > 0, "{c:?}");
    }
    assert!(r.chips.iter().any(|c| c.steps > 0), "no chip did any work");
    let (Some(ttft), Some(e2e)) = (r.ttft, r.e2e) else { panic!("no latencies") };
    assert_eq!((ttft.samples, e2e.samples), (r.requests, r.requests));
    assert!(ttft.p50_ms > 0.0 && ttft.p50_ms <= ttft.p90_ms && ttft.p90_ms <= ttft.p99_ms);
    assert!(e2e.p50_ms >= ttft.p50_ms);
    assert!(r.output_tokens > 0 && r.output_tokens_per_s > 0.0 && r.simulated_s > 0.0 && r.events > 0);
    assert!(r.prompt_tokens >= r.requests as u64);
    assert!(r.slo_met <= r.completed);
}

#[test]
fn a_disaggregated_cluster_serves_every_request_deterministically_and_frees_every_block() {
    let s = parse(DISAGGREGATED);
    let first = simulate(&s, None);
    all_served_and_all_free(&first);
    // Requests ran to max_tokens (no end-of-sequence): uniform 1..=64 averages 32.5.
    assert!((20 * 60..45 * 60).contains(&first.output_tokens), "{}", first.output_tokens);
    // Both roles did their part: the prefill chip prefilled, the decode chip decoded.
    let roles: Vec<(&str, &str)> = first.chips.iter().map(|c| (c.id.as_str(), c.role.as_str())).collect();
    assert_eq!(roles, [("h0-ascend0", "prefill"), ("h1-metax0", "decode")]);
    assert!(first.chips.iter().all(|c| c.steps > 0), "{:?}", first.chips);
    // Utilisation by phase: the prefill chip's steps carry prompts; the decode chip's
    // are mostly decode-only (its first step per request computes the last prompt token).
    let (p, d) = (&first.chips[0], &first.chips[1]);
    assert!(p.busy_prefill > 0.0 && p.busy_decode == 0.0, "{p:?}");
    assert!(d.busy_decode > d.busy_prefill && d.busy_prefill + d.busy_decode <= 1.0, "{d:?}");
    // Energy: board power by phase (910B 400 W, C500 350 W), between all-idle and
    // all-prefill for the run, and the per-request figure is the chips' sum.
    let span = first.simulated_s;
    for (c, tdp) in [(p, 400.0), (d, 350.0)] {
        let j = c.energy_j.unwrap_or(0.0);
        assert!(j >= 0.25 * tdp * span * 0.999 && j <= tdp * span * 1.001, "{} J over {span} s: {c:?}", j);
    }
    let total: f64 = first.chips.iter().filter_map(|c| c.energy_j).sum();
    let want = total / 3.6e6 * 1e4 / first.completed as f64;
    assert!(
        first.kwh_per_10k_requests.is_some_and(|k| (k - want).abs() < 1e-9 * want),
        "{:?}",
        first.kwh_per_10k_requests
    );

    let again = simulate(&s, None);
    assert_eq!(first.to_json(), again.to_json(), "same scenario and seed, different reports");
    let other = simulate(&s, Some(4));
    assert_eq!(other.seed, 4);
    all_served_and_all_free(&other);
    assert_ne!(first.to_json(), other.to_json(), "the seed changed nothing");
}

#[test]
fn a_colocated_cluster_written_inline_serves_a_timed_workload() {
    let s = parse(COLOCATED);
    assert_eq!(s.topology.hosts.len(), 2);
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    // Poisson at 20/s for 5 s: about 100 arrivals.
    assert!((60..140).contains(&r.requests), "{}", r.requests);
    assert_eq!(r.chips.len(), 4);
    // The router compares chips by predicted seconds: b1, a metax-c500 at its real
    // pace (backend cpu), is thousands of times faster than the emulations paced x2000,
    // and computes most of the work.
    let steps = |id: &str| r.chips.iter().find(|c| c.id == id).map_or(0, |c| c.steps);
    assert!(steps("b1") > r.chips.iter().map(|c| c.steps).sum::<u64>() / 2, "{:?}", r.chips);
    assert_eq!(r.to_json(), simulate(&s, None).to_json());
}

#[test]
fn the_example_scenario_runs() {
    let path = here().join("../scenarios/default-poisson.toml");
    let s = match tessera_sim::load(&path) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    all_served_and_all_free(&simulate(&s, None));
}

/// (what is wrong, the scenario, the line and key the error must name)
/// Requests in groups sharing a system prompt: the chips reuse the cached prefixes
/// (the same batchers and pools as a real cluster), deterministically.
#[test]
fn shared_prefixes_are_reused_in_the_simulation() {
    let plain = parse(&COLOCATED.replace("isl = \"normal:100,40\"", "isl = \"fixed:20\""));
    let shared = parse(
        &COLOCATED.replace("isl = \"normal:100,40\"", "isl = \"fixed:20\"\nprefix_groups = 3\nprefix_words = 200"),
    );
    let (p, r) = (simulate(&plain, None), simulate(&shared, None));
    all_served_and_all_free(&r);
    let hit = r.prefix_hit_rate.unwrap_or(0.0);
    // 200 of 220 prompt tokens are shared, in whole 16-token blocks (192 of them) once
    // each of the 3 prefixes is cached on the chips that serve it.
    assert!(hit > 0.6 && hit < 0.9, "hit rate {hit}");
    assert!(p.prefix_hit_rate.unwrap_or(0.0) < 0.05, "{:?}", p.prefix_hit_rate);
    assert_eq!(r.to_json(), simulate(&shared, None).to_json());
}

/// Multi-turn chats, as `bench serve --multi-turn` sends them: every turn served, each
/// sent once the last is answered (a closed loop of 2 chats at a time), each prompt
/// longer than the last of its chat, the chats' histories and system prompts reused from
/// the chips' caches; deterministic. Started at a rate instead, the same chats are served.
#[test]
fn multi_turn_chats_run_a_closed_loop_and_reuse_their_history() {
    let chats = DISAGGREGATED.replace(
        "rate_rps = 2.0\nrequests = 60\nisl = \"uniform:8-300\"\nosl = \"uniform:1-64\"",
        "conversations = 6\nturns = 3\nconcurrency = 2\nisl = \"20\"\nosl = \"8\"\nprefix_groups = 2\nprefix_words = 60",
    );
    let s = parse(&chats);
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    assert_eq!(r.requests, 18);
    // A closed loop reports the rate it reached.
    assert!(r.rate_rps > 0.0 && (r.rate_rps - 18.0 / r.simulated_s).abs() < 1e-6, "{}", r.rate_rps);
    // Turn k+1 holds turn k's prompt and answer: most prompt tokens are cached.
    let hit = r.prefix_hit_rate.unwrap_or(0.0);
    assert!(hit > 0.5, "hit rate {hit}");
    // 6 chats of 3 turns: 18 prompts of a 60-word system prompt, 20 words a message and
    // 8 answer tokens a turn (60+20, 60+48, 60+76 tokens, BOS aside).
    assert!((18 * 100..=18 * 110).contains(&(r.prompt_tokens as usize)), "{}", r.prompt_tokens);
    assert_eq!(r.to_json(), simulate(&s, None).to_json());
    let started = parse(&chats.replace("concurrency = 2", "rate_rps = 0.5"));
    let r = simulate(&started, None);
    all_served_and_all_free(&r);
    assert_eq!(r.requests, 18);
}

/// A Mooncake-format trace file (relative to the scenario) replays with its own
/// arrivals and lengths; requests sharing its blocks reuse each other's KV.
#[test]
fn a_trace_file_replays_with_its_arrivals_lengths_and_shared_blocks() {
    use tessera_workload::{LengthDist, trace};
    let dir = std::env::temp_dir().join(format!("tessera-sim-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let isl = LengthDist::Uniform { lo: 600, hi: 1500 };
    let t = trace::generate(40, 8.0, isl, LengthDist::Fixed(8), 0.6, 3).expect("a valid trace");
    std::fs::write(dir.join("t.jsonl"), trace::to_jsonl(&t)).expect("the trace is written");
    let text = COLOCATED.replace(
        "rate_rps = 20\nduration_s = 5\nisl = \"normal:100,40\"\nosl = \"uniform:4-40\"",
        "trace = \"t.jsonl\"",
    );
    let s = match scenario::parse(&text, "trace.toml", &dir) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    assert_eq!((r.requests, r.output_tokens), (40, 40 * 8));
    let hit = r.prefix_hit_rate.unwrap_or(0.0);
    assert!(hit > 0.2, "the trace shares blocks (oracle {:.3}): hit rate {hit}", trace::oracle_hit_rate(&t));
    // The trace fixes the workload: other workload keys are refused beside it.
    let both = text.replace("trace = \"t.jsonl\"", "trace = \"t.jsonl\"\nrate_rps = 3");
    let e = scenario::parse(&both, "trace.toml", &dir).err().map(|e| e.key);
    assert_eq!(e.as_deref(), Some("workload.rate_rps"));
    let missing = text.replace("t.jsonl", "none.jsonl");
    let e = scenario::parse(&missing, "trace.toml", &dir).err().map(|e| (e.key.clone(), e.to_string()));
    assert!(e.is_some_and(|(key, shown)| key == "workload.trace" && shown.contains("none.jsonl")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fault schedule in virtual time: a chip's worker crashes at 1 s (its supervisor
/// restarts it) and a whole host goes down at 2.5 s, while requests run. Nothing is
/// lost: every request completes with its full output, and every surviving pool ends
/// all-free.
#[test]
fn faults_on_schedule_lose_no_request() {
    let text = format!(
        "{COLOCATED}\n[[faults]]\nat_s = 1.0\nkind = \"chip_crash\"\nchip = \"a1\"\n\n\
         [[faults]]\nat_s = 2.5\nkind = \"host_down\"\nhost = \"b\"\n"
    );
    let s = parse(&text);
    let r = simulate(&s, None);
    assert_eq!((r.completed, r.failed, r.unfinished), (r.requests, 0, 0), "{:?}", r.failures);
    let marks: Vec<(f64, &str)> = r.faults.iter().map(|f| (f.at_s, f.what.as_str())).collect();
    assert_eq!(marks, vec![(1.0, "chip a1 crashed"), (2.5, "host b down")]);
    // The lost host shows in the timeline: host b had the fastest chip, so requests
    // sent after it went down take far longer end to end than those sent before.
    let p99 = |w: &&tessera_sim::report::Window| w.e2e.map_or(0.0, |l| l.p99_ms);
    let worst =
        |before: bool| r.timeline.iter().filter(|w| (w.end_s <= 2.5) == before).map(|w| p99(&w)).fold(0.0, f64::max);
    assert!(worst(false) > 2.0 * worst(true), "E2E p99 after the fault {} ms, before {} ms", worst(false), worst(true));
    let svg = r.svg();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 2, "{svg}");
    assert_eq!(svg.matches("stroke=\"red\"").count(), 2, "a mark per fault");
    for c in &r.chips {
        if c.host == "a" {
            assert_eq!((c.state.as_str(), c.kv_blocks_used, c.handoffs_open), ("up", 0, 0), "{c:?}");
        } else {
            assert_ne!(c.state, "up", "host b is gone: {c:?}");
        }
    }
    assert_eq!(r.to_json(), simulate(&s, None).to_json(), "deterministic");
    // Faults name what the topology has; the gateway's host cannot go.
    for (bad, key) in [
        ("chip = \"a1\"", "faults[0].chip"),
        ("host = \"a\"", "faults[1].host"),
        ("kind = \"chip_crash\"", "faults[0].kind"),
    ] {
        let wrong = match bad {
            "chip = \"a1\"" => text.replace(bad, "chip = \"z9\""),
            "host = \"a\"" => text.replace("host = \"b\"", bad),
            _ => text.replace(bad, "kind = \"meteor\""),
        };
        let e = scenario::parse(&wrong, "f.toml", &here()).err().map(|e| e.key);
        assert_eq!(e.as_deref(), Some(key), "{bad}");
    }
}

/// Gamma arrivals (bursts, at a coefficient of variation of 3) at the same mean rate
/// as Poisson: every request is served, and the bursts show in the tail of TTFT.
#[test]
fn gamma_arrivals_are_burstier_than_poisson() {
    let poisson = simulate(&parse(COLOCATED), None);
    let gamma =
        simulate(&parse(&COLOCATED.replace("rate_rps = 20", "rate_rps = 20\narrivals = \"gamma\"\ncv = 3")), None);
    all_served_and_all_free(&gamma);
    let p99 = |r: &Report| r.ttft.map_or(0.0, |t| t.p99_ms);
    assert!(p99(&gamma) > p99(&poisson), "gamma p99 {} against poisson {}", p99(&gamma), p99(&poisson));
}

/// A rate schedule steps the load: 5 requests/s for 2.5 s, then 40/s.
#[test]
fn a_rate_schedule_steps_the_load() {
    let s = parse(&COLOCATED.replace("rate_rps = 20", "rate_schedule = [[0, 5], [2.5, 40.0]]"));
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    assert!((r.rate_rps - 22.5).abs() < 1e-9, "the mean over 5 s: {}", r.rate_rps);
    // Per second, in the windows wholly before the step and wholly after it.
    let per_s = |keep: &dyn Fn(&tessera_sim::report::Window) -> bool| {
        let kept: Vec<_> = r.timeline.iter().filter(|w| keep(w)).collect();
        kept.iter().map(|w| w.requests).sum::<usize>() as f64 / kept.iter().map(|w| w.end_s - w.start_s).sum::<f64>()
    };
    let (before, after) = (per_s(&|w| w.end_s <= 2.5), per_s(&|w| w.start_s >= 2.5));
    assert!(after > 4.0 * before, "{after}/s after the step, {before}/s before");
}

#[test]
fn prices_calibrated_models_colocation_and_rates_change_what_is_simulated() {
    let base = parse(DISAGGREGATED);
    let r = simulate(&base, None);
    // The default chips' catalog prices (estimates): the 910B and the C500.
    let hour = r.usd_per_hour.unwrap_or(0.0);
    assert!((hour - (4.02 + 4.52)).abs() < 1e-9, "{hour}");
    let cost = hour * r.simulated_s / 3600.0;
    let per_m = r.usd_per_million_output_tokens.unwrap_or(0.0);
    assert!((per_m - cost / r.output_tokens as f64 * 1e6).abs() < 1e-9 * per_m.max(1.0));
    assert!((r.slo_met_per_usd.unwrap_or(0.0) - r.slo_met as f64 / cost).abs() < 1e-6);
    assert!(r.chips.iter().all(|c| c.usd.is_some_and(|usd| usd > 0.0)));
    assert!(r.table(&tessera_sim::Speed::of(&r, 1.0)).contains("per million output tokens"));

    // A scenario's prices replace the catalog's.
    let priced = parse(&format!("{DISAGGREGATED}\n[prices]\nascend-910b = 1.0\nmetax-c500 = 2\n"));
    assert_eq!(simulate(&priced, None).usd_per_hour, Some(3.0));

    // A calibrated model twice as slow on every step (half the efficiencies) slows the
    // chips that use it.
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let slow = tessera_sim::scenario::PerfModel::flat(0.25, 0.4);
    let file = dir.path().join("slow.toml");
    std::fs::write(&file, toml::to_string(&slow).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    let calibrated = format!("{DISAGGREGATED}\n[perf_models]\nmetax-c500 = \"{}\"\n", file.display());
    let slowed = simulate(&parse(&calibrated), None);
    all_served_and_all_free(&slowed);
    let tpot = |r: &Report| r.tpot.map_or(0.0, |l| l.p50_ms);
    assert!(tpot(&slowed) > 1.5 * tpot(&r), "{} vs {}", tpot(&slowed), tpot(&r));
    // The same model named by a topology written inside the scenario, relative to the
    // scenario's directory, times the chips alike.
    let inline = format!(
        "{}
[slo]
ttft_ms = 500
tpot_ms = 50
",
        COLOCATED.split("[slo]").next().unwrap_or_default().replace(
            "[emulation]\ntime_scale = 2000.0",
            "[emulation]\ntime_scale = 2000.0\n[emulation.perf_models]\nmetax-c500 = \"slow.toml\"",
        )
    );
    std::fs::write(dir.path().join("s.toml"), &inline).unwrap_or_else(|e| panic!("{e}"));
    let topo = tessera_sim::scenario::load(&dir.path().join("s.toml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(topo.perf_model("metax-c500"), slow);
    assert_eq!(topo.perf_model("nvidia-a100"), topo.topology.emulation.perf_model());

    // colocated = true runs every chip as both, as `tessera up --colocated`.
    let colocated = parse(&DISAGGREGATED.replace("seed = 3", "seed = 3\ncolocated = true"));
    assert!(colocated.topology.chips().all(|(_, _, c)| c.role == tessera_topology::Role::Both));
    let c = simulate(&colocated, None);
    all_served_and_all_free(&c);
    assert!(c.chips.iter().all(|chip| chip.role == "both"));

    // Another rate: the same requests' count and lengths, arriving faster.
    let Ok(faster) = base.at_rate(8.0) else { panic!("a synthetic workload takes a rate") };
    let f = simulate(&faster, None);
    assert_eq!((f.rate_rps, f.requests), (8.0, r.requests));
    assert!(f.simulated_s < r.simulated_s);
    assert!(base.at_rate(0.0).is_err() && base.at_rate(f64::NAN).is_err());
    let scheduled = parse(
        &DISAGGREGATED
            .replace("rate_rps = 2.0", "rate_schedule = [[0, 1.0], [10, 2.0]]")
            .replace("requests = 60", "duration_s = 20"),
    );
    assert!(scheduled.at_rate(3.0).is_err_and(|e| e.contains("rate_schedule")));

    // One comparison row per report.
    let table = tessera_sim::report::comparison(&[r.clone(), f]);
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(table.lines().nth(2).is_some_and(|row| row.starts_with("| test | 2 | 8.54 | 2 |")), "{table}");
}

/// A checkpoint with a tokenizer (the shared SmolLM2 GGUF): prompts are tokenized as
/// the gateway tokenizes them; without one (builtin models), one token a word.
#[test]
fn prompts_are_tokenized_as_the_gateway_does() {
    let path = here().join("../scenarios/cpu-smollm2.toml");
    let s = match tessera_sim::load(&path) {
        Ok(s) => s.at_rate(50.0).unwrap_or_else(|e| panic!("{e}")),
        Err(e) => panic!("{e}"),
    };
    let mut s = s;
    if let tessera_sim::scenario::WorkloadRequests::Synthetic { size, .. } = &mut s.workload.requests {
        *size = tessera_sim::scenario::WorkloadSize::Requests(8);
    }
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    let Ok(tokenizer) = tessera_backends::tokenizer::TextTokenizer::from_dir(Path::new(&s.topology.model)) else {
        panic!("the shared model's tokenizer")
    };
    let tessera_sim::scenario::WorkloadRequests::Synthetic { isl, osl, .. } = s.workload.requests else {
        panic!("synthetic")
    };
    let load = tessera_workload::Load::Poisson { rate_rps: 50.0 };
    let plan = tessera_workload::Workload { isl, osl, load, seed: s.seed, shared: None }.measured(8);
    let want: usize = plan.iter().map(|p| tokenizer.encode(&p.prompt, true).map_or(0, |ids| ids.len())).sum();
    assert_eq!(r.prompt_tokens, want as u64);

    let words = simulate(&parse(DISAGGREGATED), None);
    let s = parse(DISAGGREGATED);
    let tessera_sim::scenario::WorkloadRequests::Synthetic { isl, osl, .. } = s.workload.requests else {
        panic!("synthetic")
    };
    let load = tessera_workload::Load::Poisson { rate_rps: 2.0 };
    let plan = tessera_workload::Workload { isl, osl, load, seed: s.seed, shared: None }.measured(words.requests);
    assert_eq!(words.prompt_tokens, plan.iter().map(|p| p.isl as u64).sum::<u64>());
}

#[test]
fn bad_scenarios_name_file_line_and_key() {
    let cases: &[(&str, String, usize, &str)] = &[
        ("unknown key", DISAGGREGATED.replace("rate_rps = 2.0", "rate_rps = 2.0\nburst = 3"), 7, "workload.burst"),
        ("negative rate", DISAGGREGATED.replace("rate_rps = 2.0", "rate_rps = -1"), 6, "workload.rate_rps"),
        ("a bad length", DISAGGREGATED.replace("uniform:8-300", "uniform:300-8"), 8, "workload.isl"),
        ("zero SLO", DISAGGREGATED.replace("tpot_ms = 50", "tpot_ms = 0"), 13, "slo.tpot_ms"),
        ("no topology file", DISAGGREGATED.replace("default.toml", "missing.toml"), 3, "topology"),
        (
            "requests and duration",
            DISAGGREGATED.replace("requests = 60", "requests = 60\nduration_s = 3"),
            8,
            "workload.duration_s",
        ),
        (
            "rate and schedule",
            DISAGGREGATED.replace("rate_rps = 2.0", "rate_rps = 2.0\nrate_schedule = [[0, 1]]"),
            6,
            "workload.rate_rps",
        ),
        (
            "a schedule not from 0",
            DISAGGREGATED.replace("rate_rps = 2.0", "rate_schedule = [[5, 1]]"),
            6,
            "workload.rate_schedule",
        ),
        (
            "gamma without cv",
            DISAGGREGATED.replace("rate_rps = 2.0", "rate_rps = 2.0\narrivals = \"gamma\""),
            7,
            "workload.cv",
        ),
        ("cv without gamma", DISAGGREGATED.replace("rate_rps = 2.0", "rate_rps = 2.0\ncv = 2"), 7, "workload.cv"),
        (
            "prefix groups alone",
            DISAGGREGATED.replace("requests = 60", "requests = 60\nprefix_groups = 4"),
            8,
            "workload",
        ),
        (
            "no prefix words",
            DISAGGREGATED.replace("requests = 60", "requests = 60\nprefix_groups = 4\nprefix_words = 0"),
            9,
            "workload.prefix_words",
        ),
        (
            "chats and a number of requests",
            DISAGGREGATED.replace("requests = 60", "requests = 60\nconversations = 4\nturns = 2\nconcurrency = 2"),
            7,
            "workload.requests",
        ),
        (
            "chats without turns",
            DISAGGREGATED.replace("rate_rps = 2.0\nrequests = 60", "conversations = 4\nconcurrency = 2"),
            5,
            "workload.turns",
        ),
        (
            "chats at a concurrency and a rate",
            DISAGGREGATED.replace("requests = 60", "conversations = 4\nturns = 2\nconcurrency = 2"),
            9,
            "workload.concurrency",
        ),
        (
            "more chats at once than chats",
            DISAGGREGATED.replace("rate_rps = 2.0\nrequests = 60", "conversations = 4\nturns = 2\nconcurrency = 5"),
            8,
            "workload.concurrency",
        ),
        ("a price of an unknown kind", format!("{DISAGGREGATED}[prices]\nacme = 1.0\n"), 15, "prices.acme"),
        ("a price of 0", format!("{DISAGGREGATED}[prices]\ncpu = 0\n"), 15, "prices.cpu"),
        (
            "a missing performance model",
            format!("{DISAGGREGATED}[perf_models]\ncpu = \"missing.toml\"\n"),
            15,
            "perf_models.cpu",
        ),
        // A wrong key inside the embedded topology is found at its line of the scenario.
        (
            "inline topology",
            COLOCATED.replace("backend = \"cpu\"", "backend = \"gpu\""),
            28,
            "topology_toml.hosts[1].chips[1].backend",
        ),
    ];
    for (what, text, line, key) in cases {
        let Err(e) = scenario::parse(text, "bad.toml", &here()) else { panic!("{what}: accepted") };
        assert_eq!((e.file.as_str(), e.line, e.key.as_str()), ("bad.toml", *line, *key), "{what}: {e}");
        let shown = e.to_string();
        assert!(shown.starts_with(&format!("bad.toml:{line}:")) && shown.contains(key), "{what}: {shown}");
    }
    let missing = tessera_sim::load(Path::new("/nonexistent/scenario.toml"));
    assert!(missing.is_err_and(|e| e.to_string().contains("/nonexistent/scenario.toml")));
}

/// A chip taken offline and brought back, and a slowed network link, on the default
/// disaggregated pair: nothing is lost, the chip serves again once up, and a slower
/// link shows in TTFT.
#[test]
fn a_chip_down_then_up_and_a_slow_link_lose_no_request() {
    let faults = "[[faults]]\nat_s = 5\nkind = \"chip_down\"\nchip = \"h0-ascend0\"\n\n\
                  [[faults]]\nat_s = 8\nkind = \"chip_up\"\nchip = \"h0-ascend0\"\n\n\
                  [[faults]]\nat_s = 12\nkind = \"link_slow\"\nhost = \"h1\"\nfactor = 50\n\n\
                  [[faults]]\nat_s = 20\nkind = \"link_slow\"\nhost = \"h1\"\nfactor = 1\n";
    let s = parse(&format!("{DISAGGREGATED}\n{faults}"));
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    let marks: Vec<(f64, &str)> = r.faults.iter().map(|f| (f.at_s, f.what.as_str())).collect();
    assert_eq!(
        marks,
        vec![
            (5.0, "chip h0-ascend0 down"),
            (8.0, "chip h0-ascend0 up"),
            (12.0, "host h1's link 50x slower"),
            (20.0, "host h1's link restored"),
        ]
    );
    assert_eq!(r.to_json(), simulate(&s, None).to_json(), "deterministic");

    // The same workload with h1's link slow throughout: every hand-off takes longer,
    // which the second token waits for; the first comes from the prefill chip.
    let slow =
        parse(&format!("{DISAGGREGATED}\n[[faults]]\nat_s = 0\nkind = \"link_slow\"\nhost = \"h1\"\nfactor = 1000\n"));
    let (fast, slow) = (simulate(&parse(DISAGGREGATED), None), simulate(&slow, None));
    all_served_and_all_free(&slow);
    let e2e = |r: &Report| r.e2e.map_or(0.0, |l| l.p50_ms);
    assert!(e2e(&slow) > e2e(&fast), "e2e p50 {} ms with a slow link, {} ms without", e2e(&slow), e2e(&fast));
    let ttft = |r: &Report| r.ttft.map_or(0.0, |l| l.p50_ms);
    assert_eq!(ttft(&slow), ttft(&fast), "the first token does not wait for the link");

    // A chip comes up only after it went down; a factor belongs to link_slow alone.
    for (bad, key, why) in [
        (
            "[[faults]]\nat_s = 1\nkind = \"chip_up\"\nchip = \"h0-ascend0\"\n",
            "faults[0].kind",
            "without a `chip_down`",
        ),
        ("[[faults]]\nat_s = 1\nkind = \"link_slow\"\nhost = \"h1\"\n", "faults[0].factor", "names its `factor`"),
        ("[[faults]]\nat_s = 1\nkind = \"link_slow\"\nhost = \"h1\"\nfactor = 0.5\n", "faults[0].factor", "1 to 10000"),
        (
            "[[faults]]\nat_s = 1\nkind = \"chip_down\"\nchip = \"h0-ascend0\"\nfactor = 2\n",
            "faults[0].factor",
            "no `factor`",
        ),
    ] {
        let e = scenario::parse(&format!("{DISAGGREGATED}\n{bad}"), "f.toml", &here()).err();
        let e = e.unwrap_or_else(|| panic!("accepted: {bad}"));
        assert_eq!(e.key, key, "{bad}");
        assert!(e.to_string().contains(why), "{e}");
    }
}

/// The founding comparison's mixed fleet (3 910B + 5 C500), cut to 300 requests.
fn founding_mixed() -> Scenario {
    let path = here().join("../scenarios/founding/disagg-910b-x3-c500-x5.toml");
    let mut s = scenario::load(&path).expect("the founding scenario");
    if let scenario::WorkloadRequests::Synthetic { size, .. } = &mut s.workload.requests {
        *size = scenario::WorkloadSize::Requests(300);
    }
    s
}

#[test]
fn a_strategy_applies_to_the_topology_as_roles_and_limits_and_idle_chips_leave() {
    use tessera_planner::{Roles, Strategy};
    let s = founding_mixed();
    let fleet = tessera_sim::solve::fleet(&s).expect("a fleet");
    let kinds: Vec<(&str, u32)> = fleet.fleet.kinds.iter().map(|k| (k.name.as_str(), k.chips)).collect();
    assert_eq!(kinds, [("ascend-910b", 3), ("metax-c500", 5)]);
    let strategy = Strategy {
        roles: vec![Roles { prefill: 1, decode: 0, both: 1 }, Roles { prefill: 0, decode: 3, both: 0 }],
        prefill_budget: 1024,
        decode_cap: 32,
        min_prompt_tokens: 64,
    };
    let applied = tessera_sim::solve::apply(&s, &fleet, &strategy).expect("applied");
    let chips: Vec<(String, String, usize, usize)> = applied
        .topology
        .chips()
        .map(|(_, _, c)| (c.id.clone(), c.role.to_string(), c.max_batch_tokens, c.max_batch_seqs))
        .collect();
    let want: Vec<(String, String, usize, usize)> = [
        (&fleet.chips[0][0], "prefill"),
        (&fleet.chips[0][1], "both"),
        (&fleet.chips[1][0], "decode"),
        (&fleet.chips[1][1], "decode"),
        (&fleet.chips[1][2], "decode"),
    ]
    .iter()
    .map(|(id, role)| (id.to_string(), role.to_string(), 1024, 32))
    .collect();
    assert_eq!(chips, want);
    assert_eq!(applied.topology.disagg.min_prompt_tokens, 64);
    // What moves from the topology as written (all 910Bs prefill, all C500s decode).
    let moves: Vec<(String, String, String)> = fleet
        .moves(&strategy)
        .expect("moves")
        .into_iter()
        .map(|m| (m.chip, m.from.to_string(), m.to.to_string()))
        .collect();
    let want: Vec<(String, String, String)> = [
        (&fleet.chips[0][1], "prefill", "both"),
        (&fleet.chips[0][2], "prefill", "idle"),
        (&fleet.chips[1][3], "decode", "idle"),
        (&fleet.chips[1][4], "decode", "idle"),
    ]
    .iter()
    .map(|(id, a, b)| (id.to_string(), a.to_string(), b.to_string()))
    .collect();
    assert_eq!(moves, want);
    let wrong = Strategy { roles: vec![Roles::default()], ..strategy };
    assert!(tessera_sim::solve::apply(&s, &fleet, &wrong).is_err());
}

#[test]
fn the_solver_verifies_its_best_strategies_in_the_simulator_and_chooses_one_that_lost_nothing() {
    let s = founding_mixed();
    let space = tessera_planner::Space {
        prefill_budgets: vec![512, 2048],
        decode_caps: vec![64, 256],
        min_prompt_tokens: vec![32],
    };
    let solution = tessera_sim::solve::solve(&s, &space, 2).expect("solved");
    let verified: Vec<_> = solution.strategies.iter().filter_map(|p| p.simulated.map(|sim| (p.id, sim))).collect();
    assert_eq!(verified.len(), 2, "{}", solution.table(5));
    for (id, sim) in &verified {
        assert_eq!((sim.failed, sim.kv_blocks_leaked), (0, 0), "strategy {id}");
        assert!(sim.goodput_rps > 0.0 && sim.goodput_rps <= 30.0, "strategy {id}: {sim:?}");
    }
    let chosen = solution.chosen.expect("a strategy chosen");
    assert!(verified.iter().any(|(id, _)| *id == chosen), "the chosen one was verified");
    // The same scenario solves the same way.
    assert_eq!(tessera_sim::solve::solve(&s, &space, 2).expect("solved"), solution);
    // A rate no strategy keeps up with is an error that says so.
    let flood = s.at_rate(1e5).expect("a rate");
    let e = tessera_sim::solve::solve(&flood, &space, 0).expect_err("nothing serves 100k req/s");
    assert!(e.contains("no strategy serves"), "{e}");
}

#[test]
fn a_strategy_written_into_a_topology_file_keeps_the_rest_and_moves_the_gateway_off_a_host_left_empty() {
    use tessera_planner::{Roles, Strategy};
    let path = here().join("../../topology/default.toml");
    let text = std::fs::read_to_string(&path).expect("the default topology");
    let s = scenario::load(&here().join("../scenarios/default-poisson.toml")).expect("the default scenario");
    let fleet = tessera_sim::solve::fleet(&s).expect("a fleet");
    let kinds: Vec<&str> = fleet.fleet.kinds.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(kinds, ["ascend-910b", "metax-c500"]);

    // Both chips colocated, smaller limits, another threshold: every chip keeps its host.
    let both = Strategy {
        roles: vec![Roles { both: 1, ..Roles::default() }, Roles { both: 1, ..Roles::default() }],
        prefill_budget: 256,
        decode_cap: 16,
        min_prompt_tokens: 100,
    };
    let dir = path.parent().expect("a directory");
    let written = tessera_sim::solve::apply_to_topology_text(&text, dir, &fleet, &both).expect("applied");
    let spec = tessera_topology::parse(&written, "written.toml").expect("a valid topology");
    let chips: Vec<(String, String, usize, usize)> = spec
        .chips()
        .map(|(_, h, c)| (h.name.clone(), c.role.to_string(), c.max_batch_tokens, c.max_batch_seqs))
        .collect();
    assert_eq!(chips, [("h0".into(), "both".into(), 256, 16), ("h1".into(), "both".into(), 256, 16)]);
    assert_eq!(spec.disagg.min_prompt_tokens, 100);
    // Comments stay.
    assert!(written.contains("# Where the gateway listens"), "{written}");

    // The 910B idle: its host goes, and the gateway with it to the host left.
    let c500_only = Strategy { roles: vec![Roles::default(), Roles { both: 1, ..Roles::default() }], ..both.clone() };
    let written = tessera_sim::solve::apply_to_topology_text(&text, dir, &fleet, &c500_only).expect("applied");
    let spec = tessera_topology::parse(&written, "written.toml").expect("a valid topology");
    let hosts: Vec<&str> = spec.hosts.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(hosts, ["h1"]);
    assert_eq!(spec.gateway.host, "h1");

    let nothing = Strategy { roles: vec![Roles::default(); 2], ..both };
    assert!(tessera_sim::solve::apply_to_topology_text(&text, dir, &fleet, &nothing).is_err());

    // A topology with a relative model path, written elsewhere, still finds its model.
    let example = here().join("../../topology/examples/founding-pool.toml");
    let s = scenario::load_with_topology(&here().join("../scenarios/workloads/chat-7b.toml"), &example)
        .expect("the founding pool");
    let fleet = tessera_sim::solve::fleet(&s).expect("a fleet");
    let five = Strategy {
        roles: vec![Roles { both: 5, ..Roles::default() }, Roles::default()],
        prefill_budget: 512,
        decode_cap: 128,
        min_prompt_tokens: 32,
    };
    let text = std::fs::read_to_string(&example).expect("the example");
    let written =
        tessera_sim::solve::apply_to_topology_text(&text, example.parent().expect("a directory"), &fleet, &five)
            .expect("applied");
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let out = tmp.path().join("five.toml");
    std::fs::write(&out, written).expect("written");
    let spec = tessera_topology::load(&out).expect("a valid topology whose model is found from anywhere");
    assert_eq!(spec.chips().count(), 5);
}

/// Auto mode in virtual time (`sims/scenarios/solver/auto.toml`): the rate doubles at
/// 150 s and a chip the plan uses goes offline at 220 s. The solver applies a strategy
/// once traffic is known, republishes when the rate doubles and changes the strategy in
/// force once for it (not back and forth), and adapts to the lost chip within 60 s;
/// no request is lost, and the run is deterministic.
#[test]
fn auto_mode_follows_a_doubled_rate_once_and_a_dead_chip_within_a_minute() {
    let path = here().join("../scenarios/solver/auto.toml");
    let s = match tessera_sim::load(&path) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    let r = simulate(&s, None);
    assert_eq!((r.failed, r.unfinished), (0, 0), "{:?}", r.failures);
    assert_eq!(r.kv_blocks_used_at_end, 0);
    let applied: Vec<&tessera_sim::report::SolverMark> = r.solver.iter().filter(|m| m.event == "applied").collect();
    let sets = |from: f64, to: f64| {
        r.solver.iter().filter(|m| m.event == "strategies" && (from..to).contains(&m.at_s)).count()
    };
    let applies = |from: f64, to: f64| applied.iter().filter(|m| (from..to).contains(&m.at_s)).count();
    let log = format!("{:#?}", r.solver);
    assert!(applies(0.0, 150.0) >= 1, "nothing applied before the rate doubled: {log}");
    // The doubling: republished within 30 s, and the strategy changed exactly once.
    assert!(
        r.solver
            .iter()
            .any(|m| m.event == "strategies" && (150.0..180.0).contains(&m.at_s) && m.what.starts_with("rate changed")),
        "no set for the doubled rate: {log}"
    );
    assert_eq!(applies(150.0, 220.0), 1, "{log}");
    // The chip death: a plan without the chip within 60 s; the one in force used it.
    let before = applied.iter().rfind(|m| m.at_s < 220.0).map(|m| m.what.clone()).unwrap_or_default();
    assert!(!before.contains("a-910b-0 both->idle"), "the dead chip was not in use: {before}");
    let adapted = applied.iter().find(|m| (220.0..280.0).contains(&m.at_s));
    assert!(adapted.is_some(), "no plan within 60 s of the chip's death: {log}");
    assert_eq!(applies(220.0, 300.0), 1, "{log}");
    assert!(sets(0.0, 300.0) >= 5, "{log}");
    // Deterministic: the same scenario gives the same bytes.
    assert_eq!(simulate(&s, None).to_json(), r.to_json());
}

/// Llama-2-70B on 8-way tensor-parallel instances (two H100 instances prefill, six A100
/// ones decode), cut to 300 requests: every request served, every block freed, the
/// same report twice; each instance costs its 8 chips, and the solver's fleet sees two
/// kinds of instance.
#[test]
fn a_70b_model_on_tensor_parallel_instances_is_simulated_deterministically_at_its_chips_cost() {
    let path = here().join("../scenarios/parallel/70b-h100-prefill-a100-decode.toml");
    let mut s = scenario::load(&path).expect("the 70B scenario");
    if let scenario::WorkloadRequests::Synthetic { size, .. } = &mut s.workload.requests {
        *size = scenario::WorkloadSize::Requests(300);
    }
    let r = simulate(&s, None);
    all_served_and_all_free(&r);
    assert_eq!(r.chips.len(), 8, "one row per instance");
    let again = simulate(&s, None);
    assert_eq!(serde_json::to_string(&r).expect("json"), serde_json::to_string(&again).expect("json"));
    let price = |k: &str| s.price(k).expect("a catalog price");
    let want = 16.0 * price("nvidia-h100") + 48.0 * price("nvidia-a100");
    assert!((r.usd_per_hour.expect("priced") - want).abs() < 1e-6, "{:?} vs {want}", r.usd_per_hour);
    let fleet = tessera_sim::solve::fleet(&s).expect("a fleet");
    let kinds: Vec<(&str, u32)> = fleet.fleet.kinds.iter().map(|k| (k.name.as_str(), k.chips)).collect();
    assert_eq!(kinds, [("nvidia-h100 tp8", 2), ("nvidia-a100 tp8", 6)]);
}

/// `solve --tp` regroups each host's chips of a kind into instances of another size:
/// the 70B scenario's TP8 instances taken apart and made TP4 (H100) and TP2 (A100)
/// ones, chips beyond a multiple of the size left out, and the solver's fleet sees the
/// new shapes.
#[test]
fn chips_regroup_into_instances_of_other_sizes() {
    let path = here().join("../scenarios/parallel/70b-h100-prefill-a100-decode.toml");
    let s = scenario::load(&path).expect("the 70B scenario");
    let kinds = tessera_sim::solve::physical_kinds(&s);
    assert_eq!(kinds, ["nvidia-h100", "nvidia-a100"]);
    let (reshaped, left) = tessera_sim::solve::reshape(&s, &kinds, &[4, 2]).expect("reshaped");
    assert_eq!(left, 0);
    let fleet = tessera_sim::solve::fleet(&reshaped).expect("a fleet");
    let got: Vec<(&str, u32)> = fleet.fleet.kinds.iter().map(|k| (k.name.as_str(), k.chips)).collect();
    assert_eq!(got, [("nvidia-h100 tp4", 4), ("nvidia-a100 tp2", 24)]);
    assert_eq!(fleet.chips[0][0], "nvidia-h100-0-tp4");
    let roles: Vec<String> = reshaped.topology.chips().map(|(_, _, c)| c.role.to_string()).collect();
    assert_eq!(roles.iter().filter(|r| *r == "prefill").count(), 4, "each instance takes its first chip's role");
    let (_, left) = tessera_sim::solve::reshape(&s, &kinds, &[3, 3]).expect("reshaped");
    assert_eq!(left, 8 * 2, "2 of each host's 8 chips");
    // One A100 cannot hold 140 GB of weights: the fleet says so.
    let (single, _) = tessera_sim::solve::reshape(&s, &kinds, &[8, 1]).expect("reshaped");
    let e = tessera_sim::solve::fleet(&single).expect_err("70B on one chip");
    assert!(e.to_string().contains("do not fit its memory"), "{e}");
}

/// A scenario of `sims/scenarios/tenants`, its tenants' load cut to `duration_s`.
fn tenants_scenario(name: &str, duration_s: f64) -> Scenario {
    let path = here().join("../scenarios/tenants").join(name);
    let mut s = match scenario::load(&path) {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    match &mut s.workload.requests {
        scenario::WorkloadRequests::Tenants { duration_s: d, .. } => *d = duration_s,
        other => panic!("{name}: not a tenants' workload: {other:?}"),
    }
    s
}

fn tenant<'a>(r: &'a Report, name: &str) -> &'a tessera_sim::report::TenantEnd {
    r.tenants.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tenant {name} in {:?}", r.tenants))
}

/// Every failure of an overloaded run is the router's 429: waited for a chip past
/// `queue_timeout_ms` (nothing lost, nothing else failing).
fn only_overload_failures(r: &Report) {
    for (why, n) in &r.failures {
        assert!(why.contains("no chip could take the request within"), "{n} x {why}");
    }
}

/// 32 mixed chips in virtual time: a tenant flooding the cluster with several times
/// what it serves does not hold up a light tenant's first tokens (fair queuing in the
/// router's queue, the prefill chips' batchers and the decode chips' claims, and fair
/// preemption; the light tenant's request past the prompt bound takes the chip that
/// computes it first, and its lone prompt a step of its own). Every request of the light tenant is served; the flood's excess gets
/// 429s from the router's queue; no block leaks.
#[test]
fn a_flooding_tenant_does_not_hold_up_a_light_one_on_32_chips() {
    let alone = simulate(&tenants_scenario("light-alone-32.toml", 60.0), None);
    let noisy = simulate(&tenants_scenario("noisy-neighbour-32.toml", 60.0), None);
    let (light_alone, light, flood) = (tenant(&alone, "light"), tenant(&noisy, "light"), tenant(&noisy, "flood"));
    for t in [light_alone, light] {
        assert!(t.ended > 10 && t.completed == t.ended, "{t:?}");
    }
    only_overload_failures(&noisy);
    assert_eq!(noisy.kv_blocks_used_at_end, 0);
    let p50 = |t: &tessera_sim::report::TenantEnd| t.ttft.map_or(f64::INFINITY, |l| l.p50_ms);
    // Served first come first served, the light tenant would wait behind the flood.
    assert!(p50(light) * 10.0 < p50(flood), "light {} ms, flood {} ms", p50(light), p50(flood));
    // The issue's bound: within 1.5x of alone (1.33x at this writing).
    assert!(p50(light) < 1.5 * p50(light_alone), "light {} ms, alone {} ms", p50(light), p50(light_alone));
}

/// Two tenants both offering far more than 32 chips serve, weighted 2:1: while the
/// load arrives the chips' service splits 2:1 (each chip's queue is kept short, so the
/// backlog waits in the router's queue in weighted fair order), the heavier one waits
/// less, and nothing but the router's 429s fails; nothing leaks.
#[test]
fn backlogged_tenants_are_served_by_their_weights_on_32_chips() {
    let r = simulate(&tenants_scenario("weighted-32.toml", 60.0), None);
    let (gold, silver) = (tenant(&r, "gold"), tenant(&r, "silver"));
    only_overload_failures(&r);
    assert_eq!((r.unfinished, r.kv_blocks_used_at_end), (0, 0));
    assert!((gold.arriving_service_share + silver.arriving_service_share - 1.0).abs() < 1e-9);
    let ratio = gold.arriving_service_share / silver.arriving_service_share;
    assert!((1.8..2.25).contains(&ratio), "service {ratio}:1; gold {gold:?} against silver {silver:?}");
    assert!(gold.failed < silver.failed, "the heavier weight is refused less");
}

#[test]
fn bad_tenant_loads_name_the_key() {
    let base = "seed = 1\ntopology = \"../../topology/default.toml\"\n[slo]\nttft_ms = 500\ntpot_ms = 50\n\
                [workload]\nduration_s = 5\nisl = \"16\"\nosl = \"8\"\n";
    let a = "[[workload.tenants]]\nname = \"a\"\nrate_rps = 1.0\n";
    // (what, the workload's lines and tenants, the key named, a fragment of the message)
    let cases = [
        ("a rate beside tenants", format!("rate_rps = 2.0\n{a}"), "workload.rate_rps", "own load"),
        ("no duration", a.to_string(), "workload.duration_s", "give it"),
        ("twice", format!("{a}{a}"), "workload.tenants[1].name", "twice"),
        ("bad class", format!("{a}priority = \"urgent\"\n"), "workload.tenants[0].priority", "interactive"),
        ("zero weight", format!("{a}weight = 0\n"), "workload.tenants[0].weight", "1..=1000"),
        ("beside a trace", format!("trace = \"t.jsonl\"\n{a}"), "workload.tenants", "not with `trace`"),
    ];
    for (what, extra, key, fragment) in cases {
        let mut text = format!("{base}{extra}");
        if what == "no duration" {
            text = text.replace("duration_s = 5\n", "");
        }
        if what == "beside a trace" {
            text = text.replace("duration_s = 5\nisl = \"16\"\nosl = \"8\"\n", "");
        }
        let e = match scenario::parse(&text, "t.toml", &here()) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e,
        };
        assert_eq!(e.key, key, "{what}: {e}");
        assert!(e.message.contains(fragment), "{what}: `{fragment}` not in {e}");
    }
    let ok = scenario::parse(&format!("{base}{a}weight = 3\npriority = \"batch\"\n"), "t.toml", &here());
    let s = ok.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.topology.tenants[0].weight, 3);
    assert_eq!(s.topology.tenants[0].priority, tessera_topology::PriorityClass::Batch);
}
