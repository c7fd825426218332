//! One benchmark request: its synthetic prompt, its JSON body, and the streamed exchange
//! that times it. Every failure comes back as a message for the report, never a panic:
//! everything here is read from the network.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use super::Endpoint;
use super::sse::SseParser;
use tessera_workload::PlannedRequest;
#[cfg(test)]
use tessera_workload::SeededRng;
use tessera_workload::multiturn::{Conversation, Speaker};
#[cfg(test)]
use tessera_workload::multiturn::{PlannedTurn, SystemPrompt};

/// The OpenAI request for a planned one, streaming with usage, and `ignore_eos` (a vLLM
/// extension) so that every output is exactly `max_tokens` long.
pub(super) fn body(req: &PlannedRequest, endpoint: Endpoint, model: &str) -> Value {
    let input = match endpoint {
        Endpoint::Completions => ("prompt", json!(req.prompt)),
        Endpoint::Chat => ("messages", json!([{"role": "user", "content": req.prompt}])),
    };
    streamed(model, req.osl, input)
}

/// The request for `conversation`'s next turn `req` (its [`Conversation::next_request`]):
/// a completion of the whole text so far, or the chat so far as alternating messages,
/// which the model's chat template renders as an extension of the last turn.
pub(super) fn turn_body(conversation: &Conversation, req: &PlannedRequest, endpoint: Endpoint, model: &str) -> Value {
    let input = match endpoint {
        Endpoint::Completions => ("prompt", json!(req.prompt)),
        Endpoint::Chat => {
            let messages = conversation.messages().into_iter().map(|(speaker, content)| {
                let role = match speaker {
                    Speaker::System => "system",
                    Speaker::User => "user",
                    Speaker::Assistant => "assistant",
                };
                json!({"role": role, "content": content})
            });
            ("messages", Value::Array(messages.collect()))
        }
    };
    streamed(model, req.osl, input)
}

/// A streamed request with usage, asking for exactly `max_tokens`, with its input under `key`.
fn streamed(model: &str, max_tokens: u32, (key, input): (&str, Value)) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(obj) = body.as_object_mut() {
        obj.insert(key.to_string(), input);
    }
    body
}

/// The timings of one successful request.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Sample {
    /// To the first streamed token, whether or not it decodes to visible text.
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Gaps between consecutive chunks carrying tokens (a chunk may hold several).
    pub itl_s: Vec<f64>,
    /// From the usage chunk, else the number of chunks carrying tokens.
    pub output_tokens: u64,
    /// From the usage chunk; `None` when the server sent none.
    pub prompt_tokens: Option<u64>,
    /// The generated text, for the next turn of a conversation.
    pub text: String,
}

/// What one streamed response has said so far.
#[derive(Debug)]
pub(super) struct StreamState {
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    itl_s: Vec<f64>,
    token_chunks: u64,
    text: String,
    completion_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    done: bool,
}

impl StreamState {
    pub fn new(started: Instant) -> Self {
        StreamState {
            started,
            first_token: None,
            last_token: None,
            itl_s: Vec::new(),
            token_chunks: 0,
            text: String::new(),
            completion_tokens: None,
            prompt_tokens: None,
            done: false,
        }
    }

    pub fn done(&self) -> bool {
        self.done
    }

    /// One SSE event's data, received at `now`.
    pub fn on_data(&mut self, data: &str, now: Instant) -> Result<(), String> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| format!("bad stream chunk ({e}): {}", clip(data)))?;
        if let Some(message) = error_message(&chunk) {
            return Err(message);
        }
        if let Some(text) = token_text(&chunk["choices"][0]) {
            match self.last_token {
                None => self.first_token = Some(now),
                Some(last) => self.itl_s.push(now.duration_since(last).as_secs_f64()),
            }
            self.last_token = Some(now);
            self.token_chunks += 1;
            self.text.push_str(text);
        }
        let usage = &chunk["usage"];
        if let Some(n) = usage["completion_tokens"].as_u64() {
            self.completion_tokens = Some(n);
        }
        if let Some(n) = usage["prompt_tokens"].as_u64() {
            self.prompt_tokens = Some(n);
        }
        Ok(())
    }

    /// The stream has ended at `now`.
    pub fn finish(self, now: Instant) -> Result<Sample, String> {
        if !self.done {
            return Err("stream ended without `data: [DONE]`".to_string());
        }
        let Some(first) = self.first_token else {
            return Err("stream carried no tokens".to_string());
        };
        Ok(Sample {
            ttft_s: first.duration_since(self.started).as_secs_f64(),
            e2e_s: now.duration_since(self.started).as_secs_f64(),
            itl_s: self.itl_s,
            output_tokens: self.completion_tokens.unwrap_or(self.token_chunks),
            prompt_tokens: self.prompt_tokens,
            text: self.text,
        })
    }
}

