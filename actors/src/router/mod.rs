//! The router: keeps a view of every chip (from heartbeats and its host supervisor's
//! verdicts), of the work it has placed, and of where KV lives (the [`index`], from the
//! chips' KV events), and places each request: a long enough prompt on a prefill chip
//! plus a decode chip (disaggregated), anything else on a chip that decodes.
//!
//! Under the default `kv-aware` policy each candidate is scored in predicted seconds
//! ([`cost`]): the chip's work ahead, the prompt tokens it would compute (the prompt less
//! the prefix it holds cached) at its pace, and a KV-pressure term — with paces from
//! the chip kinds' performance model corrected by the chips' observed step times, so a
//! fast and a slow chip are compared fairly. A hot spot (work ahead above twice the
//! mean plus this prompt's prefill) gets no credit for its cache. Ties go to the lowest
//! address. Chips whose [`breaker`] is open, or whose queued prompts would take them
//! `Limits::max_queued_prompt` or more, take nothing new (so a backlog waits here, not
//! in one chip's queue); when no chip can take a request, it waits in a bounded queue —
//! higher priority classes ahead, tenants of a class in weighted fair order (VTC, each
//! charged what its requests cost at the paces of the chips they were placed on), first
//! come first served within a tenant — until one can or its deadline passes (then a 429
//! with `Retry-After`). The least-served tenant may place one request at a time past the
//! prompt bound and the KV breaker (see `Router::may_pass_prompt_bound`), so a light
//! tenant beside a flood does not wait in the router for the flood's work to free room.
//! When every decoding chip is full, a request runs whole on a prefill chip or waits
//! here, as `Limits::decode_overflow` says. When a chip goes down
//! the router tells every request placed there, so they re-route and replay.

pub mod breaker;
pub mod cost;
pub mod index;

use crate::batcher::fair::FairQueue;
use crate::kv::salted_prefix_hashes;
use crate::msg::{ChipReport, ChipState, ErrorKind, Msg, Role, ServeError, TenantShare, topic};
use breaker::{ErrorBreaker, kv_full};
use cost::{Ask, MeanFactor, Pace, PaceClass, Work};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;
use tessera_actor_core::{Addr, HostId, Moment};
use tessera_actor_core::{Behavior, Effects};
pub use tessera_vocab::{DecodeOverflow, RouterPolicy};

/// A chip as the router knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChipView {
    pub report: ChipReport,
    /// Tokens (prompt + max new) of requests placed there and not yet released.
    pub load_tokens: usize,
    /// The same requests as work to do (the kv-aware cost's queue).
    pub work: Work,
    /// The chip's pace: its kind's model, corrected by what it was seen to do.
    pub pace: Pace,
    /// Circuit breakers: the pool past the KV threshold, prompts queued there past the
    /// router's limit, and repeated errors.
    pub kv_full: bool,
    pub load_full: bool,
    pub errors: ErrorBreaker,
}

impl ChipView {
    /// A chip with nothing placed on it, paced as a chip of no known kind.
    pub fn new(report: ChipReport) -> ChipView {
        ChipView {
            report,
            load_tokens: 0,
            work: Work::default(),
            pace: Pace::UNKNOWN,
            kv_full: false,
            load_full: false,
            errors: ErrorBreaker::default(),
        }
    }

    /// Seconds of work placed there.
    pub fn work_s(&self) -> f64 {
        self.work.seconds(&self.pace)
    }

    /// Whether its breakers let it take a new request.
    pub fn admits(&self) -> bool {
        !self.kv_full && !self.load_full && self.errors.admits()
    }
}

/// A role and pace class's chips by (work ahead in seconds, as f64 bits, address), each
/// with its pace and work.
type ByWork = BTreeMap<(u64, Addr), (Pace, Work)>;

/// A chip's place in the walk's order: its role, pace class and work bits.
type WorkKey = (Role, PaceClass, u64);

/// A chip's gauges on the router, registered at its first report rather than looked up
/// by name at every heartbeat.
struct ChipGauges {
    up: metrics::Gauge,
    blocks_used: metrics::Gauge,
    blocks_total: metrics::Gauge,
    kv_breaker: metrics::Gauge,
    /// Registered once the chip has a figure for them.
    handoff_gap: Option<metrics::Gauge>,
    emulated: Option<metrics::Gauge>,
}

impl ChipGauges {
    fn register(id: &str) -> ChipGauges {
        let chip = [("chip", id.to_string())];
        ChipGauges {
            up: metrics::gauge!("tessera_router_chip_up", &chip),
            blocks_used: metrics::gauge!("tessera_kv_blocks_used", &chip),
            blocks_total: metrics::gauge!("tessera_kv_blocks_total", &chip),
            kv_breaker: metrics::gauge!("tessera_router_breaker_state", "chip" => id.to_string(), "breaker" => "kv"),
            handoff_gap: None,
            emulated: None,
        }
    }
}

/// A chip that can take new work: up, its host alive, not draining for a role change,
/// its breakers closed (or half-open and waiting for a probe).
fn available(addr: &Addr, c: &ChipView, down_hosts: &BTreeSet<HostId>) -> bool {
    c.report.state == ChipState::Up && !c.report.draining && !down_hosts.contains(&addr.host) && c.admits()
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

/// The kv-aware cost in predicted seconds (see [`cost`]), ranked in nanoseconds:
/// `cached` is the prompt tokens each chip holds that count, `block_size_of` the tokens
/// in a chip's KV block (what its pool's figures count in).
pub fn kv_aware<'a>(
    cached: &'a BTreeMap<Addr, usize>,
    ask: Ask,
    block_size_of: &'a dyn Fn(&Addr) -> usize,
) -> impl Fn(Leg, &Addr, &ChipView) -> i64 + 'a {
    move |leg, a, c| {
        let (used, total) = (c.report.kv_blocks_used, c.report.kv_blocks_total);
        let ask = Ask { block_size: block_size_of(a), ..ask };
        let cached = cached.get(a).copied().unwrap_or(0);
        cost::rank(match leg {
            // Only a prefill chip hands its request off; any other decodes it too.
            Leg::Compute if c.report.role == Role::Prefill => {
                cost::compute_cost(&c.pace, &c.work, used, total, &ask, cached)
            }
            Leg::Compute => cost::colocated_cost(&c.pace, &c.work, used, total, &ask, cached),
            Leg::Decode => cost::decode_cost(&c.pace, &c.work, used, total, &ask),
        })
    }
}

/// Placed tokens alone.
pub fn by_load(_: Leg, _: &Addr, c: &ChipView) -> i64 {
    c.load_tokens as i64
}

