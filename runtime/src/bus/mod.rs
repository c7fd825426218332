//! The ZeroMQ bus between host processes.
//!
//! Each host binds a ROUTER (direct messages in) and a PUB (broadcasts out). For every
//! peer it keeps a DEALER connected to the peer's ROUTER and a SUB connected to the
//! peer's PUB, subscribed to everything (topic filtering is the host's job). Direct
//! messages only ever flow DEALER -> ROUTER, so the ROUTER side is receive-only and a
//! reply goes back through the replier's own DEALER.
//!
//! Invariants:
//! - [`Bus::send`] and [`Bus::publish`] never block: each peer has a bounded queue and
//!   one writer task; a full queue is [`SendError::Full`], never unbounded memory, and a
//!   dead or stalled peer never delays sends to the others.
//! - A frame that fails to decode is counted (`tessera_bus_frames_dropped_total{reason}`)
//!   and dropped with a rate-limited warning; it never panics the node.
//! - Links reconnect in the background with backoff, so peers may start in any order
//!   and a peer that restarts is reached again without restarting us.
//! - Frames queued for a peer *before its first connection* are delivered once it is
//!   up. Frames still queued when a link comes back *after a disconnect* were addressed
//!   to the peer's previous life and are discarded (counted as `discarded`,
//!   `reason="peer_down"`); so are frames the bus had already handed to ZeroMQ when the
//!   peer died. The bus is at-most-once: requests survive restarts by replay above it.
//!
//! What `zeromq` 0.7 does and does not do (the reasons for `link.rs`):
//! - DEALER never reconnects; once the peer's end-of-stream is seen, every send fails
//!   at once ("not connected"). SUB reconnects, with a backoff growing to 30 s. So the
//!   bus rebuilds both sockets itself, with a backoff capped at `reconnect_max`.
//! - A DEALER send waits only when the crate's own per-connection queue (100,000
//!   frames) is full, i.e. a live peer that stopped reading; `send_timeout` bounds that
//!   wait. Until a peer stalls, up to that many frames sit in ZeroMQ beyond our queue.
//! - No ZMTP heartbeats, no TCP keepalive: a peer that vanishes without closing its
//!   connections is noticed only by a send timing out; see [`Bus::reset_peer`].
//! - The published crate has no maximum message size and no handshake timeout (a few
//!   bytes announcing a 2^60-byte frame aborted the process). The workspace patches it
//!   (`runtime/vendor/zeromq`, see its PATCH.md): every socket of the bus refuses a
//!   message over [`BusConfig::max_frame_bytes`] *before* reserving memory for it, in
//!   every connection state, and drops that connection; a connection that has not
//!   completed its ZMTP handshake within [`BusConfig::handshake_timeout`] is closed.
//!   So one connection can make a host hold at most about `max_frame_bytes` + 64 KiB.
//! - A handshake that ends after its socket closed leaks the connection and a task;
//!   shutdown reaps those.

mod link;
mod ports;
mod secure;

pub use ports::free_loopback_ports;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
pub use tessera_vocab::Endpoint;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::addr::HostId;
use crate::codec::{self, CodecError, Envelope};
use crate::security::{PlaneSecurity, frame};

/// Per-peer outbound frames queued before [`SendError::Full`].
pub const DEFAULT_QUEUE_CAPACITY: usize = 4096;

/// Another host of the cluster, as this host reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub host: HostId,
    /// The host's name (metrics label and logs).
    pub name: String,
    /// Its ROUTER address (a DNS name is resolved again on every reconnect).
    pub direct: Endpoint,
    /// Its PUB address.
    pub events: Endpoint,
}

