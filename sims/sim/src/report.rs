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
    /// The faults injected, in time order (`"2.5 s: host b down"`).
    pub faults: Vec<String>,
    pub chips: Vec<ChipEnd>,
}

/// How fast the simulator ran: wall-clock figures, different on every run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Speed {
    pub wall_s: f64,
    pub events_per_s: f64,
    pub simulated_s_per_wall_s: f64,
}

impl Speed {
    pub fn of(report: &Report, wall_s: f64) -> Speed {
        let per_wall = |x: f64| if wall_s > 0.0 { x / wall_s } else { 0.0 };
        Speed {
            wall_s,
            events_per_s: per_wall(report.events as f64),
            simulated_s_per_wall_s: per_wall(report.simulated_s),
        }
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
            self.requests, self.rate_rps, self.completed, self.failed, self.unfinished
        );
        for (why, n) in &self.failures {
            let _ = writeln!(t, "  {n} x {why}");
        }
        for fault in &self.faults {
            let _ = writeln!(t, "fault      {fault}");
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
        let _ = writeln!(t, "output     {} tokens, {:.1} tokens/s", self.output_tokens, self.output_tokens_per_s);
        let _ = writeln!(t, "KV blocks  {} still used at the end", self.kv_blocks_used_at_end);
        if let Some(hit) = self.prefix_hit_rate {
            let _ = writeln!(t, "prefix     hit rate {hit:.3} (prompt tokens reused from prefix caches)");
        }
        let _ = writeln!(
            t,
            "\n{:<12} {:<8} {:<9} {:>8} {:>10} {:>8}  modelled as",
            "chip", "role", "state", "steps", "KV blocks", "used"
        );
        for c in &self.chips {
            let _ = writeln!(
                t,
                "{:<12} {:<8} {:<9} {:>8} {:>10} {:>8}  {}",
                c.id,
                c.role,
                c.state,
                c.steps,
                c.kv_blocks_total,
                c.kv_blocks_used,
                c.modelled_as.as_deref().unwrap_or("-")
            );
        }
        let _ = writeln!(
            t,
            "\nsimulated  {:.3} s in {:.3} s of wall time ({:.1} simulated s per wall s); {} events, {:.0} events/s",
            self.simulated_s, speed.wall_s, speed.simulated_s_per_wall_s, self.events, speed.events_per_s
        );
        t
    }
}
