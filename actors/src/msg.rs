//! The cluster's one message type and the well-known addresses. Every variant has
//! named fields (MessagePack maps on the wire), so nodes of different versions can
//! still read what they share.

use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tessera_actor_core::{Addr, HostId, Message};
/// The vocabulary the messages carry; each travels as its name ("decode", "head-major",
/// "f16"), as it always has.
pub use tessera_vocab::{DType, GrammarKind, KvLayout, PriorityClass, Role};

/// Well-known actor ids, the same on every host.
pub mod well_known {
    /// Each host's supervisor.
    pub const SUPERVISOR: u64 = 1;
    /// The router, on the gateway's host.
    pub const ROUTER: u64 = 2;
    pub const ADMISSION: u64 = 3;
    /// The solver, on the gateway's host.
    pub const SOLVER: u64 = 4;
    /// Chip `i` of a host (in topology order) is `CHIP_BASE + i`.
    pub const CHIP_BASE: u64 = 16;
}

/// Topics.
pub mod topic {
    /// Each host's heartbeat, with the state of its chips.
    pub const HEARTBEAT: &str = "heartbeat";
    /// A supervisor's verdicts about other hosts (local subscribers only care).
    pub const MEMBERSHIP: &str = "membership";
    /// Chips' KV events (blocks stored and removed), for the router's cluster index.
    pub const KV_EVENTS: &str = "kv-events";
    /// Admission's traffic figures, one window at a time, for the solver.
    pub const TELEMETRY: &str = "telemetry";
    /// The solver's strategy sets, each a Pareto set for the traffic it last saw.
    pub const STRATEGIES: &str = "solver.strategies";
    /// Each strategy the solver applies, as `PlanApplied`.
    pub const PLANS: &str = "solver.plans";
}

/// What a client may be told when its request cannot be served: the kind alone decides
/// the client's status and generic message (the gateway maps it, in one place).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    BadRequest,
    PromptTooLong,
    Overloaded,
    Unavailable,
    Internal,
    /// Over one of its tenant's quotas (429 with `Retry-After`); `public` names the limit.
    QuotaExceeded,
}

/// Why a request cannot be served, classified once, where it is decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServeError {
    pub kind: ErrorKind,
    /// The operator's diagnostic: it may name chips, hosts and internal errors, so it goes
    /// to the log and never to a client.
    pub message: String,
    /// What the client may read beyond its kind's generic message: only ever about the
    /// client's own request (a token id, a length), never about the cluster.
    #[serde(default)]
    pub public: Option<String>,
    /// For an overloaded cluster: seconds after which a retry may succeed (the gateway
    /// sends it as `Retry-After`).
    #[serde(default)]
    pub retry_after_s: Option<u32>,
}

impl ServeError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ServeError { kind, message: message.into(), public: None, retry_after_s: None }
    }

    /// An error about the client's own request, which it may read as it is.
    pub fn about_request(kind: ErrorKind, message: impl Into<String>) -> Self {
        let message = message.into();
        ServeError { kind, public: Some(message.clone()), message, retry_after_s: None }
    }

    /// The same error, with `public` for the client and the diagnostic for the log.
    pub fn with_public(mut self, public: impl Into<String>) -> Self {
        self.public = Some(public.into());
        self
    }

    /// The same error, telling the client to retry after `seconds` (at least 1).
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_s = Some(seconds.max(1));
        self
    }
}

/// Whether a request a chip refused or handed back may go on, and what it costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Retry {
    /// It can never run (bad input, incompatible chips): the request fails.
    No,
    /// This chip lost it or cannot hold it: try another chip. Counts as an attempt.
    Elsewhere,
    /// This chip takes no new work right now (not up yet, restarting, draining for a
    /// role change): try another chip, or wait for one. Costs no attempt.
    Unavailable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finish {
    /// A stop or end-of-sequence token.
    Stop,
    /// max_tokens or the model's context.
    Length,
}

/// How a sequence samples and when it stops.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingSpec {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Report each sampled token's log-probability and this many most likely
    /// alternatives (0..=[`MAX_TOP_LOGPROBS`]); `None`: none.
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// OpenAI's presence and frequency penalties (subtracted from the logit of each
    /// output token seen: `frequency × count + presence`), 0 = off.
    #[serde(default)]
    pub presence_penalty: f32,
    #[serde(default)]
    pub frequency_penalty: f32,
    /// vLLM's repetition penalty on prompt and output tokens (a positive logit divided
    /// by it, a negative one multiplied), 1 = off.
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens before sampling.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop tokens (`stop_token_ids`, end of sequence) are ruled out until this many
    /// tokens are generated.
    #[serde(default)]
    pub min_tokens: usize,
    /// Report the log-probability of every prompt token after the first, with this many
    /// alternatives (a scoring request: `echo` with `logprobs`). The prompt is then
    /// computed whole, never taken from a prefix cache.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    /// A grammar every sampled token must keep the output within (structured outputs);
    /// the chip's worker masks the logits with it before each token is sampled.
    #[serde(default)]
    pub grammar: Option<Grammar>,
}

