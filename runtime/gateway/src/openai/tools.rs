//! Tool calls in the `<tool_call>` JSON style of Hermes and Qwen chat templates: the
//! tools rendered into the prompt (through the template's own `tools` variable, or, for
//! a template without one, as the Hermes system prompt), `required` and named choices
//! turned into a grammar so the call always parses, and the model's text parsed back
//! into OpenAI's `tool_calls`, whole or as it streams.

use serde_json::{Map, Value, json};

use super::ApiError;
use super::request::ChatMessage;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
/// The most calls one answer may hold when parallel calls are allowed and the grammar
/// enforces them (a sampled model might otherwise call forever).
const MAX_PARALLEL_CALLS: usize = 4;

/// A function the model may call: its name and JSON schema of arguments, and the tool
/// object as the client sent it (templates render that).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
    pub raw: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are left out of the prompt.
    None,
    /// The model decides; calls in its text are parsed.
    Auto,
    /// At least one call, enforced by a grammar.
    Required,
    /// A call of this function, enforced by a grammar.
    Named(String),
}

/// The request's tools and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (OpenAI's default: true).
    pub parallel: bool,
}

impl Tools {
    /// No tools.
    pub fn none() -> Tools {
        Tools { tools: Vec::new(), choice: ToolChoice::None, parallel: true }
    }

