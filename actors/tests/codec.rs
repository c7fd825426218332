//! Every cluster message survives the wire: payload encoding inside a bus envelope.

use proptest::prelude::*;
use tessera_actor_core::Message;
use tessera_actors::msg::*;
use tessera_runtime::codec::{self, Envelope, PROTOCOL_VERSION};
use tessera_runtime::{Addr, HostId};

/// Raw material for one message of each kind.
#[derive(Debug, Clone)]
struct Parts {
    a: u64,
    b: u64,
    n: usize,
    text: String,
    tokens: Vec<u32>,
    flag: bool,
    f: f32,
}

fn parts() -> impl Strategy<Value = Parts> {
    (
        any::<u64>(),
        any::<u64>(),
        0usize..1 << 20,
        ".{0,40}",
        prop::collection::vec(any::<u32>(), 0..64),
        any::<bool>(),
        -2.0f32..2.0,
    )
        .prop_map(|(a, b, n, text, tokens, flag, f)| Parts { a, b, n, text, tokens, flag, f })
}

fn addr(x: u64) -> Addr {
    Addr::new(HostId((x % 7) as u16), x)
}

fn report(p: &Parts) -> ChipReport {
    ChipReport {
        chip: addr(p.a),
        id: p.text.as_str().into(),
        host_name: "h1".into(),
        role: Role::ALL[p.n % 3],
        state: if p.flag { ChipState::Up } else { ChipState::Failed },
        kv_blocks_used: p.n,
        kv_blocks_total: p.n * 2,
        running: 3,
        waiting: 4,
        steps: p.b,
        max_step_seqs: 5,
        restarts: 1,
        error: p.flag.then(|| p.text.clone()),
        draining: p.flag,
        parked: p.flag,
        handoffs: p.n,
        emulated: p.flag.then(|| "ascend-910b x1000".into()),
        compat: Some(std::sync::Arc::new(compat(p))),
        last_handoff_gap_s: p.flag.then_some(p.f as f64),
        kv_last_event: p.b,
        kv_incarnation: p.a,
        speed: p.flag.then_some(StepSpeed {
            prefill_step_s: p.f as f64,
            prefill_step_tokens: p.n as f64,
            decode_step_s: p.f as f64 / 3.0,
            decode_batch: 2.0,
        }),
        prefix_prompt_tokens: p.b,
        prefix_reused_tokens: p.a,
        busy_prefill_s: p.f as f64,
        busy_decode_s: p.f as f64 * 2.0,
        tenant_service_s: vec![p.f as f64; p.n % 3],
    }
}

fn share(p: &Parts) -> TenantShare {
    TenantShare { tenant: p.a as u32, weight: p.n as u32 + 1, class: PriorityClass::ALL[p.n % 3] }
}

fn compat(p: &Parts) -> KvCompat {
    KvCompat { hash: p.a, fields: vec![("head_dim".into(), p.n.to_string()), ("arch".into(), p.text.clone())] }
}

fn format(p: &Parts) -> KvFormatDesc {
    KvFormatDesc {
        num_layers: p.n % 97,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: p.n,
        layout: if p.flag { KvLayout::TokenMajor } else { KvLayout::HeadMajor },
        dtype: DType::ALL[p.n % 3],
    }
}

fn region(p: &Parts) -> KvRegionDesc {
    KvRegionDesc {
        endpoint: KvEndpointDesc {
            host_key: p.text.clone(),
            pid: p.n as u32,
            tcp: "127.0.0.1:7402".parse().expect("addr"),
        },
        region: p.b,
        fd: 7,
        len: p.a,
    }
}

fn error(p: &Parts) -> ServeError {
    let kinds = [
        ErrorKind::BadRequest,
        ErrorKind::PromptTooLong,
        ErrorKind::Overloaded,
        ErrorKind::Unavailable,
        ErrorKind::Internal,
    ];
    let error = ServeError::new(kinds[p.n % kinds.len()], p.text.clone());
    if p.n.is_multiple_of(2) { error.with_public(p.text.to_uppercase()) } else { error }
}

fn logprob(token: u32, p: &Parts) -> TokenLogprob {
    TokenLogprob { token, logprob: -p.f.abs(), top: vec![(token, -p.f.abs()), (p.n as u32, -2.5)] }
}

