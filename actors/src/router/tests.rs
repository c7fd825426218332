use super::*;
use crate::msg::ChipReport;
use crate::msg::Role::{self, Both, Decode, Prefill};

fn chip(host: u16, n: u64, state: ChipState, load: usize) -> (Addr, ChipView) {
    let addr = Addr::new(HostId(host), n);
    let report = ChipReport {
        state,
        kv_blocks_total: 8,
        ..ChipReport::starting(addr, format!("h{host}-{n}"), format!("h{host}"), Both)
    };
    (addr, ChipView { report, load_tokens: load })
}

#[test]
fn pick_is_least_loaded_healthy_chip() {
    use ChipState::*;
    let a = |h, n| Addr::new(HostId(h), n);
    // (chips, hosts down, exclude, expected)
    type Case = (Vec<(Addr, ChipView)>, Vec<u16>, Vec<Addr>, Option<Addr>);
    let table: Vec<Case> = vec![
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 50)], vec![], vec![], Some(a(1, 16))),
        (vec![chip(0, 16, Up, 10), chip(1, 16, Up, 10)], vec![], vec![], Some(a(0, 16))), // tie: lowest address
        (vec![chip(0, 16, Up, 100), chip(1, 16, Starting, 0)], vec![], vec![], Some(a(0, 16))),
        (vec![chip(0, 16, Down, 0), chip(1, 16, Failed, 0)], vec![], vec![], None),
        (vec![chip(0, 16, Up, 0), chip(1, 16, Up, 500)], vec![0], vec![], Some(a(1, 16))), // host down
        (vec![chip(0, 16, Up, 0), chip(1, 16, Up, 500)], vec![], vec![a(0, 16)], Some(a(1, 16))), // excluded
        (vec![chip(0, 16, Up, 0)], vec![], vec![a(0, 16)], Some(a(0, 16))),                // excluded, but the only one
        (vec![], vec![], vec![], None),
    ];
    for (i, (chips, down, exclude, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let down: BTreeSet<HostId> = down.into_iter().map(HostId).collect();
        assert_eq!(pick(&chips, &down, &exclude), want, "case {i}");
    }
}

#[test]
fn routes_only_to_heartbeating_chips_and_re_routes_when_a_host_dies() {
    use crate::msg::{ErrorKind, Heartbeat};
    use crate::test_fx::TestFx;
    let (c0, c1) = (chip(0, 16, ChipState::Starting, 0), chip(1, 16, ChipState::Starting, 0));
    let mut router = Router::new(vec![c0.1.report.clone(), c1.1.report.clone()], 2);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    router.on_start(&mut fx);
    let req = |n| Addr::new(HostId(0), 5000 + n);
    let route = |id: u64| Msg::Route {
        request_id: id,
        req: req(id),
        tokens: 100,
        prompt_tokens: 50,
        exclude: vec![],
        prompt: vec![],
    };

    router.handle(route(1), &mut fx);
    assert!(
        matches!(&fx.take_sent()[..], [(_, Msg::RouteFailed { error, .. })] if error.kind == ErrorKind::Unavailable)
    );

    let up = |(addr, view): &(Addr, ChipView)| ChipReport { chip: *addr, state: ChipState::Up, ..view.report.clone() };
    for (host, c) in [(0u16, &c0), (1, &c1)] {
        let beat = Heartbeat { host: HostId(host), host_name: format!("h{host}"), seq: 1, chips: vec![up(c)] };
        router.handle(Msg::Heartbeat { beat }, &mut fx);
    }
    router.handle(route(1), &mut fx);
    router.handle(route(2), &mut fx);
    let placed: Vec<Addr> = fx
        .take_sent()
        .into_iter()
        .filter_map(|(_, m)| match m {
            Msg::Routed { chip, .. } => Some(chip),
            _ => None,
        })
        .collect();
    assert_eq!(placed, vec![c0.0, c1.0], "least loaded: one each");

    router.handle(route(3), &mut fx);
    assert!(
        matches!(&fx.take_sent()[..], [(_, Msg::RouteFailed { error, .. })] if error.kind == ErrorKind::Overloaded)
    );

    router.handle(Msg::HostDown { host: HostId(1), host_name: "h1".into() }, &mut fx);
    assert_eq!(fx.take_sent(), vec![(req(2), Msg::ChipLost { chip: c1.0 })]);
    router.handle(route(2), &mut fx);
    assert_eq!(fx.take_sent(), vec![(req(2), Msg::Routed { request_id: 2, chip: c0.0, prefill: None })]);
}

