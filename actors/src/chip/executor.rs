//! What a chip's worker thread runs: a loaded model over its paged KV cache, plus the
//! samplers of the sequences it serves. This is the only place an actor's plan meets
//! the device; a simulator substitutes its own `StepExecutor`.

use crate::batcher::StepPlan;
use crate::msg::{ChipInfo, SamplingSpec, StepOutcome};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;
use tessera_backends::device::{Device, DeviceConfig};
use tessera_backends::dtype::DType;
use tessera_backends::kv::{KvCacheConfig, PagedKvCache};
use tessera_backends::loader::KernelLibrary;
use tessera_backends::model::{LogitsWanted, Model, SeqChunk};
use tessera_backends::sampling::{Sampler, SamplingParams};

/// Runs step plans. Lives on a worker thread.
pub trait StepExecutor {
    fn step(&mut self, step: u64, plan: &StepPlan) -> StepOutcome;
}

/// Builds a chip's executor on its worker thread.
pub type ExecutorFactory = std::sync::Arc<dyn Fn() -> Result<(Box<dyn StepExecutor>, ChipInfo), String> + Send + Sync>;

/// How to bring up a model on a CPU-library (or plugin) device.
#[derive(Debug, Clone)]
pub struct ModelExecutorConfig {
    pub model_dir: PathBuf,
    /// None: the CPU kernel library built with Tessera.
    pub kernel_lib: Option<PathBuf>,
    pub threads: u32,
    pub memory_limit_bytes: Option<u64>,
    pub dtype: Option<DType>,
    pub kv_dtype: DType,
    pub block_size: usize,
    pub max_batch_seqs: usize,
}

/// KV memory used when a chip has no memory limit.
const DEFAULT_KV_BYTES: u64 = 256 << 20;

pub struct ModelExecutor {
    model: Model,
    kv: PagedKvCache,
    samplers: HashMap<u64, Sampler>,
}

impl ModelExecutor {
    /// Opens the device on the calling thread (the worker), loads the model and sizes
    /// the KV cache: what the memory limit leaves after the weights, or a default.
    pub fn load(config: &ModelExecutorConfig) -> Result<(ModelExecutor, ChipInfo), String> {
        let lib = match &config.kernel_lib {
            Some(path) => KernelLibrary::load(path),
            None => KernelLibrary::load_default(),
        }
        .map_err(|e| e.to_string())?;
        let device_config = DeviceConfig {
            threads: config.threads,
            memory_limit_bytes: config.memory_limit_bytes.unwrap_or(0),
            ..Default::default()
        };
        let device = Device::open(&lib, &device_config).map_err(|e| e.to_string())?;
        let model = Model::load(&config.model_dir, device, config.dtype).map_err(|e| e.to_string())?;
        let mc = model.config().clone();
        let kv_bytes = match config.memory_limit_bytes {
            // Leave an eighth of what remains for step scratch buffers.
            Some(limit) => {
                let rest = limit.checked_sub(model.weight_bytes()).ok_or_else(|| {
                    format!(
                        "the memory limit ({limit} bytes) is smaller than the model's weights ({} bytes)",
                        model.weight_bytes()
                    )
                })?;
                rest - rest / 8
            }
            None => DEFAULT_KV_BYTES,
        };
        let most_useful = (config.max_batch_seqs * mc.max_context).div_ceil(config.block_size);
        let num_blocks =
            PagedKvCache::blocks_for_bytes(&mc, config.block_size, config.kv_dtype, kv_bytes).min(most_useful);
        if num_blocks == 0 {
            return Err(format!("no memory is left for even one KV block of {} tokens", config.block_size));
        }
        let kv = PagedKvCache::new(
            model.device(),
            &mc,
            KvCacheConfig { block_size: config.block_size, num_blocks, dtype: config.kv_dtype },
        )
        .map_err(|e| e.to_string())?;
        let info = ChipInfo {
            num_blocks,
            block_size: config.block_size,
            max_context: mc.max_context,
            vocab_size: mc.vocab_size,
            eos_token_ids: mc.eos_token_ids.clone(),
        };
        Ok((ModelExecutor { model, kv, samplers: HashMap::new() }, info))
    }
}

fn sampler(spec: &SamplingSpec, skip: u64) -> Sampler {
    let mut sampler = Sampler::new(SamplingParams {
        temperature: spec.temperature,
        top_k: spec.top_k,
        top_p: spec.top_p,
        seed: spec.seed,
        max_tokens: 1,
        stop_token_ids: Vec::new(),
        ignore_eos: spec.ignore_eos,
    });
    sampler.skip(skip);
    sampler
}

impl StepExecutor for ModelExecutor {
    fn step(&mut self, step: u64, plan: &StepPlan) -> StepOutcome {
        let started = Instant::now();
        for id in &plan.drop_samplers {
            self.samplers.remove(id);
        }
        for s in &plan.seqs {
            if let Some((spec, skip)) = &s.new_sampler {
                self.samplers.insert(s.request_id, sampler(spec, *skip));
            }
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .seqs
            .iter()
            .map(|s| SeqChunk {
                tokens: &s.tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
                slots: &s.slots,
                logits: if s.sample { LogitsWanted::Last } else { LogitsWanted::None },
            })
            .collect();
        let mut outcome = StepOutcome { step, sampled: Vec::new(), error: None, elapsed_s: 0.0 };
        match self.model.forward(&self.kv, &chunks) {
            Ok(logits) => {
                let vocab = self.model.config().vocab_size;
                for (s, row) in plan.seqs.iter().filter(|s| s.sample).zip(logits.chunks_exact(vocab)) {
                    let token = match self.samplers.get_mut(&s.request_id) {
                        Some(sampler) => sampler.sample(row),
                        None => tessera_backends::sampling::argmax(row),
                    };
                    outcome.sampled.push((s.request_id, token));
                }
            }
            Err(e) => outcome.error = Some(e.to_string()),
        }
        outcome.elapsed_s = started.elapsed().as_secs_f64();
        outcome
    }
}
