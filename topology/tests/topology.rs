//! Topology files through the public API: every class of error names the file, line,
//! column and key; the default topology parses; `load` resolves relative paths.

use std::path::PathBuf;

use tessera_topology::{Backend, Role, TopologyError, catalog, default_topology, load, parse};

/// One host `h0` with one chip `c0`: lines 1-9.
const ONE_CHIP: &str = r#"[cluster]
model = "builtin:tiny"
[[hosts]]
name = "h0"
bus = "127.0.0.1:7400"
[[hosts.chips]]
id = "c0"
kind = "cpu"
backend = "cpu"
"#;

/// A second host `h1` with chip `c1`: lines 10-16 after [`ONE_CHIP`].
const SECOND_HOST: &str = r#"[[hosts]]
name = "h1"
bus = "127.0.0.1:7410"
[[hosts.chips]]
id = "c1"
kind = "cpu"
backend = "cpu"
"#;

fn error_of(text: &str) -> TopologyError {
    match parse(text, "t.toml") {
        Ok(spec) => panic!("expected an error, got {spec:#?}"),
        Err(e) => e,
    }
}

/// Asserts where the error points and a fragment of what it says.
#[track_caller]
fn assert_error(text: &str, line: usize, column: usize, key: &str, fragment: &str) {
    let e = error_of(text);
    assert_eq!((e.file.as_str(), e.line, e.column, e.key.as_str()), ("t.toml", line, column, key), "{e}");
    assert!(e.message.contains(fragment), "`{fragment}` not in: {e}");
    assert_eq!(e.to_string(), format!("t.toml:{line}:{column}: `{key}`: {}", e.message));
}

/// [`ONE_CHIP`] with `line` (1-based) replaced.
fn with_line(line: usize, replacement: &str) -> String {
    let mut lines: Vec<&str> = ONE_CHIP.lines().collect();
    lines[line - 1] = replacement;
    lines.join("\n") + "\n"
}

#[test]
fn the_base_files_are_valid() {
    let spec = parse(ONE_CHIP, "t.toml").map_err(|e| e.to_string());
    assert_eq!(spec.as_ref().map(|spec| spec.hosts.len()), Ok(1));
    let spec = parse(&format!("{ONE_CHIP}{SECOND_HOST}"), "t.toml").map_err(|e| e.to_string());
    assert_eq!(
        spec.map(|spec| spec.chips().map(|(h, _, chip)| (h, chip.id.clone())).collect::<Vec<_>>()),
        Ok(vec![(0, "c0".to_owned()), (1, "c1".to_owned())])
    );
}

#[test]
fn syntax_error() {
    assert_error(&with_line(8, "kind = cpu"), 8, 8, "hosts[0].chips[0].kind", "quoted");
}

#[test]
fn unknown_key_lists_the_allowed_keys() {
    assert_error(&with_line(8, "knd = \"cpu\""), 8, 1, "hosts[0].chips[0].knd", "unknown field `knd`, expected one of");
    assert_error(&with_line(4, "nmae = \"h0\""), 4, 1, "hosts[0].nmae", "`name`");
    assert_error(&format!("[solver]\nx = 1\n{ONE_CHIP}"), 1, 2, "solver", "unknown field `solver`");
}

#[test]
fn wrong_type() {
    assert_error(&format!("{ONE_CHIP}threads = -2\n"), 10, 11, "hosts[0].chips[0].threads", "expected usize");
}

#[test]
fn missing_model_points_at_the_cluster_table() {
    assert_error(&with_line(2, "name = \"x\""), 1, 1, "cluster.model", "missing field `model`");
}

#[test]
fn missing_chip_key_points_at_the_chip_table() {
    assert_error(
        &format!("{ONE_CHIP}{}", SECOND_HOST.replace("kind = \"cpu\"\n", "")),
        13,
        1,
        "hosts[1].chips[0].kind",
        "missing field `kind`",
    );
}

