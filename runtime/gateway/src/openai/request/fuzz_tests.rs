//! Bounded fuzzing of [`parse_completion`] and [`parse_chat`] (CI), and of the chat
//! template on what `parse_chat` accepts: request bodies are the first bytes a client
//! controls. Inputs are arbitrary bytes, and valid bodies with one field (top-level, in
//! a message, in a content part) replaced by a hostile JSON text — 1e400, -0, 2^63, 2^64,
//! nesting past serde_json's limit, the wrong type — then bytes flipped, cut or inserted.
//! A body is refused with a 400 naming a field, never a panic; an accepted one holds
//! only what the rest of the server is written to take (temperature in [0, 2], top_p in
//! (0, 1] *as the f32 sent on*, bounded max_tokens and stop strings…). The
//! coverage-guided targets are `tests/fuzz/fuzz_targets/openai_{completion,chat}.rs`.

use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::openai::ChatTemplate;

/// JSON texts that a valid request never holds where they are put, or holds only at an
/// extreme. Written as text because several (1e400, -0, 2^64) have no `Value`.
fn hostile_texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "0",
        "-1",
        "1",
        "2",
        "2.0000000001",
        "1e300",
        "-1e300",
        "1e-300",
        "1e-50",
        "5e-324",
        "1e400",
        "-1e400",
        "-0",
        "-0.0",
        "0.0",
        "1E+2",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        "1048576",
        "1048577",
        "4294967295",
        "4294967296",
        "0.5",
        "null",
        "true",
        "false",
        "\"\"",
        "\"x\"",
        "\"none\"",
        "\"text\"",
        "\"image_url\"",
        "\"developer\"",
        "\"tool\"",
        "\"\\ud800\"",
        "\"\\u0000\"",
        "[]",
        "[[]]",
        "[\"\"]",
        "[1, 2]",
        "[1, -2]",
        "[[1], [2]]",
        "[4294967296]",
        "[null]",
        "{}",
        "{\"type\": \"text\"}",
        "{\"type\": \"text\", \"text\": 1}",
        "{\"include_usage\": true}",
        "{\"include_usage\": 1}",
        "[{\"type\": \"text\", \"text\": \"a\"}, {\"type\": \"image_url\"}]",
        "[{\"role\": \"user\", \"content\": \"a\"}]",
        "[{\"id\": \"call\"}]",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    texts.push(format!("{}0{}", "[".repeat(200), "]".repeat(200)));
    texts.push(format!("{}1{}", "{\"a\":".repeat(140), "}".repeat(140)));
    texts.push(format!("[{}]", vec!["\"s\""; 17].join(",")));
    texts.push(format!("\"{}\"", "é".repeat(5000)));
    texts
}

const TOP_KEYS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "best_of",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "logprobs",
    "suffix",
    "top_logprobs",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
    "user",
    "x-unknown",
];

const MESSAGE_KEYS: &[&str] = &["role", "content", "tool_calls", "function_call", "name"];

/// Where the hostile text goes.
#[derive(Debug, Clone)]
enum Site {
    Top(usize),
    /// A key of the `n`-th message (modulo their count).
    Message(usize, usize),
    /// The `text` or `type` of a content part of the `n`-th message.
    Part(usize, bool),
    /// The `n`-th number of the serialized body (modulo their count), as text.
    Number(usize),
}

fn arb_site() -> impl Strategy<Value = Site> {
    prop_oneof![
        4 => (0..TOP_KEYS.len()).prop_map(Site::Top),
        2 => (any::<usize>(), 0..MESSAGE_KEYS.len()).prop_map(|(n, k)| Site::Message(n, k)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(n, text)| Site::Part(n, text)),
        2 => any::<usize>().prop_map(Site::Number),
    ]
}

#[derive(Debug, Clone)]
enum Scratch {
    None,
    Flip(usize, u8),
    Cut(usize),
    Insert(usize, Vec<u8>),
}

fn arb_scratch() -> impl Strategy<Value = Scratch> {
    prop_oneof![
        5 => Just(Scratch::None),
        1 => (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Scratch::Flip(at, x)),
        1 => any::<usize>().prop_map(Scratch::Cut),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..6)).prop_map(|(at, b)| Scratch::Insert(at, b)),
    ]
}

