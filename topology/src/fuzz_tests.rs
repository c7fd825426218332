//! Bounded fuzzing of [`crate::parse`] (CI). Topology files come from operators, not
//! attackers, but a typo must give a located error, never a panic, and whatever is
//! accepted must keep the ranges the spec documents (they are what keeps the runtime's
//! arithmetic finite). Inputs: arbitrary text, and valid files (the embedded default and
//! a denser one) edited line by line — a value replaced by an extreme (0, -1, 1e300,
//! 2^63, 2^64, NaN, a huge size, a port at 65535), a line deleted, repeated, swapped,
//! uncommented or inserted — then cut or sprinkled with characters. The
//! coverage-guided target is `tests/fuzz/fuzz_targets/topology_toml.rs`.

use std::collections::HashSet;
use std::time::Duration;

use proptest::prelude::*;

use crate::{Backend, ClusterSpec, DEFAULT_TOML, TopologyError, parse, perf};

/// Uses what the default leaves out: chip kinds of the file, a checkpoint path, a
/// plugin, memory limits as strings and numbers, IPv6, `tcp://`, the extreme batch sizes.
const DENSE_TOML: &str = r#"
[cluster]
model = "models/llama"
dtype = "bf16"
kv_dtype = "f16"
block_size = 4096

[bus]
max_frame_bytes = 4096
handshake_timeout_ms = 100

[disagg]
min_prompt_tokens = 2
transport = "tcp"
tcp_streams = 64
chunk_kib = 65536

[[chip_kinds]]
name = "nvidia-l40s"
vendor = "NVIDIA"
product = "L40S"
fp16_tflops = 362.0
memory = "48GiB"
memory_bw_gbs = 864.0
link_bw_gbs = 64.0
tdp_w = 350.0
confidence = "confirmed"
source = "NVIDIA L40S datasheet"

[[hosts]]
name = "a"
bus = "tcp://[::1]:9000"

[[hosts.chips]]
id = "a0"
kind = "nvidia-l40s"
backend = "plugin:lib/kernels.so"
memory_limit = "512MiB"
max_batch_tokens = 1048576
max_batch_seqs = 65536
max_mixed_step_ms = 3600000

[[hosts.chips]]
id = "a1"
backend = "emu:nvidia-l40s"
role = "decode"
memory_limit = 1048576
threads = 1024
kv_layout = "token-major"
"#;

const SEEDS: &[&str] = &[DEFAULT_TOML, DENSE_TOML];

/// Values a typo, a copy-paste or a hostile file puts where a number, a string or an
/// address belongs.
const EXTREMES: &[&str] = &[
    "0",
    "-1",
    "1",
    "1e300",
    "-1e300",
    "1e-300",
    "5e-324",
    "nan",
    "-nan",
    "+inf",
    "-inf",
    "-0.0",
    "0.009999",
    "9223372036854775807",
    "-9223372036854775808",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "4097",
    "65535",
    "65536",
    "86400001",
    "1073741825",
    "16777217",
    "1e6",
    "1000000.0001",
    "\"\"",
    "\"x\"",
    "\"0\"",
    "\" 1 \"",
    "\"99999999999TiB\"",
    "\"18446744073709551615\"",
    "\"18446744073709551615 KiB\"",
    "\"1125899906842625\"",
    "\"1PiB\"",
    "\"1.5GiB\"",
    "true",
    "[]",
    "{}",
    "[1, \"a\"]",
    "{ a = 1 }",
    "1979-05-27T07:32:00Z",
    "\"127.0.0.1:65535\"",
    "\"127.0.0.1:65534\"",
    "\"0.0.0.0:0\"",
    "\"[::]:65535\"",
    "\"tcp://\"",
    "\"tcp://127.0.0.1\"",
    "\"localhost:80\"",
    "\"emu:\"",
    "\"emu:cpu\"",
    "\"emu:emu:cpu\"",
    "\"plugin:\"",
    "\"plugin:/\"",
    "\"cpu\"",
    "\"h0\"",
    "\"h1-metax0\"",
    "\"ascend-910b\"",
    "\"nvidia-h100\"",
    "\"\u{0}\"",
    "\"é\u{301}\u{200b}\"",
    "'''a\nb'''",
];

/// Lines inserted whole: headers and keys that repeat, nest or clash.
const LINES: &[&str] = &[
    "[cluster]",
    "[[hosts]]",
    "[[hosts.chips]]",
    "[[chip_kinds]]",
    "[hosts]",
    "[[cluster]]",
    "[emulation]",
    "hosts = []",
    "name = \"h0\"",
    "bus = \"127.0.0.1:7400\"",
    "id = \"h0-ascend0\"",
    "backend = \"emu:nvidia-h100\"",
    "role = \"prefill\"",
    "cluster.model = 1",
    "x = 1",
    "model = \"builtin:tiny\"",
    "time_scale = 1e6",
    "compute_efficiency = 0.01",
];

