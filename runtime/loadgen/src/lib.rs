//! `tessera bench serve`: the HTTP driver of the workload model (`tessera-workload`), a load generator for any OpenAI-compatible server, in the spirit
//! of vLLM's `benchmark_serving.py`. It sends streamed completions (or chat completions)
//! with synthetic prompts, either as an open-loop Poisson process or with a fixed number in
//! flight, and reports throughput and TTFT / TPOT / ITL / end-to-end latency percentiles.
//! A multi-turn run releases conversations instead, whose turns follow each other: each
//! turn's prompt is the last one's, its answer and a new user message.
//!
//! Every request is decided from the seed before the run starts, so two runs with the same
//! options send the same prompts and lengths whatever the server's speed.
//!
//! An I/O adapter (reqwest, tokio, a progress bar): behaviors never depend on it; what a
//! simulator needs of a benchmark lives in `tessera-workload`.
#![forbid(unsafe_code)]

pub mod handoff;
mod request;
pub mod server;
mod sse;
mod stats;
pub mod tenants;
#[cfg(test)]
mod tests;

use std::fmt::{self, Write as _};
use std::io::IsTerminal;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{Semaphore, mpsc};

pub use sse::SseParser;
pub use stats::{LatencySummary, percentile};
pub use tessera_workload::trace::{self, TraceRequest};
pub use tessera_workload::{
    Conversation, DEFAULT_CONCURRENCY, DistParseError, LengthDist, Load, MultiTurn, SeededRng, SharedPrefix, Workload,
    WorkloadError, multiturn,
};

use request::Sample;
use tessera_workload::PlannedRequest;

/// What a turn left unsent by its conversation's failure reports.
const TURN_NOT_SENT: &str = "not sent: an earlier turn of its conversation failed";

/// Distinct error messages shown by [`ServeBenchReport::table`]; the JSON has them all.
const ERRORS_SHOWN: usize = 5;

/// Which OpenAI route to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/completions`, prompt as text.
    Completions,
    /// `POST /v1/chat/completions`, prompt as one user message.
    Chat,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

impl FromStr for Endpoint {
    type Err = LoadgenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "completions" => Ok(Endpoint::Completions),
            "chat" => Ok(Endpoint::Chat),
            _ => Err(LoadgenError::InvalidOptions(format!("unknown endpoint {s:?} (completions or chat)"))),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        })
    }
}

/// Everything `tessera bench serve` takes.
#[derive(Clone, Debug)]
pub struct ServeBenchOptions {
    /// Server base, e.g. `http://127.0.0.1:8000` (no `/v1`).
    pub url: String,
    /// Model name to send; `None`: the first id listed by `GET /v1/models`.
    pub model: Option<String>,
    pub endpoint: Endpoint,
    pub load: Load,
    /// Measured requests.
    pub requests: usize,
    /// Input length in tokens (approximate: see [`request`]'s word list).
    pub isl: LengthDist,
    /// Output length in tokens, sent as `max_tokens` with `ignore_eos`.
    pub osl: LengthDist,
    pub seed: u64,
    /// Requests sent and awaited before measuring (connections, caches, lazy init).
    pub warmup: usize,
    /// Limit on each request, from connecting to the stream's end.
    pub timeout_s: f64,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress: bool,
    /// Requests in groups sharing a system prompt.
    pub shared: Option<SharedPrefix>,
    /// Replay this trace (Mooncake's format) instead: its prompts, lengths and arrival
    /// times; `requests`, `isl`, `osl` and the load are then ignored.
    pub trace: Option<Vec<TraceRequest>>,
    /// Multi-turn chats instead of `requests` single ones: every user message has `isl`
    /// words, every answer `osl` tokens; the load releases conversations (a closed loop
    /// keeps `concurrency` of them under way, an open loop starts them at `rate_rps`) and
    /// each sends its next turn as soon as the last is answered.
    pub multi_turn: Option<MultiTurn>,
    /// Count the requests within these SLOs (goodput).
    pub slo: Option<SloLimits>,
    /// Sent as `Authorization: Bearer KEY` on every request (a shared cluster's tenant
    /// key).
    pub api_key: Option<String>,
}

