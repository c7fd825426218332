//! The solver's search. A [`Strategy`] gives every chip of a fleet a role (prefill,
//! decode, both, or idle) and sets the batch limits and the conditional-disaggregation
//! threshold; [`analytic::evaluate`] scores it on the objectives — goodput within the
//! SLOs, TTFT p90, TPOT p90, $ per million output tokens, energy per request — from the
//! performance models (roofline step times) and a queueing estimate; [`search`] scores a
//! whole space of them and keeps the Pareto set ([`pareto`]).
//!
//! Like chips are interchangeable in the model, so a strategy says how many chips of
//! each kind take each role, not which: the chips are named when a strategy is applied
//! (the first chips of a kind in topology order prefill, the next decode, ...).
//!
//! The analytic figures screen; the simulator verifies (`tessera-sim` runs a strategy
//! through the production behaviors), and the published figures are the simulated ones.

pub mod analytic;
pub mod pareto;
pub mod search;

use serde::{Deserialize, Serialize};
use tessera_perf::{Link, ModelShape, PerfModel, Power, Roof};

/// What the model knows of one kind of chip in the fleet — or of one shape of model
/// instance (`[[instances]]`: several chips holding one model between them), which the
/// search treats as one chip: its price and power are its chips' together.
#[derive(Debug, Clone, PartialEq)]
pub struct KindSpec {
    pub name: String,
    /// Chips (or instances) of this kind in the fleet.
    pub chips: u32,
    /// An instance's stages, timed as a pipeline with tensor-parallel stages
    /// ([`tessera_perf::parallel::instance_step_s`]); empty for one chip, timed by
    /// `roof` and `perf`.
    pub stages: Vec<tessera_perf::parallel::Stage>,
    pub roof: Roof,
    pub perf: PerfModel,
    /// An emulated chip's pacing scale, 1 for any other.
    pub time_scale: f64,
    /// $ per chip-hour.
    pub usd_per_hour: f64,
    pub power: Power,
    /// Tokens of KV cache one chip's running requests may hold (beside the weights,
    /// below the router's KV breaker).
    pub kv_tokens: u64,
}

/// A fleet: the model it serves and its chips, grouped by kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    pub model: ModelShape,
    pub kinds: Vec<KindSpec>,
    /// The link a prefill chip's KV travels over to its decode chip.
    pub link: Link,
}

/// The traffic a strategy is scored for: open-loop arrivals at a mean rate, mean
/// prompt and output lengths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub rate_rps: f64,
    pub isl: f64,
    pub osl: f64,
}

/// The service level a request must meet to count towards goodput (at p90 here).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_s: f64,
    pub tpot_s: f64,
}

/// How many chips of one kind take each role; the rest of the kind is idle (released,
/// neither paid for nor powered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct Roles {
    pub prefill: u32,
    pub decode: u32,
    pub both: u32,
}

impl Roles {
    /// Chips given a role.
    pub fn active(&self) -> u32 {
        self.prefill + self.decode + self.both
    }
}

/// One point of the strategy space.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Strategy {
    /// Per kind of the fleet, in its order.
    pub roles: Vec<Roles>,
    /// Prompt tokens in one step of a chip that prefills (`max_batch_tokens`).
    pub prefill_budget: u32,
    /// Sequences in one step of a chip that decodes (`max_batch_seqs`).
    pub decode_cap: u32,
    /// Prompts shorter than this run on one chip, undisaggregated.
    pub min_prompt_tokens: u32,
}

impl Strategy {
    /// A short description: `3xascend-910b:P 5xmetax-c500:D budget 2048 cap 256`.
    pub fn describe(&self, fleet: &Fleet) -> String {
        let mut parts = Vec::new();
        for (roles, kind) in self.roles.iter().zip(&fleet.kinds) {
            for (n, role) in [(roles.prefill, "P"), (roles.decode, "D"), (roles.both, "PD")] {
                if n > 0 {
                    parts.push(format!("{n}x{}:{role}", kind.name));
                }
            }
        }
        if parts.is_empty() {
            parts.push("all idle".into());
        }
        format!("{} budget {} cap {}", parts.join(" "), self.prefill_budget, self.decode_cap)
    }
}

