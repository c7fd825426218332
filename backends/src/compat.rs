//! Whether two chips may exchange KV: the same model, shapes and positional encoding,
//! and (when known) the same weights. A prefill/decode pair that differs here is refused
//! at connect time with the first differing field named (DESIGN.md §6), because KV from
//! another model decodes into fluent garbage, never into an error.
//!
//! What may differ, because the receiver converts it, is the KV *format* (block size,
//! layout, dtype: `kv_format`) and the weights' device dtype.

use std::fmt;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::config::{Architecture, ModelConfig, RopeKind};
use crate::dtype::GgmlType;
use crate::model::Model;
use crate::weights::entry_to_f32;

/// Everything about a model that two chips exchanging KV must agree on. Serializable so
/// chips can send it to each other when they connect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompatInfo {
    pub arch: Architecture,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope: RopeKind,
    pub qkv_bias: bool,
    /// [`WeightsFingerprint`] of the loaded tensors; `None` when only the config is known
    /// (then weights are not compared).
    #[serde(default)]
    pub weights: Option<u64>,
    /// The block formats of the loaded weights ([`Model::weight_format`]: `float`, or
    /// e.g. `q4_1+q8_0`); `None` when only the config is known. A chip that quantized
    /// its weights computes other logits than one that did not, so their KV differs.
    #[serde(default)]
    pub weight_format: Option<String>,
}

impl CompatInfo {
    /// The config's part, without a weights fingerprint.
    pub fn from_config(c: &ModelConfig) -> CompatInfo {
        CompatInfo {
            arch: c.arch,
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope: c.rope,
            qkv_bias: c.qkv_bias,
            weights: None,
            weight_format: None,
        }
    }

    /// The info of a loaded model, its weights fingerprint included.
    pub fn of(model: &Model) -> CompatInfo {
        model.compat_info()
    }

    pub fn with_weights(self, fingerprint: u64) -> CompatInfo {
        CompatInfo { weights: Some(fingerprint), ..self }
    }

    pub fn with_weight_format(self, format: &str) -> CompatInfo {
        CompatInfo { weight_format: Some(format.to_owned()), ..self }
    }

    /// Every compared field as (name, value), in the order [`compat_mismatch`] checks
    /// them (most telling first); "weights" comes last and only when known. For peers
    /// that carry the fields over the bus to name a mismatch themselves.
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut f: Vec<(&str, String)> = vec![
            ("architecture", self.arch.hf_name().to_string()),
            ("num_layers", self.num_layers.to_string()),
            ("num_kv_heads", self.num_kv_heads.to_string()),
            ("head_dim", self.head_dim.to_string()),
            ("num_heads", self.num_heads.to_string()),
            ("hidden_size", self.hidden_size.to_string()),
            ("intermediate_size", self.intermediate_size.to_string()),
            ("vocab_size", self.vocab_size.to_string()),
            ("rope_theta", self.rope_theta.to_string()),
            ("rope_scaling", Rope(self.rope).to_string()),
            ("rms_norm_eps", self.rms_norm_eps.to_string()),
            ("qkv_bias", self.qkv_bias.to_string()),
        ];
        if let Some(format) = &self.weight_format {
            f.push(("weight format", format.clone()));
        }
        if let Some(w) = self.weights {
            f.push(("weights fingerprint", format!("{w:016x}")));
        }
        f.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// A stable 64-bit hash of every field (the weights fingerprint included when set):
    /// equal infos hash equal on every host and build.
    pub fn hash(&self) -> u64 {
        let mut h = Xxh3::new();
        h.update(b"tessera-kv-compat-v1");
        h.update(self.arch.hf_name().as_bytes());
        for n in [
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
        ] {
            h.update(&(n as u64).to_le_bytes());
        }
        h.update(&self.rms_norm_eps.to_bits().to_le_bytes());
        h.update(&self.rope_theta.to_bits().to_le_bytes());
        let (kind, params): (u8, [u32; 4]) = match self.rope {
            RopeKind::None => (0, [0; 4]),
            RopeKind::Linear { factor } => (1, [factor.to_bits(), 0, 0, 0]),
            RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                (2, [factor.to_bits(), low_freq_factor.to_bits(), high_freq_factor.to_bits(), original_max_position])
            }
        };
        h.update(&[kind, self.qkv_bias as u8]);
        for p in params {
            h.update(&p.to_le_bytes());
        }
        match self.weights {
            Some(w) => {
                h.update(&[1]);
                h.update(&w.to_le_bytes());
            }
            None => h.update(&[0]),
        }
        // Appended only when known, so config-only hashes stay what they were.
        if let Some(format) = &self.weight_format {
            h.update(&(format.len() as u64).to_le_bytes());
            h.update(format.as_bytes());
        }
        h.digest()
    }
}