/// A grammar the output follows, as the client's request gave it (the gateway checked
/// that it compiles).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Grammar {
    pub kind: GrammarKind,
    pub source: Arc<str>,
}

fn one() -> f32 {
    1.0
}

/// The most alternatives a token's [`TokenLogprob`] lists (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampled token's log-probability under the model's raw logits (before temperature,
/// top-k or top-p), and the most likely tokens' (highest first, ties to the lower id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl SamplingSpec {
    /// Greedy decoding, stopping only at the model's end-of-sequence tokens.
    pub fn greedy() -> SamplingSpec {
        SamplingSpec {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            prompt_logprobs: None,
            grammar: None,
        }
    }

    /// Whether any penalty counts the tokens before the one sampled.
    pub fn penalized(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }

    /// Whether a sampler must be given the tokens generated before it (a replay): its
    /// penalties count them, its grammar must move past them.
    pub fn needs_history(&self) -> bool {
        self.penalized() || self.grammar.is_some()
    }
}

/// A sequence handed to a chip: the prompt plus whatever was already generated (a
/// replay after failover), and how many more tokens it may produce.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqRequest {
    pub request_id: u64,
    pub req: Addr,
    pub tokens: Vec<u32>,
    pub generated: usize,
    pub max_new_tokens: usize,
    pub sampling: SamplingSpec,
    #[serde(default)]
    pub delivery: Delivery,
    /// Sibling sequences (`n` > 1) that fork from this one where it samples its first
    /// token: they share its prompt's KV and sample from the same logits.
    #[serde(default)]
    pub forks: Vec<Fork>,
    /// What its first KV block's hash chains to (see `kv::salted_prefix_hashes`): its
    /// tenant's salt when the tenant does not share its prefix cache.
    #[serde(default)]
    pub cache_salt: Option<u64>,
    /// Its tenant's class and fair-queuing weight, which the batcher schedules by.
    #[serde(default)]
    pub share: TenantShare,
}

/// What the schedulers owe a sequence's tenant: its priority class (served before the
/// classes below it, preempted after them) and its weight in fair queuing between the
/// tenants of one class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantShare {
    /// The tenant: an index into admission's tenants.
    pub tenant: u32,
    pub weight: u32,
    pub class: PriorityClass,
}

impl Default for TenantShare {
    /// The open tenant's: standard class, weight 1.
    fn default() -> TenantShare {
        TenantShare { tenant: 0, weight: 1, class: PriorityClass::Standard }
    }
}

/// A sequence forked from another after its prompt: its own request actor, and its
/// sampler's seed (the rest of its sampling is its parent's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fork {
    pub request_id: u64,
    pub req: Addr,
    pub seed: Option<u64>,
}

/// What a client asks admission to serve (checked against the model's context already).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdmitAsk {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingSpec,
    #[serde(default)]
    pub delivery: Delivery,
    /// More sequences of the same prompt (`n` > 1), forked from this one after its
    /// prompt is computed: each one's client mailbox and seed.
    #[serde(default)]
    pub forks: Vec<ForkAsk>,
    /// The tenant it is served for: an index into admission's tenants (0 in a cluster
    /// with one open tenant).
    #[serde(default)]
    pub tenant: u32,
}

/// One more sequence of an [`AdmitAsk`]: where its events go and its seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkAsk {
    pub client: Addr,
    pub seed: Option<u64>,
}

/// How a request's tokens travel to its client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Delivery {
    /// Every token as soon as it is sampled: a streamed response.
    #[default]
    Stream,
    /// For a response read whole: the first token at once (time to first token still
    /// shows), the rest when the request ends. The chip sends tokens in groups of up to
    /// [`Delivery::GROUP`] and the request passes them on when it ends, so a response of
    /// n tokens is about n / 16 messages instead of 2n.
    Whole,
}