/// Message number `kind` built from `p`.
fn build(kind: usize, p: &Parts) -> Msg {
    let sampling = SamplingSpec {
        temperature: p.f.abs(),
        top_k: p.n,
        top_p: 0.5,
        seed: p.flag.then_some(p.b),
        stop_token_ids: p.tokens.clone(),
        ignore_eos: p.flag,
        logprobs: p.flag.then_some(p.n % 21),
        presence_penalty: p.f,
        frequency_penalty: -p.f,
        repetition_penalty: 1.0 + p.f.abs(),
        logit_bias: p.tokens.iter().map(|&t| (t, p.f)).collect(),
        min_tokens: p.n,
        prompt_logprobs: p.flag.then_some(p.n % 3),
        grammar: p
            .flag
            .then(|| Grammar { kind: GrammarKind::ALL[p.n % GrammarKind::ALL.len()], source: p.text.as_str().into() }),
    };
    let finish = if p.flag { Some(Finish::Stop) } else { Some(Finish::Length) };
    let seq = SeqRequest {
        request_id: p.a,
        req: addr(p.b),
        tokens: p.tokens.clone(),
        generated: p.n,
        max_new_tokens: p.n + 1,
        sampling: sampling.clone(),
        delivery: if p.flag { Delivery::Whole } else { Delivery::Stream },
        forks: vec![Fork { request_id: p.b, req: addr(p.a), seed: p.flag.then_some(p.n as u64) }],
        cache_salt: p.flag.then_some(p.a),
        share: share(p),
    };
    match kind {
        0 => Msg::Route {
            request_id: p.a,
            req: addr(p.b),
            tokens: p.n,
            prompt_tokens: p.n / 2,
            exclude: vec![addr(p.a), addr(p.b)],
            prompt: p.tokens.clone(),
            cache_salt: p.flag.then_some(p.b),
            share: share(p),
        },
        1 => Msg::Routed { request_id: p.a, chip: addr(p.b), prefill: p.flag.then(|| addr(p.a)) },
        2 => Msg::RouteFailed { request_id: p.a, error: error(p) },
        3 => Msg::Release { request_id: p.a, chip: addr(p.b) },
        4 => Msg::Enqueue { seq: Box::new(seq) },
        5 => Msg::Abort { request_id: p.a },
        6 => Msg::Generated {
            request_id: p.a,
            chip: addr(p.b),
            tokens: p.tokens.clone(),
            finish,
            logprobs: p.tokens.iter().map(|&t| logprob(t, p)).collect(),
        },
        7 => Msg::Refused { request_id: p.a, chip: addr(p.b), error: error(p), retry: retry(p) },
        8 => Msg::ChipLost { chip: addr(p.a) },
        9 => Msg::Cancel,
        10 => Msg::Client { event: ClientEvent::Tokens { tokens: p.tokens.clone(), logprobs: vec![] } },
        11 => Msg::Client {
            event: ClientEvent::Finished { finish: Finish::Length, prompt_tokens: p.n, completion_tokens: 2 },
        },
        12 => Msg::Client { event: ClientEvent::Failed { error: error(p) } },
        13 => Msg::WorkerReady {
            info: Box::new(ChipInfo {
                format: format(p),
                compat: compat(p),
                staging: p.flag.then(|| region(p)),
                emulated: p.flag.then(|| p.text.clone()),
                num_blocks: p.n,
                block_size: 16,
                max_context: 2048,
                vocab_size: 1024,
                eos_token_ids: p.tokens.clone(),
            }),
        },
        14 => Msg::WorkerFailed { error: p.text.clone() },
        15 => Msg::WorkerPanicked { error: p.text.clone() },
        16 => Msg::StepDone {
            outcome: StepOutcome {
                step: p.a,
                sampled: p.tokens.iter().map(|&t| (t as u64, t)).collect(),
                logprobs: p.tokens.iter().map(|&t| p.flag.then(|| logprob(t, p))).collect(),
                prompt_logprobs: vec![(p.a, addr(p.b), p.n, p.tokens.iter().map(|&t| logprob(t, p)).collect())],
                failed: vec![(p.b, p.text.clone())],
                error: p.flag.then(|| p.text.clone()),
                elapsed_s: p.f as f64,
            },
        },
        17 => Msg::Restart,
        18 => Msg::InjectFault {
            fault: [Fault::WorkerPanic, Fault::DropKvClaim, Fault::Offline, Fault::Online][(p.a % 4) as usize],
        },
        19 => Msg::Report { report: Box::new(report(p)) },
        20 => Msg::ChipCrashed { chip: addr(p.a), error: p.text.clone() },
        21 => Msg::RestartDue { chip: addr(p.a) },
        22 => Msg::GiveUp { reason: p.text.clone() },
        23 => Msg::Heartbeat {
            beat: std::sync::Arc::new(Heartbeat {
                host: HostId(3),
                host_name: p.text.clone(),
                seq: p.b,
                chips: vec![report(p), report(p)],
            }),
        },
        24 => Msg::HostDown { host: HostId(2), host_name: p.text.clone() },
        25 => Msg::HostUp { host: HostId(2), host_name: p.text.clone() },
        26 => Msg::Tick,
        27 => Msg::QueryCluster { reply_to: addr(p.a) },
        28 => Msg::ClusterView { chips: vec![report(p)], hosts_down: vec![p.text.clone()] },
        29 => Msg::Prefill { seq: Box::new(seq), decode: addr(p.b) },
        30 => Msg::KvOffer {
            offer: Box::new(KvOffer {
                seq,
                prefill: addr(p.a),
                prefill_id: p.text.clone(),
                kv_tokens: p.n,
                format: format(p),
                compat: compat(p),
                region: region(p),
            }),
        },
        31 => Msg::KvClaim { request_id: p.a, decode: addr(p.b) },
        32 => Msg::KvDecline { request_id: p.a, decode: addr(p.b), error: error(p), retry: retry(p) },
        33 => Msg::KvReady {
            request_id: p.a,
            layers: p.n..p.n * 2,
            upto: p.n * 3,
            blocks: p.tokens.clone().into(),
            capability: p.flag.then_some([p.b as u8; 16]),
        },
        34 => Msg::KvDone { request_id: p.a },
        35 => Msg::KvCancel { request_id: p.a, reason: p.text.clone() },
        36 => Msg::KvLeaseExpired { request_id: p.a, lease: p.b },
        37 => Msg::KvStaged {
            step: p.a,
            layers: p.n..p.n + 1,
            staged: vec![(p.a, p.n), (p.b, 1)],
            capabilities: vec![(p.a, [p.n as u8; 16])],
        },
        38 => Msg::KvInstalled { request_id: p.a, layers: 0..p.n, upto: p.n, error: p.flag.then(|| p.text.clone()) },
        39 => Msg::SetRole { role: Role::ALL[p.b as usize % 3] },
        40 => Msg::Reroute,
        41 => Msg::Admit {
            client: addr(p.a),
            ask: Box::new(AdmitAsk {
                prompt: p.tokens.clone(),
                max_tokens: p.n,
                sampling: seq.sampling.clone(),
                delivery: seq.delivery,
                forks: vec![ForkAsk { client: addr(p.b), seed: p.flag.then_some(p.a) }],
                tenant: p.b as u32,
            }),
        },
        42 => Msg::Admitted { request_id: p.a, request: addr(p.b) },
        43 => Msg::RequestEnded { request_id: p.a, output_tokens: p.n },
        44 => Msg::QueryAdmission { reply_to: addr(p.a) },
        45 => Msg::AdmissionView { inflight: p.n, max_inflight: p.n * 2 },
        46 => Msg::KvEvents {
            chip: addr(p.a),
            incarnation: p.b,
            events: vec![
                tessera_actors::kv::KvEvent::Stored { seq: p.a, hash: p.b },
                tessera_actors::kv::KvEvent::Removed { seq: p.a.wrapping_add(1), hash: p.a },
            ],
        },
        47 => Msg::KvSnapshotRequest { reply_to: addr(p.b) },
        48 => Msg::Prefilled { request_id: p.a, chip: addr(p.b) },
        49 => Msg::PromptLogprobs {
            request_id: p.a,
            start: p.n,
            logprobs: p.tokens.iter().map(|&t| logprob(t, p)).collect(),
        },
        50 => Msg::Client {
            event: ClientEvent::PromptLogprobs {
                start: p.n,
                logprobs: p.tokens.iter().map(|&t| logprob(t, p)).collect(),
            },
        },
        51 => Msg::Forked { request_id: p.a, req: addr(p.b), chip: addr(p.a), tokens: p.n },
        52 => Msg::Telemetry {
            telemetry: Box::new(Telemetry {
                window_s: p.f as f64,
                admitted: p.a,
                prompt_tokens: p.b,
                ended: p.n as u64,
                output_tokens: p.a / 2,
                prompt_hist: vec![p.n as u32, 1],
                output_hist: vec![2],
            }),
        },
        53 => Msg::Strategies { set: Box::new(strategy_set(p)) },
        54 => Msg::Solve { reason: p.text.clone() },
        55 => Msg::Solved { result: if p.flag { Ok(Box::new(strategy_set(p))) } else { Err(p.text.clone()) } },
        56 => Msg::QueryPlan { reply_to: addr(p.a) },
        57 => Msg::Plan {
            view: Box::new(PlanView {
                auto: p.flag,
                objective: p.text.clone(),
                chips: vec![(p.text.clone(), duty(p))],
                applied: p.flag.then(|| applied(p)),
                latest: Some(strategy_set(p)),
                solving: !p.flag,
                applies: p.b,
            }),
        },
        58 => Msg::ApplyStrategy { id: p.text.clone(), reply_to: addr(p.b) },
        59 => Msg::PlanApplied { result: if p.flag { Ok(Box::new(applied(p))) } else { Err(p.text.clone()) } },
        60 => Msg::ApplyPlan {
            changes: vec![ChipChange {
                chip: addr(p.a),
                duty: p.flag.then(|| duty(p)),
                max_batch_tokens: p.n as u32,
                max_batch_seqs: 3,
            }],
        },
        61 => Msg::Park,
        62 => Msg::SetLimits { max_batch_tokens: p.n as u32, max_batch_seqs: p.b as u32 },
        63 => Msg::ApplyRoles { roles: vec![(p.text.clone(), duty(p))], reply_to: addr(p.a) },
        64 => Msg::KvFirstToken { request_id: p.a, token: p.b as u32 },
        65 => Msg::PromptComputed { request_id: p.a },
        _ => Msg::KvSnapshot { chip: addr(p.a), incarnation: p.n as u64, last_event: p.b, hashes: vec![p.a, p.b] },
    }
}

