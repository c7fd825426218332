//! Response bodies, streaming chunks and the model list, in OpenAI's exact shapes.
//!
//! The caller passes ids and `created` (unix seconds), so these builders stay pure.

use serde_json::{Map, Value, json};

/// Token counts of one request; OpenAI's `total_tokens` is their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Usage {
    pub fn total_tokens(&self) -> usize {
        self.prompt_tokens + self.completion_tokens
    }

    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens(),
        })
    }
}

/// Why generation ended: `stop` (end-of-sequence token or a stop string) or `length` (max tokens
/// or the end of the context).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The answer called tools.
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
        }
    }
}

fn finish_json(finish: Option<FinishReason>) -> Value {
    finish.map_or(Value::Null, |f| Value::from(f.as_str()))
}

fn envelope(id: &str, object: &str, created: u64, model: &str, choice: Value) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert("id".into(), id.into());
    map.insert("object".into(), object.into());
    map.insert("created".into(), created.into());
    map.insert("model".into(), model.into());
    map.insert("choices".into(), Value::Array(vec![choice]));
    map
}

/// Body of a non-streamed `POST /v1/completions`.
pub fn completion_response(
    id: &str,
    created: u64,
    model: &str,
    text: &str,
    finish: FinishReason,
    usage: Usage,
) -> Value {
    let choice = json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str()});
    let mut map = envelope(id, "text_completion", created, model, choice);
    map.insert("usage".into(), usage.to_json());
    Value::Object(map)
}

/// Body of a non-streamed `POST /v1/chat/completions`.
pub fn chat_response(id: &str, created: u64, model: &str, text: &str, finish: FinishReason, usage: Usage) -> Value {
    let choice = json!({
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": null,
        "finish_reason": finish.as_str(),
    });
    let mut map = envelope(id, "chat.completion", created, model, choice);
    map.insert("usage".into(), usage.to_json());
    Value::Object(map)
}

/// A chat body whose answer called tools: the message's `content` (null when only calls
/// were written) and `tool_calls`, and `finish_reason` `tool_calls` unless the answer
/// was cut at its length.
pub fn with_tool_calls(mut body: Value, content: Option<&str>, calls: &[super::ToolCall]) -> Value {
    if let Some(choice) = body["choices"].get_mut(0) {
        choice["message"]["content"] = content.map_or(Value::Null, Value::from);
        choice["message"]["tool_calls"] = calls.iter().map(super::ToolCall::to_json).collect();
        if choice["finish_reason"] == FinishReason::Stop.as_str() {
            choice["finish_reason"] = FinishReason::ToolCalls.as_str().into();
        }
    }
    body
}

/// A streamed chat chunk carrying tool calls `first_index..` whole, as deltas.
pub fn tool_calls_chunk(id: &str, created: u64, model: &str, first_index: usize, calls: &[super::ToolCall]) -> Value {
    let deltas: Vec<Value> = calls.iter().enumerate().map(|(i, c)| c.delta_json(first_index + i)).collect();
    let choice = json!({"index": 0, "delta": {"tool_calls": deltas}, "logprobs": null, "finish_reason": null});
    Value::Object(envelope(id, "chat.completion.chunk", created, model, choice))
}

/// One `data:` event of a streamed completion.
pub fn completion_chunk(id: &str, created: u64, model: &str, text: &str, finish: Option<FinishReason>) -> Value {
    let choice = json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_json(finish)});
    Value::Object(envelope(id, "text_completion", created, model, choice))
}

/// One `data:` event of a streamed chat completion. The first chunk carries the role (and
/// `content: ""` when it has no text yet, as OpenAI sends it); the last usually has only
/// `finish_reason` and an empty delta.
pub fn chat_chunk(
    id: &str,
    created: u64,
    model: &str,
    delta_text: Option<&str>,
    first: bool,
    finish: Option<FinishReason>,
) -> Value {
    let mut delta = Map::new();
    if first {
        delta.insert("role".into(), "assistant".into());
    }
    match delta_text {
        Some(text) => {
            delta.insert("content".into(), text.into());
        }
        None if first => {
            delta.insert("content".into(), "".into());
        }
        None => {}
    }
    let choice = json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_json(finish)});
    Value::Object(envelope(id, "chat.completion.chunk", created, model, choice))
}

