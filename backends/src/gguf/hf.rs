//! A GGUF file seen as the Hugging Face checkpoint the executor knows: its metadata as
//! a `config.json`, its tensors under HF names in HF layout, its vocabulary as a
//! `tokenizer.json`. A GGUF file alone is then a complete model.
//!
//! Layout: llama.cpp's converter permutes the rows of a llama model's Q and K
//! projections so that each head's rotary pairs are adjacent (ggml's interleaved rope);
//! the executor ropes the Hugging Face way (pairs `i` and `i + head_dim/2`), so those
//! rows are un-permuted on load. Qwen2 files are written unpermuted (NeoX rope).

use serde_json::json;

use super::{Gguf, GgufError, TensorInfo, Value};
use crate::config::{HfConfig, RopeScaling, TokenIds};

/// Architectures read from GGUF, with their Hugging Face names.
const ARCHES: [(&str, &str); 2] = [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")];

fn meta_err(key: &str, what: impl Into<String>) -> GgufError {
    GgufError::Metadata { key: key.into(), what: what.into() }
}

/// The file's `general.architecture`, if it is one the executor runs.
pub fn architecture(g: &Gguf) -> Result<&'static str, GgufError> {
    let arch = g
        .architecture()
        .ok_or_else(|| meta_err("general.architecture", "missing (the file does not say what model it holds)"))?;
    ARCHES.iter().find(|(name, _)| *name == arch).map(|(name, _)| *name).ok_or_else(|| {
        meta_err(
            "general.architecture",
            format!("{arch:?} is not supported (supported: {})", ARCHES.map(|a| a.0).join(", ")),
        )
    })
}

fn usize_key(g: &Gguf, key: &str) -> Result<Option<usize>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| meta_err(key, format!("{v} is not a non-negative integer"))),
    }
}

fn required(g: &Gguf, key: &str) -> Result<usize, GgufError> {
    usize_key(g, key)?.ok_or_else(|| meta_err(key, "missing"))
}

fn f32_key(g: &Gguf, key: &str) -> Result<Option<f32>, GgufError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(|v| Some(v as f32)).ok_or_else(|| meta_err(key, format!("{v} is not a number"))),
    }
}