fn duty(p: &Parts) -> Duty {
    [Duty::Prefill, Duty::Decode, Duty::Both, Duty::Idle][p.n % 4]
}

fn figures(p: &Parts) -> tessera_planner::Figures {
    let x = p.f as f64;
    tessera_planner::Figures {
        goodput_rps: x,
        ttft_p90_s: x / 2.0,
        tpot_p90_s: x / 3.0,
        usd_per_million_tokens: x * 4.0,
        joules_per_request: x * 5.0,
        usd_per_hour: x + 1.0,
    }
}

fn view(p: &Parts) -> StrategyView {
    StrategyView {
        id: format!("s{}-1", p.a),
        summary: p.text.clone(),
        duties: vec![(p.text.clone(), duty(p)), ("b".into(), Duty::Idle)],
        max_batch_tokens: p.n as u32,
        max_batch_seqs: 7,
        figures: figures(p),
        score: p.f as f64 * 2.0,
        moves: vec![(p.text.clone(), duty(p), Duty::Both)],
        drain_s: p.f as f64,
    }
}

fn strategy_set(p: &Parts) -> StrategySet {
    StrategySet {
        seq: p.a,
        at_s: p.f as f64,
        reason: p.text.clone(),
        observed_rate_rps: p.f as f64,
        prefix_hit_rate: p.flag.then_some(0.25),
        workload: tessera_planner::Workload { rate_rps: p.f as f64, isl: p.n as f64, osl: 3.0 },
        slo: tessera_planner::Slo { ttft_s: 1.0, tpot_s: 0.1 },
        objective: "goodput_per_usd".into(),
        chips_up: p.n,
        chips_total: p.n + 1,
        strategies: vec![view(p), view(p)],
        current: p.flag.then(|| view(p)),
        current_keeps_up: p.flag,
        figures_from: "analytic".into(),
        tables_built: p.b,
        tables_reused: p.a,
    }
}

