//! From TOML text to a [`ClusterSpec`]: serde reads the file into spanned raw tables
//! (unknown keys refused), then every value is checked here so that each error can
//! point at the exact key that is wrong.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use crate::error::{self, TopologyError};
use crate::{
    BUILTIN_MODELS, Backend, ChipSpec, ClusterSpec, GatewaySpec, HostSpec, Role, RouterPolicy, RouterSpec,
    SupervisorSpec, catalog,
};

const DTYPES: &[&str] = &["f32", "f16", "bf16"];
const MAX_BLOCK_SIZE: usize = 4096;
const MAX_THREADS: usize = 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDoc {
    cluster: Spanned<RawCluster>,
    #[serde(default)]
    router: Option<Spanned<RawRouter>>,
    #[serde(default)]
    supervisor: Option<Spanned<RawSupervisor>>,
    #[serde(default)]
    gateway: Option<Spanned<RawGateway>>,
    #[serde(default)]
    hosts: Vec<Spanned<RawHost>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    name: Option<Spanned<String>>,
    model: Spanned<String>,
    #[serde(default)]
    dtype: Option<Spanned<String>>,
    #[serde(default)]
    kv_dtype: Option<Spanned<String>>,
    #[serde(default)]
    block_size: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouter {
    #[serde(default)]
    policy: Option<Spanned<String>>,
    #[serde(default)]
    max_queued_requests: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSupervisor {
    #[serde(default)]
    heartbeat_interval_ms: Option<Spanned<u64>>,
    #[serde(default)]
    heartbeat_timeout_ms: Option<Spanned<u64>>,
    #[serde(default)]
    max_restarts: Option<Spanned<u32>>,
    #[serde(default)]
    restart_window_s: Option<Spanned<u64>>,
    #[serde(default)]
    restart_backoff_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGateway {
    #[serde(default)]
    host: Option<Spanned<String>>,
    #[serde(default)]
    listen: Option<Spanned<String>>,
    #[serde(default)]
    served_model_name: Option<Spanned<String>>,
    #[serde(default)]
    max_inflight_requests: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: Spanned<String>,
    bus: Spanned<String>,
    #[serde(default)]
    events: Option<Spanned<String>>,
    #[serde(default)]
    chips: Vec<Spanned<RawChip>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawChip {
    id: Spanned<String>,
    kind: Spanned<String>,
    backend: Spanned<String>,
    #[serde(default)]
    role: Option<Spanned<String>>,
    #[serde(default)]
    memory_limit: Option<Spanned<toml::Value>>,
    #[serde(default)]
    threads: Option<Spanned<usize>>,
    #[serde(default)]
    max_batch_tokens: Option<Spanned<usize>>,
    #[serde(default)]
    max_batch_seqs: Option<Spanned<usize>>,
}

/// The file being checked: builds errors that point into it.
struct Checker<'a> {
    text: &'a str,
    source: &'a str,
    /// Directory relative paths are resolved against; `None` keeps them as written.
    base: Option<&'a Path>,
}

impl Checker<'_> {
    fn err(&self, span: Range<usize>, key: impl Into<String>, message: impl Into<String>) -> TopologyError {
        TopologyError::at(self.source, self.text, span, key.into(), message.into())
    }

    fn line_of(&self, span: &Range<usize>) -> usize {
        error::line_column(self.text, span.start).0
    }

    fn resolve(&self, path: &str) -> PathBuf {
        match self.base {
            Some(base) if Path::new(path).is_relative() => base.join(path),
            _ => PathBuf::from(path),
        }
    }

    /// `value` if set, after `check`; `default` otherwise.
    fn field<T: Copy>(
        &self,
        value: &Option<Spanned<T>>,
        key: &str,
        default: T,
        check: impl Fn(T) -> Result<(), String>,
    ) -> Result<T, TopologyError> {
        match value {
            None => Ok(default),
            Some(value) => {
                let inner = *value.get_ref();
                check(inner).map_err(|message| self.err(value.span(), key, message))?;
                Ok(inner)
            }
        }
    }

    fn dtype(&self, value: &Spanned<String>, key: &str) -> Result<String, TopologyError> {
        let dtype = value.get_ref();
        if DTYPES.contains(&dtype.as_str()) {
            Ok(dtype.clone())
        } else {
            Err(self.err(value.span(), key, format!("unknown dtype `{dtype}`; expected one of {}", DTYPES.join(", "))))
        }
    }

    fn address(&self, value: &Spanned<String>, key: &str) -> Result<SocketAddr, TopologyError> {
        parse_address(value.get_ref()).map_err(|message| self.err(value.span(), key, message))
    }
}

fn at_least_one<T: PartialOrd + From<u8>>(value: T) -> Result<(), String> {
    if value >= T::from(1) { Ok(()) } else { Err("must be at least 1".to_owned()) }
}

fn in_range(low: usize, high: usize) -> impl Fn(usize) -> Result<(), String> {
    move |value| {
        if (low..=high).contains(&value) { Ok(()) } else { Err(format!("{value} is out of range {low}..={high}")) }
    }
}

pub(crate) fn parse(text: &str, source: &str, base: Option<&Path>) -> Result<ClusterSpec, TopologyError> {
    let raw: RawDoc = toml::from_str(text).map_err(|e| error::from_toml(source, text, &e))?;
    let checker = Checker { text, source, base };
    checker.cluster(raw)
}

impl Checker<'_> {
    fn cluster(&self, raw: RawDoc) -> Result<ClusterSpec, TopologyError> {
        let cluster_span = raw.cluster.span();
        let cluster = raw.cluster.into_inner();

        let name = match &cluster.name {
            Some(name) => self.name(name, "cluster.name")?,
            None => "default".to_owned(),
        };
        let model = self.model(&cluster.model)?;
        let dtype = cluster.dtype.as_ref().map(|dtype| self.dtype(dtype, "cluster.dtype")).transpose()?;
        let kv_dtype = match &cluster.kv_dtype {
            Some(kv_dtype) => self.dtype(kv_dtype, "cluster.kv_dtype")?,
            None => "f32".to_owned(),
        };
        let block_size = self.field(&cluster.block_size, "cluster.block_size", 16, in_range(1, MAX_BLOCK_SIZE))?;

        let router = self.router(raw.router.as_ref().map(Spanned::get_ref))?;
        let supervisor = self.supervisor(raw.supervisor.as_ref().map(Spanned::get_ref))?;

        if raw.hosts.is_empty() {
            return Err(self.err(
                cluster_span,
                "hosts",
                "the cluster has no hosts: add a [[hosts]] table with at least one [[hosts.chips]]",
            ));
        }
        let hosts = self.hosts(&raw.hosts)?;
        let gateway = self.gateway(raw.gateway.as_ref().map(Spanned::get_ref), &hosts)?;
        self.sockets_are_distinct(&raw.hosts, &hosts, raw.gateway.as_ref().map(Spanned::get_ref), &gateway)?;
        self.roles_cover_both_phases(&raw.hosts, &hosts)?;

        Ok(ClusterSpec {
            source: self.source.to_owned(),
            name,
            model,
            dtype,
            kv_dtype,
            block_size,
            hosts,
            router,
            supervisor,
            gateway,
        })
    }

    /// Host names and chip ids end up in bus identities and metric labels.
    fn name(&self, value: &Spanned<String>, key: &str) -> Result<String, TopologyError> {
        let name = value.get_ref();
        if name.is_empty() {
            return Err(self.err(value.span(), key, "must not be empty"));
        }
        if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
            return Err(self.err(
                value.span(),
                key,
                format!("`{name}` contains {bad:?}; use ASCII letters, digits, '-', '_' and '.'"),
            ));
        }
        Ok(name.clone())
    }

    fn model(&self, value: &Spanned<String>) -> Result<String, TopologyError> {
        let model = value.get_ref();
        if model.is_empty() {
            return Err(self.err(
                value.span(),
                "cluster.model",
                format!("must name a checkpoint directory or one of {}", BUILTIN_MODELS.join(", ")),
            ));
        }
        if model.starts_with("builtin:") {
            if BUILTIN_MODELS.contains(&model.as_str()) {
                return Ok(model.clone());
            }
            return Err(self.err(
                value.span(),
                "cluster.model",
                format!("unknown builtin model `{model}`; builtin models: {}", BUILTIN_MODELS.join(", ")),
            ));
        }
        Ok(self.resolve(model).display().to_string())
    }

    fn router(&self, raw: Option<&RawRouter>) -> Result<RouterSpec, TopologyError> {
        let Some(raw) = raw else {
            return Ok(RouterSpec { policy: RouterPolicy::LeastLoaded, max_queued_requests: 256 });
        };
        let policy = match &raw.policy {
            None => RouterPolicy::LeastLoaded,
            Some(policy) => match policy.get_ref().as_str() {
                "least-loaded" => RouterPolicy::LeastLoaded,
                other => {
                    return Err(self.err(
                        policy.span(),
                        "router.policy",
                        format!("unknown router policy `{other}`; expected \"least-loaded\""),
                    ));
                }
            },
        };
        let max_queued_requests =
            self.field(&raw.max_queued_requests, "router.max_queued_requests", 256, at_least_one)?;
        Ok(RouterSpec { policy, max_queued_requests })
    }

    fn supervisor(&self, raw: Option<&RawSupervisor>) -> Result<SupervisorSpec, TopologyError> {
        let defaults = SupervisorSpec {
            heartbeat_interval_ms: 100,
            heartbeat_timeout_ms: 1000,
            max_restarts: 3,
            restart_window_s: 60,
            restart_backoff_ms: 200,
        };
        let Some(raw) = raw else { return Ok(defaults) };
        let spec = SupervisorSpec {
            heartbeat_interval_ms: self.field(
                &raw.heartbeat_interval_ms,
                "supervisor.heartbeat_interval_ms",
                defaults.heartbeat_interval_ms,
                at_least_one,
            )?,
            heartbeat_timeout_ms: self.field(
                &raw.heartbeat_timeout_ms,
                "supervisor.heartbeat_timeout_ms",
                defaults.heartbeat_timeout_ms,
                at_least_one,
            )?,
            max_restarts: self.field(
                &raw.max_restarts,
                "supervisor.max_restarts",
                defaults.max_restarts,
                |_| Ok(()),
            )?,
            restart_window_s: self.field(
                &raw.restart_window_s,
                "supervisor.restart_window_s",
                defaults.restart_window_s,
                at_least_one,
            )?,
            restart_backoff_ms: self.field(
                &raw.restart_backoff_ms,
                "supervisor.restart_backoff_ms",
                defaults.restart_backoff_ms,
                |_| Ok(()),
            )?,
        };
        if spec.heartbeat_timeout_ms <= spec.heartbeat_interval_ms {
            // Point at whichever of the two the file sets, the timeout first.
            let (span, key) = match (&raw.heartbeat_timeout_ms, &raw.heartbeat_interval_ms) {
                (Some(timeout), _) => (timeout.span(), "supervisor.heartbeat_timeout_ms"),
                (None, Some(interval)) => (interval.span(), "supervisor.heartbeat_interval_ms"),
                (None, None) => (0..0, "supervisor.heartbeat_timeout_ms"),
            };
            return Err(self.err(
                span,
                key,
                format!(
                    "heartbeat_timeout_ms ({}) must be greater than heartbeat_interval_ms ({}), \
                     or every chip would be declared dead between two heartbeats",
                    spec.heartbeat_timeout_ms, spec.heartbeat_interval_ms
                ),
            ));
        }
        Ok(spec)
    }

    fn hosts(&self, raw: &[Spanned<RawHost>]) -> Result<Vec<HostSpec>, TopologyError> {
        let mut host_names: HashMap<&str, (usize, Range<usize>)> = HashMap::new();
        let mut chip_ids: HashMap<&str, (String, Range<usize>)> = HashMap::new();
        let mut hosts = Vec::with_capacity(raw.len());
        for (h, raw_host) in raw.iter().enumerate() {
            let host = raw_host.get_ref();
            let key = format!("hosts[{h}]");
            let name = self.name(&host.name, &format!("{key}.name"))?;
            if let Some((first, first_span)) = host_names.get(host.name.get_ref().as_str()) {
                return Err(self.err(
                    host.name.span(),
                    format!("{key}.name"),
                    format!("host name `{name}` is already used by hosts[{first}] (line {})", self.line_of(first_span)),
                ));
            }
            host_names.insert(host.name.get_ref(), (h, host.name.span()));

            let bus = self.address(&host.bus, &format!("{key}.bus"))?;
            let events = match &host.events {
                Some(events) => self.address(events, &format!("{key}.events"))?,
                None => match bus.port().checked_add(1) {
                    Some(port) => SocketAddr::new(bus.ip(), port),
                    None => {
                        return Err(self.err(
                            host.bus.span(),
                            format!("{key}.bus"),
                            format!(
                                "`events` defaults to the bus port + 1, which does not exist for port {}; \
                                 set `{key}.events`",
                                bus.port()
                            ),
                        ));
                    }
                },
            };

            if host.chips.is_empty() {
                return Err(self.err(
                    raw_host.span(),
                    format!("{key}.chips"),
                    format!("host `{name}` has no chips: add a [[hosts.chips]] table after its [[hosts]]"),
                ));
            }
            let mut chips = Vec::with_capacity(host.chips.len());
            for (c, raw_chip) in host.chips.iter().enumerate() {
                let chip_key = format!("{key}.chips[{c}]");
                let chip = self.chip(raw_chip.get_ref(), &chip_key)?;
                let id = raw_chip.get_ref().id.get_ref().as_str();
                if let Some((first, first_span)) = chip_ids.get(id) {
                    return Err(self.err(
                        raw_chip.get_ref().id.span(),
                        format!("{chip_key}.id"),
                        format!("chip id `{id}` is already used by {first} (line {})", self.line_of(first_span)),
                    ));
                }
                chip_ids.insert(id, (chip_key, raw_chip.get_ref().id.span()));
                chips.push(chip);
            }
            hosts.push(HostSpec { name, bus, events, chips });
        }
        Ok(hosts)
    }

    fn chip(&self, raw: &RawChip, key: &str) -> Result<ChipSpec, TopologyError> {
        let id = self.name(&raw.id, &format!("{key}.id"))?;
        let kind = raw.kind.get_ref();
        if catalog::lookup(kind).is_none() {
            let known: Vec<&str> = catalog::kinds().iter().map(|kind| kind.name).collect();
            return Err(self.err(
                raw.kind.span(),
                format!("{key}.kind"),
                format!("unknown chip kind `{kind}`; known kinds: {}", known.join(", ")),
            ));
        }
        let backend = self.backend(&raw.backend, &format!("{key}.backend"))?;
        let role = match &raw.role {
            None => Role::Both,
            Some(role) => match role.get_ref().as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                "both" => Role::Both,
                other => {
                    return Err(self.err(
                        role.span(),
                        format!("{key}.role"),
                        format!("unknown role `{other}`; expected prefill, decode or both"),
                    ));
                }
            },
        };
        let memory_limit_bytes = raw.memory_limit.as_ref().map(|limit| self.memory(limit, key)).transpose()?;
        Ok(ChipSpec {
            id,
            kind: kind.clone(),
            backend,
            role,
            memory_limit_bytes,
            threads: self.field(&raw.threads, &format!("{key}.threads"), 1, in_range(1, MAX_THREADS))?,
            max_batch_tokens: self.field(
                &raw.max_batch_tokens,
                &format!("{key}.max_batch_tokens"),
                512,
                at_least_one,
            )?,
            max_batch_seqs: self.field(&raw.max_batch_seqs, &format!("{key}.max_batch_seqs"), 64, at_least_one)?,
        })
    }

    fn backend(&self, value: &Spanned<String>, key: &str) -> Result<Backend, TopologyError> {
        let backend = value.get_ref().as_str();
        let refuse = |message: String| Err(self.err(value.span(), key, message));
        if backend == "cpu" {
            return Ok(Backend::Cpu);
        }
        if let Some(path) = backend.strip_prefix("plugin:") {
            if path.trim().is_empty() {
                return refuse("`plugin:` needs the path of a kernel library, e.g. \"plugin:/opt/lib.so\"".to_owned());
            }
            return Ok(Backend::Plugin(self.resolve(path)));
        }
        if let Some(kind) = backend.strip_prefix("emu:") {
            return refuse(format!(
                "backend `{backend}` (a CPU emulating a `{kind}` chip) is not available yet: the emu backend \
                 arrives with disaggregation; use \"cpu\" or \"plugin:PATH\""
            ));
        }
        if backend == "sim" {
            return refuse(
                "backend `sim` is not available yet in a topology; use \"cpu\" or \"plugin:PATH\"".to_owned(),
            );
        }
        refuse(format!("unknown backend `{backend}`; expected \"cpu\" or \"plugin:PATH\""))
    }

    fn memory(&self, value: &Spanned<toml::Value>, chip_key: &str) -> Result<u64, TopologyError> {
        let key = format!("{chip_key}.memory_limit");
        let bytes = match value.get_ref() {
            toml::Value::Integer(bytes) => u64::try_from(*bytes).map_err(|_| format!("{bytes} is negative")),
            toml::Value::String(text) => parse_memory_size(text),
            other => {
                Err(format!("expected bytes as an integer or a string like \"512MiB\", found a {}", other.type_str()))
            }
        };
        match bytes {
            Ok(0) => Err(self.err(value.span(), key, "must be more than 0 bytes; leave it out for no limit")),
            Ok(bytes) => Ok(bytes),
            Err(message) => Err(self.err(value.span(), key, message)),
        }
    }

    fn gateway(&self, raw: Option<&RawGateway>, hosts: &[HostSpec]) -> Result<GatewaySpec, TopologyError> {
        let first_host = hosts.first().map(|host| host.name.clone()).unwrap_or_default();
        let default_listen = SocketAddr::from(([127, 0, 0, 1], 8000));
        let Some(raw) = raw else {
            return Ok(GatewaySpec {
                host: first_host,
                listen: default_listen,
                served_model_name: None,
                max_inflight_requests: 256,
            });
        };
        let host = match &raw.host {
            None => first_host,
            Some(host) => {
                if !hosts.iter().any(|known| &known.name == host.get_ref()) {
                    let names: Vec<&str> = hosts.iter().map(|host| host.name.as_str()).collect();
                    return Err(self.err(
                        host.span(),
                        "gateway.host",
                        format!("`{}` is not a host of this cluster; hosts: {}", host.get_ref(), names.join(", ")),
                    ));
                }
                host.get_ref().clone()
            }
        };
        let listen = match &raw.listen {
            None => default_listen,
            Some(listen) => self.address(listen, "gateway.listen")?,
        };
        let served_model_name = match &raw.served_model_name {
            Some(name) if name.get_ref().trim().is_empty() => {
                return Err(self.err(name.span(), "gateway.served_model_name", "must not be empty"));
            }
            other => other.as_ref().map(|name| name.get_ref().clone()),
        };
        let max_inflight_requests =
            self.field(&raw.max_inflight_requests, "gateway.max_inflight_requests", 256, at_least_one)?;
        Ok(GatewaySpec { host, listen, served_model_name, max_inflight_requests })
    }

    /// Two sockets bound to one address would fail at start-up, on some host, late.
    fn sockets_are_distinct(
        &self,
        raw_hosts: &[Spanned<RawHost>],
        hosts: &[HostSpec],
        raw_gateway: Option<&RawGateway>,
        gateway: &GatewaySpec,
    ) -> Result<(), TopologyError> {
        // (address, key, span, note for a defaulted address)
        let mut sockets: Vec<(SocketAddr, String, Range<usize>, &str)> = Vec::new();
        for (h, (raw, host)) in raw_hosts.iter().zip(hosts).enumerate() {
            let raw = raw.get_ref();
            sockets.push((host.bus, format!("hosts[{h}].bus"), raw.bus.span(), ""));
            match &raw.events {
                Some(events) => sockets.push((host.events, format!("hosts[{h}].events"), events.span(), "")),
                None => sockets.push((
                    host.events,
                    format!("hosts[{h}].events"),
                    raw.bus.span(),
                    " (by default: the bus port + 1)",
                )),
            }
        }
        let gateway_span = raw_gateway.and_then(|raw| raw.listen.as_ref()).map_or(0..0, Spanned::span);
        let gateway_note = if raw_gateway.is_some_and(|raw| raw.listen.is_some()) { "" } else { " (by default)" };
        sockets.push((gateway.listen, "gateway.listen".to_owned(), gateway_span, gateway_note));

        let mut seen: HashMap<SocketAddr, usize> = HashMap::new();
        for (i, (address, key, span, note)) in sockets.iter().enumerate() {
            if let Some(&first) = seen.get(address) {
                let (_, first_key, first_span, first_note) = &sockets[first];
                return Err(self.err(
                    span.clone(),
                    key.clone(),
                    format!(
                        "address {address}{note} is already taken by `{first_key}`{first_note} (line {}); \
                         every socket needs its own address",
                        self.line_of(first_span)
                    ),
                ));
            }
            seen.insert(*address, i);
        }
        Ok(())
    }

    /// A cluster that cannot prefill or cannot decode cannot finish any request.
    fn roles_cover_both_phases(&self, raw_hosts: &[Spanned<RawHost>], hosts: &[HostSpec]) -> Result<(), TopologyError> {
        let roles = || hosts.iter().flat_map(|host| host.chips.iter().map(|chip| chip.role));
        let missing = if !roles().any(Role::prefills) {
            "prefill"
        } else if !roles().any(Role::decodes) {
            "decode"
        } else {
            return Ok(());
        };
        // Point at the first chip's role (or the chip, when the role is defaulted).
        let (span, key) = match raw_hosts.first().and_then(|host| host.get_ref().chips.first()) {
            Some(chip) => match &chip.get_ref().role {
                Some(role) => (role.span(), "hosts[0].chips[0].role"),
                None => (chip.span(), "hosts[0].chips[0]"),
            },
            None => (0..0, "hosts"),
        };
        Err(self.err(
            span,
            key,
            format!("no chip of the cluster can {missing}: give at least one chip role = \"{missing}\" or \"both\""),
        ))
    }
}

