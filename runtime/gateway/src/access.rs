//! Who may call which route: the `Authorization: Bearer` key of every `/v1/*` request
//! (when the cluster has a keys file) resolved to its tenant, and of every `/admin/*`
//! request to a role of `operator` or more (the keys file's keys, or the admin token
//! `tessera up` made when there is none). Every admin call, refused or not, and refused
//! authentications (at most [`FAILURES_LOGGED_PER_MIN`] a minute, then a count) go to
//! the audit log.
//!
//! The keys file is re-read when it changes (checked at most once a second), so keys
//! added or revoked take effect without a restart; a file that no longer reads keeps the
//! keys last read, with an error in the log.

use crate::openai::ApiError;
use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use parking_lot::Mutex;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tessera_access::token::AdminToken;
use tessera_access::{AuditLog, AuthError, Identity, KeyStore, Role};
use tessera_topology::OPEN_TENANT;

/// Refused authentications written to the audit log per minute; past it they are counted
/// and the count is written with the next one logged.
pub const FAILURES_LOGGED_PER_MIN: u32 = 30;
/// How often, at most, the keys file's stamp is looked at.
const KEYS_CHECK_EVERY: Duration = Duration::from_secs(1);

/// A tenant as the gateway sees it.
#[derive(Debug, Clone)]
pub struct TenantView {
    pub name: String,
    /// Served model names its keys may use; `None`: any.
    pub models: Option<Vec<String>>,
}

/// How the gateway checks callers.
pub struct AccessConfig {
    /// The keys file; `None`: `/v1/*` is open and `/admin/*` takes `admin_token`.
    pub keys_file: Option<PathBuf>,
    pub admin_token: Option<AdminToken>,
    pub audit: AuditLog,
    /// The cluster's tenants in admission's order; empty: one open tenant.
    pub tenants: Vec<TenantView>,
    /// The model this gateway serves (a tenant's `models` must name it).
    pub served_model: String,
}

/// The caller of a `/v1/*` request, as its handler reads it.
#[derive(Debug, Clone)]
pub struct Caller {
    pub key_id: String,
    /// Index into admission's tenants.
    pub tenant: u32,
    pub tenant_name: String,
}

impl Caller {
    /// Anyone, in a cluster whose `/v1/*` is open: its one open tenant.
    pub fn open() -> Caller {
        Caller { key_id: "anonymous".into(), tenant: 0, tenant_name: OPEN_TENANT.to_owned() }
    }
}

struct KeysState {
    store: Arc<KeyStore>,
    stamp: Option<(u64, SystemTime)>,
    checked: Instant,
}

struct FailureLog {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
}

pub struct Access {
    config: AccessConfig,
    keys: Mutex<KeysState>,
    failures: Mutex<FailureLog>,
}

impl Access {
    /// Reads the keys file, if any: a missing or unreadable one is an error here, at start.
    pub fn new(config: AccessConfig) -> Result<Access, tessera_access::KeysError> {
        let (store, stamp) = match &config.keys_file {
            Some(path) => (KeyStore::load(path)?, tessera_access::keys::stamp(path)),
            None => (KeyStore::default(), None),
        };
        let now = Instant::now();
        Ok(Access {
            config,
            keys: Mutex::new(KeysState { store: Arc::new(store), stamp, checked: now }),
            failures: Mutex::new(FailureLog { window_start: now, logged: 0, suppressed: 0 }),
        })
    }

    pub fn audit(&self) -> &AuditLog {
        &self.config.audit
    }

    pub fn key_count(&self) -> usize {
        self.keys.lock().store.len()
    }

    /// The keys, re-read if the file changed since it was last looked at.
    fn store(&self) -> Arc<KeyStore> {
        let mut keys = self.keys.lock();
        let Some(path) = &self.config.keys_file else { return keys.store.clone() };
        if keys.checked.elapsed() >= KEYS_CHECK_EVERY {
            keys.checked = Instant::now();
            let stamp = tessera_access::keys::stamp(path);
            if stamp != keys.stamp {
                keys.stamp = stamp;
                match KeyStore::load(path) {
                    Ok(store) => {
                        tracing::info!(keys = store.len(), file = %path.display(), "keys file re-read");
                        keys.store = Arc::new(store);
                    }
                    Err(e) => tracing::error!("{e}; keeping the {} keys read before", keys.store.len()),
                }
            }
        }
        keys.store.clone()
    }

