//! `tessera bench transfer`: the transfer engine against the plain baselines of the same
//! bytes, measured in one run, between two processes.
//!
//! - tcp: the engine pulls the peer's region as KV-block-sized assignments (contiguous
//!   on the peer, scattered over the local region, as a decode chip's free blocks are)
//!   vs plain TCP sockets blasting the same bytes (`write_all` / `read_exact`) between
//!   the same two processes, over as many parallel streams as the engine uses, from the
//!   peer's region into a region registered here, as the engine's bytes go.
//! - shm: the engine pulls the same batch from the peer's pages vs a single `memcpy` of
//!   the same size inside this process, into a buffer written before any timing (so,
//!   like the engine's destination, it pays no page faults).
//! - The STREAM copy kernel on this machine ([`crate::stream`]), as the ceiling of both.
//!
//! A baseline must not carry a handicap the engine does not (one stream against four,
//! page faults against warm pages): a ratio then measures the engine, not the baseline.
//!
//! The peer is this binary re-executed with a hidden subcommand that calls
//! [`serve_peer`] (or, in tests, a thread running the same code): it registers a region
//! filled with a known pattern, runs the raw TCP blaster, prints one JSON line
//! ([`PeerHello`]) and serves until its stdin closes. Every transfer is checked byte
//! for byte against the pattern, outside the timed section.
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use tessera_runtime::HostId;
use tessera_runtime::transfer::{
    Assignment, Region, RegionDesc, TransferConfig, TransferEngine, TransferError, Transport,
};

pub use crate::secured::BenchSecurity;
use crate::secured::{KeysDir, MAIN_NAME, PEER_NAME, SecuredError, plane_security};

const MAIN_HOST: HostId = HostId(0);
const PEER_HOST: HostId = HostId(1);

/// Longest wait for the peer to come up or to go away.
const PEER_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("transfer bench I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("transfer bench peer: {0}")]
    Peer(String),
    #[error("transfer bench: {0}")]
    Invalid(String),
    #[error("transfer bench: {path} delivered wrong bytes: {detail}")]
    Corrupt { path: &'static str, detail: String },
    #[error(transparent)]
    Secured(#[from] SecuredError),
}

/// How the peer runs.
#[derive(Debug, Clone)]
pub enum PeerLaunch {
    /// A child process: `program args... --bytes N` (see [`TransferPeerArgs::to_args`]).
    Process { program: PathBuf, args: Vec<String> },
    /// A thread of this process (tests).
    Thread,
}

#[derive(Debug, Clone)]
pub struct TransferBenchOptions {
    /// Bytes moved per measurement.
    pub bytes: usize,
    /// Size of one assignment (a KV block's bytes).
    pub block_bytes: usize,
    /// Measured runs (after one warm-up); medians are reported.
    pub runs: usize,
    pub tcp_streams: usize,
    pub chunk_bytes: usize,
    pub pipeline_depth: usize,
    /// Bytes of each of the STREAM copy's two arrays.
    pub stream_array_bytes: usize,
    /// Passes of the STREAM copy; the best is reported.
    pub stream_passes: usize,
    pub peer: PeerLaunch,
    /// Also measure a secured engine pair (fresh host keys) beside the plain tcp path.
    pub security: Option<BenchSecurity>,
    /// The address the peer binds its engines and raw socket to (this side connects).
    pub peer_bind: IpAddr,
}

impl TransferBenchOptions {
    pub fn new(bytes: usize, peer: PeerLaunch) -> Self {
        let defaults = TransferConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        TransferBenchOptions {
            bytes,
            block_bytes: 256 << 10,
            runs: 9,
            tcp_streams: defaults.tcp_streams,
            chunk_bytes: defaults.chunk_bytes,
            pipeline_depth: defaults.pipeline_depth,
            stream_array_bytes: crate::stream::default_array_bytes(),
            stream_passes: 5,
            peer,
            security: None,
            peer_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
        }
    }
}

/// What the peer's hidden subcommand parses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPeerArgs {
    pub bytes: usize,
    /// Where the peer's engines and raw socket listen.
    pub bind: IpAddr,
    /// Serve the region from a secured engine too: its settings and both ends' keys.
    pub security: Option<(BenchSecurity, std::path::PathBuf)>,
}

impl TransferPeerArgs {
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--bytes".into(), self.bytes.to_string(), "--bind".into(), self.bind.to_string()];
        if let Some((sec, dir)) = &self.security {
            args.extend(sec.to_args(dir));
        }
        args
    }
}

