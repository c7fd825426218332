//! One actor per request: asks the router for a chip (or a prefill chip and a decode
//! chip), hands the chip its sequence,
//! forwards each generated token to the client and, when its chip is lost, re-routes
//! and replays the prompt plus every token already streamed, so the client sees one
//! continuous stream with no duplicate and no gap. It always ends with the full output
//! or a clear error, and always releases what it held.
//!
//! What a setback costs: a chip that loses the request (crash, lost hand-off, stall)
//! spends one of `max_attempts`; a chip that only declines because it takes no work
//! right now (restarting, draining) spends none — the request avoids it and re-routes
//! at once, then, if the router has nothing better, waits with a doubling backoff, for
//! at most `unavailable_timeout` in all.

use crate::msg::{
    ClientEvent, Delivery, ErrorKind, Finish, Fork, Msg, Retry, SamplingSpec, SeqRequest, ServeError, TenantShare,
    TokenLogprob,
};
use std::time::Duration;
use tessera_actor_core::Addr;
use tessera_actor_core::{Behavior, Effects, Moment};

/// What a request asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub request_id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingSpec,
    pub delivery: Delivery,
    /// Its siblings (`n` > 1), forked from it where its first token is sampled.
    pub forks: Vec<Fork>,
    /// The salt of its KV blocks' hashes (its tenant's, unless the tenant shares its
    /// prefix cache).
    pub cache_salt: Option<u64>,
    /// Its tenant's class and weight (see [`TenantShare`]).
    pub share: TenantShare,
}

/// How persistent a request is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Chips a request may try before it fails.
    pub max_attempts: u32,
    /// A chip that produced nothing for this long is given up on.
    pub stall_timeout: Duration,
    /// How long, in all, a request waits for some chip to take it while the chips it
    /// was routed to decline as unavailable (restarting, draining).
    pub unavailable_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            stall_timeout: Duration::from_secs(60),
            unavailable_timeout: Duration::from_secs(30),
        }
    }
}

/// The wait before re-route number `n` (1-based) after declines: none for the first
/// (the router may know a better chip), then 10 ms doubling up to 1 s.
pub fn reroute_backoff(n: u32) -> Duration {
    match n {
        0 | 1 => Duration::ZERO,
        n => Duration::from_millis(10 << (n - 2).min(7)).min(Duration::from_secs(1)),
    }
}

/// Chips a request remembers avoiding (the router prefers any other placement).
const MAX_AVOIDED: usize = 64;

pub struct Request {
    spec: RequestSpec,
    client: Addr,
    router: Addr,
    policy: RetryPolicy,
    generated: Vec<u32>,
    /// Their log-probabilities, when asked for (one per generated token).
    logprobs: Vec<TokenLogprob>,
    /// Prompt positions whose log-probabilities went to the client (a scoring request).
    scored: usize,
    /// The client's `Finished`, held until the prompt is scored, and since when.
    finished: Option<(ClientEvent, Moment)>,
    /// The chip that samples this request's tokens.
    chip: Option<Addr>,
    /// The chip prefilling it for `chip`, until `chip` sends a token (the prefill chip
    /// sends the first one, and holds the KV until `chip` has it).
    prefill: Option<Addr>,
    /// Whether `chip` sent a token since it was placed (the router was told).
    prefilled: bool,
    attempts: u32,
    /// Chips that lost or declined this request, oldest first.
    avoid: Vec<Addr>,
    /// Declines (and route failures) since the request last made progress.
    declines: u32,
    /// When those declines began.
    unavailable_since: Option<Moment>,
    last_progress: Moment,
    done: bool,
    /// Told when this request ends (its admission slot frees).
    admission: Option<Addr>,
    /// It waits to be forked from a sibling's sequence, since when; it routes on its
    /// own if told the fork will not happen, or after `stall_timeout`.
    awaiting_fork: Option<Moment>,
    /// It was admitted as a fork (whether or not the fork happened).
    fork: bool,
}

