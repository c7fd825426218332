use tessera_perf::{Link, PerfModel, Power, REFERENCE_MODEL, Roof};

use super::*;
use crate::search::{exhaustive, solve};
use crate::{Roles, Space};

/// A kind with these peaks, price and board power, and 40 GB of KV.
fn kind(name: &str, chips: u32, tflops: f64, gbs: f64, usd: f64, tdp: f64) -> KindSpec {
    KindSpec {
        name: name.into(),
        chips,
        stages: Vec::new(),
        roof: Roof { fp16_tflops: tflops, memory_bw_gbs: gbs },
        perf: PerfModel::flat(0.6, 0.8),
        time_scale: 1.0,
        usd_per_hour: usd,
        power: Power::from_tdp(tdp),
        kv_tokens: 40_000_000_000 / REFERENCE_MODEL.kv_bytes_per_token(),
    }
}

/// H100-, A100- and 910B-like kinds (the catalog's peaks, round prices).
fn fleet(h100: u32, a100: u32, ascend: u32) -> Fleet {
    Fleet {
        model: REFERENCE_MODEL,
        kinds: vec![
            kind("h100", h100, 989.0, 3350.0, 4.0, 700.0),
            kind("a100", a100, 312.0, 2039.0, 2.0, 400.0),
            kind("910b", ascend, 376.0, 1600.0, 2.5, 400.0),
        ],
        link: Link { bandwidth_gbs: 12.5, latency_s: 20e-6 },
    }
}

fn strategy(roles: &[(u32, u32, u32)]) -> Strategy {
    Strategy {
        roles: roles.iter().map(|&(prefill, decode, both)| Roles { prefill, decode, both }).collect(),
        prefill_budget: 2048,
        decode_cap: 256,
        min_prompt_tokens: 32,
    }
}

const WORKLOAD: Workload = Workload { rate_rps: 20.0, isl: 1024.0, osl: 256.0 };
const SLO: Slo = Slo { ttft_s: 1.0, tpot_s: 0.05 };

fn score(fleet: &Fleet, s: &Strategy, workload: &Workload) -> Option<Figures> {
    let tables = Tables::new(fleet, workload, s.prefill_budget, s.decode_cap);
    evaluate(fleet, &tables, s, workload, &SLO)
}

#[test]
fn an_unloaded_disaggregated_request_takes_its_prefill_and_hand_off_then_one_step_a_token() {
    let f = fleet(1, 1, 0);
    let s = strategy(&[(1, 0, 0), (0, 1, 0), (0, 0, 0)]);
    let light = Workload { rate_rps: 0.01, ..WORKLOAD };
    let figures = score(&f, &s, &light).expect("a light load is served");
    let t = Tables::new(&f, &light, 2048, 256);
    let handoff = f.link.transfer_s(1024 * REFERENCE_MODEL.kv_bytes_per_token() / 32);
    assert!((figures.ttft_p90_s - t.kinds[0].prefill_s - handoff).abs() < 1e-9, "{figures:?}");
    // One sequence a step, the steps paused now and then for a request's KV install.
    let install = f.link.transfer_s(1024 * REFERENCE_MODEL.kv_bytes_per_token());
    let tpot = t.kinds[1].decode_s[0] / (1.0 - 0.01 * install);
    assert!((figures.tpot_p90_s - tpot).abs() < 1e-9, "{figures:?}");
    assert_eq!(figures.goodput_rps, 0.01);
    assert_eq!(figures.usd_per_hour, 6.0);
}

#[test]
fn load_raises_the_p90s_and_lowers_the_share_within_slo_and_past_capacity_nothing_is_served() {
    let f = fleet(1, 1, 0);
    let s = strategy(&[(1, 0, 0), (0, 1, 0), (0, 0, 0)]);
    let tight = Slo { ttft_s: 0.025, ..SLO };
    let at = |rate: f64| {
        let w = Workload { rate_rps: rate, ..WORKLOAD };
        evaluate(&f, &Tables::new(&f, &w, 2048, 256), &s, &w, &tight)
    };
    let mut last = at(0.5).expect("served");
    let mut share = last.goodput_rps / 0.5;
    assert!(share > 0.98, "{last:?}");
    for rate in [2.0, 4.0, 5.0] {
        let now = at(rate).expect("served");
        assert!(now.ttft_p90_s >= last.ttft_p90_s && now.tpot_p90_s >= last.tpot_p90_s, "{last:?} then {now:?}");
        assert!(now.goodput_rps / rate <= share + 1e-12, "{rate} req/s: {now:?}");
        (last, share) = (now, now.goodput_rps / rate);
    }
    assert!(last.goodput_rps < 5.0, "the tight TTFT SLO is missed by some: {last:?}");
    // Past the decode chip's capacity (its steps and KV installs) the queues grow
    // without bound.
    assert_eq!(at(6.0), None);
}

#[test]
fn more_chips_of_a_role_never_serve_less() {
    let f = fleet(4, 4, 0);
    let heavy = Workload { rate_rps: 200.0, ..WORKLOAD };
    let mut last = 0.0;
    for n in 1..=4 {
        let g = score(&f, &strategy(&[(n, 0, 0), (0, 4, 0), (0, 0, 0)]), &heavy).map_or(0.0, |x| x.goodput_rps);
        assert!(g >= last, "{n} prefill chips: {g} < {last}");
        last = g;
    }
}