#[derive(Debug, Clone)]
pub struct BusConfig {
    pub host: HostId,
    pub name: String,
    /// Where our ROUTER binds (direct messages in).
    pub direct: SocketAddr,
    /// Where our PUB binds (broadcasts out).
    pub events: SocketAddr,
    /// The other hosts.
    pub peers: Vec<PeerSpec>,
    /// Outbound frames queued per peer (and for broadcasts) before sends are refused.
    pub queue_capacity: usize,
    /// A peer that accepts no frame for this long is treated as dead: its link is
    /// dropped and reconnected.
    pub send_timeout: Duration,
    /// Longest wait between two connection attempts to a peer.
    pub reconnect_max: Duration,
    /// The largest message accepted on any bus socket (all its ZeroMQ frames); a peer
    /// announcing more is disconnected before anything is allocated for it.
    pub max_frame_bytes: usize,
    /// A connection that has not completed its ZMTP handshake by then is closed; so is a
    /// secured link whose Noise handshake takes longer.
    pub handshake_timeout: Duration,
    /// `None`: frames travel as plain MessagePack. `Some`: every link is opened with a
    /// Noise handshake between listed hosts and every frame is sealed (`secure.rs`).
    pub security: Option<PlaneSecurity>,
    /// Frames sealed under one key before a fresh one is granted (tests lower it).
    pub rekey_after_frames: u64,
}

impl BusConfig {
    pub fn new(host: HostId, name: impl Into<String>, direct: SocketAddr, events: SocketAddr) -> BusConfig {
        BusConfig {
            host,
            name: name.into(),
            direct,
            events,
            peers: Vec::new(),
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            send_timeout: Duration::from_secs(5),
            reconnect_max: Duration::from_secs(1),
            max_frame_bytes: codec::MAX_FRAME_BYTES,
            handshake_timeout: Duration::from_secs(5),
            security: None,
            rekey_after_frames: crate::security::frame::REKEY_AFTER_FRAMES,
        }
    }

    /// Socket options every bus socket uses: the message-size bound and the handshake
    /// timeout.
    pub(crate) fn socket_options(&self) -> SocketOptions {
        let mut options = SocketOptions::default();
        options.max_message_size(self.max_frame_bytes);
        options.handshake_timeout(self.handshake_timeout);
        options
    }

    fn validate(&self) -> Result<(), BusError> {
        if self.queue_capacity == 0 {
            return Err(BusError::Config("queue_capacity must be at least 1".into()));
        }
        // Our own envelopes (up to codec::MAX_FRAME_BYTES) plus the topic or identity
        // frame must fit, or the bus would refuse its own traffic.
        if !(4096..=1 << 30).contains(&self.max_frame_bytes) {
            return Err(BusError::Config(format!(
                "max_frame_bytes must be between 4096 and {}, not {}",
                1u64 << 30,
                self.max_frame_bytes
            )));
        }
        if self.rekey_after_frames < 2 {
            return Err(BusError::Config("rekey_after_frames must be at least 2".into()));
        }
        if self.handshake_timeout.is_zero() {
            return Err(BusError::Config("handshake_timeout must be positive".into()));
        }
        let mut seen = HashSet::new();
        for peer in &self.peers {
            if peer.host == self.host {
                return Err(BusError::Config(format!("peer {} has this host's own id {}", peer.name, peer.host)));
            }
            if !seen.insert(peer.host) {
                return Err(BusError::Config(format!("peer {} is listed twice", peer.host)));
            }
        }
        Ok(())
    }
}