/// The peer's one line on stdout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerHello {
    pub region: RegionDesc,
    /// The raw-TCP baseline: send a u64 (LE) offset and a u64 (LE) length, receive that
    /// many bytes of the region from that offset; as often as wanted, on any number of
    /// connections.
    pub raw_tcp: SocketAddr,
    /// The same bytes from a secured engine, when asked for.
    #[serde(default)]
    pub sealed_region: Option<RegionDesc>,
}

/// One path's figures over the measured runs.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PathStats {
    pub median_gb_per_s: f64,
    pub min_gb_per_s: f64,
    pub max_gb_per_s: f64,
    pub median_ms: f64,
}

/// The figures of one run. Keys of `--json` keep their meaning across versions; where a
/// baseline was made fairer the key stayed and its doc says what changed.
#[derive(Debug, Clone, Serialize)]
pub struct TransferBenchReport {
    pub bytes: usize,
    pub block_bytes: usize,
    pub blocks: usize,
    /// Requests after coalescing (tcp).
    pub tcp_requests: usize,
    pub runs: usize,
    pub tcp_streams: usize,
    pub chunk_bytes: usize,
    pub pipeline_depth: usize,
    /// "process" or "thread".
    pub peer: &'static str,
    /// The peer's tcp address (its engine's listener).
    pub peer_tcp: SocketAddr,
    pub tcp: PathStats,
    /// Plain sockets: `raw_tcp_streams` connections, each reading one contiguous slice
    /// of the bytes into a registered region. (Before `raw_tcp_streams` existed this was
    /// one connection reading into a plain buffer.)
    pub raw_tcp: PathStats,
    /// Parallel streams of the raw-TCP baseline: as many as the engine's tcp read uses,
    /// `min(tcp_streams, tcp_requests)`.
    pub raw_tcp_streams: usize,
    pub shm: PathStats,
    /// One `memcpy` into a buffer whose pages were written before any timing.
    pub memcpy: PathStats,
    /// The STREAM copy kernel on one thread, best of `stream_copy_passes`, in bytes
    /// copied per second like every path above (STREAM itself reports twice this: it
    /// counts bytes read + written): the ceiling of a one-thread copy (shm, memcpy).
    pub stream_copy_gbps: f64,
    /// The same on `stream_copy_threads` threads: the machine's memory-bandwidth ceiling.
    pub stream_copy_all_threads_gbps: f64,
    pub stream_copy_threads: usize,
    pub stream_copy_array_bytes: usize,
    pub stream_copy_passes: usize,
    /// Engine tcp throughput / raw socket throughput (same number of streams): the
    /// median over runs of the ratio within each run, where the two ran back to back
    /// (robust to a slow spell of the machine hitting one path's median but not the
    /// other's). (Before `raw_tcp_streams` existed the baseline was one stream.)
    pub tcp_vs_raw: f64,
    /// Engine shm throughput / memcpy throughput (pre-faulted destination), paired the
    /// same way.
    pub shm_vs_memcpy: f64,
    /// "off", or the secured engine pair's mode and cipher.
    pub security: String,
    /// The secured engine pair's tcp reads, when measured.
    pub sealed_tcp: Option<PathStats>,
    /// Secured tcp throughput / plain engine tcp throughput, each run's pair back to back,
    /// the median.
    pub sealed_vs_tcp: Option<f64>,
    /// Every measured transfer matched the pattern byte for byte.
    pub verified: bool,
}

