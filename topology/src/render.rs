//! The human-readable summary of a validated cluster (`tessera topology check`).

use std::fmt::Write;

use crate::{Backend, ClusterSpec, catalog};

pub(crate) fn render(spec: &ClusterSpec) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_summary(&mut out, spec);
    out
}

fn write_summary(out: &mut String, spec: &ClusterSpec) -> std::fmt::Result {
    let chip_count = spec.chips().count();
    writeln!(out, "cluster `{}` ({})", spec.name, spec.source)?;
    writeln!(out, "  {} host(s), {} chip(s)", spec.hosts.len(), chip_count)?;
    writeln!(
        out,
        "  model: {}  weights dtype: {}  kv dtype: {}  block size: {} tokens",
        spec.model,
        spec.dtype.as_deref().unwrap_or("as in checkpoint"),
        spec.kv_dtype,
        spec.block_size
    )?;
    writeln!(out, "  router: {}, at most {} queued requests", spec.router.policy, spec.router.max_queued_requests)?;
    let sup = &spec.supervisor;
    writeln!(
        out,
        "  supervisor: heartbeat every {} ms, dead after {} ms; at most {} restarts per {} s, {} ms backoff",
        sup.heartbeat_interval_ms,
        sup.heartbeat_timeout_ms,
        sup.max_restarts,
        sup.restart_window_s,
        sup.restart_backoff_ms
    )?;
    let gateway = &spec.gateway;
    write!(out, "  gateway: on host {}, listening on http://{}", gateway.host, gateway.listen)?;
    if let Some(name) = &gateway.served_model_name {
        write!(out, ", serving \"{name}\"")?;
    }
    writeln!(out, ", at most {} requests in flight", gateway.max_inflight_requests)?;
    for host in &spec.hosts {
        writeln!(out, "  host {}: bus {}, events {}", host.name, host.bus, host.events)?;
        for chip in &host.chips {
            let backend = match &chip.backend {
                Backend::Cpu => "cpu".to_owned(),
                Backend::Plugin(path) => format!("plugin {}", path.display()),
            };
            let memory = chip.memory_limit_bytes.map_or_else(|| "no memory limit".to_owned(), human_bytes);
            writeln!(
                out,
                "    chip {}: {} on {}, role {}, {} thread(s), {}, batches of at most {} tokens / {} sequences",
                chip.id,
                chip.kind,
                backend,
                chip.role,
                chip.threads,
                memory,
                chip.max_batch_tokens,
                chip.max_batch_seqs
            )?;
            if let Some(kind) = catalog::lookup(&chip.kind).filter(|kind| kind.confidence != "measured") {
                writeln!(
                    out,
                    "      {} {}: {} TFLOPS fp16, {} GB, {} GB/s ({}; {})",
                    kind.vendor,
                    kind.product,
                    kind.fp16_tflops,
                    kind.memory_gib,
                    kind.memory_bw_gbs,
                    kind.confidence,
                    kind.source
                )?;
            }
        }
    }
    Ok(())
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("memory limit {} {unit}", bytes / size);
        }
    }
    format!("memory limit {bytes} bytes")
}
