//! The analytic model that screens strategies: step times from the roofline
//! (`tessera-perf`, the model emulated and simulated chips are timed by) and a queueing
//! estimate around them.
//!
//! The router's rule decides where requests go (see `place` in the router): a prompt
//! of at least `min_prompt_tokens` tokens is disaggregated when the strategy has both a
//! prefill and a decode chip; otherwise every request runs whole on one chip that
//! decodes (`decode` or `both`; a `prefill` chip only when no chip decodes).
//!
//! - **Disaggregated**: the prefill chips are one pool of servers (an M/D/c queue,
//!   Sakasegawa's approximation, the chips' shares in proportion to their speed); a
//!   prompt's TTFT is its wait, its chunked prefill, and the hand-off of its last layer
//!   (the earlier layers stream during the prefill). Each decode chip carries output
//!   tokens in proportion to its capacity and installs each of its requests' KV over
//!   the link between its steps; its batch is what that rate needs by Little's law in
//!   the time the installs leave, and TPOT is the step time of that batch stretched by
//!   the installs.
//! - **Colocated**: each chip's steps carry its decodes and, in a share of its steps,
//!   a chunk of a prompt: the share and the batch solve both the prompt tokens' and
//!   the output tokens' rates at once, TPOT is the mean step, and a prompt's service
//!   is its chunks at the mixed steps' time.
//!
//! A wait is 0 with the probability of not waiting and exponential beyond it; the p90s
//! are a request's service at the 90th percentile of the chips' shares plus the wait's
//! 90th percentile. Goodput is the offered rate times the share of requests that meet
//! both SLOs (each kind's share of requests, its service and TPOT, the wait's tail), as
//! the simulator counts it: a strategy that cannot keep up with the offered rate has
//! none, since its queues grow without bound. These are screening figures; the
//! simulator verifies.

use tessera_perf::parallel::instance_step_s;
use tessera_perf::{ModelShape, SeqStep, StepShape, roofline};

use crate::{Figures, Fleet, KindSpec, Slo, Strategy, Workload};

/// Bisection rounds for a decode batch.
const BATCH_ROUNDS: u32 = 40;
/// Standard deviations of the running-sequence count a chip's mean batch leaves below
/// its cap (see [`KindTable::usable_batch`]).
const SWING: f64 = 1.0;
/// Points of a kind's rate tables (see [`KindTable::tabulate`]).
const RATE_POINTS: usize = 1024;
/// A pool counts as saturated from this utilisation on.
const MAX_UTILISATION: f64 = 0.995;

/// One kind's step times under one setting of the limits.
#[derive(Debug, Clone)]
struct KindTable {
    /// One prompt alone, chunked by the budget.
    prefill_s: f64,
    /// Prompts per second a chip prefills when saturated (prompts shorter than the
    /// budget share a step).
    prefill_rate: f64,
    /// A decode-only step of `b` sequences at the mean context, at index `b - 1`.
    decode_s: Vec<f64>,
    /// Prompt tokens a step with `b` decodes carries, at index `b`: the budget counts
    /// every token of a step, a decode's one included (as the batcher does).
    mixed_chunk: Vec<f64>,
    /// A step of that chunk and `b` decodes, at index `b`.
    mixed_s: Vec<f64>,
    /// The most sequences a chip decodes at once: the cap, or fewer when its KV (or
    /// the step's token budget) runs out.
    max_batch: usize,
    /// Output tokens per second at the largest mean batch, decode-only.
    capacity: f64,
    /// The decode batch a chip runs at evenly spaced output rates from 0 up to (not
    /// including) `decode_rate_max` tokens/s (see [`solve_decode_batch`]).
    decode_batches: Vec<f64>,
    decode_rate_max: f64,
    /// A colocated chip's (batch, chunk-step share) at evenly spaced request rates from
    /// 0 up to (not including) `colocated_rps_max`, the most it keeps up with (see
    /// [`solve_colocated_mix`]).
    colocated: Vec<(f64, f64)>,
    colocated_rps_max: f64,
}