impl TransferBenchReport {
    pub fn table(&self) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let mut s = format!(
            "transfer, peer in a {} at {}: {:.0} MiB as {} blocks of {:.0} KiB (scattered destination), {} runs + 1 warm-up\n",
            self.peer,
            self.peer_tcp,
            mib(self.bytes),
            self.blocks,
            self.block_bytes as f64 / 1024.0,
            self.runs
        );
        s += &format!(
            "tcp: {} streams, chunks of {:.0} KiB ({} requests), pipeline depth {}; raw socket: {} streams, one slice each\n",
            self.tcp_streams,
            self.chunk_bytes as f64 / 1024.0,
            self.tcp_requests,
            self.pipeline_depth,
            self.raw_tcp_streams
        );
        s += &format!("{:<28} {:>12} {:>10} {:>10} {:>11}\n", "path", "GB/s median", "min", "max", "ms median");
        let raw = format!("raw tcp socket, {} streams", self.raw_tcp_streams);
        for (name, p) in [
            ("engine tcp", &self.tcp),
            (raw.as_str(), &self.raw_tcp),
            ("engine shm", &self.shm),
            ("memcpy, pre-faulted", &self.memcpy),
        ] {
            s += &format!(
                "{:<28} {:>12.2} {:>10.2} {:>10.2} {:>11.2}\n",
                name, p.median_gb_per_s, p.min_gb_per_s, p.max_gb_per_s, p.median_ms
            );
        }
        s += &format!(
            "{:<28} {:>12.2}   (best of {}, 2 arrays of {:.0} MiB)\n",
            "STREAM copy, 1 thread",
            self.stream_copy_gbps,
            self.stream_copy_passes,
            mib(self.stream_copy_array_bytes)
        );
        s += &format!(
            "{:<28} {:>12.2}   (bytes copied per second; STREAM reports read + written, twice these)\n",
            format!("STREAM copy, {} threads", self.stream_copy_threads),
            self.stream_copy_all_threads_gbps
        );
        let of_stream = |p: &PathStats| 100.0 * p.median_gb_per_s / self.stream_copy_gbps.max(1e-12);
        s += &format!(
            "engine tcp / raw socket: x{:.2}   engine shm / memcpy: x{:.2}   (median of per-run ratios)   verified: {}\n",
            self.tcp_vs_raw, self.shm_vs_memcpy, self.verified
        );
        s += &format!(
            "of the 1-thread STREAM copy: engine shm {:.0}%, memcpy {:.0}%\n",
            of_stream(&self.shm),
            of_stream(&self.memcpy)
        );
        if let (Some(p), Some(ratio)) = (&self.sealed_tcp, self.sealed_vs_tcp) {
            s += &format!(
                "{:<28} {:>12.2} {:>10.2} {:>10.2} {:>11.2}\n",
                format!("engine tcp, {}", self.security),
                p.median_gb_per_s,
                p.min_gb_per_s,
                p.max_gb_per_s,
                p.median_ms
            );
            s += &format!("{} / plain engine tcp: x{ratio:.2}   (median of per-run ratios)\n", self.security);
        }
        s
    }
}

/// Parses a byte count: `67108864`, `64MiB`, `512KiB`, `1GiB`, `64MB`, `64M`.
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: usize = digits.parse().map_err(|_| format!("`{text}` is not a byte count (e.g. 64MiB)"))?;
    let scale: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => return Err(format!("unknown unit `{other}` in `{text}` (use B, KiB, MiB, GiB, KB, MB, GB)")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("`{text}` is too large"))
}

/// The bytes every region and baseline carry: cheap to generate, no period to hide a
/// misplaced block behind.
fn pattern(len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while out.len() < len {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

fn loopback_any() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// The peer side: region + raw blaster; `ready` gets the hello; returns when `stop`
/// returns.
fn run_peer(args: &TransferPeerArgs, ready: impl FnOnce(&PeerHello), stop: impl FnOnce()) -> Result<(), BenchError> {
    let listen = SocketAddr::new(args.bind, 0);
    let engine = TransferEngine::start(TransferConfig::new(listen))?;
    let region = engine.register(args.bytes)?;
    region.write(0, &pattern(args.bytes))?;
    // A second engine, secured, serving the same bytes.
    let sealed = match &args.security {
        Some((sec, dir)) => {
            let mut config = TransferConfig::new(listen);
            config.security = Some(plane_security(*sec, dir, PEER_NAME, MAIN_HOST, PEER_HOST)?);
            // The whole region is offered for as long as the bench may take.
            config.capability_ttl = Duration::from_secs(24 * 3600);
            let sealed_engine = TransferEngine::start(config)?;
            let sealed_region = sealed_engine.register(args.bytes)?;
            sealed_region.write(0, &pattern(args.bytes))?;
            let mut desc = sealed_engine.describe(&sealed_region);
            desc.capability =
                Some(sealed_engine.grant(None, &sealed_region, std::iter::once(0..args.bytes as u64).collect())?);
            Some((sealed_engine, sealed_region, desc))
        }
        None => None,
    };
    let raw = TcpListener::bind(listen)?;
    let hello = PeerHello {
        region: engine.describe(&region),
        raw_tcp: raw.local_addr()?,
        sealed_region: sealed.as_ref().map(|(_, _, desc)| desc.clone()),
    };
    let stopping = Arc::new(AtomicBool::new(false));
    let stopped = stopping.clone();
    let blaster = std::thread::Builder::new().name("bench-raw-tcp".into()).spawn(move || {
        for stream in raw.incoming() {
            if stopped.load(Ordering::Acquire) {
                return;
            }
            let Ok(stream) = stream else { continue };
            let region = region.clone();
            std::thread::spawn(move || {
                if let Err(e) = blast(stream, &region) {
                    tracing::debug!("raw TCP bench connection ended: {e}");
                }
            });
        }
    })?;
    ready(&hello);
    stop();
    engine.shutdown();
    if let Some((sealed_engine, _, _)) = sealed {
        sealed_engine.shutdown();
    }
    // Wake the blaster's accept so it sees the flag (a connection of our own).
    stopping.store(true, Ordering::Release);
    if TcpStream::connect_timeout(&hello.raw_tcp, Duration::from_secs(1)).is_ok() && blaster.join().is_err() {
        tracing::error!("raw TCP bench thread panicked");
    }
    Ok(())
}

/// Raw baseline server: for each (offset, len) received, writes those bytes of the
/// region, straight from its pages as the engine's server does.
fn blast(mut stream: TcpStream, region: &Region) -> Result<(), BenchError> {
    stream.set_nodelay(true)?;
    let mut request = [0u8; 16];
    loop {
        match stream.read_exact(&mut request) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let field = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&request[at..at + 8]);
            usize::try_from(u64::from_le_bytes(b)).unwrap_or(usize::MAX)
        };
        let (offset, len) = (field(0), field(8));
        region.with_ref(offset, len, |bytes| stream.write_all(bytes))??;
    }
}

