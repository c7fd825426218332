//! The KV transfer engine over loopback, two engines in one process: exact bytes over
//! shm and tcp for random batches, edge batches, clear errors for bad requests, a
//! hostile raw client, connection limits, and a vanished peer. Nothing here waits on a
//! clock except the bounds asserted on error paths and the server's own timeouts.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tessera_runtime::transfer::{
    Assignment, Region, RegionDesc, RemoteStatus, TransferConfig, TransferEngine, TransferError, Transport,
    TransportChoice,
};

const REGION_BYTES: usize = 1 << 20;
/// Generous bound on anything that must fail fast (connect refused, a closed socket).
const FAIL_FAST: Duration = Duration::from_secs(5);

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

fn engine() -> Arc<TransferEngine> {
    let mut config = TransferConfig::new(loopback());
    config.connect_timeout = Duration::from_secs(2);
    TransferEngine::start(config).expect("start a loopback engine")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(seed as u32 % 32).to_le_bytes()[1]).collect()
}

/// Engine A owns a source region filled with a pattern; engine B reads it.
struct Pair {
    a: Arc<TransferEngine>,
    b: Arc<TransferEngine>,
    src: Region,
    src_bytes: Vec<u8>,
    remote: RegionDesc,
}

fn pair() -> Pair {
    pair_with(TransferConfig::new(loopback()))
}

/// [`pair`] with engine A (the one serving) started from `config`.
fn pair_with(config: TransferConfig) -> Pair {
    let (a, b) = (TransferEngine::start(config).expect("start the serving engine"), engine());
    let src = a.register(REGION_BYTES).expect("register the source");
    let src_bytes = pattern(REGION_BYTES, 7);
    src.write(0, &src_bytes).expect("fill the source");
    let remote = a.describe(&src);
    Pair { a, b, src, src_bytes, remote }
}

fn a(src_offset: u64, dst_offset: u64, len: u64) -> Assignment {
    Assignment { src_offset, dst_offset, len }
}

/// What `dst` must hold after `batch` (zeros elsewhere).
fn expected(src: &[u8], dst_len: usize, batch: &[Assignment]) -> Vec<u8> {
    let mut out = vec![0u8; dst_len];
    for x in batch {
        let (s, d, n) = (x.src_offset as usize, x.dst_offset as usize, x.len as usize);
        out[d..d + n].copy_from_slice(&src[s..s + n]);
    }
    out
}

fn contents(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    region.read(0, &mut out).expect("read back the region");
    out
}

fn both() -> [Transport; 2] {
    [Transport::Shm, Transport::Tcp]
}

#[test]
fn random_batches_copy_exact_bytes_over_shm_and_tcp() {
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register the destination");
    // Up to 128 blocks of up to 8 KiB, each in its own 8 KiB destination slot.
    let blocks = proptest::collection::vec((0u64..(REGION_BYTES as u64 - 8192), 1u64..=8192, 0u64..8192), 0..128);
    let mut runner = TestRunner::new(Config { cases: 12, ..Config::default() });
    runner
        .run(&blocks, |blocks| {
            let batch: Vec<Assignment> = blocks
                .iter()
                .enumerate()
                .map(|(i, &(src, len, shift))| a(src, i as u64 * 8192 + shift.min(8192 - len), len))
                .collect();
            let want = expected(&p.src_bytes, REGION_BYTES, &batch);
            for transport in both() {
                dst.write(0, &vec![0u8; REGION_BYTES]).expect("clear the destination");
                let stats = p.b.read_via(transport, &p.remote, &dst, &batch).expect("read");
                prop_assert_eq!(stats.transport, transport);
                prop_assert_eq!(stats.bytes, batch.iter().map(|x| x.len).sum::<u64>());
                prop_assert!(contents(&dst) == want, "{:?} delivered wrong bytes", transport);
            }
            Ok(())
        })
        .expect("every batch lands exactly");
}

#[test]
fn whole_region_in_scattered_blocks_crosses_chunks_and_streams() {
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register");
    // 16 KiB blocks, destination reversed: coalesced into 1 MiB requests on the wire.
    let block = 16 * 1024u64;
    let n = REGION_BYTES as u64 / block;
    let batch: Vec<_> = (0..n).map(|i| a(i * block, (n - 1 - i) * block, block)).collect();
    let want = expected(&p.src_bytes, REGION_BYTES, &batch);
    for transport in both() {
        dst.write(0, &vec![0u8; REGION_BYTES]).expect("clear");
        p.b.read_via(transport, &p.remote, &dst, &batch).expect("read");
        assert!(contents(&dst) == want, "{transport} delivered wrong bytes");
    }
}