#[test]
fn a_strategy_without_a_serving_chip_or_with_too_little_kv_scores_nothing() {
    let f = fleet(1, 1, 1);
    assert_eq!(score(&f, &strategy(&[(0, 0, 0), (0, 0, 0), (0, 0, 0)]), &WORKLOAD), None);
    let mut tiny = fleet(1, 1, 0);
    tiny.kinds[1].kv_tokens = 100;
    assert_eq!(score(&tiny, &strategy(&[(1, 0, 0), (0, 1, 0), (0, 0, 0)]), &WORKLOAD), None);
}

#[test]
fn colocated_steps_share_a_chip_between_chunks_and_decodes() {
    let f = fleet(1, 0, 0);
    let s = strategy(&[(0, 0, 1), (0, 0, 0), (0, 0, 0)]);
    let figures = score(&f, &s, &Workload { rate_rps: 2.0, ..WORKLOAD }).expect("served");
    let t = Tables::new(&f, &WORKLOAD, 2048, 256);
    // Decodes ride in chunk steps now and then: slower than decode-only, faster than a chunk.
    assert!(figures.tpot_p90_s > t.kinds[0].decode_s[0] && figures.tpot_p90_s < t.kinds[0].mixed_s[0]);
}

fn small_space() -> Space {
    Space { prefill_budgets: vec![512, 2048], decode_caps: vec![8, 128], min_prompt_tokens: vec![32, 4096] }
}

#[test]
fn the_search_finds_the_exhaustive_frontier_on_nine_and_twelve_chips_of_three_kinds() {
    let space = Space { prefill_budgets: vec![2048], decode_caps: vec![64], min_prompt_tokens: vec![32] };
    for (f, rate) in [(fleet(3, 3, 3), 5.0), (fleet(4, 4, 4), 15.0)] {
        let workload = Workload { rate_rps: rate, ..WORKLOAD };
        let searched = solve(&f, &workload, &SLO, &space).expect("searched");
        assert!(searched.len() > 3, "a trade-off to find: {searched:?}");
        assert_eq!(searched, exhaustive(&f, &workload, &SLO, &space).expect("searched"));
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]
    #[test]
    fn the_search_finds_the_exhaustive_frontier_on_small_fleets(
        chips in proptest::collection::vec(0u32..=2, 3),
        prices in proptest::collection::vec(0.5f64..5.0, 3),
        rate in 0.5f64..60.0,
        isl in 16f64..2048.0,
    ) {
        let mut f = fleet(chips[0], chips[1], chips[2]);
        for (k, p) in f.kinds.iter_mut().zip(&prices) {
            k.usd_per_hour = *p;
        }
        let workload = Workload { rate_rps: rate, isl, osl: 128.0 };
        match (solve(&f, &workload, &SLO, &small_space()), exhaustive(&f, &workload, &SLO, &small_space())) {
            (Ok(a), Ok(b)) => proptest::prop_assert_eq!(a, b),
            (a, b) => proptest::prop_assert_eq!(a.map(|_| ()), b.map(|_| ())),
        }
    }
}

#[test]
fn screening_by_sides_finds_what_the_full_search_finds_on_a_fleet_it_can_search_whole() {
    let f = fleet(5, 5, 4);
    for rate in [10.0, 60.0] {
        let workload = Workload { rate_rps: rate, ..WORKLOAD };
        let full = solve(&f, &workload, &SLO, &small_space()).expect("searched");
        let screened = crate::search::screen(&f, &workload, &SLO, &small_space(), (5, 5), &mut TableCache::default());
        let best = |set: &[crate::pareto::Candidate], by: fn(&Figures) -> f64| {
            set.iter().map(|c| by(&c.figures)).fold(f64::NEG_INFINITY, f64::max)
        };
        for by in [|f: &Figures| f.goodput_rps, |f: &Figures| f.goodput_per_usd(), |f: &Figures| -f.ttft_p90_s] {
            assert_eq!(best(&full, by), best(&screened, by), "{rate} req/s");
        }
        // With every count of every kind on its grid, screening by sides is exact.
        assert_eq!(full, screened, "{rate} req/s");
        // Every screened strategy is one the full search scores the same.
        for c in &screened {
            let tables = Tables::new(&f, &workload, c.strategy.prefill_budget, c.strategy.decode_cap);
            assert_eq!(evaluate(&f, &tables, &c.strategy, &workload, &SLO), Some(c.figures));
        }
    }
}

