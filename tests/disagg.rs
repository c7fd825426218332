//! Prefill/decode disaggregation end to end: a prefill chip and a decode chip in
//! separate host processes, the KV cache moved between them by the transfer engine.
//! Greedy answers must equal `tessera generate`'s whatever the two chips' block sizes,
//! layouts, KV dtypes and the transport (DESIGN.md §9 invariant 5); requests survive
//! either chip dying and a decode chip that never claims its KV (invariant 1); every
//! surviving pool drains (invariant 2). Every wait has a deadline.

use crate::serve_kit::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const HEARTBEAT_TIMEOUT_MS: u64 = 1000;

/// A prefill chip `p-chip` on host `p` and a decode chip `d-chip` on host `d`, with
/// extra TOML for each chip and the `[disagg]` table; the gateway on the first host
/// (`gateway_on_decode`: d's).
fn pd_topology(p_extra: &str, d_extra: &str, disagg: &str, gateway_on_decode: bool) -> Topology {
    let chip = |host: &'static str, role: &str, extra: &str| ChipDef {
        host,
        id: format!("{host}-chip"),
        toml: format!("role = \"{role}\"\nthreads = 1\n{extra}\n"),
    };
    // A CPU chip unless the extra lines pick a backend.
    let backend = |extra: &str| {
        if extra.contains("backend") {
            extra.to_string()
        } else {
            format!("kind = \"cpu\"\nbackend = \"cpu\"\n{extra}")
        }
    };
    let (p, d) = (chip("p", "prefill", &backend(p_extra)), chip("d", "decode", &backend(d_extra)));
    let chips = if gateway_on_decode { vec![d, p] } else { vec![p, d] };
    topology_of(&chips, &format!("[disagg]\nmin_prompt_tokens = 8\n{disagg}\n"), "", HEARTBEAT_TIMEOUT_MS)
}

fn prompt_of(words: usize, seed: usize) -> String {
    let vocab = ["the", "chip", "decodes", "a", "token", "while", "another", "prefills", "long", "prompts"];
    (0..words).map(|i| vocab[(i * 7 + seed * 3) % vocab.len()]).collect::<Vec<_>>().join(" ")
}

/// Every prompt, answered by the cluster at `gw`, equals `want` (non-streaming).
fn assert_answers(gw: std::net::SocketAddr, prompts: &[String], want: &[Generated], max_tokens: usize, what: &str) {
    for (prompt, want) in prompts.iter().zip(want) {
        let r = post_json(gw, "/v1/completions", &completion_body(prompt, max_tokens, false, true));
        assert_eq!(r.status, 200, "{what}: {}", r.body);
        let v = r.json();
        assert_eq!(v["choices"][0]["text"], want.text, "{what}: {prompt:?}");
        assert_usage(&v["usage"], want.prompt_tokens, max_tokens, prompt);
    }
}

