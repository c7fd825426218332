//! The topology file's reference: every table and key of the schema with its values,
//! default and meaning, rendered as `docs/reference/topology.md` (`tessera topology
//! reference`). A unit test holds [`TABLES`] to the serde structs that read the file, key
//! for key, and the checked-in page to [`markdown`], so a key added to the schema without
//! a line here fails the tests, and the page cannot drift from the code.

use std::fmt::Write as _;

/// One table of the file (`[router]`, `[[hosts.chips]]`, …).
#[derive(Debug, Clone, Copy)]
pub struct Table {
    /// The dotted path (`hosts.chips`); empty for the file's top level.
    pub path: &'static str,
    /// How it is written: `[router]`, `[[hosts]]`, or the top level.
    pub header: &'static str,
    pub about: &'static str,
    pub keys: &'static [Key],
}

/// One key of a table.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    pub name: &'static str,
    /// The values it takes (type, range or names).
    pub values: &'static str,
    /// Its default, or `required`.
    pub default: &'static str,
    pub about: &'static str,
}

const fn key(name: &'static str, values: &'static str, default: &'static str, about: &'static str) -> Key {
    Key { name, values, default, about }
}

/// Every table of the schema, in the order the page lists them.
pub const TABLES: &[Table] = &[
    Table {
        path: "",
        header: "top level",
        about: "A topology file holds these tables. Unknown tables and keys are errors.",
        keys: &[
            key("cluster", "table", "required", "The model and the cluster-wide KV defaults."),
            key("router", "table", "defaults", "How requests are placed on chips."),
            key("supervisor", "table", "defaults", "Heartbeats and restarts."),
            key("solver", "table", "defaults", "The live solver on the gateway's host."),
            key("gateway", "table", "defaults", "The OpenAI-compatible HTTP gateway."),
            key("bus", "table", "defaults", "Limits of the host-to-host message bus."),
            key(
                "security",
                "table",
                "off on loopback, else encrypt",
                "Authenticated, encrypted bus and KV transfer between hosts. See [securing a cluster](../how-to/secure-cluster.md).",
            ),
            key("emulation", "table", "defaults", "How `emu:KIND` chips are paced."),
            key("disagg", "table", "defaults", "Prefill/decode disaggregation and KV transfer."),
            key(
                "chip_kinds",
                "array of tables",
                "none",
                "Chip kinds of the operator's own, beside the built-in catalog.",
            ),
            key("hosts", "array of tables", "required", "One per host (one runtime process), with its chips."),
            key(
                "instances",
                "array of tables",
                "none",
                "Model instances: one model split over several chips (pipeline stages, on one host or several; tensor parallelism within a host).",
            ),
            key(
                "tenants",
                "array of tables",
                "one open tenant",
                "Who shares the cluster: quotas, allowed models, prefix-cache isolation; needs `gateway.keys_file`. See [tenancy](../how-to/tenancy.md).",
            ),
        ],
    },
    Table {
        path: "cluster",
        header: "[cluster]",
        about: "What the cluster serves.",
        keys: &[
            key("name", "string", "`\"default\"`", "Name of the cluster, in logs and metrics."),
            key(
                "model",
                "`builtin:tiny`, `builtin:small`, `builtin:bench`, a checkpoint directory or a GGUF file",
                "required",
                "The model to serve. A relative path is resolved against the topology file's directory; it must exist if a host runs on the machine that checks the file.",
            ),
            key("dtype", "`f32`, `f16`, `bf16`", "the checkpoint's", "Weights dtype override."),
            key(
                "kv_dtype",
                "`f32`, `f16`, `bf16`",
                "`f16`",
                "KV cache dtype, the default of every chip's `kv_dtype`; chips may differ (the KV is converted in transit).",
            ),
            key("block_size", "1..=4096 tokens", "16", "KV block size, the default of every chip's `block_size`."),
        ],
    },
    Table {
        path: "router",
        header: "[router]",
        about: "Placement of requests; see [the router](../concepts/router.md).",
        keys: &[
            key(
                "policy",
                "`kv-aware`, `least-loaded`, `round-robin`, `random`, `dynamo`",
                "`kv-aware`",
                "How a request is placed: least predicted seconds (`kv-aware`), or a baseline to compare against.",
            ),
            key(
                "max_queued_requests",
                "1..=1048576",
                "256",
                "Requests placed on chips and not finished before new ones wait in the router's queue.",
            ),
            key(
                "kv_breaker_percent",
                "1..=100",
                "90",
                "A chip whose KV pool is this full takes no new requests until a heartbeat shows it below.",
            ),
            key(
                "max_queued_prompt_ms",
                "1..=3600000",
                "500",
                "A chip whose queued prompts (placed, not yet computed) would take this long at its pace takes no new requests: the rest wait in the router's queue, where priority and fair order apply across the cluster.",
            ),
            key(
                "max_waiting_requests",
                "0..=1048576",
                "256",
                "Requests that may wait for a chip; one more gets a 429 at once.",
            ),
            key(
                "queue_timeout_ms",
                "1..=86400000",
                "5000",
                "How long a request waits for a chip before a 429 with `Retry-After`.",
            ),
            key(
                "decode_overflow",
                "`prefill-chips`, `wait`",
                "`prefill-chips`",
                "Where a request goes when every decoding chip is full: run whole on a prefill chip (more throughput, but prompts there wait for its decodes), or `wait` in the router's queue (prefill chips only prefill, so TTFT stays apart from the decode load). Either way prefill chips run requests whole while no decoding chip is up.",
            ),
        ],
    },
    Table {
        path: "supervisor",
        header: "[supervisor]",
        about: "Liveness and restarts; see [supervisors and failover](../concepts/supervisors.md).",
        keys: &[
            key("heartbeat_interval_ms", "1..=86400000", "100", "How often hosts and chips send a heartbeat."),
            key(
                "heartbeat_timeout_ms",
                "1..=86400000, more than the interval",
                "1000",
                "Silent this long means dead: the host's chips are marked down and their requests re-routed.",
            ),
            key(
                "max_restarts",
                "0..=10000",
                "3",
                "A chip restarted more than this many times within `restart_window_s` is left down and reported.",
            ),
            key("restart_window_s", "1..=86400", "60", "The window `max_restarts` counts in."),
            key(
                "restart_backoff_ms",
                "0..=86400000",
                "200",
                "The wait before a restart, doubling per restart up to 32-fold.",
            ),
        ],
    },
    Table {
        path: "solver",
        header: "[solver]",
        about: "The live solver; see [the solver](../concepts/solver.md).",
        keys: &[
            key("enabled", "bool", "true", "Run the solver actor at all."),
            key(
                "auto",
                "bool",
                "false",
                "Apply the best strategy itself (otherwise an operator applies one with `tessera plan apply`).",
            ),
            key(
                "objective",
                "`goodput_per_usd`, `goodput`",
                "`goodput_per_usd`",
                "What the first row and auto mode maximise: requests within the SLOs per dollar, or per second.",
            ),
            key("ttft_ms", "1..=86400000", "2000", "The TTFT SLO goodput counts against, at p90."),
            key("tpot_ms", "1..=86400000", "200", "The TPOT SLO goodput counts against, at p90."),
            key("period_s", "1..=86400", "60", "Re-solve at least this often while traffic flows."),
            key(
                "telemetry_interval_ms",
                "10..=86400000",
                "5000",
                "How often admission publishes a window of telemetry.",
            ),
            key(
                "rate_change_percent",
                "1..=1000",
                "20",
                "Re-solve at once when the arrival rate moves this much; plans are for the measured rate plus this much.",
            ),
            key(
                "min_gain_percent",
                "0..=1000",
                "10",
                "Auto mode: a new strategy must score this much better than the one in force.",
            ),
            key(
                "dwell_s",
                "0..=86400",
                "120",
                "Auto mode: how long the one in force runs before another may replace it (unless it lost a chip or falls behind).",
            ),
        ],
    },
    Table {
        path: "gateway",
        header: "[gateway]",
        about: "The HTTP gateway; see the [HTTP API](http-api.md).",
        keys: &[
            key(
                "host",
                "a host's name",
                "the first host",
                "The host that runs the gateway, the router, admission and the solver.",
            ),
            key("listen", "`IP:PORT`", "`\"127.0.0.1:8000\"`", "Where the gateway listens."),
            key(
                "served_model_name",
                "non-empty string",
                "derived from `cluster.model`",
                "The model name clients send.",
            ),
            key("max_inflight_requests", "1..=1048576", "256", "Most requests the gateway has in flight at once."),
            key(
                "max_connections",
                "1..=65536",
                "1024",
                "Most client connections open at once; at the cap the one idle longest is closed.",
            ),
            key(
                "header_read_timeout_ms",
                "100..=600000",
                "10000",
                "A client must send a request's headers within this time; also how long a kept-alive connection may idle.",
            ),
            key(
                "max_prompt_bytes",
                "1..=1073741824",
                "derived from the model",
                "Largest prompt accepted, in bytes of text (413 above it, before tokenizing).",
            ),
            key(
                "keys_file",
                "a path",
                "none",
                "The API keys file (`tessera keys add`), relative to the topology's directory; re-read when it changes. Set: `/v1/*` needs a key and `/admin/*` an `operator` or `admin` key. Unset: `/v1/*` is open and `tessera up` writes an admin token under `$TESSERA_HOME/admin/`.",
            ),
            key(
                "audit_log",
                "a path",
                "`audit.log` beside the keys file, else under `$TESSERA_HOME/audit/`",
                "The hash-chained audit log (`tessera audit verify`).",
            ),
        ],
    },
    Table {
        path: "bus",
        header: "[bus]",
        about: "The host-to-host ZeroMQ bus.",
        keys: &[
            key(
                "max_frame_bytes",
                "4096..=1073741824",
                "16777216 (16 MiB)",
                "Largest message a host accepts from another; a larger one is refused from its frame header and the connection dropped.",
            ),
            key(
                "handshake_timeout_ms",
                "100..=600000",
                "5000",
                "A connecting host must finish the ZMTP handshake within this time.",
            ),
            key(
                "resolve_timeout_ms",
                "0..=3600000",
                "60000",
                "A starting host retries a host name that does not resolve (its own or a peer's) for this long, then stops with an error naming it; later, a peer's name is looked up again on every reconnect, and a failure is logged and retried.",
            ),
        ],
    },
    Table {
        path: "security",
        header: "[security]",
        about: "How the planes between hosts are secured; see [securing a cluster](../how-to/secure-cluster.md).",
        keys: &[
            key(
                "mode",
                "`\"off\"`, `\"authenticate\"` or `\"encrypt\"`",
                "`\"off\"` when every host address is loopback, else `\"encrypt\"`",
                "`authenticate`: hosts prove their listed keys (Noise XX handshake per connection) and every frame carries a tag; `encrypt`: and every frame is encrypted. A host of a cluster reached beyond loopback refuses to start without keys, saying how to make them.",
            ),
            key(
                "cipher",
                "`\"chacha20-poly1305\"` or `\"sm4-gcm\"`",
                "`\"chacha20-poly1305\"`",
                "The AEAD on every frame; SM4-GCM is China's national cipher (RFC 8998).",
            ),
            key(
                "keys_dir",
                "path",
                "required unless `mode = \"off\"`",
                "Holds this host's `HOST.key` (owner-only) and the hosts' `HOST.pub`, as `tessera keys gen-host --name HOST --out DIR` writes them. Re-read when an unknown key connects, so a host restarted with a new key rejoins once its `.pub` is copied here.",
            ),
            key(
                "at_rest_key_file",
                "path",
                "`$TESSERA_AT_REST_KEY(_FILE)`, else none",
                "A key file (`tessera keys gen-at-rest --out FILE`, owner-only) that seals the gateway's keys file and audit log at rest (ChaCha20-Poly1305).",
            ),
        ],
    },
    Table {
        path: "emulation",
        header: "[emulation]",
        about: "How `emu:KIND` chips are paced; see [chips and emulation](../concepts/chips.md).",
        keys: &[
            key(
                "time_scale",
                "more than 0, at most 1000000",
                "1.0",
                "Multiplies every paced step time, so a tiny model on a CPU takes as long as a big one on the real chip.",
            ),
            key("compute_efficiency", "0.01..=1", "0.5", "Fraction of peak FLOPS a step achieves (MFU)."),
            key("memory_efficiency", "0.01..=1", "0.8", "Fraction of peak memory bandwidth a step achieves (MBU)."),
            key(
                "perf_models",
                "table `KIND = \"FILE\"`",
                "none",
                "A chip kind's calibrated performance model (a file `tessera calibrate --out` writes, relative to the topology) instead of the flat efficiencies.",
            ),
        ],
    },
    Table {
        path: "disagg",
        header: "[disagg]",
        about: "Prefill/decode disaggregation; see [disaggregation](../concepts/disaggregation.md).",
        keys: &[
            key(
                "min_prompt_tokens",
                "2..=16777216",
                "32",
                "Shorter prompts run entirely on a decode chip (conditional disaggregation).",
            ),
            key(
                "lease_ms",
                "1..=86400000",
                "5000",
                "KV a prefill chip offers is freed if the decode chip has not claimed and read it within this time.",
            ),
            key(
                "transport",
                "`auto`, `shm`, `tcp`",
                "`auto`",
                "How KV blocks travel: shared memory between chips of one machine and TCP otherwise, or one of them always.",
            ),
            key("tcp_streams", "1..=64", "4", "Parallel TCP streams per transfer."),
            key("chunk_kib", "1..=65536", "1024", "Size of one chunk of a transfer, in KiB."),
        ],
    },
    Table {
        path: "chip_kinds",
        header: "[[chip_kinds]]",
        about: "A chip kind of the operator's own. A name may not repeat nor reuse a built-in one (`cpu`, `nvidia-a100`, `nvidia-h100`, `nvidia-h200`, `ascend-910b`, `cambricon-mlu370`, `metax-c500`, `biren-br100`).",
        keys: &[
            key("name", "ASCII letters, digits, `-`, `_`, `.`", "required", "The kind's name, as chips name it."),
            key("vendor", "string", "`\"operator-defined\"`", "Who makes it."),
            key("product", "string", "the name", "The product name."),
            key("fp16_tflops", "0.001..=100000", "required", "Dense FP16/BF16 peak, TFLOPS."),
            key("memory", "bytes, or a size such as `\"48GiB\"`; 1 MiB..=1 PiB", "required", "Memory on the chip."),
            key("memory_bw_gbs", "0.1..=100000", "required", "Memory bandwidth, GB/s."),
            key("link_bw_gbs", "0.01..=100000", "required", "Chip-to-chip link, GB/s, both directions."),
            key("tdp_w", "0.1..=100000", "required", "Board power, watts."),
            key("confidence", "`confirmed`, `unconfirmed`, `estimate`", "`unconfirmed`", "How sure the figures are."),
            key("source", "string", "required", "Where the figures come from."),
            key(
                "price_per_hour",
                "0.0001..=100000",
                "none",
                "$ per chip-hour, for the simulator's and the solver's costs.",
            ),
            key(
                "price_confidence",
                "`confirmed`, `unconfirmed`, `estimate`",
                "`unconfirmed`",
                "How sure the price is (only with `price_per_hour`).",
            ),
            key("price_source", "string", "required with `price_per_hour`", "Where the price comes from."),
        ],
    },
    Table {
        path: "hosts",
        header: "[[hosts]]",
        about: "One host: one runtime process. Every socket of the cluster needs its own address. A host may be an IP address or a DNS name (a Kubernetes pod's, say): the host binds what its name resolves to at start, and peers resolve it again on every reconnect.",
        keys: &[
            key(
                "name",
                "ASCII letters, digits, `-`, `_`, `.`; unique",
                "required",
                "The host's name (`tessera node --host NAME`).",
            ),
            key(
                "bus",
                "`HOST:PORT` or `tcp://HOST:PORT`, HOST an IP address or a DNS name",
                "required",
                "The host's ZeroMQ ROUTER socket; the other sockets default to its HOST.",
            ),
            key("events", "`HOST:PORT` or `tcp://HOST:PORT`", "the bus port + 1", "The host's ZeroMQ PUB socket."),
            key(
                "public_key",
                "64 hex digits",
                "`security.keys_dir`/NAME.pub",
                "The host's public key, as `tessera keys gen-host` prints it; listed here, it needs no `.pub` file (but changing it needs every host restarted).",
            ),
            key("transfer", "`HOST:PORT` or `tcp://HOST:PORT`", "the bus port + 2", "The host's KV transfer listener."),
            key(
                "stages",
                "`HOST:PORT` or `tcp://HOST:PORT`",
                "the bus port + 3",
                "The host's stage server: where an instance on another host reaches the pipeline stages this host holds for it (one TCP link per stage). Bound only on a host that holds such a stage.",
            ),
            key(
                "chips",
                "array of tables",
                "none",
                "The host's chips (`[[hosts.chips]]`, after the `[[hosts]]` they belong to).",
            ),
        ],
    },
    Table {
        path: "hosts.chips",
        header: "[[hosts.chips]]",
        about: "One chip of a host.",
        keys: &[
            key(
                "id",
                "string, unique across the cluster",
                "required",
                "The chip's id (in `/health`, metrics and admin calls).",
            ),
            key(
                "kind",
                "a built-in kind or one of the file's `[[chip_kinds]]`",
                "the emulated kind of an `emu:` backend",
                "Which chip it is; with `emu:KIND` it must equal KIND.",
            ),
            key(
                "backend",
                "`cpu`, `emu:KIND`, `plugin:PATH`",
                "required",
                "Which kernels run it: the CPU library, the CPU library paced like KIND, or a kernel library (a relative PATH is resolved against the file's directory).",
            ),
            key(
                "role",
                "`prefill`, `decode`, `both`",
                "`both`",
                "What the chip does. The cluster needs a chip that can decode; a decode chip also prefills short prompts, and every prompt while no prefill chip is up.",
            ),
            key(
                "memory_limit",
                "bytes, or a size such as `\"512MiB\"`, `\"2GB\"`; 1 byte..=1 PiB",
                "no limit",
                "Memory the chip may use (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; any case).",
            ),
            key("threads", "1..=1024", "1", "Worker threads."),
            key("max_batch_tokens", "1..=1048576", "512", "Most tokens in one step (the prefill token budget)."),
            key("max_batch_seqs", "1..=65536", "64", "Most sequences in one step (the decode batch cap)."),
            key(
                "max_mixed_step_ms",
                "1..=3600000",
                "unset",
                "Stall-free batching: a step that carries decode tokens is cut to take about this long at the chip's observed pace.",
            ),
            key("block_size", "1..=4096 tokens", "`cluster.block_size`", "This chip's KV block size."),
            key("kv_dtype", "`f32`, `f16`, `bf16`", "`cluster.kv_dtype`", "This chip's KV cache dtype."),
            key("kv_layout", "`head-major`, `token-major`", "`head-major`", "How the chip lays out a KV block."),
            key(
                "quantize",
                "`q8_0`, `q4_0`",
                "as stored",
                "The block format float weights are quantized to when they load; every prefill and decode chip of a file agrees on it.",
            ),
            key(
                "matmul_precision",
                "`f32`, `bf16`",
                "`f32`",
                "The arithmetic of prompts' linear layers; `bf16` needs bf16 dot products (AVX512-BF16 on a CPU) and moves log-probabilities by ~0.1-0.2. Decode stays f32.",
            ),
        ],
    },
    Table {
        path: "instances",
        header: "[[instances]]",
        about: "One model instance over several chips: pipeline stages, each holding a contiguous range of layers, and within each stage `tp` chips of one host splitting heads and FFN columns with an all-reduce. Stages may be on different hosts: the instance runs on its first stage's host and reaches the others through their hosts' stage servers. The instance serves, routes, fails and is planned as one chip. See [model parallelism](../concepts/model-parallelism.md).",
        keys: &[
            key(
                "id",
                "string, unique across the cluster's chips and instances",
                "required",
                "The instance's id: the chip id it serves under (in `/health`, metrics and admin calls).",
            ),
            key(
                "chips",
                "array of chip ids, stage-major; a stage's chips on one host",
                "required",
                "Its chips: `stages × tp` of them, each stage's `tp` chips together (like kind and settings within a stage). A chip belongs to at most one instance.",
            ),
            key("tp", "1..=64, dividing the model's KV heads", "1", "Chips per stage (tensor-parallel degree)."),
            key(
                "split",
                "`\"auto\"` or an array of layer counts, one per stage, summing to the model's layers",
                "`\"auto\"`",
                "Layers per stage: `auto` sizes stages to each chip's speed (perf model) within its `memory_limit`; a list that does not fit is refused naming the stage and the bytes.",
            ),
            key(
                "role",
                "`prefill`, `decode`, `both`",
                "its first chip's `role`",
                "What the instance does, as a chip's `role`; an instance with stages on several hosts is `decode` or `both` (a stage on another host does not stage KV for a decode chip).",
            ),
        ],
    },
    Table {
        path: "tenants",
        header: "[[tenants]]",
        about: "One tenant of a shared cluster. Its keys, in `gateway.keys_file`, name it; see [tenancy](../how-to/tenancy.md).",
        keys: &[
            key(
                "name",
                "letters, digits, `-`, `_`, `.` (at most 64)",
                "required",
                "Unique; the `tenant` label of its metrics.",
            ),
            key(
                "weight",
                "1..=1000",
                "1",
                "Its share of the chips when tenants of its class compete (weighted fair queuing, charged in chip time).",
            ),
            key(
                "priority",
                "`interactive`, `standard`, `batch`",
                "`standard`",
                "Its priority class: higher classes are served first and preempted last.",
            ),
            key("models", "array of served model names", "any", "The models its keys may ask for."),
            key(
                "share_prefix_cache",
                "boolean",
                "false",
                "Its prompts may reuse cached KV blocks of other sharing tenants; otherwise its prefix cache is its own.",
            ),
            key("limits", "table", "no limits", "Its quotas over the whole cluster."),
        ],
    },
    Table {
        path: "tenants.limits",
        header: "[tenants.limits]",
        about: "A tenant's quotas, enforced by admission for the whole cluster; over one, a request gets 429 with `Retry-After` and a message naming the limit.",
        keys: &[
            key(
                "requests_per_min",
                "1..=1099511627776",
                "none",
                "Requests admitted in any 60 s (one with `n` sequences counts `n`).",
            ),
            key(
                "tokens_per_min",
                "1..=1099511627776",
                "none",
                "Prompt plus output tokens in any 60 s: a request reserves its prompt and `max_tokens` when admitted and gets back what it did not use when it ends.",
            ),
            key("max_concurrent", "1..=1048576", "none", "Sequences in flight at once."),
            key("max_tokens", "1..=1048576", "none", "Largest `max_tokens` a request may ask for."),
        ],
    },
];

