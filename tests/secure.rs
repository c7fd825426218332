//! Secured planes end to end (`[security]`): host keys made with `tessera keys gen-host`;
//! clusters with either cipher serve `tessera generate`'s greedy text; a tap on loopback
//! finds the prompt's token ids on the bus of a plain cluster and not on an encrypted
//! one, nor on a pipeline instance's stage link; the host-kill and chip-restart drills
//! lose nothing with encryption on; a cluster beyond loopback without keys is refused,
//! saying how to make them.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::serve_kit::*;
use parking_lot::Mutex;
use serde_json::json;

const HEARTBEAT_TIMEOUT_MS: u64 = 1000;

/// `tessera keys gen-host` for each host into `dir`.
fn make_keys(dir: &Path, hosts: &[&str]) {
    for host in hosts {
        let out = tessera().args(["keys", "gen-host", "--name", host, "--out"]).arg(dir).output().expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "gen-host {host}: {stderr}");
        let public = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(public.len(), 64, "the public key is printed: {public:?}");
        let listed = std::fs::read_to_string(dir.join(format!("{host}.pub"))).expect("the .pub file");
        assert_eq!(listed.trim(), public);
    }
}

fn security(mode: &str, cipher: &str, keys: &Path) -> String {
    format!("[security]\nmode = \"{mode}\"\ncipher = \"{cipher}\"\nkeys_dir = \"{}\"\n", keys.display())
}

/// A prefill chip on host `p` and a decode chip on host `d`, the gateway on `d`: every
/// long prompt crosses the bus to `p`, and its KV comes back over the transfer engine's
/// TCP path (sealed too when the cluster is).
fn pd(cluster_extra: &str) -> Topology {
    let chip = |host: &'static str, role: &str| ChipDef {
        host,
        id: format!("{host}-chip"),
        toml: format!("kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"{role}\"\nthreads = 1\n"),
    };
    let extra = format!("[disagg]\nmin_prompt_tokens = 8\ntransport = \"tcp\"\n\n{cluster_extra}");
    topology_of(&[chip("d", "decode"), chip("p", "prefill")], &extra, "", HEARTBEAT_TIMEOUT_MS)
}

#[test]
fn encrypted_clusters_serve_generates_greedy_text_with_either_cipher() {
    const MAX_TOKENS: usize = 16;
    let prompts = ["The quick brown fox jumps over the lazy dog and keeps running", "Hi"];
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    let keys = tempfile::tempdir().expect("tempdir");
    make_keys(keys.path(), &["d", "p"]);
    for cipher in ["chacha20-poly1305", "sm4-gcm"] {
        let mut cluster = Cluster::up(&pd(&security("encrypt", cipher, keys.path())));
        let gw = cluster.gateway;
        cluster.wait_ready(2);
        for (prompt, want) in prompts.iter().zip(&want) {
            let r = post_json(gw, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, true));
            assert_eq!(r.status, 200, "{cipher}: {}", r.body);
            assert_eq!(r.json()["choices"][0]["text"], want.text, "{cipher}: {prompt:?}");
        }
        let split = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
        assert_eq!(split, 1.0, "{cipher}: the long prompt went through the prefill host");
        let accepted = metric(gw, "tessera_bus_handshakes_total{side=\"accept\",outcome=\"ok\"} ");
        assert!(accepted >= 1.0, "{cipher}: p's link to d was authenticated ({accepted})");
        let kv_tcp = metric(gw, "tessera_transfer_bytes_total{transport=\"tcp\"} ");
        let sealed_links = metric(gw, "tessera_transfer_handshakes_total{outcome=\"ok\"} ");
        assert!(
            kv_tcp > 0.0 && sealed_links >= 1.0,
            "{cipher}: KV came over sealed TCP ({kv_tcp} B, {sealed_links} links)"
        );
        // Broadcasts that beat their publisher's handshake at start are dropped, and only those.
        let metrics = get(gw, "/metrics").body;
        let dropped: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with("tessera_bus_frames_dropped_total") && !l.contains("awaiting_key"))
            .collect();
        assert!(dropped.is_empty(), "{cipher}: frames dropped between listed hosts: {dropped:?}");
        wait_health(gw, "both pools free", std::time::Duration::from_secs(5), |h| drained(h, &[]));
    }
}

#[test]
fn the_host_kill_drill_loses_nothing_with_encryption_on() {
    let keys = tempfile::tempdir().expect("tempdir");
    make_keys(keys.path(), &["h0", "h1"]);
    crate::serve::killed_host_drill(&security("encrypt", "chacha20-poly1305", keys.path()));
}

