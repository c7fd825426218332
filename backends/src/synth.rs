//! Deterministic random-weight checkpoints in the Hugging Face Llama/Qwen2 layout
//! (`config.json`, safetensors weights, optionally sharded, and a trained byte-level BPE
//! tokenizer), so the runtime can be tested and benchmarked without downloading a model.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::json;

use crate::config::{HfConfig, RopeScaling, TokenIds};
use crate::dtype::{DType, DTypeExt};
use crate::error::{BackendError, Result};
use crate::tokenizer::byte_to_char_table;

/// Size class of a synthetic model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// ~1 M params, a few MB: unit tests.
    Tiny,
    /// ~6 M params, tens of MB: integration tests.
    Small,
    /// ~0.92 B params shaped like Llama-3.2-1B: benchmarks.
    Bench,
}

/// Which Hugging Face architecture the checkpoint claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthArch {
    Llama,
    Qwen2,
}

macro_rules! named_enum {
    ($ty:ident, $what:literal, $($variant:ident => $name:literal),+) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                let lower = s.to_ascii_lowercase();
                $ty::ALL.iter().copied().find(|v| v.name() == lower).ok_or_else(|| {
                    let names: Vec<&str> = $ty::ALL.iter().map(|v| v.name()).collect();
                    format!("unknown {} {s:?} (expected one of: {})", $what, names.join(", "))
                })
            }
        }
    };
}

named_enum!(Preset, "preset", Tiny => "tiny", Small => "small", Bench => "bench");
named_enum!(SynthArch, "architecture", Llama => "llama", Qwen2 => "qwen2");

/// What to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthSpec {
    pub preset: Preset,
    pub arch: SynthArch,
    pub seed: u64,
    /// `None`: the preset's default (f32 for tiny/small, f16 for bench).
    pub dtype: Option<DType>,
    /// 1: `model.safetensors`; N > 1: `model-0000i-of-0000N.safetensors` + index.
    pub shards: usize,
}

impl SynthSpec {
    pub fn new(preset: Preset, arch: SynthArch) -> Self {
        SynthSpec { preset, arch, seed: 0, dtype: None, shards: 1 }
    }

