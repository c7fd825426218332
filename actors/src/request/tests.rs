use super::*;
use crate::msg::{Delivery, SamplingSpec, TokenLogprob};
use crate::test_fx::TestFx;
use tessera_actor_core::HostId;

fn a(host: u16, n: u64) -> Addr {
    Addr::new(HostId(host), n)
}

const ME: Addr = Addr { host: HostId(0), actor: 5000 };
const CLIENT: Addr = Addr { host: HostId(0), actor: 4000 };
const ROUTER: Addr = Addr { host: HostId(0), actor: 2 };

fn request(max_tokens: usize) -> Request {
    let spec = RequestSpec {
        request_id: 9,
        prompt: vec![1, 2, 3],
        max_tokens,
        sampling: SamplingSpec::greedy(),
        delivery: Delivery::Stream,
        forks: Vec::new(),
        cache_salt: None,
        share: Default::default(),
    };
    Request::new(spec, CLIENT, ROUTER, RetryPolicy::default())
}

/// A request of `max_tokens` already placed on `chip`, with the sends so far cleared.
fn routed_to(chip: Addr, max_tokens: usize) -> (TestFx, Request) {
    routed_split(chip, None, max_tokens)
}

/// A request of `max_tokens` already placed on `chip`, prefilled by `prefill` when
/// given, with the sends so far cleared.
fn routed_split(chip: Addr, prefill: Option<Addr>, max_tokens: usize) -> (TestFx, Request) {
    let mut fx = TestFx::new(ME);
    let mut r = request(max_tokens);
    r.on_start(&mut fx);
    r.handle(Msg::Routed { request_id: 9, chip, prefill }, &mut fx);
    fx.take_sent();
    (fx, r)
}

fn generated(chip: Addr, tokens: Vec<u32>, finish: Option<Finish>) -> Msg {
    Msg::Generated { request_id: 9, chip, tokens, finish, logprobs: vec![] }
}

#[test]
fn a_lost_chip_is_replaced_and_the_stream_continues_without_gaps_or_duplicates() {
    let (p, q) = (a(1, 16), a(0, 16));
    let mut fx = TestFx::new(ME);
    let mut r = request(5);
    r.on_start(&mut fx);
    assert!(matches!(&fx.take_sent()[..], [(ROUTER, Msg::Route { exclude, .. })] if exclude.is_empty()));

    r.handle(Msg::Routed { request_id: 9, chip: p, prefill: None }, &mut fx);
    r.handle(generated(p, vec![10], None), &mut fx);
    r.handle(generated(p, vec![11], None), &mut fx);
    fx.take_sent();

    // The router says p is gone: release it, route again avoiding it.
    r.handle(Msg::ChipLost { chip: p }, &mut fx);
    let sent = fx.take_sent();
    assert!(matches!(&sent[0], (ROUTER, Msg::Release { chip, .. }) if *chip == p));
    assert!(matches!(&sent[1], (ROUTER, Msg::Route { exclude, .. }) if exclude == &vec![p]));

    // The new chip gets prompt + the two streamed tokens and only what is left to do.
    r.handle(Msg::Routed { request_id: 9, chip: q, prefill: None }, &mut fx);
    match &fx.take_sent()[..] {
        [(to, Msg::Enqueue { seq })] => {
            assert_eq!(*to, q);
            assert_eq!(seq.tokens, vec![1, 2, 3, 10, 11]);
            assert_eq!((seq.generated, seq.max_new_tokens), (2, 3));
        }
        other => panic!("expected one Enqueue, got {other:?}"),
    }
    // A late token from the old chip is not forwarded.
    r.handle(generated(p, vec![99], None), &mut fx);
    assert!(fx.take_sent().is_empty());

    r.handle(generated(q, vec![12], None), &mut fx);
    r.handle(generated(q, vec![13], None), &mut fx);
    r.handle(generated(q, vec![14], Some(Finish::Length)), &mut fx);
    let to_client: Vec<ClientEvent> = fx
        .take_sent()
        .into_iter()
        .filter_map(|(to, m)| match m {
            Msg::Client { event } if to == CLIENT => Some(event),
            _ => None,
        })
        .collect();
    assert_eq!(
        to_client,
        vec![
            ClientEvent::Tokens { tokens: vec![12], logprobs: vec![] },
            ClientEvent::Tokens { tokens: vec![13], logprobs: vec![] },
            ClientEvent::Tokens { tokens: vec![14], logprobs: vec![] },
            ClientEvent::Finished { finish: Finish::Length, prompt_tokens: 3, completion_tokens: 5 },
        ]
    );
    assert!(fx.stopped);
}

