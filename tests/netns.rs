//! Hosts on distinct network stacks: three Linux network namespaces joined by a bridge
//! (made by the test, removed after), one `tessera node` in each, every host named by a
//! DNS name that only its namespace's hosts file knows (`ip netns exec` mounts
//! `/etc/netns/NS/hosts` over `/etc/hosts`). The KV cache crosses namespaces over the
//! tcp transport. Drills: a host's link cut and restored mid-stream, a host SIGKILLed
//! mid-stream, and 5 ms added to every byte between hosts, each way (the netem qdisc
//! on every host's link; where the kernel has none, `tessera bench relay` in front of
//! every host, with nftables sending each host's traffic for a peer through the peer's
//! relay); no request is lost and every answer is `tessera generate`'s.
//!
//! Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; where
//! either is missing the test says so and checks nothing else. The latency drill needs
//! netem or nftables (`nft`), and says so where it has neither. Every wait has a deadline.

use crate::serve_kit::*;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const HEARTBEAT_TIMEOUT_MS: u64 = 1000;
const MAX_TOKENS: usize = 400;
const HOSTS: [&str; 3] = ["a", "b", "c"];
/// Every host's probe endpoint (`--probe-listen`), as Kubernetes probes reach it.
const PROBE_PORT: u16 = 9000;
/// Each host's bus, events and KV transfer ports (the defaults next to `bus`).
const HOST_PORTS: [u16; 3] = [7400, 7401, 7402];
const ADDED_DELAY_MS: u64 = 5;

/// Runs `ip ARGS`; the error says what failed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Namespaces `{prefix}a`, `{prefix}b`, `{prefix}c` on one bridge (in namespace
/// `{prefix}br`), 10.213.N.1..3/24, and a veth from the test's own namespace to the
/// bridge (10.213.N.254) so the test reaches the gateway. Dropped: all of it removed.
struct Net {
    prefix: String,
    subnet: u8,
    made: Vec<String>,
    root_link: Option<String>,
}

impl Net {
    fn ns(&self, host: &str) -> String {
        format!("{}{host}", self.prefix)
    }

    fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.subnet, i as u8 + 1)
    }

    /// Where host `i`'s relay listens (on the test's own link, in its namespace).
    fn relay_addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 213, self.subnet, i as u8 + 11)
    }

    fn hosts_dir(&self, ns: &str) -> PathBuf {
        Path::new("/etc/netns").join(ns)
    }

    fn create() -> Result<Net, String> {
        let pid = std::process::id();
        let mut net = Net {
            prefix: format!("tsr{}", pid % 100_000),
            subnet: (pid % 250) as u8,
            made: Vec::new(),
            root_link: None,
        };
        let br = net.ns("br");
        ip(&["netns", "add", &br])?;
        net.made.push(br.clone());
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        let mut hosts_file = String::from("127.0.0.1 localhost\n");
        for (i, h) in HOSTS.iter().enumerate() {
            hosts_file.push_str(&format!("{} tessera-{h}\n", net.addr(i)));
        }
        for (i, h) in HOSTS.iter().enumerate() {
            let ns = net.ns(h);
            ip(&["netns", "add", &ns])?;
            net.made.push(ns.clone());
            let port = format!("v{h}");
            ip(&["-n", &br, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            ip(&["-n", &br, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", net.addr(i)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let dir = net.hosts_dir(&ns);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            std::fs::write(dir.join("hosts"), &hosts_file).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let root = format!("{}r", net.prefix);
        ip(&["link", "add", &root, "type", "veth", "peer", "name", "vr", "netns", &br])?;
        net.root_link = Some(root.clone());
        ip(&["-n", &br, "link", "set", "vr", "master", "br0", "up"])?;
        ip(&["addr", "add", &format!("10.213.{}.254/24", net.subnet), "dev", &root])?;
        ip(&["link", "set", &root, "up"])?;
        Ok(net)
    }

    /// `tessera node --host tessera-{h}` inside host `h`'s namespace.
    fn node(&self, h: &str, topology: &Path, dir: &Path) -> Proc {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns(h), BIN, "node", "--exit-on-stdin-eof", "--host"])
            .arg(format!("tessera-{h}"))
            .arg("--topology")
            .arg(topology)
            .arg("--probe-listen")
            .arg(format!("0.0.0.0:{PROBE_PORT}"))
            .env("TESSERA_HOME", tessera_home())
            .env_remove("TESSERA_KERNEL_LIB")
            .env_remove("RUST_LOG");
        Proc::spawn(h, cmd, dir)
    }

    /// Adds `ADDED_DELAY_MS` to every byte between two hosts, each way: netem on every
    /// host's link (the running cluster keeps going), or else a relay per host and
    /// nftables rules that send each host's traffic for a peer's address through the
    /// peer's relay (for connections made from now on: the cluster must restart).
    fn add_delay(&self, dir: &Path) -> Result<Delay, String> {
        let netem = |ns: &str| {
            let delay = format!("{ADDED_DELAY_MS}ms");
            ip(&["netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", &delay])
        };
        let first = self.ns(HOSTS[0]);
        match netem(&first) {
            Ok(()) => {
                for h in &HOSTS[1..] {
                    netem(&self.ns(h))?;
                }
                return Ok(Delay::Netem);
            }
            Err(why) => eprintln!("no netem qdisc here ({why}); relaying every host instead"),
        }
        let root = self.root_link.as_deref().ok_or("no link to the bridge")?;
        let ports = HOST_PORTS.map(|p| p.to_string()).join(",");
        let mut relays = Vec::new();
        for (i, h) in HOSTS.iter().enumerate() {
            let relay = self.relay_addr(i);
            ip(&["addr", "add", &format!("{relay}/24"), "dev", root])?;
            let mut cmd = Command::new(BIN);
            cmd.args(["bench", "relay", "--listen", &relay.to_string(), "--to", &self.addr(i).to_string()]).args([
                "--ports",
                &ports,
                "--delay-ms",
                &ADDED_DELAY_MS.to_string(),
            ]);
            relays.push(Proc::spawn(&format!("relay-{h}"), cmd, dir));
        }
        for (i, h) in HOSTS.iter().enumerate() {
            let ns = self.ns(h);
            let mut rules =
                String::from("table ip tessera_delay {\n chain out {\n  type nat hook output priority -100;\n");
            for j in (0..HOSTS.len()).filter(|&j| j != i) {
                rules += &format!("  ip daddr {} counter dnat to {}\n", self.addr(j), self.relay_addr(j));
            }
            rules += " }\n}\n";
            nft(&ns, &rules)?;
        }
        // Every relay listens before any node dials it.
        for (i, relay) in relays.iter_mut().enumerate() {
            let at = SocketAddr::from((self.relay_addr(i), HOST_PORTS[0]));
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::net::TcpStream::connect_timeout(&at, Duration::from_millis(200)).is_err() {
                assert!(relay.try_status().is_none(), "relay {} exited:\n{}", relay.name, relay.log());
                assert!(Instant::now() < deadline, "relay {} not listening in 10 s:\n{}", relay.name, relay.log());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(Delay::Relays(relays))
    }

    /// Connections host `h` made through its peers' relays (the nftables counters).
    fn relayed_connections(&self, h: &str) -> u64 {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns(h), "nft", "list", "table", "ip", "tessera_delay"])
            .output()
            .expect("run nft");
        let text = String::from_utf8_lossy(&out.stdout);
        let words: Vec<&str> = text.split_whitespace().collect();
        words.windows(2).filter(|w| w[0] == "packets").filter_map(|w| w[1].parse::<u64>().ok()).sum()
    }

    /// Cuts (`up == false`) or restores host `h`'s only link.
    fn link(&self, h: &str, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns(h), "link", "set", "eth0", state]).unwrap_or_else(|e| panic!("{e}"));
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some(link) = &self.root_link {
            let _ = ip(&["link", "del", link]);
        }
        for ns in self.made.iter().rev() {
            let _ = ip(&["netns", "del", ns]);
            let _ = std::fs::remove_dir_all(self.hosts_dir(ns));
        }
    }
}

/// How the added delay is made; relays are stopped on drop.
enum Delay {
    Netem,
    Relays(Vec<Proc>),
}

