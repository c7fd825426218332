use super::*;
use crate::msg::ChipReport;
use crate::msg::Role::{self, Both, Decode, Prefill};

/// A `Route` from request `id` (its actor at host 0, 5000 + `id`).
fn ask(id: u64, tokens: usize, prompt_tokens: usize, exclude: Vec<Addr>, prompt: Vec<u32>) -> Msg {
    Msg::Route {
        request_id: id,
        req: Addr::new(HostId(0), 5000 + id),
        tokens,
        prompt_tokens,
        exclude,
        prompt,
        cache_salt: None,
        share: Default::default(),
    }
}

/// [`ask`] for a prompt of `tokens` tokens and no output, from a tenant's request.
fn ask_of(id: u64, tokens: usize, share: crate::msg::TenantShare) -> Msg {
    match ask(id, tokens, tokens, vec![], vec![]) {
        Msg::Route { request_id, req, tokens, prompt_tokens, exclude, prompt, cache_salt, .. } => {
            Msg::Route { request_id, req, tokens, prompt_tokens, exclude, prompt, cache_salt, share }
        }
        other => other,
    }
}

/// The requests routed since the last call.
fn routed(fx: &mut crate::test_fx::TestFx) -> Vec<u64> {
    fx.take_sent()
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Routed { request_id, .. } = m { Some(request_id) } else { None })
        .collect()
}

fn share(tenant: u32, weight: u32) -> crate::msg::TenantShare {
    crate::msg::TenantShare { tenant, weight, class: crate::msg::PriorityClass::Standard }
}

