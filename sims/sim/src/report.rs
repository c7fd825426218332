//! What a run reports. [`Report`] is a function of the scenario and seed alone — its
//! JSON is byte-identical across runs — while [`Speed`] (the simulator's own wall time)
//! is not, so it is kept apart.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;
use tessera_workload::percentile;

/// One latency over the requests that have it, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    pub samples: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

impl Latency {
    /// Of latencies in seconds; `None` when there are none.
    pub fn from_seconds(values_s: &[f64]) -> Option<Latency> {
        let mut ms: Vec<f64> = values_s.iter().filter(|v| v.is_finite()).map(|v| v * 1e3).collect();
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f64::total_cmp);
        Some(Latency {
            samples: ms.len(),
            mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
            p50_ms: percentile(&ms, 50.0),
            p90_ms: percentile(&ms, 90.0),
            p99_ms: percentile(&ms, 99.0),
        })
    }
}

/// A chip at the end of the run, as the router saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChipEnd {
    pub id: String,
    pub host: String,
    pub role: String,
    pub state: String,
    pub modelled_as: Option<String>,
    pub steps: u64,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub handoffs_open: usize,
    /// Prompt tokens of sequences that started on the chip, and of those, tokens whose KV
    /// came from its prefix cache.
    pub prefix_prompt_tokens: u64,
    pub prefix_reused_tokens: u64,
    /// Share of the run the chip spent in steps carrying prompt tokens, and in
    /// decode-only steps (model time over the run's simulated time).
    pub busy_prefill: f64,
    pub busy_decode: f64,
    /// Energy over the run, from its kind's board power by phase
    /// ([`tessera_topology::perf::Power::from_tdp`]); `None` for a kind of no known power.
    pub energy_j: Option<f64>,
    /// What the chip cost over the run at its kind's price; `None` for a kind of no
    /// known price.
    pub usd: Option<f64>,
}

/// One latency of a window (TTFT or end to end).
type Pick = fn(&Window) -> Option<Latency>;

/// A fault, `at_s` seconds after the workload started.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultMark {
    pub at_s: f64,
    /// `"chip a1 crashed"`, `"host b down"`.
    pub what: String,
}

/// What the solver did, `at_s` seconds after the workload started (`[solver] auto`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SolverMark {
    pub at_s: f64,
    /// `"strategies"` (a set published) or `"applied"` (a strategy put in force).
    pub event: String,
    /// The set's number, or the applied strategy's id.
    pub id: String,
    /// The set's reason, rate and best strategy, or the applied strategy and its moves.
    pub what: String,
}

/// The requests sent within `[start_s, end_s)` seconds of the workload's start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    pub start_s: f64,
    pub end_s: f64,
    pub requests: usize,
    /// Of those that got a first token ...
    pub ttft: Option<Latency>,
    /// ... and of those that completed.
    pub e2e: Option<Latency>,
}

/// Windows of one second (longer for runs past two minutes: 120 windows in all) over
/// requests given as (sent after the start, TTFT if any, end to end if completed), all
/// in seconds.
pub fn timeline(requests: impl Iterator<Item = (f64, Option<f64>, Option<f64>)>) -> Vec<Window> {
    let requests: Vec<(f64, Option<f64>, Option<f64>)> = requests.collect();
    let end = requests.iter().map(|r| r.0).fold(0.0, f64::max);
    let width = (end / 120.0).max(1.0);
    let n = (end / width).floor() as usize + 1;
    let (mut ttfts, mut e2es): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let mut counts = vec![0usize; n];
    for (sent, ttft, e2e) in requests {
        let i = ((sent / width) as usize).min(n - 1);
        counts[i] += 1;
        ttfts[i].extend(ttft);
        e2es[i].extend(e2e);
    }
    (0..n)
        .map(|i| Window {
            start_s: i as f64 * width,
            end_s: (i + 1) as f64 * width,
            requests: counts[i],
            ttft: Latency::from_seconds(&ttfts[i]),
            e2e: Latency::from_seconds(&e2es[i]),
        })
        .collect()
}

