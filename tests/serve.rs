//! Serving end to end: `tessera up` / `tessera node` processes on loopback, driven over
//! HTTP. Greedy answers must equal `tessera generate`'s (DESIGN.md §9 invariant 5)
//! whether requests are batched, streamed, or replayed after a host or worker dies
//! (invariant 1), and every KV block is free once requests drain (invariant 2).
//! Every wait has a deadline; every process is stopped by its pid when a test ends.

use crate::serve_kit::*;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const HEARTBEAT_TIMEOUT_MS: u64 = 1000;

fn chat_body(user: &str, max_tokens: usize, stream: bool) -> Value {
    let mut body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens,
        "temperature": 0, "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// An OpenAI error body with `status`; returns its `error` object.
#[track_caller]
fn assert_api_error(r: &HttpResponse, status: u16, kind: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    let obj = e.as_object().unwrap();
    for key in ["param", "code"] {
        assert!(obj.contains_key(key), "`{key}` missing: {v}");
    }
    e.clone()
}

#[test]
fn two_hosts_serve_the_same_greedy_text_as_generate() {
    const MAX_TOKENS: usize = 24;
    let prompts = ["Hello world", "The quick brown fox", "Once upon a time there was"];
    // References first: single-sequence runs without any cluster.
    let want: Vec<(Generated, Generated)> =
        prompts.iter().map(|p| (generate(p, MAX_TOKENS, false), generate(&chatml(p), MAX_TOKENS, false))).collect();

    let topo = topology(&["h0", "h1"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);

    let models = get(gw, "/v1/models");
    assert_eq!(models.status, 200, "{}", models.body);
    let models = models.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL, "{models}");
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");

    // Every prompt through every endpoint and mode at once, so both hosts' chips serve.
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for (prompt, (plain, chat)) in prompts.iter().zip(&want) {
            handles.push(s.spawn(move || {
                let r = post_json(gw, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, false));
                assert_eq!(r.status, 200, "{}", r.body);
                let v = r.json();
                assert_eq!(v["object"], "text_completion", "{v}");
                assert_eq!(v["model"], MODEL, "{v}");
                assert_eq!(v["choices"][0]["text"], plain.text, "completion of {prompt:?}");
                assert_eq!(v["choices"][0]["finish_reason"], plain.finish_reason, "{v}");
                assert_usage(&v["usage"], plain.prompt_tokens, plain.completion_tokens, prompt);
            }));
            handles.push(s.spawn(move || {
                let sse = post_stream(gw, "/v1/completions", &completion_body(prompt, MAX_TOKENS, true, false))
                    .unwrap_or_else(|r| panic!("{} {}", r.status, r.body));
                let (got, raw) = read_stream(sse, false);
                assert_eq!(got.text, plain.text, "streamed completion of {prompt:?}");
                assert_eq!(got.finish_reason.as_deref(), Some(plain.finish_reason.as_str()));
                assert!(got.text_chunks > 1 || plain.completion_tokens <= 1, "streamed in pieces: {raw}");
                let usage = got.usage.expect("include_usage sends usage");
                assert_usage(&usage, plain.prompt_tokens, plain.completion_tokens, prompt);
            }));
            handles.push(s.spawn(move || {
                let r = post_json(gw, "/v1/chat/completions", &chat_body(prompt, MAX_TOKENS, false));
                assert_eq!(r.status, 200, "{}", r.body);
                let v = r.json();
                assert_eq!(v["object"], "chat.completion", "{v}");
                assert_eq!(v["choices"][0]["message"]["role"], "assistant", "{v}");
                assert_eq!(v["choices"][0]["message"]["content"], chat.text, "chat of {prompt:?}");
                assert_eq!(v["choices"][0]["finish_reason"], chat.finish_reason, "{v}");
                // The prompt is the template's rendering, tokenized as generate does it.
                assert_usage(&v["usage"], chat.prompt_tokens, chat.completion_tokens, prompt);
            }));
            handles.push(s.spawn(move || {
                let sse = post_stream(gw, "/v1/chat/completions", &chat_body(prompt, MAX_TOKENS, true))
                    .unwrap_or_else(|r| panic!("{} {}", r.status, r.body));
                let (got, _) = read_stream(sse, true);
                assert_eq!(got.text, chat.text, "streamed chat of {prompt:?}");
                assert_eq!(got.finish_reason.as_deref(), Some(chat.finish_reason.as_str()));
                let usage = got.usage.expect("include_usage sends usage");
                assert_usage(&usage, chat.prompt_tokens, chat.completion_tokens, prompt);
            }));
        }
        for h in handles {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e);
            }
        }
    });

    // The view comes from heartbeats (every 100 ms): wait until it shows the work done.
    let served = |h: &Value| ["h0-cpu0", "h1-cpu0"].iter().all(|id| chip(h, id)["steps"].as_u64() > Some(0));
    let health =
        wait_health(gw, "KV freed after the requests", Duration::from_secs(5), |h| drained(h, &[]) && served(h));
    assert_eq!(health["status"], "ok");
    assert_eq!(health["chips_up"], 2);
    assert_eq!(health["hosts_down"], json!([]));
    for id in ["h0-cpu0", "h1-cpu0"] {
        assert!(chip(&health, id)["steps"].as_u64() > Some(0), "{id} served nothing: {health:#}");
    }
    let metrics = get(gw, "/metrics");
    assert_eq!(metrics.status, 200);
    assert!(metrics.body.contains("tessera_request_ttft_seconds"), "{}", metrics.body);

    // Ctrl-C drains: a request in flight when `up` is interrupted still completes.
    let sse = post_stream(gw, "/v1/completions", &completion_body(prompts[0], 200, true, true))
        .unwrap_or_else(|r| panic!("{} {}", r.status, r.body));
    let mut reader = StreamReader::new(sse, false);
    while reader.out.text.is_empty() {
        assert!(reader.step(), "the stream ended before any text");
    }
    let up = cluster.proc("up");
    up.interrupt();
    let (got, raw) = reader.finish();
    assert_eq!(got.finish_reason.as_deref(), Some("length"), "{raw}");
    assert_eq!(got.usage.expect("usage")["completion_tokens"], 200, "{raw}");
    let status = up.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| panic!("up did not stop:\n{}", up.log()));
    assert!(status.success(), "up exited with {status}:\n{}", up.log());
    let log = up.log();
    for host in ["h0", "h1"] {
        assert!(log.contains(&format!("host {host} stopped")), "{host} did not drain and stop:\n{log}");
    }
}

