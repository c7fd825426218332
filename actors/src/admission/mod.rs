//! Admission: the door of the cluster. It gives each admitted request its id and its
//! Request actor, refuses (429) once `max_inflight` requests are in flight, and holds
//! each tenant to its quotas (`quota`) and its share of those slots (see
//! [`Admission::over_share`]: one tenant's flood cannot lock the others out), so a virtual-time run sees the same request
//! path, refusals included, as the gateway does. There is one admission per cluster (on
//! the gateway's host), so a tenant's quotas hold for the whole cluster.
//!
//! Invariant: every admitted request is counted — in flight, and against its tenant —
//! until its Request actor ends (it always reports, whatever the outcome); nothing else
//! frees a slot or refunds a reservation.

pub mod quota;

use crate::msg::{AdmitAsk, ClientEvent, ErrorKind, Fork, Msg, ServeError, Telemetry, TenantShare, topic};
use crate::request::{Request, RequestSpec, RetryPolicy};
use quota::Ledger;
use std::collections::BTreeMap;
use std::time::Duration;
use tessera_actor_core::{Addr, Behavior, Effects, Moment};
use tessera_topology::{OPEN_TENANT, TenantSpec};

#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    pub max_inflight: usize,
    pub router: Addr,
    pub retry: RetryPolicy,
    /// Request ids are `id_base + n`: unique within one admission's life. The gateway
    /// bases them on the time it started (an adapter may read the clock), so ids of a
    /// restarted gateway do not meet old ones still on chips; a simulation passes a
    /// fixed base.
    pub id_base: u64,
    /// Publish the traffic on `topic::TELEMETRY` this often (for the solver), or never.
    pub telemetry: Option<Duration>,
    /// The cluster's tenants (`AdmitAsk::tenant` indexes them); empty: one open tenant
    /// without limits.
    pub tenants: Vec<TenantSpec>,
}

/// An admitted sequence: its tenant and the output tokens it reserved.
#[derive(Debug, Clone, Copy)]
struct Seat {
    tenant: usize,
    max_tokens: usize,
}

pub struct Admission {
    config: AdmissionConfig,
    next: u64,
    inflight: BTreeMap<u64, Seat>,
    /// Per tenant: sequences in flight.
    held: Vec<usize>,
    /// Per tenant, in the order of `config.tenants` (one for the open tenant).
    ledgers: Vec<Ledger>,
    /// Each tenant's [`cache_salt`], worked out once.
    salts: Vec<Option<u64>>,
    /// The traffic since the window began.
    window: Telemetry,
    window_start: Moment,
}

impl Admission {
    pub fn new(mut config: AdmissionConfig) -> Admission {
        if config.tenants.is_empty() {
            config.tenants.push(TenantSpec {
                name: OPEN_TENANT.to_owned(),
                weight: 1,
                priority: Default::default(),
                models: None,
                share_prefix_cache: true,
                limits: Default::default(),
            });
        }
        Admission {
            next: config.id_base,
            ledgers: vec![Ledger::default(); config.tenants.len()],
            held: vec![0; config.tenants.len()],
            salts: config.tenants.iter().map(cache_salt).collect(),
            config,
            inflight: BTreeMap::new(),
            window: Telemetry::default(),
            window_start: Moment::default(),
        }
    }

    /// Publishes the window's traffic and starts the next one.
    fn publish_telemetry(&mut self, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        let mut telemetry = std::mem::take(&mut self.window);
        telemetry.window_s = now.since(self.window_start).as_secs_f64();
        self.window_start = now;
        fx.publish(topic::TELEMETRY, Msg::Telemetry { telemetry: Box::new(telemetry) });
    }

