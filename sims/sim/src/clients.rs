//! The simulator's own behaviors, outside the cluster: the open-loop arrivals, one
//! client per request (what a gateway connection sees: when the request was sent, its
//! first token and its end), multi-turn chats (a client per chat, each turn sent once
//! the last is answered), and a probe of the router's view. They talk to the
//! cluster's admission and router by message, like the gateway does.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_actor_core::{Addr, Behavior, Effects, Moment};
use tessera_actors::msg::{AdmitAsk, ChipReport, ClientEvent, Delivery, Msg, SamplingSpec, topic};

/// How one request went, as its client saw it, on the virtual clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub sent: Moment,
    pub first_token: Option<Moment>,
    pub ended: Moment,
    pub tokens: usize,
    /// The prompt's tokens, as the request counted them when it finished.
    pub prompt_tokens: usize,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// The tenant it was sent for (an index into the topology's tenants).
    pub tenant: u32,
}

/// Outcomes by request number.
pub type Outcomes = Arc<Mutex<BTreeMap<usize, Outcome>>>;

/// One request's client.
struct Client {
    n: usize,
    admission: Addr,
    ask: Option<AdmitAsk>,
    tenant: u32,
    sent: Moment,
    first_token: Option<Moment>,
    tokens: usize,
    outcomes: Outcomes,
}

impl Client {
    fn end(&mut self, error: Option<String>, prompt_tokens: usize, fx: &mut dyn Effects<Msg>) {
        let (sent, first_token, tokens) = (self.sent, self.first_token, self.tokens);
        let outcome = Outcome { sent, first_token, ended: fx.now(), tokens, prompt_tokens, error, tenant: self.tenant };
        if let Ok(mut o) = self.outcomes.lock() {
            o.insert(self.n, outcome);
        }
        fx.stop();
    }
}

impl Behavior<Msg> for Client {
    fn name(&self) -> &'static str {
        "client"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.sent = fx.now();
        if let Some(ask) = self.ask.take()
            && let Err(e) = fx.send(self.admission, Msg::Admit { client: fx.me(), ask: Box::new(ask) })
        {
            self.end(Some(format!("admission is unreachable: {e}")), 0, fx);
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Client { event: ClientEvent::Tokens { tokens, .. } } => {
                if self.first_token.is_none() && !tokens.is_empty() {
                    self.first_token = Some(fx.now());
                }
                self.tokens += tokens.len();
            }
            Msg::Client { event: ClientEvent::Finished { prompt_tokens, .. } } => self.end(None, prompt_tokens, fx),
            Msg::Client { event: ClientEvent::Failed { error } } => self.end(Some(error.message), 0, fx),
            _ => {}
        }
    }
}

/// A tick `at_ns` nanoseconds after `started` (at once, if that has passed).
fn tick_at(fx: &mut dyn Effects<Msg>, started: Moment, at_ns: u64) {
    let due = started.0 + at_ns;
    fx.timer(Duration::from_nanos(due.saturating_sub(fx.now().0)), Msg::Tick);
}

/// Releases each planned request at its arrival time (offsets from its own start, in
/// nanoseconds, ascending), one timer at a time; `next` numbers them.
pub struct Arrivals {
    pub admission: Addr,
    /// (arrival in ns after the start, the request), drawn as they come due: a long run
    /// never holds every prompt at once.
    pub asks: std::iter::Peekable<Box<dyn Iterator<Item = (u64, AdmitAsk)> + Send>>,
    pub outcomes: Outcomes,
    pub next: usize,
    pub started: Moment,
}

impl Arrivals {
    fn arm(&mut self, fx: &mut dyn Effects<Msg>) {
        if let Some((at_ns, _)) = self.asks.peek() {
            tick_at(fx, self.started, *at_ns);
        }
    }
}

