//! One peer's two links: the DEALER that carries our direct messages to its ROUTER,
//! and the SUB that takes in its broadcasts. Each runs in its own task and rebuilds its
//! socket after a disconnect.
//!
//! While the direct link is up and nothing waits in its queue, [`Bus::send`] hands each
//! frame to ZeroMQ itself ([`LinkTx`], shared with the link's task under a lock), so a
//! message crosses no task of ours on its way out. A frame ZeroMQ cannot take at once
//! (its queue for the peer is full: a peer that stopped reading) goes to the link's
//! queue, and so does every frame after it until the queue is empty: the link's task
//! sends those, waiting at most `send_timeout` for each. Frames are sealed (on a secured
//! link) under the same lock as they are handed over, so their counters go out in order.
//!
//! [`Bus::send`]: super::Bus::send
//!
//! We reconnect ourselves rather than lean on `zeromq` 0.7: its DEALER never
//! reconnects (after the peer dies every send fails with "not connected"), and its SUB
//! reconnects with a backoff that grows to 30 s. Every connection also gets a fresh
//! ZeroMQ identity: the crate's ROUTER keys connections by identity, and when the old
//! connection's end-of-stream is noticed after the new one with the same identity was
//! registered, it unregisters the new one too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerSender, DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, TrySendError,
    ZmqError, ZmqMessage,
};

use super::{Counters, Endpoint, Receiver, stopped, tcp_endpoint};
use crate::addr::HostId;
use crate::bus::PeerSpec;
use crate::security::frame::{self, Kind, Sealer};
use crate::security::noise::{self, Grant, GrantKind, HandshakeError, Initiator};
use crate::security::{Cipher, PlaneSecurity};

/// One connection attempt (TCP connect, retried while refused, plus the handshake).
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(20);

/// A frame waiting in a link's queue: an envelope to send (and seal, on a secured
/// link), or one already sealed that ZeroMQ could not take at once.
pub(super) enum Outbound {
    Envelope(Vec<u8>),
    Wire(ZmqMessage),
}

/// A peer's direct link while it is up, as [`super::Bus::send`] and the link's task
/// share it.
pub(super) struct LinkTx {
    sender: DealerSender,
    /// A secured link's sealer, and its cipher for the next key.
    sealer: Option<(Sealer, Cipher)>,
    /// Frames wait in the link's queue: new ones go behind them, not to ZeroMQ.
    pub(super) queued: bool,
}

/// `None` while the link is down.
pub(super) type SharedLink = Arc<Mutex<Option<LinkTx>>>;

