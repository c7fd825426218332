//! `tessera bench instance`: a model instance across several devices (pipeline stages,
//! tensor-parallel ranks) beside the whole model on one device of the same total
//! threads and memory, under one batched greedy workload, run back to back in one
//! process; with where the instance's time went (stages idle: bubble, activation
//! hand-offs, all-reduce waits) and the all-reduce's time per call — the kernel
//! library's collectives (ABI 1.4) beside Tessera's host all-reduce — against the
//! machine's copy bandwidth.

use std::path::PathBuf;
use std::time::Instant;

use tessera_backends::device::{Device, DeviceConfig};
use tessera_backends::dtype::DType;
use tessera_backends::instance::{InstanceSpec, RemoteStage, ShardDevice, StepTiming};
use tessera_backends::kv::KvCacheConfig;
use tessera_backends::kv_format::KvLayout;
use tessera_backends::loader::KernelLibrary;
use tessera_backends::model::{LoadOptions, Model};
use tessera_backends::sampling::SamplingParams;
use tessera_backends::shard::{AllReduce, LibraryGroup, LocalGroup, boxed};

use crate::local::{EngineConfig, LocalEngine};

#[derive(Debug, Clone)]
pub struct InstanceBenchOptions {
    pub model_dir: PathBuf,
    pub options: LoadOptions,
    /// Layers of each pipeline stage.
    pub stages: Vec<usize>,
    pub tp: usize,
    /// Sequences run together, each `prompt_tokens` long, generating `max_tokens`.
    pub seqs: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// Threads of each device of the instance; the one device gets as many in all.
    pub threads_per_device: u32,
    pub block_size: usize,
    pub kv_dtype: DType,
    /// Also run the instance with every stage after the first behind a stage server on
    /// a loopback port (as on another host), side by side with the in-process one.
    pub remote_stages: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct InstanceBenchReport {
    pub stages: Vec<usize>,
    pub tp: usize,
    pub one_device_tokens_per_s: f64,
    pub instance_tokens_per_s: f64,
    /// Instance over one device, same workload.
    pub ratio: f64,
    pub steps: u64,
    pub microbatches_per_step: f64,
    /// Share of the stages' time not computing (bubble + hand-offs + all-reduce waits).
    pub idle_share: f64,
    /// Activation bytes moved stage to stage, and their share of the instance's wall
    /// time at the machine's copy bandwidth (each hand-off is two copies: out of one
    /// device, into the next).
    pub activation_bytes: u64,
    pub activation_share: f64,
    pub copy_gbs: f64,
    pub all_reduce: Vec<AllReduceFigure>,
    /// With `remote_stages`: the same instance, its later stages over stage links.
    pub linked: Option<LinkedFigure>,
}

/// The instance with its later stages behind a loopback stage server.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LinkedFigure {
    pub tokens_per_s: f64,
    /// Over the in-process instance's tokens/s, same workload, same run.
    pub ratio: f64,
    pub idle_share: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct AllReduceFigure {
    pub ranks: usize,
    pub bytes: usize,
    /// Median per call of Tessera's host all-reduce.
    pub host_us: f64,
    /// Median per call of the kernel library's collectives (what an instance uses);
    /// None where the library has none.
    pub library_us: Option<f64>,
    /// The same bytes at the copy bandwidth.
    pub copy_us: f64,
}

/// Runs the workload on one device, then on the instance, then the all-reduce sizes.
pub fn run(opts: &InstanceBenchOptions) -> Result<InstanceBenchReport, String> {
    if opts.stages.is_empty() || opts.tp == 0 || opts.seqs == 0 || opts.max_tokens == 0 {
        return Err("give at least one stage, tp >= 1, and seqs and max tokens > 0".into());
    }
    let config = tessera_backends::config::ModelConfig::from_dir(&opts.model_dir).map_err(|e| e.to_string())?;
    let prompts: Vec<Vec<u32>> = (0..opts.seqs)
        .map(|i| (0..opts.prompt_tokens).map(|j| ((i * 7919 + j * 104729 + 1) % config.vocab_size) as u32).collect())
        .collect();
    let devices = opts.stages.len() * opts.tp;
    let longest = opts.prompt_tokens + opts.max_tokens;
    let num_blocks = opts.seqs * longest.div_ceil(opts.block_size) + 1;
    let lib = KernelLibrary::load_default().map_err(|e| e.to_string())?;
    let threads = opts.threads_per_device * devices as u32;
    let device = Device::open(&lib, &DeviceConfig { threads, ..Default::default() }).map_err(|e| e.to_string())?;
    let model = Model::load_with(&opts.model_dir, device, opts.options).map_err(|e| e.to_string())?;
    let kv = KvCacheConfig { block_size: opts.block_size, num_blocks, dtype: opts.kv_dtype };
    let one = LocalEngine::new(model, kv, EngineConfig::default()).map_err(|e| e.to_string())?;
    let (one_s, generated) = timed(one, &prompts, opts.max_tokens)?;
    let spec = InstanceSpec {
        model_dir: opts.model_dir.clone(),
        options: opts.options,
        stages: InstanceSpec::stages_of(&opts.stages, opts.tp, |s, r| ShardDevice {
            label: format!("stage{s}-rank{r}"),
            kernel_lib: None,
            device: DeviceConfig { threads: opts.threads_per_device, ..Default::default() },
        }),
        block_size: opts.block_size,
        kv_dtype: opts.kv_dtype,
        kv_layout: KvLayout::HeadMajor,
        default_kv_bytes: 1 << 40,
        max_blocks: num_blocks,
        collectives: Default::default(),
    };
    let (inst_s, timing) = run_instance(&spec, &prompts, opts.max_tokens)?;
    let linked = if opts.remote_stages && opts.stages.len() > 1 {
        let (link_s, link_timing) = run_linked(&spec, &prompts, opts.max_tokens)?;
        Some(LinkedFigure {
            tokens_per_s: generated as f64 / link_s,
            ratio: inst_s / link_s,
            idle_share: link_timing.idle_share(opts.stages.len()),
        })
    } else {
        None
    };
    let copy_gbs = copy_bandwidth_gbs();
    let activation_s = 2.0 * timing.activation_bytes as f64 / (copy_gbs * 1e9);
    let all_reduce = if opts.tp > 1 {
        [1usize, 16, 128, 512]
            .iter()
            .map(|&rows| all_reduce_figure(&lib, opts.tp, rows * config.hidden_size, copy_gbs))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        Vec::new()
    };
    Ok(InstanceBenchReport {
        stages: opts.stages.clone(),
        tp: opts.tp,
        one_device_tokens_per_s: generated as f64 / one_s,
        instance_tokens_per_s: generated as f64 / inst_s,
        ratio: one_s / inst_s,
        steps: timing.steps,
        microbatches_per_step: timing.microbatches as f64 / timing.steps.max(1) as f64,
        idle_share: timing.idle_share(opts.stages.len()),
        activation_bytes: timing.activation_bytes,
        activation_share: activation_s / timing.wall_s.max(1e-9),
        copy_gbs,
        all_reduce,
        linked,
    })
}

/// Seconds to run every prompt to the end together on the instance of `spec`, and where
/// its time went.
fn run_instance(spec: &InstanceSpec, prompts: &[Vec<u32>], max_tokens: usize) -> Result<(f64, StepTiming), String> {
    let mut engine = LocalEngine::instance(spec, EngineConfig::default()).map_err(|e| e.to_string())?;
    let started = Instant::now();
    for (id, p) in prompts.iter().enumerate() {
        engine.add_request(id as u64, p, greedy(max_tokens)).map_err(|e| e.to_string())?;
    }
    engine.run_to_completion().map_err(|e| e.to_string())?;
    let (timing, _) = engine.instance_timing().ok_or("the instance reported no timing")?;
    Ok((started.elapsed().as_secs_f64(), timing))
}

/// [`run_instance`] with every stage after the first served by a stage server on a
/// loopback port, one link (and server thread) per stage, as another host serves it.
fn run_linked(spec: &InstanceSpec, prompts: &[Vec<u32>], max_tokens: usize) -> Result<(f64, StepTiming), String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let links = spec.stages.len() - 1;
    let whole = spec.clone();
    let server = std::thread::spawn(move || {
        std::thread::scope(|scope| {
            for _ in 0..links {
                let Ok((stream, _)) = listener.accept() else { return };
                let whole = &whole;
                scope.spawn(move || {
                    let resolve = |_: &str, stage: usize| {
                        let mut one = whole.clone();
                        one.stages = vec![whole.stages[stage].clone()];
                        Ok(one)
                    };
                    let _ = tessera_backends::stage_link::serve_connection(stream, &resolve, None);
                });
            }
        })
    });
    let mut linked = spec.clone();
    for stage in &mut linked.stages[1..] {
        stage.remote = Some(RemoteStage { addr, instance: "bench".into(), seal: None });
    }
    let ran = run_instance(&linked, prompts, max_tokens);
    // The instance is dropped, so every link has closed and the server threads end.
    server.join().map_err(|_| "the stage server panicked".to_string())?;
    ran
}