#[test]
fn large_batches_copy_exact_bytes_with_streaming_stores() {
    // Past 8 MiB a shm batch is copied with cache-bypassing stores: odd lengths and
    // unaligned source and destination offsets must still land byte for byte.
    const BIG: usize = 12 << 20;
    let (owner, reader) = (engine(), engine());
    let src = owner.register(BIG).expect("register the source");
    let src_bytes = pattern(BIG, 3);
    src.write(0, &src_bytes).expect("fill the source");
    let remote = owner.describe(&src);
    let dst = reader.register(BIG).expect("register the destination");
    let piece = (BIG / 4 - 7) as u64;
    let batch: Vec<_> = (0..4u64).map(|i| a(i * piece + 3, (3 - i) * piece + 1 + i, piece - i)).collect();
    let want = expected(&src_bytes, BIG, &batch);
    let stats = reader.read_via(Transport::Shm, &remote, &dst, &batch).expect("read");
    assert!(stats.bytes >= 8 << 20, "the batch is big enough to stream");
    assert!(contents(&dst) == want, "streamed shm copy delivered wrong bytes");
}

#[test]
fn many_small_assignments() {
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register");
    // 10,000 assignments of 1..=100 bytes, sources scattered, destinations packed.
    let mut batch = Vec::new();
    let (mut dst_at, mut x) = (0u64, 12345u64);
    for i in 0..10_000u64 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let len = 1 + i % 100;
        let src = (x >> 33) % (REGION_BYTES as u64 - len);
        batch.push(a(src, dst_at, len));
        dst_at += len;
    }
    let want = expected(&p.src_bytes, REGION_BYTES, &batch);
    for transport in both() {
        dst.write(0, &vec![0u8; REGION_BYTES]).expect("clear");
        let stats = p.b.read_via(transport, &p.remote, &dst, &batch).expect("read");
        assert_eq!(stats.bytes, dst_at);
        assert!(contents(&dst) == want, "{transport} delivered wrong bytes");
    }
}

#[test]
fn zero_length_batches_succeed_and_move_nothing() {
    let p = pair();
    let dst = p.b.register(4096).expect("register");
    dst.write(0, &[9u8; 4096]).expect("fill");
    for transport in both() {
        for batch in [vec![], vec![a(0, 0, 0), a(REGION_BYTES as u64, 4096, 0)]] {
            let stats = p.b.read_via(transport, &p.remote, &dst, &batch).expect("an empty batch succeeds");
            assert_eq!((stats.bytes, stats.transport), (0, transport));
        }
    }
    assert_eq!(contents(&dst), vec![9u8; 4096]);
}

#[test]
fn out_of_bounds_batches_name_the_region_and_offsets() {
    let p = pair();
    let dst = p.b.register(4096).expect("register");
    let len = REGION_BYTES as u64;
    for transport in both() {
        let e = p.b.read_via(transport, &p.remote, &dst, &[a(len - 10, 0, 20)]).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, TransferError::OutOfBounds { side: "remote", .. }), "{msg}");
        assert!(msg.contains(&format!("remote region {}", p.remote.region)), "{msg}");
        assert!(msg.contains(&format!("offset {}", len - 10)) && msg.contains("out of bounds"), "{msg}");

        let e = p.b.read_via(transport, &p.remote, &dst, &[a(0, 4000, 200)]).unwrap_err().to_string();
        assert!(e.contains(&format!("local region {}", dst.id())) && e.contains("offset 4000"), "{e}");

        let e = p.b.read_via(transport, &p.remote, &dst, &[a(0, u64::MAX, 2)]).unwrap_err().to_string();
        assert!(e.contains("out of bounds"), "{e}");

        let e = p.b.read_via(transport, &p.remote, &dst, &[a(0, 0, 100), a(500, 50, 100)]).unwrap_err().to_string();
        assert!(e.contains("overlapping") && e.contains("[0, 100)") && e.contains("[50, 150)"), "{e}");
    }
}

#[test]
fn a_lying_descriptor_is_refused_by_the_owner() {
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register");
    // The descriptor claims twice the real size: the client cannot know, the owner can.
    let mut big = p.remote.clone();
    big.len = 2 * REGION_BYTES as u64;
    let e = p.b.read_via(Transport::Tcp, &big, &dst, &[a(REGION_BYTES as u64, 0, 16)]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, TransferError::Refused { status: RemoteStatus::OutOfBounds, .. }), "{msg}");
    assert!(msg.contains("out of bounds") && msg.contains(&format!("region {}", p.remote.region)), "{msg}");
    let e = p.b.read_via(Transport::Shm, &big, &dst, &[a(0, 0, 16)]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, TransferError::ShmMap { .. }), "{msg}");
    assert!(msg.contains("descriptor says"), "{msg}");
}

#[test]
fn unknown_regions_give_clear_errors() {
    let p = pair();
    let dst = p.b.register(4096).expect("register");
    let mut ghost = p.remote.clone();
    ghost.region ^= 0x5555;
    let e = p.b.read_via(Transport::Tcp, &ghost, &dst, &[a(0, 0, 16)]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, TransferError::UnknownRegion { .. }), "{msg}");
    assert!(msg.contains("unknown region") && msg.contains(&ghost.region.to_string()), "{msg}");
    // Over shm the descriptor's fd is the real region's: opening it must not be trusted.
    let e = p.b.read_via(Transport::Shm, &ghost, &dst, &[a(0, 0, 16)]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, TransferError::ShmMap { .. }), "{msg}");
    assert!(msg.contains(&format!("rather than region {}", ghost.region)), "{msg}");
    // A descriptor number that is not open in the owner at all.
    let mut bad_fd = p.remote.clone();
    bad_fd.fd = 999_999;
    let msg = p.b.read_via(Transport::Shm, &bad_fd, &dst, &[a(0, 0, 16)]).unwrap_err().to_string();
    assert!(msg.contains("cannot open /proc/") && msg.contains("/fd/999999"), "{msg}");
}

