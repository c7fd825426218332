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
//!
//! `--from-steps` fits the same model to the steps a chip kind ran while serving instead
//! (`calibrate_from_steps`), read from the chips' step trace events in a `tessera up`
//! log.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tessera_actor_core::JobCtx;
use tessera_actors::batcher::{PlannedSeq, StepPlan};
use tessera_actors::chip::STEP_TRACE;
use tessera_actors::chip::executor::StepExecutor;
use tessera_actors::msg::{ChipInfo, Msg};
use tessera_chip_executor::ModelExecutor;
use tessera_topology::perf::fit::{self, Fit, Sample};
use tessera_topology::perf::{ModelShape, SeqStep, StepShape, roofline};
use tessera_topology::{Backend, ChipKind, ChipSpec, ClusterSpec};

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
    /// How many steps it stands for in the fit: 1 for a grid shape (the median of its
    /// runs), the class's size for served steps.
    pub steps: usize,
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
    /// The chips whose served steps it was fitted to; empty for a measured grid.
    pub served_by: Vec<String>,
    /// An emulated chip's time scale (its steps were fitted divided by it), else 1.
    pub time_scale: f64,
}

impl Calibration {
    /// The performance model file a scenario's `[perf_models]` and a topology's
    /// `[emulation.perf_models]` read: the fitted model, after comments saying where it
    /// comes from and how well it fits.
    pub fn to_toml(&self) -> String {
        let (origin, shapes) = if self.served_by.is_empty() {
            (format!("measured on chip {}", self.chip), format!("{} shapes", self.measured.len()))
        } else {
            let steps: usize = self.measured.iter().map(|m| m.steps).sum();
            let scaled = if self.time_scale != 1.0 {
                format!(
                    " (emulated: their times divided by the time scale, {}, so that a chip paced by this \n\
                     # model at that scale takes what they took, this machine's overruns included)",
                    self.time_scale
                )
            } else {
                String::new()
            };
            (
                format!("fitted from the steps chips {} ran serving{scaled}", self.served_by.join(", ")),
                format!("{steps} steps in {} classes", self.measured.len()),
            )
        };
        let mut out = format!(
            "# Performance model of chip kind `{}`, {origin} with model {} by `tessera calibrate`\n\
             # ({shapes}; fit error median {:.1}%, max {:.1}%{}).\n\
             # Fitted against {} bytes of weights read per step and {} bytes of KV per token.\n\
             # Name it in a scenario ([perf_models] {} = \"THIS FILE\") or a topology\n\
             # ([emulation.perf_models] {} = \"THIS FILE\").\n",
            self.kind,
            self.model,
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
                m.measured_s * self.time_scale * 1e3,
                m.predicted_s * self.time_scale * 1e3,
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
    let Loaded { chip, kind, mut exec, info, shape } = load(spec, &opts.chip, opts.kernel_lib.clone(), false)?;
    let max_context = info.max_context;

    let started = Instant::now();
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
        let m = Measured { what, step: plan.shape(), measured_s: seconds, predicted_s: 0.0, steps: 1 };
        progress(&m);
        measured.push(m);
    }
    fitted(spec, chip, kind, shape, measured, cut_short, Vec::new())
}

/// The chip `id` of `spec` with its model loaded on its kernel library, as `up` would.
struct Loaded<'a> {
    chip: &'a ChipSpec,
    kind: &'a ChipKind,
    exec: ModelExecutor,
    info: ChipInfo,
    shape: ModelShape,
}

/// An emulated chip only with `emulated_too` (its served steps can be fitted, not a grid).
fn load<'a>(
    spec: &'a ClusterSpec,
    id: &str,
    kernel_lib: Option<PathBuf>,
    emulated_too: bool,
) -> Result<Loaded<'a>, NodeError> {
    let chip = spec.chips().map(|(_, _, c)| c).find(|c| c.id == id).ok_or_else(|| {
        let ids: Vec<&str> = spec.chips().map(|(_, _, c)| c.id.as_str()).collect();
        NodeError::Config(format!("{}: no chip `{id}`; chips: {}", spec.source, ids.join(", ")))
    })?;
    if let Backend::Emu(kind) = &chip.backend
        && !emulated_too
    {
        return Err(NodeError::Config(format!(
            "chip {} is emulated (`emu:{kind}`): its steps are paced to the roofline, not measured; calibrate a \
             chip with backend \"cpu\" or \"plugin:PATH\", or an emulated one from the steps it served \
             (--from-steps)",
            chip.id
        )));
    }
    let kind = spec
        .chip_kind(&chip.kind)
        .ok_or_else(|| NodeError::Config(format!("chip {}: unknown chip kind `{}`", chip.id, chip.kind)))?;
    let model_dir = resolve_model(&spec.model)?;
    let config = executor_config(spec, chip, &model_dir, kernel_lib, None, None)?;
    let (exec, info) = ModelExecutor::load(&config).map_err(|e| NodeError::Config(format!("chip {}: {e}", chip.id)))?;
    let shape = exec.cost_shape();
    Ok(Loaded { chip, kind, exec, info, shape })
}