/// Reused over prompt tokens over every chip (`None` when no prompt was counted).
pub fn hit_rate(chips: &[ChipEnd]) -> Option<f64> {
    let prompt: u64 = chips.iter().map(|c| c.prefix_prompt_tokens).sum();
    let reused: u64 = chips.iter().map(|c| c.prefix_reused_tokens).sum();
    (prompt > 0).then(|| reused as f64 / prompt as f64)
}

/// The results of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub scenario: String,
    pub seed: u64,
    pub cluster: String,
    pub model: String,
    pub rate_rps: f64,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Neither completed nor failed when the run gave up waiting (see `simulated_s`).
    pub unfinished: usize,
    /// Failure messages and how many requests ended with each.
    pub failures: BTreeMap<String, usize>,
    pub ttft: Option<Latency>,
    pub tpot: Option<Latency>,
    pub e2e: Option<Latency>,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    /// Completed requests within both SLOs (a one-token request has no TPOT to miss).
    pub slo_met: usize,
    /// `slo_met` per second of `simulated_s`.
    pub goodput_rps: f64,
    /// Prompt tokens of the completed requests (the model's tokenizer's count when the
    /// checkpoint has one, else one a word).
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    /// From the first arrival to the last request's end, on the virtual clock.
    pub simulated_s: f64,
    /// Messages and timers the virtual host delivered, start-up and drain included.
    pub events: u64,
    /// KV blocks held on all chips after the run drained: 0 unless a block leaked.
    pub kv_blocks_used_at_end: usize,
    /// The cluster's prefix hit rate: prompt tokens reused from cache over prompt tokens.
    pub prefix_hit_rate: Option<f64>,
    /// Energy of every chip over the run, per 10,000 completed requests (`None` when a
    /// chip's power is not known or none completed).
    pub kwh_per_10k_requests: Option<f64>,
    /// What the cluster costs an hour, at the scenario's or the catalog's prices
    /// (`None` when a chip's price is not known; the catalog's are estimates).
    pub usd_per_hour: Option<f64>,
    /// The cluster's cost over the run per million output tokens.
    pub usd_per_million_output_tokens: Option<f64>,
    /// Requests within both SLOs per dollar: goodput per $.
    pub slo_met_per_usd: Option<f64>,
    /// The faults injected, in time order.
    pub faults: Vec<FaultMark>,
    /// The solver's sets and applied strategies, in time order (auto runs only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub solver: Vec<SolverMark>,
    /// TTFT over time: the requests sent in each window of the run.
    pub timeline: Vec<Window>,
    /// Each tenant's requests and service (a workload of several tenants).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantEnd>,
    pub chips: Vec<ChipEnd>,
}

/// One tenant's part of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantEnd {
    pub name: String,
    pub weight: u32,
    pub priority: String,
    /// Requests of the tenant that ended (completed or failed).
    pub ended: usize,
    pub completed: usize,
    pub failed: usize,
    pub ttft: Option<Latency>,
    pub tpot: Option<Latency>,
    pub output_tokens: u64,
    /// Model seconds the chips served it (each chip's own pace: fair queuing's charge).
    pub service_s: f64,
    /// Its part of all tenants' service.
    pub service_share: f64,
    /// The same up to the last arrival, while the load still arrived: when every tenant
    /// keeps a backlog, the split fair queuing makes (by the weights); the whole run's
    /// includes the drain, when each tenant's backlog is served to its end.
    pub arriving_service_s: f64,
    pub arriving_service_share: f64,
}

/// How fast the simulator ran: wall-clock figures, different on every run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Speed {
    pub wall_s: f64,
    pub events_per_s: f64,
    pub simulated_s_per_wall_s: f64,
    /// Where the time went, by message kind, most first (when profiled).
    pub profile: Vec<KindSpeed>,
}

