//! `tessera bench admission`: the gateway's and admission's decision for one request in
//! a shared cluster — its key checked against a store of many keys, then its tenant's
//! quotas and the admission itself — timed one decision at a time.

use std::time::{Duration, Instant};

use serde::Serialize;
use tessera_access::{KeyStore, Role};
use tessera_actor_core::testkit::TestFx;
use tessera_actor_core::{Addr, Behavior, HostId};
use tessera_actors::admission::{Admission, AdmissionConfig};
use tessera_actors::msg::{AdmitAsk, Delivery, Msg, SamplingSpec};
use tessera_actors::request::RetryPolicy;
use tessera_loadgen::SeededRng;
use tessera_topology::{PriorityClass, TenantLimits, TenantSpec};

pub struct AdmissionBenchOptions {
    pub keys: usize,
    pub tenants: usize,
    pub decisions: usize,
}

#[derive(Debug, Serialize)]
pub struct AdmissionBenchReport {
    pub keys: usize,
    pub tenants: usize,
    pub decisions: usize,
    /// The key's check alone.
    pub auth_us_p50: f64,
    pub auth_us_p99: f64,
    /// The key's check, the tenant's quotas and the admission (its Request actor made).
    pub decision_us_p50: f64,
    pub decision_us_p99: f64,
    pub decision_us_max: f64,
    pub admitted: usize,
    /// Refused by a tenant quota (the load is drawn to hit them now and then).
    pub refused: usize,
}

impl AdmissionBenchReport {
    pub fn table(&self) -> String {
        format!(
            "{} keys over {} tenants, {} decisions ({} admitted, {} refused by a quota)\n\
             key check: p50 {:.2} us, p99 {:.2} us\n\
             decision (key, quotas, admission): p50 {:.2} us, p99 {:.2} us, max {:.2} us\n",
            self.keys,
            self.tenants,
            self.decisions,
            self.admitted,
            self.refused,
            self.auth_us_p50,
            self.auth_us_p99,
            self.decision_us_p50,
            self.decision_us_p99,
            self.decision_us_max
        )
    }
}

pub fn run(opts: &AdmissionBenchOptions) -> anyhow::Result<AdmissionBenchReport> {
    let tenants: Vec<TenantSpec> = (0..opts.tenants.max(1))
        .map(|t| TenantSpec {
            name: format!("tenant-{t}"),
            weight: 1,
            priority: PriorityClass::Standard,
            models: None,
            share_prefix_cache: false,
            limits: TenantLimits {
                requests_per_min: Some(250),
                tokens_per_min: Some(200_000),
                max_concurrent: Some(8),
                max_tokens: Some(1024),
            },
        })
        .collect();
    let mut records = Vec::with_capacity(opts.keys);
    let mut texts = Vec::with_capacity(opts.keys);
    for k in 0..opts.keys.max(1) {
        let (record, key) = tessera_access::keys::generate(&tenants[k % tenants.len()].name, Role::User, None)?;
        records.push(record);
        texts.push(key);
    }
    let store = KeyStore::from_records(records)?;
    let me = Addr::new(HostId(0), 3);
    let config = AdmissionConfig {
        max_inflight: 1 << 20,
        router: Addr::new(HostId(0), 2),
        retry: RetryPolicy::default(),
        id_base: 0,
        telemetry: None,
        tenants: tenants.clone(),
    };
    let mut admission = Admission::new(config);
    let mut fx: TestFx<Msg> = TestFx::new(me);
    let mut rng = SeededRng::new(7);
    let mut auth = Vec::with_capacity(opts.decisions);
    let mut times = Vec::with_capacity(opts.decisions);
    let (mut admitted, mut refused) = (0, 0);
    let mut inflight: Vec<u64> = Vec::new();
    for d in 0..opts.decisions {
        // A request every 2 ms of model time, so the windows turn over.
        fx.now = fx.now.after(Duration::from_millis(2));
        let header = format!("Bearer {}", texts[rng.below(texts.len() as u64) as usize]);
        let t = Instant::now();
        let who = store.authenticate(Some(&header)).map_err(|e| anyhow::anyhow!("{e}"))?;
        let auth_s = t.elapsed();
        let tenant = tenants.iter().position(|s| s.name == who.tenant).unwrap_or(0) as u32;
        let ask = AdmitAsk {
            prompt: vec![1; 64 + rng.below(512) as usize],
            max_tokens: 16 + rng.below(256) as usize,
            sampling: SamplingSpec::greedy(),
            delivery: Delivery::Stream,
            forks: Vec::new(),
            tenant,
        };
        admission.handle(Msg::Admit { client: Addr::new(HostId(0), 10_000 + d as u64), ask: Box::new(ask) }, &mut fx);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        auth.push(auth_s.as_secs_f64() * 1e6);
        for (_, msg) in fx.take_sent() {
            match msg {
                Msg::Admitted { request_id, .. } => {
                    admitted += 1;
                    inflight.push(request_id);
                }
                _ => refused += 1,
            }
        }
        fx.spawned.clear();
        // Requests end in a few steps, out of order.
        while inflight.len() > 32 {
            let request_id = inflight.swap_remove(rng.below(inflight.len() as u64) as usize);
            admission.handle(Msg::RequestEnded { request_id, output_tokens: 8 }, &mut fx);
        }
    }
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v.get(((v.len() as f64 * q) as usize).min(v.len().saturating_sub(1))).copied().unwrap_or(f64::NAN)
    };
    Ok(AdmissionBenchReport {
        keys: opts.keys,
        tenants: tenants.len(),
        decisions: opts.decisions,
        auth_us_p50: pct(&mut auth, 0.5),
        auth_us_p99: pct(&mut auth, 0.99),
        decision_us_p50: pct(&mut times, 0.5),
        decision_us_p99: pct(&mut times, 0.99),
        decision_us_max: times.last().copied().unwrap_or(f64::NAN),
        admitted,
        refused,
    })
}