#[test]
fn in_process_hosts_serve_and_stop_on_interrupt() {
    const MAX_TOKENS: usize = 16;
    let prompt = "Hello world";
    let want = generate(prompt, MAX_TOKENS, false);
    let topo = topology(&["h0", "h1"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::up_in_process(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    for _ in 0..4 {
        let r = post_json(gw, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, false));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.text);
    }
    let up = cluster.proc("up");
    up.interrupt();
    let status = up.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| panic!("up did not stop:\n{}", up.log()));
    assert!(status.success(), "up exited with {status}:\n{}", up.log());
    assert!(up_host_pids(&up.log()).is_empty(), "no child processes in-process");
}

#[test]
fn concurrent_requests_are_batched_and_match_generate() {
    const MAX_TOKENS: usize = 120;
    let prompts: Vec<String> = (0..10).map(|i| format!("Request number {i} asks for a story")).collect();
    let topo = topology(&["h0", "h1"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    cluster.wait_ready(2);

    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .zip(&want)
            .map(|(prompt, want)| {
                s.spawn(move || {
                    let r = post_json(gw, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, true));
                    assert_eq!(r.status, 200, "{}", r.body);
                    let v = r.json();
                    assert_eq!(v["choices"][0]["text"], want.text, "batched completion of {prompt:?}");
                    assert_eq!(v["choices"][0]["finish_reason"], "length");
                    assert_usage(&v["usage"], want.prompt_tokens, MAX_TOKENS, prompt);
                })
            })
            .collect();
        for h in handles {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(e);
            }
        }
    });
    let most = |h: &Value| h["chips"].as_array().unwrap().iter().filter_map(|c| c["max_step_seqs"].as_u64()).max();
    let done = |h: &Value| {
        h["chips"].as_array().unwrap().iter().filter_map(|c| c["steps"].as_u64()).sum::<u64>() >= MAX_TOKENS as u64
    };
    let health = wait_health(gw, "KV freed after the batch", Duration::from_secs(5), |h| drained(h, &[]) && done(h));
    assert!(most(&health) > Some(1), "no step ran more than one sequence: {health:#}");
}

/// Requests long enough to be mid-stream when a fault hits, and their no-fault answers:
/// 400 tokens took ~0.34 s on the tiny model, short enough that under load a victim
/// could finish its streams between the health check that sees them and the fault.
const FAULT_PROMPTS: usize = 8;
const FAULT_MAX_TOKENS: usize = 1200;

fn fault_prompts() -> Vec<String> {
    (0..FAULT_PROMPTS).map(|i| format!("Tell me about the {i}th chip")).collect()
}

fn fault_references() -> &'static [Generated] {
    static REFS: OnceLock<Vec<Generated>> = OnceLock::new();
    REFS.get_or_init(|| fault_prompts().iter().map(|p| generate(p, FAULT_MAX_TOKENS, true)).collect())
}

/// Hosts `h0` and `h1`, one CPU chip each, as [`topology`] makes them, with
/// `cluster_extra` TOML (e.g. a `[security]` table).
fn two_hosts(cluster_extra: &str) -> Topology {
    let chip = "kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1\n".to_string();
    let chips: Vec<ChipDef> =
        ["h0", "h1"].iter().map(|h| ChipDef { host: h, id: format!("{h}-cpu0"), toml: chip.clone() }).collect();
    topology_of(&chips, cluster_extra, "", HEARTBEAT_TIMEOUT_MS)
}

#[test]
fn requests_survive_a_killed_host() {
    killed_host_drill("");
}

/// h1 is SIGKILLed mid-stream: every request still completes with `generate`'s text.
pub(crate) fn killed_host_drill(cluster_extra: &str) {
    let topo = two_hosts(cluster_extra);
    let mut cluster = Cluster::nodes(&topo, &["h0", "h1"]);
    let gw = cluster.gateway;
    fault_references();
    cluster.wait_ready(2);
    let h1_pid = cluster.proc("h1").pid();
    let mut detected_after = None;
    stream_through_fault(gw, "h1-cpu0", &fault_prompts(), fault_references(), FAULT_MAX_TOKENS, || {
        signal(h1_pid, "KILL");
        let killed = Instant::now();
        let limit = Duration::from_millis(HEARTBEAT_TIMEOUT_MS + 1500);
        let health = wait_health(gw, "h1 reported down", limit, |h| {
            chip(h, "h1-cpu0")["state"] != "up" && h["hosts_down"].as_array().is_some_and(|d| d.contains(&json!("h1")))
        });
        detected_after = Some(killed.elapsed());
        assert_eq!(chip(&health, "h0-cpu0")["state"], "up", "{health:#}");
        assert_eq!(health["chips_up"], 1, "{health:#}");
    });
    eprintln!("h1's death was reported after {:?}", detected_after.unwrap());
    assert!(cluster.proc("h1").wait_exit(Duration::from_secs(5)).is_some(), "h1 was killed");
    wait_health(gw, "h0's KV freed", Duration::from_secs(5), |h| drained(h, &["h0-cpu0"]));
}

