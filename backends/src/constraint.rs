//! Structured outputs: a grammar a request's tokens must follow (a JSON schema, a
//! regular expression or a Lark grammar), enforced by masking, before each token is
//! sampled, every token the grammar does not allow next. The masks come from
//! `llguidance`, the library vLLM and SGLang use; this module only adapts it to the
//! runtime's tokenizer and logits.

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::error::{BackendError, Result};
use crate::tokenizer::TextTokenizer;
pub use tessera_vocab::GrammarKind;

/// The `x-guidance` options of compact JSON output: `", "` between items, `": "` after
/// keys, no other whitespace. A small model free to add whitespace may add it forever.
pub fn compact_json() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// Compiles grammars against one vocabulary. Built once per process (the token trie
/// and the lexer's token classes are its cost), shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab_size", &self.vocab_size).finish_non_exhaustive()
    }
}

impl Grammars {
    /// Grammars over `tok`'s vocabulary, ending at its first end-of-sequence token.
    pub fn new(tok: &TextTokenizer) -> Result<Arc<Grammars>> {
        let refuse = |why: &str| BackendError::Request(format!("structured outputs are not available: {why}"));
        let words = tok.grammar_vocab().ok_or_else(|| {
            refuse("the tokenizer's tokens have no exact bytes (neither byte-level BPE nor SentencePiece)")
        })?;
        let eos = *tok.eos_ids().first().ok_or_else(|| refuse("the tokenizer has no end-of-sequence token"))?;
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_bos = tok.bos_id();
        let env = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&(env as llguidance::toktrie::TokEnv))
            .map_err(|e| refuse(&format!("cannot index the vocabulary: {e}")))?;
        factory.quiet();
        Ok(Arc::new(Grammars { factory, vocab_size: words.len() }))
    }

    /// A fresh matcher of `source`, or a [`BackendError::Request`] saying why the
    /// grammar is invalid. A JSON schema's output is [`compact_json`] unless its
    /// `x-guidance` object says otherwise.
    pub fn compile(&self, kind: GrammarKind, source: &str) -> Result<Constraint> {
        let invalid = |e: String| BackendError::Request(e);
        let grammar = match kind {
            GrammarKind::JsonSchema => {
                let mut schema: serde_json::Value =
                    serde_json::from_str(source).map_err(|e| invalid(format!("the JSON schema is not JSON: {e}")))?;
                if let Some(obj) = schema.as_object_mut()
                    && !obj.contains_key("x-guidance")
                {
                    obj.insert("x-guidance".into(), compact_json());
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarKind::Regex => TopLevelGrammar::from_regex(source),
            GrammarKind::Lark => TopLevelGrammar::from_lark(source.to_string()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| invalid(format!("invalid grammar: {e}")))?;
        Ok(Constraint { matcher: Matcher::new(Ok(parser)), vocab_size: self.vocab_size, mask_s: 0.0, masks: 0 })
    }
}

/// The tokens a grammar allows at one position.
#[derive(Debug)]
pub struct Allowed(SimpleVob);

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    vocab_size: usize,
    /// Time spent computing masks, and how many.
    mask_s: f64,
    masks: u64,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("masks", &self.masks).finish_non_exhaustive()
    }
}