impl InstanceBenchReport {
    pub fn table(&self) -> String {
        let mut out = format!(
            "instance: stages {:?} x tp {}\n\
             generated tokens/s: one device {:.1}, instance {:.1} (instance / one device = {:.3})\n\
             {} steps, {:.2} micro-batches a step; stages idle {:.1}% of their time (bubble, hand-offs, all-reduce waits)\n\
             activations {:.2} MB stage to stage: {:.2}% of the wall time at the copy bandwidth ({:.1} GB/s)\n",
            self.stages,
            self.tp,
            self.one_device_tokens_per_s,
            self.instance_tokens_per_s,
            self.ratio,
            self.steps,
            self.microbatches_per_step,
            100.0 * self.idle_share,
            self.activation_bytes as f64 / 1e6,
            100.0 * self.activation_share,
            self.copy_gbs
        );
        if let Some(l) = &self.linked {
            out += &format!(
                "stages after the first over loopback stage links: {:.1} tokens/s (linked / in-process = {:.3}); \
                 stages idle {:.1}%\n",
                l.tokens_per_s,
                l.ratio,
                100.0 * l.idle_share
            );
        }
        for f in &self.all_reduce {
            let library = f.library_us.map_or_else(|| "-".to_string(), |us| format!("{us:.1}"));
            out += &format!(
                "all-reduce of {} ranks, {:>8} bytes: median {:>8} us library, {:>8.1} us host (the bytes at the copy bandwidth: {:.1} us)\n",
                f.ranks, f.bytes, library, f.host_us, f.copy_us
            );
        }
        out
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, ..Default::default() }
}

