use serde_json::json;

use super::*;

#[derive(Clone, Copy, Debug)]
enum Endpoint {
    Completion,
    Chat,
}
use Endpoint::{Chat, Completion};

fn base(endpoint: Endpoint) -> Value {
    match endpoint {
        Completion => json!({"model": "m", "prompt": "hi"}),
        Chat => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    }
}

/// The endpoint's minimal valid body with `fields` overriding (or, as `"$remove"`, removing) keys.
fn body_with(endpoint: Endpoint, fields: Value) -> Vec<u8> {
    let mut body = base(endpoint);
    if let (Value::Object(body), Value::Object(fields)) = (&mut body, fields) {
        for (key, value) in fields {
            if value == json!("$remove") {
                body.remove(&key);
            } else {
                body.insert(key, value);
            }
        }
    }
    serde_json::to_vec(&body).unwrap_or_default()
}

fn parse(endpoint: Endpoint, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    match endpoint {
        Completion => parse_completion(body),
        Chat => parse_chat(body),
    }
}

fn parse_ok(endpoint: Endpoint, fields: Value) -> GenerationRequest {
    match parse(endpoint, &body_with(endpoint, fields.clone())) {
        Ok(request) => request,
        Err(e) => panic!("{endpoint:?} {fields} refused: {e}"),
    }
}

