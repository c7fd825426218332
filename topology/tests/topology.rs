//! Topology files through the public API: every class of error names the file, line,
//! column and key; the default topology parses; `load` resolves relative paths.

use std::path::PathBuf;

use tessera_topology::{
    Backend, BusSpec, ClusterSpec, Confidence, DEFAULT_TOML, DType, DisaggSpec, EmulationSpec, HostPaths, KvLayout,
    PathReport, Role, TopologyError, TransportChoice, catalog, default_topology, load, load_with_report, parse,
};

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

/// An operator chip kind `acme-x1`: lines 10-17 after [`ONE_CHIP`].
const ACME: &str = r#"[[chip_kinds]]
name = "acme-x1"
fp16_tflops = 100.0
memory = "32GiB"
memory_bw_gbs = 1000.0
link_bw_gbs = 100.0
tdp_w = 300.0
source = "acme datasheet"
"#;

#[track_caller]
fn spec_of(text: &str) -> ClusterSpec {
    match parse(text, "t.toml") {
        Ok(spec) => spec,
        Err(e) => panic!("{e}"),
    }
}

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
    assert_error(&format!("[solvr]\nx = 1\n{ONE_CHIP}"), 1, 2, "solvr", "unknown field `solvr`");
    assert_error(&format!("[solver]\nx = 1\n{ONE_CHIP}"), 2, 1, "solver.x", "expected one of `enabled`, `auto`");
}

#[test]
fn the_solver_section_is_checked_key_by_key() {
    assert_error(&format!("[solver]\nobjective = \"speed\"\n{ONE_CHIP}"), 2, 13, "solver.objective", "goodput_per_usd");
    assert_error(&format!("[solver]\nperiod_s = 0\n{ONE_CHIP}"), 2, 12, "solver.period_s", "out of range 1..=86400");
    assert_error(
        &format!("[solver]\nrate_change_percent = 0\n{ONE_CHIP}"),
        2,
        23,
        "solver.rate_change_percent",
        "1..=1000",
    );
    let spec = spec_of(&format!("[solver]\nauto = true\nobjective = \"goodput\"\ndwell_s = 0\n{ONE_CHIP}"));
    assert!(spec.solver.auto && spec.solver.enabled);
    assert_eq!((spec.solver.objective, spec.solver.dwell_s), (tessera_topology::SolverObjective::Goodput, 0));
    assert_eq!(spec_of(ONE_CHIP).solver, tessera_topology::SolverSpec::default());
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
        assert!(e.message.contains(&kind.name), "{} not listed: {e}", kind.name);
    }
}

#[test]
fn hosts_may_be_named_by_dns_and_keep_their_names() {
    let text = format!(
        "{}{}",
        with_line(5, "bus = \"tessera-h0-0.tessera-bus.default.svc.cluster.local:7400\""),
        SECOND_HOST.replace("127.0.0.1:7410", "tcp://Node-B:7410")
    );
    let spec = parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let h0 = &spec.hosts[0];
    assert_eq!(h0.bus.to_string(), "tessera-h0-0.tessera-bus.default.svc.cluster.local:7400");
    assert_eq!(h0.events.to_string(), "tessera-h0-0.tessera-bus.default.svc.cluster.local:7401", "bus port + 1");
    assert_eq!(h0.transfer.to_string(), "tessera-h0-0.tessera-bus.default.svc.cluster.local:7402", "bus port + 2");
    assert_eq!(spec.hosts[1].bus.to_string(), "node-b:7410", "names are case-insensitive");
    // A named host may be anywhere, so the planes are secured by default.
    assert_eq!(spec.security.mode, tessera_topology::SecurityMode::Encrypt);
    // Two hosts on one name and port clash like two on one IP address.
    let clash =
        format!("{}{}", with_line(5, "bus = \"node-b:7410\""), SECOND_HOST.replace("127.0.0.1:7410", "node-b:7410"));
    let err = parse(&clash, "t.toml").map(|_| ()).expect_err("one socket twice").to_string();
    assert!(err.contains("address node-b:7410 is already taken by `hosts[0].bus`"), "{err}");
}

#[test]
fn bad_addresses() {
    assert_error(&with_line(5, "bus = \"localhost\""), 5, 7, "hosts[0].bus", "not a HOST:PORT");
    assert_error(
        &with_line(5, "bus = \"node_0.svc:7400\""),
        5,
        7,
        "hosts[0].bus",
        "neither an IP address nor a DNS name",
    );
    assert_error(&with_line(5, "bus = \"127.0.0.1:0\""), 5, 7, "hosts[0].bus", "port 0");
    assert_error(&with_line(5, "bus = \"127.0.0.1:65535\""), 5, 7, "hosts[0].bus", "bus port + 1");
    assert_error(&format!("{ONE_CHIP}[gateway]\nlisten = \"0.0.0.0\"\n"), 11, 10, "gateway.listen", "not a HOST:PORT");
    assert_error(
        &format!("{ONE_CHIP}[gateway]\nlisten = \"gw.example:8000\"\n"),
        11,
        10,
        "gateway.listen",
        "this socket is bound, so give an IP address (\"0.0.0.0:8000\" for every interface)",
    );
    let tcp = parse(&with_line(5, "bus = \"tcp://127.0.0.1:7400\""), "t.toml").map(|spec| spec.hosts[0].events.clone());
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
        "0 is out of range 1..=1048576",
    );
    assert_error(
        &format!("{ONE_CHIP}max_batch_seqs = 0\n"),
        10,
        18,
        "hosts[0].chips[0].max_batch_seqs",
        "0 is out of range 1..=65536",
    );
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
        "0 is out of range 1..=1048576",
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
    assert_error(&text, 3, 9, "cluster.dtype", "unknown dtype `fp8`; expected f32, f16 or bf16");
    let text = with_line(2, "model = \"builtin:tiny\"\nkv_dtype = \"int4\"");
    assert_error(&text, 3, 12, "cluster.kv_dtype", "unknown dtype `int4`");
}

#[test]
fn bad_model_backend_and_role() {
    assert_error(&with_line(2, "model = \"builtin:huge\""), 2, 9, "cluster.model", "builtin:tiny, builtin:small");
    assert_error(&with_line(9, "backend = \"sim\""), 9, 11, "hosts[0].chips[0].backend", "not available yet");
    assert_error(&with_line(9, "backend = \"cuda\""), 9, 11, "hosts[0].chips[0].backend", "unknown backend");
    assert_error(&with_line(9, "backend = \"plugin:\""), 9, 11, "hosts[0].chips[0].backend", "needs the path");
    assert_error(
        &format!("{ONE_CHIP}role = \"decoder\""),
        10,
        8,
        "hosts[0].chips[0].role",
        "unknown role `decoder`; expected prefill, decode or both",
    );
    assert_error(
        &format!("{ONE_CHIP}role = \"prefill\""),
        10,
        8,
        "hosts[0].chips[0].role",
        "no chip can decode: every chip has role = \"prefill\"",
    );
}

#[test]
fn a_cluster_of_decode_chips_is_valid() {
    // Decode chips prefill short prompts themselves, and every prompt when no chip
    // prefills: such a cluster serves like a colocated one.
    let spec = spec_of(&format!("{ONE_CHIP}role = \"decode\"\n"));
    assert_eq!(spec.hosts[0].chips[0].role, Role::Decode);
}

