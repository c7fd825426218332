//! The KV transfer engine (data plane, DESIGN.md §6): moves KV-cache bytes between chip
//! worker threads of different processes, DLSlime-style. Bulk bytes never touch the
//! bus; the bus carries the small serde descriptors defined here.
//!
//! An engine registers memory [`Region`]s (memfd + `mmap`), describes them
//! ([`RegionDesc`]) for peers, and *pulls*: [`TransferEngine::read`] copies a batch of
//! `(src offset, dst offset, len)` [`Assignment`]s from a peer's region into a local one.
//! - `shm` (same host: equal `host_key`): the reader maps the writer's memfd read-only
//!   through `/proc/<pid>/fd/<fd>` (mapping cached per `(pid, region)`) and copies
//!   straight from the writer's pages.
//! - `tcp` (otherwise): the batch is coalesced, cut into `chunk_bytes` requests and
//!   spread over `tcp_streams` pooled connections per peer, each pipelining
//!   `pipeline_depth` requests; bytes go from the writer's region to the socket and
//!   from the socket into the reader's region, with no intermediate buffer.
//!
//! Invariants:
//! - Nothing a peer sends can panic or wedge the engine: the server validates every
//!   header (see [`wire`]), every socket read and write has a timeout, and a bad
//!   connection is closed without touching the others.
//! - No client can lock the others out or learn about regions it did not name: the
//!   server caps connections per peer address and in all, closes idle ones to make room
//!   for new ones, and its refusals name only what the request named (see `server`).
//! - A region stays valid while anyone maps it. [`TransferEngine::unregister`] only stops
//!   serving it over TCP and drops the engine's reference; a peer that already mapped
//!   it over shm keeps reading the same pages (a cached mapping outlives the
//!   unregistration). Reuse of unregistered memory is therefore the control plane's
//!   decision, made after the readers said they are done.
//! - Metrics (reader side): `tessera_transfer_bytes_total{transport}`,
//!   `tessera_transfer_seconds{transport}` (histogram, one sample per batch),
//!   `tessera_transfer_errors_total{reason}` (reader errors, and requests a server
//!   refused as `reason="served_<status>"`).

mod batch;
mod capability;
mod client;
mod region;
mod secure;
mod server;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use serde::{Deserialize, Serialize};

pub use region::Region;
pub use secure::{SealedReader, SealedStream, SealedWriter};
pub use wire::Status as RemoteStatus;

use region::PeerMapping;

/// Reads `bytes` as the data plane's two headers, a request as a server reads it and a
/// response as a client does; for fuzz targets and tests. Gives each header's fields if
/// accepted (`[region, offset, len]`, `(status, len)`; `None`: refused, or `bytes` shorter
/// than the header), and asserts that an accepted header re-encodes to the bytes it was
/// read from (reserved bytes aside).
#[doc(hidden)]
pub fn decode_headers_for_fuzzing(bytes: &[u8]) -> (Option<[u64; 3]>, Option<(RemoteStatus, u64)>) {
    let request = bytes.first_chunk::<{ wire::REQUEST_BYTES }>().and_then(|header| {
        let request = wire::Request::decode(header).ok()?;
        assert_eq!(&request.encode(), header, "an accepted request header must re-encode to its bytes");
        Some([request.region, request.offset, request.len])
    });
    let response = bytes.first_chunk::<{ wire::RESPONSE_BYTES }>().and_then(|header| {
        let response = wire::Response::decode(header).ok()?;
        let mut expected = *header;
        // Reserved: ignored on read, zero on write.
        expected[6..8].fill(0);
        assert_eq!(response.encode(), expected, "an accepted response header must re-encode to its bytes");
        Some((response.status, response.len))
    });
    (request, response)
}

/// Most peer-region mappings kept open; past this the cache is cleared (mappings in
/// use stay alive through their `Arc`).
const SHM_CACHE_MAX: usize = 1024;

/// Which transport [`TransferEngine::read`] uses ([`TransportChoice`]), and which one a
/// batch went by ([`Transport`], also its metric label).
pub use tessera_vocab::{Transport, TransportChoice};

