//! The served model as far as cost and KV are concerned: its shape, weight bytes,
//! context and vocabulary, from a builtin preset's config or a checkpoint's (a
//! `config.json` directory or a GGUF file). Nothing is loaded but the config.

use std::path::Path;

use tessera_actors::msg::KvCompat;
use tessera_backends::config::ModelConfig;
use tessera_backends::synth::{self, Preset, SynthArch, SynthSpec};
use tessera_backends::tokenizer::TextTokenizer;
use tessera_topology::perf::ModelShape;
use tessera_topology::{ClusterSpec, DType};

/// Why the model's shape could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{topology}: `cluster.model`: unknown builtin model {model:?}: {reason}")]
    UnknownBuiltin { topology: String, model: String, reason: String },
    #[error("{topology}: `cluster.model`: cannot read the model's config: {source}")]
    Config {
        topology: String,
        #[source]
        source: tessera_backends::error::BackendError,
    },
}

/// The model every chip of the cluster serves.
#[derive(Debug, Clone, PartialEq)]
pub struct SimModel {
    pub name: String,
    pub config: ModelConfig,
    /// Bytes of all weights in the dtype they are served in.
    pub weight_bytes: u64,
}

/// The tokenizer a real gateway would use for `spec`'s model, when the checkpoint has
/// one (a `tokenizer.json` beside its config, or a GGUF file's vocabulary): the
/// simulator then tokenizes the workload's prompts as the gateway does. Builtin models
/// (generated on first use, not here) and config-only directories have none; their
/// prompts count one token a word.
pub fn tokenizer(spec: &ClusterSpec, base_dir: &Path) -> Option<TextTokenizer> {
    if spec.model.starts_with("builtin:") {
        return None;
    }
    TextTokenizer::from_dir(&base_dir.join(&spec.model)).ok()
}

impl SimModel {
    /// The model of `spec` (`builtin:*` or a checkpoint, a relative one resolved
    /// against `base_dir`); weights in `cluster.dtype`, else the preset's dtype, else
    /// 2 bytes (how checkpoints ship).
    pub fn of(spec: &ClusterSpec, base_dir: &Path) -> Result<SimModel, ModelError> {
        let (config, default_dtype, params) = match spec.model.strip_prefix("builtin:") {
            Some(name) => {
                let preset: Preset = name.parse().map_err(|reason| ModelError::UnknownBuiltin {
                    topology: spec.source.clone(),
                    model: spec.model.clone(),
                    reason,
                })?;
                // The arch the real node generates for a builtin model.
                let synth = SynthSpec::new(preset, SynthArch::Llama);
                let hf = synth::hf_config(&synth);
                let config = ModelConfig::from_hf(&hf, Path::new(&spec.model))
                    .map_err(|source| ModelError::Config { topology: spec.source.clone(), source })?;
                (config, synth.resolved_dtype(), synth::param_count(&hf))
            }
            None => {
                let dir = base_dir.join(&spec.model);
                let config = ModelConfig::from_dir(&dir)
                    .map_err(|source| ModelError::Config { topology: spec.source.clone(), source })?;
                if tessera_backends::gguf::is_model_file(&dir) {
                    // A GGUF file's weights stay in their (quantized) types on a chip:
                    // its tensors' bytes are what a step reads.
                    let gguf = tessera_backends::gguf::Gguf::open(&dir)
                        .map_err(|source| ModelError::Config { topology: spec.source.clone(), source })?;
                    let weight_bytes = gguf.tensors().iter().map(|t| gguf.tensor_bytes(t).len() as u64).sum();
                    return Ok(SimModel { name: spec.model.clone(), weight_bytes, config });
                }
                let params = checkpoint_params(&config);
                (config, DType::F16, params)
            }
        };
        let dtype = spec.dtype.unwrap_or(default_dtype);
        Ok(SimModel { name: spec.model.clone(), weight_bytes: params * dtype.size_bytes() as u64, config })
    }

    /// The cost shape of the model with a KV cache of `kv_dtype`.
    pub fn shape(&self, kv_dtype: DType) -> ModelShape {
        self.config.cost_shape(self.weight_bytes, kv_dtype)
    }

    /// What two chips must agree on to exchange KV: every chip of a simulated cluster
    /// serves this one model.
    pub fn compat(&self) -> KvCompat {
        let c = &self.config;
        let fields: Vec<(String, String)> = [
            ("model", self.name.clone()),
            ("architecture", c.arch.hf_name().to_string()),
            ("num_layers", c.num_layers.to_string()),
            ("num_heads", c.num_heads.to_string()),
            ("num_kv_heads", c.num_kv_heads.to_string()),
            ("head_dim", c.head_dim.to_string()),
            ("hidden_size", c.hidden_size.to_string()),
            ("vocab_size", c.vocab_size.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for (k, v) in &fields {
            for b in k.bytes().chain([0]).chain(v.bytes()).chain([0]) {
                hash = (hash ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        KvCompat { hash, fields }
    }
}

/// Parameters of a checkpoint from its config: every matrix (the LM head included),
/// the embedding table unless tied to the head, and the norms.
fn checkpoint_params(c: &ModelConfig) -> u64 {
    let embedding = if c.tie_word_embeddings { 0 } else { c.vocab_size * c.hidden_size };
    let norms = (2 * c.num_layers + 1) * c.hidden_size;
    (c.linear_params() + embedding + norms) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_tiny_has_the_shape_and_weight_bytes_the_perf_model_documents() {
        let spec = tessera_topology::default_topology();
        let Ok(model) = SimModel::of(&spec, Path::new(".")) else { panic!("builtin:tiny") };
        // topology/src/perf.rs: tiny is 1,000,576 parameters in f32, 2,048 KV bytes per token.
        assert_eq!(model.weight_bytes, 4_002_304);
        let shape = model.shape(DType::F32);
        assert_eq!(shape.kv_bytes_per_token(), 2048);
        assert_eq!((shape.num_layers, shape.vocab_size), (4, 1024));
        // The same estimate from the config alone, as for a checkpoint.
        assert_eq!(checkpoint_params(&model.config) * 4, model.weight_bytes);
    }

    #[test]
    fn an_unknown_builtin_names_the_topology_and_key() {
        let mut spec = tessera_topology::default_topology();
        spec.model = "builtin:huge".into();
        let Err(e) = SimModel::of(&spec, Path::new(".")) else { panic!("builtin:huge accepted") };
        let text = e.to_string();
        assert!(text.contains("cluster.model") && text.contains("huge"), "{text}");
    }
}
