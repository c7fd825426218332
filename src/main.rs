//! The `tessera` command line: parses arguments and wires the crates together. It holds
//! no logic of its own beyond presenting results.
#![forbid(unsafe_code)]

/// The whole process allocates through mimalloc: the simulator's actors make and drop
/// small buffers at every event, where it takes about half of the system allocator's
/// instructions (docs/performance.md, "The simulator").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod access;
mod bench_admission;
mod bench_router;
mod deploy;
mod plan;
mod up;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;

use tessera_backends::device::{Device, DeviceConfig, MatmulPrecision};
use tessera_backends::dtype::{DType, Quantize, parse_dtype};
use tessera_backends::kv::{DEFAULT_BLOCK_SIZE, KvCacheConfig};
use tessera_backends::loader::KernelLibrary;
use tessera_backends::model::{LoadOptions, Model};
use tessera_backends::sampling::SamplingParams;
use tessera_backends::synth::{self, Preset, SynthArch, SynthSpec};
use tessera_backends::tokenizer::TextTokenizer;
use tessera_chip_executor::local::{EngineConfig, LocalEngine};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Serve one LLM across a cluster of unlike AI chips")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a cluster: every host of the topology on this machine (default: the
    /// embedded two-host topology with the builtin tiny model).
    Up(UpArgs),
    /// Run one host of a topology (for clusters spanning several machines).
    Node(NodeArgs),
    /// Generate a completion on one chip.
    Generate(GenerateArgs),
    /// Model utilities.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Simulate a scenario (a topology, a workload, SLOs) in virtual time: the real
    /// behaviors, chips modelled by the roofline.
    Sim(SimArgs),
    /// Search a scenario's strategies (chip roles, batch limits) for its workload and
    /// SLOs: the Pareto set by the analytic model, the best verified in the simulator.
    Solve(SolveArgs),
    /// The live solver of a running cluster: its strategies, and applying one.
    #[command(subcommand)]
    Plan(plan::PlanCommand),
    /// Measure a real chip of a topology over a grid of step shapes and fit its
    /// performance model, for the simulator (a scenario's `[perf_models]`).
    Calibrate(CalibrateArgs),
    /// API keys of a shared cluster: add, list, revoke.
    #[command(subcommand)]
    Keys(access::KeysCommand),
    /// The audit log: verify its hash chain.
    #[command(subcommand)]
    Audit(access::AuditCommand),
    /// Deployment manifests rendered from a topology (Kubernetes).
    #[command(subcommand)]
    Deploy(deploy::DeployCommand),
    /// Cluster topology files.
    Topology {
        #[command(subcommand)]
        command: TopologyCommand,
    },
}

#[derive(Subcommand)]
enum TopologyCommand {
    /// Validate a topology file, check the paths of its hosts that run on this machine,
    /// and print a summary of the cluster it describes.
    Check { file: PathBuf },
    /// Print the reference of every table and key of the schema, in Markdown
    /// (docs/reference/topology.md is this output).
    Reference,
}