#[test]
fn no_hosts() {
    assert_error("[cluster]\nmodel = \"builtin:tiny\"\n", 1, 1, "hosts", "no hosts");
}

#[test]
fn host_without_chips() {
    let text = format!("{ONE_CHIP}[[hosts]]\nname = \"h1\"\nbus = \"127.0.0.1:7410\"\n");
    assert_error(&text, 10, 1, "hosts[1].chips", "has no chips");
}

#[test]
fn duplicate_host_name() {
    let text = format!("{ONE_CHIP}{}", SECOND_HOST.replace("\"h1\"", "\"h0\""));
    assert_error(&text, 11, 8, "hosts[1].name", "already used by hosts[0] (line 4)");
}

#[test]
fn duplicate_chip_id_across_hosts() {
    let text = format!("{ONE_CHIP}{}", SECOND_HOST.replace("\"c1\"", "\"c0\""));
    assert_error(&text, 14, 6, "hosts[1].chips[0].id", "already used by hosts[0].chips[0] (line 7)");
}

#[test]
fn unknown_chip_kind_lists_the_catalog() {
    let e = error_of(&with_line(8, "kind = \"nvidia-b300\""));
    assert_eq!((e.line, e.column, e.key.as_str()), (8, 8, "hosts[0].chips[0].kind"));
    assert!(e.message.contains("unknown chip kind `nvidia-b300`"), "{e}");
    for kind in catalog::kinds() {
        assert!(e.message.contains(kind.name), "{} not listed: {e}", kind.name);
    }
}

#[test]
fn bad_addresses() {
    assert_error(&with_line(5, "bus = \"localhost:7400\""), 5, 7, "hosts[0].bus", "not an IP:PORT");
    assert_error(&with_line(5, "bus = \"127.0.0.1:0\""), 5, 7, "hosts[0].bus", "port 0");
    assert_error(&with_line(5, "bus = \"127.0.0.1:65535\""), 5, 7, "hosts[0].bus", "bus port + 1");
    assert_error(&format!("{ONE_CHIP}[gateway]\nlisten = \"0.0.0.0\"\n"), 11, 10, "gateway.listen", "not an IP:PORT");
    let tcp = parse(&with_line(5, "bus = \"tcp://127.0.0.1:7400\""), "t.toml").map(|spec| spec.hosts[0].events);
    assert_eq!(tcp.map(|events| events.to_string()), Ok("127.0.0.1:7401".to_owned()));
}

#[test]
fn two_sockets_on_one_address() {
    // h1's bus on h0's defaulted events port.
    let text = format!("{ONE_CHIP}{}", SECOND_HOST.replace("7410", "7401"));
    assert_error(
        &text,
        12,
        7,
        "hosts[1].bus",
        "already taken by `hosts[0].events` (by default: the bus port + 1) (line 5)",
    );
    let text = format!("{ONE_CHIP}[gateway]\nlisten = \"127.0.0.1:7400\"\n");
    assert_error(&text, 11, 10, "gateway.listen", "already taken by `hosts[0].bus` (line 5)");
}

#[test]
fn gateway_host_must_name_a_host() {
    let text = format!("{ONE_CHIP}{SECOND_HOST}[gateway]\nhost = \"h2\"\n");
    assert_error(&text, 18, 8, "gateway.host", "`h2` is not a host of this cluster; hosts: h0, h1");
}

