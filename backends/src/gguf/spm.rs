//! SentencePiece-style vocabularies of GGUF files (`tokenizer.ggml.model = "llama"`:
//! Llama 1/2, Mistral, TinyLlama, …), tokenized exactly as llama.cpp tokenizes them, so
//! a GGUF file gives the same ids here as in llama.cpp.
//!
//! Encoding follows llama.cpp's `llama_vocab::impl::tokenize` for SPM vocabularies:
//! 1. special tokens (control, user-defined, unknown) are cut out of the text first,
//!    longest text first, every non-overlapping occurrence left to right;
//! 2. each remaining fragment that starts the text or follows a special token gets a
//!    leading space when `tokenizer.ggml.add_space_prefix` (default true), and its
//!    spaces become `▁`;
//! 3. the fragment starts as one symbol per character, and the adjacent pair whose
//!    concatenation is the highest-scoring token is merged, repeatedly (the leftmost
//!    pair on a tie) — `llm_tokenizer_spm_session`;
//! 4. a symbol that is no token (a character outside the vocabulary) becomes its UTF-8
//!    bytes' `<0xXX>` tokens (byte fallback).
//!
//! Decoding renders `▁` as a space and a byte token as its byte; control, unknown and
//! unused tokens render nothing, and one leading space (the one step 2 added) is dropped
//! from the first token, as SentencePiece and Hugging Face decode.
//!
//! Invariant: once built, every id the vocabulary hands out is below [`SpmVocab::len`]
//! and every byte has a token, so encoding cannot fail.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{Gguf, GgufError, Value};

const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TYPES: &str = "tokenizer.ggml.token_type";

/// What a token is (llama.cpp's `llama_token_type`, the values of `tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// 0, or a value outside 0..=6: never produced, renders nothing.
    Undefined,
    /// 1: a piece of text, `▁` standing for a space.
    Normal,
    /// 2: `<unk>`.
    Unknown,
    /// 3: `<s>`, `</s>`, chat markers: matched in text, never rendered.
    Control,
    /// 4: matched in text as a whole and rendered as spelled.
    UserDefined,
    /// 5: a placeholder; merges may still reach it, as in llama.cpp.
    Unused,
    /// 6: `<0xXX>`, one byte.
    Byte,
}

impl TokenKind {
    fn from_gguf(v: u64) -> TokenKind {
        match v {
            1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Undefined,
        }
    }

    /// Matched whole in the text before it is tokenized (llama.cpp's special-token cache).
    fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
    }
}

/// A SentencePiece-style vocabulary: tokens, their scores and kinds, and the rules of
/// `tokenizer.ggml.*` that shape encoding.
#[derive(Debug, Clone)]
pub struct SpmVocab {
    tokens: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<TokenKind>,
    by_text: HashMap<String, u32>,
    /// The token of each byte value, for byte fallback.
    byte_tokens: [u32; 256],
    /// Special tokens, longest text first (ties by id): the order they are cut out in.
    specials: Vec<u32>,
    add_space_prefix: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
}

fn meta_err(key: &str, what: impl Into<String>) -> GgufError {
    GgufError::Metadata { key: key.into(), what: what.into() }
}

fn array<'a>(g: &'a Gguf, key: &str) -> Result<Option<&'a [Value]>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_array().map(Some).ok_or_else(|| meta_err(key, format!("{v} is not an array"))),
    }
}