/// Valid bodies of both endpoints, neutral values of the unsupported fields included.
fn seeds() -> Vec<Value> {
    vec![
        json!({"model": "m", "prompt": "hi"}),
        json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "stop": ["\n"], "seed": -1}),
        json!({"model": "m", "prompt": [[5]], "stream": true, "stream_options": {"include_usage": true},
               "top_k": 40, "top_p": 0.9, "n": 1, "echo": false, "logit_bias": {}, "suffix": ""}),
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        json!({"model": "m", "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "tool_calls": []},
                {"role": "user", "content": "c"}],
               "max_completion_tokens": 3, "max_tokens": 9, "stop_token_ids": [2], "ignore_eos": true,
               "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": false,
               "top_logprobs": 0, "presence_penalty": 0.0, "repetition_penalty": 1}),
    ]
}

const PLACEHOLDER: &str = "\u{1}HOSTILE\u{1}";

/// `seed` with the hostile text at `site`, serialized, then scratched.
fn body(seed: &Value, site: &Site, hostile: &str, scratch: &Scratch) -> Vec<u8> {
    let mut value = seed.clone();
    let placeholder = Value::String(PLACEHOLDER.to_owned());
    match site {
        Site::Top(k) => {
            if let Value::Object(object) = &mut value {
                object.insert(TOP_KEYS[*k].to_owned(), placeholder);
            }
        }
        Site::Message(n, k) => {
            if let Some(Value::Array(messages)) = value.get_mut("messages")
                && !messages.is_empty()
            {
                let i = n % messages.len();
                if let Value::Object(message) = &mut messages[i] {
                    message.insert(MESSAGE_KEYS[*k].to_owned(), placeholder);
                }
            }
        }
        Site::Part(n, text) => {
            if let Some(Value::Array(messages)) = value.get_mut("messages")
                && !messages.is_empty()
            {
                let i = n % messages.len();
                let key = if *text { "text" } else { "type" };
                let mut part = json!({"type": "text", "text": "p"});
                part[key] = placeholder;
                messages[i]["content"] = json!([part]);
            }
        }
        Site::Number(_) => {}
    }
    let mut text = serde_json::to_string(&value).unwrap_or_default();
    let escaped = "\"\\u0001HOSTILE\\u0001\"";
    if let Some(at) = text.find(escaped) {
        text.replace_range(at..at + escaped.len(), hostile);
    } else if let Site::Number(n) = site {
        let numbers = number_spans(&text);
        if !numbers.is_empty() {
            let (start, end) = numbers[n % numbers.len()];
            text.replace_range(start..end, hostile);
        }
    }
    let mut bytes = text.into_bytes();
    let len = bytes.len().max(1);
    match scratch {
        Scratch::None => {}
        Scratch::Flip(at, x) => bytes[at % len] ^= x,
        Scratch::Cut(at) => bytes.truncate(at % len),
        Scratch::Insert(at, extra) => {
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, extra.iter().copied());
        }
    }
    bytes
}

/// Byte spans of the numbers outside strings of compact JSON `text`.
fn number_spans(text: &str) -> Vec<(usize, usize)> {
    let bytes = text.as_bytes();
    let (mut spans, mut in_string, mut escaped, mut i) = (Vec::new(), false, false, 0);
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            i += 1;
        } else if b == b'"' {
            in_string = true;
            i += 1;
        } else if b == b'-' || b.is_ascii_digit() {
            let start = i;
            while i < bytes.len() && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                i += 1;
            }
            spans.push((start, i));
        } else {
            i += 1;
        }
    }
    spans
}

