//! Model configuration read from a Hugging Face `config.json`, validated once so the
//! executor can trust every dimension.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::error::{BackendError, Result};

/// Architectures the executor runs. All are pre-norm Llama-style decoders; they differ
/// only in biases and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    #[serde(rename = "LlamaForCausalLM")]
    Llama,
    #[serde(rename = "MistralForCausalLM")]
    Mistral,
    #[serde(rename = "Qwen2ForCausalLM")]
    Qwen2,
}

impl Architecture {
    pub const ALL: [Architecture; 3] = [Architecture::Llama, Architecture::Mistral, Architecture::Qwen2];

    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    fn from_hf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name)
    }
}

/// `rope_scaling` as HF writes it (`rope_type`, older files say `type`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default = "one")]
    pub factor: f32,
    #[serde(default = "one")]
    pub low_freq_factor: f32,
    #[serde(default = "four")]
    pub high_freq_factor: f32,
    #[serde(default)]
    pub original_max_position_embeddings: Option<u32>,
}

fn one() -> f32 {
    1.0
}
fn four() -> f32 {
    4.0
}

/// A token id or a list of them (`eos_token_id` is either in HF configs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// The subset of HF `config.json` the executor needs, with HF's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Qwen2 configs carry a `sliding_window` they do not use unless this is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