/// Called from the bus's receive tasks with each decoded envelope (direct or
/// broadcast). It must not block: hand the envelope to a queue or a mailbox.
pub type InboundFn = Arc<dyn Fn(Envelope) + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot bind the bus {role} socket on {addr}: {source}")]
    Bind {
        role: &'static str,
        addr: SocketAddr,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("invalid bus config: {0}")]
    Config(String),
    #[error("the bus must be started inside a tokio runtime")]
    NoRuntime,
    #[error("no random source for the bus's keys: {0}")]
    Random(#[from] getrandom::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("outbound queue to {peer} is full")]
    Full { peer: String },
    #[error("{0} is not a peer on this bus")]
    UnknownHost(HostId),
    #[error("envelope has no `{0}`")]
    Missing(&'static str),
    #[error("cannot encode envelope: {0}")]
    Encode(#[from] CodecError),
    #[error("the bus is shut down")]
    Closed,
}

/// Counters since the bus started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BusStats {
    /// Frames handed to ZeroMQ (direct and broadcast).
    pub sent: u64,
    /// Envelopes decoded and given to the inbound function.
    pub received: u64,
    /// Inbound frames dropped because they did not decode (or were misaddressed).
    pub dropped: u64,
    /// Sends and publishes refused because a queue was full.
    pub queue_full: u64,
    /// Links re-established after a disconnect.
    pub reconnects: u64,
    /// Outbound frames discarded because their peer went down.
    pub discarded: u64,
    /// Secured links opened (handshakes completed, either side).
    pub handshakes: u64,
    /// Handshakes refused because the other side's key is not listed (either side).
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    dropped: AtomicU64,
    queue_full: AtomicU64,
    reconnects: AtomicU64,
    discarded: AtomicU64,
    handshakes: AtomicU64,
    refused: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> BusStats {
        BusStats {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            queue_full: self.queue_full.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            discarded: self.discarded.load(Ordering::Relaxed),
            handshakes: self.handshakes.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }
}

/// At most one warning a second, saying how many were held back.
struct WarnLimiter {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl WarnLimiter {
    fn new() -> WarnLimiter {
        WarnLimiter { last: Mutex::new(None), suppressed: AtomicU64::new(0) }
    }

    /// `Some(n)` when a warning may be logged now, `n` being how many were suppressed.
    fn allow(&self) -> Option<u64> {
        let mut last = self.last.lock();
        let now = Instant::now();
        match *last {
            Some(t) if now.duration_since(t) < Duration::from_secs(1) => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.suppressed.swap(0, Ordering::Relaxed))
            }
        }
    }
}

/// What the receive tasks share.
struct Receiver {
    host: HostId,
    inbound: InboundFn,
    counters: Arc<Counters>,
    warn: WarnLimiter,
    received_direct: metrics::Counter,
    received_events: metrics::Counter,
    /// Set when the bus is secured: the broadcast keys peers granted us.
    secured: Option<secure::Secured>,
}

impl Receiver {
    fn drop_frame(&self, reason: &'static str, source: &str, detail: &dyn std::fmt::Display) {
        Counters::add(&self.counters.dropped, 1);
        metrics::counter!("tessera_bus_frames_dropped_total", "reason" => reason).increment(1);
        if reason == "awaiting_key" {
            // Expected while a peer's links come up: its PUB may be ahead of its handshake.
            tracing::debug!(reason, source, "dropped bus frame: {detail}");
        } else if let Some(suppressed) = self.warn.allow() {
            tracing::warn!(reason, source, suppressed, "dropped bus frame: {detail}");
        }
    }

    /// One frame from the ROUTER: `[identity, frame]`, split.
    fn split_direct(&self, msg: ZmqMessage) -> Option<(Bytes, Bytes)> {
        let frames = msg.into_vec();
        match <[Bytes; 2]>::try_from(frames) {
            Ok([identity, frame]) => Some((identity, frame)),
            Err(frames) => {
                let source = frames.first().map(|id| String::from_utf8_lossy(id).into_owned()).unwrap_or_default();
                self.drop_frame("framing", &source, &format_args!("{} ZeroMQ frames, expected 2", frames.len()));
                None
            }
        }
    }

    /// A direct envelope's bytes; `sender` is the host a secured link proved it came
    /// from (`None` on a plain bus).
    fn on_direct(&self, frame: &[u8], source: &dyn Fn() -> String, sender: Option<HostId>) {
        match codec::decode(frame) {
            Ok(env) if env.to.is_none_or(|to| to.host != self.host) => {
                self.drop_frame("misrouted", &source(), &format_args!("addressed to {:?}", env.to))
            }
            Ok(env) if sender.is_some_and(|h| h != env.from.host) => self.drop_frame(
                "spoofed",
                &source(),
                &format_args!("claims to be from {} on a link authenticated as {sender:?}", env.from.host),
            ),
            Ok(env) => {
                Counters::add(&self.counters.received, 1);
                self.received_direct.increment(1);
                (self.inbound)(env);
            }
            Err(e) => self.drop_frame(e.reason(), &source(), &e),
        }
    }

    /// One message from `peer`'s PUB: `[topic, frame]`.
    fn on_event(&self, msg: ZmqMessage, peer: &PeerSpec) {
        let frames = msg.into_vec();
        let [_, frame] = frames.as_slice() else {
            self.drop_frame("framing", &peer.name, &format_args!("{} ZeroMQ frames, expected 2", frames.len()));
            return;
        };
        let opened;
        let frame = match &self.secured {
            None => &frame[..],
            Some(secured) => match secured.open_broadcast(peer.host, frame) {
                Ok(body) => {
                    opened = body;
                    &opened[..]
                }
                Err(r) => return self.drop_frame(r.reason(), &peer.name, &r),
            },
        };
        match codec::decode(frame) {
            Ok(env) => {
                Counters::add(&self.counters.received, 1);
                self.received_events.increment(1);
                (self.inbound)(env);
            }
            Err(e) => self.drop_frame(e.reason(), &peer.name, &e),
        }
    }

    /// A handshake that did not complete (either side).
    fn count_handshake(&self, side: &'static str, error: &crate::security::noise::HandshakeError, source: &str) {
        let outcome = error.outcome();
        if outcome == "refused_key" {
            Counters::add(&self.counters.refused, 1);
        }
        metrics::counter!("tessera_bus_handshakes_total", "side" => side, "outcome" => outcome).increment(1);
        if let Some(suppressed) = self.warn.allow() {
            tracing::warn!(side, source, suppressed, "bus handshake {outcome}: {error}");
        }
    }

    fn count_handshake_ok(&self, side: &'static str) {
        Counters::add(&self.counters.handshakes, 1);
        metrics::counter!("tessera_bus_handshakes_total", "side" => side, "outcome" => "ok").increment(1);
    }
}

struct PeerQueue {
    name: String,
    /// The link while it is up: frames go straight to ZeroMQ through it.
    link: link::SharedLink,
    /// Frames waiting for the link's task: the link is down, or earlier frames wait.
    tx: mpsc::Sender<link::Outbound>,
    /// Bumped to make both links to the peer reconnect.
    reset: watch::Sender<u64>,
    sent: metrics::Counter,
}

/// Counts `n` outbound frames discarded for `reason`.
fn count_discarded(counters: &Counters, reason: &'static str, n: u64) {
    if n == 0 {
        return;
    }
    Counters::add(&counters.discarded, n);
    metrics::counter!("tessera_bus_frames_dropped_total", "reason" => reason).increment(n);
}

struct Inner {
    host: HostId,
    direct: SocketAddr,
    events: SocketAddr,
    peers: HashMap<HostId, PeerQueue>,
    events_tx: mpsc::Sender<(String, Vec<u8>)>,
    counters: Arc<Counters>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The tasks see this and close their sockets; `Bus::shutdown` also waits for it.
        let _ = self.stop.send(true);
    }
}

