//! `tessera up` and `tessera node`: launch a whole topology on this machine (one child
//! process per host, or one thread per host with `--in-process`), or one host of it.
//! A child's stdin is its lifeline: when `up` closes it (Ctrl-C) or dies, the child
//! drains and exits, so no host outlives its launcher.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_node::{NodeOptions, run_node};
use tessera_topology::ClusterSpec;

/// The validated topology: the file's, or the embedded default; with `colocated`,
/// every chip runs both phases.
pub fn load_spec(path: Option<&Path>, colocated: bool) -> Result<ClusterSpec> {
    let mut spec = load_topology(path)?;
    if colocated {
        for host in &mut spec.hosts {
            for chip in &mut host.chips {
                chip.role = tessera_topology::Role::Both;
            }
        }
    }
    Ok(spec)
}

fn load_topology(path: Option<&Path>) -> Result<ClusterSpec> {
    Ok(match path {
        Some(p) => tessera_topology::load(p)?,
        None => tessera_topology::default_topology(),
    })
}

/// Resolves on Ctrl-C or SIGTERM (and, for children of `up`, when stdin closes).
pub async fn shutdown_signal(watch_stdin: bool) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let stdin_closed = async {
        if !watch_stdin {
            return std::future::pending::<()>().await;
        }
        use tokio::io::AsyncReadExt;
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 256];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
        _ = stdin_closed => {}
    }
}

fn install_metrics() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    match metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder() {
        Ok(handle) => Some(handle),
        Err(e) => {
            eprintln!("tessera: metrics disabled: {e}");
            None
        }
    }
}

pub fn node(args: &crate::NodeArgs) -> Result<()> {
    let spec = load_spec(args.topology.as_deref(), args.colocated)?;
    let opts = NodeOptions {
        kernel_lib: args.kernel_lib.clone(),
        metrics: install_metrics(),
        drain_timeout: Duration::from_secs(args.drain_timeout_s),
        probe_listen: args.probe_listen,
    };
    Ok(run_node(&spec, &args.host, &opts, shutdown_signal(args.exit_on_stdin_eof))?)
}

pub fn up(topology: Option<&Path>, in_process: bool, colocated: bool, kernel_lib: Option<PathBuf>) -> Result<()> {
    let spec = load_spec(topology, colocated)?;
    eprintln!(
        "tessera up: cluster `{}` from {}: {} hosts, gateway on http://{}",
        spec.name,
        spec.source,
        spec.hosts.len(),
        spec.gateway.listen
    );
    // Generate a builtin model once, before the hosts race to do it.
    crate::resolve_model(&spec.model)?;
    if in_process {
        return up_in_process(spec, kernel_lib);
    }
    let exe = std::env::current_exe().context("cannot find the tessera executable")?;
    let mut children: Vec<(String, Child)> = Vec::new();
    // The gateway's host drains first (it waits for the requests it serves), so it
    // comes first in shutdown order.
    let mut order: Vec<&str> = spec.hosts.iter().map(|h| h.name.as_str()).collect();
    order.sort_by_key(|h| *h != spec.gateway.host);
    for name in &order {
        let mut cmd = Command::new(&exe);
        cmd.arg("node").arg("--host").arg(name).arg("--exit-on-stdin-eof");
        if colocated {
            cmd.arg("--colocated");
        }
        if let Some(t) = topology {
            cmd.arg("--topology").arg(t);
        }
        if let Some(k) = &kernel_lib {
            cmd.arg("--kernel-lib").arg(k);
        }
        // Its own process group: Ctrl-C reaches only us, and we drain in order.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = match cmd.stdin(Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_children(&mut children);
                bail!("cannot start host {name}: {e}");
            }
        };
        eprintln!("tessera up: host {name} pid {}", child.id());
        children.push((name.to_string(), child));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let failed = rt.block_on(async {
        // A host that dies is the supervisors' business: the cluster serves on without
        // it. Only the gateway's host is vital.
        let gateway = spec.gateway.host.clone();
        let watch = async {
            let mut reported = std::collections::HashSet::new();
            loop {
                for (name, child) in children.iter_mut() {
                    if let Ok(Some(status)) = child.try_wait() {
                        if *name == gateway {
                            return Some(format!("the gateway's host {name} exited ({status})"));
                        }
                        if reported.insert(name.clone()) {
                            eprintln!("tessera up: host {name} exited ({status}); serving on without it");
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            _ = shutdown_signal(false) => None,
            why = watch => why,
        }
    });
    if let Some(why) = &failed {
        eprintln!("tessera up: {why}; stopping the other hosts");
    } else {
        eprintln!("tessera up: draining");
    }
    stop_children(&mut children);
    match failed {
        Some(why) => bail!(why),
        None => Ok(()),
    }
}

/// Closes each child's stdin in order and waits for it; kills what does not exit.
fn stop_children(children: &mut [(String, Child)]) {
    for (name, child) in children.iter_mut() {
        drop(child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                _ => {
                    eprintln!("tessera up: host {name} did not stop; killing pid {}", child.id());
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
            }
        }
    }
}

fn up_in_process(spec: ClusterSpec, kernel_lib: Option<PathBuf>) -> Result<()> {
    let metrics = install_metrics();
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut order: Vec<String> = spec.hosts.iter().map(|h| h.name.clone()).collect();
    order.sort_by_key(|h| *h != spec.gateway.host);
    let mut threads = Vec::new();
    for name in order {
        let spec = spec.clone();
        let opts = NodeOptions {
            kernel_lib: kernel_lib.clone(),
            metrics: metrics.clone(),
            drain_timeout: Duration::from_secs(30),
            probe_listen: None,
        };
        let mut stop = stop_tx.subscribe();
        let thread = std::thread::Builder::new().name(format!("host-{name}")).spawn(move || {
            run_node(&spec, &name, &opts, async move {
                let _ = stop.recv().await;
            })
            .with_context(|| format!("host {name}"))
        })?;
        threads.push(thread);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        // A host that stops by itself (it failed to start, say) stops the cluster.
        let watch = async {
            while !threads.iter().any(|t| t.is_finished()) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            _ = shutdown_signal(false) => {}
            _ = watch => {}
        }
    });
    eprintln!("tessera up: draining");
    let _ = stop_tx.send(());
    let mut first_error = None;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("error: {e:#}");
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(anyhow::anyhow!("a host thread panicked"));
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}