impl SpmVocab {
    /// Reads the vocabulary of a `tokenizer.ggml.model = "llama"` file. Bad metadata
    /// (lengths that disagree, a missing byte token, an id outside the vocabulary) is an
    /// error naming the key.
    pub fn from_gguf(g: &Gguf) -> Result<SpmVocab, GgufError> {
        let tokens = array(g, TOKENS)?.ok_or_else(|| meta_err(TOKENS, "missing"))?;
        let tokens = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                t.as_str().map(str::to_owned).ok_or_else(|| meta_err(TOKENS, format!("token {id} is not a string")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let n = tokens.len();
        let scores = match array(g, SCORES)? {
            // llama.cpp scores every token 0 then: merges go left to right.
            None => vec![0.0; n],
            Some(s) if s.len() != n => return Err(meta_err(SCORES, format!("{} scores for {n} tokens", s.len()))),
            Some(s) => s
                .iter()
                .enumerate()
                .map(|(id, v)| match v.as_f64() {
                    Some(x) if !x.is_nan() => Ok(x as f32),
                    _ => Err(meta_err(SCORES, format!("score {id} ({v}) is not a number"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let kinds = match array(g, TYPES)? {
            None => vec![TokenKind::Normal; n],
            Some(t) if t.len() != n => return Err(meta_err(TYPES, format!("{} token types for {n} tokens", t.len()))),
            Some(t) => t
                .iter()
                .enumerate()
                .map(|(id, v)| {
                    v.as_u64()
                        .map(TokenKind::from_gguf)
                        .ok_or_else(|| meta_err(TYPES, format!("type {id} ({v}) is not an integer")))
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let flag = |key: &str, default: bool| match g.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| meta_err(key, format!("{v} is not a boolean"))),
        };
        let add_space_prefix = flag("tokenizer.ggml.add_space_prefix", true)?;
        // llama.cpp's defaults for SPM vocabularies: <unk> 0, <s> 1, </s> 2.
        let id = |key: &str, default: u32| -> Result<Option<u32>, GgufError> {
            match g.get(key) {
                None => Ok(((default as usize) < n).then_some(default)),
                Some(v) => v
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .filter(|&v| (v as usize) < n)
                    .map(Some)
                    .ok_or_else(|| meta_err(key, format!("{v} is not a token id (the vocabulary has {n} tokens)"))),
            }
        };
        let bos_id = id("tokenizer.ggml.bos_token_id", 1)?;
        let eos_id = id("tokenizer.ggml.eos_token_id", 2)?;
        id("tokenizer.ggml.unknown_token_id", 0)?;
        SpmVocab::new(tokens, scores, kinds, add_space_prefix, bos_id, eos_id)
    }

    /// The vocabulary from its parts (equal lengths, as `from_gguf` checked).
    fn new(
        mut tokens: Vec<String>,
        scores: Vec<f32>,
        kinds: Vec<TokenKind>,
        add_space_prefix: bool,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
    ) -> Result<SpmVocab, GgufError> {
        if u32::try_from(tokens.len()).is_err() {
            return Err(meta_err(TOKENS, format!("{} tokens do not fit 32-bit ids", tokens.len())));
        }
        let mut by_text = HashMap::with_capacity(tokens.len());
        for (id, text) in tokens.iter_mut().enumerate() {
            if text.is_empty() {
                // As llama.cpp names an empty token, so that it is never matched.
                *text = format!("[EMPTY_{id}]");
            }
            // A later duplicate wins, as in llama.cpp's token_to_id map.
            by_text.insert(text.clone(), id as u32);
        }
        let mut byte_tokens = [0u32; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            // llama.cpp's byte_to_token: `<0xXX>`, else the byte itself as a token.
            let plain = char::from_u32(b as u32).filter(char::is_ascii).map(String::from);
            *slot = by_text.get(&hex).or_else(|| plain.and_then(|p| by_text.get(&p))).copied().ok_or_else(|| {
                meta_err(TOKENS, format!("no byte token {hex}: SentencePiece byte fallback needs all 256 bytes"))
            })?;
        }
        for (id, (text, kind)) in tokens.iter().zip(&kinds).enumerate() {
            if *kind == TokenKind::Byte && byte_value(text).is_none() {
                return Err(meta_err(TYPES, format!("token {id} ({text:?}) has the byte type but is not <0xXX>")));
            }
        }
        let mut specials: Vec<u32> = (0..tokens.len() as u32).filter(|&id| kinds[id as usize].is_special()).collect();
        specials.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].len()));
        Ok(SpmVocab { tokens, scores, kinds, by_text, byte_tokens, specials, add_space_prefix, bos_id, eos_id })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Whether encoding puts a space before the text (and decoding drops it).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// The token's text as the vocabulary spells it (`▁the`, `<0x0A>`, `<s>`).
    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The bytes `id` renders as in decoded text; `None` for tokens that render nothing
    /// (control, unknown, unused) and ids outside the vocabulary.
    pub fn rendered(&self, id: u32) -> Option<Vec<u8>> {
        let text = self.token(id)?;
        match self.kind(id)? {
            TokenKind::Normal => Some(text.replace('▁', " ").into_bytes()),
            TokenKind::UserDefined => Some(text.as_bytes().to_vec()),
            TokenKind::Byte => byte_value(text).map(|b| vec![b]),
            TokenKind::Undefined | TokenKind::Unknown | TokenKind::Control | TokenKind::Unused => None,
        }
    }

    /// Whether `id`, as the first token of a decoded text, starts with the space that
    /// encoding added (then dropped).
    pub fn starts_with_prefix_space(&self, id: u32) -> bool {
        self.add_space_prefix
            && self.kind(id) == Some(TokenKind::Normal)
            && self.token(id).is_some_and(|t| t.starts_with('▁'))
    }

    /// The ids of `text` as llama.cpp's `llama_tokenize(add_special = false,
    /// parse_special = true)` gives them (no BOS).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut after_special = true;
        for fragment in self.split_specials(text) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    let mut escaped = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && after_special {
                        escaped.push('▁');
                    }
                    escaped.extend(t.chars().map(|c| if c == ' ' { '▁' } else { c }));
                    self.encode_fragment(&escaped, &mut out);
                    after_special = false;
                }
            }
        }
        out
    }

    /// llama.cpp's `tokenizer_st_partition`: each special token in turn (longest first)
    /// splits every text fragment at each of its occurrences.
    fn split_specials<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let mut fragments = if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] };
        for &id in &self.specials {
            let special = self.tokens[id as usize].as_str();
            if !fragments.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(special))) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(t) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let mut rest = 0;
                for (at, _) in t.match_indices(special) {
                    if at > rest {
                        next.push(Fragment::Text(&t[rest..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = at + special.len();
                }
                if rest < t.len() {
                    next.push(Fragment::Text(&t[rest..]));
                }
            }
            fragments = next;
        }
        fragments
    }

    /// `llm_tokenizer_spm_session::tokenize` on one escaped, non-empty fragment.
    fn encode_fragment(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: None });
            if let Some(prev) = i.checked_sub(1) {
                symbols[prev].next = Some(i);
            }
        }
        let mut queue = BinaryHeap::new();
        let bigram = |symbols: &[Symbol], left: usize, right: usize| -> Option<Bigram> {
            let (l, r) = (&symbols[left], &symbols[right]);
            let merged = &text[l.start..r.start + r.len];
            let id = *self.by_text.get(merged)?;
            Some(Bigram { score: self.scores[id as usize], left, right, size: merged.len() })
        };
        for i in 1..symbols.len() {
            queue.extend(bigram(&symbols, i - 1, i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale: one side was merged away or grew since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.left].next = r.next;
            symbols[b.right].len = 0;
            if let Some(next) = r.next {
                symbols[next].prev = Some(b.left);
            }
            if let Some(prev) = l.prev {
                queue.extend(bigram(&symbols, prev, b.left));
            }
            if let Some(next) = r.next {
                queue.extend(bigram(&symbols, b.left, next));
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            // A merged symbol is a token by construction; a single character may not be.
            match self.by_text.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.byte_tokens[b as usize])),
            }
            at = s.next;
        }
    }
}