fn applied(p: &Parts) -> AppliedPlan {
    AppliedPlan {
        id: format!("s{}-2", p.a),
        summary: p.text.clone(),
        duties: vec![(p.text.clone(), duty(p))],
        max_batch_tokens: p.n as u32,
        max_batch_seqs: 9,
        at_s: p.f as f64,
        by: "operator".into(),
        moves: vec![],
    }
}

fn retry(p: &Parts) -> Retry {
    [Retry::No, Retry::Elsewhere, Retry::Unavailable][p.n % 3]
}

const KINDS: usize = 67;

/// Fails to compile when a variant is added without a case in `build`.
fn kind_index(m: &Msg) -> usize {
    match m {
        Msg::Route { .. } => 0,
        Msg::Routed { .. } => 1,
        Msg::RouteFailed { .. } => 2,
        Msg::Release { .. } => 3,
        Msg::Enqueue { .. } => 4,
        Msg::Abort { .. } => 5,
        Msg::Generated { .. } => 6,
        Msg::Refused { .. } => 7,
        Msg::ChipLost { .. } => 8,
        Msg::Cancel => 9,
        Msg::Client { event: ClientEvent::Tokens { .. } } => 10,
        Msg::Client { event: ClientEvent::Finished { .. } } => 11,
        Msg::Client { event: ClientEvent::Failed { .. } } => 12,
        Msg::WorkerReady { .. } => 13,
        Msg::WorkerFailed { .. } => 14,
        Msg::WorkerPanicked { .. } => 15,
        Msg::StepDone { .. } => 16,
        Msg::Restart => 17,
        Msg::InjectFault { .. } => 18,
        Msg::Report { .. } => 19,
        Msg::ChipCrashed { .. } => 20,
        Msg::RestartDue { .. } => 21,
        Msg::GiveUp { .. } => 22,
        Msg::Heartbeat { .. } => 23,
        Msg::HostDown { .. } => 24,
        Msg::HostUp { .. } => 25,
        Msg::Tick => 26,
        Msg::QueryCluster { .. } => 27,
        Msg::ClusterView { .. } => 28,
        Msg::Prefill { .. } => 29,
        Msg::KvOffer { .. } => 30,
        Msg::KvClaim { .. } => 31,
        Msg::KvDecline { .. } => 32,
        Msg::KvReady { .. } => 33,
        Msg::KvDone { .. } => 34,
        Msg::KvCancel { .. } => 35,
        Msg::KvLeaseExpired { .. } => 36,
        Msg::KvStaged { .. } => 37,
        Msg::KvInstalled { .. } => 38,
        Msg::SetRole { .. } => 39,
        Msg::Reroute => 40,
        Msg::Admit { .. } => 41,
        Msg::Admitted { .. } => 42,
        Msg::RequestEnded { .. } => 43,
        Msg::QueryAdmission { .. } => 44,
        Msg::AdmissionView { .. } => 45,
        Msg::KvEvents { .. } => 46,
        Msg::KvSnapshotRequest { .. } => 47,
        Msg::KvSnapshot { .. } => 48,
        Msg::Prefilled { .. } => 49,
        Msg::PromptLogprobs { .. } => 50,
        Msg::Client { event: ClientEvent::PromptLogprobs { .. } } => 51,
        Msg::Forked { .. } => 52,
        Msg::Telemetry { .. } => 53,
        Msg::Strategies { .. } => 54,
        Msg::Solve { .. } => 55,
        Msg::Solved { .. } => 56,
        Msg::QueryPlan { .. } => 57,
        Msg::Plan { .. } => 58,
        Msg::ApplyStrategy { .. } => 59,
        Msg::PlanApplied { .. } => 60,
        Msg::ApplyPlan { .. } => 61,
        Msg::Park => 62,
        Msg::SetLimits { .. } => 63,
        Msg::ApplyRoles { .. } => 64,
        Msg::KvFirstToken { .. } => 65,
        Msg::PromptComputed { .. } => 66,
    }
}

