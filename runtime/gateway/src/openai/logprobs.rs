//! Log-probabilities in OpenAI's two shapes: the legacy completions object (parallel
//! arrays, alternatives as a token → logprob map) and chat's list of per-token entries.
//! Values come from the log-softmax of the model's raw logits, before temperature, top-k
//! or top-p (as vLLM reports them); JSON has no -inf, so a token without probability
//! shows -9999 (OpenAI's own stand-in).

use serde_json::{Map, Value, json};

/// What JSON shows for a log-probability of -inf.
const NO_PROBABILITY: f64 = -9999.0;

/// One generated token: its text, its log-probability, and the most likely tokens'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEntry {
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

fn number(logprob: f32) -> Value {
    let v = logprob as f64;
    json!(if v.is_finite() { v } else { NO_PROBABILITY })
}

/// The completions `logprobs` object of `entries`, whose text starts `offset` characters
/// into the choice's text. Each token's alternatives include the token itself (so a
/// client always finds the sampled token there), highest first.
pub fn completion_logprobs(entries: &[TokenEntry], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(entries.len());
    let mut at = offset;
    for e in entries {
        text_offset.push(at);
        at += e.text.chars().count();
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut alternatives = Map::new();
            for (text, logprob) in &e.top {
                alternatives.entry(text.clone()).or_insert_with(|| number(*logprob));
            }
            alternatives.entry(e.text.clone()).or_insert_with(|| number(e.logprob));
            Value::Object(alternatives)
        })
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| number(e.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// The completions `logprobs` object of an echoed prompt and what followed it: the
/// prompt's first token has no log-probability (`null`, as OpenAI shows it), every other
/// token its own. When the first token's text is not in the echoed text (a
/// beginning-of-sequence token the server added), it takes no characters there: the
/// offsets of the rest still point into the text the client gets.
pub fn echo_completion_logprobs(
    first: &str,
    first_in_text: bool,
    prompt: &[TokenEntry],
    generated: &[TokenEntry],
) -> Value {
    let shown = if first_in_text { first } else { "" };
    let head = TokenEntry { text: shown.to_owned(), logprob: 0.0, top: Vec::new() };
    let all: Vec<TokenEntry> =
        std::iter::once(head).chain(prompt.iter().cloned()).chain(generated.iter().cloned()).collect();
    let mut v = completion_logprobs(&all, 0);
    v["tokens"][0] = Value::String(first.to_owned());
    v["token_logprobs"][0] = Value::Null;
    v["top_logprobs"][0] = Value::Null;
    v
}

/// The chat `logprobs` object of `entries`.
pub fn chat_logprobs(entries: &[TokenEntry]) -> Value {
    let entry = |text: &str, logprob: f32| json!({"token": text, "logprob": number(logprob), "bytes": text.as_bytes()});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = entry(&e.text, e.logprob);
            v["top_logprobs"] = Value::Array(e.top.iter().map(|(t, l)| entry(t, *l)).collect());
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `body` (a response or a streamed chunk) with its one choice's `logprobs` set.
pub fn with_logprobs(mut body: Value, logprobs: Value) -> Value {
    if let Some(choice) = body.get_mut("choices").and_then(|c| c.get_mut(0)) {
        choice["logprobs"] = logprobs;
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries() -> Vec<TokenEntry> {
        vec![
            TokenEntry { text: "Hé".into(), logprob: -0.5, top: vec![("Hé".into(), -0.5), ("Yo".into(), -1.5)] },
            TokenEntry { text: " there".into(), logprob: f32::NEG_INFINITY, top: vec![(" you".into(), -0.1)] },
        ]
    }

    #[test]
    fn completions_shape_has_parallel_arrays_offsets_and_the_sampled_token_among_the_alternatives() {
        let v = completion_logprobs(&entries(), 3);
        assert_eq!(v["tokens"], json!(["Hé", " there"]));
        assert_eq!(v["token_logprobs"], json!([-0.5, -9999.0]));
        assert_eq!(v["text_offset"], json!([3, 5]), "offsets in characters");
        assert_eq!(v["top_logprobs"][0], json!({"Hé": -0.5, "Yo": -1.5}));
        assert_eq!(v["top_logprobs"][1], json!({" you": -0.1f32 as f64, " there": -9999.0}));
    }

    #[test]
    fn an_echoed_prompt_leads_with_a_null_then_every_token() {
        let v = echo_completion_logprobs("<s>", true, &entries()[..1], &entries()[1..]);
        assert_eq!(v["tokens"], json!(["<s>", "Hé", " there"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5, -9999.0]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1], json!({"Hé": -0.5, "Yo": -1.5}));
        assert_eq!(v["text_offset"], json!([0, 3, 5]));
        // A server-added first token is listed but takes no place in the echoed text.
        let v = echo_completion_logprobs("<s>", false, &entries()[..1], &entries()[1..]);
        assert_eq!(v["tokens"], json!(["<s>", "Hé", " there"]));
        assert_eq!(v["text_offset"], json!([0, 0, 2]));
    }

    #[test]
    fn chat_shape_lists_entries_with_bytes_and_alternatives() {
        let v = chat_logprobs(&entries());
        assert_eq!(v["refusal"], Value::Null);
        let first = &v["content"][0];
        assert_eq!(first["token"], "Hé");
        assert_eq!(first["bytes"], json!([72, 195, 169]));
        assert_eq!(first["top_logprobs"][1], json!({"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}));
        assert_eq!(v["content"][1]["logprob"], json!(-9999.0));
        let body = json!({"choices": [{"index": 0, "logprobs": null}]});
        assert_eq!(with_logprobs(body, v.clone())["choices"][0]["logprobs"], v);
    }
}