/// The deliveries of one message kind and the wall time their handlers took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindSpeed {
    pub kind: String,
    pub events: u64,
    pub wall_s: f64,
}

impl Speed {
    pub fn of(report: &Report, wall_s: f64) -> Speed {
        let per_wall = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
        Speed {
            wall_s,
            events_per_s: per_wall(report.events as f64),
            simulated_s_per_wall_s: per_wall(report.simulated_s),
            profile: Vec::new(),
        }
    }
}

impl Speed {
    /// Where the wall time went, by message kind (empty unless profiled).
    pub fn profile_table(&self) -> String {
        let mut t = String::new();
        if !self.profile.is_empty() {
            let handlers: f64 = self.profile.iter().map(|k| k.wall_s).sum();
            let _ = writeln!(
                t,
                "profile    handlers took {:.3} s of the {:.3} s (the rest: the event queue, the harness, the \
                 workload plan)\n{:<24} {:>12} {:>10} {:>8} {:>10}",
                handlers, self.wall_s, "message", "events", "wall s", "share", "ns/event"
            );
            for k in &self.profile {
                let _ = writeln!(
                    t,
                    "{:<24} {:>12} {:>10.3} {:>7.1}% {:>10.0}",
                    k.kind,
                    k.events,
                    k.wall_s,
                    100.0 * k.wall_s / self.wall_s.max(1e-9),
                    k.wall_s * 1e9 / k.events.max(1) as f64
                );
            }
        }
        t
    }
}