#[derive(Debug, Clone)]
enum Edit {
    /// Replaces the value of the `line`-th `key = value` line.
    Value {
        line: usize,
        value: usize,
    },
    Delete {
        line: usize,
    },
    Repeat {
        line: usize,
        to: usize,
    },
    Swap {
        a: usize,
        b: usize,
    },
    /// Uncomments the `line`-th commented `# key = value` or `# [header]` line.
    Uncomment {
        line: usize,
    },
    Insert {
        at: usize,
        line: usize,
    },
}

fn arb_edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (any::<usize>(), 0..EXTREMES.len()).prop_map(|(line, value)| Edit::Value { line, value }),
        1 => any::<usize>().prop_map(|line| Edit::Delete { line }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(line, to)| Edit::Repeat { line, to }),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Swap { a, b }),
        2 => any::<usize>().prop_map(|line| Edit::Uncomment { line }),
        1 => (any::<usize>(), 0..LINES.len()).prop_map(|(at, line)| Edit::Insert { at, line }),
    ]
}

/// Damage at the character level, after the line edits.
#[derive(Debug, Clone)]
enum Scratch {
    None,
    Cut(usize),
    Insert(usize, String),
}

fn arb_scratch() -> impl Strategy<Value = Scratch> {
    prop_oneof![
        4 => Just(Scratch::None),
        1 => any::<usize>().prop_map(Scratch::Cut),
        1 => (any::<usize>(), "[\\[\\]=\"'#.,{}\n\\\\a-z0-9 \u{80}-\u{10ffff}]{1,6}").prop_map(|(at, s)| Scratch::Insert(at, s)),
    ]
}

fn is_key_value(line: &str) -> bool {
    let line = line.trim_start();
    !line.starts_with('#') && !line.starts_with('[') && line.contains('=')
}

fn is_commented_toml(line: &str) -> bool {
    let rest = line.trim_start().trim_start_matches('#').trim_start();
    line.trim_start().starts_with('#')
        && (rest.starts_with('[') || rest.split_once('=').is_some_and(|(key, _)| is_bare_key(key.trim())))
}

