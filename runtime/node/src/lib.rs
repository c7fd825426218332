//! Builds and runs one host of a cluster from a validated topology: its actor host and
//! bus, its KV transfer engine, its supervisor, its chips (with their model executors)
//! and — on the gateway's host — the router, admission and the HTTP gateway. `tessera up`
//! and `tessera node` call [`run_node`] once per host (as child processes, or threads
//! with `--in-process`); so do the end-to-end tests, through the binary.
//!
//! The one place where behaviors meet their adapters: behaviors (`tessera-actors`) never
//! depend on it, and it makes no scheduling decision of its own.
#![forbid(unsafe_code)]

pub mod calibrate;

use metrics_exporter_prometheus::PrometheusHandle;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_access::AuditLog;
use tessera_access::token::AdminToken;
use tessera_actors::chip::executor::{ExecutorFactory, StepExecutor};
use tessera_actors::host::{HostBuildError, build_host};
use tessera_actors::msg::Msg;
use tessera_actors::solver::Costing;
use tessera_backends::config::ModelConfig;
use tessera_backends::cost::ServedModel;
use tessera_backends::synth::Preset;
use tessera_backends::tokenizer::TextTokenizer;
use tessera_chip_executor::{Emulation, ModelExecutor, ModelExecutorConfig};
use tessera_gateway::access::{Access, AccessConfig, TenantView};
use tessera_gateway::listener::HttpLimits;
use tessera_gateway::probe::HostProbe;
use tessera_gateway::server::{self, GatewayConfig, GatewayState};
use tessera_runtime::bus::{Bus, BusConfig, PeerSpec};
use tessera_runtime::host::Host;
use tessera_runtime::security::{HostKeypair, Keyring, Mode, PlaneSecurity};
use tessera_runtime::transfer::{TransferConfig, TransferEngine};
use tessera_runtime::{Addr, HostId};
use tessera_topology::SecurityMode;
use tessera_topology::perf::Link;
use tessera_topology::{Backend, ChipSpec, ClusterSpec};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a host could not be brought up or served.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{topology}: no host named `{host}`; hosts: {hosts}")]
    UnknownHost { topology: String, host: String, hosts: String },
    /// A topology value the backends refuse (a dtype, a layout, a chip kind).
    #[error("{0}")]
    Config(String),
    /// The model's files (config, weights, tokenizer).
    #[error(transparent)]
    Model(#[from] tessera_backends::error::BackendError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A host name in the topology does not resolve, even after `bus.resolve_timeout_ms`
    /// of retries.
    #[error(
        "host {host}: {what}: {source}; check the name (a hosts file entry, or the pod's DNS name under \
         its headless Service) or raise bus.resolve_timeout_ms"
    )]
    Resolve { host: String, what: String, source: tessera_topology::ResolveError },
    /// `[security]` asks for keys this host cannot find or use.
    #[error("host {host}: {detail}")]
    Keys { host: String, detail: String },
    /// Something failed to start or serve; `context` says what.
    #[error("{context}")]
    Start {
        context: String,
        #[source]
        cause: BoxError,
    },
}

