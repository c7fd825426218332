//! Helpers of the serving tests (`tests/serve.rs`): topologies on free loopback ports,
//! `tessera up` / `tessera node` processes that are always stopped by their pid, a small
//! blocking HTTP/1.1 client with server-sent events, and `/health` polling with deadlines.
//!
//! The HTTP client is hand-written on `std::net` so a test controls its connection
//! exactly (a client disconnect is dropping the socket) and needs no extra dependency.
#![allow(dead_code)]

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// One `TESSERA_HOME` for every serving test, so `builtin:tiny` is generated once (its
/// generation is safe to race: it is renamed into place).
pub fn tessera_home() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve-tessera-home")
}

/// A `tessera` command with the shared home and the default kernel library.
pub fn tessera() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("TESSERA_HOME", tessera_home()).env_remove("TESSERA_KERNEL_LIB").env_remove("RUST_LOG");
    cmd
}

/// `n` distinct free loopback ports, from below the ephemeral range so that no outgoing
/// connection takes one before the cluster binds it.
pub fn free_ports(n: usize) -> Vec<u16> {
    tessera_runtime::bus::free_loopback_ports(n).expect("free loopback ports")
}

/// A topology of `hosts` (one CPU chip `{host}-cpu0` each) on fresh ports; the gateway on
/// the first host. `gateway_extra` and `chip_extra` are TOML lines added to `[gateway]`
/// and to every chip; `heartbeat_timeout_ms` goes to `[supervisor]`.
pub struct Topology {
    pub toml: String,
    pub gateway: SocketAddr,
}

pub fn topology(hosts: &[&str], gateway_extra: &str, chip_extra: &str, heartbeat_timeout_ms: u64) -> Topology {
    let chip = format!("kind = \"cpu\"\nbackend = \"cpu\"\nrole = \"both\"\nthreads = 1\n{chip_extra}");
    let chips: Vec<ChipDef> =
        hosts.iter().map(|h| ChipDef { host: h, id: format!("{h}-cpu0"), toml: chip.clone() }).collect();
    topology_of(&chips, "", gateway_extra, heartbeat_timeout_ms)
}

/// One chip of a test topology: its host (hosts are created in order of first use),
/// its id and the TOML lines of its `[[hosts.chips]]` table besides the id.
pub struct ChipDef<'a> {
    pub host: &'a str,
    pub id: String,
    pub toml: String,
}

/// A topology of these chips on fresh loopback ports (bus, events and KV transfer for
/// each host), the gateway on the first host; `cluster_extra` is TOML added after
/// `[cluster]` (e.g. more tables).
pub fn topology_of(chips: &[ChipDef], cluster_extra: &str, gateway_extra: &str, heartbeat_timeout_ms: u64) -> Topology {
    let mut hosts: Vec<&str> = Vec::new();
    for c in chips {
        if !hosts.contains(&c.host) {
            hosts.push(c.host);
        }
    }
    let ports = free_ports(1 + 4 * hosts.len());
    let gateway: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let mut toml = format!(
        "[cluster]\nname = \"serve-test\"\nmodel = \"builtin:tiny\"\n\n{cluster_extra}\n\n\
         [supervisor]\nheartbeat_interval_ms = 100\nheartbeat_timeout_ms = {heartbeat_timeout_ms}\n\
         restart_backoff_ms = 200\n\n\
         [gateway]\nhost = \"{}\"\nlisten = \"{gateway}\"\n{gateway_extra}\n",
        hosts[0]
    );
    for (i, host) in hosts.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[hosts]]\nname = \"{host}\"\nbus = \"127.0.0.1:{}\"\nevents = \"127.0.0.1:{}\"\ntransfer = \"127.0.0.1:{}\"\n\
             stages = \"127.0.0.1:{}\"\n",
            ports[1 + 4 * i],
            ports[2 + 4 * i],
            ports[3 + 4 * i],
            ports[4 + 4 * i]
        ));
        for c in chips.iter().filter(|c| c.host == *host) {
            toml.push_str(&format!("\n[[hosts.chips]]\nid = \"{}\"\n{}\n", c.id, c.toml));
        }
    }
    Topology { toml, gateway }
}