/// A model instance of two pipeline stages (1 and 3 layers) on chips `a` and `b` of
/// the hosts named, beside a whole-model chip on `h0`, serves as chip `id`, running on
/// `a`'s host; killing `h1` mid-stream loses no request: the instance is down (with its
/// host, or on its next step over the broken stage link), and its requests replay on
/// `h0`'s chip, every text equal to single-chip `generate`'s.
fn instance_survives_h1_killed(id: &str, a: (&'static str, &str), b: (&'static str, &str)) {
    let cpu = "kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1".to_string();
    let chips = [
        ChipDef { host: "h0", id: "h0-cpu0".into(), toml: cpu.clone() },
        ChipDef { host: a.0, id: a.1.into(), toml: cpu.clone() },
        ChipDef { host: b.0, id: b.1.into(), toml: cpu },
    ];
    let instance = format!("[[instances]]\nid = \"{id}\"\nchips = [\"{}\", \"{}\"]\nsplit = [1, 3]\n", a.1, b.1);
    let topo = topology_of(&chips, &instance, "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0", "h1"]);
    let gw = cluster.gateway;
    fault_references();
    cluster.wait_ready(2);
    let health = get(gw, "/health").json();
    assert_eq!(chip(&health, id)["state"], "up", "the instance is one chip of the cluster: {health:#}");
    assert_eq!(chip(&health, id)["host"], a.0, "it runs on its first stage's host: {health:#}");
    let h1_pid = cluster.proc("h1").pid();
    stream_through_fault(gw, id, &fault_prompts(), fault_references(), FAULT_MAX_TOKENS, || {
        signal(h1_pid, "KILL");
        let limit = Duration::from_millis(HEARTBEAT_TIMEOUT_MS + 1500);
        wait_health(gw, "the instance reported down", limit, |h| chip(h, id)["state"] != "up");
    });
    wait_health(gw, "h0's KV freed", Duration::from_secs(5), |h| drained(h, &["h0-cpu0"]));
}

#[test]
fn requests_on_a_pipeline_instance_survive_its_host_killed() {
    instance_survives_h1_killed("h1-pp", ("h1", "h1-a"), ("h1", "h1-b"));
}

/// The second stage on another host: h0 runs the instance, h1's stage server runs
/// layers 1..4 for it, activations crossing over the stage link.
#[test]
fn requests_on_an_instance_survive_its_second_stages_host_killed() {
    instance_survives_h1_killed("h0-pp", ("h0", "h0-a"), ("h1", "h1-b"));
}

#[test]
fn requests_survive_a_worker_panic_and_the_chip_restarts() {
    worker_panic_drill("");
}

