//! `tessera bench router`: the router's decision on a large cluster — prompt hashing, the
//! cluster-index lookup, the cache credit and the kv-aware placement over every chip —
//! timed one decision at a time, and the rate at which the index applies KV events.

use std::time::Instant;

use serde::Serialize;
use tessera_actor_core::testkit::TestFx;
use tessera_actor_core::{Addr, Behavior, HostId};
use tessera_actors::kv::{KvEvent, prefix_hashes};
use tessera_actors::msg::{ChipReport, ChipState, Msg, Role};
use tessera_actors::router::{Router, RouterPolicy};
use tessera_loadgen::SeededRng;

pub struct RouterBenchOptions {
    pub chips: usize,
    /// (chip, block) entries indexed.
    pub blocks: usize,
    pub decisions: usize,
    pub prompt_tokens: usize,
    pub block_size: usize,
}

#[derive(Debug, Serialize)]
pub struct RouterBenchReport {
    pub chips: usize,
    pub indexed_blocks: usize,
    pub prompt_tokens: usize,
    pub decisions: usize,
    pub decision_us_p50: f64,
    pub decision_us_p99: f64,
    pub decision_us_max: f64,
    /// Decisions placed on a chip holding a cached prefix of the prompt.
    pub prefix_hits: usize,
    pub events_applied: usize,
    pub events_per_s: f64,
}

impl RouterBenchReport {
    pub fn table(&self) -> String {
        format!(
            "{} chips, {} indexed blocks, prompts of {} tokens\n\
             decision: p50 {:.2} us, p99 {:.2} us, max {:.2} us over {} decisions ({} placed on a cached prefix)\n\
             index: {} events applied at {:.2} M events/s\n",
            self.chips,
            self.indexed_blocks,
            self.prompt_tokens,
            self.decision_us_p50,
            self.decision_us_p99,
            self.decision_us_max,
            self.decisions,
            self.prefix_hits,
            self.events_applied,
            self.events_per_s / 1e6
        )
    }
}

/// Prompt families: a shared prefix of `blocks` blocks each (a system prompt, a
/// document), whose chained hashes the chips hold some of.
fn family_tokens(family: usize, tokens: usize) -> Vec<u32> {
    (0..tokens).map(|i| (family * 7919 + i * 31) as u32 % 50_000).collect()
}

pub fn run(opts: &RouterBenchOptions) -> RouterBenchReport {
    let bs = opts.block_size.max(1);
    let prompt_blocks = (opts.prompt_tokens / bs).max(1);
    let per_chip = (opts.blocks / opts.chips.max(1)).max(1);
    // Each chip holds the leading blocks of `per_chip / prompt_blocks` families.
    let families_per_chip = (per_chip / prompt_blocks).max(1);
    let families = (opts.chips * families_per_chip / 10).max(1); // each family on ~10 chips
    let hashes: Vec<Vec<u64>> =
        (0..families).map(|f| prefix_hashes(&family_tokens(f, prompt_blocks * bs), bs)).collect();
    let mut rng = SeededRng::new(0x9e37_79b9_7f4a_7c15);
    let mut below = |n: usize| rng.below(n.max(1) as u64) as usize;
    let addr = |i: usize| Addr::new(HostId((i / 64) as u16), 16 + (i % 64) as u64);

    let reports: Vec<ChipReport> = (0..opts.chips)
        .map(|c| ChipReport {
            state: ChipState::Up,
            ..ChipReport::starting(addr(c), format!("c{c}"), format!("h{}", c / 64), Role::Both)
        })
        .collect();
    let mut router = Router::new(reports, usize::MAX).with_block_size(bs).with_policy(RouterPolicy::KvAware);
    // Build the index from events, timing the apply rate.
    let index = router.index_mut();
    let mut events_applied = 0usize;
    let started = Instant::now();
    for c in 0..opts.chips {
        index.resync(addr(c), 1, 0, &[]);
        let mut events = Vec::with_capacity(per_chip);
        let mut seq = 0;
        for _ in 0..families_per_chip {
            let f = below(families);
            for &hash in &hashes[f] {
                seq += 1;
                events.push(KvEvent::Stored { seq, hash });
            }
        }
        events_applied += events.len();
        index.apply(addr(c), 1, &events);
    }
    let apply_s = started.elapsed().as_secs_f64();
    let indexed_blocks = router.index_mut().len();

    // Uneven load: requests placed (and kept) through the router itself.
    let mut fx = TestFx::new(Addr::new(HostId(0), 2));
    for r in 0..opts.chips * 4 {
        let tokens = below(4000);
        let route = Msg::Route {
            request_id: r as u64,
            req: Addr::new(HostId(0), 10_000 + r as u64),
            tokens,
            prompt_tokens: tokens / 2,
            exclude: vec![],
            prompt: vec![],
            cache_salt: None,
            share: Default::default(),
        };
        router.handle(route, &mut fx);
    }
    let mut times = Vec::with_capacity(opts.decisions);
    let mut prefix_hits = 0;
    for d in 0..opts.decisions {
        // Half the prompts extend a known family, half are new.
        let prompt: Vec<u32> = if d % 2 == 0 {
            let mut p = family_tokens(below(families), prompt_blocks * bs);
            p.extend((0..bs).map(|_| below(50_000) as u32));
            p
        } else {
            (0..(prompt_blocks + 1) * bs).map(|_| below(50_000) as u32).collect()
        };
        let t = Instant::now();
        let decision = router.decide(d as u64, &prompt, None, prompt.len(), prompt.len() + 64, &[], d as u64, None);
        times.push(t.elapsed().as_secs_f64() * 1e6);
        prefix_hits += usize::from(decision.cached_tokens > 0);
        std::hint::black_box(decision);
    }
    times.sort_by(f64::total_cmp);
    let pct = |q: f64| times.get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1))).copied();
    RouterBenchReport {
        chips: opts.chips,
        indexed_blocks,
        prompt_tokens: (prompt_blocks + 1) * bs,
        decisions: opts.decisions,
        decision_us_p50: pct(0.5).unwrap_or(f64::NAN),
        decision_us_p99: pct(0.99).unwrap_or(f64::NAN),
        decision_us_max: times.last().copied().unwrap_or(f64::NAN),
        prefix_hits,
        events_applied,
        events_per_s: events_applied as f64 / apply_s,
    }
}