impl Constraint {
    /// The tokens the grammar allows next: only the end-of-sequence token once it is
    /// complete. The costly half of masking, independent of the logits, so it can run
    /// beside the forward pass that computes them.
    pub fn allowed(&mut self) -> Result<Allowed> {
        let started = Instant::now();
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| self.failed(e))?;
        self.mask_s += started.elapsed().as_secs_f64();
        self.masks += 1;
        Ok(Allowed(allowed))
    }

    /// Sets to -inf every logit of a token `allowed` rules out (ids beyond the
    /// tokenizer's vocabulary included).
    pub fn apply(&self, allowed: &Allowed, logits: &mut [f32]) {
        let known = self.vocab_size.min(logits.len());
        allowed.0.iter_unset_entries(|id| {
            if id < known {
                logits[id] = f32::NEG_INFINITY;
            }
        });
        for l in &mut logits[known..] {
            *l = f32::NEG_INFINITY;
        }
    }

    /// [`allowed`](Self::allowed) then [`apply`](Self::apply).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.allowed()?;
        self.apply(&allowed, logits);
        Ok(())
    }

    /// Moves the grammar past `token`, which its mask allowed.
    pub fn advance(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(()); // the end-of-sequence token after a complete grammar
        }
        self.matcher.consume_token(token).map_err(|e| self.failed(e))
    }

    /// Moves the grammar past tokens generated elsewhere (a sequence replayed here).
    pub fn replay(&mut self, tokens: &[u32]) -> Result<()> {
        tokens.iter().try_for_each(|&t| self.advance(t))
    }

    /// Seconds spent computing masks and how many were computed, since the last call.
    pub fn take_mask_time(&mut self) -> (f64, u64) {
        (std::mem::take(&mut self.mask_s), std::mem::take(&mut self.masks))
    }

    fn failed(&self, e: impl std::fmt::Display) -> BackendError {
        BackendError::Request(format!("the output left its grammar: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny preset's byte-level tokenizer (its files only, no weights).
    fn tokenizer() -> TextTokenizer {
        use crate::synth::{self, Preset, SynthArch, SynthSpec};
        // A directory per call: the tests run in parallel threads of one process.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tessera-constraint-{}-{call}", std::process::id()));
        let spec = SynthSpec { preset: Preset::Tiny, arch: SynthArch::Llama, seed: 1, dtype: None, shards: 1 };
        synth::write_tokenizer_files(&dir, &synth::hf_config(&spec)).expect("tokenizer files");
        let tok = TextTokenizer::from_dir(&dir).expect("the synthetic tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        tok
    }

    fn grammars() -> Arc<Grammars> {
        Grammars::new(&tokenizer()).expect("grammars over the synthetic vocabulary")
    }

    fn allowed(c: &mut Constraint, vocab: usize) -> Vec<u32> {
        let mut logits = vec![0.0f32; vocab];
        c.mask(&mut logits).expect("a mask");
        (0..vocab as u32).filter(|&i| logits[i as usize].is_finite()).collect()
    }

    #[test]
    fn a_regex_allows_only_its_strings_then_the_end() {
        let tok = tokenizer();
        let g = Grammars::new(&tok).expect("grammars");
        let mut c = g.compile(GrammarKind::Regex, "(yes|no)").expect("compiles");
        let vocab = tok.vocab_size();
        let first: Vec<String> = allowed(&mut c, vocab).iter().map(|&id| tok.decode(&[id]).expect("decodes")).collect();
        assert!(!first.is_empty());
        assert!(first.iter().all(|t| "yes".starts_with(t.as_str()) || "no".starts_with(t.as_str())), "{first:?}");
        for id in tok.encode("no", false).expect("encodes") {
            c.advance(id).expect("allowed");
        }
        let eos = tok.eos_ids()[0];
        assert_eq!(allowed(&mut c, vocab), vec![eos], "only the end once the regex is matched");
        let (seconds, masks) = c.take_mask_time();
        assert_eq!(masks, 2);
        assert!(seconds > 0.0);
    }

    #[test]
    fn invalid_grammars_are_refused_with_the_reason() {
        let g = grammars();
        let err = g.compile(GrammarKind::JsonSchema, "{not json").expect_err("refused").to_string();
        assert!(err.contains("not JSON"), "{err}");
        let err = g.compile(GrammarKind::Regex, "(unclosed").expect_err("refused").to_string();
        assert!(err.contains("invalid grammar"), "{err}");
        let err = g.compile(GrammarKind::Lark, "start: undefined_rule").expect_err("refused").to_string();
        assert!(err.contains("invalid grammar"), "{err}");
    }

    #[test]
    fn logits_beyond_the_vocabulary_are_ruled_out() {
        let g = grammars();
        let mut c = g.compile(GrammarKind::Regex, "[a-z]+").expect("compiles");
        let mut logits = vec![0.0f32; g.vocab_size + 5];
        c.mask(&mut logits).expect("a mask");
        assert!(logits[g.vocab_size..].iter().all(|l| *l == f32::NEG_INFINITY));
    }
}