fn chip(host: u16, n: u64, state: ChipState, load: usize) -> (Addr, ChipView) {
    let addr = Addr::new(HostId(host), n);
    let report = ChipReport {
        state,
        kv_blocks_total: 8,
        ..ChipReport::starting(addr, format!("h{host}-{n}"), format!("h{host}"), Both)
    };
    (addr, ChipView { load_tokens: load, ..ChipView::new(report) })
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
    let (c0, c1) = (chip(0, 16, ChipState::Down, 0), chip(1, 16, ChipState::Down, 0));
    // At most two requests placed, and none may wait for more.
    let limits = Limits { max_waiting_requests: 0, ..Limits::new(2) };
    let mut router = Router::new(vec![c0.1.report.clone(), c1.1.report.clone()], 2).with_limits(limits);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    router.on_start(&mut fx);
    let req = |n: u64| Addr::new(HostId(0), 5000 + n);
    let route = |id: u64| ask(id, 100, 50, vec![], vec![]);

    router.handle(route(1), &mut fx);
    assert!(
        matches!(&fx.take_sent()[..], [(_, Msg::RouteFailed { error, .. })] if error.kind == ErrorKind::Unavailable)
    );

    let up = |(addr, view): &(Addr, ChipView)| ChipReport { chip: *addr, state: ChipState::Up, ..view.report.clone() };
    for (host, c) in [(0u16, &c0), (1, &c1)] {
        let beat = Heartbeat { host: HostId(host), host_name: format!("h{host}"), seq: 1, chips: vec![up(c)] };
        router.handle(Msg::Heartbeat { beat: std::sync::Arc::new(beat) }, &mut fx);
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
    assert!(matches!(&fx.take_sent()[..], [(_, Msg::RouteFailed { error, .. })]
        if error.kind == ErrorKind::Overloaded && error.retry_after_s == Some(5)));

    router.handle(Msg::HostDown { host: HostId(1), host_name: "h1".into() }, &mut fx);
    assert_eq!(fx.take_sent(), vec![(req(2), Msg::ChipLost { chip: c1.0 })]);
    router.handle(route(2), &mut fx);
    assert_eq!(fx.take_sent(), vec![(req(2), Msg::Routed { request_id: 2, chip: c0.0, prefill: None })]);
}

/// A request that finds every chip still starting waits for one, rather than failing.
#[test]
fn requests_wait_for_starting_chips() {
    use crate::msg::Heartbeat;
    use crate::test_fx::TestFx;
    let c0 = chip(0, 16, ChipState::Starting, 0);
    let mut router = Router::new(vec![c0.1.report.clone()], 8);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    router.handle(ask(1, 10, 5, vec![], vec![]), &mut fx);
    assert!(fx.take_sent().is_empty(), "it waits");
    let report = ChipReport { state: ChipState::Up, ..c0.1.report.clone() };
    router.handle(
        Msg::Heartbeat {
            beat: std::sync::Arc::new(Heartbeat {
                host: HostId(0),
                host_name: "h0".into(),
                seq: 1,
                chips: vec![report],
            }),
        },
        &mut fx,
    );
    let routed: Vec<Msg> =
        fx.take_sent().into_iter().map(|(_, m)| m).filter(|m| matches!(m, Msg::Routed { .. })).collect();
    assert_eq!(routed, vec![Msg::Routed { request_id: 1, chip: c0.0, prefill: None }]);
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
    let compat = |h| Some(std::sync::Arc::new(KvCompat { hash: h, fields: vec![] }));
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

/// The kv-aware cost in predicted seconds: a fast and a slow chip compared by what
/// each would take, caches, KV pressure, the hot-spot guard, and the decode leg.
#[test]
fn kv_aware_cost_compares_unlike_chips_in_seconds() {
    use ChipState::*;
    let a = |h| Addr::new(HostId(h), 16);
    let fast = Pace { prefill_s_per_token: 1e-4, decode_step_s: 0.01, decode_s_per_seq: 1e-3 };
    let slow = fast.scaled(4.0, 4.0);
    let prompt_work = |tokens| Work { prompt_tokens: tokens, seqs: 0 };
    let decoding = |seqs| Work { prompt_tokens: 0, seqs };
    // A chip: (host, role, pace, work ahead, KV blocks used of 1,000).
    let c = |h: u16, role: Role, pace: Pace, work: Work, used: usize| {
        let (addr, mut view) = role_chip(h, role, Up, 0);
        view.report.kv_blocks_used = used;
        view.report.kv_blocks_total = 1000;
        (addr, ChipView { pace, work, ..view })
    };
    let one = |h| Some(Placed { decode: a(h), prefill: None });
    // (chips, cached tokens per chip, prompt tokens, new tokens, want). Fast: a step of
    // 10 ms, 1 ms more a running sequence, 0.1 ms a prompt token; slow: four times that.
    type Case = (Vec<(Addr, ChipView)>, Vec<(u16, usize)>, usize, usize, Option<Placed>);
    let table: Vec<Case> = vec![
        // Idle: the fast chip computes the prompt (two chunks) in a quarter of the time
        // (0.13 s with the answer's step, against 0.52 s).
        (vec![c(0, Both, slow, Work::default(), 0), c(1, Both, fast, Work::default(), 0)], vec![], 1000, 1, one(1)),
        // The fast chip has 0.45 s of prompts ahead: 11 steps and 5,500 tokens (0.67 s);
        // the slow one takes 0.52 s.
        (vec![c(0, Both, fast, prompt_work(4500), 0), c(1, Both, slow, Work::default(), 0)], vec![], 1000, 1, one(1)),
        // With 0.25 s ahead the fast chip still finishes first: 0.43 s against 0.52 s.
        (vec![c(0, Both, fast, prompt_work(2500), 0), c(1, Both, slow, Work::default(), 0)], vec![], 1000, 1, one(0)),
        // The slow chip holds 960 of the 1,000 tokens: a step and 40 tokens at its pace
        // (0.096 s) beat two chunks of 1,000 tokens at the fast one's (0.13 s) ...
        (
            vec![c(0, Both, fast, Work::default(), 0), c(1, Both, slow, Work::default(), 0)],
            vec![(1, 960)],
            1000,
            1,
            one(1),
        ),
        // ... but 800 do not (0.16 s): a step's fixed part is paid whatever the cache saves.
        (
            vec![c(0, Both, fast, Work::default(), 0), c(1, Both, slow, Work::default(), 0)],
            vec![(1, 800)],
            1000,
            1,
            one(0),
        ),
        // The same, but the slow chip is a hot spot (4 s ahead, mean 1.33 s): its cache counts for nothing.
        (
            vec![
                c(0, Both, fast, Work::default(), 0),
                c(1, Both, slow, prompt_work(10_000), 0),
                c(2, Both, fast, Work::default(), 0),
            ],
            vec![(1, 960)],
            1000,
            1,
            one(0),
        ),
        // KV pressure: the fast chip's pool is 95% held; the empty slow one wins a short prompt.
        (vec![c(0, Both, fast, Work::default(), 950), c(1, Both, slow, Work::default(), 0)], vec![], 100, 1, one(1)),
        // At 10% held the fast one wins it back.
        (vec![c(0, Both, fast, Work::default(), 100), c(1, Both, slow, Work::default(), 0)], vec![], 100, 1, one(0)),
        // A prefix holder running 4 sequences keeps a one-token answer (0.036 s against
        // an idle equal chip's 0.13 s) ...
        (vec![c(0, Both, fast, decoding(4), 0), c(1, Both, fast, Work::default(), 0)], vec![(0, 960)], 1000, 1, one(0)),
        // ... but not 100 tokens of one: at a batch of 5, each step of it costs it 14 ms
        // and the 4 others 1 ms each (1.82 s in all, against 1.13 s on the idle chip).
        (
            vec![c(0, Both, fast, decoding(4), 0), c(1, Both, fast, Work::default(), 0)],
            vec![(0, 960)],
            1000,
            100,
            one(1),
        ),
        // The decode leg: 100 new tokens. A fast decode chip running 8 sequences decodes
        // them in 1.8 s and slows the 8 by 0.8 s, an idle slow one takes 4 s ...
        (
            vec![
                c(0, Prefill, fast, Work::default(), 0),
                c(1, Decode, fast, decoding(8), 0),
                c(2, Decode, slow, Work::default(), 0),
            ],
            vec![],
            1000,
            100,
            Some(Placed { decode: a(1), prefill: Some(a(0)) }),
        ),
        // ... but running 20, 3 s and 2 s: the slow one gets it.
        (
            vec![
                c(0, Prefill, fast, Work::default(), 0),
                c(1, Decode, fast, decoding(20), 0),
                c(2, Decode, slow, Work::default(), 0),
            ],
            vec![],
            1000,
            100,
            Some(Placed { decode: a(2), prefill: Some(a(0)) }),
        ),
        // A chip decoding does not make a prompt wait for its end: 30 running sequences
        // add 30 ms to each of the prompt's two steps on the fast chip (0.25 s in all,
        // with the answer's step), still ahead of the idle slow one (0.52 s).
        (vec![c(0, Both, fast, decoding(30), 0), c(1, Both, slow, Work::default(), 0)], vec![], 1000, 1, one(0)),
    ];
    for (i, (chips, held, prompt, new_tokens, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let held: BTreeMap<Addr, usize> = held.into_iter().map(|(h, tokens)| (a(h), tokens)).collect();
        let mean = chips.values().map(ChipView::work_s).sum::<f64>() / chips.len() as f64;
        let cached = cache_credit(&chips, &held, prompt, mean);
        let ask = Ask { prompt_tokens: prompt, total_tokens: prompt + new_tokens, block_size: 16 };
        let score = kv_aware(&cached, ask, &|_| 16);
        assert_eq!(place(&chips, &BTreeSet::new(), &[], prompt, 32, &score), want, "case {i}");
    }
}

/// A chip's pace is its modelled pace times what it was seen to do; a chip not seen yet
/// follows the geometric mean of the others' corrections.
#[test]
fn observed_step_times_correct_the_model() {
    use crate::msg::{Heartbeat, StepSpeed};
    use crate::test_fx::TestFx;
    let model = Pace { prefill_s_per_token: 1e-3, decode_step_s: 0.02, decode_s_per_seq: 1e-3 };
    let reports: Vec<ChipReport> = (0..3).map(|h| chip(h, 16, ChipState::Up, 0).1.report).collect();
    let paces = reports.iter().map(|r| (r.chip, model)).collect();
    let mut router = Router::new(reports.clone(), 64).with_paces(paces);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    // Chip 0 prefills as modelled (a step of 100 prompt tokens: 0.02 + 100 x 0.001 s),
    // chip 1 four times slower; chip 1 decodes 9 sequences in 0.1 s.
    let seen = [(0, 1.0, 0.0, 0.0), (1, 4.0, 0.1, 9.0)];
    for (h, slowdown, decode, batch) in seen {
        let speed = StepSpeed {
            prefill_step_s: 0.12 * slowdown,
            prefill_step_tokens: 100.0,
            decode_step_s: decode,
            decode_batch: batch,
        };
        let report = ChipReport { speed: Some(speed), ..reports[h].clone() };
        let beat = Heartbeat { host: HostId(h as u16), host_name: format!("h{h}"), seq: 1, chips: vec![report] };
        router.handle(Msg::Heartbeat { beat: std::sync::Arc::new(beat) }, &mut fx);
    }
    let pace = |h: u16| router.chips[&Addr::new(HostId(h), 16)].pace;
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    assert!(close(pace(0).prefill_s_per_token, 1e-3));
    assert!(close(pace(1).prefill_s_per_token, 4e-3));
    assert!(close(pace(2).prefill_s_per_token, 2e-3), "the mean of 1x and 4x: {:?}", pace(2));
    // Modelled: 0.02 + 8 x 0.001 = 0.028 s for 9 sequences; seen 0.1 s.
    assert!(close(pace(1).decode_s(9.0), 0.1));
    assert!(close(pace(0).decode_step_s, 0.02 * 0.1 / 0.028), "chip 0 follows chip 1's decode factor");
    // Idle and equal: the chip seen fastest gets the prompt.
    router.handle(ask(1, 120, 100, vec![], vec![]), &mut fx);
    let routed: Vec<Addr> = fx
        .take_sent()
        .into_iter()
        .filter_map(|(_, m)| if let Msg::Routed { chip, .. } = m { Some(chip) } else { None })
        .collect();
    assert_eq!(routed, vec![Addr::new(HostId(0), 16)]);
}

/// One stalled step cannot shut a chip out: its correction stays within
/// `MAX_DEVIATION` of the mean, so a chip seen 100 times slower than modelled (the others
/// as modelled) is paced at most 3 times the mean correction.
#[test]
fn a_chips_correction_stays_near_the_others() {
    use crate::msg::{Heartbeat, StepSpeed};
    use crate::test_fx::TestFx;
    let model = Pace { prefill_s_per_token: 1e-3, decode_step_s: 0.02, decode_s_per_seq: 1e-3 };
    let reports: Vec<ChipReport> = (0..3).map(|h| chip(h, 16, ChipState::Up, 0).1.report).collect();
    let mut router = Router::new(reports.clone(), 64).with_paces(reports.iter().map(|r| (r.chip, model)).collect());
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    for (h, slowdown) in [(0usize, 1.0), (1, 1.0), (2, 100.0)] {
        let speed = StepSpeed { prefill_step_s: 0.12 * slowdown, prefill_step_tokens: 100.0, ..StepSpeed::default() };
        let report = ChipReport { speed: Some(speed), ..reports[h].clone() };
        let beat = Heartbeat { host: HostId(h as u16), host_name: format!("h{h}"), seq: 1, chips: vec![report] };
        router.handle(Msg::Heartbeat { beat: std::sync::Arc::new(beat) }, &mut fx);
    }
    let mean = 100f64.powf(1.0 / 3.0);
    let factor = |h: u16| router.chips[&Addr::new(HostId(h), 16)].pace.prefill_s_per_token / 1e-3;
    let close = |a: f64, b: f64| (a / b - 1.0).abs() < 1e-9;
    assert!(close(factor(2), mean * cost::MAX_DEVIATION), "{}", factor(2));
    assert!(close(factor(0), mean / cost::MAX_DEVIATION), "{}", factor(0));
}

/// Breakers through the router: a chip whose requests keep leaving it opens and takes
/// nothing for the cooldown, then one probe; a full pool takes nothing until it drains;
/// when no chip can take a request it waits, and is refused with `Retry-After` only at
/// its deadline.
#[test]
fn breakers_and_the_waiting_queue() {
    use crate::msg::{ErrorKind, Heartbeat};
    use crate::test_fx::TestFx;
    let reports: Vec<ChipReport> = (0..2).map(|h| chip(h, 16, ChipState::Up, 0).1.report).collect();
    let mut router = Router::new(reports.clone(), 64);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    let (c0, c1) = (Addr::new(HostId(0), 16), Addr::new(HostId(1), 16));
    let route = |id: u64, exclude: Vec<Addr>| ask(id, 20, 10, exclude, vec![]);
    let routed = |fx: &mut TestFx| -> Vec<(u64, Addr)> {
        fx.take_sent()
            .into_iter()
            .filter_map(
                |(_, m)| if let Msg::Routed { request_id, chip, .. } = m { Some((request_id, chip)) } else { None },
            )
            .collect()
    };
    // Three requests fail on chip 0 (each re-routes away from it): its breaker opens.
    for id in 1..=3 {
        router.handle(Msg::Release { request_id: 100, chip: c0 }, &mut fx); // nothing: not placed
        router.handle(route(id, vec![]), &mut fx);
        assert_eq!(routed(&mut fx), vec![(id, c0)], "chip 0 is first by address");
        router.handle(route(id, vec![c0]), &mut fx);
        assert_eq!(routed(&mut fx), vec![(id, c1)]);
        router.handle(Msg::Release { request_id: id, chip: c1 }, &mut fx);
    }
    assert!(!router.chips[&c0].errors.admits());
    router.handle(route(4, vec![]), &mut fx);
    assert_eq!(routed(&mut fx), vec![(4, c1)], "open: chip 0 takes nothing");
    router.handle(Msg::Release { request_id: 4, chip: c1 }, &mut fx);
    // After the cooldown, one probe goes to chip 0; until it ends, nothing else.
    fx.now = fx.now.after(ErrorBreaker::COOLDOWN);
    router.handle(route(5, vec![]), &mut fx);
    router.handle(route(6, vec![]), &mut fx);
    assert_eq!(routed(&mut fx), vec![(5, c0), (6, c1)]);
    router.handle(Msg::Release { request_id: 5, chip: c0 }, &mut fx);
    assert_eq!(router.chips[&c0].errors.state(), breaker::BreakerState::Closed, "the probe succeeded");
    router.handle(Msg::Release { request_id: 6, chip: c1 }, &mut fx);

    // Both pools 90% held: requests wait (no reply yet) ...
    let beat = |h: usize, used: usize| {
        let report = ChipReport { kv_blocks_used: used, kv_blocks_total: 100, ..reports[h].clone() };
        Msg::Heartbeat {
            beat: std::sync::Arc::new(Heartbeat {
                host: HostId(h as u16),
                host_name: format!("h{h}"),
                seq: 2,
                chips: vec![report],
            }),
        }
    };
    router.handle(beat(0, 90), &mut fx);
    router.handle(beat(1, 95), &mut fx);
    router.handle(route(7, vec![]), &mut fx);
    router.handle(route(8, vec![]), &mut fx);
    let answered = fx.take_sent().into_iter().any(|(_, m)| matches!(m, Msg::Routed { .. } | Msg::RouteFailed { .. }));
    assert!(!answered, "waiting, not refused");
    // ... chip 1 drains below the threshold: both go there, in arrival order.
    router.handle(beat(1, 50), &mut fx);
    assert_eq!(routed(&mut fx), vec![(7, c1), (8, c1)]);
    // Full again: a request waits out its deadline and gets a 429 with Retry-After.
    router.handle(beat(1, 99), &mut fx);
    router.handle(route(9, vec![]), &mut fx);
    fx.now = fx.now.after(Limits::new(64).queue_timeout);
    router.handle(Msg::Tick, &mut fx);
    let refused: Vec<(ErrorKind, Option<u32>)> =
        fx.take_sent()
            .into_iter()
            .filter_map(|(_, m)| {
                if let Msg::RouteFailed { error, .. } = m { Some((error.kind, error.retry_after_s)) } else { None }
            })
            .collect();
    assert_eq!(refused, vec![(ErrorKind::Overloaded, Some(5))]);
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
            beat: std::sync::Arc::new(Heartbeat {
                host: HostId(host),
                host_name: format!("h{host}"),
                seq: 1,
                chips: vec![report],
            }),
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
    let with_prompt = |id: u64, prompt: Vec<u32>| ask(id, prompt.len() + 8, prompt.len(), vec![], prompt);
    let routed = |fx: &mut TestFx| -> Vec<Addr> {
        fx.take_sent()
            .into_iter()
            .filter_map(|(_, m)| if let Msg::Routed { chip, .. } = m { Some(chip) } else { None })
            .collect()
    };
    // A prompt after the system prompt goes to chip 1 (lowest address would be chip 0).
    router.handle(with_prompt(1, system.iter().copied().chain([50, 51]).collect()), &mut fx);
    assert_eq!(routed(&mut fx), vec![c1.0]);
    // Another prompt entirely goes by load: chip 0.
    router.handle(with_prompt(2, vec![90, 91, 92, 93, 94]), &mut fx);
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

/// A chip whose KV blocks hold another number of tokens than the cluster's is found by
/// the prompts it holds: each chip is looked up with the prompt hashed at its own size
/// (a 32-token chip beside 16-token ones, as the default topology has).
#[test]
fn a_chip_of_another_block_size_is_found_by_its_prefix() {
    use crate::kv::{KvEvent, prefix_hashes};
    use crate::test_fx::TestFx;
    let (c0, c1) = (chip(0, 16, ChipState::Up, 0), chip(1, 16, ChipState::Up, 0));
    for policy in [RouterPolicy::KvAware, RouterPolicy::Dynamo] {
        let mut router = Router::new(vec![c0.1.report.clone(), c1.1.report.clone()], 8)
            .with_block_size(4)
            .with_block_sizes(BTreeMap::from([(c0.0, 4), (c1.0, 8)]))
            .with_policy(policy);
        let mut fx = TestFx::new(Addr::new(HostId(0), 2));
        for c in [&c0, &c1] {
            router.index_mut().resync(c.0, 1, 0, &[]);
        }
        // Chip 1 holds 24 tokens of a system prompt in three blocks of 8.
        let system: Vec<u32> = (1..=24).collect();
        let events: Vec<KvEvent> = prefix_hashes(&system, 8)
            .into_iter()
            .enumerate()
            .map(|(i, hash)| KvEvent::Stored { seq: i as u64 + 1, hash })
            .collect();
        router.handle(Msg::KvEvents { chip: c1.0, incarnation: 1, events }, &mut fx);
        let prompt: Vec<u32> = system.iter().copied().chain([50, 51, 52]).collect();
        let decision = router.decide(1, &prompt, None, prompt.len(), prompt.len() + 1, &[], 0, None);
        assert_eq!(decision.placed.map(|p| p.decode), Some(c1.0), "{policy:?}");
        if policy == RouterPolicy::KvAware {
            assert_eq!(decision.cached_tokens, 24);
        }
        // Hashed at the cluster's 4 tokens, the prompt finds nothing there.
        assert!(router.index.prefix_blocks(&prefix_hashes(&prompt, 4)).is_empty());
    }
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
    let route = |id: u64, prompt: Vec<u32>| ask(id, prompt.len() + 4, prompt.len(), vec![], prompt);
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
        /// Prefill seconds per token in tenths of a millisecond; KV blocks used of 100.
        pace: u8,
        used: usize,
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            (0..3u8, prop::bool::weighted(0.85), 0..50usize, prop::option::of(0..2u8)),
            prop_oneof![3 => Just(0usize), 1 => 1..40usize],
            1..5u8,
            0..95usize,
        )
            .prop_map(|((role, state_up, load, compat), cached, pace, used)| Spec {
                role,
                state_up,
                load: load * 10,
                compat,
                cached,
                pace,
                used,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The router's shortcut (holders plus the chips each leg's bound keeps) picks
        /// exactly what scoring every chip picks, over unlike paces, loads and pools.
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
                    compat: s.compat.map(|c| std::sync::Arc::new(KvCompat { hash: c as u64, fields: vec![] })),
                    ..ChipReport::starting(addr, format!("c{i}"), format!("h{i}"), [Prefill, Decode, Both][s.role as usize])
                }
            }).collect();
            let paces = specs.iter().enumerate().map(|(i, s)| {
                let p = f64::from(s.pace) * 1e-4;
                (Addr::new(HostId(i as u16), 16), Pace { prefill_s_per_token: p, decode_step_s: 100.0 * p, decode_s_per_seq: p })
            }).collect();
            let mut router = Router::new(reports, 64).with_paces(paces);
            for (i, s) in specs.iter().enumerate() {
                let a = Addr::new(HostId(i as u16), 16);
                if let Some(v) = router.chips.get_mut(&a) {
                    v.report.kv_blocks_used = s.used;
                    v.report.kv_blocks_total = 100;
                }
                // Half of the load as prompt, the rest as decoding in load/100 sequences.
                let work = Work { prompt_tokens: s.load / 2, seqs: s.load / 100 };
                router.charge(a, s.load, work, true);
            }
            router.down_hosts = down.into_iter().map(HostId).collect();
            let exclude: Vec<Addr> = exclude.into_iter().map(|i| Addr::new(HostId(i as u16), 16)).collect();
            let held: BTreeMap<Addr, usize> = specs.iter().enumerate()
                .filter(|(_, s)| s.cached > 0)
                .map(|(i, s)| (Addr::new(HostId(i as u16), 16), s.cached * 16))
                .collect();
            let mean = router.total_work_s / router.chips.len() as f64;
            let cached = cache_credit(&router.chips, &held, prompt, mean);
            let ask = Ask { prompt_tokens: prompt, total_tokens: prompt + 50, block_size: 16 };
            let score = kv_aware(&cached, ask, &|_| 16);
            let want = place(&router.chips, &router.down_hosts, &exclude, prompt, 64, &score);
            let few = router.candidates(&held, &ask, &exclude, &score);
            let got = place_among(&few, &router.down_hosts, &exclude, prompt, 64, &score, true);
            prop_assert_eq!(got, want);
        }
    }
}