#[test]
fn emulated_chips() {
    // The kind may be left out, or written equal to the emulated kind.
    for kind_line in ["", "kind = \"nvidia-h100\""] {
        let spec = spec_of(&with_line(8, kind_line).replace("backend = \"cpu\"", "backend = \"emu:nvidia-h100\""));
        let chip = &spec.hosts[0].chips[0];
        assert_eq!((chip.kind.as_str(), &chip.backend), ("nvidia-h100", &Backend::Emu("nvidia-h100".into())));
        assert_eq!(chip.backend.to_string(), "emu:nvidia-h100");
        assert_eq!(chip.backend.emulated_kind(), Some("nvidia-h100"));
        assert_eq!(spec.chip_kind(&chip.kind).map(|kind| kind.fp16_tflops), Some(989.0));
    }
    // (text, line, column, key, fragment)
    let table: &[(String, usize, usize, &str, &str)] = &[
        (
            with_line(9, "backend = \"emu:nvidia-h100\""),
            8,
            8,
            "hosts[0].chips[0].kind",
            "kind `cpu` differs from the kind the backend emulates (`emu:nvidia-h100`)",
        ),
        (
            with_line(9, "backend = \"emu:nvidia-b300\""),
            9,
            11,
            "hosts[0].chips[0].backend",
            "emulates an unknown chip kind `nvidia-b300`; known kinds: cpu, nvidia-a100",
        ),
        (with_line(9, "backend = \"emu:\""), 9, 11, "hosts[0].chips[0].backend", "unknown chip kind ``"),
        // Without an emu backend the kind is required (reported at the chip's header).
        (with_line(8, ""), 6, 1, "hosts[0].chips[0].kind", "missing field `kind` (it may be left out only"),
    ];
    for (text, line, column, key, fragment) in table {
        assert_error(text, *line, *column, key, fragment);
    }
}

#[test]
fn operator_chip_kinds() {
    let text =
        format!("{}{ACME}", with_line(9, "backend = \"emu:acme-x1\"").replace("kind = \"cpu\"", "kind = \"acme-x1\""));
    let spec = spec_of(&text);
    let chip = &spec.hosts[0].chips[0];
    assert_eq!((chip.kind.as_str(), &chip.backend), ("acme-x1", &Backend::Emu("acme-x1".into())));
    let kind = spec.chip_kind("acme-x1").map(|kind| {
        (
            kind.vendor.as_str(),
            kind.product.as_str(),
            kind.fp16_tflops,
            kind.memory_bytes,
            kind.memory_bw_gbs,
            kind.link_bw_gbs,
            kind.tdp_w,
            kind.confidence,
            kind.source.as_str(),
        )
    });
    assert_eq!(
        kind,
        Some((
            "operator-defined",
            "acme-x1",
            100.0,
            32 << 30,
            1000.0,
            100.0,
            300.0,
            Confidence::Unconfirmed,
            "acme datasheet"
        ))
    );
    assert_eq!(spec.chip_kinds.len(), 1);
    // Built-ins still resolve; the operator kind is not in the catalog.
    assert_eq!(spec.chip_kind("nvidia-a100").map(|kind| kind.memory_bw_gbs), Some(2039.0));
    assert!(catalog::lookup("acme-x1").is_none());
    assert!(spec.render().contains("chip kind acme-x1 (from this file)"));
    // Without the table, the kind is unknown (and the error does not list it).
    let e = error_of(&with_line(8, "kind = \"acme-x1\""));
    assert!(e.message.contains("unknown chip kind `acme-x1`; known kinds: cpu"), "{e}");

    let acme = |from: &str, to: &str| format!("{ONE_CHIP}{}", ACME.replace(from, to));
    // (text, line, column, key, fragment)
    let table: &[(String, usize, usize, &str, &str)] = &[
        (acme("fp16_tflops = 100.0", "fp16_tflops = 0.0"), 12, 15, "chip_kinds[0].fp16_tflops", "greater than 0"),
        (acme("fp16_tflops = 100.0", "fp16_tflops = nan"), 12, 15, "chip_kinds[0].fp16_tflops", "greater than 0"),
        (acme("memory_bw_gbs = 1000.0", "memory_bw_gbs = -5"), 14, 17, "chip_kinds[0].memory_bw_gbs", "greater than 0"),
        (acme("link_bw_gbs = 100.0", "link_bw_gbs = inf"), 15, 15, "chip_kinds[0].link_bw_gbs", "greater than 0"),
        (acme("tdp_w = 300.0", "tdp_w = 0"), 16, 9, "chip_kinds[0].tdp_w", "greater than 0"),
        (acme("\"32GiB\"", "0"), 13, 10, "chip_kinds[0].memory", "more than 0 bytes; a chip has some memory"),
        (acme("\"32GiB\"", "\"lots\""), 13, 10, "chip_kinds[0].memory", "not a memory size"),
        (acme("acme datasheet", ""), 17, 10, "chip_kinds[0].source", "must not be empty"),
        (
            acme("tdp_w = 300.0", "tdp_w = 300.0\nconfidence = \"measured\""),
            17,
            14,
            "chip_kinds[0].confidence",
            "unknown confidence `measured`; expected confirmed, unconfirmed or estimate",
        ),
        (acme("tdp_w = 300.0\n", ""), 10, 1, "chip_kinds[0].tdp_w", "missing field `tdp_w`"),
        (acme("tdp_w", "tdp_watts"), 16, 1, "chip_kinds[0].tdp_watts", "unknown field `tdp_watts`"),
        (acme("fp16_tflops = 100.0", "fp16_tflops = \"fast\""), 12, 15, "chip_kinds[0].fp16_tflops", "expected f64"),
        (
            acme("\"acme-x1\"", "\"nvidia-a100\""),
            11,
            8,
            "chip_kinds[0].name",
            "`nvidia-a100` is a built-in chip kind and keeps its catalog figures",
        ),
        (acme("\"acme-x1\"", "\"acme x1\""), 11, 8, "chip_kinds[0].name", "contains ' '"),
        (
            format!("{ONE_CHIP}{ACME}{ACME}"),
            19,
            8,
            "chip_kinds[1].name",
            "chip kind `acme-x1` is already defined by chip_kinds[0] (line 11)",
        ),
    ];
    for (text, line, column, key, fragment) in table {
        assert_error(text, *line, *column, key, fragment);
    }
    // Integers are fine where a figure is a float.
    let spec = spec_of(&format!("{ONE_CHIP}{}", ACME.replace("100.0", "100")));
    assert_eq!(spec.chip_kinds[0].fp16_tflops, 100.0);
}

#[test]
fn operator_chip_kinds_may_carry_a_price_with_its_source() {
    let priced = |keys: &str| format!("{ONE_CHIP}{ACME}{keys}");
    assert_eq!(spec_of(&priced("")).chip_kinds[0].price, None);
    let spec = spec_of(&priced("price_per_hour = 2.5\nprice_source = \"our contract, 2026\"\n"));
    let price = spec.chip_kinds[0].price.clone();
    assert_eq!(
        price.map(|p| (p.usd_per_hour, p.confidence, p.source)),
        Some((2.5, Confidence::Unconfirmed, "our contract, 2026".to_owned()))
    );
    assert!(spec.render().contains("$2.5/h (unconfirmed; our contract, 2026)"), "{}", spec.render());
    let spec = spec_of(&priced("price_per_hour = 3\nprice_confidence = \"estimate\"\nprice_source = \"estimate\"\n"));
    assert_eq!(spec.chip_kinds[0].price.as_ref().map(|p| p.confidence), Some(Confidence::Estimate));
    // Every built-in kind has a price, marked an estimate.
    assert!(catalog::kinds().iter().all(|k| k.price.as_ref().is_some_and(|p| p.confidence == Confidence::Estimate)));
    // (text, line, column, key, fragment)
    let table: &[(String, usize, usize, &str, &str)] = &[
        (priced("price_per_hour = 2.5\n"), 18, 18, "chip_kinds[0].price_per_hour", "needs price_source"),
        (priced("price_source = \"x\"\n"), 18, 16, "chip_kinds[0].price_source", "set without price_per_hour"),
        (
            priced("price_confidence = \"estimate\"\n"),
            18,
            20,
            "chip_kinds[0].price_confidence",
            "set without price_per_hour",
        ),
        (
            priced("price_per_hour = 0\nprice_source = \"x\"\n"),
            18,
            18,
            "chip_kinds[0].price_per_hour",
            "greater than 0",
        ),
        (
            priced("price_per_hour = 1e9\nprice_source = \"x\"\n"),
            18,
            18,
            "chip_kinds[0].price_per_hour",
            "outside 0.0001..=100000 $/h",
        ),
        (
            priced("price_per_hour = 1\nprice_source = \"\"\n"),
            19,
            16,
            "chip_kinds[0].price_source",
            "must not be empty",
        ),
    ];
    for (text, line, column, key, fragment) in table {
        assert_error(text, *line, *column, key, fragment);
    }
}

