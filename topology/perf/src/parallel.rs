//! Model parallelism in the performance model: the share of a model one chip of an
//! instance holds ([`stage_shape`]), a pipelined step's time over unlike stages
//! ([`pipeline_step_s`]), a tensor-parallel stage's all-reduces ([`all_reduce_s`]), and
//! the layer split that balances stages of unlike speed and memory ([`split_layers`]).
//! The emulated chips' pacing, the simulator and the solver all cost instances here.

use crate::{Link, ModelShape, PerfModel, Roof, StepShape, roofline};

/// The part of `model` one chip of a stage holds: `layers` of its layers, its `1/tp`
/// share of the heads and MLP columns (at least one KV head), and the LM head only on
/// the last stage (`last`). Weight bytes scale with the layers held.
pub fn stage_shape(model: &ModelShape, layers: usize, last: bool, tp: usize) -> ModelShape {
    let tp = tp.max(1);
    let per_layer = model.weight_bytes.saturating_sub(model.lm_head_params() * 2) / model.num_layers.max(1) as u64;
    let head_bytes = if last { model.weight_bytes.saturating_sub(per_layer * model.num_layers as u64) } else { 0 };
    ModelShape {
        num_layers: layers,
        num_heads: (model.num_heads / tp).max(1),
        num_kv_heads: (model.num_kv_heads / tp).max(1),
        intermediate_size: model.intermediate_size / tp,
        vocab_size: if last { model.vocab_size } else { 0 },
        weight_bytes: (per_layer * layers as u64) / tp as u64 + head_bytes,
        ..*model
    }
}

/// A model's weight bytes by where they live in an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightParts {
    /// The embedding (every rank of the first stage).
    pub embed: u64,
    /// One layer (the largest).
    pub layer: u64,
    /// The LM head and final norm (the last stage's rank 0).
    pub head: u64,
}

impl WeightParts {
    /// The parts of a model known only by its shape: its weight bytes spread over its
    /// parameters evenly, the embedding and LM head untied.
    pub fn estimate(model: &ModelShape) -> WeightParts {
        let params = model.linear_params() + 2 * model.lm_head_params();
        let per_param = model.weight_bytes as f64 / params.max(1) as f64;
        let edge = (model.lm_head_params() as f64 * per_param) as u64;
        WeightParts { embed: edge, layer: (model.layer_linear_params() as f64 * per_param) as u64, head: edge }
    }

    /// Bytes one chip of stage `s` (of `stages`, `tp` chips each) holds with `layers`.
    pub fn of_stage(&self, s: usize, stages: usize, layers: usize, tp: usize) -> u64 {
        let edges = if s == 0 { self.embed } else { 0 } + if s + 1 == stages { self.head } else { 0 };
        layers as u64 * self.layer / tp.max(1) as u64 + edges
    }
}

/// One stage of an instance as the model costs it.
#[derive(Debug, Clone, Copy)]
pub struct StageCost<'a> {
    pub roof: Roof,
    pub perf: &'a PerfModel,
    pub layers: usize,
    pub tp: usize,
    /// The link between the stage's tensor-parallel chips (all-reduces).
    pub tp_link: Link,
}

/// One stage of an instance, owned: what the simulator and the solver keep of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    pub roof: Roof,
    pub perf: PerfModel,
    pub layers: usize,
    pub tp: usize,
    /// The link between the stage's chips, and to the next stage.
    pub link: Link,
}

/// The unscaled time of `step` on an instance of `stages`: pipelined over one
/// micro-batch per stage ([`pipeline_step_s`]), activations crossing the first stage's
/// link between stages.
pub fn instance_step_s(model: &ModelShape, stages: &[Stage], step: &StepShape) -> f64 {
    let costs: Vec<StageCost<'_>> = stages
        .iter()
        .map(|s| StageCost { roof: s.roof, perf: &s.perf, layers: s.layers, tp: s.tp, tp_link: s.link })
        .collect();
    let Some(first) = stages.first() else { return 0.0 };
    pipeline_step_s(model, &costs, step, costs.len(), &first.link)
}

/// Seconds of the `2 * layers` all-reduces of a tensor-parallel stage over `tokens`
/// tokens: a ring moves `2 (tp - 1) / tp` of each `hidden * 4`-byte-per-token buffer
/// through every chip's link, in `2 (tp - 1)` hops of the link's latency.
pub fn all_reduce_s(model: &ModelShape, layers: usize, tp: usize, tokens: usize, link: &Link) -> f64 {
    if tp <= 1 || tokens == 0 {
        return 0.0;
    }
    let bytes = (tokens * model.hidden_size * 4) as f64;
    let hops = 2.0 * (tp - 1) as f64;
    let one = hops * link.latency_s + bytes * hops / tp as f64 / (link.bandwidth_gbs * 1e9);
    2.0 * layers as f64 * one
}