/// The byte of a `<0xXX>` token.
fn byte_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// A run of the fragment's text, linked to its neighbours; `len == 0` once merged away.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Two adjacent symbols whose concatenation is the token scored `score`.
#[derive(Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the concatenation, to tell a stale entry.
    size: usize,
}

/// llama.cpp's `llm_bigram_spm::comparator`: the highest score first, then the leftmost.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // Scores are never NaN (`from_gguf` refuses them), and -0.0 == 0.0 as in C++.
        self.score.partial_cmp(&other.score).unwrap_or(Ordering::Equal).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::gguf::tests::Writer;

    /// A small vocabulary as llama.cpp's converter writes one: `<unk>`, `<s>`, `</s>`, the
    /// 256 byte tokens, then `normal` pieces with their scores and any `extra` tokens.
    struct Spec {
        tokens: Vec<String>,
        scores: Vec<f32>,
        types: Vec<i32>,
        flags: Vec<(&'static str, bool)>,
        ids: Vec<(&'static str, u32)>,
    }

    impl Spec {
        fn new(normal: &[(&str, f32)]) -> Spec {
            let mut spec =
                Spec { tokens: Vec::new(), scores: Vec::new(), types: Vec::new(), flags: Vec::new(), ids: Vec::new() };
            for (text, ty) in [("<unk>", 2), ("<s>", 3), ("</s>", 3)] {
                spec = spec.token(text, 0.0, ty);
            }
            for b in 0..=255u8 {
                spec = spec.token(&format!("<0x{b:02X}>"), 0.0, 6);
            }
            normal.iter().fold(spec, |spec, &(text, score)| spec.token(text, score, 1))
        }

        fn token(mut self, text: &str, score: f32, ty: i32) -> Spec {
            self.tokens.push(text.into());
            self.scores.push(score);
            self.types.push(ty);
            self
        }

        fn writer(&self) -> Writer {
            let mut w = Writer::new()
                .meta_str("general.architecture", "llama")
                .meta_str("tokenizer.ggml.model", "llama")
                .meta_strs(TOKENS, &self.tokens)
                .meta_f32s(SCORES, &self.scores)
                .meta_i32s(TYPES, &self.types);
            for &(key, value) in &self.flags {
                w = w.meta_bool(key, value);
            }
            for &(key, value) in &self.ids {
                w = w.meta_u32(key, value);
            }
            w
        }

        fn vocab(&self) -> Result<SpmVocab, GgufError> {
            SpmVocab::from_gguf(&Gguf::from_bytes(self.writer().bytes(), Path::new("spm.gguf"))?)
        }
    }

    /// Extra pieces with their scores, a text, and the pieces it encodes to.
    type MergeCase<'a> = (&'a [(&'a str, f32)], &'a str, &'a [&'a str]);

    /// Encodes `text` and spells the ids as the vocabulary does.
    fn pieces(v: &SpmVocab, text: &str) -> Vec<String> {
        v.encode(text).iter().map(|&id| v.token(id).unwrap_or("?").to_owned()).collect()
    }

    #[test]
    fn merges_take_the_highest_score_first_and_the_leftmost_on_a_tie() {
        let no_prefix = |normal: &[(&str, f32)]| {
            let mut spec = Spec::new(normal);
            spec.flags.push(("tokenizer.ggml.add_space_prefix", false));
            spec.vocab().unwrap()
        };
        let letters = [("a", -10.0), ("b", -10.0), ("c", -10.0)];
        let cases: [MergeCase; 6] = [
            (&[("ab", -2.0), ("bc", -1.0)], "abc", &["a", "bc"]),
            (&[("ab", -1.0), ("bc", -2.0)], "abc", &["ab", "c"]),
            (&[("ab", -1.0), ("bc", -1.0)], "abc", &["ab", "c"]),
            // Any two adjacent symbols that spell a token merge, whatever the split.
            (&[("ab", -1.0), ("bc", -2.0), ("abc", -3.0)], "abc", &["abc"]),
            (&[("bc", -1.0), ("abc", -3.0)], "abc", &["abc"]),
            // Equal pairs merge left to right.
            (&[("aa", -1.0)], "aaaaa", &["aa", "aa", "a"]),
        ];
        for (extra, text, want) in cases {
            let v = no_prefix(&[&letters[..], extra].concat());
            assert_eq!(pieces(&v, text), *want, "{text:?} with {extra:?}");
        }
    }

    #[test]
    fn spaces_prefix_specials_and_byte_fallback() {
        let mut spec = Spec::new(&[("▁", -1.0), ("a", -2.0), ("b", -3.0), ("▁a", -4.0), ("▁▁", -5.0)]);
        spec = spec.token("[[T]]", 0.0, 4).token("[[T]]]", 0.0, 3);
        let v = spec.vocab().unwrap();
        let cases: [(&str, &[&str]); 11] = [
            ("", &[]),
            ("a", &["▁a"]),
            ("a b", &["▁a", "▁", "b"]),
            // "▁a" outscores "▁▁".
            (" a", &["▁", "▁a"]),
            ("  ", &["▁▁", "▁"]),
            // é is not in the vocabulary: its two UTF-8 bytes.
            ("aé", &["▁a", "<0xC3>", "<0xA9>"]),
            // Special tokens are cut out first; the text after one gets a space too.
            ("<s>a</s>b", &["<s>", "▁a", "</s>", "▁", "b"]),
            ("<s>", &["<s>"]),
            ("<unk>", &["<unk>"]),
            // The longest special token wins where two overlap.
            ("a[[T]]]", &["▁a", "[[T]]]"]),
            ("[[T]][[T]]a", &["[[T]]", "[[T]]", "▁a"]),
        ];
        for (text, want) in cases {
            assert_eq!(pieces(&v, text), *want, "{text:?}");
        }
        assert_eq!(v.rendered(v.token_to_id("▁a").unwrap()), Some(b" a".to_vec()));
        assert_eq!(v.rendered(v.token_to_id("<0x41>").unwrap()), Some(b"A".to_vec()));
        assert_eq!(v.rendered(v.token_to_id("[[T]]").unwrap()), Some(b"[[T]]".to_vec()));
        assert_eq!(v.rendered(1), None, "control tokens render nothing");
        assert!(v.starts_with_prefix_space(v.token_to_id("▁a").unwrap()));
        assert!(!v.starts_with_prefix_space(v.token_to_id("a").unwrap()));
        assert_eq!((v.bos_id(), v.eos_id()), (Some(1), Some(2)), "llama.cpp's defaults");

        spec.flags.push(("tokenizer.ggml.add_space_prefix", false));
        let v = spec.vocab().unwrap();
        assert_eq!(pieces(&v, "a b"), ["a", "▁", "b"]);
        assert_eq!(pieces(&v, "<s>a"), ["<s>", "a"]);
        assert!(!v.starts_with_prefix_space(v.token_to_id("▁a").unwrap()));
    }

    #[test]
    fn bad_metadata_is_a_clear_error() {
        let good = || Spec::new(&[("a", -1.0)]);
        let mut short_scores = good();
        short_scores.scores.pop();
        let mut long_types = good();
        long_types.types.push(1);
        let mut no_byte = good();
        no_byte.tokens[3 + 0x41] = "A-byte".into();
        let mut bad_byte = good();
        bad_byte.types[3] = 6;
        bad_byte.tokens[3] = "<0xZZ>".into();
        bad_byte = bad_byte.token("<0x00>", 0.0, 1);
        let mut nan = good();
        nan.scores[5] = f32::NAN;
        let mut bos = good();
        bos.ids.push(("tokenizer.ggml.bos_token_id", 300));
        let mut unk = good();
        unk.ids.push(("tokenizer.ggml.unknown_token_id", u32::MAX));
        let cases: [(Spec, &str); 7] = [
            (short_scores, "tokenizer.ggml.scores\": 259 scores for 260 tokens"),
            (long_types, "tokenizer.ggml.token_type\": 261 token types for 260 tokens"),
            (no_byte, "no byte token <0x41>"),
            (bad_byte, "token 3 (\"<0xZZ>\") has the byte type but is not <0xXX>"),
            (nan, "score 5 (NaN) is not a number"),
            (bos, "tokenizer.ggml.bos_token_id\": 300 is not a token id (the vocabulary has 260 tokens)"),
            (unk, "4294967295 is not a token id"),
        ];
        for (spec, want) in cases {
            let err = spec.vocab().map(|_| ()).unwrap_err().to_string();
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
        let missing = Writer::new().meta_str("tokenizer.ggml.model", "llama").bytes();
        let err = SpmVocab::from_gguf(&Gguf::from_bytes(missing, Path::new("x.gguf")).unwrap()).unwrap_err();
        assert_eq!(err.to_string(), "metadata key \"tokenizer.ggml.tokens\": missing");
        // A vocabulary whose ids are all valid still loads.
        assert!(good().vocab().is_ok());
    }
}
