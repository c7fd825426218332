//! A single-chip generation loop with no actors around it (`tessera generate`, the model
//! tests): the chip's own `Batcher` plans each step over the chip's own `KvPool`, the
//! `ModelExecutor` runs it and samples, and the batcher applies the sampled tokens —
//! the very `plan` / `StepExecutor::step` / `complete` calls the chip actor makes, run
//! synchronously on the calling thread. Scheduling (token budget, chunked prefill,
//! decode first, preemption by recompute), stop and length decisions and block
//! bookkeeping therefore exist once, in `tessera-actors`.
//!
//! Invariant: when no request is left (finished, aborted, or ended by a failed step),
//! the pool is all-free.

use std::collections::BTreeMap;
use std::time::Duration;

use tessera_actors::batcher::{Batcher, BatcherLimits, Inadmissible, admissible};
use tessera_actors::chip::executor::StepExecutor;
use tessera_actors::kv::KvPool;
use tessera_actors::msg::{ChipInfo, Delivery, Finish, Msg, SamplingSpec, SeqRequest};
use tessera_backends::config::ModelConfig;
use tessera_backends::error::BackendError;
use tessera_backends::instance::{InstanceSpec, StepTiming};
use tessera_backends::kv::KvCacheConfig;
use tessera_backends::model::Model;
use tessera_backends::sampling::SamplingParams;
use tessera_runtime::actor::JobCtx;
use tessera_runtime::{Addr, HostId};

use crate::ModelExecutor;

/// Limits of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens one forward step may carry (decode tokens + prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences one step may carry.
    pub max_batch_seqs: usize,
    /// Keep the logits row each token was sampled from (for `--dump-logits`).
    pub keep_logits: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_batch_tokens: 2048, max_batch_seqs: 256, keep_logits: false }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("max_batch_tokens and max_batch_seqs must be positive")]
    Limits,
    /// The model or its KV cache could not be set up.
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Sampling(#[from] BackendError),
    #[error(transparent)]
    Inadmissible(#[from] Inadmissible),
    #[error("request id {0} is already running")]
    Duplicate(u64),
    /// Every request was ended and its blocks freed.
    #[error("a forward step failed: {0}")]
    Step(String),
    #[error("no sequence could be scheduled: the KV cache is too small")]
    Stuck,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: u64,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub finish: Finish,
    /// `tokens.len()` rows of `vocab_size` logits when `keep_logits` is on.
    pub logits: Vec<f32>,
}

/// What one step did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    pub seqs: usize,
    pub tokens: usize,
    /// (request id, sampled token) for every sequence that sampled this step.
    pub sampled: Vec<(u64, u32)>,
}

/// A request's output so far.
struct Output {
    prompt_tokens: usize,
    tokens: Vec<u32>,
    logits: Vec<f32>,
}

/// The job context of a step run in place: there is no host to pace it or to post to.
/// A local chip never emulates another (no model time to declare) and never prefills
/// for a decode chip (nothing staged to announce).
struct InPlace;

impl JobCtx<Msg> for InPlace {
    fn elapse(&mut self, _: Duration) {}

    fn notify_at(&mut self, _: Duration, _: Msg) {}
}

pub struct LocalEngine {
    exec: ModelExecutor,
    info: ChipInfo,
    batcher: Batcher,
    pool: KvPool,
    /// Requests not finished yet, by id.
    outputs: BTreeMap<u64, Output>,
    finished: Vec<Completion>,
    steps: u64,
}

/// Who the batcher's sequences answer to: nobody, locally.
const LOCAL: Addr = Addr::new(HostId(0), 0);

impl LocalEngine {
    /// An engine running `model` over a cache of `kv`.
    pub fn new(model: Model, kv: KvCacheConfig, config: EngineConfig) -> Result<LocalEngine, EngineError> {
        if config.max_batch_tokens == 0 || config.max_batch_seqs == 0 {
            return Err(EngineError::Limits);
        }
        let built = ModelExecutor::local(model, kv).map_err(EngineError::Setup)?;
        Self::over(built, config)
    }

    /// An engine running a model instance across several devices (pipeline stages,
    /// tensor-parallel ranks): the same batcher, pool and sampling over its forward passes.
    pub fn instance(spec: &InstanceSpec, config: EngineConfig) -> Result<LocalEngine, EngineError> {
        if config.max_batch_tokens == 0 || config.max_batch_seqs == 0 {
            return Err(EngineError::Limits);
        }
        let built = ModelExecutor::instance(spec, "local").map_err(EngineError::Setup)?;
        Self::over(built, config)
    }