fn is_bare_key(key: &str) -> bool {
    !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// The `n`-th (modulo their count) index of `lines` whose line satisfies `pred`.
fn nth_where(lines: &[String], n: usize, pred: fn(&str) -> bool) -> Option<usize> {
    let picks: Vec<usize> = (0..lines.len()).filter(|&i| pred(&lines[i])).collect();
    (!picks.is_empty()).then(|| picks[n % picks.len()])
}

fn edit_text(seed: &str, edits: &[Edit], scratch: &Scratch) -> String {
    let mut lines: Vec<String> = seed.lines().map(str::to_owned).collect();
    for edit in edits {
        let n = lines.len().max(1);
        match *edit {
            Edit::Value { line, value } => {
                if let Some(i) = nth_where(&lines, line, is_key_value)
                    && let Some((key, _)) = lines[i].split_once('=')
                {
                    lines[i] = format!("{key}= {}", EXTREMES[value]);
                }
            }
            Edit::Delete { line } if !lines.is_empty() => {
                lines.remove(line % n);
            }
            Edit::Repeat { line, to } if !lines.is_empty() => {
                let again = lines[line % n].clone();
                lines.insert(to % (n + 1), again);
            }
            Edit::Swap { a, b } if !lines.is_empty() => lines.swap(a % n, b % n),
            Edit::Uncomment { line } => {
                if let Some(i) = nth_where(&lines, line, is_commented_toml) {
                    lines[i] = lines[i].trim_start().trim_start_matches('#').trim_start().to_owned();
                }
            }
            Edit::Insert { at, line } => lines.insert(at % (n + 1), LINES[line].to_owned()),
            _ => {}
        }
    }
    let mut text = lines.join("\n");
    match scratch {
        Scratch::None => {}
        Scratch::Cut(at) => text.truncate(floor_boundary(&text, at % (text.len() + 1))),
        Scratch::Insert(at, s) => text.insert_str(floor_boundary(&text, at % (text.len() + 1)), s),
    }
    text
}

fn floor_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

const ONE_DAY_MS: u64 = 86_400_000;

/// What an accepted spec promises (the ranges documented on [`ClusterSpec`] and its
/// parts), checked without trusting the validator's own code paths.
fn check_spec(spec: &ClusterSpec) -> Result<(), TestCaseError> {
    let _ = spec.render();
    prop_assert!((1..=4096).contains(&spec.block_size));
    prop_assert!(!spec.hosts.is_empty());
    prop_assert!(spec.host_index(&spec.gateway.host).is_some(), "gateway host {:?} names no host", spec.gateway.host);
    prop_assert!(spec.chips().any(|(_, _, chip)| chip.role.decodes()), "no chip decodes");

    let sup = &spec.supervisor;
    prop_assert!((1..=ONE_DAY_MS).contains(&sup.heartbeat_interval_ms));
    prop_assert!(sup.heartbeat_timeout_ms > sup.heartbeat_interval_ms && sup.heartbeat_timeout_ms <= ONE_DAY_MS);
    prop_assert!(sup.restart_backoff_ms <= ONE_DAY_MS && (1..=86_400).contains(&sup.restart_window_s));
    prop_assert!(sup.max_restarts <= 10_000);
    // The 32-fold backoff must stay a Duration an Instant can be advanced by.
    prop_assert!(std::time::Instant::now().checked_add(Duration::from_millis(sup.restart_backoff_ms * 32)).is_some());

    let emu = &spec.emulation;
    prop_assert!(emu.time_scale > 0.0 && emu.time_scale <= 1e6, "time_scale {}", emu.time_scale);
    for efficiency in [emu.compute_efficiency, emu.memory_efficiency] {
        prop_assert!((0.01..=1.0).contains(&efficiency), "efficiency {efficiency}");
    }
    prop_assert!((1..=1 << 20).contains(&spec.router.max_queued_requests));
    prop_assert!((1..=1 << 20).contains(&spec.gateway.max_inflight_requests));
    prop_assert!((1..=65_536).contains(&spec.gateway.max_connections));
    prop_assert!((100..=600_000).contains(&spec.gateway.header_read_timeout_ms));
    prop_assert!(spec.gateway.max_prompt_bytes.is_none_or(|b| (1..=1 << 30).contains(&b)));
    prop_assert!((4096..=1 << 30).contains(&spec.bus.max_frame_bytes));
    prop_assert!((100..=600_000).contains(&spec.bus.handshake_timeout_ms));
    let disagg = &spec.disagg;
    prop_assert!((2..=1 << 24).contains(&disagg.min_prompt_tokens));
    prop_assert!((1..=ONE_DAY_MS).contains(&disagg.lease_ms));
    prop_assert!((1..=64).contains(&disagg.tcp_streams) && (1..=65_536).contains(&disagg.chunk_kib));
    let _ = disagg.chunk_bytes();

    let mut ids = HashSet::new();
    let mut sockets = HashSet::new();
    for host in &spec.hosts {
        for socket in [&host.bus, &host.events, &host.transfer] {
            prop_assert!(sockets.insert(socket), "socket {} used twice", socket);
        }
    }
    for (_, _, chip) in spec.chips() {
        prop_assert!(ids.insert(chip.id.as_str()), "chip id {:?} used twice", chip.id);
        let kind = spec.chip_kind(&chip.kind);
        prop_assert!(kind.is_some(), "chip kind {:?} resolves to nothing", chip.kind);
        prop_assert!((1..=1024).contains(&chip.threads));
        prop_assert!((1..=1 << 20).contains(&chip.max_batch_tokens));
        prop_assert!((1..=1 << 16).contains(&chip.max_batch_seqs));
        prop_assert!(chip.max_mixed_step_ms.is_none_or(|ms| (1..=3_600_000).contains(&ms)));
        prop_assert!((1..=4096).contains(&chip.block_size));
        prop_assert!(chip.memory_limit_bytes.is_none_or(|b| (1..=1 << 50).contains(&b)));
        if let Backend::Emu(emulated) = &chip.backend {
            prop_assert_eq!(emulated, &chip.kind);
            if let Some(kind) = kind {
                // What the pacer turns into a Duration and adds to an Instant.
                let step = emu.reference_step(kind);
                prop_assert!(step.time_s.is_finite() && step.time_s <= perf::MAX_STEP_S);
                let _ = Duration::from_secs_f64(step.time_s);
            }
        }
    }
    Ok(())
}

/// An error names a real place of the text.
fn check_error(text: &str, error: &TopologyError) -> Result<(), TestCaseError> {
    prop_assert!(error.line >= 1 && error.column >= 1, "error without a position: {error:?}");
    prop_assert!(error.line <= text.lines().count() + 1, "line {} past the end: {error:?}", error.line);
    prop_assert!(error.to_string().starts_with("fuzz.toml:"), "{error}");
    Ok(())
}

fn check(text: &str) -> Result<(), TestCaseError> {
    match parse(text, "fuzz.toml") {
        Ok(spec) => check_spec(&spec),
        Err(error) => check_error(text, &error),
    }
}

#[test]
fn the_seeds_are_valid() {
    for seed in SEEDS {
        let spec = parse(seed, "seed.toml").unwrap_or_else(|e| panic!("seed refused: {e}"));
        check_spec(&spec).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Cases per property: `PROPTEST_CASES` when set (a longer local run), else what CI runs.
fn cases(ci: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(ci)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(4096), ..ProptestConfig::default() })]

    #[test]
    fn edited_topologies_are_refused_with_a_place_or_keep_their_ranges(
        seed in 0..SEEDS.len(),
        edits in proptest::collection::vec(arb_edit(), 1..5),
        scratch in arb_scratch(),
    ) {
        check(&edit_text(SEEDS[seed], &edits, &scratch))?;
    }

    #[test]
    fn arbitrary_text_is_refused_with_a_place(
        text in prop_oneof![".{0,200}", "[\\[\\]=\"'#.{}\n a-z0-9_-]{0,200}"],
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        check(&text)?;
        check(&String::from_utf8_lossy(&bytes))?;
    }
}
