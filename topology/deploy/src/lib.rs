//! Kubernetes manifests rendered from a topology (`tessera deploy k8s`), so the topology
//! file stays the one source of truth: one StatefulSet per host (one pod, one
//! `tessera node`), a headless Service that gives each pod the DNS name the rendered
//! topology uses for its bus, a Service for the gateway, probes on `/health`, Prometheus
//! scrape annotations, the topology in a ConfigMap and host keys in Secrets (kustomize
//! generators, so a changed file rolls the pods), resources and a node selector per chip
//! kind. Depends on the topology crate only; it writes text and starts nothing.
#![forbid(unsafe_code)]

mod yaml;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};
use tessera_topology::{Backend, ClusterSpec, SecurityMode};

/// Where the rendered files put things inside a pod.
const TOPOLOGY_DIR: &str = "/etc/tessera";
const KEYS_DIR: &str = "/etc/tessera/keys";
const MODELS_DIR: &str = "/models";
const HOME_DIR: &str = "/var/lib/tessera";
/// The headless Service that names the pods (`tessera-<host>-0.tessera-bus`).
const BUS_SERVICE: &str = "tessera-bus";

#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error("{0}")]
    Unsupported(String),
    #[error("the topology file does not parse as TOML again: {0}")]
    Toml(String),
    #[error("writing {path}: {source}")]
    Write { path: String, source: std::io::Error },
}

/// Choices the topology does not make.
#[derive(Debug, Clone)]
pub struct K8sOptions {
    /// The container image (built from the repository's Dockerfile).
    pub image: String,
    /// The probe port of hosts without the gateway (`tessera node --probe-listen`).
    pub probe_port: u16,
    /// How long a draining host may wait for its requests (`--drain-timeout-s`); the
    /// pod's grace period is this plus 15 s.
    pub drain_timeout_s: u64,
}

impl Default for K8sOptions {
    fn default() -> Self {
        K8sOptions { image: "tessera:latest".to_owned(), probe_port: 9000, drain_timeout_s: 30 }
    }
}

/// The rendered files: relative path and contents, in a fixed order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub files: Vec<(String, String)>,
}

impl Rendered {
    /// Writes every file under `dir` (created if missing); existing files of the same
    /// names are replaced, others are left alone (the keys under `keys/`).
    pub fn write(&self, dir: &Path) -> Result<(), DeployError> {
        let failed = |path: &Path, source| DeployError::Write { path: path.display().to_string(), source };
        std::fs::create_dir_all(dir).map_err(|e| failed(dir, e))?;
        for (name, text) in &self.files {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|e| failed(&path, e))?;
        }
        Ok(())
    }
}

/// A host's Kubernetes name: `tessera-` and the host name as a DNS label.
fn workload_name(host: &str) -> String {
    let label: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    format!("tessera-{}", label.trim_matches('-'))
}

/// The pod's DNS name under the headless Service, resolved through the pod's search
/// path, so the manifests work in any namespace.
fn pod_dns(host: &str) -> String {
    format!("{}-0.{BUS_SERVICE}", workload_name(host))
}

/// The device plugin resource a chip kind's vendor registers, for chips that drive a
/// real device (`plugin:` backends); emulated and CPU chips run on CPU.
fn device_resource(vendor: &str) -> Option<&'static str> {
    match vendor {
        "NVIDIA" => Some("nvidia.com/gpu"),
        "Huawei" => Some("huawei.com/Ascend910"),
        "Cambricon" => Some("cambricon.com/mlu"),
        "MetaX" => Some("metax-tech.com/gpu"),
        "Biren" => Some("birentech.com/gpu"),
        _ => None,
    }
}

/// Renders `spec` (read from `text`) for Kubernetes.
pub fn render_k8s(spec: &ClusterSpec, text: &str, opts: &K8sOptions) -> Result<Rendered, DeployError> {
    check_names(spec)?;
    let topology = rewrite_topology(spec, text)?;
    let secured = spec.security.mode != SecurityMode::Off;
    let mut files = Vec::new();
    let mut resources = vec!["services.yaml".to_owned()];
    let mut host_files = Vec::new();
    for (i, host) in spec.hosts.iter().enumerate() {
        let name = format!("statefulset-{}.yaml", workload_name(&host.name).trim_start_matches("tessera-"));
        resources.push(name.clone());
        host_files.push((name, yaml::document(&statefulset(spec, i, opts, secured)?)));
    }
    files.push(("kustomization.yaml".to_owned(), yaml::document(&kustomization(spec, &resources, secured))));
    files.push(("topology.toml".to_owned(), topology));
    files.push(("services.yaml".to_owned(), services(spec)));
    files.extend(host_files);
    Ok(Rendered { files })
}