/// The extra last chunk sent with `stream_options.include_usage`: no choices, only usage.
/// `object` is `"text_completion"` or `"chat.completion.chunk"`, after the endpoint.
pub fn usage_chunk(id: &str, created: u64, model: &str, object: &str, usage: Usage) -> Value {
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_json(),
    })
}

/// Body of `GET /v1/models`.
pub fn models_response(models: &[String], created: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": created, "owned_by": "tessera"}))
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: Usage = Usage { prompt_tokens: 5, completion_tokens: 3 };

    #[test]
    fn completion_response_shape() {
        assert_eq!(
            completion_response("cmpl-1", 1700000000, "m", "Hello", FinishReason::Length, USAGE),
            json!({
                "id": "cmpl-1", "object": "text_completion", "created": 1700000000u64, "model": "m",
                "choices": [{"index": 0, "text": "Hello", "logprobs": null, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            })
        );
    }

    #[test]
    fn chat_response_shape() {
        assert_eq!(
            chat_response("chatcmpl-1", 7, "m", "Hi!", FinishReason::Stop, USAGE),
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hi!"},
                    "logprobs": null,
                    "finish_reason": "stop",
                }],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            })
        );
    }

    #[test]
    fn completion_chunk_shapes() {
        let chunk = |text, finish| completion_chunk("cmpl-1", 7, "m", text, finish);
        let expected = |text: &str, finish: Value| {
            json!({
                "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            })
        };
        assert_eq!(chunk("Hel", None), expected("Hel", Value::Null));
        assert_eq!(chunk("", Some(FinishReason::Stop)), expected("", json!("stop")));
        assert_eq!(chunk("lo", Some(FinishReason::Length)), expected("lo", json!("length")));
    }

    #[test]
    fn chat_chunk_shapes() {
        // (delta_text, first, finish) -> (delta, finish_reason)
        let cases = vec![
            (None, true, None, json!({"role": "assistant", "content": ""}), Value::Null),
            (Some("Hi"), true, None, json!({"role": "assistant", "content": "Hi"}), Value::Null),
            (Some(" there"), false, None, json!({"content": " there"}), Value::Null),
            (None, false, Some(FinishReason::Stop), json!({}), json!("stop")),
            (Some("!"), false, Some(FinishReason::Length), json!({"content": "!"}), json!("length")),
        ];
        for (text, first, finish, delta, finish_reason) in cases {
            assert_eq!(
                chat_chunk("chatcmpl-1", 7, "m", text, first, finish),
                json!({
                    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
                }),
                "{text:?} {first} {finish:?}"
            );
        }
    }

    #[test]
    fn usage_chunk_shape() {
        for object in ["text_completion", "chat.completion.chunk"] {
            assert_eq!(
                usage_chunk("id-1", 7, "m", object, USAGE),
                json!({
                    "id": "id-1", "object": object, "created": 7, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                })
            );
        }
    }

    #[test]
    fn models_response_shape() {
        assert_eq!(
            models_response(&["a".to_owned(), "b".to_owned()], 9),
            json!({"object": "list", "data": [
                {"id": "a", "object": "model", "created": 9, "owned_by": "tessera"},
                {"id": "b", "object": "model", "created": 9, "owned_by": "tessera"},
            ]})
        );
        assert_eq!(models_response(&[], 9), json!({"object": "list", "data": []}));
    }

    #[test]
    fn usage_total_is_the_sum() {
        assert_eq!(USAGE.total_tokens(), 8);
        assert_eq!(Usage::default().total_tokens(), 0);
    }
}
