//! Hosts on distinct network stacks: three Linux network namespaces joined by a bridge
//! (made by the test, removed after), one `tessera node` in each, every host named by a
//! DNS name that only its namespace's hosts file knows (`ip netns exec` mounts
//! `/etc/netns/NS/hosts` over `/etc/hosts`). The KV cache crosses namespaces over the
//! tcp transport. Drills: a host's link cut and restored mid-stream, a host SIGKILLed
//! mid-stream, and (where the kernel has the netem qdisc) 5 ms added to every packet;
//! no request is lost and every answer is `tessera generate`'s.
//!
//! Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; where
//! either is missing the test says so and checks nothing else. Every wait has a deadline.

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

    // 5 ms on every packet b sends (netem), where the kernel has it.
    match ip(&["netns", "exec", &net.ns("b"), "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "5ms"]) {
        Err(why) => eprintln!("SKIPPED the added-latency drill: {why} (this kernel has no netem qdisc)"),
        Ok(()) => {
            let t = Instant::now();
            for (prompt, want) in prompts.iter().zip(&want) {
                let r = post_json(gateway, "/v1/completions", &completion_body(prompt, MAX_TOKENS, false, true));
                assert_eq!(r.status, 200, "{}", r.body);
                assert_eq!(r.json()["choices"][0]["text"], want.text, "with 5 ms added: {prompt:?}");
            }
            eprintln!("{} requests with 5 ms added on b's link took {:?}", prompts.len(), t.elapsed());
        }
    }
}