fn check_names(spec: &ClusterSpec) -> Result<(), DeployError> {
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    for host in &spec.hosts {
        let name = workload_name(&host.name);
        // A StatefulSet's pods get a `controller-revision-hash` label of the name plus
        // 11 characters, and labels are at most 63.
        if name.len() > 52 {
            return Err(DeployError::Unsupported(format!(
                "host `{}` makes the workload name `{name}`, over the 52 characters Kubernetes allows a StatefulSet; \
                 give the host a shorter name",
                host.name
            )));
        }
        if let Some(other) = seen.insert(name.clone(), &host.name) {
            return Err(DeployError::Unsupported(format!(
                "hosts `{other}` and `{}` both become the workload `{name}`; rename one",
                host.name
            )));
        }
    }
    if spec.security.at_rest_key_file.is_some() {
        return Err(DeployError::Unsupported(
            "security.at_rest_key_file is a file on one machine; remove it and give the gateway's pod \
             TESSERA_AT_REST_KEY from a Secret of your own"
                .to_owned(),
        ));
    }
    if !spec.emulation.perf_models.is_empty() {
        return Err(DeployError::Unsupported(
            "emulation.perf_models name files on one machine; bake them into the image or remove them".to_owned(),
        ));
    }
    Ok(())
}

/// The topology the pods run: every host reached by its pod's DNS name (ports kept), the
/// gateway listening on every interface, keys, model and state at their mount points.
fn rewrite_topology(spec: &ClusterSpec, text: &str) -> Result<String, DeployError> {
    let mut doc: toml::Table = text.parse().map_err(|e: toml::de::Error| DeployError::Toml(e.to_string()))?;
    let table = |doc: &mut toml::Table, key: &str| -> toml::Table {
        doc.remove(key).and_then(|v| v.try_into::<toml::Table>().ok()).unwrap_or_default()
    };
    if let Some(toml::Value::Array(hosts)) = doc.get_mut("hosts") {
        for (raw, host) in hosts.iter_mut().zip(&spec.hosts) {
            let Some(raw) = raw.as_table_mut() else { continue };
            let dns = pod_dns(&host.name);
            raw.insert("bus".into(), format!("{dns}:{}", host.bus.port).into());
            for (key, endpoint) in
                [("events", Some(&host.events)), ("transfer", Some(&host.transfer)), ("stages", host.stages.as_ref())]
            {
                if let (true, Some(e)) = (raw.contains_key(key), endpoint) {
                    raw.insert(key.into(), format!("{dns}:{}", e.port).into());
                }
            }
        }
    }
    let mut gateway = table(&mut doc, "gateway");
    gateway.insert("listen".into(), format!("0.0.0.0:{}", spec.gateway.listen.port()).into());
    for key in ["keys_file", "audit_log"] {
        if let Some(file) = gateway.get(key).and_then(|v| v.as_str()).and_then(|p| Path::new(p).file_name()) {
            let moved = format!("{HOME_DIR}/{}", file.to_string_lossy());
            gateway.insert(key.into(), moved.into());
        }
    }
    doc.insert("gateway".into(), gateway.into());
    if spec.security.mode != SecurityMode::Off {
        let mut security = table(&mut doc, "security");
        security.insert("keys_dir".into(), KEYS_DIR.into());
        doc.insert("security".into(), security.into());
    }
    if let Some(model) = model_file(spec) {
        let mut cluster = table(&mut doc, "cluster");
        cluster.insert("model".into(), format!("{MODELS_DIR}/{model}").into());
        doc.insert("cluster".into(), cluster.into());
    }
    let body = toml::to_string(&doc).map_err(|e| DeployError::Toml(e.to_string()))?;
    Ok(format!(
        "# Rendered by `tessera deploy k8s` from {}: every host is reached by its pod's DNS name.\n\
         # Edit the source topology and render again rather than this file.\n{body}",
        spec.source
    ))
}