/// Greedy output through P -> D equals the single-chip reference for the same KV
/// dtype, whether D's blocks are larger, smaller or laid out token-major, over shm
/// and over tcp; a short prompt stays on the decode chip; both pools drain.
#[test]
fn disaggregated_output_equals_colocated_across_kv_formats_and_transports() {
    const MAX_TOKENS: usize = 24;
    let prompts: Vec<String> = vec![prompt_of(12, 1), prompt_of(60, 2), prompt_of(150, 3), "Hi".to_string()];
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    let cases = [
        ("shm", "block_size = 16\nkv_layout = \"head-major\"", "block_size = 32\nkv_layout = \"token-major\""),
        ("tcp", "block_size = 16\nkv_layout = \"token-major\"", "block_size = 8\nkv_layout = \"head-major\""),
    ];
    for (transport, p_extra, d_extra) in cases {
        let topo = pd_topology(p_extra, d_extra, &format!("transport = \"{transport}\""), false);
        let mut cluster = Cluster::up(&topo);
        let gw = cluster.gateway;
        cluster.wait_ready(2);
        assert_answers(gw, &prompts, &want, MAX_TOKENS, transport);
        let disaggregated = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
        let colocated = metric(gw, "tessera_router_decisions_total{placement=\"colocated\"} ");
        assert_eq!((disaggregated, colocated), (3.0, 1.0), "{transport}: 3 long prompts split, \"Hi\" not");
        if transport == "shm" {
            // Log-probabilities sampled on D after P's prefill: the single chip's.
            let (_, logprobs) = crate::serve::greedy_logprobs(&prompts[1], 6);
            let mut body = completion_body(&prompts[1], 6, false, true);
            body["logprobs"] = json!(1);
            let r = post_json(gw, "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            crate::serve::assert_logprobs_near(&r.json()["choices"][0]["logprobs"], &logprobs);
            let split = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
            assert_eq!(split, 4.0, "the request with logprobs was split too");
            // A scoring request of 40 prompt tokens, prefilled on P in chunks: P scores
            // the prompt and samples the one token no one sees, which ends the request
            // and its hand-off there.
            let ids: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
            let body = json!({"model": MODEL, "prompt": ids, "echo": true, "logprobs": 2, "max_tokens": 0});
            let r = post_json(gw, "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let lp = r.json()["choices"][0]["logprobs"].clone();
            let got = lp["token_logprobs"].as_array().cloned().unwrap_or_default();
            assert_eq!((got.len(), &got[0]), (40, &Value::Null), "{lp}");
            for i in [1, 17, 39] {
                let want = crate::serve::prefix_logprob(&ids, i);
                let g = got[i].as_f64().unwrap_or(f64::NAN);
                assert!((g - want).abs() < 1e-4, "prompt token {i}: {g} vs {want}");
            }
            let split = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
            assert_eq!(split, 5.0, "the scoring request was split");
        }
        // All at once: prefills share steps on P, hand-offs overlap, D batches.
        std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .zip(&want)
                .map(|(p, w)| {
                    s.spawn(move || {
                        assert_answers(gw, std::slice::from_ref(p), std::slice::from_ref(w), MAX_TOKENS, transport)
                    })
                })
                .collect();
            for h in handles {
                if let Err(e) = h.join() {
                    std::panic::resume_unwind(e);
                }
            }
        });
        let done = metric(gw, "tessera_kv_handoffs_total{chip=\"p-chip\",outcome=\"done\"} ");
        let ended = metric(gw, "tessera_kv_handoffs_total{chip=\"p-chip\",outcome=\"ended_at_first_token\"} ");
        let (logprobs, scored) = if transport == "shm" { (1.0, 1.0) } else { (0.0, 0.0) };
        assert_eq!((done, ended), (6.0 + logprobs, scored), "{transport}: every hand-off acknowledged");
        wait_health(gw, "both pools free", Duration::from_secs(5), |h| {
            drained(h, &[]) && chip(h, "d-chip")["steps"].as_u64() >= Some(MAX_TOKENS as u64)
        });
    }
}

/// Prefill instances hand their KV to decode instances of other shapes, block sizes and
/// layouts — a 2-stage prefill to a 3-stage decode, a tensor-parallel prefill (each rank
/// staging its KV heads) to one chip, 2 stages x TP=2 to a TP=2 decode — each layer's
/// KV staged by the ranks that computed it and installed on those that own it: greedy
/// answers equal single-chip `generate`'s, and every pool drains.
#[test]
fn prefill_instances_hand_kv_to_decode_instances_of_other_shapes() {
    const MAX_TOKENS: usize = 16;
    let prompts: Vec<String> = vec![prompt_of(12, 4), prompt_of(70, 5), prompt_of(140, 6), "Hi".to_string()];
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    // (prefill chips, their instance's keys, decode chips, theirs ("": one chip), decode chips' extra keys)
    let cases: [(usize, &str, usize, &str, &str); 3] = [
        (2, "tp = 2", 1, "", "kv_layout = \"token-major\""),
        (2, "split = [3, 1]", 3, "split = [1, 1, 2]", "block_size = 8\nkv_layout = \"token-major\""),
        (4, "tp = 2\nsplit = [2, 2]", 2, "tp = 2", "block_size = 32"),
    ];
    for (p_chips, p_keys, d_chips, d_keys, d_extra) in cases {
        let what = format!("P {p_chips} chips ({p_keys}), D {d_chips} chips ({d_keys})");
        let chip = |host: &'static str, id: String, role: &str, extra: &str| ChipDef {
            host,
            id,
            toml: format!("kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"{role}\"\nthreads = 1\n{extra}\n"),
        };
        let ids = |host: &str, n: usize| (0..n).map(|i| format!("{host}-{i}")).collect::<Vec<_>>();
        let mut chips: Vec<ChipDef> = ids("p", p_chips).into_iter().map(|id| chip("p", id, "prefill", "")).collect();
        let d_ids = if d_chips == 1 { vec!["d-chip".to_string()] } else { ids("d", d_chips) };
        chips.extend(d_ids.iter().map(|id| chip("d", id.clone(), "decode", d_extra)));
        let list = |v: Vec<String>| v.iter().map(|id| format!("\"{id}\"")).collect::<Vec<_>>().join(", ");
        let mut extra = format!(
            "[disagg]\nmin_prompt_tokens = 8\n\n[[instances]]\nid = \"p-chip\"\nchips = [{}]\n{p_keys}\n",
            list(ids("p", p_chips))
        );
        if d_chips > 1 {
            extra += &format!("\n[[instances]]\nid = \"d-chip\"\nchips = [{}]\n{d_keys}\n", list(d_ids));
        }
        let topo = topology_of(&chips, &extra, "", HEARTBEAT_TIMEOUT_MS);
        let mut cluster = Cluster::up(&topo);
        let gw = cluster.gateway;
        cluster.wait_ready(2);
        assert_answers(gw, &prompts, &want, MAX_TOKENS, &what);
        let disaggregated = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
        assert_eq!(disaggregated, 3.0, "{what}: the 3 long prompts were split");
        let done = metric(gw, "tessera_kv_handoffs_total{chip=\"p-chip\",outcome=\"done\"} ");
        assert_eq!(done, 3.0, "{what}: every hand-off acknowledged");
        wait_health(gw, "both instances' pools free", Duration::from_secs(5), |h| drained(h, &[]));
    }
}