impl Delivery {
    /// Tokens a chip holds back before sending them on, for [`Delivery::Whole`]: at any
    /// pace under a few seconds per token the request still hears from its chip well
    /// within its stall timeout.
    pub const GROUP: usize = 16;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChipState {
    /// Loading its model.
    Starting,
    Up,
    /// Its worker died; a restart is pending.
    Down,
    /// Out of restarts, or its host is gone: left down.
    Failed,
}

/// A chip as its host sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipReport {
    pub chip: Addr,
    pub id: Arc<str>,
    pub host_name: Arc<str>,
    pub role: Role,
    pub state: ChipState,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    /// The most sequences one forward step has carried.
    pub max_step_seqs: usize,
    pub restarts: u32,
    pub error: Option<String>,
    /// Draining before a role change, or parked: takes no new work.
    pub draining: bool,
    /// Parked by a plan: idle until given a role.
    #[serde(default)]
    pub parked: bool,
    /// Requests whose KV this chip holds for a decode chip (or is receiving).
    pub handoffs: usize,
    /// Set when the chip is an emulation of another kind (never passes as real).
    pub emulated: Option<Arc<str>>,
    pub compat: Option<Arc<KvCompat>>,
    /// As a decode chip: seconds from the prefill chip staging its last layer to this
    /// chip's first step for that request, for the latest hand-off.
    pub last_handoff_gap_s: Option<f64>,
    /// The number of the chip's last KV event, in the run of its pool `kv_incarnation`
    /// (bumped by every restart): the router's index checks it has seen them all.
    #[serde(default)]
    pub kv_last_event: u64,
    #[serde(default)]
    pub kv_incarnation: u64,
    /// How fast the chip's recent steps ran (`None` until it has run one).
    #[serde(default)]
    pub speed: Option<StepSpeed>,
    /// Prompt positions of sequences that started on the chip, and of those, positions
    /// whose KV came from its prefix cache, since it first started.
    #[serde(default)]
    pub prefix_prompt_tokens: u64,
    #[serde(default)]
    pub prefix_reused_tokens: u64,
    /// Model time the chip spent in steps that carried prompt tokens, and in steps that
    /// only decoded, since it first started (seconds).
    #[serde(default)]
    pub busy_prefill_s: f64,
    #[serde(default)]
    pub busy_decode_s: f64,
    /// Model seconds served to each tenant (by index), by the chip's performance model,
    /// since it first started: what fair queuing charges them.
    #[serde(default)]
    pub tenant_service_s: Vec<f64>,
}

/// A chip's observed pace: moving averages over its recent steps, which the router
/// uses to correct its performance model of the chip.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StepSpeed {
    /// Seconds of a step that carried prompt tokens (0: none yet) ...
    pub prefill_step_s: f64,
    /// ... and the tokens such a step computed.
    pub prefill_step_tokens: f64,
    /// Seconds of a step that only decoded (0: none yet) ...
    pub decode_step_s: f64,
    /// ... and how many sequences such a step carried.
    pub decode_batch: f64,
}

impl StepSpeed {
    /// Weight of the newest step in the moving averages.
    const ALPHA: f64 = 0.2;

    /// Folds in a step of `elapsed_s` seconds that computed `tokens` tokens for `seqs`
    /// sequences, `prompt_tokens` of them prompt (the rest one decode token each).
    pub fn observe(&mut self, elapsed_s: f64, tokens: usize, seqs: usize, prompt_tokens: usize) {
        if !(elapsed_s.is_finite() && elapsed_s > 0.0) || tokens == 0 {
            return;
        }
        let ewma = |old: f64, new: f64| if old > 0.0 { old + Self::ALPHA * (new - old) } else { new };
        if prompt_tokens > 0 {
            self.prefill_step_s = ewma(self.prefill_step_s, elapsed_s);
            self.prefill_step_tokens = ewma(self.prefill_step_tokens, tokens as f64);
        } else {
            self.decode_step_s = ewma(self.decode_step_s, elapsed_s);
            self.decode_batch = ewma(self.decode_batch, seqs as f64);
        }
    }

    /// Seconds per token of steps that carried prompt tokens (a ratio of the averages,
    /// which a short chunk's fixed cost sways less than an average of ratios); 0 when
    /// none ran yet.
    pub fn prefill_s_per_token(&self) -> f64 {
        if self.prefill_step_tokens > 0.0 { self.prefill_step_s / self.prefill_step_tokens } else { 0.0 }
    }
}

