//! The search over a fleet's strategy space: every split of each kind's chips into
//! roles, under every setting of the limits, scored analytically, kept when on the
//! Pareto set.
//!
//! Splits the router would leave chips of unused are skipped, as the strategy with
//! those chips idle scores the same for less: `both` chips while prompts are
//! disaggregated (the router only colocates when it cannot disaggregate), and
//! `prefill` chips while it colocates on chips that decode. [`exhaustive`] scores every
//! assignment of every chip instead; a test holds the two to the same set.
//!
//! A space past [`EXACT_LIMIT`] strategies (a thousand chips of six kinds holds some
//! 10^30) is screened instead ([`screen`]): each kind's chips in steps of a fraction of
//! the kind, colocated splits scored whole, and disaggregated ones by their sides — the
//! prefill chips' TTFT depends on the prefill chips alone and the decode chips' TPOT on
//! the decode chips alone, so each side keeps its own Pareto set (share within its
//! SLO, p90, $, watts) and only pairs of two sides' members that fit the fleet are
//! scored. A side's member drops out only for one at least as good that uses no more
//! chips of any kind, which then fits wherever the dropped one did: pairing the sides'
//! sets is exact (a test holds it to the full search); the steps are not.

use crate::analytic::{Side, TableCache, Tables, decode_side, evaluate, prefill_side};
use crate::pareto::{Candidate, Frontier};
use crate::{Fleet, Roles, Slo, Space, Strategy, Workload};

/// The most strategies the exhaustive reference scores.
pub const MAX_STRATEGIES: u64 = 50_000_000;
/// Up to this many strategies, [`solve`] scores every one.
pub const EXACT_LIMIT: u64 = 2_000_000;
/// The most colocated splits [`screen`] scores per setting of the limits: it picks the
/// steps of each kind's counts to fit.
pub const SCREEN_SPLITS: u64 = 50_000;
/// The most splits of each side of disaggregated strategies [`screen`] scores per
/// setting of the limits (each side's Pareto set costs about the square of it).
pub const SIDE_SPLITS: u64 = 20_000;

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
    cache: &mut TableCache,
    skip: impl Fn(&[Roles], u32) -> bool,
) -> Vec<Candidate> {
    let mut frontier = Frontier::default();
    for &budget in &space.prefill_budgets {
        for &cap in &space.decode_caps {
            let tables = cache.tables(fleet, workload, budget, cap);
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

/// How [`solve`] searches a space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every strategy scored.
    Exact { strategies: u64 },
    /// Screened with each kind's counts in `steps` steps for colocated strategies and
    /// `side_steps` for the sides of disaggregated ones ([`screen`]).
    Screened { steps: u32, side_steps: u32 },
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Exact { strategies } => write!(f, "every one of {strategies} strategies scored"),
            Mode::Screened { steps, side_steps } => write!(
                f,
                "screened: each kind's chips in {steps} steps, disaggregated strategies by their sides in {side_steps}"
            ),
        }
    }
}

/// How [`solve`] searches `fleet`'s space: whole up to [`EXACT_LIMIT`] strategies,
/// else screened with the most steps per kind that fit [`SCREEN_SPLITS`] (colocated)
/// and [`SIDE_SPLITS`] (each side of disaggregated strategies).
pub fn mode(fleet: &Fleet, workload: &Workload, space: &Space) -> Result<Mode, SearchError> {
    let strategies = check(fleet, workload, space)?;
    if strategies <= EXACT_LIMIT {
        return Ok(Mode::Exact { strategies });
    }
    let most = fleet.kinds.iter().map(|k| k.chips).max().unwrap_or(0);
    let kinds = fleet.kinds.iter().filter(|k| k.chips > 0).count().max(1) as u32;
    let steps_within = |budget: u64| {
        let mut steps = 1;
        while steps < most && ((steps + 2) as u64).pow(kinds) <= budget {
            steps += 1;
        }
        steps
    };
    Ok(Mode::Screened { steps: steps_within(SCREEN_SPLITS), side_steps: steps_within(SIDE_SPLITS) })
}

/// The Pareto set of `fleet`'s strategies for `workload` within `slo`, searched as
/// [`mode`] says.
pub fn solve(fleet: &Fleet, workload: &Workload, slo: &Slo, space: &Space) -> Result<Vec<Candidate>, SearchError> {
    solve_with(fleet, workload, slo, space, &mut TableCache::default())
}

