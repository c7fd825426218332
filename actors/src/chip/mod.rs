//! The chip actor: owns one device through a worker thread (model, KV storage,
//! samplers), its KV pool and its batcher. It admits sequences, keeps exactly one
//! forward step in flight, streams each sampled token to its request, and when its
//! worker dies hands every sequence back to its request (which replays elsewhere) and
//! reports to its host's supervisor, which decides about restarts.
//!
//! A chip also takes part in prefill/decode disaggregation (`handoff`): as a prefill
//! chip it computes a prompt's KV and streams it, layer by layer, to a decode chip; as
//! a decode chip it installs that KV (converting block size, layout and dtype) and
//! samples from the last prompt token on.

pub mod executor;
mod handoff;

use crate::batcher::{Batcher, BatcherLimits, Inadmissible, admissible};
use crate::kv::KvPool;
use crate::msg::{
    ChipInfo, ChipReport, ChipState, ErrorKind, Fault, KvCompat, Msg, Retry, Role, SeqRequest, ServeError, StepSpeed,
    topic,
};
use crate::router::cost::Pace;
use executor::{ExecutorFactory, StepExecutor};
use handoff::Handoffs;
use std::sync::Arc;
use std::time::Duration;
use tessera_actor_core::{Addr, Moment};
use tessera_actor_core::{Behavior, Effects, Job, JobCtx, WorkerId, WorkerSpec};

/// The tracing target of a chip's per-step events (`TESSERA_LOG=info,tessera::steps=trace`):
/// `step planned` with the step's shape as `new:context` per sequence, and `step done`
/// with its model time (`elapsed_s`) and the time from handing it to the worker to
/// reading its result (`span_s`: the step as the chip waited for it, dispatch
/// included), joined by chip and step number. `tessera calibrate --from-steps`
/// fits a chip kind's performance model to them.
pub const STEP_TRACE: &str = "tessera::steps";

/// While a step is in flight, a chip reports (publishing its KV events with the report)
/// at most this often; a change of state, role or drain, and going idle, are reported at
/// once. Its supervisor keeps only the latest report for its next heartbeat, so a report
/// per step (hundreds a second on a fast chip) told it nothing more.
const REPORT_EVERY: Duration = Duration::from_millis(10);

/// A chip's fixed description.
#[derive(Debug, Clone)]
pub struct ChipConfig {
    pub id: String,
    pub host_name: String,
    pub role: Role,
    pub max_batch_tokens: usize,
    pub max_batch_seqs: usize,
    pub supervisor: Addr,
    /// How long KV this chip prefilled waits for its decode chip to claim and read it.
    pub kv_lease: Duration,
    /// Stall-free batching: how long a step that carries decode tokens may take (the
    /// topology's `max_mixed_step_ms`); `None`: no limit but the token budget.
    pub max_mixed_step: Option<Duration>,
    /// The chip's modelled pace (the router's): what fair queuing charges tenants.
    pub pace: Pace,
    /// The cluster's tenants' names, by index (metric labels).
    pub tenants: Arc<[String]>,
}

/// What a draining chip does once it holds no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// Take this role.
    To(Role),
    /// Stay idle (parked by a plan) until given a role.
    Park,
}