/// A step of an instance: `step` cut into `microbatches` parts that flow through the
/// stages in order, each stage's part costed by its roofline plus its all-reduces, the
/// activations of each part crossing `hop` between stages. The pipeline's time is the
/// first part's way through every stage plus the slowest stage for each later part
/// (the bubble is what the stages idle meanwhile).
pub fn pipeline_step_s(
    model: &ModelShape,
    stages: &[StageCost<'_>],
    step: &StepShape,
    microbatches: usize,
    hop: &Link,
) -> f64 {
    if stages.is_empty() || step.seqs.is_empty() {
        return 0.0;
    }
    let m = microbatches.clamp(1, step.seqs.len());
    let part = StepShape { seqs: step.seqs.iter().copied().step_by(m).collect() };
    let tokens = part.tokens();
    let last = stages.len() - 1;
    let stage_s: Vec<f64> = stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let shape = stage_shape(model, s.layers, i == last, s.tp);
            roofline(s.roof, &shape, &part, s.perf, 1.0).unscaled_s
                + all_reduce_s(model, s.layers, s.tp, tokens, &s.tp_link)
        })
        .collect();
    let hop_s = if stages.len() > 1 { hop.transfer_s((tokens * model.hidden_size * 4) as u64) } else { 0.0 };
    let through: f64 = stage_s.iter().sum::<f64>() + hop_s * last as f64;
    let slowest = stage_s.iter().copied().fold(hop_s, f64::max);
    through + (m - 1) as f64 * slowest
}

/// Layers per stage, in order, that minimise the slowest stage: stage `s` takes
/// `layer_s[s]` seconds a layer and holds at most `max_layers[s]` layers; every stage
/// gets one layer or more. `None` when the stages cannot hold `layers` between them.
/// Ties go to the split that gives earlier stages more layers.
pub fn split_layers(layers: usize, layer_s: &[f64], max_layers: &[usize]) -> Option<Vec<usize>> {
    let n = layer_s.len();
    if n == 0 || n != max_layers.len() || layers < n {
        return None;
    }
    // best[s][l]: the slowest stage when stages 0..=s hold layers 0..l; with the count
    // of stage s behind it.
    let mut best = vec![vec![(f64::INFINITY, 0usize); layers + 1]; n];
    for (l, cell) in best[0].iter_mut().enumerate().take(layers.min(max_layers[0]) + 1).skip(1) {
        *cell = (l as f64 * layer_s[0], l);
    }
    for s in 1..n {
        for l in s + 1..=layers {
            for k in 1..=max_layers[s].min(l - s) {
                let before = best[s - 1][l - k].0;
                let t = before.max(k as f64 * layer_s[s]);
                // Strictly better only: of equal splits, the one with fewer layers here wins.
                if t < best[s][l].0 {
                    best[s][l] = (t, k);
                }
            }
        }
    }
    if !best[n - 1][layers].0.is_finite() {
        return None;
    }
    let mut counts = vec![0; n];
    let mut l = layers;
    for s in (0..n).rev() {
        counts[s] = best[s][l].1;
        l -= counts[s];
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_balance_unlike_stages_within_their_memory() {
        for (layers, speed, max, want) in [
            (30, vec![1.0, 1.0], vec![30, 30], Some(vec![15, 15])),
            // A stage twice as fast takes twice the layers.
            (30, vec![0.5, 1.0], vec![30, 30], Some(vec![20, 10])),
            // Unless its memory stops it.
            (30, vec![0.5, 1.0], vec![12, 30], Some(vec![12, 18])),
            (80, vec![1.0, 1.0, 2.0], vec![80, 80, 80], Some(vec![32, 32, 16])),
            (30, vec![1.0, 1.0], vec![10, 10], None),
            (1, vec![1.0, 1.0], vec![5, 5], None),
        ] {
            assert_eq!(split_layers(layers, &speed, &max), want, "{layers} layers, {speed:?}, {max:?}");
        }
    }

    #[test]
    fn a_pipeline_step_is_one_part_through_every_stage_plus_the_slowest_per_later_part() {
        let model = crate::REFERENCE_MODEL;
        let perf = PerfModel::flat(0.5, 0.8);
        let roof = Roof { fp16_tflops: 100.0, memory_bw_gbs: 1000.0 };
        let link = Link { bandwidth_gbs: 1e6, latency_s: 0.0 };
        let stage = |layers| StageCost { roof, perf: &perf, layers, tp: 1, tp_link: link };
        let step = StepShape::decode(8, 1024);
        let one = pipeline_step_s(&model, &[stage(32)], &step, 1, &link);
        let two = pipeline_step_s(&model, &[stage(16), stage(16)], &step, 1, &link);
        // One micro-batch: the stages run one after the other (no faster, no slower).
        assert!((two / one - 1.0).abs() < 0.02, "{two} vs {one}");
        // Two micro-batches of a memory-bound decode each read all the weights again.
        let piped = pipeline_step_s(&model, &[stage(16), stage(16)], &step, 2, &link);
        assert!(piped > two, "{piped} vs {two}");
    }

    #[test]
    fn tensor_parallel_all_reduces_grow_with_tokens_and_ranks() {
        let model = crate::REFERENCE_MODEL;
        let link = Link { bandwidth_gbs: 100.0, latency_s: 1e-6 };
        assert_eq!(all_reduce_s(&model, 32, 1, 100, &link), 0.0);
        let (a, b) = (all_reduce_s(&model, 32, 2, 100, &link), all_reduce_s(&model, 32, 2, 1000, &link));
        assert!(b > 5.0 * a && a > 0.0, "{a} {b}");
        assert!(all_reduce_s(&model, 32, 8, 100, &link) > a);
    }
}