/// Hash of what must match in two chips' model configs to exchange KV: architecture,
/// layer count, head counts and head_dim, hidden and intermediate sizes, vocabulary,
/// norm epsilon, rope theta and scaling, q/k/v bias. No weights (see
/// [`CompatInfo::hash`] for the hash that includes them).
pub fn compat_hash(config: &ModelConfig) -> u64 {
    CompatInfo::from_config(config).hash()
}

struct Rope(RopeKind);

impl fmt::Display for Rope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            RopeKind::None => f.write_str("none"),
            RopeKind::Linear { factor } => write!(f, "linear(factor {factor})"),
            RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => write!(
                f,
                "llama3(factor {factor}, low {low_freq_factor}, high {high_freq_factor}, original {original_max_position})"
            ),
        }
    }
}

/// The first field in which `a` and `b` differ, as "`field` `a's value` vs `b's value`"
/// (e.g. "head_dim 64 vs 128"), or `None` when they may exchange KV. Weights are compared
/// only when both sides know their fingerprint.
pub fn compat_mismatch(a: &CompatInfo, b: &CompatInfo) -> Option<String> {
    a.fields().into_iter().zip(b.fields()).find(|(x, y)| x != y).map(|((name, x), (_, y))| format!("{name} {x} vs {y}"))
}

/// Elements of each tensor that the fingerprint samples.
const SAMPLED_ELEMS: usize = 16;

/// A cheap fingerprint of a model's weights, computed while loading: every tensor's
/// name and shape in load order, plus its first 16 values rounded to bf16.
///
/// The values are hashed as bf16 of their f32 value, not as stored bytes, so the same
/// checkpoint saved as f32 or bf16, or loaded onto chips in different device dtypes,
/// fingerprints the same; a different fine-tune almost surely does not. It reads a few
/// bytes per tensor, not the weights, so two checkpoints differing only deep inside a
/// tensor are not told apart.
pub struct WeightsFingerprint(Xxh3);

impl WeightsFingerprint {
    pub fn new() -> WeightsFingerprint {
        let mut h = Xxh3::new();
        h.update(b"tessera-weights-v1");
        WeightsFingerprint(h)
    }

    /// Adds one tensor: its name, shape, and leading elements of `bytes` (stored as `ty`).
    pub fn add(&mut self, name: &str, shape: &[usize], bytes: &[u8], ty: GgmlType) {
        let h = &mut self.0;
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(shape.len() as u64).to_le_bytes());
        for &d in shape {
            h.update(&(d as u64).to_le_bytes());
        }
        let blocks = SAMPLED_ELEMS.div_ceil(ty.block_elements() as usize);
        let take = bytes.len().min(blocks * ty.block_bytes() as usize);
        for x in entry_to_f32(&bytes[..take], ty).into_iter().take(SAMPLED_ELEMS) {
            h.update(&half::bf16::from_f32(x).to_bits().to_le_bytes());
        }
    }

    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