impl Request {
    pub fn new(spec: RequestSpec, client: Addr, router: Addr, policy: RetryPolicy) -> Request {
        Request {
            spec,
            client,
            router,
            policy,
            generated: Vec::new(),
            logprobs: Vec::new(),
            scored: 0,
            finished: None,
            prefilled: false,
            chip: None,
            prefill: None,
            attempts: 0,
            avoid: Vec::new(),
            declines: 0,
            unavailable_since: None,
            last_progress: Moment::default(),
            done: false,
            admission: None,
            awaiting_fork: None,
            fork: false,
        }
    }

    /// A request forked from a sibling's sequence: it waits for the chip that samples
    /// the sibling's first token to sample its own, rather than routing.
    pub fn forked(spec: RequestSpec, client: Addr, router: Addr, policy: RetryPolicy) -> Request {
        let mut r = Request::new(spec, client, router, policy);
        r.awaiting_fork = Some(Moment::default());
        r.fork = true;
        r
    }

    /// The fork happened: `chip` runs this request's sequence, sharing its sibling's
    /// prompt KV. The router is told, so it counts the load and can fail it over.
    fn adopt(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        self.awaiting_fork = None;
        self.attempts = 1;
        self.chip = Some(chip);
        self.prefilled = true;
        let tokens = self.spec.prompt.len() + self.spec.max_tokens;
        let msg = Msg::Forked { request_id: self.spec.request_id, req: fx.me(), chip, tokens };
        let _ = fx.send(self.router, msg);
        metrics::counter!("tessera_request_forked_total").increment(1);
    }

    /// The fork will not happen: find a chip of its own.
    fn unforked(&mut self, fx: &mut dyn Effects<Msg>) {
        self.awaiting_fork = None;
        self.route(fx);
    }

    /// Tells `admission` when this request ends.
    pub fn reporting_to(mut self, admission: Addr) -> Request {
        self.admission = Some(admission);
        self
    }

    /// A new placement, spending one attempt.
    fn route(&mut self, fx: &mut dyn Effects<Msg>) {
        self.attempts += 1;
        if self.attempts > self.policy.max_attempts {
            let why = format!("no chip could serve the request after {} attempts", self.policy.max_attempts);
            self.fail(ServeError::new(ErrorKind::Unavailable, why), fx);
            return;
        }
        self.ask_router(fx);
    }

    fn ask_router(&mut self, fx: &mut dyn Effects<Msg>) {
        let msg = Msg::Route {
            request_id: self.spec.request_id,
            req: fx.me(),
            tokens: self.spec.prompt.len() + self.spec.max_tokens,
            prompt_tokens: self.spec.prompt.len() + self.generated.len(),
            exclude: self.avoid.clone(),
            prompt: self.spec.prompt.iter().chain(&self.generated).copied().collect(),
            cache_salt: self.spec.cache_salt,
            share: self.spec.share,
        };
        if let Err(e) = fx.send(self.router, msg) {
            self.fail(ServeError::new(ErrorKind::Unavailable, format!("the router is unreachable: {e}")), fx);
        }
    }

    fn enqueue(&mut self, chip: Addr, prefill: Option<Addr>, fx: &mut dyn Effects<Msg>) {
        self.chip = Some(chip);
        self.prefill = prefill;
        self.prefilled = false;
        self.last_progress = fx.now();
        let mut tokens = self.spec.prompt.clone();
        tokens.extend_from_slice(&self.generated);
        let seq = SeqRequest {
            request_id: self.spec.request_id,
            req: fx.me(),
            tokens,
            generated: self.generated.len(),
            max_new_tokens: self.spec.max_tokens - self.generated.len(),
            sampling: self.spec.sampling.clone(),
            delivery: self.spec.delivery,
            // Once it has sampled, its siblings forked (or went their own way).
            forks: if self.generated.is_empty() { self.spec.forks.clone() } else { Vec::new() },
            cache_salt: self.spec.cache_salt,
            share: self.spec.share,
        };
        let (to, msg) = match prefill {
            Some(p) => (p, Msg::Prefill { seq: Box::new(seq), decode: chip }),
            None => (chip, Msg::Enqueue { seq: Box::new(seq) }),
        };
        if fx.send(to, msg).is_err() {
            self.chip_failed(to, fx);
        }
    }

