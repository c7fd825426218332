//! Structured outputs, tool calls and several choices per request, on the shared
//! SmolLM2-135M-Instruct served disaggregated (prefill on an emulated Ascend 910B,
//! decode on an emulated MetaX C500): the grammar is enforced on the chip that samples.
//! Sampled at temperature 1, so the model, left alone, would rarely write valid JSON.

use crate::serve_kit::{get, post_json, post_stream};
use serde_json::{Value, json};
use std::net::SocketAddr;

/// Requests of each kind the acceptance asks to hold in every case.
const REQUESTS: usize = 50;
/// Requests in flight at once.
const CONCURRENCY: usize = 8;

/// `bodies` posted to `path`, [`CONCURRENCY`] at a time; the responses in order.
fn post_all(gateway: SocketAddr, path: &str, bodies: Vec<Value>) -> Vec<Value> {
    let chunks: Vec<Vec<(usize, Value)>> = {
        let mut chunks = vec![Vec::new(); CONCURRENCY];
        for (i, b) in bodies.into_iter().enumerate() {
            chunks[i % CONCURRENCY].push((i, b));
        }
        chunks
    };
    let mut out: Vec<(usize, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                s.spawn(move || {
                    chunk.into_iter().map(|(i, b)| (i, post_json(gateway, path, &b).json())).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a client thread")).collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, v)| v).collect()
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"type": "string", "enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": false
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}
        },
        "required": ["name", "age", "role", "address", "tags"],
        "additionalProperties": false
    })
}

/// Why `v` does not validate against [`person_schema`], if it does not.
fn person_error(v: &Value) -> Option<String> {
    let o = v.as_object()?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    if sorted != ["address", "age", "name", "role", "tags"] {
        return Some(format!("keys {keys:?}"));
    }
    let short = |v: &Value, n: usize| v.as_str().is_some_and(|s| s.chars().count() <= n);
    if !short(&o["name"], 20) {
        return Some("name".into());
    }
    if !o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)) || !o["age"].is_i64() {
        return Some("age".into());
    }
    if !["admin", "user", "guest"].contains(&o["role"].as_str().unwrap_or("")) {
        return Some("role".into());
    }
    let address = o["address"].as_object()?;
    let zip_ok = address
        .get("zip")
        .and_then(Value::as_str)
        .is_some_and(|z| z.len() == 5 && z.bytes().all(|b| b.is_ascii_digit()));
    if address.len() != 2 || !address.get("city").is_some_and(|c| short(c, 20)) || !zip_ok {
        return Some(format!("address {}", Value::Object(address.clone())));
    }
    let tags = o["tags"].as_array()?;
    if !(1..=3).contains(&tags.len()) || !tags.iter().all(|t| short(t, 10)) {
        return Some("tags".into());
    }
    None
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_time",
        "description": "The time now in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"], "additionalProperties": false}
    }})
}

/// Why a `get_weather` / `get_time` call is not valid, if it is not.
fn call_error(call: &Value) -> Option<String> {
    let name = call["function"]["name"].as_str()?;
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str()?).ok()?;
    let ok = match name {
        "get_weather" => {
            args["city"].is_string()
                && ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or(""))
                && args.as_object().is_some_and(|o| o.len() == 2)
        }
        "get_time" => args["tz"].is_string() && args.as_object().is_some_and(|o| o.len() == 1),
        _ => false,
    };
    (!ok || call["type"] != "function" || !call["id"].as_str().is_some_and(|id| id.starts_with("call_")))
        .then(|| format!("{call}"))
}