    pub fn resolved_dtype(&self) -> DType {
        self.dtype.unwrap_or(match self.preset {
            Preset::Tiny | Preset::Small => DType::F32,
            Preset::Bench => DType::F16,
        })
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    pub dir: PathBuf,
    pub params: u64,
    /// All files written (weights, JSON, tokenizer).
    pub bytes_written: u64,
    pub config: HfConfig,
}

// ---------------------------------------------------------------------------------------
// Configs

struct Dims {
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    max_pos: usize,
}

fn dims(preset: Preset) -> Dims {
    match preset {
        Preset::Tiny => {
            Dims { hidden: 128, inter: 352, layers: 4, heads: 4, kv_heads: 2, head_dim: 32, vocab: 1024, max_pos: 2048 }
        }
        Preset::Small => {
            Dims { hidden: 256, inter: 704, layers: 6, heads: 8, kv_heads: 2, head_dim: 32, vocab: 4096, max_pos: 4096 }
        }
        Preset::Bench => Dims {
            hidden: 2048,
            inter: 8192,
            layers: 14,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            vocab: 32768,
            max_pos: 8192,
        },
    }
}

const BOS: &str = "<|begin_of_text|>";
const EOT: &str = "<|end_of_text|>";
const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";
const SPECIALS: [&str; 4] = [BOS, EOT, IM_START, IM_END];

/// Qwen2's ChatML template.
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The `config.json` of `spec`.
pub fn hf_config(spec: &SynthSpec) -> HfConfig {
    let d = dims(spec.preset);
    let bpe = trained_bpe(d.vocab);
    let special = |name: &str| bpe.special_id(name);
    let (arch_name, model_type, tied, eps, theta, rope_scaling) = match spec.arch {
        SynthArch::Qwen2 => ("Qwen2ForCausalLM", "qwen2", true, 1e-6, 1_000_000.0, None),
        SynthArch::Llama => match spec.preset {
            Preset::Bench => (
                "LlamaForCausalLM",
                "llama",
                true,
                1e-5,
                500_000.0,
                Some(RopeScaling {
                    rope_type: "llama3".into(),
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: Some(8192),
                }),
            ),
            Preset::Tiny | Preset::Small => ("LlamaForCausalLM", "llama", false, 1e-5, 10_000.0, None),
        },
    };
    HfConfig {
        architectures: vec![arch_name.to_owned()],
        hidden_size: d.hidden,
        intermediate_size: d.inter,
        num_hidden_layers: d.layers,
        num_attention_heads: d.heads,
        num_key_value_heads: Some(d.kv_heads),
        head_dim: Some(d.head_dim),
        vocab_size: d.vocab,
        rms_norm_eps: eps,
        rope_theta: theta,
        rope_scaling,
        max_position_embeddings: d.max_pos,
        tie_word_embeddings: tied,
        attention_bias: match spec.arch {
            SynthArch::Llama => Some(false),
            SynthArch::Qwen2 => None,
        },
        sliding_window: None,
        use_sliding_window: None,
        hidden_act: Some("silu".into()),
        bos_token_id: Some(special(BOS)),
        eos_token_id: Some(TokenIds::Many(vec![special(EOT), special(IM_END)])),
        torch_dtype: Some(spec.resolved_dtype().torch_name().to_owned()),
        model_type: Some(model_type.to_owned()),
    }
}

// ---------------------------------------------------------------------------------------
// Tensors

#[derive(Debug, Clone, Copy)]
enum Init {
    /// N(0, std²).
    Normal(f32),
    /// 1 + N(0, 0.05²): RMSNorm weights.
    Norm,
}

struct TensorSpec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

impl TensorSpec {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Target std of the final logits (the LM head sees an RMS-normalised hidden state).
const LOGIT_STD: f32 = 4.0;
/// E[silu(g)²] for g ~ N(0,1) is ≈ 0.354; this gain makes the MLP output RMS ≈ 1.
const MLP_DOWN_GAIN: f32 = 1.68;

/// Every tensor of the checkpoint, in model order, with its initialisation.
///
/// Scaling: each sublayer reads an RMS-normalised input (RMS ≈ 1), its input
/// projections have std 1/√fan_in so q/k/v/gate/up have RMS ≈ 1 (attention scores of
/// std ≈ 1: neither uniform nor one-hot), and the output projections are scaled so each
/// sublayer adds RMS ≈ 1 to the residual stream (which thus grows like √(2·layers), no
/// explosion, and no layer is negligible). The LM head has std LOGIT_STD/√hidden so the
/// logits have std ≈ LOGIT_STD. Untied embeddings have std 1; tied ones share the LM head's.
fn tensor_specs(cfg: &HfConfig) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let inter = cfg.intermediate_size;
    let hd = cfg.head_dim.unwrap_or(h / cfg.num_attention_heads);
    let q = cfg.num_attention_heads * hd;
    let kv = cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads) * hd;
    let qkv_bias = cfg.architectures.first().map(String::as_str) == Some("Qwen2ForCausalLM");
    let inv_sqrt = |n: usize| 1.0 / (n as f32).sqrt();
    let head_std = LOGIT_STD * inv_sqrt(h);

    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, init: Init| out.push(TensorSpec { name, shape, init });
    let embed_std = if cfg.tie_word_embeddings { head_std } else { 1.0 };
    add("model.embed_tokens.weight".into(), vec![cfg.vocab_size, h], Init::Normal(embed_std));
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm.weight"), vec![h], Init::Norm);
        add(format!("{p}.self_attn.q_proj.weight"), vec![q, h], Init::Normal(inv_sqrt(h)));
        if qkv_bias {
            add(format!("{p}.self_attn.q_proj.bias"), vec![q], Init::Normal(0.02));
        }
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], Init::Normal(inv_sqrt(h)));
        if qkv_bias {
            add(format!("{p}.self_attn.k_proj.bias"), vec![kv], Init::Normal(0.02));
        }
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], Init::Normal(inv_sqrt(h)));
        if qkv_bias {
            add(format!("{p}.self_attn.v_proj.bias"), vec![kv], Init::Normal(0.02));
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, q], Init::Normal(inv_sqrt(q)));
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], Init::Norm);
        add(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], Init::Normal(inv_sqrt(h)));
        add(format!("{p}.mlp.up_proj.weight"), vec![inter, h], Init::Normal(inv_sqrt(h)));
        add(format!("{p}.mlp.down_proj.weight"), vec![h, inter], Init::Normal(MLP_DOWN_GAIN * inv_sqrt(inter)));
    }
    add("model.norm.weight".into(), vec![h], Init::Norm);
    if !cfg.tie_word_embeddings {
        add("lm_head.weight".into(), vec![cfg.vocab_size, h], Init::Normal(head_std));
    }
    out
}

/// Parameter count of `cfg` as this module writes it.
pub fn param_count(cfg: &HfConfig) -> u64 {
    tensor_specs(cfg).iter().map(|t| t.numel() as u64).sum()
}

