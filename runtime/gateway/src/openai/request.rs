//! Request bodies of `POST /v1/completions` and `POST /v1/chat/completions`, parsed and
//! validated into one [`GenerationRequest`].
//!
//! Bodies are read as a `serde_json::Value` and walked by hand rather than derived, so that
//! every refusal names the field at fault (`param`) and says what was expected. Unknown
//! fields are ignored, as clients send many; known fields we cannot honour (tools, penalties,
//! echo…) are refused unless they hold their neutral value, rather than silently ignored.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::ApiError;
use super::tools::{ToolCall, Tools, parse_tools};

/// The most tokens a request may ask for: anything larger is a client bug, not a wish.
const MAX_TOKENS_LIMIT: usize = 1 << 20;
/// Legacy completions generate 16 tokens when `max_tokens` is not given (OpenAI and vLLM).
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;
/// OpenAI allows 4 stop strings; we allow more since matching a few more costs nothing.
const MAX_STOP_STRINGS: usize = 16;

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A completions prompt, to be tokenized.
    Text(String),
    /// A completions prompt already tokenized by the client.
    TokenIds(Vec<u32>),
    /// A conversation, to be rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
}

/// One message of a conversation, its role normalized (`developer` becomes `system`) and its
/// content flattened to text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Accepts a string or an array of `{"type": "text", "text": …}` parts (concatenated).
    #[serde(deserialize_with = "deserialize_content")]
    pub content: String,
    /// An assistant turn's calls of tools.
    #[serde(skip)]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` turn: the call it answers.
    #[serde(skip)]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of text only.
    pub fn text(role: &str, content: String) -> ChatMessage {
        ChatMessage { role: role.to_owned(), content, tool_calls: Vec::new(), tool_call_id: None }
    }
}

/// A validated generation request, the same for both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    pub model: String,
    pub prompt: Prompt,
    pub stream: bool,
    /// `stream_options.include_usage`: send a final chunk with the token counts.
    pub include_usage: bool,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    /// vLLM extension; `None` when off (absent, 0 or -1).
    pub top_k: Option<usize>,
    /// A negative seed (OpenAI's seed is an int64) is taken bit for bit.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    /// vLLM extension.
    pub stop_token_ids: Vec<u32>,
    /// vLLM extension: keep generating past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Return each generated token's log-probability with this many most likely
    /// alternatives (completions' `logprobs: k`; chat's `logprobs: true` with
    /// `top_logprobs: k`); `None`: no log-probabilities.
    pub logprobs: Option<usize>,
    /// OpenAI's penalties, -2..=2 (0 = off).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's repetition penalty, more than 0 and at most 2 (1 = off).
    pub repetition_penalty: f32,
    /// Token id -> bias, -100..=100 (the ids are checked against the model's vocabulary
    /// where it is known).
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM extension: generate at least this many tokens before a stop token may end.
    pub min_tokens: usize,
    /// Completions: the prompt comes back before the completion, and with `logprobs`
    /// so do its tokens' log-probabilities (the first has none). With `max_tokens: 0`
    /// nothing is generated: a scoring request.
    pub echo: bool,
    /// What the output must follow (structured outputs), and the field that asked.
    pub structured: Option<(Structured, &'static str)>,
    /// Chat: the tools the model may call.
    pub tools: Tools,
    /// Choices to return, each sampled with its own generator: choice i with `seed + i`
    /// (so each equals a one-choice request with that seed).
    pub n: usize,
    /// Completions: generate this many candidates and return the `n` whose tokens have
    /// the highest summed log-probability. Not with `stream`.
    pub best_of: Option<usize>,
}

/// The most choices (`n`, `best_of`) one request may ask for.
pub const MAX_CHOICES: usize = 64;

/// A structured output: `response_format` (OpenAI) or vLLM's `guided_*` fields and
/// their newer `structured_outputs` object.
#[derive(Debug, Clone, PartialEq)]
pub enum Structured {
    /// JSON matching this schema (`{"type": "object"}` for `json_object`).
    JsonSchema(Value),
    /// Text the regular expression matches whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect).
    Grammar(String),
}