impl ChipReport {
    /// A chip nobody has heard from yet.
    pub fn starting(chip: Addr, id: impl Into<Arc<str>>, host_name: impl Into<Arc<str>>, role: Role) -> ChipReport {
        ChipReport {
            chip,
            id: id.into(),
            host_name: host_name.into(),
            role,
            state: ChipState::Starting,
            kv_blocks_used: 0,
            kv_blocks_total: 0,
            running: 0,
            waiting: 0,
            steps: 0,
            max_step_seqs: 0,
            restarts: 0,
            error: None,
            draining: false,
            parked: false,
            handoffs: 0,
            emulated: None,
            compat: None,
            last_handoff_gap_s: None,
            kv_last_event: 0,
            kv_incarnation: 0,
            speed: None,
            prefix_prompt_tokens: 0,
            prefix_reused_tokens: 0,
            busy_prefill_s: 0.0,
            busy_decode_s: 0.0,
            tenant_service_s: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub host: HostId,
    pub host_name: String,
    pub seq: u64,
    pub chips: Vec<ChipReport>,
}

/// The traffic admission saw over one window (`topic::TELEMETRY`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Telemetry {
    pub window_s: f64,
    /// Requests admitted in the window, and their prompt tokens.
    pub admitted: u64,
    pub prompt_tokens: u64,
    /// Requests that ended in the window, and the tokens they generated.
    pub ended: u64,
    pub output_tokens: u64,
    /// Lengths in powers of two: entry i counts lengths in 2^i..2^(i+1) (0 counts in 0).
    pub prompt_hist: Vec<u32>,
    pub output_hist: Vec<u32>,
}

impl Telemetry {
    /// Counts `len` in `hist`.
    pub fn count(hist: &mut Vec<u32>, len: usize) {
        let bucket = (usize::BITS - len.max(1).leading_zeros() - 1) as usize;
        if hist.len() <= bucket {
            hist.resize(bucket + 1, 0);
        }
        hist[bucket] += 1;
    }
}

/// What one chip does under a strategy (a role, or parked).
pub use tessera_planner::Duty;

/// A strategy as the solver publishes it: every chip's duty, the batch limits, and its
/// figures for the traffic it was solved for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StrategyView {
    /// `s<set>-<row>`: what `plan apply` names.
    pub id: String,
    pub summary: String,
    /// (chip id, duty), in topology order.
    pub duties: Vec<(String, Duty)>,
    pub max_batch_tokens: u32,
    pub max_batch_seqs: u32,
    pub figures: tessera_planner::Figures,
    /// The objective's value (higher is better).
    pub score: f64,
    /// Chips that change duty from what they do now, and a bound on how long they take
    /// to drain (their running requests' remaining tokens at their observed pace).
    pub moves: Vec<(String, Duty, Duty)>,
    pub drain_s: f64,
}

/// One solve's result (`topic::STRATEGIES`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StrategySet {
    /// Solves so far, this one included.
    pub seq: u64,
    /// When it was solved (seconds on the solver's clock since it started).
    pub at_s: f64,
    /// What set it off: "first traffic", "rate changed", "chips changed", "period", "asked".
    pub reason: String,
    /// Arrivals per second as measured; the workload is planned for more, the rate
    /// plus the change that sets off the next solve (`rate_change_percent`).
    pub observed_rate_rps: f64,
    /// The cluster's prefix hit rate as the chips report it (informs the operator; the
    /// analytic model prices every prompt token as computed).
    #[serde(default)]
    pub prefix_hit_rate: Option<f64>,
    pub workload: tessera_planner::Workload,
    pub slo: tessera_planner::Slo,
    pub objective: String,
    /// Chips up when solved, of all the topology's.
    pub chips_up: usize,
    pub chips_total: usize,
    /// The Pareto set, best first on the objective; the strategy applied now is first
    /// among equals.
    pub strategies: Vec<StrategyView>,
    /// The strategy in force, scored for the same traffic (`None`: it would not keep
    /// up with it), and whether it keeps up with the rate measured.
    pub current: Option<StrategyView>,
    pub current_keeps_up: bool,
    /// How the figures were had ("analytic": the roofline and queueing model).
    pub figures_from: String,
    /// Step-time tables the search built, and those it reused from earlier solves
    /// (they hold while the kinds and the mean lengths do).
    #[serde(default)]
    pub tables_built: u64,
    #[serde(default)]
    pub tables_reused: u64,
}

/// A strategy in force.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppliedPlan {
    pub id: String,
    pub summary: String,
    pub duties: Vec<(String, Duty)>,
    pub max_batch_tokens: u32,
    pub max_batch_seqs: u32,
    /// When it was applied (solver clock seconds), by "operator" or "auto".
    pub at_s: f64,
    pub by: String,
    /// Chips it moved.
    pub moves: Vec<(String, Duty, Duty)>,
}

/// The solver's state, for `plan show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanView {
    pub auto: bool,
    pub objective: String,
    /// What every chip does now, as its host reports it.
    pub chips: Vec<(String, Duty)>,
    /// The last strategy applied through the solver (none: the topology as written).
    pub applied: Option<AppliedPlan>,
    pub latest: Option<StrategySet>,
    pub solving: bool,
    /// Strategies applied so far.
    pub applies: u64,
}

/// What a supervisor does to one of its chips for a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipChange {
    pub chip: Addr,
    /// A new duty, when it changes.
    pub duty: Option<Duty>,
    pub max_batch_tokens: u32,
    pub max_batch_seqs: u32,
}

/// A request's state towards its client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ClientEvent {
    Tokens {
        tokens: Vec<u32>,
        /// One per token when the request asked for log-probabilities; else empty.
        #[serde(default)]
        logprobs: Vec<TokenLogprob>,
    },
    /// Log-probabilities of the prompt's tokens from position `start` on (a scoring
    /// request), in order, each part once; all of them come before `Finished`.
    PromptLogprobs {
        start: usize,
        logprobs: Vec<TokenLogprob>,
    },
    Finished {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed {
        error: ServeError,
    },
}

