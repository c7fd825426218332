//! The router: keeps a view of every chip (from heartbeats and its host supervisor's
//! verdicts), of the work it has placed, and of where KV lives (the [`index`], from the
//! chips' KV events), and places each request: a long enough prompt on a prefill chip
//! plus a decode chip (disaggregated), anything else on a chip that decodes. Among the
//! candidates it takes the one with the least work ahead: the tokens already placed
//! there plus the prompt tokens it would compute, which are the prompt less the prefix
//! that chip holds cached — unless that chip is a hot spot (more than twice the mean
//! load plus one prompt), whose cache then counts for nothing. Ties go to the lowest
//! address. When a chip goes down it tells every request placed there, so they
//! re-route and replay.

pub mod index;

use crate::kv::prefix_hashes;
use crate::msg::{ChipReport, ChipState, ErrorKind, Msg, Role, ServeError, topic};
use std::collections::{BTreeMap, BTreeSet};
use tessera_actor_core::{Addr, HostId};
use tessera_actor_core::{Behavior, Effects};
pub use tessera_vocab::RouterPolicy;

/// A chip as the router knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChipView {
    pub report: ChipReport,
    /// Tokens (prompt + max new) of requests placed there and not yet released.
    pub load_tokens: usize,
}

/// A chip that can take new work: up, its host alive, not draining for a role change.
fn available(addr: &Addr, c: &ChipView, down_hosts: &BTreeSet<HostId>) -> bool {
    c.report.state == ChipState::Up && !c.report.draining && !down_hosts.contains(&addr.host)
}

/// Which part of a request a chip is scored for: computing the prompt (a prefill chip,
/// or the one chip of a colocated request), or decoding after a hand-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    Compute,
    Decode,
}

/// A placement policy's cost of a candidate chip: lowest wins.
pub type Scorer<'a> = dyn Fn(Leg, &Addr, &ChipView) -> i64 + 'a;

/// The available chip accepted by `fits` and not in `avoid` of the lowest `score`; ties
/// go to the lowest address, so the choice is deterministic.
fn best(
    chips: &[(&Addr, &ChipView)],
    down_hosts: &BTreeSet<HostId>,
    avoid: &[Addr],
    leg: Leg,
    score: &Scorer,
    fits: impl Fn(&ChipView) -> bool,
) -> Option<Addr> {
    chips
        .iter()
        .filter(|(a, c)| available(a, c, down_hosts) && fits(c) && !avoid.contains(a))
        .min_by_key(|(a, c)| (score(leg, a, c), **a))
        .map(|(a, _)| **a)
}

/// The kv-aware cost: placed tokens less the prompt tokens cached there (the prompt's
/// own tokens are the same on every candidate). The decode leg computes no prompt.
pub fn kv_aware<'a>(cached: &'a BTreeMap<Addr, usize>) -> impl Fn(Leg, &Addr, &ChipView) -> i64 + 'a {
    move |leg, a, c| {
        let credit = if leg == Leg::Compute { cached.get(a).copied().unwrap_or(0) } else { 0 };
        c.load_tokens as i64 - credit as i64
    }
}

/// Placed tokens alone.
pub fn by_load(_: Leg, _: &Addr, c: &ChipView) -> i64 {
    c.load_tokens as i64
}

/// Cached prefix tokens per chip that count in placement (`mean`: the mean placed tokens
/// per chip): none for a hot spot, a chip loaded beyond twice the mean plus one prompt (it would get every request sharing its
/// prefix while the others idle).
pub fn cache_credit(
    chips: &BTreeMap<Addr, ChipView>,
    cached_blocks: &BTreeMap<Addr, usize>,
    block_size: usize,
    prompt_tokens: usize,
    mean: usize,
) -> BTreeMap<Addr, usize> {
    cached_blocks
        .iter()
        .filter(|(a, _)| chips.get(a).is_some_and(|c| c.load_tokens <= 2 * mean + prompt_tokens))
        .map(|(a, &blocks)| (*a, (blocks * block_size).min(prompt_tokens)))
        .collect()
}

/// The least loaded available chip of any role, preferring those not in `exclude`.
pub fn pick(chips: &BTreeMap<Addr, ChipView>, down_hosts: &BTreeSet<HostId>, exclude: &[Addr]) -> Option<Addr> {
    let all: Vec<(&Addr, &ChipView)> = chips.iter().collect();
    best(&all, down_hosts, exclude, Leg::Compute, &by_load, |_| true)
        .or_else(|| best(&all, down_hosts, &[], Leg::Compute, &by_load, |_| true))
}