impl Behavior<Msg> for Arrivals {
    fn name(&self) -> &'static str {
        "arrivals"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.started = fx.now();
        self.arm(fx);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if msg != Msg::Tick {
            return;
        }
        // Every request due now (equal arrival times) goes at once.
        let now = fx.now().0;
        while let Some((_, ask)) = self.asks.next_if(|(at_ns, _)| self.started.0 + at_ns <= now) {
            let client = Client {
                n: self.next,
                admission: self.admission,
                tenant: ask.tenant,
                ask: Some(ask),
                sent: fx.now(),
                first_token: None,
                tokens: 0,
                outcomes: self.outcomes.clone(),
            };
            fx.spawn(Box::new(client));
            self.next += 1;
        }
        if self.asks.peek().is_some() {
            self.arm(fx);
        } else {
            fx.stop();
        }
    }
}

/// The router's view of the chips, once asked.
pub type View = Arc<Mutex<Option<Vec<ChipReport>>>>;

/// Asks the router for its view once, keeps the answer.
pub struct Probe {
    pub router: Addr,
    pub view: View,
}

impl Behavior<Msg> for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        if fx.send(self.router, Msg::QueryCluster { reply_to: fx.me() }).is_err() {
            fx.stop();
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if let Msg::ClusterView { chips, .. } = msg {
            if let Ok(mut v) = self.view.lock() {
                *v = Some(chips);
            }
            fx.stop();
        }
    }
}

/// What the solver published and applied, with when (`[solver] auto` runs).
pub type SolverLog = Arc<Mutex<Vec<(Moment, Msg)>>>;

/// Listens to the solver's topics and keeps what it hears.
pub struct SolverWatch {
    pub log: SolverLog,
}

impl Behavior<Msg> for SolverWatch {
    fn name(&self) -> &'static str {
        "solver-watch"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        fx.subscribe(topic::STRATEGIES);
        fx.subscribe(topic::PLANS);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if let Ok(mut log) = self.log.lock() {
            log.push((fx.now(), msg));
        }
    }
}

/// One chat's turns as token ids: the first turn's prompt, the user message each later
/// turn appends after the last prompt and its answer, and each turn's answer length.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatPlan {
    pub opening: Vec<u32>,
    /// `messages[k]` follows turn k's prompt and answer in turn k + 1's prompt.
    pub messages: Vec<Vec<u32>>,
    pub osl: Vec<u32>,
}

impl ChatPlan {
    pub fn turns(&self) -> usize {
        self.osl.len()
    }
}

/// Why a turn after a failed one is never sent (as `bench serve` reports it).
pub const TURN_NOT_SENT: &str = "not sent: an earlier turn of its conversation failed";

/// One chat's client: sends a turn, takes its answer, sends the next turn (the last
/// prompt, the answer's ids and the next message), recording each turn's outcome under
/// its request number; tells `driver` (if any) when it ends.
struct Chat {
    plan: ChatPlan,
    /// The request number of its first turn; turn k is `first + k`.
    first: usize,
    turn: usize,
    prompt: Vec<u32>,
    answer: Vec<u32>,
    admission: Addr,
    driver: Option<Addr>,
    sent: Moment,
    first_token: Option<Moment>,
    outcomes: Outcomes,
}

impl Chat {
    fn send(&mut self, fx: &mut dyn Effects<Msg>) {
        self.sent = fx.now();
        self.first_token = None;
        self.answer.clear();
        let ask = AdmitAsk {
            prompt: self.prompt.clone(),
            max_tokens: self.plan.osl[self.turn] as usize,
            sampling: SamplingSpec::greedy(),
            delivery: Delivery::Whole,
            forks: Vec::new(),
            tenant: 0,
        };
        if let Err(e) = fx.send(self.admission, Msg::Admit { client: fx.me(), ask: Box::new(ask) }) {
            self.fail(format!("admission is unreachable: {e}"), fx);
        }
    }

    fn record(&self, n: usize, outcome: Outcome) {
        if let Ok(mut o) = self.outcomes.lock() {
            o.insert(n, outcome);
        }
    }

    fn outcome(&self, now: Moment, prompt_tokens: usize, error: Option<String>) -> Outcome {
        let tokens = self.answer.len();
        Outcome { sent: self.sent, first_token: self.first_token, ended: now, tokens, prompt_tokens, error, tenant: 0 }
    }