pub struct Chip {
    config: ChipConfig,
    factory: ExecutorFactory,
    me: Option<Addr>,
    state: ChipState,
    worker: Option<WorkerId>,
    info: Option<ChipInfo>,
    pool: Option<KvPool>,
    batcher: Option<Batcher>,
    step_in_flight: bool,
    /// When the step in flight was handed to the worker.
    step_submitted: Moment,
    steps: u64,
    max_step_seqs: usize,
    restarts: u32,
    /// Pools this chip has had (a restart starts a new one, numbering events from 1).
    pool_runs: u64,
    error: Option<String>,
    inject_panic: bool,
    /// Taken offline by a drill: no restarts until it is brought back.
    offline: bool,
    role: Role,
    /// Draining: to take a role once drained, or to stay parked.
    draining_to: Option<Drain>,
    handoffs: Handoffs,
    /// Step limits (tokens, sequences) now: the configured ones unless a plan set less.
    limits: (usize, usize),
    /// The observed pace, and the shape (tokens, sequences, prompt tokens) of the step
    /// in flight that will update it.
    speed: StepSpeed,
    step_shape: (usize, usize, usize),
    /// Prompt tokens of sequences started here, and of those, tokens reused from cache.
    prefix_tokens: (u64, u64),
    /// Model seconds served to each tenant (by index) since the chip first started.
    service_s: Vec<f64>,
    /// Model seconds of steps with prompt tokens, and of decode-only steps.
    busy_s: (f64, f64),
    /// What every report names, shared rather than copied into each.
    shown: Shown,
    /// When the last report went out, and the (state, role, draining) it said.
    last_report: Option<Moment>,
    reported: (ChipState, Role, Option<Drain>),
    /// Its per-step metrics, registered once when it starts (inside the host, whose
    /// recorder they report to) rather than looked up by name at every step.
    metrics: Option<ChipMetrics>,
}

/// The handles of the chip's per-step metrics, all labelled with its id.
struct ChipMetrics {
    step_seqs: metrics::Histogram,
    step_tokens: metrics::Histogram,
    step_seconds: metrics::Histogram,
    blocks_used: metrics::Gauge,
    blocks_total: metrics::Gauge,
    blocks_cached: metrics::Gauge,
    prompt_tokens: metrics::Counter,
    reused_tokens: metrics::Counter,
}

impl ChipMetrics {
    fn register(chip: &str) -> ChipMetrics {
        let labels = [("chip", chip.to_string())];
        ChipMetrics {
            step_seqs: metrics::histogram!("tessera_chip_step_seqs", &labels),
            step_tokens: metrics::histogram!("tessera_chip_step_tokens", &labels),
            step_seconds: metrics::histogram!("tessera_chip_step_seconds", &labels),
            blocks_used: metrics::gauge!("tessera_kv_blocks_used", &labels),
            blocks_total: metrics::gauge!("tessera_kv_blocks_total", &labels),
            blocks_cached: metrics::gauge!("tessera_kv_blocks_cached", &labels),
            prompt_tokens: metrics::counter!("tessera_prefix_prompt_tokens_total", &labels),
            reused_tokens: metrics::counter!("tessera_prefix_reused_tokens_total", &labels),
        }
    }
}

/// The parts of a chip's reports that change only when it starts.
struct Shown {
    id: Arc<str>,
    host_name: Arc<str>,
    emulated: Option<Arc<str>>,
    compat: Option<Arc<KvCompat>>,
}

impl Chip {
    pub fn new(config: ChipConfig, factory: ExecutorFactory) -> Chip {
        let role = config.role;
        let shown = Shown {
            id: Arc::from(config.id.as_str()),
            host_name: Arc::from(config.host_name.as_str()),
            emulated: None,
            compat: None,
        };
        Chip {
            role,
            draining_to: None,
            limits: (config.max_batch_tokens, config.max_batch_seqs),
            handoffs: Handoffs::default(),
            config,
            factory,
            me: None,
            state: ChipState::Starting,
            worker: None,
            info: None,
            pool: None,
            batcher: None,
            step_in_flight: false,
            step_submitted: Moment(0),
            steps: 0,
            max_step_seqs: 0,
            restarts: 0,
            pool_runs: 0,
            error: None,
            inject_panic: false,
            offline: false,
            speed: StepSpeed::default(),
            step_shape: (0, 0, 0),
            prefix_tokens: (0, 0),
            service_s: Vec::new(),
            busy_s: (0.0, 0.0),
            shown,
            last_report: None,
            reported: (ChipState::Starting, role, None),
            metrics: None,
        }
    }