#[test]
fn the_documented_chip_kind_example_is_valid() {
    // Uncomment the [[chip_kinds]] example of default.toml and use it.
    let mut lines = Vec::new();
    let mut in_example = false;
    for line in DEFAULT_TOML.lines() {
        in_example = line == "# [[chip_kinds]]" || (in_example && line.starts_with("# "));
        lines.push(if in_example { &line[2..] } else { line });
    }
    let text = lines.join("\n").replace("backend = \"emu:metax-c500\"", "backend = \"emu:nvidia-l40s\"");
    let spec = spec_of(&text);
    assert_eq!(spec.hosts[1].chips[0].kind, "nvidia-l40s");
    let kind = spec.chip_kind("nvidia-l40s").map(|kind| (kind.fp16_tflops, kind.memory_bytes, kind.confidence));
    assert_eq!(kind, Some((362.0, 48 << 30, Confidence::Confirmed)));
}

#[test]
fn per_chip_kv_format() {
    let text = format!("{ONE_CHIP}block_size = 32\nkv_dtype = \"bf16\"\nkv_layout = \"token-major\"\n{SECOND_HOST}")
        .replace("model = \"builtin:tiny\"", "model = \"builtin:tiny\"\nblock_size = 8\nkv_dtype = \"f16\"");
    let spec = spec_of(&text);
    let formats: Vec<(usize, DType, KvLayout)> =
        spec.chips().map(|(_, _, chip)| (chip.block_size, chip.kv_dtype, chip.kv_layout)).collect();
    // The second chip inherits the cluster's block size and dtype, and head-major.
    assert_eq!(formats, [(32, DType::Bf16, KvLayout::TokenMajor), (8, DType::F16, KvLayout::HeadMajor)]);
    assert!(spec.render().contains("kv cache: blocks of 32 tokens, bf16, token-major"));

    for layout in KvLayout::ALL {
        assert_eq!(layout.to_string().parse::<KvLayout>().ok(), Some(layout));
    }
    let table: &[(&str, usize, &str, &str)] = &[
        ("block_size = 0", 14, "block_size", "0 is out of range 1..=4096"),
        ("block_size = 4097", 14, "block_size", "out of range"),
        ("kv_dtype = \"fp8\"", 12, "kv_dtype", "unknown dtype `fp8`; expected f32, f16 or bf16"),
        (
            "kv_layout = \"row-major\"",
            13,
            "kv_layout",
            "unknown kv layout `row-major`; expected head-major or token-major",
        ),
        ("kv_layout = 3", 13, "kv_layout", "expected a string"),
    ];
    for (line, column, key, fragment) in table {
        assert_error(&format!("{ONE_CHIP}{line}\n"), 10, *column, &format!("hosts[0].chips[0].{key}"), fragment);
    }
}

#[test]
fn emulation_and_disagg_defaults() {
    let spec = spec_of(ONE_CHIP);
    assert_eq!(spec.emulation, EmulationSpec::default());
    assert_eq!(
        (spec.emulation.time_scale, spec.emulation.compute_efficiency, spec.emulation.memory_efficiency),
        (1.0, 0.5, 0.8)
    );
    assert!(spec.emulation.perf_models.is_empty());
    assert_eq!(
        spec.disagg,
        DisaggSpec {
            min_prompt_tokens: 32,
            lease_ms: 5000,
            transport: TransportChoice::Auto,
            tcp_streams: 4,
            chunk_kib: 1024
        }
    );
    assert_eq!(spec.disagg.chunk_bytes(), 1 << 20);
    let spec = spec_of(&format!(
        "{ONE_CHIP}[emulation]\ntime_scale = 250\nmemory_efficiency = 1.0\n\
         [disagg]\nmin_prompt_tokens = 2\nlease_ms = 1\ntransport = \"tcp\"\ntcp_streams = 64\nchunk_kib = 65536\n"
    ));
    assert_eq!(spec.emulation, EmulationSpec { time_scale: 250.0, memory_efficiency: 1.0, ..EmulationSpec::default() });
    assert_eq!(
        spec.disagg,
        DisaggSpec {
            min_prompt_tokens: 2,
            lease_ms: 1,
            transport: TransportChoice::Tcp,
            tcp_streams: 64,
            chunk_kib: 65536
        }
    );
    for transport in TransportChoice::ALL {
        assert_eq!(transport.to_string().parse::<TransportChoice>().ok(), Some(transport));
    }
}

#[test]
fn bad_emulation_and_disagg_values() {
    // (table, line, column, key, fragment), the line being line 11.
    let table: &[(&str, &str, usize, &str, &str)] = &[
        ("emulation", "time_scale = 0.0", 14, "time_scale", "0 is out of range: more than 0 and at most 1000000"),
        ("emulation", "time_scale = -1", 14, "time_scale", "more than 0 and at most 1000000"),
        ("emulation", "time_scale = nan", 14, "time_scale", "NaN is out of range"),
        ("emulation", "time_scale = inf", 14, "time_scale", "inf is out of range"),
        ("emulation", "time_scale = 1e300", 14, "time_scale", "1e300 is out of range: more than 0 and at most 1000000"),
        ("emulation", "time_scale = 1000001", 14, "time_scale", "out of range"),
        ("emulation", "compute_efficiency = 1.5", 22, "compute_efficiency", "at least 0.01 and at most 1"),
        ("emulation", "compute_efficiency = 0", 22, "compute_efficiency", "at least 0.01 and at most 1"),
        ("emulation", "compute_efficiency = 1e-300", 22, "compute_efficiency", "1e-300 must be a fraction of peak"),
        ("emulation", "memory_efficiency = 1.01", 21, "memory_efficiency", "at most 1"),
        ("emulation", "memory_efficiency = 0.009", 21, "memory_efficiency", "at least 0.01"),
        ("emulation", "speed = 2", 1, "speed", "unknown field `speed`"),
        ("disagg", "min_prompt_tokens = 1", 21, "min_prompt_tokens", "1 is below 2"),
        ("disagg", "min_prompt_tokens = 16777217", 21, "min_prompt_tokens", "out of range 2..=16777216"),
        ("disagg", "lease_ms = 0", 12, "lease_ms", "0 is out of range 1..=86400000 (ms; at most one day)"),
        ("disagg", "lease_ms = 86400001", 12, "lease_ms", "out of range 1..=86400000"),
        ("disagg", "transport = \"rdma\"", 13, "transport", "unknown transport `rdma`; expected auto, shm or tcp"),
        ("disagg", "tcp_streams = 0", 15, "tcp_streams", "out of range 1..=64"),
        ("disagg", "tcp_streams = 65", 15, "tcp_streams", "out of range 1..=64"),
        ("disagg", "chunk_kib = 0", 13, "chunk_kib", "out of range 1..=65536"),
        ("disagg", "chunk_kib = 65537", 13, "chunk_kib", "out of range"),
        ("disagg", "lease_ms = -3", 12, "lease_ms", "expected u64"),
    ];
    for (table, line, column, key, fragment) in table {
        assert_error(&format!("{ONE_CHIP}[{table}]\n{line}\n"), 11, *column, &format!("{table}.{key}"), fragment);
    }
}