/// What a chip's worker did in one forward step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    pub step: u64,
    /// (request id, sampled token) per sequence that sampled.
    pub sampled: Vec<(u64, u32)>,
    /// Each sampled token's log-probabilities, in `sampled`'s order, where its sequence
    /// asked for them; empty when none did.
    #[serde(default)]
    pub logprobs: Vec<Option<TokenLogprob>>,
    /// (request id, its request actor, prompt position of the first, log-probabilities)
    /// of the prompt tokens this step scored, for sequences that asked. The actor is
    /// named here because a prefilled sequence may have left the chip (its decode chip
    /// acknowledged the hand-off) by the time the step's result is read.
    #[serde(default)]
    pub prompt_logprobs: Vec<(u64, Addr, usize, Vec<TokenLogprob>)>,
    /// Sequences that could not sample (their grammar failed), and why: they fail.
    #[serde(default)]
    pub failed: Vec<(u64, String)>,
    pub error: Option<String>,
    /// The step's model time: what an emulated or simulated chip declared, or what a
    /// real one measured. Its start is the moment it was reported, less this.
    pub elapsed_s: f64,
}

impl StepOutcome {
    /// A step that sampled `sampled` in `elapsed_s` of model time, with no error and no
    /// log-probabilities (a modelled chip's step).
    pub fn sampled(step: u64, sampled: Vec<(u64, u32)>, elapsed_s: f64) -> StepOutcome {
        StepOutcome {
            step,
            sampled,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            failed: Vec::new(),
            error: None,
            elapsed_s,
        }
    }
}

/// How a chip stores its KV cache, as its peers need to know it to read its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvFormatDesc {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Blocks in the chip's pool (its staging region holds all of them).
    pub num_blocks: usize,
    pub layout: KvLayout,
    pub dtype: DType,
}

/// What must match for two chips to exchange KV: the model and its attention shapes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCompat {
    /// Hash over the model's architecture, shapes and weights fingerprint.
    pub hash: u64,
    /// The fields behind the hash, to name the mismatch in an error.
    pub fields: Vec<(String, String)>,
}

impl KvCompat {
    /// Why `self` (chip `mine`) and `other` (chip `theirs`) cannot exchange KV, if so.
    pub fn mismatch(&self, mine: &str, other: &KvCompat, theirs: &str) -> Option<String> {
        if self.hash == other.hash {
            return None;
        }
        let detail = self
            .fields
            .iter()
            .zip(&other.fields)
            .find(|(a, b)| a != b)
            .map(|((name, a), (_, b))| format!("{name} {a} on {mine} vs {b} on {theirs}"))
            .unwrap_or_else(|| "the model weights differ".to_string());
        Some(format!(
            "chips {mine} and {theirs} cannot exchange KV: {detail} (compatibility hash {:016x} vs {:016x})",
            self.hash, other.hash
        ))
    }
}

/// A prefill chip's KV for one request, offered to a decode chip.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvOffer {
    /// The sequence the decode chip will continue (prompt + any replayed tokens).
    pub seq: SeqRequest,
    pub prefill: Addr,
    pub prefill_id: String,
    /// Positions 0..kv_tokens are prefilled on the prefill chip. Every position of
    /// `seq.tokens`: the prefill chip samples the next token too and sends it
    /// (`KvFirstToken`), and the decode chip continues from it. One fewer (a request
    /// that forks siblings where its first token is sampled): the decode chip runs the
    /// last token itself and samples.
    pub kv_tokens: usize,
    pub format: KvFormatDesc,
    pub compat: KvCompat,
    /// The prefill chip's staging region: every block of every layer, K then V.
    pub region: KvRegionDesc,
}

/// Where a chip's KV transfer engine listens, as peers see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvEndpointDesc {
    /// Equal on two endpoints iff they run on the same machine (boot id + hostname).
    pub host_key: String,
    pub pid: u32,
    /// The TCP data-plane address.
    pub tcp: std::net::SocketAddr,
}

/// A registered memory region holding staged KV, as it travels in messages. Plain data
/// that the behaviors only forward: the executor adapter converts it to and from the
/// transfer engine's own descriptor (same fields, same serde shape), so behaviors need
/// no data-plane dependency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvRegionDesc {
    pub endpoint: KvEndpointDesc,
    pub region: u64,
    /// The memfd's descriptor number in the owner process (for `/proc/<pid>/fd/<fd>`).
    pub fd: i32,
    pub len: u64,
}

/// 16 random bytes that let a decode chip read the staged blocks of one hand-off from
/// the prefill chip's region (the transfer engine's capability, as plain data).
pub type KvCapability = [u8; 16];

