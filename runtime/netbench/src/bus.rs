//! `tessera bench bus`: round-trip latency and throughput of the bus between two host
//! processes (over loopback TCP by default, or between two addresses such as two network
//! namespaces), against a plain TCP ping-pong of the same frame size and path measured in
//! the same run.
//!
//! The baseline carries no handicap the bus does not: like the bus's ZeroMQ codec, both
//! of its ends read through a buffer (one read returns every frame that has arrived) and
//! write each frame with one write.
//!
//! The peer is this same binary re-executed with a hidden subcommand that calls
//! [`serve_peer`] (or, for tests, a thread running the same code). It echoes every
//! direct envelope back to its sender and runs a length-prefixed TCP echo server.
//! The parent owns the peer and stops it on every exit path (the guard's `Drop`).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};

pub use crate::secured::BenchSecurity;
use crate::secured::{KeysDir, MAIN_NAME, PEER_NAME, plane_security};
use tessera_runtime::bus::{Bus, BusConfig, BusError, BusStats, InboundFn, PeerSpec, SendError};
use tessera_runtime::codec::{self, Envelope};
use tessera_runtime::{Addr, HostId};

const MAIN_HOST: HostId = HostId(0);
const PEER_HOST: HostId = HostId(1);
/// Longest wait for any one reply, for the peer to come up, or for it to exit.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
const SETUP_ATTEMPTS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum BusBenchError {
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("bus benchmark: {0}")]
    Bench(String),
    #[error("bus benchmark I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Secured(#[from] crate::secured::SecuredError),
}

/// How the echo peer runs.
#[derive(Debug, Clone)]
pub enum PeerLaunch {
    /// A child process: `program args... --direct A --events B --peer-direct C
    /// --peer-events D --tcp E` (the arguments [`BusPeerArgs::to_args`] writes). The program
    /// may be a wrapper that runs the peer elsewhere, e.g. `ip netns exec NS tessera ...`.
    Process { program: PathBuf, args: Vec<String> },
    /// A thread of this process with its own tokio runtime (tests).
    Thread,
}

#[derive(Debug, Clone)]
pub struct BusBenchOptions {
    /// Round trips per measurement (latency, then throughput).
    pub messages: usize,
    /// Bytes of each envelope's payload.
    pub payload_bytes: usize,
    /// Messages in flight during the throughput measurement.
    pub window: usize,
    pub peer: PeerLaunch,
    /// `None`: a plain bus.
    pub security: Option<BenchSecurity>,
    /// The address this side binds (the peer connects to it).
    pub bind: IpAddr,
    /// The address the peer binds (this side connects to it).
    pub peer_bind: IpAddr,
}

/// Where the echo peer binds and whom it talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusPeerArgs {
    pub direct: SocketAddr,
    pub events: SocketAddr,
    pub peer_direct: SocketAddr,
    pub peer_events: SocketAddr,
    /// The plain TCP echo server's address.
    pub tcp: SocketAddr,
    /// A secured bus: its settings and the directory with both ends' keys.
    pub security: Option<(BenchSecurity, PathBuf)>,
}

impl BusPeerArgs {
    /// The peer subcommand's flags (the CLI's `bench bus-peer` parses exactly these).
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--direct".into(),
            self.direct.to_string(),
            "--events".into(),
            self.events.to_string(),
            "--peer-direct".into(),
            self.peer_direct.to_string(),
            "--peer-events".into(),
            self.peer_events.to_string(),
            "--tcp".into(),
            self.tcp.to_string(),
        ]
        .into_iter()
        .chain(self.security.iter().flat_map(|(sec, dir)| sec.to_args(dir)))
        .collect()
    }
}