/// A handle on this host's bus. Cheap to clone; the bus stops when [`Bus::shutdown`]
/// is called or the last clone is dropped.
#[derive(Clone)]
pub struct Bus {
    inner: Arc<Inner>,
}

/// Resolves once the bus is told to stop (or its handle is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

fn tcp_endpoint(addr: SocketAddr) -> String {
    format!("tcp://{addr}")
}

async fn bind<S: Socket>(socket: &mut S, role: &'static str, addr: SocketAddr) -> Result<SocketAddr, BusError> {
    let endpoint = socket.bind(&tcp_endpoint(addr)).await.map_err(|source| BusError::Bind { role, addr, source })?;
    let port = match endpoint {
        zeromq::Endpoint::Tcp(_, port) => port,
        _ => addr.port(),
    };
    Ok(SocketAddr::new(addr.ip(), port))
}

impl Bus {
    /// Binds this host's sockets, then connects to every peer in the background.
    /// Tasks run on the current tokio runtime.
    pub async fn start(config: BusConfig, inbound: InboundFn) -> Result<Bus, BusError> {
        config.validate()?;
        tokio::runtime::Handle::try_current().map_err(|_| BusError::NoRuntime)?;

        let mut router = RouterSocket::with_options(config.socket_options());
        let direct = bind(&mut router, "direct", config.direct).await?;
        let mut publisher = PubSocket::with_options(config.socket_options());
        let events = match bind(&mut publisher, "events", config.events).await {
            Ok(addr) => addr,
            Err(e) => {
                // Release the ROUTER's port before reporting.
                let _ = router.close().await;
                return Err(e);
            }
        };

        let counters = Arc::new(Counters::default());
        let (stop, stop_rx) = watch::channel(false);
        let secured = config.security.clone().map(|sec| secure::Secured::new(sec, config.peers.iter().map(|p| p.host)));
        let broadcast_keys = match &config.security {
            Some(sec) => Some(secure::BroadcastKeys::new(sec, config.host, config.rekey_after_frames)?),
            None => None,
        };
        let granted = broadcast_keys.as_ref().map(secure::BroadcastKeys::subscribe);
        let receiver = Arc::new(Receiver {
            host: config.host,
            inbound,
            counters: counters.clone(),
            warn: WarnLimiter::new(),
            received_direct: metrics::counter!("tessera_bus_frames_received_total", "channel" => "direct"),
            received_events: metrics::counter!("tessera_bus_frames_received_total", "channel" => "events"),
            secured,
        });

        let mut tasks = Vec::new();
        let sessions = config.security.as_ref().map(|_| secure::Sessions::new(config.host, config.handshake_timeout));
        tasks.push(tokio::spawn(run_router(
            router,
            receiver.clone(),
            sessions,
            config.handshake_timeout,
            stop_rx.clone(),
        )));
        let (events_tx, events_rx) = mpsc::channel(config.queue_capacity);
        let cipher = config.security.as_ref().map(|s| s.cipher);
        let sealing = broadcast_keys.zip(cipher);
        tasks.push(tokio::spawn(run_publisher(publisher, events_rx, sealing, counters.clone(), stop_rx.clone())));

        let mut peers = HashMap::new();
        for peer in &config.peers {
            let (tx, rx) = mpsc::channel(config.queue_capacity);
            let (reset, reset_rx) = watch::channel(0);
            let shared = link::SharedLink::default();
            let ctx = link::LinkCtx {
                own_name: config.name.clone(),
                own_host: config.host,
                peer: peer.clone(),
                counters: counters.clone(),
                send_timeout: config.send_timeout,
                reconnect_max: config.reconnect_max,
                max_frame_bytes: config.max_frame_bytes,
                handshake_timeout: config.handshake_timeout,
                reset: reset_rx,
                security: config.security.clone(),
                granted: granted.clone(),
                rekey_after: config.rekey_after_frames,
                receiver: receiver.clone(),
                shared: shared.clone(),
            };
            tasks.push(tokio::spawn(link::run_dealer(ctx.clone(), rx, stop_rx.clone())));
            tasks.push(tokio::spawn(link::run_subscriber(ctx, stop_rx.clone())));
            let sent = metrics::counter!("tessera_bus_frames_sent_total", "peer" => peer.name.clone());
            peers.insert(peer.host, PeerQueue { name: peer.name.clone(), link: shared, tx, reset, sent });
        }
        tracing::info!(host = %config.host, name = %config.name, %direct, %events, peers = peers.len(), "bus started");

        Ok(Bus {
            inner: Arc::new(Inner {
                host: config.host,
                direct,
                events,
                peers,
                events_tx,
                counters,
                stop,
                tasks: Mutex::new(tasks),
            }),
        })
    }

