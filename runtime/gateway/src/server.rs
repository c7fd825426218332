//! The HTTP side of the gateway (axum): turns OpenAI requests into Request actors on
//! this host, and their events back into JSON or SSE. Each HTTP request owns a mailbox;
//! when the client goes away the mailbox's guard cancels the Request actor, which
//! aborts its sequence and frees its KV on the chip.
//!
//! The async runtime this runs on also carries the bus and the heartbeats, so nothing
//! CPU-heavy runs on it: parsing a body, rendering a chat template and tokenizing run
//! on blocking threads, a few at a time (`prompt_workers`), after the prompt's text has
//! been checked against a bound derived from the model's context (`max_prompt_bytes`).

use crate::access::{self, Access, Caller};
use crate::listener::{self, HttpLimits};
use crate::openai::{self, ApiError, ChatTemplate, FinishReason, GenerationRequest, Prompt, StopMatcher, Usage};
use axum::Router as HttpRouter;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tessera_actors::msg::{AdmitAsk, Delivery, ForkAsk, Grammar, TokenLogprob};
use tessera_actors::msg::{ChipState, ClientEvent, ErrorKind, Fault, Finish, Msg, Role, SamplingSpec, ServeError};
use tessera_backends::tokenizer::TextTokenizer;
use tessera_runtime::Addr;
use tessera_runtime::host::{Host, Mailbox};

/// What the gateway needs to know.
pub struct GatewayConfig {
    pub served_model: String,
    pub max_context: usize,
    pub router: Addr,
    /// The admission behavior on this host: ids, in-flight limits, Request actors.
    pub admission: Addr,
    /// Chip ids and addresses, for fault drills.
    pub chips: HashMap<String, Addr>,
    /// The solver, when the cluster runs one (`/admin/plan`).
    pub solver: Option<Addr>,
    pub metrics: Option<PrometheusHandle>,
    /// Prompts with more bytes of text than this are refused before tokenizing; see
    /// [`default_max_prompt_bytes`].
    pub max_prompt_bytes: usize,
    /// Connections, header and idle timeouts.
    pub http: HttpLimits,
    /// Keys, roles, tenants and the audit log.
    pub access: Arc<Access>,
}

/// The longest prompt text that could fit `max_context` tokens: no token stands for more
/// than `max_token_bytes` bytes of text, so a longer text needs more tokens than fit.
pub fn default_max_prompt_bytes(max_context: usize, max_token_bytes: usize) -> usize {
    max_context.saturating_mul(max_token_bytes.max(1))
}

/// The largest request body accepted: the prompt bound, with room for JSON escapes
/// (up to 6 bytes per byte of text) and the other fields.
fn max_body_bytes(max_prompt_bytes: usize) -> usize {
    max_prompt_bytes.saturating_mul(6).saturating_add(1 << 20)
}

pub struct GatewayState {
    host: Arc<Host<Msg>>,
    tokenizer: Arc<TextTokenizer>,
    template: Option<ChatTemplate>,
    config: GatewayConfig,
    /// Bodies being parsed and prompts tokenized at once, off the async runtime.
    prompt_workers: tokio::sync::Semaphore,
    grammars: openai::GrammarCheck,
}

impl GatewayState {
    pub fn new(host: Arc<Host<Msg>>, tokenizer: TextTokenizer, config: GatewayConfig) -> Result<Self, String> {
        let template = match tokenizer.chat_template() {
            Some(src) => {
                let bos = tokenizer.bos_id().and_then(|id| tokenizer.id_to_token(id));
                let eos = tokenizer.eos_ids().first().and_then(|&id| tokenizer.id_to_token(id));
                Some(ChatTemplate::new(src, bos, eos).map_err(|e| format!("the model's chat template: {e}"))?)
            }
            None => None,
        };
        Ok(GatewayState {
            host,
            tokenizer: Arc::new(tokenizer),
            template,
            config,
            prompt_workers: tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get),
            ),
            grammars: openai::GrammarCheck::default(),
        })
    }
}

/// The gateway's routes. Every error, including unknown paths, wrong methods and
/// bodies over the limit, is OpenAI error JSON.
pub fn routes(state: Arc<GatewayState>) -> HttpRouter {
    let body_limit = max_body_bytes(state.config.max_prompt_bytes);
    let access = state.config.access.clone();
    HttpRouter::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health/live", get(live))
        .route("/metrics", get(prometheus))
        .route("/admin/faults", post(inject_fault))
        .route("/admin/role", post(set_role))
        .route("/admin/plan", get(plan_show))
        .route("/admin/plan/apply", post(plan_apply))
        .route("/admin/plan/solve", post(plan_solve))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn(move |req, next| refuse_announced_oversize(req, next, body_limit)))
        // Outermost: a caller is known (or refused) before its body is read.
        .layer(axum::middleware::from_fn(move |req, next| access::authorize(access.clone(), req, next)))
        .with_state(state)
}

/// A body whose announced length is over the limit is refused from its headers, before
/// the client spends time sending it (one without a length is cut off at the limit).
async fn refuse_announced_oversize(
    req: axum::extract::Request,
    next: axum::middleware::Next,
    limit: usize,
) -> Response {
    let announced =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit as u64) {
        return error_response(ApiError::body_too_large(limit));
    }
    next.run(req).await
}

async fn unknown_route(method: Method, uri: Uri) -> Response {
    error_response(ApiError::unknown_route(method.as_str(), uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(ApiError::method_not_allowed(method.as_str(), uri.path()))
}

/// A request body, or the error JSON for one that could not be read (over the limit:
/// 413; cut off or unreadable: 400).
fn body_or_error(st: &GatewayState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::body_too_large(max_body_bytes(st.config.max_prompt_bytes))
        } else {
            ApiError::bad_request(format!("cannot read the request body: {}", rejection.body_text()), None)
        }
    })
}

/// Serves until `shutdown` resolves, then waits for in-flight requests to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<GatewayState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.config.http;
    listener::serve(listener, routes(state), limits, shutdown).await
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn error_response(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    metrics::counter!("tessera_gateway_errors_total", "status" => e.status.to_string()).increment(1);
    let retry_after = e.retry_after_s.map(|s| [(axum::http::header::RETRY_AFTER, s.to_string())]);
    (status, retry_after, axum::Json(e.to_json())).into_response()
}