/// How this host secures its planes, from `[security]`: its own key from the keys
/// directory and every host's public key; `None` when the mode is `off`.
pub fn plane_security(spec: &ClusterSpec, host_index: usize) -> Result<Option<PlaneSecurity>, NodeError> {
    let me = &spec.hosts[host_index];
    let keys_err = |detail: String| NodeError::Keys { host: me.name.clone(), detail };
    let mode = match spec.security.mode {
        SecurityMode::Off => {
            if let Some(h) = spec.hosts.iter().find(|h| !h.bus.is_loopback()) {
                tracing::warn!(host = %h.name, bus = %h.bus, "security is off: bus and KV transfer travel in clear beyond loopback");
            }
            return Ok(None);
        }
        SecurityMode::Authenticate => Mode::Authenticate,
        SecurityMode::Encrypt => Mode::Encrypt,
    };
    let Some(dir) = &spec.security.keys_dir else {
        let beyond = spec.hosts.iter().find(|h| !h.bus.is_loopback());
        let why = beyond.map_or_else(String::new, |h| {
            format!(" (the default once a host is reached beyond loopback: `{}` at {})", h.name, h.bus)
        });
        return Err(keys_err(format!(
            "the bus and KV transfer are secured (security mode `{}`{why}) and that needs host keys: on each host run \
             `tessera keys gen-host --name HOST --out DIR`, copy every HOST.pub into each host's DIR, and add \
             [security] keys_dir = \"DIR\" (or mode = \"off\" to send in clear on a network you trust)",
            spec.security.mode
        )));
    };
    let identity = HostKeypair::load(dir, &me.name).map_err(|e| {
        keys_err(format!(
            "{e} (make this host's key with `tessera keys gen-host --name {} --out {}`)",
            me.name,
            dir.display()
        ))
    })?;
    let hosts = spec.hosts.iter().enumerate().map(|(i, h)| (HostId(i as u16), h.name.clone())).collect();
    let inline = spec.hosts.iter().enumerate().filter_map(|(i, h)| Some((HostId(i as u16), h.public_key?))).collect();
    let keyring = Keyring::new(hosts, inline, Some(dir.clone()));
    let missing = keyring.missing();
    if !missing.is_empty() {
        return Err(keys_err(format!(
            "no public key for host(s) {}: copy each one's HOST.pub into {} or set its hosts.public_key",
            missing.join(", "),
            dir.display()
        )));
    }
    if keyring.host_of(identity.public()) != Some(HostId(host_index as u16)) {
        return Err(keys_err(format!(
            "{} does not match the public key the cluster lists for this host; copy this host's new .pub to every host",
            tessera_runtime::security::keys::private_key_path(dir, &me.name).display()
        )));
    }
    Ok(Some(PlaneSecurity {
        mode,
        cipher: spec.security.cipher,
        identity: Arc::new(identity),
        keyring: Arc::new(keyring),
    }))
}

/// Who may call the gateway: the keys file, or an admin token made for this start (so
/// admin routes are never open), and the audit log, which records the start and the
/// tenants' limits.
fn gateway_access(spec: &ClusterSpec, served_model: &str) -> Result<Arc<Access>, NodeError> {
    let home = tessera_backends::builtin::cache_dir();
    let listen = spec.gateway.listen;
    let admin_token = match &spec.gateway.keys_file {
        Some(_) => None,
        None => {
            let (token, path) = AdminToken::create(&home, listen)
                .map_err(ctx(format!("gateway: writing the admin token under {}", home.display())))?;
            eprintln!(
                "tessera: no keys file (gateway.keys_file): admin routes take the token in {} (the CLI on this machine reads it)",
                path.display()
            );
            Some(token)
        }
    };
    let audit = spec.gateway.audit_log.clone().unwrap_or_else(|| match &spec.gateway.keys_file {
        Some(keys) => keys.with_file_name("audit.log"),
        None => home.join("audit").join(format!("{}.log", tessera_access::token::file_stem(listen))),
    });
    let tenants = spec.tenants.iter().map(|t| TenantView { name: t.name.clone(), models: t.models.clone() }).collect();
    let config = AccessConfig {
        keys_file: spec.gateway.keys_file.clone(),
        admin_token,
        audit: AuditLog::new(audit),
        tenants,
        served_model: served_model.to_owned(),
    };
    let access = Access::new(config).map_err(|e| match &e {
        tessera_access::KeysError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            NodeError::Config(format!("{e}; make it with `tessera keys add --file FILE --tenant NAME`"))
        }
        _ => NodeError::Config(e.to_string()),
    })?;
    let limits: Vec<serde_json::Value> = spec
        .tenants
        .iter()
        .map(|t| {
            serde_json::json!({
                "tenant": t.name, "weight": t.weight, "priority": t.priority.as_str(),
                "requests_per_min": t.limits.requests_per_min, "tokens_per_min": t.limits.tokens_per_min,
                "max_concurrent": t.limits.max_concurrent, "max_tokens": t.limits.max_tokens,
                "share_prefix_cache": t.share_prefix_cache,
            })
        })
        .collect();
    let details = serde_json::json!({
        "listen": listen.to_string(), "topology": spec.source, "keys": access.key_count(),
        "keys_file": spec.gateway.keys_file.as_ref().map(|p| p.display().to_string()), "tenants": limits,
    });
    access.append("gateway_started", "tessera", details);
    eprintln!("tessera: audit log {}", access.audit().path().display());
    Ok(Arc::new(access))
}