    /// This host's id.
    pub fn host(&self) -> HostId {
        self.inner.host
    }

    /// The ROUTER's bound address (the real port when the config asked for port 0).
    pub fn direct_addr(&self) -> SocketAddr {
        self.inner.direct
    }

    /// The PUB's bound address.
    pub fn events_addr(&self) -> SocketAddr {
        self.inner.events
    }

    /// Whether the direct link to `host` is up now (connected and, on a secured bus,
    /// past its handshake); `None` for a host that is not a peer.
    pub fn link_up(&self, host: HostId) -> Option<bool> {
        self.inner.peers.get(&host).map(|p| p.link.lock().is_some())
    }

    /// Sends `env` to `env.to.host`: hands it to ZeroMQ at once while the link is up
    /// and nothing waits before it, else queues it for the link. Never blocks.
    /// Same-host delivery is not the bus's business: this host's own id is an
    /// [`SendError::UnknownHost`].
    pub fn send(&self, env: Envelope) -> Result<(), SendError> {
        let to = env.to.ok_or(SendError::Missing("to"))?;
        let peer = self.inner.peers.get(&to.host).ok_or(SendError::UnknownHost(to.host))?;
        let frame = codec::encode(&env)?;
        // Under the link's lock from sealing to queueing, so frames leave in order.
        let mut link = peer.link.lock();
        let queued = match link.as_mut() {
            Some(tx) if !tx.queued => match tx.hand(frame) {
                Ok((left, handed)) => {
                    Counters::add(&self.inner.counters.sent, handed);
                    peer.sent.increment(handed);
                    left.into_iter().map(link::Outbound::Wire).collect()
                }
                Err(link::LinkBroken(_)) => {
                    // The link's task sees the connection close and reconnects.
                    count_discarded(&self.inner.counters, "peer_down", 1);
                    *link = None;
                    return Ok(());
                }
            },
            _ => vec![link::Outbound::Envelope(frame)],
        };
        for frame in queued {
            self.queue(peer, frame)?;
        }
        Ok(())
    }