#[test]
fn transfer_addresses() {
    let spec = spec_of(&format!("{ONE_CHIP}{SECOND_HOST}"));
    let transfers: Vec<String> = spec.hosts.iter().map(|host| host.transfer.to_string()).collect();
    assert_eq!(transfers, ["127.0.0.1:7402", "127.0.0.1:7412"]);
    let set = with_line(5, "bus = \"127.0.0.1:7400\"\ntransfer = \"127.0.0.1:9000\"");
    assert_eq!(spec_of(&set).hosts[0].transfer.to_string(), "127.0.0.1:9000");

    // h1's bus on h0's defaulted transfer port.
    assert_error(
        &format!("{ONE_CHIP}{}", SECOND_HOST.replace("7410", "7402")),
        12,
        7,
        "hosts[1].bus",
        "already taken by `hosts[0].transfer` (by default: the bus port + 2) (line 5)",
    );
    assert_error(
        &with_line(5, "bus = \"127.0.0.1:7400\"\ntransfer = \"127.0.0.1:7400\""),
        6,
        12,
        "hosts[0].transfer",
        "address 127.0.0.1:7400 is already taken by `hosts[0].bus` (line 5)",
    );
    assert_error(
        &with_line(5, "bus = \"127.0.0.1:7400\"\ntransfer = \"127.0.0.1:7401\""),
        6,
        12,
        "hosts[0].transfer",
        "already taken by `hosts[0].events` (by default: the bus port + 1) (line 5)",
    );
    assert_error(
        &with_line(5, "bus = \"127.0.0.1:7400\"\ntransfer = \"localhost\""),
        6,
        12,
        "hosts[0].transfer",
        "not a HOST:PORT",
    );
    assert_error(
        &with_line(5, "bus = \"127.0.0.1:65534\""),
        5,
        7,
        "hosts[0].bus",
        "`transfer` defaults to the bus port + 2",
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
    assert_eq!((spec.kv_dtype, spec.block_size, spec.dtype), (DType::F16, 16, None));
    assert_eq!(spec.gateway.host, "h0");
    assert_eq!(spec.gateway.listen.to_string(), "127.0.0.1:8000");
    assert_eq!((spec.supervisor.heartbeat_interval_ms, spec.supervisor.heartbeat_timeout_ms), (100, 1000));
    let c0 = &spec.hosts[0].chips[0];
    assert_eq!((c0.role, c0.memory_limit_bytes, c0.threads), (Role::Prefill, Some(512 << 20), 4));
    assert_eq!((c0.max_batch_tokens, c0.max_batch_seqs), (512, 64));
    assert_eq!((c0.block_size, c0.kv_dtype, c0.kv_layout), (16, DType::F16, KvLayout::HeadMajor));
    let c1 = &spec.hosts[1].chips[0];
    assert_eq!((c1.role, &c1.backend), (Role::Decode, &Backend::Plugin(PathBuf::from("kernels/libx.so"))));
    assert_eq!(spec.hosts[0].transfer.to_string(), "127.0.0.1:7402");
    assert!(spec.chip_kinds.is_empty());
    assert_eq!(spec.host_index("h1"), Some(1));
    assert_eq!(spec.host_index("h9"), None);
}

#[test]
fn default_topology_is_heterogeneous_and_disaggregated() {
    let spec = default_topology();
    assert_eq!((spec.name.as_str(), spec.model.as_str()), ("default", "builtin:tiny"));
    let hosts: Vec<(&str, String, String, String)> = spec
        .hosts
        .iter()
        .map(|host| (host.name.as_str(), host.bus.to_string(), host.events.to_string(), host.transfer.to_string()))
        .collect();
    assert_eq!(
        hosts,
        [
            ("h0", "127.0.0.1:7400".into(), "127.0.0.1:7401".into(), "127.0.0.1:7402".into()),
            ("h1", "127.0.0.1:7410".into(), "127.0.0.1:7411".into(), "127.0.0.1:7412".into())
        ]
    );
    let chips: Vec<(&str, &str, String, Role, usize)> = spec
        .chips()
        .map(|(_, _, chip)| (chip.id.as_str(), chip.kind.as_str(), chip.backend.to_string(), chip.role, chip.threads))
        .collect();
    assert_eq!(
        chips,
        [
            ("h0-ascend0", "ascend-910b", "emu:ascend-910b".into(), Role::Prefill, 1),
            ("h1-metax0", "metax-c500", "emu:metax-c500".into(), Role::Decode, 1)
        ]
    );
    // The chips disagree on KV block size and layout, not on dtype (exact greedy outputs).
    let formats: Vec<(usize, DType, KvLayout)> =
        spec.chips().map(|(_, _, chip)| (chip.block_size, chip.kv_dtype, chip.kv_layout)).collect();
    assert_eq!(formats, [(16, DType::F32, KvLayout::HeadMajor), (32, DType::F32, KvLayout::TokenMajor)]);
    // The pairing the file justifies: more FLOPS prefill, more bandwidth decode.
    let figures = |kind: &str| spec.chip_kind(kind).map_or((0.0, 0.0), |kind| (kind.fp16_tflops, kind.memory_bw_gbs));
    let (ascend, metax) = (figures("ascend-910b"), figures("metax-c500"));
    assert!(ascend.0 > metax.0 && metax.1 > ascend.1, "{ascend:?} {metax:?}");
    assert_eq!(spec.emulation.time_scale, 5000.0);
    assert_eq!(spec.disagg, DisaggSpec::default());
    assert_eq!((spec.gateway.host.as_str(), spec.gateway.listen.to_string()), ("h0", "127.0.0.1:8000".to_owned()));

    let rendered = spec.render();
    for needle in [
        "default",
        "builtin:tiny",
        "host h0",
        "host h1",
        "chip h0-ascend0: ascend-910b on emu:ascend-910b, role prefill",
        "chip h1-metax0: metax-c500 on emu:metax-c500, role decode",
        "transfer 127.0.0.1:7412",
        "Huawei Ascend 910B (910B2): 354 TFLOPS fp16, 64 GiB, 1600 GB/s",
        "emulation: time x 5000",
        "127.0.0.1:8000",
    ] {
        assert!(rendered.contains(needle), "{needle} not in:\n{rendered}");
    }
}

#[test]
fn every_key_of_the_default_topology_is_commented() {
    // Each `key = value` line has a comment line somewhere in the run of comments and
    // keys it belongs to, or the same key was explained earlier in the file.
    let mut explained: Vec<&str> = Vec::new();
    let mut comment_seen = false;
    for line in DEFAULT_TOML.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('[') {
            comment_seen = false;
        } else if line.starts_with('#') {
            comment_seen = true;
        } else if let Some((key, _)) = line.split_once('=') {
            let key = key.trim();
            assert!(comment_seen || explained.contains(&key), "`{key}` has no comment");
            explained.push(key);
        }
    }
}

/// A fresh directory with a checkpoint directory `ckpt/tiny` and a kernel library
/// `lib/libk.so` (empty: `load` checks that paths exist, not what they hold).
fn paths_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let made = std::fs::create_dir_all(dir.path().join("ckpt/tiny"))
        .and_then(|()| std::fs::create_dir_all(dir.path().join("lib")))
        .and_then(|()| std::fs::write(dir.path().join("lib/libk.so"), b""));
    made.unwrap_or_else(|e| panic!("{e}"));
    dir
}

/// Writes `text` to `dir/cluster.toml` and loads it.
fn load_in(dir: &std::path::Path, text: &str) -> Result<(ClusterSpec, PathReport), TopologyError> {
    let path = dir.join("cluster.toml");
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write: {e}"));
    load_with_report(&path)
}

/// h1 of [`SECOND_HOST`] on an address no machine has (TEST-NET-1, RFC 5737): a host
/// that runs elsewhere.
fn remote_second_host(backend: &str) -> String {
    SECOND_HOST.replace("127.0.0.1:7410", "192.0.2.1:7410").replace("backend = \"cpu\"", backend)
}

#[test]
fn load_resolves_relative_paths_against_the_file() {
    let dir = paths_dir();
    let text =
        ONE_CHIP.replace("builtin:tiny", "ckpt/tiny").replace("backend = \"cpu\"", "backend = \"plugin:lib/libk.so\"");
    // An absolute path on a host of another machine: not checked here.
    let text = format!("{text}{}", remote_second_host("backend = \"plugin:/abs/libk.so\""));
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

#[test]
fn every_example_topology_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let spec = tessera_topology::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(!spec.hosts.is_empty(), "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen > 0, "no example in {}", dir.display());
}

#[test]
fn load_reports_which_hosts_paths_it_checked() {
    let dir = paths_dir();
    let text =
        ONE_CHIP.replace("builtin:tiny", "ckpt/tiny").replace("backend = \"cpu\"", "backend = \"plugin:lib/libk.so\"");
    let text = format!("{text}{}", remote_second_host("backend = \"plugin:/abs/libk.so\""));
    let (_, report) = load_in(dir.path(), &text).unwrap_or_else(|e| panic!("{e}"));
    let (ckpt, lib) = (dir.path().join("ckpt/tiny"), dir.path().join("lib/libk.so"));
    assert_eq!(
        report,
        PathReport {
            hosts: vec![
                HostPaths {
                    host: "h0".into(),
                    bus: "127.0.0.1:7400".parse().unwrap_or_else(|e| panic!("{e}")),
                    local: true,
                    paths: vec![ckpt.clone(), lib.clone()],
                },
                HostPaths {
                    host: "h1".into(),
                    bus: "192.0.2.1:7410".parse().unwrap_or_else(|e| panic!("{e}")),
                    local: false,
                    paths: vec![ckpt.clone(), PathBuf::from("/abs/libk.so")],
                },
            ]
        }
    );
    let rendered = report.render();
    for needle in [
        format!("host h0 (bus 127.0.0.1:7400): on this machine; checked: {}, {}", ckpt.display(), lib.display()),
        format!(
            "host h1 (bus 192.0.2.1:7410): not on this machine; NOT checked here: {}, /abs/libk.so",
            ckpt.display()
        ),
    ] {
        assert!(rendered.contains(&needle), "{needle} not in:\n{rendered}");
    }
    // A builtin model and cpu chips need no path.
    let (_, report) = load_in(dir.path(), ONE_CHIP).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.render().contains("host h0 (bus 127.0.0.1:7400): on this machine; checked: none needed"));
    // `parse` checks no path.
    assert!(parse(&text.replace("lib/libk.so", "missing.so"), "t.toml").is_ok());
}

