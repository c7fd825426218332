//! The P/D hand-off between two chips in virtual time: every message between them is
//! delivered by hand, worker jobs run on a recording executor, and each test checks
//! what reached the request and that both pools end all-free.

use super::executor::{ExecutorFactory, KvInstall, StepExecutor, stage_groups};
use super::*;
use crate::batcher::StepPlan;
use crate::msg::{DType, Delivery, Finish, KvCompat, KvFormatDesc, KvLayout, SamplingSpec, StepOutcome};
use crate::msg::{KvEndpointDesc, KvRegionDesc};
use crate::test_fx::TestFx;
use std::sync::Arc;
use std::time::Duration;
use tessera_actor_core::HostId;
use tessera_actor_core::JobCtx;
use tessera_actor_core::testkit::run_job;

const P: Addr = Addr { host: HostId(0), actor: 16 };
const D: Addr = Addr { host: HostId(1), actor: 16 };
const REQ: Addr = Addr { host: HostId(0), actor: 5000 };
const SUP: Addr = Addr { host: HostId(0), actor: 1 };
/// Staged in groups of 2, 1, 1 and 1 layers.
const LAYERS: usize = 5;

/// Stages every layer of every staged sequence (telling each group of layers at its
/// last one's millisecond), installs nothing, samples token 7.
#[derive(Default)]
struct Recorder {
    installs: Vec<KvInstall>,
}

impl StepExecutor for Recorder {
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome {
        for layers in stage_groups(LAYERS) {
            let seqs: Vec<(u64, usize)> =
                plan.seqs.iter().filter(|s| s.stage).map(|s| (s.request_id, s.start_pos + s.tokens.len())).collect();
            if !seqs.is_empty() {
                let at = Duration::from_millis(layers.end as u64);
                // A secured worker's grant, one per staged sequence: P forwards it to D.
                let capabilities = seqs.iter().map(|&(request, _)| (request, [request as u8; 16])).collect();
                ctx.notify_at(at, Msg::KvStaged { step, layers, staged: seqs, capabilities });
            }
        }
        ctx.elapse(Duration::from_millis(LAYERS as u64));
        let sampled = plan.seqs.iter().flat_map(|s| s.samplers()).map(|id| (id, 7)).collect();
        StepOutcome::sampled(step, sampled, 0.0)
    }

    fn install(&mut self, job: &KvInstall, _ctx: &mut dyn JobCtx<Msg>) -> Result<(), String> {
        self.installs.push(job.clone());
        Ok(())
    }
}

fn info(block_size: usize, layout: KvLayout, hash: u64) -> ChipInfo {
    ChipInfo {
        format: KvFormatDesc {
            num_layers: LAYERS,
            num_kv_heads: 2,
            head_dim: 8,
            block_size,
            num_blocks: 32,
            layout,
            dtype: DType::F32,
        },
        compat: KvCompat { hash, fields: vec![("head_dim".into(), if hash == 1 { "8" } else { "16" }.into())] },
        staging: Some(KvRegionDesc {
            endpoint: KvEndpointDesc { host_key: "test".into(), pid: 1, tcp: "127.0.0.1:9".parse().expect("addr") },
            region: 1,
            fd: 3,
            len: 1 << 20,
        }),
        emulated: None,
        num_blocks: 32,
        block_size,
        max_context: 256,
        vocab_size: 100,
        eos_token_ids: vec![],
    }
}

struct Side {
    chip: Chip,
    fx: TestFx,
    exec: Box<dyn StepExecutor>,
}

impl Side {
    fn new(me: Addr, role: Role, info: ChipInfo) -> Side {
        let factory: ExecutorFactory = Arc::new(|| Err("not used".into()));
        let config = ChipConfig {
            id: format!("chip-{}", me.host.0),
            host_name: format!("h{}", me.host.0),
            role,
            max_batch_tokens: 8,
            max_batch_seqs: 8,
            supervisor: SUP,
            kv_lease: Duration::from_secs(5),
            max_mixed_step: None,
            pace: crate::router::cost::Pace::UNKNOWN,
            tenants: Arc::from([]),
        };
        let mut chip = Chip::new(config, factory);
        let mut fx = TestFx::new(me);
        chip.on_start(&mut fx);
        chip.handle(Msg::WorkerReady { info: Box::new(info) }, &mut fx);
        let exec: Box<dyn StepExecutor> = Box::new(Recorder::default());
        Side { chip, fx, exec }
    }