    /// Admits `ask` and its forks (all or none): each is a request of its own, the
    /// forks spawned first so the parent's sequence can name them.
    fn admit(&mut self, client: Addr, ask: AdmitAsk, fx: &mut dyn Effects<Msg>) {
        let clients = std::iter::once(client).chain(ask.forks.iter().map(|f| f.client));
        let sequences = 1 + ask.forks.len();
        let tenant = ask.tenant as usize;
        let refusal = if tenant >= self.config.tenants.len() {
            let why = format!("tenant #{tenant} is not one of the cluster's {}", self.config.tenants.len());
            Some(("unknown_tenant", ServeError::new(ErrorKind::Internal, why)))
        } else if self.inflight.len() + sequences > self.config.max_inflight {
            Some(if sequences > self.config.max_inflight {
                // It would never fit: retrying cannot help.
                let why = format!(
                    "{sequences} sequences (n or best_of) exceed the gateway's max_inflight_requests = {}",
                    self.config.max_inflight
                );
                ("too_many_sequences", ServeError::new(ErrorKind::BadRequest, why.clone()).with_public(why))
            } else {
                let why = format!("the gateway already serves {} requests; retry later", self.config.max_inflight);
                ("overloaded", ServeError::new(ErrorKind::Overloaded, why).retry_after(1))
            })
        } else if let Some(why) = self.over_share(tenant, sequences) {
            Some(("fair_share", ServeError::new(ErrorKind::Overloaded, why).retry_after(1)))
        } else {
            let spec = &self.config.tenants[tenant];
            let want = quota::Ask { sequences, prompt_tokens: ask.prompt.len(), max_tokens: ask.max_tokens };
            self.ledgers[tenant].check(&spec.limits, &spec.name, want, fx.now()).err().map(|refused| {
                let error = match refused.retry_after_s {
                    Some(s) => ServeError::new(ErrorKind::QuotaExceeded, refused.message.clone()).retry_after(s),
                    // It would never fit: a bad request, not "retry later".
                    None => ServeError::new(ErrorKind::BadRequest, refused.message.clone()),
                };
                (refused.limit, error.with_public(refused.message))
            })
        };
        if let Some((reason, error)) = refusal {
            let tenant = self.config.tenants.get(tenant).map_or("unknown", |t| t.name.as_str()).to_owned();
            metrics::counter!("tessera_admission_refused_total", "reason" => reason, "tenant" => tenant).increment(1);
            // Counted above; logged only at debug, as a flood of refusals would flood the log.
            tracing::debug!(error = %error.message, "request refused");
            for client in clients {
                let _ = fx.send(client, Msg::Client { event: ClientEvent::Failed { error: error.clone() } });
            }
            return;
        }
        let salt = self.salts[tenant];
        let t = &self.config.tenants[tenant];
        let share = TenantShare { tenant: tenant as u32, weight: t.weight, class: t.priority };
        let spec = |request_id, seed, forks| {
            let mut sampling = ask.sampling.clone();
            sampling.seed = seed;
            RequestSpec {
                request_id,
                prompt: ask.prompt.clone(),
                max_tokens: ask.max_tokens,
                sampling,
                delivery: ask.delivery,
                forks,
                cache_salt: salt,
                share,
            }
        };
        let seat = Seat { tenant, max_tokens: ask.max_tokens };
        let mut forks = Vec::with_capacity(ask.forks.len());
        for f in &ask.forks {
            let request_id = self.take_id();
            let request =
                Request::forked(spec(request_id, f.seed, Vec::new()), f.client, self.config.router, self.config.retry);
            self.ledgers[tenant].charge(request_id, ask.max_tokens as u64, None, fx.now());
            let req = self.start(request_id, seat, f.client, request, fx);
            forks.push(Fork { request_id, req, seed: f.seed });
        }
        let request_id = self.take_id();
        self.window.admitted += 1;
        self.window.prompt_tokens += ask.prompt.len() as u64;
        Telemetry::count(&mut self.window.prompt_hist, ask.prompt.len());
        let name = self.config.tenants[tenant].name.clone();
        metrics::counter!("tessera_tenant_requests_total", "tenant" => name.clone()).increment(1);
        metrics::counter!("tessera_tenant_tokens_total", "tenant" => name, "kind" => "prompt")
            .increment(ask.prompt.len() as u64);
        let reserved = (ask.prompt.len() + ask.max_tokens) as u64;
        self.ledgers[tenant].charge(request_id, reserved, Some(sequences as u64), fx.now());
        let request =
            Request::new(spec(request_id, ask.sampling.seed, forks), client, self.config.router, self.config.retry);
        self.start(request_id, seat, client, request, fx);
    }