/// Seconds to run every prompt to the end together, and the tokens generated.
fn timed(mut engine: LocalEngine, prompts: &[Vec<u32>], max_tokens: usize) -> Result<(f64, usize), String> {
    let started = Instant::now();
    for (id, p) in prompts.iter().enumerate() {
        engine.add_request(id as u64, p, greedy(max_tokens)).map_err(|e| e.to_string())?;
    }
    let done = engine.run_to_completion().map_err(|e| e.to_string())?;
    Ok((started.elapsed().as_secs_f64(), done.iter().map(|c| c.tokens.len()).sum()))
}

/// A 64 MiB memcpy's bandwidth (best of 5), GB/s.
fn copy_bandwidth_gbs() -> f64 {
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    n as f64 / best / 1e9
}

/// The median time of an all-reduce of `values` f32 over `ranks` devices on threads,
/// through the host's all-reduce and through the library's collectives.
fn all_reduce_figure(
    lib: &std::sync::Arc<KernelLibrary>,
    ranks: usize,
    values: usize,
    copy_gbs: f64,
) -> Result<AllReduceFigure, String> {
    let host_us = all_reduce_median_us(lib, boxed(LocalGroup::new(ranks)), values)?;
    let library_us = if lib.has_collectives() {
        let groups = LibraryGroup::new(lib, ranks).map_err(|e| e.to_string())?;
        Some(all_reduce_median_us(lib, boxed(groups), values)?)
    } else {
        None
    };
    let bytes = values * 4;
    Ok(AllReduceFigure { ranks, bytes, host_us, library_us, copy_us: bytes as f64 / (copy_gbs * 1e9) * 1e6 })
}

/// Rank 0's median time per call of `groups`' all-reduce of `values` f32.
fn all_reduce_median_us(
    lib: &std::sync::Arc<KernelLibrary>,
    groups: Vec<Box<dyn AllReduce + Send>>,
    values: usize,
) -> Result<f64, String> {
    const CALLS: usize = 60;
    let times = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                scope.spawn(move || -> Result<Vec<f64>, String> {
                    let dev = Device::open(lib, &DeviceConfig { threads: 1, ..Default::default() })
                        .map_err(|e| e.to_string())?;
                    let buf = dev.upload(&vec![1.0f32; values]).map_err(|e| e.to_string())?;
                    let mut times = Vec::with_capacity(CALLS);
                    for _ in 0..CALLS {
                        let t = Instant::now();
                        group.all_reduce(&dev, buf.view(), values).map_err(|e| e.to_string())?;
                        times.push(t.elapsed().as_secs_f64());
                    }
                    Ok(times)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "an all-reduce rank panicked".to_string())?)
            .collect::<Result<Vec<_>, _>>()
    })?;
    let mut rank0 = times.into_iter().next().unwrap_or_default();
    rank0.sort_by(f64::total_cmp);
    Ok(rank0.get(rank0.len() / 2).copied().unwrap_or(0.0) * 1e6)
}
