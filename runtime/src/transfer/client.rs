//! The reading side of TCP: per peer, `tcp_streams` worker threads, each owning one
//! pooled connection. A batch's requests sit in one shared list; every worker that
//! takes part pulls the next request as soon as it has room in its pipeline, so a slow
//! stream takes fewer requests instead of holding the batch back.
//!
//! A pooled connection may have been closed by the peer while it sat idle; a worker
//! that sees its reused connection fail before any response arrived reconnects once
//! and resends what it had in flight. Every other failure fails the batch.
#![forbid(unsafe_code)]

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::batch::Plan;
use super::secure::{Link, SealedStream};
use super::wire::{self, Request, Response, Status};
use super::{Completion, Region, RegionDesc, TransferConfig, TransferError, Transport};
use crate::security::PlaneSecurity;

#[derive(Debug, Clone)]
pub(crate) struct ClientConfig {
    streams: usize,
    depth: usize,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// Pooled connections idle longer than this are not reused.
    pool_idle: Duration,
    /// A secured cluster: every connection proves our host key first.
    security: Option<PlaneSecurity>,
}

impl From<&TransferConfig> for ClientConfig {
    fn from(c: &TransferConfig) -> Self {
        ClientConfig {
            streams: c.tcp_streams,
            depth: c.pipeline_depth,
            connect_timeout: c.connect_timeout,
            io_timeout: c.io_timeout,
            pool_idle: c.idle_timeout / 2,
            security: c.security.clone(),
        }
    }
}

/// One batch to one peer, shared by the workers that serve it.
struct Job {
    peer: SocketAddr,
    region: u64,
    /// Sent with every request when the owner offered one.
    capability: Option<[u8; wire::CAPABILITY_BYTES]>,
    plan: Plan,
    dst: Region,
    next: AtomicUsize,
    completion: Arc<Completion>,
}

struct PeerLink {
    workers: Vec<mpsc::Sender<Arc<Job>>>,
    threads: Vec<JoinHandle<()>>,
}

pub(crate) struct TcpClient {
    config: ClientConfig,
    peers: Mutex<Option<HashMap<SocketAddr, PeerLink>>>,
}

impl TcpClient {
    pub(crate) fn new(config: ClientConfig) -> TcpClient {
        TcpClient { config, peers: Mutex::new(Some(HashMap::new())) }
    }

    pub(crate) fn start(
        &self,
        remote: &RegionDesc,
        local: &Region,
        plan: Plan,
        started: Instant,
    ) -> Result<Arc<Completion>, TransferError> {
        let peer = remote.endpoint.tcp;
        let parts = plan.chunks.len().min(self.config.streams);
        let completion = Completion::new(parts, plan.bytes, Transport::Tcp, started);
        if parts == 0 {
            return Ok(completion);
        }
        let job = Arc::new(Job {
            peer,
            region: remote.region,
            capability: remote.capability,
            plan,
            dst: local.clone(),
            next: AtomicUsize::new(0),
            completion: completion.clone(),
        });
        let mut peers = self.peers.lock();
        let peers = peers.as_mut().ok_or(TransferError::ShutDown)?;
        let link = match peers.entry(peer) {
            Entry::Occupied(link) => link.into_mut(),
            Entry::Vacant(slot) => slot.insert(self.spawn_link(peer)?),
        };
        let mut broken = false;
        for worker in link.workers.iter().take(parts) {
            if worker.send(job.clone()).is_err() {
                broken = true;
                completion
                    .part_done(Err(TransferError::Internal(format!("a transfer stream thread to {peer} is gone"))));
            }
        }
        if broken {
            // Start fresh threads for the next batch; the remaining ones end as their
            // channels close.
            peers.remove(&peer);
        }
        Ok(completion)
    }