/// What a chip's worker knows once its model is loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipInfo {
    pub format: KvFormatDesc,
    pub compat: KvCompat,
    /// Where the chip stages KV for decode chips to read.
    pub staging: Option<KvRegionDesc>,
    /// Roofline emulation of another chip kind, if any (e.g. "ascend-910b x2000").
    pub emulated: Option<String>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_context: usize,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
}

/// Faults a drill can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// The chip's worker thread panics in its next job.
    WorkerPanic,
    /// As a decode chip, ignore the next KV offer: no claim, no decline, so the prefill
    /// chip's lease on that KV runs out.
    DropKvClaim,
    /// The chip goes offline (a device lost, as a hardware fault or maintenance takes
    /// one): its requests are handed back to be re-routed, and it stays `Failed`, with
    /// no restart, until `Online`.
    Offline,
    /// An offline chip is back: it starts a fresh worker and pool. No effect otherwise.
    Online,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    // Admission.
    /// Client -> admission: serve this; the answer is `Admitted` or a failed `Client`
    /// event, then the request's events.
    Admit {
        client: Addr,
        ask: Box<AdmitAsk>,
    },
    /// Admission -> client: admitted as `request_id`, run by the Request actor `request`.
    Admitted {
        request_id: u64,
        request: Addr,
    },
    /// Request -> admission: it ended, whatever the outcome.
    RequestEnded {
        request_id: u64,
        /// Tokens it generated (for the solver's telemetry).
        #[serde(default)]
        output_tokens: usize,
    },
    QueryAdmission {
        reply_to: Addr,
    },
    AdmissionView {
        inflight: usize,
        max_inflight: usize,
    },

    // Request life.
    /// Request -> router: pick a chip, avoiding `exclude`.
    Route {
        request_id: u64,
        req: Addr,
        tokens: usize,
        prompt_tokens: usize,
        exclude: Vec<Addr>,
        /// The tokens a chip would prefill (prompt and any replayed output), whose
        /// cached prefix the router looks up.
        #[serde(default)]
        prompt: Vec<u32>,
        /// The salt of its blocks' hashes (`SeqRequest::cache_salt`).
        #[serde(default)]
        cache_salt: Option<u64>,
        /// Its tenant's class: higher classes leave the router's queue first.
        #[serde(default)]
        share: TenantShare,
    },
    /// Router -> request: decode (or colocated) on `chip`; prefill on `prefill` first
    /// when the request is disaggregated.
    Routed {
        request_id: u64,
        chip: Addr,
        prefill: Option<Addr>,
    },
    /// Router -> request: nowhere to go.
    RouteFailed {
        request_id: u64,
        error: ServeError,
    },
    /// Request -> router: this request no longer loads `chip`.
    Release {
        request_id: u64,
        chip: Addr,
    },
    /// Request -> router: `chip` sampled the request's first token, so its prompt is
    /// computed (the router stops counting it as work ahead there).
    Prefilled {
        request_id: u64,
        chip: Addr,
    },
    /// Request -> router: the prefill chip of a disaggregated request sampled its first
    /// token, so its prompt is computed (its KV may still be on the way to the decode
    /// chip, which `Prefilled` tells).
    PromptComputed {
        request_id: u64,
    },
    /// Forked request -> router: it runs on `chip`, forked from its parent there, and
    /// holds `tokens` of KV (the router counts it as a placement of its own).
    Forked {
        request_id: u64,
        req: Addr,
        chip: Addr,
        tokens: usize,
    },
    /// Request -> chip.
    Enqueue {
        seq: Box<SeqRequest>,
    },
    /// Request -> prefill chip: prefill `seq` and hand its KV to `decode`.
    Prefill {
        seq: Box<SeqRequest>,
        decode: Addr,
    },
    /// Request -> chip: forget this request and free its KV.
    Abort {
        request_id: u64,
    },
    /// Chip -> request: new tokens, maybe the end.
    Generated {
        request_id: u64,
        chip: Addr,
        tokens: Vec<u32>,
        finish: Option<Finish>,
        /// One per token when the request asked for log-probabilities; else empty.
        #[serde(default)]
        logprobs: Vec<TokenLogprob>,
    },
    /// Chip -> request: log-probabilities of prompt tokens `start..` (position 1 is the
    /// first that has one), as the chip computing the prompt scored them.
    PromptLogprobs {
        request_id: u64,
        start: usize,
        logprobs: Vec<TokenLogprob>,
    },
    /// Chip -> request: not taken, or handed back; `retry` says whether and how the
    /// request may go on. `chip` is the chip at fault (a prefill chip forwarding its
    /// decode chip's decline names the decode chip).
    Refused {
        request_id: u64,
        chip: Addr,
        error: ServeError,
        retry: Retry,
    },
    /// Router -> request: its chip went down; re-route and replay.
    ChipLost {
        chip: Addr,
    },
    /// Client -> request: the client went away.
    Cancel,
    /// Request -> client.
    Client {
        event: ClientEvent,
    },

    // KV handoff between a prefill chip P and a decode chip D.
    /// P -> D.
    KvOffer {
        offer: Box<KvOffer>,
    },
    /// D -> P: blocks are reserved; stream the layers.
    KvClaim {
        request_id: u64,
        decode: Addr,
    },
    /// D -> P: not taken. `retry`: whether another decode chip might.
    KvDecline {
        request_id: u64,
        decode: Addr,
        error: ServeError,
        retry: Retry,
    },
    /// P -> D: `layers` of positions 0..upto are staged, in P's blocks `blocks`.
    KvReady {
        request_id: u64,
        layers: std::ops::Range<usize>,
        upto: usize,
        /// P's block table for the sequence (shared by every layer's message).
        blocks: std::sync::Arc<[u32]>,
        /// What lets D read those blocks of P's staging region over tcp on a secured
        /// cluster (P's worker grants it, for the hand-off's lease).
        #[serde(default)]
        capability: Option<KvCapability>,
    },
    /// P -> D: the token P sampled from the prompt's last position (an offer of every
    /// position), once D has claimed; D's sequence continues from it.
    KvFirstToken {
        request_id: u64,
        token: u32,
    },
    /// D -> P: every layer is installed; P frees its blocks.
    KvDone {
        request_id: u64,
    },
    /// Either side: the hand-off is off; free what it holds.
    KvCancel {
        request_id: u64,
        reason: String,
    },
    /// P -> itself: the lease on a hand-off's blocks is up.
    KvLeaseExpired {
        request_id: u64,
        lease: u64,
    },
    /// P's worker -> P, mid-step: these sequences' `layers` are staged up to `upto`.
    KvStaged {
        step: u64,
        layers: std::ops::Range<usize>,
        staged: Vec<(u64, usize)>,
        /// The capability to read each staged sequence's blocks (secured clusters).
        #[serde(default)]
        capabilities: Vec<(u64, KvCapability)>,
    },
    /// D's worker -> D: installed positions ..upto of `layers` (or failed).
    KvInstalled {
        request_id: u64,
        layers: std::ops::Range<usize>,
        upto: usize,
        error: Option<String>,
    },
    /// Operator -> chip: take this role once drained.
    SetRole {
        role: Role,
    },

    // Chip internals.
    WorkerReady {
        info: Box<ChipInfo>,
    },
    WorkerFailed {
        error: String,
    },
    WorkerPanicked {
        error: String,
    },
    StepDone {
        outcome: StepOutcome,
    },
    /// Supervisor -> chip: start the worker again.
    Restart,
    /// Chip -> topic KV_EVENTS: blocks its pool started or stopped holding, in order.
    KvEvents {
        chip: Addr,
        incarnation: u64,
        events: Vec<crate::kv::KvEvent>,
    },
    /// Router -> chip: send every hash your pool holds.
    KvSnapshotRequest {
        reply_to: Addr,
    },
    /// Chip -> router: every hash its pool holds, as of event `last_event`.
    KvSnapshot {
        chip: Addr,
        incarnation: u64,
        last_event: u64,
        hashes: Vec<u64>,
    },
    /// Drill -> chip.
    InjectFault {
        fault: Fault,
    },

    // Health.
    /// Chip -> its host's supervisor.
    Report {
        report: Box<ChipReport>,
    },
    /// Chip -> its supervisor: the worker died.
    ChipCrashed {
        chip: Addr,
        error: String,
    },
    /// Supervisor -> itself: a restart's backoff is over.
    RestartDue {
        chip: Addr,
    },
    /// Supervisor -> chip: no more restarts.
    GiveUp {
        reason: String,
    },
    /// Published to every supervisor and the router: shared, not copied, per subscriber.
    Heartbeat {
        beat: std::sync::Arc<Heartbeat>,
    },
    HostDown {
        host: HostId,
        host_name: String,
    },
    HostUp {
        host: HostId,
        host_name: String,
    },
    Tick,
    /// Request -> itself: route again after a backoff. Chip or parent -> a request
    /// waiting to be forked: the fork will not happen; route on your own.
    Reroute,

    // Solver.
    /// Admission -> topic TELEMETRY.
    Telemetry {
        telemetry: Box<Telemetry>,
    },
    /// Solver -> topic STRATEGIES.
    Strategies {
        set: Box<StrategySet>,
    },
    /// Anyone -> solver: solve again now. Solver -> itself: the period is up.
    Solve {
        reason: String,
    },
    /// The solver's worker -> solver: a solve's result (or why there is none).
    Solved {
        result: Result<Box<StrategySet>, String>,
    },
    /// Operator -> solver: reply with `Plan`.
    QueryPlan {
        reply_to: Addr,
    },
    Plan {
        view: Box<PlanView>,
    },
    /// Operator -> solver: apply strategy `id` of the latest set; the reply is
    /// `PlanApplied`.
    ApplyStrategy {
        id: String,
        reply_to: Addr,
    },
    /// Operator -> solver: these chips take these duties (the others keep theirs);
    /// the reply is `PlanApplied`.
    ApplyRoles {
        roles: Vec<(String, Duty)>,
        reply_to: Addr,
    },
    PlanApplied {
        result: Result<Box<AppliedPlan>, String>,
    },
    /// Solver -> a host's supervisor: change these chips of the host.
    ApplyPlan {
        changes: Vec<ChipChange>,
    },
    /// Supervisor -> chip: drain, then take no work until a `SetRole`.
    Park,
    /// Supervisor -> chip: step limits from now on (at most the chip's configured ones).
    SetLimits {
        max_batch_tokens: u32,
        max_batch_seqs: u32,
    },

    // Queries.
    /// Anyone -> router: reply with `ClusterView`.
    QueryCluster {
        reply_to: Addr,
    },
    ClusterView {
        chips: Vec<ChipReport>,
        hosts_down: Vec<String>,
    },
}