#[test]
fn the_chip_restart_drill_loses_nothing_with_encryption_on() {
    let keys = tempfile::tempdir().expect("tempdir");
    make_keys(keys.path(), &["h0", "h1"]);
    crate::serve::worker_panic_drill(&security("encrypt", "sm4-gcm", keys.path()));
}

#[test]
fn a_cluster_beyond_loopback_or_missing_its_keys_is_refused_saying_how_to_make_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    // p on another machine and no [security]: encrypted by default, and d's node refuses
    // to start without keys, saying how to make them.
    let mut remote = pd("");
    let p_bus = remote.toml.rfind("bus = \"127.0.0.1:").expect("p's bus");
    remote.toml.replace_range(p_bus..p_bus + "bus = \"127.0.0.1:".len(), "bus = \"10.9.8.7:");
    let mut cluster = Cluster::nodes(&remote, &["d"]);
    let d = cluster.proc("d");
    let status = d.wait_exit(std::time::Duration::from_secs(20)).expect("d refuses to start");
    let log = d.log();
    assert!(!status.success() && log.contains("tessera keys gen-host") && log.contains("10.9.8.7"), "{log}");
    drop(cluster);

    // Keys for d only: p's node refuses to start and names what is missing.
    let keys = dir.path().join("keys");
    make_keys(&keys, &["d"]);
    let topo = pd(&security("encrypt", "chacha20-poly1305", &keys));
    let mut cluster = Cluster::nodes(&topo, &["p"]);
    let p = cluster.proc("p");
    let status = p.wait_exit(std::time::Duration::from_secs(20)).expect("p refuses to start");
    assert!(!status.success());
    let log = p.log();
    assert!(log.contains("p.key") && log.contains("tessera keys gen-host --name p"), "{log}");
}

/// A raw packet tap on `lo`: the TCP payloads to or from `ports`, until dropped.
struct LoopbackTap {
    stop: Arc<AtomicBool>,
    captured: Arc<Mutex<Vec<u8>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

// The one place these tests talk to the kernel directly: a packet socket (libc).
#[allow(unsafe_code)]
impl LoopbackTap {
    /// `None` where this process may not open a packet socket (no CAP_NET_RAW).
    fn start(ports: HashSet<u16>) -> Option<LoopbackTap> {
        const ETH_P_IP: u16 = 0x0800;
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, i32::from(ETH_P_IP.to_be())) };
        if fd < 0 {
            return None;
        }
        // SAFETY: the name is a NUL-terminated literal.
        let ifindex = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = ETH_P_IP.to_be();
        addr.sll_ifindex = ifindex as i32;
        let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
        // SAFETY: `addr` and `timeout` outlive the calls, with their sizes passed.
        let ok = unsafe {
            libc::bind(fd, (&raw const addr).cast(), size_of::<libc::sockaddr_ll>() as u32) == 0
                && libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&raw const timeout).cast(),
                    size_of::<libc::timeval>() as u32,
                ) == 0
        };
        if !ok {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return None;
        }
        let (stop, captured) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let (stop_t, captured_t) = (stop.clone(), captured.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            while !stop_t.load(Ordering::Relaxed) {
                // SAFETY: `buf` is valid for its length; the result is checked.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n <= 0 {
                    continue;
                }
                if let Some(payload) = tcp_payload(&buf[..n as usize], &ports) {
                    captured_t.lock().extend_from_slice(payload);
                }
            }
            // SAFETY: fd is ours and no longer used.
            unsafe { libc::close(fd) };
        });
        Some(LoopbackTap { stop, captured, thread: Some(thread) })
    }

    fn finish(mut self) -> Vec<u8> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        std::mem::take(&mut *self.captured.lock())
    }
}

/// The TCP payload of an IPv4 packet whose source or destination port is in `ports`.
fn tcp_payload<'a>(packet: &'a [u8], ports: &HashSet<u16>) -> Option<&'a [u8]> {
    let ihl = usize::from(packet.first()? & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([*packet.get(2)?, *packet.get(3)?])).min(packet.len());
    if *packet.get(9)? != 6 || total < ihl + 20 {
        return None;
    }
    let tcp = &packet[ihl..total];
    let (src, dst) = (u16::from_be_bytes([tcp[0], tcp[1]]), u16::from_be_bytes([tcp[2], tcp[3]]));
    let offset = usize::from(tcp[12] >> 4) * 4;
    (ports.contains(&src) || ports.contains(&dst)).then(|| tcp.get(offset..)).flatten()
}

