//! One peer's two links: the DEALER that carries our direct messages to its ROUTER,
//! and the SUB that takes in its broadcasts. Each runs in its own task and rebuilds its
//! socket after a disconnect.
//!
//! We reconnect ourselves rather than lean on `zeromq` 0.7: its DEALER never
//! reconnects (after the peer dies every send fails with "not connected"), and its SUB
//! reconnects with a backoff that grows to 30 s. Every connection also gets a fresh
//! ZeroMQ identity: the crate's ROUTER keys connections by identity, and when the old
//! connection's end-of-stream is noticed after the new one with the same identity was
//! registered, it unregisters the new one too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage,
};

use super::{Counters, Receiver, stopped, tcp_endpoint};
use crate::addr::HostId;
use crate::bus::PeerSpec;

/// One connection attempt (TCP connect, retried while refused, plus the handshake).
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);
const FIRST_BACKOFF: Duration = Duration::from_millis(20);

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

/// Connects a fresh socket, retrying with backoff; `None` when told to stop.
async fn connect<S: Socket>(
    ctx: &LinkCtx,
    what: &'static str,
    endpoint: &str,
    stop: &mut watch::Receiver<bool>,
) -> Option<(S, futures::channel::mpsc::Receiver<SocketEvent>)> {
    let mut backoff = Backoff::new(ctx.reconnect_max);
    loop {
        let mut socket = S::with_options(options(ctx));
        let monitor = socket.monitor();
        tokio::select! {
            biased;
            () = stopped(stop) => return None,
            result = socket.connect(endpoint) => match result {
                Ok(()) => return Some((socket, monitor)),
                Err(e) => tracing::debug!(peer = %ctx.peer.name, what, endpoint, "bus connect failed: {e}"),
            },
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
    if n == 0 {
        return;
    }
    Counters::add(&ctx.counters.discarded, n);
    metrics::counter!("tessera_bus_frames_dropped_total", "reason" => reason).increment(n);
}

/// Is this monitor event the end of the link?
fn is_down(event: Option<SocketEvent>) -> bool {
    matches!(event, None | Some(SocketEvent::Disconnected(_)))
}

/// Drains `rx` into the peer's DEALER; reconnects when the peer goes away.
pub(super) async fn run_dealer(mut ctx: LinkCtx, mut rx: mpsc::Receiver<Vec<u8>>, mut stop: watch::Receiver<bool>) {
    let endpoint = tcp_endpoint(ctx.peer.direct);
    let sent = metrics::counter!("tessera_bus_frames_sent_total", "peer" => ctx.peer.name.clone());
    let mut ever_connected = false;
    loop {
        let Some((socket, mut monitor)) = connect::<DealerSocket>(&ctx, "direct", &endpoint, &mut stop).await else {
            return;
        };
        // A reset asked for while we were connecting is already served.
        ctx.reset.borrow_and_update();
        if ever_connected {
            count_reconnect(&ctx, "direct");
            // Whatever queued up while the peer was down was meant for its previous life.
            let mut stale = 0;
            while rx.try_recv().is_ok() {
                stale += 1;
            }
            count_discarded(&ctx, "peer_down", stale);
        } else {
            tracing::debug!(peer = %ctx.peer.name, endpoint, "bus direct link up");
        }
        ever_connected = true;
        // The receive half is polled only so that the peer's end-of-stream is noticed
        // (it surfaces as a monitor event); the peer's ROUTER never sends to us.
        let (mut tx_half, mut rx_half) = socket.split();
        'link: loop {
            tokio::select! {
                biased;
                () = stopped(&mut stop) => return,
                event = monitor.next() => if is_down(event) {
                    tracing::warn!(peer = %ctx.peer.name, "bus direct link down; reconnecting");
                    break 'link;
                },
                Ok(()) = ctx.reset.changed() => {
                    tracing::info!(peer = %ctx.peer.name, "bus direct link reset");
                    break 'link;
                },
                msg = rx_half.recv() => if let Err(e) = msg {
                    tracing::debug!(peer = %ctx.peer.name, "bus DEALER receive: {e}");
                    break 'link;
                },
                frame = rx.recv() => {
                    let Some(frame) = frame else { return };
                    let outcome = tokio::select! {
                        biased;
                        () = stopped(&mut stop) => return,
                        r = tokio::time::timeout(ctx.send_timeout, tx_half.send(ZmqMessage::from(frame))) => r,
                    };
                    match outcome {
                        Ok(Ok(())) => {
                            Counters::add(&ctx.counters.sent, 1);
                            sent.increment(1);
                        }
                        Ok(Err(ZmqError::ReturnToSender { .. })) => {
                            count_discarded(&ctx, "peer_down", 1);
                            tracing::warn!(peer = %ctx.peer.name, "bus direct link down; reconnecting");
                            break 'link;
                        }
                        Ok(Err(e)) => {
                            count_discarded(&ctx, "peer_down", 1);
                            tracing::warn!(peer = %ctx.peer.name, "bus DEALER send failed: {e}; reconnecting");
                            break 'link;
                        }
                        Err(_) => {
                            count_discarded(&ctx, "send_timeout", 1);
                            tracing::warn!(
                                peer = %ctx.peer.name,
                                timeout_ms = ctx.send_timeout.as_millis() as u64,
                                "bus peer accepts no frames; dropping the link and reconnecting"
                            );
                            break 'link;
                        }
                    }
                }
            }
        }
    }
}

/// Takes in the peer's broadcasts; reconnects when the peer goes away.
pub(super) async fn run_subscriber(mut ctx: LinkCtx, receiver: Arc<Receiver>, mut stop: watch::Receiver<bool>) {
    let endpoint = tcp_endpoint(ctx.peer.events);
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
                    Ok(msg) => receiver.on_event(msg, &ctx.peer.name),
                    Err(e) => {
                        tracing::debug!(peer = %ctx.peer.name, "bus SUB receive: {e}");
                        break;
                    }
                },
            }
        }
    }
}
