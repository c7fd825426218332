//! The served model as far as cost and KV are concerned: its shape, weight bytes,
//! context and vocabulary, from a builtin preset's config or a checkpoint's (a
//! `config.json` directory or a GGUF file). Nothing is loaded but the config, so the
//! simulator and the solver can cost a model no chip of this machine could hold.

use std::path::Path;

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::BackendError;
use crate::synth::{self, Preset, SynthArch, SynthSpec};

/// Why a model's cost could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("unknown builtin model {model:?}: {reason}")]
    UnknownBuiltin { model: String, reason: String },
    #[error("cannot read the model's config: {0}")]
    Config(#[source] BackendError),
}

/// A model's config and the bytes of its weights as served.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedModel {
    pub name: String,
    pub config: ModelConfig,
    /// Bytes of all weights in the dtype they are served in.
    pub weight_bytes: u64,
}

impl ServedModel {
    /// `model` (`builtin:*` or a checkpoint, a relative one resolved against
    /// `base_dir`); weights in `dtype`, else the preset's dtype, else 2 bytes (how
    /// checkpoints ship); a GGUF file's weights in their own (quantized) types.
    pub fn read(model: &str, dtype: Option<DType>, base_dir: &Path) -> Result<ServedModel, CostError> {
        let (config, default_dtype, params) = match model.strip_prefix("builtin:") {
            Some(name) => {
                let preset: Preset =
                    name.parse().map_err(|reason| CostError::UnknownBuiltin { model: model.to_string(), reason })?;
                // The arch the real node generates for a builtin model.
                let synth = SynthSpec::new(preset, SynthArch::Llama);
                let hf = synth::hf_config(&synth);
                let config = ModelConfig::from_hf(&hf, Path::new(model)).map_err(CostError::Config)?;
                (config, synth.resolved_dtype(), synth::param_count(&hf))
            }
            None => {
                let dir = base_dir.join(model);
                let config = ModelConfig::from_dir(&dir).map_err(CostError::Config)?;
                if crate::gguf::is_model_file(&dir) {
                    // A GGUF file's weights stay in their (quantized) types on a chip:
                    // its tensors' bytes are what a step reads.
                    let gguf = crate::gguf::Gguf::open(&dir).map_err(CostError::Config)?;
                    let weight_bytes = gguf.tensors().iter().map(|t| gguf.tensor_bytes(t).len() as u64).sum();
                    return Ok(ServedModel { name: model.to_string(), weight_bytes, config });
                }
                let params = checkpoint_params(&config);
                (config, DType::F16, params)
            }
        };
        let dtype = dtype.unwrap_or(default_dtype);
        Ok(ServedModel { name: model.to_string(), weight_bytes: params * dtype.size_bytes() as u64, config })
    }

    /// The cost shape of the model with a KV cache of `kv_dtype`.
    pub fn shape(&self, kv_dtype: DType) -> tessera_perf::ModelShape {
        self.config.cost_shape(self.weight_bytes, kv_dtype)
    }
}

/// Parameters of a checkpoint from its config: every matrix (the LM head included),
/// the embedding table unless tied to the head, and the norms.
pub fn checkpoint_params(c: &ModelConfig) -> u64 {
    let embedding = if c.tie_word_embeddings { 0 } else { c.vocab_size * c.hidden_size };
    let norms = (2 * c.num_layers + 1) * c.hidden_size;
    (c.linear_params() + embedding + norms) as u64
}