    // The init's error is the failure message itself, built once per start.
    #[allow(clippy::result_large_err)]
    fn start_worker(&mut self, fx: &mut dyn Effects<Msg>) {
        self.state = ChipState::Starting;
        self.step_in_flight = false;
        let factory = self.factory.clone();
        let spec = WorkerSpec {
            name: format!("chip-{}", self.config.id),
            init: Box::new(move || match factory() {
                Ok((exec, info)) => {
                    Ok((Box::new(exec) as Box<dyn std::any::Any>, Msg::WorkerReady { info: Box::new(info) }))
                }
                Err(error) => Err(Msg::WorkerFailed { error }),
            }),
            on_panic: Box::new(|error| Msg::WorkerPanicked { error }),
        };
        self.worker = Some(fx.start_worker(spec));
        self.report(fx);
    }

    /// Reports now if it is due (see [`REPORT_EVERY`]).
    fn report_if_due(&mut self, fx: &mut dyn Effects<Msg>) {
        let changed = self.reported != (self.state, self.role, self.draining_to);
        let due = self.last_report.is_none_or(|at| fx.now().since(at) >= REPORT_EVERY);
        if changed || due || !self.step_in_flight {
            self.report(fx);
        }
    }

    fn report(&mut self, fx: &mut dyn Effects<Msg>) {
        self.last_report = Some(fx.now());
        self.reported = (self.state, self.role, self.draining_to);
        // The KV events first, then the report whose heartbeat says how many there were.
        let (kv_last_event, kv_incarnation) = match self.pool.as_mut() {
            Some(pool) => {
                let events = pool.take_events();
                if !events.is_empty() {
                    fx.publish(topic::KV_EVENTS, Msg::KvEvents { chip: fx.me(), incarnation: self.pool_runs, events });
                }
                (pool.snapshot_seq(), self.pool_runs)
            }
            None => (0, self.pool_runs),
        };
        let (used, total) = self.pool.as_ref().map_or((0, 0), |p| (p.used(), p.capacity()));
        let report = ChipReport {
            chip: fx.me(),
            id: self.shown.id.clone(),
            host_name: self.shown.host_name.clone(),
            role: self.role,
            state: self.state,
            kv_blocks_used: used,
            kv_blocks_total: total,
            running: self.batcher.as_ref().map_or(0, Batcher::running),
            waiting: self.batcher.as_ref().map_or(0, Batcher::waiting),
            steps: self.steps,
            max_step_seqs: self.max_step_seqs,
            restarts: self.restarts,
            error: self.error.clone(),
            draining: self.draining_to.is_some(),
            parked: self.draining_to == Some(Drain::Park),
            handoffs: self.handoffs.len(),
            emulated: self.shown.emulated.clone(),
            compat: self.shown.compat.clone(),
            last_handoff_gap_s: self.handoffs.last_gap_s,
            kv_last_event,
            kv_incarnation,
            speed: (self.speed != StepSpeed::default()).then_some(self.speed),
            prefix_prompt_tokens: self.prefix_tokens.0,
            prefix_reused_tokens: self.prefix_tokens.1,
            busy_prefill_s: self.busy_s.0,
            busy_decode_s: self.busy_s.1,
            tenant_service_s: self.service_s.clone(),
        };
        if let Some(m) = &self.metrics {
            m.blocks_used.set(used as f64);
            m.blocks_total.set(total as f64);
            m.blocks_cached.set(self.pool.as_ref().map_or(0, KvPool::cached) as f64);
        }
        // The supervisor is on this host; it is only gone while the host shuts down.
        let _ = fx.send(self.config.supervisor, Msg::Report { report: Box::new(report) });
    }

    /// Why `seq` can never run here, if so.
    fn check(&self, seq: &SeqRequest, info: &ChipInfo, batcher: &Batcher) -> Option<ServeError> {
        self.check_fits(seq, info, batcher.blocks_to_finish(seq))
    }