#[test]
fn limits() {
    assert_error(&format!("{ONE_CHIP}threads = 0\n"), 10, 11, "hosts[0].chips[0].threads", "out of range 1..=1024");
    assert_error(&format!("{ONE_CHIP}threads = 1025\n"), 10, 11, "hosts[0].chips[0].threads", "out of range");
    assert_error(
        &format!("{ONE_CHIP}max_batch_tokens = 0\n"),
        10,
        20,
        "hosts[0].chips[0].max_batch_tokens",
        "at least 1",
    );
    assert_error(&format!("{ONE_CHIP}max_batch_seqs = 0\n"), 10, 18, "hosts[0].chips[0].max_batch_seqs", "at least 1");
    assert_error(
        &format!("{ONE_CHIP}memory_limit = \"0MiB\"\n"),
        10,
        16,
        "hosts[0].chips[0].memory_limit",
        "more than 0",
    );
    assert_error(
        &format!("{ONE_CHIP}memory_limit = \"lots\"\n"),
        10,
        16,
        "hosts[0].chips[0].memory_limit",
        "not a memory size",
    );
    assert_error(&with_line(2, "model = \"builtin:tiny\"\nblock_size = 0"), 3, 14, "cluster.block_size", "1..=4096");
    assert_error(
        &format!("{ONE_CHIP}[router]\nmax_queued_requests = 0\n"),
        11,
        23,
        "router.max_queued_requests",
        "at least 1",
    );
}

#[test]
fn heartbeat_timeout_must_exceed_interval() {
    let text = format!("{ONE_CHIP}[supervisor]\nheartbeat_interval_ms = 500\nheartbeat_timeout_ms = 500\n");
    assert_error(&text, 12, 24, "supervisor.heartbeat_timeout_ms", "must be greater than heartbeat_interval_ms (500)");
    let text = format!("{ONE_CHIP}[supervisor]\nheartbeat_interval_ms = 2000\n");
    assert_error(&text, 11, 25, "supervisor.heartbeat_interval_ms", "(1000) must be greater");
}

#[test]
fn bad_dtypes() {
    let text = with_line(2, "model = \"builtin:tiny\"\ndtype = \"fp8\"");
    assert_error(&text, 3, 9, "cluster.dtype", "unknown dtype `fp8`; expected one of f32, f16, bf16");
    let text = with_line(2, "model = \"builtin:tiny\"\nkv_dtype = \"int4\"");
    assert_error(&text, 3, 12, "cluster.kv_dtype", "unknown dtype `int4`");
}

#[test]
fn bad_model_backend_and_role() {
    assert_error(&with_line(2, "model = \"builtin:huge\""), 2, 9, "cluster.model", "builtin:tiny, builtin:small");
    assert_error(&with_line(9, "backend = \"emu:nvidia-h100\""), 9, 11, "hosts[0].chips[0].backend", "`nvidia-h100`");
    assert_error(
        &with_line(9, "backend = \"emu:nvidia-h100\""),
        9,
        11,
        "hosts[0].chips[0].backend",
        "not available yet",
    );
    assert_error(&with_line(9, "backend = \"sim\""), 9, 11, "hosts[0].chips[0].backend", "not available yet");
    assert_error(&with_line(9, "backend = \"cuda\""), 9, 11, "hosts[0].chips[0].backend", "unknown backend");
    assert_error(&with_line(9, "backend = \"plugin:\""), 9, 11, "hosts[0].chips[0].backend", "needs the path");
    assert_error(&format!("{ONE_CHIP}role = \"decoder\""), 10, 8, "hosts[0].chips[0].role", "unknown role `decoder`");
    assert_error(
        &format!("{ONE_CHIP}role = \"prefill\""),
        10,
        8,
        "hosts[0].chips[0].role",
        "no chip of the cluster can decode",
    );
}

#[test]
fn names_must_be_plain() {
    assert_error(&with_line(7, "id = \"c 0\""), 7, 6, "hosts[0].chips[0].id", "contains ' '");
    assert_error(&with_line(4, "name = \"\""), 4, 8, "hosts[0].name", "must not be empty");
}

