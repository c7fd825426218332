//! The load generator against a small stand-in for an OpenAI-compatible server: real HTTP
//! on 127.0.0.1, OpenAI-format SSE chunks cut into odd-sized pieces, a 429 for every
//! `reject_every`-th request.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use super::*;

#[derive(Clone, Default)]
struct FakeServer {
    hits: Arc<AtomicUsize>,
    prompt_words: Arc<AtomicU64>,
    /// Every accepted request's input (`prompt` or `messages`), in order of arrival.
    inputs: Arc<Mutex<Vec<Value>>>,
    /// Every n-th request (counting from 1) gets a 429; 0 for never.
    reject_every: usize,
    usage: bool,
    /// Never answer: for the timeout.
    hang: bool,
    /// The bearer key every request must carry, if any (401 otherwise).
    key: Option<&'static str>,
}

const RATE_LIMITED: &str = "Rate limit exceeded";

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}})))
        .into_response()
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "test-model", "object": "model"}, {"id": "other"}]}))
}

async fn complete(State(fake): State<FakeServer>, headers: axum::http::HeaderMap, Json(req): Json<Value>) -> Response {
    if fake.hang {
        std::future::pending::<()>().await;
    }
    if let Some(key) = fake.key {
        let sent = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if sent != Some(&format!("Bearer {key}")) {
            return error(StatusCode::UNAUTHORIZED, "Incorrect API key provided.");
        }
    }
    let hit = fake.hits.fetch_add(1, Ordering::SeqCst) + 1;
    if fake.reject_every > 0 && hit % fake.reject_every == 0 {
        return error(StatusCode::TOO_MANY_REQUESTS, RATE_LIMITED);
    }
    if req["stream"] != json!(true) || req["stream_options"]["include_usage"] != json!(true) {
        return error(StatusCode::BAD_REQUEST, "this server only streams, with usage");
    }
    if req["ignore_eos"] != json!(true) {
        return error(StatusCode::BAD_REQUEST, "ignore_eos missing");
    }
    let model = req["model"].as_str().unwrap_or_default().to_string();
    if !["test-model", "given"].contains(&model.as_str()) {
        return error(StatusCode::NOT_FOUND, "no such model");
    }
    let chat = req.get("messages").is_some();
    let prompt_tokens = if chat {
        let messages = req["messages"].as_array().map(Vec::as_slice).unwrap_or_default();
        messages.iter().map(|m| m["content"].as_str().unwrap_or_default().split_whitespace().count() as u64).sum()
    } else {
        req["prompt"].as_str().unwrap_or_default().split_whitespace().count() as u64
    };
    fake.prompt_words.fetch_add(prompt_tokens, Ordering::SeqCst);
    if let Ok(mut inputs) = fake.inputs.lock() {
        inputs.push(if chat { req["messages"].clone() } else { req["prompt"].clone() });
    }
    let max_tokens = req["max_tokens"].as_u64().unwrap_or(16);

    let mut events: Vec<Value> = (0..max_tokens)
        .map(|i| {
            let finish = if i + 1 == max_tokens { json!("length") } else { Value::Null };
            let choice = if chat {
                json!({"index": 0, "delta": {"content": format!(" t{i}")}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": format!(" t{i}"), "logprobs": null, "finish_reason": finish})
            };
            let object = if chat { "chat.completion.chunk" } else { "text_completion" };
            json!({"id": "cmpl-1", "object": object, "created": 0, "model": model, "choices": [choice]})
        })
        .collect();
    if fake.usage {
        events.push(json!({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": model,
            "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens}}));
    }
    let mut text: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    text.push_str("data: [DONE]\n\n");
    // Pieces of 7 bytes: events reach the client split mid-line.
    let pieces: Vec<Result<Vec<u8>, Infallible>> = text.into_bytes().chunks(7).map(|c| Ok(c.to_vec())).collect();
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(futures::stream::iter(pieces)))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response"))
}

/// Starts `fake` on an ephemeral port; returns its base URL.
async fn serve(fake: FakeServer) -> String {
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(complete))
        .route("/v1/chat/completions", post(complete))
        .with_state(fake);
    let (listener, url) = listen().await;
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("{url}/")
}

/// A listener on an ephemeral loopback port, and its base URL (no trailing slash).
async fn listen() -> (tokio::net::TcpListener, String) {
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => panic!("cannot bind the test server: {e}"),
    };
    match listener.local_addr() {
        Ok(addr) => (listener, format!("http://{addr}")),
        Err(e) => panic!("test server has no address: {e}"),
    }
}

fn options(url: String) -> ServeBenchOptions {
    ServeBenchOptions {
        url,
        model: None,
        endpoint: Endpoint::Completions,
        load: Load::Closed { concurrency: 3 },
        requests: 12,
        isl: LengthDist::Fixed(16),
        osl: LengthDist::Fixed(5),
        seed: 1,
        warmup: 0,
        timeout_s: 10.0,
        progress: false,
        shared: None,
        trace: None,
        multi_turn: None,
        slo: None,
        api_key: None,
    }
}

#[tokio::test]
async fn every_request_carries_the_api_key() {
    let fake = FakeServer { usage: true, key: Some("tsk_k"), ..FakeServer::default() };
    let url = serve(fake).await;
    let report = run_ok(ServeBenchOptions {
        api_key: Some("tsk_k".into()),
        model: Some("given".into()),
        ..options(url.clone())
    })
    .await;
    assert_eq!((report.requests_ok, report.requests_failed), (12, 0));
    let report = run_ok(ServeBenchOptions { model: Some("given".into()), ..options(url) }).await;
    assert_eq!((report.requests_ok, report.requests_failed), (0, 12), "without the key every request is refused");
}

/// `--tenants`: each tenant's requests carry its own key, at its own load and count,
/// and are reported apart (the server knows one of the two keys).
#[tokio::test]
async fn each_tenant_sends_its_own_key_and_is_reported_apart() {
    let fake = FakeServer { usage: true, key: Some("tsk_a"), ..FakeServer::default() };
    let url = serve(fake).await;
    let file = "[[tenants]]\nname = \"a\"\nkey = \"tsk_a\"\nconcurrency = 2\nrequests = 5\n\
                [[tenants]]\nname = \"b\"\nkey_env = \"B_KEY\"\nrate = 50.0\nosl = \"3\"\n";
    let env = |var: &str| (var == "B_KEY").then(|| "tsk_b".to_string());
    let tenants = match tenants::parse(file, "t.toml", env) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(tenants[1].osl, Some(LengthDist::Fixed(3)));
    let report = match tenants::run(ServeBenchOptions { model: Some("given".into()), ..options(url) }, tenants).await {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let got: Vec<(&str, usize, usize)> =
        report.tenants.iter().map(|t| (t.name.as_str(), t.report.requests_ok, t.report.requests_failed)).collect();
    assert_eq!(got, vec![("a", 5, 0), ("b", 0, 12)], "b's key is not the server's");
    assert_eq!(report.tenants[1].report.rate_rps, Some(50.0));
    let table = report.table();
    assert!(table.lines().nth(1).is_some_and(|l| l.starts_with("a ")), "{table}");
}

#[test]
fn bad_tenants_files_say_what_is_wrong() {
    let env = |_: &str| None;
    // (file, a fragment of the error)
    let cases = [
        ("", "missing field `tenants`"),
        ("tenants = []", "1 to 256"),
        ("[[tenants]]\nname = \"a\"\nrate = 1.0", "`key` or `key_env`"),
        ("[[tenants]]\nname = \"a\"\nkey_env = \"NOPE\"", "$NOPE is not set"),
        ("[[tenants]]\nname = \"a\"\nkey = \"k\"\nrate = 1.0\nconcurrency = 2", "`rate` or `concurrency`"),
        ("[[tenants]]\nname = \"a\"\nkey = \"k\"\nrate = -1.0", "`rate` must be positive"),
        ("[[tenants]]\nname = \"a\"\nkey = \"k\"\nisl = \"many\"", "`isl`"),
        ("[[tenants]]\nname = \"a\"\nkey = \"k\"\n[[tenants]]\nname = \"a\"\nkey = \"j\"", "a name of its own"),
        ("[[tenants]]\nname = \"a\"\nkey = \"k\"\nburst = 2", "unknown field `burst`"),
    ];
    for (file, fragment) in cases {
        match tenants::parse(file, "t.toml", env) {
            Ok(t) => panic!("{file:?} accepted: {t:?}"),
            Err(e) => assert!(e.to_string().contains(fragment) && e.to_string().contains("t.toml"), "{file:?}: {e}"),
        }
    }
}

async fn run_ok(opts: ServeBenchOptions) -> ServeBenchReport {
    match run(opts).await {
        Ok(r) => r,
        Err(e) => panic!("the run should complete: {e}"),
    }
}

#[tokio::test]
async fn closed_loop_counts_tokens_latencies_and_rate_limit_errors() {
    let fake = FakeServer { reject_every: 4, usage: true, ..FakeServer::default() };
    let hits = Arc::clone(&fake.hits);
    let url = serve(fake).await;
    // Warm-up takes hits 1 and 2, so the measured 3..=14 meet the 429s at 4, 8 and 12.
    let report = run_ok(ServeBenchOptions { warmup: 2, ..options(url) }).await;

    assert_eq!(hits.load(Ordering::SeqCst), 14);
    assert_eq!(report.model, "test-model", "first id of /v1/models");
    assert_eq!((report.requests_ok, report.requests_failed), (9, 3));
    assert_eq!(report.errors, vec![ErrorCount { message: format!("HTTP 429: {RATE_LIMITED}"), count: 3 }]);
    assert_eq!((report.input_tokens, report.output_tokens), (9 * 16, 9 * 5));
    assert_eq!(report.requests_without_usage, 0);
    let samples = |l: &Option<LatencySummary>| l.map_or(0, |l| l.samples);
    assert_eq!(samples(&report.ttft), 9);
    assert_eq!(samples(&report.tpot), 9);
    assert_eq!(samples(&report.itl), 9 * 4, "five text chunks, four gaps");
    assert_eq!(samples(&report.e2e), 9);
    assert!(report.duration_s > 0.0 && report.request_throughput_rps > 0.0);
    assert!((report.output_throughput_tok_s / report.request_throughput_rps - 5.0).abs() < 1e-9);
    assert_eq!((report.concurrency, report.rate_rps), (Some(3), None));

    let table = report.table();
    assert!(table.contains("9 ok, 3 failed"), "{table}");
    assert!(table.contains("3 x HTTP 429: Rate limit exceeded"), "{table}");
    let json = serde_json::to_value(&report).unwrap_or_default();
    assert_eq!(json["requests_ok"], json!(9));
    assert_eq!(json["errors"][0]["count"], json!(3));
    assert_eq!(json["endpoint"], json!("completions"));
}

/// Goodput counts the successful requests within both SLOs: all of them under loose
/// bounds, none under a TTFT bound no request can meet; failures never count.
#[tokio::test]
async fn goodput_counts_successes_within_both_slos() {
    for (ttft_ms, tpot_ms, want) in [(60_000.0, 60_000.0, 9), (1e-6, 60_000.0, 0), (60_000.0, 1e-6, 0)] {
        let url = serve(FakeServer { reject_every: 4, usage: true, ..FakeServer::default() }).await;
        let slo = Some(SloLimits { ttft_ms, tpot_ms });
        let report = run_ok(ServeBenchOptions { warmup: 2, slo, ..options(url) }).await;
        let Some(g) = report.goodput else { panic!("no goodput with SLOs given") };
        assert_eq!((report.requests_ok, g.met), (9, want), "TTFT {ttft_ms} ms, TPOT {tpot_ms} ms");
        assert!((g.goodput_rps - want as f64 / report.duration_s).abs() < 1e-9);
        assert!(report.table().contains(&format!("{want} of 12 requests within")), "{}", report.table());
    }
    let url = serve(FakeServer::default()).await;
    assert!(run_ok(options(url)).await.goodput.is_none());
}

#[tokio::test]
async fn poisson_chat_without_usage_falls_back_to_nominal_lengths() {
    let fake = FakeServer { usage: false, ..FakeServer::default() };
    let words = Arc::clone(&fake.prompt_words);
    let url = serve(fake).await;
    let report = run_ok(ServeBenchOptions {
        model: Some("given".into()),
        endpoint: Endpoint::Chat,
        load: Load::Poisson { rate_rps: 1000.0 },
        requests: 6,
        isl: LengthDist::Uniform { lo: 4, hi: 8 },
        osl: LengthDist::Fixed(3),
        ..options(url)
    })
    .await;

    assert_eq!((report.requests_ok, report.requests_failed), (6, 0), "{:?}", report.errors);
    assert_eq!(report.output_tokens, 18, "one token per text chunk");
    assert_eq!(report.input_tokens, words.load(Ordering::SeqCst), "nominal ISL = words sent");
    assert!((6 * 4..=6 * 8).contains(&report.input_tokens));
    assert_eq!(report.requests_without_usage, 6);
    assert_eq!((report.model.as_str(), report.rate_rps, report.concurrency), ("given", Some(1000.0), None));
}

#[tokio::test]
async fn a_request_past_its_timeout_is_a_failure() {
    let url = serve(FakeServer { hang: true, ..FakeServer::default() }).await;
    let report = run_ok(ServeBenchOptions { requests: 2, timeout_s: 0.1, ..options(url) }).await;
    assert_eq!((report.requests_ok, report.requests_failed), (0, 2));
    assert_eq!(report.errors, vec![ErrorCount { message: "timed out after 0.1 s".into(), count: 2 }]);
    assert_eq!(report.ttft, None);
}

#[tokio::test]
async fn a_warm_up_that_only_fails_stops_the_run() {
    let url = serve(FakeServer { reject_every: 1, ..FakeServer::default() }).await;
    let result = run(ServeBenchOptions { warmup: 2, ..options(url) }).await;
    assert!(
        matches!(&result, Err(LoadgenError::WarmupFailed { count: 2, first }) if first.contains("429")),
        "{result:?}"
    );
}

#[tokio::test]
async fn no_server_no_model() {
    // A port that was just free: nothing listens there.
    let addr = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
        Ok(a) => a,
        Err(e) => panic!("cannot reserve a port: {e}"),
    };
    let result = run(options(format!("http://{addr}"))).await;
    assert!(matches!(result, Err(LoadgenError::ModelDiscovery { .. })), "{result:?}");
}

/// A server that answers one request per connection and drops the next one a client
/// sends on it unanswered, without having said `Connection: close` (as a server does
/// whose keep-alive limit or idle timeout ends a connection as a request arrives):
/// each request on a connection of its own.
async fn one_request_per_connection() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (listener, url) = listen().await;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The whole first request (headers and a body well under 64 KiB).
                let mut request = Vec::new();
                let mut buf = [0u8; 65536];
                loop {
                    let Ok(n) = socket.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    let Some(end) = text.find("\r\n\r\n") else { continue };
                    let length = text[..end]
                        .lines()
                        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(str::to_owned))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        break;
                    }
                }
                let chunk = |text: &str, finish: Value| {
                    json!({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
                };
                let usage = json!({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
                let body = format!(
                    "data: {}\n\ndata: {}\n\ndata: {usage}\n\ndata: [DONE]\n\n",
                    chunk(" a", Value::Null),
                    chunk(" b", json!("length"))
                );
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                if socket.write_all(head.as_bytes()).await.is_err() || socket.write_all(body.as_bytes()).await.is_err()
                {
                    return;
                }
                // Whatever comes next on this connection goes unanswered.
                let _ = socket.read(&mut buf).await;
            });
        }
    });
    url
}