impl KindTable {
    fn new(kind: &KindSpec, model: &ModelShape, workload: &Workload, budget: u32, cap: u32) -> KindTable {
        let time = |step: &StepShape| {
            if kind.stages.is_empty() {
                roofline(kind.roof, model, step, &kind.perf, kind.time_scale).time_s
            } else {
                instance_step_s(model, &kind.stages, step) * kind.time_scale
            }
        };
        let isl = workload.isl.round().max(1.0) as usize;
        let context = (workload.isl + workload.osl / 2.0).round().max(1.0) as usize;
        let budget = budget.max(1) as usize;
        let chunk = isl.min(budget);
        let (mut prefill_s, mut done) = (0.0, 0);
        while done < isl {
            let n = chunk.min(isl - done);
            done += n;
            prefill_s += time(&StepShape { seqs: vec![SeqStep { new_tokens: n, context: done }] });
        }
        let prefill_rate = if isl >= budget {
            1.0 / prefill_s
        } else {
            let per_step = budget / isl;
            per_step as f64 / time(&StepShape { seqs: vec![SeqStep { new_tokens: isl, context: isl }; per_step] })
        };
        // A running sequence holds its prompt and, on average, half its output.
        let per_seq = (workload.isl + workload.osl / 2.0).max(1.0);
        let max_batch = (cap as usize).min(budget).min((kind.kv_tokens as f64 / per_seq) as usize);
        let decode_s = (1..=max_batch).map(|b| time(&StepShape::decode(b, context))).collect();
        let mixed_chunk: Vec<f64> = (0..=max_batch).map(|b| isl.min(budget - b) as f64).collect();
        let mixed_s = (0..=max_batch)
            .map(|b| {
                let chunk = isl.min(budget - b);
                let mut seqs = vec![SeqStep { new_tokens: 1, context }; b];
                if chunk > 0 {
                    seqs.push(SeqStep { new_tokens: chunk, context: (isl + chunk) / 2 });
                }
                time(&StepShape { seqs })
            })
            .collect();
        let mut table = KindTable {
            prefill_s,
            prefill_rate,
            decode_s,
            mixed_chunk,
            mixed_s,
            max_batch,
            capacity: 0.0,
            decode_batches: Vec::new(),
            decode_rate_max: 0.0,
            colocated: Vec::new(),
            colocated_rps_max: 0.0,
        };
        table.tabulate(workload);
        table
    }

    /// Fills the rate tables: the solves of every strategy's chips then take a lookup.
    fn tabulate(&mut self, workload: &Workload) {
        let b = self.usable_batch();
        let t = self.decode_at(b);
        self.capacity = if b > 0.0 && t > 0.0 { b / t } else { 0.0 };
        let step = |max: f64| max / (RATE_POINTS - 1) as f64;
        self.decode_rate_max = self.decode_capacity() * MAX_UTILISATION;
        let s = step(self.decode_rate_max);
        self.decode_batches =
            (0..RATE_POINTS).map(|i| solve_decode_batch(self, i as f64 * s * (1.0 - 1e-12)).unwrap_or(0.0)).collect();
        // The most requests a second the chip keeps up with, colocated: at most its
        // decode capacity's worth of outputs.
        let (mut lo, mut hi) = (0.0, self.decode_capacity() / workload.osl.max(1.0));
        for _ in 0..BATCH_ROUNDS {
            let mid = (lo + hi) / 2.0;
            if solve_colocated_mix(self, workload, mid).is_some() { lo = mid } else { hi = mid }
        }
        self.colocated_rps_max = lo;
        let s = step(lo);
        self.colocated =
            (0..RATE_POINTS).map(|i| solve_colocated_mix(self, workload, i as f64 * s).unwrap_or((0.0, 0.0))).collect();
    }