/// Runs the peer until its standard input closes (the parent exited or let go).
pub fn serve_peer(args: &TransferPeerArgs) -> Result<(), BenchError> {
    run_peer(
        args,
        |hello| match serde_json::to_string(hello) {
            Ok(line) => {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
            Err(e) => eprintln!("cannot encode the peer hello: {e}"),
        },
        || {
            let mut sink = String::new();
            let mut stdin = std::io::stdin().lock();
            while matches!(stdin.read_line(&mut sink), Ok(n) if n > 0) {
                sink.clear();
            }
        },
    )
}

/// The running peer; stopping it is `Drop`, so every exit path reaps it.
enum PeerGuard {
    Process(Child),
    Thread { stop: Option<std::sync::mpsc::Sender<()>>, join: Option<std::thread::JoinHandle<()>> },
}

impl Drop for PeerGuard {
    fn drop(&mut self) {
        match self {
            PeerGuard::Process(child) => crate::peer::stop_peer_process(child, "transfer bench peer"),
            PeerGuard::Thread { stop, join } => {
                drop(stop.take());
                if let Some(join) = join.take()
                    && join.join().is_err()
                {
                    tracing::error!("transfer bench peer thread panicked");
                }
            }
        }
    }
}

fn launch_peer(launch: &PeerLaunch, args: &TransferPeerArgs) -> Result<(PeerGuard, PeerHello), BenchError> {
    let (tx, rx) = std::sync::mpsc::channel::<Result<PeerHello, String>>();
    let guard = match launch {
        PeerLaunch::Process { program, args: prefix } => {
            let mut child = crate::peer::spawn_peer_process(program, prefix, args.to_args())
                .map_err(|e| BenchError::Peer(format!("cannot start {}: {e}", program.display())))?;
            let stdout = child.stdout.take().ok_or_else(|| BenchError::Peer("peer has no stdout".into()))?;
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stdout);
                let mut line = String::new();
                let hello = match reader.read_line(&mut line) {
                    Ok(n) if n > 0 => serde_json::from_str::<PeerHello>(line.trim())
                        .map_err(|e| format!("bad hello line `{}`: {e}", line.trim())),
                    _ => Err("peer exited before it was ready".to_string()),
                };
                let _ = tx.send(hello);
                // Keep draining so the peer never blocks on a full pipe.
                while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                    line.clear();
                }
            });
            PeerGuard::Process(child)
        }
        PeerLaunch::Thread => {
            let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
            let args = args.clone();
            let join = std::thread::spawn(move || {
                let ready = tx.clone();
                let result = run_peer(
                    &args,
                    |hello| drop(ready.send(Ok(hello.clone()))),
                    || {
                        let _ = stop_rx.recv();
                    },
                );
                if let Err(e) = result {
                    let _ = tx.send(Err(e.to_string()));
                }
            });
            PeerGuard::Thread { stop: Some(stop_tx), join: Some(join) }
        }
    };
    match rx.recv_timeout(PEER_TIMEOUT) {
        Ok(Ok(hello)) => Ok((guard, hello)),
        Ok(Err(e)) => Err(BenchError::Peer(e)),
        Err(_) => Err(BenchError::Peer(format!("not ready within {PEER_TIMEOUT:?}"))),
    }
}

/// Source blocks in order, destination blocks in a fixed shuffled order.
fn scattered_batch(bytes: usize, block: usize) -> Vec<Assignment> {
    let blocks = bytes.div_ceil(block);
    let mut order: Vec<usize> = (0..blocks).collect();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..blocks).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    // The last block may be short: keep it last on both sides so slots stay disjoint.
    if let Some(pos) = order.iter().position(|&b| b == blocks - 1) {
        order.swap(pos, blocks - 1);
    }
    (0..blocks)
        .map(|i| {
            let len = block.min(bytes - i * block) as u64;
            Assignment { src_offset: (i * block) as u64, dst_offset: (order[i] * block) as u64, len }
        })
        .collect()
}