    /// Whether the prompt shows the tools and the output is parsed for calls.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// The Lark grammar a `required` or named choice is enforced with: one call (up to
    /// [`MAX_PARALLEL_CALLS`] when parallel), each `{"name": …, "arguments": …}` of one
    /// of the allowed functions, its arguments valid under that function's schema.
    pub fn grammar(&self) -> Option<String> {
        let allowed: Vec<&Tool> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
        };
        let mut lark = String::new();
        if self.parallel {
            lark.push_str(&format!("start: call (\"\\n\" call){{0,{}}}\n", MAX_PARALLEL_CALLS - 1));
        } else {
            lark.push_str("start: call\n");
        }
        let names: Vec<String> = (0..allowed.len()).map(|i| format!("fn{i}")).collect();
        lark.push_str(&format!("call: \"{}\\n\" ({}) \"\\n{}\"\n", OPEN, names.join(" | "), CLOSE));
        for (name, tool) in names.iter().zip(&allowed) {
            let schema = json!({
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
                // Compact, as structured outputs are.
                "x-guidance": tessera_backends::constraint::compact_json(),
            });
            lark.push_str(&format!("{name}: %json {schema}\n"));
        }
        Some(lark)
    }
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls` of a chat request body.
pub fn parse_tools(body: &Map<String, Value>) -> Result<Tools, ApiError> {
    let get = |key: &str| body.get(key).filter(|v| !v.is_null());
    let tools = match get("tools") {
        None => Vec::new(),
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(i, t)| parse_tool(i, t)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(ApiError::bad_request("`tools` must be an array of tools", Some("tools"))),
    };
    for (i, t) in tools.iter().enumerate() {
        if tools[..i].iter().any(|o: &Tool| o.name == t.name) {
            let param = format!("tools[{i}].function.name");
            return Err(ApiError::bad_request(format!("two tools are named `{}`", t.name), Some(&param)));
        }
    }
    let choice = match get("tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_request(
                    format!("`tool_choice` must be none, auto, required or a function, got {other:?}"),
                    Some("tool_choice"),
                ));
            }
        },
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_request(
                    "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    Some("tool_choice"),
                )
            })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::bad_request(
                    format!("`tool_choice` names function `{name}`, which is not among `tools`"),
                    Some("tool_choice"),
                ));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => {
            return Err(ApiError::bad_request("`tool_choice` must be a string or an object", Some("tool_choice")));
        }
    };
    if tools.is_empty() && choice != ToolChoice::None {
        return Err(ApiError::bad_request("`tool_choice` needs `tools`", Some("tool_choice")));
    }
    let parallel = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad_request("`parallel_tool_calls` must be a boolean", Some("parallel_tool_calls")));
        }
    };
    Ok(Tools { tools, choice, parallel })
}

fn parse_tool(i: usize, tool: &Value) -> Result<Tool, ApiError> {
    let param = format!("tools[{i}]");
    let bad = |what: &str| ApiError::bad_request(format!("`{param}` {what}"), Some(&param));
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("must have `type` `function`"));
    }
    let function = tool.get("function").and_then(Value::as_object).ok_or_else(|| bad("needs a `function` object"))?;
    let name = function.get("name").and_then(Value::as_str).ok_or_else(|| bad("needs `function.name`"))?;
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if !name_ok {
        return Err(bad("`function.name` must be 1 to 64 letters, digits, `_`, `-` or `.`"));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(bad("`function.parameters` must be a JSON schema object")),
    };
    Ok(Tool { name: name.to_owned(), parameters, raw: tool.clone() })
}

/// The system prompt that describes `tools` to a model whose chat template has no
/// `tools` variable (Hermes' and Qwen 2.5's wording).
pub fn system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.raw.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// A conversation with tools, in plain messages for a template without tool support:
/// the tools' system prompt before (or at the head of) the system message, each earlier
/// call as the `<tool_call>` text the model writes, each result as a user turn in
/// `<tool_response>` tags.
pub fn plain_messages(messages: &[ChatMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let intro = (!tools.is_empty()).then(|| system_prompt(tools));
    let mut rest = messages;
    match (intro, messages.first()) {
        (Some(intro), Some(first)) if first.role == "system" => {
            out.push(ChatMessage::text("system", format!("{}\n\n{intro}", first.content)));
            rest = &messages[1..];
        }
        (Some(intro), _) => out.push(ChatMessage::text("system", intro)),
        (None, _) => {}
    }
    for m in rest {
        match m.role.as_str() {
            "tool" => out.push(ChatMessage::text("user", format!("<tool_response>\n{}\n</tool_response>", m.content))),
            "assistant" if !m.tool_calls.is_empty() => {
                let mut text = m.content.clone();
                for call in &m.tool_calls {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    let shown = json!({"name": call.name, "arguments": call.arguments_value()});
                    text.push_str(&format!("{OPEN}\n{shown}\n{CLOSE}"));
                }
                out.push(ChatMessage::text("assistant", text));
            }
            _ => out.push(ChatMessage::text(&m.role, m.content.clone())),
        }
    }
    out
}

/// One call, as the model wrote it and OpenAI returns it (`arguments` is JSON text).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// The arguments as a JSON value (a template renders them as an object); text that
    /// is not JSON stays a string.
    pub fn arguments_value(&self) -> Value {
        serde_json::from_str(&self.arguments).unwrap_or_else(|_| Value::String(self.arguments.clone()))
    }

    /// `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// A streamed delta carrying this whole call, at position `index` of the answer.
    pub fn delta_json(&self, index: usize) -> Value {
        json!({"index": index, "id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// Splits a model's text into content and calls as it arrives: content streams until a
/// `<tool_call>` opens (text that may be the start of one is held back), each call is
/// returned once its `</tool_call>` closes. A block whose inside is not a
/// `{"name", "arguments"}` object is content after all, tags included.
#[derive(Debug)]
pub struct ToolCallParser {
    /// Text not yet returned: a possible start of a tag, or an open block.
    pending: String,
    calls: usize,
    /// A call just closed: a newline right after it separates it from the next.
    after_call: bool,
    /// Ids are `call_<id_prefix>_<n>`.
    id_prefix: String,
}

/// Where the `</tool_call>` that closes a block starts in `inner`, the text after its
/// `<tool_call>`: the first one outside a JSON string, since an argument's text may
/// hold the tag itself (a sampled model writes it there now and then). `"`, `\` and
/// `<` are ASCII, never inside another character's UTF-8 bytes.
fn close_at(inner: &str) -> Option<usize> {
    let (mut in_string, mut escaped) = (false, false);
    for (i, b) in inner.bytes().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
        } else if b == b'<' && inner[i..].starts_with(CLOSE) {
            return Some(i);
        }
    }
    None
}

/// What one push returned: content to show, and calls completed.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

impl ToolCallParser {
    pub fn new(id_prefix: &str) -> Self {
        ToolCallParser { pending: String::new(), calls: 0, after_call: false, id_prefix: id_prefix.to_owned() }
    }

    /// Calls returned so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Parsed {
        self.pending.push_str(text);
        let mut out = Parsed::default();
        loop {
            if self.after_call && !self.pending.is_empty() {
                self.after_call = false;
                // The newline between two calls belongs to neither.
                if self.pending.starts_with('\n') {
                    self.pending.remove(0);
                }
            }
            match self.pending.find(OPEN) {
                Some(0) => {
                    let Some(end) = close_at(&self.pending[OPEN.len()..]).map(|at| OPEN.len() + at) else { break };
                    let block: String = self.pending.drain(..end + CLOSE.len()).collect();
                    match self.call(&block[OPEN.len()..end]) {
                        Some(call) => {
                            out.calls.push(call);
                            self.after_call = true;
                        }
                        None => out.content.push_str(&block),
                    }
                }
                Some(at) => {
                    out.content.extend(self.pending.drain(..at));
                }
                None => {
                    // Keep back what could still become `<tool_call>`.
                    let keep = (1..OPEN.len().min(self.pending.len() + 1))
                        .rev()
                        .find(|&n| {
                            self.pending.is_char_boundary(self.pending.len() - n)
                                && OPEN.starts_with(&self.pending[self.pending.len() - n..])
                        })
                        .unwrap_or(0);
                    let cut = self.pending.len() - keep;
                    out.content.extend(self.pending.drain(..cut));
                    break;
                }
            }
        }
        out
    }

    /// The end of the text: an unclosed block is a call if what it holds parses (the
    /// answer was cut at its end), else content.
    pub fn finish(&mut self) -> Parsed {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Parsed::default();
        if let Some(inner) = rest.strip_prefix(OPEN)
            && let Some(call) = self.call(inner)
        {
            out.calls.push(call);
            return out;
        }
        out.content = rest;
        out
    }

    fn call(&mut self, inner: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(inner.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_owned();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            Some(Value::String(s)) => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            None => "{}".to_owned(),
            Some(_) => return None,
        };
        let id = format!("call_{}_{}", self.id_prefix, self.calls);
        self.calls += 1;
        Some(ToolCall { id, name, arguments })
    }
}