/// f32 KV on the prefill chip, f16 on the decode chip: the decode chip rounds the f32
/// values it receives to f16, exactly as a colocated f16 chip rounds what it computes,
/// so the answer is compared with the single-chip f16-KV reference. (Positions after
/// the first chunk attend to f32 KV on P but f16 KV on the reference; that difference is
/// within f16 rounding and does not change these greedy answers; the bit-level check of
/// the conversion is in backends' kv_format tests.)
#[test]
fn f32_prefill_to_f16_decode_matches_f16_reference() {
    const MAX_TOKENS: usize = 24;
    let prompts: Vec<String> = vec![prompt_of(20, 4), prompt_of(90, 5)];
    let want: Vec<Generated> =
        prompts.iter().map(|p| generate_with(p, MAX_TOKENS, true, &["--kv-dtype", "f16"])).collect();
    let topo = pd_topology("kv_dtype = \"f32\"", "kv_dtype = \"f16\"\nblock_size = 32", "", false);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    assert_answers(gw, &prompts, &want, MAX_TOKENS, "f32 -> f16");
    assert_eq!(metric(gw, "tessera_kv_handoffs_total{chip=\"p-chip\",outcome=\"done\"} "), 2.0);
    wait_health(gw, "both pools free", Duration::from_secs(5), |h| drained(h, &[]));
}

const FAULT_MAX_TOKENS: usize = 64;

fn fault_prompts() -> Vec<String> {
    (0..6).map(|i| prompt_of(180, 10 + i)).collect()
}

fn fault_references() -> Vec<Generated> {
    fault_prompts().iter().map(|p| generate(p, FAULT_MAX_TOKENS, true)).collect()
}

/// P is an emulated Ascend paced slowly enough that prefills and their KV transfers are
/// still in flight when a chip is killed; its queue is unbounded, so every prompt waits
/// there (none runs on the decode chip instead).
const SLOW_PREFILL: &str = "[emulation]\ntime_scale = 20000.0\n\n[router]\nmax_queued_prompt_ms = 3600000";

/// The decode host is SIGKILLed while prefills stream KV to it: every request still
/// completes with its no-fault answer (on the prefill chip, the only one left), and the
/// prefill chip's pool drains.
#[test]
fn requests_survive_the_decode_chip_dying_with_kv_in_flight() {
    let prompts = fault_prompts();
    let want = fault_references();
    let p_emu = "kind = \"ascend-910b\"\nbackend = \"emu:ascend-910b\"";
    let topo = pd_topology_with(p_emu, "", SLOW_PREFILL, false);
    let mut cluster = Cluster::nodes(&topo, &["p", "d"]);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    let health = get(gw, "/health").json();
    assert_eq!(chip(&health, "p-chip")["emulated"], "ascend-910b x20000", "{health:#}");
    let metrics = get(gw, "/metrics").body;
    assert!(metrics.contains("tessera_emu_time_scale{chip=\"p-chip\",kind=\"ascend-910b\"} 20000"), "{metrics}");
    let d_pid = cluster.proc("d").pid();
    stream_through_fault_after(gw, "d-chip", 1, &prompts, &want, FAULT_MAX_TOKENS, || {
        // The first request decodes on d; later ones are still prefilled and streamed.
        wait_health(gw, "p holds KV for d", Duration::from_secs(2), |h| {
            chip(h, "p-chip")["kv_handoffs"].as_u64() > Some(0)
        });
        signal(d_pid, "KILL");
    });
    wait_health(gw, "p's KV freed", Duration::from_secs(5), |h| drained(h, &["p-chip"]));
}