#[test]
fn unregistered_region_is_no_longer_served_but_existing_mappings_stay_valid() {
    let p = pair();
    let dst = p.b.register(4096).expect("register");
    // B maps the region over shm (cached), then the owner unregisters it.
    p.b.read_via(Transport::Shm, &p.remote, &dst, &[a(0, 0, 16)]).expect("first shm read");
    p.a.unregister(&p.src);
    let msg = p.b.read_via(Transport::Tcp, &p.remote, &dst, &[a(0, 0, 16)]).unwrap_err().to_string();
    assert!(msg.contains("unknown region"), "{msg}");
    p.src.write(100, b"still mapped").expect("the owner still holds its region");
    p.b.read_via(Transport::Shm, &p.remote, &dst, &[a(100, 0, 12)]).expect("the cached mapping stays valid");
    let mut got = [0u8; 12];
    dst.read(0, &mut got).expect("read back");
    assert_eq!(&got, b"still mapped");
}

#[test]
fn auto_picks_shm_on_this_host_and_tcp_elsewhere() {
    let p = pair();
    let dst = p.b.register(4096).expect("register");
    let stats = p.b.read(&p.remote, &dst, &[a(0, 0, 4096)]).expect("auto read");
    assert_eq!(stats.transport, Transport::Shm);
    let mut elsewhere = p.remote.clone();
    elsewhere.endpoint.host_key = "another-boot/another-host".into();
    let stats = p.b.read(&elsewhere, &dst, &[a(0, 0, 4096)]).expect("auto read from another host");
    assert_eq!(stats.transport, Transport::Tcp);
    assert_eq!(contents(&dst), p.src_bytes[..4096]);
    let e = p.b.read_via(Transport::Shm, &elsewhere, &dst, &[a(0, 0, 16)]).unwrap_err().to_string();
    assert!(e.contains("another host"), "{e}");

    let mut config = TransferConfig::new(loopback());
    config.transport = TransportChoice::Tcp;
    let forced = TransferEngine::start(config).expect("start");
    let dst = forced.register(4096).expect("register");
    assert_eq!(forced.read(&p.remote, &dst, &[a(0, 0, 16)]).expect("read").transport, Transport::Tcp);
}

#[test]
fn async_reads_complete_through_the_handle() {
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register");
    let batch = [a(0, 0, REGION_BYTES as u64)];
    let mut pending = p.b.read_via_async(Transport::Tcp, &p.remote, &dst, &batch).expect("start");
    // The completion arrives exactly once, by wait() here.
    let outcome = match pending.try_wait() {
        Some(outcome) => outcome,
        None => pending.wait(),
    };
    assert_eq!(outcome.expect("read").bytes, REGION_BYTES as u64);
    assert!(contents(&dst) == p.src_bytes);
    let mut done = p.b.read_via_async(Transport::Shm, &p.remote, &dst, &batch).expect("start");
    assert!(done.try_wait().is_some_and(|r| r.is_ok()), "an shm batch is done on return");
    assert!(done.try_wait().is_none(), "the outcome is handed out once");
}

/// Reads one response frame from a raw socket: (status code, payload).
fn raw_response(stream: &mut TcpStream) -> std::io::Result<(u16, Vec<u8>)> {
    let mut header = [0u8; 16];
    stream.read_exact(&mut header)?;
    assert_eq!(&header[0..4], b"TSXR", "response magic");
    let status = u16::from_le_bytes([header[4], header[5]]);
    let len = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok((status, payload))
}

fn raw_request(magic: &[u8; 4], version: u16, op: u16, region: u64, offset: u64, len: u64) -> Vec<u8> {
    let mut b = magic.to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&op.to_le_bytes());
    b.extend_from_slice(&region.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

fn raw_connect(p: &Pair) -> TcpStream {
    let s = TcpStream::connect(p.remote.endpoint.tcp).expect("connect to the engine");
    s.set_read_timeout(Some(FAIL_FAST)).expect("timeout");
    s
}

/// A raw connection to `p`'s engine from loopback address `from`: the server sees each
/// 127.0.0.x as a different peer (std cannot bind before connecting; tokio's socket can).
fn raw_connect_from(from: Ipv4Addr, p: &Pair) -> TcpStream {
    let to = p.remote.endpoint.tcp;
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build().expect("a runtime to connect with");
    let s = rt
        .block_on(async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::from((from, 0)))?;
            socket.connect(to).await?.into_std()
        })
        .unwrap_or_else(|e| panic!("connect from {from} to {to}: {e}"));
    s.set_nonblocking(false).expect("blocking");
    s.set_read_timeout(Some(FAIL_FAST)).expect("timeout");
    s
}

