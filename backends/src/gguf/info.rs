//! What a GGUF file holds, for `tessera model info`: architecture and shapes, tensors by
//! type with their bytes, the vocabulary and the chat template.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::{Gguf, GgufError, Value, hf};
use crate::config::ModelConfig;
use crate::error::BackendError;

#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    pub path: String,
    pub gguf_version: u32,
    pub architecture: String,
    pub name: Option<String>,
    pub layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub tied_embeddings: bool,
    pub parameters: u64,
    pub tensor_bytes: u64,
    /// Per ggml type: tensors, values, bytes.
    pub tensor_types: BTreeMap<String, TypeCount>,
    pub tokenizer: TokenizerInfo,
    pub chat_template: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TypeCount {
    pub tensors: usize,
    pub values: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizerInfo {
    pub model: Option<String>,
    /// How Tessera tokenizes it: "byte-level BPE", "SentencePiece", or "unsupported".
    pub kind: &'static str,
    pub pre: Option<String>,
    pub tokens: usize,
    pub merges: usize,
    pub bos: Option<u64>,
    pub eos: Option<u64>,
    pub add_bos: Option<bool>,
}

/// Describes the GGUF file `g`.
pub fn describe(g: &Gguf) -> Result<ModelInfo, BackendError> {
    let fail = |reason: GgufError| BackendError::Gguf { path: g.path().to_owned(), reason };
    let hf = hf::hf_config(g).map_err(fail)?;
    let config = ModelConfig::from_hf(&hf, g.path())?;
    let mut tensor_types: BTreeMap<String, TypeCount> = BTreeMap::new();
    for t in g.tensors() {
        let c = tensor_types.entry(t.ty.name().to_owned()).or_default();
        c.tensors += 1;
        c.values += t.elements();
        c.bytes += t.size;
    }
    let str_key = |k: &str| g.get(k).and_then(Value::as_str).map(str::to_owned);
    let len_key = |k: &str| g.get(k).and_then(Value::as_array).map_or(0, <[Value]>::len);
    let model = str_key("tokenizer.ggml.model");
    let kind = match model.as_deref() {
        Some("gpt2") => "byte-level BPE",
        Some("llama") => "SentencePiece",
        _ => "unsupported",
    };
    Ok(ModelInfo {
        path: g.path().display().to_string(),
        gguf_version: g.version,
        architecture: g.architecture().unwrap_or_default().to_owned(),
        name: str_key("general.name"),
        layers: config.num_layers,
        hidden_size: config.hidden_size,
        intermediate_size: config.intermediate_size,
        heads: config.num_heads,
        kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        vocab_size: config.vocab_size,
        context: config.max_context,
        rope_theta: config.rope_theta,
        tied_embeddings: config.tie_word_embeddings,
        parameters: tensor_types.values().map(|c| c.values).sum(),
        tensor_bytes: tensor_types.values().map(|c| c.bytes).sum(),
        tensor_types,
        tokenizer: TokenizerInfo {
            model,
            kind,
            pre: str_key("tokenizer.ggml.pre"),
            tokens: len_key("tokenizer.ggml.tokens"),
            merges: len_key("tokenizer.ggml.merges"),
            bos: g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64),
            eos: g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64),
            add_bos: g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool),
        },
        chat_template: str_key("tokenizer.chat_template"),
    })
}

impl ModelInfo {
    /// The human-readable summary.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let _ = writeln!(s, "{} (GGUF v{})", self.path, self.gguf_version);
        let _ = writeln!(s, "  name:          {}", self.name.as_deref().unwrap_or("-"));
        let _ = writeln!(
            s,
            "  architecture:  {}: {} layers, hidden {}, FFN {}, {} heads / {} KV heads of {}, vocab {}, context {}, rope base {}{}",
            self.architecture,
            self.layers,
            self.hidden_size,
            self.intermediate_size,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.vocab_size,
            self.context,
            self.rope_theta,
            if self.tied_embeddings { ", tied embeddings" } else { "" }
        );
        let _ = writeln!(
            s,
            "  weights:       {:.1}M parameters in {:.1} MiB",
            self.parameters as f64 / 1e6,
            mib(self.tensor_bytes)
        );
        for (ty, c) in &self.tensor_types {
            let _ = writeln!(
                s,
                "    {ty:<6} {:>4} tensors {:>12} values {:>9.1} MiB ({:.2} bits/value)",
                c.tensors,
                c.values,
                mib(c.bytes),
                c.bytes as f64 * 8.0 / c.values.max(1) as f64
            );
        }
        let t = &self.tokenizer;
        let _ = writeln!(
            s,
            "  tokenizer:     {} ({}, pre-tokenizer {}), {} tokens, {} merges, bos {}, eos {}, add bos {}",
            t.model.as_deref().unwrap_or("-"),
            t.kind,
            t.pre.as_deref().unwrap_or("-"),
            t.tokens,
            t.merges,
            t.bos.map_or("-".into(), |v| v.to_string()),
            t.eos.map_or("-".into(), |v| v.to_string()),
            t.add_bos.map_or("-".into(), |v| v.to_string()),
        );
        match &self.chat_template {
            Some(tpl) => {
                let _ = writeln!(s, "  chat template: {} bytes", tpl.len());
                for line in tpl.lines().take(12) {
                    let _ = writeln!(s, "    {line}");
                }
            }
            None => {
                let _ = writeln!(s, "  chat template: none");
            }
        }
        s
    }
}