/// A request the actors could not serve, as its client sees it: the one place an
/// [`ErrorKind`] becomes a status, an OpenAI error type and a generic message. The
/// diagnostic (`message`: chips, hosts, internal errors) was logged where the request
/// failed and never reaches the client; `public`, about the client's own request, does.
fn api_error(e: &ServeError) -> ApiError {
    tracing::debug!(kind = ?e.kind, error = %e.message, "request refused");
    let public = |generic: &str| e.public.clone().unwrap_or_else(|| generic.to_owned());
    match e.kind {
        ErrorKind::BadRequest => ApiError::bad_request(public("The request cannot be served as sent."), None),
        ErrorKind::PromptTooLong => ApiError {
            status: 413,
            code: Some("context_length_exceeded".to_owned()),
            ..ApiError::bad_request(
                public("The prompt leaves no room in the model's context. Please shorten the prompt."),
                Some("prompt"),
            )
        },
        ErrorKind::Overloaded => ApiError {
            retry_after_s: Some(e.retry_after_s.unwrap_or(1)),
            ..ApiError::overloaded(public("The server is overloaded; retry later."))
        },
        ErrorKind::Unavailable => ApiError {
            retry_after_s: Some(e.retry_after_s.unwrap_or(1)),
            ..ApiError::unavailable(public("No chip can serve the request right now; retry later."))
        },
        ErrorKind::Internal => ApiError::internal(public("The server could not complete the request.")),
        ErrorKind::QuotaExceeded => ApiError {
            retry_after_s: Some(e.retry_after_s.unwrap_or(1)),
            ..ApiError::quota_exceeded(public("Your tenant is over one of its quotas; retry later."))
        },
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Completions,
    Chat,
}

/// The caller the access layer found; the open tenant where it found none.
fn caller_or_open(caller: Option<Extension<Caller>>) -> Caller {
    caller.map_or_else(Caller::open, |Extension(c)| c)
}

async fn completions(
    State(st): State<Arc<GatewayState>>,
    caller: Option<Extension<Caller>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body_or_error(&st, body) {
        Ok(body) => generate(st, body, Endpoint::Completions, caller_or_open(caller)).await,
        Err(e) => error_response(e),
    }
}

async fn chat_completions(
    State(st): State<Arc<GatewayState>>,
    caller: Option<Extension<Caller>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body_or_error(&st, body) {
        Ok(body) => generate(st, body, Endpoint::Chat, caller_or_open(caller)).await,
        Err(e) => error_response(e),
    }
}

/// Cancels the Request actor unless it ended by itself (its end frees the admission
/// slot).
struct RequestGuard {
    st: Arc<GatewayState>,
    actor: Addr,
    done: bool,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.done {
            // The actor may have ended meanwhile; then there is nothing to cancel.
            let _ = self.st.host.send(self.actor, Msg::Cancel);
        }
    }
}

/// Bytes of text in a prompt, before any template.
fn prompt_text_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(text) => text.len(),
        Prompt::TokenIds(_) => 0,
        Prompt::Chat(messages) => messages.iter().map(|m| m.content.len()).sum(),
    }
}

/// Parses a body and tokenizes its prompt: CPU work, run on a blocking thread.
/// A request parsed, its prompt tokenized, its grammar (if any) checked.
struct Prepared {
    req: GenerationRequest,
    prompt: Vec<u32>,
    grammar: Option<Grammar>,
}

fn prepare(st: &GatewayState, body: &[u8], endpoint: Endpoint) -> Result<Prepared, ApiError> {
    let req = match endpoint {
        Endpoint::Completions => openai::parse_completion(body)?,
        Endpoint::Chat => openai::parse_chat(body)?,
    };
    if req.model != st.config.served_model {
        return Err(ApiError::not_found_model(&req.model, std::slice::from_ref(&st.config.served_model)));
    }
    let bytes = prompt_text_bytes(&req.prompt);
    if bytes > st.config.max_prompt_bytes {
        metrics::counter!("tessera_gateway_prompts_too_long_total").increment(1);
        return Err(ApiError::prompt_text_too_long(bytes, st.config.max_prompt_bytes, st.config.max_context));
    }
    let prompt = prompt_ids(st, &req)?;
    let grammar = match &req.structured {
        Some((structured, param)) => {
            let grammar = openai::grammar_of(structured);
            st.grammars.check(&st.tokenizer, &grammar, param)?;
            Some(grammar)
        }
        None => None,
    };
    Ok(Prepared { req, prompt, grammar })
}

fn prompt_ids(st: &GatewayState, req: &GenerationRequest) -> Result<Vec<u32>, ApiError> {
    let encode = |text: &str, add_bos: bool| {
        st.tokenizer.encode(text, add_bos).map_err(|e| {
            tracing::warn!(error = %e, "a prompt could not be tokenized");
            ApiError::bad_request("The prompt cannot be tokenized.", Some("prompt"))
        })
    };
    match &req.prompt {
        Prompt::Text(text) => encode(text, true),
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Chat(messages) => {
            let template = st.template.as_ref().ok_or_else(|| {
                ApiError::bad_request("the model has no chat template; use /v1/completions", Some("messages"))
            })?;
            let tools = if req.tools.active() { req.tools.tools.as_slice() } else { &[] };
            let text = template.render(messages, true, tools)?;
            // Templates that write the BOS token themselves must not get a second one.
            let bos = st.tokenizer.bos_id().and_then(|id| st.tokenizer.id_to_token(id));
            let add_bos = !bos.is_some_and(|b| text.starts_with(&b));
            encode(&text, add_bos)
        }
    }
}