    /// Puts `frame` in `peer`'s queue for its link's task.
    fn queue(&self, peer: &PeerQueue, frame: link::Outbound) -> Result<(), SendError> {
        match peer.tx.try_send(frame) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&self.inner.counters.queue_full, 1);
                metrics::counter!("tessera_bus_queue_full_total", "peer" => peer.name.clone()).increment(1);
                Err(SendError::Full { peer: peer.name.clone() })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SendError::Closed),
        }
    }

    /// Queues `env` for broadcast on `env.topic` to every peer. Never blocks. PUB/SUB
    /// is lossy: a peer that is down or has not subscribed yet misses it.
    pub fn publish(&self, env: Envelope) -> Result<(), SendError> {
        let topic = env.topic.clone().ok_or(SendError::Missing("topic"))?;
        let frame = codec::encode(&env)?;
        match self.inner.events_tx.try_send((topic, frame)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&self.inner.counters.queue_full, 1);
                metrics::counter!("tessera_bus_queue_full_total", "peer" => "all").increment(1);
                Err(SendError::Full { peer: "all (broadcast)".into() })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SendError::Closed),
        }
    }

    /// Drops both links to `host` and reconnects them. For the host above when it stops
    /// hearing a peer whose connections look alive: `zeromq` 0.7 has neither ZMTP
    /// heartbeats nor TCP keepalive, so a peer that vanished without closing its
    /// connections (power loss, partition) is otherwise noticed only when a send to it
    /// times out, and never on the broadcast side.
    pub fn reset_peer(&self, host: HostId) -> Result<(), SendError> {
        let peer = self.inner.peers.get(&host).ok_or(SendError::UnknownHost(host))?;
        peer.reset.send_modify(|n| *n += 1);
        Ok(())
    }

    pub fn stats(&self) -> BusStats {
        self.inner.counters.snapshot()
    }

    /// Stops every task and waits until the sockets are closed and the ports released.
    /// Other clones of this handle see [`SendError::Closed`] afterwards.
    pub async fn shutdown(self) {
        let _ = self.inner.stop.send(true);
        let tasks = std::mem::take(&mut *self.inner.tasks.lock());
        for task in tasks {
            if let Err(e) = task.await
                && e.is_panic()
            {
                tracing::error!("bus task panicked: {e}");
            }
        }
        tracing::info!(host = %self.inner.host, "bus stopped");
    }
}