/// The reference page, `docs/reference/topology.md`.
pub fn markdown() -> String {
    let mut page = String::new();
    page.push_str(
        "<!-- Generated by `tessera topology reference` from topology/src/reference.rs; do not edit. -->\n\n",
    );
    page.push_str("# Topology keys\n\n");
    page.push_str(
        "Every table and key a topology file may hold. [`topology/default.toml`](../../topology/default.toml) \
         is the embedded default with every key commented, and `tessera topology check FILE` validates a file: \
         an error names the file, line, column and dotted key. Durations are at most a day, and counts that \
         multiply stay small, so nothing derived from a value overflows.\n",
    );
    for table in TABLES {
        let _ = write!(page, "\n## {}\n\n{}\n\n", heading(table), table.about);
        page.push_str("| key | values | default | meaning |\n|---|---|---|---|\n");
        for key in table.keys {
            let _ = writeln!(page, "| `{}` | {} | {} | {} |", key.name, key.values, key.default, key.about);
        }
    }
    page
}

fn heading(table: &Table) -> String {
    if table.path.is_empty() { "Tables".to_owned() } else { format!("`{}`", table.header) }
}

/// serde's own list of a struct's fields: a deserializer that, asked for a struct,
/// keeps the field names serde passes it and stops.
#[cfg(test)]
pub(crate) mod introspect {
    use serde::Deserialize;
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;

