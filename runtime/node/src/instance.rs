//! An `[[instances]]` entry made concrete once the model is known: each stage's layers
//! (`tessera_topology::parallel::resolve_split`: the file's split checked against each
//! chip's memory, or `split = "auto"` solved) and devices, or for a stage on another
//! host, that host's stage server; and the stage server, which loads and runs such a
//! stage for the instance's host.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_backends::config::ModelConfig;
use tessera_backends::device::DeviceConfig;
use tessera_backends::instance::{InstanceSpec, RemoteStage, ShardDevice, StageSpec, weight_parts};
use tessera_backends::stage_link::{LinkHalves, LinkSeal};
use tessera_runtime::security::PlaneSecurity;
use tessera_runtime::transfer::SealedStream;
use tessera_topology::parallel::resolve_split;
use tessera_topology::{Backend, ChipSpec, ClusterSpec, ParallelSpec};

use crate::NodeError;

/// A stage link's handshake must finish within this.
const STAGE_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Seals stage links as the data plane's connections are sealed: the same handshake,
/// host keys and cipher, every byte in sealed records after it.
#[derive(Clone)]
pub struct StageSeal(pub PlaneSecurity);

impl std::fmt::Debug for StageSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StageSeal({} {})", self.0.mode.name(), self.0.cipher)
    }
}

impl LinkSeal for StageSeal {
    fn client(&self, tcp: std::net::TcpStream) -> std::io::Result<LinkHalves> {
        let (r, w) = SealedStream::connect(tcp, &self.0, STAGE_HANDSHAKE_TIMEOUT)?.split();
        Ok((Box::new(r), Box::new(w)))
    }

    fn server(&self, tcp: std::net::TcpStream) -> std::io::Result<LinkHalves> {
        let (r, w) = SealedStream::accept(tcp, &self.0, STAGE_HANDSHAKE_TIMEOUT)?.split();
        Ok((Box::new(r), Box::new(w)))
    }
}

/// The stages of instance `chip` (whose [`ParallelSpec`] is `par`) over the model in
/// `model_dir`, each stage's layers resolved; links to stages on other hosts are sealed
/// with `seal` where given.
pub fn stages(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    par: &ParallelSpec,
    model_dir: &Path,
    kernel_lib: Option<PathBuf>,
    seal: Option<Arc<dyn LinkSeal>>,
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
        let remote = match par.stage_hosts.get(s) {
            Some(host) if *host != par.stage_hosts[0] => {
                let server =
                    spec.hosts.iter().find(|h| h.name == *host).and_then(|h| h.stages.as_ref()).ok_or_else(|| {
                        NodeError::Config(format!(
                            "instance `{}`: stage {s} is on host `{host}`, which has no stage server",
                            chip.id
                        ))
                    })?;
                // Looked up each time the instance is built (a restarted chip reconnects to
                // where the name points now).
                let within = std::time::Duration::from_millis(spec.bus.resolve_timeout_ms);
                let addr = server.resolve_within(within, std::time::Duration::from_millis(250)).map_err(|source| {
                    NodeError::Resolve {
                        host: par.stage_hosts[0].clone(),
                        what: format!("instance `{}`: the stage server of host `{host}`", chip.id),
                        source,
                    }
                })?;
                Some(RemoteStage { addr, instance: chip.id.clone(), seal: seal.clone() })
            }
            _ => None,
        };
        stages.push(StageSpec { layers: start..start + layers, devices, remote });
        start += layers;
    }
    Ok(stages)
}

/// What the stage server of host `me` loads for stage `stage` of instance `instance`:
/// that stage alone, with this host's devices, as the instance's host resolved it.
pub fn resolve_stage(
    spec: &ClusterSpec,
    me: &str,
    instance: &str,
    stage: usize,
    model_dir: &Path,
    kernel_lib: Option<PathBuf>,
) -> Result<InstanceSpec, NodeError> {
    let chip = spec
        .hosts
        .iter()
        .flat_map(|h| &h.chips)
        .find(|c| c.id == instance && c.parallel.is_some())
        .ok_or_else(|| NodeError::Config(format!("this host's topology has no instance `{instance}`")))?;
    let par = chip.parallel.as_ref().ok_or_else(|| NodeError::Config(format!("`{instance}` is no instance")))?;
    match par.stage_hosts.get(stage) {
        Some(host) if host == me => {}
        Some(host) => {
            return Err(NodeError::Config(format!(
                "stage {stage} of instance `{instance}` is on host `{host}`, not on `{me}`"
            )));
        }
        None => {
            return Err(NodeError::Config(format!("instance `{instance}` has {} stages", par.stage_hosts.len())));
        }
    }
    let config = crate::executor_config(spec, chip, model_dir, kernel_lib, None, None)?;
    let mut whole = config
        .instance_spec()
        .map_err(NodeError::Config)?
        .ok_or_else(|| NodeError::Config(format!("`{instance}` is no instance")))?;
    let mut one = whole.stages.swap_remove(stage);
    one.remote = None;
    whole.stages = vec![one];
    Ok(whole)
}

/// Resolves (instance id, stage index) to what this host's stage server loads.
pub type StageResolver = std::sync::Arc<dyn Fn(&str, usize) -> Result<InstanceSpec, NodeError> + Send + Sync>;

/// Serves the stages this host holds for instances on other hosts, a thread per
/// connection (one connection per stage), until the process ends; on a secured cluster
/// each connection must pass `seal`'s handshake first.
pub fn serve_stages(listener: std::net::TcpListener, resolve: StageResolver, seal: Option<Arc<dyn LinkSeal>>) {
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "stage server: a connection failed");
                continue;
            }
        };
        let (resolve, seal) = (resolve.clone(), seal.clone());
        let spawned = std::thread::Builder::new().name("stage-server".into()).spawn(move || {
            let peer = stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
            tracing::info!(%peer, "stage server: an instance connected");
            let resolve = |instance: &str, stage: usize| {
                resolve(instance, stage).map_err(|e| tessera_backends::error::BackendError::Shard(e.to_string()))
            };
            match tessera_backends::stage_link::serve_connection(stream, &resolve, seal.as_deref()) {
                Ok(()) => tracing::info!(%peer, "stage server: the instance closed its link; stage dropped"),
                Err(e) => tracing::warn!(%peer, error = %e, "stage server: link ended; stage dropped"),
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "stage server: cannot start a connection's thread");
        }
    }
}