/// One transport's figures.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PathReport {
    pub rtt_p50_us: f64,
    pub rtt_p99_us: f64,
    /// Completed round trips per second with `window` messages in flight.
    pub round_trips_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct BusBenchReport {
    pub messages: usize,
    pub payload_bytes: usize,
    /// Encoded envelope size; the TCP baseline sends frames of this many bytes.
    pub frame_bytes: usize,
    pub window: usize,
    /// "process" or "thread".
    pub peer: &'static str,
    /// `BIND -> PEER_BIND`: the addresses of the two ends.
    pub path: String,
    /// "off", or the secured bus's mode and cipher.
    pub security: String,
    pub bus: PathReport,
    pub tcp: PathReport,
    /// Bus RTT p50 / TCP RTT p50.
    pub rtt_p50_ratio: f64,
    /// Bus round trips/s / TCP round trips/s.
    pub throughput_ratio: f64,
    /// The measuring side's bus counters at the end.
    pub bus_stats: BusStats,
}

impl BusBenchReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "bus ({}) vs TCP, {}, peer in a {}: {} round trips, payload {} B (frame {} B), window {}\n",
            self.security, self.path, self.peer, self.messages, self.payload_bytes, self.frame_bytes, self.window
        );
        s += &format!("{:<6} {:>12} {:>12} {:>16}\n", "path", "RTT p50 us", "RTT p99 us", "round trips/s");
        for (name, p) in [("bus", &self.bus), ("tcp", &self.tcp)] {
            s += &format!("{:<6} {:>12.1} {:>12.1} {:>16.0}\n", name, p.rtt_p50_us, p.rtt_p99_us, p.round_trips_per_s);
        }
        s += &format!("bus/tcp: RTT p50 x{:.2}, throughput x{:.2}\n", self.rtt_p50_ratio, self.throughput_ratio);
        let st = &self.bus_stats;
        s += &format!(
            "bus counters: sent {} received {} dropped {} queue_full {} reconnects {} discarded {}\n",
            st.sent, st.received, st.dropped, st.queue_full, st.reconnects, st.discarded
        );
        s
    }
}

fn bench_err(msg: impl Into<String>) -> BusBenchError {
    BusBenchError::Bench(msg.into())
}

fn runtime() -> Result<tokio::runtime::Runtime, BusBenchError> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// Where both ends bind unless told otherwise.
pub const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Runs the echo peer until its standard input closes (the parent exited or let go).
pub fn serve_peer(args: &BusPeerArgs) -> Result<(), BusBenchError> {
    let rt = runtime()?;
    rt.block_on(async {
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            let mut stdin = std::io::stdin().lock();
            while matches!(stdin.read_line(&mut sink), Ok(n) if n > 0) {
                sink.clear();
            }
        });
        serve(args, async { drop(stdin_closed.await) }, || println!("ready")).await
    })
}

async fn serve(
    args: &BusPeerArgs,
    stop: impl std::future::Future<Output = ()>,
    ready: impl FnOnce(),
) -> Result<(), BusBenchError> {
    let tcp = TcpListener::bind(args.tcp).await?;
    let slot: Arc<OnceLock<Bus>> = Arc::new(OnceLock::new());
    let echo = slot.clone();
    let inbound: InboundFn = Arc::new(move |env: Envelope| {
        let (Some(bus), Some(to)) = (echo.get(), env.to) else { return };
        let reply = Envelope { to: Some(env.from), from: to, ..env };
        if let Err(e) = bus.send(reply) {
            tracing::warn!("bench peer cannot echo: {e}");
        }
    });
    let mut config = BusConfig::new(PEER_HOST, PEER_NAME, args.direct, args.events);
    if let Some((sec, dir)) = &args.security {
        config.security = Some(plane_security(*sec, dir, PEER_NAME, MAIN_HOST, PEER_HOST)?);
    }
    config.peers.push(PeerSpec {
        host: MAIN_HOST,
        name: MAIN_NAME.into(),
        direct: args.peer_direct.into(),
        events: args.peer_events.into(),
    });
    let bus = Bus::start(config, inbound).await?;
    let _ = slot.set(bus.clone());
    let tcp_task = tokio::spawn(tcp_echo_server(tcp));
    ready();
    stop.await;
    tcp_task.abort();
    // The echo closure holds a clone of the bus: only an explicit shutdown ends it.
    bus.shutdown().await;
    Ok(())
}