    /// The turn under way failed: so do the turns after it, unsent.
    fn fail(&mut self, error: String, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        self.record(self.first + self.turn, self.outcome(now, 0, Some(error)));
        for k in self.turn + 1..self.plan.turns() {
            let unsent = Outcome {
                sent: now,
                first_token: None,
                ended: now,
                tokens: 0,
                prompt_tokens: 0,
                error: Some(TURN_NOT_SENT.into()),
                tenant: 0,
            };
            self.record(self.first + k, unsent);
        }
        self.end(fx);
    }

    fn end(&mut self, fx: &mut dyn Effects<Msg>) {
        if let Some(driver) = self.driver {
            let _ = fx.send(driver, Msg::Tick);
        }
        fx.stop();
    }
}

impl Behavior<Msg> for Chat {
    fn name(&self) -> &'static str {
        "chat"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.prompt = self.plan.opening.clone();
        self.send(fx);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Client { event: ClientEvent::Tokens { tokens, .. } } => {
                if self.first_token.is_none() && !tokens.is_empty() {
                    self.first_token = Some(fx.now());
                }
                self.answer.extend(tokens);
            }
            Msg::Client { event: ClientEvent::Finished { prompt_tokens, .. } } => {
                self.record(self.first + self.turn, self.outcome(fx.now(), prompt_tokens, None));
                let Some(message) = self.plan.messages.get(self.turn) else { return self.end(fx) };
                self.prompt.extend_from_slice(&self.answer);
                self.prompt.extend_from_slice(message);
                self.turn += 1;
                self.send(fx);
            }
            Msg::Client { event: ClientEvent::Failed { error } } => self.fail(error.message, fx),
            _ => {}
        }
    }
}

/// When chats start: `concurrency` under way at once (a new one as one ends), or each
/// at its time (nanoseconds after the start, ascending).
pub enum ChatStarts {
    Closed { concurrency: usize },
    At(VecDeque<u64>),
}

/// Starts the planned chats as `starts` says, numbering their turns in plan order.
pub struct Chats {
    pub admission: Addr,
    pub plans: VecDeque<ChatPlan>,
    pub starts: ChatStarts,
    pub outcomes: Outcomes,
    pub next_request: usize,
    pub started: Moment,
}

impl Chats {
    fn start_one(&mut self, fx: &mut dyn Effects<Msg>) {
        let Some(plan) = self.plans.pop_front() else { return };
        let driver = matches!(self.starts, ChatStarts::Closed { .. }).then(|| fx.me());
        let first = self.next_request;
        self.next_request += plan.turns();
        let chat = Chat {
            plan,
            first,
            turn: 0,
            prompt: Vec::new(),
            answer: Vec::new(),
            admission: self.admission,
            driver,
            sent: fx.now(),
            first_token: None,
            outcomes: self.outcomes.clone(),
        };
        fx.spawn(Box::new(chat));
    }

    fn arm(&mut self, fx: &mut dyn Effects<Msg>) {
        if let ChatStarts::At(times) = &self.starts
            && let Some(at_ns) = times.front()
        {
            tick_at(fx, self.started, *at_ns);
        }
    }
}

impl Behavior<Msg> for Chats {
    fn name(&self) -> &'static str {
        "chats"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.started = fx.now();
        match self.starts {
            ChatStarts::Closed { concurrency } => {
                for _ in 0..concurrency {
                    self.start_one(fx);
                }
            }
            ChatStarts::At(_) => self.arm(fx),
        }
        if self.plans.is_empty() {
            fx.stop();
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        if msg != Msg::Tick {
            return;
        }
        match &mut self.starts {
            // A chat ended: the next one starts.
            ChatStarts::Closed { .. } => self.start_one(fx),
            ChatStarts::At(times) => {
                let now = fx.now().0;
                let mut due = 0;
                while times.front().is_some_and(|at_ns| self.started.0 + at_ns <= now) {
                    times.pop_front();
                    due += 1;
                }
                for _ in 0..due {
                    self.start_one(fx);
                }
                self.arm(fx);
            }
        }
        if self.plans.is_empty() {
            fx.stop();
        }
    }
}