/// The prefill host is SIGKILLed mid-prefill (the gateway lives on the decode host):
/// every request completes on the decode chip, whose pool drains.
#[test]
fn requests_survive_the_prefill_chip_dying_mid_prefill() {
    let prompts = fault_prompts();
    let want = fault_references();
    let p_emu = "kind = \"ascend-910b\"\nbackend = \"emu:ascend-910b\"";
    let topo = pd_topology_with(p_emu, "", SLOW_PREFILL, true);
    let mut cluster = Cluster::nodes(&topo, &["d", "p"]);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    let p_pid = cluster.proc("p").pid();
    stream_through_fault_after(gw, "d-chip", 1, &prompts, &want, FAULT_MAX_TOKENS, || {
        wait_health(gw, "p prefills", Duration::from_secs(2), |h| chip(h, "p-chip")["running"].as_u64() > Some(0));
        signal(p_pid, "KILL");
    });
    wait_health(gw, "d's KV freed", Duration::from_secs(5), |h| drained(h, &["d-chip"]));
}

/// The decode chip drops its claim: the prefill chip's lease runs out, it frees the KV
/// and the request is served elsewhere with its no-fault answer; both pools drain.
#[test]
fn an_unclaimed_hand_off_expires_and_the_request_is_served_elsewhere() {
    const MAX_TOKENS: usize = 16;
    let prompt = prompt_of(40, 7);
    let want = generate(&prompt, MAX_TOKENS, true);
    let topo = pd_topology("", "", "lease_ms = 300", false);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    let r = post_json(gw, "/admin/faults", &json!({"chip": "d-chip", "fault": "drop_kv_claim"}));
    assert_eq!(r.status, 202, "{}", r.body);
    let started = Instant::now();
    assert_answers(gw, std::slice::from_ref(&prompt), std::slice::from_ref(&want), MAX_TOKENS, "lease");
    assert!(started.elapsed() >= Duration::from_millis(300), "answered before the lease could expire");
    assert_eq!(metric(gw, "tessera_kv_handoffs_total{chip=\"p-chip\",outcome=\"lease_expired\"} "), 1.0);
    assert!(metric(gw, "tessera_request_reroutes_total ") >= 1.0);
    wait_health(gw, "both pools free", Duration::from_secs(5), |h| drained(h, &[]));
}