/// OpenAI's limit on the alternatives listed per token.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Parses `POST /v1/completions`. One prompt per request: a string, token ids, or an array
/// holding exactly one of those.
pub fn parse_completion(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let object = parse_object(body)?;
    let body = Body(&object);
    let model = parse_model(&body)?;
    let prompt = parse_prompt(body.get("prompt"))?;
    body.refuse_unsupported(COMMON_UNSUPPORTED)?;
    body.refuse_unsupported(COMPLETION_UNSUPPORTED)?;
    let echo = body.bool("echo")?.unwrap_or(false);
    // Echoing the prompt alone (a scoring request) is asked for with max_tokens 0.
    let max_tokens = match body.integer("max_tokens")? {
        Some(0) if echo => 0,
        _ => body.max_tokens("max_tokens")?.unwrap_or(COMPLETION_DEFAULT_MAX_TOKENS),
    };
    let logprobs = match body.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(_) => Some(body.top_logprobs("logprobs")?),
    };
    let req = parse_sampling(&body, model, prompt, Some(max_tokens))?;
    let best_of = match body.choices("best_of")? {
        None => None,
        Some(b) if b < req.n => {
            return Err(ApiError::bad_request(
                format!("`best_of` must be at least `n` ({}), got {b}", req.n),
                Some("best_of"),
            ));
        }
        // As many candidates as choices: every one is returned.
        Some(b) if b == req.n => None,
        Some(_) if req.stream => {
            return Err(ApiError::bad_request("`best_of` cannot be used with `stream`", Some("best_of")));
        }
        Some(b) => Some(b),
    };
    Ok(GenerationRequest { logprobs, echo, best_of, ..req })
}

/// Parses `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let object = parse_object(body)?;
    let body = Body(&object);
    let model = parse_model(&body)?;
    let messages = parse_messages(body.get("messages"))?;
    body.refuse_unsupported(COMMON_UNSUPPORTED)?;
    body.refuse_unsupported(CHAT_UNSUPPORTED)?;
    // `max_tokens` is deprecated in chat in favour of `max_completion_tokens`; both are sent.
    let max_tokens = match body.max_tokens("max_completion_tokens")? {
        Some(n) => Some(n),
        None => body.max_tokens("max_tokens")?,
    };
    let top = match body.get("top_logprobs") {
        None | Some(Value::Null) => None,
        Some(_) => Some(body.top_logprobs("top_logprobs")?),
    };
    let logprobs = match (body.bool("logprobs")?.unwrap_or(false), top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, None | Some(0)) => None,
        (false, Some(_)) => {
            return Err(ApiError::bad_request("`top_logprobs` needs `logprobs` set to true", Some("top_logprobs")));
        }
    };
    let tools = parse_tools(&object)?;
    let mut req = parse_sampling(&body, model, Prompt::Chat(messages), max_tokens)?;
    if let Some(lark) = tools.grammar() {
        if let Some((_, param)) = req.structured {
            return Err(ApiError::bad_request(
                format!(
                    "`tool_choice` required or named enforces the calls' format; `{param}` cannot be asked for with it"
                ),
                Some(param),
            ));
        }
        req.structured = Some((Structured::Grammar(lark), "tool_choice"));
    }
    Ok(GenerationRequest { logprobs, tools, ..req })
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}"), None))?;
    match value {
        Value::Object(object) => Ok(object),
        other => Err(ApiError::bad_request(
            format!("The request body must be a JSON object, got {}", type_name(&other)),
            None,
        )),
    }
}

fn parse_model(body: &Body) -> Result<String, ApiError> {
    match body.string("model")? {
        Some(model) if !model.is_empty() => Ok(model.to_owned()),
        _ => Err(ApiError::bad_request("You must provide a `model` parameter", Some("model"))),
    }
}