/// Where a request runs: `decode` samples every token; `prefill`, when set, computes
/// the prompt's KV first and streams it to `decode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub decode: Addr,
    pub prefill: Option<Addr>,
}

/// Disaggregates when the prompt has at least `min_prompt_tokens` tokens and both a
/// `prefill` and a compatible `decode` chip are available; otherwise runs the request
/// on one chip: a `decode` or `both` chip, or — rather than refusing it — a `prefill`
/// chip when no other is up. Any placement that avoids every chip in `exclude` (chips
/// that lost or declined this request) wins over one that uses them: a request whose
/// only decode chip is restarting runs on the prefill chip instead of waiting. Only
/// when no chip outside `exclude` is available may an excluded one be chosen again.
/// Each candidate is scored by `score` (the router's policy; [`by_load`] and
/// [`kv_aware`] are two).
pub fn place(
    chips: &BTreeMap<Addr, ChipView>,
    down_hosts: &BTreeSet<HostId>,
    exclude: &[Addr],
    prompt_tokens: usize,
    min_prompt_tokens: usize,
    score: &Scorer,
) -> Option<Placed> {
    let all: Vec<(&Addr, &ChipView)> = chips.iter().collect();
    place_among(&all, down_hosts, exclude, prompt_tokens, min_prompt_tokens, score)
}

/// [`place`] among `chips` only: the same choice as among all chips whenever every chip
/// left out scores no better than one kept that fits the same leg (see
/// `Router::candidates`).
pub fn place_among(
    chips: &[(&Addr, &ChipView)],
    down_hosts: &BTreeSet<HostId>,
    exclude: &[Addr],
    prompt_tokens: usize,
    min_prompt_tokens: usize,
    score: &Scorer,
) -> Option<Placed> {
    let place_avoiding = |avoid: &[Addr]| {
        if prompt_tokens >= min_prompt_tokens
            && let Some(p) = best(chips, down_hosts, avoid, Leg::Compute, score, |c| c.report.role == Role::Prefill)
        {
            let compat = chips.iter().find(|(a, _)| **a == p).and_then(|(_, c)| c.report.compat.clone());
            let decode = best(chips, down_hosts, avoid, Leg::Decode, score, |c| {
                c.report.role == Role::Decode
                    && (compat.is_none() || c.report.compat.is_none() || c.report.compat == compat)
            });
            if let Some(d) = decode {
                return Some(Placed { decode: d, prefill: Some(p) });
            }
        }
        best(chips, down_hosts, avoid, Leg::Compute, score, |c| c.report.role.decodes())
            .or_else(|| best(chips, down_hosts, avoid, Leg::Compute, score, |_| true))
            .map(|decode| Placed { decode, prefill: None })
    };
    place_avoiding(exclude).or_else(|| place_avoiding(&[]))
}

struct Placement {
    req: Addr,
    /// (chip, tokens it was charged) for each chip the request holds.
    chips: Vec<(Addr, usize)>,
}

pub struct Router {
    chips: BTreeMap<Addr, ChipView>,
    down_hosts: BTreeSet<HostId>,
    down_host_names: BTreeMap<HostId, String>,
    placements: BTreeMap<u64, Placement>,
    max_queued_requests: usize,
    min_prompt_tokens: usize,
    /// Where KV lives, and the chips asked for a snapshot and not answered yet.
    index: index::ClusterIndex,
    snapshot_asked: BTreeSet<Addr>,
    /// The block size prompts are hashed at (the cluster's; chips with another size
    /// are found by no prompt).
    block_size: usize,
    policy: RouterPolicy,
    /// Routes so far (round-robin's turn).
    turns: u64,
    /// The chips of each role by (placed tokens, address): the least loaded are found
    /// without a scan.
    by_load: BTreeMap<Role, BTreeSet<(usize, Addr)>>,
    total_load: usize,
}