/// Asks for `len` bytes at `offset` of `p`'s source region on a raw connection and
/// checks they arrive.
fn assert_raw_read(s: &mut TcpStream, p: &Pair, offset: usize, len: usize) {
    s.write_all(&raw_request(b"TSXF", 1, 1, p.remote.region, offset as u64, len as u64)).expect("send");
    let (status, bytes) = raw_response(s).expect("a reply");
    assert_eq!(status, 0, "{}", String::from_utf8_lossy(&bytes));
    assert!(bytes == p.src_bytes[offset..offset + len], "wrong bytes");
}

/// The peer closed: EOF (or a reset) within the bound, not a hang.
fn assert_closed(stream: &mut TcpStream) {
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "expected a close, got {e}"),
    }
}

fn assert_still_serving(p: &Pair) {
    let dst = p.b.register(4096).expect("register");
    p.b.read_via(Transport::Tcp, &p.remote, &dst, &[a(4096, 0, 4096)]).expect("the engine still serves");
    assert_eq!(contents(&dst), p.src_bytes[4096..8192]);
}

#[test]
fn hostile_raw_clients_get_errors_or_closes_and_others_keep_being_served() {
    let p = pair();
    let region = p.remote.region;

    // Garbage: an error naming the bad magic, then a close.
    let mut s = raw_connect(&p);
    s.write_all(&[0xab; 32]).expect("send garbage");
    let (status, text) = raw_response(&mut s).expect("an error reply");
    let text = String::from_utf8_lossy(&text);
    assert!(status != 0 && text.contains("bad magic"), "{status}: {text}");
    assert_closed(&mut s);

    // Wrong version: an error, then a close.
    let mut s = raw_connect(&p);
    s.write_all(&raw_request(b"TSXF", 99, 1, region, 0, 16)).expect("send");
    let (_, text) = raw_response(&mut s).expect("an error reply");
    assert!(String::from_utf8_lossy(&text).contains("unsupported protocol version 99"));
    assert_closed(&mut s);

    // Oversized, unknown-region and out-of-bounds requests are refused, and the same
    // connection then serves a good request.
    let mut s = raw_connect(&p);
    s.write_all(&raw_request(b"TSXF", 1, 1, region, 0, 1 << 40)).expect("send");
    let (status, text) = raw_response(&mut s).expect("a reply");
    assert!(status != 0 && String::from_utf8_lossy(&text).contains("exceeds"), "{}", String::from_utf8_lossy(&text));
    s.write_all(&raw_request(b"TSXF", 1, 1, region ^ 1, 0, 16)).expect("send");
    let (_, text) = raw_response(&mut s).expect("a reply");
    assert!(String::from_utf8_lossy(&text).contains("unknown region"));
    s.write_all(&raw_request(b"TSXF", 1, 1, region, u64::MAX - 4, 16)).expect("send");
    let (_, text) = raw_response(&mut s).expect("a reply");
    assert!(String::from_utf8_lossy(&text).contains("out of bounds"));
    s.write_all(&raw_request(b"TSXF", 1, 1, region, 10, 16)).expect("send");
    let (status, bytes) = raw_response(&mut s).expect("data");
    assert_eq!((status, bytes.as_slice()), (0, &p.src_bytes[10..26]));

    // A truncated header left open: the engine serves others meanwhile.
    let mut stalled = raw_connect(&p);
    stalled.write_all(&raw_request(b"TSXF", 1, 1, region, 0, 16)[..10]).expect("send part of a header");
    assert_still_serving(&p);
    // ... and a truncated header then end of stream: closed without a reply.
    stalled.shutdown(Shutdown::Write).expect("half-close");
    assert_closed(&mut stalled);

    // A client that asks and never reads does not block the others either.
    let mut greedy = raw_connect(&p);
    for _ in 0..8 {
        greedy.write_all(&raw_request(b"TSXF", 1, 1, region, 0, REGION_BYTES as u64)).expect("send");
    }
    assert_still_serving(&p);
}

/// `RemoteStatus::TooManyConnections` on the wire.
const TOO_MANY_CONNECTIONS: u16 = 6;

#[test]
fn a_peer_past_its_connection_cap_is_refused_and_other_peers_are_served() {
    let mut config = TransferConfig::new(loopback());
    (config.tcp_streams, config.max_connections_per_peer) = (2, 3);
    let p = pair_with(config);
    let hostile = Ipv4Addr::new(127, 0, 0, 2);
    let mut within: Vec<TcpStream> = (0..3).map(|_| raw_connect_from(hostile, &p)).collect();
    // One more from the same address: refused at once, without a request, then closed.
    let mut over = raw_connect_from(hostile, &p);
    let (status, text) = raw_response(&mut over).expect("a refusal");
    let text = String::from_utf8_lossy(&text);
    assert_eq!(status, TOO_MANY_CONNECTIONS, "{text}");
    assert!(text.contains("at most 3 connections per peer address"), "{text}");
    assert_closed(&mut over);
    for s in &mut within {
        assert_raw_read(s, &p, 100, 64);
    }
    // Engine B (from 127.0.0.1) is another peer: served as usual.
    let dst = p.b.register(REGION_BYTES).expect("register");
    p.b.read_via(Transport::Tcp, &p.remote, &dst, &[a(0, 0, REGION_BYTES as u64)]).expect("another peer is served");
    assert!(contents(&dst) == p.src_bytes);
}