#[test]
fn load_refuses_missing_local_paths() {
    let dir = paths_dir();
    let cluster_toml = dir.path().join("cluster.toml").display().to_string();
    let (missing_lib, missing_ckpt) = (dir.path().join("nope/libk.so"), dir.path().join("nope/ckpt"));
    let plugin = |path: &str| with_line(9, &format!("backend = \"plugin:{path}\""));
    let model = |path: &str| with_line(2, &format!("model = \"{path}\""));
    // (text, line, column, key, fragment)
    let table: &[(String, usize, usize, &str, String)] = &[
        (
            plugin("nope/libk.so"),
            9,
            11,
            "hosts[0].chips[0].backend",
            format!(
                "kernel library `{}` does not exist on this machine, where host `h0` runs (bus 127.0.0.1:7400 is local)",
                missing_lib.display()
            ),
        ),
        (plugin("lib"), 9, 11, "hosts[0].chips[0].backend", "is not a file; `plugin:` needs the path".to_owned()),
        (
            model("nope/ckpt"),
            2,
            9,
            "cluster.model",
            format!("model `{}` does not exist on this machine", missing_ckpt.display()),
        ),
        (model("lib/libk.so"), 2, 9, "cluster.model", "is neither a checkpoint directory nor a GGUF file".to_owned()),
        // The model directory is checked when any host runs here, not only the first.
        (
            format!("{}{SECOND_HOST}", model("nope/ckpt").replace("127.0.0.1:7400", "192.0.2.1:7400")),
            2,
            9,
            "cluster.model",
            "where host `h1` runs (bus 127.0.0.1:7410 is local)".to_owned(),
        ),
        // A missing library on the second (local) host.
        (
            format!("{ONE_CHIP}{}", SECOND_HOST.replace("backend = \"cpu\"", "backend = \"plugin:/nope/libk.so\"")),
            16,
            11,
            "hosts[1].chips[0].backend",
            "kernel library `/nope/libk.so` does not exist".to_owned(),
        ),
    ];
    for (text, line, column, key, fragment) in table {
        let e = match load_in(dir.path(), text) {
            Ok((spec, _)) => panic!("expected an error, got {spec:#?}"),
            Err(e) => e,
        };
        assert_eq!((e.file.as_str(), e.line, e.column, e.key.as_str()), (cluster_toml.as_str(), *line, *column, *key));
        assert!(e.message.contains(fragment.as_str()), "`{fragment}` not in: {e}");
        assert!(e.to_string().starts_with(&format!("{cluster_toml}:{line}:{column}: `{key}`: ")), "{e}");
    }
    // The same paths on a host of another machine are left to that machine.
    let text = format!(
        "{}{}",
        ONE_CHIP.replace("builtin:tiny", "nope/ckpt").replace("127.0.0.1:7400", "192.0.2.1:7400"),
        remote_second_host("backend = \"plugin:/nope/libk.so\"")
    );
    let report = load_in(dir.path(), &text).map(|(_, report)| report).map_err(|e| e.to_string());
    assert_eq!(report.map(|report| report.hosts.iter().filter(|host| host.local).count()), Ok(0));
}

#[test]
fn hostile_numbers_are_refused_where_they_are_written() {
    let acme = |from: &str, to: &str| format!("{ONE_CHIP}{}", ACME.replace(from, to));
    let section = |table: &str, line: &str| format!("{ONE_CHIP}[{table}]\n{line}\n");
    let chip = |line: &str| format!("{ONE_CHIP}{line}\n");
    // (text, line, column, key, fragment)
    let table: &[(String, usize, usize, &str, &str)] = &[
        // Paced steps (modelled seconds x time_scale) that no Duration holds.
        (
            section("emulation", "time_scale = 1e300"),
            11,
            14,
            "emulation.time_scale",
            "1e300 is out of range: more than 0 and at most 1000000",
        ),
        (
            acme("fp16_tflops = 100.0", "fp16_tflops = 1e-300"),
            12,
            15,
            "chip_kinds[0].fp16_tflops",
            "1e-300 TFLOPS is outside 0.001..=100000 TFLOPS, the range of real chips",
        ),
        (
            acme("memory_bw_gbs = 1000.0", "memory_bw_gbs = 1e-300"),
            14,
            17,
            "chip_kinds[0].memory_bw_gbs",
            "1e-300 GB/s is outside 0.1..=100000 GB/s",
        ),
        (acme("fp16_tflops = 100.0", "fp16_tflops = 1e6"), 12, 15, "chip_kinds[0].fp16_tflops", "outside"),
        (acme("link_bw_gbs = 100.0", "link_bw_gbs = 0.001"), 15, 15, "chip_kinds[0].link_bw_gbs", "outside"),
        (acme("tdp_w = 300.0", "tdp_w = 1e9"), 16, 9, "chip_kinds[0].tdp_w", "1e9 W is outside 0.1..=100000 W"),
        (
            acme("\"32GiB\"", "\"2048TiB\""),
            13,
            10,
            "chip_kinds[0].memory",
            "2251799813685248 bytes is out of range: from 1 MiB to 1 PiB",
        ),
        (acme("\"32GiB\"", "1024"), 13, 10, "chip_kinds[0].memory", "from 1 MiB to 1 PiB"),
        // Timers that overflow an Instant.
        (
            section("supervisor", "heartbeat_interval_ms = 9223372036854775807"),
            11,
            25,
            "supervisor.heartbeat_interval_ms",
            "9223372036854775807 is out of range 1..=86400000 (ms; at most one day)",
        ),
        (
            section("supervisor", "heartbeat_timeout_ms = 86400001"),
            11,
            24,
            "supervisor.heartbeat_timeout_ms",
            "out of range 1..=86400000",
        ),
        (
            section("supervisor", "restart_backoff_ms = 9223372036854775807"),
            11,
            22,
            "supervisor.restart_backoff_ms",
            "out of range 0..=86400000",
        ),
        (
            section("supervisor", "restart_window_s = 86401"),
            11,
            20,
            "supervisor.restart_window_s",
            "86401 is out of range 1..=86400 (s; at most one day)",
        ),
        (section("supervisor", "restart_window_s = 0"), 11, 20, "supervisor.restart_window_s", "out of range"),
        (section("supervisor", "max_restarts = 4000000000"), 11, 16, "supervisor.max_restarts", "0..=10000"),
        (section("disagg", "lease_ms = 9223372036854775807"), 11, 12, "disagg.lease_ms", "at most one day"),
        // Counts that wrap a product.
        (
            chip("max_batch_seqs = 9007199254740992"),
            10,
            18,
            "hosts[0].chips[0].max_batch_seqs",
            "9007199254740992 is out of range 1..=65536",
        ),
        (
            chip("max_batch_tokens = 1048577"),
            10,
            20,
            "hosts[0].chips[0].max_batch_tokens",
            "1048577 is out of range 1..=1048576",
        ),
        (
            chip("memory_limit = 9223372036854775807"),
            10,
            16,
            "hosts[0].chips[0].memory_limit",
            "9223372036854775807 bytes is out of range: from 1 byte to 1 PiB",
        ),
        (chip("memory_limit = \"1025TiB\""), 10, 16, "hosts[0].chips[0].memory_limit", "to 1 PiB"),
        (section("router", "max_queued_requests = 1048577"), 11, 23, "router.max_queued_requests", "1..=1048576"),
        (section("router", "kv_breaker_percent = 0"), 11, 22, "router.kv_breaker_percent", "1..=100"),
        (section("router", "kv_breaker_percent = 101"), 11, 22, "router.kv_breaker_percent", "1..=100"),
        (section("router", "max_queued_prompt_ms = 0"), 11, 24, "router.max_queued_prompt_ms", "1..=3600000"),
        (section("router", "max_waiting_requests = 1048577"), 11, 24, "router.max_waiting_requests", "0..=1048576"),
        (section("router", "queue_timeout_ms = 0"), 11, 20, "router.queue_timeout_ms", "at most one day"),
        (
            section("gateway", "max_inflight_requests = 9007199254740992"),
            11,
            25,
            "gateway.max_inflight_requests",
            "out of range 1..=1048576",
        ),
    ];
    for (text, line, column, key, fragment) in table {
        assert_error(text, *line, *column, key, fragment);
    }
    // The largest values of every range are valid.
    let spec = spec_of(&format!(
        "{ONE_CHIP}max_batch_tokens = 1048576\nmax_batch_seqs = 65536\nmemory_limit = \"1024TiB\"\n\
         [supervisor]\nheartbeat_interval_ms = 86399999\nheartbeat_timeout_ms = 86400000\n\
         restart_window_s = 86400\nrestart_backoff_ms = 86400000\nmax_restarts = 10000\n\
         [emulation]\ntime_scale = 1e6\n"
    ));
    let c0 = &spec.hosts[0].chips[0];
    assert_eq!((c0.max_batch_tokens, c0.max_batch_seqs, c0.memory_limit_bytes), (1 << 20, 1 << 16, Some(1 << 50)));
    assert_eq!(spec.emulation.time_scale, 1e6);
}

