//! A mixed-tenant load (`tessera bench serve --tenants FILE`): several tenants, each
//! with its own key, its own load (a rate or a concurrency) and its own lengths, sent
//! side by side to one server; the report gives each tenant's latencies and refusals.
//!
//! ```toml
//! [[tenants]]
//! name = "flood"
//! key_env = "FLOOD_KEY"     # or key = "tsk_…" (a file holding keys: keep it private)
//! concurrency = 32          # or rate = 20.0 (Poisson arrivals a second)
//! requests = 400
//! [[tenants]]
//! name = "light"
//! key_env = "LIGHT_KEY"
//! rate = 0.5
//! requests = 20
//! isl = "256"               # over --isl/--osl
//! ```

use std::fmt::Write;

use serde::{Deserialize, Serialize};
use tessera_workload::{LengthDist, Load};

use crate::{LoadgenError, ServeBenchOptions, ServeBenchReport};

/// Most tenants one file may list.
const MAX_TENANTS: usize = 256;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    tenants: Vec<RawTenant>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    key: Option<String>,
    key_env: Option<String>,
    rate: Option<f64>,
    concurrency: Option<usize>,
    requests: Option<usize>,
    isl: Option<String>,
    osl: Option<String>,
}

/// One tenant's part of the load.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLoad {
    pub name: String,
    pub api_key: String,
    pub load: Load,
    /// `None`: the run's `--requests`.
    pub requests: Option<usize>,
    pub isl: Option<LengthDist>,
    pub osl: Option<LengthDist>,
}

/// Reads a tenants file's `text` (named `source` in errors); `env` looks up `key_env`.
pub fn parse(text: &str, source: &str, env: impl Fn(&str) -> Option<String>) -> Result<Vec<TenantLoad>, LoadgenError> {
    let bad = |why: String| LoadgenError::InvalidOptions(format!("{source}: {why}"));
    let raw: RawFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
    if raw.tenants.is_empty() || raw.tenants.len() > MAX_TENANTS {
        return Err(bad(format!("list 1 to {MAX_TENANTS} [[tenants]], not {}", raw.tenants.len())));
    }
    let mut loads: Vec<TenantLoad> = Vec::with_capacity(raw.tenants.len());
    for (i, t) in raw.tenants.into_iter().enumerate() {
        let at = |why: String| bad(format!("tenants[{i}] ({}): {why}", t.name));
        if t.name.is_empty() || loads.iter().any(|l| l.name == t.name) {
            return Err(at("needs a name of its own".into()));
        }
        let api_key = match (&t.key, &t.key_env) {
            (Some(key), None) => key.clone(),
            (None, Some(var)) => env(var).ok_or_else(|| at(format!("`key_env`: ${var} is not set")))?,
            _ => return Err(at("give its key as `key` or `key_env` (one of them)".into())),
        };
        if reqwest::header::HeaderValue::from_str(&format!("Bearer {api_key}")).is_err() {
            return Err(at("its key is not a valid header value".into()));
        }
        let load = Load::from_flags(t.rate, t.concurrency)
            .map_err(|e| at(e.0.replace("--rate", "`rate`").replace("--concurrency", "`concurrency`")))?;
        if t.requests == Some(0) {
            return Err(at("`requests` must be at least 1".into()));
        }
        let length = |v: &Option<String>, key: &str| {
            v.as_deref().map(|s| s.parse::<LengthDist>().map_err(|e| at(format!("`{key}`: {e}")))).transpose()
        };
        let (isl, osl) = (length(&t.isl, "isl")?, length(&t.osl, "osl")?);
        loads.push(TenantLoad { name: t.name, api_key, load, requests: t.requests, isl, osl });
    }
    Ok(loads)
}

/// Each tenant's report, in the file's order.
#[derive(Debug, Clone, Serialize)]
pub struct TenantsReport {
    pub tenants: Vec<TenantReport>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantReport {
    pub name: String,
    #[serde(flatten)]
    pub report: ServeBenchReport,
}

/// Sends every tenant's load at once, each as `base` with the tenant's key, load,
/// requests and lengths (and a seed of its own), and waits for all of them.
pub async fn run(base: ServeBenchOptions, tenants: Vec<TenantLoad>) -> Result<TenantsReport, LoadgenError> {
    let runs = tenants.into_iter().enumerate().map(|(i, t)| {
        let opts = ServeBenchOptions {
            api_key: Some(t.api_key),
            load: t.load,
            requests: t.requests.unwrap_or(base.requests),
            isl: t.isl.unwrap_or(base.isl),
            osl: t.osl.unwrap_or(base.osl),
            seed: base.seed.wrapping_add(i as u64),
            // One bar per tenant would fight over the terminal.
            progress: false,
            ..base.clone()
        };
        async move { (t.name, crate::run(opts).await) }
    });
    let mut out = Vec::new();
    for (name, result) in futures::future::join_all(runs).await {
        let report = result.map_err(|e| LoadgenError::InvalidOptions(format!("tenant {name}: {e}")))?;
        out.push(TenantReport { name, report });
    }
    Ok(TenantsReport { tenants: out })
}

impl TenantsReport {
    /// A row per tenant: its load, what it got, its latencies and its refusals.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<12} {:<16} {:>6} {:>7} {:>12} {:>12} {:>12} {:>12}  refusals",
            "tenant", "load", "ok", "failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "output tok/s"
        );
        let ms = |l: Option<crate::LatencySummary>, p50: bool| {
            l.map_or("-".into(), |l| format!("{:.1}", if p50 { l.p50_ms } else { l.p99_ms }))
        };
        for t in &self.tenants {
            let r = &t.report;
            let load = match (r.rate_rps, r.concurrency) {
                (Some(rate), _) => format!("{rate} req/s"),
                (None, Some(c)) => format!("concurrency {c}"),
                (None, None) => "-".into(),
            };
            let refusals: usize = r.errors.iter().filter(|e| e.message.starts_with("HTTP 429")).map(|e| e.count).sum();
            let _ = writeln!(
                s,
                "{:<12} {:<16} {:>6} {:>7} {:>12} {:>12} {:>12} {:>12.1}  {refusals}",
                t.name,
                load,
                r.requests_ok,
                r.requests_failed,
                ms(r.ttft, true),
                ms(r.ttft, false),
                ms(r.tpot, true),
                r.output_throughput_tok_s
            );
        }
        for t in &self.tenants {
            for e in &t.report.errors {
                let _ = writeln!(s, "  {}: {} × {}", t.name, e.count, e.message);
            }
        }
        s
    }
}