async fn tcp_echo_server(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        tokio::spawn(async move {
            if let Err(e) = tcp_echo(stream).await {
                tracing::debug!("bench TCP echo connection ended: {e}");
            }
        });
    }
}

/// Echoes length-prefixed frames. Reads are buffered, as the bus's ZeroMQ codec's are:
/// an unbuffered reader would pay two reads per frame where the bus pays one per many.
async fn tcp_echo(stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (read, mut write) = stream.into_split();
    let mut read = tokio::io::BufReader::new(read);
    let mut frame = Vec::new();
    loop {
        let mut len = [0u8; 4];
        match read.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > codec::MAX_FRAME_BYTES {
            return Err(std::io::Error::other("frame too large"));
        }
        frame.clear();
        frame.extend_from_slice(&len);
        frame.resize(4 + n, 0);
        read.read_exact(&mut frame[4..]).await?;
        write.write_all(&frame).await?;
    }
}

/// The running echo peer; stopping it is `Drop`, so every exit path reaps it.
enum PeerGuard {
    Process(Option<Child>),
    Thread {
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        join: Option<std::thread::JoinHandle<Result<(), BusBenchError>>>,
    },
}

impl Drop for PeerGuard {
    fn drop(&mut self) {
        match self {
            PeerGuard::Process(child) => {
                if let Some(mut child) = child.take() {
                    crate::peer::stop_peer_process(&mut child, "bus bench peer");
                }
            }
            PeerGuard::Thread { stop, join } => {
                if let Some(stop) = stop.take() {
                    let _ = stop.send(());
                }
                if let Some(join) = join.take() {
                    match join.join() {
                        Ok(Err(e)) => tracing::warn!("bench peer thread failed: {e}"),
                        Err(_) => tracing::error!("bench peer thread panicked"),
                        Ok(Ok(())) => {}
                    }
                }
            }
        }
    }
}

/// Starts the peer and waits until it has bound its sockets.
fn launch_peer(launch: &PeerLaunch, args: &BusPeerArgs) -> Result<PeerGuard, BusBenchError> {
    match launch {
        PeerLaunch::Process { program, args: prefix } => {
            let child = crate::peer::spawn_peer_process(program, prefix, args.to_args())
                .map_err(|e| bench_err(format!("cannot start the peer {}: {e}", program.display())))?;
            let mut guard = PeerGuard::Process(Some(child));
            let PeerGuard::Process(Some(child)) = &mut guard else { unreachable!() };
            let stdout = child.stdout.take().ok_or_else(|| bench_err("peer has no stdout"))?;
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let mut reader = BufReader::new(stdout);
                let ready = matches!(reader.read_line(&mut line), Ok(n) if n > 0) && line.trim() == "ready";
                let _ = tx.send(ready);
                // Keep draining so the peer never blocks on a full pipe.
                while matches!(reader.read_line(&mut line), Ok(n) if n > 0) {
                    line.clear();
                }
            });
            match rx.recv_timeout(REPLY_TIMEOUT) {
                Ok(true) => Ok(guard),
                Ok(false) => {
                    let status = child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                    Err(bench_err(format!("peer exited before it was ready ({status})")))
                }
                Err(_) => Err(bench_err("peer not ready in time")),
            }
        }
        PeerLaunch::Thread => {
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let peer_args = args.clone();
            let join = std::thread::spawn(move || {
                let rt = runtime()?;
                let ready = ready_tx.clone();
                let result = rt.block_on(serve(&peer_args, async { drop(stop_rx.await) }, move || {
                    let _ = ready.send(true);
                }));
                let _ = ready_tx.send(false);
                result
            });
            let guard = PeerGuard::Thread { stop: Some(stop_tx), join: Some(join) };
            match ready_rx.recv_timeout(REPLY_TIMEOUT) {
                Ok(true) => Ok(guard),
                _ => Err(bench_err("peer thread did not come up")),
            }
        }
    }
}

