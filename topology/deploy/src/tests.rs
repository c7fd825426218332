use super::*;

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/k8s/cluster.toml");
const BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/k8s/base");

fn example() -> (ClusterSpec, String) {
    let text = std::fs::read_to_string(EXAMPLE).unwrap_or_else(|e| panic!("{EXAMPLE}: {e}"));
    let spec = tessera_topology::parse(&text, "deploy/k8s/cluster.toml").unwrap_or_else(|e| panic!("{e}"));
    (spec, text)
}

fn file<'a>(r: &'a Rendered, name: &str) -> &'a str {
    r.files.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_str()).unwrap_or_else(|| panic!("no {name}"))
}

#[test]
fn the_checked_in_manifests_are_what_the_example_renders() {
    let (spec, text) = example();
    let rendered = render_k8s(&spec, &text, &K8sOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    for (name, want) in &rendered.files {
        let path = Path::new(BASE).join(name);
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == *want,
            "{} is not what deploy/k8s/cluster.toml renders: run \
             `cargo run -- deploy k8s deploy/k8s/cluster.toml --out deploy/k8s/base`",
            path.display()
        );
    }
}

#[test]
fn the_rendered_topology_names_every_host_by_its_pod_and_validates() {
    let (spec, text) = example();
    let rendered = render_k8s(&spec, &text, &K8sOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let topology = file(&rendered, "topology.toml");
    let pods = tessera_topology::parse(topology, "rendered").unwrap_or_else(|e| panic!("{e}\n{topology}"));
    let buses: Vec<String> = pods.hosts.iter().map(|h| h.bus.to_string()).collect();
    assert_eq!(
        buses,
        [
            "tessera-prefill-0.tessera-bus:7400",
            "tessera-decode-a-0.tessera-bus:7410",
            "tessera-decode-b-0.tessera-bus:7420"
        ]
    );
    assert_eq!(pods.gateway.listen.to_string(), "0.0.0.0:8000");
    assert_eq!(pods.security.keys_dir.as_deref(), Some(Path::new(KEYS_DIR)));
    assert_eq!(pods.hosts[0].chips, spec.hosts[0].chips, "chips are kept as written");
}

#[test]
fn every_workload_has_probes_a_grace_period_and_its_keys() {
    let (spec, text) = example();
    let opts = K8sOptions { drain_timeout_s: 20, ..K8sOptions::default() };
    let rendered = render_k8s(&spec, &text, &opts).unwrap_or_else(|e| panic!("{e}"));
    for host in ["prefill", "decode-a", "decode-b"] {
        let yaml = file(&rendered, &format!("statefulset-{host}.yaml"));
        for needle in [
            "readinessProbe:",
            "livenessProbe:",
            "path: \"/health\"",
            "path: \"/health/live\"",
            "terminationGracePeriodSeconds: 35",
            "\"--drain-timeout-s\"\n",
            "prometheus.io/scrape: \"true\"",
            &format!("name: \"tessera-{host}-key\""),
            "name: \"tessera-public-keys\"",
            "serviceName: \"tessera-bus\"",
        ] {
            assert!(yaml.contains(needle), "{host}: no {needle:?} in\n{yaml}");
        }
    }
    let gateway = file(&rendered, "statefulset-prefill.yaml");
    assert!(gateway.contains("name: \"http\"") && gateway.contains("containerPort: 8000"), "{gateway}");
    let kustomization = file(&rendered, "kustomization.yaml");
    assert!(kustomization.contains("- \"keys/decode-b.key\"") && kustomization.contains("- \"keys/prefill.pub\""));
    let services = file(&rendered, "services.yaml");
    assert!(services.contains("clusterIP: \"None\"") && services.contains("publishNotReadyAddresses: true"));
}

#[test]
fn a_device_chip_asks_for_its_device_and_lands_on_its_kind() {
    let text = "[cluster]\nmodel = \"/srv/models/llama\"\n[security]\nmode = \"off\"\n[[hosts]]\nname = \"gpu_box\"\n\
                bus = \"10.0.0.5:7400\"\n[[hosts.chips]]\nid = \"g0\"\nkind = \"nvidia-h100\"\n\
                backend = \"plugin:/opt/vendor/libtessera_cuda.so\"\n[[hosts.chips]]\nid = \"g1\"\n\
                kind = \"nvidia-h100\"\nbackend = \"plugin:/opt/vendor/libtessera_cuda.so\"\nthreads = 2\n";
    let spec = tessera_topology::parse(text, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let rendered = render_k8s(&spec, text, &K8sOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let sts = file(&rendered, "statefulset-gpu-box.yaml");
    for needle in
        ["nvidia.com/gpu: 2", "tessera.dev/chip-kind: \"nvidia-h100\"", "cpu: \"4\"", "claimName: \"tessera-models\""]
    {
        assert!(sts.contains(needle), "no {needle:?} in\n{sts}");
    }
    assert!(!sts.contains("tessera-public-keys"), "security off: no keys");
    assert!(file(&rendered, "topology.toml").contains("model = \"/models/llama\""));
}

#[test]
fn what_cannot_be_rendered_is_refused_with_the_reason() {
    let base = "[cluster]\nmodel = \"builtin:tiny\"\n[[hosts]]\nname = \"h0\"\nbus = \"127.0.0.1:7400\"\n\
                [[hosts.chips]]\nid = \"c0\"\nkind = \"cpu\"\nbackend = \"cpu\"\n";
    let clash = format!(
        "{base}[[hosts]]\nname = \"H0\"\nbus = \"127.0.0.1:7410\"\n[[hosts.chips]]\nid = \"c1\"\nkind = \"cpu\"\nbackend = \"cpu\"\n"
    );
    let spec = tessera_topology::parse(&clash, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let err = render_k8s(&spec, &clash, &K8sOptions::default()).expect_err("two hosts, one name").to_string();
    assert!(err.contains("both become the workload `tessera-h0`"), "{err}");
    let spec = tessera_topology::parse(base, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    let opts = K8sOptions { probe_port: 7401, ..K8sOptions::default() };
    let err = render_k8s(&spec, base, &opts).expect_err("the probe on the events port").to_string();
    assert!(err.contains("already uses port 7401"), "{err}");
}