#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// TCP data-plane listener; port 0 picks any.
    pub listen: SocketAddr,
    /// Parallel TCP connections per peer.
    pub tcp_streams: usize,
    /// Largest single TCP request.
    pub chunk_bytes: usize,
    pub transport: TransportChoice,
    /// Requests in flight per TCP connection.
    pub pipeline_depth: usize,
    /// Bound on connecting to a peer; past it the peer is unreachable.
    pub connect_timeout: Duration,
    /// Bound on any one socket read or write stalling (both sides).
    pub io_timeout: Duration,
    /// How long a server keeps an idle connection; clients drop pooled connections
    /// idle for half of it.
    pub idle_timeout: Duration,
    /// How long a server waits for a new connection's first request header.
    pub first_request_timeout: Duration,
    /// Connections a server keeps open in all; when full, a new one makes room by
    /// closing the one idle longest (see `server.rs`).
    pub max_connections: usize,
    /// Connections a server keeps open from one peer IP address; more are refused.
    /// Every engine on a peer host opens `tcp_streams`, so leave room for several.
    pub max_connections_per_peer: usize,
    /// The address peers dial, when it is not the bound one (e.g. listening on 0.0.0.0).
    pub advertise: Option<SocketAddr>,
    /// `Some`: every TCP connection, both ways, opens with the hosts' Noise handshake
    /// and carries sealed records (`secure.rs`), and every read must carry a capability
    /// the owner granted ([`TransferEngine::grant`]). Shared memory stays on the host.
    pub security: Option<crate::security::PlaneSecurity>,
    /// How long a capability lasts after it was last granted (a hand-off's lease and a
    /// margin; the owner regrants as it stages more).
    pub capability_ttl: Duration,
}

impl TransferConfig {
    pub fn new(listen: SocketAddr) -> Self {
        TransferConfig {
            listen,
            tcp_streams: 4,
            chunk_bytes: 1 << 20,
            transport: TransportChoice::Auto,
            pipeline_depth: 4,
            connect_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            first_request_timeout: Duration::from_secs(5),
            max_connections: 512,
            max_connections_per_peer: 64,
            advertise: None,
            security: None,
            capability_ttl: Duration::from_secs(10),
        }
    }

    /// Whether the server refuses reads without a capability: on a secured cluster.
    pub fn require_capability(&self) -> bool {
        self.security.is_some()
    }

    fn validate(&self) -> Result<(), TransferError> {
        let bad = |what: &str| Err(TransferError::Config(what.into()));
        if self.tcp_streams == 0 {
            return bad("tcp_streams must be at least 1");
        }
        if self.chunk_bytes == 0 || self.chunk_bytes as u64 > wire::MAX_REQUEST_LEN {
            return bad("chunk_bytes must be between 1 byte and 1 GiB");
        }
        if self.pipeline_depth == 0 {
            return bad("pipeline_depth must be at least 1");
        }
        if [self.connect_timeout, self.io_timeout, self.idle_timeout, self.first_request_timeout]
            .iter()
            .any(Duration::is_zero)
        {
            return bad("timeouts must be positive");
        }
        if self.max_connections == 0 || self.max_connections_per_peer < self.tcp_streams {
            // A peer configured like this engine opens `tcp_streams` connections.
            return bad("max_connections must be at least 1 and max_connections_per_peer at least tcp_streams");
        }
        Ok(())
    }
}

/// Where an engine is: enough for a peer to pick a transport and reach it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct EndpointDesc {
    /// Equal on two endpoints iff they run on the same machine (boot id + hostname).
    pub host_key: String,
    pub pid: u32,
    /// The TCP data-plane address.
    pub tcp: SocketAddr,
}

/// A registered region as peers see it (sent over the bus).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RegionDesc {
    pub endpoint: EndpointDesc,
    pub region: u64,
    /// The memfd's descriptor number in the owner process (for `/proc/<pid>/fd/<fd>`).
    pub fd: i32,
    pub len: u64,
    /// The owner's grant to read some ranges of it ([`TransferEngine::grant`]), sent
    /// with every tcp read; the owner's description of a region carries none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<Capability>,
}