/// The model's file or directory name, when it is not builtin (it is read from the
/// `tessera-models` volume).
fn model_file(spec: &ClusterSpec) -> Option<String> {
    if spec.model.starts_with("builtin:") {
        return None;
    }
    Path::new(&spec.model).file_name().map(|f| f.to_string_lossy().into_owned())
}

fn labels(spec: &ClusterSpec) -> Value {
    json!({"app.kubernetes.io/name": "tessera", "app.kubernetes.io/instance": spec.name})
}

fn kustomization(spec: &ClusterSpec, resources: &[String], secured: bool) -> Value {
    let mut k = json!({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
        "configMapGenerator": [{"name": "tessera-topology", "files": ["topology.toml"]}],
    });
    if secured {
        // Each pod gets its own private key and every public key; `keys/` is filled by
        // `tessera keys gen-host --name HOST --out keys` (the README says how).
        let secrets: Vec<Value> = spec
            .hosts
            .iter()
            .map(|h| json!({"name": format!("{}-key", workload_name(&h.name)), "files": [format!("keys/{}.key", h.name)]}))
            .collect();
        k["secretGenerator"] = json!(secrets);
        let pubs: Vec<String> = spec.hosts.iter().map(|h| format!("keys/{}.pub", h.name)).collect();
        if let Some(list) = k["configMapGenerator"].as_array_mut() {
            list.push(json!({"name": "tessera-public-keys", "files": pubs}));
        }
    }
    k
}

/// The ports a host's pod opens: its planes, and the gateway's or the probe's HTTP.
fn ports(spec: &ClusterSpec, i: usize, opts: &K8sOptions) -> Vec<(String, u16)> {
    let host = &spec.hosts[i];
    let mut ports = vec![
        ("bus".to_owned(), host.bus.port),
        ("events".to_owned(), host.events.port),
        ("transfer".to_owned(), host.transfer.port),
    ];
    if let Some(stages) = &host.stages {
        ports.push(("stages".to_owned(), stages.port));
    }
    if spec.gateway.host == host.name {
        ports.push(("http".to_owned(), spec.gateway.listen.port()));
    }
    ports.push(("probe".to_owned(), opts.probe_port));
    ports
}

fn services(spec: &ClusterSpec) -> String {
    let mut ports: Vec<Value> = Vec::new();
    let mut named = std::collections::BTreeSet::new();
    for host in &spec.hosts {
        for (name, port) in [("bus", host.bus.port), ("events", host.events.port), ("transfer", host.transfer.port)] {
            if named.insert(port) {
                ports.push(json!({"name": format!("{name}-{port}"), "port": port, "targetPort": port}));
            }
        }
    }
    let bus = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": BUS_SERVICE, "labels": labels(spec)},
        "spec": {
            // Peers need each other's names before they are ready: the bus is how they get ready.
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": labels(spec),
            "ports": ports,
        },
    });
    let gateway_port = spec.gateway.listen.port();
    let mut selector = labels(spec);
    selector["tessera.dev/host"] = json!(workload_name(&spec.gateway.host));
    let gateway = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tessera-gateway", "labels": labels(spec)},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": gateway_port, "targetPort": "http"}],
        },
    });
    format!("{}---\n{}", yaml::document(&bus), yaml::document(&gateway))
}

