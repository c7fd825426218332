//! `tessera deploy k8s`: Kubernetes manifests for a topology (tessera-deploy renders
//! them), host keys made where the planes are secured and none exist yet.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DeployCommand {
    /// Write a kustomize directory for a topology: one StatefulSet per host, a headless
    /// Service naming the pods for the bus, a Service for the gateway, the topology in a
    /// ConfigMap (every host renamed to its pod's DNS name), host keys as Secrets.
    K8s(K8sArgs),
}

#[derive(Args)]
pub struct K8sArgs {
    /// The topology file the manifests are rendered from.
    topology: PathBuf,
    /// The directory to write (made if missing; files of the same names are replaced).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The container image (`docker build -t IMAGE .` from the repository).
    #[arg(long, default_value = "tessera:latest")]
    image: String,
    /// The port of each host's probe endpoint (`/health`, `/health/live`, `/metrics`).
    #[arg(long, default_value_t = 9000)]
    probe_port: u16,
    /// How long a host drains on SIGTERM; the pod's grace period is 15 s more.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    drain_timeout_s: u64,
    /// Make a key pair in DIR/keys for every host that has none (planes secured only).
    #[arg(long)]
    gen_keys: bool,
}

pub fn deploy(command: DeployCommand) -> Result<()> {
    let DeployCommand::K8s(args) = command;
    let text = std::fs::read_to_string(&args.topology)
        .with_context(|| format!("cannot read the topology {}", args.topology.display()))?;
    let spec = tessera_topology::load(&args.topology)?;
    let opts = tessera_deploy::K8sOptions {
        image: args.image,
        probe_port: args.probe_port,
        drain_timeout_s: args.drain_timeout_s,
    };
    let rendered = tessera_deploy::render_k8s(&spec, &text, &opts)?;
    rendered.write(&args.out)?;
    for (name, _) in &rendered.files {
        eprintln!("wrote {}", args.out.join(name).display());
    }
    if spec.security.mode == tessera_topology::SecurityMode::Off {
        return Ok(());
    }
    let keys = args.out.join("keys");
    let mut missing = Vec::new();
    for host in &spec.hosts {
        if keys.join(format!("{}.key", host.name)).exists() && keys.join(format!("{}.pub", host.name)).exists() {
            continue;
        }
        if args.gen_keys {
            let pair = tessera_runtime::security::HostKeypair::generate()?;
            let (key, _) = pair.write(&keys, &host.name)?;
            eprintln!("made a key pair for host `{}`: {}", host.name, key.display());
        } else {
            missing.push(host.name.as_str());
        }
    }
    if !missing.is_empty() {
        eprintln!(
            "the planes are secured: kustomize needs {}/HOST.key and HOST.pub for hosts {}; run again with --gen-keys, \
             or `tessera keys gen-host --name HOST --out {}` for each",
            keys.display(),
            missing.join(", "),
            keys.display()
        );
    }
    Ok(())
}