pub use capability::Capability;

/// Copy `len` bytes from `src_offset` of the remote region to `dst_offset` of the local one.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub len: u64,
}

/// One finished batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferStats {
    pub bytes: u64,
    pub transport: Transport,
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("invalid transfer config: {0}")]
    Config(String),
    #[error("cannot bind the transfer listener on {listen}: {source}")]
    Listen { listen: SocketAddr, source: std::io::Error },
    #[error("cannot register a region of {len} bytes: {source}")]
    Register { len: usize, source: std::io::Error },
    #[error("{side} region {region}: offset {offset} + len {len} is out of bounds (the region is {region_len} bytes)")]
    OutOfBounds { side: &'static str, region: u64, offset: u64, len: u64, region_len: u64 },
    #[error(
        "local region {region}: bytes at offset {offset} (+{len}) are in use by another transfer or borrow ([{busy_start}, {busy_end}))"
    )]
    RangeBusy { region: u64, offset: u64, len: u64, busy_start: u64, busy_end: u64 },
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("peer {peer} has no region {region} (unknown region): {message}")]
    UnknownRegion { peer: SocketAddr, region: u64, message: String },
    #[error("peer {peer} refused to read region {region} at offset {offset} (+{len}): {message}")]
    Refused { peer: SocketAddr, status: RemoteStatus, region: u64, offset: u64, len: u64, message: String },
    #[error("peer {peer} unreachable (connect timeout {timeout:?}): {reason}")]
    PeerUnreachable { peer: SocketAddr, timeout: Duration, reason: String },
    #[error("peer {peer} closed the connection {during}")]
    PeerClosed { peer: SocketAddr, during: String },
    #[error("peer {peer} stalled for {after:?} {during}")]
    Timeout { peer: SocketAddr, after: Duration, during: String },
    #[error("protocol error from peer {peer}: {detail}")]
    Protocol { peer: SocketAddr, detail: String },
    #[error("I/O error with peer {peer} {during}: {source}")]
    Io { peer: SocketAddr, during: String, source: std::io::Error },
    #[error("cannot map region {region} of pid {pid} over shared memory: {reason}")]
    ShmMap { pid: u32, region: u64, reason: String },
    #[error("transport {transport} cannot reach region {region}: {reason}")]
    TransportUnavailable { transport: Transport, region: u64, reason: String },
    #[error("the transfer engine is shut down")]
    ShutDown,
    #[error("transfer engine internal error: {0}")]
    Internal(String),
}

impl TransferError {
    /// `reason` label of `tessera_transfer_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            TransferError::Config(_) => "config",
            TransferError::Listen { .. } => "listen",
            TransferError::Register { .. } => "register",
            TransferError::OutOfBounds { .. } => "out_of_bounds",
            TransferError::RangeBusy { .. } => "range_busy",
            TransferError::InvalidBatch(_) => "invalid_batch",
            TransferError::UnknownRegion { .. } => "unknown_region",
            TransferError::Refused { status, .. } => status.reason(),
            TransferError::PeerUnreachable { .. } => "peer_unreachable",
            TransferError::PeerClosed { .. } => "peer_closed",
            TransferError::Timeout { .. } => "timeout",
            TransferError::Protocol { .. } => "protocol",
            TransferError::Io { .. } => "io",
            TransferError::ShmMap { .. } => "shm_map",
            TransferError::TransportUnavailable { .. } => "transport_unavailable",
            TransferError::ShutDown => "shut_down",
            TransferError::Internal(_) => "internal",
        }
    }
}

fn count_error(e: &TransferError) {
    metrics::counter!("tessera_transfer_errors_total", "reason" => e.reason()).increment(1);
}

/// Where a batch ends: set once by the last part to finish, read by the handle.
pub(crate) struct Completion {
    state: Mutex<CompletionState>,
    done: Condvar,
}