/// Fit `kind`'s model to `measured` and fill in each shape's prediction.
fn fitted(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    kind: &ChipKind,
    shape: ModelShape,
    mut measured: Vec<Measured>,
    cut_short: bool,
    served_by: Vec<String>,
) -> Result<Calibration, NodeError> {
    let samples: Vec<Sample> = measured
        .iter()
        .map(|m| Sample { step: m.step.clone(), seconds: m.measured_s, weight: m.steps as f64 })
        .collect();
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
        served_by,
        time_scale: 1.0,
    })
}

/// Calibrate chip `id`'s kind from the steps its chips ran while serving: the
/// `tessera::steps` trace events (`STEP_TRACE`) of every chip of that kind in `log`, a
/// `tessera up` log written with `TESSERA_LOG=info,tessera::steps=trace`. Unlike the
/// grid, these steps ran beside everything a serving host does (the other chips, the
/// gateway, the bus, the load), at the shapes the workload makes. Steps are grouped
/// into classes of like shape (prefill by tokens and sequences, decode by batch and
/// context, each on a scale of 2^(1/4)), each class as one step of its members' mean
/// time, weighing as many steps as it holds. A step's time is its span (`span_s`): from
/// the chip handing it to its worker to reading the result, the dispatch included.
pub fn calibrate_from_steps(
    spec: &ClusterSpec,
    id: &str,
    log: &str,
    kernel_lib: Option<PathBuf>,
) -> Result<Calibration, NodeError> {
    let Loaded { chip, kind, shape, .. } = load(spec, id, kernel_lib, true)?;
    // An emulated chip's steps took their paced time or, where this machine computes
    // slower than the pace, longer: fitted at 1/time_scale, the model paced at that
    // scale takes what the chip took.
    let scale = tessera_actors::solver::time_scale(spec, &chip.backend);
    let chips: Vec<&str> =
        spec.chips().map(|(_, _, c)| c).filter(|c| c.kind == chip.kind).map(|c| c.id.as_str()).collect();
    let steps = served_steps(log, &chips);
    let served_by =
        chips.iter().enumerate().filter(|(i, _)| steps.iter().any(|(c, _)| c == i)).map(|(_, c)| c.to_string());
    let served_by: Vec<String> = served_by.collect();
    let steps: Vec<Sample> = steps.into_iter().map(|(_, s)| Sample { seconds: s.seconds / scale, ..s }).collect();
    let measured = step_classes(&steps);
    let has = |prefill: bool| measured.iter().any(|m| m.step.is_prefill() == prefill);
    if !has(true) || !has(false) {
        let missing = if measured.is_empty() {
            "no steps"
        } else if has(true) {
            "no decode steps"
        } else {
            "no prefill steps"
        };
        return Err(NodeError::Config(format!(
            "the log holds {missing} of chips {} (kind `{}`); a calibration needs both phases. Serve a workload with \
             `TESSERA_LOG=info,{STEP_TRACE}=trace tessera up ...` and pass that log",
            chips.join(", "),
            chip.kind
        )));
    }
    let mut calibration = fitted(spec, chip, kind, shape, measured, false, served_by)?;
    calibration.time_scale = scale;
    Ok(calibration)
}

/// The steps of `chips` in a log, each with its chip's index in `chips`: each `step
/// planned` event's shape joined with the `step done` event of the same chip and step
/// that follows it. Lines that are not step events, and steps that never finished or
/// took no time, are passed over.
pub fn served_steps(log: &str, chips: &[&str]) -> Vec<(usize, Sample)> {
    let mut planned: HashMap<(String, u64), StepShape> = HashMap::new();
    let mut steps = Vec::new();
    for line in log.lines() {
        let line = strip_ansi(line);
        if !line.contains(STEP_TRACE) {
            continue;
        }
        let field =
            |name: &str| line.split_whitespace().find_map(|w| w.strip_prefix(name).and_then(|w| w.strip_prefix('=')));
        let (Some(chip), Some(step)) = (field("chip"), field("step").and_then(|s| s.parse::<u64>().ok())) else {
            continue;
        };
        let Some(index) = chips.iter().position(|c| *c == chip) else {
            continue;
        };
        if line.contains("step planned") {
            if let Some(shape) = field("shape").and_then(parse_shape) {
                planned.insert((chip.to_string(), step), shape);
            }
        } else if line.contains("step done") {
            // The step as its chip waited for it; a log without spans has model times.
            let seconds = field("span_s").or_else(|| field("elapsed_s")).and_then(|s| s.parse::<f64>().ok());
            if let (Some(shape), Some(seconds)) = (planned.remove(&(chip.to_string(), step)), seconds)
                && seconds.is_finite()
                && seconds > 0.0
                && shape.tokens() > 0
            {
                steps.push((index, Sample::new(shape, seconds)));
            }
        }
    }
    steps
}