fn check_region(path: &'static str, dst: &Region, batch: &[Assignment], want: &[u8]) -> Result<(), BenchError> {
    for a in batch {
        let (s, d, n) = (a.src_offset as usize, a.dst_offset as usize, a.len as usize);
        let same = dst.with_ref(d, n, |got| got == &want[s..s + n])?;
        if !same {
            return Err(BenchError::Corrupt {
                path,
                detail: format!("block at source offset {s} (local offset {d}, {n} bytes) differs"),
            });
        }
    }
    Ok(())
}

fn stats(bytes: usize, times: &[Duration]) -> PathStats {
    let mut rates: Vec<f64> = times.iter().map(|t| bytes as f64 / t.as_secs_f64().max(1e-9) / 1e9).collect();
    rates.sort_by(f64::total_cmp);
    let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let median = |v: &[f64]| {
        let n = v.len();
        if n == 0 {
            0.0
        } else if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    PathStats {
        median_gb_per_s: median(&rates),
        min_gb_per_s: rates.first().copied().unwrap_or(0.0),
        max_gb_per_s: rates.last().copied().unwrap_or(0.0),
        median_ms: median(&ms),
    }
}

/// The raw-TCP baseline's reading side: one thread per stream, each owning one
/// connection to the peer's blaster and one contiguous slice of the destination region,
/// woken for every run as the engine wakes its stream workers for every batch.
struct RawStreams {
    go: Vec<mpsc::Sender<()>>,
    done: mpsc::Receiver<Result<(), BenchError>>,
    threads: Vec<JoinHandle<()>>,
}

impl RawStreams {
    /// Connects `streams` streams to `peer`, splitting `dst` into as many slices.
    fn connect(peer: SocketAddr, dst: &Region, streams: usize) -> Result<RawStreams, BenchError> {
        let (done_tx, done) = mpsc::channel();
        let mut raw = RawStreams { go: Vec::new(), done, threads: Vec::new() };
        let slice = dst.len().div_ceil(streams.max(1));
        for (i, start) in (0..dst.len()).step_by(slice.max(1)).enumerate() {
            let range = start..(start + slice).min(dst.len());
            let stream = TcpStream::connect_timeout(&peer, PEER_TIMEOUT)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(PEER_TIMEOUT))?;
            stream.set_write_timeout(Some(PEER_TIMEOUT))?;
            let (go_tx, go) = mpsc::channel();
            let (dst, done) = (dst.clone(), done_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("bench-raw-tcp{i}"))
                .spawn(move || raw_stream(stream, &dst, range, &go, &done))?;
            raw.go.push(go_tx);
            raw.threads.push(thread);
        }
        Ok(raw)
    }

    fn streams(&self) -> usize {
        self.go.len()
    }

    /// One transfer of the whole region, every stream reading its slice; returns when
    /// the last stream is done.
    fn read(&self) -> Result<(), BenchError> {
        for go in &self.go {
            go.send(()).map_err(|_| BenchError::Peer("a raw TCP stream thread is gone".into()))?;
        }
        for _ in 0..self.go.len() {
            match self.done.recv_timeout(PEER_TIMEOUT) {
                Ok(outcome) => outcome?,
                Err(_) => return Err(BenchError::Peer(format!("a raw TCP stream took over {PEER_TIMEOUT:?}"))),
            }
        }
        Ok(())
    }
}

impl Drop for RawStreams {
    fn drop(&mut self) {
        // Closing the channels ends each thread after its current read (bounded by the
        // socket timeouts).
        self.go.clear();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("raw TCP bench stream thread panicked");
            }
        }
    }
}

fn raw_stream(
    mut stream: TcpStream,
    dst: &Region,
    range: Range<usize>,
    go: &mpsc::Receiver<()>,
    done: &mpsc::Sender<Result<(), BenchError>>,
) {
    let mut request = [0u8; 16];
    request[..8].copy_from_slice(&(range.start as u64).to_le_bytes());
    request[8..].copy_from_slice(&(range.len() as u64).to_le_bytes());
    while go.recv().is_ok() {
        let outcome = match dst.with_mut(range.start, range.len(), |buf| {
            stream.write_all(&request)?;
            stream.read_exact(buf)
        }) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(BenchError::Io(e)),
            Err(e) => Err(BenchError::Transfer(e)),
        };
        if done.send(outcome).is_err() {
            return;
        }
    }
}

/// A buffer of `len` bytes whose every page has been written: the first copy into it
/// pays no page faults, as none into the engine's destination region does (it is
/// written before each run).
fn prefaulted(len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    std::hint::black_box(&mut buf).fill(0x5a);
    buf
}