    fn holds(&self, chip: Addr) -> bool {
        self.chip == Some(chip) || self.prefill == Some(chip)
    }

    fn avoid(&mut self, chip: Addr) {
        self.avoid.retain(|&c| c != chip);
        if self.avoid.len() == MAX_AVOIDED {
            self.avoid.remove(0);
        }
        self.avoid.push(chip);
    }

    /// Lets go of both chips (the other one frees what it holds for this request) and
    /// remembers to avoid `chip`.
    fn leave(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        for other in [self.chip, self.prefill].into_iter().flatten().filter(|&c| c != chip) {
            let _ = fx.send(other, Msg::Abort { request_id: self.spec.request_id });
        }
        self.release(fx);
        self.avoid(chip);
        metrics::counter!("tessera_request_reroutes_total").increment(1);
    }

    /// A chip this request holds is gone or lost it: try elsewhere, spending an attempt.
    fn chip_failed(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        if !self.holds(chip) {
            return;
        }
        self.leave(chip, fx);
        self.route(fx);
    }

    /// A chip this request holds takes no work right now: try elsewhere at once, then
    /// with backoff, for at most `unavailable_timeout`; no attempt is spent.
    fn chip_unavailable(&mut self, chip: Addr, error: ServeError, fx: &mut dyn Effects<Msg>) {
        if !self.holds(chip) {
            return;
        }
        self.leave(chip, fx);
        self.wait_for_a_chip(error, fx);
    }

    fn wait_for_a_chip(&mut self, error: ServeError, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        let since = *self.unavailable_since.get_or_insert(now);
        if now.since(since) >= self.policy.unavailable_timeout {
            let why = format!(
                "no chip took the request within {} s ({})",
                self.policy.unavailable_timeout.as_secs(),
                error.message
            );
            self.fail(ServeError::new(ErrorKind::Unavailable, why), fx);
            return;
        }
        self.declines += 1;
        metrics::counter!("tessera_request_declines_total").increment(1);
        match reroute_backoff(self.declines) {
            d if d.is_zero() => self.ask_router(fx),
            d => {
                fx.timer(d, Msg::Reroute);
            }
        }
    }

    /// The router found no placement. A request that has not started fails at once
    /// (the client gets 503/429); one already under way waits for a chip to come back.
    fn route_failed(&mut self, error: ServeError, fx: &mut dyn Effects<Msg>) {
        // A request under way (it lost its chip) waits for one, the router's queue
        // deadline included, up to `unavailable_timeout`; a fresh one is refused at once.
        let under_way = self.attempts > 1 || self.declines > 0 || !self.generated.is_empty();
        if under_way && matches!(error.kind, ErrorKind::Unavailable | ErrorKind::Overloaded) {
            self.wait_for_a_chip(error, fx);
        } else {
            self.fail(error, fx);
        }
    }