async fn run_router(
    mut router: RouterSocket,
    receiver: Arc<Receiver>,
    mut sessions: Option<secure::Sessions>,
    handshake_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            biased;
            () = stopped(&mut stop) => break,
            msg = router.recv() => match msg {
                Ok(msg) => {
                    let Some((identity, frame)) = receiver.split_direct(msg) else { continue };
                    let source = || String::from_utf8_lossy(&identity).into_owned();
                    let (Some(sessions), Some(secured)) = (sessions.as_mut(), receiver.secured.as_ref()) else {
                        receiver.on_direct(&frame, &source, None);
                        continue;
                    };
                    let reply = match sessions.on_frame(secured, &identity, &frame) {
                        Ok(secure::Inbound::Deliver { host, envelope }) => {
                            receiver.on_direct(&envelope, &source, Some(host));
                            None
                        }
                        Ok(secure::Inbound::Reply(reply)) => Some(reply),
                        Ok(secure::Inbound::Done) => {
                            if frame::kind_of(&frame) == Some(frame::Kind::HelloDone) {
                                receiver.count_handshake_ok("accept");
                            }
                            None
                        }
                        Err(secure::Refusal::Frame(r)) => {
                            receiver.drop_frame(r.reason(), &source(), &r);
                            None
                        }
                        Err(secure::Refusal::Handshake { error, reply }) => {
                            receiver.count_handshake("accept", &error, &source());
                            reply
                        }
                    };
                    if let Some(reply) = reply {
                        let msg = ZmqMessage::try_from(vec![identity.clone(), Bytes::from(reply)]);
                        if let Ok(msg) = msg
                            && !matches!(tokio::time::timeout(handshake_timeout, router.send(msg)).await, Ok(Ok(())))
                        {
                            tracing::debug!(source = %source(), "bus handshake reply not sent");
                        }
                    }
                }
                Err(e) => {
                    // Not expected from a ROUTER that waits for clients; do not spin on it.
                    tracing::warn!("bus ROUTER receive failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    close_and_reap(router, "ROUTER").await;
}

async fn run_publisher(
    mut publisher: PubSocket,
    mut rx: mpsc::Receiver<(String, Vec<u8>)>,
    mut sealing: Option<(secure::BroadcastKeys, crate::security::Cipher)>,
    counters: Arc<Counters>,
    mut stop: watch::Receiver<bool>,
) {
    let sent = metrics::counter!("tessera_bus_frames_sent_total", "peer" => "all");
    loop {
        tokio::select! {
            biased;
            () = stopped(&mut stop) => break,
            item = rx.recv() => {
                let Some((topic, frame)) = item else { break };
                // Sealed, the topic stays inside: subscribers take every frame anyway.
                let (topic, frame) = match sealing.as_mut() {
                    Some((keys, cipher)) => (String::new(), keys.seal(*cipher, &frame)),
                    None => (topic, frame),
                };
                let msg = match ZmqMessage::try_from(vec![Bytes::from(topic), Bytes::from(frame)]) {
                    Ok(msg) => msg,
                    Err(_) => continue,
                };
                // PUB never waits: ZeroMQ drops for a subscriber whose queue is full.
                match publisher.send(msg).await {
                    Ok(()) => {
                        Counters::add(&counters.sent, 1);
                        sent.increment(1);
                    }
                    Err(e) => tracing::warn!("bus PUB send failed: {e}"),
                }
            }
        }
    }
    close_and_reap(publisher, "PUB").await;
}

/// How long a shutdown waits for connections that were mid-handshake when the socket
/// closed.
const REAP_TIMEOUT: Duration = Duration::from_secs(1);

/// Closes a bound socket and reaps the connections `zeromq` 0.7 leaks on close.
///
/// The crate finishes the handshake of a connection accepted just before close in a
/// detached task, then registers it in the closed socket's backend: its writer task
/// then holds the backend, the backend holds the writer's queue, and both live as
/// long as the runtime. Shutting the backend down again once those handshakes end
/// breaks the cycle; every such task holds a reference to the backend, so the count
/// says when none is left. A client that connects and never handshakes keeps its
/// task past the deadline: the crate has no handshake timeout.
async fn close_and_reap<S: Socket>(socket: S, what: &'static str) {
    let backend = socket.backend();
    for e in socket.close().await {
        tracing::debug!("closing the bus {what}: {e}");
    }
    let deadline = Instant::now() + REAP_TIMEOUT;
    while Arc::strong_count(&backend) > 1 {
        if Instant::now() >= deadline {
            tracing::debug!(what, "bus socket closed with connections still handshaking; left to zeromq");
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        backend.shutdown();
    }
}