    /// Runs queued worker jobs and delivers what they report (notifications first, as
    /// the worker posts them before its result), until none are left.
    fn run_jobs(&mut self) {
        while !self.fx.jobs.is_empty() {
            self.run_next_job();
        }
    }

    /// Runs the first queued worker job and delivers what it reports.
    fn run_next_job(&mut self) {
        let job = self.fx.jobs.remove(0);
        let run = run_job(job, &mut self.exec as &mut dyn std::any::Any);
        for (_, m) in run.notifications {
            self.chip.handle(m, &mut self.fx);
        }
        self.chip.handle(run.result, &mut self.fx);
    }

    /// Tokens sent to the request since the last look at the sends.
    fn generated(&mut self) -> Vec<u32> {
        self.sent()
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Generated { tokens, .. } if to == REQ => Some(tokens),
                _ => None,
            })
            .flatten()
            .collect()
    }

    fn used(&self) -> usize {
        self.chip.pool.as_ref().map_or(0, |p| p.used())
    }

    /// Sends to other actors since the last call, supervisor reports left out.
    fn sent(&mut self) -> Vec<(Addr, Msg)> {
        self.fx.take_sent().into_iter().filter(|(to, _)| *to != SUP).collect()
    }
}

fn seq(prompt: usize, max_new: usize) -> SeqRequest {
    SeqRequest {
        request_id: 9,
        req: REQ,
        tokens: (1..=prompt as u32).collect(),
        generated: 0,
        max_new_tokens: max_new,
        sampling: SamplingSpec { ignore_eos: true, ..SamplingSpec::greedy() },
        delivery: Delivery::Stream,
        forks: Vec::new(),
        cache_salt: None,
        share: Default::default(),
    }
}

/// Delivers every message `from` sent to `to`'s chip; returns the rest.
fn deliver(from: &mut Side, to: &mut Side) -> Vec<(Addr, Msg)> {
    let mut rest = Vec::new();
    for (addr, msg) in from.sent() {
        if addr == to.fx.me {
            to.chip.handle(msg, &mut to.fx);
        } else {
            rest.push((addr, msg));
        }
    }
    rest
}

/// While a step is in flight a chip reports to its supervisor at most every 10 ms, not
/// after every step; going idle, it reports at once, with every step counted.
#[test]
fn a_busy_chip_reports_at_most_every_10_ms_and_at_once_when_idle() {
    let mut c = Side::new(P, Role::Both, info(4, KvLayout::HeadMajor, 1));
    let reports = |c: &mut Side| -> Vec<(u64, usize)> {
        c.fx.take_sent()
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Report { report } if to == SUP => Some((report.steps, report.running)),
                _ => None,
            })
            .collect()
    };
    reports(&mut c);
    // A 6-token prompt and 8 tokens: a prefill step, then 7 decode steps.
    c.chip.handle(Msg::Enqueue { seq: Box::new(seq(6, 8)) }, &mut c.fx);
    for _ in 0..3 {
        c.run_next_job();
    }
    assert_eq!(reports(&mut c), vec![], "3 steps within 10 ms of the last report: none");
    c.fx.now = c.fx.now.after(Duration::from_millis(10));
    c.run_next_job();
    assert_eq!(reports(&mut c), vec![(5, 1)], "10 ms on: one report (step 5 in flight)");
    for _ in 0..3 {
        c.run_next_job();
    }
    assert_eq!(reports(&mut c), vec![]);
    c.run_next_job();
    assert!(c.fx.jobs.is_empty());
    assert_eq!(reports(&mut c), vec![(8, 0)], "idle: reported at once");
}

/// P (blocks of 4, head-major) asked to prefill a 14-token prompt for D (blocks of 8,
/// token-major), three tokens to generate.
fn prefilling_for_d() -> (Side, Side) {
    prefilling(seq(14, 3))
}

/// P (blocks of 4, head-major) asked to prefill `s` for D (blocks of 8, token-major).
fn prefilling(s: SeqRequest) -> (Side, Side) {
    let mut p = Side::new(P, Role::Prefill, info(4, KvLayout::HeadMajor, 1));
    let d = Side::new(D, Role::Decode, info(8, KvLayout::TokenMajor, 1));
    p.chip.handle(Msg::Prefill { seq: Box::new(s), decode: D }, &mut p.fx);
    (p, d)
}

