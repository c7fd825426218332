//! Admission: the door of the cluster. It gives each admitted request its id and its
//! Request actor, and refuses (429) once `max_inflight` requests are in flight, so a
//! virtual-time run sees the same request path, refusals included, as the gateway does.
//!
//! Invariant: every admitted request is counted until its Request actor ends (it always
//! reports, whatever the outcome); nothing else frees a slot.

use crate::msg::{AdmitAsk, ClientEvent, ErrorKind, Msg, ServeError};
use crate::request::{Request, RequestSpec, RetryPolicy};
use std::collections::BTreeSet;
use tessera_actor_core::{Addr, Behavior, Effects};

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
}

pub struct Admission {
    config: AdmissionConfig,
    next: u64,
    inflight: BTreeSet<u64>,
}

impl Admission {
    pub fn new(config: AdmissionConfig) -> Admission {
        Admission { next: config.id_base, config, inflight: BTreeSet::new() }
    }

    fn admit(&mut self, client: Addr, ask: AdmitAsk, fx: &mut dyn Effects<Msg>) {
        if self.inflight.len() >= self.config.max_inflight {
            metrics::counter!("tessera_admission_refused_total", "reason" => "overloaded").increment(1);
            let error = ServeError::new(
                ErrorKind::Overloaded,
                format!("the gateway already serves {} requests; retry later", self.config.max_inflight),
            )
            .retry_after(1);
            // Counted above; logged only at debug, as a flood of refusals would flood the log.
            tracing::debug!(error = %error.message, "request refused");
            let _ = fx.send(client, Msg::Client { event: ClientEvent::Failed { error } });
            return;
        }
        let request_id = self.next;
        self.next = self.next.wrapping_add(1);
        let spec = RequestSpec {
            request_id,
            prompt: ask.prompt,
            max_tokens: ask.max_tokens,
            sampling: ask.sampling,
            delivery: ask.delivery,
        };
        let request = Request::new(spec, client, self.config.router, self.config.retry).reporting_to(fx.me());
        let actor = fx.spawn(Box::new(request));
        self.inflight.insert(request_id);
        metrics::gauge!("tessera_gateway_inflight_requests").set(self.inflight.len() as f64);
        if fx.send(client, Msg::Admitted { request_id, request: actor }).is_err() {
            // The client left already: the request has nobody to serve.
            let _ = fx.send(actor, Msg::Cancel);
        }
    }
}

impl Behavior<Msg> for Admission {
    fn name(&self) -> &'static str {
        "admission"
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Admit { client, ask } => self.admit(client, *ask, fx),
            Msg::RequestEnded { request_id } => {
                self.inflight.remove(&request_id);
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
    use crate::msg::{Delivery, SamplingSpec};
    use crate::test_fx::TestFx;
    use tessera_actor_core::HostId;

    const ME: Addr = Addr { host: HostId(0), actor: 3 };
    const CLIENT: Addr = Addr { host: HostId(0), actor: 4000 };
    const ROUTER: Addr = Addr { host: HostId(0), actor: 2 };

    fn ask() -> Msg {
        Msg::Admit {
            client: CLIENT,
            ask: Box::new(AdmitAsk {
                prompt: vec![1, 2],
                max_tokens: 4,
                sampling: SamplingSpec::greedy(),
                delivery: Delivery::Stream,
            }),
        }
    }

    #[test]
    fn admits_up_to_the_limit_then_refuses_until_a_request_ends() {
        let config = AdmissionConfig { max_inflight: 2, router: ROUTER, retry: RetryPolicy::default(), id_base: 100 };
        let mut a = Admission::new(config);
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
        a.handle(Msg::RequestEnded { request_id: 100 }, &mut fx);
        a.handle(ask(), &mut fx);
        assert!(matches!(fx.take_sent().pop(), Some((_, Msg::Admitted { request_id: 102, .. }))));
        a.handle(Msg::QueryAdmission { reply_to: CLIENT }, &mut fx);
        assert_eq!(fx.take_sent(), vec![(CLIENT, Msg::AdmissionView { inflight: 2, max_inflight: 2 })]);
    }
}