    fn generated(
        &mut self,
        from: Addr,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
        finish: Option<Finish>,
        fx: &mut dyn Effects<Msg>,
    ) {
        self.last_progress = fx.now();
        self.declines = 0;
        self.unavailable_since = None;
        // A token from the decode chip: it has the KV, so the prefill chip's part is
        // over, and only decoding is left there. (The prefill chip's own first token
        // leaves it held: if it fails before the decode chip has the KV, the request
        // must hear of it.)
        if self.chip == Some(from) {
            let request_id = self.spec.request_id;
            if let Some(p) = self.prefill.take() {
                let _ = fx.send(self.router, Msg::Release { request_id, chip: p });
            }
            if !self.prefilled {
                self.prefilled = true;
                let _ = fx.send(self.router, Msg::Prefilled { request_id, chip: from });
            }
        } else if self.prefill == Some(from) && self.generated.is_empty() {
            // The prefill chip's first token: the prompt is computed (the router lets
            // the tenant's next request pass the prompt bound).
            let _ = fx.send(self.router, Msg::PromptComputed { request_id: self.spec.request_id });
        }
        let first = self.generated.is_empty();
        self.generated.extend_from_slice(&tokens);
        self.logprobs.extend(logprobs.iter().cloned());
        // A streamed response gets the tokens as they come; a whole one its first token
        // now and the rest at the end.
        let n = self.generated.len();
        let whole_part = match (self.spec.delivery, finish.is_some(), first) {
            (Delivery::Stream, ..) => None,
            (Delivery::Whole, true, _) => Some(usize::from(!first).min(n)..n),
            (Delivery::Whole, false, true) => Some(0..n.min(1)),
            (Delivery::Whole, false, false) => Some(n..n),
        };
        let (tokens, logprobs) = match whole_part {
            None => (tokens, logprobs),
            Some(part) => (
                self.generated[part.clone()].to_vec(),
                self.logprobs.get(part).map(<[TokenLogprob]>::to_vec).unwrap_or_default(),
            ),
        };
        if !tokens.is_empty()
            && fx.send(self.client, Msg::Client { event: ClientEvent::Tokens { tokens, logprobs } }).is_err()
        {
            self.cancel(fx);
            return;
        }
        if let Some(finish) = finish {
            let event = ClientEvent::Finished {
                finish,
                prompt_tokens: self.spec.prompt.len(),
                completion_tokens: self.generated.len(),
            };
            self.release(fx);
            // A scoring request ends once its prompt's log-probabilities are all out
            // (the chip that prefilled them may report after the one that decoded).
            self.finished = Some((event, fx.now()));
            self.end_when_scored(fx);
        }
    }

    /// Prompt positions a scoring request reports (1..prompt length); 0 otherwise.
    fn prompt_to_score(&self) -> usize {
        match self.spec.sampling.prompt_logprobs {
            Some(_) => self.spec.prompt.len().saturating_sub(1),
            None => 0,
        }
    }

    /// Passes on the part of `logprobs` (of prompt positions `start..`) not sent yet.
    fn prompt_logprobs(&mut self, start: usize, logprobs: Vec<TokenLogprob>, fx: &mut dyn Effects<Msg>) {
        let next = self.scored + 1;
        if start > next || self.prompt_to_score() == 0 {
            return; // a gap (never, in order) or not asked for
        }
        let new: Vec<TokenLogprob> = logprobs.into_iter().skip(next - start).collect();
        if new.is_empty() {
            return; // a replay's repeat
        }
        self.scored += new.len();
        let event = ClientEvent::PromptLogprobs { start: next, logprobs: new };
        if fx.send(self.client, Msg::Client { event }).is_err() {
            self.cancel(fx);
            return;
        }
        self.end_when_scored(fx);
    }

    /// Sends the held `Finished` and ends, once every prompt log-probability is out
    /// (or after a stall timeout without them, rather than never).
    fn end_when_scored(&mut self, fx: &mut dyn Effects<Msg>) {
        let Some((_, since)) = &self.finished else { return };
        let waited_out = fx.now().since(*since) >= self.policy.stall_timeout;
        if self.scored < self.prompt_to_score() && !waited_out {
            return;
        }
        if let Some((event, _)) = self.finished.take() {
            let _ = fx.send(self.client, Msg::Client { event });
            self.finish(fx);
        }
    }

    fn release(&mut self, fx: &mut dyn Effects<Msg>) {
        for chip in [self.chip.take(), self.prefill.take()].into_iter().flatten() {
            let _ = fx.send(self.router, Msg::Release { request_id: self.spec.request_id, chip });
        }
    }

    fn abort_all(&mut self, fx: &mut dyn Effects<Msg>) {
        for chip in [self.chip, self.prefill].into_iter().flatten() {
            let _ = fx.send(chip, Msg::Abort { request_id: self.spec.request_id });
        }
    }

    fn cancel(&mut self, fx: &mut dyn Effects<Msg>) {
        self.abort_all(fx);
        self.release(fx);
        metrics::counter!("tessera_request_cancelled_total").increment(1);
        self.finish(fx);
    }