/// One chip that takes new requests while its queued prompts would take it under 10 ms,
/// its router, and the router's effects.
fn one_chip_bounded_at_10_ms() -> (Addr, Router, crate::test_fx::TestFx) {
    let (c0, view) = chip(0, 16, ChipState::Up, 0);
    let limits = Limits { max_queued_prompt: Duration::from_millis(10), ..Limits::new(64) };
    let router = Router::new(vec![view.report], 64).with_limits(limits);
    (c0, router, crate::test_fx::TestFx::new(Addr::new(HostId(0), 2)))
}

/// A chip takes new requests only while the prompts queued there are short (here 10 ms
/// at 0.1 ms a token: two prompts of 60 tokens); the backlog waits in the router's
/// queue, and each prompt computed lets more go — by weighted fair order, so two
/// backlogged tenants weighted 2:1 are placed 2:1. The least-served tenant may place
/// one request past the bound, so the queue never holds more than the bound's two
/// prompts and one per tenant.
#[test]
fn a_chips_prompt_queue_is_bounded_and_the_backlog_leaves_in_weighted_fair_order() {
    let (c0, mut router, mut fx) = one_chip_bounded_at_10_ms();
    let (gold, silver) = (share(0, 2), share(1, 1));
    let route = |id: u64, share| ask_of(id, 60, share);
    router.handle(route(1, gold), &mut fx);
    router.handle(route(2, gold), &mut fx);
    assert_eq!(routed(&mut fx), vec![1, 2]);
    assert!(router.chips[&c0].load_full, "120 prompt tokens queued: 12 ms");
    for id in 3..=8 {
        router.handle(route(id, gold), &mut fx);
    }
    assert_eq!(routed(&mut fx), Vec::<u64>::new(), "alone, the backlog waits in the router");
    for id in 9..=14 {
        router.handle(route(id, silver), &mut fx);
    }
    assert_eq!(routed(&mut fx), vec![9], "silver, least served on arrival, passes the bound once");
    let mut placed = Vec::new();
    let mut computing = std::collections::VecDeque::from([1, 2, 9]);
    while placed.len() < 9 {
        let done = computing.pop_front().expect("a request on the chip");
        router.handle(Msg::Prefilled { request_id: done, chip: c0 }, &mut fx);
        let next = routed(&mut fx);
        computing.extend(&next);
        placed.extend(next);
        let queued = router.chips[&c0].work.prompt_tokens;
        assert!(queued <= 4 * 60, "{queued} prompt tokens queued: more than the bound and one per tenant");
    }
    let golds = placed.iter().filter(|&&id| id <= 8).count();
    assert_eq!((golds, placed.len() - golds), (6, 3), "placed 2:1 by weight: {placed:?}");
}