fn role_chip(host: u16, role: Role, state: ChipState, load: usize) -> (Addr, ChipView) {
    let (addr, mut view) = chip(host, 16, state, load);
    view.report.role = role;
    (addr, view)
}

#[test]
fn place_disaggregates_long_prompts_and_colocates_the_rest() {
    use ChipState::*;
    let a = |h| Addr::new(HostId(h), 16);
    let pd = |p, d| Some(Placed { decode: a(d), prefill: Some(a(p)) });
    let one = |d| Some(Placed { decode: a(d), prefill: None });
    // (chips, prompt tokens, expected); min_prompt_tokens is 32.
    type Case = (Vec<(Addr, ChipView)>, usize, Option<Placed>);
    let table: Vec<Case> = vec![
        (vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], 100, pd(0, 1)),
        (vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], 31, one(1)), // short: decode chip alone
        (vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Down, 0)], 100, one(0)), // no decode chip: fall back
        (vec![role_chip(0, Prefill, Down, 0), role_chip(1, Decode, Up, 0)], 100, one(1)),
        (vec![role_chip(0, Both, Up, 0), role_chip(1, Both, Up, 9)], 100, one(0)), // all both: colocated
        (
            vec![
                role_chip(0, Prefill, Up, 50),
                role_chip(1, Prefill, Up, 10),
                role_chip(2, Decode, Up, 5),
                role_chip(3, Decode, Up, 1),
            ],
            100,
            pd(1, 3),
        ),
        (vec![role_chip(0, Prefill, Up, 0), role_chip(1, Both, Up, 0)], 100, one(1)), // no decode-role chip
    ];
    for (i, (chips, prompt, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        assert_eq!(place(&chips, &BTreeSet::new(), &[], prompt, 32, &by_load), want, "case {i}");
    }
}

#[test]
fn place_never_pairs_chips_of_different_models_and_skips_draining_chips() {
    use crate::msg::KvCompat;
    let compat = |h| Some(KvCompat { hash: h, fields: vec![] });
    let (p, mut pv) = role_chip(0, Prefill, ChipState::Up, 0);
    let (d1, mut d1v) = role_chip(1, Decode, ChipState::Up, 0);
    let (d2, mut d2v) = role_chip(2, Decode, ChipState::Up, 5);
    pv.report.compat = compat(1);
    d1v.report.compat = compat(2);
    d2v.report.compat = compat(1);
    let mut chips: BTreeMap<Addr, ChipView> = [(p, pv), (d1, d1v), (d2, d2v)].into_iter().collect();
    assert_eq!(place(&chips, &BTreeSet::new(), &[], 100, 32, &by_load), Some(Placed { decode: d2, prefill: Some(p) }));
    if let Some(v) = chips.get_mut(&d2) {
        v.report.draining = true;
    }
    assert_eq!(place(&chips, &BTreeSet::new(), &[], 100, 32, &by_load), Some(Placed { decode: d1, prefill: None }));
}

#[test]
fn place_avoids_excluded_chips_whole_before_reusing_them() {
    use ChipState::*;
    let a = |h| Addr::new(HostId(h), 16);
    let pd = |p, d| Some(Placed { decode: a(d), prefill: Some(a(p)) });
    let one = |d| Some(Placed { decode: a(d), prefill: None });
    let pair = || vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)];
    // (chips, excluded hosts, expected); a long prompt, min_prompt_tokens 32.
    type Case = (Vec<(Addr, ChipView)>, Vec<u16>, Option<Placed>);
    let table: Vec<Case> = vec![
        (pair(), vec![], pd(0, 1)),
        // The only decode chip declined (restarting): the prefill chip serves alone.
        (pair(), vec![1], one(0)),
        // The only prefill chip declined: the decode chip serves alone.
        (pair(), vec![0], one(1)),
        // Both declined: nothing better, so the pair again (the request backs off).
        (pair(), vec![0, 1], pd(0, 1)),
        // Another decode chip is up: a pair that avoids the excluded one.
        (
            vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0), role_chip(2, Decode, Up, 99)],
            vec![1],
            pd(0, 2),
        ),
        // Colocated on a non-excluded chip before an excluded one, whatever the load.
        (vec![role_chip(0, Both, Up, 0), role_chip(1, Both, Up, 500)], vec![0], one(1)),
    ];
    for (i, (chips, exclude, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let exclude: Vec<Addr> = exclude.into_iter().map(a).collect();
        assert_eq!(place(&chips, &BTreeSet::new(), &exclude, 100, 32, &by_load), want, "case {i}");
    }
}