/// How rotary frequencies are scaled (mirrors the kernel ABI's `tk_rope`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RopeKind {
    None,
    Linear { factor: f32 },
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: u32 },
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope: RopeKind,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_context: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`, adding the end-of-sequence ids of
    /// `dir/generation_config.json` when it exists (chat models list their end-of-turn
    /// token only there, as HF `generate` reads it).
    /// A GGUF file instead of a directory reads its metadata ([`crate::gguf::hf`]).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if crate::gguf::is_model_file(dir) {
            let g = crate::gguf::Gguf::open(dir)?;
            let hf = crate::gguf::hf::hf_config(&g)
                .map_err(|reason| BackendError::Gguf { path: dir.to_path_buf(), reason })?;
            return Self::from_hf(&hf, dir);
        }
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| BackendError::io(&path, e))?;
        let mut config = Self::from_json(&text, &path)?;
        let gen_path = dir.join("generation_config.json");
        if gen_path.is_file() {
            #[derive(Deserialize)]
            struct GenerationConfig {
                #[serde(default)]
                eos_token_id: Option<TokenIds>,
            }
            let gen_err = |reason: String| BackendError::Config { path: gen_path.clone(), reason };
            let text = std::fs::read_to_string(&gen_path).map_err(|e| BackendError::io(&gen_path, e))?;
            let generation: GenerationConfig = serde_json::from_str(&text).map_err(|e| gen_err(e.to_string()))?;
            for id in generation.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default() {
                if id as usize >= config.vocab_size {
                    return Err(gen_err(format!(
                        "eos token id {id} is outside the vocabulary ({})",
                        config.vocab_size
                    )));
                }
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let config_err = |reason: String| BackendError::Config { path: path.to_path_buf(), reason };
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| config_err(e.to_string()))?;
        Self::from_hf(&hf, path)
    }

    pub fn from_hf(hf: &HfConfig, path: &Path) -> Result<Self> {
        let config_err = |reason: String| BackendError::Config { path: path.to_path_buf(), reason };
        let supported = Architecture::ALL.map(|a| a.hf_name()).join(", ");
        let arch_name = hf.architectures.first().ok_or_else(|| config_err("`architectures` is empty".into()))?;
        let arch = Architecture::from_hf_name(arch_name).ok_or_else(|| BackendError::UnknownArchitecture {
            path: path.to_path_buf(),
            arch: arch_name.clone(),
            supported,
        })?;
        // Generous bounds (today's largest open models are well inside them) that keep
        // every size derived from the config far from overflow.
        for (key, value, max) in [
            ("hidden_size", hf.hidden_size, 1 << 16),
            ("intermediate_size", hf.intermediate_size, 1 << 18),
            ("num_hidden_layers", hf.num_hidden_layers, 1 << 10),
            ("num_attention_heads", hf.num_attention_heads, 1 << 10),
            ("vocab_size", hf.vocab_size, 1 << 22),
            ("max_position_embeddings", hf.max_position_embeddings, 1 << 24),
        ] {
            if value == 0 || value > max {
                return Err(config_err(format!("`{key}` = {value} is out of range (1..={max})")));
            }
        }
        if let Some(act) = hf.hidden_act.as_deref()
            && act != "silu"
            && act != "swish"
        {
            return Err(config_err(format!("`hidden_act` = {act:?} is not supported (supported: silu)")));
        }
        let num_heads = hf.num_attention_heads;
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(config_err(format!(
                "`num_key_value_heads` = {num_kv_heads} must divide `num_attention_heads` = {num_heads}"
            )));
        }
        let head_dim = match hf.head_dim {
            Some(d) => d,
            None if hf.hidden_size.is_multiple_of(num_heads) => hf.hidden_size / num_heads,
            None => {
                return Err(config_err(format!(
                    "`hidden_size` = {} is not a multiple of `num_attention_heads` = {num_heads} and no `head_dim` is given",
                    hf.hidden_size
                )));
            }
        };
        if head_dim == 0 || head_dim > 1024 || !head_dim.is_multiple_of(2) {
            return Err(config_err(format!("`head_dim` = {head_dim} must be even and in 2..=1024")));
        }
        if !(hf.rms_norm_eps > 0.0 && hf.rms_norm_eps.is_finite()) {
            return Err(config_err(format!("`rms_norm_eps` = {} must be positive", hf.rms_norm_eps)));
        }
        if !(hf.rope_theta > 1.0 && hf.rope_theta.is_finite()) {
            return Err(config_err(format!("`rope_theta` = {} must be > 1", hf.rope_theta)));
        }
        let rope = match &hf.rope_scaling {
            None => RopeKind::None,
            Some(s) => match s.rope_type.as_str() {
                "default" => RopeKind::None,
                "linear" => RopeKind::Linear { factor: s.factor },
                "llama3" => RopeKind::Llama3 {
                    factor: s.factor,
                    low_freq_factor: s.low_freq_factor,
                    high_freq_factor: s.high_freq_factor,
                    original_max_position: s.original_max_position_embeddings.unwrap_or(8192),
                },
                other => {
                    return Err(config_err(format!(
                        "`rope_scaling.rope_type` = {other:?} is not supported (supported: default, linear, llama3)"
                    )));
                }
            },
        };
        if let RopeKind::Linear { factor } | RopeKind::Llama3 { factor, .. } = rope
            && !(factor >= 1.0 && factor.is_finite())
        {
            return Err(config_err(format!("`rope_scaling.factor` = {factor} must be >= 1")));
        }
        if let RopeKind::Llama3 { low_freq_factor: lo, high_freq_factor: hi, original_max_position, .. } = rope
            && !(lo > 0.0 && hi > lo && hi.is_finite() && original_max_position > 0)
        {
            return Err(config_err(format!(
                "llama3 `rope_scaling` needs 0 < low_freq_factor ({lo}) < high_freq_factor ({hi}) and \
                 original_max_position_embeddings ({original_max_position}) > 0"
            )));
        }
        // Without a sliding-window kernel the model is exact only inside the window.
        let max_context = match (hf.sliding_window, hf.use_sliding_window) {
            (Some(w), None | Some(true)) if w > 0 => hf.max_position_embeddings.min(w),
            _ => hf.max_position_embeddings,
        };
        let qkv_bias = match arch {
            Architecture::Qwen2 => true,
            Architecture::Llama | Architecture::Mistral => hf.attention_bias.unwrap_or(false),
        };
        let eos_token_ids = hf.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default();
        for &id in eos_token_ids.iter().chain(hf.bos_token_id.iter()) {
            if id as usize >= hf.vocab_size {
                return Err(config_err(format!("special token id {id} is outside the vocabulary ({})", hf.vocab_size)));
            }
        }
        Ok(ModelConfig {
            arch,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: hf.vocab_size,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope,
            max_context,
            tie_word_embeddings: hf.tie_word_embeddings,
            qkv_bias,
            bos_token_id: hf.bos_token_id,
            eos_token_ids,
        })
    }

    /// Bytes of K plus V for one token across all layers, at `dtype_bytes` per element.
    pub fn kv_bytes_per_token(&self, dtype_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
    }

    /// Parameters in the matmuls of one forward step (all layers + LM head).
    pub fn linear_params(&self) -> usize {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * i;
        self.num_layers * per_layer + self.vocab_size * h
    }

    /// The model as the performance models cost it: its shape, `weight_bytes` of
    /// weights read per step and `kv_dtype` KV.
    pub fn cost_shape(&self, weight_bytes: u64, kv_dtype: DType) -> tessera_perf::ModelShape {
        tessera_perf::ModelShape {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            weight_bytes,
            kv_bytes_per_elem: kv_dtype.size_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "eos_token_id": [1, 2]
        })
    }

    fn parse(v: serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v.to_string(), Path::new("config.json"))
    }

    #[test]
    fn defaults_follow_hf() {
        let c = parse(base()).unwrap();
        assert_eq!((c.head_dim, c.num_kv_heads, c.max_context), (16, 2, 2048));
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert!(!c.qkv_bias);
        assert_eq!(c.rope, RopeKind::None);
    }

    #[test]
    fn qwen2_has_qkv_bias_and_llama3_scaling_parses() {
        let mut v = base();
        v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        assert!(c.qkv_bias);
        assert!(matches!(c.rope, RopeKind::Llama3 { factor: 32.0, original_max_position: 8192, .. }));
    }

    #[test]
    fn generation_config_adds_eos_ids() {
        let dir = std::env::temp_dir().join(format!("tessera-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), base().to_string()).unwrap();
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [2, 7]}"#).unwrap();
        assert_eq!(ModelConfig::from_dir(&dir).unwrap().eos_token_ids, vec![1, 2, 7]);
        std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 5000}"#).unwrap();
        let err = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("generation_config.json") && err.contains("eos token id 5000"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refusals_name_the_problem() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (serde_json::json!({"architectures": ["GPT2LMHeadModel"]}), "missing field"),
            (
                {
                    let mut v = base();
                    v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
                    v
                },
                "unsupported architecture \"GPT2LMHeadModel\"",
            ),
            (
                {
                    let mut v = base();
                    v["num_key_value_heads"] = serde_json::json!(3);
                    v
                },
                "`num_key_value_heads` = 3 must divide",
            ),
            (
                {
                    let mut v = base();
                    v["eos_token_id"] = serde_json::json!(999);
                    v
                },
                "special token id 999",
            ),
            (
                {
                    let mut v = base();
                    v["num_hidden_layers"] = serde_json::json!(200_000_000);
                    v
                },
                "`num_hidden_layers` = 200000000 is out of range",
            ),
            (
                {
                    let mut v = base();
                    v["head_dim"] = serde_json::json!(4_611_686_018_427_387_904u64);
                    v
                },
                "`head_dim` = 4611686018427387904 must be even and in 2..=1024",
            ),
            (
                {
                    let mut v = base();
                    v["hidden_act"] = serde_json::json!("gelu");
                    v
                },
                "`hidden_act` = \"gelu\" is not supported",
            ),
            (
                {
                    let mut v = base();
                    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
                        "low_freq_factor": 4.0, "high_freq_factor": 1.0});
                    v
                },
                "low_freq_factor (4) < high_freq_factor (1)",
            ),
        ];
        for (v, want) in cases {
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(want), "{err:?} should contain {want:?}");
        }
    }
}