/// A light tenant arriving beside a backlogged flood places its request at once, past
/// the prompt bound the flood waits behind; its next waits in fair order while the
/// first still holds a prompt. Alone, a tenant never passes the bound.
#[test]
fn the_least_served_tenant_passes_the_prompt_bound_one_request_at_a_time() {
    let (c0, mut router, mut fx) = one_chip_bounded_at_10_ms();
    let (flood, light) = (share(0, 1), share(1, 1));
    for id in 1..=6 {
        router.handle(ask_of(id, 60, flood), &mut fx);
    }
    assert_eq!(routed(&mut fx), vec![1, 2], "alone, the flood waits behind the bound");
    router.handle(ask_of(10, 60, light), &mut fx);
    router.handle(ask_of(11, 60, light), &mut fx);
    assert_eq!(routed(&mut fx), vec![10], "the light tenant's first passes the bound; its second waits");
    assert_eq!(router.chips[&c0].work.prompt_tokens, 180);
    // Its prompt computed, the light tenant has been served more than the flood: the
    // flood's next is the one to place, and it may pass the bound in turn, once.
    router.handle(Msg::Prefilled { request_id: 10, chip: c0 }, &mut fx);
    assert_eq!(routed(&mut fx), vec![3]);
    router.handle(Msg::Prefilled { request_id: 1, chip: c0 }, &mut fx);
    // The flood's next is first in fair order (a tie goes to the earliest), and the flood
    // holds a prompt past the bound already: nothing goes.
    assert_eq!(routed(&mut fx), Vec::<u64>::new(), "the bound holds");
}