impl Router {
    /// `chips`: every chip of the topology, reported as Starting until heard from.
    /// Requests run on one chip until `with_disaggregation` says otherwise.
    pub fn new(chips: Vec<ChipReport>, max_queued_requests: usize) -> Router {
        let chips: BTreeMap<Addr, ChipView> =
            chips.into_iter().map(|r| (r.chip, ChipView { report: r, load_tokens: 0 })).collect();
        let mut by_load: BTreeMap<Role, BTreeSet<(usize, Addr)>> = BTreeMap::new();
        for (a, c) in &chips {
            by_load.entry(c.report.role).or_default().insert((0, *a));
        }
        Router {
            chips,
            down_hosts: BTreeSet::new(),
            down_host_names: BTreeMap::new(),
            placements: BTreeMap::new(),
            max_queued_requests,
            min_prompt_tokens: usize::MAX,
            index: index::ClusterIndex::new(),
            snapshot_asked: BTreeSet::new(),
            block_size: 16,
            policy: RouterPolicy::default(),
            turns: 0,
            by_load,
            total_load: 0,
        }
    }

    /// Sets `chip`'s placed tokens, keeping `by_load` in step.
    fn set_load(&mut self, chip: Addr, load: impl FnOnce(usize) -> usize) {
        if let Some(v) = self.chips.get_mut(&chip) {
            let set = self.by_load.entry(v.report.role).or_default();
            set.remove(&(v.load_tokens, chip));
            self.total_load -= v.load_tokens;
            v.load_tokens = load(v.load_tokens);
            self.total_load += v.load_tokens;
            set.insert((v.load_tokens, chip));
        }
    }