#[test]
fn prefill_streams_layers_and_its_first_token_to_decode_and_both_pools_drain() {
    let (mut p, mut d) = prefilling_for_d();
    // P offers at once and starts computing; D claims.
    assert!(deliver(&mut p, &mut d).is_empty());
    assert_eq!(d.used(), 2, "D reserved ceil(14 / 8) blocks for the 14 prefilled positions");
    assert!(deliver(&mut d, &mut p).is_empty());
    // 14 positions with a budget of 8: two steps, each group of layers told as it is
    // staged; the second samples the first token, which goes to the request at once.
    p.run_jobs();
    let rest = deliver(&mut p, &mut d);
    assert!(
        matches!(&rest[..], [(REQ, Msg::Generated { chip: P, tokens, finish: None, .. })] if tokens == &[7]),
        "{rest:?}"
    );
    let told = d.exec_installs();
    let groups = [0..2, 2..3, 3..4, 4..5];
    let expected: Vec<_> = [8, 14].into_iter().flat_map(|upto| groups.iter().map(move |g| (g.clone(), upto))).collect();
    assert_eq!(told, expected);
    // D installed everything and has the first token: acknowledges P, decodes from it.
    assert!(deliver(&mut d, &mut p).is_empty());
    assert_eq!(p.used(), 0, "P freed its blocks on D's acknowledgement");
    d.run_jobs();
    let tokens = d.generated();
    assert_eq!(tokens, vec![7, 7], "D sampled the other two tokens");
    assert_eq!(d.used(), 0, "D finished the request and freed its blocks");
    assert!(p.chip.handoffs.is_empty() && d.chip.handoffs.is_empty());
}

/// A request that forks its siblings (`n` > 1) samples on D, where they fork: P
/// computes all but the last position.
#[test]
fn a_forking_request_samples_on_decode() {
    let mut s = seq(14, 3);
    s.forks = vec![crate::msg::Fork { request_id: 10, req: Addr::new(HostId(0), 1010), seed: Some(5) }];
    let (mut p, mut d) = prefilling(s);
    assert!(deliver(&mut p, &mut d).is_empty());
    assert!(deliver(&mut d, &mut p).is_empty());
    p.run_jobs();
    assert!(deliver(&mut p, &mut d).is_empty(), "P samples nothing");
    assert_eq!(d.exec_installs().last().map(|(_, upto)| *upto), Some(13));
    assert!(deliver(&mut d, &mut p).is_empty());
    d.run_jobs();
    assert_eq!(d.generated(), vec![7, 7, 7], "D sampled every token, the first one included");
}

/// A first token that ends the request (a stop token, or its only one) ends the
/// hand-off: D frees what it reserved, and P its blocks.
#[test]
fn a_request_ended_by_its_first_token_frees_both_sides() {
    let (mut p, mut d) = prefilling(seq(14, 1));
    assert!(deliver(&mut p, &mut d).is_empty());
    assert!(deliver(&mut d, &mut p).is_empty());
    p.run_jobs();
    let rest = deliver(&mut p, &mut d);
    assert!(matches!(&rest[..], [(REQ, Msg::Generated { chip: P, finish: Some(Finish::Length), .. })]), "{rest:?}");
    d.exec_installs();
    assert_eq!((p.used(), d.used()), (0, 0));
    assert!(p.chip.handoffs.is_empty() && d.chip.handoffs.is_empty());
    assert!(d.fx.jobs.is_empty(), "D runs nothing");
}

