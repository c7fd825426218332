//! The tokenizer the runtime uses: a Hugging Face `tokenizer.json` (plus the optional
//! `tokenizer_config.json` / `generation_config.json`) or a GGUF file's vocabulary, with
//! BOS/EOS handling, the chat template, and an incremental decoder for streaming that
//! never splits a character.

use std::path::{Path, PathBuf};

use tokenizers::{DecoderWrapper, Tokenizer};

use crate::error::{BackendError, Result};
use crate::gguf::spm::SpmVocab;

/// The GPT-2 byte-to-character table of byte-level BPE: printable bytes map to
/// themselves, the others to code points from U+0100 on. Index = byte value.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let code = if printable {
            b as u32
        } else {
            let c = next;
            next += 1;
            c
        };
        // All codes are < 0x200, far from the surrogate range.
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// Where the ids come from.
enum Vocab {
    /// A Hugging Face `tokenizer.json` (a GGUF `gpt2` vocabulary is converted to one).
    Hf(Box<Tokenizer>),
    /// A GGUF SentencePiece-style (`llama`) vocabulary, tokenized as llama.cpp does.
    Spm(Box<SpmVocab>),
}

impl Vocab {
    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Vocab::Hf(t) => t.id_to_token(id),
            Vocab::Spm(v) => v.token(id).map(str::to_owned),
        }
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Vocab::Hf(t) => t.token_to_id(token),
            Vocab::Spm(v) => v.token_to_id(token),
        }
    }
}

/// A loaded tokenizer with the special tokens and chat template of its checkpoint.
pub struct TextTokenizer {
    inner: Vocab,
    path: PathBuf,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    chat_template: Option<String>,
    /// Per-id raw bytes when they are exact (a byte-level or SentencePiece vocabulary:
    /// exact byte streaming); else `None`. `None` entries render nothing.
    token_bytes: Option<Vec<Option<Vec<u8>>>>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish_non_exhaustive()
    }
}

/// `"<s>"` or `{"content": "<s>", ...}` as `tokenizer_config.json` writes special tokens.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content").and_then(|c| c.as_str()).map(str::to_owned),
        _ => None,
    }
}

fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| BackendError::Tokenizer { path: path.to_path_buf(), reason: format!("invalid JSON: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(BackendError::io(path, e)),
    }
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` (required) and `dir/tokenizer_config.json` and
    /// `dir/generation_config.json` (optional: chat template, BOS/EOS).
    /// A GGUF file instead of a directory reads its vocabulary, special tokens and chat
    /// template from its metadata.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if crate::gguf::is_model_file(dir) {
            return Self::from_gguf(dir);
        }
        let path = dir.join("tokenizer.json");
        let tok_err = |reason: String| BackendError::Tokenizer { path: path.clone(), reason };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(tok_err(format!(
                    "file not found; the checkpoint directory {} must contain a Hugging Face tokenizer.json",
                    dir.display()
                )));
            }
            Err(e) => return Err(BackendError::io(&path, e)),
        };
        let inner: Tokenizer =
            text.parse().map_err(|e| tok_err(format!("cannot parse as a Hugging Face tokenizer.json: {e}")))?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional_json(&config_path)?;
        let gen_config = read_optional_json(&dir.join("generation_config.json"))?;

        let lookup = |name: &str, what: &str, at: &Path| -> Result<u32> {
            inner.token_to_id(name).ok_or_else(|| BackendError::Tokenizer {
                path: at.to_path_buf(),
                reason: format!("{what} {name:?} is not in the vocabulary of {}", path.display()),
            })
        };
        let mut bos_id = None;
        let mut eos_ids = Vec::new();
        let mut chat_template = None;
        if let Some(cfg) = &config {
            if let Some(bos) = token_string(cfg.get("bos_token")) {
                bos_id = Some(lookup(&bos, "bos_token", &config_path)?);
            }
            if let Some(eos) = token_string(cfg.get("eos_token")) {
                eos_ids.push(lookup(&eos, "eos_token", &config_path)?);
            }
            chat_template = match cfg.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // The list form: [{"name": "default", "template": ...}, ...].
                Some(serde_json::Value::Array(items)) => items
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| items.first())
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_owned),
                _ => None,
            };
        }
        if let Some(eos) = gen_config.as_ref().and_then(|g| g.get("eos_token_id")) {
            let ids: Vec<u64> = match eos {
                serde_json::Value::Number(n) => n.as_u64().into_iter().collect(),
                serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_u64()).collect(),
                _ => Vec::new(),
            };
            for id in ids {
                if let Ok(id) = u32::try_from(id)
                    && !eos_ids.contains(&id)
                {
                    eos_ids.push(id);
                }
            }
        }

        Ok(Self::assemble(Vocab::Hf(Box::new(inner)), path, bos_id, eos_ids, chat_template))
    }

    /// The tokenizer of a GGUF file: `tokenizer.ggml.*` and `tokenizer.chat_template`.
    /// BOS is added only when the file asks for it (`tokenizer.ggml.add_bos_token`,
    /// default true, as llama.cpp reads it). A `llama` (SentencePiece-style) vocabulary
    /// is tokenized by [`SpmVocab`], the others through a `tokenizer.json` built from
    /// the metadata.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        use crate::gguf::{Gguf, Value, hf};
        let g = Gguf::open(path)?;
        let tok_err = |reason: String| BackendError::Tokenizer { path: path.to_path_buf(), reason };
        let key_id = |key: &str| g.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok());
        let (bos, eos, inner) = if g.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama") {
            let vocab = SpmVocab::from_gguf(&g).map_err(|e| tok_err(e.to_string()))?;
            (vocab.bos_id(), vocab.eos_id(), Vocab::Spm(Box::new(vocab)))
        } else {
            let json = hf::tokenizer_json(&g).map_err(|e| tok_err(e.to_string()))?;
            let inner: Tokenizer = json.parse().map_err(|e| tok_err(format!("cannot build the vocabulary: {e}")))?;
            let known = |id: Option<u32>| id.filter(|&v| inner.id_to_token(v).is_some());
            (
                known(key_id("tokenizer.ggml.bos_token_id")),
                known(key_id("tokenizer.ggml.eos_token_id")),
                Vocab::Hf(Box::new(inner)),
            )
        };
        let add_bos = g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(true);
        let bos_id = bos.filter(|_| add_bos);
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        if let Some(eot) = key_id("tokenizer.ggml.eot_token_id").filter(|&v| inner.id_to_token(v).is_some())
            && !eos_ids.contains(&eot)
        {
            eos_ids.push(eot);
        }
        let chat_template = g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_owned);
        Ok(Self::assemble(inner, path.to_path_buf(), bos_id, eos_ids, chat_template))
    }

    fn assemble(
        inner: Vocab,
        path: PathBuf,
        bos_id: Option<u32>,
        eos_ids: Vec<u32>,
        chat_template: Option<String>,
    ) -> Self {
        let token_bytes = match &inner {
            Vocab::Hf(hf) => Self::byte_level_table(hf),
            Vocab::Spm(v) => Some((0..v.len() as u32).map(|id| v.rendered(id)).collect()),
        };
        TextTokenizer { inner, path, bos_id, eos_ids, chat_template, token_bytes }
    }

    /// Per-id raw bytes of a byte-level BPE vocabulary; `None` for other decoders.
    fn byte_level_table(inner: &Tokenizer) -> Option<Vec<Option<Vec<u8>>>> {
        matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))).then(|| {
            let table = byte_to_char_table();
            let mut char_to_byte = std::collections::HashMap::with_capacity(256);
            for (b, c) in table.iter().enumerate() {
                char_to_byte.insert(*c, b as u8);
            }
            let n = inner.get_vocab_size(true);
            let mut max_id = n;
            for id in inner.get_added_vocabulary().get_added_tokens_decoder().keys() {
                max_id = max_id.max(*id as usize + 1);
            }
            (0..max_id)
                .map(|id| {
                    // Same rule as the ByteLevel decoder: map every char back to its byte,
                    // or take the token's UTF-8 as is if any char is outside the table.
                    inner.id_to_token(id as u32).map(|t| {
                        t.chars()
                            .map(|c| char_to_byte.get(&c).copied())
                            .collect::<Option<Vec<u8>>>()
                            .unwrap_or_else(|| t.as_bytes().to_vec())
                    })
                })
                .collect()
        })
    }

    fn err(&self, reason: String) -> BackendError {
        BackendError::Tokenizer { path: self.path.clone(), reason }
    }

    /// Token ids of `text`. Special-token strings in `text` (as a rendered chat template
    /// has) become their ids. With `add_bos`, the BOS id is prepended unless the text
    /// already starts with it or the tokenizer has none.
    ///
    /// A SentencePiece vocabulary puts a space before the text and after each special
    /// token, as llama.cpp does (its ids equal llama.cpp's `llama_tokenize` with
    /// `parse_special`, except that a text starting with BOS gets no second one).
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let ids = match &self.inner {
            Vocab::Hf(t) => {
                t.encode(text, false).map_err(|e| self.err(format!("cannot encode text: {e}")))?.get_ids().to_vec()
            }
            Vocab::Spm(v) => v.encode(text),
        };
        match self.bos_id {
            Some(bos) if add_bos && ids.first() != Some(&bos) => {
                let mut out = Vec::with_capacity(ids.len() + 1);
                out.push(bos);
                out.extend_from_slice(&ids);
                Ok(out)
            }
            _ => Ok(ids),
        }
    }

    /// The text of `ids`, special tokens included (so `decode(encode(s)) == s`). Ids the
    /// tokenizer does not know (the model's vocabulary may be larger) decode to "".
    /// A SentencePiece vocabulary renders no control tokens and drops the one space
    /// its encoding put before the text (SentencePiece's and Hugging Face's decode).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(table) = &self.token_bytes {
            let mut bytes = Vec::new();
            let mut at_start = true;
            for &id in ids {
                self.render(table, id, &mut at_start, &mut bytes);
            }
            return Ok(String::from_utf8_lossy(&bytes).into_owned());
        }
        let Vocab::Hf(inner) = &self.inner else {
            return Err(self.err("a SentencePiece vocabulary without its byte table".into()));
        };
        let known: Vec<u32> = ids.iter().copied().filter(|&id| inner.id_to_token(id).is_some()).collect();
        inner.decode(&known, false).map_err(|e| self.err(format!("cannot decode ids: {e}")))
    }

    /// Appends the bytes of `id`; `at_start` is true until a token has rendered something
    /// (a SentencePiece vocabulary drops the first one's prefix space).
    fn render(&self, table: &[Option<Vec<u8>>], id: u32, at_start: &mut bool, out: &mut Vec<u8>) {
        let Some(Some(bytes)) = table.get(id as usize) else {
            return;
        };
        let skip = match &self.inner {
            Vocab::Spm(v) if *at_start && v.starts_with_prefix_space(id) => 1,
            _ => 0,
        };
        *at_start &= bytes.is_empty();
        out.extend_from_slice(&bytes[skip.min(bytes.len())..]);
    }

    /// The most bytes of text one token can stand for: its raw bytes for a byte-level
    /// vocabulary; otherwise its spelling's length in UTF-8, which is never shorter than
    /// the text it decodes to (`▁` is 3 bytes for 1 space, `<0x41>` 6 for 1 byte).
    pub fn max_token_bytes(&self) -> usize {
        let spelled = match &self.inner {
            Vocab::Hf(t) => t.get_vocab(true).keys().map(String::len).max(),
            Vocab::Spm(v) => (0..v.len() as u32).filter_map(|id| v.token(id)).map(str::len).max(),
        }
        .unwrap_or(1);
        let raw = self.token_bytes.as_ref().and_then(|t| t.iter().flatten().map(Vec::len).max()).unwrap_or(0);
        spelled.max(raw).max(1)
    }

    /// Every id's bytes as a constrained-decoding library reads a vocabulary: the raw
    /// bytes of a text token, and for a special token (`<|im_end|>`, a SentencePiece
    /// control token) its spelling after the marker byte 0xFF, so no grammar can spell
    /// it out of text. `None` when the vocabulary's tokens have no exact bytes (neither
    /// byte-level nor SentencePiece).
    pub fn grammar_vocab(&self) -> Option<Vec<Vec<u8>>> {
        let table = self.token_bytes.as_ref()?;
        let special = |id: u32| match &self.inner {
            Vocab::Hf(t) => t.get_added_vocabulary().get_added_tokens_decoder().get(&id).is_some_and(|a| a.special),
            Vocab::Spm(v) => v.kind(id) == Some(crate::gguf::spm::TokenKind::Control),
        };
        let marked = |id: u32, bytes: &[u8]| {
            let mut out = Vec::with_capacity(bytes.len() + 1);
            out.push(0xFF);
            out.extend_from_slice(self.id_to_token(id).as_deref().map_or(bytes, str::as_bytes));
            out
        };
        Some(
            table
                .iter()
                .enumerate()
                .map(|(id, bytes)| {
                    let bytes = bytes.as_deref().unwrap_or_default();
                    if special(id as u32) { marked(id as u32, bytes) } else { bytes.to_vec() }
                })
                .collect(),
        )
    }

    /// Number of tokens including added/special tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Vocab::Hf(t) => t.get_vocab_size(true),
            Vocab::Spm(v) => v.len(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation: `tokenizer_config.json`'s `eos_token`, then the
    /// `eos_token_id`s of `generation_config.json` (deduplicated, in that order).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// The Jinja chat template of `tokenizer_config.json`, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token string (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id as the vocabulary spells it (e.g. `<|begin_of_text|>`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// An incremental decoder for streaming output.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            pending: Vec::new(),
            at_start: true,
        }
    }
}

/// Incremental detokenisation: `push` returns only newly completed text, never half of
/// a multi-byte character, and all pushes plus `finish` concatenate to `decode(ids)`.
pub struct StreamDecoder<'a> {
    tok: &'a TextTokenizer,
    /// Generic path: all ids so far and the token offsets of the last emitted window.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Byte path: bytes not yet emitted (an incomplete UTF-8 sequence).
    pending: Vec<u8>,
    /// Byte path: no token has rendered anything yet.
    at_start: bool,
}

impl std::fmt::Debug for StreamDecoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDecoder").field("ids", &self.ids.len()).field("pending", &self.pending).finish()
    }
}

/// Splits `bytes` into the text that is final and the incomplete UTF-8 tail (at most 3
/// bytes that a following byte could still complete). Invalid bytes become U+FFFD
/// exactly as `String::from_utf8_lossy` does.
fn take_complete(bytes: &[u8], at_end: bool) -> (String, usize) {
    let mut out = String::new();
    let mut consumed = 0;
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        consumed += chunk.valid().len();
        let invalid = chunk.invalid();
        if invalid.is_empty() {
            continue;
        }
        let is_tail = consumed + invalid.len() == bytes.len();
        if is_tail && !at_end && std::str::from_utf8(invalid).err().is_some_and(|e| e.error_len().is_none()) {
            // A valid prefix of a character: wait for more bytes.
            break;
        }
        out.push(char::REPLACEMENT_CHARACTER);
        consumed += invalid.len();
    }
    (out, consumed)
}

impl StreamDecoder<'_> {
    /// Adds one generated id; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        if let Some(table) = &self.tok.token_bytes {
            self.tok.render(table, id, &mut self.at_start, &mut self.pending);
            let (text, consumed) = take_complete(&self.pending, false);
            self.pending.drain(..consumed);
            return Ok((!text.is_empty()).then_some(text));
        }
        // Generic path (e.g. SentencePiece-style decoders): decode a window that starts a
        // few tokens back so context-dependent spacing is right, emit the new suffix once
        // it no longer ends in an incomplete character.
        self.ids.push(id);
        let prefix = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with(char::REPLACEMENT_CHARACTER) && full.starts_with(&prefix) {
            let new = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(Some(new));
        }
        Ok(None)
    }

    /// Flushes whatever is held back (an incomplete character becomes U+FFFD, as in
    /// `decode`). Call once after the last `push`.
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.tok.token_bytes.is_some() {
            let (text, _) = take_complete(&self.pending, true);
            self.pending.clear();
            return Ok((!text.is_empty()).then_some(text));
        }
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let prefix = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let new = full.strip_prefix(prefix.as_str()).unwrap_or(full.as_str());
        Ok((!new.is_empty()).then(|| new.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{self, Preset, SynthArch, SynthSpec};

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tessera-tok-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A directory with only the tokenizer files of the tiny preset (no weights).
    fn tiny_tokenizer_dir(tag: &str) -> PathBuf {
        let d = tmpdir(tag);
        let spec = SynthSpec { preset: Preset::Tiny, arch: SynthArch::Llama, seed: 1, dtype: None, shards: 1 };
        synth::write_tokenizer_files(&d, &synth::hf_config(&spec)).unwrap();
        d
    }

    const SAMPLES: &[&str] = &[
        "",
        "Hello, world!",
        "  leading and   internal   spaces  ",
        "line one\nline two\n\n\ttabbed\r\n",
        "Café naïve résumé Ångström",
        "你好，世界。こんにちは 안녕하세요",
        "emoji 🙂👍🚀 and flags 🇫🇷 and zwj 👩‍👩‍👧",
        "<|im_start|>user\nhi<|im_end|>\n",
        "\u{0}\u{7f}\u{80}\u{ffff}\u{10ffff}",
    ];

    #[test]
    fn round_trips_every_sample() {
        let d = tiny_tokenizer_dir("rt");
        let tok = TextTokenizer::from_dir(&d).unwrap();
        assert!(tok.vocab_size() <= 1024 && tok.vocab_size() > 300, "{}", tok.vocab_size());
        for s in SAMPLES {
            let ids = tok.encode(s, false).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), *s, "ids {ids:?}");
        }
        // Merges do compress English.
        let text = "The tortoise and the hare ran a race.";
        assert!(tok.encode(text, false).unwrap().len() < text.len() / 2);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn specials_bos_eos_and_template() {
        let d = tiny_tokenizer_dir("sp");
        let tok = TextTokenizer::from_dir(&d).unwrap();
        let bos = tok.bos_id().unwrap();
        assert_eq!(tok.token_to_id("<|begin_of_text|>"), Some(bos));
        let im_end = tok.token_to_id("<|im_end|>").unwrap();
        let eot = tok.token_to_id("<|end_of_text|>").unwrap();
        assert_eq!(tok.eos_ids(), vec![eot, im_end]);
        let ids = tok.encode("hi", true).unwrap();
        assert_eq!(ids[0], bos);
        // No double BOS when the text already has it.
        let ids2 = tok.encode("<|begin_of_text|>hi", true).unwrap();
        assert_eq!(ids, ids2);
        let chat = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(chat[0], tok.token_to_id("<|im_start|>").unwrap());
        assert_eq!(*chat.last().unwrap(), im_end);
        assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
        // Ids past the tokenizer's vocabulary decode to nothing.
        assert_eq!(tok.decode(&[u32::MAX, 5000, 72]).unwrap(), "H");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn stream_decode_equals_full_decode() {
        let d = tiny_tokenizer_dir("st");
        let tok = TextTokenizer::from_dir(&d).unwrap();
        for s in SAMPLES {
            let ids = tok.encode(s, true).unwrap();
            let mut dec = tok.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                if let Some(piece) = dec.push(id).unwrap() {
                    assert!(!piece.contains('\u{fffd}') || s.contains('\u{fffd}'), "split char in {piece:?}");
                    out.push_str(&piece);
                }
            }
            if let Some(rest) = dec.finish().unwrap() {
                out.push_str(&rest);
            }
            assert_eq!(out, tok.decode(&ids).unwrap());
        }
        // Arbitrary (random-model) id sequences, including lone continuation bytes and
        // ids beyond the vocabulary: still equal to the full decode.
        let mut x = 12345u64;
        for _ in 0..50 {
            let ids: Vec<u32> = (0..40)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 33) % 1100) as u32
                })
                .collect();
            let mut dec = tok.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&dec.push(id).unwrap().unwrap_or_default());
            }
            out.push_str(&dec.finish().unwrap().unwrap_or_default());
            assert_eq!(out, tok.decode(&ids).unwrap(), "{ids:?}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn multibyte_char_is_held_until_complete() {
        let d = tiny_tokenizer_dir("mb");
        let tok = TextTokenizer::from_dir(&d).unwrap();
        // Byte tokens: ids 0..256 are the raw bytes. "€" = E2 82 AC.
        let mut dec = tok.stream_decoder();
        assert_eq!(dec.push(0xE2).unwrap(), None);
        assert_eq!(dec.push(0x82).unwrap(), None);
        assert_eq!(dec.push(0xAC).unwrap().as_deref(), Some("€"));
        assert_eq!(dec.push(0xE2).unwrap(), None);
        assert_eq!(dec.finish().unwrap().as_deref(), Some("\u{fffd}"));
        assert_eq!(tok.decode(&[0xE2, 0x82, 0xAC, 0xE2]).unwrap(), "€\u{fffd}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn generic_decoder_path_streams_too() {
        // A tokenizer.json without a byte-level decoder takes the generic path.
        let d = tiny_tokenizer_dir("gen");
        let path = d.join("tokenizer.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}]});
        std::fs::write(&path, v.to_string()).unwrap();
        let tok = TextTokenizer::from_dir(&d).unwrap();
        assert!(tok.token_bytes.is_none());
        for s in SAMPLES {
            let ids = tok.encode(s, false).unwrap();
            assert_eq!(tok.decode(&ids).unwrap(), *s);
            let mut dec = tok.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&dec.push(id).unwrap().unwrap_or_default());
            }
            out.push_str(&dec.finish().unwrap().unwrap_or_default());
            assert_eq!(out, *s);
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_or_broken_tokenizer_is_a_clear_error() {
        let d = tmpdir("missing");
        let err = TextTokenizer::from_dir(&d).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json") && err.contains("file not found"), "{err}");
        std::fs::write(d.join("tokenizer.json"), "{not json").unwrap();
        let err = TextTokenizer::from_dir(&d).unwrap_err().to_string();
        assert!(err.contains("cannot parse as a Hugging Face tokenizer.json"), "{err}");
        let _ = std::fs::remove_dir_all(&d);

        let d = tiny_tokenizer_dir("badcfg");
        std::fs::write(d.join("tokenizer_config.json"), r#"{"eos_token": "<nope>"}"#).unwrap();
        let err = TextTokenizer::from_dir(&d).unwrap_err().to_string();
        assert!(err.contains("eos_token \"<nope>\" is not in the vocabulary"), "{err}");
        // tokenizer_config.json is optional.
        std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();
        std::fs::remove_file(d.join("generation_config.json")).unwrap();
        let tok = TextTokenizer::from_dir(&d).unwrap();
        assert_eq!((tok.bos_id(), tok.eos_ids(), tok.chat_template()), (None, vec![], None));
        let _ = std::fs::remove_dir_all(&d);
    }
}