/// The ports of every host's bus, events, KV transfer and stage sockets in `toml`.
fn plane_ports(toml: &str) -> HashSet<u16> {
    let spec = tessera_topology::parse(toml, "t.toml").expect("the test topology parses");
    spec.hosts
        .iter()
        .flat_map(|h| [Some(&h.bus), Some(&h.events), Some(&h.transfer), h.stages.as_ref()])
        .flatten()
        .map(|a| a.port)
        .collect()
}

#[test]
fn a_tap_on_loopback_sees_the_prompts_token_ids_in_a_plain_cluster_and_not_in_an_encrypted_one() {
    // Token ids above 255 (MessagePack `uint16`), an unlikely run of them.
    let ids: Vec<u32> = (0..24).map(|i| 300 + (i * 37) % 200).collect();
    let needle = rmp_serde::to_vec(&ids[4..12]).expect("encode")[1..].to_vec();
    let keys = tempfile::tempdir().expect("tempdir");
    make_keys(keys.path(), &["d", "p"]);
    for (mode, expect_in_clear) in [("off", true), ("encrypt", false)] {
        let topo = pd(&security(mode, "chacha20-poly1305", keys.path()));
        let mut cluster = Cluster::up(&topo);
        let gw = cluster.gateway;
        cluster.wait_ready(2);
        let Some(tap) = LoopbackTap::start(plane_ports(&topo.toml)) else {
            eprintln!("SKIPPED: no packet socket here (needs CAP_NET_RAW); the tap test did not run");
            return;
        };
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 4, "ignore_eos": true});
        let r = post_json(gw, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{mode}: {}", r.body);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let captured = tap.finish();
        assert!(captured.len() > 1000, "{mode}: the tap saw the planes' traffic ({} bytes)", captured.len());
        let found = captured.windows(needle.len()).any(|w| w == needle.as_slice());
        assert_eq!(found, expect_in_clear, "{mode}: prompt token ids in clear on the wire: {found}");
        let split = metric(gw, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
        assert_eq!(split, 1.0, "{mode}: the prompt went to the prefill host");
    }
}

/// `tessera` with the at-rest key file in its environment.
fn sealed_cli(key: &Path) -> std::process::Command {
    let mut cmd = tessera();
    cmd.env("TESSERA_AT_REST_KEY_FILE", key);
    cmd
}

#[test]
fn the_keys_file_and_audit_log_are_sealed_at_rest_and_read_only_with_the_key() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let (key, keys, audit) =
        (dir.path().join("at-rest.key"), dir.path().join("keys.json"), dir.path().join("audit.log"));
    let out = tessera().args(["keys", "gen-at-rest", "--out"]).arg(&key).output().expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::metadata(&key).expect("key").permissions().mode() & 0o777, 0o600);
    let again = tessera().args(["keys", "gen-at-rest", "--out"]).arg(&key).output().expect("run");
    assert!(!again.status.success(), "an at-rest key is never replaced");

    let out = sealed_cli(&key)
        .args(["keys", "add", "--tenant", "default", "--name", "pager-team", "--role", "admin", "--file"])
        .arg(&keys)
        .output()
        .expect("run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let api_key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // Nothing readable on disk: the file is sealed, each audit line too.
    let raw = std::fs::read(&keys).expect("keys file");
    assert!(raw.starts_with(b"TESSERA-SEALED-1\n"), "the keys file is sealed");
    assert!(!raw.windows(10).any(|w| w == b"pager-team"), "a key's name in clear");
    let log = std::fs::read_to_string(&audit).expect("audit log");
    assert!(log.lines().all(|l| l.starts_with("sealed:")) && !log.contains("pager-team"), "{log}");
    // With the key: listed and verified; without: refused, saying which variable to set.
    let list = sealed_cli(&key).args(["keys", "list", "--file"]).arg(&keys).output().expect("run");
    assert!(String::from_utf8_lossy(&list.stdout).contains("pager-team"));
    let verify = sealed_cli(&key).args(["audit", "verify"]).arg(&audit).output().expect("run");
    assert!(verify.status.success(), "{}", String::from_utf8_lossy(&verify.stderr));
    for args in [vec!["keys", "list", "--file"], vec!["audit", "verify"]] {
        let path = if args[0] == "keys" { &keys } else { &audit };
        let out = tessera().args(&args).arg(path).output().expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("TESSERA_AT_REST_KEY"), "{args:?}: {stderr}");
    }
    // An edited sealed line is named.
    let mut lines: Vec<String> = log.lines().map(str::to_owned).collect();
    let mid = lines[0].len() / 2;
    let flipped = if &lines[0][mid..=mid] == "0" { "1" } else { "0" };
    lines[0].replace_range(mid..=mid, flipped);
    std::fs::write(&audit, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).expect("write");
    let verify = sealed_cli(&key).args(["audit", "verify"]).arg(&audit).output().expect("run");
    let stderr = String::from_utf8_lossy(&verify.stderr);
    assert!(!verify.status.success() && stderr.contains(":1:") && stderr.contains("does not open"), "{stderr}");

    // A gateway with the key in its topology reads the sealed keys file and seals its log.
    let served_audit = dir.path().join("served-audit.log");
    let gateway = format!("keys_file = \"{}\"\naudit_log = \"{}\"\n", keys.display(), served_audit.display());
    let chip = ChipDef {
        host: "h0",
        id: "h0-cpu0".into(),
        toml: "kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1\n".into(),
    };
    let extra = format!("[security]\nat_rest_key_file = \"{}\"\n", key.display());
    let topo = topology_of(&[chip], &extra, &gateway, HEARTBEAT_TIMEOUT_MS);
    let mut cluster = Cluster::up(&topo);
    let gw = cluster.gateway;
    cluster.wait_ready(1);
    let body = completion_body("Hi", 2, false, false).to_string();
    assert_eq!(request_as(gw, "POST", "/v1/completions", Some(&body), Some(&api_key)).status, 200);
    assert_eq!(request_as(gw, "POST", "/v1/completions", Some(&body), Some("tsk-wrong")).status, 401);
    let served = std::fs::read_to_string(&served_audit).expect("the gateway's audit log");
    assert!(!served.is_empty() && served.lines().all(|l| l.starts_with("sealed:")), "{served}");
}