#[test]
fn an_emulated_chip_whose_pace_exceeds_a_day_is_refused() {
    // Every figure and the time scale are in range, but together they pace one decode
    // step of a 7B model at ~195 s x 1000.
    let slow_acme = ACME.replace("fp16_tflops = 100.0", "fp16_tflops = 0.001").replace("1000.0", "0.1");
    let chip = with_line(9, "backend = \"emu:acme-x1\"").replace("kind = \"cpu\"", "kind = \"acme-x1\"");
    let text = format!("{chip}{slow_acme}[emulation]\ntime_scale = 1000\n");
    assert_error(
        &text,
        9,
        11,
        "hosts[0].chips[0].backend",
        "`emu:acme-x1` paces too slowly: at 0.1 GB/s x memory_efficiency 0.8, times emulation.time_scale 1000, one \
         decode step of a 7B-parameter model at 4096 tokens of context would take 195310 s, more than a \
         day (86400 s)",
    );
    // At a smaller scale, or with a catalog chip at the largest scale, it paces.
    assert!(parse(&text.replace("time_scale = 1000", "time_scale = 100"), "t.toml").is_ok());
    let h100 = with_line(9, "backend = \"emu:nvidia-h100\"").replace("kind = \"cpu\"\n", "");
    let spec = spec_of(&format!("{h100}[emulation]\ntime_scale = 1e6\n"));
    assert_eq!(spec.emulation.time_scale, 1e6);
    // A cpu chip is not paced: a slow kind there is fine.
    assert!(
        parse(&format!("{}{slow_acme}[emulation]\ntime_scale = 1e6\n", with_line(8, "kind = \"acme-x1\"")), "t.toml")
            .is_ok()
    );
}

#[test]
fn gateway_and_bus_limits() {
    let spec = spec_of(ONE_CHIP);
    let gateway = &spec.gateway;
    assert_eq!(
        (gateway.max_connections, gateway.header_read_timeout_ms, gateway.max_prompt_bytes),
        (1024, 10_000, None)
    );
    assert_eq!(spec.bus, BusSpec { max_frame_bytes: 16 << 20, handshake_timeout_ms: 5000, resolve_timeout_ms: 60_000 });
    assert_eq!(spec.bus, BusSpec::default());
    let spec = spec_of(&format!(
        "{ONE_CHIP}[gateway]\nmax_connections = 65536\nheader_read_timeout_ms = 100\nmax_prompt_bytes = 1073741824\n\
         [bus]\nmax_frame_bytes = 4096\nhandshake_timeout_ms = 600000\nresolve_timeout_ms = 0\n"
    ));
    let gateway = &spec.gateway;
    assert_eq!(
        (gateway.max_connections, gateway.header_read_timeout_ms, gateway.max_prompt_bytes),
        (65_536, 100, Some(1 << 30))
    );
    assert_eq!(spec.bus, BusSpec { max_frame_bytes: 4096, handshake_timeout_ms: 600_000, resolve_timeout_ms: 0 });
    let rendered = spec.render();
    assert!(rendered.contains("over 65536 connections, headers within 100 ms, prompts of at most 1073741824 bytes"));
    assert!(rendered.contains("bus: frames of at most 4096 bytes, handshakes within 600000 ms"), "{rendered}");

    // (table, line, column, key, fragment), the line being line 11.
    let table: &[(&str, &str, usize, &str, &str)] = &[
        ("gateway", "max_connections = 0", 19, "max_connections", "0 is out of range 1..=65536"),
        ("gateway", "max_connections = 65537", 19, "max_connections", "65537 is out of range 1..=65536"),
        ("gateway", "header_read_timeout_ms = 99", 26, "header_read_timeout_ms", "99 is out of range 100..=600000"),
        ("gateway", "header_read_timeout_ms = 600001", 26, "header_read_timeout_ms", "out of range 100..=600000"),
        ("gateway", "header_read_timeout_ms = -1", 26, "header_read_timeout_ms", "expected u64"),
        ("gateway", "max_prompt_bytes = 0", 20, "max_prompt_bytes", "0 is out of range 1..=1073741824"),
        ("gateway", "max_prompt_bytes = 1073741825", 20, "max_prompt_bytes", "out of range 1..=1073741824"),
        ("gateway", "max_prompt_tokens = 5", 1, "max_prompt_tokens", "unknown field `max_prompt_tokens`"),
        ("bus", "max_frame_bytes = 4095", 19, "max_frame_bytes", "4095 is out of range 4096..=1073741824"),
        ("bus", "max_frame_bytes = 1073741825", 19, "max_frame_bytes", "out of range 4096..=1073741824"),
        ("bus", "handshake_timeout_ms = 99", 24, "handshake_timeout_ms", "99 is out of range 100..=600000"),
        ("bus", "handshake_timeout_ms = 600001", 24, "handshake_timeout_ms", "out of range 100..=600000"),
        ("bus", "max_frame_kib = 4", 1, "max_frame_kib", "unknown field `max_frame_kib`"),
    ];
    for (table, line, column, key, fragment) in table {
        assert_error(&format!("{ONE_CHIP}[{table}]\n{line}\n"), 11, *column, &format!("{table}.{key}"), fragment);
    }
}

#[test]
fn a_chip_quantizes_its_weights_and_kv_peers_must_agree() {
    let q8 = |role: &str| format!("role = \"{role}\"\nquantize = \"q8_0\"\n");
    // Lines 1-9, then chip c0's role and quantize (10-11), then host h1 (12-18) and c1's.
    let text = format!("{ONE_CHIP}{}{SECOND_HOST}{}", q8("prefill"), q8("decode"));
    let spec = spec_of(&text);
    let chips: Vec<_> = spec.hosts.iter().flat_map(|h| &h.chips).map(|c| c.quantize).collect();
    assert_eq!(chips, [Some(tessera_topology::Quantize::Q8_0); 2]);
    assert_eq!(spec_of(ONE_CHIP).hosts[0].chips[0].quantize, None);
    // A decode chip that keeps float weights cannot continue a q8_0 prefill.
    let text = format!("{ONE_CHIP}{}{SECOND_HOST}role = \"decode\"\nquantize = \"q4_0\"\n", q8("prefill"));
    assert_error(&text, 20, 12, "hosts[1].chips[0].quantize", "must load the same weights");
    // A chip with role both runs whole requests: it may differ.
    let text = format!("{ONE_CHIP}{}{SECOND_HOST}role = \"both\"\n", q8("prefill"));
    let spec = spec_of(&text.replace("role = \"prefill\"", "role = \"decode\""));
    assert_eq!(spec.hosts[1].chips[0].quantize, None);
    // Only the formats Tessera quantizes to.
    assert_error(
        &with_line(9, "backend = \"cpu\"\nquantize = \"q4_k\""),
        10,
        12,
        "hosts[0].chips[0].quantize",
        "q8_0 or q4_0",
    );
}