/// The text of a chunk's choice when the chunk carries tokens: a completion's `text`, a
/// chat delta's `content` — possibly empty (a token that decodes to no visible text yet,
/// e.g. part of a multi-byte character) — but not the opening chat chunk that only
/// announces the assistant's role, nor a chunk that only ends the choice.
fn token_text(choice: &Value) -> Option<&str> {
    if let Some(text) = choice["text"].as_str() {
        return (!text.is_empty() || choice["finish_reason"].is_null()).then_some(text);
    }
    let delta = &choice["delta"];
    let content = delta["content"].as_str()?;
    let role_only = content.is_empty() && !delta["role"].is_null();
    let closing = content.is_empty() && !choice["finish_reason"].is_null();
    (!role_only && !closing).then_some(content)
}

/// Sends `body` to `url` and reads the stream to its end, or fails with a message for the report.
pub(super) async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Sample, String> {
    let started = Instant::now();
    let response = client.post(url).json(body).timeout(timeout).send().await.map_err(|e| describe(&e, timeout))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| error_message(&v))
            .unwrap_or_else(|| clip(text.trim()).to_string());
        return Err(format!("HTTP {}: {detail}", status.as_u16()));
    }
    let mut state = StreamState::new(started);
    let mut parser = SseParser::new();
    // Kept while no event has arrived, to explain a body that is not an event stream.
    let mut head: Vec<u8> = Vec::new();
    let mut events = 0usize;
    let mut stream = response.bytes_stream();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.map_err(|e| describe(&e, timeout))?;
        let now = Instant::now();
        if events == 0 && head.len() < 4096 {
            head.extend_from_slice(&bytes);
        }
        for data in parser.push(&bytes) {
            events += 1;
            state.on_data(&data, now)?;
        }
        if state.done() {
            break;
        }
    }
    if !state.done()
        && let Some(data) = parser.finish()
    {
        events += 1;
        state.on_data(&data, Instant::now())?;
    }
    if events == 0
        && let Some(message) = serde_json::from_slice::<Value>(&head).ok().and_then(|v| error_message(&v))
    {
        return Err(message);
    }
    state.finish(Instant::now())
}

/// `{"error": {"message": ..}}` or `{"error": ".."}`: the message the server gave.
pub(super) fn error_message(v: &Value) -> Option<String> {
    let error = v.get("error").filter(|e| !e.is_null())?;
    Some(match error {
        Value::String(s) => s.clone(),
        _ => error.get("message").and_then(Value::as_str).map_or_else(|| error.to_string(), str::to_string),
    })
}