    /// The chips a load-monotone policy (kv-aware, least-loaded) can choose: the holders
    /// of the prompt's cached prefix, and, in load order, enough of the rest that every
    /// leg has its least-loaded fitting chip both with and without `exclude` — for the
    /// decode leg, one per compatibility class of the prefill candidates. Any chip left
    /// out has a cache credit of zero and a load no lower than a kept chip that fits the
    /// same leg, so it cannot score better.
    /// Walks the chips of `role` in load order, keeping each that is the first (with
    /// and without `exclude`) to fit one of `legs`, until every leg has both.
    fn scan<'a>(
        &'a self,
        role: Role,
        legs: &[&dyn Fn(&ChipView) -> bool],
        exclude: &[Addr],
        out: &mut Vec<(&'a Addr, &'a ChipView)>,
    ) {
        let Some(set) = self.by_load.get(&role) else { return };
        let mut found = vec![[false; 2]; legs.len()];
        for (_, a) in set {
            if found.iter().all(|f| f[0] && f[1]) {
                break;
            }
            let Some((a, c)) = self.chips.get_key_value(a) else { continue };
            if !available(a, c, &self.down_hosts) {
                continue;
            }
            let avoided = exclude.contains(a);
            let mut useful = false;
            for (leg, f) in legs.iter().zip(found.iter_mut()) {
                if leg(c) {
                    useful |= !f[1] || (!avoided && !f[0]);
                    f[1] = true;
                    f[0] |= !avoided;
                }
            }
            if useful {
                out.push((a, c));
            }
        }
    }

    fn candidates(&self, holders: &BTreeMap<Addr, usize>, exclude: &[Addr]) -> Vec<(&Addr, &ChipView)> {
        let mut out: Vec<(&Addr, &ChipView)> = holders.keys().filter_map(|a| self.chips.get_key_value(a)).collect();
        let prefill = |c: &ChipView| c.report.role == Role::Prefill;
        let any = |_: &ChipView| true;
        // Per role, its least-loaded chips: the prefill leg and the colocated legs
        // (decoding chips first, then any chip) all draw from these.
        for role in Role::ALL {
            self.scan(role, &[&any], exclude, &mut out);
        }
        // The decode leg: for each compatibility class among the prefill candidates, the
        // least-loaded decode chip a hand-off may go to.
        let mut classes: Vec<Option<crate::msg::KvCompat>> =
            out.iter().filter(|(_, c)| prefill(c)).map(|(_, c)| c.report.compat.clone()).collect();
        classes.dedup();
        type Fits = Box<dyn Fn(&ChipView) -> bool>;
        let fits: Vec<Fits> = classes
            .into_iter()
            .map(|compat| {
                Box::new(move |c: &ChipView| {
                    c.report.role == Role::Decode
                        && (compat.is_none() || c.report.compat.is_none() || c.report.compat == compat)
                }) as Fits
            })
            .collect();
        let legs: Vec<&dyn Fn(&ChipView) -> bool> = fits.iter().map(|f| f.as_ref()).collect();
        self.scan(Role::Decode, &legs, exclude, &mut out);
        out.sort_by_key(|(a, _)| **a);
        out.dedup_by_key(|(a, _)| **a);
        out
    }

    pub fn with_policy(mut self, policy: RouterPolicy) -> Router {
        self.policy = policy;
        self
    }

    /// Prompts are hashed in blocks of `block_size` tokens (the cluster's block size).
    pub fn with_block_size(mut self, block_size: usize) -> Router {
        self.block_size = block_size.max(1);
        self
    }

    /// The index went stale for `chip`: ask it for a snapshot (once until answered).
    fn resync(&mut self, chip: Addr, applied: index::Applied, fx: &mut dyn Effects<Msg>) {
        if applied == index::Applied::NeedsSnapshot && self.snapshot_asked.insert(chip) {
            let _ = fx.send(chip, Msg::KvSnapshotRequest { reply_to: fx.me() });
        }
    }

    fn index_metrics(&self) {
        metrics::gauge!("tessera_router_index_blocks").set(self.index.len() as f64);
    }

    /// Prompts of at least `min_prompt_tokens` tokens are prefilled on a prefill chip
    /// and decoded on a decode chip.
    pub fn with_disaggregation(mut self, min_prompt_tokens: usize) -> Router {
        self.min_prompt_tokens = min_prompt_tokens;
        self
    }

    fn update(&mut self, report: ChipReport, fx: &mut dyn Effects<Msg>) {
        let chip = report.chip;
        let was_up = self.chips.get(&chip).is_some_and(|c| c.report.state == ChipState::Up);
        let is_up = report.state == ChipState::Up;
        // The gateway's /metrics shows every chip of the cluster, not only local ones.
        let id = report.id.clone();
        metrics::gauge!("tessera_router_chip_up", "chip" => id.clone()).set(if is_up { 1.0 } else { 0.0 });
        metrics::gauge!("tessera_kv_blocks_used", "chip" => id.clone()).set(report.kv_blocks_used as f64);
        metrics::gauge!("tessera_kv_blocks_total", "chip" => id.clone()).set(report.kv_blocks_total as f64);
        if let Some(emulation) = &report.emulated {
            // An emulated chip is labelled as such wherever its figures appear.
            metrics::gauge!("tessera_chip_emulated", "chip" => id.clone(), "emulation" => emulation.clone()).set(1.0);
        }
        if let Some(gap) = report.last_handoff_gap_s {
            metrics::gauge!("tessera_kv_handoff_gap_last_seconds", "chip" => id).set(gap);
        }
        let view = self.chips.entry(chip).or_insert_with(|| ChipView { report: report.clone(), load_tokens: 0 });
        // A role change moves the chip between the load orders.
        for role in Role::ALL {
            if let Some(set) = self.by_load.get_mut(&role) {
                set.remove(&(view.load_tokens, chip));
            }
        }
        self.by_load.entry(report.role).or_default().insert((view.load_tokens, chip));
        view.report = report;
        if was_up && !is_up {
            self.lose(chip, fx);
        }
    }

    /// Every request placed on `chip` (as prefill or decode chip) must go elsewhere.
    fn lose(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        let lost: Vec<u64> = self
            .placements
            .iter()
            .filter(|(_, p)| p.chips.iter().any(|(c, _)| *c == chip))
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(p) = self.placements.get(&id) {
                let _ = fx.send(p.req, Msg::ChipLost { chip });
            }
            self.release(id, chip);
        }
        self.set_load(chip, |_| 0);
    }

    fn host_down(&mut self, host: HostId, name: String, fx: &mut dyn Effects<Msg>) {
        if !self.down_hosts.insert(host) {
            return;
        }
        tracing::warn!(host = %name, "host down: its chips are out of rotation");
        self.down_host_names.insert(host, name);
        let chips: Vec<Addr> = self.chips.keys().filter(|a| a.host == host).copied().collect();
        for chip in chips {
            if let Some(view) = self.chips.get_mut(&chip) {
                let r = &view.report;
                metrics::gauge!("tessera_router_chip_up", "chip" => r.id.clone()).set(0.0);
                // Its last figures describe a host that is gone: keep who it is, drop them.
                let known = ChipReport::starting(chip, r.id.clone(), r.host_name.clone(), r.role);
                view.report = ChipReport {
                    state: ChipState::Failed,
                    error: Some("its host stopped heartbeating".into()),
                    restarts: r.restarts,
                    emulated: r.emulated.clone(),
                    compat: r.compat.clone(),
                    ..known
                };
                metrics::gauge!("tessera_kv_blocks_used", "chip" => view.report.id.clone()).set(0.0);
            }
            self.lose(chip, fx);
        }
    }

    /// Where the policy places a request (`turn`: round-robin's), and whether the chip
    /// computing its prompt holds a cached prefix of it. Changes nothing.
    pub fn decide(
        &self,
        request_id: u64,
        prompt: &[u32],
        prompt_tokens: usize,
        exclude: &[Addr],
        turn: u64,
    ) -> (Option<Placed>, bool) {
        let bs = self.block_size;
        let held = match self.policy {
            RouterPolicy::KvAware | RouterPolicy::Dynamo => self.index.prefix_blocks(&prefix_hashes(prompt, bs)),
            RouterPolicy::LeastLoaded | RouterPolicy::RoundRobin | RouterPolicy::Random => BTreeMap::new(),
        };
        let mean = self.total_load / self.chips.len().max(1);
        let cached = cache_credit(&self.chips, &held, bs, prompt_tokens, mean);
        let prompt_blocks = prompt_tokens.div_ceil(bs) as i64;
        let n = self.chips.len().max(1) as i64;
        let ranks: BTreeMap<Addr, i64> = match self.policy {
            RouterPolicy::RoundRobin => self.chips.keys().enumerate().map(|(i, a)| (*a, i as i64)).collect(),
            _ => BTreeMap::new(),
        };
        let score: Box<Scorer> = match self.policy {
            RouterPolicy::KvAware => Box::new(kv_aware(&cached)),
            RouterPolicy::LeastLoaded => Box::new(by_load),
            RouterPolicy::RoundRobin => {
                Box::new(move |_, a, _| (ranks.get(a).copied().unwrap_or(0) - turn as i64).rem_euclid(n))
            }
            RouterPolicy::Random => Box::new(move |_, a, _| {
                let mut bytes = request_id.to_le_bytes().to_vec();
                bytes.extend_from_slice(&a.host.0.to_le_bytes());
                bytes.extend_from_slice(&a.actor.to_le_bytes());
                (xxhash_rust::xxh3::xxh3_64(&bytes) >> 1) as i64
            }),
            // Dynamo: overlap_weight (1) x blocks to prefill + blocks in use.
            RouterPolicy::Dynamo => Box::new(|leg, a, c| {
                let new_blocks = match leg {
                    Leg::Compute => prompt_blocks - held.get(a).copied().unwrap_or(0) as i64,
                    Leg::Decode => 0,
                };
                new_blocks.max(0) + c.report.kv_blocks_used as i64
            }),
        };
        let candidates: Vec<(&Addr, &ChipView)> = match self.policy {
            RouterPolicy::KvAware | RouterPolicy::LeastLoaded => self.candidates(&held, exclude),
            RouterPolicy::RoundRobin | RouterPolicy::Random | RouterPolicy::Dynamo => self.chips.iter().collect(),
        };
        let placed =
            place_among(&candidates, &self.down_hosts, exclude, prompt_tokens, self.min_prompt_tokens, &*score);
        let prefix_hit = placed.is_some_and(|p| cached.get(&p.prefill.unwrap_or(p.decode)).is_some_and(|&t| t > 0));
        (placed, prefix_hit)
    }

    /// The cluster index (for tools that load it directly, e.g. `bench router`).
    pub fn index_mut(&mut self) -> &mut index::ClusterIndex {
        &mut self.index
    }

    fn route(&mut self, route: RouteAsk, fx: &mut dyn Effects<Msg>) {
        let RouteAsk { request_id, req, tokens, prompt_tokens, exclude, prompt } = route;
        if !self.placements.contains_key(&request_id) && self.placements.len() >= self.max_queued_requests {
            let error = ServeError::new(
                ErrorKind::Overloaded,
                format!("{} requests are already in flight (the router's limit)", self.placements.len()),
            );
            let _ = fx.send(req, Msg::RouteFailed { request_id, error });
            return;
        }
        let turn = self.turns;
        self.turns += 1;
        let (placed, prefix_hit) = self.decide(request_id, &prompt, prompt_tokens, &exclude, turn);
        let Some(Placed { decode, prefill }) = placed else {
            let states: Vec<String> =
                self.chips.values().map(|c| format!("{} {:?}", c.report.id, c.report.state).to_lowercase()).collect();
            let error = ServeError::new(ErrorKind::Unavailable, format!("no healthy chip ({})", states.join(", ")));
            let _ = fx.send(req, Msg::RouteFailed { request_id, error });
            return;
        };
        // A re-route replaces whatever the request held.
        if let Some(old) = self.placements.remove(&request_id) {
            for (chip, t) in old.chips {
                self.set_load(chip, |l| l.saturating_sub(t));
            }
        }
        let mut held = vec![(decode, tokens)];
        if let Some(p) = prefill {
            held.push((p, prompt_tokens));
        }
        for &(chip, t) in &held {
            self.set_load(chip, |l| l + t);
        }
        self.placements.insert(request_id, Placement { req, chips: held });
        let kind = if prefill.is_some() { "disaggregated" } else { "colocated" };
        let reason = if prefix_hit { "prefix_hit" } else { "least_work" };
        metrics::counter!("tessera_router_decisions_total", "placement" => kind).increment(1);
        metrics::counter!("tessera_router_decision_reasons_total", "reason" => reason).increment(1);
        let _ = fx.send(req, Msg::Routed { request_id, chip: decode, prefill });
    }

    fn release(&mut self, request_id: u64, chip: Addr) {
        let Some(p) = self.placements.get_mut(&request_id) else { return };
        if let Some(i) = p.chips.iter().position(|(c, _)| *c == chip) {
            let (_, t) = p.chips.remove(i);
            if p.chips.is_empty() {
                self.placements.remove(&request_id);
            }
            self.set_load(chip, |l| l.saturating_sub(t));
            return;
        }
        if p.chips.is_empty() {
            self.placements.remove(&request_id);
        }
    }
}