/// Runs the benchmark; creates its own tokio runtime (call it from sync code).
pub fn run(opts: &BusBenchOptions) -> Result<BusBenchReport, BusBenchError> {
    if opts.messages == 0 || opts.window == 0 {
        return Err(bench_err("messages and window must be at least 1"));
    }
    let rt = runtime()?;
    let mut last = None;
    // Ports are picked free then released, so another process may take one first.
    for _ in 0..SETUP_ATTEMPTS {
        match run_once(&rt, opts) {
            Err(Attempt::Setup(e)) => {
                tracing::debug!("bus bench setup failed, retrying on other ports: {e}");
                last = Some(e);
            }
            Err(Attempt::Measure(e)) => return Err(e),
            Ok(report) => return Ok(report),
        }
    }
    Err(last.unwrap_or_else(|| bench_err("no attempt made")))
}

enum Attempt {
    Setup(BusBenchError),
    Measure(BusBenchError),
}

fn run_once(rt: &tokio::runtime::Runtime, opts: &BusBenchOptions) -> Result<BusBenchReport, Attempt> {
    let ports = tessera_runtime::bus::free_loopback_ports(5).map_err(|e| Attempt::Setup(e.into()))?;
    // Fresh keys for both ends, removed when the run ends.
    let keys = opts.security.map(|_| KeysDir::new()).transpose().map_err(|e| Attempt::Setup(e.into()))?;
    let (peer, me) = (opts.peer_bind, opts.bind);
    let peer_args = BusPeerArgs {
        direct: SocketAddr::new(peer, ports[0]),
        events: SocketAddr::new(peer, ports[1]),
        peer_direct: SocketAddr::new(me, ports[2]),
        peer_events: SocketAddr::new(me, ports[3]),
        tcp: SocketAddr::new(peer, ports[4]),
        security: opts.security.zip(keys.as_ref().map(|k: &KeysDir| k.0.clone())),
    };
    let _peer = launch_peer(&opts.peer, &peer_args).map_err(Attempt::Setup)?;
    rt.block_on(async {
        let (tx, rx) = mpsc::unbounded_channel();
        let inbound: InboundFn = Arc::new(move |env: Envelope| {
            let _ = tx.send(env.corr);
        });
        let mut config = BusConfig::new(MAIN_HOST, MAIN_NAME, peer_args.peer_direct, peer_args.peer_events);
        if let Some((sec, dir)) = &peer_args.security {
            config.security =
                Some(plane_security(*sec, dir, MAIN_NAME, MAIN_HOST, PEER_HOST).map_err(|e| Attempt::Setup(e.into()))?);
        }
        config.peers.push(PeerSpec {
            host: PEER_HOST,
            name: PEER_NAME.into(),
            direct: peer_args.direct.into(),
            events: peer_args.events.into(),
        });
        let bus = Bus::start(config, inbound).await.map_err(|e| Attempt::Setup(e.into()))?;
        let measured = measure(&bus, rx, opts, peer_args.tcp).await;
        let stats = bus.stats();
        bus.shutdown().await;
        let (frame_bytes, bus_path, tcp_path) = measured.map_err(Attempt::Measure)?;
        Ok(BusBenchReport {
            messages: opts.messages,
            payload_bytes: opts.payload_bytes,
            frame_bytes,
            window: opts.window,
            peer: match opts.peer {
                PeerLaunch::Process { .. } => "process",
                PeerLaunch::Thread => "thread",
            },
            path: format!("{me} -> {peer}"),
            security: BenchSecurity::label(opts.security),
            rtt_p50_ratio: bus_path.rtt_p50_us / tcp_path.rtt_p50_us,
            throughput_ratio: bus_path.round_trips_per_s / tcp_path.round_trips_per_s,
            bus: bus_path,
            tcp: tcp_path,
            bus_stats: stats,
        })
    })
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<u64>) -> Result<u64, BusBenchError> {
    match tokio::time::timeout(REPLY_TIMEOUT, rx.recv()).await {
        Ok(Some(corr)) => Ok(corr),
        Ok(None) => Err(bench_err("bus closed")),
        Err(_) => Err(bench_err("no echo from the peer within 10 s")),
    }
}