/// h1's chip worker panics mid-stream and restarts; then it is taken offline and back.
pub(crate) fn worker_panic_drill(cluster_extra: &str) {
    let topo = two_hosts(cluster_extra);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    fault_references();
    cluster.wait_ready(2);
    stream_through_fault(gw, "h1-cpu0", &fault_prompts(), fault_references(), FAULT_MAX_TOKENS, || {
        let r = post_json(gw, "/admin/faults", &json!({"chip": "h1-cpu0", "fault": "worker_panic"}));
        assert_eq!(r.status, 202, "{}", r.body);
    });
    let health = wait_health(gw, "h1-cpu0 restarted, all KV free", Duration::from_secs(10), |h| {
        chip(h, "h1-cpu0")["state"] == "up" && chip(h, "h1-cpu0")["restarts"] == 1 && drained(h, &[])
    });
    assert_eq!(health["chips_up"], 2, "{health:#}");
    assert_eq!(health["hosts_down"], json!([]), "{health:#}");
    // The restarted chip serves again.
    let r = post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false));
    assert_eq!(r.status, 200, "{}", r.body);

    // Offline: left down (no restart) while the other chip serves, until brought online.
    let r = post_json(gw, "/admin/faults", &json!({"chip": "h1-cpu0", "fault": "chip_offline"}));
    assert_eq!(r.status, 202, "{}", r.body);
    wait_health(gw, "h1-cpu0 offline", Duration::from_secs(10), |h| chip(h, "h1-cpu0")["state"] == "failed");
    for _ in 0..3 {
        let r = post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let health = try_health(gw).expect("/health answers");
    assert_eq!(chip(&health, "h1-cpu0")["state"], "failed", "no restart while offline: {health:#}");
    let r = post_json(gw, "/admin/faults", &json!({"chip": "h1-cpu0", "fault": "chip_online"}));
    assert_eq!(r.status, 202, "{}", r.body);
    wait_health(gw, "h1-cpu0 back online", Duration::from_secs(10), |h| {
        chip(h, "h1-cpu0")["state"] == "up" && h["chips_up"] == 2
    });
    let r = post_json(gw, "/admin/faults", &json!({"chip": "h1-cpu0", "fault": "chip_melted"}));
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn gateway_errors_have_status_and_openai_shape() {
    let topo = topology(&["h0"], "max_inflight_requests = 1", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    cluster.wait_ready(1);

    let r = post(gw, "/v1/completions", "{\"model\": \"builtin:tiny\", \"prompt\": ");
    assert_api_error(&r, 400, "invalid_request_error");
    let r = post(gw, "/v1/chat/completions", "not json at all");
    assert_api_error(&r, 400, "invalid_request_error");
    let mut bad = completion_body("Hi", 4, false, false);
    bad["temperature"] = json!(5.0);
    let e = assert_api_error(&post_json(gw, "/v1/completions", &bad), 400, "invalid_request_error");
    assert_eq!(e["param"], "temperature", "{e}");
    let mut unknown = completion_body("Hi", 4, false, false);
    unknown["model"] = json!("gpt-nonexistent");
    let e = assert_api_error(&post_json(gw, "/v1/completions", &unknown), 404, "invalid_request_error");
    assert_eq!(e["code"], "model_not_found", "{e}");
    let long = json!({"model": MODEL, "prompt": vec![5u32; 2048], "max_tokens": 1, "temperature": 0});
    let e = assert_api_error(&post_json(gw, "/v1/completions", &long), 413, "invalid_request_error");
    assert_eq!(e["code"], "context_length_exceeded", "{e}");
    // A text no context could hold is refused before it is tokenized.
    let huge = completion_body(&"lorem ipsum ".repeat(20_000), 4, false, false);
    let e = assert_api_error(&post_json(gw, "/v1/completions", &huge), 413, "invalid_request_error");
    assert!(e["message"].as_str().is_some_and(|m| m.contains("bytes of text")), "{e}");
    // A body over the limit, an unknown path and a wrong method: OpenAI error JSON too.
    // (Announced, not sent: the gateway answers from the header and closes.)
    let raw = {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(gw).expect("connect");
        let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                    content-length: 67108864\r\n\r\n";
        c.write_all(head.as_bytes()).expect("send the head");
        c.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    assert!(raw.starts_with("HTTP/1.1 413"), "{raw}");
    assert!(raw.contains("\"code\":\"request_too_large\""), "{raw}");
    let e = assert_api_error(&get(gw, "/v1/nothing-here"), 404, "invalid_request_error");
    assert_eq!(e["code"], "unknown_url", "{e}");
    let e = assert_api_error(&get(gw, "/v1/completions"), 405, "invalid_request_error");
    assert_eq!(e["code"], "method_not_allowed", "{e}");

    // One long stream holds the only in-flight slot: a second request is refused.
    let mut sse = post_stream(gw, "/v1/completions", &completion_body("A long story", 2000, true, true))
        .unwrap_or_else(|r| panic!("{} {}", r.status, r.body));
    for _ in 0..3 {
        sse.next_data().expect("chunks while streaming");
    }
    let e = assert_api_error(
        &post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false)),
        429,
        "rate_limit_error",
    );
    assert_eq!(e["code"], "overloaded", "{e}");
    let busy = get(gw, "/health").json();
    assert_eq!(busy["inflight_requests"], 1, "{busy:#}");
    // The client goes away mid-stream: the request is cancelled and its KV freed. First
    // make sure the (heartbeat-fed) view shows it running, so "freed" is not a stale view.
    wait_health(gw, "the stream shows as running", Duration::from_secs(5), |h| chip(h, "h0-cpu0")["running"] == 1);
    drop(sse);
    let health = wait_health(gw, "KV freed after the client left", Duration::from_secs(5), |h| drained(h, &[]));
    // Generating all 2000 tokens takes 2000 steps (and the KV would be held until then):
    // fewer ran, so the request was cancelled. (How many depends on how fast steps are.)
    assert!(chip(&health, "h0-cpu0")["steps"].as_u64() < Some(2000), "the request was not cancelled: {health:#}");
    // And the slot is free again.
    let r = post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn no_healthy_chip_is_503() {
    let topo = topology(&["h0"], "", "memory_limit = \"1KiB\"", HEARTBEAT_TIMEOUT_MS);
    let cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    let health = wait_health(gw, "the chip that cannot load is given up on", Duration::from_secs(20), |h| {
        h["chips"][0]["state"] == "failed"
    });
    assert_eq!(health["status"], "unavailable", "{health:#}");
    assert_eq!(health["chips_up"], 0, "{health:#}");
    assert!(health["chips"][0]["error"].as_str().is_some_and(|e| !e.is_empty()), "{health:#}");
    let r = get(gw, "/health");
    assert_eq!(r.status, 503, "{}", r.body);
    let e = assert_api_error(
        &post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false)),
        503,
        "service_unavailable",
    );
    assert_eq!(e["code"], "no_healthy_chip", "{e}");
    // The router's diagnostic names the chip and its state; that is for the log only.
    assert!(!e["message"].as_str().is_some_and(|m| m.contains("h0-cpu0")), "{e}");
    let e =
        assert_api_error(&post_json(gw, "/v1/chat/completions", &chat_body("Hi", 4, true)), 503, "service_unavailable");
    assert_eq!(e["code"], "no_healthy_chip", "{e}");
    assert!(!e["message"].as_str().is_some_and(|m| m.contains("h0-cpu0")), "{e}");
}