/// `host:port` or `tcp://host:port`, with an IP address and a port other than 0.
fn parse_address(text: &str) -> Result<SocketAddr, String> {
    let bare = match text.split_once("://") {
        Some(("tcp", rest)) => rest,
        Some((scheme, _)) => return Err(format!("`{text}`: only tcp:// addresses are supported, not {scheme}://")),
        None => text,
    };
    let address: SocketAddr = bare.parse().map_err(|_| {
        format!("`{text}` is not an IP:PORT address such as \"127.0.0.1:7400\" (host names are not resolved)")
    })?;
    if address.port() == 0 {
        return Err(format!("`{text}`: port 0 is not allowed; other hosts need a fixed port to connect to"));
    }
    Ok(address)
}

/// Bytes in `"512MiB"`, `"2 GB"`, `"4096"`: an integer and an optional unit, B, KB,
/// MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), any case.
pub(crate) fn parse_memory_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let bad = || format!("`{text}` is not a memory size such as \"512MiB\", \"2GB\" or 1048576 (bytes)");
    if digits.is_empty() {
        return Err(bad());
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|count| count.checked_mul(multiplier))
        .ok_or_else(|| format!("`{text}` is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes() {
        let table: &[(&str, Option<u64>)] = &[
            ("4096", Some(4096)),
            ("512B", Some(512)),
            ("1KB", Some(1000)),
            ("1kib", Some(1024)),
            ("512MiB", Some(512 << 20)),
            ("512 MiB", Some(512 << 20)),
            ("3mb", Some(3_000_000)),
            ("2GB", Some(2_000_000_000)),
            ("2GiB", Some(2 << 30)),
            ("1TiB", Some(1 << 40)),
            ("0", Some(0)),
            ("", None),
            ("MiB", None),
            ("1.5GiB", None),
            ("-1", None),
            ("12 parsecs", None),
            ("99999999999TiB", None),
        ];
        for (text, expected) in table {
            assert_eq!(parse_memory_size(text).ok(), *expected, "{text:?}");
        }
    }

    #[test]
    fn addresses() {
        let ok = |text: &str| parse_address(text).ok().map(|address| address.to_string());
        assert_eq!(ok("127.0.0.1:7400"), Some("127.0.0.1:7400".to_owned()));
        assert_eq!(ok("tcp://10.0.0.2:7400"), Some("10.0.0.2:7400".to_owned()));
        assert_eq!(ok("[::1]:7400"), Some("[::1]:7400".to_owned()));
        for bad in ["localhost:7400", "127.0.0.1", "127.0.0.1:0", "ipc://x:1", "127.0.0.1:70000"] {
            assert_eq!(ok(bad), None, "{bad}");
        }
    }
}