#[test]
fn every_validation_error_names_its_param() {
    // (endpoint, fields over the minimal valid body, expected param, message fragment)
    let cases: Vec<(Endpoint, Value, Option<&str>, &str)> = vec![
        (Completion, json!({"model": "$remove"}), Some("model"), "`model`"),
        (Chat, json!({"model": "$remove"}), Some("model"), "`model`"),
        (Chat, json!({"model": ""}), Some("model"), "`model`"),
        (Chat, json!({"model": 7}), Some("model"), "must be a string, got a number"),
        (Completion, json!({"prompt": "$remove"}), Some("prompt"), "provide a `prompt`"),
        (Completion, json!({"prompt": []}), Some("prompt"), "must not be empty"),
        (Completion, json!({"prompt": [[]]}), Some("prompt"), "must not be empty"),
        (Completion, json!({"prompt": ["a", "b"]}), Some("prompt"), "Only one prompt per request"),
        (Completion, json!({"prompt": [[1, 2], [3]]}), Some("prompt"), "batch of 2"),
        (Completion, json!({"prompt": [1, -2]}), Some("prompt"), "between 0 and 4294967295, got -2"),
        (Completion, json!({"prompt": [4294967296u64]}), Some("prompt"), "got 4294967296"),
        (Completion, json!({"prompt": [1.5]}), Some("prompt"), "got 1.5"),
        (Completion, json!({"prompt": [1, "a"]}), Some("prompt"), "token ids must be integers"),
        (Completion, json!({"prompt": [true]}), Some("prompt"), "got a boolean"),
        (Completion, json!({"prompt": {"text": "hi"}}), Some("prompt"), "got an object"),
        (Chat, json!({"messages": "$remove"}), Some("messages"), "provide `messages`"),
        (Chat, json!({"messages": []}), Some("messages"), "must not be empty"),
        (Chat, json!({"messages": "hi"}), Some("messages"), "must be an array of messages, got a string"),
        (Chat, json!({"messages": ["hi"]}), Some("messages[0]"), "must be an object"),
        (Chat, json!({"messages": [{"content": "hi"}]}), Some("messages[0].role"), "is required"),
        (Chat, json!({"messages": [{"role": 1, "content": "hi"}]}), Some("messages[0].role"), "must be a string"),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "hi"}]}),
            Some("messages[1].role"),
            "`wizard` is unknown",
        ),
        (Chat, json!({"messages": [{"role": "tool", "content": "42"}]}), Some("messages[0].tool_call_id"), "required"),
        (Chat, json!({"messages": [{"role": "user"}]}), Some("messages[0].content"), "is required"),
        (Chat, json!({"messages": [{"role": "user", "content": 3}]}), Some("messages[0].content"), "got a number"),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
            Some("messages[0].content[1]"),
            "images are not supported",
        ),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
            Some("messages[0].content[0]"),
            "`input_audio` are not supported",
        ),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": [{"text": "a"}]}]}),
            Some("messages[0].content[0]"),
            "type` is required",
        ),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            Some("messages[0].content[0].text"),
            "is required",
        ),
        (
            Chat,
            json!({"messages": [{"role": "user", "content": ["a"]}]}),
            Some("messages[0].content[0]"),
            "must be an object",
        ),
        (
            Chat,
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}),
            Some("messages[0].tool_calls[0]"),
            "\"function\"",
        ),
        (Completion, json!({"temperature": 2.5}), Some("temperature"), "between 0 and 2, got 2.5"),
        (Chat, json!({"temperature": -0.1}), Some("temperature"), "between 0 and 2"),
        (Chat, json!({"temperature": "hot"}), Some("temperature"), "must be a number, got a string"),
        (Completion, json!({"top_p": 0}), Some("top_p"), "greater than 0"),
        (Chat, json!({"top_p": 1.01}), Some("top_p"), "at most 1"),
        (Completion, json!({"max_tokens": 0}), Some("max_tokens"), "at least 1, got 0"),
        (Completion, json!({"max_tokens": -5}), Some("max_tokens"), "at least 1"),
        (Completion, json!({"max_tokens": (1u64 << 20) + 1}), Some("max_tokens"), "at most 1048576"),
        (Completion, json!({"max_tokens": 1.5}), Some("max_tokens"), "must be an integer"),
        (Chat, json!({"max_tokens": 0}), Some("max_tokens"), "at least 1"),
        (Chat, json!({"max_completion_tokens": 0}), Some("max_completion_tokens"), "at least 1"),
        (Chat, json!({"max_completion_tokens": 10_000_000}), Some("max_completion_tokens"), "at most"),
        (Completion, json!({"top_k": -2}), Some("top_k"), "0 or -1 to turn it off"),
        (Chat, json!({"seed": "x"}), Some("seed"), "must be an integer"),
        (Completion, json!({"stream": "yes"}), Some("stream"), "must be a boolean"),
        (
            Chat,
            json!({"stream_options": {"include_usage": true}}),
            Some("stream_options"),
            "only allowed when `stream`",
        ),
        (Chat, json!({"stream": true, "stream_options": true}), Some("stream_options"), "must be an object"),
        (
            Chat,
            json!({"stream": true, "stream_options": {"include_usage": 1}}),
            Some("stream_options.include_usage"),
            "`stream_options.include_usage` must be a boolean",
        ),
        (Completion, json!({"stop": 3}), Some("stop"), "a string or an array of strings"),
        (Completion, json!({"stop": ["a", 3]}), Some("stop"), "a string or an array of strings"),
        (Chat, json!({"stop": [""]}), Some("stop"), "must not be empty"),
        (Chat, json!({"stop": vec!["x"; 17]}), Some("stop"), "at most 16 strings, got 17"),
        (Completion, json!({"stop_token_ids": [-1]}), Some("stop_token_ids"), "between 0 and"),
        (Completion, json!({"stop_token_ids": 5}), Some("stop_token_ids"), "an array of token ids"),
        (Chat, json!({"ignore_eos": "true"}), Some("ignore_eos"), "must be a boolean"),
        (Completion, json!({"n": 0}), Some("n"), "between 1 and 64"),
        (Chat, json!({"n": 65}), Some("n"), "between 1 and 64"),
        (Completion, json!({"n": 3, "best_of": 2}), Some("best_of"), "at least `n` (3)"),
        (Completion, json!({"best_of": 2, "stream": true}), Some("best_of"), "`stream`"),
        (Chat, json!({"best_of": 2}), Some("best_of"), "completions parameter"),
        (Completion, json!({"max_tokens": 0}), Some("max_tokens"), "at least 1"),
        (Completion, json!({"logprobs": 21}), Some("logprobs"), "between 0 and 20, got 21"),
        (Completion, json!({"logprobs": -1}), Some("logprobs"), "between 0 and 20"),
        (Completion, json!({"logprobs": true}), Some("logprobs"), "an integer"),
        (Chat, json!({"logprobs": 1}), Some("logprobs"), "a boolean"),
        (Chat, json!({"logprobs": true, "top_logprobs": 30}), Some("top_logprobs"), "between 0 and 20"),
        (Chat, json!({"top_logprobs": 5}), Some("top_logprobs"), "needs `logprobs` set to true"),
        (Completion, json!({"suffix": "end"}), Some("suffix"), "not supported"),
        (Chat, json!({"tools": [{"type": "function"}]}), Some("tools[0]"), "needs a `function` object"),
        (Chat, json!({"functions": [{"name": "f"}]}), Some("functions"), "deprecated"),
        (Chat, json!({"tool_choice": "auto"}), Some("tool_choice"), "needs `tools`"),
        (Chat, json!({"function_call": "auto"}), Some("function_call"), "deprecated"),
        (Chat, json!({"response_format": {"type": "yaml"}}), Some("response_format.type"), "json_schema"),
        (Chat, json!({"response_format": {"type": "json_schema"}}), Some("response_format.json_schema"), "required"),
        (Completion, json!({"guided_choice": []}), Some("guided_choice"), "at least one"),
        (Completion, json!({"guided_regex": 5}), Some("guided_regex"), "a string"),
        (Completion, json!({"guided_json": "{"}), Some("guided_json"), "not a JSON schema"),
        (Completion, json!({"structured_outputs": {"yaml": "x"}}), Some("structured_outputs"), "json, regex"),
        (
            Completion,
            json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
            Some("guided_regex"),
            "only one",
        ),
        (
            Chat,
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                   "guided_regex": "a"}),
            Some("guided_regex"),
            "cannot be asked for",
        ),
        (Completion, json!({"presence_penalty": 2.5}), Some("presence_penalty"), "between -2 and 2, got 2.5"),
        (Chat, json!({"frequency_penalty": "1"}), Some("frequency_penalty"), "a number"),
        (Chat, json!({"repetition_penalty": 0}), Some("repetition_penalty"), "greater than 0 and at most 2"),
        (Chat, json!({"min_tokens": 20, "max_tokens": 5}), Some("min_tokens"), "max_tokens, got 20"),
        (Completion, json!({"min_tokens": -1}), Some("min_tokens"), "between 0"),
        (Completion, json!({"logit_bias": {"x": 1}}), Some("logit_bias"), "keys must be token ids"),
        (Completion, json!({"logit_bias": {"5": 101}}), Some("logit_bias"), "between -100 and 100"),
        (Completion, json!({"logit_bias": [1]}), Some("logit_bias"), "an object of token ids"),
        (Completion, json!({"min_p": 0.1}), Some("min_p"), "must be 0"),
    ];
    for (endpoint, fields, param, fragment) in cases {
        let body = body_with(endpoint, fields.clone());
        let err = match parse(endpoint, &body) {
            Ok(request) => panic!("{endpoint:?} {fields} accepted as {request:?}"),
            Err(err) => err,
        };
        assert_eq!(err.status, 400, "{endpoint:?} {fields}: {err:?}");
        assert_eq!(err.kind, "invalid_request_error", "{endpoint:?} {fields}");
        assert_eq!(err.param.as_deref(), param, "{endpoint:?} {fields}: {}", err.message);
        assert!(err.message.contains(fragment), "{endpoint:?} {fields}: {:?} lacks {fragment:?}", err.message);
    }
}

