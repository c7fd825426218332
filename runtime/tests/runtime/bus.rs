//! The ZeroMQ bus between two hosts in one process, over loopback TCP: direct messages
//! both ways, broadcasts, a garbage frame, a peer restart, and start/stop cycles.
//! Every wait is bounded; "eventually" means polling until a deadline.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_runtime::bus::{Bus, BusConfig, BusError, Endpoint, InboundFn, PeerSpec, SendError};
use tessera_runtime::codec::Envelope;
use tessera_runtime::{Addr, HostId};
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketSend, ZmqMessage};

#[path = "secure_bus.rs"]
mod secure;

const WAIT: Duration = Duration::from_secs(10);
const A: HostId = HostId(0);
const B: HostId = HostId(1);

fn free_port() -> u16 {
    tessera_runtime::bus::free_loopback_ports(1).expect("a free loopback port")[0]
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

#[derive(Clone, Copy)]
struct Ports {
    direct: SocketAddr,
    events: SocketAddr,
}

fn ports() -> Ports {
    let p = tessera_runtime::bus::free_loopback_ports(2).expect("free loopback ports");
    Ports { direct: loopback(p[0]), events: loopback(p[1]) }
}

fn config(host: HostId, own: Ports, peer_host: HostId, peer: Ports, capacity: usize) -> BusConfig {
    let mut c = BusConfig::new(host, format!("test-{}", host.0), own.direct, own.events);
    c.peers.push(PeerSpec {
        host: peer_host,
        name: format!("test-{}", peer_host.0),
        direct: peer.direct.into(),
        events: peer.events.into(),
    });
    c.queue_capacity = capacity;
    c.reconnect_max = Duration::from_millis(200);
    c
}

fn collector() -> (InboundFn, mpsc::UnboundedReceiver<Envelope>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Arc::new(move |env| drop(tx.send(env))), rx)
}