/// A light tenant's request past the bound lets its next one pass once the prefill chip
/// sampled the first token (`PromptComputed`), not only when the decode chip has the KV.
#[test]
fn a_prompt_computed_lets_the_tenants_next_request_pass_the_bound() {
    let (c0, mut router, mut fx) = one_chip_bounded_at_10_ms();
    // Weighted 10: one request leaves the light tenant still the least served.
    let (flood, light) = (share(0, 1), share(1, 10));
    for id in 1..=4 {
        router.handle(ask_of(id, 60, flood), &mut fx);
    }
    assert_eq!(routed(&mut fx), vec![1, 2]);
    router.handle(ask_of(10, 60, light), &mut fx);
    router.handle(ask_of(11, 60, light), &mut fx);
    assert_eq!(routed(&mut fx), vec![10], "its second waits while the first's prompt is computed");
    router.handle(Msg::PromptComputed { request_id: 10 }, &mut fx);
    // The queue moves: the flood's next, least served once the light's first was
    // charged, passes the bound once; then the light's second, its first prompt computed.
    assert_eq!(routed(&mut fx), vec![3, 11]);
    assert_eq!(router.chips[&c0].work.prompt_tokens, 300, "the first still counts until the decode chip has it");
}

/// A request past the prompt bound (the least served tenant's) goes before the other
/// tenants' prompts in every chip's fair order, so it counts only its own tenant's
/// prompts queued there: a fast chip with a flood queued computes it sooner than a
/// slower idle one.
#[test]
fn past_the_bound_a_request_counts_only_its_own_tenants_queued_prompts() {
    let (c0, v0) = chip(0, 16, ChipState::Up, 0);
    let (c1, v1) = chip(1, 16, ChipState::Up, 0);
    let pace = |prefill_s_per_token| Pace { prefill_s_per_token, decode_step_s: 1e-3, decode_s_per_seq: 0.0 };
    let paces = BTreeMap::from([(c0, pace(1e-4)), (c1, pace(2e-4))]);
    let mut router = Router::new(vec![v0.report, v1.report], 64).with_paces(paces);
    // The flood's prompts queued on the fast chip: 120 tokens, 12 ms there.
    router.chips.get_mut(&c0).expect("c0").work.prompt_tokens = 120;
    let decide = |past| router.decide(1, &[], None, 60, 61, &[], 0, past).placed.map(|p| p.decode);
    assert_eq!(decide(None), Some(c1), "behind the flood (18 ms) the slower idle chip (12 ms) is first");
    assert_eq!(decide(Some(1)), Some(c0), "before the flood: the fast chip (6 ms)");
}

