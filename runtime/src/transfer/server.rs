//! The TCP side that serves registered regions: one accept thread, one thread per
//! connection (a peer opens `tcp_streams` of them and keeps them pooled).
//!
//! Every header is validated before anything is read from a region; a bad one gets an
//! error response, and the connection is closed when the stream can no longer be
//! trusted. Error text names only what the request itself named (the region id, offset
//! and length asked for): never other regions, how many there are, or their sizes.
//!
//! Limits, so that connections opened by anyone cannot lock real peers out
//! ([`TransferConfig`] fields, defaults in brackets):
//! - `max_connections_per_peer` (64) open from one peer IP address: a connection past
//!   it gets a `TooManyConnections` error and is closed; no other peer is affected.
//! - `max_connections` (512) open in all: when full, a new connection makes room by
//!   closing the open one idle longest (no request in progress; idle since its last
//!   served read, or since it was accepted: refused requests are not activity). It is
//!   refused only when every open connection has a request in progress.
//! - `first_request_timeout` (5 s): a connection that has not sent a complete request
//!   header by then is closed. Afterwards `idle_timeout` (30 s) without a request
//!   closes it; clients stop reusing a pooled connection after half of that.
//! - `io_timeout` (10 s) on every read and write, so a peer that stalls or vanishes
//!   only ever costs its own thread.
//!
//! A connection closed while idle looks to its client like a pooled connection gone
//! stale: the client reconnects once and resends (see `client.rs`).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::secure::{Link, SealedStream};
use super::wire::{self, Request, Response, Status};
use super::{Region, TransferConfig, TransferError};
use crate::security::PlaneSecurity;

type Regions = Arc<RwLock<HashMap<u64, Region>>>;
use super::capability::Capabilities;

pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Connections>,
}

#[derive(Clone)]
struct ConnContext {
    regions: Regions,
    io_timeout: Duration,
    first_request_timeout: Duration,
    idle_timeout: Duration,
    local: SocketAddr,
    /// A secured cluster: every connection proves a listed host key first.
    security: Option<PlaneSecurity>,
    /// What readers were offered; checked on every read when `require_capability`.
    capabilities: Capabilities,
    require_capability: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    total: usize,
    per_peer: usize,
}

/// The open connections, as the accept thread sees them.
struct Connections {
    open: Mutex<HashMap<u64, Slot>>,
    /// Origin of [`Activity::idle_since_us`].
    epoch: Instant,
}

struct Slot {
    peer: IpAddr,
    /// A clone of the connection's socket, to close it from outside its thread.
    stream: TcpStream,
    activity: Arc<Activity>,
}

const IDLE: u8 = 0;
const BUSY: u8 = 1;
const SHED: u8 = 2;

/// Whether a connection has a request in progress, shared by its thread and the
/// accept thread. `IDLE -> BUSY -> IDLE` by the connection, `IDLE -> SHED` (final) by
/// the accept thread: a connection is closed to make room only while it serves nothing.
struct Activity {
    state: AtomicU8,
    /// When it was accepted or last served a read, in µs since [`Connections::epoch`].
    idle_since_us: AtomicU64,
}