    /// The batch at which a chip carries `tokens_per_s` output tokens decode-only, or
    /// `None` past its full batch (interpolated in the rate table).
    fn decode_batch(&self, tokens_per_s: f64) -> Option<f64> {
        if tokens_per_s.is_nan() || tokens_per_s >= self.decode_rate_max {
            return None;
        }
        let x = tokens_per_s.max(0.0) / self.decode_rate_max * (RATE_POINTS - 1) as f64;
        Some(interpolate(&self.decode_batches, x))
    }

    /// A colocated chip's batch and chunk-step share at `rps` requests a second, or
    /// `None` past what it keeps up with (interpolated in the rate table).
    fn colocated_mix(&self, rps: f64) -> Option<(f64, f64)> {
        if rps.is_nan() || rps >= self.colocated_rps_max {
            return None;
        }
        let x = rps.max(0.0) / self.colocated_rps_max * (RATE_POINTS - 1) as f64;
        let i = (x.floor() as usize).min(RATE_POINTS - 2);
        let (a, b) = (self.colocated[i], self.colocated[i + 1]);
        let frac = (x - i as f64).clamp(0.0, 1.0);
        Some((a.0 + (b.0 - a.0) * frac, a.1 + (b.1 - a.1) * frac))
    }

    /// A decode step of `b` sequences (fractional: interpolated; under one: one's).
    fn decode_at(&self, b: f64) -> f64 {
        interpolate(&self.decode_s, b - 1.0)
    }

    /// Prompt tokens in a step with `b` decodes.
    fn chunk_at(&self, b: f64) -> f64 {
        interpolate(&self.mixed_chunk, b)
    }

    /// A chunk step with `b` decodes.
    fn mixed_at(&self, b: f64) -> f64 {
        interpolate(&self.mixed_s, b)
    }

    /// The largest mean batch a chip runs at: the number of running sequences swings
    /// (a Poisson count), so the mean leaves room for [`SWING`] standard deviations
    /// below the cap — `b + SWING sqrt(b) <= max_batch` — or the swings queue requests
    /// at the cap.
    fn usable_batch(&self) -> f64 {
        if self.max_batch == 0 {
            return 0.0;
        }
        // b + SWING * sqrt(b) = max: sqrt(b) = (sqrt(SWING^2 / 4 + max) - SWING / 2).
        let root = (SWING * SWING / 4.0 + self.max_batch as f64).sqrt() - SWING / 2.0;
        root * root
    }

    /// Output tokens per second at the largest mean batch, decode-only (computed once,
    /// by [`KindTable::tabulate`]).
    fn decode_capacity(&self) -> f64 {
        self.capacity
    }
}

/// `table` at fractional index `x`, clamped to its ends.
fn interpolate(table: &[f64], x: f64) -> f64 {
    let Some(&last) = table.last() else { return f64::INFINITY };
    if x <= 0.0 {
        return table[0];
    }
    let i = x.floor() as usize;
    if i + 1 >= table.len() {
        return last;
    }
    let frac = x - i as f64;
    table[i] * (1.0 - frac) + table[i + 1] * frac
}

/// The step-time tables of every kind of `fleet` under one setting of the limits:
/// built once, shared by every role split scored with them.
#[derive(Debug, Clone)]
pub struct Tables {
    kinds: Vec<KindTable>,
    prefill_budget: u32,
    decode_cap: u32,
}

impl Tables {
    pub fn new(fleet: &Fleet, workload: &Workload, prefill_budget: u32, decode_cap: u32) -> Tables {
        let kinds =
            fleet.kinds.iter().map(|k| KindTable::new(k, &fleet.model, workload, prefill_budget, decode_cap)).collect();
        Tables { kinds, prefill_budget, decode_cap }
    }
}

/// Step-time tables kept from one solve to the next. They depend on the kinds' figures,
/// the model and the mean prompt and output lengths, not on the arrival rate nor on how
/// many chips of each kind are up, so a re-solve after the rate moves or a chip goes
/// down reuses every one of them (the search's first step for each setting of the
/// limits); a change of kinds, model or lengths starts afresh.
#[derive(Debug, Default)]
pub struct TableCache {
    key: Option<(Vec<KindSpec>, ModelShape, u64, u64)>,
    tables: std::collections::BTreeMap<(u32, u32), std::sync::Arc<Tables>>,
    /// Tables built, and tables reused, since the cache was made.
    pub built: u64,
    pub reused: u64,
}

