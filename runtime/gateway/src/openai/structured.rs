//! Structured outputs: a request's `response_format` or vLLM-style constraint as the
//! grammar its chip masks sampling with, checked here first so that a grammar that
//! does not compile is the client's 400, not a failed generation.

use std::sync::{Arc, OnceLock};

use tessera_actors::msg::{Grammar, GrammarKind};
use tessera_backends::constraint::Grammars;
use tessera_backends::tokenizer::TextTokenizer;

use super::ApiError;
use super::request::Structured;

/// The grammar a chip enforces for `s`.
pub fn grammar_of(s: &Structured) -> Grammar {
    let (kind, source) = match s {
        Structured::JsonSchema(schema) => (GrammarKind::JsonSchema, schema.to_string()),
        Structured::Regex(rx) => (GrammarKind::Regex, rx.clone()),
        // Lark string literals are JSON strings.
        Structured::Choice(choices) => {
            let literals: Vec<String> =
                choices.iter().map(|c| serde_json::Value::from(c.as_str()).to_string()).collect();
            (GrammarKind::Lark, format!("start: {}", literals.join(" | ")))
        }
        Structured::Grammar(lark) => (GrammarKind::Lark, lark.clone()),
    };
    Grammar { kind, source: source.into() }
}

/// Compiles grammars over the served model's vocabulary, built on first use (the
/// vocabulary's index costs tens of milliseconds; most servers never need it).
#[derive(Debug, Default)]
pub struct GrammarCheck {
    grammars: OnceLock<Result<Arc<Grammars>, String>>,
}

impl GrammarCheck {
    /// Ok if `grammar` compiles over `tok`'s vocabulary; else a 400 naming `param`.
    pub fn check(&self, tok: &TextTokenizer, grammar: &Grammar, param: &str) -> Result<(), ApiError> {
        let grammars = self.grammars.get_or_init(|| Grammars::new(tok).map_err(|e| e.to_string()));
        let grammars = grammars.as_ref().map_err(|why| ApiError::bad_request(why.clone(), Some(param)))?;
        grammars.compile(grammar.kind, &grammar.source).map(drop).map_err(|e| {
            let why = e.to_string();
            let why = why.strip_prefix("invalid request: ").unwrap_or(&why);
            ApiError::bad_request(format!("`{param}`: {why}"), Some(param))
        })
    }
}