    /// Why `seq` can never run here, if so, when it needs `need` KV blocks at most.
    fn check_fits(&self, seq: &SeqRequest, info: &ChipInfo, need: usize) -> Option<ServeError> {
        let error = admissible(seq, info.vocab_size, info.max_context, need, info.num_blocks).err()?;
        Some(match error {
            Inadmissible::NoRoomInContext { .. } => {
                ServeError::about_request(ErrorKind::PromptTooLong, error.to_string())
            }
            // The client may read the sizes, not which chip was asked.
            Inadmissible::TooFewBlocks { .. } => {
                ServeError::new(ErrorKind::BadRequest, format!("chip {}: {error}", self.config.id))
                    .with_public(error.to_string())
            }
            Inadmissible::EmptyPrompt | Inadmissible::OutOfVocabulary { .. } => {
                ServeError::about_request(ErrorKind::BadRequest, error.to_string())
            }
        })
    }

    fn enqueue(&mut self, seq: SeqRequest, fx: &mut dyn Effects<Msg>) {
        let me = fx.me();
        let refuse = |fx: &mut dyn Effects<Msg>, error: ServeError, retry: Retry| {
            let _ = fx.send(seq.req, Msg::Refused { request_id: seq.request_id, chip: me, error, retry });
        };
        let (Some(info), Some(batcher), ChipState::Up, None) =
            (&self.info, &self.batcher, self.state, &self.draining_to)
        else {
            refuse(fx, self.unavailable(), Retry::Unavailable);
            return;
        };
        if batcher.contains(seq.request_id) {
            return; // a duplicate of a request already here
        }
        if let Some(error) = self.check(&seq, info, batcher) {
            refuse(fx, error, Retry::No);
            return;
        }
        if let Some(b) = self.batcher.as_mut() {
            b.enqueue(seq);
        }
        self.try_step(fx);
    }

    /// Why new work is not taken now (retryable elsewhere).
    fn unavailable(&self) -> ServeError {
        let why = match (&self.draining_to, self.state) {
            (Some(Drain::To(role)), _) => format!("chip {} is draining to become a {role} chip", self.config.id),
            (Some(Drain::Park), _) => format!("chip {} is parked: it takes no work", self.config.id),
            _ => format!("chip {} is not up", self.config.id),
        };
        ServeError::new(ErrorKind::Unavailable, why)
    }