impl TableCache {
    /// The tables of `fleet`'s kinds for `workload` at these limits, built or reused.
    pub fn tables(&mut self, fleet: &Fleet, workload: &Workload, budget: u32, cap: u32) -> std::sync::Arc<Tables> {
        let kinds = fleet.kinds.iter().map(|k| KindSpec { chips: 0, ..k.clone() }).collect();
        let key = Some((kinds, fleet.model, workload.isl.to_bits(), workload.osl.to_bits()));
        if self.key != key {
            self.key = key;
            self.tables.clear();
        }
        if let Some(t) = self.tables.get(&(budget, cap)) {
            self.reused += 1;
            return t.clone();
        }
        self.built += 1;
        let t = std::sync::Arc::new(Tables::new(fleet, workload, budget, cap));
        self.tables.insert((budget, cap), t.clone());
        t
    }
}

/// What a strategy's chips do at one arrival rate.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Load {
    ttft_p90_s: f64,
    tpot_p90_s: f64,
    /// The share of requests within both SLOs.
    within_slo: f64,
    /// Board power of the active chips.
    watts: f64,
}

/// The wait of a pooled queue: none with probability `1 - p_wait`, else exponential
/// with mean `tail_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Wait {
    p_wait: f64,
    tail_s: f64,
}

impl Wait {
    /// The wait in an M/D/c queue of `servers` at utilisation `rho` and arrival rate
    /// `rate` (Sakasegawa's approximation of the mean wait; the probability of waiting
    /// from the same power of `rho`).
    fn of(servers: f64, rho: f64, rate: f64) -> Wait {
        if rho <= 0.0 || rate <= 0.0 {
            return Wait { p_wait: 0.0, tail_s: 0.0 };
        }
        let power = (2.0 * (servers + 1.0)).sqrt();
        // Poisson arrivals (cv^2 = 1), deterministic service (cv^2 = 0).
        let mean_wait = rho.powf(power) / (1.0 - rho) * 0.5 / rate;
        let p_wait = rho.powf(power - 1.0).min(1.0);
        if p_wait <= 0.0 {
            return Wait { p_wait: 0.0, tail_s: 0.0 };
        }
        Wait { p_wait, tail_s: mean_wait / p_wait }
    }

    /// The wait's 90th percentile.
    fn p90(&self) -> f64 {
        if self.p_wait <= 0.1 { 0.0 } else { self.tail_s * (self.p_wait / 0.1).ln() }
    }

    /// The probability that the wait is at most `s`.
    fn within(&self, s: f64) -> f64 {
        if s < 0.0 {
            0.0
        } else if self.tail_s <= 0.0 {
            1.0
        } else {
            1.0 - self.p_wait * (-s / self.tail_s).exp()
        }
    }
}

/// The value below which `share` of the weight lies, over (value, weight) pairs.
fn weighted_quantile(mut points: Vec<(f64, f64)>, share: f64) -> f64 {
    points.retain(|&(_, w)| w > 0.0);
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: f64 = points.iter().map(|p| p.1).sum();
    let mut seen = 0.0;
    for &(value, weight) in &points {
        seen += weight;
        if seen >= share * total {
            return value;
        }
    }
    points.last().map_or(0.0, |p| p.0)
}

/// The batch at which a chip of `table` carries `tokens_per_s` output tokens decode-only
/// (Little: batch / step time), or `None` past its full batch.
fn solve_decode_batch(table: &KindTable, tokens_per_s: f64) -> Option<f64> {
    if tokens_per_s <= 0.0 {
        return Some(0.0);
    }
    if tokens_per_s >= table.decode_capacity() * MAX_UTILISATION {
        return None;
    }
    let (mut lo, mut hi) = (0.0, table.usable_batch());
    for _ in 0..BATCH_ROUNDS {
        let mid = (lo + hi) / 2.0;
        if mid / table.decode_at(mid) < tokens_per_s { lo = mid } else { hi = mid }
    }
    Some(hi)
}