#[test]
fn refusals_retry_or_fail_and_a_gone_client_cancels() {
    let p = a(1, 16);
    // Not retryable: the client gets the error, the chip is released.
    let (mut fx, mut r) = routed_to(p, 4);
    let error = ServeError::new(ErrorKind::PromptTooLong, "too long");
    r.handle(Msg::Refused { request_id: 9, chip: p, error: error.clone(), retry: Retry::No }, &mut fx);
    let sent = fx.take_sent();
    assert!(sent.iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Release { .. })));
    assert!(
        sent.iter()
            .any(|(to, m)| *to == CLIENT && *m == Msg::Client { event: ClientEvent::Failed { error: error.clone() } })
    );
    assert!(fx.stopped);

    // The client's mailbox is gone: the chip is told to abort.
    let (mut fx, mut r) = routed_to(p, 4);
    fx.unreachable.push(CLIENT);
    r.handle(generated(p, vec![10], None), &mut fx);
    assert!(fx.take_sent().iter().any(|(to, m)| *to == p && matches!(m, Msg::Abort { request_id: 9 })));
    assert!(fx.stopped);
}

#[test]
fn a_request_gives_up_after_max_attempts() {
    let p = a(1, 16);
    let mut fx = TestFx::new(ME);
    let mut r = request(4);
    r.on_start(&mut fx);
    for _ in 0..RetryPolicy::default().max_attempts {
        r.handle(Msg::Routed { request_id: 9, chip: p, prefill: None }, &mut fx);
        let error = ServeError::new(ErrorKind::Unavailable, "chip down");
        r.handle(Msg::Refused { request_id: 9, chip: p, error, retry: Retry::Elsewhere }, &mut fx);
    }
    let failed = fx.take_sent().into_iter().any(|(to, m)| {
        to == CLIENT
            && matches!(m, Msg::Client { event: ClientEvent::Failed { error } } if error.kind == ErrorKind::Unavailable)
    });
    assert!(failed && fx.stopped);
}

#[test]
fn a_stalled_chip_is_abandoned_after_the_stall_timeout() {
    let p = a(1, 16);
    let (mut fx, mut r) = routed_to(p, 4);
    let stall = RetryPolicy::default().stall_timeout;
    fx.advance(stall - Duration::from_secs(1), &mut r);
    assert!(fx.take_sent().is_empty(), "not yet");
    fx.advance(stall, &mut r);
    let sent = fx.take_sent();
    assert!(sent.iter().any(|(to, m)| *to == p && matches!(m, Msg::Abort { .. })));
    assert!(sent.iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Route { .. })));
}

#[test]
fn disaggregated_request_prefills_on_one_chip_and_decodes_on_the_other() {
    let (pc, dc) = (a(0, 16), a(1, 16));
    let mut fx = TestFx::new(ME);
    let mut r = request(3);
    r.on_start(&mut fx);
    fx.take_sent();
    r.handle(Msg::Routed { request_id: 9, chip: dc, prefill: Some(pc) }, &mut fx);
    assert!(matches!(&fx.take_sent()[..], [(to, Msg::Prefill { decode, .. })] if *to == pc && *decode == dc));
    // The first token from D ends P's part: P is released at the router.
    r.handle(generated(dc, vec![10], None), &mut fx);
    let sent = fx.take_sent();
    assert!(sent.iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Release { chip, .. } if *chip == pc)));
    // P going down now does not matter.
    r.handle(Msg::ChipLost { chip: pc }, &mut fx);
    assert!(fx.take_sent().is_empty());
    r.handle(generated(dc, vec![11, 12], Some(Finish::Length)), &mut fx);
    assert!(fx.stopped);
}