/// The fields both endpoints share.
fn parse_sampling(
    body: &Body,
    model: String,
    prompt: Prompt,
    max_tokens: Option<usize>,
) -> Result<GenerationRequest, ApiError> {
    let stream = body.bool("stream")?.unwrap_or(false);
    let include_usage = match body.get("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::bad_request(
                "`stream_options` is only allowed when `stream` is true",
                Some("stream_options"),
            ));
        }
        Some(Value::Object(options)) => Body(options)
            .bool("include_usage")
            .map_err(|e| rename_param(e, "stream_options.include_usage"))?
            .unwrap_or(false),
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    };

    let temperature = body.number("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(
            format!("`temperature` must be between 0 and 2, got {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = body.number("top_p")?.unwrap_or(1.0);
    // Checked as the f32 sampling receives: 1e-300 is above 0, its f32 is not.
    if !(top_p as f32 > 0.0 && top_p <= 1.0) {
        let rounded = if top_p > 0.0 && top_p <= 1.0 { ", which rounds to 0 in single precision" } else { "" };
        return Err(ApiError::bad_request(
            format!("`top_p` must be greater than 0 and at most 1, got {top_p}{rounded}"),
            Some("top_p"),
        ));
    }
    let top_k = match body.integer("top_k")? {
        None | Some(0) | Some(-1) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ApiError::bad_request(
                format!("`top_k` must be a positive integer, or 0 or -1 to turn it off, got {k}"),
                Some("top_k"),
            ));
        }
    };
    // Bit for bit: a client's seed -1 and 2^64-1 give the same stream, and any seed is honoured.
    let seed = body.integer("seed")?.map(|s| s as u64);
    let stop = parse_stop(body.get("stop"))?;
    let stop_token_ids = match body.get("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(ids)) => token_ids(ids, "stop_token_ids")?,
        Some(other) => return Err(wrong_type("stop_token_ids", "an array of token ids", other)),
    };
    let ignore_eos = body.bool("ignore_eos")?.unwrap_or(false);
    let penalty = |key: &str, default: f64, ok: fn(f64) -> bool, range: &str| -> Result<f32, ApiError> {
        match body.number(key)? {
            None => Ok(default as f32),
            Some(v) if ok(v) => Ok(v as f32),
            Some(v) => Err(ApiError::bad_request(format!("`{key}` must be {range}, got {v}"), Some(key))),
        }
    };
    let presence_penalty = penalty("presence_penalty", 0.0, |v| (-2.0..=2.0).contains(&v), "between -2 and 2")?;
    let frequency_penalty = penalty("frequency_penalty", 0.0, |v| (-2.0..=2.0).contains(&v), "between -2 and 2")?;
    let repetition_penalty =
        penalty("repetition_penalty", 1.0, |v| v > 0.0 && v <= 2.0, "greater than 0 and at most 2")?;
    let logit_bias = parse_logit_bias(body.get("logit_bias"))?;
    let structured = parse_structured(body)?;
    let min_tokens = match body.integer("min_tokens")? {
        None => 0,
        Some(n) if n >= 0 && max_tokens.is_none_or(|m| n as usize <= m) => n as usize,
        Some(n) => {
            return Err(ApiError::bad_request(
                format!("`min_tokens` must be between 0 and the request's max_tokens, got {n}"),
                Some("min_tokens"),
            ));
        }
    };

    Ok(GenerationRequest {
        model,
        prompt,
        stream,
        include_usage,
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        seed,
        stop,
        stop_token_ids,
        ignore_eos,
        logprobs: None,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias,
        min_tokens,
        echo: false,
        structured,
        tools: Tools::none(),
        n: body.choices("n")?.unwrap_or(1),
        best_of: None,
    })
}

