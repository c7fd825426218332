//! The served model as far as cost and KV are concerned: its shape, weight bytes,
//! context and vocabulary, from a builtin preset's config or a checkpoint's (a
//! `config.json` directory or a GGUF file). Nothing is loaded but the config.

use std::path::Path;

use tessera_actors::msg::KvCompat;
use tessera_backends::config::ModelConfig;
use tessera_backends::cost::{CostError, ServedModel};
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
    /// against `base_dir`), as [`ServedModel::read`] costs it.
    pub fn of(spec: &ClusterSpec, base_dir: &Path) -> Result<SimModel, ModelError> {
        let topology = spec.source.clone();
        let served = ServedModel::read(&spec.model, spec.dtype, base_dir).map_err(|e| match e {
            CostError::UnknownBuiltin { model, reason } => ModelError::UnknownBuiltin { topology, model, reason },
            CostError::Config(source) => ModelError::Config { topology, source },
        })?;
        Ok(SimModel { name: served.name, config: served.config, weight_bytes: served.weight_bytes })
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
        assert_eq!(tessera_backends::cost::checkpoint_params(&model.config) * 4, model.weight_bytes);
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