/// Thousands of words per prompt, ~`bytes` long.
fn heavy_prompt(bytes: usize, seed: usize) -> String {
    let words = ["chip", "token", "prefill", "decode", "cache", "router", "tile", "mosaic", "lorem", "ipsum"];
    let mut s = String::with_capacity(bytes + 16);
    let mut i = seed;
    while s.len() < bytes {
        s.push_str(words[i % words.len()]);
        s.push(' ');
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

/// Eight clients post multi-megabyte prompts (the gateway is told to accept that much
/// text, so each one is parsed and tokenized): the host's heartbeats never starve —
/// neither supervisor declares a host down — `/health` answers within 1 s throughout,
/// each heavy request gets a clean 413, and normal requests are still served.
#[test]
fn heavy_prompts_do_not_starve_heartbeats_or_health() {
    let topo = topology(&["h0", "h1"], "max_prompt_bytes = 4194304", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0", "h1"]);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    let prompts: Vec<String> = (0..8).map(|i| heavy_prompt(3 << 20, i)).collect();
    let done = std::sync::atomic::AtomicUsize::new(0);
    let mut slowest_health = Duration::ZERO;
    std::thread::scope(|s| {
        for prompt in &prompts {
            let done = &done;
            s.spawn(move || {
                let r = post_json(gw, "/v1/completions", &completion_body(prompt, 4, false, false));
                let e = assert_api_error(&r, 413, "invalid_request_error");
                assert_eq!(e["code"], "context_length_exceeded", "{e}");
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while done.load(std::sync::atomic::Ordering::SeqCst) < prompts.len() {
            assert!(Instant::now() < deadline, "the heavy prompts were not answered within 120 s");
            let asked = Instant::now();
            let h = get(gw, "/health");
            let took = asked.elapsed();
            slowest_health = slowest_health.max(took);
            assert_eq!(h.status, 200, "{}", h.body);
            assert_eq!(h.json()["hosts_down"], json!([]), "a host was declared down: {}", h.body);
            assert!(took < Duration::from_secs(1), "/health took {took:?} under heavy prompts");
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    eprintln!("slowest /health under 8 heavy prompts: {slowest_health:?}");
    let r = post_json(gw, "/v1/completions", &completion_body("Hi", 4, false, false));
    assert_eq!(r.status, 200, "{}", r.body);
    for host in ["h0", "h1"] {
        let log = cluster.proc(host).log();
        assert!(!log.contains("missed its heartbeats"), "{host} declared a host down:\n{log}");
    }
}

/// A flood of clients that open connections and send only part of their headers: the
/// gateway sheds them (closes the longest idle when at its connection cap, times out
/// the rest) and keeps serving normal requests meanwhile; connections over the cap
/// while all are busy would get 503 JSON rather than an OS error.
#[test]
fn a_slow_header_flood_is_shed_and_requests_keep_being_served() {
    use std::io::{Read, Write};
    let extra = "max_connections = 32\nheader_read_timeout_ms = 2000";
    let topo = topology(&["h0"], extra, "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    cluster.wait_ready(1);
    let mut slow = Vec::new();
    let mut served = 0;
    for i in 0..400 {
        let mut c = std::net::TcpStream::connect(gw).expect("connect");
        // Half a request line and one header, never finished.
        let _ = c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n");
        slow.push(c);
        if i % 50 == 49 {
            let r = post_json(gw, "/v1/completions", &completion_body("Hi", 2, false, false));
            assert_eq!(r.status, 200, "request during the flood: {}", r.body);
            served += 1;
        }
    }
    assert_eq!(served, 8);
    // Every slow connection ends: shed at the cap, or timed out after 2 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    for c in &mut slow {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        c.set_read_timeout(Some(left)).expect("read timeout");
        let mut buf = [0u8; 512];
        loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {} // a 408 or error response before the close
            }
            assert!(Instant::now() < deadline, "a slow-header connection was never closed");
        }
        assert!(Instant::now() < deadline, "a slow-header connection was still open after 10 s");
    }
    let metrics = get(gw, "/metrics").body;
    let shed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tessera_gateway_connections_shed_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(shed >= 300.0, "the flood was not shed at the cap: {shed}");
    let r = post_json(gw, "/v1/completions", &completion_body("Hi", 2, false, false));
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The greedy completion of `prompt` by `tessera generate` and each of its tokens'
/// log-probability: the log-softmax of the raw logits it dumps.
pub(crate) fn greedy_logprobs(prompt: &str, n: usize) -> (Generated, Vec<f64>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let npy = dir.path().join("logits.npy");
    let reference = generate_with(prompt, n, true, &["--dump-logits", npy.to_str().expect("utf-8 path")]);
    let (shape, logits) = crate::cli::read_npy(&npy);
    let want: Vec<f64> = logits.chunks(shape[1]).map(|row| log_softmax(row, argmax(row))).collect();
    assert_eq!(want.len(), n);
    (reference, want)
}

/// `row`'s log-softmax at `i`, in f64.
fn log_softmax(row: &[f32], i: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    row[i] as f64 - max - row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln()
}

/// The first index of `row`'s largest value (the greedy token).
fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

/// The logits rows `tessera generate --dump-logits` writes for `n` greedy tokens after
/// the token ids `prompt`.
fn dumped_rows(prompt: &[u32], n: usize) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().expect("temp dir");
    let npy = dir.path().join("logits.npy");
    let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let out = tessera()
        .args(["generate", "--model", MODEL, "--prompt-ids", &ids, "--max-tokens", &n.to_string(), "--ignore-eos"])
        .args(["--dump-logits", npy.to_str().expect("utf-8 path")])
        .output()
        .expect("run generate");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (shape, logits) = crate::cli::read_npy(&npy);
    logits.chunks(shape[1]).map(<[f32]>::to_vec).collect()
}

/// A completions `logprobs` object's token log-probabilities, each within 1e-4 of `want`.
#[track_caller]
pub(crate) fn assert_logprobs_near(lp: &Value, want: &[f64]) -> Vec<f64> {
    let got: Vec<f64> =
        lp["token_logprobs"].as_array().expect("token_logprobs").iter().filter_map(Value::as_f64).collect();
    assert_eq!(got.len(), want.len(), "{lp}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-4, "token {i}: {g} vs the dump's {w}");
    }
    got
}

/// Log-probabilities of generated tokens: the log-softmax of the raw logits that
/// `tessera generate --dump-logits` writes for the same greedy completion (to 1e-4), in
/// OpenAI's completions and chat shapes, streamed equal to whole.
#[test]
fn logprobs_are_the_dumped_logits_log_softmax_streamed_and_whole() {
    const N: usize = 8;
    let prompt = "The quick brown fox";
    let (reference, want) = greedy_logprobs(prompt, N);

    let topo = topology(&["h0"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    cluster.wait_ready(1);

    let mut body = completion_body(prompt, N, false, true);
    body["logprobs"] = json!(3);
    let r = post_json(gw, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], reference.text);
    let lp = &v["choices"][0]["logprobs"];
    let got = assert_logprobs_near(lp, &want);
    let tokens: Vec<&str> = lp["tokens"].as_array().expect("tokens").iter().filter_map(Value::as_str).collect();
    assert_eq!(tokens.concat(), reference.text, "the tokens spell the text");
    let offsets: Vec<u64> = lp["text_offset"].as_array().expect("offsets").iter().filter_map(Value::as_u64).collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for (i, top) in lp["top_logprobs"].as_array().expect("top_logprobs").iter().enumerate() {
        // Three alternatives and the sampled token, fewer where their texts coincide (a
        // map keyed by text, in OpenAI's shape).
        let top = top.as_object().expect("a token -> logprob map");
        assert!((1..=4).contains(&top.len()), "{top:?}");
        // Greedy: the sampled token is the most likely, and listed.
        let best = top.values().filter_map(Value::as_f64).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(top.get(tokens[i]).and_then(Value::as_f64), Some(best), "{top:?}");
    }

    // Streamed: the same figures, chunk by chunk.
    body["stream"] = json!(true);
    let sse = post_stream(gw, "/v1/completions", &body).unwrap_or_else(|r| panic!("{} {}", r.status, r.body));
    let (_, raw) = read_stream(sse, false);
    let streamed: Vec<f64> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default())
        .filter_map(|x| x.as_f64())
        .collect();
    assert_eq!(streamed, got, "{raw}");

    // Chat: a list of entries, each with its bytes and exactly top_logprobs alternatives.
    let mut chat = chat_body(prompt, N, false);
    chat["logprobs"] = json!(true);
    chat["top_logprobs"] = json!(2);
    chat["ignore_eos"] = json!(true);
    let r = post_json(gw, "/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().cloned().expect("content");
    assert_eq!(content.len(), N, "{v}");
    let mut text = String::new();
    for e in &content {
        let token = e["token"].as_str().expect("token");
        text.push_str(token);
        let bytes: Vec<u8> =
            e["bytes"].as_array().expect("bytes").iter().filter_map(|b| b.as_u64()).map(|b| b as u8).collect();
        assert_eq!(bytes, token.as_bytes());
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(2), "{e}");
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"], "greedy takes the most likely: {e}");
    }
    assert_eq!(v["choices"][0]["message"]["content"], text);
    // Without the flag: no log-probabilities, as before.
    let r = post_json(gw, "/v1/chat/completions", &chat_body(prompt, N, false));
    assert_eq!(r.json()["choices"][0]["logprobs"], Value::Null);
}

/// Penalties, `logit_bias` and `min_tokens` change the greedy choice exactly as their
/// definitions say, computed here from the logits `tessera generate --dump-logits`
/// writes for the same prompt (token ids, so both sides see the same ones). The served
/// token is recognised by its reported log-probability, which is of the raw logits.
#[test]
fn penalties_and_logit_bias_pick_what_the_dumped_logits_say() {
    let prompt: Vec<u32> = vec![5, 17, 42, 42, 9, 300, 17];
    let rows = dumped_rows(&prompt, 2);
    let t0 = argmax(&rows[0]);

    let topo = topology(&["h0"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    cluster.wait_ready(1);
    // The raw log-probabilities of the tokens served for `extra`.
    let served = |extra: Value, n: usize| -> Vec<f64> {
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                              "ignore_eos": true, "logprobs": 0});
        for (k, v) in extra.as_object().expect("fields") {
            body[k] = v.clone();
        }
        let r = post_json(gw, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .expect("logprobs")
            .iter()
            .filter_map(Value::as_f64)
            .collect()
    };
    let is = |got: f64, row: &[f32], token: usize, what: &str| {
        assert!((got - log_softmax(row, token)).abs() < 1e-4, "{what}: served {got}, want token {token}");
    };
    is(served(json!({}), 1)[0], &rows[0], t0, "no penalty");

    // logit_bias: lifting the runner-up just past the best makes it the choice; -100 on
    // the best does too.
    let mut without_best = rows[0].clone();
    without_best[t0] = f32::NEG_INFINITY;
    let second = argmax(&without_best);
    let lift = rows[0][t0] - rows[0][second] + 0.5;
    is(served(json!({"logit_bias": {second.to_string(): lift}}), 1)[0], &rows[0], second, "bias up");
    is(served(json!({"logit_bias": {t0.to_string(): -100}}), 1)[0], &rows[0], second, "bias down");

    // repetition_penalty 2 on the prompt's tokens.
    let mut repeated = rows[0].clone();
    for &id in &prompt {
        let l = &mut repeated[id as usize];
        *l = if *l > 0.0 { *l / 2.0 } else { *l * 2.0 };
    }
    is(served(json!({"repetition_penalty": 2.0}), 1)[0], &rows[0], argmax(&repeated), "repetition");

    // Frequency and presence on the output: the first token is unchanged (nothing out
    // yet); the second is chosen with the first one's logit lowered by 2 + 2.
    let mut second_row = rows[1].clone();
    second_row[t0] -= 4.0;
    let got = served(json!({"frequency_penalty": 2.0, "presence_penalty": 2.0}), 2);
    is(got[0], &rows[0], t0, "frequency, first token");
    is(got[1], &rows[1], argmax(&second_row), "frequency, second token");

    // min_tokens: with the best token as a stop token the request ends at once; with
    // min_tokens 1 the stop token is ruled out for the first token.
    let stop = json!({"stop_token_ids": [t0], "ignore_eos": false});
    assert!(served(stop.clone(), 4).len() <= 1, "stopped at once");
    let mut with_min = stop;
    with_min["min_tokens"] = json!(1);
    is(served(with_min, 4)[0], &rows[0], second, "min_tokens");

    // A bias for a token the model does not have is refused.
    let mut body = completion_body("Hi", 2, false, false);
    body["logit_bias"] = json!({"99999999": 1});
    let r = post_json(gw, "/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("logit_bias"), "{}", r.body);
}

/// The log-probability of `prompt[i]` after `prompt[..i]`, from the logits `tessera
/// generate --dump-logits` writes for that prefix.
pub(crate) fn prefix_logprob(prompt: &[u32], i: usize) -> f64 {
    log_softmax(&dumped_rows(&prompt[..i], 1)[0], prompt[i] as usize)
}

/// A scoring request (`echo`, `logprobs: 1`, `max_tokens: 0`) returns the prompt and,
/// for every prompt token after the first, the log-probability `generate` computes
/// after the tokens before it (to 1e-4); with `max_tokens` > 0 the completion follows;
/// streamed, the same.
#[test]
fn a_scoring_request_returns_each_prompt_token_s_logprob() {
    let prompt: Vec<u32> = vec![11, 250, 7, 7, 480, 33, 2, 91];
    let want: Vec<f64> = (1..prompt.len()).map(|i| prefix_logprob(&prompt, i)).collect();
    let topo = topology(&["h0"], "", "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::nodes(&topo, &["h0"]);
    let gw = cluster.gateway;
    cluster.wait_ready(1);
    let body = json!({"model": MODEL, "prompt": prompt, "echo": true, "logprobs": 1, "max_tokens": 0});
    let r = post_json(gw, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["token_logprobs"][0], Value::Null, "{lp}");
    assert_eq!(lp["top_logprobs"][0], Value::Null, "{lp}");
    let got: Vec<f64> =
        lp["token_logprobs"].as_array().expect("logprobs").iter().skip(1).filter_map(Value::as_f64).collect();
    assert_eq!(got.len(), want.len(), "{lp}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() < 1e-4, "prompt token {}: {g} vs generate's {w}", i + 1);
    }
    let tokens: Vec<&str> = lp["tokens"].as_array().expect("tokens").iter().filter_map(Value::as_str).collect();
    assert_eq!(tokens.len(), prompt.len());
    assert_eq!(v["choices"][0]["text"], tokens.concat(), "the echoed prompt");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(8), Some(0)));

    // Its prompt is now in the chip's prefix cache; a scoring request recomputes it (the
    // cache holds KV, not logits) and scores the same.
    let plain = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    assert_eq!(post_json(gw, "/v1/completions", &plain).status, 200);
    let v = post_json(gw, "/v1/completions", &body).json();
    let cached: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .expect("logprobs")
        .iter()
        .skip(1)
        .filter_map(Value::as_f64)
        .collect();
    assert_eq!(cached, got);

    // With a completion after the prompt: the same prompt figures, then its tokens.
    let mut more = body.clone();
    more["max_tokens"] = json!(3);
    more["ignore_eos"] = json!(true);
    more["temperature"] = json!(0);
    let v = post_json(gw, "/v1/completions", &more).json();
    let lp = &v["choices"][0]["logprobs"];
    let all: Vec<Value> = lp["token_logprobs"].as_array().cloned().expect("logprobs");
    assert_eq!(all.len(), prompt.len() + 3, "{lp}");
    let again: Vec<f64> = all[1..prompt.len()].iter().filter_map(Value::as_f64).collect();
    assert_eq!(again, got, "the prompt scores the same");
    let text = v["choices"][0]["text"].as_str().expect("text");
    assert!(text.starts_with(&tokens.concat()) && v["usage"]["completion_tokens"] == 3, "{v}");

    // Streamed, the prompt comes first with its figures, then the tokens: the same text,
    // tokens, log-probabilities and offsets as the whole response; a streamed scoring
    // request is the prompt alone.
    let streamed = |body: &Value| {
        let mut body = body.clone();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let Ok(mut sse) = post_stream(gw, "/v1/completions", &body) else { panic!("the stream was refused") };
        let (mut text, mut lp, mut usage) = (String::new(), json!({}), Value::Null);
        while let Some(data) = sse.next_data().filter(|d| d != "[DONE]") {
            let chunk: Value = serde_json::from_str(&data).expect("a JSON chunk");
            if !chunk["usage"].is_null() {
                usage = chunk["usage"].clone();
                continue;
            }
            text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let items = chunk["choices"][0]["logprobs"][key].as_array().cloned().unwrap_or_default();
                let all = lp[key].as_array().cloned().unwrap_or_default();
                lp[key] = all.into_iter().chain(items).collect();
            }
        }
        (text, lp, usage)
    };
    let (s_text, s_lp, s_usage) = streamed(&more);
    assert_eq!(s_text, text);
    assert_eq!(s_lp, v["choices"][0]["logprobs"], "streamed vs whole");
    assert_eq!(s_usage["completion_tokens"], 3);
    let (s_text, s_lp, s_usage) = streamed(&body);
    assert_eq!((s_text, s_usage["completion_tokens"].as_u64()), (tokens.concat(), Some(0)));
    let s_got: Vec<f64> =
        s_lp["token_logprobs"].as_array().expect("logprobs").iter().skip(1).filter_map(Value::as_f64).collect();
    assert_eq!(s_got, got);
}

/// A served chip's steps, traced (`TESSERA_LOG=info,tessera::steps=trace`), calibrate
/// its kind: `tessera calibrate --from-steps` fits a model to every step the chip ran,
/// and a log without step events is refused with what to do.
#[test]
fn served_steps_calibrate_a_chip_kind() {
    let topo = topology(&["h0"], "", "", HEARTBEAT_TIMEOUT_MS);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("topology.toml");
    std::fs::write(&path, &topo.toml).unwrap();
    let mut cmd = tessera();
    cmd.env("TESSERA_LOG", "info,tessera::steps=trace").arg("up").arg(&path);
    let mut up = Proc::spawn("up", cmd, dir.path());
    wait_health(topo.gateway, "the chip up", Duration::from_secs(30), |h| {
        h["chips"].as_array().is_some_and(|c| c.len() == 1 && c[0]["state"] == "up")
    });
    // Prompts of several lengths, one at a time and then together (batched decodes).
    let prompts: Vec<String> = (1..=6).map(|n| "the quick brown fox jumps ".repeat(n * 3)).collect();
    for p in &prompts[..2] {
        let r = post_json(topo.gateway, "/v1/completions", &completion_body(p, 8, false, true));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Long enough answers, started together, that their decodes share steps.
    let start = std::sync::Barrier::new(prompts.len() - 2);
    std::thread::scope(|s| {
        for p in &prompts[2..] {
            let start = &start;
            s.spawn(move || {
                start.wait();
                let r = post_json(topo.gateway, "/v1/completions", &completion_body(p, 48, false, true));
                assert_eq!(r.status, 200, "{}", r.body);
            });
        }
    });
    up.interrupt();
    assert!(up.wait_exit(Duration::from_secs(20)).is_some(), "up did not stop");
    let log = up.log();
    let done = log.lines().filter(|l| l.contains("step done")).count();
    // Two requests alone (a prefill and 7 decodes each), then at least one prefill step
    // and 47 decode steps for the four together.
    assert!(done >= 2 * 8 + 1 + 47, "{done} steps traced:\n{log}");

    let perf = dir.path().join("perf.toml");
    let log_path = dir.path().join("up.log");
    let out = tessera()
        .args(["calibrate", "--chip", "h0-cpu0", "--topology"])
        .arg(&path)
        .arg("--from-steps")
        .arg(&log_path)
        .arg("--out")
        .arg(&perf)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    // Every step is in one class: "prefill 22 tok x 1 (1)", "decode 4 x ctx 40 (7)".
    let counted: usize = stdout
        .lines()
        .filter(|l| l.starts_with("prefill ") || l.starts_with("decode "))
        .filter_map(|l| l.split_once(" (")?.1.split_once(')')?.0.parse::<usize>().ok())
        .sum();
    assert_eq!(counted, done, "{stdout}");
    let batched = stdout.lines().any(|l| l.strip_prefix("decode ").is_some_and(|l| !l.starts_with("1 x")));
    assert!(stdout.contains("prefill ") && stdout.contains("decode 1 x ctx") && batched, "{stdout}");
    let model = std::fs::read_to_string(&perf).unwrap();
    assert!(model.contains("from the steps") && model.contains("[decode.memory]"), "{model}");

    // A log with no step events: refused, saying how to get one.
    let plain = dir.path().join("plain.log");
    std::fs::write(&plain, "2026-01-01T00:00:00Z  INFO tessera: serving\n").unwrap();
    let out = tessera()
        .args(["calibrate", "--chip", "h0-cpu0", "--topology"])
        .arg(&path)
        .arg("--from-steps")
        .arg(&plain)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no steps") && stderr.contains("tessera::steps=trace"),
        "{stderr}"
    );
}

/// A host without the gateway is ready once it has joined the cluster: its probe answers
/// 503 (`joining`, naming the gateway's host) while that host is not running, 200 once
/// the bus link to it is up.
#[test]
fn a_hosts_probe_is_ready_once_its_bus_reaches_the_gateways_host() {
    let topo = two_hosts("");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("topology.toml");
    std::fs::write(&path, &topo.toml).expect("write the topology");
    let probe = SocketAddr::from(([127, 0, 0, 1], free_ports(1)[0]));
    let node = |h: &str, with_probe: bool| {
        let mut cmd = tessera();
        cmd.args(["node", "--host", h, "--exit-on-stdin-eof", "--topology"]).arg(&path);
        if with_probe {
            cmd.arg("--probe-listen").arg(probe.to_string());
        }
        Proc::spawn(h, cmd, dir.path())
    };
    let mut h1 = node("h1", true);
    let deadline = Instant::now() + Duration::from_secs(30);
    let joining = loop {
        if let Ok(r) = try_request(probe, "GET", "/health", None) {
            break r;
        }
        assert!(h1.try_status().is_none(), "h1 exited:\n{}", h1.log());
        assert!(Instant::now() < deadline, "h1's probe did not answer in 30 s:\n{}", h1.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    let body = joining.json();
    assert_eq!((joining.status, body["status"].as_str()), (503, Some("joining")), "{}", joining.body);
    assert!(body["reason"].as_str().is_some_and(|r| r.contains("`h0`")), "{}", joining.body);
    assert_eq!(get(probe, "/health/live").status, 200, "h1 is alive meanwhile");

    let _h0 = node("h0", false);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = get(probe, "/health");
        if r.status == 200 {
            assert_eq!(r.json()["status"], "ok", "{}", r.body);
            break;
        }
        assert!(Instant::now() < deadline, "h1 not ready 30 s after h0 started: {}\n{}", r.body, h1.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}