/// Work ahead = placed tokens less the prompt prefix a chip holds cached: a cached
/// chip wins at equal load and even a little above it; a hot spot's cache counts for
/// nothing; the decode leg of a disaggregated request is placed by load alone.
#[test]
fn placement_credits_cached_prefixes_but_not_to_a_hot_spot() {
    use ChipState::*;
    let a = |h| Addr::new(HostId(h), 16);
    let one = |h| Some(Placed { decode: a(h), prefill: None });
    // (chips, cached blocks per chip (16 tokens each), prompt tokens, want)
    type Case = (Vec<(Addr, ChipView)>, Vec<(u16, usize)>, usize, Option<Placed>);
    let table: Vec<Case> = vec![
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 100)], vec![(1, 4)], 100, one(1)), // equal load: the cache
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 150)], vec![(1, 4)], 100, one(1)), // 150 - 64 < 100
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 180)], vec![(1, 4)], 100, one(0)), // 180 - 64 > 100
        (vec![chip(0, 16, Up, 100), chip(1, 16, Up, 150)], vec![(1, 20)], 100, one(1)), // credit capped at the prompt
        (vec![chip(0, 16, Up, 0), chip(1, 16, Up, 1000), chip(2, 16, Up, 0)], vec![(1, 200)], 1000, one(0)), // hot spot
        (vec![chip(0, 16, Up, 50), chip(1, 16, Up, 40)], vec![], 100, one(1)),
        (
            vec![role_chip(0, Prefill, Up, 10), role_chip(1, Prefill, Up, 0), role_chip(2, Decode, Up, 0)],
            vec![(0, 2), (2, 8)],
            100,
            Some(Placed { decode: a(2), prefill: Some(a(0)) }),
        ),
    ];
    for (i, (chips, held, prompt, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let held: BTreeMap<Addr, usize> = held.into_iter().map(|(h, b)| (a(h), b)).collect();
        let mean = chips.values().map(|c| c.load_tokens).sum::<usize>() / chips.len().max(1);
        let cached = cache_credit(&chips, &held, 16, prompt, mean);
        assert_eq!(place(&chips, &BTreeSet::new(), &[], prompt, 32, &kv_aware(&cached)), want, "case {i}");
    }
}