/// The peer is gone (ZeroMQ dropped its connection), or no key could be made: the frame
/// is lost with the link.
pub(super) struct LinkBroken(pub &'static str);

impl LinkTx {
    /// `frame` as it goes on the wire (sealed on a secured link), then a fresh link key
    /// when the current one has sealed its share.
    fn wire(&mut self, frame: Vec<u8>) -> Result<Vec<ZmqMessage>, LinkBroken> {
        let Some((sealer, cipher)) = self.sealer.as_mut() else { return Ok(vec![ZmqMessage::from(frame)]) };
        let mut out = vec![ZmqMessage::from(sealer.seal(Kind::Data, &frame))];
        if sealer.needs_rekey() {
            let next = Grant::fresh(GrantKind::Direct, sealer.epoch().wrapping_add(1))
                .map_err(|_| LinkBroken("no random source for a fresh link key"))?;
            out.push(ZmqMessage::from(sealer.seal(Kind::Control, &noise::encode_grants(std::slice::from_ref(&next)))));
            sealer.rekey(*cipher, next.epoch, &next.key);
        }
        Ok(out)
    }

    /// Seals `frame` into the link's counter order and hands what ZeroMQ takes at once;
    /// returns the rest (the link is then `queued`) and how many were handed.
    pub(super) fn hand(&mut self, frame: Vec<u8>) -> Result<(Vec<ZmqMessage>, u64), LinkBroken> {
        let frames = self.wire(frame)?;
        self.hand_all(frames)
    }

    /// A control frame (keys granted to the peer), sealed and handed as [`LinkTx::hand`].
    fn hand_control(&mut self, body: &[u8]) -> Result<(Vec<ZmqMessage>, u64), LinkBroken> {
        let Some((sealer, _)) = self.sealer.as_mut() else { return Ok((Vec::new(), 0)) };
        let frame = ZmqMessage::from(sealer.seal(Kind::Control, body));
        self.hand_all(vec![frame])
    }

    fn hand_all(&mut self, frames: Vec<ZmqMessage>) -> Result<(Vec<ZmqMessage>, u64), LinkBroken> {
        let (mut left, mut handed) = (Vec::new(), 0);
        for frame in frames {
            if self.queued {
                left.push(frame);
                continue;
            }
            match self.sender.try_send(frame) {
                Ok(()) => handed += 1,
                Err(TrySendError::Full(frame)) => {
                    self.queued = true;
                    left.push(frame);
                }
                Err(TrySendError::Disconnected) => return Err(LinkBroken("the peer's connection closed")),
            }
        }
        Ok((left, handed))
    }
}

#[derive(Clone)]
pub(super) struct LinkCtx {
    pub own_name: String,
    pub own_host: HostId,
    pub peer: PeerSpec,
    pub counters: Arc<Counters>,
    pub send_timeout: Duration,
    pub reconnect_max: Duration,
    pub max_frame_bytes: usize,
    pub handshake_timeout: Duration,
    pub reset: watch::Receiver<u64>,
    /// Set when the bus is secured.
    pub security: Option<PlaneSecurity>,
    /// Our broadcast keys, to grant the peer (secured bus only).
    pub granted: Option<watch::Receiver<Vec<Grant>>>,
    pub rekey_after: u64,
    pub receiver: Arc<Receiver>,
    /// The link as `Bus::send` reaches it while it is up.
    pub shared: SharedLink,
}

/// `name.host.nonce`: says who connected, and is unique per connection.
fn fresh_identity(name: &str, host: HostId) -> Option<PeerIdentity> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static EPOCH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(|| {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        (nanos as u64) ^ u64::from(std::process::id()).rotate_left(32)
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let short: String = name.chars().take(64).collect();
    format!("{short}.{}.{epoch:x}.{n}", host.0).parse().ok()
}

fn options(ctx: &LinkCtx) -> SocketOptions {
    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_ATTEMPT);
    options.max_message_size(ctx.max_frame_bytes);
    options.handshake_timeout(ctx.handshake_timeout);
    if let Some(id) = fresh_identity(&ctx.own_name, ctx.own_host) {
        options.peer_identity(id);
    }
    options
}

struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new(max: Duration) -> Backoff {
        Backoff { next: FIRST_BACKOFF.min(max), max }
    }

    fn step(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        now
    }
}

/// Where `endpoint` is now: a peer named by DNS is looked up on every attempt, since the
/// machine behind its name may have changed since the last connection.
async fn resolve(endpoint: &Endpoint) -> Result<Vec<SocketAddr>, String> {
    match endpoint.ip() {
        Some(ip) => Ok(vec![SocketAddr::new(ip, endpoint.port)]),
        None => match tokio::net::lookup_host(endpoint.to_string()).await {
            Ok(addrs) => {
                Some(addrs.collect::<Vec<_>>()).filter(|a| !a.is_empty()).ok_or("the name has no address".into())
            }
            Err(e) => Err(e.to_string()),
        },
    }
}

/// Connects a fresh socket, retrying with backoff; `None` when told to stop. Every
/// address a name resolves to is tried in turn (`localhost` may be `::1` first while the
/// peer listens on 127.0.0.1); a name that does not resolve is retried like a refused
/// connection, and logged once per streak.
async fn connect<S: Socket>(
    ctx: &LinkCtx,
    what: &'static str,
    endpoint: &Endpoint,
    stop: &mut watch::Receiver<bool>,
) -> Option<(S, futures::channel::mpsc::Receiver<SocketEvent>)> {
    let mut backoff = Backoff::new(ctx.reconnect_max);
    let mut unresolved = false;
    loop {
        let addrs = tokio::select! {
            biased;
            () = stopped(stop) => return None,
            addrs = resolve(endpoint) => addrs,
        };
        match addrs {
            Ok(addrs) => {
                if std::mem::take(&mut unresolved) {
                    tracing::info!(peer = %ctx.peer.name, what, %endpoint, "the bus peer's name resolves again");
                }
                for addr in addrs {
                    let mut socket = S::with_options(options(ctx));
                    let monitor = socket.monitor();
                    let zmq_endpoint = tcp_endpoint(addr);
                    tokio::select! {
                        biased;
                        () = stopped(stop) => return None,
                        result = socket.connect(&zmq_endpoint) => match result {
                            Ok(()) => return Some((socket, monitor)),
                            Err(e) => tracing::debug!(peer = %ctx.peer.name, what, %endpoint, %addr, "bus connect failed: {e}"),
                        },
                    }
                }
            }
            Err(e) => {
                if !std::mem::replace(&mut unresolved, true) {
                    tracing::warn!(peer = %ctx.peer.name, what, %endpoint, "cannot resolve the bus peer's name: {e}; retrying");
                }
                metrics::counter!("tessera_bus_resolve_failures_total", "peer" => ctx.peer.name.clone()).increment(1);
            }
        }
        tokio::select! {
            biased;
            () = stopped(stop) => return None,
            () = tokio::time::sleep(backoff.step()) => {}
        }
    }
}