#[derive(Args)]
struct UpArgs {
    /// Topology TOML (default: the embedded two-host topology).
    topology: Option<PathBuf>,
    /// Run every host as a thread of this process instead of one process per host.
    #[arg(long)]
    in_process: bool,
    /// Run every chip as `role = "both"` (no prefill/decode disaggregation): the
    /// colocated baseline on the same chips.
    #[arg(long)]
    colocated: bool,
    /// Kernel library for `backend = "cpu"` chips (default: the one built with tessera).
    #[arg(long, value_name = "PATH")]
    kernel_lib: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct NodeArgs {
    /// Topology TOML (default: the embedded two-host topology).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// Which of its hosts to run.
    #[arg(long)]
    host: String,
    /// Drain and exit when stdin closes (how `tessera up` stops its hosts).
    #[arg(long)]
    exit_on_stdin_eof: bool,
    /// Run every chip as `role = "both"` (see `tessera up --colocated`).
    #[arg(long)]
    colocated: bool,
    /// Kernel library for `backend = "cpu"` chips (default: the one built with tessera).
    #[arg(long, value_name = "PATH")]
    kernel_lib: Option<PathBuf>,
    /// Serve this host's probe endpoint here: `/health` (200 while serving, 503 while
    /// draining), `/health/live` and `/metrics`, for hosts without the gateway.
    #[arg(long, value_name = "IP:PORT")]
    probe_listen: Option<std::net::SocketAddr>,
    /// How long a draining host waits for the requests it serves before it exits.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    drain_timeout_s: u64,
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write a deterministic random-weight checkpoint in the Hugging Face layout.
    MakeTiny(MakeTinyArgs),
    /// What a GGUF file holds: architecture, shapes, tensor types and bytes, tokenizer,
    /// chat template.
    Info(ModelInfoArgs),
}

#[derive(Args)]
struct ModelInfoArgs {
    /// The GGUF file.
    #[arg(value_name = "FILE.gguf")]
    file: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput of one chip, against the machine's measured
    /// memory bandwidth and matmul peak.
    Engine(BenchEngineArgs),
    /// Load an OpenAI-compatible server with streamed requests; report throughput and
    /// TTFT / TPOT / ITL / end-to-end latency percentiles.
    Serve(ServeArgs),
    /// Write a request trace in Mooncake's JSONL format with a chosen prefix reuse (for
    /// `bench serve --trace`); prints its oracle hit rate on stderr.
    TraceGen(TraceGenArgs),
    /// Round-trip latency and throughput of the ZeroMQ bus between two host processes
    /// (over loopback, or across namespaces or hosts with --peer-via), against plain TCP
    /// ping-pong of the same frame size over the same path.
    Bus(BenchBusArgs),
    /// The router's decision time on a large synthetic cluster (chips x indexed KV
    /// blocks) and its index's event apply rate.
    Router(BenchRouterArgs),
    /// The decision for one request of a shared cluster: its key checked among many,
    /// its tenant's quotas, the admission.
    Admission(BenchAdmissionArgs),
    /// The echo peer of `bench bus` (started by it).
    #[command(hide = true)]
    BusPeer(BusPeerArgs),
    /// KV transfer engine between two processes: tcp against plain TCP sockets (as many
    /// streams as the engine) and shm against memcpy, of the same bytes, in one run,
    /// beside the STREAM copy bandwidth of the machine.
    Transfer(BenchTransferArgs),
    /// The region-owning peer of `bench transfer` (started by it).
    #[command(hide = true)]
    TransferPeer(TransferPeerArgs),
    /// Forward TCP connections with every byte delayed (an added-latency link where the
    /// kernel has no netem qdisc): LISTEN:PORT -> TO:PORT for each port, until stopped.
    Relay(BenchRelayArgs),
    /// A model instance across several devices (pipeline stages x tensor-parallel
    /// ranks) beside the whole model on one device of as many threads, under one batched
    /// greedy workload: throughput ratio, the stages' idle share, the activation
    /// transfer's share, and the all-reduce's time against the copy bandwidth.
    Instance(BenchInstanceArgs),
}

#[derive(Args)]
struct BenchInstanceArgs {
    /// Checkpoint directory, GGUF file or `builtin:tiny|small|bench`.
    #[arg(long, default_value = "builtin:small", value_name = "DIR|FILE")]
    model: String,
    /// Layers of each pipeline stage, e.g. `3,3` (default: two halves).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    stages: Option<Vec<usize>>,
    /// Tensor-parallel devices per stage.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequences run together.
    #[arg(long, default_value_t = 8)]
    seqs: usize,
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Threads of each device of the instance (the one device gets as many in all).
    #[arg(long, default_value_t = 1)]
    threads_per_device: u32,
    /// Also run the instance with every stage after the first behind a stage server on
    /// a loopback port (as on another host), beside the in-process instance.
    #[arg(long)]
    remote_stages: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchTransferArgs {
    /// Bytes moved per measurement (e.g. 64MiB, 1GiB).
    #[arg(long, default_value = "64MiB", value_parser = tessera_netbench::transfer::parse_bytes)]
    bytes: usize,
    /// Bytes per assignment (one KV block).
    #[arg(long, default_value = "256KiB", value_parser = tessera_netbench::transfer::parse_bytes)]
    block: usize,
    /// Measured runs after one warm-up; medians are reported.
    #[arg(long, default_value_t = 9)]
    runs: usize,
    /// Parallel TCP streams (default: the engine's).
    #[arg(long)]
    streams: Option<usize>,
    /// Bytes per TCP request (default: the engine's).
    #[arg(long, value_parser = tessera_netbench::transfer::parse_bytes)]
    chunk: Option<usize>,
    /// Bytes of each array of the STREAM copy (default: 4 x the last-level cache,
    /// within 256MiB..1GiB).
    #[arg(long, value_parser = tessera_netbench::transfer::parse_bytes)]
    stream_bytes: Option<usize>,
    /// Also measure the prefill -> decode hand-off gap on the disaggregated cluster
    /// serving at this URL (e.g. `tessera up topology/examples/disagg-small.toml`).
    #[arg(long, value_name = "URL")]
    handoff_url: Option<String>,
    /// Prompt length of the hand-off measurement, in tokens.
    #[arg(long, default_value_t = 2048)]
    handoff_prompt_tokens: usize,
    /// Requests of the hand-off measurement, sent one at a time.
    #[arg(long, default_value_t = 5)]
    handoff_requests: usize,
    /// Model name for the hand-off requests (default: the first of GET /v1/models).
    #[arg(long)]
    handoff_model: Option<String>,
    /// Also measure a secured engine pair (`encrypt` or `authenticate`, fresh host keys)
    /// beside the plain engine's tcp, run by run.
    #[arg(long, default_value = "off")]
    security: tessera_topology::SecurityMode,
    /// The secured pair's cipher.
    #[arg(long, default_value = "chacha20-poly1305")]
    cipher: tessera_topology::Cipher,
    #[command(flatten)]
    peer: BenchPeerPlace,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Flags written by `tessera_netbench::transfer::TransferPeerArgs::to_args`.
#[derive(Args)]
struct TransferPeerArgs {
    #[arg(long)]
    bytes: usize,
    #[arg(long)]
    bind: std::net::IpAddr,
    #[command(flatten)]
    security: PeerSecurityArgs,
}

#[derive(Args)]
struct BenchRouterArgs {
    /// Chips in the cluster.
    #[arg(long, default_value_t = 1000)]
    chips: usize,
    /// (chip, block) entries in the cluster index.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// Decisions timed.
    #[arg(long, default_value_t = 20_000)]
    decisions: usize,
    /// Tokens per prompt (about; whole blocks plus one).
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchAdmissionArgs {
    /// API keys in the store.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Tenants the keys are spread over, each with every quota set.
    #[arg(long, default_value_t = 100)]
    tenants: usize,
    /// Decisions timed.
    #[arg(long, default_value_t = 100_000)]
    decisions: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchBusArgs {
    /// Round trips per measurement (latency, then throughput).
    #[arg(long, default_value_t = 10_000)]
    messages: usize,
    /// Payload bytes per envelope.
    #[arg(long, default_value_t = 64)]
    payload_bytes: usize,
    /// Messages in flight during the throughput measurement.
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// The bus's security modes to measure, in turn in this run (fresh host keys for
    /// each): e.g. `off,encrypt`; each after the first is also compared with the first.
    #[arg(long, value_delimiter = ',', default_value = "off", value_name = "MODE,...")]
    security: Vec<tessera_topology::SecurityMode>,
    /// The cipher of the secured modes.
    #[arg(long, default_value = "chacha20-poly1305")]
    cipher: tessera_topology::Cipher,
    /// The address this side binds; the peer connects to it.
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    #[command(flatten)]
    peer: BenchPeerPlace,
    /// Print JSON objects (one per mode) instead of tables.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchRelayArgs {
    /// The address to listen on.
    #[arg(long)]
    listen: std::net::IpAddr,
    /// The address connections are forwarded to (same port).
    #[arg(long)]
    to: std::net::IpAddr,
    /// Ports to relay, e.g. 7400,7401,7402 (a host's bus, events and transfer ports).
    #[arg(long, value_delimiter = ',', required = true, value_name = "PORT,...")]
    ports: Vec<u16>,
    /// Milliseconds added to every byte in each direction (a round trip gains twice this).
    #[arg(long, default_value_t = 5.0)]
    delay_ms: f64,
    /// Bytes in flight per direction of a connection (the emulated TCP window).
    #[arg(long, default_value = "4MiB", value_parser = tessera_netbench::transfer::parse_bytes)]
    window: usize,
}

/// Where a network benchmark's peer process runs (default: beside this one, on loopback).
#[derive(Args)]
struct BenchPeerPlace {
    /// The address the peer binds; this side connects to it.
    #[arg(long, default_value = "127.0.0.1")]
    peer_bind: std::net::IpAddr,
    /// A command that runs the peer elsewhere, words separated by spaces, the peer's own
    /// command line appended: e.g. `ip netns exec ns-b` to measure across two network
    /// namespaces (with --bind and --peer-bind set to their addresses).
    #[arg(long, value_name = "COMMAND")]
    peer_via: Option<String>,
}

impl BenchPeerPlace {
    /// The program to start and its first arguments, for peer subcommand `sub`.
    fn launch(&self, sub: &str) -> Result<(PathBuf, Vec<String>)> {
        let me = std::env::current_exe().context("locating the tessera binary to start the benchmark's peer")?;
        let tail = ["bench".to_string(), sub.to_string()];
        let Some(via) = &self.peer_via else { return Ok((me, tail.to_vec())) };
        let mut words = via.split_whitespace().map(str::to_string);
        let program = words.next().context("--peer-via is empty; give a command, e.g. `ip netns exec NS`")?;
        let args = words.chain(std::iter::once(me.display().to_string())).chain(tail).collect();
        Ok((PathBuf::from(program), args))
    }
}

/// Flags written by `tessera_netbench::bus::BusPeerArgs::to_args`.
#[derive(Args)]
struct BusPeerArgs {
    #[arg(long)]
    direct: std::net::SocketAddr,
    #[arg(long)]
    events: std::net::SocketAddr,
    #[arg(long)]
    peer_direct: std::net::SocketAddr,
    #[arg(long)]
    peer_events: std::net::SocketAddr,
    #[arg(long)]
    tcp: std::net::SocketAddr,
    #[command(flatten)]
    security: PeerSecurityArgs,
}

/// A bench peer's secured plane: the flags `tessera_netbench`'s `BenchSecurity::to_args`
/// writes.
#[derive(Args)]
struct PeerSecurityArgs {
    #[arg(long)]
    mode: Option<tessera_topology::SecurityMode>,
    #[arg(long, default_value = "chacha20-poly1305")]
    cipher: tessera_topology::Cipher,
    #[arg(long)]
    keys_dir: Option<PathBuf>,
}

impl PeerSecurityArgs {
    fn settings(self) -> Option<(tessera_netbench::bus::BenchSecurity, PathBuf)> {
        self.mode.and_then(|m| bench_security(m, self.cipher)).zip(self.keys_dir)
    }
}

/// The bench's secured-bus settings for a topology security mode (`None`: off).
fn bench_security(
    mode: tessera_topology::SecurityMode,
    cipher: tessera_topology::Cipher,
) -> Option<tessera_netbench::bus::BenchSecurity> {
    use tessera_runtime::security::Mode;
    let mode = match mode {
        tessera_topology::SecurityMode::Off => return None,
        tessera_topology::SecurityMode::Authenticate => Mode::Authenticate,
        tessera_topology::SecurityMode::Encrypt => Mode::Encrypt,
    };
    Some(tessera_netbench::bus::BenchSecurity { mode, cipher })
}

/// Where the kernels run.
#[derive(Args, Clone)]
struct DeviceArgs {
    /// Kernel library to load (default: the CPU library cargo builds, or $TESSERA_KERNEL_LIB).
    #[arg(long, value_name = "PATH")]
    kernel_lib: Option<PathBuf>,
    /// Worker threads of the device (0 = all cores).
    #[arg(long, default_value_t = 0)]
    threads: u32,
    /// Arithmetic of prompts' linear layers: f32, or bf16 (about twice as fast where the
    /// CPU has AVX512-BF16, with 8-bit significands; decode stays f32).
    #[arg(long, default_value = "f32", value_name = "f32|bf16")]
    matmul_precision: MatmulPrecision,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer.json), a GGUF file, or
    /// `builtin:tiny` / `builtin:small` for a generated test model.
    #[arg(long, value_name = "DIR|FILE")]
    model: String,
    /// Prompt text.
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', value_name = "ID,ID,...")]
    prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample among the k most likely tokens; 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample among the most likely tokens holding this probability mass; 1 = off.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler (same seed, same tokens); default: fresh entropy.
    #[arg(long)]
    seed: Option<u64>,
    /// Weight dtype on the device (default: as stored).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Quantize float weights when loading: q8_0 or q4_0 (the embedding and LM head
    /// to q8_0). A GGUF file's quantized tensors keep their formats.
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<Quantize>,
    /// KV cache dtype (f16 by default, as llama.cpp's; f32 or bf16).
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    kv_dtype: DType,
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    /// Extra token ids that end the generation (besides the model's end-of-sequence ids).
    #[arg(long, value_delimiter = ',', value_name = "ID,ID,...")]
    stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Write the logits each token was sampled from: float32 [tokens, vocab] .npy.
    #[arg(long, value_name = "FILE.npy")]
    dump_logits: Option<PathBuf>,
    /// Run the model as an instance over several CPU devices: the layers of each
    /// pipeline stage, e.g. `10,20` (stages may differ in size).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    stages: Option<Vec<usize>>,
    /// Tensor-parallel devices per stage (alone: one stage of that many devices).
    #[arg(long)]
    tp: Option<usize>,
    /// Memory limit of each device of the instance, bytes (default: none).
    #[arg(long, value_name = "BYTES")]
    device_memory_bytes: Option<u64>,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct MakeTinyArgs {
    /// Directory to write (created if missing; its checkpoint files are replaced).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// tiny (~1M parameters), small (~6M) or bench (~0.9B, shaped like Llama-3.2-1B).
    #[arg(long, default_value = "tiny")]
    preset: Preset,
    /// llama or qwen2 (q/k/v biases, tied embeddings).
    #[arg(long, default_value = "llama")]
    arch: SynthArch,
    /// Seed of the random weights: same seed, same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight dtype in the file (default: f32 for tiny/small, f16 for bench).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Split the weights over this many safetensors shards (with an index file).
    #[arg(long, default_value_t = 1)]
    shards: usize,
}

#[derive(Args)]
struct BenchEngineArgs {
    /// Checkpoint directory or `builtin:<preset>`.
    #[arg(long, value_name = "DIR")]
    model: String,
    /// Weight dtype on the device (default: as stored).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// Quantize float weights when loading: q8_0 or q4_0 (see `generate --help`).
    #[arg(long, value_name = "FORMAT")]
    quantize: Option<Quantize>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batch: Vec<usize>,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Tokens already in each sequence's cache during decode.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// KV cache dtype (f16 by default, as llama.cpp's; f32 or bf16).
    #[arg(long, default_value = "f16", value_parser = parse_dtype)]
    kv_dtype: DType,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also show where each phase's step time goes: every kernel op's calls and
    /// milliseconds per step, and the host's time around them.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
struct CalibrateArgs {
    /// Topology TOML (default: the embedded two-host topology).
    #[arg(long)]
    topology: Option<PathBuf>,
    /// The chip to measure (its id); its backend must be `cpu` or `plugin:PATH`.
    #[arg(long)]
    chip: String,
    /// Write the fitted model here (TOML, as a scenario's `[perf_models]` reads it).
    #[arg(long, value_name = "FILE.toml")]
    out: Option<PathBuf>,
    /// Stop measuring new shapes after this many seconds.
    #[arg(long, default_value_t = 600)]
    budget_s: u64,
    /// Timed runs of each shape after one warm-up; the median counts.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    repeats: u64,
    /// Kernel library for a `backend = "cpu"` chip (default: the one built with tessera).
    #[arg(long)]
    kernel_lib: Option<PathBuf>,
    /// Fit to the steps served chips ran instead of measuring a grid: a `tessera up` log
    /// written with `TESSERA_LOG=info,tessera::steps=trace`, whose steps of every chip
    /// of `--chip`'s kind are used.
    #[arg(long, value_name = "LOG")]
    from_steps: Option<PathBuf>,
}

#[derive(Args)]
struct SimArgs {
    /// The scenario TOML (see sims/scenarios/). Several (or --rate with several rates)
    /// run one after another and print one comparison table.
    #[arg(required = true, value_name = "SCENARIO")]
    scenarios: Vec<PathBuf>,
    /// Run at these arrival rates (requests/s, comma-separated) instead of the
    /// scenario's own `rate_rps`.
    #[arg(long, value_delimiter = ',', value_name = "RPS")]
    rate: Vec<f64>,
    /// Seed of the workload (default: the scenario's `seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Print the report as JSON (the same for the same scenario and seed); the
    /// simulator's wall-clock speed goes to stderr.
    #[arg(long)]
    json: bool,
    /// Count the events and time their handlers per message kind, and print where the
    /// wall time went.
    #[arg(long)]
    profile: bool,
    /// Also draw TTFT and end-to-end p99 over time, with the scenario's faults marked,
    /// as an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct SolveArgs {
    /// The scenario whose topology (its chips, by kind), workload and SLOs to solve.
    #[arg(value_name = "SCENARIO", required_unless_present = "topology", conflicts_with = "topology")]
    scenario: Option<PathBuf>,
    /// The topology whose chips to solve for (with --workload, instead of a scenario).
    #[arg(long, value_name = "T.toml", requires = "workload")]
    topology: Option<PathBuf>,
    /// A workload file: a scenario's `[workload]`, `[slo]` and the rest, without a topology.
    #[arg(long, value_name = "W.toml", requires = "topology")]
    workload: Option<PathBuf>,
    /// Solve for this arrival rate (requests/s) instead of the scenario's `rate_rps`.
    #[arg(long, value_name = "RPS")]
    rate: Option<f64>,
    /// Verify this many strategies of the set (the best by analytic goodput per $) in
    /// the simulator, with the scenario's requests.
    #[arg(long, default_value_t = 6, value_name = "N")]
    verify: usize,
    /// Prefill token budgets to try (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [512, 1024, 2048, 4096])]
    budgets: Vec<u32>,
    /// Decode batch caps to try (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [16, 32, 64, 128, 256])]
    caps: Vec<u32>,
    /// Conditional-disaggregation thresholds to try (default: the topology's).
    #[arg(long, value_delimiter = ',', value_name = "TOKENS")]
    min_prompt_tokens: Vec<u32>,
    /// Rows of the table (the set's best by goodput, then $ per token; verified ones always).
    #[arg(long, default_value_t = 20, value_name = "N")]
    rows: usize,
    /// Print the set as JSON.
    #[arg(long)]
    json: bool,
    /// Also draw the set (goodput per $ against TTFT p90, the chosen one marked) as an SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Write the topology with this strategy of the set applied (its id; `chosen` for the
    /// chosen one) to --out, ready for `tessera up`: roles, batch limits, the
    /// disaggregation threshold; idle chips left out.
    #[arg(long, value_name = "ID|chosen", requires = "out")]
    apply: Option<String>,
    /// Where --apply writes the topology.
    #[arg(long, value_name = "FILE.toml", requires = "apply")]
    out: Option<PathBuf>,
    /// Instead: time the analytic solve, then a re-solve after a small change (the first
    /// kind one chip short, the rate 20% up) with the first one's step-time tables and
    /// from scratch, as the live solver re-solves.
    #[arg(long, conflicts_with_all = ["apply", "json", "plot"])]
    resolve: bool,
    /// Also search instance shapes: regroup each host's chips of every kind into
    /// tensor-parallel instances of these sizes (comma-separated; 1: single chips),
    /// solve every combination of one size per kind, and compare the best of each.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", conflicts_with_all = ["apply", "json", "plot", "resolve"])]
    tp: Vec<usize>,
}

#[derive(Args)]
struct ServeArgs {
    /// Server base URL, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    url: String,
    /// Model name to send (default: the first id from GET {url}/v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Route to load: `completions` or `chat`.
    #[arg(long, default_value = "completions")]
    endpoint: tessera_loadgen::Endpoint,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Closed loop: requests kept in flight (the default, with 8).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Measured requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Input tokens per request (approximate): `128`, `uniform:64-256` or `normal:128,32`.
    #[arg(long, default_value = "128")]
    isl: tessera_loadgen::LengthDist,
    /// Output tokens per request (`max_tokens` with `ignore_eos`), same syntax as --isl.
    #[arg(long, default_value = "128")]
    osl: tessera_loadgen::LengthDist,
    /// Seed of the prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Requests sent and awaited before measuring.
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Limit on each request, from connecting to the end of its stream.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Requests in this many groups, each sharing a system prompt of --prefix-words.
    #[arg(long, requires = "prefix_words")]
    prefix_groups: Option<u32>,
    /// Words of each group's system prompt (about as many tokens).
    #[arg(long, requires = "prefix_groups")]
    prefix_words: Option<u32>,
    /// Replay a trace in Mooncake's JSONL format (timestamp, input_length, output_length,
    /// hash_ids) instead of --requests/--isl/--osl/--rate (see `bench trace-gen`).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Multi-turn chats instead of --requests: this many conversations of --turns turns.
    /// Every user message has --isl words, every answer --osl tokens; a turn is sent once
    /// the last is answered, its prompt the last prompt, its answer and a new message.
    /// --concurrency keeps that many conversations under way; --rate starts them. With
    /// --prefix-groups, each conversation opens with its group's system prompt.
    #[arg(
        long,
        value_name = "CONVERSATIONS",
        requires = "turns",
        conflicts_with_all = ["trace", "requests"],
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    multi_turn: Option<u32>,
    /// Turns of each --multi-turn conversation.
    #[arg(long, requires = "multi_turn", value_parser = clap::value_parser!(u32).range(1..))]
    turns: Option<u32>,
    /// Goodput: count the requests whose TTFT is within this many ms ...
    #[arg(long, requires = "slo_tpot_ms", value_parser = positive_ms)]
    slo_ttft_ms: Option<f64>,
    /// ... and whose TPOT is within this many ms (a one-token answer has none to miss).
    #[arg(long, requires = "slo_ttft_ms", value_parser = positive_ms)]
    slo_tpot_ms: Option<f64>,
    /// A tenant's key, sent as `Authorization: Bearer KEY` (default:
    /// `$TESSERA_API_KEY`; none if unset).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Several tenants' loads side by side, each with its own key, rate or concurrency,
    /// requests and lengths (a TOML file of `[[tenants]]`; see docs/how-to/tenancy.md);
    /// the report gives each tenant's latencies and refusals.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = ["api_key", "rate", "concurrency", "trace", "multi_turn", "prefix_groups"],
    )]
    tenants: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A latency bound in milliseconds: a finite number above zero.
fn positive_ms(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms > 0.0 => Ok(ms),
        _ => Err(format!("{text:?} is not a number of milliseconds above 0")),
    }
}

#[derive(Args)]
struct TraceGenArgs {
    /// Requests in the trace.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Input lengths in tokens (as --isl of bench serve).
    #[arg(long, default_value = "uniform:2048-8192")]
    isl: tessera_loadgen::LengthDist,
    /// Output lengths in tokens.
    #[arg(long, default_value = "128")]
    osl: tessera_loadgen::LengthDist,
    /// Share (0..=1) of each prompt's 512-token blocks taken from an earlier prompt.
    #[arg(long, default_value_t = 0.5)]
    reuse: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to write the JSONL trace (default: standard output).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => {
            init_logging();
            up::up(args.topology.as_deref(), args.in_process, args.colocated, args.kernel_lib)
        }
        Command::Node(args) => {
            init_logging();
            up::node(&args)
        }
        Command::Generate(args) => generate(args),
        Command::Model(ModelCommand::MakeTiny(args)) => make_tiny(args),
        Command::Model(ModelCommand::Info(args)) => model_info(args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine(args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve(args),
        Command::Bench(BenchCommand::Bus(args)) => bench_bus(args),
        Command::Bench(BenchCommand::Router(args)) => bench_router(args),
        Command::Bench(BenchCommand::Admission(args)) => bench_admission(args),
        Command::Bench(BenchCommand::TraceGen(args)) => trace_gen(args),
        Command::Bench(BenchCommand::BusPeer(args)) => bench_bus_peer(args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_transfer(args),
        Command::Bench(BenchCommand::TransferPeer(args)) => bench_transfer_peer(args),
        Command::Bench(BenchCommand::Relay(args)) => bench_relay(args),
        Command::Bench(BenchCommand::Instance(args)) => bench_instance(args),
        Command::Topology { command: TopologyCommand::Check { file } } => topology_check(&file),
        Command::Topology { command: TopologyCommand::Reference } => {
            print!("{}", tessera_topology::reference::markdown());
            Ok(())
        }
        Command::Sim(args) => sim(args),
        Command::Solve(args) => solve(args),
        Command::Plan(command) => plan::plan(command),
        Command::Keys(command) => access::keys(command),
        Command::Deploy(command) => deploy::deploy(command),
        Command::Audit(command) => access::audit(command),
        Command::Calibrate(args) => calibrate(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn sim(args: SimArgs) -> Result<()> {
    // Every scenario is read (and every rate applied) before the first runs: a typo in
    // the last file fails at once. The errors name the file, line, column and key.
    let mut runs = Vec::new();
    for path in &args.scenarios {
        let scenario = tessera_sim::load(path)?;
        if args.rate.is_empty() {
            runs.push(scenario);
        } else {
            for &rate in &args.rate {
                runs.push(scenario.at_rate(rate).map_err(anyhow::Error::msg)?);
            }
        }
    }
    if runs.iter().any(|s| !s.faults.is_empty()) {
        // A scheduled chip crash is a worker panic by design: not worth a backtrace.
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info.payload().downcast_ref::<&str>().copied().unwrap_or_default();
            if !message.starts_with("fault drill") {
                default(info);
            }
        }));
    }
    if let [scenario] = &runs[..] {
        return sim_one(scenario, &args);
    }
    if args.plot.is_some() {
        bail!("--plot draws one run; give one scenario and at most one rate");
    }
    let mut reports = Vec::with_capacity(runs.len());
    for (i, scenario) in runs.iter().enumerate() {
        let load = match scenario.workload.requests {
            tessera_sim::scenario::WorkloadRequests::Chats { concurrency: Some(c), .. } => {
                format!("{c} chats at a time")
            }
            _ => format!("{} req/s", scenario.workload.rate_rps),
        };
        eprintln!("run {}/{}: {} at {load}", i + 1, runs.len(), scenario.source);
        let options = tessera_sim::RunOptions { seed: args.seed, profile: args.profile };
        let (report, speed) = tessera_sim::run_with_progress(scenario, &options, &mut |_, _| {})?;
        eprintln!(
            "  simulated {:.1} s in {:.1} s of wall time ({:.0} events/s)",
            report.simulated_s, speed.wall_s, speed.events_per_s
        );
        eprint!("{}", speed.profile_table());
        reports.push(report);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", tessera_sim::report::comparison(&reports));
    }
    Ok(())
}

fn solve(args: SolveArgs) -> Result<()> {
    let mut scenario = match (&args.scenario, &args.topology, &args.workload) {
        (Some(path), _, _) => tessera_sim::load(path)?,
        (None, Some(topology), Some(workload)) => tessera_sim::scenario::load_with_topology(workload, topology)?,
        _ => bail!("give a scenario, or --topology and --workload"),
    };
    if let Some(rate) = args.rate {
        scenario = scenario.at_rate(rate).map_err(anyhow::Error::msg)?;
    }
    let min_prompt_tokens = if args.min_prompt_tokens.is_empty() {
        vec![u32::try_from(scenario.topology.disagg.min_prompt_tokens).unwrap_or(u32::MAX)]
    } else {
        args.min_prompt_tokens.clone()
    };
    let space = tessera_planner::Space {
        prefill_budgets: args.budgets.clone(),
        decode_caps: args.caps.clone(),
        min_prompt_tokens,
    };
    if args.resolve {
        let r = tessera_sim::solve::resolve(&scenario, &space).map_err(anyhow::Error::msg)?;
        println!(
            "solve {:.3} s; re-solve after {}: {:.3} s with the first solve's {} step-time tables, \
             {:.3} s from scratch ({})",
            r.first_s,
            r.change,
            r.reused_s,
            r.tables_reused,
            r.fresh_s,
            if r.same { "the same set" } else { "DIFFERENT sets" }
        );
        if !r.same {
            bail!("the re-solve with kept tables found another set than from scratch");
        }
        return Ok(());
    }
    if !args.tp.is_empty() {
        return solve_shapes(&scenario, &space, &args);
    }
    let solution = tessera_sim::solve::solve(&scenario, &space, args.verify).map_err(anyhow::Error::msg)?;
    if let Some(path) = &args.plot {
        std::fs::write(path, solution.svg()).with_context(|| format!("cannot write the plot to {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&solution)?);
    } else {
        print!("{}", solution.table(args.rows));
    }
    if let (Some(id), Some(out)) = (&args.apply, &args.out) {
        write_applied(&scenario, &solution, id, out)?;
    }
    Ok(())
}

/// `tessera solve --tp`: every combination of one instance size per chip kind solved
/// (sizes a kind's chips cannot hold the model at skipped, saying why), each shape's
/// chosen strategy compared, best first by goodput per $ (simulated where verified).
fn solve_shapes(scenario: &tessera_sim::Scenario, space: &tessera_planner::Space, args: &SolveArgs) -> Result<()> {
    if let Some(bad) = args.tp.iter().find(|&&t| t == 0 || t > 64) {
        bail!("--tp {bad}: an instance holds 1 to 64 chips");
    }
    let kinds = tessera_sim::solve::physical_kinds(scenario);
    let mut combos: Vec<Vec<usize>> = vec![Vec::new()];
    for _ in &kinds {
        combos = combos.into_iter().flat_map(|c| args.tp.iter().map(move |&t| [c.clone(), vec![t]].concat())).collect();
    }
    let (mut rows, mut verified) = (Vec::new(), Vec::new());
    for tps in combos {
        let shape: Vec<String> = kinds.iter().zip(&tps).map(|(k, t)| format!("{k} tp{t}")).collect();
        let shape = shape.join(", ");
        let solved = tessera_sim::solve::reshape(scenario, &kinds, &tps)
            .and_then(|(s, left)| Ok((tessera_sim::solve::solve(&s, space, args.verify)?, left)));
        match solved {
            Err(e) => println!("{shape}: not solved: {e}"),
            Ok((solution, left)) => {
                let chosen =
                    solution.strategies.iter().chain(&solution.baselines).find(|p| Some(p.id) == solution.chosen);
                let Some(p) = chosen else {
                    println!("{shape}: nothing verified keeps up");
                    continue;
                };
                let (per_usd, goodput, how) = match p.simulated {
                    Some(s) => (s.goodput_per_usd.unwrap_or(0.0), s.goodput_rps, "simulated"),
                    None => (p.analytic.goodput_per_usd(), p.analytic.goodput_rps, "analytic"),
                };
                println!(
                    "{shape}: {} ({per_usd:.1} req/$, {goodput:.2} req/s within SLO, {how}; {left} chip(s) left out)",
                    p.describe
                );
                // The best verified mix and single kind of this shape, for the comparison.
                for p in solution.strategies.iter().chain(&solution.baselines) {
                    if let Some(sim) = p.simulated.filter(|s| s.failed == 0) {
                        let mix = tessera_sim::solve::is_mix(&p.strategy);
                        verified.push((sim.goodput_per_usd.unwrap_or(0.0), mix, shape.clone(), p.describe.clone()));
                    }
                }
                rows.push((per_usd, shape, p.describe.clone()));
            }
        }
    }
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    match rows.first() {
        Some((per_usd, shape, describe)) => println!("\nbest shape: {shape}: {describe} at {per_usd:.1} req/$"),
        None => bail!("no shape of {:?} serves the workload within the SLOs", args.tp),
    }
    let best = |mix: bool| verified.iter().filter(|v| v.1 == mix).max_by(|a, b| a.0.total_cmp(&b.0));
    if let (Some(m), Some(one)) = (best(true), best(false)) {
        println!(
            "best verified mix: {} ({}) at {:.1} req/$; best verified single-kind cluster: {} ({}) at {:.1}: the mix {:+.1}%",
            m.3,
            m.2,
            m.0,
            one.3,
            one.2,
            one.0,
            (m.0 / one.0 - 1.0) * 100.0
        );
    }
    Ok(())
}

/// Writes `scenario`'s topology file with strategy `id` of `solution` applied to `out`.
fn write_applied(
    scenario: &tessera_sim::Scenario,
    solution: &tessera_sim::solve::Solution,
    id: &str,
    out: &Path,
) -> Result<()> {
    let (applied, what) = solution.applied_topology(scenario, id).map_err(anyhow::Error::msg)?;
    // The result must be a valid topology before it is written.
    tessera_topology::parse(&applied, &out.display().to_string()).map_err(anyhow::Error::msg)?;
    std::fs::write(out, applied).with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!("wrote {}: {what}", out.display());
    Ok(())
}

fn sim_one(scenario: &tessera_sim::Scenario, args: &SimArgs) -> Result<()> {
    // A progress bar on a terminal, and not over JSON (it draws on stderr).
    let bar = if std::io::stderr().is_terminal() && !args.json {
        let style = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests ended ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        indicatif::ProgressBar::new(0).with_style(style)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let options = tessera_sim::RunOptions { seed: args.seed, profile: args.profile };
    let (report, speed) = tessera_sim::run_with_progress(scenario, &options, &mut |ended, requests| {
        bar.set_length(requests as u64);
        bar.set_position(ended as u64);
    })?;
    bar.finish_and_clear();
    if let Some(path) = &args.plot {
        std::fs::write(path, report.svg()).with_context(|| format!("cannot write the plot to {}", path.display()))?;
    }
    if args.json {
        println!("{}", report.to_json());
        eprintln!(
            "simulated {:.3} s in {:.3} s of wall time; {} events, {:.0} events/s",
            report.simulated_s, speed.wall_s, report.events, speed.events_per_s
        );
        eprint!("{}", speed.profile_table());
    } else {
        print!("{}", report.table(&speed));
    }
    Ok(())
}

fn calibrate(args: CalibrateArgs) -> Result<()> {
    use tessera_node::calibrate::{CalibrateOptions, calibrate, calibrate_from_steps};
    let spec = up::load_spec(args.topology.as_deref(), false)?;
    let calibration = match &args.from_steps {
        Some(log) => {
            let text = std::fs::read_to_string(log).with_context(|| format!("cannot read {}", log.display()))?;
            eprintln!("fitting chip {}'s kind to the served steps in {}", args.chip, log.display());
            calibrate_from_steps(&spec, &args.chip, &text, args.kernel_lib)
                .with_context(|| format!("{}", log.display()))?
        }
        None => {
            let opts = CalibrateOptions {
                chip: args.chip,
                budget: Duration::from_secs(args.budget_s),
                repeats: args.repeats as usize,
                kernel_lib: args.kernel_lib,
            };
            eprintln!("measuring chip {} of {} (at most {} s)", opts.chip, spec.source, args.budget_s);
            calibrate(&spec, &opts, &mut |m| eprintln!("  {:<28} {:>10.3} ms", m.what, m.measured_s * 1e3))?
        }
    };
    print!("{}", calibration.table());
    let fit = &calibration.fit;
    println!(
        "fit: error median {:.1}%, max {:.1}% over {} {}{}",
        fit.median_error * 100.0,
        fit.max_error * 100.0,
        calibration.measured.len(),
        if calibration.served_by.is_empty() { "shapes" } else { "classes of served steps" },
        if calibration.cut_short { " (the budget cut the grid short)" } else { "" }
    );
    let text = calibration.to_toml();
    match &args.out {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("cannot write {}", path.display()))?;
            println!("wrote {}", path.display());
        }
        None => print!("\n{text}"),
    }
    Ok(())
}

fn topology_check(file: &std::path::Path) -> Result<()> {
    // The error already names the file, line, column and key.
    let (spec, paths) = tessera_topology::load_with_report(file)?;
    print!("{}{}", spec.render(), paths.render());
    // Instances' splits, where the model can be read here.
    let instances: Vec<_> =
        spec.hosts.iter().flat_map(|h| &h.chips).filter_map(|c| c.parallel.as_ref().map(|p| (c, p))).collect();
    if instances.is_empty() {
        return Ok(());
    }
    let Ok(dir) = resolve_model(&spec.model) else { return Ok(()) };
    if !dir.exists() {
        return Ok(());
    }
    println!("instances:");
    for (chip, par) in instances {
        let stages = tessera_node::instance::stages(&spec, chip, par, &dir, None, None)?;
        let layers: Vec<String> = stages
            .iter()
            .map(|s| {
                let ids: Vec<&str> = s.devices.iter().map(|d| d.label.as_str()).collect();
                let remote = s.remote.as_ref().map_or(String::new(), |r| format!(" (stage server {})", r.addr));
                format!("layers {}..{} on {}{remote}", s.layers.start, s.layers.end, ids.join("+"))
            })
            .collect();
        println!("  {}: {} stage(s) x tp {}: {}", chip.id, stages.len(), par.tp, layers.join("; "));
    }
    Ok(())
}

/// Logs to stderr; `TESSERA_LOG` takes a tracing filter (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn open_device(args: &DeviceArgs) -> Result<Device> {
    let lib = match &args.kernel_lib {
        Some(path) => KernelLibrary::load(path)?,
        None => KernelLibrary::load_default()?,
    };
    let config = DeviceConfig { threads: args.threads, matmul_precision: args.matmul_precision, ..Default::default() };
    Ok(Device::open(&lib, &config)?)
}

/// A checkpoint directory, or a builtin test model generated on first use.
fn resolve_model(spec: &str) -> Result<PathBuf> {
    Ok(tessera_node::resolve_model(spec)?)
}

fn load_model(model: &str, options: LoadOptions, device: &DeviceArgs) -> Result<(PathBuf, Model)> {
    let dir = resolve_model(model)?;
    let device = open_device(device)?;
    let model = Model::load_with(&dir, device, options)?;
    Ok((dir, model))
}

fn generate(args: GenerateArgs) -> Result<()> {
    let options = LoadOptions { dtype: args.dtype, quantize: args.quantize };
    let sharded = args.stages.is_some() || args.tp.is_some() || args.device_memory_bytes.is_some();
    let (dir, model) = if sharded {
        (resolve_model(&args.model)?, None)
    } else {
        let (dir, model) = load_model(&args.model, options, &args.device)?;
        (dir, Some(model))
    };
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => tokenizer.encode(text, true)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: args.max_tokens,
        // The model's EOS ids (config.json, generation_config.json) stop the engine
        // unless --ignore-eos; the tokenizer's own eos_token joins them.
        stop_token_ids: if args.ignore_eos {
            args.stop_token_ids.clone()
        } else {
            args.stop_token_ids.iter().copied().chain(tokenizer.eos_ids()).collect()
        },
        ignore_eos: args.ignore_eos,
        penalties: Default::default(),
    };
    let model_config = tessera_backends::config::ModelConfig::from_dir(&dir)?;
    let vocab = model_config.vocab_size;
    let longest = prompt.len().saturating_add(args.max_tokens).min(model_config.max_context);
    let num_blocks = longest.div_ceil(args.block_size.max(1)).max(1);
    let kv = KvCacheConfig { block_size: args.block_size, num_blocks, dtype: args.kv_dtype };
    let config = EngineConfig { keep_logits: args.dump_logits.is_some(), ..Default::default() };
    let mut engine = match model {
        Some(model) => LocalEngine::new(model, kv, config)?,
        None => {
            let stages = args.stages.clone().unwrap_or_else(|| vec![model_config.num_layers]);
            let tp = args.tp.unwrap_or(1);
            let device = |s: usize, r: usize| tessera_backends::instance::ShardDevice {
                label: format!("stage{s}-rank{r}"),
                kernel_lib: args.device.kernel_lib.clone(),
                device: DeviceConfig {
                    threads: args.device.threads,
                    memory_limit_bytes: args.device_memory_bytes.unwrap_or(0),
                    matmul_precision: args.device.matmul_precision,
                    ..Default::default()
                },
            };
            let spec = tessera_backends::instance::InstanceSpec {
                model_dir: dir.clone(),
                options,
                stages: tessera_backends::instance::InstanceSpec::stages_of(&stages, tp, device),
                block_size: args.block_size,
                kv_dtype: args.kv_dtype,
                kv_layout: tessera_backends::kv_format::KvLayout::HeadMajor,
                default_kv_bytes: 256 << 20,
                max_blocks: num_blocks,
                collectives: Default::default(),
            };
            eprintln!("[an instance of {} stages ({stages:?} layers) x tp {tp}]", stages.len());
            LocalEngine::instance(&spec, config)?
        }
    };
    engine.add_request(0, &prompt, params.clone())?;
    let started = Instant::now();
    let mut first_token_s = None;
    let mut decoder = tokenizer.stream_decoder();
    let mut out = std::io::stdout().lock();
    use std::io::Write;
    while engine.has_work() {
        let report = engine.step()?;
        for (_, token) in report.sampled {
            first_token_s.get_or_insert(started.elapsed().as_secs_f64());
            // The token that stopped the sequence (EOS, --stop-token-ids) is not text, as
            // the gateway does not show it either.
            if params.stop_token_ids.contains(&token) {
                continue;
            }
            if let Some(text) = decoder.push(token)? {
                write!(out, "{text}")?;
                out.flush()?;
            }
        }
    }
    if let Some(text) = decoder.finish()? {
        write!(out, "{text}")?;
    }
    writeln!(out)?;
    let done = engine.take_finished().pop().context("the request did not finish")?;
    let total_s = started.elapsed().as_secs_f64();
    let ttft = first_token_s.unwrap_or(total_s);
    let decode_tps =
        if done.tokens.len() > 1 { (done.tokens.len() - 1) as f64 / (total_s - ttft).max(1e-9) } else { 0.0 };
    eprintln!(
        "[{} prompt + {} generated tokens ({:?}); ttft {:.1} ms; decode {:.1} tok/s; token ids {:?}]",
        done.prompt_tokens,
        done.tokens.len(),
        done.finish,
        ttft * 1e3,
        decode_tps,
        done.tokens
    );
    if let Some(path) = &args.dump_logits {
        tessera_backends::npy::write_f32(path, &[done.tokens.len(), vocab], &done.logits)?;
        eprintln!("[logits of {} tokens written to {}]", done.tokens.len(), path.display());
    }
    Ok(())
}

fn model_info(args: ModelInfoArgs) -> Result<()> {
    let gguf = tessera_backends::gguf::Gguf::open(&args.file)?;
    let info = tessera_backends::gguf::info::describe(&gguf)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{}", info.render());
    }
    Ok(())
}

fn make_tiny(args: MakeTinyArgs) -> Result<()> {
    let spec =
        SynthSpec { preset: args.preset, arch: args.arch, seed: args.seed, dtype: args.dtype, shards: args.shards };
    let started = Instant::now();
    let summary = synth::write_checkpoint(&args.out, &spec)?;
    println!(
        "wrote {} ({} {}, {:.1}M parameters, {:.1} MB) in {:.1} s",
        summary.dir.display(),
        args.preset,
        args.arch,
        summary.params as f64 / 1e6,
        summary.bytes_written as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn trace_gen(args: TraceGenArgs) -> Result<()> {
    use tessera_loadgen::trace;
    let t = trace::generate(args.requests, args.rate, args.isl, args.osl, args.reuse, args.seed)
        .map_err(|e| anyhow::anyhow!("{}", e.0))?;
    let text = trace::to_jsonl(&t);
    match &args.out {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    eprintln!("{} requests; oracle hit rate {:.3}", t.len(), trace::oracle_hit_rate(&t));
    Ok(())
}

fn bench_instance(args: BenchInstanceArgs) -> Result<()> {
    let dir = resolve_model(&args.model)?;
    let stages = match args.stages {
        Some(stages) => stages,
        None => {
            let layers = tessera_backends::config::ModelConfig::from_dir(&dir)?.num_layers;
            vec![layers / 2, layers - layers / 2]
        }
    };
    let opts = tessera_chip_executor::bench::InstanceBenchOptions {
        model_dir: dir,
        options: LoadOptions::default(),
        stages,
        tp: args.tp,
        seqs: args.seqs,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        threads_per_device: args.threads_per_device,
        block_size: DEFAULT_BLOCK_SIZE,
        kv_dtype: DType::F16,
        remote_stages: args.remote_stages,
    };
    let report = tessera_chip_executor::bench::run(&opts).map_err(|e| anyhow::anyhow!("{e}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn bench_router(args: BenchRouterArgs) -> Result<()> {
    let opts = bench_router::RouterBenchOptions {
        chips: args.chips,
        blocks: args.blocks,
        decisions: args.decisions,
        prompt_tokens: args.prompt_tokens,
        block_size: args.block_size,
    };
    let report = bench_router::run(&opts);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn bench_admission(args: BenchAdmissionArgs) -> Result<()> {
    let opts =
        bench_admission::AdmissionBenchOptions { keys: args.keys, tenants: args.tenants, decisions: args.decisions };
    let report = bench_admission::run(&opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn bench_bus(args: BenchBusArgs) -> Result<()> {
    use tessera_netbench::bus as bench;
    let (program, prefix) = args.peer.launch("bus-peer")?;
    let mut reports: Vec<bench::BusBenchReport> = Vec::new();
    for mode in &args.security {
        let opts = bench::BusBenchOptions {
            messages: args.messages,
            payload_bytes: args.payload_bytes,
            window: args.window,
            peer: bench::PeerLaunch::Process { program: program.clone(), args: prefix.clone() },
            security: bench_security(*mode, args.cipher),
            bind: args.bind,
            peer_bind: args.peer.peer_bind,
        };
        let report = bench::run(&opts)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", report.table());
        }
        reports.push(report);
    }
    if let [first, rest @ ..] = reports.as_slice()
        && !args.json
    {
        for r in rest {
            println!(
                "{} vs {}: RTT p50 x{:.2}, throughput x{:.2} (bus against bus, this run)",
                r.security,
                first.security,
                r.bus.rtt_p50_us / first.bus.rtt_p50_us,
                r.bus.round_trips_per_s / first.bus.round_trips_per_s
            );
        }
    }
    Ok(())
}

fn bench_bus_peer(args: BusPeerArgs) -> Result<()> {
    let args = tessera_netbench::bus::BusPeerArgs {
        direct: args.direct,
        events: args.events,
        peer_direct: args.peer_direct,
        peer_events: args.peer_events,
        tcp: args.tcp,
        security: args.security.settings(),
    };
    Ok(tessera_netbench::bus::serve_peer(&args)?)
}

fn bench_transfer(args: BenchTransferArgs) -> Result<()> {
    use tessera_netbench::transfer as bench;
    let (program, prefix) = args.peer.launch("transfer-peer")?;
    let peer = bench::PeerLaunch::Process { program, args: prefix };
    let mut opts = bench::TransferBenchOptions::new(args.bytes, peer);
    opts.peer_bind = args.peer.peer_bind;
    opts.block_bytes = args.block;
    opts.runs = args.runs;
    opts.tcp_streams = args.streams.unwrap_or(opts.tcp_streams);
    opts.chunk_bytes = args.chunk.unwrap_or(opts.chunk_bytes);
    opts.stream_array_bytes = args.stream_bytes.unwrap_or(opts.stream_array_bytes);
    opts.security = bench_security(args.security, args.cipher);
    let report = bench::run(&opts)?;
    let handoff = match &args.handoff_url {
        Some(url) => {
            Some(bench_handoff(url, args.handoff_model.clone(), args.handoff_prompt_tokens, args.handoff_requests)?)
        }
        None => None,
    };
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(h) = &handoff {
            v["handoff"] = serde_json::to_value(h)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", report.table());
        if let Some(h) = &handoff {
            println!(
                "\nhand-off, {} requests of {} prompt tokens, decode chip {}:\n  \
                 P's last layer staged -> D's first step: p50 {:.2} ms, p99 {:.2} ms (mean {:.2})\n  \
                 TTFT seen by the client: p50 {:.1} ms, p99 {:.1} ms",
                h.requests,
                h.prompt_tokens,
                h.decode_chip,
                h.gap.p50_ms,
                h.gap.p99_ms,
                h.gap.mean_ms,
                h.ttft.p50_ms,
                h.ttft.p99_ms
            );
        }
    }
    Ok(())
}

fn bench_handoff(
    url: &str,
    model: Option<String>,
    prompt_tokens: usize,
    requests: usize,
) -> Result<tessera_loadgen::handoff::HandoffReport> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the tokio runtime")?;
    Ok(runtime.block_on(tessera_loadgen::handoff::run(url, model, prompt_tokens, requests))?)
}

fn bench_relay(args: BenchRelayArgs) -> Result<()> {
    use tessera_netbench::relay::{RelayOptions, Route, serve};
    if !(args.delay_ms.is_finite() && (0.0..=60_000.0).contains(&args.delay_ms)) {
        bail!("--delay-ms {} is not within 0..=60000", args.delay_ms);
    }
    let routes = args
        .ports
        .iter()
        .map(|&port| Route {
            listen: std::net::SocketAddr::new(args.listen, port),
            target: std::net::SocketAddr::new(args.to, port),
        })
        .collect();
    let opts = RelayOptions { routes, delay: Duration::from_secs_f64(args.delay_ms / 1e3), window_bytes: args.window };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the tokio runtime")?;
    runtime.block_on(serve(&opts, up::shutdown_signal(false), |bound| {
        for r in bound {
            println!("relaying {} -> {} (+{} ms each way)", r.listen, r.target, args.delay_ms);
        }
        let _ = std::io::Write::flush(&mut std::io::stdout());
    }))?;
    Ok(())
}

fn bench_transfer_peer(args: TransferPeerArgs) -> Result<()> {
    let args = tessera_netbench::transfer::TransferPeerArgs {
        bytes: args.bytes,
        bind: args.bind,
        security: args.security.settings(),
    };
    Ok(tessera_netbench::transfer::serve_peer(&args)?)
}

fn bench_engine(args: BenchEngineArgs) -> Result<()> {
    let (_, model) = load_model(&args.model, LoadOptions { dtype: args.dtype, quantize: args.quantize }, &args.device)?;
    let opts = tessera_backends::bench::EngineBenchOptions {
        batches: args.batch.clone(),
        prompt_len: args.prompt_len,
        context: args.context,
        steps: args.steps,
        kv_dtype: args.kv_dtype,
        profile: args.profile,
    };
    let report = tessera_backends::bench::run_engine_bench(model, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

fn bench_serve(args: ServeArgs) -> Result<()> {
    use tessera_loadgen as loadgen;
    let opts = loadgen::ServeBenchOptions {
        url: args.url,
        model: args.model,
        endpoint: args.endpoint,
        load: loadgen::Load::from_flags(args.rate, args.concurrency).map_err(loadgen::LoadgenError::from)?,
        requests: args.requests,
        isl: args.isl,
        osl: args.osl,
        seed: args.seed,
        warmup: args.warmup,
        timeout_s: args.timeout_s,
        progress: !args.json,
        shared: args
            .prefix_groups
            .zip(args.prefix_words)
            .map(|(groups, words)| loadgen::SharedPrefix { groups, words }),
        trace: match &args.trace {
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
                Some(loadgen::trace::parse(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.0))?)
            }
            None => None,
        },
        multi_turn: args
            .multi_turn
            .zip(args.turns)
            .map(|(conversations, turns)| loadgen::MultiTurn { conversations, turns }),
        slo: args.slo_ttft_ms.zip(args.slo_tpot_ms).map(|(ttft_ms, tpot_ms)| loadgen::SloLimits { ttft_ms, tpot_ms }),
        api_key: args.api_key.or_else(|| std::env::var("TESSERA_API_KEY").ok()),
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the tokio runtime")?;
    if let Some(path) = &args.tenants {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let tenants = loadgen::tenants::parse(&text, &path.display().to_string(), |var| std::env::var(var).ok())?;
        let report = runtime.block_on(loadgen::tenants::run(opts, tenants))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", report.table());
        }
        return Ok(());
    }
    let report = runtime.block_on(loadgen::run(opts))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