    /// Why `sequences` more of `tenant` would take slots held back for the others, if so.
    /// Each tenant is guaranteed its weighted share of `max_inflight`; beyond it, it may
    /// borrow free slots but leaves each other tenant a quarter of its guarantee (or what
    /// it has not used of it, if less), so a tenant with a light load is never locked
    /// out by another's flood.
    fn over_share(&self, tenant: usize, sequences: usize) -> Option<String> {
        let tenants = &self.config.tenants;
        if tenants.len() < 2 {
            return None;
        }
        let max = self.config.max_inflight;
        let total_weight: u64 = tenants.iter().map(|t| u64::from(t.weight)).sum();
        let guarantee = |u: usize| (max as u64 * u64::from(tenants[u].weight)).div_ceil(total_weight.max(1)) as usize;
        if self.held[tenant] + sequences <= guarantee(tenant) {
            return None;
        }
        let held_back: usize = (0..tenants.len())
            .filter(|&u| u != tenant)
            .map(|u| guarantee(u).saturating_sub(self.held[u]).min(guarantee(u).div_ceil(4)))
            .sum();
        let free = max.saturating_sub(self.inflight.len());
        (sequences + held_back > free).then(|| {
            format!(
                "tenant `{}` holds {} of the gateway's {max} request slots, more than its share ({}); the \
                 {held_back} free slots left are held for the other tenants; retry later",
                tenants[tenant].name,
                self.held[tenant],
                guarantee(tenant)
            )
        })
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        id
    }

    /// Spawns an admitted request's actor and tells its client.
    fn start(
        &mut self,
        request_id: u64,
        seat: Seat,
        client: Addr,
        request: Request,
        fx: &mut dyn Effects<Msg>,
    ) -> Addr {
        let actor = fx.spawn(Box::new(request.reporting_to(fx.me())));
        self.inflight.insert(request_id, seat);
        self.held[seat.tenant] += 1;
        metrics::gauge!("tessera_gateway_inflight_requests").set(self.inflight.len() as f64);
        if fx.send(client, Msg::Admitted { request_id, request: actor }).is_err() {
            // The client left already: the request has nobody to serve.
            let _ = fx.send(actor, Msg::Cancel);
        }
        actor
    }
}

/// The salt of a tenant's KV block hashes: its own unless it shares its prefix cache, so
/// no tenant's prompt can hit (and so time) another's cached blocks.
pub fn cache_salt(tenant: &TenantSpec) -> Option<u64> {
    let salt = || xxhash_rust::xxh3::xxh3_64(format!("tessera tenant {}", tenant.name).as_bytes());
    (!tenant.share_prefix_cache).then(salt)
}