#[test]
fn smollm2_follows_schemas_and_calls_tools_and_samples_several_choices() {
    let cluster = crate::gguf::smollm2_disaggregated();
    let gw = cluster.gateway;

    // 1. JSON schemas: every answer validates.
    let bodies = (0..REQUESTS)
        .map(|i| {
            json!({"model": "smollm2", "temperature": 1, "seed": i, "max_tokens": 200, "messages": [
                {"role": "user", "content": "Describe a person as JSON: name, age, role, address and tags."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": person_schema()}}})
        })
        .collect();
    for (i, r) in post_all(gw, "/v1/chat/completions", bodies).iter().enumerate() {
        let content = r["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("request {i}: {r}"));
        let v: Value =
            serde_json::from_str(content).unwrap_or_else(|e| panic!("request {i}: not JSON ({e}): {content}"));
        assert_eq!(person_error(&v), None, "request {i}: {content}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "request {i}: {r}");
    }

    // 2. tool_choice required: every answer is a parseable call of an offered tool.
    let bodies = (0..REQUESTS)
        .map(|i| {
            json!({"model": "smollm2", "temperature": 1, "seed": i, "max_tokens": 120, "parallel_tool_calls": false,
                "tools": [weather_tool(), time_tool()], "tool_choice": "required",
                "messages": [{"role": "user", "content": "What's the weather like in Paris today?"}]})
        })
        .collect();
    for (i, r) in post_all(gw, "/v1/chat/completions", bodies).iter().enumerate() {
        let choice = &r["choices"][0];
        let calls = choice["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("request {i}: {r}"));
        assert_eq!(calls.len(), 1, "request {i}: {r}");
        assert_eq!(call_error(&calls[0]), None, "request {i}");
        assert_eq!(
            (&choice["finish_reason"], &choice["message"]["content"]),
            (&json!("tool_calls"), &Value::Null),
            "{r}"
        );
    }
    // A named choice calls that function; streamed, the call comes as a delta.
    let named = json!({"model": "smollm2", "temperature": 1, "seed": 3, "max_tokens": 120, "stream": true, "parallel_tool_calls": false,
        "tools": [weather_tool(), time_tool()], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}]});
    let Ok(mut sse) = post_stream(gw, "/v1/chat/completions", &named) else { panic!("the stream was refused") };
    let (mut deltas, mut finish) = (Vec::new(), Value::Null);
    while let Some(data) = sse.next_data() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).expect("a JSON chunk");
        let choice = &chunk["choices"][0];
        if let Some(calls) = choice["delta"]["tool_calls"].as_array() {
            deltas.extend(calls.iter().cloned());
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!((deltas.len(), &finish), (1, &json!("tool_calls")), "{deltas:?}");
    assert_eq!((deltas[0]["index"].as_u64(), deltas[0]["function"]["name"].as_str()), (Some(0), Some("get_time")));
    assert_eq!(call_error(&deltas[0]), None);

    // 3. n choices; best_of: the best 2 of 4 candidates, by their tokens' summed
    // log-probability (the forks themselves: `n_choices_fork_from_one_prefill`).
    let prompt = "Once upon a time, in a land far away, there lived a dragon who loved to read books about ".repeat(3);
    let best = post_json(
        gw,
        "/v1/completions",
        &json!({"model": "smollm2", "prompt": prompt, "max_tokens": 6,
        "temperature": 1, "seed": 1, "n": 2, "best_of": 4}),
    )
    .json();
    assert_eq!(best["choices"].as_array().map(Vec::len), Some(2), "{best}");
    assert_eq!(best["usage"]["completion_tokens"], 24, "all four candidates are counted: {best}");
}

/// The value of the metric line named `name` (labels included), 0 when absent.
fn metric(metrics: &str, name: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// `n: 4` with a seed: four choices, each the completion a single request with seed
/// `seed + i` gets, from one prefill: the other three fork from the first on the chip
/// that samples its first token (the prompt's KV shared, the partial last block
/// copied), colocated and disaggregated. Echoed prompt scores reach every choice.
#[test]
fn n_choices_fork_from_one_prefill() {
    let prompt = "Once upon a time, in a land far away, there lived a dragon who loved to read books about ".repeat(3)
        + "the sea";
    type Up = fn() -> crate::serve_kit::Cluster;
    let clusters: [(&str, Up, &str); 2] = [
        ("colocated", crate::gguf::smollm2_colocated, "h0-cpu0"),
        ("disaggregated", crate::gguf::smollm2_disaggregated, "h0-ascend0"),
    ];
    for (placement, up, prefill_chip) in clusters {
        let cluster = up();
        let gw = cluster.gateway;
        let ask = |seed: u64, n: usize| {
            let body =
                json!({"model": "smollm2", "prompt": prompt, "max_tokens": 12, "temperature": 1, "seed": seed, "n": n});
            post_json(gw, "/v1/completions", &body).json()
        };
        let texts = |r: &Value| -> Vec<String> {
            let choices = r["choices"].as_array().unwrap_or_else(|| panic!("{r}"));
            let indices: Vec<u64> = choices.iter().filter_map(|c| c["index"].as_u64()).collect();
            assert_eq!(indices, (0..choices.len() as u64).collect::<Vec<_>>(), "{r}");
            choices.iter().map(|c| c["text"].as_str().unwrap_or_default().to_owned()).collect()
        };
        // Each seed alone, one after another: decoded at batch 1. A first request fills
        // the prefix cache, so each computes the same part of the prompt (the kernels'
        // numerics depend on the chunk: a prompt computed whole differs in the last bits).
        ask(1, 1);
        // Prompt positions the chip that prefills started (the gateway's process holds it).
        let prompt_positions = format!("tessera_prefix_prompt_tokens_total{{chip=\"{prefill_chip}\"}}");
        let before = get(gw, "/metrics").body;
        let singles: Vec<String> = (0..4).flat_map(|i| texts(&ask(7 + i, 1))).collect();
        let after = get(gw, "/metrics").body;
        let prefilled_singly = metric(&after, &prompt_positions) - metric(&before, &prompt_positions);
        assert!(prefilled_singly > 0.0, "{placement}: {after}");

        let decisions = format!("tessera_router_decisions_total{{placement=\"{placement}\"}}");
        let before = get(gw, "/metrics").body;
        let forked = ask(7, 4);
        let after = get(gw, "/metrics").body;
        assert_eq!(texts(&forked), singles, "{placement}: choice i is seed 7 + i's completion");
        let distinct: std::collections::HashSet<&String> = singles.iter().collect();
        assert!(distinct.len() > 1, "{placement}: each choice has its own sampler: {singles:?}");
        assert_eq!(forked["usage"]["completion_tokens"], 48, "{forked}");
        let prompt_tokens = forked["usage"]["prompt_tokens"].as_u64().unwrap_or_else(|| panic!("{forked}"));
        assert_ne!(prompt_tokens % 16, 0, "the prompt's last KV block (of 16) is partial: each fork copies it");
        // One placement, one prefill; three sequences forked from it.
        assert_eq!(metric(&after, &decisions) - metric(&before, &decisions), 1.0, "{placement}: {after}");
        let forks = metric(&after, "tessera_request_forked_total") - metric(&before, "tessera_request_forked_total");
        assert_eq!(forks, 3.0, "{placement}: {after}");
        let prefilled = metric(&after, &prompt_positions) - metric(&before, &prompt_positions);
        // Disaggregated, a single request's P samples its first token, so it computes the
        // last prompt position too; a forking one leaves that to D, where the forks are.
        let last_on_p = if placement == "disaggregated" { 1.0 } else { 0.0 };
        assert_eq!((prefilled + last_on_p) * 4.0, prefilled_singly, "{placement}: the prompt is prefilled once");

        // A scoring request of two choices: both echo the prompt with its scores.
        let body = json!({"model": "smollm2", "prompt": "The capital of France is Paris", "max_tokens": 0,
            "echo": true, "logprobs": 1, "n": 2});
        let scored = post_json(gw, "/v1/completions", &body).json();
        let choices = scored["choices"].as_array().unwrap_or_else(|| panic!("{scored}"));
        assert_eq!(choices.len(), 2, "{scored}");
        let lps: Vec<&Value> = choices.iter().map(|c| &c["logprobs"]["token_logprobs"]).collect();
        assert!(lps[0].as_array().is_some_and(|l| l.len() > 3 && l[0].is_null() && l[1].is_f64()), "{scored}");
        assert_eq!(lps[0], lps[1], "{placement}: {scored}");
    }
}