async fn generate(st: Arc<GatewayState>, body: Bytes, endpoint: Endpoint, caller: Caller) -> Response {
    let started = Instant::now();
    let prepared = {
        // The semaphore is never closed; a wait for it is a queue, not a failure.
        let Ok(_permit) = st.prompt_workers.acquire().await else {
            return error_response(ApiError::internal("the gateway is shutting down"));
        };
        let st = st.clone();
        tokio::task::spawn_blocking(move || prepare(&st, &body, endpoint)).await
    };
    let Prepared { req, prompt, grammar } = match prepared {
        Ok(Ok(prepared)) => prepared,
        Ok(Err(e)) => return error_response(e),
        Err(e) => {
            tracing::error!("preparing a prompt failed: {e}");
            return error_response(ApiError::internal("the request could not be prepared"));
        }
    };
    let max_context = st.config.max_context;
    if prompt.is_empty() {
        return error_response(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    if prompt.len() >= max_context {
        return error_response(ApiError::prompt_too_long(prompt.len(), max_context));
    }
    let max_tokens = req.max_tokens.unwrap_or(max_context - prompt.len());
    if prompt.len() + max_tokens > max_context {
        return error_response(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_context} tokens. However, you requested {} tokens \
                 ({} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                prompt.len() + max_tokens,
                prompt.len()
            ),
            Some("max_tokens"),
        ));
    }
    let vocab = st.tokenizer.vocab_size();
    if let Some(&(id, _)) = req.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return error_response(ApiError::bad_request(
            format!("`logit_bias` names token {id}, but the vocabulary has {vocab} tokens"),
            Some("logit_bias"),
        ));
    }
    let mut stop_token_ids = req.stop_token_ids.clone();
    if !req.ignore_eos {
        stop_token_ids.extend(st.tokenizer.eos_ids());
    }
    let stop_ids = stop_token_ids.clone();
    // A scoring request (`echo` and `max_tokens: 0`) still decodes one token, which no
    // one sees: the chips' requests always produce one.
    let mut ask = AdmitAsk {
        prompt: prompt.clone(),
        max_tokens: max_tokens.max(1),
        sampling: SamplingSpec {
            temperature: req.temperature,
            top_k: req.top_k.unwrap_or(0),
            top_p: req.top_p,
            seed: req.seed,
            stop_token_ids,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            repetition_penalty: req.repetition_penalty,
            logit_bias: req.logit_bias.clone(),
            min_tokens: req.min_tokens,
            prompt_logprobs: req.logprobs.filter(|_| req.echo),
            grammar,
        },
        // A response read whole needs its tokens only at the end, unless stop strings
        // must be matched as the text grows (to stop the generation early).
        delivery: if req.stream || !req.stop.is_empty() { Delivery::Stream } else { Delivery::Whole },
        forks: Vec::new(),
        tenant: caller.tenant,
    };
    // `n` choices (or `best_of` candidates), choice i sampled with `seed + i`. The
    // others fork from the first where it samples its first token: one prefill, the
    // prompt's KV shared, each choice with its own sampler from the same logits.
    let sequences = req.best_of.unwrap_or(req.n);
    if req.best_of.is_some() && ask.sampling.logprobs.is_none() {
        ask.sampling.logprobs = Some(0); // best_of ranks by each candidate's log-probability
    }
    let fork_mailboxes: Vec<Mailbox<Msg>> = (1..sequences).map(|_| st.host.mailbox()).collect();
    ask.forks = fork_mailboxes
        .iter()
        .enumerate()
        .map(|(i, m)| ForkAsk { client: m.addr(), seed: ask.sampling.seed.map(|s| s.wrapping_add(i as u64 + 1)) })
        .collect();
    let mut admitted = Vec::with_capacity(sequences);
    match admit(&st, ask).await {
        Ok(a) => admitted.push(a),
        Err(e) => return error_response(e),
    }
    let ttft = started.elapsed();
    metrics::histogram!("tessera_request_ttft_seconds", "tenant" => caller.tenant_name.clone())
        .record(ttft.as_secs_f64());
    for mailbox in fork_mailboxes {
        match await_admitted(&st, mailbox).await {
            Ok(a) => admitted.push(a),
            Err(e) => return error_response(e),
        }
    }
    if sequences > 1 {
        metrics::counter!("tessera_gateway_forked_sequences_total").increment(sequences as u64 - 1);
    }
    let request_id = admitted[0].request_id;
    let ctx = Completion {
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{request_id:x}"),
            Endpoint::Chat => format!("chatcmpl-{request_id:x}"),
        },
        created: unix_now(),
        model: st.config.served_model.clone(),
        endpoint,
        prompt_tokens: prompt.len(),
        stops: req.stop.clone(),
        stop_ids,
        started,
        logprobs: req.logprobs.is_some(),
        echo: req.echo.then(|| {
            let text = match &req.prompt {
                openai::Prompt::Text(text) => text.clone(),
                _ => st.tokenizer.decode(&prompt).unwrap_or_default(),
            };
            Echo { text, ids: prompt.clone() }
        }),
        output: max_tokens > 0,
        tools: req.tools.active(),
        tenant: caller.tenant_name,
        ttft,
    };
    if req.stream {
        stream_response(st, ctx, admitted, req.include_usage)
    } else {
        whole_response(st, ctx, admitted, req.n, req.best_of.is_some()).await
    }
}

/// A sequence admission took, with its first event (it is served: its prompt is
/// computed, or it failed).
struct Admitted {
    request_id: u64,
    mailbox: Mailbox<Msg>,
    guard: RequestGuard,
    first: ClientEvent,
}

/// Asks admission to serve `ask` and waits for it to be served (its forks' answers go to
/// their own mailboxes).
async fn admit(st: &Arc<GatewayState>, ask: AdmitAsk) -> Result<Admitted, ApiError> {
    let mailbox = st.host.mailbox();
    let admit = Msg::Admit { client: mailbox.addr(), ask: Box::new(ask) };
    st.host.send_from(&mailbox, st.config.admission, admit).map_err(|e| {
        tracing::error!("admission is unreachable: {e}");
        ApiError::internal("the request could not be admitted")
    })?;
    await_admitted(st, mailbox).await
}

/// Waits for admission's answer and the request's first event, so a request that
/// cannot be served gets its status.
async fn await_admitted(st: &Arc<GatewayState>, mut mailbox: Mailbox<Msg>) -> Result<Admitted, ApiError> {
    let (request_id, actor) = match mailbox.recv().await {
        Some(Msg::Admitted { request_id, request }) => (request_id, request),
        Some(Msg::Client { event: ClientEvent::Failed { error } }) => return Err(api_error(&error)),
        _ => return Err(ApiError::internal("the request could not be admitted")),
    };
    let mut guard = RequestGuard { st: st.clone(), actor, done: false };
    let first = match mailbox.recv().await {
        Some(Msg::Client { event: ClientEvent::Failed { error } }) => {
            guard.done = true;
            return Err(api_error(&error));
        }
        Some(Msg::Client { event }) => event,
        _ => {
            guard.done = true;
            return Err(ApiError::internal("the request ended without a result"));
        }
    };
    Ok(Admitted { request_id, mailbox, guard, first })
}