/// Wraps an error with what was being done, for `map_err`.
fn ctx<E: Into<BoxError>>(context: impl Into<String>) -> impl FnOnce(E) -> NodeError {
    let context = context.into();
    move |e| NodeError::Start { context, cause: e.into() }
}

/// A checkpoint directory, or a builtin test model (`builtin:<preset>`) generated on first use.
pub fn resolve_model(spec: &str) -> Result<PathBuf, NodeError> {
    match spec.strip_prefix("builtin:") {
        Some(name) => {
            let preset = name.parse::<Preset>().map_err(NodeError::Config)?;
            Ok(tessera_backends::builtin::model_dir(preset)?)
        }
        None => Ok(PathBuf::from(spec)),
    }
}

/// How a node is run.
pub struct NodeOptions {
    /// The kernel library for `backend = "cpu"` chips (default: the one built with us).
    pub kernel_lib: Option<PathBuf>,
    /// Prometheus recorder of this process (installed once per process).
    pub metrics: Option<PrometheusHandle>,
    /// How long a draining gateway waits for in-flight requests.
    pub drain_timeout: Duration,
    /// Where to serve this host's probe endpoint (`/health`, `/health/live`, `/metrics`;
    /// see `tessera_gateway::probe`), if anywhere: how an orchestrator checks a host that
    /// does not run the gateway.
    pub probe_listen: Option<SocketAddr>,
}

pub use tessera_actors::host::chip_addr;

pub mod instance;

/// How chip `chip` of `spec` loads its model from `model_dir`: its kernel library (a
/// plugin's, else `kernel_lib`, else the one built with us), threads, memory, dtypes,
/// KV layout and batch limits; attached to `transfer` for disaggregation, and paced
/// when it is emulated.
pub fn executor_config(
    spec: &ClusterSpec,
    chip: &ChipSpec,
    model_dir: &Path,
    kernel_lib: Option<PathBuf>,
    transfer: Option<Arc<TransferEngine>>,
    stage_seal: Option<Arc<dyn tessera_backends::stage_link::LinkSeal>>,
) -> Result<ModelExecutorConfig, NodeError> {
    let kind_of = |name: &str| {
        spec.chip_kind(name).cloned().ok_or_else(|| NodeError::Config(format!("unknown chip kind `{name}`")))
    };
    let mut emulation = match &chip.backend {
        Backend::Emu(kind) => {
            Some(Emulation { kind: kind_of(kind)?, spec: spec.emulation.clone(), stages: Vec::new() })
        }
        Backend::Cpu | Backend::Plugin(_) => None,
    };
    let parallel = match &chip.parallel {
        None => None,
        Some(par) => {
            let stages = instance::stages(spec, chip, par, model_dir, kernel_lib.clone(), stage_seal)?;
            let emulated = par.chips.iter().filter(|c| c.backend.emulated_kind().is_some()).count();
            if emulated != 0 && emulated != par.chips.len() {
                return Err(NodeError::Config(format!(
                    "instance `{}`: {emulated} of its {} chips are emulated; an instance is paced as one, so \
                     its chips are all emulated or none",
                    chip.id,
                    par.chips.len()
                )));
            }
            if let Some(emu) = emulation.as_mut() {
                for (s, stage) in stages.iter().enumerate() {
                    emu.stages.push((kind_of(&par.stage(s)[0].kind)?, stage.layers.len(), par.tp));
                }
            }
            Some(stages)
        }
    };
    Ok(ModelExecutorConfig {
        parallel,
        model_dir: model_dir.to_path_buf(),
        kernel_lib: match &chip.backend {
            Backend::Plugin(path) => Some(path.clone()),
            Backend::Cpu | Backend::Emu(_) => kernel_lib,
        },
        threads: chip.threads as u32,
        memory_limit_bytes: chip.memory_limit_bytes,
        dtype: spec.dtype,
        kv_dtype: chip.kv_dtype,
        kv_layout: chip.kv_layout,
        quantize: chip.quantize,
        matmul_precision: chip.matmul_precision,
        block_size: chip.block_size,
        max_batch_seqs: chip.max_batch_seqs,
        chip_id: chip.id.clone(),
        transfer,
        emulation,
    })
}