    fn try_step(&mut self, fx: &mut dyn Effects<Msg>) {
        if self.step_in_flight || self.state != ChipState::Up {
            return;
        }
        let (Some(worker), Some(pool), Some(batcher)) = (self.worker, self.pool.as_mut(), self.batcher.as_mut()) else {
            return;
        };
        let panic_now = std::mem::take(&mut self.inject_panic);
        if let Some(limit) = self.config.max_mixed_step {
            batcher.set_mixed_prefill_cap(mixed_prefill_tokens(limit, &self.speed, pool.block_size()));
        }
        let plan = batcher.plan(pool);
        for (tenant, seconds) in batcher.take_service() {
            let t = tenant as usize;
            if self.service_s.len() <= t {
                self.service_s.resize(t + 1, 0.0);
            }
            self.service_s[t] += seconds;
            let name = self.config.tenants.get(t).map_or_else(|| tenant.to_string(), String::clone);
            let chip = self.config.id.clone();
            metrics::gauge!("tessera_chip_tenant_service_seconds", "chip" => chip, "tenant" => name)
                .set(self.service_s[t]);
        }
        let preempted = batcher.take_preemptions();
        for (reason, n) in [("kv", preempted.kv), ("priority", preempted.priority), ("fair", preempted.fair)] {
            if n > 0 {
                let chip = self.config.id.clone();
                metrics::counter!("tessera_chip_preemptions_total", "chip" => chip, "reason" => reason).increment(n);
            }
        }
        let (prompt, reused) = batcher.take_prefix_stats();
        if prompt > 0 {
            self.prefix_tokens.0 += prompt;
            self.prefix_tokens.1 += reused;
            if let Some(m) = &self.metrics {
                m.prompt_tokens.increment(prompt);
                m.reused_tokens.increment(reused);
            }
        }
        let dropped = batcher.take_dropped();
        let unforked = batcher.take_unforked();
        self.prefills_dropped(dropped, fx);
        for (request_id, req) in unforked {
            tracing::debug!(chip = %self.config.id, request_id, "no KV block to fork into; the request routes on its own");
            let _ = fx.send(req, Msg::Reroute);
        }
        let Some(plan) = plan else {
            if panic_now {
                self.inject_panic = true; // wait for work, so the drill hits a live step
            }
            return;
        };
        self.steps += 1;
        self.max_step_seqs = self.max_step_seqs.max(plan.seqs.len());
        if let Some(m) = &self.metrics {
            m.step_seqs.record(plan.seqs.len() as f64);
            m.step_tokens.record(plan.tokens() as f64);
        }
        let prompt_tokens = plan.seqs.iter().filter(|s| s.tokens.len() > 1).map(|s| s.tokens.len()).sum();
        self.step_shape = (plan.tokens(), plan.seqs.len(), prompt_tokens);
        tracing::trace!(target: STEP_TRACE, chip = %self.config.id, step = self.steps,
            shape = %plan.seqs.iter().map(|s| format!("{}:{}", s.tokens.len(), s.start_pos + s.tokens.len()))
                .collect::<Vec<_>>().join(","),
            "step planned");
        let step = self.steps;
        let job = Job {
            label: "forward",
            run: Box::new(move |state: &mut dyn std::any::Any, ctx: &mut dyn JobCtx<Msg>| {
                if panic_now {
                    panic!("fault drill: worker panic injected");
                }
                match state.downcast_mut::<Box<dyn StepExecutor>>() {
                    Some(exec) => Msg::StepDone { outcome: exec.step(step, &plan, ctx) },
                    None => Msg::WorkerPanicked { error: "the worker holds no step executor".into() },
                }
            }),
        };
        // Before the hand-over: the worker may finish before this thread reads the clock.
        self.step_submitted = fx.now();
        match fx.submit(worker, job) {
            Ok(()) => self.step_in_flight = true,
            Err(e) => self.crash(format!("the worker is gone: {e}"), fx),
        }
    }