/// VTC's lift at the router: a tenant whose request arrives while none of its requests
/// waits or runs rises to the counters of those present (with nobody present, to the
/// greatest) — also when its request is placed at once. Otherwise a tenant that ran
/// alone before would lose every tie to the newcomer until the newcomer's service
/// caught up with all it got alone.
#[test]
fn a_tenant_arriving_is_lifted_even_when_its_request_is_placed_at_once() {
    use crate::test_fx::TestFx;
    let (c0, view) = chip(0, 16, ChipState::Up, 0);
    let mut router = Router::new(vec![view.report], 64);
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    let (flood, light) = (share(0, 1), share(1, 1));
    for id in 1..=3 {
        router.handle(ask_of(id, 60, light), &mut fx);
        router.handle(Msg::Release { request_id: id, chip: c0 }, &mut fx);
    }
    let alone = router.fair.counter(1);
    assert!(alone > 0.0);
    router.handle(ask_of(10, 60, flood), &mut fx);
    let placed = fx.take_sent().iter().any(|(_, m)| matches!(m, Msg::Routed { request_id: 10, .. }));
    assert!(placed, "placed at once, never waiting");
    assert!(router.fair.counter(0) >= alone, "lifted to {alone}: {}", router.fair.counter(0));
    // A light request now arriving beside the flood's is lifted to the flood's counter.
    router.handle(ask_of(11, 60, light), &mut fx);
    assert!(router.fair.counter(1) >= router.fair.counter(0) - 1e-12);
}