impl Activity {
    /// `false`: the connection was shed and must not serve this request.
    fn begin_request(&self) -> bool {
        self.state.compare_exchange(IDLE, BUSY, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    fn end_request(&self, served_at_us: Option<u64>) {
        if let Some(at) = served_at_us {
            self.idle_since_us.store(at, Ordering::Relaxed);
        }
        self.state.store(IDLE, Ordering::Release);
    }

    fn try_shed(&self) -> bool {
        self.state.compare_exchange(IDLE, SHED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// `None` while a request is in progress.
    fn idle_since_us(&self) -> Option<u64> {
        (self.state.load(Ordering::Acquire) == IDLE).then(|| self.idle_since_us.load(Ordering::Relaxed))
    }
}

impl Connections {
    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros().try_into().unwrap_or(u64::MAX)
    }
}

/// An open connection, for [`admission`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OpenConn {
    id: u64,
    peer: IpAddr,
    /// `None` while it has a request in progress.
    idle_since_us: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Admission {
    Admit,
    /// Full: close one of these (idle longest first) to make room, then admit.
    Shed(Vec<u64>),
    Refuse(Refusal),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    PeerFull,
    AllBusy,
}

/// Whether a new connection from `peer` may be served, given those open.
fn admission(open: &[OpenConn], peer: IpAddr, limits: Limits) -> Admission {
    if open.iter().filter(|c| c.peer == peer).count() >= limits.per_peer {
        return Admission::Refuse(Refusal::PeerFull);
    }
    if open.len() < limits.total {
        return Admission::Admit;
    }
    let mut idle: Vec<(u64, u64)> = open.iter().filter_map(|c| Some((c.idle_since_us?, c.id))).collect();
    if idle.is_empty() {
        return Admission::Refuse(Refusal::AllBusy);
    }
    // Ties go to the older connection (lower id).
    idle.sort_unstable();
    Admission::Shed(idle.into_iter().map(|(_, id)| id).collect())
}

impl Server {
    pub(crate) fn start(
        config: &TransferConfig,
        regions: Regions,
        capabilities: Capabilities,
    ) -> Result<Server, TransferError> {
        let listen_err = |source| TransferError::Listen { listen: config.listen, source };
        let listener = TcpListener::bind(config.listen).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Connections { open: Mutex::new(HashMap::new()), epoch: Instant::now() });
        let ctx = ConnContext {
            regions,
            io_timeout: config.io_timeout,
            first_request_timeout: config.first_request_timeout,
            idle_timeout: config.idle_timeout,
            local: addr,
            security: config.security.clone(),
            capabilities,
            require_capability: config.require_capability(),
        };
        let limits = Limits { total: config.max_connections, per_peer: config.max_connections_per_peer };
        let accept = {
            let (stop, conns) = (stop.clone(), conns.clone());
            std::thread::Builder::new()
                .name("tessera-xfer-accept".into())
                .spawn(move || accept_loop(listener, ctx, limits, stop, conns))
                .map_err(listen_err)?
        };
        Ok(Server { addr, stop, accept: Some(accept), conns })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the listener (joined) and every open connection (their threads end on
    /// their own as their sockets report the shutdown).
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        // The accept thread sits in accept(): wake it with a connection of our own.
        let wake = match self.addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => SocketAddr::from((Ipv4Addr::LOCALHOST, a.port())),
            SocketAddr::V6(a) if a.ip().is_unspecified() => SocketAddr::from((Ipv6Addr::LOCALHOST, a.port())),
            a => a,
        };
        let woke = TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok();
        if let Some(accept) = self.accept.take() {
            if woke {
                if accept.join().is_err() {
                    tracing::error!("transfer accept thread panicked");
                }
            } else {
                tracing::warn!("cannot wake the transfer listener on {}; leaving its thread", self.addr);
            }
        }
        for (_, slot) in self.conns.open.lock().drain() {
            let _ = slot.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    ctx: ConnContext,
    limits: Limits,
    stop: Arc<AtomicBool>,
    conns: Arc<Connections>,
) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("transfer listener {}: accept failed: {e}", ctx.local);
                // Out of descriptors and the like: do not spin on it.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let peer = match stream.peer_addr() {
            Ok(peer) => peer,
            // Gone already.
            Err(_) => continue,
        };
        let mut conn = match Conn::configure(stream, &ctx) {
            Ok(conn) => conn,
            Err(e) => {
                tracing::debug!("transfer connection from {peer}: cannot configure the socket: {e}");
                continue;
            }
        };
        let clone = match conn.stream.tcp().try_clone() {
            Ok(clone) => clone,
            Err(e) => {
                tracing::debug!("transfer connection from {peer}: {e}");
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        let activity = match admit(&conns, id, peer, clone, limits) {
            Ok(activity) => activity,
            Err(refusal) => {
                let text = match refusal {
                    Refusal::PeerFull => {
                        format!("{} serves at most {} connections per peer address", ctx.local, limits.per_peer)
                    }
                    Refusal::AllBusy => {
                        format!("{} serves at most {} connections, all busy now", ctx.local, limits.total)
                    }
                };
                tracing::debug!("transfer connection from {peer} refused: {text}");
                // A secured reader expects a handshake first: it sees the close.
                if !conn.stream.is_sealed() && ctx.security.is_none() {
                    let _ = send_error(&mut conn.stream, Status::TooManyConnections, &text);
                }
                continue;
            }
        };
        let (conn_ctx, conns_done) = (ctx.clone(), conns.clone());
        let spawned = std::thread::Builder::new().name("tessera-xfer-conn".into()).spawn(move || {
            let secured = match &conn_ctx.security {
                None => Ok(conn),
                Some(sec) => conn.seal(sec, conn_ctx.first_request_timeout),
            };
            let result = secured.and_then(|mut conn| serve(&mut conn, &conn_ctx, &activity, &conns_done));
            if let Err(e) = result {
                tracing::debug!("transfer connection from {peer} closed: {e}");
            }
            conns_done.open.lock().remove(&id);
        });
        if let Err(e) = spawned {
            tracing::warn!("transfer listener {}: cannot start a connection thread: {e}", ctx.local);
            conns.open.lock().remove(&id);
        }
    }
}

/// Records connection `id` from `peer` (`stream`: a clone of its socket) as open,
/// closing an idle one first if the server is full; `Err` if it must be refused instead.
fn admit(
    conns: &Connections,
    id: u64,
    peer: SocketAddr,
    stream: TcpStream,
    limits: Limits,
) -> Result<Arc<Activity>, Refusal> {
    // An IPv4 peer reaching a dual-stack listener is the same peer as over IPv4.
    let peer_ip = peer.ip().to_canonical();
    let mut open = conns.open.lock();
    let snapshot: Vec<OpenConn> = open
        .iter()
        .map(|(&id, slot)| OpenConn { id, peer: slot.peer, idle_since_us: slot.activity.idle_since_us() })
        .collect();
    match admission(&snapshot, peer_ip, limits) {
        Admission::Admit => {}
        Admission::Refuse(refusal) => return Err(refusal),
        Admission::Shed(candidates) => {
            // A candidate may have started a request since the snapshot: try the next.
            let shed = candidates.into_iter().find(|c| open.get(c).is_some_and(|slot| slot.activity.try_shed()));
            let Some(victim) = shed.and_then(|c| open.remove(&c)) else { return Err(Refusal::AllBusy) };
            tracing::debug!("transfer connections full: closing an idle one from {} for {peer}", victim.peer);
            let _ = victim.stream.shutdown(std::net::Shutdown::Both);
        }
    }
    let activity = Arc::new(Activity { state: AtomicU8::new(IDLE), idle_since_us: AtomicU64::new(conns.now_us()) });
    open.insert(id, Slot { peer: peer_ip, stream, activity: activity.clone() });
    Ok(activity)
}

/// A served socket and the read timeout set on it (changed only when it must be:
/// one system call less per request).
struct Conn {
    stream: Link,
    read_timeout: Duration,
}

impl Conn {
    fn configure(stream: TcpStream, ctx: &ConnContext) -> io::Result<Conn> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(ctx.io_timeout))?;
        // None yet: `read_header` sets one before every read.
        Ok(Conn { stream: Link::Plain(stream), read_timeout: Duration::ZERO })
    }

    /// The reader must prove a listed host key within `timeout`; then every byte is sealed.
    fn seal(self, sec: &PlaneSecurity, timeout: Duration) -> io::Result<Conn> {
        let Link::Plain(tcp) = self.stream else { return Ok(self) };
        Ok(Conn { stream: Link::Sealed(Box::new(SealedStream::accept(tcp, sec, timeout)?)), read_timeout: timeout })
    }

    fn set_read_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        if timeout != self.read_timeout {
            self.stream.tcp().set_read_timeout(Some(timeout))?;
            self.read_timeout = timeout;
        }
        Ok(())
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Reads one request header. `Ok(None)`: the peer closed, or sent nothing for `wait`,
/// between requests (a clean end). Once part of a header arrived, the rest must follow
/// within `io_timeout`.
fn read_header(conn: &mut Conn, wait: Duration, io_timeout: Duration) -> io::Result<Option<[u8; wire::REQUEST_BYTES]>> {
    let mut header = [0u8; wire::REQUEST_BYTES];
    let mut filled = 0;
    let started = Instant::now();
    conn.set_read_timeout(wait)?;
    while filled < header.len() {
        match conn.stream.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("truncated request header ({filled} of {} bytes)", wire::REQUEST_BYTES),
                ));
            }
            Ok(n) => {
                filled += n;
                if filled < header.len() {
                    conn.set_read_timeout(io_timeout)?;
                }
            }
            Err(e) if (e.kind() == io::ErrorKind::Interrupted || is_timeout(&e)) && filled == 0 => {
                // Woken early (a signal, a coarse timer): wait out the rest.
                match wait.checked_sub(started.elapsed()).filter(|left| !left.is_zero()) {
                    Some(left) => conn.set_read_timeout(left)?,
                    None => return Ok(None),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("request header stalled after {filled} of {} bytes", wire::REQUEST_BYTES),
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Some(header))
}

fn send_error(stream: &mut Link, status: Status, text: &str) -> io::Result<()> {
    metrics::counter!("tessera_transfer_errors_total", "reason" => served_reason(status)).increment(1);
    let mut frame = Response { status, len: text.len() as u64 }.encode().to_vec();
    frame.extend_from_slice(text.as_bytes());
    stream.write_all(&frame)
}

fn served_reason(status: Status) -> &'static str {
    match status {
        Status::Ok => "served_ok",
        Status::UnknownRegion => "served_unknown_region",
        Status::OutOfBounds => "served_out_of_bounds",
        Status::TooLarge => "served_too_large",
        Status::BadRequest => "served_bad_request",
        Status::Busy => "served_range_busy",
        Status::TooManyConnections => "served_too_many_connections",
        Status::Forbidden => "served_forbidden",
    }
}