    fn spawn_link(&self, peer: SocketAddr) -> Result<PeerLink, TransferError> {
        let mut link = PeerLink { workers: Vec::new(), threads: Vec::new() };
        for i in 0..self.config.streams {
            let (tx, rx) = mpsc::channel::<Arc<Job>>();
            let config = self.config.clone();
            let thread = std::thread::Builder::new()
                .name(format!("tessera-xfer-tcp{i}"))
                .spawn(move || worker(rx, config))
                .map_err(|e| TransferError::Io { peer, during: "starting a stream thread".into(), source: e })?;
            link.workers.push(tx);
            link.threads.push(thread);
        }
        Ok(link)
    }

    /// Ends every worker after the batch it is on (bounded by the I/O timeouts).
    pub(crate) fn shutdown(&self) {
        let Some(peers) = self.peers.lock().take() else { return };
        for (_, link) in peers {
            drop(link.workers);
            for thread in link.threads {
                if thread.join().is_err() {
                    tracing::error!("transfer stream thread panicked");
                }
            }
        }
    }
}

struct Conn {
    stream: Link,
    last_used: Instant,
}

/// Ends this worker's part of a batch exactly once, even if the worker panics, so a
/// waiter is never left hanging.
struct Part<'a> {
    completion: Option<&'a Completion>,
}

impl Part<'_> {
    fn done(mut self, outcome: Result<(), TransferError>) {
        if let Some(c) = self.completion.take() {
            c.part_done(outcome);
        }
    }
}

impl Drop for Part<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.completion.take() {
            c.part_done(Err(TransferError::Internal("a transfer stream thread panicked".into())));
        }
    }
}

fn worker(jobs: mpsc::Receiver<Arc<Job>>, config: ClientConfig) {
    let mut conn: Option<Conn> = None;
    while let Ok(job) = jobs.recv() {
        let part = Part { completion: Some(&job.completion) };
        let outcome = run_job(&job, &mut conn, &config);
        if outcome.is_err() {
            conn = None;
        }
        part.done(outcome);
    }
}

fn connect(peer: SocketAddr, config: &ClientConfig) -> Result<Conn, TransferError> {
    let unreachable =
        |e: io::Error| TransferError::PeerUnreachable { peer, timeout: config.connect_timeout, reason: e.to_string() };
    let stream = TcpStream::connect_timeout(&peer, config.connect_timeout).map_err(unreachable)?;
    let setup = || -> io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(config.io_timeout))?;
        stream.set_write_timeout(Some(config.io_timeout))
    };
    setup().map_err(|source| TransferError::Io { peer, during: "configuring a new connection".into(), source })?;
    let stream =
        match &config.security {
            None => Link::Plain(stream),
            Some(sec) => Link::Sealed(Box::new(SealedStream::connect(stream, sec, config.connect_timeout).map_err(
                |source| TransferError::Io { peer, during: "authenticating (the transfer handshake)".into(), source },
            )?)),
        };
    Ok(Conn { stream, last_used: Instant::now() })
}

