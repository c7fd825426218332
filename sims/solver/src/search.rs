//! The search over a fleet's strategy space: every split of each kind's chips into
//! roles, under every setting of the limits, scored analytically, kept when on the
//! Pareto set.
//!
//! Splits the router would leave chips of unused are skipped, as the strategy with
//! those chips idle scores the same for less: `both` chips while prompts are
//! disaggregated (the router only colocates when it cannot disaggregate), and
//! `prefill` chips while it colocates on chips that decode. [`exhaustive`] scores every
//! assignment of every chip instead; a test holds the two to the same set.

use crate::analytic::{Tables, evaluate};
use crate::pareto::{Candidate, Frontier};
use crate::{Fleet, Roles, Slo, Space, Strategy, Workload};

/// The most strategies one search scores.
pub const MAX_STRATEGIES: u64 = 50_000_000;

/// Why a space cannot be searched.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SearchError {
    #[error("the fleet has no chips")]
    NoChips,
    #[error("the space has no {0} to try")]
    EmptyKnob(&'static str),
    #[error(
        "the space holds {0} strategies, more than the {MAX_STRATEGIES} one search scores: fewer chips of a kind, or fewer limits to try"
    )]
    TooLarge(u64),
    #[error("the workload must have a positive rate and lengths, not {0}")]
    BadWorkload(String),
}

/// Role splits of one kind of `n` chips: (prefill, decode, both), the rest idle.
fn splits(n: u32) -> Vec<Roles> {
    let mut out = Vec::new();
    for prefill in 0..=n {
        for decode in 0..=n - prefill {
            for both in 0..=n - prefill - decode {
                out.push(Roles { prefill, decode, both });
            }
        }
    }
    out
}

/// Every combination of one split per kind, in order.
fn combinations(per_kind: &[Vec<Roles>], mut visit: impl FnMut(&[Roles])) {
    if per_kind.iter().any(|s| s.is_empty()) {
        return;
    }
    let mut index = vec![0usize; per_kind.len()];
    let mut current: Vec<Roles> = per_kind.iter().map(|s| s[0]).collect();
    loop {
        visit(&current);
        let mut k = 0;
        loop {
            if k == per_kind.len() {
                return;
            }
            index[k] += 1;
            if index[k] < per_kind[k].len() {
                current[k] = per_kind[k][index[k]];
                break;
            }
            index[k] = 0;
            current[k] = per_kind[k][0];
            k += 1;
        }
    }
}

fn check(fleet: &Fleet, workload: &Workload, space: &Space) -> Result<u64, SearchError> {
    if fleet.kinds.iter().all(|k| k.chips == 0) {
        return Err(SearchError::NoChips);
    }
    for (name, empty) in [
        ("prefill_budgets", space.prefill_budgets.is_empty()),
        ("decode_caps", space.decode_caps.is_empty()),
        ("min_prompt_tokens", space.min_prompt_tokens.is_empty()),
    ] {
        if empty {
            return Err(SearchError::EmptyKnob(name));
        }
    }
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !(ok(workload.rate_rps) && ok(workload.isl) && ok(workload.osl)) {
        return Err(SearchError::BadWorkload(format!(
            "{} req/s, {} prompt / {} output tokens",
            workload.rate_rps, workload.isl, workload.osl
        )));
    }
    let knobs = (space.prefill_budgets.len() * space.decode_caps.len() * space.min_prompt_tokens.len()) as u64;
    let mut total = knobs;
    for kind in &fleet.kinds {
        let n = kind.chips as u64;
        total = total.saturating_mul((n + 1) * (n + 2) * (n + 3) / 6);
    }
    if total > MAX_STRATEGIES {
        return Err(SearchError::TooLarge(total));
    }
    Ok(total)
}

/// Whether the router would leave some active chip of `roles` unused.
fn leaves_chips_unused(roles: &[Roles], workload: &Workload, min_prompt_tokens: u32) -> bool {
    let sum = |f: fn(&Roles) -> u32| roles.iter().map(f).sum::<u32>();
    let (prefill, decode, both) = (sum(|r| r.prefill), sum(|r| r.decode), sum(|r| r.both));
    let disaggregates = prefill > 0 && decode > 0 && workload.isl >= min_prompt_tokens as f64;
    if disaggregates { both > 0 } else { prefill > 0 && decode + both > 0 }
}