struct CompletionState {
    parts_left: usize,
    error: Option<TransferError>,
    result: Option<Result<TransferStats, TransferError>>,
    started: Instant,
    bytes: u64,
    transport: Transport,
}

impl Completion {
    pub(crate) fn new(parts: usize, bytes: u64, transport: Transport, started: Instant) -> Arc<Completion> {
        let completion = Arc::new(Completion {
            state: Mutex::new(CompletionState {
                parts_left: parts,
                error: None,
                result: None,
                started,
                bytes,
                transport,
            }),
            done: Condvar::new(),
        });
        if parts == 0 {
            completion.finish_locked(&mut completion.state.lock());
        }
        completion
    }

    /// One part (a stream's share, or the whole batch) ended; the first error wins.
    pub(crate) fn part_done(&self, outcome: Result<(), TransferError>) {
        let mut state = self.state.lock();
        if let Err(e) = outcome
            && state.error.is_none()
        {
            state.error = Some(e);
        }
        state.parts_left = state.parts_left.saturating_sub(1);
        if state.parts_left == 0 && state.result.is_none() {
            self.finish_locked(&mut state);
        }
    }

    pub(crate) fn failed(&self) -> bool {
        self.state.lock().error.is_some()
    }

    fn finish_locked(&self, state: &mut CompletionState) {
        let result = match state.error.take() {
            Some(e) => {
                count_error(&e);
                Err(e)
            }
            None => {
                let elapsed = state.started.elapsed();
                let label = state.transport.as_str();
                metrics::counter!("tessera_transfer_bytes_total", "transport" => label).increment(state.bytes);
                metrics::histogram!("tessera_transfer_seconds", "transport" => label).record(elapsed.as_secs_f64());
                Ok(TransferStats { bytes: state.bytes, transport: state.transport, elapsed })
            }
        };
        state.result = Some(result);
        self.done.notify_all();
    }
}

/// A batch in flight. Dropping it does not cancel the batch: the local region keeps
/// being written until the batch ends.
pub struct PendingTransfer {
    completion: Arc<Completion>,
    taken: bool,
}

impl PendingTransfer {
    /// Blocks until the batch ends (bounded by the engine's I/O timeouts).
    pub fn wait(mut self) -> Result<TransferStats, TransferError> {
        let mut state = self.completion.state.lock();
        loop {
            if let Some(result) = state.result.take() {
                self.taken = true;
                return result;
            }
            self.completion.done.wait(&mut state);
        }
    }

    /// The outcome if the batch has ended: `Some` exactly once, then `None`.
    pub fn try_wait(&mut self) -> Option<Result<TransferStats, TransferError>> {
        if self.taken {
            return None;
        }
        let result = self.completion.state.lock().result.take();
        self.taken = result.is_some();
        result
    }
}

fn host_key() -> String {
    let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_string()).ok();
    match (read("/proc/sys/kernel/random/boot_id"), read("/proc/sys/kernel/hostname")) {
        (Some(boot), Some(host)) => format!("{boot}/{host}"),
        // Unknown machine identity: claim no other process shares it, so only this
        // process's own engines would use shm with each other.
        _ => format!("unknown-host/pid-{}", std::process::id()),
    }
}

/// The data-plane engine of one process (or one chip worker): registered regions, a
/// TCP server for them, pooled TCP streams and cached shm mappings of peers.
pub struct TransferEngine {
    config: TransferConfig,
    endpoint: EndpointDesc,
    regions: Arc<RwLock<HashMap<u64, Region>>>,
    server: Mutex<Option<server::Server>>,
    capabilities: capability::Capabilities,
    client: client::TcpClient,
    peer_maps: Mutex<HashMap<(u32, u64), Arc<PeerMapping>>>,
    shut_down: AtomicBool,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

impl TransferEngine {
    /// Binds the TCP listener and starts the engine's threads.
    pub fn start(config: TransferConfig) -> Result<Arc<TransferEngine>, TransferError> {
        config.validate()?;
        let regions = Arc::new(RwLock::new(HashMap::new()));
        let capabilities = capability::Capabilities::default();
        let server = server::Server::start(&config, regions.clone(), capabilities.clone())?;
        let endpoint = EndpointDesc {
            host_key: host_key(),
            pid: std::process::id(),
            tcp: config.advertise.unwrap_or(server.local_addr()),
        };
        let client = client::TcpClient::new(client::ClientConfig::from(&config));
        Ok(Arc::new(TransferEngine {
            config,
            endpoint,
            regions,
            server: Mutex::new(Some(server)),
            capabilities,
            client,
            peer_maps: Mutex::new(HashMap::new()),
            shut_down: AtomicBool::new(false),
        }))
    }