/// The content and calls of a whole answer; content `None` when only calls were
/// written (OpenAI's `content: null`).
pub fn parse_answer(text: &str, id_prefix: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = ToolCallParser::new(id_prefix);
    let mut a = p.push(text);
    let b = p.finish();
    a.content.push_str(&b.content);
    a.calls.extend(b.calls);
    let content = a.content.trim();
    let content = if a.calls.is_empty() || !content.is_empty() { Some(a.content.clone()) } else { None };
    (content, a.calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tools_and_choices_parse_and_bad_ones_name_the_field() {
        let body = |v: Value| v.as_object().cloned().unwrap_or_default();
        let t = parse_tools(&body(json!({"tools": [weather()]}))).expect("parses");
        assert_eq!((t.tools[0].name.as_str(), &t.choice, t.parallel), ("get_weather", &ToolChoice::Auto, true));
        let t =
            parse_tools(&body(json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false})))
                .expect("parses");
        assert_eq!((&t.choice, t.parallel), (&ToolChoice::Required, false));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = parse_tools(&body(json!({"tools": [weather()], "tool_choice": named}))).expect("parses");
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(!parse_tools(&body(json!({"tools": [weather()], "tool_choice": "none"}))).expect("parses").active());
        let refused = [
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0]"),
            (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools[0]"),
            (json!({"tools": [weather(), weather()]}), "tools[1].function.name"),
            (json!({"tools": "x"}), "tools"),
        ];
        for (b, param) in refused {
            let e = parse_tools(&body(b.clone())).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{b}: {}", e.message);
        }
    }

    #[test]
    fn calls_parse_whole_and_streamed_alike() {
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let (content, calls) = parse_answer(text, "x");
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].name.as_str(), calls[0].arguments.as_str()), ("get_weather", "{\"city\":\"Paris\"}"));
        assert_eq!((calls[0].id.as_str(), calls[1].id.as_str()), ("call_x_0", "call_x_1"));
        // Any split of the text gives the same content and calls.
        for step in 1..7 {
            let (content, streamed) = streamed(text, step);
            assert_eq!((content.as_str(), &streamed), ("Let me check.", &calls), "step {step}");
        }
    }

    /// `text` pushed `step` characters at a time: the content and calls, finish included.
    fn streamed(text: &str, step: usize) -> (String, Vec<ToolCall>) {
        let mut p = ToolCallParser::new("x");
        let (mut content, mut calls) = (String::new(), Vec::new());
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(step) {
            let got = p.push(&piece.iter().collect::<String>());
            content.push_str(&got.content);
            calls.extend(got.calls);
        }
        let end = p.finish();
        content.push_str(&end.content);
        calls.extend(end.calls);
        (content, calls)
    }

    /// An argument that holds the closing tag (and escaped quotes before it) is text
    /// of the call, which ends at the tag after the JSON, whole or streamed.
    #[test]
    fn a_closing_tag_inside_an_argument_does_not_end_the_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Fr\\\"ance</tool_call> x\"}}\n</tool_call>";
        let (content, calls) = parse_answer(text, "x");
        assert_eq!((content, calls.len()), (None, 1), "{text}");
        assert_eq!(calls[0].arguments, "{\"city\":\"Fr\\\"ance</tool_call> x\"}");
        for step in 1..5 {
            let (content, streamed) = streamed(text, step);
            assert_eq!((content.as_str(), &streamed), ("", &calls), "step {step}");
        }
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        let (content, calls) = parse_answer("I use <tool_call> tags.", "x");
        assert_eq!((content.as_deref(), calls.len()), (Some("I use <tool_call> tags."), 0));
        let (content, calls) = parse_answer("<tool_call>\nnot json\n</tool_call>", "x");
        assert_eq!((content.as_deref(), calls.len()), (Some("<tool_call>\nnot json\n</tool_call>"), 0));
        let (content, calls) = parse_answer("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}", "x");
        assert_eq!((content, calls.len()), (None, 1), "a call cut at its end still parses");
        let (content, _) = parse_answer("a <tool_ b", "x");
        assert_eq!(content.as_deref(), Some("a <tool_ b"));
    }

    #[test]
    fn a_required_choice_is_a_grammar_of_the_allowed_functions() {
        let mut tools = Tools {
            tools: vec![parse_tool(0, &weather()).expect("a tool")],
            choice: ToolChoice::Auto,
            parallel: false,
        };
        assert_eq!(tools.grammar(), None);
        tools.choice = ToolChoice::Required;
        let g = tools.grammar().expect("a grammar");
        assert!(g.starts_with("start: call\n"), "{g}");
        tools.parallel = true;
        assert!(tools.grammar().is_some_and(|g| g.starts_with("start: call (\"\\n\" call){0,3}\n")));
        assert!(g.contains("fn0: %json {") && g.contains("\"const\":\"get_weather\""), "{g}");
    }

    #[test]
    fn a_template_without_tools_gets_the_hermes_prompt_and_tags() {
        let tools = vec![parse_tool(0, &weather()).expect("a tool")];
        let call = ToolCall { id: "c".into(), name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() };
        let messages = vec![
            ChatMessage::text("system", "Be brief.".into()),
            ChatMessage::text("user", "Weather in Paris?".into()),
            ChatMessage { tool_calls: vec![call], ..ChatMessage::text("assistant", String::new()) },
            ChatMessage { tool_call_id: Some("c".into()), ..ChatMessage::text("tool", "22 C".into()) },
        ];
        let plain = plain_messages(&messages, &tools);
        let roles: Vec<&str> = plain.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(plain[0].content.starts_with("Be brief.\n\n# Tools") && plain[0].content.contains("\"get_weather\""));
        assert_eq!(
            plain[2].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(plain[3].content, "<tool_response>\n22 C\n</tool_response>");
    }
}