/// Cached prefix tokens per chip that count in placement (`cached_tokens`: what each
/// holds; `mean_work_s`: the mean work ahead per chip, in seconds): none for a hot spot,
/// a chip whose work ahead passes twice the mean plus this prompt's prefill there (it
/// would get every request sharing its prefix while the others idle).
pub fn cache_credit(
    chips: &BTreeMap<Addr, ChipView>,
    cached_tokens: &BTreeMap<Addr, usize>,
    prompt_tokens: usize,
    mean_work_s: f64,
) -> BTreeMap<Addr, usize> {
    cached_tokens
        .iter()
        .filter(|(a, _)| {
            chips
                .get(a)
                .is_some_and(|c| c.work_s() <= 2.0 * mean_work_s + prompt_tokens as f64 * c.pace.prefill_s_per_token)
        })
        .map(|(a, &tokens)| (*a, tokens.min(prompt_tokens)))
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
/// chip when none of those is available (`place_among` may forbid that while one is up:
/// see [`DecodeOverflow`]). Any placement that avoids every chip in `exclude` (chips
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
    place_among(&all, down_hosts, exclude, prompt_tokens, min_prompt_tokens, score, true)
}

/// [`place`] among `chips` only: the same choice as among all chips whenever every chip
/// left out scores no better than one kept that fits the same leg (see
/// `Router::candidates`). A prefill chip runs a request whole only if
/// `prefill_may_decode` (see [`prefill_may_decode`]).
pub fn place_among(
    chips: &[(&Addr, &ChipView)],
    down_hosts: &BTreeSet<HostId>,
    exclude: &[Addr],
    prompt_tokens: usize,
    min_prompt_tokens: usize,
    score: &Scorer,
    prefill_may_decode: bool,
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
            .or_else(|| best(chips, down_hosts, avoid, Leg::Compute, score, |_| prefill_may_decode))
            .map(|decode| Placed { decode, prefill: None })
    };
    place_avoiding(exclude).or_else(|| place_avoiding(&[]))
}

/// Whether a prefill chip may run a request whole (`place_among`): always under
/// [`DecodeOverflow::PrefillChips`]; under [`DecodeOverflow::Wait`] only while no
/// decoding chip is up, its host alive and outside `exclude` (whatever its breakers and
/// load: one that is merely full makes the request wait). So a request whose only
/// decode chip is restarting, or declined it, still runs on a prefill chip.
pub fn prefill_may_decode(
    overflow: DecodeOverflow,
    chips: &BTreeMap<Addr, ChipView>,
    down_hosts: &BTreeSet<HostId>,
    exclude: &[Addr],
) -> bool {
    overflow == DecodeOverflow::PrefillChips
        || !chips.iter().any(|(a, c)| {
            c.report.role.decodes()
                && c.report.state == ChipState::Up
                && !c.report.draining
                && !down_hosts.contains(&a.host)
                && !exclude.contains(a)
        })
}

struct Placement {
    req: Addr,
    /// (chip, tokens it was charged, work it was given) for each chip the request holds.
    chips: Vec<(Addr, usize, Work)>,
    /// Its tenant (a fork's is not known here; it counts as its parent).
    tenant: Option<u32>,
    /// Placed past the chips' prompt bound (see `Router::may_pass_prompt_bound`) and its
    /// prompt not yet computed (`PromptComputed` clears it).
    past_bound: bool,
}

impl Placement {
    /// Whether a chip still has its prompt to compute (or, a prefill chip, holds it
    /// until the decode chip samples).
    fn holds_prompt(&self) -> bool {
        self.chips.iter().any(|(_, _, work)| work.prompt_tokens > 0)
    }
}

/// Whether the prompts placed on a chip and not yet computed would take it `limit` or
/// more at its pace. A chip with no prompt queued always takes one, however long. A
/// prefill chip's prompt counts until its decode chip samples a token (the prefill chip
/// samples the first), so the bound also holds back a pipeline whose decode chips are
/// the bottleneck: first tokens do not run ahead of the decode chips' room.
fn load_full(v: &ChipView, limit: Duration) -> bool {
    v.work.prompt_tokens > 0 && v.work.prompt_tokens as f64 * v.pace.prefill_s_per_token >= limit.as_secs_f64()
}

/// How the router meets saturation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests placed and not released before new ones wait.
    pub max_queued_requests: usize,
    /// A chip whose pool holds this share (percent) of its blocks takes nothing new.
    pub kv_breaker_percent: u32,
    /// A chip whose queued prompts would take this long at its pace takes nothing new:
    /// the rest wait here, where priority and fair order apply across the cluster,
    /// rather than in one chip's queue.
    pub max_queued_prompt: Duration,
    /// Requests that may wait for a chip; one more is refused at once (429).
    pub max_waiting_requests: usize,
    /// How long a request waits before it is refused (429 with `Retry-After`).
    pub queue_timeout: Duration,
    /// Where a request goes when every decoding chip is full.
    pub decode_overflow: DecodeOverflow,
}

impl Limits {
    /// `max_queued_requests` with the defaults of the rest: 90%, 256 waiting, 5 s,
    /// overflow onto prefill chips.
    pub fn new(max_queued_requests: usize) -> Limits {
        Limits {
            max_queued_requests,
            kv_breaker_percent: 90,
            max_queued_prompt: Duration::from_millis(500),
            max_waiting_requests: 256,
            queue_timeout: Duration::from_secs(5),
            decode_overflow: DecodeOverflow::PrefillChips,
        }
    }
}

/// A request waiting for a chip, and when it stops waiting.
struct Waiting {
    ask: RouteAsk,
    deadline: Moment,
}

/// Where the policy places a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub placed: Option<Placed>,
    /// Prompt tokens the chip computing the prompt holds cached (that count).
    pub cached_tokens: usize,
}

