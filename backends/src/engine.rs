//! A single-chip generation loop over the executor: admits requests, packs each step
//! with decode tokens first and prefill chunks after (under a token budget), samples,
//! stops, preempts by recomputation when KV blocks run out, and frees every block of a
//! finished request. The CLI's `generate` and the model tests drive it; the serving
//! runtime's batcher makes the same decisions as an actor.

use crate::error::{BackendError, Result};
use crate::kv::{KvCacheConfig, PagedKvCache, SequenceKv};
use crate::model::{LogitsWanted, Model, SeqChunk};
use crate::sampling::{Sampler, SamplingParams};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Hit max_tokens or the model's context.
    Length,
    /// Sampled a stop or end-of-sequence token.
    Stop,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: u64,
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
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

struct Sequence {
    id: u64,
    prompt_len: usize,
    /// Prompt followed by the tokens generated so far.
    tokens: Vec<u32>,
    kv: SequenceKv,
    sampler: Sampler,
    logits: Vec<f32>,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn pending(&self) -> usize {
        self.tokens.len() - self.kv.len()
    }
}

pub struct Engine {
    model: Model,
    kv: PagedKvCache,
    config: EngineConfig,
    running: Vec<Sequence>,
    finished: Vec<Completion>,
}

impl Engine {
    pub fn new(model: Model, kv_config: KvCacheConfig, config: EngineConfig) -> Result<Engine> {
        if config.max_batch_tokens == 0 || config.max_batch_seqs == 0 {
            return Err(BackendError::Request("max_batch_tokens and max_batch_seqs must be positive".into()));
        }
        let kv = PagedKvCache::new(model.device(), model.config(), kv_config)?;
        Ok(Engine { model, kv, config, running: Vec::new(), finished: Vec::new() })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    pub fn kv(&self) -> &PagedKvCache {
        &self.kv
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty()
    }

    /// Admits a request; refuses it (changing nothing) if it can never run here.
    pub fn add_request(&mut self, id: u64, prompt: &[u32], params: SamplingParams) -> Result<()> {
        params.validate()?;
        let c = self.model.config();
        if prompt.is_empty() {
            return Err(BackendError::Request("the prompt is empty".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(BackendError::Request(format!(
                "prompt token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        if prompt.len() >= c.max_context {
            return Err(BackendError::Request(format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                c.max_context
            )));
        }
        let longest = prompt.len().saturating_add(params.max_tokens).min(c.max_context);
        let blocks = longest.div_ceil(self.kv.config().block_size);
        if blocks > self.kv.allocator().capacity() {
            return Err(BackendError::Request(format!(
                "{longest} tokens need {blocks} KV blocks but the cache holds {}",
                self.kv.allocator().capacity()
            )));
        }
        if self.running.iter().any(|s| s.id == id) {
            return Err(BackendError::Request(format!("request id {id} is already running")));
        }
        self.running.push(Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt.to_vec(),
            kv: SequenceKv::default(),
            sampler: Sampler::new(params),
            logits: Vec::new(),
        });
        Ok(())
    }

    /// Drops a request and frees its blocks. Returns whether it was running.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            return false;
        };
        let mut seq = self.running.remove(i);
        self.kv.release(&mut seq.kv);
        true
    }

    /// Runs one forward step and samples where a sequence reached its end.
    pub fn step(&mut self) -> Result<StepReport> {
        // (index into running, chunk length, slots)
        let mut plan: Vec<(usize, usize, Vec<i32>)> = Vec::new();
        let mut budget = self.config.max_batch_tokens;
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        // Decode tokens first: they are latency-critical and cost one token each.
        order.sort_by_key(|&i| (self.running[i].pending() > 1, i));
        for i in order {
            if budget == 0 || plan.len() == self.config.max_batch_seqs {
                break;
            }
            let n = self.running[i].pending().min(budget);
            let need = self.kv.blocks_needed(&self.running[i].kv, n);
            if need > self.kv.allocator().free_blocks() {
                // Evict only later arrivals, and only if that can make room; otherwise
                // their KV would be thrown away for nothing.
                let evictable: usize = (i + 1..self.running.len())
                    .filter(|&j| !plan.iter().any(|p| p.0 == j))
                    .map(|j| self.running[j].kv.block_table().len())
                    .sum();
                if need > self.kv.allocator().free_blocks() + evictable {
                    continue;
                }
                while need > self.kv.allocator().free_blocks() && self.preempt_one(i, &plan) {}
            }
            let seq = &mut self.running[i];
            let (start, end) = (seq.kv.len(), seq.kv.len() + n);
            let Ok(slots) = self.kv.append(&mut seq.kv, &seq.tokens[start..end]) else { continue };
            budget -= n;
            plan.push((i, n, slots));
        }
        if plan.is_empty() {
            return Ok(StepReport::default());
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|(i, n, slots)| {
                let seq = &self.running[*i];
                let start = seq.kv.len() - n;
                let ends = seq.kv.len() == seq.tokens.len();
                SeqChunk {
                    tokens: &seq.tokens[start..seq.kv.len()],
                    start_pos: start,
                    block_table: seq.kv.block_table(),
                    slots,
                    logits: if ends { LogitsWanted::Last } else { LogitsWanted::None },
                }
            })
            .collect();
        let logits = self.model.forward(&self.kv, &chunks);
        let report_tokens = chunks.iter().map(|c| c.tokens.len()).sum();
        drop(chunks);
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // Un-append this step's tokens so a retry recomputes them.
                for (i, _, _) in &plan {
                    let seq = &mut self.running[*i];
                    self.kv.release(&mut seq.kv);
                }
                return Err(e);
            }
        };
        let vocab = self.model.config().vocab_size;
        let mut report = StepReport { seqs: plan.len(), tokens: report_tokens, sampled: Vec::new() };
        let mut row = 0;
        let mut done = Vec::new();
        for (i, _, _) in &plan {
            let seq = &mut self.running[*i];
            if seq.kv.len() != seq.tokens.len() {
                continue;
            }
            let r = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            let token = seq.sampler.sample(r);
            if self.config.keep_logits {
                seq.logits.extend_from_slice(r);
            }
            seq.tokens.push(token);
            report.sampled.push((seq.id, token));
            let params = seq.sampler.params();
            let stop = params.stop_token_ids.contains(&token)
                || (!params.ignore_eos && self.model.config().eos_token_ids.contains(&token));
            let length = seq.generated() >= params.max_tokens || seq.tokens.len() >= self.model.config().max_context;
            if stop || length {
                done.push((*i, if stop { FinishReason::Stop } else { FinishReason::Length }));
            }
        }
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (i, finish) in done {
            let mut seq = self.running.remove(i);
            self.kv.release(&mut seq.kv);
            self.finished.push(Completion {
                id: seq.id,
                prompt_tokens: seq.prompt_len,
                tokens: seq.tokens[seq.prompt_len..].to_vec(),
                finish,
                logits: seq.logits,
            });
        }
        Ok(report)
    }

    /// Frees the KV of the latest-admitted sequence that arrived after `keep` and is not
    /// in this step's plan; it will recompute its tokens later. False if none can go.
    fn preempt_one(&mut self, keep: usize, plan: &[(usize, usize, Vec<i32>)]) -> bool {
        let victim = (keep + 1..self.running.len())
            .rev()
            .find(|&j| !self.running[j].kv.is_empty() && !plan.iter().any(|p| p.0 == j));
        match victim {
            Some(j) => {
                let seq = &mut self.running[j];
                self.kv.release(&mut seq.kv);
                true
            }
            None => false,
        }
    }

    /// Completions finished so far, in finishing order.
    pub fn take_finished(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.finished)
    }

    /// Steps until every admitted request has finished.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>> {
        while self.has_work() {
            let report = self.step()?;
            if report.seqs == 0 {
                return Err(BackendError::KvCache("no sequence could be scheduled: the KV cache is too small".into()));
            }
        }
        Ok(self.take_finished())
    }
}