fn serve(conn: &mut Conn, ctx: &ConnContext, activity: &Activity, conns: &Connections) -> io::Result<()> {
    let mut wait = ctx.first_request_timeout.min(ctx.idle_timeout);
    while let Some(header) = read_header(conn, wait, ctx.io_timeout)? {
        wait = ctx.idle_timeout;
        if !activity.begin_request() {
            // Closed to make room while this request was arriving; the client resends.
            return Ok(());
        }
        let request = match Request::decode(&header) {
            Ok(r) => r,
            Err(e) => {
                // The stream cannot be trusted past a bad header: say why, then close.
                send_error(&mut conn.stream, Status::BadRequest, &format!("{} rejected the request: {e}", ctx.local))?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
            }
        };
        let capability = if request.capability {
            let mut token = [0u8; wire::CAPABILITY_BYTES];
            conn.stream.read_exact(&mut token)?;
            Some(token)
        } else {
            None
        };
        let status = serve_read(&mut conn.stream, ctx, request, capability)?;
        activity.end_request((status == Status::Ok).then(|| conns.now_us()));
    }
    Ok(())
}

/// Answers one read: the bytes, or a refusal (returned as the status sent). Refusals
/// name only what the request named, so a client learns nothing about regions it did
/// not already know of.
fn serve_read(
    stream: &mut Link,
    ctx: &ConnContext,
    req: Request,
    capability: Option<[u8; wire::CAPABILITY_BYTES]>,
) -> io::Result<Status> {
    let Request { region: id, offset, len, .. } = req;
    match capability {
        Some(token) if !ctx.capabilities.allows(&token, id, offset, len) => {
            // The same words whether the capability is unknown, expired or elsewhere.
            let text = format!("no valid capability for region {id} at offset {offset} (+{len})");
            return refuse(stream, Status::Forbidden, text);
        }
        None if ctx.require_capability => {
            let text = format!("region {id}: reads need the capability offered with the KV (none was sent)");
            return refuse(stream, Status::Forbidden, text);
        }
        _ => {}
    }
    let region = ctx.regions.read().get(&id).cloned();
    let Some(region) = region else {
        return refuse(stream, Status::UnknownRegion, format!("unknown region {id}"));
    };
    if len > wire::MAX_REQUEST_LEN {
        let text = format!("request of {len} bytes exceeds the {} byte limit per request", wire::MAX_REQUEST_LEN);
        return refuse(stream, Status::TooLarge, text);
    }
    if offset.checked_add(len).is_none_or(|end| end > region.len() as u64) {
        // Not the region's length: the client's descriptor says it, or it has none.
        let text = format!("out of bounds: offset {offset} + len {len} is past the end of region {id}");
        return refuse(stream, Status::OutOfBounds, text);
    }
    // Bounds checked above, so the casts are exact on this host.
    let header = Response { status: Status::Ok, len }.encode();
    // Straight from the region's pages to the socket, the header in the same segment.
    let lent = region.with_ref(offset as usize, len as usize, |bytes| {
        write_all_vectored(stream, &mut [IoSlice::new(&header), IoSlice::new(bytes)])
    });
    match lent {
        Ok(written) => written.map(|()| Status::Ok),
        Err(TransferError::RangeBusy { .. }) => {
            let text = format!("region {id}: bytes at offset {offset} (+{len}) are being written by the owner");
            refuse(stream, Status::Busy, text)
        }
        Err(e) => {
            tracing::warn!("transfer listener {}: cannot lend region {id} at {offset} (+{len}): {e}", ctx.local);
            refuse(stream, Status::BadRequest, format!("region {id} cannot be read at offset {offset} (+{len})"))
        }
    }
}