pub struct Router {
    chips: BTreeMap<Addr, ChipView>,
    down_hosts: BTreeSet<HostId>,
    down_host_names: BTreeMap<HostId, String>,
    placements: BTreeMap<u64, Placement>,
    limits: Limits,
    min_prompt_tokens: usize,
    /// Where KV lives, and the chips asked for a snapshot and not answered yet.
    index: index::ClusterIndex,
    snapshot_asked: BTreeSet<Addr>,
    /// The block size of chips not in `block_sizes` (the cluster's), and the chips of
    /// another: a prompt is hashed at each size in use, and each chip looked up at its own.
    block_size: usize,
    block_sizes: BTreeMap<Addr, usize>,
    policy: RouterPolicy,
    /// Routes so far (round-robin's turn).
    turns: u64,
    /// The chips of each role and pace class by (work ahead in seconds, as f64 bits,
    /// address), with their pace and work: the kv-aware search walks each class
    /// cheapest first, the class's pace bounding what a chip not yet looked at there can
    /// cost, and each chip's own pace and work bounding its cost before a look at it.
    by_work: BTreeMap<(Role, PaceClass), ByWork>,
    /// Each chip's place in that order: (role, pace class, work bits).
    keys: BTreeMap<Addr, WorkKey>,
    total_work_s: f64,
    /// Chips' modelled paces, their observed correction factors (prefill, decode), the
    /// factors' means, and the means as last applied to chips without factors.
    modelled: BTreeMap<Addr, Pace>,
    factors: BTreeMap<Addr, (Option<f64>, Option<f64>)>,
    means: (MeanFactor, MeanFactor),
    applied_means: (f64, f64),
    /// Chips whose error breaker is open (to move to half-open when due).
    open_breakers: BTreeSet<Addr>,
    waiting: VecDeque<Waiting>,
    /// Tenants' virtual counters: which waiting request of a class goes next.
    fair: FairQueue,
    /// Per tenant: its requests placed and not released. A tenant with some is
    /// backlogged for VTC's lift even with nothing waiting here: its work waits on chips.
    placed_by_tenant: BTreeMap<u32, usize>,
    gauges: BTreeMap<Addr, ChipGauges>,
}