/// At most one structured output, from `response_format`, `structured_outputs` or a
/// `guided_*` field.
fn parse_structured(body: &Body) -> Result<Option<(Structured, &'static str)>, ApiError> {
    let mut found: Vec<(Structured, &'static str)> = Vec::new();
    if let Some(format) = body.get("response_format")
        && let Some(s) = parse_response_format(format)?
    {
        found.push((s, "response_format"));
    }
    for (key, kind) in
        [("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")]
    {
        if let Some(v) = body.get(key) {
            found.push((structured_of(kind, v, key)?, key));
        }
    }
    match body.get("structured_outputs") {
        None => {}
        Some(Value::Object(fields)) => {
            for (kind, v) in fields.iter().filter(|(_, v)| !v.is_null()) {
                let param = match kind.as_str() {
                    "json" => "structured_outputs.json",
                    "regex" => "structured_outputs.regex",
                    "choice" => "structured_outputs.choice",
                    "grammar" => "structured_outputs.grammar",
                    other => {
                        return Err(ApiError::bad_request(
                            format!(
                                "`structured_outputs.{other}` is not supported; use json, regex, choice or grammar"
                            ),
                            Some("structured_outputs"),
                        ));
                    }
                };
                found.push((structured_of(kind, v, param)?, param));
            }
        }
        Some(other) => return Err(wrong_type("structured_outputs", "an object", other)),
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, k)| *k).collect();
        return Err(ApiError::bad_request(
            format!("only one structured output may be asked for, got {}", names.join(", ")),
            Some(found[1].1),
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or
/// `json_schema` with its `json_schema.schema`.
fn parse_response_format(format: &Value) -> Result<Option<Structured>, ApiError> {
    const PARAM: &str = "response_format";
    let Value::Object(format) = format else {
        return Err(wrong_type(PARAM, "an object", format));
    };
    let body = Body(format);
    match body.string("type").map_err(|e| rename_param(e, "response_format.type"))? {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Structured::JsonSchema(serde_json::json!({"type": "object"})))),
        Some("json_schema") => {
            let Some(Value::Object(spec)) = body.get("json_schema") else {
                return Err(ApiError::bad_request(
                    "`response_format.json_schema` is required and must be an object when `type` is `json_schema`",
                    Some("response_format.json_schema"),
                ));
            };
            match spec.get("schema").filter(|v| !v.is_null()) {
                // OpenAI lets the schema be left out: any JSON object.
                None => Ok(Some(Structured::JsonSchema(serde_json::json!({"type": "object"})))),
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(Some(Structured::JsonSchema(schema.clone()))),
                Some(other) => Err(wrong_type("response_format.json_schema.schema", "an object", other)),
            }
        }
        Some(other) => Err(ApiError::bad_request(
            format!("`response_format.type` must be text, json_object or json_schema, got {other:?}"),
            Some("response_format.type"),
        )),
        None => Err(ApiError::bad_request("`response_format.type` is required", Some("response_format.type"))),
    }
}

/// One vLLM-style structured output of `kind` (json, regex, choice, grammar).
fn structured_of(kind: &str, v: &Value, param: &str) -> Result<Structured, ApiError> {
    match (kind, v) {
        // A schema may come as an object or as its JSON text.
        ("json", Value::Object(_) | Value::Bool(_)) => Ok(Structured::JsonSchema(v.clone())),
        ("json", Value::String(text)) => serde_json::from_str(text)
            .map(Structured::JsonSchema)
            .map_err(|e| ApiError::bad_request(format!("`{param}` is not a JSON schema: {e}"), Some(param))),
        ("json", other) => Err(wrong_type(param, "a JSON schema", other)),
        ("regex", Value::String(rx)) => Ok(Structured::Regex(rx.clone())),
        ("grammar", Value::String(g)) => Ok(Structured::Grammar(g.clone())),
        ("regex" | "grammar", other) => Err(wrong_type(param, "a string", other)),
        ("choice", Value::Array(items)) => {
            let choices = items
                .iter()
                .map(|c| c.as_str().map(str::to_owned).ok_or_else(|| wrong_type(param, "an array of strings", c)))
                .collect::<Result<Vec<_>, _>>()?;
            if choices.is_empty() {
                return Err(ApiError::bad_request(format!("`{param}` must hold at least one string"), Some(param)));
            }
            Ok(Structured::Choice(choices))
        }
        (_, other) => Err(wrong_type(param, "an array of strings", other)),
    }
}

/// `logit_bias`: an object of token ids (as strings, as JSON keys are) to biases in
/// -100..=100, sorted by id.
fn parse_logit_bias(value: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |message: String| ApiError::bad_request(message, Some("logit_bias"));
    let map = match value {
        None => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(other) => return Err(wrong_type("logit_bias", "an object of token ids to biases", other)),
    };
    let mut out = Vec::with_capacity(map.len());
    for (id, bias) in map {
        let id: u32 = id.parse().map_err(|_| bad(format!("`logit_bias` keys must be token ids, got {id:?}")))?;
        let bias = bias.as_f64().ok_or_else(|| bad(format!("`logit_bias[{id}]` must be a number")))?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(bad(format!("`logit_bias[{id}]` must be between -100 and 100, got {bias}")));
        }
        out.push((id, bias as f32));
    }
    out.sort_by_key(|(id, _)| *id);
    Ok(out)
}

