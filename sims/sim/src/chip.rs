//! A modelled chip: a [`StepExecutor`] that computes nothing and declares, as each job's
//! model time, what the performance model (`tessera-perf`, the one emulated chips are
//! paced by) predicts for the chip's kind and the model's shape: the topology's flat
//! efficiencies, or the kind's calibrated model when the scenario names one. A KV hand-off
//! installed from another chip takes the link model's time. Sampling is a hash of the
//! last token and its position, so a request replayed on another chip continues exactly
//! where it was, and it never yields an end-of-sequence token: every request runs to its
//! `max_tokens`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tessera_actor_core::JobCtx;
use tessera_actors::batcher::StepPlan;
use tessera_actors::chip::executor::{ExecutorFactory, KvInstall, StepExecutor, stage_groups};
use tessera_actors::msg::{ChipInfo, KvEndpointDesc, KvFormatDesc, KvRegionDesc, Msg, StepOutcome};
use tessera_topology::parallel::model_instance;
use tessera_topology::perf::parallel::{Stage, instance_step_s};
use tessera_topology::perf::{Link, ModelShape, PerfModel, Roof, roofline};
use tessera_topology::{ChipSpec, ClusterSpec, ParallelSpec};

use crate::model::SimModel;
use crate::scenario::Network;

/// Why a chip cannot be modelled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChipModelError {
    #[error("unknown chip kind {0:?}")]
    UnknownKind(String),
    #[error("its memory ({memory} bytes) is smaller than the model's weights ({weights} bytes)")]
    WeightsExceedMemory { memory: u64, weights: u64 },
    #[error("no memory is left for even one KV block of {block_size} tokens")]
    NoKvBlock { block_size: usize },
    #[error("{0}")]
    Instance(String),
}

/// Where each chip of the cluster is and how fast its links are, for hand-off times.
/// Chips are numbered in topology order; a modelled chip's staging region carries its
/// number, which is how a decode chip knows where KV comes from.
#[derive(Debug)]
pub struct Links {
    /// (host index, scale-up link GB/s) per chip.
    chips: Vec<(usize, f64)>,
    network: Network,
    /// Per host, how many times slower its network link is than `network` (a
    /// `link_slow` fault), as f64 bits; 1.0 when healthy.
    slowdown: Vec<AtomicU64>,
}

impl Links {
    pub fn new(spec: &ClusterSpec, network: Network) -> Links {
        let chips =
            spec.chips().map(|(h, _, chip)| (h, spec.chip_kind(&chip.kind).map_or(0.0, |k| k.link_bw_gbs))).collect();
        let slowdown = spec.hosts.iter().map(|_| AtomicU64::new(1f64.to_bits())).collect();
        Links { chips, network, slowdown }
    }

    /// From now on, network hand-offs into or out of `host` take `factor` times as long.
    pub fn slow_down(&self, host: usize, factor: f64) {
        if let Some(s) = self.slowdown.get(host) {
            s.store(factor.to_bits(), Ordering::Relaxed);
        }
    }

    fn slowdown(&self, host: usize) -> f64 {
        self.slowdown.get(host).map_or(1.0, |s| f64::from_bits(s.load(Ordering::Relaxed)))
    }