/// `new:context,new:context,...`, as the chip writes a step's shape.
fn parse_shape(text: &str) -> Option<StepShape> {
    let seqs = text
        .split(',')
        .map(|seq| {
            let (new, context) = seq.split_once(':')?;
            Some(SeqStep { new_tokens: new.parse().ok()?, context: context.parse().ok()? })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(StepShape { seqs })
}

/// `line` without terminal colour codes (`ESC [ ... letter`), which a log written by a
/// terminal-minded formatter carries.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Steps grouped by like shape, each class as one step of its mean time, named with its
/// shape and how many steps it holds; prefill classes first, then decode, each by size.
fn step_classes(steps: &[Sample]) -> Vec<Measured> {
    // A class: phase (prefill first), sequences, then tokens (prefill) or mean context
    // (decode) on a scale of 2^(1/4).
    let bucket = |n: usize| ((n.max(1) as f64).log2() * 4.0).floor() as u32;
    let contexts = |step: &StepShape| step.seqs.iter().map(|q| q.context).sum::<usize>();
    let mut classes: BTreeMap<(bool, usize, u32), Vec<&Sample>> = BTreeMap::new();
    for s in steps {
        let seqs = s.step.seqs.len();
        let key = if s.step.is_prefill() {
            (false, seqs, bucket(s.step.tokens()))
        } else {
            (true, seqs, bucket(contexts(&s.step) / seqs.max(1)))
        };
        classes.entry(key).or_default().push(s);
    }
    classes
        .into_values()
        .map(|mut members| {
            // The class's shape is its median member's by size; its time, the mean of
            // its members' (what a run of such steps adds up to, outliers included).
            members.sort_by_key(|s| (s.step.tokens(), contexts(&s.step)));
            let step = &members[members.len() / 2].step;
            let mean_s = members.iter().map(|s| s.seconds).sum::<f64>() / members.len() as f64;
            let what = if step.is_prefill() {
                format!("prefill {} tok x {} ({})", step.tokens(), step.seqs.len(), members.len())
            } else {
                format!("decode {} x ctx {} ({})", step.seqs.len(), contexts(step) / step.seqs.len(), members.len())
            };
            Measured { what, step: step.clone(), measured_s: mean_s, predicted_s: 0.0, steps: members.len() }
        })
        .collect()
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

    /// What the chip's trace events look like in a log, colours included.
    fn event(chip: &str, step: u64, fields: &str, what: &str) -> String {
        format!(
            "\u{1b}[2m2026-12-02T12:21:46.965742Z\u{1b}[0m \u{1b}[35mTRACE\u{1b}[0m \u{1b}[2m{STEP_TRACE}\u{1b}[0m\u{1b}[2m:\u{1b}[0m \
             {what} \u{1b}[3mchip\u{1b}[0m\u{1b}[2m=\u{1b}[0m{chip} \u{1b}[3mstep\u{1b}[0m\u{1b}[2m=\u{1b}[0m{step} {fields}"
        )
    }

    #[test]
    fn served_steps_join_each_plan_with_its_result() {
        let log = [
            event("a", 1, "shape=40:40", "step planned"),
            event("b", 1, "shape=1:41,1:90", "step planned"),
            "2026-12-02T12:21:47Z  INFO tessera: an unrelated line with step=1 chip=a".to_string(),
            event("c", 1, "shape=1:7", "step planned"), // not a chip asked for
            event("c", 1, "elapsed_s=0.5 span_s=0.5", "step done"),
            event("b", 1, "elapsed_s=0.012 span_s=0.0125", "step done"),
            event("a", 1, "elapsed_s=0.25 span_s=0.2504", "step done"),
            event("a", 2, "elapsed_s=0.01", "step done"), // no plan seen
            event("a", 3, "shape=1:41", "step planned"),
            event("a", 3, "elapsed_s=0.011", "step done"), // an older log: no span
            event("a", 4, "shape=oops", "step planned"),
            event("a", 4, "elapsed_s=0.01 span_s=0.01", "step done"),
            event("a", 5, "shape=1:42", "step planned"),
            event("a", 5, "elapsed_s=NaN span_s=NaN", "step done"),
            event("a", 6, "shape=1:43", "step planned"), // never finished
        ]
        .join("\n");
        let steps = served_steps(&log, &["a", "b"]);
        let seq = |new_tokens, context| SeqStep { new_tokens, context };
        let want = vec![
            (1, Sample::new(StepShape { seqs: vec![seq(1, 41), seq(1, 90)] }, 0.0125)),
            (0, Sample::new(StepShape { seqs: vec![seq(40, 40)] }, 0.2504)),
            (0, Sample::new(StepShape { seqs: vec![seq(1, 41)] }, 0.011)),
        ];
        assert_eq!(steps, want);
    }

    /// An emulated chip's served steps (paced: a step takes its roofline times the time
    /// scale, or longer) fit a model that, paced at that scale, takes what they took.
    #[test]
    fn an_emulated_chip_is_fitted_to_its_steps_at_its_time_scale() {
        let spec = tessera_topology::default_topology();
        let Some(kind) = spec.chip_kind("ascend-910b") else { panic!("in the catalog") };
        let Ok(model) = tessera_backends::cost::ServedModel::read(&spec.model, spec.dtype, std::path::Path::new("."))
        else {
            panic!("builtin:tiny's config")
        };
        let served = model.shape(tessera_topology::DType::F32);
        let shapes: Vec<StepShape> = [16, 64, 256, 512]
            .iter()
            .map(|&n| StepShape { seqs: vec![SeqStep { new_tokens: n, context: n }] })
            .chain([1, 4, 16, 32].iter().flat_map(|&b| [64, 512].map(|ctx| StepShape::decode(b, ctx))))
            .collect();
        let scale = spec.emulation.time_scale;
        let paced = |step: &StepShape| spec.emulation.roofline(kind, &served, step).time_s;
        let mut log = Vec::new();
        for (i, step) in shapes.iter().enumerate() {
            let shape: Vec<String> = step.seqs.iter().map(|s| format!("{}:{}", s.new_tokens, s.context)).collect();
            let t = paced(step);
            log.push(event("h0-ascend0", i as u64 + 1, &format!("shape={}", shape.join(",")), "step planned"));
            log.push(event("h0-ascend0", i as u64 + 1, &format!("elapsed_s={t} span_s={t}"), "step done"));
        }
        let calibration = match calibrate_from_steps(&spec, "h0-ascend0", &log.join("\n"), None) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(calibration.time_scale, scale);
        for m in &calibration.measured {
            // Stored at 1/scale, fitted there; shown at the chip's own pace.
            let error = m.predicted_s / m.measured_s - 1.0;
            assert!(error.abs() < 0.25, "{}: {:.3} ms against {:.3}", m.what, m.predicted_s * 1e3, m.measured_s * 1e3);
            assert!(m.measured_s * scale > 1e-4, "{}: not at the chip's pace", m.what);
        }
        assert!(calibration.table().contains("decode 32 x ctx 512"), "{}", calibration.table());
        assert!(calibration.to_toml().contains("divided by the time scale, 5000"), "{}", calibration.to_toml());
    }

    #[test]
    fn step_classes_are_means_weighing_their_size() {
        let decode = |batch, context, seconds| Sample::new(StepShape::decode(batch, context), seconds);
        let steps = vec![
            decode(1, 100, 0.010),
            decode(1, 105, 0.014), // 100 and 105: one class at 2^(1/4)
            decode(1, 200, 0.020),
            decode(2, 100, 0.030),
            Sample::new(StepShape::prefill(64), 0.3),
            Sample::new(StepShape::prefill(66), 0.4),
            Sample::new(StepShape::prefill(67), 0.2),
        ];
        let classes = step_classes(&steps);
        let got: Vec<(&str, usize, f64)> =
            classes.iter().map(|m| (m.what.as_str(), m.steps, (m.measured_s * 1e6).round() / 1e6)).collect();
        assert_eq!(
            got,
            [
                ("prefill 66 tok x 1 (3)", 3, 0.3),
                ("decode 1 x ctx 105 (2)", 2, 0.012),
                ("decode 1 x ctx 200 (1)", 1, 0.02),
                ("decode 2 x ctx 100 (1)", 1, 0.03),
            ]
        );
    }

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
