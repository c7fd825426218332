//! The README's shell commands run as written: every command of its ```sh blocks, in
//! order, against the debug binary. `cargo run --release -- ARGS` runs the binary with
//! ARGS (the release build is CI's to skip: the arguments and what they do are the
//! same); `cargo run --release -- up [FILE]` starts that cluster on free ports (the
//! file's own addresses rewritten, so tests can run side by side) and waits for every
//! chip; each `curl` sends its request to the cluster started last and must succeed (2xx);
//! `cargo test --workspace` must be what CI runs (`.ci/run`). A command of any other
//! shape fails the test, so a new one cannot go unchecked.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::serve_kit::{Cluster, Topology, free_ports, tessera, try_request};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every command of the ```sh blocks of `markdown`: continuation lines joined, comments
/// and blank lines left out.
fn sh_commands(markdown: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let line = line.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(start) => pending.push_str(start),
            None => {
                pending.push_str(line);
                commands.push(std::mem::take(&mut pending));
            }
        }
    }
    assert!(pending.is_empty(), "a command continues past its block: {pending}");
    commands
}

/// A command's words, as a POSIX shell splits them (single and double quotes; no
/// expansions: a README command uses none).
fn words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in command.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_default().push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => {
                assert!(!"$`*?|;<>(){}".contains(c), "shell syntax this test does not run, in {command:?}");
                word.get_or_insert_default().push(c)
            }
        }
    }
    assert!(quote.is_none(), "an unclosed quote in {command:?}");
    words.extend(word);
    words
}