fn count_reconnect(ctx: &LinkCtx, channel: &'static str) {
    Counters::add(&ctx.counters.reconnects, 1);
    metrics::counter!("tessera_bus_reconnects_total", "peer" => ctx.peer.name.clone(), "channel" => channel)
        .increment(1);
    tracing::info!(peer = %ctx.peer.name, channel, "bus link re-established");
}

fn count_discarded(ctx: &LinkCtx, reason: &'static str, n: u64) {
    super::count_discarded(&ctx.counters, reason, n);
}

/// Is this monitor event the end of the link?
fn is_down(event: Option<SocketEvent>) -> bool {
    matches!(event, None | Some(SocketEvent::Disconnected(_)))
}

/// Runs the peer's DEALER: connects (and authenticates, on a secured bus), opens the
/// shared link to `Bus::send`, sends what waits in `rx`, and reconnects when the peer
/// goes away.
pub(super) async fn run_dealer(mut ctx: LinkCtx, mut rx: mpsc::Receiver<Outbound>, mut stop: watch::Receiver<bool>) {
    let endpoint = ctx.peer.direct.clone();
    let sent = metrics::counter!("tessera_bus_frames_sent_total", "peer" => ctx.peer.name.clone());
    let mut ever_connected = false;
    loop {
        let Some((socket, mut monitor)) = connect::<DealerSocket>(&ctx, "direct", &endpoint, &mut stop).await else {
            return;
        };
        // The receive half is polled only so that the peer's end-of-stream is noticed
        // (it surfaces as a monitor event) and, on a secured bus, for the handshake's
        // reply or a refusal; the peer's ROUTER sends nothing else.
        let (mut tx_half, mut rx_half) = socket.split();
        let sealer = match ctx.security.clone() {
            None => None,
            Some(sec) => match open_link(&mut ctx, &sec, &mut tx_half, &mut rx_half, &mut stop).await {
                Ok(sealer) => {
                    ctx.receiver.count_handshake_ok("connect");
                    Some((sealer, sec.cipher))
                }
                Err(LinkFailure::Stopped) => return,
                Err(LinkFailure::Handshake(e)) => {
                    ctx.receiver.count_handshake("connect", &e, &ctx.peer.name);
                    pause(&ctx, &mut stop).await;
                    continue;
                }
                Err(LinkFailure::Io(e)) => {
                    tracing::debug!(peer = %ctx.peer.name, "bus handshake: {e}");
                    pause(&ctx, &mut stop).await;
                    continue;
                }
            },
        };
        // A reset asked for while we were connecting is already served.
        ctx.reset.borrow_and_update();
        {
            let mut shared = ctx.shared.lock();
            if ever_connected {
                count_reconnect(&ctx, "direct");
                // Whatever queued up while the peer was down was meant for its previous life.
                let mut stale = 0;
                while rx.try_recv().is_ok() {
                    stale += 1;
                }
                count_discarded(&ctx, "peer_down", stale);
            } else {
                tracing::debug!(peer = %ctx.peer.name, %endpoint, "bus direct link up");
            }
            // Frames queued before the first connection go first.
            *shared = Some(LinkTx { sender: tx_half.sender(), sealer, queued: !rx.is_empty() });
        }
        ever_connected = true;
        let mut granted = ctx.granted.clone();
        if let Some(g) = granted.as_mut() {
            g.borrow_and_update();
        }
        let why = 'link: loop {
            // Frames to send this turn: an envelope, or keys (ours to grant, or a fresh
            // key for this link once the current one has sealed its share), sealed and
            // handed to ZeroMQ under the shared lock; what it could not take, waited for.
            let handed = tokio::select! {
                biased;
                () = stopped(&mut stop) => break 'link None,
                event = monitor.next() => if is_down(event) {
                    tracing::warn!(peer = %ctx.peer.name, "bus direct link down; reconnecting");
                    break 'link Some(());
                } else {
                    continue 'link;
                },
                Ok(()) = ctx.reset.changed() => {
                    tracing::info!(peer = %ctx.peer.name, "bus direct link reset");
                    break 'link Some(());
                },
                msg = rx_half.recv() => match msg {
                    Err(e) => {
                        tracing::debug!(peer = %ctx.peer.name, "bus DEALER receive: {e}");
                        break 'link Some(());
                    }
                    Ok(msg) if msg.iter().any(|f| frame::kind_of(f) == Some(Kind::Refused)) => {
                        let e = HandshakeError::UnknownKey { key: "ours (the peer refused it)".into() };
                        ctx.receiver.count_handshake("connect", &e, &ctx.peer.name);
                        pause(&ctx, &mut stop).await;
                        break 'link Some(());
                    }
                    Ok(_) => continue 'link,
                },
                Some(Ok(())) = async { match granted.as_mut() { Some(g) => Some(g.changed().await), None => None } } => {
                    let grants = granted.as_mut().map(|g| g.borrow_and_update().clone()).unwrap_or_default();
                    let mut shared = ctx.shared.lock();
                    shared.as_mut().map(|tx| tx.hand_control(&noise::encode_grants(&grants)))
                },
                frame = rx.recv() => {
                    let Some(frame) = frame else { break 'link None };
                    let mut shared = ctx.shared.lock();
                    match frame {
                        Outbound::Envelope(frame) => shared.as_mut().map(|tx| tx.hand(frame)),
                        Outbound::Wire(frame) => Some(Ok((vec![frame], 0))),
                    }
                }
            };
            let left = match handed {
                None => break 'link Some(()),
                Some(Err(LinkBroken(why))) => {
                    count_discarded(&ctx, "peer_down", 1);
                    tracing::warn!(peer = %ctx.peer.name, "bus direct link: {why}; reconnecting");
                    break 'link Some(());
                }
                Some(Ok((left, n))) => {
                    Counters::add(&ctx.counters.sent, n);
                    sent.increment(n);
                    left
                }
            };
            for frame in left {
                let outcome = tokio::select! {
                    biased;
                    () = stopped(&mut stop) => break 'link None,
                    r = tokio::time::timeout(ctx.send_timeout, tx_half.send(frame)) => r,
                };
                match outcome {
                    Ok(Ok(())) => {
                        Counters::add(&ctx.counters.sent, 1);
                        sent.increment(1);
                    }
                    Ok(Err(ZmqError::ReturnToSender { .. })) => {
                        count_discarded(&ctx, "peer_down", 1);
                        tracing::warn!(peer = %ctx.peer.name, "bus direct link down; reconnecting");
                        break 'link Some(());
                    }
                    Ok(Err(e)) => {
                        count_discarded(&ctx, "peer_down", 1);
                        tracing::warn!(peer = %ctx.peer.name, "bus DEALER send failed: {e}; reconnecting");
                        break 'link Some(());
                    }
                    Err(_) => {
                        count_discarded(&ctx, "send_timeout", 1);
                        tracing::warn!(
                            peer = %ctx.peer.name,
                            timeout_ms = ctx.send_timeout.as_millis() as u64,
                            "bus peer accepts no frames; dropping the link and reconnecting"
                        );
                        break 'link Some(());
                    }
                }
            }
            // The queue is empty: `Bus::send` hands frames over itself again.
            let mut shared = ctx.shared.lock();
            if let Some(tx) = shared.as_mut()
                && rx.is_empty()
            {
                tx.queued = false;
            }
        };
        // Down (or stopping): `Bus::send` queues until the link is up again.
        ctx.shared.lock().take();
        if why.is_none() {
            return;
        }
    }
}