/// The solver of `spec`'s cluster, its chips costed by their kinds' performance models
/// and prices, KV crossing a 100 Gb/s fabric between hosts; `None` (logged) when the
/// solver is off or the fleet cannot be costed (a kind without a price, say): the
/// cluster serves as written.
pub fn solver_config(spec: &ClusterSpec) -> Option<tessera_actors::solver::SolverConfig> {
    if !spec.solver.enabled {
        return None;
    }
    let served = match ServedModel::read(&spec.model, spec.dtype, Path::new(".")) {
        Ok(served) => served,
        Err(e) => {
            tracing::warn!(error = %e, "solver off: the model cannot be costed");
            return None;
        }
    };
    let shape = |d| served.shape(d);
    let perf = |k: &str| spec.emulation.perf_model_of(k);
    let price = |k: &str| spec.chip_kind(k).and_then(|kind| kind.price.as_ref()).map(|p| p.usd_per_hour);
    let costing = Costing {
        shape: &shape,
        weight_bytes: served.weight_bytes,
        perf: &perf,
        price: &price,
        link: Link::ETHERNET_100G,
    };
    match tessera_actors::solver::solver_config(spec, &costing) {
        Ok(config) => Some(config),
        Err(e) => {
            tracing::warn!(error = %e, "solver off: the fleet cannot be costed");
            None
        }
    }
}

/// This host's sockets as it binds them: its own names resolved now. The topology keeps
/// the names; peers look them up again whenever they reconnect.
struct Addresses {
    bus: SocketAddr,
    events: SocketAddr,
    transfer: SocketAddr,
    stages: Option<SocketAddr>,
}

impl Addresses {
    /// Resolves this host's own addresses and checks that every peer's bus name resolves
    /// too, each retried for `bus.resolve_timeout_ms`: a name that never resolves is a
    /// start-up error, not a link that silently never comes up.
    fn resolve(spec: &ClusterSpec, index: usize) -> Result<Addresses, NodeError> {
        let me = &spec.hosts[index];
        let within = Duration::from_millis(spec.bus.resolve_timeout_ms);
        let every = Duration::from_millis(250);
        let own = |what: &str, endpoint: &tessera_topology::Endpoint| {
            endpoint.resolve_within(within, every).map_err(|source| NodeError::Resolve {
                host: me.name.clone(),
                what: format!("its own {what} address"),
                source,
            })
        };
        let at = Addresses {
            bus: own("bus", &me.bus)?,
            events: own("events", &me.events)?,
            transfer: own("transfer", &me.transfer)?,
            stages: me.stages.as_ref().map(|e| own("stages", e)).transpose()?,
        };
        for peer in spec.hosts.iter().filter(|h| h.name != me.name) {
            let addr = peer.bus.resolve_within(within, every).map_err(|source| NodeError::Resolve {
                host: me.name.clone(),
                what: format!("peer host `{}`", peer.name),
                source,
            })?;
            if peer.bus.ip().is_none() {
                tracing::info!(peer = %peer.name, name = %peer.bus, %addr, "peer host's name resolves");
            }
        }
        Ok(at)
    }
}