impl Message for Msg {
    fn kind(&self) -> &'static str {
        match self {
            Msg::Admit { .. } => "admit",
            Msg::Admitted { .. } => "admitted",
            Msg::RequestEnded { .. } => "request_ended",
            Msg::QueryAdmission { .. } => "query_admission",
            Msg::AdmissionView { .. } => "admission_view",
            Msg::Route { .. } => "route",
            Msg::Routed { .. } => "routed",
            Msg::RouteFailed { .. } => "route_failed",
            Msg::Release { .. } => "release",
            Msg::Prefilled { .. } => "prefilled",
            Msg::PromptComputed { .. } => "prompt_computed",
            Msg::Enqueue { .. } => "enqueue",
            Msg::Prefill { .. } => "prefill",
            Msg::Abort { .. } => "abort",
            Msg::Generated { .. } => "generated",
            Msg::PromptLogprobs { .. } => "prompt_logprobs",
            Msg::Refused { .. } => "refused",
            Msg::ChipLost { .. } => "chip_lost",
            Msg::Cancel => "cancel",
            Msg::Client { .. } => "client",
            Msg::KvOffer { .. } => "kv_offer",
            Msg::KvClaim { .. } => "kv_claim",
            Msg::KvDecline { .. } => "kv_decline",
            Msg::KvReady { .. } => "kv_ready",
            Msg::KvFirstToken { .. } => "kv_first_token",
            Msg::KvDone { .. } => "kv_done",
            Msg::KvCancel { .. } => "kv_cancel",
            Msg::KvLeaseExpired { .. } => "kv_lease_expired",
            Msg::KvStaged { .. } => "kv_staged",
            Msg::KvInstalled { .. } => "kv_installed",
            Msg::SetRole { .. } => "set_role",
            Msg::WorkerReady { .. } => "worker_ready",
            Msg::WorkerFailed { .. } => "worker_failed",
            Msg::WorkerPanicked { .. } => "worker_panicked",
            Msg::StepDone { .. } => "step_done",
            Msg::Restart => "restart",
            Msg::KvEvents { .. } => "kv_events",
            Msg::KvSnapshotRequest { .. } => "kv_snapshot_request",
            Msg::KvSnapshot { .. } => "kv_snapshot",
            Msg::InjectFault { .. } => "inject_fault",
            Msg::Report { .. } => "report",
            Msg::ChipCrashed { .. } => "chip_crashed",
            Msg::RestartDue { .. } => "restart_due",
            Msg::GiveUp { .. } => "give_up",
            Msg::Heartbeat { .. } => "heartbeat",
            Msg::HostDown { .. } => "host_down",
            Msg::HostUp { .. } => "host_up",
            Msg::Tick => "tick",
            Msg::Reroute => "reroute",
            Msg::Forked { .. } => "forked",
            Msg::QueryCluster { .. } => "query_cluster",
            Msg::ClusterView { .. } => "cluster_view",
            Msg::Telemetry { .. } => "telemetry",
            Msg::Strategies { .. } => "strategies",
            Msg::Solve { .. } => "solve",
            Msg::Solved { .. } => "solved",
            Msg::QueryPlan { .. } => "query_plan",
            Msg::Plan { .. } => "plan",
            Msg::ApplyStrategy { .. } => "apply_strategy",
            Msg::ApplyRoles { .. } => "apply_roles",
            Msg::PlanApplied { .. } => "plan_applied",
            Msg::ApplyPlan { .. } => "apply_plan",
            Msg::Park => "park",
            Msg::SetLimits { .. } => "set_limits",
        }
    }
}
