//! Tessera's cluster description: the topology TOML schema, its validation into a
//! [`ClusterSpec`], the embedded default topology, and the catalog of chip kinds a
//! topology may name. Every error points at the file, line, column and dotted key that
//! is wrong. This crate only describes a cluster; it starts nothing and depends on no
//! other tessera crate (nor on actors, the bus or the kernels), so every other crate
//! can read a topology.
#![forbid(unsafe_code)]

pub mod catalog;
mod error;
mod render;
mod validate;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use error::TopologyError;

/// The embedded default topology: two hosts of one CPU chip each on localhost. It
/// doubles as the documented example of the schema.
pub const DEFAULT_TOML: &str = include_str!("../default.toml");

/// The name [`default_topology`] gives as the source of the embedded file.
pub const DEFAULT_SOURCE: &str = "<embedded default topology>";

/// The builtin test models `cluster.model` may name instead of a checkpoint directory.
pub const BUILTIN_MODELS: &[&str] = &["builtin:tiny", "builtin:small", "builtin:bench"];

/// A validated cluster description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Where the spec was read from (a path, or [`DEFAULT_SOURCE`]).
    pub source: String,
    pub name: String,
    /// One of [`BUILTIN_MODELS`], or a checkpoint directory. [`load`] resolves a relative
    /// directory against the topology file's directory; [`parse`] leaves it as written.
    pub model: String,
    /// Weights dtype override: `"f32"`, `"f16"` or `"bf16"`; `None` keeps the checkpoint's.
    pub dtype: Option<String>,
    /// KV cache dtype: `"f32"` (default), `"f16"` or `"bf16"`.
    pub kv_dtype: String,
    /// KV block size in tokens (default 16, 1..=4096).
    pub block_size: usize,
    pub hosts: Vec<HostSpec>,
    pub router: RouterSpec,
    pub supervisor: SupervisorSpec,
    pub gateway: GatewaySpec,
}

/// One host (one process of the runtime) and the chips it drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    pub name: String,
    /// The host's ZeroMQ ROUTER socket.
    pub bus: SocketAddr,
    /// The host's ZeroMQ PUB socket (default: the bus port + 1).
    pub events: SocketAddr,
    pub chips: Vec<ChipSpec>,
}

/// One chip of a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChipSpec {
    /// Unique across the cluster.
    pub id: String,
    /// A [`catalog`] kind.
    pub kind: String,
    pub backend: Backend,
    pub role: Role,
    pub memory_limit_bytes: Option<u64>,
    /// Worker threads (default 1, 1..=1024).
    pub threads: usize,
    /// Most tokens in one batch (default 512).
    pub max_batch_tokens: usize,
    /// Most sequences in one batch (default 64).
    pub max_batch_seqs: usize,
}

/// Which kernels run a chip.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The reference CPU kernel library.
    Cpu,
    /// A kernel library loaded from this path (resolved by [`load`] against the
    /// topology file's directory when written relative).
    Plugin(PathBuf),
}

/// Which phases of a request a chip runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterSpec {
    pub policy: RouterPolicy,
    /// Requests the router holds before it refuses new ones (default 256).
    pub max_queued_requests: usize,
}

/// How the router picks a chip. TOML: `"least-loaded"` (default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouterPolicy {
    LeastLoaded,
}

impl RouterPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            RouterPolicy::LeastLoaded => "least-loaded",
        }
    }
}

impl std::fmt::Display for RouterPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SupervisorSpec {
    /// Default 100.
    pub heartbeat_interval_ms: u64,
    /// Default 1000; always greater than the interval.
    pub heartbeat_timeout_ms: u64,
    /// Restarts allowed within `restart_window_s` before giving up (default 3).
    pub max_restarts: u32,
    /// Default 60.
    pub restart_window_s: u64,
    /// Default 200.
    pub restart_backoff_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewaySpec {
    /// The host that runs the HTTP gateway (default: the first host); names a host.
    pub host: String,
    /// Default 127.0.0.1:8000.
    pub listen: SocketAddr,
    /// The model name clients send; `None`: derived from `cluster.model` by the gateway.
    pub served_model_name: Option<String>,
    /// Default 256.
    pub max_inflight_requests: usize,
}

impl ClusterSpec {
    /// Index in [`ClusterSpec::hosts`] of the host named `name`.
    pub fn host_index(&self, name: &str) -> Option<usize> {
        self.hosts.iter().position(|host| host.name == name)
    }

    /// Every chip with its host's index and host, in file order.
    pub fn chips(&self) -> impl Iterator<Item = (usize, &HostSpec, &ChipSpec)> {
        self.hosts.iter().enumerate().flat_map(|(index, host)| host.chips.iter().map(move |chip| (index, host, chip)))
    }

    /// A human-readable summary (what `tessera topology check` prints).
    pub fn render(&self) -> String {
        render::render(self)
    }
}

/// Reads and validates the topology file at `path`. Relative model and plugin paths
/// are resolved against the file's directory. A file that cannot be read gives an
/// error with line 0 (see [`TopologyError`]).
pub fn load(path: &Path) -> Result<ClusterSpec, TopologyError> {
    let source = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TopologyError::file(&source, format!("cannot read the topology file: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new(""));
    // Absolute, so that the spec means the same thing to a process with another cwd.
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    validate::parse(&text, &source, Some(&dir))
}

/// Parses and validates topology `text`; `source` names it in error messages. Relative
/// model and plugin paths are kept as written.
pub fn parse(text: &str, source: &str) -> Result<ClusterSpec, TopologyError> {
    validate::parse(text, source, None)
}

/// The embedded default topology ([`DEFAULT_TOML`]).
pub fn default_topology() -> ClusterSpec {
    match parse(DEFAULT_TOML, DEFAULT_SOURCE) {
        Ok(spec) => spec,
        // The file is part of this crate and a unit test parses it.
        Err(e) => panic!("the embedded default topology is invalid: {e}"),
    }
}