/// A claim that comes after P staged everything is answered with one `KvReady` for all
/// the layers, installed by one job.
#[test]
fn a_late_claim_is_told_every_staged_layer_at_once() {
    let (mut p, mut d) = prefilling_for_d();
    assert!(deliver(&mut p, &mut d).is_empty());
    let claim = d.sent();
    p.run_jobs();
    assert!(p.sent().iter().all(|(to, _)| *to == REQ), "nothing is told to D before the claim");
    for (_, m) in claim {
        p.chip.handle(m, &mut p.fx);
    }
    let told = p.sent();
    assert!(
        matches!(&told[..], [(D, Msg::KvReady { layers, upto: 14, capability: Some(c), .. }), (D, Msg::KvFirstToken { token: 7, .. })]
            if *layers == (0..LAYERS) && c[0] != 0),
        "{told:?}"
    );
    for (_, m) in told {
        d.chip.handle(m, &mut d.fx);
    }
    assert_eq!(d.exec_installs(), vec![(0..LAYERS, 14)]);
    assert!(deliver(&mut d, &mut p).is_empty());
    assert_eq!(p.used(), 0, "D acknowledged: P freed its blocks");
    d.run_jobs();
    assert_eq!(d.generated(), vec![7, 7]);
    assert_eq!(d.used(), 0);
}

impl Side {
    /// Runs D's install jobs, up to its first step (left queued); returns (layers, upto)
    /// of each, in order.
    fn exec_installs(&mut self) -> Vec<(std::ops::Range<usize>, usize)> {
        let mut seen = Vec::new();
        while self.fx.jobs.first().is_some_and(|job| job.label == "kv_install") {
            let job = self.fx.jobs.remove(0);
            let result = run_job(job, &mut self.exec as &mut dyn std::any::Any).result;
            if let Msg::KvInstalled { layers, upto, .. } = &result {
                seen.push((layers.clone(), *upto));
            }
            self.chip.handle(result, &mut self.fx);
        }
        seen
    }
}

#[test]
fn incompatible_decode_chip_refuses_the_offer_naming_both_chips() {
    let mut p = Side::new(P, Role::Prefill, info(4, KvLayout::HeadMajor, 1));
    let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 2));
    p.chip.handle(Msg::Prefill { seq: Box::new(seq(10, 3)), decode: D }, &mut p.fx);
    assert!(deliver(&mut p, &mut d).is_empty());
    assert_eq!(d.used(), 0);
    assert!(deliver(&mut d, &mut p).is_empty());
    let sent = p.sent();
    let refused = sent.iter().find_map(|(to, m)| match m {
        Msg::Refused { error, retry, .. } if *to == REQ => Some((error.message.clone(), *retry)),
        _ => None,
    });
    let (message, retry) = refused.expect("the request is told");
    assert_eq!(retry, Retry::No);
    assert!(message.contains("chip-1") && message.contains("chip-0") && message.contains("head_dim"), "{message}");
    p.run_jobs();
    assert_eq!(p.used(), 0);
    assert!(p.chip.handoffs.is_empty());
}

/// P prefills request 9 for D, which drops the offer: P holds the KV, unclaimed.
fn unclaimed_prefill() -> Side {
    let mut p = Side::new(P, Role::Prefill, info(4, KvLayout::HeadMajor, 1));
    let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 1));
    d.chip.handle(Msg::InjectFault { fault: Fault::DropKvClaim }, &mut d.fx);
    p.chip.handle(Msg::Prefill { seq: Box::new(seq(10, 3)), decode: D }, &mut p.fx);
    assert!(deliver(&mut p, &mut d).is_empty());
    assert!(d.sent().is_empty(), "D dropped the offer: no claim");
    p.run_jobs();
    p
}

#[test]
fn unclaimed_kv_is_freed_when_the_lease_runs_out() {
    let mut p = unclaimed_prefill();
    assert!(p.used() > 0, "P holds the prefilled blocks for D");
    p.fx.take_sent();
    p.fx.advance(Duration::from_secs(6), &mut p.chip);
    assert_eq!(p.used(), 0, "the lease freed them");
    let sent = p.sent();
    assert!(sent.iter().any(|(to, m)| *to == REQ
        && matches!(m, Msg::Refused { retry: Retry::Elsewhere, error, .. } if error.message.contains("lease"))));
    assert!(sent.iter().any(|(to, m)| *to == D && matches!(m, Msg::KvCancel { .. })));
}