/// Runs host `host_name` of `spec` until `shutdown` resolves, then drains.
pub fn run_node(
    spec: &ClusterSpec,
    host_name: &str,
    opts: &NodeOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), NodeError> {
    let Some(index) = spec.host_index(host_name) else {
        let names: Vec<&str> = spec.hosts.iter().map(|h| h.name.as_str()).collect();
        return Err(NodeError::UnknownHost {
            topology: spec.source.to_string(),
            host: host_name.into(),
            hosts: names.join(", "),
        });
    };
    let me = &spec.hosts[index];
    let at = Addresses::resolve(spec, index)?;
    if let Some(path) = &spec.security.at_rest_key_file {
        let key = tessera_access::at_rest::AtRestKey::from_file(path)
            .map_err(|e| NodeError::Keys { host: me.name.clone(), detail: e.to_string() })?;
        // A second host of this process (`up --in-process`) shares the first one's key.
        tessera_access::at_rest::install(key);
    }
    let model_dir = resolve_model(&spec.model)?;
    let model_config = ModelConfig::from_dir(&model_dir)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(format!("tessera-io-{host_name}"))
        .enable_all()
        .build()?;
    let host = Arc::new(Host::<Msg>::start(HostId(index as u16))?);
    let peers = spec
        .hosts
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != index)
        .map(|(i, h)| PeerSpec {
            host: HostId(i as u16),
            name: h.name.clone(),
            direct: h.bus.clone(),
            events: h.events.clone(),
        })
        .collect();
    let security = plane_security(spec, index)?;
    let bus_config = BusConfig {
        peers,
        security: security.clone(),
        max_frame_bytes: spec.bus.max_frame_bytes,
        handshake_timeout: Duration::from_millis(spec.bus.handshake_timeout_ms),
        ..BusConfig::new(HostId(index as u16), me.name.clone(), at.bus, at.events)
    };
    let bus: Bus = rt
        .block_on(Bus::start(bus_config, host.inbound()))
        .map_err(ctx(format!("host {host_name}: starting the bus on {} / {}", me.bus, me.events)))?;
    host.attach_bus(bus.clone());

    // The data plane: KV blocks move between chips through it, never over the bus.
    let d = &spec.disagg;
    let transfer = TransferEngine::start(TransferConfig {
        tcp_streams: d.tcp_streams,
        chunk_bytes: d.chunk_bytes(),
        transport: d.transport,
        security: security.clone(),
        // A hand-off's capability outlives its lease a little: D may be mid-read.
        capability_ttl: Duration::from_millis(2 * d.lease_ms),
        ..TransferConfig::new(at.transfer)
    })
    .map_err(ctx(format!("host {host_name}: starting the KV transfer engine on {}", me.transfer)))?;

    // Stage links (to and from stage servers) are sealed like the data plane.
    let stage_seal: Option<Arc<dyn tessera_backends::stage_link::LinkSeal>> =
        security.clone().map(|sec| Arc::new(instance::StageSeal(sec)) as _);
    // The stages this host holds for instances on other hosts.
    if let Some(addr) = at.stages {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(ctx(format!("host {host_name}: starting the stage server on {addr}")))?;
        let (spec_c, me_c, dir_c, lib_c) = (spec.clone(), me.name.clone(), model_dir.clone(), opts.kernel_lib.clone());
        let resolve = Arc::new(move |inst: &str, stage: usize| {
            instance::resolve_stage(&spec_c, &me_c, inst, stage, &dir_c, lib_c.clone())
        });
        std::thread::Builder::new()
            .name(format!("stage-server-{host_name}"))
            .spawn({
                let seal = stage_seal.clone();
                move || instance::serve_stages(listener, resolve, seal)
            })
            .map_err(ctx(format!("host {host_name}: starting the stage server thread")))?;
    }

    // Request ids based on the start time (the one clock read here, in the adapter): a
    // restarted gateway's ids do not meet old ones still on chips.
    let id_base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64 & 0xffff_ffff_0000);
    let solver = if spec.gateway.host == me.name { solver_config(spec) } else { None };
    // The router and the chips pace work by the served model's roofline.
    let served = match ServedModel::read(&spec.model, spec.dtype, Path::new(".")) {
        Ok(served) => Some(served.shape(spec.kv_dtype)),
        Err(e) => {
            tracing::warn!(error = %e, "paces modelled on the reference model: the served model cannot be costed");
            None
        }
    };
    let built = build_host(spec, host_name, id_base, solver, served.as_ref(), |_, chip| {
        let config = executor_config(
            spec,
            chip,
            &model_dir,
            opts.kernel_lib.clone(),
            Some(transfer.clone()),
            stage_seal.clone(),
        )?;
        let factory: ExecutorFactory = Arc::new(move || {
            ModelExecutor::load(&config).map(|(exec, info)| (Box::new(exec) as Box<dyn StepExecutor>, info))
        });
        Ok::<_, NodeError>(factory)
    })
    .map_err(|e| match e {
        HostBuildError::UnknownHost { topology, host, hosts } => NodeError::UnknownHost { topology, host, hosts },
        HostBuildError::Executor { chip, source: NodeError::Config(why) } => {
            NodeError::Config(format!("chip {chip}: {why}"))
        }
        HostBuildError::Executor { source, .. } => source,
    })?;
    let router = built.router;
    let solver_addr = built.solver;
    let chip_addrs: HashMap<String, Addr> = built.chips.into_iter().collect();
    for (actor, behavior) in built.actors {
        host.spawn_at(actor, behavior);
    }

    // The probe endpoint answers until the host stops; it turns not-ready when the drain
    // starts, so that the host is taken out of rotation first.
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let shutdown = {
        let tx = shutdown_tx;
        async move {
            shutdown.await;
            let _ = tx.send(true);
        }
    };
    if let Some(listen) = opts.probe_listen {
        // Joined: the bus link to the gateway's host is up (requests and heartbeats
        // cross it); the gateway's own host has joined by definition.
        let joined: tessera_gateway::probe::JoinedCheck = match spec.host_index(&spec.gateway.host) {
            Some(gw) if gw != index => {
                let (bus, gw_name) = (bus.clone(), spec.gateway.host.clone());
                Box::new(move || match bus.link_up(HostId(gw as u16)) {
                    Some(false) => Err(format!("no bus link to the gateway's host `{gw_name}` yet")),
                    _ => Ok(()),
                })
            }
            _ => Box::new(|| Ok(())),
        };
        let probe = Arc::new(HostProbe::new(host_name.to_string(), me.chips.len(), opts.metrics.clone(), joined));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(listen))
            .map_err(ctx(format!("host {host_name}: cannot serve its probe endpoint on {listen}")))?;
        let mut draining = shutdown_rx.clone();
        let p = probe.clone();
        rt.spawn(async move {
            let _ = draining.wait_for(|d| *d).await;
            p.set_draining();
        });
        // It answers (not ready) through the drain and ends with the runtime.
        rt.spawn(async move {
            if let Err(e) = tessera_gateway::probe::serve(listener, probe, std::future::pending()).await {
                tracing::warn!("the probe endpoint stopped: {e}");
            }
        });
        eprintln!("tessera: host {host_name} probe endpoint on http://{listen}/health");
    }

    let result = if let Some(admission) = built.admission {
        let tokenizer = TextTokenizer::from_dir(&model_dir)?;
        let served_model = spec.gateway.served_model_name.clone().unwrap_or_else(|| spec.model.clone());
        let config = GatewayConfig {
            served_model: served_model.clone(),
            max_context: model_config.max_context,
            router,
            admission,
            chips: chip_addrs,
            solver: solver_addr,
            metrics: opts.metrics.clone(),
            max_prompt_bytes: spec.gateway.max_prompt_bytes.unwrap_or_else(|| {
                server::default_max_prompt_bytes(model_config.max_context, tokenizer.max_token_bytes())
            }),
            http: HttpLimits {
                max_connections: spec.gateway.max_connections,
                header_read_timeout: Duration::from_millis(spec.gateway.header_read_timeout_ms),
            },
            access: gateway_access(spec, &served_model)?,
        };
        let state = Arc::new(GatewayState::new(host.clone(), tokenizer, config).map_err(NodeError::Config)?);
        let listen = spec.gateway.listen;
        let drain = opts.drain_timeout;
        let host_name = host_name.to_string();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(ctx(format!("gateway: cannot listen on {listen}")))?;
            eprintln!(
                "tessera: host {host_name} serving model `{served_model}` on http://{listen} ({} chips in the cluster)",
                spec.hosts.iter().map(|h| h.chips.len()).sum::<usize>()
            );
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let name = host_name.clone();
            let drained = tokio::spawn(async move {
                shutdown.await;
                eprintln!("tessera: host {name} draining (up to {} s)", drain.as_secs());
                let _ = stop_tx.send(());
            });
            let serving = server::serve(listener, state, async move {
                let _ = stop_rx.await;
            });
            // Graceful shutdown waits for open requests; the drain timeout bounds it.
            let outcome = tokio::select! {
                r = serving => r.map_err(NodeError::from),
                _ = async { let _ = drained.await; tokio::time::sleep(drain).await } => {
                    eprintln!("tessera: drain timeout reached; closing the remaining requests");
                    Ok(())
                }
            };
            outcome
        })
    } else {
        eprintln!("tessera: host {host_name} up (bus {})", me.bus);
        rt.block_on(shutdown);
        Ok(())
    };
    eprintln!("tessera: host {host_name} stopped");
    match Arc::try_unwrap(host) {
        Ok(host) => host.shutdown(),
        Err(host) => drop(host),
    }
    rt.block_on(bus.shutdown());
    transfer.shutdown();
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}