    fn step_done(&mut self, outcome: crate::msg::StepOutcome, fx: &mut dyn Effects<Msg>) {
        self.step_in_flight = false;
        if let Some(error) = outcome.error {
            self.crash(format!("a forward step failed: {error}"), fx);
            return;
        }
        if let Some(m) = &self.metrics {
            m.step_seconds.record(outcome.elapsed_s);
        }
        tracing::trace!(target: STEP_TRACE, chip = %self.config.id, step = self.steps, elapsed_s = outcome.elapsed_s,
            span_s = fx.now().since(self.step_submitted).as_secs_f64(), "step done");
        let (tokens, seqs, prompt_tokens) = self.step_shape;
        self.speed.observe(outcome.elapsed_s, tokens, seqs, prompt_tokens);
        if outcome.elapsed_s.is_finite() && outcome.elapsed_s > 0.0 {
            let phase = if prompt_tokens > 0 { &mut self.busy_s.0 } else { &mut self.busy_s.1 };
            *phase += outcome.elapsed_s;
        }
        self.first_steps_after_handoff(&outcome, fx.now());
        // Scored prompt tokens go first: a colocated request's then precede its tokens.
        for (request_id, req, start, logprobs) in outcome.prompt_logprobs {
            let _ = fx.send(req, Msg::PromptLogprobs { request_id, start, logprobs });
        }
        let me = fx.me();
        let (Some(pool), Some(batcher)) = (self.pool.as_mut(), self.batcher.as_mut()) else { return };
        let emitted = batcher.complete(&outcome.sampled, &outcome.logprobs, pool);
        // After `complete`: a prefill for a decode chip that samples here has its token.
        let prefilled = batcher.take_prefilled();
        let mut first_tokens = Vec::new();
        for e in emitted {
            if let Some(&token) = e.tokens.first()
                && self.handoffs.is_prefilling(e.request_id)
            {
                first_tokens.push((e.request_id, token, e.finish.is_some()));
            }
            let msg = Msg::Generated {
                request_id: e.request_id,
                chip: me,
                tokens: e.tokens,
                finish: e.finish,
                logprobs: e.logprobs,
            };
            if fx.send(e.req, msg).is_err() && e.finish.is_none() {
                // Its request is unreachable: stop spending compute on it.
                batcher.abort(e.request_id, pool);
            }
        }
        // After `complete`: a fork whose sampler failed exists by then, to be aborted.
        for (request_id, why) in outcome.failed {
            if let Some(req) = batcher.abort(request_id, pool) {
                tracing::error!(chip = %self.config.id, request_id, error = %why, "a sequence could not sample");
                let error = ServeError::new(ErrorKind::Internal, format!("chip {}: {why}", self.config.id));
                let _ = fx.send(req, Msg::Refused { request_id, chip: me, error, retry: Retry::No });
            }
        }
        for p in prefilled {
            self.prefill_finished(p, fx);
        }
        for (request_id, token, finished) in first_tokens {
            self.first_token_sampled(request_id, token, finished, fx);
        }
        self.settle(fx);
    }

    /// After work ended: claim KV offers that now fit, finish a drain if it is time, go
    /// on, and report if due.
    fn settle(&mut self, fx: &mut dyn Effects<Msg>) {
        self.admit_offers(fx);
        let idle = self.batcher.as_ref().is_none_or(|b| !b.has_work()) && self.handoffs.is_empty();
        if idle && let Some(Drain::To(role)) = self.draining_to {
            tracing::info!(chip = %self.config.id, from = %self.role, to = %role, "drained; role changed");
            self.draining_to = None;
            self.role = role;
        }
        self.try_step(fx);
        self.report_if_due(fx);
    }

    /// The worker is gone: hand every sequence back, free the pool, tell the supervisor.
    fn crash(&mut self, error: String, fx: &mut dyn Effects<Msg>) {
        tracing::error!(chip = %self.config.id, %error, "chip down");
        self.halt(ChipState::Down, &error, fx);
        let _ = fx.send(self.config.supervisor, Msg::ChipCrashed { chip: fx.me(), error });
        self.report(fx);
    }

    /// A drill's `Offline`: as a crash, but `Failed` and not told to the supervisor,
    /// which would restart it; only `Online` brings it back.
    fn go_offline(&mut self, fx: &mut dyn Effects<Msg>) {
        if self.offline {
            return;
        }
        tracing::warn!(chip = %self.config.id, "fault drill: chip offline");
        self.offline = true;
        self.halt(ChipState::Failed, "offline (fault drill)", fx);
        self.report(fx);
    }

    /// Stops the worker and hands every sequence and hand-off back, leaving `state`.
    fn halt(&mut self, state: ChipState, error: &str, fx: &mut dyn Effects<Msg>) {
        if let Some(w) = self.worker.take() {
            fx.stop_worker(w);
        }
        self.evict_all(error, fx);
        self.handoffs_lost(error, fx);
        self.state = state;
        self.error = Some(error.to_string());
        self.step_in_flight = false;
    }