fn parse_prompt(prompt: Option<&Value>) -> Result<Prompt, ApiError> {
    const EXPECTED: &str = "a string, an array of token ids, or an array holding one of those";
    let items = match prompt {
        None => return Err(ApiError::bad_request("You must provide a `prompt`", Some("prompt"))),
        Some(Value::String(text)) => return Ok(Prompt::Text(text.clone())),
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong_type("prompt", EXPECTED, other)),
    };
    let Some(first) = items.first() else {
        return Err(ApiError::bad_request("`prompt` must not be empty", Some("prompt")));
    };
    match first {
        Value::Number(_) => Ok(Prompt::TokenIds(non_empty_token_ids(items)?)),
        Value::String(_) | Value::Array(_) if items.len() > 1 => Err(ApiError::bad_request(
            format!(
                "Only one prompt per request is supported, got a batch of {}: send one request per prompt",
                items.len()
            ),
            Some("prompt"),
        )),
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(ids) => Ok(Prompt::TokenIds(non_empty_token_ids(ids)?)),
        other => Err(wrong_type("prompt", EXPECTED, other)),
    }
}

fn non_empty_token_ids(ids: &[Value]) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad_request("`prompt` must not be empty", Some("prompt")));
    }
    token_ids(ids, "prompt")
}

fn token_ids(ids: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|id| {
            id.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| {
                ApiError::bad_request(
                    format!("`{param}` token ids must be integers between 0 and {}, got {id}", u32::MAX),
                    Some(param),
                )
            })
        })
        .collect()
}

fn parse_stop(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.clone()),
                other => Err(wrong_type("stop", "a string or an array of strings", other)),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong_type("stop", "a string or an array of strings", other)),
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_request(
            format!("`stop` may hold at most {MAX_STOP_STRINGS} strings, got {}", stops.len()),
            Some("stop"),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::bad_request("`stop` strings must not be empty", Some("stop")));
    }
    Ok(stops)
}

fn parse_messages(messages: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let messages = match messages {
        None => return Err(ApiError::bad_request("You must provide `messages`", Some("messages"))),
        Some(Value::Array(messages)) => messages,
        Some(other) => return Err(wrong_type("messages", "an array of messages", other)),
    };
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty", Some("messages")));
    }
    messages.iter().enumerate().map(|(i, m)| parse_message(i, m)).collect()
}