/// The model's config, as `config.json` would state it.
pub fn hf_config(g: &Gguf) -> Result<HfConfig, GgufError> {
    let arch = architecture(g)?;
    let hf_arch = ARCHES.iter().find(|(a, _)| *a == arch).map_or("", |(_, hf)| *hf);
    let k = |suffix: &str| format!("{arch}.{suffix}");
    let num_heads = required(g, &k("attention.head_count"))?;
    let hidden = required(g, &k("embedding_length"))?;
    let tokens = g.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len);
    let vocab_size = match (usize_key(g, &k("vocab_size"))?, tokens) {
        (Some(v), _) => v,
        (None, Some(n)) => n,
        (None, None) => match g.tensor("token_embd.weight") {
            Some(t) => t.shape()[0],
            None => return Err(meta_err(&k("vocab_size"), "missing, and the file has no vocabulary")),
        },
    };
    let rope_scaling = match g.get(&k("rope.scaling.type")).and_then(Value::as_str) {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling {
            rope_type: "linear".into(),
            factor: f32_key(g, &k("rope.scaling.factor"))?.unwrap_or(1.0),
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: None,
        }),
        Some(other) => {
            return Err(meta_err(&k("rope.scaling.type"), format!("{other:?} is not supported (supported: linear)")));
        }
    };
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(GgufError::Tensor {
            name: "rope_freqs.weight".into(),
            what: "per-dimension rope frequencies (Llama 3.1-style scaling) are not supported yet".into(),
        });
    }
    let head_dim = usize_key(g, &k("attention.key_length"))?;
    let id = |key: &str| -> Result<Option<u32>, GgufError> {
        usize_key(g, key)?.map(|v| u32::try_from(v).map_err(|_| meta_err(key, format!("{v} is too large")))).transpose()
    };
    Ok(HfConfig {
        architectures: vec![hf_arch.into()],
        hidden_size: hidden,
        intermediate_size: required(g, &k("feed_forward_length"))?,
        num_hidden_layers: required(g, &k("block_count"))?,
        num_attention_heads: num_heads,
        num_key_value_heads: usize_key(g, &k("attention.head_count_kv"))?,
        head_dim,
        vocab_size,
        rms_norm_eps: f32_key(g, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
        rope_theta: f32_key(g, &k("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling,
        max_position_embeddings: usize_key(g, &k("context_length"))?.unwrap_or(2048),
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        attention_bias: Some(g.tensor("blk.0.attn_q.bias").is_some()),
        sliding_window: None,
        use_sliding_window: None,
        hidden_act: Some("silu".into()),
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: id("tokenizer.ggml.eos_token_id")?.map(TokenIds::One),
        torch_dtype: None,
        model_type: Some(arch.into()),
    })
}

/// The Hugging Face name of a GGUF tensor the executor uses; `None` for others.
pub fn hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = tail.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    matches!(kind, "weight" | "bias").then(|| format!("model.layers.{layer}.{hf}.{kind}"))
}

/// The number of heads whose rows of `info` llama.cpp permuted (`None`: not permuted).
pub fn permuted_heads(g: &Gguf, info: &TensorInfo, config: &HfConfig) -> Option<usize> {
    if architecture(g).ok()? != "llama" {
        return None;
    }
    let part = info.name.strip_prefix("blk.")?.split_once('.')?.1;
    match part {
        "attn_q.weight" | "attn_q.bias" => Some(config.num_attention_heads),
        "attn_k.weight" | "attn_k.bias" => Some(config.num_key_value_heads.unwrap_or(config.num_attention_heads)),
        _ => None,
    }
}

/// Undoes llama.cpp's Q/K permutation in place: within each head of `rows / heads` rows,
/// GGUF row `2i + j` is Hugging Face row `j * half + i`. `values` is row-major with
/// `cols` values per row (for a quantized tensor: bytes, `cols` bytes per row).
pub fn unpermute_rows<T: Copy>(values: &mut [T], heads: usize, cols: usize) -> Result<(), String> {
    let rows = values.len() / cols.max(1);
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!("{rows} rows do not split into {heads} heads of an even size"));
    }
    let head = rows / heads;
    let half = head / 2;
    let original = values.to_vec();
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = (h * head + 2 * i + j) * cols;
                let to = (h * head + j * half + i) * cols;
                values[to..to + cols].copy_from_slice(&original[from..from + cols]);
            }
        }
    }
    Ok(())
}

/// The file's vocabulary as a Hugging Face `tokenizer.json`, for `gpt2`-style byte-level
/// BPE vocabularies (`tokenizer.ggml.model = "gpt2"`). `llama` (SentencePiece-style)
/// vocabularies are tokenized by [`super::spm::SpmVocab`] instead.
pub fn tokenizer_json(g: &Gguf) -> Result<String, GgufError> {
    let model = g.get("tokenizer.ggml.model").and_then(Value::as_str).unwrap_or("");
    if model != "gpt2" {
        return Err(meta_err(
            "tokenizer.ggml.model",
            format!(
                "{model:?} vocabularies are not supported yet (supported: gpt2 byte-level BPE, llama SentencePiece)"
            ),
        ));
    }
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| meta_err("tokenizer.ggml.tokens", "missing"))?;
    let types = g.get("tokenizer.ggml.token_type").and_then(Value::as_array).unwrap_or(&[]);
    let merges = g.get("tokenizer.ggml.merges").and_then(Value::as_array).unwrap_or(&[]);
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let t = t.as_str().ok_or_else(|| meta_err("tokenizer.ggml.tokens", format!("token {id} is not a string")))?;
        // 3: control, 4: user-defined (llama.cpp's `llama_token_type`): matched whole.
        let ty = types.get(id).and_then(Value::as_u64).unwrap_or(1);
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == 3,
            }));
        }
        vocab.entry(t.to_owned()).or_insert(json!(id));
    }
    let merges: Vec<&str> = merges.iter().filter_map(Value::as_str).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let pre_tokenizer = match pre {
        "default" | "gpt2" => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
        }
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        ]}),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level,
        ]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level,
        ]}),
        other => {
            return Err(meta_err(
                "tokenizer.ggml.pre",
                format!(
                    "pre-tokenizer {other:?} is not supported (supported: default, gpt2, smollm, llama-bpe, qwen2)"
                ),
            ));
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": pre == "llama-bpe" || pre == "llama3",
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}