/// The service level a request must meet to count towards goodput: its TTFT and its
/// TPOT (a one-token answer has no TPOT to miss), as the simulator counts them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SloLimits {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

/// Requests within the SLOs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Goodput {
    pub slo: SloLimits,
    /// Successful requests within both.
    pub met: usize,
    /// `met` per second of the measured duration.
    pub goodput_rps: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    #[error("invalid options: {0}")]
    InvalidOptions(String),
    #[error("invalid options: {0}")]
    Workload(#[from] WorkloadError),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("cannot pick a model from {url}: {reason} (pass --model)")]
    ModelDiscovery { url: String, reason: String },
    #[error("all {count} warm-up requests failed; the first with: {first}")]
    WarmupFailed { count: usize, first: String },
    #[error("{0}")]
    Http(String),
}

/// One distinct failure and how often it happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// What a run measured. Latencies are over successful requests only.
#[derive(Clone, Debug, Serialize)]
pub struct ServeBenchReport {
    pub url: String,
    pub model: String,
    pub endpoint: Endpoint,
    /// Set for an open-loop run.
    pub rate_rps: Option<f64>,
    /// Set for a closed-loop run.
    pub concurrency: Option<usize>,
    pub isl: String,
    pub osl: String,
    pub seed: u64,
    pub warmup: usize,
    pub requests_ok: usize,
    pub requests_failed: usize,
    /// From the first measured request's release to the last one's end.
    pub duration_s: f64,
    pub request_throughput_rps: f64,
    /// Prompt tokens of successful requests as the server counted them (`usage`).
    pub input_tokens: u64,
    /// Generated tokens of successful requests.
    pub output_tokens: u64,
    pub input_throughput_tok_s: f64,
    pub output_throughput_tok_s: f64,
    /// Successful requests without a usage chunk: their input is the nominal ISL and their
    /// output the count of chunks carrying tokens.
    pub requests_without_usage: usize,
    /// Successful requests whose tokens decoded to no visible text (a random-weight
    /// model's often do): counted as successes, shown apart.
    pub requests_without_text: usize,
    pub ttft: Option<LatencySummary>,
    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`.
    pub tpot: Option<LatencySummary>,
    /// Gaps between chunks carrying tokens.
    pub itl: Option<LatencySummary>,
    pub e2e: Option<LatencySummary>,
    /// Distinct failure messages in order of first appearance.
    pub errors: Vec<ErrorCount>,
    /// Set for a multi-turn run.
    pub multi_turn: Option<MultiTurn>,
    /// Set for a trace replay: the requests in the trace.
    pub trace_requests: Option<usize>,
    /// Share of the prompts' tokens that a single chip holding everything sent and
    /// generated before would have found cached, from the plan (multi-turn runs: words
    /// and asked answer tokens; trace replays: 512-token blocks). `None` for synthetic
    /// single-turn runs.
    pub oracle_hit_rate: Option<f64>,
    /// What a Tessera server counted during the measured part (`None` against another
    /// server): per chip, prompt tokens computed and reused, and busy seconds.
    pub server: Option<server::ServerCounters>,
    /// Set when SLOs were given.
    pub goodput: Option<Goodput>,
}

/// Runs the benchmark to its end; failed requests are counted in the report, not returned.
pub async fn run(opts: ServeBenchOptions) -> Result<ServeBenchReport, LoadgenError> {
    if opts.requests == 0 {
        return Err(LoadgenError::InvalidOptions("--requests must be at least 1".into()));
    }
    if !(opts.timeout_s.is_finite() && opts.timeout_s > 0.0) {
        return Err(LoadgenError::InvalidOptions(format!("--timeout-s must be positive, got {}", opts.timeout_s)));
    }
    let workload = Workload { isl: opts.isl, osl: opts.osl, load: opts.load, seed: opts.seed, shared: opts.shared };
    let measured = plan_measured(&opts, &workload)?;
    let timeout = Duration::from_secs_f64(opts.timeout_s);
    let base = opts.url.trim_end_matches('/').to_string();
    // A connection per request: a server may end a kept-alive connection (its idle
    // timeout, or a limit of requests per connection as llama.cpp's server has) just
    // as the next request goes out on it, which would count as a failure that never
    // reached it. A connect on the loopback is a fraction of a millisecond of TTFT.
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = &opts.api_key {
        let value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| LoadgenError::InvalidOptions("--api-key is not a valid header value".into()))?;
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let client = reqwest::Client::builder()
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .pool_max_idle_per_host(0)
        .default_headers(headers)
        .build()
        .map_err(LoadgenError::Client)?;
    let model = match opts.model.clone() {
        Some(m) => m,
        None => discover_model(&client, &base, timeout).await?,
    };
    let target = Arc::new(Target {
        client,
        url: format!("{base}{}", opts.endpoint.path()),
        model: model.clone(),
        endpoint: opts.endpoint,
        timeout,
    });

    if opts.warmup > 0 {
        let concurrency = match opts.load {
            Load::Closed { concurrency } => concurrency,
            Load::Poisson { .. } => DEFAULT_CONCURRENCY,
        };
        let plan = workload.warmup(opts.warmup).into_iter().map(Job::Single).collect();
        let (outcomes, _) = drive(&target, plan, &[], concurrency, &ProgressBar::hidden()).await;
        if outcomes.iter().all(|o| o.result.is_err()) {
            let first = outcomes.into_iter().find_map(|o| o.result.err()).unwrap_or_default();
            return Err(LoadgenError::WarmupFailed { count: opts.warmup, first });
        }
    }

    let requests = measured.requests;
    let bar = progress_bar(opts.progress, requests);
    let before = server::scrape(&target.client, &base, timeout).await;
    let (outcomes, duration) = drive(&target, measured.jobs, &measured.arrivals_s, measured.concurrency, &bar).await;
    bar.finish_and_clear();
    let counted = server::between(before, server::scrape(&target.client, &base, timeout).await);

    let mut report = ServeBenchReport {
        url: base,
        model,
        endpoint: opts.endpoint,
        rate_rps: match opts.load {
            Load::Poisson { rate_rps } => Some(rate_rps),
            Load::Closed { .. } => None,
        },
        concurrency: match opts.load {
            Load::Poisson { .. } => None,
            Load::Closed { concurrency } => Some(concurrency),
        },
        isl: opts.isl.to_string(),
        osl: opts.osl.to_string(),
        seed: opts.seed,
        warmup: opts.warmup,
        requests_ok: 0,
        requests_failed: 0,
        duration_s: duration.as_secs_f64(),
        request_throughput_rps: 0.0,
        input_tokens: 0,
        output_tokens: 0,
        input_throughput_tok_s: 0.0,
        output_throughput_tok_s: 0.0,
        requests_without_usage: 0,
        requests_without_text: 0,
        ttft: None,
        tpot: None,
        itl: None,
        e2e: None,
        errors: Vec::new(),
        multi_turn: opts.multi_turn,
        trace_requests: opts.trace.as_ref().map(Vec::len),
        oracle_hit_rate: measured.oracle_hit_rate,
        server: counted,
        goodput: None,
    };
    report.add_outcomes(requests, outcomes, opts.slo);
    Ok(report)
}

/// The measured part of a run, decided before anything is sent.
struct MeasuredPlan {
    jobs: Vec<Job>,
    /// Release times of the jobs (open loop); empty for a closed loop.
    arrivals_s: Vec<f64>,
    /// Jobs under way at once.
    concurrency: usize,
    /// Requests in all the jobs.
    requests: usize,
    oracle_hit_rate: Option<f64>,
}

/// The jobs of a trace replay, a multi-turn run or a run of single requests.
fn plan_measured(opts: &ServeBenchOptions, workload: &Workload) -> Result<MeasuredPlan, LoadgenError> {
    // Open loop: the arrivals pace the jobs, so none waits for a slot.
    let concurrency = |jobs: usize| match opts.load {
        Load::Poisson { .. } => jobs,
        Load::Closed { concurrency } => concurrency,
    };
    match (&opts.trace, opts.multi_turn) {
        (Some(_), Some(_)) => Err(LoadgenError::InvalidOptions("give --trace or --multi-turn, not both".into())),
        (Some(trace), None) => {
            let (reqs, arrivals_s) = trace::replay(trace, trace::TRACE_BLOCK_TOKENS);
            Ok(MeasuredPlan {
                requests: reqs.len(),
                concurrency: reqs.len(),
                jobs: reqs.into_iter().map(Job::Single).collect(),
                arrivals_s,
                oracle_hit_rate: Some(trace::oracle_hit_rate(trace)),
            })
        }
        (None, Some(shape)) => {
            let conversations = workload.conversations(shape)?;
            Ok(MeasuredPlan {
                requests: conversations.iter().map(Conversation::turns).sum(),
                concurrency: concurrency(conversations.len()),
                arrivals_s: workload.arrivals_s(conversations.len()),
                oracle_hit_rate: Some(multiturn::oracle_hit_rate(&conversations)),
                jobs: conversations.into_iter().map(Job::Chat).collect(),
            })
        }
        (None, None) => Ok(MeasuredPlan {
            jobs: workload.measured(opts.requests).into_iter().map(Job::Single).collect(),
            arrivals_s: workload.arrivals_s(opts.requests),
            concurrency: concurrency(opts.requests),
            requests: opts.requests,
            oracle_hit_rate: None,
        }),
    }
}

/// Where and how every request is sent.
struct Target {
    client: reqwest::Client,
    url: String,
    model: String,
    endpoint: Endpoint,
    timeout: Duration,
}

struct Outcome {
    nominal_isl: u32,
    result: Result<Sample, String>,
}

/// What the load releases: one request, or one conversation whose turns go in order.
enum Job {
    Single(PlannedRequest),
    Chat(Conversation),
}

impl Job {
    fn requests(&self) -> usize {
        match self {
            Job::Single(_) => 1,
            Job::Chat(conversation) => conversation.turns(),
        }
    }
}

/// Releases `jobs`, the i-th at `arrivals_s[i]` seconds after the start when arrivals are
/// given, with at most `concurrency` under way; returns the outcomes of their requests (in
/// completion order) and the time from the start to the last completion.
async fn drive(
    target: &Arc<Target>,
    jobs: Vec<Job>,
    arrivals_s: &[f64],
    concurrency: usize,
    bar: &ProgressBar,
) -> (Vec<Outcome>, Duration) {
    let total = jobs.iter().map(Job::requests).sum();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let started = Instant::now();
    let start = tokio::time::Instant::from_std(started);
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let dispatch = async move {
        for (i, job) in jobs.into_iter().enumerate() {
            if let Some(&at_s) = arrivals_s.get(i) {
                tokio::time::sleep_until(start + Duration::from_secs_f64(at_s)).await;
            }
            let Ok(slot) = slots.clone().acquire_owned().await else { break };
            let (target, tx) = (Arc::clone(target), tx.clone());
            // Spawned, so that the runtime's workers read each stream as its bytes arrive.
            tokio::spawn(async move {
                perform(&target, job, &tx).await;
                drop(slot);
            });
        }
        // The collector stops once this and every task's sender are gone.
        drop(tx);
    };
    let collect = async {
        let mut outcomes = Vec::with_capacity(total);
        let mut failed = 0usize;
        while let Some(outcome) = rx.recv().await {
            if outcome.result.is_err() {
                failed += 1;
                bar.set_message(format!("{failed} failed"));
            }
            bar.inc(1);
            outcomes.push(outcome);
        }
        outcomes
    };
    let ((), outcomes) = tokio::join!(dispatch, collect);
    (outcomes, started.elapsed())
}

/// Sends a job's requests, reporting each one's outcome as it ends.
async fn perform(target: &Target, job: Job, tx: &mpsc::UnboundedSender<Outcome>) {
    match job {
        Job::Single(req) => {
            let body = request::body(&req, target.endpoint, &target.model);
            let result = request::send(&target.client, &target.url, &body, target.timeout).await;
            let _ = tx.send(Outcome { nominal_isl: req.isl, result });
        }
        Job::Chat(conversation) => converse(target, conversation, tx).await,
    }
}

/// Sends a conversation's turns in order, each once the one before it has been answered
/// (that answer is part of its prompt); after a failed turn, the turns left cannot be
/// written and are reported failed without being sent.
async fn converse(target: &Target, mut conversation: Conversation, tx: &mpsc::UnboundedSender<Outcome>) {
    while let Some(req) = conversation.next_request() {
        let body = request::turn_body(&conversation, &req, target.endpoint, &target.model);
        let mut result = request::send(&target.client, &target.url, &body, target.timeout).await;
        let answer = result.as_mut().ok().map(|sample| std::mem::take(&mut sample.text));
        let _ = tx.send(Outcome { nominal_isl: req.isl, result });
        match answer {
            Some(text) => conversation.answer(text),
            None => {
                let unsent = conversation.turns() - conversation.answered() - 1;
                for _ in 0..unsent {
                    let _ = tx.send(Outcome { nominal_isl: 0, result: Err(TURN_NOT_SENT.into()) });
                }
                return;
            }
        }
    }
}

impl ServeBenchReport {
    /// Folds the outcomes of `expected` requests in; any that never reported (a panicked
    /// task) count as failed.
    fn add_outcomes(&mut self, expected: usize, outcomes: Vec<Outcome>, slo: Option<SloLimits>) {
        let (mut ttft, mut tpot, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut met = 0;
        let lost = expected.saturating_sub(outcomes.len());
        for outcome in outcomes {
            match outcome.result {
                Ok(s) => {
                    self.requests_ok += 1;
                    if s.prompt_tokens.is_none() {
                        self.requests_without_usage += 1;
                    }
                    if s.text.is_empty() {
                        self.requests_without_text += 1;
                    }
                    self.input_tokens += s.prompt_tokens.unwrap_or(u64::from(outcome.nominal_isl));
                    self.output_tokens += s.output_tokens;
                    ttft.push(s.ttft_s);
                    e2e.push(s.e2e_s);
                    let per_token = (s.output_tokens > 1).then(|| (s.e2e_s - s.ttft_s) / (s.output_tokens - 1) as f64);
                    tpot.extend(per_token);
                    if let Some(slo) = slo
                        && s.ttft_s * 1e3 <= slo.ttft_ms
                        && per_token.is_none_or(|t| t * 1e3 <= slo.tpot_ms)
                    {
                        met += 1;
                    }
                    itl.extend(s.itl_s);
                }
                Err(message) => self.add_error(message, 1),
            }
        }
        if lost > 0 {
            self.add_error("request task ended without reporting".into(), lost);
        }
        if self.duration_s > 0.0 {
            self.request_throughput_rps = self.requests_ok as f64 / self.duration_s;
            self.input_throughput_tok_s = self.input_tokens as f64 / self.duration_s;
            self.output_throughput_tok_s = self.output_tokens as f64 / self.duration_s;
        }
        self.goodput = slo.map(|slo| Goodput {
            slo,
            met,
            goodput_rps: if self.duration_s > 0.0 { met as f64 / self.duration_s } else { 0.0 },
        });
        self.ttft = LatencySummary::from_seconds(&ttft);
        self.tpot = LatencySummary::from_seconds(&tpot);
        self.itl = LatencySummary::from_seconds(&itl);
        self.e2e = LatencySummary::from_seconds(&e2e);
    }

    fn add_error(&mut self, message: String, count: usize) {
        self.requests_failed += count;
        match self.errors.iter_mut().find(|e| e.message == message) {
            Some(e) => e.count += count,
            None => self.errors.push(ErrorCount { message, count }),
        }
    }

    /// The human-readable report.
    pub fn table(&self) -> String {
        let load = match (self.trace_requests, self.rate_rps, self.concurrency, self.multi_turn) {
            (Some(n), ..) => format!("replay of a {n}-request trace (its arrival times and lengths)"),
            (None, Some(r), _, None) => format!("Poisson arrivals at {r} req/s"),
            (None, None, Some(c), None) => format!("concurrency {c}"),
            (None, Some(r), _, Some(m)) => {
                format!("{} conversations of {} turns, started as Poisson arrivals at {r}/s", m.conversations, m.turns)
            }
            (None, None, Some(c), Some(m)) => {
                format!("{} conversations of {} turns, {c} under way at once", m.conversations, m.turns)
            }
            (None, None, None, _) => "unknown load".to_string(),
        };
        let lengths = match self.trace_requests {
            Some(_) => String::new(),
            None => format!(", ISL {}, OSL {}", self.isl, self.osl),
        };
        let mut s = format!(
            "{} {} at {}: {load}{lengths}, seed {}, warm-up {}\n\n",
            self.model, self.endpoint, self.url, self.seed, self.warmup
        );
        let _ = writeln!(
            s,
            "requests      {} ok, {} failed in {:.3} s\n\
             throughput    {:.2} req/s, input {:.1} tok/s, output {:.1} tok/s\n\
             tokens        {} in, {} out",
            self.requests_ok,
            self.requests_failed,
            self.duration_s,
            self.request_throughput_rps,
            self.input_throughput_tok_s,
            self.output_throughput_tok_s,
            self.input_tokens,
            self.output_tokens
        );
        if self.requests_without_usage > 0 {
            let _ = writeln!(
                s,
                "              ({} requests had no usage chunk: nominal ISL and token chunks counted)",
                self.requests_without_usage
            );
        }
        if self.requests_without_text > 0 {
            let _ = writeln!(
                s,
                "              ({} requests streamed tokens that decode to no visible text; counted as ok)",
                self.requests_without_text
            );
        }
        if let Some(rate) = self.oracle_hit_rate {
            let _ = writeln!(
                s,
                "prefix reuse  oracle hit rate {rate:.3} (share of prompt tokens a single chip holding \
                 everything would have cached)"
            );
        }
        if let Some(counted) = &self.server {
            if let Some(hit) = counted.hit_rate() {
                let of_oracle = match self.oracle_hit_rate {
                    Some(o) if o > 0.0 => format!(", {:.0}% of the oracle's", 100.0 * hit / o),
                    _ => String::new(),
                };
                let _ = writeln!(
                    s,
                    "prefix reuse  cluster hit rate {hit:.3} (the server's reused / prompt tokens){of_oracle}"
                );
            }
            let busy: Vec<String> = counted.chips.iter().map(|c| format!("{} {:.2}", c.chip, c.busy_s)).collect();
            let imbalance = counted.busy_imbalance().map_or(String::new(), |r| format!("; busiest / mean {r:.2}"));
            let _ = writeln!(s, "chip load     busy s: {}{imbalance}", busy.join(", "));
        }
        if let Some(g) = &self.goodput {
            let _ = writeln!(
                s,
                "goodput       {:.3} req/s: {} of {} requests within TTFT {} ms and TPOT {} ms",
                g.goodput_rps,
                g.met,
                self.requests_ok + self.requests_failed,
                g.slo.ttft_ms,
                g.slo.tpot_ms
            );
        }
        s += "\nlatency (ms)       mean        p50        p90        p99\n";
        for (name, summary) in [("TTFT", &self.ttft), ("TPOT", &self.tpot), ("ITL", &self.itl), ("E2E", &self.e2e)] {
            match summary {
                Some(l) => {
                    let _ = writeln!(
                        s,
                        "{name:<12} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                        l.mean_ms, l.p50_ms, l.p90_ms, l.p99_ms
                    );
                }
                None => {
                    let _ = writeln!(s, "{name:<12} {:>10} {:>10} {:>10} {:>10}", "-", "-", "-", "-");
                }
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(
                s,
                "\nerrors ({} distinct{}):",
                self.errors.len(),
                if self.errors.len() > ERRORS_SHOWN { format!(", first {ERRORS_SHOWN} shown") } else { String::new() }
            );
            for e in self.errors.iter().take(ERRORS_SHOWN) {
                let _ = writeln!(s, "{:>7} x {}", e.count, e.message);
            }
        }
        s
    }
}

/// The first model id listed by `GET {base}/v1/models`.
async fn discover_model(client: &reqwest::Client, base: &str, timeout: Duration) -> Result<String, LoadgenError> {
    let url = format!("{base}/v1/models");
    let fail = |reason: String| LoadgenError::ModelDiscovery { url: url.clone(), reason };
    let response = client.get(&url).timeout(timeout).send().await.map_err(|e| fail(request::describe(&e, timeout)))?;
    let status = response.status();
    if !status.is_success() {
        return Err(fail(format!("HTTP {}", status.as_u16())));
    }
    let listing: Value = response.json().await.map_err(|e| fail(request::describe(&e, timeout)))?;
    listing["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| fail("no model listed".into()))
}

fn progress_bar(wanted: bool, requests: usize) -> ProgressBar {
    if !wanted || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(requests as u64);
    let style = ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {per_sec} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("=> "));
    bar
}