/// An instance of two pipeline stages, its second on h1's stage server: the link
/// carries each chunk's token ids in its frame headers (JSON) and the activations. On a
/// plain cluster a tap on the stage port finds the prompt's ids; with encryption on it
/// does not, the instance serves the same text, and a stage client that skips the
/// handshake is refused by the stage server.
#[test]
fn stage_links_are_sealed_on_an_encrypted_cluster() {
    let ids: Vec<u32> = (0..24).map(|i| 300 + (i * 37) % 200).collect();
    let needle = ids[4..12].iter().map(u32::to_string).collect::<Vec<_>>().join(",").into_bytes();
    let keys = tempfile::tempdir().expect("tempdir");
    make_keys(keys.path(), &["h0", "h1"]);
    let cpu = "kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1".to_string();
    let chips = [
        ChipDef { host: "h0", id: "h0-a".into(), toml: cpu.clone() },
        ChipDef { host: "h1", id: "h1-b".into(), toml: cpu },
    ];
    let instance = "[[instances]]\nid = \"h0-pp\"\nchips = [\"h0-a\", \"h1-b\"]\nsplit = [1, 3]\n";
    let mut texts = Vec::new();
    for (mode, expect_in_clear) in [("off", true), ("encrypt", false)] {
        let extra = format!("{instance}\n{}", security(mode, "chacha20-poly1305", keys.path()));
        let topo = topology_of(&chips, &extra, "", HEARTBEAT_TIMEOUT_MS);
        let spec = tessera_topology::parse(&topo.toml, "t.toml").expect("the test topology parses");
        let stages = spec.hosts[1].stages.clone().expect("h1 serves a stage");
        let mut cluster = Cluster::nodes(&topo, &["h0", "h1"]);
        let gw = cluster.gateway;
        cluster.wait_ready(1);
        let tap = LoopbackTap::start(HashSet::from([stages.port]));
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
        let r = post_json(gw, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{mode}: {}", r.body);
        texts.push(r.json()["choices"][0]["text"].clone());
        match tap {
            None => eprintln!("SKIPPED the tap on the stage link: no packet socket here (needs CAP_NET_RAW)"),
            Some(tap) => {
                std::thread::sleep(std::time::Duration::from_millis(300));
                let captured = tap.finish();
                assert!(captured.len() > 1000, "{mode}: the tap saw the stage link ({} bytes)", captured.len());
                let found = captured.windows(needle.len()).any(|w| w == needle.as_slice());
                assert_eq!(found, expect_in_clear, "{mode}: the prompt's token ids in clear on the stage link");
            }
        }
        if mode == "encrypt" {
            // A client in clear: the server wants a handshake, so no stage is loaded.
            let addr = stages.resolve().expect("loopback");
            let plain = tessera_backends::stage_link::StageClient::connect(
                addr,
                "h0-pp",
                1,
                1..4,
                std::time::Duration::from_secs(5),
                None,
            );
            assert!(plain.is_err(), "a stage client in clear loaded a stage of an encrypted cluster");
        }
    }
    assert_eq!(texts[0], texts[1], "the sealed link changed the text");
}