impl Report {
    /// Pretty JSON: the same scenario and seed give the same bytes.
    pub fn to_json(&self) -> String {
        // Plain data of strings, numbers and maps with string keys: nothing to fail on.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A human-readable table, with the simulator's speed.
    pub fn table(&self, speed: &Speed) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "scenario   {} (seed {})", self.scenario, self.seed);
        let _ = writeln!(t, "cluster    {}, {} chips, model {}", self.cluster, self.chips.len(), self.model);
        let _ = writeln!(
            t,
            "requests   {} at {} req/s: {} completed, {} failed, {} unfinished",
            self.requests,
            (self.rate_rps * 1e3).round() / 1e3,
            self.completed,
            self.failed,
            self.unfinished
        );
        for (why, n) in &self.failures {
            let _ = writeln!(t, "  {n} x {why}");
        }
        for fault in &self.faults {
            let _ = writeln!(t, "fault      {} s: {}", fault.at_s, fault.what);
        }
        for mark in self.solver.iter().filter(|m| m.event == "applied") {
            let _ = writeln!(t, "solver     {:.1} s: applied {}: {}", mark.at_s, mark.id, mark.what);
        }
        if !self.solver.is_empty() {
            let sets = self.solver.iter().filter(|m| m.event == "strategies").count();
            let _ = writeln!(t, "solver     {sets} strategy sets published (--json lists them)");
        }
        if !self.faults.is_empty() {
            let width = self.timeline.first().map_or(1.0, |w| w.end_s - w.start_s);
            let series: [(&str, Pick); 2] = [("TTFT", |w| w.ttft), ("E2E", |w| w.e2e)];
            for (name, pick) in series {
                let p99: Vec<String> =
                    self.timeline.iter().map(|w| pick(w).map_or("-".into(), |l| format!("{:.0}", l.p99_ms))).collect();
                let _ = writeln!(t, "{name} p99 per {width:.0} s window (ms): {}", p99.join(" "));
            }
        }
        let _ = writeln!(t, "\n{:<8} {:>10} {:>10} {:>10} {:>10}", "ms", "mean", "p50", "p90", "p99");
        for (name, l) in [("TTFT", &self.ttft), ("TPOT", &self.tpot), ("E2E", &self.e2e)] {
            match l {
                Some(l) => {
                    let _ = writeln!(
                        t,
                        "{name:<8} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                        l.mean_ms, l.p50_ms, l.p90_ms, l.p99_ms
                    );
                }
                None => {
                    let _ = writeln!(t, "{name:<8} {:>10}", "-");
                }
            }
        }
        let _ = writeln!(
            t,
            "\ngoodput    {:.3} req/s ({} of {} within TTFT {} ms and TPOT {} ms)",
            self.goodput_rps, self.slo_met, self.requests, self.slo_ttft_ms, self.slo_tpot_ms
        );
        let _ = writeln!(
            t,
            "tokens     {} prompt, {} output ({:.1} output tokens/s)",
            self.prompt_tokens, self.output_tokens, self.output_tokens_per_s
        );
        let _ = writeln!(t, "KV blocks  {} still used at the end", self.kv_blocks_used_at_end);
        if let Some(kwh) = self.kwh_per_10k_requests {
            let _ = writeln!(t, "energy     {kwh:.3} kWh per 10,000 requests (board power by phase; idle estimated)");
        }
        if let (Some(hour), Some(per_m), Some(per_usd)) =
            (self.usd_per_hour, self.usd_per_million_output_tokens, self.slo_met_per_usd)
        {
            let _ = writeln!(
                t,
                "cost       ${hour:.2}/h: ${per_m:.3} per million output tokens, {per_usd:.1} requests within SLO per $"
            );
        }
        if let Some(hit) = self.prefix_hit_rate {
            let _ = writeln!(t, "prefix     hit rate {hit:.3} (prompt tokens reused from prefix caches)");
        }
        if !self.tenants.is_empty() {
            // service: each tenant's part of the chips' model time over the run;
            // arriving: the same while the load still arrived (the backlogged split).
            let _ = writeln!(
                t,
                "\n{:<12} {:>6} {:<11} {:>9} {:>7} {:>12} {:>12} {:>12} {:>8} {:>9}",
                "tenant",
                "weight",
                "priority",
                "completed",
                "failed",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "service",
                "arriving"
            );
            let ms = |l: &Option<Latency>, pick: fn(&Latency) -> f64| {
                l.as_ref().map_or("-".into(), |l| format!("{:.2}", pick(l)))
            };
            for e in &self.tenants {
                let _ = writeln!(
                    t,
                    "{:<12} {:>6} {:<11} {:>9} {:>7} {:>12} {:>12} {:>12} {:>7.1}% {:>8.1}%",
                    e.name,
                    e.weight,
                    e.priority,
                    e.completed,
                    e.failed,
                    ms(&e.ttft, |l| l.p50_ms),
                    ms(&e.ttft, |l| l.p99_ms),
                    ms(&e.tpot, |l| l.p50_ms),
                    100.0 * e.service_share,
                    100.0 * e.arriving_service_share
                );
            }
        }
        let _ = writeln!(
            t,
            "\n{:<12} {:<8} {:<9} {:>8} {:>10} {:>8} {:>8} {:>8}  modelled as",
            "chip", "role", "state", "steps", "KV blocks", "used", "prefill", "decode"
        );
        for c in &self.chips {
            let _ = writeln!(
                t,
                "{:<12} {:<8} {:<9} {:>8} {:>10} {:>8} {:>7.1}% {:>7.1}%  {}",
                c.id,
                c.role,
                c.state,
                c.steps,
                c.kv_blocks_total,
                c.kv_blocks_used,
                100.0 * c.busy_prefill,
                100.0 * c.busy_decode,
                c.modelled_as.as_deref().unwrap_or("-")
            );
        }
        let _ = writeln!(
            t,
            "\nsimulated  {:.3} s in {:.3} s of wall time ({:.1} simulated s per wall s); {} events, {:.0} events/s",
            self.simulated_s, speed.wall_s, speed.simulated_s_per_wall_s, self.events, speed.events_per_s
        );
        t += &speed.profile_table();
        t
    }
}