    #[derive(Debug)]
    pub(crate) struct Stop(Option<&'static [&'static str]>);

    impl fmt::Display for Stop {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("introspection stops here")
        }
    }

    impl std::error::Error for Stop {}

    impl de::Error for Stop {
        fn custom<T: fmt::Display>(_: T) -> Self {
            Stop(None)
        }
    }

    struct Introspect;

    impl<'de> Deserializer<'de> for Introspect {
        type Error = Stop;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop(None))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            Err(Stop(Some(fields)))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
            unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    /// The keys serde reads into `T`.
    pub(crate) fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        match T::deserialize(Introspect) {
            Err(Stop(Some(fields))) => fields,
            _ => panic!("{} is not a struct", std::any::type_name::<T>()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn every_schema_key_is_documented_and_nothing_else() {
        let schema = crate::validate::schema_tables();
        let documented: BTreeSet<&str> = TABLES.iter().map(|t| t.path).collect();
        let read: BTreeSet<&str> = schema.iter().map(|(path, _)| *path).collect();
        assert_eq!(documented, read, "tables documented vs tables the schema reads");
        // A table a file may hold has its own keys listed.
        for table in TABLES {
            for key in table.keys.iter().filter(|k| k.values.contains("table") && !k.values.contains('=')) {
                let path =
                    if table.path.is_empty() { key.name.to_owned() } else { format!("{}.{}", table.path, key.name) };
                assert!(documented.contains(path.as_str()), "{path} has no table of keys in TABLES");
            }
        }
        for (path, fields) in schema {
            let table = TABLES.iter().find(|t| t.path == path).expect("compared above");
            let documented: BTreeSet<&str> = table.keys.iter().map(|k| k.name).collect();
            let read: BTreeSet<&str> = fields.iter().copied().collect();
            assert_eq!(
                documented, read,
                "[{path}]: keys documented in topology/src/reference.rs vs keys the schema reads"
            );
        }
    }

    #[test]
    fn every_key_says_what_it_is() {
        for table in TABLES {
            for key in table.keys {
                assert!(
                    !key.values.is_empty() && !key.default.is_empty() && !key.about.is_empty(),
                    "{}.{}",
                    table.path,
                    key.name
                );
                assert!(
                    !key.about.contains('|') && !key.values.contains('|'),
                    "a table cell: {}.{}",
                    table.path,
                    key.name
                );
            }
        }
    }

    #[test]
    fn the_checked_in_page_is_the_generated_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/reference/topology.md");
        let page = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            page == markdown(),
            "docs/reference/topology.md is not what the schema generates: run \
             `cargo run -- topology reference > docs/reference/topology.md`"
        );
    }
}