/// Whether a prefill chip may run a request whole: under `prefill-chips` always; under
/// `wait` only while no decoding chip is up, its host alive and not excluded, however
/// full the decoding chips are.
#[test]
fn prefill_chips_decode_only_as_the_overflow_setting_says() {
    use ChipState::*;
    use DecodeOverflow::{PrefillChips, Wait};
    let a = |h| Addr::new(HostId(h), 16);
    let full = |h, role| {
        let (addr, mut view) = role_chip(h, role, Up, 0);
        view.kv_full = true;
        (addr, view)
    };
    // (setting, chips, hosts down, excluded hosts, may a prefill chip run a request whole)
    type Case = (DecodeOverflow, Vec<(Addr, ChipView)>, Vec<u16>, Vec<u16>, bool);
    let table: Vec<Case> = vec![
        (PrefillChips, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], vec![], vec![], true),
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], vec![], vec![], false),
        (Wait, vec![role_chip(0, Prefill, Up, 0), full(1, Decode)], vec![], vec![], false), // full: wait
        (Wait, vec![role_chip(0, Prefill, Up, 0), full(1, Both)], vec![], vec![], false),
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Down, 0)], vec![], vec![], true),
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Starting, 0)], vec![], vec![], true),
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], vec![1], vec![], true), // host down
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Decode, Up, 0)], vec![], vec![1], true), // declined
        (Wait, vec![role_chip(0, Prefill, Up, 0), role_chip(1, Prefill, Up, 0)], vec![], vec![], true), // none decodes
    ];
    for (i, (overflow, chips, down, exclude, want)) in table.into_iter().enumerate() {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().collect();
        let down: BTreeSet<HostId> = down.into_iter().map(HostId).collect();
        let exclude: Vec<Addr> = exclude.into_iter().map(a).collect();
        assert_eq!(prefill_may_decode(overflow, &chips, &down, &exclude), want, "case {i}");
    }
}