/// Loads nftables `rules` into namespace `ns`.
fn nft(ns: &str, rules: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run `nft` in {ns}: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes()).map_err(|e| format!("nft in {ns}: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("nft in {ns}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft in {ns} refused the rules: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Host a prefills (and runs the gateway), b and c decode; names, not addresses, in the
/// file; KV over tcp between namespaces.
fn topology(net: &Net) -> (String, SocketAddr) {
    let gateway = SocketAddr::from((net.addr(0), 8000));
    let mut toml = format!(
        "[cluster]\nname = \"netns\"\nmodel = \"builtin:tiny\"\n\n\
         [disagg]\nmin_prompt_tokens = 4\ntransport = \"tcp\"\n\n\
         [security]\nmode = \"off\"\n\n\
         [supervisor]\nheartbeat_interval_ms = 100\nheartbeat_timeout_ms = {HEARTBEAT_TIMEOUT_MS}\nrestart_backoff_ms = 200\n\n\
         [gateway]\nhost = \"tessera-a\"\nlisten = \"{gateway}\"\n"
    );
    for (h, role) in HOSTS.iter().zip(["prefill", "decode", "decode"]) {
        toml.push_str(&format!(
            "\n[[hosts]]\nname = \"tessera-{h}\"\nbus = \"tessera-{h}:7400\"\n\n\
             [[hosts.chips]]\nid = \"{h}-chip\"\nkind = \"cpu\"\nbackend = \"cpu\"\nrole = \"{role}\"\nthreads = 1\n"
        ));
    }
    (toml, gateway)
}

fn prompts() -> Vec<String> {
    (0..6).map(|i| format!("Tell me about the {i}th chip on the other side of the network")).collect()
}

#[test]
fn hosts_in_network_namespaces_serve_by_name_and_survive_a_partition_and_a_killed_host() {
    let net = match Net::create() {
        Ok(net) => net,
        Err(why) => {
            eprintln!("SKIPPED hosts_in_network_namespaces: this machine refuses network namespaces here: {why}");
            return;
        }
    };
    let prompts = prompts();
    let want: Vec<Generated> = prompts.iter().map(|p| generate(p, MAX_TOKENS, true)).collect();
    let (toml, gateway) = topology(&net);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("topology.toml");
    std::fs::write(&path, &toml).expect("write the topology");
    let procs = HOSTS.iter().map(|h| net.node(h, &path, dir.path())).collect();
    let mut cluster = Cluster { procs, gateway, topology: path, dir };
    cluster.wait_ready(3);
    // A host without the gateway answers its own probes.
    let probe = SocketAddr::from((net.addr(1), PROBE_PORT));
    let ready = get(probe, "/health");
    assert_eq!((ready.status, ready.json()["host"].as_str()), (200, Some("tessera-b")), "{}", ready.body);
    assert_eq!(get(probe, "/health/live").status, 200);
    assert!(get(probe, "/metrics").body.contains("tessera_"), "b's /metrics has no samples");

    // Served across namespaces: prefill on a, KV over tcp to b or c, tokens back to a.
    for (prompt, want) in prompts.iter().zip(&want).take(2) {
        let r = post_json(gateway, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, true));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.text, "{prompt:?}");
    }
    let split = metric(gateway, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
    assert!(split >= 2.0, "prompts were not split between namespaces: {split}");

    // Partition: b's link goes down mid-stream, b is declared down and its requests move
    // to c; then the link comes back and b rejoins.
    let mut restored = None;
    stream_through_fault_after(gateway, "b-chip", 1, &prompts, &want, MAX_TOKENS, || {
        net.link("b", false);
        let limit = Duration::from_millis(HEARTBEAT_TIMEOUT_MS + 3000);
        let h = wait_health(gateway, "b reported down", limit, |h| chip(h, "b-chip")["state"] != "up");
        assert_eq!(chip(&h, "c-chip")["state"], "up", "{h:#}");
        net.link("b", true);
        restored = Some(Instant::now());
    });
    wait_health(gateway, "b back after its link returned", Duration::from_secs(30), |h| {
        chip(h, "b-chip")["state"] == "up"
    });
    eprintln!("b was up again {:?} after its link returned", restored.map(|t| t.elapsed()));

    // A host SIGKILLed mid-stream.
    let c_pid = cluster.proc("c").pid();
    stream_through_fault_after(gateway, "c-chip", 1, &prompts, &want, MAX_TOKENS, || signal(c_pid, "KILL"));
    wait_health(gateway, "a's and b's KV freed", Duration::from_secs(10), |h| drained(h, &["a-chip", "b-chip"]));

    // 5 ms more on every byte between two hosts, each way.
    let delay = match net.add_delay(cluster.dir.path()) {
        Ok(delay) => delay,
        Err(why) => {
            eprintln!("SKIPPED the added-latency drill: {why}");
            return;
        }
    };
    let how = match &delay {
        Delay::Netem => "netem".to_string(),
        Delay::Relays(relays) => {
            // New connections cross the relays: start every host again (c was killed).
            cluster.procs.clear();
            cluster.procs = HOSTS.iter().map(|h| net.node(h, &cluster.topology, cluster.dir.path())).collect();
            cluster.wait_ready(3);
            format!("{} relays", relays.len())
        }
    };
    let before = metric(gateway, "tessera_router_decisions_total{placement=\"disaggregated\"} ");
    let t = Instant::now();
    for (prompt, want) in prompts.iter().zip(&want) {
        let r = post_json(gateway, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, true));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.text, "with {ADDED_DELAY_MS} ms added ({how}): {prompt:?}");
    }
    let split = metric(gateway, "tessera_router_decisions_total{placement=\"disaggregated\"} ") - before;
    assert!(split >= 2.0, "with the delay, prompts were not split between namespaces: {split}");
    eprintln!("{} requests with {ADDED_DELAY_MS} ms added each way ({how}) took {:?}", prompts.len(), t.elapsed());
    if let Delay::Relays(_) = &delay {
        for h in HOSTS {
            // Each host dials both peers' buses at least: all through the relays.
            let n = net.relayed_connections(h);
            assert!(n >= 2, "host {h} made {n} connections through the relays");
        }
    }
    // Stop the nodes before their relays.
    cluster.procs.clear();
    drop(delay);
}