/// P samples the first token: the client has it at once, and P stays held until D's
/// first token (it still holds the KV D reads). Losing P then replays the first token.
#[test]
fn a_first_token_from_the_prefill_chip_streams_at_once_and_keeps_it_held() {
    let (pc, dc) = (a(0, 16), a(1, 16));
    let (mut fx, mut r) = routed_split(dc, Some(pc), 3);
    r.handle(generated(pc, vec![10], None), &mut fx);
    let sent = fx.take_sent();
    // The router hears that the prompt is computed, and the client has the token.
    assert!(
        matches!(&sent[..], [
            (ROUTER, Msg::PromptComputed { request_id: 9 }),
            (CLIENT, Msg::Client { event: ClientEvent::Tokens { tokens, .. } }),
        ] if tokens == &[10]),
        "{sent:?}"
    );
    // D loses the KV when P goes: the request aborts D and replays prompt + [10].
    r.handle(Msg::ChipLost { chip: pc }, &mut fx);
    let sent = fx.take_sent();
    assert!(sent.iter().any(|(to, m)| *to == dc && matches!(m, Msg::Abort { .. })), "{sent:?}");
    assert!(
        sent.iter().any(|(to, m)| *to == ROUTER
            && matches!(m, Msg::Route { prompt, prompt_tokens, .. } if prompt.last() == Some(&10) && *prompt_tokens == prompt.len())),
        "{sent:?}"
    );
    r.handle(Msg::Routed { request_id: 9, chip: dc, prefill: None }, &mut fx);
    let sent = fx.take_sent();
    assert!(
        matches!(&sent[..], [(to, Msg::Enqueue { seq })] if *to == dc && seq.generated == 1 && seq.max_new_tokens == 2),
        "{sent:?}"
    );
    r.handle(generated(dc, vec![11, 12], Some(Finish::Length)), &mut fx);
    assert!(fx.stopped);
}

#[test]
fn losing_either_chip_of_a_disaggregated_request_aborts_the_other_and_replays() {
    for lost_prefill in [true, false] {
        let (pc, dc) = (a(0, 16), a(1, 16));
        let (mut fx, mut r) = routed_split(dc, Some(pc), 3);
        let (lost, other) = if lost_prefill { (pc, dc) } else { (dc, pc) };
        r.handle(Msg::ChipLost { chip: lost }, &mut fx);
        let sent = fx.take_sent();
        assert!(sent.iter().any(|(to, m)| *to == other && matches!(m, Msg::Abort { .. })), "{sent:?}");
        assert!(
            sent.iter()
                .any(|(to, m)| *to == ROUTER && matches!(m, Msg::Route { exclude, .. } if exclude == &vec![lost]))
        );
        // Late messages from the old pair are ignored.
        r.handle(generated(dc, vec![10], None), &mut fx);
        r.handle(
            Msg::Refused {
                request_id: 9,
                chip: pc,
                error: ServeError::new(ErrorKind::Unavailable, "x"),
                retry: Retry::Elsewhere,
            },
            &mut fx,
        );
        assert!(fx.take_sent().is_empty());
    }
}