impl Default for WeightsFingerprint {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, DTypeExt};
    use crate::weights::f32_to_bytes;

    fn config() -> ModelConfig {
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300
        });
        ModelConfig::from_json(&json.to_string(), std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn mismatches_name_the_first_differing_field() {
        let base = config();
        let info = CompatInfo::from_config(&base);
        assert_eq!(compat_mismatch(&info, &info.clone()), None);
        type Change = fn(&mut ModelConfig);
        let cases: Vec<(Change, &str)> = vec![
            (|c| c.head_dim = 32, "head_dim 16 vs 32"),
            (|c| c.num_layers = 3, "num_layers 2 vs 3"),
            (|c| c.num_kv_heads = 4, "num_kv_heads 2 vs 4"),
            (|c| c.vocab_size = 301, "vocab_size 300 vs 301"),
            (|c| c.hidden_size = 32, "hidden_size 64 vs 32"),
            (|c| c.arch = Architecture::Qwen2, "architecture LlamaForCausalLM vs Qwen2ForCausalLM"),
            (|c| c.rope_theta = 500_000.0, "rope_theta 10000 vs 500000"),
            (|c| c.rope = RopeKind::Linear { factor: 4.0 }, "rope_scaling none vs linear(factor 4)"),
            (|c| c.qkv_bias = true, "qkv_bias false vs true"),
            // Two differences: the first in field order is named.
            (
                |c| {
                    c.vocab_size = 9;
                    c.num_layers = 7
                },
                "num_layers 2 vs 7",
            ),
        ];
        for (change, want) in cases {
            let mut other = base.clone();
            change(&mut other);
            let b = CompatInfo::from_config(&other);
            assert_eq!(compat_mismatch(&info, &b).as_deref(), Some(want));
            assert_ne!(compat_hash(&base), compat_hash(&other), "{want}");
        }
        // Fields that do not touch KV do not matter.
        let mut other = base.clone();
        other.max_context = 17;
        other.eos_token_ids = vec![3];
        other.tie_word_embeddings = true;
        assert_eq!(compat_hash(&base), compat_hash(&other));
        assert_eq!(compat_mismatch(&info, &CompatInfo::from_config(&other)), None);
    }

    #[test]
    fn weights_compared_only_when_both_known() {
        let info = CompatInfo::from_config(&config());
        let (a, b) = (info.clone().with_weights(1), info.clone().with_weights(0xabc));
        assert_eq!(
            compat_mismatch(&a, &b).as_deref(),
            Some("weights fingerprint 0000000000000001 vs 0000000000000abc")
        );
        assert_eq!(compat_mismatch(&a, &info), None);
        assert_ne!(a.hash(), b.hash());
        assert_ne!(a.hash(), info.hash());
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<CompatInfo>(&json).unwrap(), a);
    }

    #[test]
    fn the_weight_format_is_compared_and_hashed() {
        let c = config();
        let float = CompatInfo::from_config(&c).with_weights(7).with_weight_format("float");
        let q8 = CompatInfo::from_config(&c).with_weights(7).with_weight_format("q8_0");
        assert_ne!(float.hash(), q8.hash());
        assert_eq!(compat_mismatch(&float, &q8).as_deref(), Some("weight format float vs q8_0"));
        assert_eq!(compat_mismatch(&q8, &q8.clone()), None);
    }

    #[test]
    fn fingerprint_ignores_storage_dtype_but_not_values_names_or_shapes() {
        let vals: Vec<f32> = (0..40).map(|i| half::bf16::from_f32(i as f32 * 0.37 - 3.0).to_f32()).collect();
        let fp = |name: &str, shape: &[usize], vals: &[f32], dt: DType| {
            let mut f = WeightsFingerprint::new();
            f.add(name, shape, &f32_to_bytes(vals, dt), dt.ggml());
            f.finish()
        };
        let base = fp("w", &[5, 8], &vals, DType::F32);
        assert_eq!(base, fp("w", &[5, 8], &vals, DType::Bf16));
        assert_ne!(base, fp("v", &[5, 8], &vals, DType::F32));
        assert_ne!(base, fp("w", &[8, 5], &vals, DType::F32));
        let mut changed = vals.clone();
        changed[3] = 100.0;
        assert_ne!(base, fp("w", &[5, 8], &changed, DType::F32));
        // Values past the sampled prefix are not read.
        changed = vals.clone();
        changed[SAMPLED_ELEMS] = 100.0;
        assert_eq!(base, fp("w", &[5, 8], &changed, DType::F32));
    }
}