    fn over(built: (ModelExecutor, ChipInfo), config: EngineConfig) -> Result<LocalEngine, EngineError> {
        let (mut exec, info) = built;
        exec.keep_logits(config.keep_logits);
        let limits = BatcherLimits {
            max_batch_tokens: config.max_batch_tokens,
            max_batch_seqs: config.max_batch_seqs,
            block_size: info.block_size,
            max_context: info.max_context,
        };
        Ok(LocalEngine {
            batcher: Batcher::new(limits, info.eos_token_ids.clone()),
            pool: KvPool::new(LOCAL, info.num_blocks, info.block_size),
            exec,
            info,
            outputs: BTreeMap::new(),
            finished: Vec::new(),
            steps: 0,
        })
    }

    /// The model, when it is whole on one device.
    pub fn model(&self) -> Option<&Model> {
        self.exec.model()
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        self.exec.config()
    }

    /// On an instance across several devices: where its steps' time went, and its
    /// number of stages.
    pub fn instance_timing(&self) -> Option<(StepTiming, usize)> {
        self.exec.instance_timing()
    }

    /// The chip's KV pool (every block free once no request is left).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn has_work(&self) -> bool {
        self.batcher.has_work()
    }

    /// Admits a request; refuses it (changing nothing) if it can never run here.
    pub fn add_request(&mut self, id: u64, prompt: &[u32], params: SamplingParams) -> Result<(), EngineError> {
        params.validate()?;
        let SamplingParams { temperature, top_k, top_p, seed, max_tokens, stop_token_ids, ignore_eos, penalties } =
            params;
        let sampling = SamplingSpec {
            temperature,
            top_k,
            top_p,
            seed,
            stop_token_ids,
            ignore_eos,
            logprobs: None,
            presence_penalty: penalties.presence,
            frequency_penalty: penalties.frequency,
            repetition_penalty: penalties.repetition,
            logit_bias: penalties.logit_bias,
            min_tokens: penalties.min_tokens,
            prompt_logprobs: None,
            grammar: None,
        };
        let seq = SeqRequest {
            request_id: id,
            req: LOCAL,
            tokens: prompt.to_vec(),
            generated: 0,
            max_new_tokens: max_tokens,
            sampling,
            delivery: Delivery::Stream,
            forks: Vec::new(),
            cache_salt: None,
            share: Default::default(),
        };
        let need = self.batcher.blocks_to_finish(&seq);
        admissible(&seq, self.info.vocab_size, self.info.max_context, need, self.pool.capacity())?;
        if self.batcher.contains(id) {
            return Err(EngineError::Duplicate(id));
        }
        self.outputs.insert(id, Output { prompt_tokens: prompt.len(), tokens: Vec::new(), logits: Vec::new() });
        self.batcher.enqueue(seq);
        Ok(())
    }

    /// Drops a request and frees its blocks. Returns whether it was running.
    pub fn abort(&mut self, id: u64) -> bool {
        self.outputs.remove(&id);
        self.batcher.abort(id, &mut self.pool).is_some()
    }

    /// Runs one forward step (planned by the batcher) and samples where a sequence
    /// reached its end. A failed step ends every request and frees its blocks, as a
    /// chip whose step fails hands its sequences back.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let Some(plan) = self.batcher.plan(&mut self.pool) else {
            return if self.has_work() { Err(EngineError::Stuck) } else { Ok(StepReport::default()) };
        };
        self.steps += 1;
        let outcome = self.exec.step(self.steps, &plan, &mut InPlace);
        if let Some(error) = outcome.error {
            self.batcher.evict_all(Some(&mut self.pool));
            // Blocks sealed for the failed step may never have been written.
            self.pool.drop_cached();
            self.exec.forget_samplers();
            self.exec.take_logits();
            self.outputs.clear();
            return Err(EngineError::Step(error));
        }
        for (id, row) in self.exec.take_logits() {
            if let Some(out) = self.outputs.get_mut(&id) {
                out.logits.extend_from_slice(&row);
            }
        }
        for e in self.batcher.complete(&outcome.sampled, &outcome.logprobs, &mut self.pool) {
            let Some(out) = self.outputs.get_mut(&e.request_id) else { continue };
            out.tokens.extend_from_slice(&e.tokens);
            if let Some(finish) = e.finish
                && let Some(out) = self.outputs.remove(&e.request_id)
            {
                let Output { prompt_tokens, tokens, logits } = out;
                self.finished.push(Completion { id: e.request_id, prompt_tokens, tokens, finish, logits });
            }
        }
        Ok(StepReport { seqs: plan.seqs.len(), tokens: plan.tokens(), sampled: outcome.sampled })
    }

    /// Completions finished so far, in finishing order.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    /// Steps until every admitted request has finished.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>, EngineError> {
        while self.has_work() {
            self.step()?;
        }
        Ok(self.take_finished())
    }
}