#[test]
fn declines_from_a_chip_that_is_not_up_cost_no_attempt_and_back_off() {
    let (p, q) = (a(1, 16), a(2, 16));
    let mut fx = TestFx::new(ME);
    let mut r = request(4);
    r.on_start(&mut fx);
    fx.take_sent();
    let not_up = |chip| Msg::Refused {
        request_id: 9,
        chip,
        error: ServeError::new(ErrorKind::Unavailable, "chip is not up"),
        retry: Retry::Unavailable,
    };
    let routes = |fx: &mut TestFx| -> Vec<Vec<Addr>> {
        fx.take_sent()
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Route { exclude, .. } if to == ROUTER => Some(exclude),
                _ => None,
            })
            .collect()
    };
    // Far more declines than max_attempts: none of them is an attempt.
    let declines = 3 * RetryPolicy::default().max_attempts;
    for n in 1..=declines {
        let chip = if n % 2 == 0 { p } else { q };
        r.handle(Msg::Routed { request_id: 9, chip, prefill: None }, &mut fx);
        fx.take_sent();
        r.handle(not_up(chip), &mut fx);
        if n == 1 {
            // The first decline re-routes at once, avoiding the chip.
            assert_eq!(routes(&mut fx), vec![vec![q]]);
            continue;
        }
        assert!(routes(&mut fx).is_empty(), "decline {n}: waits before routing again");
        let wait = reroute_backoff(n);
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(1), "decline {n}: {wait:?}");
        fx.advance(wait, &mut r);
        let asked = routes(&mut fx);
        assert_eq!(asked.len(), 1, "decline {n}: one route after the backoff");
        assert!(asked[0].contains(&p) && asked[0].contains(&q), "both chips avoided: {asked:?}");
    }
    assert!(!fx.stopped, "declines alone never exhaust the attempts");
    // Progress resets the wait; then declines for longer than unavailable_timeout fail it.
    r.handle(Msg::Routed { request_id: 9, chip: p, prefill: None }, &mut fx);
    r.handle(generated(p, vec![10], None), &mut fx);
    fx.take_sent();
    let limit = RetryPolicy::default().unavailable_timeout;
    let started = fx.now();
    r.handle(not_up(p), &mut fx);
    while !fx.stopped {
        assert!(fx.now().since(started) <= limit + Duration::from_secs(2), "bounded by unavailable_timeout");
        fx.advance(Duration::from_millis(500), &mut r);
        if let Some(Msg::Route { .. }) = fx.sent.last().map(|(_, m)| m) {
            r.handle(Msg::Routed { request_id: 9, chip: p, prefill: None }, &mut fx);
            r.handle(not_up(p), &mut fx);
        }
    }
    assert!(fx.now().since(started) >= limit, "gave up only after unavailable_timeout");
    let failed = fx.take_sent().into_iter().any(|(to, m)| {
        to == CLIENT
            && matches!(m, Msg::Client { event: ClientEvent::Failed { error } } if error.message.contains("no chip took"))
    });
    assert!(failed);
}

#[test]
fn a_route_failure_mid_stream_waits_for_a_chip_but_a_fresh_request_fails_at_once() {
    for kind in [ErrorKind::Unavailable, ErrorKind::Overloaded] {
        route_failure_mid_stream(kind);
    }
}

/// The router answered `kind` (no healthy chip; its queue's deadline passed).
fn route_failure_mid_stream(kind: ErrorKind) {
    let p = a(1, 16);
    let no_chip = || Msg::RouteFailed { request_id: 9, error: ServeError::new(kind, "no chip took it") };
    let mut fx = TestFx::new(ME);
    let mut r = request(4);
    r.on_start(&mut fx);
    r.handle(no_chip(), &mut fx);
    assert!(fx.stopped, "nothing started: the client gets the error (503, 429) at once");

    let (mut fx, mut r) = routed_to(p, 4);
    r.handle(generated(p, vec![10], None), &mut fx);
    r.handle(Msg::ChipLost { chip: p }, &mut fx);
    fx.take_sent();
    r.handle(no_chip(), &mut fx);
    assert!(!fx.stopped, "a request under way waits for a chip to come back");
    r.handle(no_chip(), &mut fx);
    fx.advance(Duration::from_secs(1), &mut r);
    assert!(fx.take_sent().iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Route { .. })));
    r.handle(Msg::Routed { request_id: 9, chip: p, prefill: None }, &mut fx);
    let sent = fx.take_sent();
    assert!(
        sent.iter().any(|(to, m)| *to == p && matches!(m, Msg::Enqueue { seq } if seq.tokens == vec![1, 2, 3, 10])),
        "replays the prompt and the token already sent: {sent:?}"
    );
}

/// A request of prompt [1, 2, 3] read whole, placed on `chip`, with the sends so far
/// cleared.
fn whole_on(chip: Addr, max_tokens: usize, sampling: SamplingSpec) -> (TestFx, Request) {
    let mut fx = TestFx::new(ME);
    let spec = RequestSpec {
        request_id: 9,
        prompt: vec![1, 2, 3],
        max_tokens,
        sampling,
        delivery: Delivery::Whole,
        forks: Vec::new(),
        cache_salt: None,
        share: Default::default(),
    };
    let mut r = Request::new(spec, CLIENT, ROUTER, RetryPolicy::default());
    r.on_start(&mut fx);
    r.handle(Msg::Routed { request_id: 9, chip, prefill: None }, &mut fx);
    fx.take_sent();
    (fx, r)
}

