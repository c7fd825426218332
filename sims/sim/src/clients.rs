//! The simulator's own behaviors, outside the cluster: the open-loop arrivals, one
//! client per request (what a gateway connection sees: when the request was sent, its
//! first token and its end), and a probe of the router's view. They talk to the
//! cluster's admission and router by message, like the gateway does.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_actor_core::{Addr, Behavior, Effects, Moment};
use tessera_actors::msg::{AdmitAsk, ChipReport, ClientEvent, Msg, topic};

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
            let due = self.started.0 + at_ns;
            fx.timer(Duration::from_nanos(due.saturating_sub(fx.now().0)), Msg::Tick);
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