    /// Ends the request with `error`. Its diagnostic is logged here, the one place a
    /// request fails; the client is told only what the error's kind and `public` allow.
    fn fail(&mut self, error: ServeError, fx: &mut dyn Effects<Msg>) {
        tracing::warn!(request_id = self.spec.request_id, kind = ?error.kind, error = %error.message, "request failed");
        self.abort_all(fx);
        self.release(fx);
        let _ = fx.send(self.client, Msg::Client { event: ClientEvent::Failed { error } });
        metrics::counter!("tessera_request_failed_total").increment(1);
        self.finish(fx);
    }

    fn finish(&mut self, fx: &mut dyn Effects<Msg>) {
        self.done = true;
        // Ended before its first token: its siblings will not be forked from it.
        if self.generated.is_empty() {
            for fork in &self.spec.forks {
                let _ = fx.send(fork.req, Msg::Reroute);
            }
        }
        if let Some(admission) = self.admission {
            let _ = fx.send(
                admission,
                Msg::RequestEnded { request_id: self.spec.request_id, output_tokens: self.generated.len() },
            );
        }
        fx.stop();
    }
}

impl Behavior<Msg> for Request {
    fn name(&self) -> &'static str {
        "request"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.last_progress = fx.now();
        fx.timer(self.policy.stall_timeout / 2, Msg::Tick);
        match self.awaiting_fork.as_mut() {
            Some(since) => *since = fx.now(),
            None => self.route(fx),
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if self.done {
            return;
        }
        if let Some(since) = self.awaiting_fork {
            match msg {
                Msg::Generated { chip, tokens, finish, logprobs, .. } => {
                    self.adopt(chip, fx);
                    self.generated(chip, tokens, logprobs, finish, fx);
                }
                // Its sibling's prompt scores (`echo`), which are its own.
                Msg::PromptLogprobs { start, logprobs, .. } => self.prompt_logprobs(start, logprobs, fx),
                Msg::Refused { error, retry: Retry::No, .. } => self.fail(error, fx),
                Msg::Refused { .. } | Msg::Reroute => self.unforked(fx),
                Msg::Cancel => self.cancel(fx),
                Msg::Tick => {
                    if fx.now().since(since) >= self.policy.stall_timeout {
                        tracing::warn!(request_id = self.spec.request_id, "not forked in time; routing on its own");
                        self.unforked(fx);
                    }
                    fx.timer(self.policy.stall_timeout / 2, Msg::Tick);
                }
                _ => {}
            }
            return;
        }
        match msg {
            Msg::Routed { chip, prefill, .. } => self.enqueue(chip, prefill, fx),
            Msg::RouteFailed { error, .. } => self.route_failed(error, fx),
            // Only while waiting to be placed again.
            Msg::Reroute if self.chip.is_none() => self.ask_router(fx),
            Msg::Generated { chip, tokens, finish, logprobs, .. } if self.holds(chip) => {
                self.generated(chip, tokens, logprobs, finish, fx)
            }
            Msg::PromptLogprobs { start, logprobs, .. } => self.prompt_logprobs(start, logprobs, fx),
            Msg::Refused { chip, error, retry, .. } if self.holds(chip) => match retry {
                Retry::No => self.fail(error, fx),
                Retry::Elsewhere => self.chip_failed(chip, fx),
                Retry::Unavailable => self.chip_unavailable(chip, error, fx),
            },
            Msg::ChipLost { chip } => self.chip_failed(chip, fx),
            Msg::Cancel => self.cancel(fx),
            Msg::Tick => {
                self.end_when_scored(fx);
                if self.done {
                    return;
                }
                if let Some(chip) = self.chip
                    && fx.now().since(self.last_progress) >= self.policy.stall_timeout
                {
                    tracing::warn!(request_id = self.spec.request_id, %chip, "no progress; re-routing");
                    self.abort_all(fx);
                    self.chip_failed(chip, fx);
                }
                fx.timer(self.policy.stall_timeout / 2, Msg::Tick);
            }
            // A fork's sequence running on a chip it does not hold: its sibling's chip
            // forked it after it had routed on its own.
            Msg::Generated { chip, finish: None, .. } if self.fork && !self.holds(chip) => {
                let _ = fx.send(chip, Msg::Abort { request_id: self.spec.request_id });
            }
            // Late messages from a chip this request already left.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests;
