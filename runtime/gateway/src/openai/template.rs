//! Chat templates: the model's Jinja template (from its `tokenizer_config.json`) turning a
//! conversation into the prompt text, rendered with minijinja configured as Hugging Face's
//! `apply_chat_template` configures Jinja2 (trim_blocks, lstrip_blocks, loop controls,
//! `raise_exception`, Python string methods such as `.strip()`).

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value, context};

use super::tools::{self, Tool};
use super::{ApiError, ChatMessage};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template reads a `tools` variable (renders tools and calls itself).
    knows_tools: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// What `raise_exception` raised: the template's own words for the client.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; the error says why and where it does not parse.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, String> {
        let mut env = Environment::new();
        // As transformers compiles chat templates; without these, whitespace differs from the
        // prompt the model was trained on.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("chat template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| format!("invalid chat template: {e:#}"))?;
        let knows_tools = source.contains("tools");
        Ok(Self { env, knows_tools, bos_token, eos_token })
    }

    /// Renders the conversation; a template that refuses it (`raise_exception`, e.g. roles out
    /// of order) or fails on it is the client's 400, with the template's message.
    /// The prompt of a conversation that may offer `tools`: through the template's
    /// own `tools` variable when it has one, else as plain messages in the Hermes style
    /// (see [`tools::plain_messages`]).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: &[Tool],
    ) -> Result<String, ApiError> {
        let has_tool_turns = messages.iter().any(|m| m.role == "tool" || !m.tool_calls.is_empty());
        if !self.knows_tools && (!tools.is_empty() || has_tool_turns) {
            return self.render(&tools::plain_messages(messages, tools), add_generation_prompt, &[]);
        }
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        let function = context! { name => c.name.as_str(), arguments => Value::from(minijinja::value::Serde(c.arguments_value())) };
                        context! { id => c.id.as_str(), type => "function", function }
                    })
                    .collect();
                let calls = if calls.is_empty() { Value::UNDEFINED } else { Value::from(calls) };
                let call_id = m.tool_call_id.as_deref().map_or(Value::UNDEFINED, Value::from);
                context! { role => m.role.as_str(), content => m.content.as_str(), tool_calls => calls, tool_call_id => call_id }
            })
            .collect();
        let tools: Value = if tools.is_empty() {
            Value::UNDEFINED
        } else {
            Value::from(tools.iter().map(|t| Value::from(minijinja::value::Serde(&t.raw))).collect::<Vec<_>>())
        };
        let ctx = context! {
            messages,
            tools,
            add_generation_prompt,
            // Left undefined when the tokenizer has none, as transformers does.
            bos_token => self.bos_token.as_deref().map_or(Value::UNDEFINED, Value::from),
            eos_token => self.eos_token.as_deref().map_or(Value::UNDEFINED, Value::from),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| {
            tracing::error!(error = %e, "the chat template is missing");
            ApiError::internal("The server could not complete the request.")
        })?;
        template.render(ctx).map_err(|e| render_error(&e))
    }
}

fn render_error(error: &Error) -> ApiError {
    let raised = std::iter::successors(Some(error as &(dyn std::error::Error + 'static)), |e| e.source())
        .find_map(|e| e.downcast_ref::<RaisedByTemplate>());
    let message = match raised {
        Some(RaisedByTemplate(message)) => message.clone(),
        // The template's error (its lines, its variables) is the operator's to read.
        None => {
            tracing::warn!(error = %error, "the chat template could not render a request's messages");
            "The chat template could not render these messages.".to_owned()
        }
    };
    ApiError::bad_request(message, Some("messages"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}\
        {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
        {% endif %}\
        {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\
        {% endfor %}\
        {% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::text(role, content.into())
    }

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source, Some("<|begin_of_text|>".into()), Some("<|eot_id|>".into()))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn render(t: &ChatTemplate, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        t.render(messages, add_generation_prompt, &[]).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn chatml_renders_the_conversation() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap_or_else(|e| panic!("{e}"));
        let messages = [msg("system", "Be brief."), msg("user", "Hi")];
        assert_eq!(
            render(&t, &messages, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(render(&t, &messages[1..], false), "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn llama3_style_uses_bos_and_trims() {
        let t = template(LLAMA3);
        let messages = [msg("user", "  Hi \n"), msg("assistant", "Hello"), msg("user", "Bye")];
        assert_eq!(
            render(&t, &messages, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn raise_exception_is_the_clients_400_with_the_templates_words() {
        let t = template(LLAMA3);
        let err = t.render(&[msg("user", "a"), msg("user", "b")], true, &[]).err();
        assert_eq!(
            err,
            Some(ApiError::bad_request(
                "Conversation roles must alternate user/assistant/user/assistant/...",
                Some("messages")
            ))
        );
    }

    #[test]
    fn other_render_failures_are_400_too() {
        let t = template("{{ messages[0]['content'] + 1 }}");
        let err = t.render(&[msg("user", "a")], false, &[]).err();
        assert!(err.as_ref().is_some_and(|e| e.status == 400 && e.message.contains("could not render")), "{err:?}");
    }

    #[test]
    fn hugging_face_idioms_work() {
        // Python string methods, tojson, trim_blocks/lstrip_blocks, loop controls, bos/eos.
        let source = "{% for message in messages %}\n    {% if loop.index0 == 2 %}{% break %}{% endif %}\n\
                      {{ message['content'].strip() }}|{{ message.role | tojson }}\n{% endfor %}\
                      {% if eos_token is defined %}{{ eos_token }}{% endif %}";
        let t = template(source);
        let messages = [msg("user", " a "), msg("assistant", "b\n"), msg("user", "c")];
        assert_eq!(render(&t, &messages, false), "a|\"user\"\nb|\"assistant\"\n<|eot_id|>");
        let t = ChatTemplate::new("{% if bos_token is defined %}bos{% else %}none{% endif %}", None, None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(render(&t, &[msg("user", "a")], false), "none");
    }

    #[test]
    fn syntax_errors_are_refused_at_load() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}", None, None).err();
        assert!(err.as_ref().is_some_and(|e| e.contains("invalid chat template")), "{err:?}");
    }
}