// ---------------------------------------------------------------------------------------
// Deterministic random numbers (own implementation: never changes with crate versions)

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Elements per independently seeded chunk (so chunks can be generated in parallel).
const CHUNK: usize = 1 << 16;

/// Fills `out` (elements `chunk*CHUNK ..`) of the tensor seeded by `tensor_seed`.
fn fill_chunk(tensor_seed: u64, chunk: u64, init: Init, dtype: DType, out: &mut [u8]) {
    let mut state = tensor_seed ^ chunk.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    splitmix64(&mut state);
    let (mean, std) = match init {
        Init::Normal(s) => (0.0f32, s),
        Init::Norm => (1.0, 0.05),
    };
    let size = dtype.size_bytes();
    for dst in out.chunks_exact_mut(size) {
        // Irwin-Hall: the sum of four 16-bit uniforms, centred and scaled to unit variance,
        // is close to N(0, 1) (bounded at ±3.46). Only integer and exactly rounded f32
        // operations, so the bits are the same on every platform (no libm `ln`/`sin`).
        let r = splitmix64(&mut state);
        let sum: i64 = (0..4).map(|k| ((r >> (16 * k)) & 0xffff) as i64).sum();
        let centred = (2 * sum + 4 - 4 * 65536) as f32; // 2·65536·(Σu − 2), exact
        let z = centred * (SQRT_3 / 131_072.0);
        let v = mean + std * z;
        match dtype {
            DType::F32 => dst.copy_from_slice(&v.to_le_bytes()),
            DType::F16 => dst.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            DType::Bf16 => dst.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
}

const SQRT_3: f32 = 1.732_050_8;

/// Streams the tensor's bytes to `w` in blocks generated on all cores.
fn write_tensor(w: &mut impl Write, seed: u64, t: &TensorSpec, dtype: DType, threads: usize) -> std::io::Result<()> {
    let mut name_state = seed ^ fnv1a64(t.name.as_bytes());
    let tensor_seed = splitmix64(&mut name_state);
    let size = dtype.size_bytes();
    let numel = t.numel();
    let chunks_per_block = 16 * threads;
    let mut buf = vec![0u8; (chunks_per_block * CHUNK).min(numel) * size];
    let mut first_chunk = 0usize;
    let total_chunks = numel.div_ceil(CHUNK);
    while first_chunk < total_chunks {
        let chunks = chunks_per_block.min(total_chunks - first_chunk);
        let elems = (numel - first_chunk * CHUNK).min(chunks * CHUNK);
        let block = &mut buf[..elems * size];
        let mut pieces: Vec<(usize, &mut [u8])> = block.chunks_mut(CHUNK * size).enumerate().collect();
        let per_thread = pieces.len().div_ceil(threads).max(1);
        if pieces.len() <= 1 || threads <= 1 {
            for (k, piece) in pieces.iter_mut() {
                fill_chunk(tensor_seed, (first_chunk + *k) as u64, t.init, dtype, piece);
            }
        } else {
            std::thread::scope(|s| {
                for group in pieces.chunks_mut(per_thread) {
                    s.spawn(move || {
                        for (k, piece) in group.iter_mut() {
                            fill_chunk(tensor_seed, (first_chunk + *k) as u64, t.init, dtype, piece);
                        }
                    });
                }
            });
        }
        w.write_all(block)?;
        first_chunk += chunks;
    }
    Ok(())
}

/// Writes one safetensors file holding `tensors` (streamed, never all in memory).
fn write_safetensors(path: &Path, seed: u64, tensors: &[&TensorSpec], dtype: DType, threads: usize) -> Result<u64> {
    let io_err = |e| BackendError::io(path, e);
    let mut header = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0usize;
    for t in tensors {
        let bytes = t.numel() * dtype.size_bytes();
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        header.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            serde_json::Value::String(t.name.clone()),
            dtype.safetensors_name(),
            shape.join(","),
            offset,
            offset + bytes
        ));
        offset += bytes;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let file = File::create(path).map_err(io_err)?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io_err)?;
    w.write_all(header.as_bytes()).map_err(io_err)?;
    for t in tensors {
        write_tensor(&mut w, seed, t, dtype, threads).map_err(io_err)?;
    }
    w.flush().map_err(io_err)?;
    Ok(8 + header.len() as u64 + offset as u64)
}