/// A lease runs `kv_lease` from its last renewal, on one timer at a time: the timer that
/// comes due after a renewal is set again for the rest, not taken as the end.
#[test]
fn a_renewed_lease_runs_from_its_last_renewal_on_one_timer() {
    let mut p = unclaimed_prefill();
    let leases = |p: &Side| p.fx.timers.iter().filter(|(_, _, m)| matches!(m, Msg::KvLeaseExpired { .. })).count();
    assert_eq!(leases(&p), 1, "offer and prefill renew the lease on one timer");
    // 3 s later D claims (late): a renewal. At 5 s the first timer is not the end.
    p.fx.advance(Duration::from_secs(3), &mut p.chip);
    p.chip.handle(Msg::KvClaim { request_id: 9, decode: D }, &mut p.fx);
    assert_eq!(leases(&p), 1);
    p.fx.advance(Duration::from_secs(3), &mut p.chip);
    assert!(p.used() > 0, "renewed at 3 s: held at 6 s");
    assert_eq!(leases(&p), 1, "set again for the rest");
    p.fx.take_sent();
    p.fx.advance(Duration::from_secs(3), &mut p.chip);
    assert_eq!(p.used(), 0, "ran out 5 s after the renewal");
    assert!(p.sent().iter().any(|(to, m)| *to == D && matches!(m, Msg::KvCancel { .. })));
    assert_eq!(leases(&p), 0);
}

#[test]
fn malformed_kv_ready_is_refused_and_frees_both_sides() {
    for bad in [
        Msg::KvReady { request_id: 9, layers: LAYERS..LAYERS + 1, upto: 4, blocks: Arc::from([0]), capability: None },
        Msg::KvReady { request_id: 9, layers: 2..LAYERS + 1, upto: 4, blocks: Arc::from([0]), capability: None },
        Msg::KvReady { request_id: 9, layers: 1..1, upto: 4, blocks: Arc::from([0]), capability: None },
        Msg::KvReady { request_id: 9, layers: 0..1, upto: 99, blocks: Arc::from([0]), capability: None },
        Msg::KvReady { request_id: 9, layers: 0..1, upto: 8, blocks: Arc::from([0]), capability: None },
        Msg::KvReady { request_id: 9, layers: 0..LAYERS, upto: 4, blocks: Arc::from([1_000_000]), capability: None },
    ] {
        let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 1));
        d.chip.handle(Msg::KvOffer { offer: Box::new(make_offer()) }, &mut d.fx);
        assert_eq!(d.used(), 3);
        d.fx.take_sent();
        d.chip.handle(bad.clone(), &mut d.fx);
        assert_eq!(d.used(), 0, "{bad:?}");
        let sent = d.sent();
        assert!(sent.iter().any(|(to, m)| *to == P && matches!(m, Msg::KvCancel { .. })), "{bad:?}");
        assert!(sent.iter().any(|(to, m)| *to == REQ
            && matches!(m, Msg::Refused { retry: Retry::Elsewhere, error, .. } if error.message.contains("malformed"))));
    }
}

#[test]
fn offers_with_a_bad_format_are_declined_not_installed() {
    type Breaks = Box<dyn Fn(&mut crate::msg::KvOffer)>;
    // An unknown layout or dtype never reaches a chip: its payload does not decode
    // (actors/tests/codec.rs).
    let cases: Vec<(&str, Breaks)> = vec![
        ("KV shape", Box::new(|o| o.format.num_kv_heads = 4)),
        ("block size", Box::new(|o| o.format.block_size = 0)),
        ("prefilled positions", Box::new(|o| o.kv_tokens = 11)),
    ];
    for (what, break_it) in cases {
        let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 1));
        let mut offer = make_offer();
        break_it(&mut offer);
        d.chip.handle(Msg::KvOffer { offer: Box::new(offer) }, &mut d.fx);
        assert_eq!(d.used(), 0, "{what}");
        let sent = d.sent();
        assert!(
            sent.iter().any(|(to, m)| *to == P
                && matches!(m, Msg::KvDecline { retry: Retry::No, error, .. } if error.message.contains(what))),
            "{what}: {sent:?}"
        );
    }
}

fn make_offer() -> crate::msg::KvOffer {
    let i = info(4, KvLayout::HeadMajor, 1);
    crate::msg::KvOffer {
        seq: seq(10, 3),
        prefill: P,
        prefill_id: "chip-0".into(),
        kv_tokens: 9,
        format: i.format,
        compat: i.compat,
        region: i.staging.expect("staging"),
    }
}

