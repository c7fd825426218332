//! `tessera calibrate`: measures a real chip of a topology — its model loaded on its
//! kernel library, as `tessera up` would — over a grid of step shapes (prefill chunks
//! of growing length, decode batches of growing size at several contexts), and fits its
//! performance model (`tessera_perf::fit`). The file it writes is what a scenario's
//! `[perf_models]` names, so that the simulator times that kind of chip as measured.
//!
//! Shapes run from small to large, each once to warm up and then `repeats` times (the
//! median counts), until the grid is done or the time budget is spent. Each step is a
//! real forward pass with sampling, on a KV cache sized as the chip's; a decode step at
//! context `c` attends over `c` positions of the cache (their contents do not change
//! its time).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tessera_actor_core::JobCtx;
use tessera_actors::batcher::{PlannedSeq, StepPlan};
use tessera_actors::chip::executor::StepExecutor;
use tessera_actors::msg::Msg;
use tessera_chip_executor::{ModelExecutor, model_shape};
use tessera_topology::perf::fit::{self, Fit, Sample};
use tessera_topology::perf::{ModelShape, StepShape, roofline};
use tessera_topology::{Backend, ClusterSpec};

use crate::{NodeError, executor_config, resolve_model};

/// What to calibrate and how long to spend.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// The chip's id in the topology.
    pub chip: String,
    /// Stop measuring new shapes after this long (the fit and the shapes measured so far
    /// are kept).
    pub budget: Duration,
    /// Timed runs of each shape after one warm-up run; the median counts.
    pub repeats: usize,
    /// The kernel library for a `cpu` chip (default: the one built with us).
    pub kernel_lib: Option<PathBuf>,
}

/// One shape: what it was, what it took, what the fitted model predicts.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub what: String,
    pub step: StepShape,
    pub measured_s: f64,
    pub predicted_s: f64,
}

/// A chip's calibration.
#[derive(Debug, Clone)]
pub struct Calibration {
    pub chip: String,
    pub kind: String,
    pub model: String,
    pub shape: ModelShape,
    pub measured: Vec<Measured>,
    pub fit: Fit,
    /// Whether the time budget ran out before the grid was done.
    pub cut_short: bool,
}

impl Calibration {
    /// The performance model file a scenario's `[perf_models]` and a topology's
    /// `[emulation.perf_models]` read: the fitted model, after comments saying where it
    /// comes from and how well it fits.
    pub fn to_toml(&self) -> String {
        let mut out = format!(
            "# Performance model of chip kind `{}`, measured on chip {} with model {} by `tessera calibrate`\n\
             # ({} shapes; fit error median {:.1}%, max {:.1}%{}).\n\
             # Fitted against {} bytes of weights read per step and {} bytes of KV per token.\n\
             # Name it in a scenario ([perf_models] {} = \"THIS FILE\") or a topology\n\
             # ([emulation.perf_models] {} = \"THIS FILE\").\n",
            self.kind,
            self.chip,
            self.model,
            self.measured.len(),
            self.fit.median_error * 100.0,
            self.fit.max_error * 100.0,
            if self.cut_short { "; the time budget cut the grid short" } else { "" },
            self.shape.weight_bytes,
            self.shape.kv_bytes_per_token(),
            self.kind,
            self.kind,
        );
        // Plain numbers and tables: serializing cannot fail.
        out += &toml::to_string(&self.fit.model).unwrap_or_default();
        out
    }

    /// The shapes, measured against predicted, as a table.
    pub fn table(&self) -> String {
        let mut out = format!("{:<28} {:>12} {:>12} {:>8}\n", "step", "measured ms", "fitted ms", "error");
        for m in &self.measured {
            out += &format!(
                "{:<28} {:>12.3} {:>12.3} {:>+7.1}%\n",
                m.what,
                m.measured_s * 1e3,
                m.predicted_s * 1e3,
                (m.predicted_s / m.measured_s - 1.0) * 100.0
            );
        }
        out
    }
}

/// A job context for steps run outside any host: nothing to pace, nobody to notify.
struct Bench;

impl JobCtx<Msg> for Bench {
    fn elapse(&mut self, _: Duration) {}
    fn notify_at(&mut self, _: Duration, _: Msg) {}
}

