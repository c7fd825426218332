//! One host's behaviors, built from a validated topology: its supervisor, its chips and
//! — on the gateway's host — the router and admission. The real host (`tessera-node`)
//! and the virtual-time host (tests, the simulator) both spawn exactly this list, so
//! they run the same cluster; only the chips' executors differ, and the caller supplies
//! those.

use crate::admission::{Admission, AdmissionConfig};
use crate::chip::executor::ExecutorFactory;
use crate::chip::{Chip, ChipConfig};
use crate::msg::{ChipReport, Msg, well_known};
use crate::request::RetryPolicy;
use crate::router::cost::Pace;
use crate::router::{Limits, Router};
use crate::solver::{Solver, SolverConfig};
use crate::supervisor::{Supervisor, SupervisorConfig};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_actor_core::{Addr, Behavior, HostId};
use tessera_topology::perf::{self, ModelShape};
use tessera_topology::{ChipSpec, ClusterSpec, EmulationSpec, HostSpec, OPEN_TENANT};

/// The address of chip `i` of host `host` (in topology order).
pub fn chip_addr(host: usize, i: usize) -> Addr {
    Addr::new(HostId(host as u16), well_known::CHIP_BASE + i as u64)
}

/// Each chip's pace as its kind's performance model predicts it for `served` (the
/// served model's shape; the reference model's when not known): paced like its
/// emulation for an emulated chip, at the emulation's efficiencies and real time for
/// the others. A kind the catalog does not know is paced as [`Pace::UNKNOWN`].
pub fn modelled_paces(spec: &ClusterSpec, served: Option<&ModelShape>) -> BTreeMap<Addr, Pace> {
    let model = served.unwrap_or(&perf::REFERENCE_MODEL);
    let chips =
        spec.hosts.iter().enumerate().flat_map(|(h, host)| host.chips.iter().enumerate().map(move |(i, c)| (h, i, c)));
    chips
        .map(|(h, i, chip)| {
            let emu = match chip.backend.emulated_kind() {
                Some(_) => spec.emulation.clone(),
                None => EmulationSpec { time_scale: 1.0, ..spec.emulation.clone() },
            };
            let pace = spec.chip_kind(&chip.kind).map_or(Pace::UNKNOWN, |kind| Pace::modelled(kind, &emu, model));
            (chip_addr(h, i), pace)
        })
        .collect()
}

/// Each chip's KV block size, in tokens.
pub fn chip_block_sizes(spec: &ClusterSpec) -> BTreeMap<Addr, usize> {
    spec.hosts
        .iter()
        .enumerate()
        .flat_map(|(h, host)| host.chips.iter().enumerate().map(move |(i, c)| (chip_addr(h, i), c.block_size)))
        .collect()
}

/// Why a host's behaviors could not be built.
#[derive(Debug, thiserror::Error)]
pub enum HostBuildError<E> {
    #[error("{topology}: no host named `{host}`; hosts: {hosts}")]
    UnknownHost { topology: String, host: String, hosts: String },
    /// The caller's executor for `chip` could not be made.
    #[error("chip {chip}: {source}")]
    Executor {
        chip: String,
        #[source]
        source: E,
    },
}

/// What to spawn on one host, and where the cluster's well-known actors are.
pub struct HostActors {
    pub host: HostId,
    /// (well-known actor id on `host`, behavior), in the order to spawn them.
    pub actors: Vec<(u64, Box<dyn Behavior<Msg>>)>,
    /// Where the router runs (the gateway's host).
    pub router: Addr,
    /// Admission, when this is the gateway's host.
    pub admission: Option<Addr>,
    /// The solver, when this is the gateway's host and it runs one.
    pub solver: Option<Addr>,
    /// Every chip of the cluster, by id.
    pub chips: BTreeMap<String, Addr>,
}