/// The values the search tries for a strategy's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    pub prefill_budgets: Vec<u32>,
    pub decode_caps: Vec<u32>,
    pub min_prompt_tokens: Vec<u32>,
}

impl Default for Space {
    fn default() -> Self {
        Space {
            prefill_budgets: vec![512, 1024, 2048, 4096],
            decode_caps: vec![16, 32, 64, 128, 256],
            min_prompt_tokens: vec![32],
        }
    }
}

/// A strategy's objectives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Requests per second within both SLOs at the offered rate. Higher is better.
    pub goodput_rps: f64,
    /// At the offered rate. Lower is better, as for every figure below.
    pub ttft_p90_s: f64,
    pub tpot_p90_s: f64,
    /// The active chips' cost over the output tokens of the goodput.
    pub usd_per_million_tokens: f64,
    /// Board energy of the active chips per request at the offered rate.
    pub joules_per_request: f64,
    /// The active chips' cost.
    pub usd_per_hour: f64,
}

impl Figures {
    /// Requests within SLO per dollar.
    pub fn goodput_per_usd(&self) -> f64 {
        if self.usd_per_hour > 0.0 { self.goodput_rps * 3600.0 / self.usd_per_hour } else { 0.0 }
    }
}

/// What one chip does under a strategy: a role, or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Duty {
    Prefill,
    Decode,
    Both,
    Idle,
}

impl std::fmt::Display for Duty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Duty::Prefill => "prefill",
            Duty::Decode => "decode",
            Duty::Both => "both",
            Duty::Idle => "idle",
        })
    }
}

/// The duty of each chip of one kind under `roles`, the chips doing `now` today (in
/// topology order): a chip keeps its duty while `roles` has room for it, so as few chips
/// as the counts allow drain and switch; the others take the duties left, prefill
/// first, then decode, both and idle, in chip order.
pub fn assign(now: &[Duty], roles: &Roles) -> Vec<Duty> {
    let active = roles.active() as usize;
    let mut left = [
        (Duty::Prefill, roles.prefill as usize),
        (Duty::Decode, roles.decode as usize),
        (Duty::Both, roles.both as usize),
        (Duty::Idle, now.len().saturating_sub(active)),
    ];
    let mut out: Vec<Option<Duty>> = vec![None; now.len()];
    for (slot, &duty) in out.iter_mut().zip(now) {
        if let Some(entry) = left.iter_mut().find(|(d, n)| *d == duty && *n > 0) {
            entry.1 -= 1;
            *slot = Some(duty);
        }
    }
    for slot in out.iter_mut().filter(|s| s.is_none()) {
        if let Some(entry) = left.iter_mut().find(|(_, n)| *n > 0) {
            entry.1 -= 1;
            *slot = Some(entry.0);
        }
    }
    out.into_iter().map(|d| d.unwrap_or(Duty::Idle)).collect()
}

impl Roles {
    /// How many of `duties` take each role.
    pub fn of(duties: &[Duty]) -> Roles {
        let count = |d: Duty| duties.iter().filter(|&&x| x == d).count() as u32;
        Roles { prefill: count(Duty::Prefill), decode: count(Duty::Decode), both: count(Duty::Both) }
    }
}

/// How long chips moving away from duties `from` take to drain, at the strategy in
/// force's figures `now`: a chip that decodes finishes its requests' output at the TPOT
/// p90, a prefill chip its prompts within the TTFT p90. `None` when nothing moves that
/// holds work, or `now` is unknown (the strategy in force does not keep up: its queues
/// set the time).
pub fn drain_estimate(from: impl IntoIterator<Item = Duty>, osl: f64, now: Option<&Figures>) -> Option<f64> {
    let now = now?;
    from.into_iter()
        .filter_map(|duty| match duty {
            Duty::Decode | Duty::Both => Some(osl * now.tpot_p90_s),
            Duty::Prefill => Some(now.ttft_p90_s),
            Duty::Idle => None,
        })
        .reduce(f64::max)
}