struct Completion {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
    prompt_tokens: usize,
    stops: Vec<String>,
    /// Tokens that end generation (EOS, `stop_token_ids`): counted, never shown as text.
    stop_ids: Vec<u32>,
    started: Instant,
    /// The client asked for log-probabilities.
    logprobs: bool,
    /// The prompt to return before the completion (`echo`).
    echo: Option<Echo>,
    /// Whether the generated tokens are shown (not with `max_tokens: 0`).
    output: bool,
    /// The answer is parsed for tool calls.
    tools: bool,
    /// The caller's tenant (the `tenant` label of its metrics) and its time to the first
    /// token.
    tenant: String,
    ttft: Duration,
}

impl Completion {
    /// Records the end of a request that produced `completion_tokens` (its sequences'
    /// sum over `sequences`).
    fn record_end(&self, completion_tokens: usize, sequences: usize) {
        let e2e = self.started.elapsed();
        metrics::histogram!("tessera_request_e2e_seconds", "tenant" => self.tenant.clone()).record(e2e.as_secs_f64());
        let per_sequence = completion_tokens / sequences.max(1);
        if per_sequence > 1 {
            let tpot = e2e.saturating_sub(self.ttft).as_secs_f64() / (per_sequence - 1) as f64;
            metrics::histogram!("tessera_request_tpot_seconds", "tenant" => self.tenant.clone()).record(tpot);
        }
    }
}

/// A prompt echoed back: its text as the client sent it, and its tokens.
struct Echo {
    text: String,
    ids: Vec<u32>,
}

impl Echo {
    /// The completions `logprobs` of the echoed prompt (`prompt`: its tokens after the
    /// first) and of `generated` after it.
    fn logprobs(&self, tok: &TextTokenizer, prompt: &[openai::TokenEntry], generated: &[openai::TokenEntry]) -> Value {
        let first = self.ids.first().map(|&id| tok.decode(&[id]).unwrap_or_default()).unwrap_or_default();
        openai::echo_completion_logprobs(&first, self.text.starts_with(&first), prompt, generated)
    }
}

impl Completion {
    /// Tool call ids are `call_<this>_<n>`: the request's id, unique per gateway.
    fn call_id_prefix(&self) -> &str {
        self.id.rsplit('-').next().unwrap_or(&self.id)
    }

    /// The `logprobs` object of `entries` in this endpoint's shape (`offset`: characters
    /// of the choice's text before them).
    fn logprobs_json(&self, entries: &[openai::TokenEntry], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Completions => openai::completion_logprobs(entries, offset),
            Endpoint::Chat => openai::chat_logprobs(entries),
        }
    }
}

/// Turns token events into text: detokenizes incrementally and applies stop strings.
struct TextAssembler<'a> {
    decoder: tessera_backends::tokenizer::StreamDecoder<'a>,
    stops: StopMatcher,
    stop_ids: Vec<u32>,
    completion_tokens: usize,
    stopped: bool,
}

impl<'a> TextAssembler<'a> {
    fn new(tok: &'a TextTokenizer, stops: Vec<String>, stop_ids: Vec<u32>) -> Self {
        TextAssembler {
            decoder: tok.stream_decoder(),
            stops: StopMatcher::new(stops),
            stop_ids,
            completion_tokens: 0,
            stopped: false,
        }
    }

    /// Text that is final after these tokens, and the log-probability entries of the
    /// tokens it took (all of them, unless a stop ended the text first).
    fn push_with(
        &mut self,
        tokens: &[u32],
        logprobs: &[TokenLogprob],
        tok: &TextTokenizer,
    ) -> Result<(String, Vec<openai::TokenEntry>), ApiError> {
        let before = self.completion_tokens;
        let text = self.push(tokens)?;
        let taken = self.completion_tokens - before;
        Ok((text, logprobs.iter().take(taken).map(|lp| token_entry(tok, lp)).collect()))
    }

    /// Text that is final after these tokens.
    fn push(&mut self, tokens: &[u32]) -> Result<String, ApiError> {
        let mut out = String::new();
        for &t in tokens {
            if self.stopped {
                break;
            }
            self.completion_tokens += 1;
            if self.stop_ids.contains(&t) {
                // The chip ends the sequence on it; its text (`<|im_end|>`) is no output.
                break;
            }
            let piece = self.decoder.push(t).map_err(detokenize_error)?;
            if let Some(piece) = piece {
                let (safe, hit) = self.stops.push(&piece);
                out.push_str(&safe);
                self.stopped = hit;
            }
        }
        Ok(out)
    }

    fn finish(&mut self) -> Result<String, ApiError> {
        if self.stopped {
            return Ok(String::new());
        }
        let mut out = String::new();
        if let Some(piece) = self.decoder.finish().map_err(detokenize_error)? {
            let (safe, hit) = self.stops.push(&piece);
            out.push_str(&safe);
            self.stopped = hit;
        }
        if !self.stopped {
            out.push_str(&self.stops.finish());
        }
        Ok(out)
    }
}

/// A token's log-probabilities with the texts of it and its alternatives.
fn token_entry(tok: &TextTokenizer, lp: &TokenLogprob) -> openai::TokenEntry {
    let text = |id: u32| tok.decode(&[id]).unwrap_or_default();
    openai::TokenEntry {
        text: text(lp.token),
        logprob: lp.logprob,
        top: lp.top.iter().map(|&(id, l)| (text(id), l)).collect(),
    }
}

fn detokenize_error(e: impl std::fmt::Display) -> ApiError {
    tracing::error!(error = %e, "detokenizing generated tokens failed");
    ApiError::internal("The server could not complete the request.")
}

fn finish_reason(f: Finish) -> FinishReason {
    match f {
        Finish::Stop => FinishReason::Stop,
        Finish::Length => FinishReason::Length,
    }
}

