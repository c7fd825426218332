//! A shared cluster end to end: API keys (missing, wrong, revoked: 401), each tenant
//! quota (429 with `Retry-After`, or 400 where no retry can help) while another tenant is
//! served, roles on every admin route (403 for a `user` key), keys added and revoked
//! while the gateway runs, and an audit log that records it all and verifies. Also a
//! cluster without a keys file: admin routes need the token `tessera up` wrote, which
//! `tessera plan` finds by itself.

use crate::serve_kit::*;
use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

/// Every admin route, with a body that is valid where one is read.
const ADMIN_ROUTES: &[(&str, &str, &str)] = &[
    ("POST", "/admin/faults", r#"{"chip": "h0-cpu0", "fault": "chip_online"}"#),
    ("POST", "/admin/role", r#"{"chip": "h0-cpu0", "role": "both"}"#),
    ("GET", "/admin/plan", ""),
    ("POST", "/admin/plan/apply", r#"{"roles": {"h0-cpu0": "both"}}"#),
    ("POST", "/admin/plan/solve", ""),
];

/// `tessera keys add`: the key's text.
fn add_key(file: &Path, tenant: &str, role: &str) -> String {
    let out = tessera()
        .args(["keys", "add", "--tenant", tenant, "--role", role, "--file"])
        .arg(file)
        .output()
        .expect("tessera keys add");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let key = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(key.starts_with("tsk_"), "{key}");
    key
}

fn key_id(key: &str) -> &str {
    key.split('_').nth(1).unwrap()
}

fn completion(gw: std::net::SocketAddr, key: Option<&str>, max_tokens: usize) -> HttpResponse {
    let body = json!({"model": MODEL, "prompt": "Hello world", "max_tokens": max_tokens, "temperature": 0});
    request_as(gw, "POST", "/v1/completions", Some(&body.to_string()), key)
}

#[track_caller]
fn assert_error(r: &HttpResponse, status: u16, words: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.json()["error"].clone();
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains(words), "`{words}` not in {message:?}");
    e
}

/// Polls until `f` holds (the gateway re-reads the keys file within a second).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "{what} did not happen within 10 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn keys_quotas_roles_and_the_audit_log() {
    let keys_dir = tempfile::tempdir().unwrap();
    let keys_file = keys_dir.path().join("keys.json");
    let audit = keys_dir.path().join("audit.log");
    let tenants = format!(
        "[[tenants]]\nname = \"rpm\"\n[tenants.limits]\nrequests_per_min = 2\n\n\
         [[tenants]]\nname = \"tpm\"\n[tenants.limits]\ntokens_per_min = 60\n\n\
         [[tenants]]\nname = \"conc\"\n[tenants.limits]\nmax_concurrent = 1\n\n\
         [[tenants]]\nname = \"small\"\n[tenants.limits]\nmax_tokens = 8\n\n\
         [[tenants]]\nname = \"free\"\nmodels = [\"{MODEL}\"]\n\n\
         [[tenants]]\nname = \"elsewhere\"\nmodels = [\"another-model\"]\n\n\
         [[tenants]]\nname = \"own_a\"\n\n[[tenants]]\nname = \"own_b\"\n\n\
         [[tenants]]\nname = \"shared_a\"\nshare_prefix_cache = true\n\n\
         [[tenants]]\nname = \"shared_b\"\nshare_prefix_cache = true\n"
    );
    let gateway_extra = format!("keys_file = \"{}\"", keys_file.display());
    let chips = [ChipDef {
        host: "h0",
        id: "h0-cpu0".into(),
        toml: "kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1\n".into(),
    }];
    let topo = topology_of(&chips, &tenants, &gateway_extra, 1000);
    let keys: Vec<(&str, String)> =
        ["rpm", "tpm", "conc", "small", "free", "elsewhere", "own_a", "own_b", "shared_a", "shared_b"]
            .into_iter()
            .map(|tenant| (tenant, add_key(&keys_file, tenant, "user")))
            .collect();
    let key = |tenant: &str| keys.iter().find(|(t, _)| *t == tenant).map(|(_, k)| k.as_str()).unwrap();
    let operator = add_key(&keys_file, "free", "operator");
    let revoked = add_key(&keys_file, "free", "user");
    let out = tessera().args(["keys", "revoke", key_id(&revoked), "--file"]).arg(&keys_file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let mut cluster = Cluster::up_in_process(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(1);

    // Authentication.
    assert_eq!(assert_error(&completion(gw, None, 4), 401, "didn't provide an API key")["code"], "missing_api_key");
    assert_error(&completion(gw, Some("not-a-key"), 4), 401, "Incorrect API key");
    let forged = format!("{}{}", &operator[..operator.len() - 4], "0000");
    assert_error(&completion(gw, Some(&forged), 4), 401, "Incorrect API key");
    assert_error(&completion(gw, Some(&revoked), 4), 401, "revoked");
    assert_eq!(completion(gw, Some(key("free")), 4).status, 200);
    assert_eq!(
        assert_error(&completion(gw, Some(key("elsewhere")), 4), 404, "do not have access")["code"],
        "model_not_found"
    );
    assert_eq!(get(gw, "/health").status, 200, "probes need no key");

    // Each quota refuses its tenant, naming the limit, while `free` is served.
    // (tenant, requests that pass, the request refused: max_tokens, status, words, Retry-After)
    let table: &[(&str, usize, usize, usize, u16, &str, bool)] = &[
        ("rpm", 4, 2, 4, 429, "2 requests per minute", true),
        ("tpm", 40, 1, 40, 429, "60 tokens per minute", true),
        ("small", 8, 1, 9, 400, "limit of 8 tokens per request", false),
    ];
    for &(tenant, ok_tokens, passes, refused_tokens, status, words, retry) in table {
        for _ in 0..passes {
            assert_eq!(completion(gw, Some(key(tenant)), ok_tokens).status, 200, "{tenant}");
        }
        let r = completion(gw, Some(key(tenant)), refused_tokens);
        let e = assert_error(&r, status, words);
        assert!(e["message"].as_str().unwrap().contains(&format!("`{tenant}`")), "{e}");
        if retry {
            let after: u64 = r.header("retry-after").and_then(|v| v.parse().ok()).expect("Retry-After");
            assert!((1..=60).contains(&after), "Retry-After {after}");
            assert_eq!(e["code"], "rate_limit_exceeded");
        }
        assert_eq!(
            completion(gw, Some(key("free")), 4).status,
            200,
            "another tenant is served while {tenant} is refused"
        );
    }
    // Concurrency: one long stream in flight, the second request refused, `free` served.
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true,
        "temperature": 0, "stream": true});
    let mut sse = post_stream_as(gw, "/v1/completions", &body, Some(key("conc")))
        .unwrap_or_else(|r| panic!("the stream was refused: {} {}", r.status, r.body));
    assert!(sse.next_data().is_some(), "the stream started");
    let r = completion(gw, Some(key("conc")), 4);
    let e = assert_error(&r, 429, "sequences in flight");
    assert!(e["message"].as_str().unwrap().contains("limit is 1"), "{e}");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(completion(gw, Some(key("free")), 4).status, 200);
    while sse.next_data().is_some() {}
    eventually("the stream's seat is freed", || completion(gw, Some(key("conc")), 4).status == 200);

    // Prefix isolation: an identical prompt of another tenant reuses no cached block,
    // unless both tenants share their caches.
    let reused = || -> f64 {
        let text = get(gw, "/metrics").body;
        text.lines()
            .filter(|l| l.starts_with("tessera_prefix_reused_tokens_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let long = "The committee reviewed every proposal submitted this quarter and agreed that the \
                shared cluster should keep each team's cached prompts apart unless both teams ask.";
    let ask = |tenant: &str, tail: &str| {
        let body = json!({"model": MODEL, "prompt": format!("{long} {tail}"), "max_tokens": 1, "temperature": 0});
        let r = request_as(gw, "POST", "/v1/completions", Some(&body.to_string()), Some(key(tenant)));
        assert_eq!(r.status, 200, "{}", r.body);
    };
    // (tenant, reuses the blocks cached before it)
    for (tenant, hit) in [("own_a", false), ("own_b", false), ("own_a", true), ("shared_a", false), ("shared_b", true)]
    {
        let before = reused();
        ask(tenant, tenant);
        let after = reused();
        assert_eq!(after > before, hit, "{tenant}: reused tokens {before} -> {after}");
    }

    // Roles: a user key is refused on every admin route; an operator's is let through.
    for &(method, path, body) in ADMIN_ROUTES {
        let body = (!body.is_empty()).then_some(body);
        let r = request_as(gw, method, path, body, Some(key("free")));
        assert_error(&r, 403, "needs an operator or admin key");
        assert_error(&request_as(gw, method, path, body, None), 401, "didn't provide an API key");
        let r = request_as(gw, method, path, body, Some(&operator));
        assert!(![401, 403].contains(&r.status), "{method} {path} with an operator key: {} {}", r.status, r.body);
    }

    // Keys added and revoked while the gateway runs.
    let late = add_key(&keys_file, "free", "user");
    eventually("a new key is accepted", || completion(gw, Some(&late), 2).status == 200);
    let out = tessera().args(["keys", "revoke", key_id(&late), "--file"]).arg(&keys_file).output().unwrap();
    assert!(out.status.success());
    eventually("a revoked key is refused", || completion(gw, Some(&late), 2).status == 401);

    // The audit log: every admin call, the refusals, the key changes; its chain holds.
    let log = std::fs::read_to_string(&audit).unwrap();
    let entries: Vec<Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let count = |event: &str, who: Option<&str>| {
        entries.iter().filter(|e| e["event"] == event && who.is_none_or(|w| e["who"] == w)).count()
    };
    assert_eq!(count("admin_action", Some(key_id(&operator))), ADMIN_ROUTES.len(), "{log}");
    assert_eq!(count("admin_denied", Some(key_id(key("free")))), ADMIN_ROUTES.len());
    assert!(count("auth_failed", None) >= 4 + ADMIN_ROUTES.len());
    assert_eq!(count("key_created", None), keys.len() + 3);
    assert_eq!(count("key_revoked", None), 2);
    assert_eq!(count("gateway_started", None), 1);
    let started = entries.iter().find(|e| e["event"] == "gateway_started").unwrap();
    assert_eq!(started["tenants"][0]["requests_per_min"], 2, "the limits in force are recorded");
    let out = tessera().args(["audit", "verify"]).arg(&audit).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // An edit is found, naming its entry.
    let edited = log.replacen("\"status\":200", "\"status\":500", 1);
    std::fs::write(&audit, edited).unwrap();
    let out = tessera().args(["audit", "verify"]).arg(&audit).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("was edited") && err.contains("audit.log:"), "{err}");
}

#[test]
fn without_a_keys_file_admin_routes_take_the_generated_token() {
    let topo = topology(&["h0"], "", "", 1000);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(1);
    // `/v1/*` stays open, as the README's first command needs.
    assert_eq!(completion(gw, None, 2).status, 200);
    let token = tessera_access::token::read(&tessera_home(), gw).expect("up wrote the admin token");
    for &(method, path, body) in ADMIN_ROUTES {
        let body = (!body.is_empty()).then_some(body);
        assert_error(&request_as(gw, method, path, body, None), 401, "didn't provide an API key");
        assert_error(&request_as(gw, method, path, body, Some("tsa_00")), 401, "Incorrect API key");
        let r = request_as(gw, method, path, body, Some(&token));
        assert!(![401, 403].contains(&r.status), "{method} {path} with the token: {} {}", r.status, r.body);
    }
    // The CLI on this machine finds the token by itself.
    let out = tessera().args(["plan", "show", "--gateway", &format!("http://{gw}")]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("chips now"));
    // Elsewhere (another home) it has no token, and says how to give one.
    let other = tempfile::tempdir().unwrap();
    let out = tessera()
        .env("TESSERA_HOME", other.path())
        .args(["plan", "show", "--gateway", &format!("http://{gw}")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-key"), "{}", String::from_utf8_lossy(&out.stderr));
}