/// A colocated chip's batch and chunk-step share when it takes `rps` requests a
/// second: `None` when no batch up to its largest mean one keeps up.
fn solve_colocated_mix(table: &KindTable, workload: &Workload, rps: f64) -> Option<(f64, f64)> {
    if rps <= 0.0 {
        return Some((0.0, 0.0));
    }
    let (out_rate, in_rate) = (rps * workload.osl, rps * workload.isl);
    // With a batch of b: a step each `b / out_rate` seconds, a chunk in a share f of
    // them; the batch that balances is where the mean step time meets that pace.
    let mix = |b: f64| {
        let step = b.max(1e-9) / out_rate;
        let chunk = table.chunk_at(b);
        let f = if chunk > 0.0 { in_rate * step / chunk } else { f64::INFINITY };
        (f, (1.0 - f) * table.decode_at(b) + f * table.mixed_at(b) - step)
    };
    // The mean step time less the pace shrinks as the batch grows; past the full batch
    // it cannot keep up. The chunk share at the balance must be at most every step
    // (checked there: it grows with the batch, so a full batch's share says nothing).
    let full = table.usable_batch();
    if mix(full).1 >= 0.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0, full);
    for _ in 0..BATCH_ROUNDS {
        let mid = (lo + hi) / 2.0;
        if mix(mid).1 > 0.0 { lo = mid } else { hi = mid }
    }
    let (f, _) = mix(hi);
    (f <= 1.0).then_some((hi, f))
}

/// One side of a disaggregated strategy at one rate: the share of requests it keeps
/// within its SLO (TTFT for prefill, TPOT for decode), its p90 of that figure, and its
/// chips' board power.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Side {
    pub ok: f64,
    pub p90_s: f64,
    pub watts: f64,
}

/// `counts[k]` chips of each kind prefilling for decode chips, at `rate`: `None` when
/// they cannot keep up (or there are none).
pub(crate) fn prefill_side(
    fleet: &Fleet,
    tables: &Tables,
    counts: &[u32],
    workload: &Workload,
    slo: &Slo,
    rate: f64,
) -> Option<Side> {
    let kinds = || fleet.kinds.iter().zip(&tables.kinds).zip(counts);
    let capacity: f64 = kinds().map(|((_, t), &n)| n as f64 * t.prefill_rate).sum();
    let rho = rate / capacity;
    if rho.is_nan() || rho >= MAX_UTILISATION {
        return None;
    }
    let service =
        weighted_quantile(kinds().map(|((_, t), &n)| (t.prefill_s, n as f64 * t.prefill_rate)).collect(), 0.9);
    let layers = fleet.model.num_layers.max(1) as u64;
    let last_layer = (workload.isl.max(1.0) as u64) * fleet.model.kv_bytes_per_token() / layers;
    let handoff = fleet.link.transfer_s(last_layer);
    let servers: u32 = counts.iter().sum();
    let wait = Wait::of(servers as f64, rho, rate);
    let ok = kinds()
        .map(|((_, t), &n)| n as f64 * t.prefill_rate / capacity * wait.within(slo.ttft_s - t.prefill_s - handoff))
        .sum();
    let watts = kinds().map(|((k, _), &n)| n as f64 * busy_watts(k, rho, 0.0)).sum();
    Some(Side { ok, p90_s: service + wait.p90() + handoff, watts })
}