/// The router learns where KV lives from the chips' events, asks a chip it has no
/// exact view of (first contact, a gap shown by a heartbeat) for a snapshot, and
/// places a prompt sharing a cached prefix on the chip holding it.
#[test]
fn kv_events_and_snapshots_steer_placement() {
    use crate::kv::{KvEvent, prefix_hashes};
    use crate::msg::Heartbeat;
    use crate::test_fx::TestFx;
    let (c0, c1) = (chip(0, 16, ChipState::Up, 0), chip(1, 16, ChipState::Up, 0));
    let mut router = Router::new(vec![c0.1.report.clone(), c1.1.report.clone()], 8).with_block_size(4);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    router.on_start(&mut fx);
    let beat = |host: u16, c: &(Addr, ChipView), last: u64| {
        let report = ChipReport { kv_last_event: last, kv_incarnation: 1, ..c.1.report.clone() };
        Msg::Heartbeat {
            beat: Heartbeat { host: HostId(host), host_name: format!("h{host}"), seq: 1, chips: vec![report] },
        }
    };
    // First contact: both chips are asked for a snapshot, once.
    router.handle(beat(0, &c0, 0), &mut fx);
    router.handle(beat(1, &c1, 0), &mut fx);
    router.handle(beat(1, &c1, 0), &mut fx);
    let asked: Vec<Addr> = fx
        .take_sent()
        .into_iter()
        .filter(|(_, m)| matches!(m, Msg::KvSnapshotRequest { .. }))
        .map(|(to, _)| to)
        .collect();
    assert_eq!(asked, vec![c0.0, c1.0]);
    for c in [&c0, &c1] {
        router.handle(Msg::KvSnapshot { chip: c.0, incarnation: 1, last_event: 0, hashes: vec![] }, &mut fx);
    }
    // Chip 1 computes a system prompt: its blocks are stored.
    let system: Vec<u32> = (1..=12).collect();
    let events: Vec<KvEvent> = prefix_hashes(&system, 4)
        .into_iter()
        .enumerate()
        .map(|(i, hash)| KvEvent::Stored { seq: i as u64 + 1, hash })
        .collect();
    router.handle(Msg::KvEvents { chip: c1.0, incarnation: 1, events }, &mut fx);
    let ask = |id: u64, prompt: Vec<u32>| Msg::Route {
        request_id: id,
        req: Addr::new(HostId(0), 5000 + id),
        tokens: prompt.len() + 8,
        prompt_tokens: prompt.len(),
        exclude: vec![],
        prompt,
    };
    let routed = |fx: &mut TestFx| -> Vec<Addr> {
        fx.take_sent()
            .into_iter()
            .filter_map(|(_, m)| if let Msg::Routed { chip, .. } = m { Some(chip) } else { None })
            .collect()
    };
    // A prompt after the system prompt goes to chip 1 (lowest address would be chip 0).
    router.handle(ask(1, system.iter().copied().chain([50, 51]).collect()), &mut fx);
    assert_eq!(routed(&mut fx), vec![c1.0]);
    // Another prompt entirely goes by load: chip 0.
    router.handle(ask(2, vec![90, 91, 92, 93, 94]), &mut fx);
    assert_eq!(routed(&mut fx), vec![c0.0]);
    // Chip 1's heartbeat says 5 events; the router saw 3: a snapshot is asked for, and
    // until it comes chip 1's cache counts for nothing.
    router.handle(beat(1, &c1, 5), &mut fx);
    assert!(fx.take_sent().iter().any(|(to, m)| *to == c1.0 && matches!(m, Msg::KvSnapshotRequest { .. })));
    assert!(router.index.held(c1.0).is_empty());
    let hashes = prefix_hashes(&system, 4);
    router.handle(Msg::KvSnapshot { chip: c1.0, incarnation: 1, last_event: 5, hashes }, &mut fx);
    assert_eq!(router.index.prefix_blocks(&prefix_hashes(&system, 4)), BTreeMap::from([(c1.0, 3)]));
}

/// The baseline policies, through the router: round-robin takes turns, random is the
/// same for the same request id, dynamo adds blocks to prefill to blocks in use, and
/// least-loaded ignores caches.
#[test]
fn baseline_policies_place_as_documented() {
    use crate::kv::{KvEvent, prefix_hashes};
    use crate::test_fx::TestFx;
    let up = |h: u16, used: usize| {
        let (_, mut v) = chip(h, 16, ChipState::Up, 0);
        v.report.kv_blocks_used = used;
        v.report
    };
    let route = |id: u64, prompt: Vec<u32>| Msg::Route {
        request_id: id,
        req: Addr::new(HostId(0), 5000 + id),
        tokens: prompt.len() + 4,
        prompt_tokens: prompt.len(),
        exclude: vec![],
        prompt,
    };
    let run = |policy: RouterPolicy, used: [usize; 3], ids: &[u64], prompt: &[u32]| -> Vec<u16> {
        let reports = vec![up(0, used[0]), up(1, used[1]), up(2, used[2])];
        let mut router = Router::new(reports, 64).with_block_size(4).with_policy(policy);
        let mut fx = TestFx::new(Addr::new(HostId(0), 2));
        // Chip 2 holds the prompt's first two blocks.
        let c2 = Addr::new(HostId(2), 16);
        router.index.resync(c2, 0, 0, &prefix_hashes(prompt, 4)[..2]);
        router.handle(
            Msg::KvEvents { chip: c2, incarnation: 0, events: vec![KvEvent::Stored { seq: 1, hash: 1 }] },
            &mut fx,
        );
        let mut got = Vec::new();
        for &id in ids {
            router.handle(route(id, prompt.to_vec()), &mut fx);
            router.handle(Msg::Release { request_id: id, chip: Addr::new(HostId(0), 0) }, &mut fx);
            for (_, m) in fx.take_sent() {
                if let Msg::Routed { chip, .. } = m {
                    got.push(chip.host.0);
                    router.handle(Msg::Release { request_id: id, chip }, &mut fx);
                }
            }
        }
        got
    };
    let prompt: Vec<u32> = (1..=12).collect();
    assert_eq!(run(RouterPolicy::RoundRobin, [0; 3], &[1, 2, 3, 4], &prompt), vec![0, 1, 2, 0]);
    let a = run(RouterPolicy::Random, [0; 3], &[1, 2, 3, 4, 5, 6], &prompt);
    assert_eq!(a, run(RouterPolicy::Random, [0; 3], &[1, 2, 3, 4, 5, 6], &prompt), "seeded by the request id");
    assert!(a.iter().any(|&c| c != a[0]), "and not always the same chip: {a:?}");
    // 3 blocks to prefill: chip 2 saves 2 of them; blocks in use 0, 0, 1 -> 3, 3, 2.
    assert_eq!(run(RouterPolicy::Dynamo, [0, 0, 1], &[1], &prompt), vec![2]);
    // 3, 3, 1 + 3 = 4: chip 0.
    assert_eq!(run(RouterPolicy::Dynamo, [0, 0, 3], &[1], &prompt), vec![0]);
    assert_eq!(run(RouterPolicy::LeastLoaded, [0; 3], &[1], &prompt), vec![0]);
    assert_eq!(run(RouterPolicy::KvAware, [0; 3], &[1], &prompt), vec![2]);
}

