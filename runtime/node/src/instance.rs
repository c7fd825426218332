//! An `[[instances]]` entry made concrete once the model is known: each stage's layers
//! (`tessera_topology::parallel::resolve_split`: the file's split checked against each
//! chip's memory, or `split = "auto"` solved) and devices.

use std::path::{Path, PathBuf};

use tessera_backends::config::ModelConfig;
use tessera_backends::device::DeviceConfig;
use tessera_backends::instance::{ShardDevice, StageSpec, weight_parts};
use tessera_topology::parallel::resolve_split;
use tessera_topology::{Backend, ChipSpec, ClusterSpec, ParallelSpec};

use crate::NodeError;

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
    let parts = weight_parts(model_dir)?;
    let weights = parts.embed + parts.layer * config.num_layers as u64 + parts.head;
    let shape = config.cost_shape(weights, chip.kv_dtype);
    let counts = resolve_split(spec, chip, par, &shape, &parts).map_err(NodeError::Config)?;
    let mut start = 0;
    let mut stages = Vec::with_capacity(counts.len());
    for (s, &layers) in counts.iter().enumerate() {
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