/// Shard index of each tensor: contiguous, balanced by bytes, every shard non-empty.
fn assign_shards(sizes: &[usize], shards: usize) -> Vec<usize> {
    let total: usize = sizes.iter().sum::<usize>().max(1);
    let n = sizes.len();
    let mut out = Vec::with_capacity(n);
    let mut start = 0usize;
    let mut prev = 0usize;
    for (i, size) in sizes.iter().enumerate() {
        let want = ((start as u128 * shards as u128) / total as u128) as usize;
        let lo = if i == 0 { 0 } else { prev.max((shards + i).saturating_sub(n)) };
        let hi = if i == 0 { 0 } else { (prev + 1).min(shards - 1) };
        let s = want.clamp(lo, hi);
        out.push(s);
        prev = s;
        start += size;
    }
    out
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<u64> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| BackendError::Config { path: path.to_path_buf(), reason: e.to_string() })?;
    text.push('\n');
    std::fs::write(path, &text).map_err(|e| BackendError::io(path, e))?;
    Ok(text.len() as u64)
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` for
/// `config` (whose vocabulary bounds the tokenizer's). Returns the bytes written.
pub fn write_tokenizer_files(dir: &Path, config: &HfConfig) -> Result<u64> {
    std::fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, e))?;
    let bpe = trained_bpe(config.vocab_size);
    let mut bytes = 0;
    let path = dir.join("tokenizer.json");
    let text = bpe.tokenizer_json();
    std::fs::write(&path, &text).map_err(|e| BackendError::io(&path, e))?;
    bytes += text.len() as u64;
    bytes += write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "add_bos_token": true,
            "add_eos_token": false,
            "bos_token": BOS,
            "eos_token": EOT,
            "pad_token": EOT,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": false,
            "model_max_length": config.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }),
    )?;
    bytes += write_json(
        &dir.join("generation_config.json"),
        &json!({
            "bos_token_id": bpe.special_id(BOS),
            "eos_token_id": [bpe.special_id(EOT), bpe.special_id(IM_END)],
        }),
    )?;
    Ok(bytes)
}

/// Removes weight files a previous (differently sharded) checkpoint left in `dir`.
fn remove_stale_weights(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| BackendError::io(dir, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let stale = name == "model.safetensors"
            || name == "model.safetensors.index.json"
            || (name.starts_with("model-") && name.contains("-of-") && name.ends_with(".safetensors"));
        if stale {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| BackendError::io(&path, e))?;
        }
    }
    Ok(())
}

/// Writes the checkpoint of `spec` into `dir` (created if missing; files overwritten).
pub fn write_checkpoint(dir: &Path, spec: &SynthSpec) -> Result<SynthSummary> {
    let config = hf_config(spec);
    let tensors = tensor_specs(&config);
    if spec.shards == 0 || spec.shards > tensors.len() {
        return Err(BackendError::Request(format!(
            "shards = {} must be between 1 and the number of tensors ({})",
            spec.shards,
            tensors.len()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| BackendError::io(dir, e))?;
    remove_stale_weights(dir)?;
    let dtype = spec.resolved_dtype();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(16);

    let config_value = serde_json::to_value(&config)
        .map_err(|e| BackendError::Config { path: dir.join("config.json"), reason: e.to_string() })?;
    let mut bytes_written = write_json(&dir.join("config.json"), &config_value)?;
    bytes_written += write_tokenizer_files(dir, &config)?;

    if spec.shards == 1 {
        let refs: Vec<&TensorSpec> = tensors.iter().collect();
        bytes_written += write_safetensors(&dir.join("model.safetensors"), spec.seed, &refs, dtype, threads)?;
    } else {
        let sizes: Vec<usize> = tensors.iter().map(|t| t.numel() * dtype.size_bytes()).collect();
        let assignment = assign_shards(&sizes, spec.shards);
        let mut weight_map = BTreeMap::new();
        for shard in 0..spec.shards {
            let file = format!("model-{:05}-of-{:05}.safetensors", shard + 1, spec.shards);
            let group: Vec<&TensorSpec> =
                tensors.iter().zip(&assignment).filter(|(_, s)| **s == shard).map(|(t, _)| t).collect();
            for t in &group {
                weight_map.insert(t.name.clone(), file.clone());
            }
            bytes_written += write_safetensors(&dir.join(&file), spec.seed, &group, dtype, threads)?;
        }
        let total_size: usize = sizes.iter().sum();
        bytes_written += write_json(
            &dir.join("model.safetensors.index.json"),
            &json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map }),
        )?;
    }
    Ok(SynthSummary {
        dir: dir.to_path_buf(),
        params: tensors.iter().map(|t| t.numel() as u64).sum(),
        bytes_written,
        config,
    })
}

// ---------------------------------------------------------------------------------------
// Byte-level BPE trained on the embedded corpus

const CORPUS: &str = include_str!("corpus.txt");

/// A trained byte-level BPE: ids 0..256 are the bytes (in byte order), then one id per
/// merge result, then the special tokens.
struct Bpe {
    /// Token strings (byte-level alphabet) by id, without specials.
    vocab: Vec<String>,
    merges: Vec<(u32, u32)>,
}

impl Bpe {
    fn special_id(&self, name: &str) -> u32 {
        let k = SPECIALS.iter().position(|s| *s == name).unwrap_or(0);
        (self.vocab.len() + k) as u32
    }

    fn tokenizer_json(&self) -> String {
        let added: Vec<serde_json::Value> = SPECIALS
            .iter()
            .map(|s| {
                json!({"id": self.special_id(s), "content": s, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let vocab: serde_json::Map<String, serde_json::Value> =
            self.vocab.iter().enumerate().map(|(i, s)| (s.clone(), json!(i))).collect();
        let merges: Vec<String> = self
            .merges
            .iter()
            .map(|&(a, b)| format!("{} {}", self.vocab[a as usize], self.vocab[b as usize]))
            .collect();
        let bos = self.special_id(BOS);
        let value = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS: {"id": BOS, "ids": [bos], "tokens": [BOS]}}
            },
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges
            }
        });
        let mut text = serde_json::to_string_pretty(&value).unwrap_or_default();
        text.push('\n');
        text
    }
}

/// Splits the corpus exactly as the tokenizer's ByteLevel pre-tokenizer (GPT-2 regex)
/// will, as byte ids with their counts.
fn corpus_words() -> Vec<(Vec<u32>, u64)> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let char_to_byte: HashMap<char, u32> =
        byte_to_char_table().iter().enumerate().map(|(b, c)| (*c, b as u32)).collect();
    let mut pts = PreTokenizedString::from(CORPUS);
    let pre = tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true);
    // Cannot fail on a valid string; without words the BPE just has no merges.
    if pre.pre_tokenize(&mut pts).is_err() {
        return Vec::new();
    }
    let mut counts: BTreeMap<Vec<u32>, u64> = BTreeMap::new();
    for (word, _, _) in pts.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        let ids: Vec<u32> = word.chars().filter_map(|c| char_to_byte.get(&c).copied()).collect();
        *counts.entry(ids).or_default() += 1;
    }
    counts.into_iter().collect()
}

fn train_bpe(max_vocab: usize) -> Bpe {
    let table = byte_to_char_table();
    let mut vocab: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let mut index: HashMap<String, u32> = vocab.iter().enumerate().map(|(i, s)| (s.clone(), i as u32)).collect();
    let mut merges = Vec::new();
    let mut words = corpus_words();
    let target = max_vocab.saturating_sub(SPECIALS.len());
    let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
    while vocab.len() < target {
        counts.clear();
        for (w, c) in &words {
            for p in w.windows(2) {
                *counts.entry((p[0], p[1])).or_default() += c;
            }
        }
        // Most frequent pair; ties go to the smallest ids (deterministic).
        let best = counts.iter().filter(|(_, c)| **c >= 2).max_by(|(pa, ca), (pb, cb)| ca.cmp(cb).then(pb.cmp(pa)));
        let Some((&(a, b), _)) = best else { break };
        let merged = format!("{}{}", vocab[a as usize], vocab[b as usize]);
        let id = match index.get(&merged) {
            Some(&id) => id,
            None => {
                let id = vocab.len() as u32;
                index.insert(merged.clone(), id);
                vocab.push(merged);
                id
            }
        };
        merges.push((a, b));
        for (w, _) in words.iter_mut() {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == a && w[i + 1] == b {
                    out.push(id);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
    }
    Bpe { vocab, merges }
}

/// The BPE for a model vocabulary of `max_vocab` (cached: training takes a moment).
fn trained_bpe(max_vocab: usize) -> Arc<Bpe> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Bpe>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Ok(map) = cache.lock()
        && let Some(b) = map.get(&max_vocab)
    {
        return b.clone();
    }
    let bpe = Arc::new(train_bpe(max_vocab));
    if let Ok(mut map) = cache.lock() {
        map.insert(max_vocab, bpe.clone());
    }
    bpe
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tessera-synth-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn spec(preset: Preset, arch: SynthArch) -> SynthSpec {
        SynthSpec { preset, arch, seed: 7, dtype: None, shards: 1 }
    }

    /// name -> (dtype, shape, bytes) of every tensor in the checkpoint at `dir`.
    fn load_tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
        let mut files = vec![];
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().and_then(|x| x.to_str()) == Some("safetensors") {
                files.push(p);
            }
        }
        let mut out = BTreeMap::new();
        for f in files {
            let data = std::fs::read(&f).unwrap();
            let st = safetensors::SafeTensors::deserialize(&data).unwrap();
            for (name, view) in st.tensors() {
                out.insert(name, (format!("{:?}", view.dtype()), view.shape().to_vec(), view.data().to_vec()));
            }
        }
        out
    }

    fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
            })
            .collect()
    }

    #[test]
    fn names_parse_and_display() {
        assert_eq!("tiny".parse::<Preset>().unwrap(), Preset::Tiny);
        assert_eq!("Bench".parse::<Preset>().unwrap().to_string(), "bench");
        assert_eq!("qwen2".parse::<SynthArch>().unwrap(), SynthArch::Qwen2);
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::Bf16);
        let err = "huge".parse::<Preset>().unwrap_err();
        assert_eq!(err, "unknown preset \"huge\" (expected one of: tiny, small, bench)");
        assert!("f8".parse::<DType>().unwrap_err().to_string().contains("f32, f16 or bf16"));
    }

    #[test]
    fn every_preset_config_is_accepted() {
        for &preset in Preset::ALL {
            for &arch in SynthArch::ALL {
                let cfg = hf_config(&spec(preset, arch));
                let mc = ModelConfig::from_hf(&cfg, Path::new("config.json")).unwrap();
                assert_eq!(mc.qkv_bias, arch == SynthArch::Qwen2);
                assert!(mc.eos_token_ids.len() == 2 && mc.bos_token_id.is_some());
            }
        }
        let bench = hf_config(&spec(Preset::Bench, SynthArch::Llama));
        let params = param_count(&bench);
        assert!((850_000_000..1_000_000_000).contains(&params), "{params}");
        assert_eq!(bench.torch_dtype.as_deref(), Some("float16"));
        assert!(bench.tie_word_embeddings);
        let mc = ModelConfig::from_hf(&bench, Path::new("config.json")).unwrap();
        assert!(matches!(mc.rope, crate::config::RopeKind::Llama3 { factor: 32.0, .. }));
        assert_eq!((mc.head_dim, mc.num_kv_heads, mc.max_context), (64, 8, 8192));
    }

    #[test]
    fn written_checkpoints_load_and_are_deterministic() {
        for &preset in &[Preset::Tiny, Preset::Small] {
            for &arch in SynthArch::ALL {
                let d = tmpdir(&format!("{preset}-{arch}"));
                let s = spec(preset, arch);
                let summary = write_checkpoint(&d, &s).unwrap();
                let mc = ModelConfig::from_dir(&d).unwrap();
                assert_eq!(mc.tie_word_embeddings, arch == SynthArch::Qwen2);
                let tok = crate::tokenizer::TextTokenizer::from_dir(&d).unwrap();
                assert!(tok.vocab_size() <= mc.vocab_size);
                assert_eq!(tok.bos_id(), mc.bos_token_id);
                assert_eq!(tok.eos_ids(), mc.eos_token_ids);
                let tensors = load_tensors(&d);
                let specs = tensor_specs(&summary.config);
                assert_eq!(tensors.len(), specs.len());
                for t in &specs {
                    let (dtype, shape, _) = &tensors[&t.name];
                    assert_eq!((dtype.as_str(), shape), ("F32", &t.shape), "{}", t.name);
                }
                assert_eq!(tensors.contains_key("lm_head.weight"), arch == SynthArch::Llama);
                assert_eq!(tensors.contains_key("model.layers.0.self_attn.q_proj.bias"), arch == SynthArch::Qwen2);
                let files = dir_files(&d);
                let on_disk: u64 = files.values().map(|b| b.len() as u64).sum();
                assert_eq!(summary.bytes_written, on_disk);
                // Twice: byte-identical.
                write_checkpoint(&d, &s).unwrap();
                assert!(files == dir_files(&d), "{preset} {arch} not deterministic");
                let _ = std::fs::remove_dir_all(&d);
            }
        }
    }

    #[test]
    fn sharded_equals_unsharded_and_dtypes_convert() {
        let d1 = tmpdir("one");
        let d3 = tmpdir("three");
        let mut s = spec(Preset::Tiny, SynthArch::Qwen2);
        s.dtype = Some(DType::F16);
        write_checkpoint(&d1, &s).unwrap();
        s.shards = 3;
        write_checkpoint(&d3, &s).unwrap();
        let (a, b) = (load_tensors(&d1), load_tensors(&d3));
        assert!(a == b, "sharded tensors differ");
        assert!(a.values().all(|(dt, _, _)| dt == "F16"));
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d3.join("model.safetensors.index.json")).unwrap()).unwrap();
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), a.len());
        let total: usize = a.values().map(|(_, _, b)| b.len()).sum();
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
        for k in 1..=3 {
            let f = format!("model-{k:05}-of-00003.safetensors");
            assert!(map.values().any(|v| v == &f[..]), "{f} holds no tensor");
        }
        // Re-writing unsharded into the sharded dir removes the stale shards and index.
        s.shards = 1;
        write_checkpoint(&d3, &s).unwrap();
        assert!(!d3.join("model.safetensors.index.json").exists());
        assert!(load_tensors(&d3) == a);
        // Other seeds give other weights; bf16 halves f32.
        s.seed = 8;
        s.dtype = Some(DType::Bf16);
        write_checkpoint(&d3, &s).unwrap();
        let c = load_tensors(&d3);
        assert_ne!(c["model.embed_tokens.weight"].2, a["model.embed_tokens.weight"].2);
        assert_eq!(c["model.norm.weight"].0, "BF16");
        s.shards = 0;
        assert!(write_checkpoint(&d3, &s).unwrap_err().to_string().contains("shards = 0"));
        let _ = std::fs::remove_dir_all(&d1);
        let _ = std::fs::remove_dir_all(&d3);
    }

    #[test]
    fn generated_values_have_the_requested_moments() {
        let mut buf = vec![0u8; CHUNK * 4];
        fill_chunk(42, 3, Init::Normal(0.5), DType::F32, &mut buf);
        let v: Vec<f64> = buf.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / v.len() as f64).sqrt();
        assert!(mean.abs() < 0.01 && (std - 0.5).abs() < 0.01, "{mean} {std}");
        // Pinned bits: the generator must never change (checkpoints are reproducible).
        let first = f32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
        assert_eq!(first.to_bits(), 0xbfb9_29e6, "generator changed: {first:e}");
        fill_chunk(42, 3, Init::Norm, DType::F32, &mut buf);
        let v: Vec<f32> = buf.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert!(v.iter().all(|x| (0.8..1.2).contains(x)));
    }

    #[test]
    fn shard_assignment_is_contiguous_and_non_empty() {
        for (sizes, n) in [(vec![1, 1, 1], 3), (vec![100, 1, 1, 1], 2), (vec![1, 1, 1, 100], 4), (vec![5; 10], 3)] {
            let a = assign_shards(&sizes, n);
            assert_eq!(a[0], 0);
            assert_eq!(*a.last().unwrap(), n - 1, "{sizes:?} {a:?}");
            assert!(a.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1), "{a:?}");
        }
    }

    /// A plain f32 forward pass of the tiny checkpoint (RMSNorm, RoPE, GQA attention,
    /// SwiGLU) to check the random model is numerically healthy.
    fn forward_stats(arch: SynthArch, tokens: &[u32]) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
        let d = tmpdir(&format!("fwd-{arch}"));
        let summary = write_checkpoint(&d, &spec(Preset::Tiny, arch)).unwrap();
        let cfg = ModelConfig::from_hf(&summary.config, Path::new("c")).unwrap();
        let raw = load_tensors(&d);
        let _ = std::fs::remove_dir_all(&d);
        let w = |n: &str| -> Vec<f32> {
            raw[n].2.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
        };
        let (h, hd, nh, nkv) = (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
        let matvec = |m: &[f32], x: &[f32], rows: usize| -> Vec<f32> {
            (0..rows).map(|r| m[r * x.len()..(r + 1) * x.len()].iter().zip(x).map(|(a, b)| a * b).sum()).collect()
        };
        let rms = |x: &[f32]| (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let norm = |x: &[f32], g: &[f32]| -> Vec<f32> {
            let r = rms(x) + cfg.rms_norm_eps;
            x.iter().zip(g).map(|(v, g)| v / r * g).collect()
        };
        let rope = |v: &mut [f32], pos: usize| {
            for head in v.chunks_mut(hd) {
                for i in 0..hd / 2 {
                    let f = pos as f32 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32);
                    let (s, c) = f.sin_cos();
                    let (a, b) = (head[i], head[i + hd / 2]);
                    head[i] = a * c - b * s;
                    head[i + hd / 2] = a * s + b * c;
                }
            }
        };
        let embed = w("model.embed_tokens.weight");
        let head = if cfg.tie_word_embeddings { embed.clone() } else { w("lm_head.weight") };
        let mut xs: Vec<Vec<f32>> =
            tokens.iter().map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
        let mut layer_rms = vec![];
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let bias = |n: &str, len: usize| {
                if cfg.qkv_bias { w(&format!("{p}.self_attn.{n}_proj.bias")) } else { vec![0.0; len] }
            };
            let (wq, wk, wv, wo) = (
                w(&format!("{p}.self_attn.q_proj.weight")),
                w(&format!("{p}.self_attn.k_proj.weight")),
                w(&format!("{p}.self_attn.v_proj.weight")),
                w(&format!("{p}.self_attn.o_proj.weight")),
            );
            let (bq, bk, bv) = (bias("q", nh * hd), bias("k", nkv * hd), bias("v", nkv * hd));
            let g1 = w(&format!("{p}.input_layernorm.weight"));
            let (mut ks, mut vs, mut qs) = (vec![], vec![], vec![]);
            for (pos, x) in xs.iter().enumerate() {
                let n = norm(x, &g1);
                let add = |mut v: Vec<f32>, b: &[f32]| {
                    v.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                    v
                };
                let mut q = add(matvec(&wq, &n, nh * hd), &bq);
                let mut k = add(matvec(&wk, &n, nkv * hd), &bk);
                rope(&mut q, pos);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(add(matvec(&wv, &n, nkv * hd), &bv));
            }
            for pos in 0..xs.len() {
                let mut attn = vec![0.0f32; nh * hd];
                for hh in 0..nh {
                    let kvh = hh / (nh / nkv);
                    let q = &qs[pos][hh * hd..(hh + 1) * hd];
                    let scores: Vec<f32> = (0..=pos)
                        .map(|j| {
                            q.iter().zip(&ks[j][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f32>()
                                / (hd as f32).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f32::MIN, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f32 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        for i in 0..hd {
                            attn[hh * hd + i] += ej / z * vs[j][kvh * hd + i];
                        }
                    }
                }
                let o = matvec(&wo, &attn, h);
                xs[pos].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            }
            let g2 = w(&format!("{p}.post_attention_layernorm.weight"));
            let (wg, wu, wd) = (
                w(&format!("{p}.mlp.gate_proj.weight")),
                w(&format!("{p}.mlp.up_proj.weight")),
                w(&format!("{p}.mlp.down_proj.weight")),
            );
            for x in xs.iter_mut() {
                let n = norm(x, &g2);
                let g = matvec(&wg, &n, cfg.intermediate_size);
                let u = matvec(&wu, &n, cfg.intermediate_size);
                let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let o = matvec(&wd, &a, h);
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            }
            layer_rms.push(xs.iter().map(|x| rms(x)).sum::<f32>() / xs.len() as f32);
        }
        let gf = w("model.norm.weight");
        let mut logit_std = vec![];
        let mut argmax = vec![];
        for x in &xs {
            let logits = matvec(&head, &norm(x, &gf), cfg.vocab_size);
            let mean = logits.iter().sum::<f32>() / logits.len() as f32;
            logit_std.push((logits.iter().map(|l| (l - mean) * (l - mean)).sum::<f32>() / logits.len() as f32).sqrt());
            let best = logits.iter().enumerate().fold((0, f32::MIN), |b, (i, &l)| if l > b.1 { (i, l) } else { b });
            argmax.push(best.0);
        }
        (layer_rms, logit_std, argmax)
    }

    #[test]
    fn random_model_is_numerically_healthy() {
        let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 1000).collect();
        for &arch in SynthArch::ALL {
            let (layer_rms, logit_std, argmax) = forward_stats(arch, &tokens);
            eprintln!("{arch}: hidden rms per layer {layer_rms:?}\n  logit std {logit_std:?}\n  argmax {argmax:?}");
            assert!(layer_rms.iter().all(|r| (0.5..20.0).contains(r)), "{layer_rms:?}");
            assert!(logit_std.iter().all(|s| (1.5..10.0).contains(s)), "{logit_std:?}");
            let distinct: std::collections::BTreeSet<_> = argmax.iter().collect();
            assert!(distinct.len() > tokens.len() / 2, "argmax too repetitive: {argmax:?}");
            let same_as_input = argmax.iter().zip(&tokens).filter(|(a, t)| **a == **t as usize).count();
            assert!(same_as_input < tokens.len() / 2, "model mostly echoes its input: {argmax:?}");
        }
    }
}