#[test]
fn role_change_drains_first() {
    let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 1));
    d.chip.handle(Msg::KvOffer { offer: Box::new(make_offer()) }, &mut d.fx);
    d.fx.take_sent();
    d.chip.handle(Msg::SetRole { role: Role::Prefill }, &mut d.fx);
    assert_eq!(d.chip.role, Role::Decode, "a hand-off is in flight");
    d.chip.handle(Msg::Enqueue { seq: Box::new(SeqRequest { request_id: 10, ..seq(4, 2) }) }, &mut d.fx);
    assert!(
        d.sent()
            .iter()
            .any(|(_, m)| matches!(m, Msg::Refused { retry: Retry::Unavailable, error, .. } if error.message.contains("draining")))
    );
    d.chip.handle(Msg::KvCancel { request_id: 9, reason: "test".into() }, &mut d.fx);
    assert_eq!(d.chip.role, Role::Prefill, "drained: the new role is taken");
    assert_eq!(d.used(), 0);
}

/// `both` keeps whatever the chip does, so it is taken at once, hand-off and all; a
/// parked chip drains, takes nothing, and takes its own role back at once.
#[test]
fn both_is_taken_at_once_and_a_parked_chip_comes_back_at_once() {
    let mut d = Side::new(D, Role::Decode, info(4, KvLayout::HeadMajor, 1));
    d.chip.handle(Msg::KvOffer { offer: Box::new(make_offer()) }, &mut d.fx);
    d.fx.take_sent();
    d.chip.handle(Msg::SetRole { role: Role::Both }, &mut d.fx);
    assert_eq!((d.chip.role, d.chip.draining_to), (Role::Both, None), "no drain for a wider role");
    d.chip.handle(Msg::KvCancel { request_id: 9, reason: "test".into() }, &mut d.fx);
    d.chip.handle(Msg::Park, &mut d.fx);
    d.chip.handle(Msg::Enqueue { seq: Box::new(SeqRequest { request_id: 10, ..seq(4, 2) }) }, &mut d.fx);
    assert!(
        d.sent()
            .iter()
            .any(|(_, m)| matches!(m, Msg::Refused { retry: Retry::Unavailable, error, .. } if error.message.contains("parked"))),
        "a parked chip takes no work"
    );
    d.chip.handle(Msg::SetRole { role: Role::Both }, &mut d.fx);
    assert_eq!((d.chip.role, d.chip.draining_to), (Role::Both, None));
}

#[test]
fn an_offer_waits_for_free_blocks_then_is_claimed() {
    let mut small = info(4, KvLayout::HeadMajor, 1);
    small.num_blocks = 4;
    small.format.num_blocks = 4;
    let mut d = Side::new(D, Role::Decode, small);
    let first = make_offer();
    let mut second = make_offer();
    second.seq.request_id = 10;
    d.chip.handle(Msg::KvOffer { offer: Box::new(first) }, &mut d.fx);
    d.chip.handle(Msg::KvOffer { offer: Box::new(second) }, &mut d.fx);
    let claims = |sent: &[(Addr, Msg)]| -> Vec<u64> {
        sent.iter()
            .filter_map(|(_, m)| match m {
                Msg::KvClaim { request_id, .. } => Some(*request_id),
                _ => None,
            })
            .collect()
    };
    assert_eq!(claims(&d.sent()), vec![9], "the second offer's 3 blocks do not fit beside the first's");
    assert_eq!(d.used(), 3);
    d.chip.handle(Msg::KvCancel { request_id: 9, reason: "test".into() }, &mut d.fx);
    assert_eq!(claims(&d.sent()), vec![10], "claimed once the first one's blocks were freed");
    assert_eq!(d.used(), 3);
}

/// The request re-routed while its old sequence is still here and its new prefill
/// chip's offer arrives before the abort of the old one: the offer replaces the stale
/// sequence (two of one request would leave one holding blocks forever).
#[test]
fn an_offer_for_a_request_still_here_replaces_its_stale_sequence() {
    let mut d = Side::new(D, Role::Both, info(4, KvLayout::HeadMajor, 1));
    d.chip.handle(Msg::Enqueue { seq: Box::new(seq(10, 3)) }, &mut d.fx);
    assert_eq!(d.used(), 2, "the old sequence's first chunk is being computed");
    d.chip.handle(Msg::KvOffer { offer: Box::new(make_offer()) }, &mut d.fx);
    assert!(d.sent().iter().any(|(_, m)| matches!(m, Msg::KvClaim { request_id: 9, .. })));
    assert_eq!(d.used(), 3, "the new hand-off's blocks alone");
    d.chip.handle(Msg::KvCancel { request_id: 9, reason: "test".into() }, &mut d.fx);
    d.run_jobs();
    assert_eq!(d.used(), 0, "nothing of the request is left");
    assert!(!d.chip.batcher.as_ref().is_some_and(|b| b.contains(9)));
}