/// What reached the client since the last look at the sends.
fn to_client(fx: &mut TestFx) -> Vec<ClientEvent> {
    fx.take_sent()
        .into_iter()
        .filter_map(|(to, m)| match m {
            Msg::Client { event } if to == CLIENT => Some(event),
            _ => None,
        })
        .collect()
}

/// A whole response passes the first token on at once and the rest when it ends, however
/// its chip grouped them.
#[test]
fn a_whole_response_reaches_the_client_as_its_first_token_then_the_rest() {
    let chip = a(1, 16);
    let (mut fx, mut r) = whole_on(chip, 6, SamplingSpec::greedy());
    r.handle(generated(chip, vec![10], None), &mut fx);
    assert_eq!(to_client(&mut fx), vec![ClientEvent::Tokens { tokens: vec![10], logprobs: vec![] }]);
    r.handle(generated(chip, vec![11, 12], None), &mut fx);
    r.handle(generated(chip, vec![13], None), &mut fx);
    assert_eq!(to_client(&mut fx), vec![], "held until the end");
    r.handle(generated(chip, vec![14, 15], Some(Finish::Length)), &mut fx);
    assert_eq!(
        to_client(&mut fx),
        vec![
            ClientEvent::Tokens { tokens: vec![11, 12, 13, 14, 15], logprobs: vec![] },
            ClientEvent::Finished { finish: Finish::Length, prompt_tokens: 3, completion_tokens: 6 },
        ]
    );
}

/// A scoring request passes each prompt log-probability on once (a replay's repeat is
/// cut), and ends only when all are out, even if its chip finished first.
#[test]
fn a_scoring_request_passes_prompt_logprobs_once_and_ends_after_them() {
    let chip = a(1, 16);
    let (mut fx, mut r) = whole_on(chip, 1, SamplingSpec { prompt_logprobs: Some(0), ..SamplingSpec::greedy() });
    let lp = |token| TokenLogprob { token, logprob: -1.0, top: vec![] };
    // The decoding chip finishes before the prompt's scores arrive: held.
    r.handle(generated(chip, vec![7], Some(Finish::Length)), &mut fx);
    assert_eq!(to_client(&mut fx), vec![ClientEvent::Tokens { tokens: vec![7], logprobs: vec![] }]);
    assert!(!fx.stopped, "waits for the prompt's log-probabilities");
    r.handle(Msg::PromptLogprobs { request_id: 9, start: 1, logprobs: vec![lp(2)] }, &mut fx);
    assert_eq!(to_client(&mut fx), vec![ClientEvent::PromptLogprobs { start: 1, logprobs: vec![lp(2)] }]);
    // A replay sends positions 1.. again: only position 2 is new; then it ends.
    r.handle(Msg::PromptLogprobs { request_id: 9, start: 1, logprobs: vec![lp(2), lp(3)] }, &mut fx);
    assert_eq!(
        to_client(&mut fx),
        vec![
            ClientEvent::PromptLogprobs { start: 2, logprobs: vec![lp(3)] },
            ClientEvent::Finished { finish: Finish::Length, prompt_tokens: 3, completion_tokens: 1 },
        ]
    );
    assert!(fx.stopped);
}

/// A sibling (`n` > 1) waiting to be forked from request 8's sequence.
fn fork_of(max_tokens: usize) -> (TestFx, Request) {
    let spec = RequestSpec {
        request_id: 9,
        prompt: vec![1, 2, 3],
        max_tokens,
        sampling: SamplingSpec { seed: Some(8), ..SamplingSpec::greedy() },
        delivery: Delivery::Stream,
        forks: Vec::new(),
        cache_salt: None,
        share: Default::default(),
    };
    let mut fx = TestFx::new(ME);
    let mut r = Request::forked(spec, CLIENT, ROUTER, RetryPolicy::default());
    r.on_start(&mut fx);
    (fx, r)
}