    pub fn endpoint(&self) -> &EndpointDesc {
        &self.endpoint
    }

    pub fn config(&self) -> &TransferConfig {
        &self.config
    }

    /// A new zero-filled region of `len` bytes (memfd + shared mapping, pages
    /// allocated up front), served to peers until [`unregister`](Self::unregister).
    pub fn register(&self, len: usize) -> Result<Region, TransferError> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(TransferError::ShutDown);
        }
        let region = Region::create(len)?;
        self.regions.write().insert(region.id(), region.clone());
        Ok(region)
    }

    pub fn describe(&self, region: &Region) -> RegionDesc {
        RegionDesc {
            endpoint: self.endpoint.clone(),
            region: region.id(),
            fd: region.raw_fd(),
            len: region.len() as u64,
            capability: None,
        }
    }

    /// Lets the holder of `token` (a new one when `None`) read exactly `ranges` of
    /// `region` over tcp for [`TransferConfig::capability_ttl`], replacing what `token`
    /// allowed before. The token travels in the offer (over the secured bus), never
    /// anywhere else.
    pub fn grant(
        &self,
        token: Option<Capability>,
        region: &Region,
        ranges: Vec<std::ops::Range<u64>>,
    ) -> Result<Capability, TransferError> {
        self.capabilities.grant(token, region.id(), ranges, self.config.capability_ttl)
    }

    /// Ends what `token` allowed.
    pub fn revoke(&self, token: &Capability) {
        self.capabilities.revoke(token);
    }

    /// Stops serving the region and drops the engine's reference. Peers' existing shm
    /// mappings stay valid (and keep reading these pages); see the module doc.
    pub fn unregister(&self, region: &Region) {
        self.regions.write().remove(&region.id());
    }

    /// Copies `batch` from `remote` into `local`, by the configured transport choice.
    pub fn read(
        &self,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
    ) -> Result<TransferStats, TransferError> {
        self.read_async(remote, local, batch)?.wait()
    }

    /// [`read`](Self::read) with the transport forced.
    pub fn read_via(
        &self,
        transport: Transport,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
    ) -> Result<TransferStats, TransferError> {
        self.read_via_async(transport, remote, local, batch)?.wait()
    }

    /// How many requests a `tcp` read of `batch` sends: the batch coalesced where it is
    /// contiguous on the peer, then cut at `chunk_bytes`. Checks the batch as a read does.
    pub fn tcp_requests(
        &self,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
    ) -> Result<usize, TransferError> {
        let plan = batch::plan(
            batch,
            (remote.region, remote.len),
            (local.id(), local.len() as u64),
            self.config.chunk_bytes as u64,
        )?;
        Ok(plan.chunks.len())
    }

    /// Starts [`read`](Self::read) and returns at once (an shm batch is copied before
    /// returning: it is a memcpy on this thread). Batch errors found up front (bounds,
    /// overlap, unreachable transport) are returned here; the rest by the handle.
    pub fn read_async(
        &self,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
    ) -> Result<PendingTransfer, TransferError> {
        let same_host = remote.endpoint.host_key == self.endpoint.host_key;
        match self.config.transport {
            TransportChoice::Shm => self.read_via_async(Transport::Shm, remote, local, batch),
            TransportChoice::Tcp => self.read_via_async(Transport::Tcp, remote, local, batch),
            TransportChoice::Auto if !same_host => self.read_via_async(Transport::Tcp, remote, local, batch),
            TransportChoice::Auto => match self.read_via_async(Transport::Shm, remote, local, batch) {
                Err(e @ TransferError::ShmMap { .. }) => {
                    tracing::warn!("{e}; falling back to tcp for this batch");
                    self.read_via_async(Transport::Tcp, remote, local, batch)
                }
                other => other,
            },
        }
    }

    /// [`read_async`](Self::read_async) with the transport forced.
    pub fn read_via_async(
        &self,
        transport: Transport,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
    ) -> Result<PendingTransfer, TransferError> {
        let started = Instant::now();
        let result = self.start_read(transport, remote, local, batch, started);
        if let Err(e) = &result {
            count_error(e);
        }
        Ok(PendingTransfer { completion: result?, taken: false })
    }

    fn start_read(
        &self,
        transport: Transport,
        remote: &RegionDesc,
        local: &Region,
        batch: &[Assignment],
        started: Instant,
    ) -> Result<Arc<Completion>, TransferError> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(TransferError::ShutDown);
        }
        let chunk_bytes = match transport {
            Transport::Tcp => self.config.chunk_bytes as u64,
            // One memcpy per contiguous piece: no reason to cut.
            Transport::Shm => u64::MAX,
        };
        let plan = batch::plan(batch, (remote.region, remote.len), (local.id(), local.len() as u64), chunk_bytes)?;
        match transport {
            Transport::Shm => {
                if remote.endpoint.host_key != self.endpoint.host_key {
                    return Err(TransferError::TransportUnavailable {
                        transport,
                        region: remote.region,
                        reason: format!(
                            "its owner is on another host ({} vs ours {})",
                            remote.endpoint.host_key, self.endpoint.host_key
                        ),
                    });
                }
                let completion = Completion::new(1, plan.bytes, transport, started);
                if plan.chunks.is_empty() {
                    completion.part_done(Ok(()));
                    return Ok(completion);
                }
                let peer = self.peer_mapping(remote)?;
                completion.part_done(shm_copy(&peer, local, &plan));
                Ok(completion)
            }
            Transport::Tcp => self.client.start(remote, local, plan, started),
        }
    }

    /// The cached read-only mapping of a same-host peer's region, opened on first use.
    fn peer_mapping(&self, remote: &RegionDesc) -> Result<Arc<PeerMapping>, TransferError> {
        let key = (remote.endpoint.pid, remote.region);
        if let Some(map) = self.peer_maps.lock().get(&key)
            && map.len() as u64 >= remote.len
        {
            return Ok(map.clone());
        }
        // Opened outside the lock: opening and mapping a peer's region takes syscalls.
        let map = Arc::new(PeerMapping::open(remote).map_err(|reason| TransferError::ShmMap {
            pid: remote.endpoint.pid,
            region: remote.region,
            reason,
        })?);
        let mut maps = self.peer_maps.lock();
        if maps.len() >= SHM_CACHE_MAX {
            maps.clear();
        }
        maps.insert(key, map.clone());
        Ok(map)
    }

    /// Stops serving (listener and connections closed), ends the client streams and
    /// drops cached mappings. Regions stay usable by whoever holds them. Idempotent.
    pub fn shutdown(&self) {
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(server) = self.server.lock().take() {
            server.stop();
        }
        self.client.shutdown();
        self.peer_maps.lock().clear();
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Batches larger than this are copied with streaming (cache-bypassing) stores: they
/// would only evict the caches anyway. Smaller ones (one layer of one request's KV,
/// decoded right after) stay in cache for the reader.
const SHM_STREAMING_BYTES: u64 = 8 << 20;

fn shm_copy(peer: &PeerMapping, local: &Region, plan: &batch::Plan) -> Result<(), TransferError> {
    let streaming = plan.bytes >= SHM_STREAMING_BYTES;
    for chunk in &plan.chunks {
        let mut src = chunk.src_offset as usize;
        for piece in &plan.pieces[chunk.pieces.clone()] {
            local.copy_from_peer(peer, src, piece.dst_offset as usize, piece.len as usize, streaming)?;
            src += piece.len as usize;
        }
    }
    Ok(())
}
