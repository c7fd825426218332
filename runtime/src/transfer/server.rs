//! The TCP side that serves registered regions: one accept thread, one thread per
//! connection (a peer opens `tcp_streams` of them and keeps them pooled).
//!
//! Every header is validated before anything is read from a region; a bad one gets an
//! error response, and the connection is closed when the stream can no longer be
//! trusted. Reads and writes time out (`io_timeout`), idle connections are closed after
//! `idle_timeout`, so a peer that stalls or vanishes only ever costs its own thread.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::wire::{self, Request, Response, Status};
use super::{Region, TransferConfig, TransferError};

/// Connections served at once; more are answered with an error and closed.
const MAX_CONNECTIONS: usize = 512;

type Regions = Arc<RwLock<HashMap<u64, Region>>>;

pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
}

#[derive(Clone)]
struct ConnContext {
    regions: Regions,
    io_timeout: Duration,
    idle_timeout: Duration,
    local: SocketAddr,
}

impl Server {
    pub(crate) fn start(config: &TransferConfig, regions: Regions) -> Result<Server, TransferError> {
        let listen_err = |source| TransferError::Listen { listen: config.listen, source };
        let listener = TcpListener::bind(config.listen).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(HashMap::new()));
        let ctx =
            ConnContext { regions, io_timeout: config.io_timeout, idle_timeout: config.idle_timeout, local: addr };
        let accept = {
            let (stop, conns) = (stop.clone(), conns.clone());
            std::thread::Builder::new()
                .name("tessera-xfer-accept".into())
                .spawn(move || accept_loop(listener, ctx, stop, conns))
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
        for (_, conn) in self.conns.lock().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    ctx: ConnContext,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
) {
    let next_id = AtomicU64::new(0);
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("transfer listener {}: accept failed: {e}", ctx.local);
                // Out of descriptors and the like: do not spin on it.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let peer = stream.peer_addr().map_or_else(|_| "?".to_string(), |a| a.to_string());
        if let Err(e) = configure(&stream, &ctx) {
            tracing::debug!("transfer connection from {peer}: cannot configure the socket: {e}");
            continue;
        }
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut open = conns.lock();
            if open.len() >= MAX_CONNECTIONS {
                drop(open);
                let text = format!("{} serves at most {MAX_CONNECTIONS} connections", ctx.local);
                let _ = send_error(&mut stream, Status::TooManyConnections, &text);
                continue;
            }
            match stream.try_clone() {
                Ok(clone) => {
                    open.insert(id, clone);
                }
                Err(e) => {
                    tracing::debug!("transfer connection from {peer}: {e}");
                    continue;
                }
            }
        }
        let (conn_ctx, conns_done) = (ctx.clone(), conns.clone());
        let spawned = std::thread::Builder::new().name("tessera-xfer-conn".into()).spawn(move || {
            if let Err(e) = serve(&mut stream, &conn_ctx) {
                tracing::debug!("transfer connection from {peer} closed: {e}");
            }
            conns_done.lock().remove(&id);
        });
        if let Err(e) = spawned {
            tracing::warn!("transfer listener {}: cannot start a connection thread: {e}", ctx.local);
            conns.lock().remove(&id);
        }
    }
}

fn configure(stream: &TcpStream, ctx: &ConnContext) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(ctx.io_timeout))?;
    stream.set_write_timeout(Some(ctx.io_timeout))
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Reads one request header. `Ok(None)`: the peer closed, or stayed idle too long,
/// between requests (a clean end).
fn read_header(stream: &mut TcpStream, ctx: &ConnContext) -> io::Result<Option<[u8; wire::REQUEST_BYTES]>> {
    let mut header = [0u8; wire::REQUEST_BYTES];
    let mut filled = 0;
    let mut idle = Duration::ZERO;
    while filled < header.len() {
        match stream.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("truncated request header ({filled} of {} bytes)", wire::REQUEST_BYTES),
                ));
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) && filled == 0 => {
                idle += ctx.io_timeout;
                if idle >= ctx.idle_timeout {
                    return Ok(None);
                }
            }
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

fn send_error(stream: &mut TcpStream, status: Status, text: &str) -> io::Result<()> {
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
    }
}

fn serve(stream: &mut TcpStream, ctx: &ConnContext) -> io::Result<()> {
    while let Some(header) = read_header(stream, ctx)? {
        let request = match Request::decode(&header) {
            Ok(r) => r,
            Err(e) => {
                // The stream cannot be trusted past a bad header: say why, then close.
                send_error(stream, Status::BadRequest, &format!("{} rejected the request: {e}", ctx.local))?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e.to_string()));
            }
        };
        serve_read(stream, ctx, request)?;
    }
    Ok(())
}

fn serve_read(stream: &mut TcpStream, ctx: &ConnContext, req: Request) -> io::Result<()> {
    let Request { region: id, offset, len } = req;
    let region = ctx.regions.read().get(&id).cloned();
    let Some(region) = region else {
        let known = ctx.regions.read().len();
        let text = format!("unknown region {id} ({} has {known} registered regions)", ctx.local);
        return send_error(stream, Status::UnknownRegion, &text);
    };
    if len > wire::MAX_REQUEST_LEN {
        let text = format!("request of {len} bytes exceeds the {} byte limit per request", wire::MAX_REQUEST_LEN);
        return send_error(stream, Status::TooLarge, &text);
    }
    let region_len = region.len() as u64;
    if offset.checked_add(len).is_none_or(|end| end > region_len) {
        let text = format!("out of bounds: region {id} is {region_len} bytes; asked for offset {offset} + len {len}");
        return send_error(stream, Status::OutOfBounds, &text);
    }
    // Bounds checked above, so the casts are exact on this host.
    let header = Response { status: Status::Ok, len }.encode();
    // Straight from the region's pages to the socket, the header in the same segment.
    let lent = region.with_ref(offset as usize, len as usize, |bytes| {
        write_all_vectored(stream, &mut [IoSlice::new(&header), IoSlice::new(bytes)])
    });
    match lent {
        Ok(written) => written,
        Err(e @ TransferError::RangeBusy { .. }) => send_error(stream, Status::Busy, &e.to_string()),
        Err(e) => send_error(stream, Status::BadRequest, &e.to_string()),
    }
}

fn write_all_vectored(stream: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
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