#[test]
fn a_forked_request_waits_for_its_first_token_and_then_is_a_placement_of_its_own() {
    let chip = a(1, 16);
    let (mut fx, mut r) = fork_of(3);
    assert!(fx.take_sent().is_empty(), "it does not route: its sibling's chip will fork it");
    // Its sibling's prompt scores reach it (echo) before its own first token.
    let lp = TokenLogprob { token: 2, logprob: -0.5, top: vec![] };
    r.handle(Msg::PromptLogprobs { request_id: 9, start: 1, logprobs: vec![lp] }, &mut fx);
    r.handle(generated(chip, vec![10], None), &mut fx);
    let sent = fx.take_sent();
    assert!(
        sent.iter()
            .any(|(to, m)| *to == ROUTER && matches!(m, Msg::Forked { request_id: 9, chip: c, .. } if *c == chip)),
        "{sent:?}"
    );
    assert!(sent.iter().any(|(to, m)| *to == CLIENT
        && matches!(m, Msg::Client { event: ClientEvent::Tokens { tokens, .. } } if tokens == &vec![10])));
    // From then on it is like any placed request: the chip lost, it replays elsewhere.
    r.handle(Msg::ChipLost { chip }, &mut fx);
    let sent = fx.take_sent();
    assert!(
        sent.iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Route { exclude, .. } if exclude == &vec![chip]))
    );
    r.handle(Msg::Routed { request_id: 9, chip: a(2, 16), prefill: None }, &mut fx);
    match &fx.take_sent()[..] {
        [(_, Msg::Enqueue { seq })] => {
            assert_eq!((seq.tokens.clone(), seq.generated, seq.sampling.seed), (vec![1, 2, 3, 10], 1, Some(8)));
        }
        other => panic!("expected one Enqueue, got {other:?}"),
    }
}

#[test]
fn a_fork_that_will_not_happen_routes_on_its_own() {
    // Told so (no block for its copy, or its sibling ended before sampling)…
    let (mut fx, mut r) = fork_of(3);
    r.handle(Msg::Reroute, &mut fx);
    assert!(matches!(&fx.take_sent()[..], [(ROUTER, Msg::Route { .. })]));
    // Should its sibling's chip fork it after all, that sequence is stopped there.
    r.handle(Msg::Routed { request_id: 9, chip: a(2, 16), prefill: None }, &mut fx);
    fx.take_sent();
    r.handle(generated(a(1, 16), vec![10], None), &mut fx);
    assert_eq!(fx.take_sent(), vec![(a(1, 16), Msg::Abort { request_id: 9 })]);
    // …or after the stall timeout without a word.
    let (mut fx, mut r) = fork_of(3);
    let stall = RetryPolicy::default().stall_timeout;
    fx.advance(stall - Duration::from_secs(1), &mut r);
    assert!(fx.take_sent().is_empty(), "not yet");
    fx.advance(stall, &mut r);
    assert!(fx.take_sent().iter().any(|(to, m)| *to == ROUTER && matches!(m, Msg::Route { .. })));
}

#[test]
fn a_request_that_ends_before_sampling_releases_its_forks() {
    let fork = Fork { request_id: 10, req: a(0, 77), seed: Some(1) };
    let spec = RequestSpec {
        request_id: 9,
        prompt: vec![1, 2, 3],
        max_tokens: 3,
        sampling: SamplingSpec::greedy(),
        delivery: Delivery::Stream,
        forks: vec![fork.clone()],
        cache_salt: None,
        share: Default::default(),
    };
    let mut fx = TestFx::new(ME);
    let mut r = Request::new(spec, CLIENT, ROUTER, RetryPolicy::default());
    r.on_start(&mut fx);
    fx.take_sent();
    r.handle(Msg::Routed { request_id: 9, chip: a(1, 16), prefill: None }, &mut fx);
    match &fx.take_sent()[..] {
        [(_, Msg::Enqueue { seq })] => assert_eq!(seq.forks, vec![fork.clone()], "the chip is told to fork it"),
        other => panic!("expected one Enqueue, got {other:?}"),
    }
    r.handle(Msg::Cancel, &mut fx);
    assert!(fx.take_sent().iter().any(|(to, m)| *to == fork.req && matches!(m, Msg::Reroute)));
}