mod candidates {
    use super::*;
    use crate::msg::KvCompat;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    struct Spec {
        role: u8,
        state_up: bool,
        load: usize,
        compat: Option<u8>,
        cached: usize,
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            0..3u8,
            prop::bool::weighted(0.85),
            0..50usize,
            prop::option::of(0..2u8),
            prop_oneof![3 => Just(0usize), 1 => 1..40usize],
        )
            .prop_map(|(role, state_up, load, compat, cached)| Spec {
                role,
                state_up,
                load: load * 10,
                compat,
                cached,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The router's shortcut (holders plus the least-loaded chips of each leg) picks
        /// exactly what scoring every chip picks, for kv-aware and least-loaded.
        #[test]
        fn the_shortcut_places_as_a_full_scan(
            specs in prop::collection::vec(spec(), 1..24),
            exclude in prop::collection::vec(0..24usize, 0..3),
            down in prop::collection::vec(0..24u16, 0..2),
            prompt in 1..400usize,
        ) {
            let reports: Vec<ChipReport> = specs.iter().enumerate().map(|(i, s)| {
                let addr = Addr::new(HostId(i as u16), 16);
                ChipReport {
                    state: if s.state_up { ChipState::Up } else { ChipState::Down },
                    compat: s.compat.map(|c| KvCompat { hash: c as u64, fields: vec![] }),
                    ..ChipReport::starting(addr, format!("c{i}"), format!("h{i}"), [Prefill, Decode, Both][s.role as usize])
                }
            }).collect();
            let mut router = Router::new(reports, 64);
            for (i, s) in specs.iter().enumerate() {
                router.set_load(Addr::new(HostId(i as u16), 16), |_| s.load);
            }
            router.down_hosts = down.into_iter().map(HostId).collect();
            let exclude: Vec<Addr> = exclude.into_iter().map(|i| Addr::new(HostId(i as u16), 16)).collect();
            let held: BTreeMap<Addr, usize> = specs.iter().enumerate()
                .filter(|(_, s)| s.cached > 0)
                .map(|(i, s)| (Addr::new(HostId(i as u16), 16), s.cached))
                .collect();
            let cached = cache_credit(&router.chips, &held, 16, prompt, router.total_load / router.chips.len());
            let kv = kv_aware(&cached);
            let scorers: [&Scorer; 2] = [&kv, &by_load];
            for score in scorers {
                let want = place(&router.chips, &router.down_hosts, &exclude, prompt, 64, score);
                let few = router.candidates(&held, &exclude);
                let got = place_among(&few, &router.down_hosts, &exclude, prompt, 64, score);
                prop_assert_eq!(got, want);
            }
        }
    }
}