/// The behaviors of host `host_name` of `spec`. `id_base` seeds admission's request ids
/// (the real gateway bases it on its start time; a simulation passes a constant);
/// `solver` is the solver's fleet and space (it runs on the gateway's host when given
/// and `[solver]` enables it); `served` is the served model's shape, which the router's
/// and the chips' modelled paces are of (the reference model's when `None`); `executor`
/// makes the executor of each of this host's chips.
pub fn build_host<E>(
    spec: &ClusterSpec,
    host_name: &str,
    id_base: u64,
    solver: Option<SolverConfig>,
    served: Option<&ModelShape>,
    mut executor: impl FnMut(&HostSpec, &ChipSpec) -> Result<ExecutorFactory, E>,
) -> Result<HostActors, HostBuildError<E>> {
    let Some(index) = spec.host_index(host_name) else {
        let names: Vec<&str> = spec.hosts.iter().map(|h| h.name.as_str()).collect();
        return Err(HostBuildError::UnknownHost {
            topology: spec.source.clone(),
            host: host_name.into(),
            hosts: names.join(", "),
        });
    };
    let me = &spec.hosts[index];
    let host = HostId(index as u16);
    let is_gateway = spec.gateway.host == me.name;
    let gateway_index = spec.host_index(&spec.gateway.host).unwrap_or(0);
    let router = Addr::new(HostId(gateway_index as u16), well_known::ROUTER);
    let supervisor = Addr::new(host, well_known::SUPERVISOR);

    let mut chips = BTreeMap::new();
    let mut reports = Vec::new();
    for (h, host_spec) in spec.hosts.iter().enumerate() {
        for (i, chip) in host_spec.chips.iter().enumerate() {
            let addr = chip_addr(h, i);
            chips.insert(chip.id.clone(), addr);
            reports.push(ChipReport::starting(addr, chip.id.clone(), host_spec.name.clone(), chip.role));
        }
    }

    let mut actors: Vec<(u64, Box<dyn Behavior<Msg>>)> = Vec::new();
    let paces = modelled_paces(spec, served);
    // As admission numbers them: the open tenant alone when none are configured.
    let tenants: Arc<[String]> = match spec.tenants.is_empty() {
        true => Arc::from([OPEN_TENANT.to_owned()]),
        false => spec.tenants.iter().map(|t| t.name.clone()).collect(),
    };
    let sup = &spec.supervisor;
    let supervising = Supervisor::new(SupervisorConfig {
        host,
        host_name: me.name.clone(),
        peers: spec
            .hosts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .map(|(i, h)| (HostId(i as u16), h.name.clone()))
            .collect(),
        router: is_gateway.then_some(router),
        heartbeat_interval: Duration::from_millis(sup.heartbeat_interval_ms),
        heartbeat_timeout: Duration::from_millis(sup.heartbeat_timeout_ms),
        max_restarts: sup.max_restarts,
        restart_window: Duration::from_secs(sup.restart_window_s),
        restart_backoff: Duration::from_millis(sup.restart_backoff_ms),
    });
    actors.push((well_known::SUPERVISOR, Box::new(supervising)));

    let admission = is_gateway.then(|| Addr::new(host, well_known::ADMISSION));
    if is_gateway {
        let r = &spec.router;
        let limits = Limits {
            max_queued_requests: r.max_queued_requests,
            kv_breaker_percent: r.kv_breaker_percent,
            max_queued_prompt: Duration::from_millis(r.max_queued_prompt_ms),
            max_waiting_requests: r.max_waiting_requests,
            queue_timeout: Duration::from_millis(r.queue_timeout_ms),
            decode_overflow: r.decode_overflow,
        };
        let routing = Router::new(reports, r.max_queued_requests)
            .with_disaggregation(spec.disagg.min_prompt_tokens)
            .with_block_size(spec.block_size)
            .with_block_sizes(chip_block_sizes(spec))
            .with_policy(r.policy)
            .with_limits(limits)
            .with_paces(paces.clone());
        actors.push((well_known::ROUTER, Box::new(routing)));
        let solver = solver.filter(|_| spec.solver.enabled);
        let config = AdmissionConfig {
            max_inflight: spec.gateway.max_inflight_requests,
            router,
            retry: RetryPolicy::default(),
            id_base,
            telemetry: solver.as_ref().map(|_| Duration::from_millis(spec.solver.telemetry_interval_ms)),
            tenants: spec.tenants.clone(),
        };
        actors.push((well_known::ADMISSION, Box::new(Admission::new(config))));
        if let Some(config) = solver {
            actors.push((well_known::SOLVER, Box::new(Solver::new(config))));
        }
    }

    let h = index;
    for (i, chip) in me.chips.iter().enumerate() {
        let factory =
            executor(me, chip).map_err(|source| HostBuildError::Executor { chip: chip.id.clone(), source })?;
        let config = ChipConfig {
            id: chip.id.clone(),
            host_name: me.name.clone(),
            role: chip.role,
            max_batch_tokens: chip.max_batch_tokens,
            max_batch_seqs: chip.max_batch_seqs,
            max_mixed_step: chip.max_mixed_step_ms.map(Duration::from_millis),
            supervisor,
            kv_lease: Duration::from_millis(spec.disagg.lease_ms),
            pace: paces.get(&chip_addr(h, i)).copied().unwrap_or(Pace::UNKNOWN),
            tenants: tenants.clone(),
        };
        actors.push((well_known::CHIP_BASE + i as u64, Box::new(Chip::new(config, factory))));
    }
    let solver = actors.iter().any(|(id, _)| *id == well_known::SOLVER).then(|| Addr::new(host, well_known::SOLVER));
    Ok(HostActors { host, actors, router, admission, solver, chips })
}