/// [`solve`], reusing (and keeping) step-time tables in `cache`: a re-solve after the
/// rate moved or a chip went down builds none.
pub fn solve_with(
    fleet: &Fleet,
    workload: &Workload,
    slo: &Slo,
    space: &Space,
    cache: &mut TableCache,
) -> Result<Vec<Candidate>, SearchError> {
    if let Mode::Screened { steps, side_steps } = mode(fleet, workload, space)? {
        return Ok(screen(fleet, workload, slo, space, (steps, side_steps), cache));
    }
    let per_kind: Vec<Vec<Roles>> = fleet.kinds.iter().map(|k| splits(k.chips)).collect();
    Ok(scan(fleet, workload, slo, space, &per_kind, cache, |roles, min| leaves_chips_unused(roles, workload, min)))
}

/// The Pareto set from every assignment of a role to every chip, one by one (4^chips
/// of them, each scored as the split it makes): the reference [`solve`] is tested
/// against, for small fleets.
pub fn exhaustive(fleet: &Fleet, workload: &Workload, slo: &Slo, space: &Space) -> Result<Vec<Candidate>, SearchError> {
    if check(fleet, workload, space)? > MAX_STRATEGIES {
        return Err(SearchError::TooLarge(MAX_STRATEGIES));
    }
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

/// Counts of a kind of `n` chips in `steps` steps: 0, n/steps, ..., n (rounded, each once).
fn levels(n: u32, steps: u32) -> Vec<u32> {
    let steps = steps.clamp(1, n.max(1));
    let mut out: Vec<u32> =
        (0..=steps).map(|i| ((n as u64 * i as u64 + steps as u64 / 2) / steps as u64) as u32).collect();
    out.dedup();
    out
}

/// One side's member: its counts per kind and what they score.
#[derive(Debug, Clone)]
struct SideMember {
    counts: Vec<u32>,
    side: Side,
    usd_per_hour: f64,
    key: [f64; 4],
}

/// The Pareto set of one side's splits (share within its SLO up; p90, $, watts down),
/// where a split beats another only if it also uses no more chips of any kind.
fn side_frontier(mut members: Vec<(Vec<u32>, Side, f64)>) -> Vec<SideMember> {
    // Fewest chips first: a split's dominators come before it (they use no more chips
    // of any kind), so few members are ever dropped again.
    members.sort_by_key(|(counts, _, _)| counts.iter().sum::<u32>());
    let mut out: Vec<SideMember> = Vec::new();
    let beats = |a: &SideMember, key: &[f64; 4], counts: &[u32]| {
        a.key.iter().zip(key).all(|(x, y)| x <= y) && a.counts.iter().zip(counts).all(|(x, y)| x <= y)
    };
    // The member that last turned a split away, tried first.
    let mut hint = 0;
    for (counts, side, usd_per_hour) in members {
        let key = [-side.ok, side.p90_s, usd_per_hour, side.watts];
        if out.get(hint).is_some_and(|m| beats(m, &key, &counts)) {
            continue;
        }
        if let Some(i) = out.iter().position(|m| beats(m, &key, &counts)) {
            hint = i;
            continue;
        }
        let new = SideMember { counts, side, usd_per_hour, key };
        if out.iter().any(|m| beats(&new, &m.key, &m.counts)) {
            out.retain(|m| !beats(&new, &m.key, &m.counts));
        }
        out.push(new);
    }
    out
}

/// Screens `fleet`'s strategies with each kind's counts in `steps` steps for colocated
/// strategies and `side_steps` for each side of disaggregated ones (see the module doc),
/// with step-time tables from `cache`: the Pareto set of what it scores.
pub fn screen(
    fleet: &Fleet,
    workload: &Workload,
    slo: &Slo,
    space: &Space,
    (steps, side_steps): (u32, u32),
    cache: &mut TableCache,
) -> Vec<Candidate> {
    let grid: Vec<Vec<u32>> = fleet.kinds.iter().map(|k| levels(k.chips, steps)).collect();
    let side_grid: Vec<Vec<u32>> = fleet.kinds.iter().map(|k| levels(k.chips, side_steps)).collect();
    let price =
        |counts: &[u32]| -> f64 { counts.iter().zip(&fleet.kinds).map(|(&n, k)| n as f64 * k.usd_per_hour).sum() };
    // Counts as one-role splits, for `combinations` to walk.
    let as_roles = |grid: &[Vec<u32>]| -> Vec<Vec<Roles>> {
        grid.iter().map(|g| g.iter().map(|&n| Roles { prefill: n, ..Roles::default() }).collect()).collect()
    };
    let (grid_roles, side_roles) = (as_roles(&grid), as_roles(&side_grid));
    let counts_of = |roles: &[Roles]| -> Vec<u32> { roles.iter().map(|r| r.prefill).collect() };
    let rate = workload.rate_rps;
    let least_threshold = space.min_prompt_tokens.iter().copied().min().unwrap_or(0);
    let mut frontier = Frontier::default();
    for &budget in &space.prefill_budgets {
        for &cap in &space.decode_caps {
            let tables = cache.tables(fleet, workload, budget, cap);
            // Each side's Pareto set, once per setting of the limits.
            let (mut prefill, mut decode) = (Vec::new(), Vec::new());
            combinations(&side_roles, |roles| {
                let counts = counts_of(roles);
                if counts.iter().all(|&n| n == 0) {
                    return;
                }
                let usd = price(&counts);
                if let Some(side) = prefill_side(fleet, &tables, &counts, workload, slo, rate) {
                    prefill.push((counts.clone(), side, usd));
                }
                if let Some(side) = decode_side(fleet, &tables, &counts, workload, slo, rate) {
                    decode.push((counts, side, usd));
                }
            });
            let (prefill, decode) = (side_frontier(prefill), side_frontier(decode));
            // Colocated: the counts as chips that do both, once — without prefill chips
            // the threshold decides nothing, and of equal strategies the set keeps the
            // least threshold.
            combinations(&grid_roles, |roles| {
                let roles: Vec<Roles> = roles.iter().map(|r| Roles { both: r.prefill, ..Roles::default() }).collect();
                if roles.iter().all(|r| r.both == 0) {
                    return;
                }
                let s = Strategy { roles, prefill_budget: budget, decode_cap: cap, min_prompt_tokens: least_threshold };
                if let Some(figures) = evaluate(fleet, &tables, &s, workload, slo) {
                    frontier.offer(Candidate { strategy: s, figures });
                }
            });
            for &min_prompt_tokens in &space.min_prompt_tokens {
                let strategy =
                    |roles: Vec<Roles>| Strategy { roles, prefill_budget: budget, decode_cap: cap, min_prompt_tokens };
                if workload.isl < min_prompt_tokens as f64 {
                    continue;
                }
                for p in &prefill {
                    for d in &decode {
                        let fits = p.counts.iter().zip(&d.counts).zip(&fleet.kinds).all(|((a, b), k)| a + b <= k.chips);
                        if !fits {
                            continue;
                        }
                        let figures = crate::analytic::figures(
                            p.usd_per_hour + d.usd_per_hour,
                            workload,
                            p.side.ok * d.side.ok,
                            p.side.p90_s,
                            d.side.p90_s,
                            p.side.watts + d.side.watts,
                        );
                        if let Some(figures) = figures {
                            let roles = p
                                .counts
                                .iter()
                                .zip(&d.counts)
                                .map(|(&prefill, &decode)| Roles { prefill, decode, both: 0 })
                                .collect();
                            frontier.offer(Candidate { strategy: strategy(roles), figures });
                        }
                    }
                }
            }
        }
    }
    frontier.into_sorted()
}

/// Per kind, the best strategy by goodput per $ that runs every request on chips of
/// that kind alone, all of them doing both phases (a single-vendor, single-role
/// cluster): every count of the kind's chips under every setting of `space`. Of equal
/// ones, the fewest chips (then the first setting). `None` for a kind no count of
/// which serves any request within the SLOs.
pub fn best_single_kinds(fleet: &Fleet, workload: &Workload, slo: &Slo, space: &Space) -> Vec<Option<Candidate>> {
    let mut best: Vec<Option<Candidate>> = vec![None; fleet.kinds.len()];
    // Without prefill chips, the threshold decides nothing: the least is kept, as the
    // Pareto set keeps it of equal strategies.
    let min_prompt_tokens = space.min_prompt_tokens.iter().copied().min().unwrap_or(0);
    for &budget in &space.prefill_budgets {
        for &cap in &space.decode_caps {
            let tables = Tables::new(fleet, workload, budget, cap);
            for (kind, best) in best.iter_mut().enumerate() {
                for n in 1..=fleet.kinds[kind].chips {
                    let mut roles = vec![Roles::default(); fleet.kinds.len()];
                    roles[kind].both = n;
                    let strategy = Strategy { roles, prefill_budget: budget, decode_cap: cap, min_prompt_tokens };
                    let Some(figures) = evaluate(fleet, &tables, &strategy, workload, slo) else { continue };
                    let better = best.as_ref().is_none_or(|b| {
                        let (x, y) = (figures.goodput_per_usd(), b.figures.goodput_per_usd());
                        x > y || (x == y && n < b.strategy.roles[kind].both)
                    });
                    if better {
                        *best = Some(Candidate { strategy, figures });
                    }
                }
            }
        }
    }
    best
}