/// The body of a response read whole: its `n` choices, or with `best_of` the `n` of the
/// candidates with the highest log-probability (summed over their tokens).
async fn whole_response(
    st: Arc<GatewayState>,
    ctx: Completion,
    admitted: Vec<Admitted>,
    n: usize,
    best_of: bool,
) -> Response {
    let ctx = Arc::new(ctx);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, a) in admitted.into_iter().enumerate() {
        let (st, ctx) = (st.clone(), ctx.clone());
        tasks.spawn(async move { (i, whole_choice(st, ctx, a).await) });
    }
    let mut choices = Vec::new();
    // Dropping the set (an error) aborts the other choices, whose guards cancel them.
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((i, Ok(choice))) => choices.push((i, choice)),
            Ok((_, Err(e))) => return error_response(e),
            Err(e) => {
                tracing::error!("a choice's task failed: {e}");
                return error_response(ApiError::internal("The server could not complete the request."));
            }
        }
    }
    choices.sort_by_key(|(i, _)| *i);
    let completion_tokens: usize = choices.iter().map(|(_, c)| c.completion_tokens).sum();
    let sequences = choices.len();
    if best_of {
        choices.sort_by(|(i, a), (j, b)| b.logprob.total_cmp(&a.logprob).then(i.cmp(j)));
    }
    choices.truncate(n);
    ctx.record_end(completion_tokens, sequences);
    let Some(mut body) = choices.first().map(|(_, c)| c.body.clone()) else {
        return error_response(ApiError::internal("the request ended without a result"));
    };
    let indexed: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, (_, c))| {
            let mut choice = c.body["choices"][0].clone();
            choice["index"] = i.into();
            choice
        })
        .collect();
    body["choices"] = indexed.into();
    body["usage"]["completion_tokens"] = completion_tokens.into();
    body["usage"]["total_tokens"] = (ctx.prompt_tokens + completion_tokens).into();
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// One choice of a response read whole, in a body of its own.
struct WholeChoice {
    body: Value,
    completion_tokens: usize,
    /// The sum of its tokens' log-probabilities (when they were asked for).
    logprob: f64,
}

async fn whole_choice(st: Arc<GatewayState>, ctx: Arc<Completion>, a: Admitted) -> Result<WholeChoice, ApiError> {
    let Admitted { mut mailbox, mut guard, first, .. } = a;
    let tokenizer = st.tokenizer.clone();
    let mut text = TextAssembler::new(&tokenizer, ctx.stops.clone(), ctx.stop_ids.clone());
    let mut out = String::new();
    let mut entries = Vec::new();
    let mut prompt_entries = Vec::new();
    let mut event = Some(first);
    let finish = loop {
        let ev = match event.take() {
            Some(e) => e,
            None => match mailbox.recv().await {
                Some(Msg::Client { event }) => event,
                _ => return Err(ApiError::internal("the request ended without a result")),
            },
        };
        match ev {
            ClientEvent::Tokens { tokens, logprobs } => match text.push_with(&tokens, &logprobs, &tokenizer) {
                Ok((s, taken)) => {
                    out.push_str(&s);
                    entries.extend(taken);
                }
                Err(e) => return Err(e),
            },
            ClientEvent::PromptLogprobs { logprobs, .. } => {
                prompt_entries.extend(logprobs.iter().map(|lp| token_entry(&tokenizer, lp)));
            }
            ClientEvent::Finished { finish, .. } => {
                guard.done = true;
                break finish_reason(finish);
            }
            ClientEvent::Failed { error } => {
                guard.done = true;
                return Err(api_error(&error));
            }
        }
        if text.stopped {
            // The guard cancels the request: the rest is not needed.
            break FinishReason::Stop;
        }
    };
    out.push_str(&text.finish()?);
    let mut completion_tokens = text.completion_tokens;
    if !ctx.output {
        // max_tokens 0: the one token decoded is not part of the answer.
        (out, completion_tokens) = (String::new(), 0);
        entries.clear();
    }
    let usage = Usage { prompt_tokens: ctx.prompt_tokens, completion_tokens };
    let logprob = entries.iter().map(|e| f64::from(e.logprob)).sum();
    let shown = match &ctx.echo {
        Some(echo) => format!("{}{out}", echo.text),
        None => out,
    };
    let mut body = match ctx.endpoint {
        Endpoint::Completions => openai::completion_response(&ctx.id, ctx.created, &ctx.model, &shown, finish, usage),
        Endpoint::Chat => openai::chat_response(&ctx.id, ctx.created, &ctx.model, &shown, finish, usage),
    };
    if ctx.tools {
        let (content, calls) = openai::parse_answer(&shown, ctx.call_id_prefix());
        if !calls.is_empty() {
            body = openai::with_tool_calls(body, content.as_deref(), &calls);
        }
    }
    if ctx.logprobs {
        let logprobs = match &ctx.echo {
            Some(echo) => echo.logprobs(&tokenizer, &prompt_entries, &entries),
            None => ctx.logprobs_json(&entries, 0),
        };
        body = openai::with_logprobs(body, logprobs);
    }
    Ok(WholeChoice { body, completion_tokens, logprob })
}

fn chunk(ctx: &Completion, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
    match ctx.endpoint {
        Endpoint::Completions => openai::completion_chunk(&ctx.id, ctx.created, &ctx.model, text.unwrap_or(""), finish),
        Endpoint::Chat => openai::chat_chunk(&ctx.id, ctx.created, &ctx.model, text, first, finish),
    }
}

type EventSender = tokio::sync::mpsc::Sender<Result<Event, Infallible>>;