/// What the rest of the gateway relies on in an accepted request.
fn check_accepted(request: &GenerationRequest, chat: bool) -> Result<(), TestCaseError> {
    prop_assert!(!request.model.is_empty());
    prop_assert!((0.0..=2.0).contains(&request.temperature), "temperature {}", request.temperature);
    // The f32 that sampling receives, which refuses 0 (`SamplingParams::validate`).
    prop_assert!(request.top_p > 0.0 && request.top_p <= 1.0, "top_p {} reaches sampling", request.top_p);
    prop_assert!(request.top_k.is_none_or(|k| k >= 1));
    prop_assert!(request.max_tokens.is_none_or(|n| (1..=MAX_TOKENS_LIMIT).contains(&n)));
    prop_assert!(request.stop.len() <= MAX_STOP_STRINGS && request.stop.iter().all(|s| !s.is_empty()));
    prop_assert!(!request.include_usage || request.stream);
    match (&request.prompt, chat) {
        (Prompt::Chat(messages), true) => {
            prop_assert!(!messages.is_empty());
            for m in messages {
                prop_assert!(["system", "user", "assistant", "tool"].contains(&m.role.as_str()), "role {}", m.role);
            }
        }
        (Prompt::Text(_), false) => prop_assert!(request.max_tokens.is_some()),
        (Prompt::TokenIds(ids), false) => prop_assert!(!ids.is_empty() && request.max_tokens.is_some()),
        (prompt, _) => prop_assert!(false, "{prompt:?} from the {} endpoint", if chat { "chat" } else { "completion" }),
    }
    Ok(())
}

fn check_refused(error: &ApiError) -> Result<(), TestCaseError> {
    prop_assert_eq!(error.status, 400);
    prop_assert!(!error.message.is_empty());
    Ok(())
}

fn check(body: &[u8]) -> Result<(), TestCaseError> {
    for chat in [false, true] {
        let parsed = if chat { parse_chat(body) } else { parse_completion(body) };
        match parsed {
            Ok(request) => {
                check_accepted(&request, chat)?;
                if let Prompt::Chat(messages) = &request.prompt {
                    render(messages)?;
                }
            }
            Err(error) => check_refused(&error)?,
        }
    }
    Ok(())
}

/// Chat templates of the two shapes models ship: ChatML, and Llama 3's, which raises on
/// roles out of order.
fn render(messages: &[ChatMessage]) -> Result<(), TestCaseError> {
    const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}";
    for source in [CHATML, LLAMA3] {
        let template =
            ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())).map_err(TestCaseError::fail)?;
        match template.render(messages, true, &[]) {
            Ok(text) => prop_assert!(messages.iter().all(|m| text.contains(m.content.trim()))),
            Err(error) => check_refused(&error)?,
        }
    }
    Ok(())
}

#[test]
fn the_seeds_are_accepted() {
    for seed in seeds() {
        let bytes = serde_json::to_vec(&seed).unwrap_or_default();
        let chat = seed.get("messages").is_some();
        let parsed = if chat { parse_chat(&bytes) } else { parse_completion(&bytes) };
        let request = parsed.unwrap_or_else(|e| panic!("{seed} refused: {e}"));
        check_accepted(&request, chat).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Found by this fuzzing: a `top_p` above 0 that rounds to 0 in f32 was accepted, and
/// reached the chips as 0, outside the domain `SamplingParams::validate` enforces.
#[test]
fn top_p_that_rounds_to_zero_is_refused() {
    for top_p in ["1e-300", "1e-50", "5e-324", "1e-46"] {
        let body = format!(r#"{{"model": "m", "prompt": "hi", "top_p": {top_p}}}"#);
        let error = parse_completion(body.as_bytes()).err();
        assert_eq!(error.and_then(|e| e.param), Some("top_p".to_owned()), "top_p {top_p}");
    }
}

/// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
fn cases(ci: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(8192), ..ProptestConfig::default() })]

    #[test]
    fn edited_bodies_are_refused_with_a_400_or_sound(
        seed in 0..5usize,
        site in arb_site(),
        hostile in 0..hostile_texts().len(),
        scratch in arb_scratch(),
    ) {
        let seeds = seeds();
        let texts = hostile_texts();
        check(&body(&seeds[seed % seeds.len()], &site, &texts[hostile], &scratch))?;
    }

    #[test]
    fn arbitrary_bytes_are_refused_with_a_400(
        bytes in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..128),
            "[\\[\\]{}\",:0-9a-z .eE+-]{0,128}".prop_map(String::into_bytes),
        ],
    ) {
        check(&bytes)?;
    }
}