/// A prefill chip and a decode chip whose pool is past the KV breaker (92 of 100
/// blocks of 16 tokens held): under `prefill-chips` a request runs whole on the prefill
/// chip; under `wait` it waits until the decode chip has room, and then is
/// disaggregated — except a least-served tenant's one request, which passes the KV
/// breaker at once if the 8 free blocks hold it.
#[test]
fn with_decode_overflow_wait_a_request_waits_for_a_full_decode_chip() {
    use crate::msg::Heartbeat;
    use crate::test_fx::TestFx;
    let (p, pv) = role_chip(0, Prefill, ChipState::Up, 0);
    let (d, dv) = role_chip(1, Decode, ChipState::Up, 0);
    let beat = |report: &ChipReport, used: usize| Msg::Heartbeat {
        beat: std::sync::Arc::new(Heartbeat {
            host: report.chip.host,
            host_name: report.host_name.to_string(),
            seq: 2,
            chips: vec![ChipReport { kv_blocks_used: used, kv_blocks_total: 100, ..report.clone() }],
        }),
    };
    let placed = |fx: &mut TestFx| -> Vec<(u64, Addr, Option<Addr>)> {
        fx.take_sent()
            .into_iter()
            .filter_map(|(_, m)| match m {
                Msg::Routed { request_id, chip, prefill } => Some((request_id, chip, prefill)),
                _ => None,
            })
            .collect()
    };
    for overflow in [DecodeOverflow::PrefillChips, DecodeOverflow::Wait] {
        let limits = Limits { decode_overflow: overflow, ..Limits::new(64) };
        let mut router =
            Router::new(vec![pv.report.clone(), dv.report.clone()], 64).with_disaggregation(32).with_limits(limits);
        let mut fx = TestFx::new(Addr::new(HostId(0), 2));
        router.handle(beat(&pv.report, 0), &mut fx);
        router.handle(beat(&dv.report, 92), &mut fx);
        router.handle(ask_of(1, 100, share(0, 1)), &mut fx);
        match overflow {
            DecodeOverflow::PrefillChips => {
                assert_eq!(placed(&mut fx), vec![(1, p, None)], "whole on the prefill chip")
            }
            DecodeOverflow::Wait => {
                assert_eq!(placed(&mut fx), vec![], "waits for the decode chip");
                // Another tenant, least served, passes the KV breaker with one request.
                router.handle(ask_of(2, 100, share(1, 1)), &mut fx);
                router.handle(ask_of(3, 100, share(1, 1)), &mut fx);
                assert_eq!(placed(&mut fx), vec![(2, d, Some(p))]);
                router.handle(ask_of(4, 200, share(2, 1)), &mut fx);
                assert_eq!(placed(&mut fx), vec![], "13 blocks do not fit in the 8 free");
                router.handle(beat(&dv.report, 50), &mut fx);
                let got = placed(&mut fx);
                assert!(got.iter().all(|&(_, chip, prefill)| (chip, prefill) == (d, Some(p))), "{got:?}");
                let mut ids: Vec<u64> = got.iter().map(|(id, ..)| *id).collect();
                ids.sort();
                assert_eq!(ids, vec![1, 3, 4], "room again: the waiting go, disaggregated");
            }
        }
    }
}