impl Router {
    /// `chips`: every chip of the topology, reported as Starting until heard from.
    /// Requests run on one chip until `with_disaggregation` says otherwise.
    pub fn new(chips: Vec<ChipReport>, max_queued_requests: usize) -> Router {
        let chips: BTreeMap<Addr, ChipView> = chips.into_iter().map(|r| (r.chip, ChipView::new(r))).collect();
        let addrs: Vec<Addr> = chips.keys().copied().collect();
        let mut router = Router {
            chips,
            down_hosts: BTreeSet::new(),
            down_host_names: BTreeMap::new(),
            placements: BTreeMap::new(),
            limits: Limits::new(max_queued_requests),
            min_prompt_tokens: usize::MAX,
            index: index::ClusterIndex::new(),
            snapshot_asked: BTreeSet::new(),
            block_size: 16,
            block_sizes: BTreeMap::new(),
            policy: RouterPolicy::default(),
            turns: 0,
            by_work: BTreeMap::new(),
            keys: BTreeMap::new(),
            total_work_s: 0.0,
            modelled: BTreeMap::new(),
            factors: BTreeMap::new(),
            means: (MeanFactor::default(), MeanFactor::default()),
            applied_means: (1.0, 1.0),
            open_breakers: BTreeSet::new(),
            waiting: VecDeque::new(),
            fair: FairQueue::default(),
            placed_by_tenant: BTreeMap::new(),
            gauges: BTreeMap::new(),
        };
        for a in addrs {
            router.reindex(a);
        }
        router
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

    /// Chips whose KV blocks hold another number of tokens than the cluster's: their
    /// prefix caches are looked up with the prompt hashed at their size.
    pub fn with_block_sizes(mut self, sizes: BTreeMap<Addr, usize>) -> Router {
        self.block_sizes = sizes.into_iter().filter(|&(_, size)| size > 0).collect();
        self
    }

    /// Tokens in a KV block of `chip`.
    fn block_size_of(&self, chip: &Addr) -> usize {
        self.block_sizes.get(chip).copied().unwrap_or(self.block_size)
    }

    /// The prompt tokens each chip holds cached: the longest prefix of whole blocks of
    /// the chip's own size whose hashes (salted with `cache_salt`) it holds.
    fn cached_tokens(&self, prompt: &[u32], cache_salt: Option<u64>) -> BTreeMap<Addr, usize> {
        let mut sizes: BTreeSet<usize> = self.block_sizes.values().copied().collect();
        sizes.insert(self.block_size);
        let mut cached = BTreeMap::new();
        for size in sizes {
            let held = self.index.prefix_blocks(&salted_prefix_hashes(prompt, size, cache_salt));
            // A chip of another size holds none of these hashes but by collision.
            cached.extend(held.into_iter().filter(|(a, _)| self.block_size_of(a) == size).map(|(a, n)| (a, n * size)));
        }
        cached
    }

    /// Prompts of at least `min_prompt_tokens` tokens are prefilled on a prefill chip
    /// and decoded on a decode chip.
    pub fn with_disaggregation(mut self, min_prompt_tokens: usize) -> Router {
        self.min_prompt_tokens = min_prompt_tokens;
        self
    }

    pub fn with_limits(mut self, limits: Limits) -> Router {
        self.limits = limits;
        self
    }

    /// Each chip's modelled pace (chips not named keep [`Pace::UNKNOWN`]).
    pub fn with_paces(mut self, paces: BTreeMap<Addr, Pace>) -> Router {
        self.modelled = paces;
        let addrs: Vec<Addr> = self.chips.keys().copied().collect();
        for a in addrs {
            self.reindex(a);
        }
        self
    }

    /// Recomputes `chip`'s pace and its places in the cost orders.
    fn reindex(&mut self, chip: Addr) {
        let Some(v) = self.chips.get_mut(&chip) else { return };
        let modelled = self.modelled.get(&chip).copied().unwrap_or(Pace::UNKNOWN);
        let (prefill, decode) = self.factors.get(&chip).copied().unwrap_or((None, None));
        // A chip's own correction stays within MAX_DEVIATION of the others': one stalled
        // step must not make a chip look so slow that it never gets work to show otherwise.
        let near = |own: Option<f64>, mean: f64| {
            own.map_or(mean, |f| f.clamp(mean / cost::MAX_DEVIATION, mean * cost::MAX_DEVIATION))
        };
        v.pace = modelled.scaled(near(prefill, self.means.0.get()), near(decode, self.means.1.get()));
        let work = v.work_s();
        let key = (v.report.role, PaceClass::of(&v.pace), work.to_bits());
        let entry = (v.pace, v.work);
        if let Some(old) = self.keys.insert(chip, key) {
            let (role, class, old_work) = old;
            let set = self.by_work.get_mut(&(role, class));
            if old == key && set.as_ref().and_then(|s| s.get(&(old_work, chip))) == Some(&entry) {
                return; // most reports move nothing
            }
            if let Some(set) = set {
                set.remove(&(old_work, chip));
                if set.is_empty() {
                    self.by_work.remove(&(role, class));
                }
            }
            self.total_work_s -= f64::from_bits(old_work);
        }
        self.by_work.entry((key.0, key.1)).or_default().insert((key.2, chip), entry);
        self.total_work_s = (self.total_work_s + work).max(0.0);
    }

    /// Adds (or, with `add` false, takes back) a placement's charge on `chip`.
    fn charge(&mut self, chip: Addr, tokens: usize, work: Work, add: bool) {
        let Some(v) = self.chips.get_mut(&chip) else { return };
        if add {
            v.load_tokens += tokens;
            v.work.add(work);
        } else {
            v.load_tokens = v.load_tokens.saturating_sub(tokens);
            v.work.remove(work);
        }
        v.load_full = load_full(v, self.limits.max_queued_prompt);
        self.reindex(chip);
    }

    /// Folds in `chip`'s observed pace; when the factors' means moved, chips that have
    /// not been observed follow them.
    fn observe(&mut self, chip: Addr, speed: &crate::msg::StepSpeed) {
        let modelled = self.modelled.get(&chip).copied().unwrap_or(Pace::UNKNOWN);
        let (prefill, decode) = modelled.factors(speed);
        let (old_prefill, old_decode) = self.factors.get(&chip).copied().unwrap_or((None, None));
        let (prefill, decode) = (prefill.or(old_prefill), decode.or(old_decode));
        for (old, new, mean) in [(old_prefill, prefill, &mut self.means.0), (old_decode, decode, &mut self.means.1)] {
            if let Some(f) = old {
                mean.remove(f);
            }
            if let Some(f) = new {
                mean.add(f);
            }
        }
        self.factors.insert(chip, (prefill, decode));
        self.reindex(chip);
        let means = (self.means.0.get(), self.means.1.get());
        let moved = |now: f64, then: f64| (now / then - 1.0).abs() > 0.01;
        if moved(means.0, self.applied_means.0) || moved(means.1, self.applied_means.1) {
            self.applied_means = means;
            let followers: Vec<Addr> = self
                .chips
                .keys()
                .filter(|a| self.factors.get(a).is_none_or(|(p, d)| p.is_none() || d.is_none()))
                .copied()
                .collect();
            for a in followers {
                self.reindex(a);
            }
        }
    }

    /// Walks the available chips of `role`, each pace class cheapest work first,
    /// keeping each that is the best so far (with and without `exclude`) for one of
    /// `legs`, until no chip further on in the class can beat them. `bound` is at most
    /// the cost of a chip of that pace and work that holds none of the prompt (a holder
    /// is in `out` already); a chip's cost is at least its work ahead plus the bound of
    /// its class's least pace with no work, which ends a class's walk, and a chip whose
    /// own bound rules it out is passed over without a look at the rest of it.
    #[allow(clippy::too_many_arguments)]
    fn scan<'a>(
        &'a self,
        role: Role,
        legs: &[&dyn Fn(&ChipView) -> bool],
        exclude: &[Addr],
        leg: Leg,
        score: &Scorer,
        bound: impl Fn(&Pace, &Work) -> f64,
        out: &mut Vec<(&'a Addr, &'a ChipView)>,
    ) {
        // Per leg, the best (score, address) among chips not excluded, and among all:
        // first of the chips of this role already kept (the prompt's cache holders), so
        // that a cheap holder ends the walk at once. A chip is kept only if it beats one
        // of them in the order `best` chooses by (ties to the lower address), so a
        // thousand idle chips of one kind give a few candidates, not a thousand.
        let mut best = vec![[None::<(i64, Addr)>; 2]; legs.len()];
        let consider = |a: &Addr, c: &ChipView, best: &mut [[Option<(i64, Addr)>; 2]]| {
            let avoided = exclude.contains(a);
            let s = (score(leg, a, c), *a);
            let mut useful = false;
            for (fits, b) in legs.iter().zip(best.iter_mut()) {
                if !fits(c) {
                    continue;
                }
                for (slot, counts) in [(0, !avoided), (1, true)] {
                    if counts && b[slot].is_none_or(|b| s < b) {
                        b[slot] = Some(s);
                        useful = true;
                    }
                }
            }
            useful
        };
        for (a, c) in out.iter() {
            if c.report.role == role && available(a, c, &self.down_hosts) {
                consider(a, c, &mut best);
            }
        }
        let beaten = |best: &[[Option<(i64, Addr)>; 2]], bound: i64| {
            best.iter().flatten().all(|b| b.is_some_and(|(b, _)| bound > b.saturating_add(1)))
        };
        let classes = (role, PaceClass::FASTEST)..=(role, PaceClass::SLOWEST);
        for (&(_, class), set) in self.by_work.range(classes) {
            let class_floor_s = bound(&class.floor(), &Work::default());
            for (&(work, a), (pace, chip_work)) in set {
                if beaten(&best, cost::rank(f64::from_bits(work) + class_floor_s)) {
                    break;
                }
                if beaten(&best, cost::rank(bound(pace, chip_work))) {
                    continue;
                }
                let Some((a, c)) = self.chips.get_key_value(&a) else { continue };
                if available(a, c, &self.down_hosts) && consider(a, c, &mut best) {
                    out.push((a, c));
                }
            }
        }
    }