#[test]
fn idle_connections_filling_the_server_are_closed_to_make_room_for_a_new_peer() {
    let mut config = TransferConfig::new(loopback());
    (config.tcp_streams, config.max_connections, config.max_connections_per_peer) = (2, 4, 2);
    // Only shedding, not the first-request timeout, may free a place during the test.
    config.first_request_timeout = Duration::from_secs(600);
    let p = pair_with(config);
    // Two peers fill the server with connections that never ask for anything.
    let mut idle: Vec<TcpStream> = [2, 2, 3, 3].map(|x| raw_connect_from(Ipv4Addr::new(127, 0, 0, x), &p)).into();
    // B reads over two streams: two new connections, each closing the one idle longest.
    let mut config = TransferConfig::new(loopback());
    (config.tcp_streams, config.chunk_bytes) = (2, 64 * 1024);
    let b = TransferEngine::start(config).expect("start");
    let dst = b.register(REGION_BYTES).expect("register");
    b.read_via(Transport::Tcp, &p.remote, &dst, &[a(0, 0, REGION_BYTES as u64)]).expect("a new peer is served");
    assert!(contents(&dst) == p.src_bytes);
    assert_closed(&mut idle[0]);
    assert_closed(&mut idle[1]);
    // The younger idle ones were kept.
    assert_raw_read(&mut idle[2], &p, 0, 32);
    assert_raw_read(&mut idle[3], &p, 32, 32);
}

#[test]
fn a_connection_that_never_asks_is_closed_after_the_first_request_timeout() {
    let mut config = TransferConfig::new(loopback());
    config.first_request_timeout = Duration::from_millis(200);
    let p = pair_with(config);
    let mut asked = raw_connect(&p);
    assert_raw_read(&mut asked, &p, 0, 16);
    let mut silent = raw_connect(&p);
    let started = Instant::now();
    assert_closed(&mut silent);
    let waited = started.elapsed();
    assert!(waited < FAIL_FAST, "closed after {waited:?}");
    // The timeout is for a first request only: the connection that asked, idle since
    // before the silent one came, is still served (idle_timeout is 30 s).
    assert_raw_read(&mut asked, &p, 16, 16);
}

#[test]
fn refusals_say_nothing_about_other_regions() {
    let p = pair();
    let others: Vec<Region> = (0..3).map(|_| p.a.register(3 * 4096).expect("register")).collect();
    let mut s = raw_connect(&p);
    // Unknown region: the id asked for, and nothing else that counts or sizes regions.
    let ghost = p.remote.region ^ 0x5555;
    s.write_all(&raw_request(b"TSXF", 1, 1, ghost, 0, 16)).expect("send");
    let (status, text) = raw_response(&mut s).expect("a reply");
    let text = String::from_utf8_lossy(&text).into_owned();
    assert_eq!(status, 1, "{text}");
    assert!(text.contains(&format!("unknown region {ghost}")), "{text}");
    let rest = text.replace(&ghost.to_string(), "");
    assert!(!rest.contains(|c: char| c.is_ascii_digit()), "a number besides the id: {text}");
    for other in &others {
        assert!(!text.contains(&other.id().to_string()), "{text}");
    }
    // Out of bounds: the region's real length stays unsaid.
    let len = REGION_BYTES as u64;
    s.write_all(&raw_request(b"TSXF", 1, 1, p.remote.region, len - 8, 16)).expect("send");
    let (status, text) = raw_response(&mut s).expect("a reply");
    let text = String::from_utf8_lossy(&text).into_owned();
    assert_eq!(status, 2, "{text}");
    assert!(text.contains("out of bounds") && text.contains(&format!("offset {}", len - 8)), "{text}");
    let rest = text.replace(&p.remote.region.to_string(), "").replace(&(len - 8).to_string(), "").replace("16", "");
    assert!(!rest.contains(|c: char| c.is_ascii_digit()), "a number besides those asked for: {text}");
    // And the client-side error carries the same text.
    let dst = p.b.register(4096).expect("register");
    let mut desc = p.remote.clone();
    desc.region = ghost;
    let msg = p.b.read_via(Transport::Tcp, &desc, &dst, &[a(0, 0, 16)]).unwrap_err().to_string();
    assert!(msg.contains(&format!("unknown region {ghost}")) && !msg.contains("registered"), "{msg}");
}