/// A streamed response: each choice's chunks as they come (each with its `index`),
/// then the usage chunk if asked for, then `[DONE]`.
fn stream_response(st: Arc<GatewayState>, ctx: Completion, admitted: Vec<Admitted>, include_usage: bool) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    tokio::spawn(async move {
        let ctx = Arc::new(ctx);
        let sequences = admitted.len();
        let mut tasks = tokio::task::JoinSet::new();
        for (i, a) in admitted.into_iter().enumerate() {
            tasks.spawn(stream_choice(st.clone(), ctx.clone(), a, i, tx.clone()));
        }
        let mut completion_tokens = Some(0);
        while let Some(joined) = tasks.join_next().await {
            let tokens = joined.ok().flatten();
            completion_tokens = completion_tokens.zip(tokens).map(|(a, b)| a + b);
        }
        // Every choice ended (none failed or lost its client).
        if let Some(completion_tokens) = completion_tokens {
            if include_usage {
                let usage = Usage { prompt_tokens: ctx.prompt_tokens, completion_tokens };
                let object = match ctx.endpoint {
                    Endpoint::Completions => "text_completion",
                    Endpoint::Chat => "chat.completion.chunk",
                };
                let chunk = openai::usage_chunk(&ctx.id, ctx.created, &ctx.model, object, usage);
                let _ = tx.send(Ok(Event::default().data(chunk.to_string()))).await;
            }
            ctx.record_end(completion_tokens, sequences);
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response()
}

/// Streams choice `index`; returns its completion tokens once it ended, or `None` if it
/// failed or the client went away.
async fn stream_choice(
    st: Arc<GatewayState>,
    ctx: Arc<Completion>,
    a: Admitted,
    index: usize,
    tx: EventSender,
) -> Option<usize> {
    let Admitted { mut mailbox, mut guard, first, .. } = a;
    let chunk = |text: Option<&str>, first: bool, finish: Option<FinishReason>| {
        let mut c = chunk(&ctx, text, first, finish);
        c["choices"][0]["index"] = index.into();
        c
    };
    let tokenizer = st.tokenizer.clone();
    let mut text = TextAssembler::new(&tokenizer, ctx.stops.clone(), ctx.stop_ids.clone());
    let data = |v: Value| Ok(Event::default().data(v.to_string()));
    if ctx.endpoint == Endpoint::Chat {
        tx.send(data(chunk(Some(""), true, None))).await.ok()?;
    }
    let mut event = Some(first);
    // Characters of token text streamed so far (completions' `text_offset`).
    let mut offset = 0;
    // An echoed prompt goes first, once its tokens' log-probabilities are in: they all
    // come before the first generated token.
    let mut echo = ctx.echo.as_ref();
    let mut prompt_entries = Vec::new();
    let mut calls = ctx.tools.then(|| openai::ToolCallParser::new(ctx.call_id_prefix()));
    let finish = loop {
        let ev = match event.take() {
            Some(e) => e,
            None => tokio::select! {
                m = mailbox.recv() => match m {
                    Some(Msg::Client { event }) => event,
                    _ => ClientEvent::Failed { error: ServeError::new(ErrorKind::Internal, "the request ended without a result") },
                },
                // The client went away: the guard cancels the request.
                _ = tx.closed() => return None,
            },
        };
        if matches!(ev, ClientEvent::Tokens { .. } | ClientEvent::Finished { .. })
            && let Some(e) = echo.take()
        {
            let mut c = chunk(Some(&e.text), false, None);
            if ctx.logprobs {
                c = openai::with_logprobs(c, e.logprobs(&tokenizer, &prompt_entries, &[]));
            }
            offset = e.text.chars().count();
            tx.send(data(c)).await.ok()?;
        }
        match ev {
            // `max_tokens: 0` (scoring): the one token decoded is not part of the answer.
            ClientEvent::Tokens { .. } if !ctx.output => {}
            ClientEvent::Tokens { tokens, logprobs } => match text.push_with(&tokens, &logprobs, &tokenizer) {
                Ok((s, taken)) if !s.is_empty() || (ctx.logprobs && !taken.is_empty()) => {
                    let s = match calls.as_mut() {
                        Some(parser) => send_calls(&tx, &ctx, index, parser.push(&s), parser.calls()).await?,
                        None => s,
                    };
                    if s.is_empty() && (!ctx.logprobs || taken.is_empty()) {
                        continue;
                    }
                    let mut c = chunk(Some(&s), false, None);
                    if ctx.logprobs {
                        c = openai::with_logprobs(c, ctx.logprobs_json(&taken, offset));
                        offset += taken.iter().map(|e| e.text.chars().count()).sum::<usize>();
                    }
                    tx.send(data(c)).await.ok()?;
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = tx.send(data(e.to_json())).await;
                    break None;
                }
            },
            ClientEvent::PromptLogprobs { logprobs, .. } => {
                prompt_entries.extend(logprobs.iter().map(|lp| token_entry(&tokenizer, lp)));
            }
            ClientEvent::Finished { finish, .. } => {
                guard.done = true;
                break Some(finish_reason(finish));
            }
            ClientEvent::Failed { error } => {
                guard.done = true;
                let _ = tx.send(data(api_error(&error).to_json())).await;
                break None;
            }
        }
        if text.stopped {
            break Some(FinishReason::Stop);
        }
    };
    let mut finish = finish?;
    let mut rest = text.finish().unwrap_or_default();
    if let Some(parser) = calls.as_mut() {
        let mut parsed = parser.push(&rest);
        let end = parser.finish();
        parsed.content.push_str(&end.content);
        parsed.calls.extend(end.calls);
        rest = send_calls(&tx, &ctx, index, parsed, parser.calls()).await?;
        if parser.calls() > 0 && finish == FinishReason::Stop {
            finish = FinishReason::ToolCalls;
        }
    }
    if !rest.is_empty() {
        tx.send(data(chunk(Some(&rest), false, None))).await.ok()?;
    }
    tx.send(data(chunk(None, false, Some(finish)))).await.ok()?;
    drop(guard);
    Some(if ctx.output { text.completion_tokens } else { 0 })
}

/// Sends the calls `parsed` completed (the last of `total` so far) as one tool-call
/// chunk; returns its content, or `None` when the client is gone.
async fn send_calls(
    tx: &EventSender,
    ctx: &Completion,
    index: usize,
    parsed: openai::Parsed,
    total: usize,
) -> Option<String> {
    if !parsed.calls.is_empty() {
        let first = total - parsed.calls.len();
        let mut c = openai::tool_calls_chunk(&ctx.id, ctx.created, &ctx.model, first, &parsed.calls);
        c["choices"][0]["index"] = index.into();
        tx.send(Ok(Event::default().data(c.to_string()))).await.ok()?;
    }
    Some(parsed.content)
}

async fn models(State(st): State<Arc<GatewayState>>) -> Response {
    axum::Json(openai::models_response(std::slice::from_ref(&st.config.served_model), unix_now())).into_response()
}

/// Asks the router for its view of the cluster.
async fn cluster_view(st: &GatewayState) -> Option<(Vec<tessera_actors::msg::ChipReport>, Vec<String>)> {
    let mut mailbox = st.host.mailbox();
    st.host.send_from(&mailbox, st.config.router, Msg::QueryCluster { reply_to: mailbox.addr() }).ok()?;
    match tokio::time::timeout(Duration::from_secs(2), mailbox.recv()).await {
        Ok(Some(Msg::ClusterView { chips, hosts_down })) => Some((chips, hosts_down)),
        _ => None,
    }
}

/// Asks admission how many requests are in flight.
async fn inflight(st: &GatewayState) -> Option<usize> {
    let mut mailbox = st.host.mailbox();
    st.host.send_from(&mailbox, st.config.admission, Msg::QueryAdmission { reply_to: mailbox.addr() }).ok()?;
    match tokio::time::timeout(Duration::from_secs(2), mailbox.recv()).await {
        Ok(Some(Msg::AdmissionView { inflight, .. })) => Some(inflight),
        _ => None,
    }
}

/// Liveness: the process answers HTTP. Unlike `/health` it does not depend on the chips,
/// so an orchestrator does not restart a gateway whose chips are down elsewhere.
async fn live() -> Response {
    axum::Json(json!({"status": "alive"})).into_response()
}

async fn health(State(st): State<Arc<GatewayState>>) -> Response {
    let (Some((chips, hosts_down)), Some(inflight)) = (cluster_view(&st).await, inflight(&st).await) else {
        return error_response(ApiError::unavailable("the router did not answer"));
    };
    let up = chips.iter().filter(|c| c.state == ChipState::Up).count();
    let status = if up > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    // The strategy in force, when the solver applied one (null: the topology as written).
    let plan = match st.config.solver {
        Some(_) => ask_solver(&st, |reply_to| Msg::QueryPlan { reply_to }).await.and_then(|m| match m {
            Msg::Plan { view } => view.applied.map(|p| json!({"id": p.id, "summary": p.summary, "by": p.by})),
            _ => None,
        }),
        None => None,
    };
    let body = json!({
        "status": if up > 0 { "ok" } else { "unavailable" },
        "model": st.config.served_model,
        "plan": plan,
        "chips_up": up,
        "hosts_down": hosts_down,
        "inflight_requests": inflight,
        "chips": chips.iter().map(|c| {
            // A dead host's chips have no figures: null, never its last report's.
            let live = !hosts_down.iter().any(|h| **h == *c.host_name);
            let figure = |v: usize| if live { json!(v) } else { Value::Null };
            json!({
            "id": c.id,
            "host": c.host_name,
            "role": c.role,
            "state": if live { format!("{:?}", c.state).to_lowercase() } else { "down".to_string() },
            "kv_blocks_used": figure(c.kv_blocks_used),
            "kv_blocks_total": figure(c.kv_blocks_total),
            "running": figure(c.running),
            "waiting": figure(c.waiting),
            "steps": c.steps,
            "max_step_seqs": c.max_step_seqs,
            "restarts": c.restarts,
            "error": c.error,
            "draining": c.draining,
            "parked": c.parked,
            "kv_handoffs": c.handoffs,
            // "ascend-910b x2000": an emulation of that kind, steps paced to its
            // roofline with that time scale — never real hardware.
            "emulated": c.emulated,
            "last_handoff_gap_s": if live { c.last_handoff_gap_s } else { None },
        })}).collect::<Vec<_>>(),
    });
    (status, axum::Json(body)).into_response()
}

async fn prometheus(State(st): State<Arc<GatewayState>>) -> Response {
    match &st.config.metrics {
        Some(handle) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response(),
        None => error_response(ApiError::unavailable("metrics are not enabled in this process")),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultRequest {
    chip: String,
    fault: String,
}

/// A fault drill: `{"chip": "h1-cpu0", "fault": "worker_panic"}`.
async fn inject_fault(State(st): State<Arc<GatewayState>>, body: Bytes) -> Response {
    let req: FaultRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(ApiError::bad_request(format!("malformed fault request: {e}"), None)),
    };
    let fault = match req.fault.as_str() {
        "worker_panic" => Fault::WorkerPanic,
        "drop_kv_claim" => Fault::DropKvClaim,
        "chip_offline" => Fault::Offline,
        "chip_online" => Fault::Online,
        other => {
            return error_response(ApiError::bad_request(
                format!("unknown fault `{other}`; known: worker_panic, drop_kv_claim, chip_offline, chip_online"),
                Some("fault"),
            ));
        }
    };
    let chip = match known_chip(&st, &req.chip) {
        Ok(chip) => chip,
        Err(e) => return error_response(*e),
    };
    match st.host.send(chip, Msg::InjectFault { fault }) {
        Ok(()) => (StatusCode::ACCEPTED, axum::Json(json!({"injected": req.fault, "chip": req.chip}))).into_response(),
        Err(e) => {
            tracing::warn!(chip = %req.chip, error = %e, "an admin request could not reach its chip");
            error_response(ApiError::unavailable(format!("chip `{}` is unreachable", req.chip)))
        }
    }
}

fn known_chip(st: &GatewayState, id: &str) -> Result<Addr, Box<ApiError>> {
    st.config.chips.get(id).copied().ok_or_else(|| {
        let mut known: Vec<&String> = st.config.chips.keys().collect();
        known.sort();
        Box::new(ApiError::bad_request(format!("unknown chip `{id}`; chips: {known:?}"), Some("chip")))
    })
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleRequest {
    chip: String,
    /// Parsed apart, so that an unknown role is refused naming the `role` parameter.
    role: String,
}

/// A live role change: `{"chip": "h1-metax0", "role": "both"}`. The chip drains its
/// current work first (it takes no new work meanwhile), so no request is lost.
async fn set_role(State(st): State<Arc<GatewayState>>, body: Bytes) -> Response {
    let req: RoleRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(ApiError::bad_request(format!("malformed role request: {e}"), None)),
    };
    let role = match req.role.parse::<Role>() {
        Ok(role) => role,
        Err(e) => return error_response(ApiError::bad_request(e.to_string(), Some("role"))),
    };
    let chip = match known_chip(&st, &req.chip) {
        Ok(chip) => chip,
        Err(e) => return error_response(*e),
    };
    match st.host.send(chip, Msg::SetRole { role }) {
        Ok(()) => (StatusCode::ACCEPTED, axum::Json(json!({"chip": req.chip, "role": role, "draining": true})))
            .into_response(),
        Err(e) => {
            tracing::warn!(chip = %req.chip, error = %e, "an admin request could not reach its chip");
            error_response(ApiError::unavailable(format!("chip `{}` is unreachable", req.chip)))
        }
    }
}

/// Sends the solver a question built around a reply address and waits (2 s) for the
/// answer.
async fn ask_solver(st: &GatewayState, ask: impl FnOnce(Addr) -> Msg) -> Option<Msg> {
    let solver = st.config.solver?;
    let mut mailbox = st.host.mailbox();
    st.host.send_from(&mailbox, solver, ask(mailbox.addr())).ok()?;
    tokio::time::timeout(Duration::from_secs(2), mailbox.recv()).await.ok().flatten()
}

fn solver_off() -> Response {
    error_response(ApiError::unavailable(
        "the cluster runs no solver ([solver] enabled = false, or its fleet could not be costed: see the gateway's log)",
    ))
}

/// The solver's state: what each chip does, the strategy in force and the latest
/// strategy set.
async fn plan_show(State(st): State<Arc<GatewayState>>) -> Response {
    if st.config.solver.is_none() {
        return solver_off();
    }
    match ask_solver(&st, |reply_to| Msg::QueryPlan { reply_to }).await {
        Some(Msg::Plan { view }) => axum::Json(*view).into_response(),
        _ => error_response(ApiError::unavailable("the solver did not answer")),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ApplyRequest {
    #[serde(default)]
    id: Option<String>,
    /// Chip id -> "prefill", "decode", "both" or "idle".
    #[serde(default)]
    roles: Option<std::collections::BTreeMap<String, tessera_actors::msg::Duty>>,
}

/// Applies a strategy of the latest set, `{"id": "s3-2"}`, or the operator's own
/// assignment, `{"roles": {"h1-metax0": "prefill"}}` (the other chips keep theirs).
/// Each chip that changes duty drains first, so no request is lost; the reply names
/// the chips that move.
async fn plan_apply(State(st): State<Arc<GatewayState>>, body: Bytes) -> Response {
    let req: ApplyRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(ApiError::bad_request(format!("malformed plan request: {e}"), None)),
    };
    if st.config.solver.is_none() {
        return solver_off();
    }
    let with_reply: Box<dyn FnOnce(Addr) -> Msg + Send> = match (req.id, req.roles) {
        (Some(id), None) => Box::new(move |reply_to| Msg::ApplyStrategy { id, reply_to }),
        (None, Some(roles)) => {
            Box::new(move |reply_to| Msg::ApplyRoles { roles: roles.into_iter().collect(), reply_to })
        }
        _ => {
            let why = "give either `id` (a strategy of the latest set) or `roles` ({chip: duty}), not both";
            return error_response(ApiError::bad_request(why, None));
        }
    };
    match ask_solver(&st, with_reply).await {
        Some(Msg::PlanApplied { result: Ok(plan) }) => (StatusCode::ACCEPTED, axum::Json(*plan)).into_response(),
        Some(Msg::PlanApplied { result: Err(why) }) => error_response(ApiError::bad_request(why, Some("id"))),
        _ => error_response(ApiError::unavailable("the solver did not answer")),
    }
}

/// Asks the solver to solve again now (it also does on its own, on a change of traffic
/// or chips and on its period).
async fn plan_solve(State(st): State<Arc<GatewayState>>) -> Response {
    let Some(solver) = st.config.solver else { return solver_off() };
    match st.host.send(solver, Msg::Solve { reason: "asked".into() }) {
        Ok(()) => (StatusCode::ACCEPTED, axum::Json(json!({"solving": true}))).into_response(),
        Err(e) => error_response(ApiError::unavailable(format!("the solver is unreachable: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_tells_the_client_its_kind_and_never_the_diagnostic() {
        let detail = "chip h1-metax0 of host h1 lost it: worker panicked at kv.rs:42";
        // (kind, status, type, code)
        let cases = [
            (ErrorKind::BadRequest, 400, "invalid_request_error", None),
            (ErrorKind::PromptTooLong, 413, "invalid_request_error", Some("context_length_exceeded")),
            (ErrorKind::Overloaded, 429, "rate_limit_error", Some("overloaded")),
            (ErrorKind::Unavailable, 503, "service_unavailable", Some("no_healthy_chip")),
            (ErrorKind::Internal, 500, "server_error", None),
        ];
        for (kind, status, type_, code) in cases {
            let e = api_error(&ServeError::new(kind, detail));
            assert_eq!((e.status, e.kind, e.code.as_deref()), (status, type_, code), "{kind:?}");
            assert!(!e.message.is_empty(), "{kind:?}");
            for secret in ["h1", "metax", "panicked", "kv.rs"] {
                assert!(!e.message.contains(secret), "{kind:?}: {:?} leaks {secret:?}", e.message);
            }
            // What is about the client's own request reaches it.
            let e = api_error(&ServeError::new(kind, detail).with_public("token id 99 is outside the vocabulary"));
            assert_eq!(e.message, "token id 99 is outside the vocabulary", "{kind:?}");
        }
    }

    /// 429 and 503 say when to retry: what the cluster said, else in a second.
    #[test]
    fn refusals_for_load_carry_retry_after() {
        let cases = [
            (ServeError::new(ErrorKind::Overloaded, "queue deadline").retry_after(5), Some("5")),
            (ServeError::new(ErrorKind::Overloaded, "admission full"), Some("1")),
            (ServeError::new(ErrorKind::Unavailable, "no chip"), Some("1")),
            (ServeError::new(ErrorKind::BadRequest, "bad"), None),
        ];
        for (error, want) in cases {
            let response = error_response(api_error(&error));
            let got = response.headers().get(axum::http::header::RETRY_AFTER).and_then(|v| v.to_str().ok());
            assert_eq!(got, want, "{error:?}");
        }
    }
}