/// A server may end a kept-alive connection just as the next request goes out on it;
/// that request never reached it, and must not be counted a failure of the server.
#[tokio::test]
async fn a_server_that_ends_kept_alive_connections_loses_no_request() {
    let url = one_request_per_connection().await;
    let opts = ServeBenchOptions {
        model: Some("m".into()),
        load: Load::Closed { concurrency: 1 },
        requests: 6,
        osl: LengthDist::Fixed(2),
        ..options(url)
    };
    let report = run_ok(opts).await;
    assert_eq!((report.requests_ok, report.requests_failed), (6, 0), "{:?}", report.errors);
    assert_eq!(report.output_tokens, 12);
}

#[test]
fn endpoint_names() {
    assert_eq!("chat".parse::<Endpoint>().ok(), Some(Endpoint::Chat));
    assert_eq!("completions".parse::<Endpoint>().ok(), Some(Endpoint::Completions));
    assert!("embeddings".parse::<Endpoint>().is_err());
}

#[tokio::test]
async fn invalid_options_are_refused_before_any_request() {
    let url = "http://127.0.0.1:9".to_string();
    let chats = Some(MultiTurn { conversations: 2, turns: 3 });
    let trace = trace::generate(2, 1.0, LengthDist::Fixed(8), LengthDist::Fixed(2), 0.0, 0).ok();
    for opts in [
        ServeBenchOptions { requests: 0, ..options(url.clone()) },
        ServeBenchOptions { timeout_s: 0.0, ..options(url.clone()) },
        ServeBenchOptions { multi_turn: chats, trace, ..options(url.clone()) },
    ] {
        assert!(matches!(run(opts).await, Err(LoadgenError::InvalidOptions(_))));
    }
    for opts in [
        ServeBenchOptions { multi_turn: Some(MultiTurn { conversations: 0, turns: 3 }), ..options(url.clone()) },
        ServeBenchOptions { multi_turn: Some(MultiTurn { conversations: 2, turns: 0 }), ..options(url) },
    ] {
        assert!(matches!(run(opts).await, Err(LoadgenError::Workload(_))));
    }
}