#[test]
fn a_vanished_peer_is_unreachable_within_a_bound() {
    let (gone, b) = (engine(), engine());
    let region = gone.register(4096).expect("register");
    let remote = gone.describe(&region);
    let dst = b.register(4096).expect("register");
    // B first holds pooled connections to the peer, then the peer goes away.
    b.read_via(Transport::Tcp, &remote, &dst, &[a(0, 0, 4096)]).expect("read while the peer is up");
    gone.shutdown();
    for _ in 0..2 {
        let started = Instant::now();
        let e = b.read_via(Transport::Tcp, &remote, &dst, &[a(0, 0, 4096)]).unwrap_err();
        assert!(started.elapsed() < FAIL_FAST, "took {:?}", started.elapsed());
        let msg = e.to_string();
        assert!(matches!(e, TransferError::PeerUnreachable { .. }), "{msg}");
        assert!(msg.contains(&remote.endpoint.tcp.to_string()) && msg.contains("unreachable"), "{msg}");
    }
    // A shut-down engine refuses work clearly.
    assert!(matches!(gone.register(16), Err(TransferError::ShutDown)));
}

#[test]
fn engine_and_regions_are_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TransferEngine>();
    send_sync::<Region>();
    send_sync::<TransferError>();
    let p = pair();
    let dst = p.b.register(REGION_BYTES).expect("register");
    // Four threads pull disjoint quarters concurrently through the shared engine.
    let quarter = REGION_BYTES as u64 / 4;
    std::thread::scope(|s| {
        for (i, transport) in [Transport::Tcp, Transport::Shm, Transport::Tcp, Transport::Shm].into_iter().enumerate() {
            let (p, dst) = (&p, &dst);
            s.spawn(move || {
                let at = i as u64 * quarter;
                p.b.read_via(transport, &p.remote, dst, &[a(at, at, quarter)]).expect("concurrent read");
            });
        }
    });
    assert!(contents(&dst) == p.src_bytes);
}

#[test]
fn region_access_is_bounds_checked_and_exclusive() {
    let e = engine();
    assert!(e.register(0).unwrap_err().to_string().contains("must not be empty"));
    let r = e.register(100).expect("register");
    assert_eq!((r.len(), contents(&r)), (100, vec![0u8; 100]), "regions start zeroed");
    let msg = r.write(95, &[1u8; 10]).unwrap_err().to_string();
    assert!(msg.contains(&format!("local region {}", r.id())) && msg.contains("offset 95 + len 10"), "{msg}");
    assert!(r.read(usize::MAX, &mut [0u8; 2]).is_err());
    r.with_mut(10, 5, |b| b.copy_from_slice(b"hello")).expect("in bounds");
    assert_eq!(r.with_ref(10, 5, |b| b.to_vec()).expect("in bounds"), b"hello");
    // A range lent mutably cannot be lent again, read or written, until it is returned.
    let nested = r
        .with_mut(0, 50, |_| (r.with_ref(40, 20, |_| ()).unwrap_err(), r.write(60, b"ok").is_ok()))
        .expect("outer borrow");
    assert!(matches!(nested.0, TransferError::RangeBusy { .. }), "{}", nested.0);
    assert!(nested.0.to_string().contains("in use"));
    assert!(nested.1, "a disjoint range is free");
    // Shared borrows overlap freely.
    r.with_ref(0, 50, |_| r.with_ref(10, 50, |_| ()).expect("shared")).expect("outer");
}

#[test]
fn tcp_requests_counts_coalesced_chunks() {
    let mut config = TransferConfig::new(loopback());
    config.chunk_bytes = 256 << 10;
    let (reader, writer) = (TransferEngine::start(config).expect("reader"), engine());
    let (remote, local) =
        (writer.register(REGION_BYTES).expect("remote"), reader.register(REGION_BYTES).expect("local"));
    let desc = writer.describe(&remote);
    // Four 64 KiB blocks back to back on the writer, scattered locally: one request.
    let block = 64 << 10;
    let scattered: Vec<Assignment> = [3u64, 0, 7, 5]
        .iter()
        .enumerate()
        .map(|(i, &slot)| Assignment { src_offset: i as u64 * block, dst_offset: slot * block, len: block })
        .collect();
    assert_eq!(reader.tcp_requests(&desc, &local, &scattered).expect("plan"), 1);
    // The whole region: cut at chunk_bytes; a gap on the writer splits a request.
    let whole = [Assignment { src_offset: 0, dst_offset: 0, len: REGION_BYTES as u64 }];
    assert_eq!(reader.tcp_requests(&desc, &local, &whole).expect("plan"), 4);
    let gap = [
        Assignment { src_offset: 0, dst_offset: 0, len: 4096 },
        Assignment { src_offset: 8192, dst_offset: 4096, len: 4096 },
    ];
    assert_eq!(reader.tcp_requests(&desc, &local, &gap).expect("plan"), 2);
    // Checked as a read is.
    let past_end = [Assignment { src_offset: REGION_BYTES as u64, dst_offset: 0, len: 1 }];
    assert!(matches!(reader.tcp_requests(&desc, &local, &past_end), Err(TransferError::OutOfBounds { .. })));
}

/// Secured engines (`TransferConfig::security`): both hold listed host keys.
mod secured {
    use super::*;
    use std::collections::HashMap;
    use tessera_runtime::HostId;
    use tessera_runtime::security::{Cipher, HostKeypair, Keyring, Mode, PlaneSecurity};