#[test]
fn malformed_bodies_are_refused_with_position() {
    let cases: Vec<(&[u8], &str)> = vec![
        (b"{\"model\": \"m\",\n \"prompt\": }", "line 2 column"),
        (b"", "EOF while parsing"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got an array"),
        (b"\"hi\"", "must be a JSON object, got a string"),
    ];
    for endpoint in [Completion, Chat] {
        for (body, fragment) in &cases {
            let err = parse(endpoint, body).err().unwrap_or_else(|| panic!("{body:?} accepted"));
            assert_eq!((err.status, err.param.as_deref()), (400, None), "{err:?}");
            assert!(err.message.contains(fragment), "{:?} lacks {fragment:?}", err.message);
        }
    }
}

#[test]
fn completion_defaults_follow_openai() {
    let r = parse_ok(Completion, json!({}));
    assert_eq!(
        r,
        GenerationRequest {
            model: "m".into(),
            prompt: Prompt::Text("hi".into()),
            stream: false,
            include_usage: false,
            max_tokens: Some(16),
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: vec![],
            min_tokens: 0,
            echo: false,
            structured: None,
            tools: crate::openai::Tools::none(),
            n: 1,
            best_of: None,
        }
    );
    // echo, and max_tokens 0 with it alone (a scoring request).
    let e = parse_ok(Completion, json!({"echo": true, "max_tokens": 0, "logprobs": 1}));
    assert_eq!((e.echo, e.max_tokens, e.logprobs), (true, Some(0), Some(1)));
    // Penalties, biases and min_tokens, as given.
    let p = parse_ok(
        Chat,
        json!({"presence_penalty": -2, "frequency_penalty": 1.5, "repetition_penalty": 1.2,
               "logit_bias": {"50": -100, "7": 2.5}, "min_tokens": 3, "max_tokens": 8}),
    );
    assert_eq!((p.presence_penalty, p.frequency_penalty, p.repetition_penalty), (-2.0, 1.5, 1.2));
    assert_eq!((p.logit_bias, p.min_tokens), (vec![(7, 2.5), (50, -100.0)], 3));
    // Log-probabilities: completions' count; chat's flag with an optional count.
    assert_eq!(parse_ok(Completion, json!({"logprobs": 0})).logprobs, Some(0));
    assert_eq!(parse_ok(Completion, json!({"logprobs": 5})).logprobs, Some(5));
    assert_eq!(parse_ok(Chat, json!({"logprobs": true})).logprobs, Some(0));
    assert_eq!(parse_ok(Chat, json!({"logprobs": true, "top_logprobs": 20})).logprobs, Some(20));
    assert_eq!(parse_ok(Chat, json!({"logprobs": false, "top_logprobs": 0})).logprobs, None);
    // `null` reads as absent, the way many clients send unset fields.
    assert_eq!(parse_ok(Completion, json!({"max_tokens": null, "stop": null, "n": null, "logprobs": null})), r);
}

#[test]
fn chat_defaults_leave_max_tokens_to_the_context() {
    let r = parse_ok(Chat, json!({}));
    assert_eq!(r.max_tokens, None);
    assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::text("user", "hi".into())]));
    assert_eq!((r.temperature, r.top_p, r.stream), (1.0, 1.0, false));
}