fn wire(msg: &Msg) -> Msg {
    let env = Envelope {
        v: PROTOCOL_VERSION,
        from: addr(1),
        to: Some(addr(2)),
        topic: None,
        kind: msg.kind().to_string(),
        corr: 0,
        payload: codec::encode_payload(msg).expect("encodes"),
    };
    let frame = codec::encode(&env).expect("encodes");
    let back = codec::decode(&frame).expect("decodes");
    assert_eq!(back.kind, msg.kind());
    codec::decode_payload(&back.payload).expect("payload decodes")
}

#[test]
fn every_kind_is_covered() {
    let p = Parts { a: 1, b: 2, n: 3, text: "x".into(), tokens: vec![1], flag: true, f: 0.5 };
    let covered: std::collections::BTreeSet<usize> = (0..KINDS).map(|k| kind_index(&build(k, &p))).collect();
    assert_eq!(covered.len(), KINDS);
}

/// Role, KV layout and dtype were strings on the wire before they were enums; they are
/// still written as the same strings, so older and newer nodes read each other.
mod before_the_vocabulary {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Serialize)]
    pub enum Msg {
        SetRole { role: String },
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct KvFormatDesc {
        pub num_layers: usize,
        pub num_kv_heads: usize,
        pub head_dim: usize,
        pub block_size: usize,
        pub num_blocks: usize,
        pub layout: String,
        pub dtype: String,
    }

    /// What an older reader took of a chip report: the role as a string.
    #[derive(Debug, Deserialize)]
    pub struct ChipReport {
        pub role: String,
    }

    pub fn format(layout: &str, dtype: &str) -> KvFormatDesc {
        KvFormatDesc {
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            num_blocks: 1,
            layout: layout.into(),
            dtype: dtype.into(),
        }
    }
}