/// `toml` (read from `dir`) on fresh loopback ports: the gateway's `listen` and each
/// host's bus, events and transfer sockets; a relative model path made absolute.
/// Returns the topology and how many chips it has.
fn on_free_ports(toml: &str, dir: &Path) -> (Topology, usize) {
    let hosts = toml.lines().filter(|l| l.trim_start().starts_with("bus = ")).count();
    let mut ports = free_ports(1 + 3 * hosts).into_iter();
    let mut port = || ports.next().expect("enough free ports");
    let mut out = String::new();
    let mut gateway = None;
    let mut chips = 0;
    for line in toml.lines() {
        let key = line.split('=').next().unwrap_or("").trim();
        match key {
            "listen" => {
                let addr: SocketAddr = ([127, 0, 0, 1], port()).into();
                gateway = Some(addr);
                out.push_str(&format!("listen = \"{addr}\"\n"));
            }
            "bus" => {
                for key in ["bus", "events", "transfer"] {
                    out.push_str(&format!("{key} = \"127.0.0.1:{}\"\n", port()));
                }
            }
            "events" | "transfer" => {}
            "model" => {
                let model = line.split('"').nth(1).expect("a quoted model");
                let model = if model.starts_with("builtin:") { PathBuf::from(model) } else { dir.join(model) };
                out.push_str(&format!("model = \"{}\"\n", model.display()));
            }
            _ => {
                chips += usize::from(line.trim() == "[[hosts.chips]]");
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    let gateway = gateway.expect("the README's topologies set [gateway] listen");
    (Topology { toml: out, gateway }, chips)
}

/// `tessera ARGS`, which must succeed.
fn run(args: &[String]) {
    let out = tessera().args(args).current_dir(root()).output().expect("run tessera");
    assert!(out.status.success(), "`tessera {}` failed:\n{}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// `curl ARGS` against `gateway`: the request it would send, which must succeed.
fn curl(args: &[String], gateway: SocketAddr, command: &str) {
    let mut method = "GET";
    let mut body = None;
    let mut path = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-s" | "-sN" => {}
            "-X" => method = if args.next().map(String::as_str) == Some("POST") { "POST" } else { "GET" },
            "-H" => {
                args.next();
            }
            "-d" => {
                method = "POST";
                body = args.next().cloned();
            }
            url if url.starts_with("http://") => {
                let rest = &url["http://".len()..];
                path = Some(rest[rest.find('/').unwrap_or(rest.len())..].to_owned());
            }
            other => panic!("a curl option this test does not know, {other:?}, in {command}"),
        }
    }
    let path = path.unwrap_or_else(|| panic!("no URL in {command}"));
    if let Some(body) = &body {
        serde_json::from_str::<serde_json::Value>(body)
            .unwrap_or_else(|e| panic!("{command}: the body is not JSON: {e}"));
    }
    let r = try_request(gateway, method, &path, body.as_deref()).unwrap_or_else(|e| panic!("{command}: {e}"));
    assert!((200..300).contains(&r.status), "{command}: {}\n{}", r.status, r.body);
    if body.as_deref().is_some_and(|b| b.contains("\"stream\": true")) {
        assert!(r.body.contains("data: [DONE]"), "{command}: a stream ends with [DONE]:\n{}", r.body);
    }
}

#[test]
fn readme_is_short_and_starts_with_the_two_commands() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(lines <= 300, "README.md has {lines} lines; at most 300");
    let first = sh_commands(&readme);
    assert_eq!(
        first.get(..2),
        Some(&["cargo run --release -- up".to_owned(), "cargo test --workspace".to_owned()][..])
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).expect(".ci/run");
    assert!(ci.lines().any(|l| l.trim() == "cargo test --workspace"), ".ci/run must run the README's test command");
}

#[test]
fn every_readme_command_runs_as_written() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let commands = sh_commands(&readme);
    assert!(commands.len() >= 10, "found only {} commands: the scan is broken", commands.len());
    let mut cluster: Option<Cluster> = None;
    for command in &commands {
        let words = words(command);
        let words: Vec<String> = words.into_iter().filter(|w| w != "&").collect();
        let w: Vec<&str> = words.iter().map(String::as_str).collect();
        match w.as_slice() {
            ["cargo", "test", "--workspace"] => {} // .ci/run runs it (the test above).
            ["cargo", "run", "--release", "--", "up", file @ ..] => {
                // One cluster at a time, as the README says: stop the last one first.
                drop(cluster.take());
                let (text, dir) = match file {
                    [] => (tessera_topology::DEFAULT_TOML.to_owned(), root().to_path_buf()),
                    [file] => {
                        let path = root().join(file);
                        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
                        (text, path.parent().expect("a directory").to_path_buf())
                    }
                    _ => panic!("`up` with more than a file: {command}"),
                };
                let (topology, chips) = on_free_ports(&text, &dir);
                let mut up = Cluster::up(&topology);
                up.wait_ready(chips);
                cluster = Some(up);
            }
            ["cargo", "run", "--release", "--", ..] => run(&words[4..]),
            ["curl", ..] => {
                let up = cluster.as_ref().unwrap_or_else(|| panic!("{command}: no cluster is up before it"));
                curl(&words[1..], up.gateway, command);
            }
            _ => panic!("a README command this test cannot run: {command}"),
        }
    }
}

#[test]
fn commands_are_read_as_a_shell_reads_them() {
    let md = "text\n```sh\n# a comment\ncurl -s http://h:1/x \\\n  -d '{\"a\": \"b c\"}'\n\ncargo run -- up &\n```\n```text\nnot a command\n```\n";
    let commands = sh_commands(md);
    assert_eq!(commands, ["curl -s http://h:1/x -d '{\"a\": \"b c\"}'", "cargo run -- up &"]);
    assert_eq!(words(&commands[0]), ["curl", "-s", "http://h:1/x", "-d", "{\"a\": \"b c\"}"]);
    let (topology, chips) = on_free_ports(tessera_topology::DEFAULT_TOML, root());
    assert_eq!(chips, 2);
    let settings: Vec<&str> = topology.toml.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    assert!(settings.iter().all(|l| !l.contains(":7400\"") && !l.contains(":8000\"")), "{}", topology.toml);
    tessera_topology::parse(&topology.toml, "rewritten default").expect("the rewritten default is valid");
}