/// `counts[k]` chips of each kind decoding what prefill chips hand them, at `rate`,
/// output tokens in proportion to each chip's capacity: `None` when they cannot keep up.
pub(crate) fn decode_side(
    fleet: &Fleet,
    tables: &Tables,
    counts: &[u32],
    workload: &Workload,
    slo: &Slo,
    rate: f64,
) -> Option<Side> {
    let capacity: f64 = tables.kinds.iter().zip(counts).map(|(t, &n)| n as f64 * t.decode_capacity()).sum();
    if capacity.is_nan() || capacity <= 0.0 || tables.kinds.iter().zip(counts).any(|(t, &n)| n > 0 && t.max_batch == 0)
    {
        return None;
    }
    // A decode chip installs each request's KV as it arrives, between its steps: the
    // whole prompt's cache over the link.
    let install_s = fleet.link.transfer_s((workload.isl.max(1.0) as u64) * fleet.model.kv_bytes_per_token());
    let tokens = rate * workload.osl;
    let (mut tpots, mut ok, mut watts) = (Vec::new(), 0.0, 0.0);
    for ((table, &n), kind) in tables.kinds.iter().zip(counts).zip(&fleet.kinds) {
        if n == 0 {
            continue;
        }
        let per_chip = tokens * table.decode_capacity() / capacity;
        let installing = per_chip / workload.osl.max(1.0) * install_s;
        if installing >= MAX_UTILISATION {
            return None;
        }
        // Steps run in the rest of the time, each a pause longer for the installs.
        let batch = table.decode_batch(per_chip / (1.0 - installing))?;
        let tpot = table.decode_at(batch) / (1.0 - installing);
        tpots.push((tpot, per_chip * n as f64));
        if tpot <= slo.tpot_s {
            ok += per_chip * n as f64 / tokens;
        }
        let stepping = batch.min(1.0) * (1.0 - installing);
        watts += n as f64 * busy_watts(kind, 0.0, stepping + installing);
    }
    Some(Side { ok, p90_s: weighted_quantile(tpots, 0.9), watts })
}

/// The strategy's chips at `rate` requests a second, or `None` when they cannot keep up.
fn load_at(
    fleet: &Fleet,
    tables: &Tables,
    strategy: &Strategy,
    workload: &Workload,
    slo: &Slo,
    rate: f64,
) -> Option<Load> {
    let kinds = fleet.kinds.iter().zip(&tables.kinds).zip(&strategy.roles);
    let prefills: u32 = strategy.roles.iter().map(|r| r.prefill).sum();
    let decodes: u32 = strategy.roles.iter().map(|r| r.decode).sum();
    let disaggregated = prefills > 0 && decodes > 0 && workload.isl >= strategy.min_prompt_tokens as f64;
    let mut watts = 0.0;
    if disaggregated {
        let p: Vec<u32> = strategy.roles.iter().map(|r| r.prefill).collect();
        let d: Vec<u32> = strategy.roles.iter().map(|r| r.decode).collect();
        let prefill = prefill_side(fleet, tables, &p, workload, slo, rate)?;
        let decode = decode_side(fleet, tables, &d, workload, slo, rate)?;
        // `both` chips take nothing while the cluster disaggregates.
        let idle: f64 = kinds.map(|((k, _), r)| r.both as f64 * k.power.idle_w).sum();
        return Some(Load {
            ttft_p90_s: prefill.p90_s,
            tpot_p90_s: decode.p90_s,
            within_slo: prefill.ok * decode.ok,
            watts: prefill.watts + decode.watts + idle,
        });
    }
    // Colocated: chips that decode, or prefill chips when none does.
    let any_decodes = decodes + strategy.roles.iter().map(|r| r.both).sum::<u32>() > 0;
    let serving = |r: &crate::Roles| if any_decodes { r.decode + r.both } else { r.prefill };
    let capacity: f64 = kinds.clone().map(|((_, t), r)| serving(r) as f64 * t.decode_capacity()).sum();
    if capacity <= 0.0 || kinds.clone().any(|((_, t), r)| serving(r) > 0 && t.max_batch == 0) {
        return None;
    }
    let (mut ttfts, mut tpots, mut prefill_rate, mut servers) = (Vec::new(), Vec::new(), 0.0, 0.0);
    // (share of requests, service, TPOT) per kind, for the share within the SLOs.
    let mut shares = Vec::new();
    for ((kind, table), roles) in kinds {
        let n = serving(roles);
        watts += (roles.active() - n) as f64 * kind.power.idle_w;
        if n == 0 {
            continue;
        }
        let rps = rate * table.decode_capacity() / capacity;
        let (batch, f) = table.colocated_mix(rps)?;
        let step = (1.0 - f) * table.decode_at(batch) + f * table.mixed_at(batch);
        let chunk = table.chunk_at(batch).max(1.0);
        let service = (workload.isl / chunk).ceil().max(1.0) * table.mixed_at(batch);
        tpots.push((step, rps * n as f64));
        ttfts.push((service, rps * n as f64));
        shares.push((rps * n as f64 / rate, service, step));
        // A chunk step serves `chunk / isl` prompts.
        prefill_rate += n as f64 * (chunk / workload.isl.max(1.0)) / table.mixed_at(batch);
        servers += n as f64;
        watts += n as f64 * busy_watts(kind, f, batch.min(1.0) * (1.0 - f));
    }
    let rho = rate / prefill_rate;
    if rho >= MAX_UTILISATION {
        return None;
    }
    let wait = Wait::of(servers, rho, rate);
    let ttft = weighted_quantile(ttfts, 0.9) + wait.p90();
    let within_slo = shares
        .iter()
        .map(|&(share, service, tpot)| if tpot <= slo.tpot_s { share * wait.within(slo.ttft_s - service) } else { 0.0 })
        .sum();
    Some(Load { ttft_p90_s: ttft, tpot_p90_s: weighted_quantile(tpots, 0.9), within_slo, watts })
}