fn parse_message(index: usize, message: &Value) -> Result<ChatMessage, ApiError> {
    let param = format!("messages[{index}]");
    let Value::Object(object) = message else {
        return Err(wrong_type(&param, "an object", message));
    };
    let body = Body(object);
    let role_param = format!("{param}.role");
    let role = match body.get("role") {
        None => return Err(ApiError::bad_request(format!("`{role_param}` is required"), Some(&role_param))),
        Some(Value::String(role)) => role.as_str(),
        Some(other) => return Err(wrong_type(&role_param, "a string", other)),
    };
    let role = match role {
        "system" | "user" | "assistant" => role,
        // Chat templates predate `developer`, OpenAI's new name for the system prompt.
        "developer" => "system",
        "tool" => role,
        "function" => {
            return Err(ApiError::bad_request(
                format!("`{role_param}` `function` is deprecated and not supported: use `tool`"),
                Some(&role_param),
            ));
        }
        other => {
            return Err(ApiError::bad_request(
                format!("`{role_param}` `{other}` is unknown; expected system, developer, user or assistant"),
                Some(&role_param),
            ));
        }
    };
    if body.get("function_call").is_some() {
        let param = format!("{param}.function_call");
        return Err(ApiError::bad_request(
            format!("`{param}` is deprecated and not supported: use `tool_calls`"),
            Some(&param),
        ));
    }
    let tool_calls = match body.get("tool_calls") {
        None => Vec::new(),
        Some(Value::Array(calls)) if role == "assistant" => calls
            .iter()
            .enumerate()
            .map(|(j, c)| parse_past_call(&format!("{param}.tool_calls[{j}]"), c))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            let param = format!("{param}.tool_calls");
            return Err(ApiError::bad_request(
                format!("`{param}` must be an array of calls, on an assistant message"),
                Some(&param),
            ));
        }
    };
    let tool_call_id = match body.get("tool_call_id") {
        None if role == "tool" => {
            let param = format!("{param}.tool_call_id");
            return Err(ApiError::bad_request(format!("`{param}` is required on a `tool` message"), Some(&param)));
        }
        None => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(other) => return Err(wrong_type(&format!("{param}.tool_call_id"), "a string", other)),
    };
    let content_param = format!("{param}.content");
    let content = match body.get("content") {
        // An assistant turn without content is legal in OpenAI's schema (it then carries tool calls).
        None if role == "assistant" => String::new(),
        Some(Value::Null) if role == "assistant" => String::new(),
        None => return Err(ApiError::bad_request(format!("`{content_param}` is required"), Some(&content_param))),
        Some(content) => content_text(content, &content_param)?,
    };
    Ok(ChatMessage { role: role.to_owned(), content, tool_calls, tool_call_id })
}

/// A call an earlier assistant turn made: `{"id", "type": "function", "function":
/// {"name", "arguments"}}`, the arguments as JSON text (or, leniently, an object).
fn parse_past_call(param: &str, call: &Value) -> Result<ToolCall, ApiError> {
    let bad = || {
        ApiError::bad_request(
            format!("`{param}` must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"),
            Some(param),
        )
    };
    let function = call.get("function").ok_or_else(bad)?;
    let name = function.get("name").and_then(Value::as_str).ok_or_else(bad)?;
    let arguments = match function.get("arguments") {
        Some(Value::String(a)) => a.clone(),
        Some(a @ Value::Object(_)) => a.to_string(),
        None | Some(Value::Null) => "{}".to_owned(),
        Some(_) => return Err(bad()),
    };
    let id = call.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    Ok(ToolCall { id, name: name.to_owned(), arguments })
}

/// A message's content as text: a string, or text parts concatenated; anything else refused.
fn content_text(content: &Value, param: &str) -> Result<String, ApiError> {
    const EXPECTED: &str = "a string or an array of text parts";
    let parts = match content {
        Value::String(text) => return Ok(text.clone()),
        Value::Array(parts) => parts,
        other => return Err(wrong_type(param, EXPECTED, other)),
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let part_param = format!("{param}[{j}]");
        let Value::Object(part) = part else {
            return Err(wrong_type(&part_param, "an object", part));
        };
        match part.get("type").and_then(Value::as_str) {
            Some("text") => match part.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                Some(other) => return Err(wrong_type(&format!("{part_param}.text"), "a string", other)),
                None => {
                    let param = format!("{part_param}.text");
                    return Err(ApiError::bad_request(format!("`{param}` is required"), Some(&param)));
                }
            },
            Some("image_url" | "input_image" | "image") => {
                return Err(ApiError::bad_request(
                    format!("`{part_param}`: images are not supported, this server serves a text-only model"),
                    Some(&part_param),
                ));
            }
            Some(other) => {
                return Err(ApiError::bad_request(
                    format!("`{part_param}`: content parts of type `{other}` are not supported, only `text`"),
                    Some(&part_param),
                ));
            }
            None => {
                return Err(ApiError::bad_request(
                    format!("`{part_param}.type` is required and must be a string"),
                    Some(&part_param),
                ));
            }
        }
    }
    Ok(text)
}

fn deserialize_content<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let value = Value::deserialize(deserializer)?;
    content_text(&value, "content").map_err(|e| serde::de::Error::custom(e.message))
}