fn percentile_us(sorted: &[Duration], pct: usize) -> f64 {
    let i = (sorted.len() * pct / 100).min(sorted.len().saturating_sub(1));
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

fn path_report(mut rtts: Vec<Duration>, round_trips: usize, elapsed: Duration) -> PathReport {
    rtts.sort_unstable();
    PathReport {
        rtt_p50_us: percentile_us(&rtts, 50),
        rtt_p99_us: percentile_us(&rtts, 99),
        round_trips_per_s: round_trips as f64 / elapsed.as_secs_f64().max(1e-9),
    }
}

async fn measure(
    bus: &Bus,
    mut rx: mpsc::UnboundedReceiver<u64>,
    opts: &BusBenchOptions,
    tcp: SocketAddr,
) -> Result<(usize, PathReport, PathReport), BusBenchError> {
    let payload = vec![0xa5u8; opts.payload_bytes];
    let ping = |corr: u64| {
        Envelope::direct(Addr::new(MAIN_HOST, 1), Addr::new(PEER_HOST, 1), "BenchPing", corr, payload.clone())
    };
    let frame_bytes = codec::encode(&ping(u64::MAX)).map_err(|e| bench_err(format!("encode: {e}")))?.len();
    let send = |corr: u64| bus.send(ping(corr)).map_err(|e: SendError| bench_err(format!("send: {e}")));

    // Both links must be up: ping until the first echo, then take every echo back.
    let deadline = Instant::now() + REPLY_TIMEOUT;
    let mut warm_sent = 0u64;
    loop {
        send(warm_sent)?;
        warm_sent += 1;
        match tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
            Ok(Some(_)) => break,
            Ok(None) => return Err(bench_err("bus closed")),
            Err(_) if Instant::now() < deadline => {}
            Err(_) => return Err(bench_err("peer unreachable over the bus within 10 s")),
        }
    }
    for _ in 1..warm_sent {
        recv(&mut rx).await?;
    }
    let warmup = opts.messages.min(1000) as u64;
    for i in 0..warmup {
        send(i)?;
        recv(&mut rx).await?;
    }

    // Bus: latency one at a time, then throughput with a window in flight.
    let n = opts.messages;
    let mut rtts = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let t = Instant::now();
        send(i)?;
        let corr = recv(&mut rx).await?;
        rtts.push(t.elapsed());
        if corr != i {
            return Err(bench_err(format!("echo out of order: {corr} for {i}")));
        }
    }
    let started = Instant::now();
    let (mut sent, mut done) = (0usize, 0usize);
    while done < n {
        while sent < n && sent - done < opts.window {
            match bus.send(ping(sent as u64)) {
                Ok(()) => sent += 1,
                Err(SendError::Full { .. }) => break,
                Err(e) => return Err(bench_err(format!("send: {e}"))),
            }
        }
        recv(&mut rx).await?;
        done += 1;
    }
    let bus_path = path_report(rtts, n, started.elapsed());

    let tcp_path = measure_tcp(tcp, frame_bytes, n, opts.window).await?;
    Ok((frame_bytes, bus_path, tcp_path))
}