/// Serves requests of `job` until none is left (or the batch failed elsewhere).
fn run_job(job: &Job, conn: &mut Option<Conn>, config: &ClientConfig) -> Result<(), TransferError> {
    if conn.as_ref().is_some_and(|c| c.last_used.elapsed() > config.pool_idle) {
        *conn = None;
    }
    let mut reused = conn.is_some();
    let mut in_flight: VecDeque<usize> = VecDeque::with_capacity(config.depth);
    loop {
        let c = match conn {
            Some(c) => c,
            None => conn.insert(connect(job.peer, config)?),
        };
        let mut received = false;
        match pump(job, &mut c.stream, &mut in_flight, &mut received, config) {
            Ok(()) => {
                c.last_used = Instant::now();
                return Ok(());
            }
            Err(e) if reused && !received && is_stale(&e) => {
                tracing::debug!("pooled transfer connection to {} was stale ({e}); reconnecting", job.peer);
                *conn = None;
                reused = false;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A failure that a connection closed while pooled would give.
fn is_stale(e: &TransferError) -> bool {
    matches!(e, TransferError::PeerClosed { .. } | TransferError::Io { .. })
}

fn io_error(job: &Job, e: io::Error, during: String, config: &ClientConfig) -> TransferError {
    let peer = job.peer;
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => TransferError::PeerClosed { peer, during },
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            TransferError::Timeout { peer, after: config.io_timeout, during }
        }
        _ => TransferError::Io { peer, during, source: e },
    }
}

/// Keeps up to `depth` requests in flight on `stream` and lands each response in the
/// destination pieces. `in_flight` holds requests sent but not answered: on a reconnect
/// they are sent again first.
fn pump(
    job: &Job,
    stream: &mut Link,
    in_flight: &mut VecDeque<usize>,
    received: &mut bool,
    config: &ClientConfig,
) -> Result<(), TransferError> {
    let chunks = &job.plan.chunks;
    let mut resend: Vec<usize> = in_flight.iter().copied().collect();
    let mut out = Vec::with_capacity(config.depth * (wire::REQUEST_BYTES + wire::CAPABILITY_BYTES));
    loop {
        out.clear();
        let push = |out: &mut Vec<u8>, i: usize| {
            out.extend_from_slice(&request(job, i).encode());
            if let Some(token) = &job.capability {
                out.extend_from_slice(token);
            }
        };
        for &i in &resend {
            push(&mut out, i);
        }
        resend.clear();
        while in_flight.len() < config.depth && !job.completion.failed() {
            let i = job.next.fetch_add(1, Ordering::Relaxed);
            if i >= chunks.len() {
                break;
            }
            push(&mut out, i);
            in_flight.push_back(i);
        }
        if !out.is_empty() {
            stream.write_all(&out).map_err(|e| io_error(job, e, "while sending requests".into(), config))?;
        }
        let Some(&i) = in_flight.front() else { return Ok(()) };
        receive(job, stream, i, config)?;
        *received = true;
        in_flight.pop_front();
    }
}

fn request(job: &Job, i: usize) -> Request {
    let chunk = &job.plan.chunks[i];
    Request { region: job.region, offset: chunk.src_offset, len: chunk.len, capability: job.capability.is_some() }
}

fn receive(job: &Job, stream: &mut Link, i: usize, config: &ClientConfig) -> Result<(), TransferError> {
    let chunk = &job.plan.chunks[i];
    let during = || format!("while reading region {} at offset {} (+{})", job.region, chunk.src_offset, chunk.len);
    let mut header = [0u8; wire::RESPONSE_BYTES];
    stream.read_exact(&mut header).map_err(|e| io_error(job, e, during(), config))?;
    let response = Response::decode(&header).map_err(|detail| TransferError::Protocol { peer: job.peer, detail })?;
    if response.status != Status::Ok {
        if response.len > wire::MAX_ERROR_TEXT {
            return Err(TransferError::Protocol {
                peer: job.peer,
                detail: format!("error text of {} bytes (limit {})", response.len, wire::MAX_ERROR_TEXT),
            });
        }
        let mut text = vec![0u8; response.len as usize];
        stream.read_exact(&mut text).map_err(|e| io_error(job, e, during(), config))?;
        let message = String::from_utf8_lossy(&text).into_owned();
        let (peer, region, offset, len) = (job.peer, job.region, chunk.src_offset, chunk.len);
        return Err(match response.status {
            Status::UnknownRegion => TransferError::UnknownRegion { peer, region, message },
            status => TransferError::Refused { peer, status, region, offset, len, message },
        });
    }
    if response.len != chunk.len {
        return Err(TransferError::Protocol {
            peer: job.peer,
            detail: format!(
                "asked for {} bytes at offset {}, response announces {}",
                chunk.len, chunk.src_offset, response.len
            ),
        });
    }
    for piece in &job.plan.pieces[chunk.pieces.clone()] {
        job.dst
            .with_mut(piece.dst_offset as usize, piece.len as usize, |dst| stream.read_exact(dst))?
            .map_err(|e| io_error(job, e, during(), config))?;
    }
    Ok(())
}
