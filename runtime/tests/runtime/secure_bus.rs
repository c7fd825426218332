//! The secured bus (`security/`, `bus/secure.rs`) between real sockets on loopback: both
//! ciphers carry direct messages and broadcasts through key rotations; an unlisted host
//! cannot join; captured frames replayed on a new connection, plaintext and junk are
//! dropped and counted; a host restarted with a new listed key rejoins.

use std::collections::HashMap;
use std::path::Path;

use parking_lot::Mutex;
use tessera_runtime::bus::BusStats;
use tessera_runtime::security::{Cipher, HostKeypair, Keyring, Mode, PlaneSecurity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// Every host's keys listed in `dir` (`h<id>.pub`); returns each host's settings.
fn secured_cluster(dir: &Path, n: u16, cipher: Cipher) -> Vec<PlaneSecurity> {
    let hosts: Vec<_> = (0..n).map(|i| (HostId(i), format!("h{i}"))).collect();
    let pairs: Vec<_> = (0..n)
        .map(|i| {
            let pair = HostKeypair::generate().expect("keypair");
            pair.write(dir, &format!("h{i}")).expect("key written");
            Arc::new(pair)
        })
        .collect();
    let ring = Arc::new(Keyring::new(hosts, HashMap::new(), Some(dir.to_path_buf())));
    pairs
        .into_iter()
        .map(|identity| PlaneSecurity { mode: Mode::Encrypt, cipher, identity, keyring: ring.clone() })
        .collect()
}

fn secured(mut c: BusConfig, sec: &PlaneSecurity) -> BusConfig {
    c.security = Some(sec.clone());
    c.rekey_after_frames = 8;
    c
}

async fn wait_for(bus: &Bus, what: &str, ok: impl Fn(&BusStats) -> bool) {
    let deadline = Instant::now() + WAIT;
    while !ok(&bus.stats()) {
        assert!(Instant::now() < deadline, "{what}: {:?}", bus.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes from `from` until a broadcast reaches `rx`.
async fn publish_until_received(from: &Bus, host: HostId, rx: &mut mpsc::UnboundedReceiver<Envelope>) {
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no broadcast from {host} arrived");
        from.publish(Envelope::broadcast(Addr::new(host, 1), "heartbeat", "Beat", vec![7])).expect("publish");
        if let Ok(Some(env)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await
            && env.topic.as_deref() == Some("heartbeat")
        {
            assert_eq!(env.payload, vec![7]);
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ciphers_carry_direct_messages_and_broadcasts_through_key_rotations() {
    for cipher in [Cipher::ChaCha20Poly1305, Cipher::Sm4Gcm] {
        let dir = tempfile::tempdir().expect("tempdir");
        let secs = secured_cluster(dir.path(), 2, cipher);
        let (pa, pb) = (ports(), ports());
        let (ia, mut ra) = collector();
        let (ib, mut rb) = collector();
        let a = start(secured(config(A, pa, B, pb, 256), &secs[0]), ia).await;
        let b = start(secured(config(B, pb, A, pa, 256), &secs[1]), ib).await;
        send_until_received(&a, A, B, 0, &mut rb).await;
        send_until_received(&b, B, A, 0, &mut ra).await;

        // 100 frames at 8 a key: a dozen rotations of the link's key, nothing lost, in order.
        for corr in 1000..1100 {
            a.send(direct(A, B, corr)).expect("send");
        }
        let mut got = Vec::new();
        while got.len() < 100 {
            let env = recv(&mut rb).await;
            if env.corr >= 1000 {
                got.push(env.corr);
            }
        }
        assert_eq!(got, (1000..1100).collect::<Vec<_>>(), "{cipher:?}");
        // Broadcasts both ways, then enough of them to rotate the broadcast key several times.
        publish_until_received(&a, A, &mut rb).await;
        publish_until_received(&b, B, &mut ra).await;
        for i in 0..40u8 {
            a.publish(Envelope::broadcast(Addr::new(A, 1), "kv", "KvEvent", vec![i])).expect("publish");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let deadline = Instant::now() + WAIT;
        let mut last = None;
        while last != Some(39) {
            assert!(Instant::now() < deadline, "{cipher:?}: broadcasts stopped at {last:?}: {:?}", b.stats());
            if let Ok(Some(env)) = tokio::time::timeout(Duration::from_millis(50), rb.recv()).await
                && env.topic.as_deref() == Some("kv")
            {
                last = env.payload.first().copied();
            }
        }
        for bus in [&a, &b] {
            let s = bus.stats();
            assert!(s.handshakes >= 2 && s.refused == 0 && s.dropped == 0, "{cipher:?}: {s:?}");
        }
        a.shutdown().await;
        b.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_host_cannot_join_and_the_cluster_serves_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secs = secured_cluster(dir.path(), 2, Cipher::ChaCha20Poly1305);
    let (pa, pb, pc) = (ports(), ports(), ports());
    let (ia, mut ra) = collector();
    let (ib, mut rb) = collector();
    let a = start(secured(config(A, pa, B, pb, 64), &secs[0]), ia).await;
    let b = start(secured(config(B, pb, A, pa, 64), &secs[1]), ib).await;
    send_until_received(&a, A, B, 0, &mut rb).await;

    // An impostor claiming to be B, with a key of its own that nobody listed.
    let impostor = PlaneSecurity { identity: Arc::new(HostKeypair::generate().expect("key")), ..secs[1].clone() };
    let (ic, mut rc) = collector();
    let c = start(secured(config(B, pc, A, pa, 64), &impostor), ic).await;
    wait_for(&a, "A never refused the impostor", |s| s.refused >= 1).await;
    wait_for(&c, "the impostor was not told", |s| s.refused >= 1).await;
    for corr in 0..20 {
        let _ = c.send(direct(B, A, 50_000 + corr));
    }
    // A serves B on, and nothing of the impostor's arrives.
    send_until_received(&b, B, A, 0, &mut ra).await;
    send_until_received(&a, A, B, 100, &mut rb).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    while let Ok(env) = ra.try_recv() {
        assert!(env.corr < 50_000, "a frame from the unlisted host was delivered");
    }
    assert!(rc.try_recv().is_err(), "A's traffic reached the impostor");
    c.shutdown().await;
    a.shutdown().await;
    b.shutdown().await;
}

/// A TCP relay that records what the client sends: a wiretap on one link.
async fn recording_relay(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.expect("relay binds");
    let addr = listener.local_addr().expect("relay address");
    let tape = Arc::new(Mutex::new(Vec::new()));
    let record = tape.clone();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut client, _)) = listener.accept().await {
            let Ok(mut server) = TcpStream::connect(to).await else { continue };
            let tape = first.then(|| record.clone());
            first = false;
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.split();
                let (mut sr, mut sw) = server.split();
                let up = async {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = cr.read(&mut buf).await {
                        if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        if let Some(tape) = &tape {
                            tape.lock().extend_from_slice(&buf[..n]);
                        }
                    }
                };
                let down = tokio::io::copy(&mut sr, &mut cw);
                let _ = tokio::join!(up, down);
            });
        }
    });
    (addr, tape)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_frames_replayed_plaintext_and_junk_are_dropped_and_counted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secs = secured_cluster(dir.path(), 2, Cipher::Sm4Gcm);
    let (pa, pb) = (ports(), ports());
    let (relay, tape) = recording_relay(pb.direct).await;
    let (ia, _ra) = collector();
    let (ib, mut rb) = collector();
    // A reaches B's ROUTER through the tap.
    let mut ca = secured(config(A, pa, B, pb, 64), &secs[0]);
    ca.peers[0].direct = relay.into();
    let a = start(ca, ia).await;
    let b = start(secured(config(B, pb, A, pa, 64), &secs[1]), ib).await;
    send_until_received(&a, A, B, 0, &mut rb).await;
    for corr in 100..110 {
        a.send(direct(A, B, corr)).expect("send");
    }
    let mut seen = Vec::new();
    while seen.len() < 10 {
        let env = recv(&mut rb).await;
        if env.corr >= 100 {
            seen.push(env.corr);
        }
    }
    let captured = tape.lock().clone();
    let dropped_before = b.stats().dropped;

    // The whole captured conversation, replayed byte for byte on a new connection.
    let mut replay = TcpStream::connect(pb.direct).await.expect("connect");
    replay.write_all(&captured).await.expect("replay");
    // Plaintext and junk frames on an authenticated-looking DEALER connection.
    let mut raw = DealerSocket::new();
    tokio::time::timeout(WAIT, raw.connect(&format!("tcp://{}", pb.direct))).await.expect("connect").expect("connect");
    let plain = tessera_runtime::codec::encode(&direct(A, B, 7_000)).expect("encode");
    for frame in [plain, b"T\x10\x02 junk that looks sealed but is not at all".to_vec(), vec![0xff; 40]] {
        raw.send(ZmqMessage::from(frame)).await.expect("raw send");
    }
    wait_for(&b, "replayed, plaintext and junk frames not counted", |s| s.dropped >= dropped_before + 3 + 10).await;

    // Nothing was delivered twice or from the raw socket, and A still reaches B.
    send_until_received(&a, A, B, 10_000, &mut rb).await;
    while let Ok(env) = rb.try_recv() {
        assert!(env.corr >= 10_000, "corr {} delivered again or from a raw socket", env.corr);
    }
    drop((replay, raw));
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_connections_at_secured_ports_leave_the_host_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secs = secured_cluster(dir.path(), 2, Cipher::ChaCha20Poly1305);
    let (pa, pb) = (ports(), ports());
    let (ia, mut ra) = collector();
    let (ib, mut rb) = collector();
    let fast =
        |c: BusConfig, s: &PlaneSecurity| BusConfig { handshake_timeout: Duration::from_millis(500), ..secured(c, s) };
    let a = start(fast(config(A, pa, B, pb, 64), &secs[0]), ia).await;
    let b = start(fast(config(B, pb, A, pa, 64), &secs[1]), ib).await;
    send_until_received(&a, A, B, 0, &mut rb).await;
    for (port, peer_type) in [(a.direct_addr(), "DEALER"), (a.events_addr(), "SUB")] {
        for stage in [hostile::Stage::Silent, hostile::Stage::HugeMessage] {
            hostile::play(port, peer_type, stage).await;
        }
        // Random bytes instead of a greeting.
        let mut conn = TcpStream::connect(port).await.expect("connect");
        let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let _ = conn.write_all(&noise).await;
        drop(conn);
    }
    send_until_received(&b, B, A, 1_000, &mut ra).await;
    send_until_received(&a, A, B, 1_000, &mut rb).await;
    publish_until_received(&a, A, &mut rb).await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_restarted_with_a_new_listed_key_rejoins_without_restarting_the_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secs = secured_cluster(dir.path(), 2, Cipher::ChaCha20Poly1305);
    let (pa, pb) = (ports(), ports());
    let (ia, mut ra) = collector();
    let (ib, _rb) = collector();
    let a = start(secured(config(A, pa, B, pb, 64), &secs[0]), ia).await;
    let b = start(secured(config(B, pb, A, pa, 64), &secs[1]), ib).await;
    send_until_received(&b, B, A, 0, &mut ra).await;
    b.shutdown().await;

    // B's operator makes a new key and lists it (replaces h1.pub), then restarts B.
    std::fs::remove_file(dir.path().join("h1.key")).expect("old key removed");
    let fresh = HostKeypair::generate().expect("keypair");
    fresh.write(dir.path(), "h1").expect("new key listed");
    let b2_sec = PlaneSecurity { identity: Arc::new(fresh), ..secs[1].clone() };
    let (ib2, mut rb2) = collector();
    let b2 = start(secured(config(B, pb, A, pa, 64), &b2_sec), ib2).await;
    send_until_received(&b2, B, A, 100, &mut ra).await;
    send_until_received(&a, A, B, 100, &mut rb2).await;
    publish_until_received(&b2, B, &mut ra).await;
    publish_until_received(&a, A, &mut rb2).await;
    a.shutdown().await;
    b2.shutdown().await;
}