/// Calibrates chip `opts.chip` of `spec`, calling `progress` with each shape measured.
pub fn calibrate(
    spec: &ClusterSpec,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(&Measured),
) -> Result<Calibration, NodeError> {
    let chip = spec.chips().map(|(_, _, c)| c).find(|c| c.id == opts.chip).ok_or_else(|| {
        let ids: Vec<&str> = spec.chips().map(|(_, _, c)| c.id.as_str()).collect();
        NodeError::Config(format!("{}: no chip `{}`; chips: {}", spec.source, opts.chip, ids.join(", ")))
    })?;
    if let Backend::Emu(kind) = &chip.backend {
        return Err(NodeError::Config(format!(
            "chip {} is emulated (`emu:{kind}`): its steps are paced to the roofline, not measured; calibrate a \
             chip with backend \"cpu\" or \"plugin:PATH\"",
            chip.id
        )));
    }
    let kind = spec
        .chip_kind(&chip.kind)
        .ok_or_else(|| NodeError::Config(format!("chip {}: unknown chip kind `{}`", chip.id, chip.kind)))?;
    let model_dir = resolve_model(&spec.model)?;
    let config = executor_config(spec, chip, &model_dir, opts.kernel_lib.clone(), None)?;
    let (mut exec, info) =
        ModelExecutor::load(&config).map_err(|e| NodeError::Config(format!("chip {}: {e}", chip.id)))?;
    let shape = model_shape(exec.model(), chip.kv_dtype);
    let max_context = info.max_context;

    let started = Instant::now();
    let mut samples = Vec::new();
    let mut measured = Vec::new();
    let mut cut_short = false;
    for (what, plan) in grid(chip.max_batch_tokens, chip.max_batch_seqs, max_context, info.block_size, info.num_blocks)
    {
        if started.elapsed() >= opts.budget {
            cut_short = true;
            break;
        }
        let repeats = opts.repeats.max(1);
        let mut times = Vec::with_capacity(repeats);
        for run in 0..=repeats {
            let t = Instant::now();
            let outcome = exec.step(run as u64, &plan, &mut Bench);
            if let Some(e) = outcome.error {
                return Err(NodeError::Config(format!("chip {}: step {what} failed: {e}", chip.id)));
            }
            if run > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let seconds = times[times.len() / 2];
        let m = Measured { what, step: plan.shape(), measured_s: seconds, predicted_s: 0.0 };
        progress(&m);
        samples.push(Sample { step: m.step.clone(), seconds });
        measured.push(m);
    }
    let fit =
        fit::fit(kind.roof(), &shape, &samples).map_err(|e| NodeError::Config(format!("chip {}: {e}", chip.id)))?;
    for m in &mut measured {
        m.predicted_s = roofline(kind.roof(), &shape, &m.step, &fit.model, 1.0).unscaled_s;
    }
    Ok(Calibration {
        chip: chip.id.clone(),
        kind: kind.name.clone(),
        model: spec.model.clone(),
        shape,
        measured,
        fit,
        cut_short,
    })
}

/// The shapes to measure, small to large: single prefills of 16 tokens up to the
/// batch's token limit, then decode batches of 1 up to the sequence limit at contexts
/// from 64 tokens up to the model's, each within the KV cache.
fn grid(
    max_tokens: usize,
    max_seqs: usize,
    max_context: usize,
    block_size: usize,
    num_blocks: usize,
) -> Vec<(String, StepPlan)> {
    let fits = |seqs: usize, context: usize| seqs * context.div_ceil(block_size) <= num_blocks;
    let mut plans = Vec::new();
    let doubling =
        |from: usize, to: usize| std::iter::successors(Some(from), |n| Some(n * 2)).take_while(move |n| *n <= to);
    for tokens in doubling(16, max_tokens.min(max_context)) {
        if fits(1, tokens) {
            plans.push((format!("prefill {tokens}"), plan(&[(tokens, tokens)], block_size)));
        }
    }
    for context in doubling(64, max_context).step_by(2) {
        for seqs in doubling(1, max_seqs) {
            if fits(seqs, context) {
                let seq = vec![(1, context); seqs];
                plans.push((format!("decode {seqs} x ctx {context}"), plan(&seq, block_size)));
            }
        }
    }
    plans
}

/// A step of sequences `(new tokens, context after the step)` over consecutive blocks.
fn plan(seqs: &[(usize, usize)], block_size: usize) -> StepPlan {
    let mut next_block = 0u32;
    let seqs = seqs
        .iter()
        .enumerate()
        .map(|(i, &(new, context))| {
            let blocks = context.div_ceil(block_size) as u32;
            let block_table: Vec<u32> = (next_block..next_block + blocks).collect();
            next_block += blocks;
            let start_pos = context - new;
            let slots = (start_pos..context)
                .map(|pos| (block_table[pos / block_size] as usize * block_size + pos % block_size) as i32)
                .collect();
            PlannedSeq {
                request_id: i as u64,
                tokens: (0..new).map(|t| (t % 100 + 1) as u32).collect(),
                start_pos,
                block_table: block_table.into(),
                slots,
                sample: true,
                new_sampler: None,
                score: None,
                stage: false,
                stage_from: 0,
                forks: Vec::new(),
            }
        })
        .collect();
    StepPlan { seqs, drop_samplers: Vec::new(), copies: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_grows_within_the_batch_limits_and_the_cache() {
        let shapes = grid(512, 8, 2048, 16, 300);
        let names: Vec<&str> = shapes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            &names[..6],
            ["prefill 16", "prefill 32", "prefill 64", "prefill 128", "prefill 256", "prefill 512"]
        );
        assert!(names.contains(&"decode 8 x ctx 64") && names.contains(&"decode 4 x ctx 1024"));
        // 8 x 1024 tokens need 512 blocks of 16, more than the cache's 300.
        assert!(!names.contains(&"decode 8 x ctx 1024"));
        for (name, plan) in &shapes {
            let blocks: Vec<u32> = plan.seqs.iter().flat_map(|s| s.block_table.iter().copied()).collect();
            assert!(blocks.iter().all(|b| (*b as usize) < 300), "{name}");
            let mut distinct = blocks.clone();
            distinct.dedup();
            assert_eq!(distinct.len(), blocks.len(), "{name}: blocks shared");
            for s in &plan.seqs {
                assert_eq!(s.slots.len(), s.tokens.len());
                let last = s.start_pos + s.tokens.len() - 1;
                assert_eq!(s.slots.last().copied(), Some((s.block_table[last / 16] as usize * 16 + last % 16) as i32));
            }
        }
    }
}