/// The fake's answer to a request for `n` tokens.
fn fake_answer(n: usize) -> String {
    (0..n).map(|i| format!(" t{i}")).collect()
}

#[tokio::test]
async fn multi_turn_completions_extend_the_last_prompt_and_its_answer() {
    let fake = FakeServer { usage: true, ..FakeServer::default() };
    let inputs = Arc::clone(&fake.inputs);
    let url = serve(fake).await;
    let shape = MultiTurn { conversations: 2, turns: 3 };
    let opts = ServeBenchOptions { multi_turn: Some(shape), load: Load::Closed { concurrency: 2 }, ..options(url) };
    let workload = Workload { isl: opts.isl, osl: opts.osl, load: opts.load, seed: opts.seed, shared: None };
    let plan = workload.conversations(shape).unwrap_or_default();
    let report = run_ok(opts).await;

    assert_eq!((report.requests_ok, report.requests_failed), (6, 0), "{:?}", report.errors);
    // Turns of 16 words with answers of 5: prompts of 16, 16+5+16 and 37+5+16 words.
    assert_eq!(report.input_tokens, 2 * (16 + 37 + 58));
    assert_eq!(report.multi_turn, Some(shape));
    assert_eq!(report.oracle_hit_rate, Some(multiturn::oracle_hit_rate(&plan)));
    // Of 111 prompt tokens a conversation sends, 21 + 42 were cached before.
    assert!((multiturn::oracle_hit_rate(&plan) - 63.0 / 111.0).abs() < 1e-12);

    let prompts: Vec<String> = match inputs.lock() {
        Ok(inputs) => inputs.iter().map(|p| p.as_str().unwrap_or_default().to_string()).collect(),
        Err(e) => panic!("the fake server panicked: {e}"),
    };
    assert_eq!(prompts.len(), 6);
    let answer = fake_answer(5);
    let openings = prompts.iter().filter(|p| p.split_whitespace().count() == 16).count();
    assert_eq!(openings, 2);
    for (i, prompt) in prompts.iter().enumerate() {
        if prompt.split_whitespace().count() == 16 {
            continue;
        }
        // The turn before it reached the server earlier, and was answered before it was sent.
        let extends = prompts[..i].iter().any(|p| prompt.starts_with(&format!("{p}{answer} ")));
        assert!(extends, "turn {prompt:?} extends no earlier prompt and its answer");
    }
    let table = report.table();
    assert!(table.contains("2 conversations of 3 turns, 2 under way at once"), "{table}");
    assert!(table.contains("oracle hit rate 0.568"), "{table}");
}