    /// The chips the kv-aware policy can choose (`score` its cost of `ask`): the holders
    /// of the prompt's cached prefix, and, per role, the chips that may cost least for
    /// a leg (see `scan`) — for the decode leg, per compatibility class of the prefill
    /// candidates. Any chip left out holds no cached prefix and cannot score better
    /// than a kept chip that fits the same leg.
    fn candidates(
        &self,
        holders: &BTreeMap<Addr, usize>,
        ask: &Ask,
        exclude: &[Addr],
        score: &Scorer,
    ) -> Vec<(&Addr, &ChipView)> {
        let mut out: Vec<(&Addr, &ChipView)> = holders.keys().filter_map(|a| self.chips.get_key_value(a)).collect();
        let prefill = |c: &ChipView| c.report.role == Role::Prefill;
        let any = |_: &ChipView| true;
        // Per role, its cheapest chips: the prefill leg and the colocated legs
        // (decoding chips first, then any chip) all draw from these. A chip's bound is
        // its cost holding none of the prompt, less the KV-pressure term (never negative).
        for role in Role::ALL {
            let compute_bound = |pace: &Pace, work: &Work| match role {
                Role::Prefill => cost::compute_cost(pace, work, 0, 0, ask, 0),
                _ => cost::colocated_cost(pace, work, 0, 0, ask, 0),
            };
            self.scan(role, &[&any], exclude, Leg::Compute, score, compute_bound, &mut out);
        }
        // Compatibility classes by their hash (what a class is; the fields only explain
        // a mismatch), so that hundreds of prefill candidates copy nothing.
        let class = |c: &ChipView| c.report.compat.as_ref().map(|c| c.hash);
        let mut classes: Vec<Option<u64>> = out.iter().filter(|(_, c)| prefill(c)).map(|(_, c)| class(c)).collect();
        classes.sort_unstable();
        classes.dedup();
        type Fits = Box<dyn Fn(&ChipView) -> bool>;
        let fits: Vec<Fits> = classes
            .into_iter()
            .map(|compat| {
                Box::new(move |c: &ChipView| {
                    c.report.role == Role::Decode && (compat.is_none() || class(c).is_none() || class(c) == compat)
                }) as Fits
            })
            .collect();
        let legs: Vec<&dyn Fn(&ChipView) -> bool> = fits.iter().map(|f| f.as_ref()).collect();
        let decode_bound = |pace: &Pace, work: &Work| cost::decode_cost(pace, work, 0, 0, ask);
        self.scan(Role::Decode, &legs, exclude, Leg::Decode, score, decode_bound, &mut out);
        out.sort_by_key(|(a, _)| **a);
        out.dedup_by_key(|(a, _)| **a);
        out
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

    fn update(&mut self, report: ChipReport, fx: &mut dyn Effects<Msg>) {
        let chip = report.chip;
        let was_up = self.chips.get(&chip).is_some_and(|c| c.report.state == ChipState::Up);
        let is_up = report.state == ChipState::Up;
        // The gateway's /metrics shows every chip of the cluster, not only local ones.
        let gauges = self.gauges.entry(chip).or_insert_with(|| ChipGauges::register(&report.id));
        gauges.up.set(if is_up { 1.0 } else { 0.0 });
        gauges.blocks_used.set(report.kv_blocks_used as f64);
        gauges.blocks_total.set(report.kv_blocks_total as f64);
        if let Some(emulation) = &report.emulated
            && gauges.emulated.is_none()
        {
            // An emulated chip is labelled as such wherever its figures appear.
            let labels = [("chip", report.id.to_string()), ("emulation", emulation.to_string())];
            let emulated = metrics::gauge!("tessera_chip_emulated", &labels);
            emulated.set(1.0);
            gauges.emulated = Some(emulated);
        }
        if let Some(gap) = report.last_handoff_gap_s {
            let labels = [("chip", report.id.to_string())];
            gauges
                .handoff_gap
                .get_or_insert_with(|| metrics::gauge!("tessera_kv_handoff_gap_last_seconds", &labels))
                .set(gap);
        }
        let full = kv_full(report.kv_blocks_used, report.kv_blocks_total, self.limits.kv_breaker_percent);
        gauges.kv_breaker.set(f64::from(u8::from(full)));
        let speed = report.speed;
        let view = self.chips.entry(chip).or_insert_with(|| ChipView::new(report.clone()));
        view.report = report;
        view.kv_full = full;
        view.load_full = load_full(view, self.limits.max_queued_prompt);
        match speed {
            Some(speed) => self.observe(chip, &speed),
            None => self.reindex(chip), // a role change moves it between the orders
        }
        if was_up && !is_up {
            self.lose(chip, fx);
        }
    }

    /// A request failed on `chip` at `now`: its error breaker counts it.
    fn failed_on(&mut self, chip: Addr, now: Moment) {
        let Some(v) = self.chips.get_mut(&chip) else { return };
        if v.errors.failure(now) {
            tracing::warn!(chip = %v.report.id, "repeated failures: the chip's breaker opens");
            self.open_breakers.insert(chip);
            self.breaker_metric(chip);
        }
    }

    fn breaker_metric(&self, chip: Addr) {
        if let Some(v) = self.chips.get(&chip) {
            metrics::gauge!("tessera_router_breaker_state", "chip" => v.report.id.clone(), "breaker" => "errors")
                .set(v.errors.state().gauge());
        }
    }

    /// Moves open breakers whose cooldown is over to half-open.
    fn poll_breakers(&mut self, now: Moment) {
        let due: Vec<Addr> = self
            .open_breakers
            .iter()
            .filter(|a| self.chips.get(a).is_none_or(|v| v.errors.reopens_at().is_none_or(|t| t <= now)))
            .copied()
            .collect();
        for chip in due {
            self.open_breakers.remove(&chip);
            if let Some(v) = self.chips.get_mut(&chip)
                && v.errors.poll(now)
            {
                tracing::info!(chip = %v.report.id, "breaker half-open: one probe request");
                self.breaker_metric(chip);
            }
        }
    }

    /// Every request placed on `chip` (as prefill or decode chip) must go elsewhere.
    fn lose(&mut self, chip: Addr, fx: &mut dyn Effects<Msg>) {
        self.failed_on(chip, fx.now());
        let lost: Vec<u64> = self
            .placements
            .iter()
            .filter(|(_, p)| p.chips.iter().any(|(c, ..)| *c == chip))
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(p) = self.placements.get(&id) {
                let _ = fx.send(p.req, Msg::ChipLost { chip });
            }
            self.unplace(id, Some(chip));
        }
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

    /// Where the policy places a request of `prompt_tokens` prompt tokens (`prompt`,
    /// hashed with `cache_salt` for the cache lookup) and `tokens` tokens in all (`turn`:
    /// round-robin's), as a request of tenant `past_bound` that may pass the chips'
    /// prompt bound (see `may_pass_prompt_bound`; every chip is then a candidate), if
    /// set. Changes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(
        &self,
        request_id: u64,
        prompt: &[u32],
        cache_salt: Option<u64>,
        prompt_tokens: usize,
        tokens: usize,
        exclude: &[Addr],
        turn: u64,
        past_bound: Option<u32>,
    ) -> Decision {
        let lifted = past_bound.map(|tenant| self.past_prompt_bound(tenant, tokens.max(prompt_tokens)));
        let chips = lifted.as_ref().unwrap_or(&self.chips);
        let held = match self.policy {
            RouterPolicy::KvAware | RouterPolicy::Dynamo => self.cached_tokens(prompt, cache_salt),
            RouterPolicy::LeastLoaded | RouterPolicy::RoundRobin | RouterPolicy::Random => BTreeMap::new(),
        };
        let mean_work_s = self.total_work_s / self.chips.len().max(1) as f64;
        let cached = cache_credit(chips, &held, prompt_tokens, mean_work_s);
        let ask = Ask { prompt_tokens, total_tokens: tokens.max(prompt_tokens), block_size: self.block_size };
        let block_size_of = |a: &Addr| self.block_size_of(a);
        let n = self.chips.len().max(1) as i64;
        let ranks: BTreeMap<Addr, i64> = match self.policy {
            RouterPolicy::RoundRobin => self.chips.keys().enumerate().map(|(i, a)| (*a, i as i64)).collect(),
            _ => BTreeMap::new(),
        };
        let score: Box<Scorer> = match self.policy {
            RouterPolicy::KvAware => Box::new(kv_aware(&cached, ask, &block_size_of)),
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
            // Dynamo: overlap_weight (1) x blocks to prefill + blocks in use (the chip's).
            RouterPolicy::Dynamo => Box::new(|leg, a, c| {
                let new_blocks = match leg {
                    Leg::Compute => {
                        prompt_tokens.saturating_sub(held.get(a).copied().unwrap_or(0)).div_ceil(block_size_of(a))
                    }
                    Leg::Decode => 0,
                };
                new_blocks as i64 + c.report.kv_blocks_used as i64
            }),
        };
        let candidates: Vec<(&Addr, &ChipView)> = match (past_bound, self.policy) {
            (None, RouterPolicy::KvAware) => self.candidates(&held, &ask, exclude, &*score),
            _ => chips.iter().collect(),
        };
        let may_decode = prefill_may_decode(self.limits.decode_overflow, &self.chips, &self.down_hosts, exclude);
        let min_prompt = self.min_prompt_tokens;
        let placed =
            place_among(&candidates, &self.down_hosts, exclude, prompt_tokens, min_prompt, &*score, may_decode);
        let cached_tokens = placed.map_or(0, |p| cached.get(&p.prefill.unwrap_or(p.decode)).copied().unwrap_or(0));
        Decision { placed, cached_tokens }
    }