fn refuse(stream: &mut Link, status: Status, text: String) -> io::Result<Status> {
    send_error(stream, status, &text).map(|()| status)
}

fn write_all_vectored(stream: &mut Link, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket accepted no bytes")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));

    fn idle(id: u64, peer: IpAddr, since_us: u64) -> OpenConn {
        OpenConn { id, peer, idle_since_us: Some(since_us) }
    }

    fn busy(id: u64, peer: IpAddr) -> OpenConn {
        OpenConn { id, peer, idle_since_us: None }
    }

    #[test]
    fn admission_caps_each_peer_and_sheds_the_longest_idle_when_full() {
        let limits = Limits { total: 3, per_peer: 2 };
        #[rustfmt::skip]
        let table: Vec<(&str, Vec<OpenConn>, IpAddr, Admission)> = vec![
            ("empty", vec![], A, Admission::Admit),
            ("room for A", vec![idle(0, A, 5)], A, Admission::Admit),
            ("A at its cap", vec![idle(0, A, 5), busy(1, A)], A, Admission::Refuse(Refusal::PeerFull)),
            ("A at its cap, B not", vec![idle(0, A, 5), busy(1, A)], B, Admission::Admit),
            ("full: idle longest first", vec![idle(0, A, 9), idle(1, B, 3), busy(2, B)], A,
                Admission::Shed(vec![1, 0])),
            ("full: ties to the older", vec![idle(4, A, 3), idle(1, B, 3), busy(2, B)], A,
                Admission::Shed(vec![1, 4])),
            ("full: the cap still holds", vec![idle(0, A, 1), idle(1, A, 2), idle(2, B, 3)], A,
                Admission::Refuse(Refusal::PeerFull)),
            ("full and all busy", vec![busy(0, A), busy(1, B), busy(2, B)], A, Admission::Refuse(Refusal::AllBusy)),
        ];
        for (case, open, peer, want) in table {
            assert_eq!(admission(&open, peer, limits), want, "{case}");
        }
    }

    #[test]
    fn only_an_idle_connection_is_shed_and_a_shed_one_serves_nothing() {
        let a = Activity { state: AtomicU8::new(IDLE), idle_since_us: AtomicU64::new(7) };
        assert_eq!(a.idle_since_us(), Some(7));
        assert!(a.begin_request());
        assert_eq!(a.idle_since_us(), None);
        assert!(!a.try_shed(), "busy");
        a.end_request(None);
        assert_eq!(a.idle_since_us(), Some(7), "a refused request is not activity");
        assert!(a.begin_request());
        a.end_request(Some(40));
        assert_eq!(a.idle_since_us(), Some(40));
        assert!(a.try_shed());
        assert!(!a.begin_request(), "shed for good");
        assert_eq!(a.idle_since_us(), None);
    }
}