#[test]
fn completion_prompt_forms() {
    let cases = vec![
        (json!("hello"), Prompt::Text("hello".into())),
        (json!(""), Prompt::Text(String::new())),
        (json!(["hello"]), Prompt::Text("hello".into())),
        (json!([1, 2, 4294967295u64]), Prompt::TokenIds(vec![1, 2, u32::MAX])),
        (json!([[7, 8]]), Prompt::TokenIds(vec![7, 8])),
    ];
    for (prompt, expected) in cases {
        assert_eq!(parse_ok(Completion, json!({ "prompt": prompt })).prompt, expected, "{prompt}");
    }
}

#[test]
fn sampling_fields_are_read() {
    let r = parse_ok(
        Completion,
        json!({
            "max_tokens": 1 << 20, "temperature": 0, "top_p": 0.5, "top_k": 40, "seed": 42,
            "stop": "\n", "stop_token_ids": [2, 0], "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true},
        }),
    );
    assert_eq!(r.max_tokens, Some(1 << 20));
    assert_eq!((r.temperature, r.top_p, r.top_k, r.seed), (0.0, 0.5, Some(40), Some(42)));
    assert_eq!(r.stop, vec!["\n".to_owned()]);
    assert_eq!(r.stop_token_ids, vec![2, 0]);
    assert!(r.ignore_eos && r.stream && r.include_usage);

    let r = parse_ok(Chat, json!({"stop": ["a", "b"], "top_k": -1, "seed": -1, "temperature": 2}));
    assert_eq!(r.stop, vec!["a".to_owned(), "b".to_owned()]);
    assert_eq!((r.top_k, r.seed, r.temperature), (None, Some(u64::MAX), 2.0));
    assert_eq!(parse_ok(Chat, json!({"top_k": 0})).top_k, None);
    assert!(!parse_ok(Chat, json!({"stream": true})).include_usage);
}

#[test]
fn chat_max_completion_tokens_wins_over_max_tokens() {
    assert_eq!(parse_ok(Chat, json!({"max_tokens": 10})).max_tokens, Some(10));
    assert_eq!(parse_ok(Chat, json!({"max_completion_tokens": 20, "max_tokens": 10})).max_tokens, Some(20));
}

#[test]
fn neutral_values_of_unsupported_fields_and_unknown_fields_are_accepted() {
    // What LangChain's and other clients send on every request.
    parse_ok(
        Completion,
        json!({"n": 1, "best_of": 1, "echo": false, "logit_bias": {}, "presence_penalty": 0,
               "frequency_penalty": 0.0, "suffix": "", "user": "u", "some_future_field": [1]}),
    );
    parse_ok(
        Chat,
        json!({"n": 1, "logprobs": false, "top_logprobs": 0, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "repetition_penalty": 1, "min_p": 0,
               "parallel_tool_calls": false, "metadata": {"a": "b"}}),
    );
}

#[test]
fn chat_messages_are_normalized() {
    let r = parse_ok(
        Chat,
        json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "日本"}], "name": "x"},
            {"role": "assistant", "content": null},
            {"role": "assistant", "content": "ok", "tool_calls": []},
        ]}),
    );
    let expected = vec![
        ChatMessage::text("system", "be brief".into()),
        ChatMessage::text("user", "héllo 日本".into()),
        ChatMessage::text("assistant", String::new()),
        ChatMessage::text("assistant", "ok".into()),
    ];
    assert_eq!(r.prompt, Prompt::Chat(expected));
}

#[test]
fn chat_message_deserializes_string_or_text_parts() {
    let m: ChatMessage = serde_json::from_value(
        json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m, ChatMessage::text("user", "ab".into()));
    let m: ChatMessage =
        serde_json::from_value(json!({"role": "user", "content": "c"})).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(serde_json::to_value(&m).ok(), Some(json!({"role": "user", "content": "c"})));
    let err = serde_json::from_value::<ChatMessage>(json!({"role": "user", "content": [{"type": "image_url"}]}));
    assert!(err.is_err_and(|e| e.to_string().contains("images are not supported")));
}