/// Runs the benchmark (blocking).
pub fn run(opts: &TransferBenchOptions) -> Result<TransferBenchReport, BenchError> {
    if opts.bytes == 0 || opts.block_bytes == 0 || opts.runs == 0 {
        return Err(BenchError::Invalid("bytes, block size and runs must be positive".into()));
    }
    let keys = opts.security.map(|_| KeysDir::new()).transpose()?;
    let peer_args = TransferPeerArgs {
        bytes: opts.bytes,
        bind: opts.peer_bind,
        security: opts.security.zip(keys.as_ref().map(|k| k.0.clone())),
    };
    let (_peer, hello) = launch_peer(&opts.peer, &peer_args)?;
    let remote = &hello.region;
    if remote.len != opts.bytes as u64 {
        return Err(BenchError::Peer(format!("peer registered {} bytes, asked for {}", remote.len, opts.bytes)));
    }

    let mut config = TransferConfig::new(loopback_any());
    config.tcp_streams = opts.tcp_streams;
    config.chunk_bytes = opts.chunk_bytes;
    config.pipeline_depth = opts.pipeline_depth;
    let engine = TransferEngine::start(config.clone())?;
    let dst = engine.register(opts.bytes)?;
    let batch = scattered_batch(opts.bytes, opts.block_bytes);
    // The secured pair: same streams, chunks and depth, its own destination.
    let sealed = match (&peer_args.security, &hello.sealed_region) {
        (Some((sec, dir)), Some(remote)) => {
            let mut config = config;
            config.security = Some(plane_security(*sec, dir, MAIN_NAME, MAIN_HOST, PEER_HOST)?);
            let engine = TransferEngine::start(config)?;
            let dst = engine.register(opts.bytes)?;
            Some((engine, dst, remote.clone()))
        }
        (Some(_), None) => return Err(BenchError::Peer("the peer served no secured region".into())),
        _ => None,
    };
    let tcp_requests = engine.tcp_requests(remote, &dst, &batch)?;

    let want = pattern(opts.bytes);
    // The raw baseline lands in a registered region too, over as many streams as the
    // engine's read uses (it gives each of its streams at least one request).
    let raw_dst = engine.register(opts.bytes)?;
    let raw = RawStreams::connect(hello.raw_tcp, &raw_dst, opts.tcp_streams.min(tcp_requests))?;
    // The memcpy source is its own buffer, touched only by the copies, as the peer's
    // region is only by transfers: `want` is hot from every check, which would favour
    // the baseline (this CPU's last-level cache holds several of these buffers).
    let copy_src = pattern(opts.bytes);
    let mut copy_dst = prefaulted(opts.bytes);

    // The ceiling first, while nothing else of the bench runs.
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let ceiling = crate::stream::measure(opts.stream_array_bytes, threads, opts.stream_passes);

    let clear = |r: &Region| r.with_mut(0, r.len(), |b| b.fill(0));
    // Each path: reset its destination, time the transfer alone, then check the bytes.
    let engine_tcp = || -> Result<Duration, BenchError> {
        clear(&dst)?;
        let t = Instant::now();
        engine.read_via(Transport::Tcp, remote, &dst, &batch)?;
        let elapsed = t.elapsed();
        check_region("engine tcp", &dst, &batch, &want)?;
        Ok(elapsed)
    };
    let raw_tcp = || -> Result<Duration, BenchError> {
        clear(&raw_dst)?;
        let t = Instant::now();
        raw.read()?;
        let elapsed = t.elapsed();
        if !raw_dst.with_ref(0, raw_dst.len(), |got| got == want.as_slice())? {
            return Err(BenchError::Corrupt { path: "raw tcp", detail: "the blast differs from the pattern".into() });
        }
        Ok(elapsed)
    };
    let engine_shm = || -> Result<Duration, BenchError> {
        clear(&dst)?;
        let t = Instant::now();
        engine.read_via(Transport::Shm, remote, &dst, &batch)?;
        let elapsed = t.elapsed();
        check_region("engine shm", &dst, &batch, &want)?;
        Ok(elapsed)
    };
    let mut memcpy = || -> Result<Duration, BenchError> {
        copy_dst.fill(0);
        let t = Instant::now();
        copy_dst.copy_from_slice(std::hint::black_box(&copy_src));
        let elapsed = t.elapsed();
        if std::hint::black_box(&copy_dst) != &want {
            return Err(BenchError::Corrupt { path: "memcpy", detail: "the copy differs".into() });
        }
        Ok(elapsed)
    };

    let engine_sealed = || -> Result<Option<Duration>, BenchError> {
        let Some((engine, dst, remote)) = &sealed else { return Ok(None) };
        clear(dst)?;
        let t = Instant::now();
        engine.read_via(Transport::Tcp, remote, dst, &batch)?;
        let elapsed = t.elapsed();
        check_region("secured engine tcp", dst, &batch, &want)?;
        Ok(Some(elapsed))
    };

    let mut times: [Vec<Duration>; 4] = Default::default();
    let mut sealed_times: Vec<Duration> = Vec::new();
    let mut plain_beside_sealed: Vec<Duration> = Vec::new();
    for run in 0..=opts.runs {
        // Alternate which of a pair goes first, so neither always inherits the other's
        // cache and socket state.
        let (tcp, raw_time, shm, copy);
        if run % 2 == 0 {
            (tcp, raw_time) = (engine_tcp()?, raw_tcp()?);
            (shm, copy) = (engine_shm()?, memcpy()?);
        } else {
            raw_time = raw_tcp()?;
            tcp = engine_tcp()?;
            copy = memcpy()?;
            shm = engine_shm()?;
        }
        // The secured read right beside a plain one, alternating which goes first.
        let (sealed_time, plain_time) = if run % 2 == 0 {
            (engine_sealed()?, engine_tcp()?)
        } else {
            let plain_time = engine_tcp()?;
            (engine_sealed()?, plain_time)
        };
        if run > 0 {
            for (list, t) in times.iter_mut().zip([tcp, raw_time, shm, copy]) {
                list.push(t);
            }
            if let Some(t) = sealed_time {
                sealed_times.push(t);
                plain_beside_sealed.push(plain_time);
            }
        }
    }
    if let Some((sealed_engine, _, _)) = &sealed {
        sealed_engine.shutdown();
    }
    let raw_tcp_streams = raw.streams();
    drop(raw);
    engine.shutdown();

    // Throughput ratio = inverse time ratio, per run, then the median.
    let paired = |ours: &[Duration], base: &[Duration]| {
        let mut r: Vec<f64> =
            ours.iter().zip(base).map(|(o, b)| b.as_secs_f64() / o.as_secs_f64().max(1e-12)).collect();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied().unwrap_or(0.0)
    };
    let tcp_vs_raw = paired(&times[0], &times[1]);
    let sealed_vs_tcp = (!sealed_times.is_empty()).then(|| paired(&sealed_times, &plain_beside_sealed));
    let sealed_stats = (!sealed_times.is_empty()).then(|| stats(opts.bytes, &sealed_times));
    let shm_vs_memcpy = paired(&times[2], &times[3]);
    let [tcp, raw_tcp, shm, memcpy] = times.map(|t| stats(opts.bytes, &t));
    Ok(TransferBenchReport {
        bytes: opts.bytes,
        block_bytes: opts.block_bytes,
        blocks: batch.len(),
        tcp_requests,
        runs: opts.runs,
        tcp_streams: opts.tcp_streams,
        chunk_bytes: opts.chunk_bytes,
        pipeline_depth: opts.pipeline_depth,
        peer: match opts.peer {
            PeerLaunch::Process { .. } => "process",
            PeerLaunch::Thread => "thread",
        },
        peer_tcp: remote.endpoint.tcp,
        tcp_vs_raw,
        shm_vs_memcpy,
        security: BenchSecurity::label(opts.security),
        sealed_tcp: sealed_stats,
        sealed_vs_tcp,
        tcp,
        raw_tcp,
        raw_tcp_streams,
        shm,
        memcpy,
        stream_copy_gbps: ceiling.one_thread_gb_per_s,
        stream_copy_all_threads_gbps: ceiling.all_threads_gb_per_s,
        stream_copy_threads: ceiling.threads,
        stream_copy_array_bytes: ceiling.array_bytes,
        stream_copy_passes: ceiling.passes,
        verified: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_byte_counts() {
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("512KiB"), Ok(512 << 10));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("64MB"), Ok(64_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").unwrap_err().contains("not a byte count"));
        assert!(parse_bytes("3 parsecs").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn scattered_batch_covers_both_sides_once() {
        let batch = scattered_batch(10 * 4096 + 100, 4096);
        assert_eq!(batch.len(), 11);
        let mut src: Vec<_> = batch.iter().map(|a| (a.src_offset, a.len)).collect();
        let mut dst: Vec<_> = batch.iter().map(|a| (a.dst_offset, a.len)).collect();
        src.sort_unstable();
        dst.sort_unstable();
        assert_eq!(src, dst, "destination slots are a permutation of the source blocks");
        assert!(batch.iter().any(|a| a.src_offset != a.dst_offset), "destinations are scattered");
    }

    #[test]
    fn bench_measures_a_secured_engine_pair_beside_the_plain_one() {
        use tessera_runtime::security::{Cipher, Mode};
        let mut opts = TransferBenchOptions::new(2 << 20, PeerLaunch::Thread);
        opts.block_bytes = 64 * 1024;
        opts.runs = 1;
        opts.stream_array_bytes = 1 << 20;
        opts.stream_passes = 1;
        opts.security = Some(BenchSecurity { mode: Mode::Encrypt, cipher: Cipher::Sm4Gcm });
        let report = run(&opts).expect("bench");
        assert!(report.verified);
        assert_eq!(report.security, "encrypt sm4-gcm");
        assert!(report.sealed_tcp.is_some_and(|p| p.median_gb_per_s > 0.0), "{report:?}");
        assert!(report.sealed_vs_tcp.is_some_and(|r| r > 0.0));
        assert!(report.table().contains("encrypt sm4-gcm / plain engine tcp"));
    }

    #[test]
    fn bench_runs_end_to_end_with_a_thread_peer() {
        let mut opts = TransferBenchOptions::new(2 << 20, PeerLaunch::Thread);
        opts.block_bytes = 64 * 1024;
        opts.runs = 1;
        opts.stream_array_bytes = 1 << 20;
        opts.stream_passes = 1;
        let report = run(&opts).expect("bench");
        assert!(report.verified);
        assert_eq!((report.blocks, report.tcp_requests), (32, 2));
        // Two 1 MiB requests keep two of the engine's four streams busy: so many raw ones.
        assert_eq!((report.tcp_streams, report.raw_tcp_streams), (4, 2));
        assert!(report.tcp.median_gb_per_s > 0.0 && report.shm.median_gb_per_s > 0.0);
        assert!(report.raw_tcp.median_gb_per_s > 0.0 && report.memcpy.median_gb_per_s > 0.0);
        assert!(report.sealed_tcp.is_none() && report.sealed_vs_tcp.is_none());
        assert!(report.stream_copy_gbps > 0.0 && report.stream_copy_all_threads_gbps > 0.0);
        assert_eq!(report.stream_copy_array_bytes, 1 << 20);
        let table = report.table();
        for line in
            ["engine tcp / raw socket", "raw tcp socket, 2 streams", "memcpy, pre-faulted", "STREAM copy, 1 thread"]
        {
            assert!(table.contains(line), "{line} missing from\n{table}");
        }
        let json = serde_json::to_value(&report).expect("json");
        for key in ["tcp_vs_raw", "shm_vs_memcpy", "raw_tcp", "memcpy", "raw_tcp_streams", "stream_copy_gbps"] {
            assert!(json.get(key).is_some(), "--json lacks {key}");
        }
    }

    #[test]
    fn raw_streams_split_the_region_and_read_it_whole() {
        let peer_engine = TransferEngine::start(TransferConfig::new(loopback_any())).expect("peer engine");
        let source = peer_engine.register(10_000).expect("source");
        source.write(0, &pattern(10_000)).expect("fill");
        let listener = TcpListener::bind(loopback_any()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let handles: Vec<_> = listener
                .incoming()
                .take(3)
                .map(|stream| {
                    let source = source.clone();
                    std::thread::spawn(move || blast(stream.expect("accept"), &source))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("blaster")).collect::<Vec<_>>()
        });
        let engine = TransferEngine::start(TransferConfig::new(loopback_any())).expect("engine");
        let dst = engine.register(10_000).expect("dst");
        let raw = RawStreams::connect(addr, &dst, 3).expect("connect");
        assert_eq!(raw.streams(), 3);
        for _ in 0..2 {
            dst.with_mut(0, dst.len(), |b| b.fill(0)).expect("clear");
            raw.read().expect("read");
            assert!(dst.with_ref(0, dst.len(), |got| got == pattern(10_000).as_slice()).expect("check"));
        }
        drop(raw);
        // Every blaster saw its connection close cleanly.
        assert!(server.join().expect("server").iter().all(Result::is_ok));
    }

    #[test]
    fn blaster_refuses_bytes_past_the_region() {
        let engine = TransferEngine::start(TransferConfig::new(loopback_any())).expect("engine");
        let source = engine.register(4096).expect("source");
        let listener = TcpListener::bind(loopback_any()).expect("bind");
        let mut client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (stream, _) = listener.accept().expect("accept");
        let mut request = [0u8; 16];
        request[..8].copy_from_slice(&4000u64.to_le_bytes());
        request[8..].copy_from_slice(&200u64.to_le_bytes());
        client.write_all(&request).expect("send");
        let err = blast(stream, &source).expect_err("out of bounds");
        assert!(matches!(err, BenchError::Transfer(TransferError::OutOfBounds { .. })), "{err}");
    }
}