#[test]
fn defaults_and_values() {
    let text = format!(
        "{ONE_CHIP}role = \"prefill\"\nmemory_limit = \"512MiB\"\nthreads = 4\n{}",
        SECOND_HOST.replace("backend = \"cpu\"", "backend = \"plugin:kernels/libx.so\"\nrole = \"decode\"")
    );
    let spec = match parse(&text, "t.toml") {
        Ok(spec) => spec,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(spec.name, "default");
    assert_eq!((spec.kv_dtype.as_str(), spec.block_size, spec.dtype.clone()), ("f32", 16, None));
    assert_eq!(spec.gateway.host, "h0");
    assert_eq!(spec.gateway.listen.to_string(), "127.0.0.1:8000");
    assert_eq!((spec.supervisor.heartbeat_interval_ms, spec.supervisor.heartbeat_timeout_ms), (100, 1000));
    let c0 = &spec.hosts[0].chips[0];
    assert_eq!((c0.role, c0.memory_limit_bytes, c0.threads), (Role::Prefill, Some(512 << 20), 4));
    assert_eq!((c0.max_batch_tokens, c0.max_batch_seqs), (512, 64));
    let c1 = &spec.hosts[1].chips[0];
    assert_eq!((c1.role, &c1.backend), (Role::Decode, &Backend::Plugin(PathBuf::from("kernels/libx.so"))));
    assert_eq!(spec.host_index("h1"), Some(1));
    assert_eq!(spec.host_index("h9"), None);
}

#[test]
fn default_topology_parses_and_renders_every_host_and_chip() {
    let spec = default_topology();
    assert_eq!((spec.name.as_str(), spec.model.as_str()), ("default", "builtin:tiny"));
    let hosts: Vec<(&str, String, String)> =
        spec.hosts.iter().map(|host| (host.name.as_str(), host.bus.to_string(), host.events.to_string())).collect();
    assert_eq!(
        hosts,
        [
            ("h0", "127.0.0.1:7400".into(), "127.0.0.1:7401".into()),
            ("h1", "127.0.0.1:7410".into(), "127.0.0.1:7411".into())
        ]
    );
    let chips: Vec<(&str, &str, &Backend, Role, usize)> = spec
        .chips()
        .map(|(_, _, chip)| (chip.id.as_str(), chip.kind.as_str(), &chip.backend, chip.role, chip.threads))
        .collect();
    assert_eq!(
        chips,
        [("h0-cpu0", "cpu", &Backend::Cpu, Role::Both, 1), ("h1-cpu0", "cpu", &Backend::Cpu, Role::Both, 1)]
    );
    assert_eq!((spec.gateway.host.as_str(), spec.gateway.listen.to_string()), ("h0", "127.0.0.1:8000".to_owned()));

    let rendered = spec.render();
    for needle in ["default", "builtin:tiny", "host h0", "host h1", "chip h0-cpu0", "chip h1-cpu0", "127.0.0.1:8000"] {
        assert!(rendered.contains(needle), "{needle} not in:\n{rendered}");
    }
}

#[test]
fn load_resolves_relative_paths_against_the_file() {
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(e) => panic!("tempdir: {e}"),
    };
    let text =
        ONE_CHIP.replace("builtin:tiny", "ckpt/tiny").replace("backend = \"cpu\"", "backend = \"plugin:lib/libk.so\"");
    let text = format!("{text}{}", SECOND_HOST.replace("backend = \"cpu\"", "backend = \"plugin:/abs/libk.so\""));
    let path = dir.path().join("cluster.toml");
    if let Err(e) = std::fs::write(&path, text) {
        panic!("write: {e}");
    }
    let spec = match load(&path) {
        Ok(spec) => spec,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(spec.source, path.display().to_string());
    assert_eq!(spec.model, dir.path().join("ckpt/tiny").display().to_string());
    assert_eq!(spec.hosts[0].chips[0].backend, Backend::Plugin(dir.path().join("lib/libk.so")));
    assert_eq!(spec.hosts[1].chips[0].backend, Backend::Plugin(PathBuf::from("/abs/libk.so")));

    // Errors from `load` name the path; a missing file is a whole-file error.
    let missing = dir.path().join("missing.toml");
    let e = load(&missing).err();
    let e = e.as_ref().map(|e| (e.line, e.column, e.key.as_str(), e.to_string()));
    let expected = format!("{}: cannot read the topology file", missing.display());
    assert!(matches!(&e, Some((0, 0, "", text)) if text.starts_with(&expected)), "{e:?}");
}