#[test]
fn string_payloads_of_older_nodes_still_decode() {
    for role in Role::ALL {
        let old = codec::encode_payload(&before_the_vocabulary::Msg::SetRole { role: role.to_string() }).unwrap();
        assert_eq!(codec::encode_payload(&Msg::SetRole { role }).unwrap(), old, "{role}: the same bytes");
        assert_eq!(codec::decode_payload::<Msg>(&old).unwrap(), Msg::SetRole { role });
    }
    let p = Parts { a: 1, b: 2, n: 1, text: "x".into(), tokens: vec![1], flag: true, f: 0.5 };
    let bytes = codec::encode_payload(&before_the_vocabulary::format("token-major", "f16")).unwrap();
    assert_eq!(codec::encode_payload(&format(&p)).unwrap(), bytes, "the same bytes");
    assert_eq!(codec::decode_payload::<KvFormatDesc>(&bytes).unwrap(), format(&p));

    let report = codec::encode_payload(&ChipReport { role: Role::Decode, ..report(&p) }).unwrap();
    let seen: before_the_vocabulary::ChipReport = codec::decode_payload(&report).unwrap();
    assert_eq!(seen.role, "decode");
}

/// A name this node does not know (a newer peer's layout) fails the payload's decoding,
/// naming the value and the accepted ones; the bus counts and drops such a frame.
#[test]
fn unknown_names_are_refused_naming_them() {
    // (layout, dtype, the unknown name, an accepted name the error lists)
    let cases = [("diagonal", "f32", "diagonal", "head-major"), ("head-major", "f8", "f8", "bf16")];
    for (layout, dtype, unknown, accepted) in cases {
        let bytes = codec::encode_payload(&before_the_vocabulary::format(layout, dtype)).unwrap();
        let e = codec::decode_payload::<KvFormatDesc>(&bytes).unwrap_err().to_string();
        assert!(e.contains(unknown) && e.contains(accepted), "{e}");
    }
    let bytes = codec::encode_payload(&before_the_vocabulary::Msg::SetRole { role: "sideways".into() }).unwrap();
    let e = codec::decode_payload::<Msg>(&bytes).unwrap_err().to_string();
    assert!(e.contains("sideways") && e.contains("prefill"), "{e}");
}

proptest! {
    #[test]
    fn every_message_kind_round_trips(kind in 0..KINDS, p in parts()) {
        let msg = build(kind, &p);
        prop_assert_eq!(wire(&msg), msg);
    }

    #[test]
    fn arbitrary_payload_bytes_never_panic_the_decoder(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = codec::decode_payload::<Msg>(&bytes);
    }

    #[test]
    fn truncated_or_mutated_payloads_never_panic(kind in 0..KINDS, p in parts(), cut in any::<prop::sample::Index>(), flip in any::<(prop::sample::Index, u8)>()) {
        let bytes = codec::encode_payload(&build(kind, &p)).unwrap();
        let _ = codec::decode_payload::<Msg>(&bytes[..cut.index(bytes.len() + 1)]);
        let mut mutated = bytes.clone();
        if !mutated.is_empty() {
            let i = flip.0.index(mutated.len());
            mutated[i] ^= flip.1 | 1;
        }
        let _ = codec::decode_payload::<Msg>(&mutated);
    }
}