/// A child process stopped on drop: SIGINT by pid, then SIGKILL after a grace period.
/// Its stdout and stderr go to a log file, shown when a test fails.
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
}

/// Sends `signal` (e.g. "INT", "KILL") to `pid`.
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status().expect("run kill");
    assert!(status.success(), "kill -{signal} {pid} failed");
}

impl Proc {
    /// Spawns `cmd` with its output to `dir/{name}.log` and a piped stdin (closed on drop,
    /// which `--exit-on-stdin-eof` nodes take as a stop).
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("create log file");
        let err = out.try_clone().unwrap();
        let child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        Proc { name: name.to_string(), child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn interrupt(&mut self) {
        if self.try_status().is_none() {
            signal(self.pid(), "INT");
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            let _ = Command::new("kill").arg("-INT").arg(self.pid().to_string()).status();
            if self.wait_exit(Duration::from_secs(10)).is_none() {
                self.kill();
            }
        }
        drop(self.child.stdin.take());
        if std::thread::panicking() {
            eprintln!("---- log of {} (pid {}) ----\n{}", self.name, self.pid(), self.log());
        }
    }
}

/// A running cluster: its processes (stopped first on drop), its files, its gateway.
pub struct Cluster {
    pub procs: Vec<Proc>,
    pub gateway: SocketAddr,
    pub topology: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Cluster {
    fn files(topo: &Topology) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("topology.toml");
        std::fs::write(&path, &topo.toml).unwrap();
        (dir, path)
    }

    /// `tessera up FILE`: one process, which starts one child per host.
    pub fn up(topo: &Topology) -> Cluster {
        let (dir, path) = Self::files(topo);
        let mut cmd = tessera();
        cmd.arg("up").arg(&path);
        let up = Proc::spawn("up", cmd, dir.path());
        Cluster { procs: vec![up], gateway: topo.gateway, topology: path, dir }
    }

    /// `tessera up --in-process FILE`: every host a thread of one process.
    pub fn up_in_process(topo: &Topology) -> Cluster {
        let (dir, path) = Self::files(topo);
        let mut cmd = tessera();
        cmd.arg("up").arg("--in-process").arg(&path);
        let up = Proc::spawn("up", cmd, dir.path());
        Cluster { procs: vec![up], gateway: topo.gateway, topology: path, dir }
    }

    /// `tessera node --host H` for each of `hosts`, as separate processes of this test.
    pub fn nodes(topo: &Topology, hosts: &[&str]) -> Cluster {
        let (dir, path) = Self::files(topo);
        let procs = hosts
            .iter()
            .map(|h| {
                let mut cmd = tessera();
                cmd.args(["node", "--host", h, "--exit-on-stdin-eof", "--topology"]).arg(&path);
                Proc::spawn(h, cmd, dir.path())
            })
            .collect();
        Cluster { procs, gateway: topo.gateway, topology: path, dir }
    }

    pub fn proc(&mut self, name: &str) -> &mut Proc {
        self.procs.iter_mut().find(|p| p.name == name).unwrap_or_else(|| panic!("no process {name}"))
    }