/// Starts a bus, retrying while its ports are still held (bounded).
async fn start(config: BusConfig, inbound: InboundFn) -> Bus {
    let deadline = Instant::now() + WAIT;
    loop {
        match Bus::start(config.clone(), inbound.clone()).await {
            Ok(bus) => return bus,
            Err(BusError::Bind { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("bus did not start: {e}"),
        }
    }
}

fn direct(from: HostId, to: HostId, corr: u64) -> Envelope {
    Envelope::direct(Addr::new(from, 7), Addr::new(to, 9), "Ping", corr, corr.to_le_bytes().to_vec())
}

/// Sends `corr` values from `first` up every 20 ms until one of them arrives; returns it.
async fn send_until_received(
    bus: &Bus,
    from: HostId,
    to: HostId,
    first: u64,
    rx: &mut mpsc::UnboundedReceiver<Envelope>,
) -> Envelope {
    let deadline = Instant::now() + WAIT;
    let mut corr = first;
    loop {
        assert!(Instant::now() < deadline, "no message from {from} reached {to}");
        match bus.send(direct(from, to, corr)) {
            Ok(()) | Err(SendError::Full { .. }) => {}
            Err(e) => panic!("send failed: {e}"),
        }
        corr += 1;
        if let Ok(Some(env)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await
            && env.corr >= first
        {
            return env;
        }
    }
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<Envelope>) -> Envelope {
    tokio::time::timeout(WAIT, rx.recv()).await.expect("timed out waiting for an envelope").expect("bus closed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_both_ways_and_broadcasts() {
    let (pa, pb) = (ports(), ports());
    let (ia, mut ra) = collector();
    let (ib, mut rb) = collector();
    let a = start(config(A, pa, B, pb, 64), ia).await;
    let b = start(config(B, pb, A, pa, 64), ib).await;

    let first = send_until_received(&a, A, B, 0, &mut rb).await;
    assert_eq!(first.from, Addr::new(A, 7));
    assert_eq!(first.to, Some(Addr::new(B, 9)));
    assert_eq!(first.payload, first.corr.to_le_bytes());
    // Once connected, order is kept: the next ones arrive in order.
    for corr in 1000..1010 {
        a.send(direct(A, B, corr)).expect("send a->b");
    }
    let mut got = Vec::new();
    while got.len() < 10 {
        let env = recv(&mut rb).await;
        if env.corr >= 1000 {
            got.push(env.corr);
        }
    }
    assert_eq!(got, (1000..1010).collect::<Vec<_>>());

    let back = send_until_received(&b, B, A, 0, &mut ra).await;
    assert_eq!(back.from.host, B);

    // Broadcasts: the subscription may land after the first publishes, so publish until
    // one arrives, then check what arrived.
    let deadline = Instant::now() + WAIT;
    let event = loop {
        assert!(Instant::now() < deadline, "no broadcast from a reached b");
        a.publish(Envelope::broadcast(Addr::new(A, 1), "kv.events", "KvEvent", vec![1, 2, 3])).expect("publish");
        match tokio::time::timeout(Duration::from_millis(20), rb.recv()).await {
            Ok(Some(env)) if env.topic.is_some() => break env,
            _ => {}
        }
    };
    assert_eq!(event.topic.as_deref(), Some("kv.events"));
    assert_eq!(event.kind, "KvEvent");
    assert_eq!(event.to, None);
    assert_eq!(event.payload, vec![1, 2, 3]);

    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no broadcast from b reached a");
        b.publish(Envelope::broadcast(Addr::new(B, 1), "heartbeat", "Heartbeat", vec![])).expect("publish");
        match tokio::time::timeout(Duration::from_millis(20), ra.recv()).await {
            Ok(Some(env)) if env.topic.as_deref() == Some("heartbeat") => break,
            _ => {}
        }
    }

    // A forced relink (what the host does when a peer's heartbeats stop) reconnects.
    a.reset_peer(B).expect("b is a peer");
    send_until_received(&a, A, B, 2000, &mut rb).await;
    let deadline = Instant::now() + WAIT;
    while a.stats().reconnects < 2 {
        assert!(Instant::now() < deadline, "reset did not relink both links: {:?}", a.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(a.reset_peer(HostId(9)), Err(SendError::UnknownHost(HostId(9)))));

    assert!(matches!(a.send(direct(A, HostId(9), 0)), Err(SendError::UnknownHost(HostId(9)))));
    assert!(matches!(a.send(direct(A, A, 0)), Err(SendError::UnknownHost(A))), "same-host delivery skips the bus");
    let mut no_topic = direct(A, B, 0);
    no_topic.topic = None;
    assert!(matches!(a.publish(no_topic), Err(SendError::Missing("topic"))));
    let sa = a.stats();
    assert!(sa.sent >= 11 && sa.received >= 1 && sa.dropped == 0, "{sa:?}");

    a.shutdown().await;
    let b2 = b.clone();
    b.shutdown().await;
    assert!(matches!(b2.send(direct(B, A, 0)), Err(SendError::Closed)));
}

/// A peer written as a DNS name is looked up when connecting, and every address the name
/// has is tried: `localhost` may give `::1` first while the peer listens on 127.0.0.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_named_by_dns_is_reached_through_its_name() {
    let (pa, pb) = (ports(), ports());
    let (ia, _ra) = collector();
    let (ib, mut rb) = collector();
    let mut ca = config(A, pa, B, pb, 64);
    let named = |addr: SocketAddr| Endpoint::parse(&format!("localhost:{}", addr.port())).expect("an endpoint");
    ca.peers[0].direct = named(pb.direct);
    ca.peers[0].events = named(pb.events);
    let a = start(ca, ia).await;
    let b = start(config(B, pb, A, pa, 64), ib).await;
    let got = send_until_received(&a, A, B, 0, &mut rb).await;
    assert_eq!(got.from, Addr::new(A, 7));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_are_counted_and_dropped() {
    let (pa, pb) = (ports(), ports());
    let (ia, _ra) = collector();
    let (ib, mut rb) = collector();
    let a = start(config(A, pa, B, pb, 64), ia).await;
    let b = start(config(B, pb, A, pa, 64), ib).await;
    send_until_received(&a, A, B, 0, &mut rb).await;

    let mut raw = DealerSocket::new();
    tokio::time::timeout(WAIT, raw.connect(&format!("tcp://{}", pb.direct)))
        .await
        .expect("raw connect timed out")
        .expect("raw connect");
    let garbage: [&[u8]; 3] = [b"\xc1\xc1 not msgpack", b"", &[0x92, 0x01]];
    for frame in garbage {
        raw.send(ZmqMessage::from(frame.to_vec())).await.expect("raw send");
    }
    // Two ZeroMQ frames where one envelope is expected.
    let two = ZmqMessage::try_from(vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]).expect("two frames");
    raw.send(two).await.expect("raw send");
    // A well-formed envelope of a future protocol version.
    let mut v2 = direct(A, B, 5);
    v2.v = 2;
    raw.send(ZmqMessage::from(tessera_runtime::codec::encode(&v2).expect("encode"))).await.expect("raw send");

    let deadline = Instant::now() + WAIT;
    while b.stats().dropped < 5 {
        assert!(Instant::now() < deadline, "garbage not counted: {:?}", b.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.stats().dropped, 5);

    // Still working, and nothing garbage reached the inbound function.
    let env = send_until_received(&a, A, B, 100, &mut rb).await;
    assert_eq!(env.v, 1);
    while let Ok(env) = rb.try_recv() {
        assert_eq!(env.from, Addr::new(A, 7));
    }
    drop(raw);
    a.shutdown().await;
    b.shutdown().await;
}

/// Frames queued before the peer is up go out first, and the frames `send` hands to
/// ZeroMQ itself once the link is up follow them: every frame arrives, in send order,
/// across the switch from the link's queue to the direct path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_keep_their_order_from_the_queue_to_the_direct_path() {
    let (pa, pb) = (ports(), ports());
    let (ia, _ra) = collector();
    let (ib, mut rb) = collector();
    let a = start(config(A, pa, B, pb, 512), ia).await;
    for corr in 0..300 {
        a.send(direct(A, B, corr)).expect("queued before the peer is up");
    }
    let b = start(config(B, pb, A, pa, 512), ib).await;
    let total = 5_000u64;
    let mut corr = 300;
    while corr < total {
        match a.send(direct(A, B, corr)) {
            Ok(()) => corr += 1,
            Err(SendError::Full { .. }) => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(e) => panic!("send: {e}"),
        }
    }
    for want in 0..total {
        let env = tokio::time::timeout(WAIT, rb.recv()).await.expect("every frame arrives").expect("open");
        assert_eq!(env.corr, want, "out of order");
    }
    assert_eq!(a.stats().sent, total);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_restart_gives_full_then_reconnects() {
    let (pa, pb) = (ports(), ports());
    let capacity = 8;
    let (ia, mut ra) = collector();
    let (ib, mut rb) = collector();
    let a = start(config(A, pa, B, pb, capacity), ia).await;
    let b = start(config(B, pb, A, pa, capacity), ib.clone()).await;
    send_until_received(&a, A, B, 0, &mut rb).await;
    send_until_received(&b, B, A, 0, &mut ra).await;

    b.shutdown().await;
    // With b gone, a's queue to b fills and then refuses, without blocking. A few frames
    // may vanish into the dead connection before a notices.
    let deadline = Instant::now() + WAIT;
    let mut accepted = 0;
    loop {
        assert!(Instant::now() < deadline, "sends to a dead peer never reported Full ({accepted} accepted)");
        let t = Instant::now();
        let r = a.send(direct(A, B, 10_000 + accepted));
        assert!(t.elapsed() < Duration::from_millis(50), "send blocked for {:?}", t.elapsed());
        match r {
            Ok(()) => accepted += 1,
            Err(SendError::Full { peer }) => {
                assert_eq!(peer, "test-1");
                break;
            }
            Err(e) => panic!("unexpected send error: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(accepted >= capacity as u64, "Full after only {accepted} sends");
    assert!(a.stats().queue_full >= 1);

    // b comes back on the same ports; a reconnects by itself and new messages flow.
    let (ib2, mut rb2) = collector();
    let b = start(config(B, pb, A, pa, capacity), ib2).await;
    let env = send_until_received(&a, A, B, 20_000, &mut rb2).await;
    assert!(env.corr >= 20_000, "a frame queued while b was down reached its new life: {}", env.corr);
    send_until_received(&b, B, A, 30_000, &mut ra).await;
    let sa = a.stats();
    assert!(sa.reconnects >= 1, "{sa:?}");
    assert!(sa.discarded >= capacity as u64, "{sa:?}");
    drop(rb);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_stop_cycles_release_ports_and_tasks() {
    let (pa, pb) = (ports(), ports());
    let metrics = tokio::runtime::Handle::current().metrics();
    let baseline = metrics.num_alive_tasks();
    for round in 0..20u64 {
        let (ia, _ra) = collector();
        let (ib, mut rb) = collector();
        let a = start(config(A, pa, B, pb, 16), ia).await;
        let b = start(config(B, pb, A, pa, 16), ib).await;
        if round % 5 == 0 {
            send_until_received(&a, A, B, 0, &mut rb).await;
        }
        a.shutdown().await;
        b.shutdown().await;
    }
    // ZeroMQ's own per-connection tasks end shortly after their sockets close.
    let deadline = Instant::now() + WAIT;
    while metrics.num_alive_tasks() > baseline {
        assert!(
            Instant::now() < deadline,
            "{} tasks still alive after 20 start/stop cycles (baseline {baseline})",
            metrics.num_alive_tasks()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The same ports bind straight away after a shutdown (no retry needed).
    let (ia, _ra) = collector();
    let a = Bus::start(config(A, pa, B, pb, 16), ia).await.expect("ports released by shutdown");
    a.shutdown().await;
}

#[test]
fn bus_handles_are_shareable() {
    fn shareable<T: Send + Sync + Clone + 'static>() {}
    shareable::<Bus>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_failure_names_the_address() {
    let taken = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let addr = taken.local_addr().expect("addr");
    let (ia, _ra) = collector();
    let cfg = config(A, Ports { direct: addr, events: loopback(free_port()) }, B, ports(), 16);
    let err = Bus::start(cfg, ia).await.err().expect("binding a taken port must fail");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");

    let (ia, _ra) = collector();
    let mut cfg = config(A, ports(), B, ports(), 16);
    cfg.peers.push(cfg.peers[0].clone());
    assert!(matches!(Bus::start(cfg, ia).await, Err(BusError::Config(_))));
}

/// Hostile bytes at a bus port, as a raw TCP client would send them.
mod hostile {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// A ZMTP 3.0 greeting with the NULL mechanism.
    pub fn greeting() -> Vec<u8> {
        let mut g = vec![0u8; 64];
        g[0] = 0xff;
        g[9] = 0x7f;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        g
    }

    /// A READY command announcing `socket_type`.
    pub fn ready(socket_type: &str) -> Vec<u8> {
        let mut body = vec![5u8];
        body.extend_from_slice(b"READY");
        body.push(11);
        body.extend_from_slice(b"Socket-Type");
        body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        body.extend_from_slice(socket_type.as_bytes());
        let mut frame = vec![0x04, body.len() as u8];
        frame.extend_from_slice(&body);
        frame
    }

    /// A long frame header (flags | LONG) announcing `len` bytes.
    pub fn long_header(flags: u8, len: u64) -> Vec<u8> {
        let mut h = vec![flags | 0x02];
        h.extend_from_slice(&len.to_be_bytes());
        h
    }

    /// How far into a connection the hostile bytes come.
    #[derive(Debug, Clone, Copy)]
    pub enum Stage {
        /// Connected, nothing sent: the handshake must time out.
        Silent,
        /// Greeting sent, then a command header announcing ~2^60 bytes.
        HugeCommand,
        /// Greeting and READY done, then a message frame announcing ~2^60 bytes.
        HugeMessage,
        /// Handshake done, then a 300 MB frame announced and trickled.
        TrickledLarge,
        /// Handshake done, then a multipart message whose parts together pass the bound.
        ManyParts,
    }

    pub const STAGES: [Stage; 5] =
        [Stage::Silent, Stage::HugeCommand, Stage::HugeMessage, Stage::TrickledLarge, Stage::ManyParts];

    /// Plays `stage` against `addr` (a ROUTER or PUB port; `peer_type` is what we claim
    /// to be) and returns once the host has closed the connection; panics if it has not
    /// within `WAIT`.
    pub async fn play(addr: SocketAddr, peer_type: &str, stage: Stage) {
        let mut conn = TcpStream::connect(addr).await.expect("connect to the bus port");
        async fn write(conn: &mut TcpStream, bytes: Vec<u8>) -> bool {
            conn.write_all(&bytes).await.is_ok()
        }
        match stage {
            Stage::Silent => {}
            Stage::HugeCommand => {
                let mut bytes = greeting();
                bytes.extend(long_header(0x04, 1 << 60));
                write(&mut conn, bytes).await;
            }
            Stage::HugeMessage | Stage::TrickledLarge | Stage::ManyParts => {
                let mut bytes = greeting();
                bytes.extend(ready(peer_type));
                write(&mut conn, bytes).await;
                let header = match stage {
                    Stage::HugeMessage => long_header(0x00, 1 << 60),
                    Stage::TrickledLarge => long_header(0x00, 300 << 20),
                    _ => Vec::new(),
                };
                write(&mut conn, header).await;
                match stage {
                    Stage::TrickledLarge => {
                        // A few KiB at a time, as a slow attacker would.
                        for _ in 0..64 {
                            if !write(&mut conn, vec![0u8; 4096]).await {
                                break;
                            }
                        }
                    }
                    Stage::ManyParts => {
                        // 1 MiB parts with MORE set: 17 of them pass a 16 MiB bound.
                        let part = {
                            let mut p = long_header(0x01, 1 << 20);
                            p.extend(vec![0u8; 1 << 20]);
                            p
                        };
                        for _ in 0..24 {
                            if !write(&mut conn, part.clone()).await {
                                break;
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        let deadline = Instant::now() + WAIT;
        let mut buf = vec![0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "the host kept a hostile connection open ({stage:?} at {addr})");
            match tokio::time::timeout(left, conn.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(_)) => {} // the host's own greeting and READY
                Err(_) => panic!("the host kept a hostile connection open ({stage:?} at {addr})"),
            }
        }
    }
}

/// Hostile frame headers (huge, trickled, split into many parts) and silent clients, at
/// both bus ports of a host and in each connection state: each such connection is
/// closed by the host, and the host goes on serving its real peer both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_at_every_port_and_state_leave_the_host_serving() {
    let (pa, pb) = (ports(), ports());
    let (ia, mut ra) = collector();
    let (ib, mut rb) = collector();
    let hardened = |mut c: BusConfig| {
        c.handshake_timeout = Duration::from_millis(500);
        c
    };
    let a = start(hardened(config(A, pa, B, pb, 64)), ia).await;
    let b = start(hardened(config(B, pb, A, pa, 64)), ib).await;
    send_until_received(&a, A, B, 0, &mut rb).await;
    send_until_received(&b, B, A, 0, &mut ra).await;

    let mut corr = 1_000_000;
    for (port, peer_type) in [(a.direct_addr(), "DEALER"), (a.events_addr(), "SUB")] {
        for stage in hostile::STAGES {
            hostile::play(port, peer_type, stage).await;
            // Still serving, both ways: direct messages in and out, broadcasts out.
            send_until_received(&b, B, A, corr, &mut ra).await;
            send_until_received(&a, A, B, corr, &mut rb).await;
            corr += 1_000;
        }
    }
    // Two trickling connections at once are each bounded and cut off too.
    let both = futures::future::join(
        hostile::play(a.direct_addr(), "DEALER", hostile::Stage::TrickledLarge),
        hostile::play(a.events_addr(), "SUB", hostile::Stage::TrickledLarge),
    );
    both.await;
    send_until_received(&a, A, B, corr, &mut rb).await;
    // A's PUB still reaches B's SUB.
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no broadcast from A reached B after the hostile connections");
        a.publish(Envelope::broadcast(Addr::new(A, 7), "heartbeat", "Beat", vec![1])).expect("publish");
        if let Ok(Some(env)) = tokio::time::timeout(Duration::from_millis(20), rb.recv()).await
            && env.topic.as_deref() == Some("heartbeat")
        {
            break;
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}