async fn measure_tcp(to: SocketAddr, frame_bytes: usize, n: usize, window: usize) -> Result<PathReport, BusBenchError> {
    let mut frame = (frame_bytes as u32).to_le_bytes().to_vec();
    frame.resize(4 + frame_bytes, 0xa5);
    let timeout = |what: &'static str| move |_| bench_err(format!("TCP baseline: {what} timed out"));

    let stream = tokio::time::timeout(REPLY_TIMEOUT, TcpStream::connect(to)).await.map_err(timeout("connect"))??;
    stream.set_nodelay(true)?;
    // Buffered reads, like the bus's (see `tcp_echo`); one write per frame, like the bus's.
    let (read_half, mut write_half) = stream.into_split();
    let mut read_half = tokio::io::BufReader::new(read_half);
    let mut reply = vec![0u8; frame.len()];
    let warmup = n.min(1000);
    let mut rtts = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let t = Instant::now();
        write_half.write_all(&frame).await?;
        tokio::time::timeout(REPLY_TIMEOUT, read_half.read_exact(&mut reply)).await.map_err(timeout("echo"))??;
        if i >= warmup {
            rtts.push(t.elapsed());
        }
    }

    // Pipelined: a writer bounded by the window, the reader returning permits.
    let permits = Arc::new(Semaphore::new(window));
    let started = Instant::now();
    let writer_permits = permits.clone();
    let writer = tokio::spawn(async move {
        for _ in 0..n {
            let permit = writer_permits.acquire().await.map_err(|_| std::io::Error::other("closed"))?;
            permit.forget();
            write_half.write_all(&frame).await?;
        }
        Ok::<_, std::io::Error>(write_half)
    });
    for _ in 0..n {
        tokio::time::timeout(REPLY_TIMEOUT, read_half.read_exact(&mut reply)).await.map_err(timeout("echo"))??;
        permits.add_permits(1);
    }
    let elapsed = started.elapsed();
    writer.await.map_err(|e| bench_err(format!("TCP writer: {e}")))??;
    Ok(path_report(rtts, n, elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_runs_against_a_thread_peer() {
        // Two loopback addresses: each end binds the one it is given.
        let peer_bind = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let opts = BusBenchOptions {
            messages: 300,
            payload_bytes: 64,
            window: 16,
            peer: PeerLaunch::Thread,
            security: None,
            bind: LOOPBACK,
            peer_bind,
        };
        let report = run(&opts).expect("bench");
        assert_eq!((report.peer, report.path.as_str()), ("thread", "127.0.0.1 -> 127.0.0.2"));
        assert!(report.frame_bytes > 64);
        assert!(report.bus.rtt_p50_us > 0.0 && report.bus.rtt_p99_us >= report.bus.rtt_p50_us);
        assert!(report.tcp.rtt_p50_us > 0.0 && report.tcp.round_trips_per_s > 0.0);
        assert!(report.rtt_p50_ratio.is_finite() && report.throughput_ratio.is_finite());
        assert!(report.bus_stats.received >= 600, "{:?}", report.bus_stats);
        assert_eq!(report.bus_stats.dropped, 0);
        assert!(report.table().contains("bus/tcp"));
    }

    #[test]
    fn bench_runs_a_secured_bus_with_either_cipher() {
        use tessera_runtime::security::{Cipher, Mode};
        for cipher in [Cipher::ChaCha20Poly1305, Cipher::Sm4Gcm] {
            let security = Some(BenchSecurity { mode: Mode::Encrypt, cipher });
            let opts = BusBenchOptions {
                messages: 200,
                payload_bytes: 64,
                window: 16,
                peer: PeerLaunch::Thread,
                security,
                bind: LOOPBACK,
                peer_bind: LOOPBACK,
            };
            let report = run(&opts).expect("bench");
            assert_eq!(report.security, format!("encrypt {cipher}"));
            let st = report.bus_stats;
            assert!(st.received >= 400 && st.dropped == 0 && st.handshakes >= 2 && st.refused == 0, "{st:?}");
        }
    }
}