    /// Waits until `/health` answers with `chips` chips all up.
    pub fn wait_ready(&mut self, chips: usize) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for p in &mut self.procs {
                if let Some(s) = p.try_status() {
                    panic!("{} exited ({s}) before the cluster was ready:\n{}", p.name, p.log());
                }
            }
            if let Some(h) = try_health(self.gateway)
                && h["chips"].as_array().is_some_and(|c| c.len() == chips && c.iter().all(|c| c["state"] == "up"))
            {
                return h;
            }
            assert!(Instant::now() < deadline, "the cluster was not ready within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The host pids `tessera up` printed (`tessera up: host h1 pid 12345`).
pub fn up_host_pids(log: &str) -> Vec<(String, u32)> {
    log.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("tessera up: host ")?;
            let (name, pid) = rest.split_once(" pid ")?;
            Some((name.to_string(), pid.trim().parse().ok()?))
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    Command::new("kill").arg("-0").arg(pid.to_string()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Drop for Cluster {
    /// Stops the processes; if `up` had to be killed, also its hosts (by the pids it
    /// printed), which otherwise drain on their own once their stdin closes.
    fn drop(&mut self) {
        let hosts: Vec<u32> = self
            .procs
            .iter()
            .filter(|p| p.name == "up")
            .flat_map(|p| up_host_pids(&p.log()))
            .map(|(_, pid)| pid)
            .collect();
        self.procs.clear();
        let deadline = Instant::now() + Duration::from_secs(5);
        while hosts.iter().any(|&pid| alive(pid)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        for pid in hosts {
            if alive(pid) {
                let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
            }
        }
    }
}

// ---- HTTP ----

/// Response headers, in order.
pub type Headers = Vec<(String, String)>;

/// A whole HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Headers,
    pub body: String,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// The body of a response, decoding chunked transfer encoding.
enum Framing {
    Chunked { left: usize, done: bool },
    Length(usize),
    UntilClose,
}

pub struct Body {
    r: BufReader<TcpStream>,
    framing: Framing,
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.framing {
            Framing::Length(left) => {
                let n = (*left).min(buf.len());
                if n == 0 {
                    return Ok(0);
                }
                let got = self.r.read(&mut buf[..n])?;
                *left -= got;
                Ok(got)
            }
            Framing::UntilClose => self.r.read(buf),
            Framing::Chunked { left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut line = String::new();
                    self.r.read_line(&mut line)?;
                    let size = line.trim().split(';').next().unwrap_or("");
                    let size = usize::from_str_radix(size, 16).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad chunk size line {line:?}"))
                    })?;
                    if size == 0 {
                        *done = true;
                        return Ok(0);
                    }
                    *left = size;
                }
                let n = (*left).min(buf.len());
                let got = self.r.read(&mut buf[..n])?;
                if got == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                *left -= got;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    self.r.read_exact(&mut crlf)?;
                }
                Ok(got)
            }
        }
    }
}

/// Sends one request (`Connection: close`) and reads the status line and headers. An
/// `/admin/*` request carries the admin token `tessera up` made for the gateway at `addr`
/// (if it made one, in the shared home).
fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> std::io::Result<(u16, Headers, Body)> {
    let token = path.starts_with("/admin").then(|| tessera_access::token::read(&tessera_home(), addr)).flatten();
    send_as(addr, method, path, body, token.as_deref())
}

/// [`send`] with `key` (if any) as its `Authorization: Bearer` key.
fn send_as(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> std::io::Result<(u16, Headers, Body)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or("");
    let auth = key.map_or_else(String::new, |key| format!("Authorization: Bearer {key}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{auth}\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad status line {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let get = |name: &str| headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
    let framing = if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        Framing::Chunked { left: 0, done: false }
    } else if let Some(len) = get("content-length") {
        Framing::Length(len.parse().unwrap_or(0))
    } else {
        Framing::UntilClose
    };
    Ok((status, headers, Body { r, framing }))
}

pub fn try_request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> std::io::Result<HttpResponse> {
    let (status, headers, b) = send(addr, method, path, body)?;
    read_whole(status, headers, b)
}

/// One request with `key` as its bearer key (or none), read whole.
pub fn request_as(addr: SocketAddr, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> HttpResponse {
    send_as(addr, method, path, body, key)
        .and_then(|(status, headers, b)| read_whole(status, headers, b))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn read_whole(status: u16, headers: Headers, mut b: Body) -> std::io::Result<HttpResponse> {
    let mut bytes = Vec::new();
    b.read_to_end(&mut bytes)?;
    Ok(HttpResponse { status, headers, body: String::from_utf8(bytes).expect("the body is UTF-8") })
}

pub fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    try_request(addr, "GET", path, None).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

pub fn post(addr: SocketAddr, path: &str, body: &str) -> HttpResponse {
    try_request(addr, "POST", path, Some(body)).unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    post(addr, path, &body.to_string())
}

/// A streamed response: its `data:` payloads one at a time, its raw text kept for checks.
pub struct Sse {
    r: BufReader<Body>,
    /// Everything read so far, as sent.
    pub raw: String,
}

impl Sse {
    /// The next event's data, `None` at the end of the stream. Panics on a line that is
    /// not `data: ...` or an event not ended by a blank line.
    pub fn next_data(&mut self) -> Option<String> {
        let mut line = String::new();
        if self.r.read_line(&mut line).expect("reading the event stream") == 0 {
            return None;
        }
        self.raw.push_str(&line);
        let data = line
            .strip_suffix('\n')
            .and_then(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("not an SSE data line: {line:?}; stream so far:\n{}", self.raw))
            .to_string();
        let mut blank = String::new();
        self.r.read_line(&mut blank).expect("reading the event stream");
        self.raw.push_str(&blank);
        assert_eq!(blank, "\n", "an event must end with a blank line; stream so far:\n{}", self.raw);
        Some(data)
    }
}

/// POSTs `body` and returns the event stream, or the whole response if it is not a 200.
pub fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Result<Sse, HttpResponse> {
    post_stream_as(addr, path, body, None)
}

/// [`post_stream`] with `key` as its bearer key.
pub fn post_stream_as(addr: SocketAddr, path: &str, body: &Value, key: Option<&str>) -> Result<Sse, HttpResponse> {
    let (status, headers, mut b) =
        send_as(addr, "POST", path, Some(&body.to_string()), key).unwrap_or_else(|e| panic!("POST {path}: {e}"));
    if status != 200 {
        let mut text = String::new();
        let _ = b.read_to_string(&mut text);
        return Err(HttpResponse { status, headers, body: text });
    }
    let ct = headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-type")).map(|(_, v)| v.as_str());
    assert_eq!(ct, Some("text/event-stream"), "{headers:?}");
    Ok(Sse { r: BufReader::new(b), raw: String::new() })
}

/// What a streamed completion added up to.
#[derive(Debug, Default, Clone)]
pub struct Streamed {
    pub text: String,
    pub finish_reason: Option<String>,
    pub usage: Option<Value>,
    /// Chunks that carried text.
    pub text_chunks: usize,
}

/// Reads a streamed completion or chat completion event by event, checking its framing:
/// every chunk is JSON of the endpoint's object, the first chat chunk carries the role,
/// exactly one has a finish_reason, usage (if any) comes after it, and the stream ends
/// with `data: [DONE]`.
pub struct StreamReader {
    pub sse: Sse,
    pub chat: bool,
    pub out: Streamed,
    first: bool,
    done: bool,
}

impl StreamReader {
    pub fn new(sse: Sse, chat: bool) -> StreamReader {
        StreamReader { sse, chat, out: Streamed::default(), first: true, done: false }
    }

    /// Reads one event; false once the stream has ended.
    pub fn step(&mut self) -> bool {
        let Some(data) = self.sse.next_data() else {
            assert!(self.done, "the stream did not end with data: [DONE]:\n{}", self.sse.raw);
            assert!(self.sse.raw.ends_with("data: [DONE]\n\n"), "{}", self.sse.raw);
            return false;
        };
        assert!(!self.done, "data after [DONE]:\n{}", self.sse.raw);
        if data == "[DONE]" {
            self.done = true;
            return true;
        }
        let out = &mut self.out;
        let v: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("chunk is not JSON ({e}): {data}"));
        assert!(v.get("error").is_none(), "error in stream: {data}");
        assert_eq!(v["object"], if self.chat { "chat.completion.chunk" } else { "text_completion" }, "{data}");
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            assert!(out.finish_reason.is_some(), "usage before the finish chunk: {data}");
            assert_eq!(v["choices"], json!([]), "{data}");
            out.usage = Some(usage.clone());
            return true;
        }
        assert!(out.usage.is_none(), "a chunk after the usage chunk: {data}");
        let choice = &v["choices"][0];
        let piece = if self.chat {
            if self.first {
                assert_eq!(choice["delta"]["role"], "assistant", "first chat chunk has the role: {data}");
            }
            choice["delta"]["content"].as_str().unwrap_or("")
        } else {
            choice["text"].as_str().unwrap_or_else(|| panic!("no text: {data}"))
        };
        self.first = false;
        if !piece.is_empty() {
            assert!(out.finish_reason.is_none(), "text after the finish chunk: {data}");
            out.text.push_str(piece);
            out.text_chunks += 1;
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            assert!(out.finish_reason.is_none(), "two finish chunks:\n{}", self.sse.raw);
            out.finish_reason = Some(f.to_string());
        }
        true
    }

    /// Reads to the end of the stream.
    pub fn finish(mut self) -> (Streamed, String) {
        while self.step() {}
        (self.out, self.sse.raw)
    }
}

/// Reads a whole stream (see `StreamReader`); returns it and its raw text.
pub fn read_stream(sse: Sse, chat: bool) -> (Streamed, String) {
    StreamReader::new(sse, chat).finish()
}

// ---- health ----

pub fn try_health(addr: SocketAddr) -> Option<Value> {
    let r = try_request(addr, "GET", "/health", None).ok()?;
    serde_json::from_str(&r.body).ok()
}

/// The value of the gateway's Prometheus sample line starting with `prefix` (0 when
/// absent).
pub fn metric(gw: SocketAddr, prefix: &str) -> f64 {
    get(gw, "/metrics")
        .body
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Polls `/health` until `pred` holds; panics after `timeout` with the last answer.
#[track_caller]
pub fn wait_health(addr: SocketAddr, what: &str, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + timeout;
    let mut last = None;
    loop {
        if let Some(h) = try_health(addr) {
            if pred(&h) {
                return h;
            }
            last = Some(h);
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}; last /health: {last:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The chip `id` of a /health answer.
pub fn chip<'a>(health: &'a Value, id: &str) -> &'a Value {
    health["chips"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["id"] == id))
        .unwrap_or_else(|| panic!("no chip {id} in {health:#}"))
}

/// Every listed chip (all if `ids` is empty) holds no KV block and no sequence, and the
/// gateway has nothing in flight.
pub fn drained(health: &Value, ids: &[&str]) -> bool {
    health["inflight_requests"] == 0
        && health["chips"].as_array().is_some_and(|chips| {
            chips.iter().filter(|c| ids.is_empty() || ids.iter().any(|id| c["id"] == *id)).all(|c| {
                c["kv_blocks_used"] == 0
                    && c["running"] == 0
                    && c["waiting"] == 0
                    && c["kv_blocks_total"].as_u64() > Some(0)
            })
        })
}

// ---- reference ----

/// What `tessera generate` produced for a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// "stop" or "length", as the API says it.
    pub finish_reason: String,
}

/// The greedy completion of `prompt` by `tessera generate` (a single sequence, no cluster).
pub fn generate(prompt: &str, max_tokens: usize, ignore_eos: bool) -> Generated {
    generate_with(prompt, max_tokens, ignore_eos, &[])
}

/// `generate` with more `tessera generate` flags (e.g. `--kv-dtype f16`).
pub fn generate_with(prompt: &str, max_tokens: usize, ignore_eos: bool, flags: &[&str]) -> Generated {
    let mut cmd = tessera();
    cmd.args(["generate", "--model", "builtin:tiny", "--prompt", prompt, "--max-tokens", &max_tokens.to_string()]);
    cmd.args(flags);
    if ignore_eos {
        cmd.arg("--ignore-eos");
    }
    let out = cmd.output().expect("run tessera generate");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tessera generate failed: {stderr}");
    let stdout = String::from_utf8(out.stdout).expect("generate prints UTF-8");
    let text = stdout.strip_suffix('\n').unwrap_or_else(|| panic!("no final newline: {stdout:?}")).to_string();
    // "[6 prompt + 20 generated tokens (Length); ..."
    let summary = stderr.lines().rev().find(|l| l.contains(" generated tokens (")).unwrap_or_default();
    let nums: Vec<usize> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .take(2)
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(nums.len(), 2, "no token counts in: {stderr}");
    let finish_reason = if summary.contains("(Length)") {
        "length"
    } else if summary.contains("(Stop)") {
        "stop"
    } else {
        panic!("no finish reason in: {stderr}")
    };
    Generated { text, prompt_tokens: nums[0], completion_tokens: nums[1], finish_reason: finish_reason.to_string() }
}

/// The prompt the tiny model's chat template makes of one user message (with the
/// template's default system message).
pub fn chatml(user: &str) -> String {
    format!(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n\
         <|im_start|>assistant\n"
    )
}

// ---- requests ----

pub const MODEL: &str = "builtin:tiny";

pub fn completion_body(prompt: &str, max_tokens: usize, stream: bool, ignore_eos: bool) -> Value {
    let mut body = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    body
}

#[track_caller]
pub fn assert_usage(usage: &Value, prompt_tokens: usize, completion_tokens: usize, what: &str) {
    assert_eq!(usage["prompt_tokens"], prompt_tokens, "{what}: {usage}");
    assert_eq!(usage["completion_tokens"], completion_tokens, "{what}: {usage}");
    assert_eq!(usage["total_tokens"], prompt_tokens + completion_tokens, "{what}: {usage}");
}

/// Starts one streaming request per fault prompt; once every stream has produced text and
/// `victim` runs sequences, calls `fault`; then reads every stream to its end and checks
/// it against the no-fault answer: same text, every token, finish "length".
pub fn stream_through_fault(
    gw: SocketAddr,
    victim: &str,
    prompts: &[String],
    want: &[Generated],
    max_tokens: usize,
    fault: impl FnOnce(),
) {
    stream_through_fault_after(gw, victim, prompts.len(), prompts, want, max_tokens, fault)
}

/// `stream_through_fault`, with the fault coming once `started` streams produced text.
pub fn stream_through_fault_after(
    gw: SocketAddr,
    victim: &str,
    started: usize,
    prompts: &[String],
    want: &[Generated],
    max_tokens: usize,
    fault: impl FnOnce(),
) {
    let (started_tx, started_rx) = mpsc::channel::<usize>();
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let started_tx = started_tx.clone();
                s.spawn(move || {
                    let body = completion_body(prompt, max_tokens, true, true);
                    let sse = post_stream(gw, "/v1/completions", &body)
                        .unwrap_or_else(|r| panic!("{prompt:?}: {} {}", r.status, r.body));
                    let mut reader = StreamReader::new(sse, false);
                    while reader.out.text.is_empty() {
                        assert!(reader.step(), "{prompt:?} ended before any text");
                    }
                    let _ = started_tx.send(i);
                    reader.finish()
                })
            })
            .collect();
        drop(started_tx);
        let deadline = Instant::now() + Duration::from_secs(20);
        for _ in 0..started {
            let left = deadline.saturating_duration_since(Instant::now());
            started_rx.recv_timeout(left).expect("streams produce text within 20 s");
        }
        wait_health(gw, &format!("{victim} runs sequences"), Duration::from_secs(3), |h| {
            chip(h, victim)["running"].as_u64() > Some(0)
        });
        fault();
        for ((handle, prompt), want) in handles.into_iter().zip(prompts).zip(want) {
            let (got, raw) = match handle.join() {
                Ok(r) => r,
                Err(e) => std::panic::resume_unwind(e),
            };
            assert_eq!(got.text, want.text, "{prompt:?} differs from its no-fault run; stream:\n{raw}");
            assert_eq!(got.finish_reason.as_deref(), Some("length"), "{prompt:?}");
            let usage = got.usage.expect("include_usage sends usage");
            assert_usage(&usage, want.prompt_tokens, max_tokens, prompt);
        }
    });
    // The fault hit requests mid-stream: some were re-routed and replayed.
    let metrics = get(gw, "/metrics").body;
    let reroutes: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tessera_request_reroutes_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no tessera_request_reroutes_total in /metrics:\n{metrics}"));
    assert!(reroutes >= 1.0, "no request was re-routed: {reroutes}");
}