/// A chip's board power busy in prefill a share `prefill` of the time and in decode a
/// share `decode`, idle otherwise.
fn busy_watts(kind: &KindSpec, prefill: f64, decode: f64) -> f64 {
    let idle = (1.0 - prefill - decode).max(0.0);
    kind.power.prefill_w * prefill + kind.power.decode_w * decode + kind.power.idle_w * idle
}

/// `strategy`'s objectives for `workload` within `slo`, with `tables` built for its
/// limits; `None` when it gives no chip a role, cannot keep up with the offered rate,
/// or serves no request within the SLOs.
pub fn evaluate(
    fleet: &Fleet,
    tables: &Tables,
    strategy: &Strategy,
    workload: &Workload,
    slo: &Slo,
) -> Option<Figures> {
    debug_assert_eq!((tables.prefill_budget, tables.decode_cap), (strategy.prefill_budget, strategy.decode_cap));
    let usd_per_hour: f64 =
        strategy.roles.iter().zip(&fleet.kinds).map(|(r, k)| r.active() as f64 * k.usd_per_hour).sum();
    if strategy.roles.iter().all(|r| r.active() == 0) || workload.rate_rps <= 0.0 {
        return None;
    }
    let load = load_at(fleet, tables, strategy, workload, slo, workload.rate_rps)?;
    figures(usd_per_hour, workload, load.within_slo, load.ttft_p90_s, load.tpot_p90_s, load.watts)
}

/// The objectives of chips costing `usd_per_hour` that keep a share `within_slo` of
/// `workload`'s requests within the SLOs at these p90s, drawing `watts`: `None` when
/// none is within.
pub(crate) fn figures(
    usd_per_hour: f64,
    workload: &Workload,
    within_slo: f64,
    ttft_p90_s: f64,
    tpot_p90_s: f64,
    watts: f64,
) -> Option<Figures> {
    let goodput = workload.rate_rps * within_slo.clamp(0.0, 1.0);
    if goodput.is_nan() || goodput <= 0.0 {
        return None;
    }
    let tokens_per_hour = goodput * workload.osl * 3600.0;
    Some(Figures {
        goodput_rps: goodput,
        ttft_p90_s,
        tpot_p90_s,
        usd_per_million_tokens: usd_per_hour / tokens_per_hour * 1e6,
        joules_per_request: watts / workload.rate_rps,
        usd_per_hour,
    })
}

#[cfg(test)]
mod tests;