/// A `Route` message's fields.
struct RouteAsk {
    request_id: u64,
    req: Addr,
    tokens: usize,
    prompt_tokens: usize,
    exclude: Vec<Addr>,
    prompt: Vec<u32>,
}

impl Behavior<Msg> for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn on_start(&mut self, fx: &mut dyn Effects<Msg>) {
        fx.subscribe(topic::HEARTBEAT);
        fx.subscribe(topic::KV_EVENTS);
    }

    fn handle(&mut self, msg: Msg, fx: &mut dyn Effects<Msg>) {
        match msg {
            Msg::Route { request_id, req, tokens, prompt_tokens, exclude, prompt } => {
                self.route(RouteAsk { request_id, req, tokens, prompt_tokens, exclude, prompt }, fx)
            }
            Msg::KvEvents { chip, incarnation, events } => {
                let applied = self.index.apply(chip, incarnation, &events);
                self.resync(chip, applied, fx);
                self.index_metrics();
            }
            Msg::KvSnapshot { chip, incarnation, last_event, hashes } => {
                self.snapshot_asked.remove(&chip);
                self.index.resync(chip, incarnation, last_event, &hashes);
                metrics::counter!("tessera_router_index_resyncs_total").increment(1);
                self.index_metrics();
            }
            Msg::Release { request_id, chip } => self.release(request_id, chip),
            Msg::Heartbeat { beat } => {
                if self.down_hosts.contains(&beat.host) {
                    // The host is back (restarted): its chips report their own state.
                    tracing::info!(host = %beat.host_name, "host heartbeating again");
                    self.down_hosts.remove(&beat.host);
                    self.down_host_names.remove(&beat.host);
                }
                for report in beat.chips {
                    if report.state == ChipState::Up {
                        let applied = self.index.heartbeat(report.chip, report.kv_incarnation, report.kv_last_event);
                        self.resync(report.chip, applied, fx);
                    }
                    self.update(report, fx);
                }
            }
            Msg::HostDown { host, host_name } => self.host_down(host, host_name, fx),
            Msg::QueryCluster { reply_to } => {
                let chips = self.chips.values().map(|c| c.report.clone()).collect();
                let hosts_down = self.down_host_names.values().cloned().collect();
                let _ = fx.send(reply_to, Msg::ClusterView { chips, hosts_down });
            }
            other => tracing::debug!(kind = ?other, "router: unexpected message"),
        }
    }
}

#[cfg(test)]
mod tests;