/// A field the server knows but cannot honour: allowed only at its neutral value.
struct Unsupported {
    key: &'static str,
    neutral: fn(&Value) -> bool,
    message: &'static str,
}

fn is_one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}
fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn is_empty_array(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}
fn is_none_choice(v: &Value) -> bool {
    v.as_str() == Some("none")
}

// Neutral values are accepted because several client libraries send them on every request.
const COMMON_UNSUPPORTED: &[Unsupported] =
    &[Unsupported { key: "min_p", neutral: is_zero, message: "is not supported: it must be 0" }];

const COMPLETION_UNSUPPORTED: &[Unsupported] =
    &[Unsupported { key: "suffix", neutral: |v| v.as_str() == Some(""), message: "is not supported" }];

const CHAT_UNSUPPORTED: &[Unsupported] = &[
    Unsupported { key: "best_of", neutral: is_one, message: "is a completions parameter; use `n`" },
    Unsupported { key: "functions", neutral: is_empty_array, message: "are deprecated and not supported: use `tools`" },
    Unsupported {
        key: "function_call",
        neutral: is_none_choice,
        message: "is deprecated and not supported: use `tool_choice`",
    },
];

/// A request object; `null` reads as absent throughout, as clients send `null` for "unset".
struct Body<'a>(&'a Map<String, Value>);

impl Body<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn refuse_unsupported(&self, table: &[Unsupported]) -> Result<(), ApiError> {
        for field in table {
            if let Some(value) = self.get(field.key)
                && !(field.neutral)(value)
            {
                return Err(ApiError::bad_request(format!("`{}` {}", field.key, field.message), Some(field.key)));
            }
        }
        Ok(())
    }

    fn string(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong_type(key, "a string", other)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(wrong_type(key, "a boolean", other)),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(wrong_type(key, "a number", other)),
        }
    }

    /// A count of alternatives per token, 0..=[`MAX_TOP_LOGPROBS`].
    fn top_logprobs(&self, key: &str) -> Result<usize, ApiError> {
        match self.integer(key)? {
            Some(k) if (0..=MAX_TOP_LOGPROBS as i128).contains(&k) => Ok(k as usize),
            Some(k) => Err(ApiError::bad_request(
                format!("`{key}` must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                Some(key),
            )),
            None => Ok(0),
        }
    }

    /// Any JSON integer that fits i64 or u64.
    fn integer(&self, key: &str) -> Result<Option<i128>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
                Ok(n.as_u64().map(i128::from).or(n.as_i64().map(i128::from)))
            }
            Some(other) => Err(wrong_type(key, "an integer", other)),
        }
    }

    /// A count of choices, 1..=[`MAX_CHOICES`].
    fn choices(&self, key: &str) -> Result<Option<usize>, ApiError> {
        match self.integer(key)? {
            None => Ok(None),
            Some(n) if (1..=MAX_CHOICES as i128).contains(&n) => Ok(Some(n as usize)),
            Some(n) => {
                Err(ApiError::bad_request(format!("`{key}` must be between 1 and {MAX_CHOICES}, got {n}"), Some(key)))
            }
        }
    }

    fn max_tokens(&self, key: &str) -> Result<Option<usize>, ApiError> {
        let Some(n) = self.integer(key)? else {
            return Ok(None);
        };
        if n < 1 {
            return Err(ApiError::bad_request(format!("`{key}` must be at least 1, got {n}"), Some(key)));
        }
        if n > MAX_TOKENS_LIMIT as i128 {
            return Err(ApiError::bad_request(
                format!("`{key}` must be at most {MAX_TOKENS_LIMIT}, got {n}"),
                Some(key),
            ));
        }
        Ok(Some(n as usize))
    }
}

fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::bad_request(format!("`{param}` must be {expected}, got {}", type_name(got)), Some(param))
}

fn rename_param(mut error: ApiError, param: &str) -> ApiError {
    if let Some(old) = error.param.replace(param.to_owned()) {
        error.message = error.message.replace(&format!("`{old}`"), &format!("`{param}`"));
    }
    error
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod tests;
