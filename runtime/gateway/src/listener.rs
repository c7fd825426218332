//! The gateway's HTTP/1.1 listener: the axum routes served by hyper, with the limits a
//! server facing clients it does not control needs.
//!
//! - A connection must deliver a request's headers within `header_read_timeout`; the
//!   same clock runs while a kept-alive connection waits for its next request, so it is
//!   also the idle timeout. Slow-header ("slowloris") clients cost one slot for at most
//!   that long.
//! - At most `max_connections` are open. When a new one arrives at the cap, the
//!   connection idle longest (no request in progress: a slow-header client or a
//!   kept-alive one between requests) is shut down to make room; if every connection is
//!   busy with a request, the newcomer gets a 503 in OpenAI error JSON and is closed. So
//!   a flood of idle connections can never lock real requests out.
//! - An `accept` that fails (out of file descriptors) is retried after a short pause,
//!   never spun on.
//! - On shutdown, no new connection is taken and each open one finishes the request it
//!   is serving (streams included) before it closes.

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower::Service;

/// What one gateway accepts from its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Open connections at most.
    pub max_connections: usize,
    /// The longest a connection may take to send a request's headers, or stay idle
    /// between requests.
    pub header_read_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits { max_connections: 1024, header_read_timeout: Duration::from_secs(10) }
    }
}

/// One open connection, as the accept loop sees it.
struct Slot {
    /// Requests in progress on it (headers read, response not yet fully sent).
    busy: Arc<AtomicUsize>,
    /// When it last became idle (ms since the listener started).
    idle_since_ms: Arc<AtomicU64>,
    /// Notified to make it close once its current request (if any) is done.
    shed: Arc<Notify>,
}

#[derive(Default)]
struct Slots {
    open: Mutex<BTreeMap<u64, Slot>>,
}

impl Slots {
    /// The idle connection that has been idle longest, if any.
    fn longest_idle(&self) -> Option<u64> {
        let open = self.open.lock();
        open.iter()
            .filter(|(_, s)| s.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(id, s)| (s.idle_since_ms.load(Ordering::Acquire), **id))
            .map(|(id, _)| *id)
    }
}

/// Counts a request in progress on its connection until the response body is done.
struct BusyGuard {
    busy: Arc<AtomicUsize>,
    idle_since_ms: Arc<AtomicU64>,
    epoch: Instant,
}

impl BusyGuard {
    fn new(slot_busy: &Arc<AtomicUsize>, idle_since_ms: &Arc<AtomicU64>, epoch: Instant) -> BusyGuard {
        slot_busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard { busy: slot_busy.clone(), idle_since_ms: idle_since_ms.clone(), epoch }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.idle_since_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Release);
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `routes` on `listener` until `shutdown` resolves, then lets every open
/// connection finish its request and returns.
pub async fn serve(
    listener: TcpListener,
    routes: axum::Router,
    limits: HttpLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let epoch = Instant::now();
    let slots = Arc::new(Slots::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut next_id = 0u64;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        while conns.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE and friends: the listener stays, new clients wait in the backlog.
                tracing::warn!("gateway: accept failed: {e}");
                metrics::counter!("tessera_gateway_accept_errors_total").increment(1);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let open = slots.open.lock().len();
        if open >= limits.max_connections {
            match slots.longest_idle() {
                Some(idle) => {
                    if let Some(slot) = slots.open.lock().get(&idle) {
                        slot.shed.notify_one();
                    }
                    metrics::counter!("tessera_gateway_connections_shed_total").increment(1);
                }
                None => {
                    metrics::counter!("tessera_gateway_connections_refused_total").increment(1);
                    conns.spawn(refuse(stream));
                    continue;
                }
            }
        }
        next_id += 1;
        let id = next_id;
        let slot = Slot {
            busy: Arc::new(AtomicUsize::new(0)),
            idle_since_ms: Arc::new(AtomicU64::new(epoch.elapsed().as_millis() as u64)),
            shed: Arc::new(Notify::new()),
        };
        let conn = Connection {
            busy: slot.busy.clone(),
            idle_since_ms: slot.idle_since_ms.clone(),
            shed: slot.shed.clone(),
            epoch,
        };
        slots.open.lock().insert(id, slot);
        metrics::gauge!("tessera_gateway_connections_open").set(slots.open.lock().len() as f64);
        let (routes, slots, stop) = (routes.clone(), slots.clone(), stop_rx.clone());
        conns.spawn(async move {
            conn.run(stream, routes, limits, stop).await;
            slots.open.lock().remove(&id);
            metrics::gauge!("tessera_gateway_connections_open").set(slots.open.lock().len() as f64);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// What a connection's task needs.
struct Connection {
    busy: Arc<AtomicUsize>,
    idle_since_ms: Arc<AtomicU64>,
    shed: Arc<Notify>,
    epoch: Instant,
}

impl Connection {
    async fn run(self, stream: TcpStream, routes: axum::Router, limits: HttpLimits, mut stop: watch::Receiver<bool>) {
        let (busy, idle_since_ms, epoch) = (self.busy.clone(), self.idle_since_ms.clone(), self.epoch);
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let guard = BusyGuard::new(&busy, &idle_since_ms, epoch);
            let mut routes = routes.clone();
            async move {
                let response = match routes.call(req).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                // The guard lives as long as the body: a stream counts as busy until done.
                let response = response.map(move |body| {
                    Body::new(body.map_frame(move |frame| {
                        let _busy = &guard;
                        frame
                    }))
                });
                Ok::<_, Infallible>(response)
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let mut closing = false;
        loop {
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(e) = result {
                        // Timeouts and client errors end the connection; nothing to report upward.
                        if e.is_timeout() {
                            metrics::counter!("tessera_gateway_header_timeouts_total").increment(1);
                        }
                        tracing::debug!("gateway connection ended: {e}");
                    }
                    break;
                }
                () = self.shed.notified(), if !closing => {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
                _ = stop.wait_for(|s| *s), if !closing => {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// Tells a client that arrived while every connection was busy to come back later.
async fn refuse(mut stream: TcpStream) {
    let body = serde_json::json!({"error": {
        "message": "the gateway has too many open connections; retry later",
        "type": "service_unavailable",
        "param": null,
        "code": "too_many_connections",
    }})
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(response.as_bytes())).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
}