    /// How long `bytes` of KV take from chip `from` to chip `to`: the scale-up link
    /// within a host (the slower end's, one direction: half the quoted bidirectional
    /// figure), the scenario's network between hosts, plus the network's latency; a
    /// slowed host's network link takes that many times as long.
    pub fn transfer_time(&self, from: usize, to: usize, bytes: u64) -> Duration {
        let network =
            Link { bandwidth_gbs: self.network.kv_bandwidth_gbs, latency_s: self.network.kv_latency.as_secs_f64() };
        match (self.chips.get(from), self.chips.get(to)) {
            (Some(&(from_host, from_gbs)), Some(&(to_host, to_gbs)))
                if from_host == to_host && from_gbs > 0.0 && to_gbs > 0.0 =>
            {
                secs(Link { bandwidth_gbs: from_gbs.min(to_gbs) / 2.0, latency_s: 0.0 }.transfer_s(bytes))
            }
            (from, to) => {
                let slowdown = |c: Option<&(usize, f64)>| c.map_or(1.0, |&(h, _)| self.slowdown(h));
                secs(network.transfer_s(bytes) * slowdown(from).max(slowdown(to)))
            }
        }
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

/// A chip's executor in the simulator.
#[derive(Debug, Clone)]
pub struct ModelledChip {
    /// This chip's number in topology order.
    index: usize,
    roof: Roof,
    perf: PerfModel,
    /// An emulated chip's pacing scale; 1 for any other (see [`time_scale`]).
    time_scale: f64,
    shape: ModelShape,
    vocab: u64,
    links: Arc<Links>,
    /// An instance's stages, pipelined (see `tessera_perf::parallel`); empty for one chip.
    stages: Vec<Stage>,
}

pub use tessera_actors::solver::time_scale;

/// The executor factory and description of chip number `index` of `spec`.
pub fn modelled_chip(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    index: usize,
    host_name: &str,
    model: &SimModel,
    perf: PerfModel,
    links: Arc<Links>,
) -> Result<(ExecutorFactory, ChipInfo), ChipModelError> {
    let kind = spec.chip_kind(&chip.kind).ok_or_else(|| ChipModelError::UnknownKind(chip.kind.clone()))?;
    let shape = model.shape(chip.kv_dtype);
    let most_useful = (chip.max_batch_seqs * model.config.max_context).div_ceil(chip.block_size);
    let (num_blocks, stages) = match &chip.parallel {
        None => {
            let memory = chip.memory_limit_bytes.unwrap_or(kind.memory_bytes);
            (kv_blocks(memory, model.weight_bytes, chip.block_size, shape.kv_bytes_per_token())?, Vec::new())
        }
        Some(par) => instance_stages(spec, chip, par, &shape)?,
    };
    let num_blocks = num_blocks.min(most_useful);
    if num_blocks == 0 {
        return Err(ChipModelError::NoKvBlock { block_size: chip.block_size });
    }
    let c = &model.config;
    let format = KvFormatDesc {
        num_layers: c.num_layers,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        block_size: chip.block_size,
        num_blocks,
        layout: chip.kv_layout,
        dtype: chip.kv_dtype,
    };
    let time_scale = time_scale(spec, &chip.backend);
    // No memory behind it: it names the chip, so that its decode chips know where the
    // KV comes from.
    let staging = KvRegionDesc {
        endpoint: KvEndpointDesc { host_key: format!("sim:{host_name}"), pid: 0, tcp: ([0, 0, 0, 0], 0).into() },
        region: index as u64,
        fd: -1,
        len: 0,
    };
    let info = ChipInfo {
        format,
        compat: model.compat(),
        staging: Some(staging),
        emulated: Some(format!("{} (simulated, x{time_scale})", kind.name)),
        num_blocks,
        block_size: chip.block_size,
        max_context: c.max_context,
        vocab_size: c.vocab_size,
        eos_token_ids: Vec::new(),
    };
    let exec = ModelledChip {
        index,
        roof: kind.roof(),
        perf,
        time_scale,
        shape,
        vocab: c.vocab_size.max(1) as u64,
        links,
        stages,
    };
    let ready = info.clone();
    let factory: ExecutorFactory =
        Arc::new(move || Ok((Box::new(exec.clone()) as Box<dyn StepExecutor>, ready.clone())));
    Ok((factory, info))
}

/// KV blocks of `block_size` tokens a chip of `memory` bytes holds beside `weights`: as
/// the real executor, an eighth of what the weights leave is step scratch.
fn kv_blocks(memory: u64, weights: u64, block_size: usize, kv_bytes_per_token: u64) -> Result<usize, ChipModelError> {
    let rest = memory.checked_sub(weights).ok_or(ChipModelError::WeightsExceedMemory { memory, weights })?;
    let block_bytes = (block_size as u64).saturating_mul(kv_bytes_per_token).max(1);
    Ok(usize::try_from((rest - rest / 8) / block_bytes).unwrap_or(usize::MAX))
}

/// An instance's KV blocks (what every stage holds for its layers) and its stages, the
/// split resolved as the live node resolves it.
fn instance_stages(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    par: &ParallelSpec,
    shape: &ModelShape,
) -> Result<(usize, Vec<Stage>), ChipModelError> {
    let modelled = model_instance(spec, chip, par, shape).map_err(ChipModelError::Instance)?;
    let blocks = usize::try_from(modelled.kv_tokens / chip.block_size.max(1) as u64).unwrap_or(usize::MAX);
    Ok((blocks, modelled.stages))
}

impl ModelledChip {
    /// The roofline time of `plan` on this chip; an instance's, pipelined over one
    /// micro-batch per stage.
    pub fn step_time(&self, plan: &StepPlan) -> Duration {
        if !self.stages.is_empty() {
            let s = instance_step_s(&self.shape, &self.stages, &plan.shape()) * self.time_scale;
            return secs(s.min(tessera_topology::perf::MAX_STEP_S));
        }
        secs(roofline(self.roof, &self.shape, &plan.shape(), &self.perf, self.time_scale).time_s)
    }
}

impl StepExecutor for ModelledChip {
    fn step(&mut self, step: u64, plan: &StepPlan, ctx: &mut dyn JobCtx<Msg>) -> StepOutcome {
        let time = self.step_time(plan);
        // As a real prefill chip: layer l of the sequences prefilled for a decode chip is
        // staged at (l+1)/L of the step, and told with the rest of its group.
        let staged: Vec<(u64, usize)> =
            plan.seqs.iter().filter(|s| s.stage).map(|s| (s.request_id, s.start_pos + s.tokens.len())).collect();
        if !staged.is_empty() {
            let num_layers = self.shape.num_layers.max(1);
            for layers in stage_groups(num_layers) {
                let at = time.mul_f64(layers.end as f64 / num_layers as f64);
                ctx.notify_at(at, Msg::KvStaged { step, layers, staged: staged.clone(), capabilities: Vec::new() });
            }
        }
        let mut sampled = Vec::with_capacity(plan.seqs.len());
        for s in &plan.seqs {
            let last = s.tokens.last().copied().unwrap_or(0) as u64;
            let pos = (s.start_pos + s.tokens.len()) as u64;
            let token = ((last * 7919 + pos * 104_729) % self.vocab) as u32;
            sampled.extend(s.samplers().map(|id| (id, token)));
        }
        ctx.elapse(time);
        StepOutcome::sampled(step, sampled, time.as_secs_f64())
    }

    fn install(&mut self, job: &KvInstall, ctx: &mut dyn JobCtx<Msg>) -> Result<(), String> {
        let f = &job.format;
        let bytes_per_position = (2 * f.num_kv_heads * f.head_dim * f.dtype.size_bytes()) as u64;
        let bytes = (job.positions.len() * job.layers.len()) as u64 * bytes_per_position;
        ctx.elapse(self.links.transfer_time(job.region.region as usize, self.index, bytes));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_actors::batcher::PlannedSeq;

    fn seq(id: u64, new: usize, start: usize) -> PlannedSeq {
        PlannedSeq {
            request_id: id,
            tokens: vec![1; new].into(),
            start_pos: start,
            block_table: Arc::from([]),
            slots: Default::default(),
            sample: true,
            new_sampler: None,
            score: None,
            stage: false,
            stage_from: 0,
            forks: Vec::new(),
        }
    }

    #[test]
    fn step_times_are_the_emulated_chips_pacing_and_links_their_bandwidth() {
        let spec = tessera_topology::default_topology();
        let Ok(model) = SimModel::of(&spec, std::path::Path::new(".")) else { panic!("builtin:tiny") };
        let links = Arc::new(Links::new(&spec, Network::default()));
        let chips: Vec<_> = spec.chips().map(|(_, h, c)| (h.name.clone(), c.clone())).collect();
        let flat = spec.emulation.perf_model();
        let made = |i: usize| modelled_chip(&spec, &chips[i].1, i, &chips[i].0, &model, flat, links.clone());
        let (Ok((_, ascend)), Ok((_, metax))) = (made(0), made(1)) else { panic!("default chips") };
        assert_eq!(ascend.format.block_size, 16);
        assert_eq!(metax.format.block_size, 32);
        assert!(ascend.num_blocks > 0 && ascend.compat == metax.compat);

        let kind = |n: &str| spec.chip_kind(n).unwrap_or_else(|| panic!("{n}"));
        let chip = |k: &str| ModelledChip {
            index: 0,
            roof: kind(k).roof(),
            perf: flat,
            time_scale: spec.emulation.time_scale,
            shape: model.shape(tessera_topology::DType::F32),
            vocab: 1024,
            links: links.clone(),
            stages: Vec::new(),
        };
        // perf.rs's documented default-topology figures: a 512-token prefill on the 910B
        // in ~29 ms, a decode at 128 tokens of context on the C500 in ~14.8 ms.
        let prefill = chip("ascend-910b").step_time(&StepPlan {
            seqs: vec![seq(1, 512, 0)],
            drop_samplers: Vec::new(),
            copies: Vec::new(),
        });
        let decode = chip("metax-c500").step_time(&StepPlan {
            seqs: vec![seq(1, 1, 127)],
            drop_samplers: Vec::new(),
            copies: Vec::new(),
        });
        assert!((0.025..0.035).contains(&prefill.as_secs_f64()), "{prefill:?}");
        assert!((0.010..0.020).contains(&decode.as_secs_f64()), "{decode:?}");

        // Two hosts: the scenario's network, 12.5 GB/s plus 20 us.
        let t = links.transfer_time(0, 1, 12_500_000);
        assert_eq!(t, Duration::from_micros(1_020));
    }
}