#[test]
fn chips_keep_their_duty_where_the_counts_allow() {
    use crate::{Duty::*, assign};
    let now = [Prefill, Prefill, Decode, Decode, Both];
    // Same counts: nobody moves.
    assert_eq!(assign(&now, &Roles { prefill: 2, decode: 2, both: 1 }), now);
    // One prefill chip fewer, one decode more: only the second prefill chip switches.
    assert_eq!(assign(&now, &Roles { prefill: 1, decode: 3, both: 1 }), [Prefill, Decode, Decode, Decode, Both]);
    // All colocated on three chips: the first two prefill chips and one decode chip move.
    assert_eq!(assign(&now, &Roles { both: 3, ..Roles::default() }), [Both, Both, Idle, Idle, Both]);
    // Idle stays idle while the counts leave room for one; the next idle chip starts.
    assert_eq!(assign(&[Idle, Idle, Decode], &Roles { decode: 2, ..Roles::default() }), [Idle, Decode, Decode]);
}

/// A re-solve with the tables of an earlier one gives the same set and builds no table
/// when only the rate and the chip counts moved; new lengths start afresh.
#[test]
fn a_re_solve_reuses_the_tables_and_gives_the_same_set() {
    let fleet = fleet(3, 3, 3);
    let (slo, space) = (Slo { ttft_s: 1.0, tpot_s: 0.1 }, small_space());
    let work = Workload { rate_rps: 20.0, isl: 512.0, osl: 128.0 };
    let mut cache = TableCache::default();
    let first = crate::search::solve_with(&fleet, &work, &slo, &space, &mut cache);
    assert_eq!(first, crate::search::solve(&fleet, &work, &slo, &space));
    let settings = (space.prefill_budgets.len() * space.decode_caps.len()) as u64;
    assert_eq!((cache.built, cache.reused), (settings, 0));
    // Rate up 20% and a chip down: every table reused, the same set as from scratch.
    let mut smaller = fleet.clone();
    smaller.kinds[0].chips -= 1;
    let faster = Workload { rate_rps: 24.0, ..work };
    let again = crate::search::solve_with(&smaller, &faster, &slo, &space, &mut cache);
    assert_eq!(again, crate::search::solve(&smaller, &faster, &slo, &space));
    assert_eq!((cache.built, cache.reused), (settings, settings));
    // Longer prompts: new tables.
    let longer = Workload { isl: 1024.0, ..work };
    let _ = crate::search::solve_with(&fleet, &longer, &slo, &space, &mut cache);
    assert_eq!(cache.built, 2 * settings);
}

/// `base` as an instance of `stages` stages of `tp` chips each (layers split evenly), at
/// its chips' price and power together.
fn instance_of(base: &KindSpec, chips: u32, stages: usize, tp: usize) -> KindSpec {
    let layers = REFERENCE_MODEL.num_layers;
    let link = Link { bandwidth_gbs: 300.0, latency_s: 5e-6 };
    let stages: Vec<tessera_perf::parallel::Stage> = (0..stages)
        .map(|s| tessera_perf::parallel::Stage {
            roof: base.roof,
            perf: base.perf,
            layers: layers * (s + 1) / stages - layers * s / stages,
            tp,
            link,
        })
        .collect();
    let n = (stages.len() * tp) as f64;
    KindSpec {
        name: format!("{} x{n}", base.name),
        chips,
        usd_per_hour: base.usd_per_hour * n,
        power: Power::from_tdp(base.power.prefill_w * n),
        kv_tokens: base.kv_tokens * n as u64,
        stages,
        ..base.clone()
    }
}

/// Instances are kinds like any other to the search: on a fleet of a tensor-parallel
/// kind, a pipelined kind and single chips, the search finds the exhaustive frontier;
/// and an instance is timed as one: a TP=2 decode step is faster than its chip's alone
/// but, for the all-reduces, not twice as fast; two stages take as long as one chip
/// (the same layers, one after the other) plus the hand-off.
#[test]
fn instances_are_searched_exactly_and_timed_as_pipelines() {
    let base = fleet(0, 0, 0);
    let (h100, a100, ascend) = (&base.kinds[0], &base.kinds[1], &base.kinds[2]);
    let f = Fleet {
        kinds: vec![instance_of(h100, 2, 1, 2), instance_of(a100, 2, 2, 1), KindSpec { chips: 3, ..ascend.clone() }],
        ..base.clone()
    };
    let space = Space { prefill_budgets: vec![2048], decode_caps: vec![64], min_prompt_tokens: vec![32] };
    for rate in [4.0, 12.0] {
        let workload = Workload { rate_rps: rate, ..WORKLOAD };
        let searched = solve(&f, &workload, &SLO, &space).expect("searched");
        assert!(searched.len() > 2, "a trade-off to find: {searched:?}");
        assert_eq!(searched, exhaustive(&f, &workload, &SLO, &space).expect("searched"));
    }
    let one = Tables::new(&Fleet { kinds: vec![h100.clone(), a100.clone()], ..base.clone() }, &WORKLOAD, 2048, 64);
    let inst = Tables::new(&f, &WORKLOAD, 2048, 64);
    let (single, tp2) = (one.kinds[0].decode_s[7], inst.kinds[0].decode_s[7]);
    assert!(tp2 < single && tp2 > single / 2.0, "TP2 {tp2} s, one chip {single} s");
    let (single, pp2) = (one.kinds[1].decode_s[0], inst.kinds[1].decode_s[0]);
    assert!(pp2 >= single && pp2 < single * 1.1, "PP2 {pp2} s, one chip {single} s");
}
