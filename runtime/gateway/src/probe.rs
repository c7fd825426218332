//! The probe endpoint of a host without the gateway: `/health` (ready: 200 while the host
//! serves; 503 while it has not joined the cluster yet, or has lost it, and once it
//! drains), `/health/live` (200 while the process answers) and
//! `/metrics` (this process's Prometheus samples). Orchestrators (Kubernetes probes,
//! Prometheus scrapes) reach every host through it, not only the gateway's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

use crate::listener::{self, HttpLimits};

/// Why the host cannot serve now (`Err`), asked on every readiness probe.
pub type JoinedCheck = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What the probe endpoint reports about its host.
pub struct HostProbe {
    pub host: String,
    pub chips: usize,
    pub metrics: Option<PrometheusHandle>,
    joined: JoinedCheck,
    draining: AtomicBool,
}

impl HostProbe {
    /// `joined` says whether the host is part of the cluster now (e.g. its bus link to
    /// the gateway's host is up).
    pub fn new(host: String, chips: usize, metrics: Option<PrometheusHandle>, joined: JoinedCheck) -> HostProbe {
        HostProbe { host, chips, metrics, joined, draining: AtomicBool::new(false) }
    }

    /// From now on `/health` answers 503, so the host is taken out of rotation while it
    /// drains; `/health/live` still answers.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}

pub fn routes(probe: Arc<HostProbe>) -> Router {
    Router::new()
        .route("/health", get(ready))
        .route("/health/live", get(live))
        .route("/metrics", get(prometheus))
        .with_state(probe)
}

async fn ready(State(p): State<Arc<HostProbe>>) -> Response {
    let (status, state, reason) = if p.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining", None)
    } else {
        match (p.joined)() {
            Ok(()) => (StatusCode::OK, "ok", None),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, "joining", Some(why)),
        }
    };
    let mut body = json!({"host": p.host, "status": state, "chips": p.chips});
    if let Some(why) = reason {
        body["reason"] = why.into();
    }
    (status, axum::Json(body)).into_response()
}

async fn live(State(p): State<Arc<HostProbe>>) -> Response {
    axum::Json(json!({"host": p.host, "status": "alive"})).into_response()
}

async fn prometheus(State(p): State<Arc<HostProbe>>) -> Response {
    match &p.metrics {
        Some(handle) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "metrics are not enabled in this process\n").into_response(),
    }
}

/// Serves the probe endpoint until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    probe: Arc<HostProbe>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = HttpLimits { max_connections: 64, header_read_timeout: std::time::Duration::from_secs(10) };
    listener::serve(listener, routes(probe), limits, shutdown).await
}