pub(super) fn describe(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return format!("timed out after {:.1} s", timeout.as_secs_f64());
    }
    // reqwest's own message is generic; the cause (refused, reset, ...) is in the chain.
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// At most 200 characters of `s`, cut on a character boundary.
fn clip(s: &str) -> &str {
    s.char_indices().nth(200).map_or(s, |(i, _)| &s[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(events: &[&str]) -> Result<Sample, String> {
        let t0 = Instant::now();
        let mut state = StreamState::new(t0);
        for (i, e) in events.iter().enumerate() {
            state.on_data(e, t0 + Duration::from_millis(10 * (i as u64 + 1)))?;
        }
        state.finish(t0 + Duration::from_millis(10 * (events.len() as u64 + 1)))
    }

    #[test]
    fn completion_stream_timings_and_usage() {
        let s = feed(&[
            r#"{"object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}"#,
            r#"{"object":"text_completion","choices":[{"index":0,"text":"b","finish_reason":null}]}"#,
            r#"{"object":"text_completion","choices":[{"index":0,"text":"c","finish_reason":"length"}]}"#,
            r#"{"object":"text_completion","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4,"total_tokens":11}}"#,
            "[DONE]",
        ]);
        let Ok(s) = s else { panic!("a complete stream succeeds: {s:?}") };
        assert!((s.ttft_s - 0.010).abs() < 1e-9);
        assert!((s.e2e_s - 0.060).abs() < 1e-9);
        assert_eq!(s.itl_s.len(), 2);
        assert!(s.itl_s.iter().all(|g| (g - 0.010).abs() < 1e-9));
        assert_eq!((s.output_tokens, s.prompt_tokens), (4, Some(7)), "usage wins over the chunk count");
        assert_eq!(s.text, "abc");
    }

    #[test]
    fn chat_stream_without_usage_counts_text_chunks() {
        let s = feed(&[
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}"#,
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" there"}}]}"#,
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            "[DONE]",
        ]);
        let Ok(s) = s else { panic!("a complete stream succeeds: {s:?}") };
        assert!((s.ttft_s - 0.020).abs() < 1e-9, "the empty role chunk is not the first token");
        assert_eq!((s.output_tokens, s.prompt_tokens), (2, None));
        assert_eq!(s.text, "hi there");
    }

    /// Tokens that decode to no visible text (a random-weight model's, a multi-byte
    /// character's first bytes) still stream: the request succeeds, its TTFT is its first
    /// token and its output is the server's count.
    #[test]
    fn tokens_without_visible_text_still_count() {
        let s = feed(&[
            r#"{"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":null}]}"#,
            r#"{"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":null}]}"#,
            r#"{"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
            r#"{"object":"text_completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}"#,
            "[DONE]",
        ]);
        let Ok(s) = s else { panic!("a stream of tokens succeeds: {s:?}") };
        assert!((s.ttft_s - 0.010).abs() < 1e-9, "TTFT is the first token, text or not");
        assert_eq!((s.output_tokens, s.itl_s.len(), s.text.as_str()), (3, 1, ""));
        let chat = feed(&[
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":""}}]}"#,
            r#"{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}"#,
            "[DONE]",
        ]);
        let Ok(chat) = chat else { panic!("a chat stream of tokens succeeds: {chat:?}") };
        assert!((chat.ttft_s - 0.020).abs() < 1e-9, "the role chunk is no token");
        assert_eq!(chat.output_tokens, 1, "no usage: the chunks that carried tokens");
    }

    #[test]
    fn failures_keep_their_message() {
        let text = r#"{"choices":[{"text":"a"}]}"#;
        let cases: &[(&[&str], &str)] = &[
            (&[text, r#"{"error":{"message":"engine died","code":500}}"#], "engine died"),
            (&[r#"{"error":"plain"}"#], "plain"),
            (&[text], "stream ended without `data: [DONE]`"),
            (&["[DONE]"], "stream carried no tokens"),
        ];
        for (events, want) in cases {
            assert_eq!(feed(events).err().as_deref(), Some(*want), "{events:?}");
        }
        assert!(feed(&["not json"]).is_err_and(|m| m.starts_with("bad stream chunk")));
    }

    #[test]
    fn bodies_carry_the_planned_prompt_and_length() {
        let a = PlannedRequest::new(100, 5, &mut SeededRng::new(3));
        let chat = body(&a, Endpoint::Chat, "m");
        assert_eq!(chat["messages"][0]["content"], json!(a.prompt));
        assert_eq!((chat["max_tokens"].clone(), chat["ignore_eos"].clone()), (json!(5), json!(true)));
        assert_eq!(body(&a, Endpoint::Completions, "m")["prompt"], json!(a.prompt));
    }

    #[test]
    fn turn_bodies_carry_the_conversation_so_far() {
        let turn = |user: &str| PlannedTurn { user: user.into(), user_words: 1, osl: 2 };
        let mut c = Conversation::new(vec![turn("hi"), turn("more")]);
        c.answer(" there".into());
        let Some(req) = c.next_request() else { panic!("a second turn is planned") };
        let completion = turn_body(&c, &req, Endpoint::Completions, "m");
        assert_eq!(
            (completion["prompt"].clone(), completion["max_tokens"].clone()),
            (json!("hi there more"), json!(2))
        );
        let chat = turn_body(&c, &req, Endpoint::Chat, "m");
        assert_eq!(
            chat["messages"],
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " there"},
                   {"role": "user", "content": "more"}])
        );
        assert_eq!(chat["stream"], json!(true));
        // A chat of a system prompt group opens with it, as text and as a system message.
        let system = SystemPrompt { group: 0, text: "be brief".into(), words: 2 };
        let mut c = Conversation::new(vec![turn("hi"), turn("more")]).with_system(Some(system));
        c.answer(" there".into());
        let Some(req) = c.next_request() else { panic!("a second turn is planned") };
        assert_eq!(turn_body(&c, &req, Endpoint::Completions, "m")["prompt"], json!("be brief hi there more"));
        assert_eq!(
            turn_body(&c, &req, Endpoint::Chat, "m")["messages"],
            json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": " there"}, {"role": "user", "content": "more"}])
        );
    }

    #[test]
    fn clip_cuts_on_a_character_boundary() {
        let long = "é".repeat(300);
        assert_eq!(clip(&long).chars().count(), 200);
        assert_eq!(clip("short"), "short");
    }
}