    /// The identity of a request's `Authorization` header.
    fn identify(&self, authorization: Option<&str>) -> Result<Identity, AuthError> {
        match (&self.config.keys_file, &self.config.admin_token) {
            (Some(_), _) => self.store().authenticate(authorization),
            (None, Some(token)) => token.authenticate(authorization),
            (None, None) => Err(AuthError::Invalid),
        }
    }

    /// Writes a refused authentication to the audit log, unless this minute's share is
    /// spent (then it is counted, and the count written with the next one).
    fn log_failure(self: &Arc<Self>, route: &str, reason: &str) {
        metrics::counter!("tessera_gateway_auth_failures_total", "reason" => reason.to_owned()).increment(1);
        let suppressed = {
            let mut f = self.failures.lock();
            if f.window_start.elapsed() >= Duration::from_secs(60) {
                f.window_start = Instant::now();
                f.logged = 0;
            }
            if f.logged >= FAILURES_LOGGED_PER_MIN {
                f.suppressed += 1;
                return;
            }
            f.logged += 1;
            std::mem::take(&mut f.suppressed)
        };
        let details = json!({ "route": route, "reason": reason, "suppressed_before": suppressed });
        self.write_audit("auth_failed", "anonymous".to_owned(), details);
    }

    /// Appends to the audit log off the async runtime, without waiting.
    fn write_audit(self: &Arc<Self>, event: &'static str, who: String, details: serde_json::Value) {
        let access = self.clone();
        tokio::task::spawn_blocking(move || access.append(event, &who, details));
    }

    /// Appends to the audit log; a failure is logged and counted (the call it records has
    /// been answered already).
    pub fn append(&self, event: &str, who: &str, details: serde_json::Value) {
        if let Err(e) = self.config.audit.append(event, who, details) {
            metrics::counter!("tessera_audit_write_errors_total").increment(1);
            tracing::error!("{e}");
        }
    }
}

fn unauthorized(e: AuthError) -> Response {
    crate::server::error_response(ApiError::unauthorized(e.to_string(), e.reason()))
}

/// The middleware: `/admin/*` needs an operator, `/v1/*` a key when there is a keys
/// file; other routes (`/health`, `/metrics`) are open.
pub async fn authorize(access: Arc<Access>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    let authorization = req.headers().get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or("?").to_owned());
    if path == "/admin" || path.starts_with("/admin/") {
        let method = req.method().to_string();
        let who = match access.identify(authorization.as_deref()) {
            Ok(who) => who,
            Err(e) => {
                access.log_failure(&path, e.reason());
                return unauthorized(e);
            }
        };
        if who.role < Role::Operator {
            let details = json!({ "method": method, "route": path, "status": 403, "role": who.role.as_str() });
            access.write_audit("admin_denied", who.key_id.clone(), details);
            return crate::server::error_response(ApiError::forbidden(format!(
                "The {} route needs an operator or admin key; this key's role is `{}`.",
                path, who.role
            )));
        }
        let response = next.run(req).await;
        let status = response.status().as_u16();
        let details = json!({ "method": method, "route": path, "status": status, "role": who.role.as_str() });
        let (access, key) = (access.clone(), who.key_id);
        // Written before the answer goes out, so an action answered is an action recorded.
        let _ = tokio::task::spawn_blocking(move || access.append("admin_action", &key, details)).await;
        return response;
    }
    if path == "/v1" || path.starts_with("/v1/") {
        let caller = match &access.config.keys_file {
            None => Caller::open(),
            Some(_) => {
                let who = match access.store().authenticate(authorization.as_deref()) {
                    Ok(who) => who,
                    Err(e) => {
                        access.log_failure(&path, e.reason());
                        return unauthorized(e);
                    }
                };
                let tenants = &access.config.tenants;
                let index =
                    if tenants.is_empty() { Some(0) } else { tenants.iter().position(|t| t.name == who.tenant) };
                let Some(index) = index else {
                    access.log_failure(&path, "unknown_tenant");
                    return crate::server::error_response(ApiError::forbidden(format!(
                        "This key's tenant `{}` is not a tenant of this cluster.",
                        who.tenant
                    )));
                };
                let tenant = tenants.get(index);
                if let Some(models) = tenant.and_then(|t| t.models.as_ref())
                    && !models.contains(&access.config.served_model)
                {
                    return crate::server::error_response(ApiError::model_not_allowed(&access.config.served_model));
                }
                let tenant_name = tenant.map_or_else(|| OPEN_TENANT.to_owned(), |t| t.name.clone());
                Caller { key_id: who.key_id, tenant: index as u32, tenant_name }
            }
        };
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}