/// Runs side by side, one Markdown table row each: chips, cost, rate, goodput, goodput
/// per dollar, TTFT and TPOT p50/p99, energy, failures.
pub fn comparison(reports: &[Report]) -> String {
    let mut t = String::from(
        "| scenario | chips | $/h | rate req/s | goodput req/s | SLO-met req per $ | TTFT p50 / p99 ms | TPOT p50 / p99 ms \
         | kWh / 10k req | failed |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".into());
    let pair = |l: Option<Latency>| or_dash(l.map(|l| format!("{:.0} / {:.0}", l.p50_ms, l.p99_ms)));
    for r in reports {
        let name =
            std::path::Path::new(&r.scenario).file_stem().map_or(r.scenario.clone(), |s| s.display().to_string());
        let _ = writeln!(
            t,
            "| {name} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} |",
            r.chips.len(),
            or_dash(r.usd_per_hour.map(|h| format!("{h:.2}"))),
            // A closed loop's rate is what it reached: no need for every digit.
            (r.rate_rps * 1e3).round() / 1e3,
            r.goodput_rps,
            or_dash(r.slo_met_per_usd.map(|x| format!("{x:.0}"))),
            pair(r.ttft),
            pair(r.tpot),
            or_dash(r.kwh_per_10k_requests.map(|k| format!("{k:.3}"))),
            r.failed + r.unfinished,
        );
    }
    t
}

impl Report {
    /// TTFT p99 and end-to-end p99 over the run's windows (by the time requests were
    /// sent) as an SVG line chart, with each fault marked where it happened.
    pub fn svg(&self) -> String {
        const W: f64 = 800.0;
        const H: f64 = 400.0;
        const M: f64 = 50.0;
        let end = self.timeline.last().map_or(1.0, |w| w.end_s).max(1e-9);
        let top = self.timeline.iter().filter_map(|w| w.e2e.or(w.ttft).map(|l| l.p99_ms)).fold(1.0, f64::max) * 1.1;
        let x = |s: f64| M + (W - 2.0 * M) * s / end;
        let y = |ms: f64| H - M - (H - 2.0 * M) * ms / top;
        let line = |pick: Pick| -> String {
            let points: Vec<String> = self
                .timeline
                .iter()
                .filter_map(|w| pick(w).map(|l| format!("{:.1},{:.1}", x((w.start_s + w.end_s) / 2.0), y(l.p99_ms))))
                .collect();
            points.join(" ")
        };
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" \
             font-size=\"12\">\n<rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>\n\
             <text x=\"{M}\" y=\"20\">{} (seed {}): latency over time</text>\n\
             <line x1=\"{M}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <line x1=\"{M}\" y1=\"{M}\" x2=\"{M}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <text x=\"{r}\" y=\"{t}\" text-anchor=\"end\">{end:.0} s (request sent)</text>\n\
             <text x=\"5\" y=\"{M}\">{top:.0} ms</text>\n",
            xml(&self.scenario),
            self.seed,
            b = H - M,
            r = W - M,
            t = H - M + 20.0,
        );
        let series: [(&str, &str, Pick); 2] =
            [("TTFT p99", "steelblue", |w| w.ttft), ("E2E p99", "darkorange", |w| w.e2e)];
        for (i, (name, color, pick)) in series.into_iter().enumerate() {
            svg +=
                &format!("<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n", line(pick));
            let ly = 40.0 + 16.0 * i as f64;
            svg += &format!("<text x=\"{}\" y=\"{ly}\" fill=\"{color}\">{name}</text>\n", W - M - 80.0);
        }
        for fault in &self.faults {
            let at = fault.at_s;
            svg += &format!(
                "<line x1=\"{0:.1}\" y1=\"{M}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"red\" stroke-dasharray=\"4 3\"/>\n\
                 <text x=\"{2:.1}\" y=\"{3}\" fill=\"red\">{4}</text>\n",
                x(at),
                H - M,
                x(at) + 3.0,
                M + 12.0,
                xml(&fault.what)
            );
        }
        svg + "</svg>\n"
    }
}

/// `text` with XML's special characters escaped.
pub(crate) fn xml(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