/// A role change through the admin API drains first and loses nothing: after it, long
/// prompts are no longer split.
#[test]
fn a_live_role_change_takes_effect_after_draining() {
    const MAX_TOKENS: usize = 16;
    let prompt = prompt_of(40, 9);
    let want = generate(&prompt, MAX_TOKENS, true);
    let topo = pd_topology("", "", "", false);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    let bad = post_json(gw, "/admin/role", &json!({"chip": "d-chip", "role": "sideways"}));
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.body.contains("unknown role `sideways`; expected prefill, decode or both"), "{}", bad.body);
    let r = post_json(gw, "/admin/role", &json!({"chip": "d-chip", "role": "both"}));
    assert_eq!(r.status, 202, "{}", r.body);
    assert!(r.body.contains(r#""role":"both""#), "{}", r.body);
    wait_health(gw, "d-chip is a both chip", Duration::from_secs(5), |h: &Value| chip(h, "d-chip")["role"] == "both");
    assert_answers(gw, std::slice::from_ref(&prompt), std::slice::from_ref(&want), MAX_TOKENS, "after the change");
    assert_eq!(metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} "), 0.0);
    assert_eq!(metric(gw, "tessera_router_decisions_total{placement=\"colocated\"} "), 1.0);
}

fn pd_topology_with(p_extra: &str, d_extra: &str, cluster_extra: &str, gateway_on_decode: bool) -> Topology {
    let mut topo = pd_topology(p_extra, d_extra, "", gateway_on_decode);
    topo.toml = topo.toml.replacen("[disagg]", &format!("{cluster_extra}\n\n[disagg]"), 1);
    topo
}

/// Ten long prompts, for the worker-panic drills.
fn panic_prompts() -> Vec<String> {
    (0..10).map(|i| prompt_of(180, 40 + i)).collect()
}

/// A `worker_panic` drill on `victim` (`p-chip` or `d-chip`) while ten streams run,
/// prefills and KV hand-offs in flight: the chip restarts, and meanwhile its requests
/// avoid it (the other chip serves them alone) instead of being declined until their
/// attempts run out. Every stream finishes with all its tokens, equal to the no-fault
/// answer; both pools drain; the victim is up again with one restart.
fn ten_streams_survive_a_worker_panic_on(victim: &str) {
    let prompts = panic_prompts();
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, FAULT_MAX_TOKENS, true)).collect();
    let p_emu = "kind = \"ascend-910b\"\nbackend = \"emu:ascend-910b\"";
    let topo = pd_topology_with(p_emu, "", SLOW_PREFILL, false);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(2);
    stream_through_fault_after(gw, "d-chip", 1, &prompts, &want, FAULT_MAX_TOKENS, || {
        wait_health(gw, "p prefills", Duration::from_secs(5), |h| chip(h, "p-chip")["running"].as_u64() > Some(0));
        let r = post_json(gw, "/admin/faults", &json!({"chip": victim, "fault": "worker_panic"}));
        assert_eq!(r.status, 202, "{}", r.body);
    });
    let health = wait_health(gw, "the victim restarted and every pool drained", Duration::from_secs(10), |h| {
        chip(h, victim)["state"] == "up" && chip(h, victim)["restarts"] == 1 && drained(h, &[])
    });
    assert_eq!(health["chips_up"], 2, "{health:#}");
    assert!(metric(gw, "tessera_request_failed_total ") == 0.0, "a request failed");
}

#[test]
fn ten_streams_survive_a_worker_panic_on_the_decode_chip() {
    ten_streams_survive_a_worker_panic_on("d-chip");
}

#[test]
fn ten_streams_survive_a_worker_panic_on_the_prefill_chip() {
    ten_streams_survive_a_worker_panic_on("p-chip");
}