    fn securities(cipher: Cipher, mode: Mode) -> (PlaneSecurity, PlaneSecurity, PlaneSecurity) {
        let (a, b, stranger) = (HostKeypair::generate(), HostKeypair::generate(), HostKeypair::generate());
        let (a, b, stranger) = (Arc::new(a.expect("a")), Arc::new(b.expect("b")), Arc::new(stranger.expect("s")));
        let hosts = vec![(HostId(0), "a".to_string()), (HostId(1), "b".to_string())];
        let ring =
            Arc::new(Keyring::new(hosts, HashMap::from([(HostId(0), *a.public()), (HostId(1), *b.public())]), None));
        let sec = |identity: &Arc<HostKeypair>| PlaneSecurity {
            mode,
            cipher,
            identity: identity.clone(),
            keyring: ring.clone(),
        };
        (sec(&a), sec(&b), sec(&stranger))
    }

    fn secured_engine(sec: &PlaneSecurity) -> Arc<TransferEngine> {
        let mut config = TransferConfig::new(loopback());
        config.connect_timeout = Duration::from_secs(2);
        config.first_request_timeout = Duration::from_millis(500);
        config.security = Some(sec.clone());
        TransferEngine::start(config).expect("start a secured engine")
    }

    #[test]
    fn secured_tcp_copies_exact_bytes_with_either_cipher_and_mode() {
        for (cipher, mode) in [
            (Cipher::ChaCha20Poly1305, Mode::Encrypt),
            (Cipher::Sm4Gcm, Mode::Encrypt),
            (Cipher::ChaCha20Poly1305, Mode::Authenticate),
        ] {
            let (sa, sb, _) = securities(cipher, mode);
            let (a, b) = (secured_engine(&sa), secured_engine(&sb));
            let src = a.register(REGION_BYTES).expect("register");
            let bytes = pattern(REGION_BYTES, 3);
            src.write(0, &bytes).expect("fill");
            let dst = b.register(REGION_BYTES).expect("register");
            // Blocks crossing record boundaries, and the whole region in one go, under a
            // capability for the whole region.
            let batch =
                vec![a_(0, 0, 300_000), a_(400_001, 300_000, 600_000), a_(REGION_BYTES as u64 - 5, 1_000_000, 5)];
            let mut remote = a.describe(&src);
            remote.capability =
                Some(a.grant(None, &src, std::iter::once(0..REGION_BYTES as u64).collect()).expect("grant"));
            let stats = b.read_via(Transport::Tcp, &remote, &dst, &batch).expect("secured read");
            assert_eq!(stats.bytes, 900_005, "{cipher:?} {mode:?}");
            assert!(contents(&dst) == expected(&bytes, REGION_BYTES, &batch), "{cipher:?} {mode:?}: wrong bytes");
            let whole = [a_(0, 0, REGION_BYTES as u64)];
            b.read_via(Transport::Tcp, &remote, &dst, &whole).expect("whole region");
            assert!(contents(&dst) == bytes, "{cipher:?} {mode:?}");
        }
    }

    fn a_(src: u64, dst: u64, len: u64) -> Assignment {
        Assignment { src_offset: src, dst_offset: dst, len }
    }

    #[test]
    fn an_unlisted_or_plain_reader_gets_nothing_and_a_listed_one_is_served_on() {
        let (sa, sb, stranger) = securities(Cipher::ChaCha20Poly1305, Mode::Encrypt);
        let a = secured_engine(&sa);
        let src = a.register(REGION_BYTES).expect("register");
        let bytes = pattern(REGION_BYTES, 9);
        src.write(0, &bytes).expect("fill");
        let mut remote = a.describe(&src);
        remote.capability = Some(a.grant(None, &src, std::iter::once(0..4096).collect()).expect("grant"));
        let batch = [a_(0, 0, 4096)];

        // A reader whose key is not listed: refused at the handshake, nothing read.
        let intruder = secured_engine(&stranger);
        let dst = intruder.register(4096).expect("register");
        let err = intruder.read_via(Transport::Tcp, &remote, &dst, &batch).expect_err("an unlisted key reads nothing");
        let chain = format!("{err} {:?}", err);
        assert!(chain.contains("authenticating") && chain.contains("refused"), "{chain}");
        assert!(contents(&dst).iter().all(|&b| b == 0), "no byte arrived");
        // A plain engine: its request is not a handshake.
        let plain = engine();
        let dst = plain.register(4096).expect("register");
        assert!(plain.read_via(Transport::Tcp, &remote, &dst, &batch).is_err());
        assert!(contents(&dst).iter().all(|&b| b == 0), "no byte arrived in clear");
        // A raw client sending a well-formed plaintext request gets no region bytes.
        let mut raw = TcpStream::connect(remote.endpoint.tcp).expect("connect");
        raw.set_read_timeout(Some(FAIL_FAST)).expect("timeout");
        let mut request = Vec::new();
        request.extend_from_slice(b"TSXF");
        request.extend_from_slice(&1u16.to_le_bytes());
        request.extend_from_slice(&1u16.to_le_bytes());
        request.extend_from_slice(&remote.region.to_le_bytes());
        request.extend_from_slice(&0u64.to_le_bytes());
        request.extend_from_slice(&4096u64.to_le_bytes());
        let _ = raw.write_all(&request);
        let mut got = Vec::new();
        let _ = raw.read_to_end(&mut got);
        assert!(!got.windows(64).any(|w| w == &bytes[..64]), "region bytes reached a raw client");
        // Random bytes and a ZMTP-like greeting: closed, nothing served.
        for junk in [vec![0xffu8; 64], (0..200u32).map(|i| (i * 7) as u8).collect()] {
            let mut s = TcpStream::connect(remote.endpoint.tcp).expect("connect");
            s.set_read_timeout(Some(FAIL_FAST)).expect("timeout");
            let _ = s.write_all(&junk);
            let mut got = Vec::new();
            let _ = s.read_to_end(&mut got);
            assert!(got.len() < 200, "a junk client got {} bytes", got.len());
        }
        // The listed host is still served, exactly.
        let b = secured_engine(&sb);
        let dst = b.register(4096).expect("register");
        b.read_via(Transport::Tcp, &remote, &dst, &batch).expect("a listed reader is served");
        assert!(contents(&dst) == bytes[..4096]);
    }
}