    /// A role that keeps everything the chip does now (`both`, or its own role, as when
    /// unparking) is taken at once: the work it holds stays its to finish. Any other
    /// drains first: the chip takes no new work until what it holds is done.
    fn set_role(&mut self, role: Role, fx: &mut dyn Effects<Msg>) {
        let parked = self.draining_to == Some(Drain::Park);
        if role == Role::Both || (role == self.role && (parked || self.draining_to.is_none())) {
            tracing::info!(chip = %self.config.id, from = %self.role, to = %role, "role change: at once");
            self.draining_to = None;
            self.role = role;
        } else {
            tracing::info!(chip = %self.config.id, from = %self.role, to = %role, "role change: draining first");
            self.draining_to = Some(Drain::To(role));
        }
        self.settle(fx);
    }

    /// Takes no new work from now on, finishing what it holds, until a `SetRole`.
    fn park(&mut self, fx: &mut dyn Effects<Msg>) {
        tracing::info!(chip = %self.config.id, role = %self.role, "parked: draining, then idle");
        self.draining_to = Some(Drain::Park);
        self.settle(fx);
    }

    /// New step limits, at most the configured ones (the worker's buffers are sized for
    /// those); the batch in flight is not cut.
    fn set_limits(&mut self, max_batch_tokens: u32, max_batch_seqs: u32) {
        let tokens = (max_batch_tokens as usize).clamp(1, self.config.max_batch_tokens);
        let seqs = (max_batch_seqs as usize).clamp(1, self.config.max_batch_seqs);
        self.limits = (tokens, seqs);
        if let Some(batcher) = self.batcher.as_mut() {
            batcher.set_limits(tokens, seqs);
        }
        tracing::info!(chip = %self.config.id, max_batch_tokens = tokens, max_batch_seqs = seqs, "step limits set");
    }

    fn evict_all(&mut self, why: &str, fx: &mut dyn Effects<Msg>) {
        let me = fx.me();
        if let Some(batcher) = self.batcher.as_mut() {
            for (request_id, req) in batcher.evict_all(self.pool.as_mut()) {
                let error = ServeError::new(ErrorKind::Unavailable, format!("chip {}: {why}", self.config.id));
                let _ = fx.send(req, Msg::Refused { request_id, chip: me, error, retry: Retry::Elsewhere });
            }
        }
    }
}

/// Prompt tokens a step that also decodes may carry to take at most `limit`, at the
/// chip's observed pace: what the limit leaves after a decode-only step, at the time per
/// token of its steps with prompt tokens. At least one block's worth, so prompts always
/// progress; `None` (no cap) until a step with prompt tokens has been timed.
fn mixed_prefill_tokens(limit: Duration, speed: &StepSpeed, block_size: usize) -> Option<usize> {
    let per_token = speed.prefill_s_per_token();
    if per_token <= 0.0 {
        return None;
    }
    let left = (limit.as_secs_f64() - speed.decode_step_s).max(0.0);
    Some(((left / per_token) as usize).max(block_size.max(1)))
}

