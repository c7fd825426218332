//! The human-readable summary of a validated cluster (`tessera topology check`).

use std::fmt::Write;

use crate::{ChipKind, ClusterSpec, PathReport};

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
        spec.dtype.map_or("as in checkpoint", crate::DType::as_str),
        spec.kv_dtype,
        spec.block_size
    )?;
    let r = &spec.router;
    writeln!(
        out,
        "  router: {}, {} requests placed before more wait; up to {} wait {} ms; a chip past {}% KV or {} ms of queued prompts takes none; with every decoding chip full, {}",
        r.policy,
        r.max_queued_requests,
        r.max_waiting_requests,
        r.queue_timeout_ms,
        r.kv_breaker_percent,
        r.max_queued_prompt_ms,
        match r.decode_overflow {
            crate::DecodeOverflow::PrefillChips => "prefill chips decode",
            crate::DecodeOverflow::Wait => "requests wait",
        }
    )?;
    let sol = &spec.solver;
    if sol.enabled {
        writeln!(
            out,
            "  solver: {} for {} within TTFT {} ms / TPOT {} ms (p90); re-solves every {} s or at a {}% rate change{}",
            if sol.auto { "applies the best strategy" } else { "publishes strategies" },
            sol.objective,
            sol.ttft_ms,
            sol.tpot_ms,
            sol.period_s,
            sol.rate_change_percent,
            if sol.auto {
                format!(" (a new one must win by {}% after {} s)", sol.min_gain_percent, sol.dwell_s)
            } else {
                String::new()
            }
        )?;
    } else {
        writeln!(out, "  solver: off")?;
    }
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
    write!(out, ", at most {} requests in flight", gateway.max_inflight_requests)?;
    write!(out, " over {} connections, headers within {} ms", gateway.max_connections, gateway.header_read_timeout_ms)?;
    match gateway.max_prompt_bytes {
        Some(bytes) => writeln!(out, ", prompts of at most {bytes} bytes")?,
        None => writeln!(out)?,
    }
    writeln!(
        out,
        "  bus: frames of at most {} bytes, handshakes within {} ms, host names retried for {} ms at start",
        spec.bus.max_frame_bytes, spec.bus.handshake_timeout_ms, spec.bus.resolve_timeout_ms
    )?;
    let security = &spec.security;
    match (&security.mode, &security.keys_dir) {
        (tessera_vocab::SecurityMode::Off, _) => writeln!(out, "  security: off (bus and KV transfer in clear)")?,
        (mode, dir) => writeln!(
            out,
            "  security: {mode} with {}, host keys in {}",
            security.cipher,
            dir.as_ref().map_or("(none)".into(), |d| d.display().to_string())
        )?,
    }
    let emu = &spec.emulation;
    writeln!(
        out,
        "  emulation: time x {}, {} of peak FLOPS, {} of peak bandwidth",
        emu.time_scale, emu.compute_efficiency, emu.memory_efficiency
    )?;
    let disagg = &spec.disagg;
    writeln!(
        out,
        "  disaggregation: prompts under {} tokens stay on the decode chip; KV lease {} ms; transport {}, \
         {} TCP stream(s) of {} KiB chunks",
        disagg.min_prompt_tokens, disagg.lease_ms, disagg.transport, disagg.tcp_streams, disagg.chunk_kib
    )?;
    for kind in &spec.chip_kinds {
        write!(out, "  chip kind {} (from this file): ", kind.name)?;
        write_figures(out, kind)?;
        if let Some(price) = &kind.price {
            writeln!(out, "    ${}/h ({}; {})", price.usd_per_hour, price.confidence, price.source)?;
        }
    }
    for host in &spec.hosts {
        writeln!(out, "  host {}: bus {}, events {}, transfer {}", host.name, host.bus, host.events, host.transfer)?;
        for chip in &host.chips {
            let memory = chip.memory_limit_bytes.map_or_else(|| "no memory limit".to_owned(), human_bytes);
            writeln!(
                out,
                "    chip {}: {} on {}, role {}, {} thread(s), {}, batches of at most {} tokens / {} sequences",
                chip.id,
                chip.kind,
                chip.backend,
                chip.role,
                chip.threads,
                memory,
                chip.max_batch_tokens,
                chip.max_batch_seqs
            )?;
            if let Some(ms) = chip.max_mixed_step_ms {
                writeln!(
                    out,
                    "      stall-free: a step that decodes takes at most {ms} ms (its prompt chunks cut to fit)"
                )?;
            }
            writeln!(
                out,
                "      kv cache: blocks of {} tokens, {}, {}",
                chip.block_size, chip.kv_dtype, chip.kv_layout
            )?;
            if let Some(kind) = spec.chip_kind(&chip.kind) {
                write!(out, "      ")?;
                write_figures(out, kind)?;
            }
        }
    }
    Ok(())
}

pub(crate) fn render_paths(report: &PathReport) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = write_paths(&mut out, report);
    out
}

fn write_paths(out: &mut String, report: &PathReport) -> std::fmt::Result {
    writeln!(out, "local paths (a host runs on this machine when this machine can bind its bus address):")?;
    for host in &report.hosts {
        let paths: Vec<String> = host.paths.iter().map(|path| path.display().to_string()).collect();
        let paths = if paths.is_empty() { "none needed".to_owned() } else { paths.join(", ") };
        if host.local {
            writeln!(out, "  host {} (bus {}): on this machine; checked: {paths}", host.host, host.bus)?;
        } else {
            writeln!(out, "  host {} (bus {}): not on this machine; NOT checked here: {paths}", host.host, host.bus)?;
        }
    }
    Ok(())
}

fn write_figures(out: &mut String, kind: &ChipKind) -> std::fmt::Result {
    writeln!(
        out,
        "{} {}: {} TFLOPS fp16, {:.0} GiB, {} GB/s, link {} GB/s, {} W ({}; {})",
        kind.vendor,
        kind.product,
        kind.fp16_tflops,
        kind.memory_gib(),
        kind.memory_bw_gbs,
        kind.link_bw_gbs,
        kind.tdp_w,
        kind.confidence,
        kind.source
    )
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