/// Takes in the peer's broadcasts; reconnects when the peer goes away.
pub(super) async fn run_subscriber(mut ctx: LinkCtx, mut stop: watch::Receiver<bool>) {
    let endpoint = ctx.peer.events.clone();
    let mut ever_connected = false;
    loop {
        let Some((mut socket, mut monitor)) = connect::<SubSocket>(&ctx, "events", &endpoint, &mut stop).await else {
            return;
        };
        if let Err(e) = socket.subscribe("").await {
            tracing::debug!(peer = %ctx.peer.name, "bus subscribe failed: {e}");
            continue;
        }
        ctx.reset.borrow_and_update();
        if ever_connected {
            count_reconnect(&ctx, "events");
        }
        ever_connected = true;
        loop {
            tokio::select! {
                biased;
                () = stopped(&mut stop) => return,
                event = monitor.next() => if is_down(event) {
                    tracing::warn!(peer = %ctx.peer.name, "bus events link down; reconnecting");
                    break;
                },
                Ok(()) = ctx.reset.changed() => {
                    tracing::info!(peer = %ctx.peer.name, "bus events link reset");
                    break;
                },
                msg = socket.recv() => match msg {
                    Ok(msg) => ctx.receiver.on_event(msg, &ctx.peer),
                    Err(e) => {
                        tracing::debug!(peer = %ctx.peer.name, "bus SUB receive: {e}");
                        break;
                    }
                },
            }
        }
    }
}