/// Scores every combination of per-kind splits from `per_kind` under every setting of
/// `space`, skipping those `skip` names, into one Pareto set.
fn scan(
    fleet: &Fleet,
    workload: &Workload,
    slo: &Slo,
    space: &Space,
    per_kind: &[Vec<Roles>],
    skip: impl Fn(&[Roles], u32) -> bool,
) -> Vec<Candidate> {
    let mut frontier = Frontier::default();
    for &budget in &space.prefill_budgets {
        for &cap in &space.decode_caps {
            let tables = Tables::new(fleet, workload, budget, cap);
            for &min_prompt_tokens in &space.min_prompt_tokens {
                combinations(per_kind, |roles| {
                    if skip(roles, min_prompt_tokens) {
                        return;
                    }
                    let strategy =
                        Strategy { roles: roles.to_vec(), prefill_budget: budget, decode_cap: cap, min_prompt_tokens };
                    if let Some(figures) = evaluate(fleet, &tables, &strategy, workload, slo) {
                        frontier.offer(Candidate { strategy, figures });
                    }
                });
            }
        }
    }
    frontier.into_sorted()
}

/// The Pareto set of `fleet`'s strategies for `workload` within `slo`.
pub fn solve(fleet: &Fleet, workload: &Workload, slo: &Slo, space: &Space) -> Result<Vec<Candidate>, SearchError> {
    check(fleet, workload, space)?;
    let per_kind: Vec<Vec<Roles>> = fleet.kinds.iter().map(|k| splits(k.chips)).collect();
    Ok(scan(fleet, workload, slo, space, &per_kind, |roles, min| leaves_chips_unused(roles, workload, min)))
}

/// The Pareto set from every assignment of a role to every chip, one by one (4^chips
/// of them, each scored as the split it makes): the reference [`solve`] is tested
/// against, for small fleets.
pub fn exhaustive(fleet: &Fleet, workload: &Workload, slo: &Slo, space: &Space) -> Result<Vec<Candidate>, SearchError> {
    check(fleet, workload, space)?;
    let chips: u32 = fleet.kinds.iter().map(|k| k.chips).sum();
    if 4u64.saturating_pow(chips) > MAX_STRATEGIES {
        return Err(SearchError::TooLarge(4u64.saturating_pow(chips)));
    }
    // Each chip is one "kind" of its own with four choices; the splits they add up to
    // are then scored per kind of the fleet.
    let one = vec![
        Roles::default(),
        Roles { prefill: 1, ..Roles::default() },
        Roles { decode: 1, ..Roles::default() },
        Roles { both: 1, ..Roles::default() },
    ];
    let owner: Vec<usize> =
        fleet.kinds.iter().enumerate().flat_map(|(k, kind)| std::iter::repeat_n(k, kind.chips as usize)).collect();
    let per_chip = vec![one; chips as usize];
    let mut frontier = Frontier::default();
    for &budget in &space.prefill_budgets {
        for &cap in &space.decode_caps {
            let tables = Tables::new(fleet, workload, budget, cap);
            for &min_prompt_tokens in &space.min_prompt_tokens {
                combinations(&per_chip, |assignment| {
                    let mut roles = vec![Roles::default(); fleet.kinds.len()];
                    for (chip, r) in assignment.iter().enumerate() {
                        let k = &mut roles[owner[chip]];
                        k.prefill += r.prefill;
                        k.decode += r.decode;
                        k.both += r.both;
                    }
                    let strategy = Strategy { roles, prefill_budget: budget, decode_cap: cap, min_prompt_tokens };
                    if let Some(figures) = evaluate(fleet, &tables, &strategy, workload, slo) {
                        frontier.offer(Candidate { strategy, figures });
                    }
                });
            }
        }
    }
    Ok(frontier.into_sorted())
}