/// `tessera plan ARGS --gateway`: its standard output, or its standard error when it
/// fails.
fn try_plan_cli(gw: std::net::SocketAddr, args: &[&str]) -> Result<String, String> {
    let out = tessera().arg("plan").args(args).arg("--gateway").arg(format!("http://{gw}")).output().expect("runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() { Ok(stdout.into_owned()) } else { Err(stderr.into_owned()) }
}

/// `tessera plan ARGS --gateway`, which must succeed, returning its standard output.
fn plan_cli(gw: std::net::SocketAddr, args: &[&str]) -> String {
    try_plan_cli(gw, args).unwrap_or_else(|e| panic!("tessera plan {args:?}: {e}"))
}

/// The live solver under load (issue: live re-planning): one prefill and two decode
/// chips serve four clients that never stop; `tessera plan apply` moves a decode chip
/// to prefill, then applies the solver's own best strategy (which parks chips). Every
/// chip that changes duty drains first: no request fails, every answer equals the
/// single-chip reference, and `/health` and `/metrics` show each change.
#[test]
fn plan_apply_moves_a_decode_chip_to_prefill_under_load_and_loses_nothing() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    const MAX_TOKENS: usize = 12;
    let prompts: Vec<String> = (0..3).map(|i| prompt_of(40 + 10 * i, 60 + i)).collect();
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    let cpu = |role: &str| format!("kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"{role}\"\nthreads = 1\n");
    let chips = [
        ChipDef { host: "p", id: "p-chip".into(), toml: cpu("prefill") },
        ChipDef { host: "d", id: "d0".into(), toml: cpu("decode") },
        ChipDef { host: "d", id: "d1".into(), toml: cpu("decode") },
    ];
    let extra = "[disagg]\nmin_prompt_tokens = 8\n\n[solver]\ntelemetry_interval_ms = 200\n";
    let topo = topology_of(&chips, extra, "", HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(3);

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (stop, served, prompts, want) = (stop.clone(), served.clone(), prompts.clone(), want.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                let mut i = c;
                while !stop.load(Ordering::Relaxed) {
                    let k = i % prompts.len();
                    let r = post_json(gw, "/v1/completions", &completion_body(&prompts[k], MAX_TOKENS, false, true));
                    if r.status != 200 || r.json()["choices"][0]["text"] != want[k].text {
                        failures.push(format!("{}: {}", r.status, r.body));
                    }
                    served.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                failures
            })
        })
        .collect();

    // The first strategy set, solved for the traffic the solver measured.
    let deadline = Instant::now() + Duration::from_secs(30);
    let set = loop {
        let plan = get(gw, "/admin/plan");
        assert_eq!(plan.status, 200, "{}", plan.body);
        let v = plan.json();
        if !v["latest"].is_null() {
            break v["latest"].clone();
        }
        assert!(Instant::now() < deadline, "no strategy set within 30 s: {v:#}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(set["observed_rate_rps"].as_f64() > Some(0.0) && set["chips_up"] == 3, "{set:#}");
    assert!(set["prefix_hit_rate"].as_f64().is_some_and(|h| (0.0..=1.0).contains(&h)), "{set:#}");
    assert!(set["strategies"][0]["id"].is_string(), "{set:#}");

    // A decode chip becomes a prefill chip, under load.
    let out = plan_cli(gw, &["apply", "--role", "d0=prefill"]);
    assert!(out.contains("applied manual-1") && out.contains("d0 drains, then decode -> prefill"), "{out}");
    let before = served.load(Ordering::Relaxed);
    let h = wait_health(gw, "d0 prefills", Duration::from_secs(10), |h| {
        chip(h, "d0")["role"] == "prefill" && !chip(h, "d0")["draining"].as_bool().unwrap_or(true)
    });
    assert_eq!(h["plan"]["id"], "manual-1", "{h:#}");
    assert_eq!(metric(gw, "tessera_solver_chip_duty{chip=\"d0\",duty=\"prefill\"} "), 1.0);
    assert_eq!(metric(gw, "tessera_solver_chip_duty{chip=\"d0\",duty=\"decode\"} "), 0.0);
    assert_eq!(metric(gw, "tessera_solver_plans_applied_total{by=\"operator\"} "), 1.0);
    // Requests went on through the change, and now run on the new roles.
    let waited = Instant::now() + Duration::from_secs(10);
    while served.load(Ordering::Relaxed) < before + 8 {
        assert!(Instant::now() < waited, "requests stalled after the change");
        std::thread::sleep(Duration::from_millis(50));
    }

    // The solver's own best strategy, by its id, under load. The solver re-solves when
    // duties or the traffic rate change, so the id is read from the latest set just
    // before applying, and read again should a newer set land in between.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (best, out) = loop {
        let latest = get(gw, "/admin/plan").json()["latest"].clone();
        let best = latest["strategies"][0]["id"].as_str().expect("a strategy").to_string();
        match try_plan_cli(gw, &["apply", &best]) {
            Ok(out) => break (best, out),
            Err(e) => assert!(e.contains("in the latest set") && Instant::now() < deadline, "apply {best}: {e}"),
        }
    };
    assert!(out.contains(&format!("applied {best}")), "{out}");
    let plan = get(gw, "/admin/plan").json();
    let duties: Vec<(String, String)> = plan["applied"]["duties"]
        .as_array()
        .expect("duties")
        .iter()
        .map(|d| (d[0].as_str().unwrap_or("").to_string(), d[1].as_str().unwrap_or("").to_string()))
        .collect();
    wait_health(gw, "every chip on its duty", Duration::from_secs(10), |h| {
        duties.iter().all(|(id, duty)| {
            let c = chip(h, id);
            match duty.as_str() {
                "idle" => c["parked"] == true,
                role => c["role"] == role && c["draining"] == false,
            }
        })
    });
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let failures: Vec<String> = clients.into_iter().flat_map(|c| c.join().expect("client")).collect();
    assert!(failures.is_empty(), "{} failed: {:?}", failures.len(), &failures[..failures.len().min(3)]);
    assert!(served.load(Ordering::Relaxed) >= 20, "too little load: {}", served.load(Ordering::Relaxed));
    assert_eq!(metric(gw, "tessera_request_failed_total "), 0.0);
    assert_eq!(metric(gw, "tessera_solver_plans_applied_total{by=\"operator\"} "), 2.0);
    let h = wait_health(gw, "every pool drained", Duration::from_secs(5), |h| drained(h, &[]));
    assert_eq!(h["plan"]["id"], best.as_str(), "{h:#}");
}