    /// The chips as a request of `tenant` with `tokens` tokens that passes the prompt
    /// bound sees them (see `may_pass_prompt_bound`): none past it, nor past the KV
    /// breaker where the pool's free blocks (as last reported) hold the request whole —
    /// the breaker's headroom, used by one request per tenant at a time. And the prompts
    /// queued on a chip are only `tenant`'s own: the least served tenant's prompt goes
    /// before the others' in every chip's fair order, so only the step in flight and its
    /// own prompts are ahead of it (a chip that would prefill it fastest is not passed
    /// over for the flood queued there).
    fn past_prompt_bound(&self, tenant: u32, tokens: usize) -> BTreeMap<Addr, ChipView> {
        let fits = |a: &Addr, c: &ChipView| {
            c.report.kv_blocks_total.saturating_sub(c.report.kv_blocks_used) >= tokens.div_ceil(self.block_size_of(a))
        };
        let mut own: BTreeMap<Addr, usize> = BTreeMap::new();
        for p in self.placements.values().filter(|p| p.tenant == Some(tenant)) {
            for (chip, _, work) in &p.chips {
                *own.entry(*chip).or_default() += work.prompt_tokens;
            }
        }
        self.chips
            .iter()
            .map(|(a, c)| {
                let work = Work { prompt_tokens: own.get(a).copied().unwrap_or(0), ..c.work };
                (*a, ChipView { load_full: false, kv_full: c.kv_full && !fits(a, c), work, ..c.clone() })
            })
            .collect()
    }

    /// The cluster index (for tools that load it directly, e.g. `bench router`).
    pub fn index_mut(&mut self) -> &mut index::ClusterIndex {
        &mut self.index
    }

    fn route(&mut self, ask: RouteAsk, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        self.poll_breakers(now);
        // A re-route: the chips it left for good are chips it failed on.
        let left: Vec<Addr> = self
            .placements
            .get(&ask.request_id)
            .map_or(Vec::new(), |p| p.chips.iter().map(|(c, ..)| *c).filter(|c| ask.exclude.contains(c)).collect());
        for chip in left {
            self.failed_on(chip, now);
        }
        // New requests queue behind those of their class or above already waiting;
        // re-routes go first.
        let new = !self.placements.contains_key(&ask.request_id);
        if new {
            self.arrive(ask.share.tenant);
        }
        let past_bound = new && self.may_pass_prompt_bound(ask.share);
        let queued_ahead = self.waiting.iter().any(|w| w.ask.share.class <= ask.share.class);
        if new && ((queued_ahead && !past_bound) || self.placements.len() >= self.limits.max_queued_requests) {
            self.wait(ask, fx);
            return;
        }
        if let Some(ask) = self.place_now(ask, past_bound, fx) {
            if self.a_chip_may_take_it() {
                self.wait(ask, fx); // starting, breakers or load: a chip will take it soon
            } else {
                let states: Vec<String> = self
                    .chips
                    .values()
                    .map(|c| format!("{} {:?}", c.report.id, c.report.state).to_lowercase())
                    .collect();
                let error = ServeError::new(ErrorKind::Unavailable, format!("no healthy chip ({})", states.join(", ")));
                self.unplace(ask.request_id, None);
                let _ = fx.send(ask.req, Msg::RouteFailed { request_id: ask.request_id, error });
            }
        }
    }

    /// Whether some chip is up or starting, its host alive and not parked (whatever its
    /// breakers): a chip draining into a new role takes work again once drained, so a
    /// request waits for it rather than failing while a re-plan drains every chip.
    fn a_chip_may_take_it(&self) -> bool {
        self.chips.iter().any(|(a, c)| {
            matches!(c.report.state, ChipState::Up | ChipState::Starting)
                && !c.report.parked
                && !self.down_hosts.contains(&a.host)
        })
    }