/// Chats with system prompts: every turn of chat i opens with system prompt i mod 2,
/// the same text each time, and the oracle misses each of them once.
#[tokio::test]
async fn multi_turn_chats_open_with_their_groups_system_prompt() {
    let fake = FakeServer { usage: true, ..FakeServer::default() };
    let inputs = Arc::clone(&fake.inputs);
    let url = serve(fake).await;
    let shape = MultiTurn { conversations: 4, turns: 2 };
    let shared = Some(SharedPrefix { groups: 2, words: 10 });
    let opts =
        ServeBenchOptions { multi_turn: Some(shape), shared, load: Load::Closed { concurrency: 2 }, ..options(url) };
    let workload = Workload { isl: opts.isl, osl: opts.osl, load: opts.load, seed: opts.seed, shared };
    let plan = workload.conversations(shape).unwrap_or_default();
    let report = run_ok(opts).await;
    assert_eq!((report.requests_ok, report.requests_failed), (8, 0), "{:?}", report.errors);
    // Prompts of 10 + 16 and 10 + 16 + 5 + 16 words.
    assert_eq!(report.input_tokens, 4 * (26 + 47));
    assert_eq!(report.oracle_hit_rate, Some(multiturn::oracle_hit_rate(&plan)));
    let prompts: Vec<String> = match inputs.lock() {
        Ok(inputs) => inputs.iter().map(|p| p.as_str().unwrap_or_default().to_string()).collect(),
        Err(e) => panic!("the fake server panicked: {e}"),
    };
    let systems: std::collections::BTreeSet<String> =
        prompts.iter().map(|p| p.split_whitespace().take(10).collect::<Vec<_>>().join(" ")).collect();
    assert_eq!(systems.len(), 2, "two system prompts open every turn: {systems:?}");
}

