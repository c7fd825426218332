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
use crate::dtype::GgmlTypeExt;

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
    let head_dim = usize_key(g, &k("attention.key_length"))?;
    let rope_theta = f32_key(g, &k("rope.freq_base"))?.unwrap_or(10_000.0);
    let rope_scaling = match g.tensor("rope_freqs.weight") {
        None => rope_scaling,
        Some(info) => {
            let fail = |what: String| GgufError::Tensor { name: "rope_freqs.weight".into(), what };
            let dim = head_dim.unwrap_or(hidden / num_heads.max(1));
            if info.elements() != (dim / 2) as u64 || info.ty.float().is_none() {
                return Err(fail(format!(
                    "expected {} float values (head_dim / 2), found {} of {}",
                    dim / 2,
                    info.elements(),
                    info.ty
                )));
            }
            llama3_from_rope_factors(&g.tensor_f32(info), rope_theta, dim).map_err(fail)?
        }
    };
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
        rope_theta,
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

/// Llama 3's rope scaling from the per-dimension factors llama.cpp's converter stores in
/// `rope_freqs.weight` (frequency `i` is divided by `factors[i]`): `factor` is the
/// largest, and the dimensions between the unscaled and the fully scaled ones lie on
/// the line `s = (old / wavelength - low) / (high - low)` that Llama 3's
/// `_compute_llama3_parameters` interpolates along. Only the ratios of `old`, `low` and
/// `high` shape the factors, so `old` is taken as 8192 (Llama 3.1's) and the other two
/// fitted. The result is checked by recomputing every factor; anything else is refused.
pub fn llama3_from_rope_factors(factors: &[f32], theta: f32, head_dim: usize) -> Result<Option<RopeScaling>, String> {
    const OLD: f32 = 8192.0;
    let factor = factors.iter().copied().fold(f32::NAN, f32::max);
    if !(factor.is_finite() && factors.iter().all(|&r| r.is_finite() && r >= 1.0 - 1e-6)) {
        return Err("rope factors must be finite and at least 1".into());
    }
    if factor <= 1.0 + 1e-6 {
        return Ok(None);
    }
    let wavelength = |i: usize| 2.0 * std::f64::consts::PI * (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
    let near = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b;
    // s of each dimension strictly between the two plateaus, against 1 / wavelength.
    let mut points = Vec::new();
    for (i, &r) in factors.iter().enumerate() {
        if !near(r, 1.0) && !near(r, factor) {
            let s = (1.0 / r as f64 - 1.0 / factor as f64) / (1.0 - 1.0 / factor as f64);
            points.push((1.0 / wavelength(i), s));
        }
    }
    // s = a / wavelength + b, so that s = 0 at old / low and s = 1 at old / high.
    let (a, b) = if points.len() >= 2 {
        let n = points.len() as f64;
        let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let a = sxy / sxx;
        (a, my - a * mx)
    } else {
        // No slope to fit: put s = 0 and s = 1 just inside the plateaus' last dimensions.
        let last_unscaled = factors.iter().rposition(|&r| near(r, 1.0));
        let first_scaled = factors.iter().position(|&r| near(r, factor));
        let (Some(hi_i), Some(lo_i)) = (last_unscaled, first_scaled) else {
            return Err("rope factors have no unscaled or no fully scaled dimension".into());
        };
        let (x1, x0) = (1.0 / wavelength(hi_i) * 0.999, 1.0 / wavelength(lo_i) * 1.001);
        let a = 1.0 / (x1 - x0);
        (a, -a * x0)
    };
    let span = OLD as f64 / a;
    let low = -b * span;
    let high = low + span;
    let scaling = RopeScaling {
        rope_type: "llama3".into(),
        factor,
        low_freq_factor: low as f32,
        high_freq_factor: high as f32,
        original_max_position_embeddings: Some(OLD as u32),
    };
    if !(a.is_finite() && a > 0.0 && low > 0.0 && high > low) {
        return Err(format!("rope factors {factors:?} do not follow Llama 3's scaling"));
    }
    // Every factor as the kernels will compute it.
    for (i, &r) in factors.iter().enumerate() {
        let wl = wavelength(i) as f32;
        let inv = if wl < OLD / high as f32 {
            1.0
        } else if wl > OLD / low as f32 {
            1.0 / factor
        } else {
            let s = (OLD / wl - low as f32) / (high as f32 - low as f32);
            (1.0 - s) / factor + s
        };
        if (1.0 / inv - r).abs() > 2e-3 * r {
            return Err(format!(
                "rope factor {i} is {r} but Llama 3's scaling that fits the others gives {}: not Llama 3's scaling",
                1.0 / inv
            ));
        }
    }
    Ok(Some(scaling))
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
        // llama.cpp names the GPT-2 regex `gpt-2`; `gpt2` is kept for files written that way.
        "default" | "gpt2" | "gpt-2" => {
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
                    "pre-tokenizer {other:?} is not supported (supported: default, gpt2, gpt-2, smollm, llama-bpe, qwen2)"
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