    /// Places `ask` if a chip can take it now (`past_bound`: whatever the chips' prompt
    /// bound); gives it back otherwise.
    fn place_now(&mut self, ask: RouteAsk, past_bound: bool, fx: &mut dyn Effects<Msg>) -> Option<RouteAsk> {
        let turn = self.turns;
        let (id, salt, exclude) = (ask.request_id, ask.cache_salt, &ask.exclude);
        let (prompt, prompt_tokens, tokens) = (&ask.prompt, ask.prompt_tokens, ask.tokens);
        let past = past_bound.then_some(ask.share.tenant);
        let decision = self.decide(id, prompt, salt, prompt_tokens, tokens, exclude, turn, past);
        let Some(Placed { decode, prefill }) = decision.placed else { return Some(ask) };
        // Past the bound only where a chip it chose had reached it.
        let past_bound = [Some(decode), prefill]
            .iter()
            .flatten()
            .any(|c| self.chips.get(c).is_some_and(|v| v.load_full || v.kv_full));
        self.turns += 1;
        // A re-route replaces whatever the request held.
        self.unplace(ask.request_id, None);
        let uncached = ask.prompt_tokens.saturating_sub(decision.cached_tokens);
        let mut held = Vec::new();
        match prefill {
            Some(p) => {
                held.push((decode, ask.tokens, Work { prompt_tokens: 0, seqs: 1 }));
                held.push((p, ask.prompt_tokens, Work { prompt_tokens: uncached, seqs: 0 }));
            }
            None => held.push((decode, ask.tokens, Work { prompt_tokens: uncached, seqs: 1 })),
        }
        self.charge_tenant(&ask, decode, prefill, uncached);
        for &(chip, tokens, work) in &held {
            self.charge(chip, tokens, work, true);
            if let Some(v) = self.chips.get_mut(&chip) {
                v.errors.placed(ask.request_id);
            }
        }
        *self.placed_by_tenant.entry(ask.share.tenant).or_default() += 1;
        let tenant = Some(ask.share.tenant);
        self.placements.insert(ask.request_id, Placement { req: ask.req, chips: held, tenant, past_bound });
        tracing::debug!(
            request = ask.request_id,
            tenant = ask.share.tenant,
            past_bound,
            prompt = ask.prompt_tokens,
            cached = decision.cached_tokens,
            decode = %decode,
            prefill = ?prefill,
            work = ?self.chips.iter().map(|(a, c)| (a.actor, c.work.seqs, c.work.prompt_tokens)).collect::<Vec<_>>(),
            "placed"
        );
        let kind = if prefill.is_some() { "disaggregated" } else { "colocated" };
        let reason = if decision.cached_tokens > 0 { "prefix_hit" } else { "least_work" };
        metrics::counter!("tessera_router_decisions_total", "placement" => kind).increment(1);
        metrics::counter!("tessera_router_decision_reasons_total", "reason" => reason).increment(1);
        if fx.send(ask.req, Msg::Routed { request_id: ask.request_id, chip: decode, prefill }).is_err() {
            // The request is gone (its client left while it waited): nothing holds the chips.
            self.unplace(ask.request_id, None);
        }
        None
    }

    /// Charges `ask`'s tenant what the request will cost where it was placed: its
    /// uncached prompt at the prefill chip's pace over the mean chip's, and its output
    /// at the decode chip's time per token (an equal part of a decode step as its batch
    /// stands) over the mean chip's decode step. So a token on a slow chip costs more
    /// than on a fast one, while a pace off by a factor common to every chip (modelled
    /// before any step is seen, then corrected by what the chips do) charges early and
    /// late requests alike: charged in seconds, a tenant placed before the correction
    /// could wait behind the others for thousands of requests.
    fn charge_tenant(&mut self, ask: &RouteAsk, decode: Addr, prefill: Option<Addr>, uncached: usize) {
        let pace = |a: Addr| self.chips.get(&a).map_or(Pace::UNKNOWN, |c| c.pace);
        let n = self.chips.len().max(1) as f64;
        let mean = |f: fn(&Pace) -> f64| self.chips.values().map(|c| f(&c.pace)).sum::<f64>() / n;
        let relative = |x: f64, mean: f64| if mean > 0.0 { x / mean } else { x };
        let batch = self.chips.get(&decode).map_or(1, |c| c.work.seqs + 1) as f64;
        let output = ask.tokens.saturating_sub(ask.prompt_tokens) as f64;
        let prompt = relative(pace(prefill.unwrap_or(decode)).prefill_s_per_token, mean(|p| p.prefill_s_per_token));
        let per_output = relative(pace(decode).decode_s(batch) / batch, mean(|p| p.decode_step_s));
        self.fair.charge(ask.share, uncached as f64 * prompt + output * per_output);
    }

    /// Queues `ask` until a chip can take it, or refuses it when the queue is full.
    fn wait(&mut self, ask: RouteAsk, fx: &mut dyn Effects<Msg>) {
        // While it waits, it holds no chip.
        self.unplace(ask.request_id, None);
        if self.waiting.len() >= self.limits.max_waiting_requests {
            let why = format!("{} requests already wait for a chip (the router's limit)", self.waiting.len());
            self.refuse(ask, "full", why, fx);
            return;
        }
        tracing::debug!(
            request = ask.request_id,
            tenant = ask.share.tenant,
            counter = self.fair.counter(ask.share.tenant),
            waiting = self.waiting.len(),
            "waits"
        );
        fx.timer(self.limits.queue_timeout, Msg::Tick);
        // After every request of its class or a higher one.
        let class = ask.share.class;
        let at = self.waiting.iter().position(|w| w.ask.share.class > class).unwrap_or(self.waiting.len());
        self.waiting.insert(at, Waiting { ask, deadline: fx.now().after(self.limits.queue_timeout) });
        metrics::gauge!("tessera_router_waiting_requests").set(self.waiting.len() as f64);
    }

    /// A new request of `tenant` arrives: a tenant with nothing waiting or placed (its
    /// work all done) catches up with the counters of those present (VTC's lift), whether
    /// its request waits or is placed at once.
    fn arrive(&mut self, tenant: u32) {
        if self.waiting.iter().any(|w| w.ask.share.tenant == tenant) || self.placed_by_tenant.contains_key(&tenant) {
            return;
        }
        let present = self.waiting.iter().map(|w| w.ask.share.tenant).chain(self.placed_by_tenant.keys().copied());
        self.fair.arrive(tenant, present);
    }

    /// Whether a new request of `share`'s tenant may be placed past the chips' prompt
    /// bound and the KV breaker (error breakers still hold): while another tenant has work
    /// here, `share`'s tenant is the least served (VTC: its request is the one to place
    /// next) and none of its requests placed past the bound still has its prompt to
    /// compute (the prefill chip's first token ends that, not the decode chip's). So a
    /// light tenant beside a flood starts its prompt at once, rather than waiting for
    /// the flood's work to free room, while the prompts past the bound stay one per
    /// tenant: two backlogged tenants cannot take turns at lifting the bound for good.
    fn may_pass_prompt_bound(&self, share: TenantShare) -> bool {
        let others = self.waiting.iter().map(|w| w.ask.share.tenant).chain(self.placed_by_tenant.keys().copied());
        let least = others.filter(|&t| t != share.tenant).map(|t| self.fair.counter(t)).min_by(f64::total_cmp);
        least.is_some_and(|least| self.fair.counter(share.tenant) <= least)
            && !self.placements.values().any(|p| p.past_bound && p.tenant == Some(share.tenant) && p.holds_prompt())
    }

