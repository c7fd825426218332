//! An instance's layer split made concrete once the model's size is known: the file's
//! `split`, or `split = "auto"` solved from each stage's speed (its chip kind's
//! roofline for a decode step of one layer) and memory, and every stage checked against
//! its chips' memory before anything loads. The live node and the simulator both use it.

pub use crate::perf::parallel::WeightParts;
use crate::perf::parallel::{Stage, split_layers, stage_shape};
use crate::perf::{self, ModelShape, StepShape};
use crate::{ChipSpec, ClusterSpec, ParallelSpec};

/// Weights a shard holds may not take more than this share of a chip's memory: the
/// rest holds KV blocks and step buffers.
pub const WEIGHTS_SHARE: f64 = 0.875;

/// The memory of the smallest chip of stage `s`: its limit, else its kind's memory.
pub fn stage_memory(spec: &ClusterSpec, par: &ParallelSpec, s: usize) -> Option<u64> {
    par.stage(s)
        .iter()
        .filter_map(|c| c.memory_limit_bytes.or_else(|| spec.chip_kind(&c.kind).map(|k| k.memory_bytes)))
        .min()
}

/// Layers of each stage of instance `chip` over a model of `num_layers` layers, `shape`
/// and `parts`: the file's split checked, or the auto split. The error names the
/// instance, the stage and the bytes.
pub fn resolve_split(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    par: &ParallelSpec,
    shape: &ModelShape,
    parts: &WeightParts,
) -> Result<Vec<usize>, String> {
    let (n, tp, num_layers) = (par.stages(), par.tp, shape.num_layers);
    let counts = match &par.split {
        Some(counts) => {
            let total: usize = counts.iter().sum();
            if total != num_layers {
                return Err(format!(
                    "instance `{}`: split {counts:?} holds {total} layers; the model has {num_layers}",
                    chip.id
                ));
            }
            counts.clone()
        }
        None => {
            let mut layer_s = Vec::with_capacity(n);
            for s in 0..n {
                let kind_name = &par.stage(s)[0].kind;
                let kind = spec.chip_kind(kind_name).ok_or_else(|| format!("unknown chip kind `{kind_name}`"))?;
                let one = stage_shape(shape, 1, false, tp);
                let perf = spec.emulation.perf_model_of(&kind.name);
                layer_s.push(perf::roofline(kind.roof(), &one, &StepShape::decode(8, 1024), &perf, 1.0).unscaled_s);
            }
            let max_layers: Vec<usize> = (0..n)
                .map(|s| match stage_memory(spec, par, s) {
                    None => num_layers,
                    Some(memory) => {
                        let room = (memory as f64 * WEIGHTS_SHARE) as u64;
                        let edges = parts.of_stage(s, n, 0, tp);
                        (room.saturating_sub(edges) / (parts.layer / tp as u64).max(1)) as usize
                    }
                })
                .collect();
            split_layers(num_layers, &layer_s, &max_layers).ok_or_else(|| {
                format!(
                    "instance `{}`: its {n} stages cannot hold the model's {num_layers} layers of {} bytes each \
                     (at most {max_layers:?} layers fit their chips' memory)",
                    chip.id, parts.layer
                )
            })?
        }
    };
    let mut start = 0;
    for (s, &layers) in counts.iter().enumerate() {
        let need = parts.of_stage(s, n, layers, tp);
        if let Some(memory) = stage_memory(spec, par, s)
            && need as f64 > memory as f64 * WEIGHTS_SHARE
        {
            let ids: Vec<&str> = par.stage(s).iter().map(|c| c.id.as_str()).collect();
            return Err(format!(
                "instance `{}`: stage {s} ({}) holds layers {start}..{}: {need} bytes of weights a chip, more \
                 than {:.1}% of its {memory} bytes of memory; give it fewer layers or more memory",
                chip.id,
                ids.join(", "),
                start + layers,
                WEIGHTS_SHARE * 100.0
            ));
        }
        start += layers;
    }
    Ok(counts)
}

/// An instance as the simulator and the solver cost it: its stages resolved as the live
/// node resolves them, and the KV tokens it holds (the fewest any stage holds for its
/// layers, an eighth of what each stage's weights leave kept as step scratch, as the
/// real executor does).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelledInstance {
    pub stages: Vec<Stage>,
    pub kv_tokens: u64,
}

/// Instance `chip` (its [`ParallelSpec`] `par`) over a model of `shape`.
pub fn model_instance(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    par: &ParallelSpec,
    shape: &ModelShape,
) -> Result<ModelledInstance, String> {
    let parts = WeightParts::estimate(shape);
    let counts = resolve_split(spec, chip, par, shape, &parts)?;
    let (n, tp) = (counts.len(), par.tp);
    let mut kv_tokens = u64::MAX;
    let mut stages = Vec::with_capacity(n);
    for (s, &layers) in counts.iter().enumerate() {
        let first = &par.stage(s)[0];
        let kind = spec.chip_kind(&first.kind).ok_or_else(|| format!("unknown chip kind `{}`", first.kind))?;
        let memory = stage_memory(spec, par, s).unwrap_or(kind.memory_bytes);
        let weights = parts.of_stage(s, n, layers, tp);
        let rest = memory.checked_sub(weights).ok_or_else(|| {
            format!("instance `{}`: stage {s}'s {weights} bytes of weights exceed its {memory} bytes", chip.id)
        })?;
        let per_token =
            (shape.kv_bytes_per_token() * layers as u64 / shape.num_layers.max(1) as u64 / tp as u64).max(1);
        kv_tokens = kv_tokens.min((rest - rest / 8) / per_token);
        let perf = spec.emulation.perf_model_of(&kind.name);
        stages.push(Stage { roof: kind.roof(), perf, layers, tp, link: kind.chip_link() });
    }
    Ok(ModelledInstance { stages, kv_tokens })
}