/// A secured engine serves a read only under a capability covering all of it.
#[test]
fn a_secured_read_without_a_valid_capability_gets_nothing() {
    use std::collections::HashMap;
    use tessera_runtime::HostId;
    use tessera_runtime::security::{Cipher, HostKeypair, Keyring, Mode, PlaneSecurity};
    let (ka, kb) = (Arc::new(HostKeypair::generate().expect("a")), Arc::new(HostKeypair::generate().expect("b")));
    let hosts = vec![(HostId(0), "a".to_string()), (HostId(1), "b".to_string())];
    let inline = HashMap::from([(HostId(0), *ka.public()), (HostId(1), *kb.public())]);
    let ring = Arc::new(Keyring::new(hosts, inline, None));
    let start = |identity: &Arc<HostKeypair>, ttl: Duration| {
        let mut config = TransferConfig::new(loopback());
        config.capability_ttl = ttl;
        let (mode, cipher) = (Mode::Encrypt, Cipher::ChaCha20Poly1305);
        config.security = Some(PlaneSecurity { mode, cipher, identity: identity.clone(), keyring: ring.clone() });
        TransferEngine::start(config).expect("engine")
    };
    let (owner, b) = (start(&ka, Duration::from_secs(60)), start(&kb, Duration::from_secs(60)));
    let src = owner.register(REGION_BYTES).expect("register");
    let other = owner.register(4096).expect("register");
    let bytes = pattern(REGION_BYTES, 5);
    src.write(0, &bytes).expect("fill");
    let dst = b.register(REGION_BYTES).expect("register");
    let offered = owner.grant(None, &src, vec![8192..16384, 65536..69632]).expect("grant");
    let read = |capability: Option<[u8; 16]>, region: &Region, batch: &[Assignment]| {
        dst.write(0, &vec![0u8; REGION_BYTES]).expect("clear");
        let mut remote = owner.describe(region);
        remote.capability = capability;
        let result = b.read_via(Transport::Tcp, &remote, &dst, batch);
        (result, contents(&dst).iter().all(|&x| x == 0))
    };
    let forbidden = |(result, untouched): (Result<_, TransferError>, bool), what: &str| {
        let err = result.expect_err(what);
        assert!(matches!(err, TransferError::Refused { status: RemoteStatus::Forbidden, .. }), "{what}: {err}");
        assert!(untouched, "{what}: bytes arrived");
    };
    forbidden(read(None, &src, &[a(8192, 0, 4096)]), "no capability");
    forbidden(read(Some([9; 16]), &src, &[a(8192, 0, 4096)]), "a made-up capability");
    forbidden(read(Some(offered), &src, &[a(0, 0, 4096)]), "a range not offered");
    forbidden(read(Some(offered), &src, &[a(12288, 0, 8192)]), "a range running past the offer");
    forbidden(read(Some(offered), &other, &[a(0, 0, 4096)]), "another region");
    // What was offered reads exactly.
    let (result, _) = read(Some(offered), &src, &[a(8192, 0, 8192), a(65536, 8192, 4096)]);
    result.expect("the offered ranges");
    assert!(contents(&dst)[..12288] == [&bytes[8192..16384], &bytes[65536..69632]].concat());
    // Revoked; and expired with its lease.
    owner.revoke(&offered);
    forbidden(read(Some(offered), &src, &[a(8192, 0, 4096)]), "a revoked capability");
    let short_lived = start(&ka, Duration::from_millis(1));
    let src_short = short_lived.register(4096).expect("register");
    let brief = short_lived.grant(None, &src_short, std::iter::once(0..4096).collect()).expect("grant");
    std::thread::sleep(Duration::from_millis(20));
    let mut remote = short_lived.describe(&src_short);
    remote.capability = Some(brief);
    let err = b.read_via(Transport::Tcp, &remote, &dst, &[a(0, 0, 4096)]).expect_err("expired");
    assert!(matches!(err, TransferError::Refused { status: RemoteStatus::Forbidden, .. }), "{err}");
}