    /// Refuses `ask` as overloaded, telling its client when to retry.
    fn refuse(&mut self, ask: RouteAsk, reason: &'static str, why: String, fx: &mut dyn Effects<Msg>) {
        metrics::counter!("tessera_router_refused_total", "reason" => reason).increment(1);
        let retry_after = self.limits.queue_timeout.as_secs_f64().ceil() as u32;
        let error = ServeError::new(ErrorKind::Overloaded, why).retry_after(retry_after);
        let _ = fx.send(ask.req, Msg::RouteFailed { request_id: ask.request_id, error });
    }

    /// The waiting request to place next: the highest class, then the tenant least
    /// served (weighted VTC, charged what its requests cost on the chips they were
    /// placed on), then the earliest. The queue is in class order, so with one tenant
    /// waiting it is the first.
    fn next_waiting(&self) -> Option<usize> {
        let first = self.waiting.front()?;
        let class = first.ask.share.class;
        let tenant = first.ask.share.tenant;
        let same_class = self.waiting.iter().take_while(|w| w.ask.share.class == class);
        if same_class.clone().all(|w| w.ask.share.tenant == tenant) {
            return Some(0);
        }
        let key = |(i, w): (usize, &Waiting)| (self.fair.counter(w.ask.share.tenant), i);
        same_class.enumerate().map(key).min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1))).map(|(_, i)| i)
    }

    /// Refuses the waiting requests whose deadline passed, then places waiting requests
    /// in class order, then fair order between tenants, while chips take them.
    fn drain(&mut self, fx: &mut dyn Effects<Msg>) {
        if self.waiting.is_empty() {
            return;
        }
        let now = fx.now();
        self.poll_breakers(now);
        let (expired, kept): (VecDeque<Waiting>, VecDeque<Waiting>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|w| w.deadline <= now);
        self.waiting = kept;
        for w in expired {
            let why = format!("no chip could take the request within {:?}", self.limits.queue_timeout);
            self.refuse(w.ask, "deadline", why, fx);
        }
        while let Some(next) = self.next_waiting() {
            let Some(w) = self.waiting.remove(next) else { break };
            let new = !self.placements.contains_key(&w.ask.request_id);
            if new && self.placements.len() >= self.limits.max_queued_requests {
                self.waiting.insert(next, w);
                break;
            }
            let past_bound = new && self.may_pass_prompt_bound(w.ask.share);
            if let Some(ask) = self.place_now(w.ask, past_bound, fx) {
                self.waiting.insert(next, Waiting { ask, deadline: w.deadline });
                break;
            }
        }
        metrics::gauge!("tessera_router_waiting_requests").set(self.waiting.len() as f64);
    }

    /// Takes back what request `request_id` holds on `chip` (`None`: on every chip).
    fn unplace(&mut self, request_id: u64, chip: Option<Addr>) {
        let Some(p) = self.placements.get_mut(&request_id) else { return };
        let (gone, kept): (Vec<_>, Vec<_>) = p.chips.drain(..).partition(|(c, ..)| chip.is_none_or(|x| x == *c));
        p.chips = kept;
        if p.chips.is_empty() {
            if let Some(t) = p.tenant
                && let Some(n) = self.placed_by_tenant.get_mut(&t)
            {
                *n -= 1;
                if *n == 0 {
                    self.placed_by_tenant.remove(&t);
                }
            }
            self.placements.remove(&request_id);
        }
        for (c, tokens, work) in gone {
            self.charge(c, tokens, work, false);
        }
    }

    /// `chip` computed the request's prompt: what is left there is decoding.
    fn prefilled(&mut self, request_id: u64, chip: Addr) {
        let Some(p) = self.placements.get_mut(&request_id) else { return };
        let Some((_, _, work)) = p.chips.iter_mut().find(|(c, ..)| *c == chip) else { return };
        let done = Work { prompt_tokens: std::mem::take(&mut work.prompt_tokens), seqs: 0 };
        self.charge(chip, 0, done, false);
    }

    /// A request forked from another on `chip` runs there: a placement of its own,
    /// decoding only (its prompt was computed once, for its parent).
    fn forked(&mut self, request_id: u64, req: Addr, chip: Addr, tokens: usize) {
        if self.placements.contains_key(&request_id) || !self.chips.contains_key(&chip) {
            return;
        }
        let work = Work { prompt_tokens: 0, seqs: 1 };
        self.charge(chip, tokens, work, true);
        let chips = vec![(chip, tokens, work)];
        self.placements.insert(request_id, Placement { req, chips, tenant: None, past_bound: false });
    }

    /// The request left `chip` without failing there.
    fn release(&mut self, request_id: u64, chip: Addr) {
        let held = self.placements.get(&request_id).is_some_and(|p| p.chips.iter().any(|(c, ..)| *c == chip));
        if !held {
            return;
        }
        self.unplace(request_id, Some(chip));
        if let Some(v) = self.chips.get_mut(&chip)
            && v.errors.success(request_id)
        {
            tracing::info!(chip = %v.report.id, "probe succeeded: the chip's breaker closes");
            self.breaker_metric(chip);
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
    cache_salt: Option<u64>,
    /// Its tenant's class and weight: the queue is kept in class order, and fair
    /// between tenants within a class.
    share: TenantShare,
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
            Msg::Route { request_id, req, tokens, prompt_tokens, exclude, prompt, cache_salt, share } => {
                self.route(RouteAsk { request_id, req, tokens, prompt_tokens, exclude, prompt, cache_salt, share }, fx)
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
            Msg::Release { request_id, chip } => {
                self.release(request_id, chip);
                self.drain(fx);
            }
            Msg::Prefilled { request_id, chip } => {
                // Its prompt no longer counts against the chip's queue: one may wait for that.
                self.prefilled(request_id, chip);
                self.drain(fx);
            }
            Msg::PromptComputed { request_id } => {
                // Its tenant's next request may pass the prompt bound.
                if let Some(p) = self.placements.get_mut(&request_id) {
                    p.past_bound = false;
                }
                self.drain(fx);
            }
            Msg::Forked { request_id, req, chip, tokens } => self.forked(request_id, req, chip, tokens),
            Msg::Heartbeat { beat } => {
                let beat = std::sync::Arc::unwrap_or_clone(beat);
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
                self.drain(fx);
            }
            Msg::Tick => self.drain(fx),
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