fn statefulset(spec: &ClusterSpec, i: usize, opts: &K8sOptions, secured: bool) -> Result<Value, DeployError> {
    let host = &spec.hosts[i];
    let name = workload_name(&host.name);
    let is_gateway = spec.gateway.host == host.name;
    let mut pod_labels = labels(spec);
    pod_labels["tessera.dev/host"] = json!(name);
    let port_list = ports(spec, i, opts);
    if let Some((_, p)) = port_list.iter().filter(|(n, _)| n != "probe").find(|(_, p)| *p == opts.probe_port) {
        return Err(DeployError::Unsupported(format!(
            "host `{}` already uses port {p}; pick another --probe-port",
            host.name
        )));
    }
    let args = vec![
        "node".to_owned(),
        "--host".to_owned(),
        host.name.clone(),
        "--topology".to_owned(),
        format!("{TOPOLOGY_DIR}/topology.toml"),
        "--probe-listen".to_owned(),
        format!("0.0.0.0:{}", opts.probe_port),
        "--drain-timeout-s".to_owned(),
        opts.drain_timeout_s.to_string(),
    ];
    // Readiness: the gateway's /health (some chip up) on the gateway's pod, the probe
    // endpoint elsewhere; liveness never depends on other pods.
    let (ready_port, ready_path) = if is_gateway { ("http", "/health") } else { ("probe", "/health") };
    let probe = |path: &str, port: &str, period: u32, failures: u32| json!({"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 3});
    // Resources: a worker thread per chip thread plus the I/O threads; device chips ask
    // for their device and land on nodes labelled with their kind.
    let threads: usize = host.chips.iter().map(|c| c.threads).sum();
    let cpu = threads + 1;
    let memory_gib: u64 =
        host.chips.iter().map(|c| c.memory_limit_bytes.map_or(2, |b| b.div_ceil(1 << 30))).sum::<u64>() + 1;
    let mut limits = json!({"memory": format!("{memory_gib}Gi")});
    let mut node_selector = json!({"kubernetes.io/os": "linux"});
    let mut devices: BTreeMap<&str, usize> = BTreeMap::new();
    for chip in &host.chips {
        let Backend::Plugin(_) = chip.backend else { continue };
        let vendor = spec.chip_kind(&chip.kind).map(|k| k.vendor.clone()).unwrap_or_default();
        if let Some(resource) = device_resource(&vendor) {
            *devices.entry(resource).or_default() += 1;
            node_selector["tessera.dev/chip-kind"] = json!(chip.kind);
        }
    }
    for (resource, n) in &devices {
        limits[*resource] = json!(n);
    }
    let mut mounts = vec![
        json!({"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": true}),
        json!({"name": "home", "mountPath": HOME_DIR}),
        // The root filesystem is read-only; scratch files go here.
        json!({"name": "tmp", "mountPath": "/tmp"}),
    ];
    let mut volumes = vec![
        json!({"name": "topology", "configMap": {"name": "tessera-topology"}}),
        json!({"name": "tmp", "emptyDir": {}}),
    ];
    if secured {
        mounts.push(json!({"name": "keys", "mountPath": KEYS_DIR, "readOnly": true}));
        volumes.push(json!({"name": "keys", "projected": {"defaultMode": 0o400, "sources": [
            {"secret": {"name": format!("{name}-key")}},
            {"configMap": {"name": "tessera-public-keys"}},
        ]}}));
    }
    if model_file(spec).is_some() {
        mounts.push(json!({"name": "models", "mountPath": MODELS_DIR, "readOnly": true}));
        volumes.push(
            json!({"name": "models", "persistentVolumeClaim": {"claimName": "tessera-models", "readOnly": true}}),
        );
    }
    let container_ports: Vec<Value> =
        port_list.iter().map(|(n, p)| json!({"name": n, "containerPort": p, "protocol": "TCP"})).collect();
    let container = json!({
        "name": "tessera",
        "image": opts.image,
        "args": args,
        "env": [{"name": "TESSERA_HOME", "value": HOME_DIR}, {"name": "TESSERA_LOG", "value": "info"}],
        "ports": container_ports,
        // The builtin model is generated at first start: give it time before liveness counts.
        "startupProbe": probe("/health/live", "probe", 5, 60),
        "readinessProbe": probe(ready_path, ready_port, 5, 3),
        "livenessProbe": probe("/health/live", "probe", 10, 6),
        "resources": {"requests": {"cpu": cpu.to_string(), "memory": format!("{memory_gib}Gi")}, "limits": limits},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}},
    });
    let pod_spec = json!({
        "terminationGracePeriodSeconds": opts.drain_timeout_s + 15,
        "securityContext": {"runAsNonRoot": true, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
        "nodeSelector": node_selector,
        "containers": [container],
        "volumes": volumes,
    });
    let home_claim = json!({
        "metadata": {"name": "home"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    });
    Ok(json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": pod_labels},
        "spec": {
            "serviceName": BUS_SERVICE,
            "replicas": 1,
            // Hosts wait for each other on the bus: start them together.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": opts.probe_port.to_string(),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
            "volumeClaimTemplates": [home_claim],
        },
    }))
}

#[cfg(test)]
mod tests;