#[test]
fn a_chip_chooses_the_arithmetic_of_its_prompts() {
    use tessera_topology::MatmulPrecision;
    assert_eq!(spec_of(ONE_CHIP).hosts[0].chips[0].matmul_precision, MatmulPrecision::F32);
    let spec = spec_of(&format!("{ONE_CHIP}matmul_precision = \"bf16\"\n"));
    assert_eq!(spec.hosts[0].chips[0].matmul_precision, MatmulPrecision::Bf16);
    assert_error(
        &format!("{ONE_CHIP}matmul_precision = \"fp8\"\n"),
        10,
        20,
        "hosts[0].chips[0].matmul_precision",
        "unknown matmul precision `fp8`; expected f32 or bf16",
    );
}

/// `[emulation.perf_models]` points a chip kind at a calibrated model: its chips are
/// paced by it (here, decode steps twice as slow at half the memory efficiency), files
/// are read relative to the topology file, and every mistake names the key.
#[test]
fn a_chip_kind_is_paced_by_its_calibrated_model_file() {
    use tessera_topology::perf::{Curve, Efficiency, PerfModel, REFERENCE_MODEL, StepShape};
    let dir = tempfile::tempdir().expect("temp dir");
    let flat = PerfModel::flat(0.5, 0.8);
    let slow = PerfModel { decode: Efficiency { memory: Curve::flat(0.4), ..flat.decode }, ..flat };
    std::fs::write(dir.path().join("910b.toml"), toml::to_string(&slow).expect("toml")).expect("write");
    std::fs::write(dir.path().join("bad.toml"), "overlap = 7\n").expect("write");
    let topology = |perf: &str| {
        format!(
            "[cluster]\nmodel = \"builtin:tiny\"\n[emulation]\ntime_scale = 100.0\n[emulation.perf_models]\n{perf}\n\
             [[hosts]]\nname = \"h0\"\nbus = \"127.0.0.1:7400\"\n[[hosts.chips]]\nid = \"p\"\nbackend = \"emu:ascend-910b\"\n"
        )
    };
    let path = dir.path().join("t.toml");
    std::fs::write(&path, topology("ascend-910b = \"910b.toml\"")).expect("write");
    let spec = tessera_topology::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.emulation.perf_models.get("ascend-910b"), Some(&slow));
    assert_eq!(spec.emulation.perf_model_of("ascend-910b"), slow);
    assert_eq!(spec.emulation.perf_model_of("metax-c500"), flat, "other kinds keep the flat efficiencies");
    let kind = spec.chip_kind("ascend-910b").expect("a catalog kind");
    let model = REFERENCE_MODEL;
    let step = StepShape::decode(1, 512);
    let calibrated = spec.emulation.roofline(kind, &model, &step).time_s;
    let default = EmulationSpec { time_scale: 100.0, ..EmulationSpec::default() }.roofline(kind, &model, &step).time_s;
    assert!((calibrated / default - 2.0).abs() < 0.01, "{calibrated} vs {default}");
    // Read relative to the file a topology is written in, for one inside a scenario.
    let inline = tessera_topology::parse_in(&topology("ascend-910b = \"910b.toml\""), "s.toml", dir.path());
    assert_eq!(inline.map(|s| s.emulation.perf_models.len()).ok(), Some(1));

    for (perf, key, fragment) in [
        ("meteor-9000 = \"910b.toml\"", "emulation.perf_models.meteor-9000", "no chip kind `meteor-9000`"),
        ("ascend-910b = \"missing.toml\"", "emulation.perf_models.ascend-910b", "cannot read performance model"),
        ("ascend-910b = \"bad.toml\"", "emulation.perf_models.ascend-910b", "bad.toml"),
    ] {
        std::fs::write(&path, topology(perf)).expect("write");
        let e = tessera_topology::load(&path).err().unwrap_or_else(|| panic!("accepted: {perf}"));
        assert_eq!((e.line, e.key.as_str()), (6, key), "{e}");
        assert!(e.message.contains(fragment), "`{fragment}` not in {e}");
    }
    // A kind no chip of this machine's hosts has is not read here: its hosts read it.
    std::fs::write(&path, topology("metax-c500 = \"missing.toml\"")).expect("write");
    assert!(tessera_topology::load(&path).is_ok());
}

/// Host `h0` with chips `a`, `b`, `c`, `d` (lines 1-21), then `[[instances]]` lines.
fn instance_file(instances: &str) -> String {
    let mut text =
        String::from("[cluster]\nmodel = \"builtin:tiny\"\n[[hosts]]\nname = \"h0\"\nbus = \"127.0.0.1:7400\"\n");
    for id in ["a", "b", "c", "d"] {
        text += &format!("[[hosts.chips]]\nid = \"{id}\"\nkind = \"cpu\"\nbackend = \"cpu\"\n");
    }
    text + instances
}

#[test]
fn an_instance_folds_its_chips_into_one_chip_of_the_cluster() {
    let spec = spec_of(&instance_file(
        "[[instances]]\nid = \"pp\"\nchips = [\"b\", \"c\", \"d\", \"a\"]\ntp = 2\nsplit = [3, 1]\nrole = \"decode\"\n",
    ));
    let chips = &spec.hosts[0].chips;
    assert_eq!(chips.len(), 1, "{chips:#?}");
    let pp = &chips[0];
    assert_eq!((pp.id.as_str(), pp.role, pp.threads), ("pp", Role::Decode, 4));
    let par = pp.parallel.as_ref().expect("an instance");
    assert_eq!((par.tp, par.split.clone(), par.stages()), (2, Some(vec![3, 1]), 2));
    let ids = |s: usize| par.stage(s).iter().map(|c| c.id.clone()).collect::<Vec<_>>();
    assert_eq!((ids(0), ids(1)), (vec!["b".to_string(), "c".into()], vec!["d".to_string(), "a".into()]));
    // `split` left out is "auto"; the other chips stay where they were.
    let spec = spec_of(&instance_file("[[instances]]\nid = \"pp\"\nchips = [\"c\", \"d\"]\n"));
    let ids: Vec<&str> = spec.hosts[0].chips.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "pp"]);
    assert_eq!(spec.hosts[0].chips[2].parallel.as_ref().map(|p| p.split.clone()), Some(None));
}

#[test]
fn instances_that_cannot_work_are_refused_at_their_key() {
    let cases = [
        ("id = \"a\"\nchips = [\"b\", \"c\"]", "instances[0].id", "already the id of a chip"),
        ("id = \"pp\"\nchips = [\"b\"]", "instances[0].chips", "two chips or more"),
        ("id = \"pp\"\nchips = [\"b\", \"x\"]", "instances[0].chips[1]", "no chip has the id `x`"),
        ("id = \"pp\"\nchips = [\"b\", \"c\", \"d\"]\ntp = 2", "instances[0].tp", "3 chips do not make stages of 2"),
        (
            "id = \"pp\"\nchips = [\"b\", \"c\"]\nsplit = [1, 2, 1]",
            "instances[0].split",
            "expected 2 positive layer counts",
        ),
        ("id = \"pp\"\nchips = [\"b\", \"c\"]\nsplit = \"even\"", "instances[0].split", "expected \"auto\" or a list"),
    ];
    for (body, key, fragment) in cases {
        let e = error_of(&instance_file(&format!("[[instances]]\n{body}\n")));
        assert_eq!(e.key, key, "{body}: {e}");
        assert!(e.message.contains(fragment), "{body}: `{fragment}` not in {e}");
    }
    let two =
        "[[instances]]\nid = \"p1\"\nchips = [\"a\", \"b\"]\n[[instances]]\nid = \"p2\"\nchips = [\"b\", \"c\"]\n";
    let e = error_of(&instance_file(two));
    assert!(e.message.contains("chip `b` is already in instance `p1`"), "{e}");
}