impl Behavior<Msg> for Admission {
    fn name(&self) -> &'static str {
        "admission"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        self.window_start = fx.now();
        if let Some(every) = self.config.telemetry {
            fx.timer(every, Msg::Tick);
        }
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Admit { client, ask } => self.admit(client, *ask, fx),
            Msg::Tick => {
                if let Some(every) = self.config.telemetry {
                    self.publish_telemetry(fx);
                    fx.timer(every, Msg::Tick);
                }
            }
            Msg::RequestEnded { request_id, output_tokens } => {
                if let Some(seat) = self.inflight.remove(&request_id) {
                    self.held[seat.tenant] -= 1;
                    let unused = seat.max_tokens.saturating_sub(output_tokens);
                    self.ledgers[seat.tenant].refund(request_id, unused as u64);
                    let name = self.config.tenants[seat.tenant].name.clone();
                    metrics::counter!("tessera_tenant_tokens_total", "tenant" => name, "kind" => "output")
                        .increment(output_tokens as u64);
                    self.window.ended += 1;
                    self.window.output_tokens += output_tokens as u64;
                    Telemetry::count(&mut self.window.output_hist, output_tokens);
                }
                metrics::gauge!("tessera_gateway_inflight_requests").set(self.inflight.len() as f64);
            }
            Msg::QueryAdmission { reply_to } => {
                let view = Msg::AdmissionView { inflight: self.inflight.len(), max_inflight: self.config.max_inflight };
                let _ = fx.send(reply_to, view);
            }
            other => tracing::debug!(kind = ?other, "admission: unexpected message"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{Delivery, ForkAsk, SamplingSpec};
    use crate::test_fx::TestFx;
    use tessera_actor_core::HostId;

    const ME: Addr = Addr { host: HostId(0), actor: 3 };
    const CLIENT: Addr = Addr { host: HostId(0), actor: 4000 };
    const ROUTER: Addr = Addr { host: HostId(0), actor: 2 };

    fn config(max_inflight: usize) -> AdmissionConfig {
        AdmissionConfig {
            max_inflight,
            router: ROUTER,
            retry: RetryPolicy::default(),
            id_base: 100,
            telemetry: None,
            tenants: Vec::new(),
        }
    }

    fn ask() -> Msg {
        Msg::Admit {
            client: CLIENT,
            ask: Box::new(AdmitAsk {
                prompt: vec![1, 2],
                max_tokens: 4,
                sampling: SamplingSpec::greedy(),
                delivery: Delivery::Stream,
                forks: Vec::new(),
                tenant: 0,
            }),
        }
    }

    #[test]
    fn admits_up_to_the_limit_then_refuses_until_a_request_ends() {
        let mut a = Admission::new(config(2));
        let mut fx = TestFx::new(ME);
        // (what happens, expected reply to the client)
        for want in ["admitted 100", "admitted 101", "overloaded"] {
            a.handle(ask(), &mut fx);
            let got = match fx.take_sent().pop() {
                Some((to, Msg::Admitted { request_id, .. })) if to == CLIENT => format!("admitted {request_id}"),
                Some((to, Msg::Client { event: ClientEvent::Failed { error } })) if to == CLIENT => {
                    assert_eq!(error.kind, ErrorKind::Overloaded);
                    "overloaded".to_string()
                }
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(got, want);
        }
        assert_eq!(fx.spawned.len(), 2, "one Request actor per admitted request");
        a.handle(Msg::RequestEnded { request_id: 100, output_tokens: 4 }, &mut fx);
        a.handle(ask(), &mut fx);
        assert!(matches!(fx.take_sent().pop(), Some((_, Msg::Admitted { request_id: 102, .. }))));
        a.handle(Msg::QueryAdmission { reply_to: CLIENT }, &mut fx);
        assert_eq!(fx.take_sent(), vec![(CLIENT, Msg::AdmissionView { inflight: 2, max_inflight: 2 })]);
    }

    /// `n` > 1: the request and its forks are admitted together (each its own request,
    /// counted in flight), or refused together.
    #[test]
    fn a_request_and_its_forks_are_admitted_all_or_none() {
        let mut a = Admission::new(config(4));
        let mut fx = TestFx::new(ME);
        let fork_clients = [Addr { host: HostId(0), actor: 4001 }, Addr { host: HostId(0), actor: 4002 }];
        let with_forks = || match ask() {
            Msg::Admit { client, mut ask } => {
                ask.forks =
                    fork_clients.iter().zip(5..).map(|(&client, seed)| ForkAsk { client, seed: Some(seed) }).collect();
                Msg::Admit { client, ask }
            }
            _ => unreachable!(),
        };
        a.handle(with_forks(), &mut fx);
        let admitted: Vec<(Addr, u64)> = fx
            .take_sent()
            .into_iter()
            .filter_map(|(to, m)| match m {
                Msg::Admitted { request_id, .. } => Some((to, request_id)),
                _ => None,
            })
            .collect();
        assert_eq!(admitted, vec![(fork_clients[0], 100), (fork_clients[1], 101), (CLIENT, 102)]);
        assert_eq!(fx.spawned.len(), 3, "a Request actor each");
        // Three in flight of four: another three do not fit, and none of them is admitted.
        a.handle(with_forks(), &mut fx);
        let refused = fx.take_sent();
        assert_eq!(refused.len(), 3);
        assert!(refused.iter().all(|(_, m)| matches!(m, Msg::Client { event: ClientEvent::Failed { error } }
            if error.kind == ErrorKind::Overloaded)));
        assert_eq!(fx.spawned.len(), 3);
        // More sequences than could ever be in flight: a bad request, not "retry later".
        let mut a = Admission::new(config(2));
        a.handle(with_forks(), &mut fx);
        let refused = fx.take_sent();
        assert!(refused.iter().all(|(_, m)| matches!(m, Msg::Client { event: ClientEvent::Failed { error } }
            if error.kind == ErrorKind::BadRequest && error.message.contains("max_inflight_requests = 2"))));
        assert_eq!(refused.len(), 3);
    }

    /// A tenant over its quota is refused (429, its limit named, a retry time) while
    /// another is admitted; a request's end gives back its seat and unused tokens; a
    /// tenant that keeps its cache to itself salts its requests' block hashes.
    #[test]
    fn each_tenant_is_held_to_its_own_quotas() {
        use tessera_topology::{PriorityClass, TenantLimits};
        let tenant = |name: &str, limits: TenantLimits, share_prefix_cache: bool| TenantSpec {
            name: name.into(),
            weight: 1,
            priority: PriorityClass::Standard,
            models: None,
            share_prefix_cache,
            limits,
        };
        let mut config = config(16);
        config.tenants = vec![
            tenant(
                "a",
                TenantLimits { max_concurrent: Some(1), tokens_per_min: Some(20), ..Default::default() },
                false,
            ),
            tenant("b", TenantLimits::default(), true),
        ];
        let mut a = Admission::new(config.clone());
        let mut fx = TestFx::new(ME);
        let ask_for = |tenant: u32| match ask() {
            Msg::Admit { client, mut ask } => {
                ask.tenant = tenant;
                Msg::Admit { client, ask }
            }
            _ => unreachable!(),
        };
        let reply = |fx: &mut TestFx| match fx.take_sent().pop() {
            Some((_, Msg::Admitted { request_id, .. })) => format!("admitted {request_id}"),
            Some((_, Msg::Client { event: ClientEvent::Failed { error } })) => {
                format!("{:?} {:?} {}", error.kind, error.retry_after_s, error.public.unwrap_or_default())
            }
            other => panic!("unexpected {other:?}"),
        };
        a.handle(ask_for(0), &mut fx);
        assert_eq!(reply(&mut fx), "admitted 100");
        a.handle(ask_for(0), &mut fx);
        let refused = reply(&mut fx);
        assert!(refused.starts_with("QuotaExceeded Some(1)") && refused.contains("tenant `a`"), "{refused}");
        a.handle(ask_for(1), &mut fx);
        assert_eq!(reply(&mut fx), "admitted 101", "another tenant is admitted meanwhile");
        // Request 100 reserved 2 + 4 tokens and used 1: its seat and 3 tokens come back.
        a.handle(Msg::RequestEnded { request_id: 100, output_tokens: 1 }, &mut fx);
        // (event, the reply to the next ask of tenant a): 6 tokens reserved per ask.
        let steps: [(Option<(u64, usize)>, &str); 4] = [
            (None, "admitted 102"),
            (None, "sequences in flight"), // 102 is in flight
            (Some((102, 4)), "admitted 103"),
            (Some((103, 4)), "tokens per minute"), // 3 + 6 + 6 used, 6 more is over 20
        ];
        for (end, want) in steps {
            if let Some((request_id, output_tokens)) = end {
                a.handle(Msg::RequestEnded { request_id, output_tokens }, &mut fx);
            }
            a.handle(ask_for(0), &mut fx);
            let got = reply(&mut fx);
            assert!(got.contains(want), "{want}: {got}");
        }
        assert_eq!(cache_salt(&config.tenants[1]), None);
        assert!(cache_salt(&config.tenants[0]).is_some());
        // An unknown tenant index is refused, never admitted.
        a.handle(ask_for(9), &mut fx);
        assert!(reply(&mut fx).starts_with("Internal"));
    }

    /// A flooding tenant borrows the idle slots but not the last quarter of the other's
    /// guarantee: the light tenant still gets in, then the cluster's limit holds for all.
    #[test]
    fn a_flood_leaves_slots_for_the_other_tenants() {
        use tessera_topology::PriorityClass;
        let tenant = |name: &str, weight| TenantSpec {
            name: name.into(),
            weight,
            priority: PriorityClass::Standard,
            models: None,
            share_prefix_cache: true,
            limits: Default::default(),
        };
        // Of 16 slots, a (weight 3) is guaranteed 12, b (weight 1) 4, of which 1 is
        // held back for b while a borrows.
        let mut config = config(16);
        config.tenants = vec![tenant("a", 3), tenant("b", 1)];
        let mut a = Admission::new(config);
        let mut fx = TestFx::new(ME);
        let mut admit = |tenant: u32, fx: &mut TestFx| {
            let Msg::Admit { client, mut ask } = ask() else { unreachable!() };
            ask.tenant = tenant;
            a.handle(Msg::Admit { client, ask }, fx);
            match fx.take_sent().pop() {
                Some((_, Msg::Admitted { .. })) => "admitted".to_string(),
                Some((_, Msg::Client { event: ClientEvent::Failed { error } })) => {
                    assert_eq!((error.kind, error.retry_after_s), (ErrorKind::Overloaded, Some(1)));
                    error.message
                }
                other => panic!("unexpected {other:?}"),
            }
        };
        for n in 0..15 {
            assert_eq!(admit(0, &mut fx), "admitted", "a's ask #{n}");
        }
        let refused = admit(0, &mut fx);
        assert!(refused.contains("tenant `a` holds 15") && refused.contains("share (12)"), "{refused}");
        assert_eq!(admit(1, &mut fx), "admitted", "the slot held back for b");
        assert!(admit(1, &mut fx).contains("already serves 16"), "then the cluster is full");
    }
}
