//! An `[[instances]]` entry made concrete once the model is known: each stage's layers
//! (the file's split, or `split = "auto"` solved from the stages' speed and memory) and
//! devices, checked against each chip's memory limit before anything loads.

use std::path::{Path, PathBuf};

use tessera_backends::config::ModelConfig;
use tessera_backends::device::DeviceConfig;
use tessera_backends::instance::{ShardDevice, StageSpec, StoredBytes};
use tessera_topology::perf::parallel::{split_layers, stage_shape};
use tessera_topology::perf::{self, StepShape};
use tessera_topology::{Backend, ChipSpec, ClusterSpec, ParallelSpec};

use crate::NodeError;

/// Weights a shard loads may not take more than this share of a chip's memory: the
/// rest holds KV blocks and step buffers.
const WEIGHTS_SHARE: f64 = 0.875;

/// The stages of instance `chip` (whose [`ParallelSpec`] is `par`) over the model in
/// `model_dir`, each stage's layers resolved.
pub fn stages(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    par: &ParallelSpec,
    model_dir: &Path,
    kernel_lib: Option<PathBuf>,
) -> Result<Vec<StageSpec>, NodeError> {
    let config = ModelConfig::from_dir(model_dir)?;
    let bytes = StoredBytes::of(model_dir)?;
    let n = par.stages();
    let tp = par.tp;
    let edges = |s: usize| if s == 0 { bytes.embed } else { 0 } + if s + 1 == n { bytes.head } else { 0 };
    // The least memory among a stage's chips bounds every rank of it.
    let memory = |s: usize| par.stage(s).iter().filter_map(|c| c.memory_limit_bytes).min();
    let counts = match &par.split {
        Some(counts) => {
            let total: usize = counts.iter().sum();
            if total != config.num_layers {
                return Err(NodeError::Config(format!(
                    "instance `{}`: split {counts:?} holds {total} layers; the model has {}",
                    chip.id, config.num_layers
                )));
            }
            counts.clone()
        }
        None => {
            let shape =
                config.cost_shape(bytes.embed + bytes.layer * config.num_layers as u64 + bytes.head, chip.kv_dtype);
            let layer_s: Vec<f64> = (0..n)
                .map(|s| {
                    let kind = &par.stage(s)[0].kind;
                    let kind =
                        spec.chip_kind(kind).ok_or_else(|| NodeError::Config(format!("unknown chip kind `{kind}`")))?;
                    let one = stage_shape(&shape, 1, false, tp);
                    let step = StepShape::decode(8, 1024);
                    Ok(perf::roofline(kind.roof(), &one, &step, &spec.emulation.perf_model_of(&kind.name), 1.0)
                        .unscaled_s)
                })
                .collect::<Result<_, NodeError>>()?;
            let max_layers: Vec<usize> = (0..n)
                .map(|s| match memory(s) {
                    None => config.num_layers,
                    Some(limit) => {
                        let room = (limit as f64 * WEIGHTS_SHARE) as u64;
                        (room.saturating_sub(edges(s)) / (bytes.layer / tp as u64).max(1)) as usize
                    }
                })
                .collect();
            split_layers(config.num_layers, &layer_s, &max_layers).ok_or_else(|| {
                NodeError::Config(format!(
                    "instance `{}`: its {n} stages cannot hold the model's {} layers of {} bytes each \
                     (at most {max_layers:?} layers fit their memory limits)",
                    chip.id, config.num_layers, bytes.layer
                ))
            })?
        }
    };
    let mut start = 0;
    let mut stages = Vec::with_capacity(n);
    for (s, &layers) in counts.iter().enumerate() {
        let need = layers as u64 * bytes.layer / tp as u64 + edges(s);
        if let Some(limit) = memory(s)
            && need as f64 > limit as f64 * WEIGHTS_SHARE
        {
            let ids: Vec<&str> = par.stage(s).iter().map(|c| c.id.as_str()).collect();
            return Err(NodeError::Config(format!(
                "instance `{}`: stage {s} ({}) holds layers {start}..{}: about {need} bytes of weights a chip, \
                 more than {:.0}% of its memory limit of {limit} bytes; give it fewer layers or more memory",
                chip.id,
                ids.join(", "),
                start + layers,
                WEIGHTS_SHARE * 100.0
            )));
        }
        let devices = par
            .stage(s)
            .iter()
            .map(|c| ShardDevice {
                label: c.id.clone(),
                kernel_lib: match &c.backend {
                    Backend::Plugin(path) => Some(path.clone()),
                    Backend::Cpu | Backend::Emu(_) => kernel_lib.clone(),
                },
                device: DeviceConfig {
                    threads: c.threads as u32,
                    memory_limit_bytes: c.memory_limit_bytes.unwrap_or(0),
                    matmul_precision: c.matmul_precision,
                    ..Default::default()
                },
            })
            .collect();
        stages.push(StageSpec { layers: start..start + layers, devices });
        start += layers;
    }
    Ok(stages)
}