impl Behavior<Msg> for Chip {
    fn name(&self) -> &'static str {
        "chip"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.me = Some(fx.me());
        self.metrics = Some(ChipMetrics::register(&self.config.id));
        self.start_worker(fx);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::WorkerReady { info } => {
                let limits = BatcherLimits {
                    max_batch_tokens: self.limits.0,
                    max_batch_seqs: self.limits.1,
                    block_size: info.block_size,
                    max_context: info.max_context,
                };
                self.pool = Some(KvPool::new(fx.me(), info.num_blocks, info.block_size));
                self.pool_runs += 1;
                let mut batcher = Batcher::new(limits, info.eos_token_ids.clone());
                batcher.set_pace(self.config.pace);
                let shared = self.config.tenants.len() > 1;
                batcher.set_shared(shared);
                self.batcher = Some(batcher);
                tracing::info!(chip = %self.config.id, kv_blocks = info.num_blocks, block_size = info.block_size, "chip up");
                tracing::debug!(
                    chip = %self.config.id,
                    shared,
                    knee_tokens = self.config.pace.knee_tokens(),
                    prefill_s_per_token = self.config.pace.prefill_s_per_token,
                    decode_step_s = self.config.pace.decode_step_s,
                    "chip pace"
                );
                self.shown.emulated = info.emulated.as_deref().map(Arc::from);
                self.shown.compat = Some(Arc::new(info.compat.clone()));
                self.info = Some(*info);
                self.state = ChipState::Up;
                self.error = None;
                self.report(fx);
            }
            Msg::WorkerFailed { error } => {
                self.worker = None;
                self.crash(format!("cannot start: {error}"), fx);
            }
            Msg::WorkerPanicked { error } => {
                self.worker = None;
                self.crash(format!("worker panicked: {error}"), fx);
            }
            Msg::StepDone { outcome } => self.step_done(outcome, fx),
            Msg::Enqueue { seq } => self.enqueue(*seq, fx),
            Msg::Prefill { seq, decode } => self.prefill(*seq, decode, fx),
            Msg::Abort { request_id } => {
                self.forget(request_id, "its request aborted it", fx);
                self.settle(fx);
            }
            Msg::KvOffer { offer } => self.offered(*offer, fx),
            Msg::KvClaim { request_id, decode } => self.claimed(request_id, decode, fx),
            Msg::KvDecline { request_id, decode, error, retry } => self.declined(request_id, decode, error, retry, fx),
            Msg::KvReady { request_id, layers, upto, blocks, capability } => {
                self.kv_ready(request_id, layers, upto, blocks, capability, fx)
            }
            Msg::KvFirstToken { request_id, token } => self.first_token_came(request_id, token, fx),
            Msg::KvDone { request_id } => self.kv_done(request_id, fx),
            Msg::KvCancel { request_id, reason } => {
                self.cancelled(request_id, &reason, fx);
                self.settle(fx);
            }
            Msg::KvLeaseExpired { request_id, lease } => self.lease_expired(request_id, lease, fx),
            Msg::KvStaged { layers, staged, capabilities, .. } => self.staged(layers, staged, capabilities, fx),
            Msg::KvInstalled { request_id, layers, upto, error } => self.installed(request_id, layers, upto, error, fx),
            Msg::SetRole { role } => self.set_role(role, fx),
            Msg::Park => self.park(fx),
            Msg::SetLimits { max_batch_tokens, max_batch_seqs } => self.set_limits(max_batch_tokens, max_batch_seqs),
            Msg::KvSnapshotRequest { reply_to } => {
                // Pending events go out first: the snapshot includes them, and a reader
                // that sees them after it skips them by number.
                self.report(fx);
                if let Some(pool) = &self.pool {
                    let (last_event, hashes) = pool.snapshot();
                    let msg = Msg::KvSnapshot { chip: fx.me(), incarnation: self.pool_runs, last_event, hashes };
                    let _ = fx.send(reply_to, msg);
                }
            }
            Msg::Restart if self.state == ChipState::Down && !self.offline => {
                self.restarts += 1;
                self.start_worker(fx);
            }
            Msg::GiveUp { reason } => {
                self.state = ChipState::Failed;
                self.error = Some(reason);
                self.report(fx);
            }
            Msg::InjectFault { fault: Fault::WorkerPanic } => {
                self.inject_panic = true;
                self.try_step(fx);
            }
            Msg::InjectFault { fault: Fault::DropKvClaim } => self.handoffs.drop_next_claim = true,
            Msg::InjectFault { fault: Fault::Offline } => self.go_offline(fx),
            Msg::InjectFault { fault: Fault::Online } if self.offline => {
                tracing::warn!(chip = %self.config.id, "fault drill: chip back online; starting");
                self.offline = false;
                self.error = None;
                self.restarts += 1;
                self.start_worker(fx);
            }
            Msg::Tick => self.report(fx),
            other => tracing::debug!(chip = %self.config.id, kind = ?other, "unexpected message"),
        }
    }
}

impl std::fmt::Debug for Chip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chip").field("id", &self.config.id).field("state", &self.state).finish()
    }
}

#[cfg(test)]
mod tests;