#[tokio::test]
async fn multi_turn_chat_sends_the_conversation_as_messages() {
    let fake = FakeServer { usage: true, ..FakeServer::default() };
    let inputs = Arc::clone(&fake.inputs);
    let url = serve(fake).await;
    let opts = ServeBenchOptions {
        endpoint: Endpoint::Chat,
        multi_turn: Some(MultiTurn { conversations: 1, turns: 3 }),
        load: Load::Poisson { rate_rps: 1000.0 },
        osl: LengthDist::Fixed(2),
        ..options(url)
    };
    let report = run_ok(opts).await;
    assert_eq!((report.requests_ok, report.requests_failed), (3, 0), "{:?}", report.errors);

    let sent: Vec<Vec<Value>> = match inputs.lock() {
        Ok(inputs) => inputs.iter().map(|m| m.as_array().cloned().unwrap_or_default()).collect(),
        Err(e) => panic!("the fake server panicked: {e}"),
    };
    assert_eq!(sent.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 3, 5]);
    for pair in sent.windows(2) {
        let (before, after) = (&pair[0], &pair[1]);
        assert_eq!(after[..before.len()], before[..], "earlier messages are sent again unchanged");
        assert_eq!(after[before.len()], json!({"role": "assistant", "content": fake_answer(2)}));
        assert_eq!(after[before.len() + 1]["role"], json!("user"));
    }
}

#[tokio::test]
async fn a_failed_turn_ends_its_conversation() {
    // The second request of the run is refused: turn 2 fails, turn 3 cannot be written.
    let fake = FakeServer { usage: true, reject_every: 2, ..FakeServer::default() };
    let hits = Arc::clone(&fake.hits);
    let url = serve(fake).await;
    let opts = ServeBenchOptions { multi_turn: Some(MultiTurn { conversations: 1, turns: 3 }), ..options(url) };
    let report = run_ok(opts).await;
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    assert_eq!((report.requests_ok, report.requests_failed), (1, 2));
    assert_eq!(
        report.errors,
        vec![
            ErrorCount { message: format!("HTTP 429: {RATE_LIMITED}"), count: 1 },
            ErrorCount { message: TURN_NOT_SENT.into(), count: 1 },
        ]
    );
}