/// D cancels a hand-off after the request has already moved on to run on P alone (same
/// request id): only the hand-off is dropped; the new sequence on P runs to its end.
#[test]
fn a_late_cancel_of_a_hand_off_spares_the_request_s_new_placement() {
    let mut p = Side::new(P, Role::Prefill, info(4, KvLayout::HeadMajor, 1));
    p.chip.handle(Msg::Prefill { seq: Box::new(seq(14, 3)), decode: D }, &mut p.fx);
    // D went down: its request re-routed to P alone (aborting the hand-off first)...
    p.chip.handle(Msg::Abort { request_id: 9 }, &mut p.fx);
    p.chip.handle(Msg::Enqueue { seq: Box::new(seq(14, 3)) }, &mut p.fx);
    // ...and only then does D's cancel of the old hand-off arrive.
    p.chip.handle(Msg::KvCancel { request_id: 9, reason: "chip d: worker panicked".into() }, &mut p.fx);
    p.run_jobs();
    let tokens = p.generated();
    assert_eq!(tokens, vec![7, 7, 7], "the colocated run went on to its end");
    assert_eq!(p.used(), 0);
}

#[test]
fn an_offline_chip_hands_its_requests_back_and_restarts_only_when_online() {
    let mut c = Side::new(D, Role::Both, info(4, KvLayout::HeadMajor, 1));
    c.chip.handle(Msg::Enqueue { seq: Box::new(seq(4, 8)) }, &mut c.fx);
    assert!(c.used() > 0);
    c.fx.take_sent();
    c.chip.handle(Msg::InjectFault { fault: Fault::Offline }, &mut c.fx);
    let sent = c.fx.take_sent();
    let refused = sent.iter().any(|(to, m)| {
        *to == REQ
            && matches!(m, Msg::Refused { retry: Retry::Elsewhere, error, .. } if error.message.contains("offline"))
    });
    assert!(refused, "the request is handed back to be re-routed: {sent:?}");
    assert!(!sent.iter().any(|(_, m)| matches!(m, Msg::ChipCrashed { .. })), "no restart is asked for");
    assert_eq!(c.chip.state, ChipState::Failed);
    // A restart (a supervisor's, scheduled before) does not bring it back.
    c.chip.handle(Msg::Restart, &mut c.fx);
    assert_eq!(c.chip.state, ChipState::Failed);
    c.chip.handle(Msg::InjectFault { fault: Fault::Online }, &mut c.fx);
    assert_eq!(c.chip.state, ChipState::Starting, "online: a fresh worker starts");
    assert_eq!(c.chip.error, None);
    // Online again on a chip that is not offline changes nothing.
    c.chip.handle(Msg::InjectFault { fault: Fault::Online }, &mut c.fx);
    assert_eq!(c.chip.state, ChipState::Starting);
    assert_eq!(c.chip.restarts, 1);
}

#[test]
fn the_mixed_step_cap_follows_the_observed_pace() {
    let cap = |ms: u64, speed: &StepSpeed| super::mixed_prefill_tokens(Duration::from_millis(ms), speed, 16);
    let mut speed = StepSpeed::default();
    assert_eq!(cap(100, &speed), None, "no step with prompt tokens timed yet");
    speed.observe(0.5, 100, 1, 100); // 5 ms per prompt token
    assert_eq!(cap(200, &speed), Some(40));
    speed.observe(0.04, 4, 4, 0); // a decode-only step of 40 ms
    assert_eq!(cap(200, &speed), Some(32), "what 200 ms leaves after 40 ms of decoding, at 5 ms a token");
    assert_eq!(cap(100, &speed), Some(16), "at least a block, so prompts progress");
    assert_eq!(cap(30, &speed), Some(16), "even when decoding alone overruns the limit");
}