/// `instance_file` with a second host `h1` (bus 7500) of chips `e` and `f`, `h1_extra`
/// among its keys, then `[[instances]]` lines.
fn two_host_file(h1_extra: &str, instances: &str) -> String {
    let mut text = instance_file("");
    text += &format!("[[hosts]]\nname = \"h1\"\nbus = \"127.0.0.1:7500\"\n{h1_extra}\n");
    for id in ["e", "f"] {
        text += &format!("[[hosts.chips]]\nid = \"{id}\"\nkind = \"cpu\"\nbackend = \"cpu\"\n");
    }
    text + instances
}

#[test]
fn an_instances_stages_may_span_hosts_and_its_stage_hosts_serve_them() {
    let spec = spec_of(&two_host_file(
        "",
        "[[instances]]\nid = \"pp\"\nchips = [\"a\", \"b\", \"e\", \"f\"]\ntp = 2\nrole = \"both\"\n",
    ));
    let h0: Vec<&str> = spec.hosts[0].chips.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(h0, ["pp", "c", "d"], "the instance runs on its first stage's host");
    assert!(spec.hosts[1].chips.is_empty(), "its chips leave h1: {:#?}", spec.hosts[1].chips);
    let par = spec.hosts[0].chips[0].parallel.as_ref().expect("an instance");
    assert_eq!(par.stage_hosts, ["h0", "h1"]);
    assert_eq!(spec.hosts[1].stages, Some("127.0.0.1:7503".parse().unwrap()), "the bus port + 3");
    assert_eq!(spec.hosts[0].stages, None, "h0 serves no stage of another host's instance");

    let e = error_of(&two_host_file("", "[[instances]]\nid = \"pp\"\nchips = [\"a\", \"e\"]\ntp = 2\n"));
    assert_eq!(e.key, "instances[0].chips");
    assert!(e.message.contains("stage 0 has `a` on host `h0` and `e` on `h1`"), "{e}");
    let e = error_of(&two_host_file("", "[[instances]]\nid = \"pp\"\nchips = [\"a\", \"e\"]\nrole = \"prefill\"\n"));
    assert_eq!(e.key, "instances[0].role");
    assert!(e.message.contains("stages on hosts h0, h1") && e.message.contains("a prefill instance"), "{e}");
    let e =
        error_of(&two_host_file("stages = \"127.0.0.1:7400\"", "[[instances]]\nid = \"pp\"\nchips = [\"a\", \"e\"]\n"));
    assert_eq!(e.key, "hosts[1].stages");
    assert!(e.message.contains("is also hosts[0].bus"), "{e}");
}

/// `[[tenants]]`: read with their limits, and refused (naming the key) where a tenant
/// could not be told apart, is listed twice, allows no model, or asks for scheduling
/// that is not built.
#[test]
fn tenants_are_read_and_bad_ones_refused() {
    let keys = "[gateway]\nkeys_file = \"keys.json\"\n\n";
    let text = format!(
        "{ONE_CHIP}{keys}[[tenants]]\nname = \"a\"\nmodels = [\"m\"]\n[tenants.limits]\ntokens_per_min = 500\n\n\
         [[tenants]]\nname = \"b\"\nshare_prefix_cache = true\n"
    );
    let spec = spec_of(&text);
    assert_eq!(spec.gateway.keys_file.as_deref(), Some(std::path::Path::new("keys.json")));
    let names: Vec<&str> = spec.tenants.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(spec.tenants[0].limits.tokens_per_min, Some(500));
    assert_eq!(spec.tenants[0].limits.requests_per_min, None);
    assert_eq!(spec.tenants[0].models.as_deref(), Some(&["m".to_owned()][..]));
    assert!(!spec.tenants[0].share_prefix_cache && spec.tenants[1].share_prefix_cache);
    let classed = spec_of(&format!("{ONE_CHIP}{keys}[[tenants]]\nname = \"a\"\nweight = 3\npriority = \"batch\"\n"));
    assert_eq!((classed.tenants[0].weight, classed.tenants[0].priority), (3, tessera_topology::PriorityClass::Batch));
    assert!(spec_of(ONE_CHIP).tenants.is_empty(), "no tenants: one open tenant");
    // (tenants table, the key named, a fragment of the message)
    let table = [
        ("", "[[tenants]]\nname = \"a\"\n", "tenants", "set gateway.keys_file"),
        (keys, "[[tenants]]\nname = \"a\"\n[[tenants]]\nname = \"a\"\n", "tenants[1].name", "listed twice"),
        (keys, "[[tenants]]\nname = \"a b\"\n", "tenants[0].name", "contains ' '"),
        (keys, "[[tenants]]\nname = \"a\"\nmodels = []\n", "tenants[0].models", "no model"),
        (
            keys,
            "[[tenants]]\nname = \"a\"\n[tenants.limits]\nmax_tokens = 0\n",
            "tenants[0].limits.max_tokens",
            "out of range",
        ),
        (keys, "[[tenants]]\nname = \"a\"\nweight = 0\n", "tenants[0].weight", "out of range"),
        (
            keys,
            "[[tenants]]\nname = \"a\"\npriority = \"urgent\"\n",
            "tenants[0].priority",
            "interactive, standard or batch",
        ),
    ];
    for (gateway, tenants, key, fragment) in table {
        let e = error_of(&format!("{ONE_CHIP}{gateway}{tenants}"));
        assert_eq!(e.key, key, "{e}");
        assert!(e.message.contains(fragment), "`{fragment}` not in: {e}");
    }
}

#[test]
fn security_defaults_to_off_on_loopback_and_to_encrypt_beyond_it() {
    let spec = spec_of(ONE_CHIP);
    assert_eq!(spec.security.mode, tessera_topology::SecurityMode::Off);
    // One address beyond loopback: encrypted by default (the node asks for the keys).
    let spec = spec_of(&with_line(5, "bus = \"10.0.0.2:7400\""));
    assert_eq!((spec.security.mode, &spec.security.keys_dir), (tessera_topology::SecurityMode::Encrypt, &None));
    // With keys, it encrypts by default; the cipher and directory are read.
    let text = format!(
        "{}[security]\nkeys_dir = \"/etc/tessera/keys\"\ncipher = \"sm4-gcm\"\n",
        with_line(5, "bus = \"10.0.0.2:7400\"")
    );
    let spec = spec_of(&text);
    assert_eq!(spec.security.mode, tessera_topology::SecurityMode::Encrypt);
    assert_eq!(spec.security.cipher, tessera_topology::Cipher::Sm4Gcm);
    assert_eq!(spec.security.keys_dir, Some(PathBuf::from("/etc/tessera/keys")));
    // Off beyond loopback is the operator's call.
    let text = format!("{}[security]\nmode = \"off\"\n", with_line(5, "bus = \"10.0.0.2:7400\""));
    assert_eq!(spec_of(&text).security.mode, tessera_topology::SecurityMode::Off);
    // Unknown names, an empty path, and a malformed inline key.
    assert_error(
        &format!("{ONE_CHIP}[security]\nkeys_dir = \" \"\n"),
        11,
        12,
        "security.keys_dir",
        "must not be empty",
    );
    assert_error(
        &format!("{ONE_CHIP}[security]\nmode = \"tls\"\n"),
        11,
        8,
        "security.mode",
        "off, authenticate or encrypt",
    );
    assert_error(
        &format!("{ONE_CHIP}[security]\ncipher = \"aes\"\n"),
        11,
        10,
        "security.cipher",
        "chacha20-poly1305 or sm4-gcm",
    );
    assert_error(
        &with_line(5, "bus = \"127.0.0.1:7400\"\npublic_key = \"abc\""),
        6,
        14,
        "hosts[0].public_key",
        "64 hex digits",
    );
    let key = "ab".repeat(32);
    let spec = spec_of(&with_line(5, &format!("bus = \"127.0.0.1:7400\"\npublic_key = \"{key}\"")));
    assert_eq!(spec.hosts[0].public_key, Some([0xab; 32]));
}