/// Why a secured link did not open.
enum LinkFailure {
    Stopped,
    Handshake(HandshakeError),
    Io(String),
}

/// Waits `reconnect_max` before another attempt after a failed or refused handshake, so
/// a misconfigured peer is not hammered.
async fn pause(ctx: &LinkCtx, stop: &mut watch::Receiver<bool>) {
    tokio::select! {
        biased;
        () = stopped(stop) => {}
        () = tokio::time::sleep(ctx.reconnect_max) => {}
    }
}

/// Runs the Noise handshake on a fresh DEALER connection: proves both keys, grants the
/// link's key and our broadcast keys, and returns the sealer for the link's frames.
async fn open_link(
    ctx: &mut LinkCtx,
    sec: &PlaneSecurity,
    tx: &mut zeromq::DealerSendHalf,
    rx: &mut zeromq::DealerRecvHalf,
    stop: &mut watch::Receiver<bool>,
) -> Result<Sealer, LinkFailure> {
    let (initiator, hello) = Initiator::start(&sec.identity, sec.mode, sec.cipher).map_err(LinkFailure::Handshake)?;
    let within = ctx.handshake_timeout;
    tokio::select! {
        biased;
        () = stopped(stop) => return Err(LinkFailure::Stopped),
        r = send_handshake(tx, hello, within) => r?,
    }
    let reply = tokio::select! {
        biased;
        () = stopped(stop) => return Err(LinkFailure::Stopped),
        r = tokio::time::timeout(within, rx.recv()) => match r {
            Ok(Ok(msg)) => msg.into_vec().into_iter().next().unwrap_or_default(),
            Ok(Err(e)) => return Err(LinkFailure::Io(e.to_string())),
            Err(_) => return Err(LinkFailure::Io("no handshake reply in time".into())),
        },
    };
    let direct = Grant::fresh(GrantKind::Direct, 0).map_err(|e| LinkFailure::Io(e.to_string()))?;
    let mut grants = vec![direct.clone()];
    if let Some(g) = ctx.granted.as_mut() {
        grants.extend(g.borrow_and_update().iter().cloned());
    }
    let done = initiator.finish(&reply, &sec.keyring, Some(ctx.peer.host), &grants).map_err(LinkFailure::Handshake)?;
    tokio::select! {
        biased;
        () = stopped(stop) => return Err(LinkFailure::Stopped),
        r = send_handshake(tx, done, within) => r?,
    }
    tracing::debug!(peer = %ctx.peer.name, "bus direct link authenticated");
    Ok(Sealer::new(sec.mode, sec.cipher, ctx.own_host.0, direct.epoch, &direct.key).rekey_after(ctx.rekey_after))
}

async fn send_handshake(tx: &mut zeromq::DealerSendHalf, frame: Vec<u8>, within: Duration) -> Result<(), LinkFailure> {
    match tokio::time::timeout(within, tx.send(ZmqMessage::from(frame))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(LinkFailure::Io(e.to_string())),
        Err(_) => Err(LinkFailure::Io("handshake send timed out".into())),
    }
}
