//! Continuous batching for one chip, as a pure policy the chip actor drives: every step
//! carries the decode tokens of running sequences first, then prefill chunks (of
//! sequences part-way through their prompt, then of new arrivals) under a token budget,
//! so new requests join running batches. Sequences are served by their tenant's
//! priority class first (interactive, standard, batch); new arrivals of one class start
//! in fair-queuing order between tenants ([`fair`]: weighted VTC), first come first
//! served within a tenant. On a chip shared by tenants a step computes prompt tokens up
//! to the chip's roofline knee, and a lone prompt (a tenant's only sequence here, as a
//! light tenant's beside a flood) goes first and whole, the other tenants' decodes held
//! back one step, so its first token comes about as fast as alone. When KV blocks run
//! out a decoding sequence preempts by recompute the lowest class's latest arrival, and
//! a waiting sequence of a higher class preempts running ones of lower classes to start:
//! a preempted sequence waits and resumes, it is never lost. A sequence that starts
//! (or restarts) takes the leading blocks of its prompt that the pool still holds —
//! sealed by a running sequence or cached after an ended one — and computes only the
//! rest (prefix reuse; at least its last prompt token is always computed, so it has
//! logits to sample from). The chip actor and the
//! single-chip local engine of `tessera-chip-executor` (`tessera generate`) both drive
//! this batcher over a `KvPool`: one scheduler, one block allocator.

pub mod fair;

pub use crate::kv::prefix_hashes;
use crate::kv::{BlockRef, KvPool, chained_block_hash};
use crate::msg::{Delivery, Finish, Fork, PriorityClass, SamplingSpec, SeqRequest, TenantShare, TokenLogprob};
use crate::router::cost::Pace;
use fair::FairQueue;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tessera_actor_core::Addr;
use tessera_topology::perf::{SeqStep, StepShape};

/// Limits of one chip's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatcherLimits {
    pub max_batch_tokens: usize,
    pub max_batch_seqs: usize,
    pub block_size: usize,
    pub max_context: usize,
}

/// Where a sequence's work happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Prefill and decode here.
    Local,
    /// Prefill positions 0..kv_tokens only, for a decode chip. Every position: it
    /// samples the first new token here and leaves (the decode chip continues from that
    /// token). One fewer: the decode chip runs the last one and samples.
    PrefillFor { kv_tokens: usize },
    /// Positions 0..cached come from a prefill chip; plannable once `ready`.
    Receiving { ready: bool },
}

#[derive(Debug)]
struct Seq {
    request_id: u64,
    req: Addr,
    /// Prompt, then every token generated (including ones replayed from another chip).
    tokens: Vec<u32>,
    /// Tokens this request generated before it came here (a replay).
    generated_before: usize,
    /// Tokens it may still generate here, and how many it has.
    max_new: usize,
    new_tokens: usize,
    /// Tokens whose K/V are written or scheduled to be.
    cached: usize,
    blocks: Vec<BlockRef>,
    hashes: Vec<u64>,
    /// Leading positions whose KV came from the pool's cache, not computed here.
    reused: usize,
    arrival: u64,
    sampling: SamplingSpec,
    /// The worker holds a sampler for it (kept across preemption, so a recomputed
    /// sequence samples exactly as if it had never been preempted).
    sampler_live: bool,
    mode: Mode,
    delivery: Delivery,
    /// What its first block's hash chains to (its tenant's salt, if any).
    salt: Option<u64>,
    /// Its tenant's class and weight.
    share: TenantShare,
    /// Sampled tokens not sent yet ([`Delivery::Whole`]), and their log-probabilities
    /// when asked for.
    held: Vec<u32>,
    held_logprobs: Vec<TokenLogprob>,
    /// Siblings to fork where it samples its first token here.
    forks: Vec<Fork>,
    /// Forks planned in the step being run, each with its copy of the partial last
    /// block (none when the prompt ends on a block boundary): made in `complete`.
    forking: Vec<(Fork, Option<BlockRef>)>,
    /// The number of the last plan that scheduled it.
    planned_in: u64,
    /// The last block table a plan carried, which the next plan shares while no block
    /// was added (see `shared_table`).
    table: Arc<[u32]>,
}

impl Seq {
    fn new(seq: SeqRequest, arrival: u64, mode: Mode) -> Seq {
        Seq {
            request_id: seq.request_id,
            req: seq.req,
            tokens: seq.tokens,
            generated_before: seq.generated,
            max_new: seq.max_new_tokens,
            new_tokens: 0,
            cached: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            reused: 0,
            arrival,
            sampling: seq.sampling,
            sampler_live: false,
            mode,
            delivery: seq.delivery,
            salt: seq.cache_salt,
            share: seq.share,
            held: Vec::new(),
            held_logprobs: Vec::new(),
            // A replay has sampled already: its siblings forked before.
            forks: if seq.generated == 0 { seq.forks } else { Vec::new() },
            forking: Vec::new(),
            planned_in: 0,
            table: Arc::from([]),
        }
    }

    /// Tokens still to run through the model here.
    fn pending(&self) -> usize {
        match self.mode {
            Mode::PrefillFor { kv_tokens } => kv_tokens - self.cached,
            Mode::Local | Mode::Receiving { .. } => self.tokens.len() - self.cached,
        }
    }

    /// It samples here once its pending tokens are computed.
    fn samples(&self) -> bool {
        match self.mode {
            Mode::PrefillFor { kv_tokens } => kv_tokens == self.tokens.len(),
            Mode::Local | Mode::Receiving { .. } => true,
        }
    }

    fn plannable(&self) -> bool {
        self.mode != Mode::Receiving { ready: false }
    }

    /// Preemption may take its blocks. Not a sequence whose KV is still being
    /// installed: that ends on its own, so waiting for it cannot deadlock.
    fn preemptible(&self) -> bool {
        self.mode != Mode::Receiving { ready: false }
    }
}

/// A prompt's place in the order prompts are served (see [`Batcher::plan`]).
#[derive(Debug, Clone, Copy)]
struct PromptKey {
    class: PriorityClass,
    /// The step's lone prompt (see `Batcher::lone_lead`) goes first in its class.
    leads: bool,
    counter: f64,
    /// Its tenant has other sequences here: of two tenants served alike, the one with no
    /// backlog here goes first (a returning tenant is lifted level with the others).
    backlog: bool,
    arrival: u64,
}

impl PromptKey {
    fn order(&self, other: &PromptKey) -> std::cmp::Ordering {
        self.class
            .cmp(&other.class)
            .then(other.leads.cmp(&self.leads))
            .then(self.counter.total_cmp(&other.counter))
            .then(self.backlog.cmp(&other.backlog))
            .then(self.arrival.cmp(&other.arrival))
    }
}

/// A prefill for a decode chip that has run to its end: its blocks now wait for the
/// decode chip to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefilled {
    pub request_id: u64,
    pub req: Addr,
    pub blocks: Vec<BlockRef>,
}

/// A step's tokens of one sequence, and their cache slots: one for a decode step, held
/// inline (most of a plan's sequences are decoding, and a plan is made every step).
pub type Tokens = SmallVec<[u32; 4]>;
pub type Slots = SmallVec<[i32; 4]>;

/// One sequence's share of a step, in the form the worker runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedSeq {
    pub request_id: u64,
    pub tokens: Tokens,
    pub start_pos: usize,
    /// Device block ids of the sequence's blocks, in order (shared with the steps
    /// before it while no block was added).
    pub block_table: Arc<[u32]>,
    pub slots: Slots,
    /// Sample a token from the last row (the chunk ends what is pending).
    pub sample: bool,
    /// Create the sampler first (boxed, as `score`: most steps of a sequence carry
    /// neither, and a plan's sequences are moved about whole).
    pub new_sampler: Option<Box<NewSampler>>,
    /// Score prompt tokens: the logits of every row of this chunk are wanted, and the
    /// first `targets.len()` rows predict these prompt tokens.
    pub score: Option<Box<Score>>,
    /// A prefill for a decode chip: stage each layer's KV of positions
    /// `stage_from..start_pos + tokens.len()` (from 0 on the first chunk after a reused
    /// prefix, whose blocks the decode chip needs too).
    pub stage: bool,
    pub stage_from: usize,
    /// Sequences forked from this one at this step: each samples its first token from
    /// the same logits row, with its own sampler, after this sequence's.
    pub forks: Vec<PlannedFork>,
}

impl PlannedSeq {
    /// The requests that sample from this chunk's last row, in the order their tokens
    /// are reported: this one, then its forks.
    pub fn samplers(&self) -> impl Iterator<Item = u64> + '_ {
        self.sample.then_some(self.request_id).into_iter().chain(self.forks.iter().map(|f| f.request_id))
    }
}

/// A sequence forked from a [`PlannedSeq`]: its sampler, created before it samples.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedFork {
    pub request_id: u64,
    pub new_sampler: NewSampler,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub seqs: Vec<PlannedSeq>,
    /// Samplers of requests that ended: the worker forgets them.
    pub drop_samplers: Vec<u64>,
    /// (source, destination) device blocks to copy, in every layer, after the forward
    /// pass: the partial last prompt block of a forking sequence, one copy per fork
    /// (copy-on-write: each fork writes its own tokens after the prompt there).
    pub copies: Vec<(u32, u32)>,
}

impl StepPlan {
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// The step as the performance models cost it.
    pub fn shape(&self) -> StepShape {
        StepShape {
            seqs: self
                .seqs
                .iter()
                .map(|s| SeqStep { new_tokens: s.tokens.len(), context: s.start_pos + s.tokens.len() })
                .collect(),
        }
    }
}

/// Why a sequence can never run on a chip, whatever else runs there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inadmissible {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {token} is outside the vocabulary ({vocab_size} tokens)")]
    OutOfVocabulary { token: u32, vocab_size: usize },
    #[error("the prompt has {tokens} tokens; the model's context is {max_context}")]
    NoRoomInContext { tokens: usize, max_context: usize },
    #[error(
        "{prompt} prompt tokens + {new} new tokens need {need} KV blocks but the cache holds {num_blocks}: \
         lower max_tokens"
    )]
    TooFewBlocks { prompt: usize, new: usize, need: usize, num_blocks: usize },
}

/// Whether `seq` may be admitted to a chip whose model has `vocab_size` tokens and a
/// context of `max_context`, and whose pool has `num_blocks` blocks, when it needs
/// `need_blocks` of them at most.
pub fn admissible(
    seq: &SeqRequest,
    vocab_size: usize,
    max_context: usize,
    need_blocks: usize,
    num_blocks: usize,
) -> Result<(), Inadmissible> {
    if seq.tokens.is_empty() {
        return Err(Inadmissible::EmptyPrompt);
    }
    if let Some(&token) = seq.tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(Inadmissible::OutOfVocabulary { token, vocab_size });
    }
    if seq.tokens.len() >= max_context {
        return Err(Inadmissible::NoRoomInContext { tokens: seq.tokens.len(), max_context });
    }
    // Admit only what can run to its end alone: then the earliest arrival can always
    // finish by preempting later ones, and the chip never deadlocks on KV.
    if need_blocks > num_blocks {
        let (prompt, new) = (seq.tokens.len(), seq.max_new_tokens);
        return Err(Inadmissible::TooFewBlocks { prompt, new, need: need_blocks, num_blocks });
    }
    Ok(())
}

/// Prompt tokens a chunk's rows predict, for a scoring request.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Where the scores go: the sequence's request actor.
    pub req: Addr,
    /// Siblings still to fork from it (`n` > 1), which echo the same prompt: theirs go
    /// to them too, (request id, actor).
    pub forks: Vec<(u64, Addr)>,
    /// Alternatives listed per token.
    pub k: usize,
    /// The prompt tokens after rows `0..targets.len()` of the chunk, in order.
    pub targets: Vec<u32>,
}

/// A sequence's sampler, to create before its first sampled step here.
#[derive(Debug, Clone, PartialEq)]
pub struct NewSampler {
    pub spec: SamplingSpec,
    /// Tokens it generated elsewhere (a replay): draws to skip, and what its penalties
    /// and `min_tokens` count.
    pub skip: u64,
    /// Its prompt and those tokens, when its penalties or grammar need them; empty
    /// otherwise.
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
}

/// Tokens a step produced for a request, to send it: the one just sampled, after any
/// held back for a [`Delivery::Whole`] response.
#[derive(Debug, Clone, PartialEq)]
pub struct Emitted {
    pub request_id: u64,
    pub req: Addr,
    pub tokens: Vec<u32>,
    pub finish: Option<Finish>,
    /// One per token, when the request asked for log-probabilities.
    pub logprobs: Vec<TokenLogprob>,
}

#[derive(Debug)]
pub struct Batcher {
    limits: BatcherLimits,
    eos_token_ids: Vec<u32>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    arrivals: u64,
    drop_samplers: Vec<u64>,
    /// Prefills for decode chips that preemption took: a decode chip may be reading
    /// their blocks, so they are not recomputed here but handed back to the chip.
    dropped: Vec<(u64, Addr)>,
    /// Prompt positions of sequences started since `take_prefix_stats`, and how many of
    /// them came from the cache.
    prefix_stats: (u64, u64),
    /// Forks that cannot happen here (no block for their copy): their request actors
    /// are told to find a chip of their own.
    unforked: Vec<(u64, Addr)>,
    /// Plans made so far (a sequence's `planned_in` names the last that took it).
    plans: u64,
    /// Most prompt tokens a step that carries decode tokens may add (stall-free
    /// batching); `None`: only the token budget.
    mixed_prefill_cap: Option<usize>,
    /// Tenants' virtual counters: which waiting sequence of a class starts next.
    fair: FairQueue,
    /// The cluster serves several tenants: steps keep to the knee (see `plan`).
    shared: bool,
    /// Tenants with one sequence here, as the current plan began.
    lone: BTreeSet<u32>,
    /// The current plan's lone lead (see `lone_lead`).
    leading: Option<u32>,
    /// Preemptions since `take_preemptions`.
    preemptions: Preemptions,
}

/// Sequences preempted, by why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Preemptions {
    /// A running sequence needed KV blocks.
    pub kv: u64,
    /// A waiting sequence of a higher class needed KV blocks to start.
    pub priority: u64,
    /// A waiting sequence of a tenant below its share of the batch needed room to start.
    pub fair: u64,
}

impl Batcher {
    /// Step limits from the next step on.
    pub fn set_limits(&mut self, max_batch_tokens: usize, max_batch_seqs: usize) {
        self.limits.max_batch_tokens = max_batch_tokens.max(1);
        self.limits.max_batch_seqs = max_batch_seqs.max(1);
    }

    pub fn new(limits: BatcherLimits, eos_token_ids: Vec<u32>) -> Batcher {
        Batcher {
            limits,
            eos_token_ids,
            waiting: VecDeque::new(),
            running: Vec::new(),
            arrivals: 0,
            drop_samplers: Vec::new(),
            dropped: Vec::new(),
            prefix_stats: (0, 0),
            unforked: Vec::new(),
            plans: 0,
            mixed_prefill_cap: None,
            fair: FairQueue::default(),
            shared: false,
            lone: BTreeSet::new(),
            leading: None,
            preemptions: Preemptions::default(),
        }
    }

    /// Whether the chip serves several tenants (from the next step on): see `plan`.
    pub fn set_shared(&mut self, shared: bool) {
        self.shared = shared;
    }

    /// Preemptions since the last call.
    pub fn take_preemptions(&mut self) -> Preemptions {
        std::mem::take(&mut self.preemptions)
    }

    /// Costs tenants' service at this chip's `pace` (the router's model of it).
    pub fn set_pace(&mut self, pace: Pace) {
        self.fair.set_pace(pace);
    }

    /// Chip seconds served to each tenant (by index) since the last call.
    pub fn take_service(&mut self) -> BTreeMap<u32, f64> {
        self.fair.take_service()
    }

    /// A sequence of `share`'s tenant arrives: a tenant with nothing here catches up
    /// with the counters of those present (VTC's lift).
    fn arrive(&mut self, share: TenantShare) {
        let mut present = self.running.iter().chain(&self.waiting).map(|s| s.share.tenant);
        if present.any(|t| t == share.tenant) {
            return;
        }
        let present: Vec<u32> = self.running.iter().chain(&self.waiting).map(|s| s.share.tenant).collect();
        self.fair.arrive(share.tenant, present);
    }

    /// Where a sequence of `share` stands in this chip's order: its class, then its
    /// tenant's counter (lower goes first).
    pub fn rank(&self, share: TenantShare) -> (crate::msg::PriorityClass, f64) {
        (share.class, self.fair.counter(share.tenant))
    }

    /// The waiting sequence to start next: the highest class, then the tenant least
    /// served (VTC), then the earliest arrival.
    fn next_waiting(&self) -> Option<usize> {
        (0..self.waiting.len())
            .min_by(|&a, &b| self.prompt_key(&self.waiting[a]).order(&self.prompt_key(&self.waiting[b])))
    }

    /// Where `s` stands in the order prompts are served: class, its tenant's counter,
    /// whether the tenant has a backlog here, arrival.
    fn prompt_key(&self, s: &Seq) -> PromptKey {
        let (class, tenant) = (s.share.class, s.share.tenant);
        PromptKey {
            class,
            leads: self.leading == Some(tenant),
            counter: self.fair.counter(tenant),
            backlog: !self.lone.contains(&tenant),
            arrival: s.arrival,
        }
    }

    /// Tenants with exactly one sequence here.
    fn lone_tenants(&self) -> BTreeSet<u32> {
        let mut count: BTreeMap<u32, usize> = BTreeMap::new();
        for s in self.running.iter().chain(&self.waiting) {
            *count.entry(s.share.tenant).or_default() += 1;
        }
        count.into_iter().filter(|&(_, n)| n == 1).map(|(t, _)| t).collect()
    }

    /// Takes running sequence `j` back to waiting by recompute (a prefill for a decode
    /// chip goes back to the chip instead).
    fn preempt(&mut self, j: usize, pool: &mut KvPool) {
        let mut seq = self.running.remove(j);
        release_blocks(&mut seq, pool);
        if matches!(seq.mode, Mode::PrefillFor { .. }) {
            self.dropped.push((seq.request_id, seq.req));
            return;
        }
        seq.cached = 0;
        let at = self.waiting.iter().position(|w| w.arrival > seq.arrival).unwrap_or(self.waiting.len());
        self.waiting.insert(at, seq);
    }

    /// Makes room for the next waiting sequence (see [`Batcher::make_room`]) for its
    /// first chunk.
    fn preempt_for_next(&mut self, pool: &mut KvPool) {
        let Some(next) = self.next_waiting() else { return };
        let (share, need) = {
            let s = &self.waiting[next];
            let first = s.pending().min(self.limits.max_batch_tokens);
            (s.share, blocks_needed(s, first, self.limits.block_size))
        };
        self.make_room(share, need, pool);
    }

    /// Preempts running sequences until `need` blocks are free and a sequence slot is
    /// open for one of `share`'s, taking them (latest arrival first) from lower classes,
    /// then — while `share`'s tenant runs fewer sequences than its weighted share of the
    /// batch — from the most-served tenant of its class that runs more than its share.
    /// Returns whether the room is there. Nothing is lost: the victims wait and recompute.
    pub fn make_room(&mut self, share: TenantShare, need: usize, pool: &mut KvPool) -> bool {
        let full = |b: &Batcher, pool: &KvPool| need > pool.free() || b.running.len() >= b.limits.max_batch_seqs;
        while full(self, pool) {
            let Some((j, priority)) = self.victim(share) else { return false };
            self.preempt(j, pool);
            if priority {
                self.preemptions.priority += 1;
            } else {
                self.preemptions.fair += 1;
            }
        }
        true
    }

    /// The running sequence to preempt for one of `share`'s, and whether it is for
    /// class (else for fair share).
    fn victim(&self, share: TenantShare) -> Option<(usize, bool)> {
        // Not one the last plan took: its step may be running on the worker now.
        let candidates =
            || self.running.iter().enumerate().filter(|(_, s)| s.preemptible() && s.planned_in != self.plans);
        let lower =
            candidates().filter(|(_, s)| s.share.class > share.class).max_by_key(|(_, s)| (s.share.class, s.arrival));
        if let Some((j, _)) = lower {
            return Some((j, true));
        }
        if self.running.iter().all(|s| s.share.tenant == share.tenant) {
            return None; // nobody else's to take
        }
        // Sequences each tenant of this class runs, and its weight.
        let mut tenants: BTreeMap<u32, (usize, u32)> = BTreeMap::new();
        for s in self.running.iter().chain(&self.waiting).filter(|s| s.share.class == share.class) {
            tenants.entry(s.share.tenant).or_insert((0, s.share.weight.max(1)));
        }
        tenants.entry(share.tenant).or_insert((0, share.weight.max(1)));
        for s in self.running.iter().filter(|s| s.share.class == share.class) {
            if let Some(t) = tenants.get_mut(&s.share.tenant) {
                t.0 += 1;
            }
        }
        let slots = self.running.len() + 1;
        let total_weight: u64 = tenants.values().map(|t| u64::from(t.1)).sum();
        // Shares of `slots` by weight, compared as counts scaled by the total weight: the
        // newcomer must stay within its share, the victim's tenant be at or over its
        // share even without the victim (so two tenants never trade a sequence back
        // and forth).
        let share_of = |t: &(usize, u32)| slots as u64 * u64::from(t.1);
        let mine = tenants.get(&share.tenant).copied().unwrap_or((0, 1));
        if (mine.0 as u64 + 1) * total_weight > share_of(&mine) {
            return None;
        }
        let over = |t: &(usize, u32)| t.0 > 0 && (t.0 as u64 - 1) * total_weight >= share_of(t);
        candidates()
            .filter(|(_, s)| s.share.class == share.class && s.share.tenant != share.tenant)
            .filter(|(_, s)| tenants.get(&s.share.tenant).is_some_and(over))
            .max_by(|(_, a), (_, b)| {
                let (ca, cb) = (self.fair.counter(a.share.tenant), self.fair.counter(b.share.tenant));
                ca.total_cmp(&cb).then(a.arrival.cmp(&b.arrival))
            })
            .map(|(j, _)| (j, false))
    }

    /// Caps the prompt tokens of the steps that carry decode tokens (stall-free
    /// batching: the running streams' steps stay short while prompts arrive), or lifts
    /// the cap. Steps without decode tokens keep the whole token budget.
    pub fn set_mixed_prefill_cap(&mut self, cap: Option<usize>) {
        self.mixed_prefill_cap = cap;
    }

    /// Forks that will not happen here, since the last call: (request id, its actor).
    pub fn take_unforked(&mut self) -> Vec<(u64, Addr)> {
        std::mem::take(&mut self.unforked)
    }

    /// (prompt positions started, positions of those reused from the cache) since the
    /// last call: a chip's prefix hit rate.
    pub fn take_prefix_stats(&mut self) -> (u64, u64) {
        std::mem::take(&mut self.prefix_stats)
    }

    pub fn limits(&self) -> BatcherLimits {
        self.limits
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn contains(&self, request_id: u64) -> bool {
        self.running.iter().chain(&self.waiting).any(|s| s.request_id == request_id)
    }

    /// Blocks a sequence of `tokens` tokens occupies.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.limits.block_size)
    }

    /// Blocks `seq` occupies at its longest: its prompt and every new token it may
    /// generate, within the model's context.
    pub fn blocks_to_finish(&self, seq: &SeqRequest) -> usize {
        self.blocks_for(seq.tokens.len().saturating_add(seq.max_new_tokens).min(self.limits.max_context))
    }

    pub fn enqueue(&mut self, seq: SeqRequest) {
        self.arrive(seq.share);
        self.arrivals += 1;
        self.waiting.push_back(Seq::new(seq, self.arrivals, Mode::Local));
    }

    /// Queues the prefill of positions 0..kv_tokens of `seq` for a decode chip.
    pub fn enqueue_prefill(&mut self, seq: SeqRequest, kv_tokens: usize) {
        self.arrive(seq.share);
        self.arrivals += 1;
        let kv_tokens = kv_tokens.min(seq.tokens.len());
        self.waiting.push_back(Seq::new(seq, self.arrivals, Mode::PrefillFor { kv_tokens }));
    }

    /// Admits `seq` whose positions 0..kv_tokens a prefill chip computed (all of them
    /// when the prefill chip samples its next token): reserves their blocks now, all or
    /// nothing, and returns the slot of each position. The sequence runs once
    /// `mark_received`, which seals the blocks: until their KV has arrived no other
    /// sequence may find them by hash.
    pub fn admit_received(&mut self, seq: SeqRequest, kv_tokens: usize, pool: &mut KvPool) -> Option<Vec<i32>> {
        let bs = self.limits.block_size;
        if kv_tokens == 0 || kv_tokens > seq.tokens.len() || kv_tokens.div_ceil(bs) > pool.free() {
            return None;
        }
        self.arrive(seq.share);
        self.arrivals += 1;
        let mut s = Seq::new(seq, self.arrivals, Mode::Receiving { ready: false });
        s.cached = kv_tokens;
        if !pool.alloc_run(s.request_id, kv_tokens.div_ceil(bs), &mut s.blocks) {
            return None;
        }
        let mut slots = Vec::with_capacity(kv_tokens);
        cache_slots(&mut slots, &s.blocks, 0..kv_tokens, bs);
        self.running.push(s);
        Some(slots)
    }

    /// A received sequence's KV is all in place, and `first` is the token the prefill
    /// chip sampled after it (when it did): its full blocks are sealed (now others may
    /// reuse them) and it may run.
    pub fn mark_received(&mut self, request_id: u64, first: Option<u32>, pool: &mut KvPool) -> bool {
        let bs = self.limits.block_size;
        match self.running.iter_mut().find(|s| s.request_id == request_id) {
            Some(s) if s.mode == (Mode::Receiving { ready: false }) => {
                s.mode = Mode::Receiving { ready: true };
                if let Some(token) = first {
                    // Generated elsewhere, as a replay's tokens are.
                    s.tokens.push(token);
                    s.generated_before += 1;
                    s.max_new = s.max_new.saturating_sub(1);
                }
                seal_full_blocks(s, bs, pool);
                true
            }
            _ => false,
        }
    }

    /// Prefills for decode chips that preemption dropped since the last call.
    pub fn take_dropped(&mut self) -> Vec<(u64, Addr)> {
        std::mem::take(&mut self.dropped)
    }

    /// Device block ids of a sequence here, in order (shared with its last plan while
    /// no block was added).
    pub fn block_table(&mut self, request_id: u64) -> Option<Arc<[u32]>> {
        let s = self.running.iter_mut().chain(&mut self.waiting).find(|s| s.request_id == request_id)?;
        Some(shared_table(s))
    }

    /// Prefills for decode chips that the last step finished: they leave the batcher
    /// with their blocks (after `complete`, which took the first token of those that
    /// sample it here).
    pub fn take_prefilled(&mut self) -> Vec<Prefilled> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            if matches!(s.mode, Mode::PrefillFor { kv_tokens } if s.cached == kv_tokens) {
                let s = self.running.remove(i);
                if s.sampler_live {
                    self.drop_samplers.push(s.request_id);
                }
                out.push(Prefilled { request_id: s.request_id, req: s.req, blocks: s.blocks });
            } else {
                i += 1;
            }
        }
        out
    }

    /// Forgets a request and frees its blocks; returns its requester if it was here.
    pub fn abort(&mut self, request_id: u64, pool: &mut KvPool) -> Option<Addr> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.request_id == request_id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.request_id == request_id)?;
            self.waiting.remove(i)?
        };
        Some(self.retire(seq, pool))
    }

    /// Removes every sequence (the chip is going down); their blocks are freed if the
    /// pool still exists. Returns (request id, requester) of each.
    pub fn evict_all(&mut self, pool: Option<&mut KvPool>) -> Vec<(u64, Addr)> {
        let mut seqs: Vec<Seq> = self.running.drain(..).chain(self.waiting.drain(..)).collect();
        seqs.sort_by_key(|s| s.arrival);
        if let Some(pool) = pool {
            for s in &mut seqs {
                release_blocks(s, pool);
            }
        }
        self.drop_samplers.clear();
        seqs.into_iter().map(|s| (s.request_id, s.req)).collect()
    }

    fn retire(&mut self, mut seq: Seq, pool: &mut KvPool) -> Addr {
        release_blocks(&mut seq, pool);
        if seq.sampler_live {
            self.drop_samplers.push(seq.request_id);
        }
        seq.req
    }

    /// On a chip shared by tenants, the tenant whose prompt is first in the order prompts
    /// are served (see `plan`) when that prompt is its only sequence here: a tenant with
    /// no backlog here, as a light one beside a flood; or one whose lone prompt is part
    /// way (longer than a step's budget), which keeps the lead until it is computed. Its
    /// prompt goes first, whole as far as the budget goes, in a step free of the other
    /// tenants' decodes (held back one step), so its first token comes as it would alone;
    /// a backlogged tenant always has several sequences here.
    fn lone_lead(&self) -> Option<u32> {
        if !self.shared {
            return None;
        }
        let started = self
            .running
            .iter()
            .filter(|s| s.pending() > 1 && s.plannable() && self.lone.contains(&s.share.tenant))
            .min_by(|a, b| self.prompt_key(a).order(&self.prompt_key(b)));
        if let Some(s) = started {
            return Some(s.share.tenant);
        }
        let waiting = self.next_waiting().map(|n| &self.waiting[n]);
        let partial = self
            .running
            .iter()
            .filter(|s| s.pending() > 1 && s.plannable())
            .min_by(|a, b| self.prompt_key(a).order(&self.prompt_key(b)));
        let first = match (waiting, partial) {
            (Some(w), Some(p)) => Some(if self.prompt_key(w).order(&self.prompt_key(p)).is_lt() { w } else { p }),
            (w, p) => w.or(p),
        }?;
        Some(first.share.tenant).filter(|t| self.lone.contains(t))
    }

    /// The next step, or None when there is nothing to run.
    pub fn plan(&mut self, pool: &mut KvPool) -> Option<StepPlan> {
        let bs = self.limits.block_size;
        let mut budget = self.limits.max_batch_tokens;
        let mut seqs_left = self.limits.max_batch_seqs;
        // Every running sequence, at most: one allocation, no growing.
        let mut planned: Vec<PlannedSeq> = Vec::with_capacity(self.running.len().min(seqs_left) + 1);
        self.plans += 1;
        let this_plan = self.plans;
        let mut preempted = false;
        self.preempt_for_next(pool);
        self.running.sort_by_key(|s| (s.share.class, s.arrival));
        self.lone = if self.shared { self.lone_tenants() } else { BTreeSet::new() };
        self.leading = None;
        let lone = self.lone_lead();
        self.leading = lone;

        // 1. Decode tokens (one pending token), highest class first, then earliest arrival.
        // A lone prompt leading the step holds back one step the other tenants' decodes
        // that ran in the last one (never two steps running).
        let mut i = 0;
        while i < self.running.len() && seqs_left > 0 && budget > 0 {
            let s = &self.running[i];
            let held_back = lone.is_some_and(|t| s.share.tenant != t && s.planned_in + 1 == this_plan);
            if s.pending() != 1 || !s.plannable() || held_back {
                i += 1;
                continue;
            }
            let need = blocks_needed(&self.running[i], 1, bs);
            while need > pool.free() {
                // Recompute one after it in the order, not already in this step: of the
                // lowest class, the most-served tenant's latest arrival (a light
                // tenant's new sequence is not the one to go).
                let key = |s: &Seq| (s.share.class, self.fair.counter(s.share.tenant), s.arrival);
                let victim = (i + 1..self.running.len())
                    .filter(|&j| self.running[j].preemptible() && self.running[j].planned_in != this_plan)
                    .max_by(|&a, &b| {
                        let (ka, kb) = (key(&self.running[a]), key(&self.running[b]));
                        ka.0.cmp(&kb.0).then(ka.1.total_cmp(&kb.1)).then(ka.2.cmp(&kb.2))
                    });
                let Some(j) = victim else { break };
                preempted = true;
                self.preempt(j, pool);
                self.preemptions.kv += 1;
            }
            if need <= pool.free() {
                self.running[i].planned_in = this_plan;
                planned.push(schedule(&mut self.running[i], 1, bs, pool));
                budget -= 1;
                seqs_left -= 1;
            }
            i += 1;
        }
        let decoding = planned.len();
        for s in self.running.iter().filter(|s| s.planned_in == this_plan) {
            self.fair.charge_decode(s.share, decoding);
        }

        // A step that decodes adds only as many prompt tokens as keep it short.
        if let (Some(cap), false) = (self.mixed_prefill_cap, planned.is_empty()) {
            budget = budget.min(cap);
        }

        // 2. Prompts: those part-way through their prefill and new arrivals, in one
        // order: by class, then the tenant least served, then arrival. So a light
        // tenant's new prompt is not left for a later step behind the partial prompts of
        // a tenant served more, while one tenant's prompts go oldest first (a partial
        // prompt before a new one). New arrivals join unless this step had to preempt:
        // the freed blocks go to the running sequences, not back and forth.
        let mut partial: Vec<(PromptKey, usize)> = (0..self.running.len())
            .filter(|&j| {
                let s = &self.running[j];
                s.planned_in != this_plan && s.pending() > 1 && s.plannable()
            })
            .map(|j| (self.prompt_key(&self.running[j]), j))
            .collect();
        partial.sort_by(|a, b| a.0.order(&b.0));
        let mut partial = partial.into_iter().peekable();
        let mut arrivals = !preempted;
        // On a chip shared by tenants a step computes prompt tokens up to the chip's
        // roofline knee (past it a step is compute bound: chunks no larger lose nothing
        // but its fixed part), so the step in flight when a light tenant's prompt comes
        // is short; a lone prompt leading the step goes whole (see `lone_lead`).
        let knee = if self.shared { self.fair.pace().knee_tokens() } else { usize::MAX };
        let mut prompt_left = knee;
        while seqs_left > 0 && budget > 0 && prompt_left > 0 {
            let next = if arrivals { self.next_waiting() } else { None };
            let arrival_first = match (partial.peek(), next) {
                (_, None) => false,
                (None, Some(_)) => true,
                (Some((key, _)), Some(n)) => self.prompt_key(&self.waiting[n]).order(key).is_lt(),
            };
            // The first prompt of the step whole if it is the lone prompt of its tenant.
            let tenant = match (arrival_first, next, partial.peek()) {
                (true, Some(n), _) => Some(self.waiting[n].share.tenant),
                (false, _, Some((_, j))) => Some(self.running[*j].share.tenant),
                _ => None,
            };
            let most = if prompt_left == knee && tenant.is_some() && tenant == lone { budget } else { prompt_left };
            if !arrival_first {
                let Some((_, j)) = partial.next() else { break };
                let seq = &mut self.running[j];
                let chunk = fit_chunk(seq, seq.pending().min(budget).min(most), bs, pool.free());
                if chunk > 0 {
                    seq.planned_in = this_plan;
                    planned.push(schedule(seq, chunk, bs, pool));
                    self.fair.charge_prefill(seq.share, chunk);
                    budget -= chunk;
                    prompt_left = prompt_left.saturating_sub(chunk);
                    seqs_left -= 1;
                }
                continue;
            }
            let Some(next) = next else { break };
            let front = &mut self.waiting[next];
            let starting = front.cached == 0 && front.blocks.is_empty();
            if starting {
                reuse_prefix(front, bs, pool);
            }
            let chunk = fit_chunk(front, front.pending().min(budget).min(most), bs, pool.free());
            if chunk == 0 {
                // It waits without holding blocks: the running sequences may need them.
                release_blocks(front, pool);
                front.cached = 0;
                arrivals = false;
                continue;
            }
            let Some(mut seq) = self.waiting.remove(next) else { break };
            if starting {
                self.prefix_stats.0 += seq.pending() as u64 + seq.cached as u64;
                self.prefix_stats.1 += seq.reused as u64;
            }
            seq.planned_in = this_plan;
            planned.push(schedule(&mut seq, chunk, bs, pool));
            self.fair.charge_prefill(seq.share, chunk);
            self.running.push(seq);
            budget -= chunk;
            prompt_left = prompt_left.saturating_sub(chunk);
            seqs_left -= 1;
        }

        if planned.is_empty() {
            return None;
        }
        let copies = self.plan_forks(&mut planned, pool);
        Some(StepPlan { seqs: planned, drop_samplers: std::mem::take(&mut self.drop_samplers), copies })
    }

    /// Sequences sampling their first token in this step fork their siblings: each
    /// fork shares the prompt's full blocks and gets a copy of the partial last one
    /// (when the pool has a block for every fork; otherwise none forks here). Returns
    /// the block copies to make.
    fn plan_forks(&mut self, planned: &mut [PlannedSeq], pool: &mut KvPool) -> Vec<(u32, u32)> {
        let bs = self.limits.block_size;
        let mut copies = Vec::new();
        for p in planned.iter_mut().filter(|p| p.sample && !p.stage) {
            let Some(seq) = self.running.iter_mut().find(|s| s.request_id == p.request_id) else { continue };
            if seq.forks.is_empty() {
                continue;
            }
            let forks = std::mem::take(&mut seq.forks);
            // The partial last block each fork copies (none on a block boundary).
            let partial = !seq.cached.is_multiple_of(bs);
            let last = seq.blocks.last().map(|b| b.slot).filter(|_| partial);
            if partial && (last.is_none() || pool.free() < forks.len()) {
                self.unforked.extend(forks.iter().map(|f| (f.request_id, f.req)));
                continue;
            }
            let prompt = if seq.sampling.needs_history() { seq.tokens.clone() } else { Vec::new() };
            for fork in forks {
                let copy = last.and_then(|src| {
                    let dst = pool.alloc(fork.request_id)?;
                    copies.push((src, dst.slot));
                    Some(dst)
                });
                let mut spec = seq.sampling.clone();
                spec.seed = fork.seed;
                let new_sampler = NewSampler { spec, skip: 0, prompt: prompt.clone(), output: Vec::new() };
                p.forks.push(PlannedFork { request_id: fork.request_id, new_sampler });
                seq.forking.push((fork, copy));
            }
        }
        copies
    }

    /// The sequences forked from `parent` (its prompt computed, its first token not
    /// yet appended): each shares its full blocks and owns its copied last block.
    fn forked(&mut self, parent: &mut Seq, pool: &mut KvPool) -> Vec<Seq> {
        let mut out = Vec::new();
        for (fork, copy) in std::mem::take(&mut parent.forking) {
            let sealed = parent.hashes.len();
            let mut blocks = Vec::with_capacity(parent.blocks.len());
            for &b in &parent.blocks[..sealed] {
                match pool.share(b) {
                    Ok(()) => blocks.push(b),
                    Err(e) => {
                        tracing::error!(error = %e, request_id = fork.request_id, "KV block share failed");
                        break;
                    }
                }
            }
            blocks.extend(copy);
            if blocks.len() != parent.blocks.len() {
                // Not forkable after all: it finds a chip of its own.
                for b in blocks.drain(..).rev() {
                    let _ = pool.release(b);
                }
                self.unforked.push((fork.request_id, fork.req));
                continue;
            }
            let mut sampling = parent.sampling.clone();
            sampling.seed = fork.seed;
            let request = SeqRequest {
                request_id: fork.request_id,
                req: fork.req,
                tokens: parent.tokens.clone(),
                generated: 0,
                max_new_tokens: parent.max_new,
                sampling,
                delivery: parent.delivery,
                forks: Vec::new(),
                cache_salt: parent.salt,
                share: parent.share,
            };
            let mut seq = Seq::new(request, parent.arrival, Mode::Local);
            seq.cached = parent.cached;
            seq.blocks = blocks;
            seq.hashes = parent.hashes.clone();
            seq.sampler_live = true;
            out.push(seq);
        }
        out
    }

    /// Applies a step's sampled tokens: appends them, decides which requests finished
    /// and frees their blocks.
    pub fn complete(
        &mut self,
        sampled: &[(u64, u32)],
        logprobs: &[Option<TokenLogprob>],
        pool: &mut KvPool,
    ) -> Vec<Emitted> {
        let mut out = Vec::with_capacity(sampled.len());
        // Sampled in the order the plan took the running sequences: look there first.
        let mut next = 0;
        for (n, &(request_id, token)) in sampled.iter().enumerate() {
            let found = match self.running.get(next) {
                Some(s) if s.request_id == request_id => Some(next),
                _ => self.running.iter().position(|s| s.request_id == request_id),
            };
            let Some(i) = found else {
                continue; // aborted while the step ran
            };
            next = i + 1;
            if !self.running[i].forking.is_empty() {
                let mut parent = self.running.remove(i);
                let forked = self.forked(&mut parent, pool);
                self.running.insert(i, parent);
                for (k, f) in forked.into_iter().enumerate() {
                    self.running.insert(i + 1 + k, f);
                }
            }
            let seq = &mut self.running[i];
            seq.tokens.push(token);
            seq.new_tokens += 1;
            let stop = seq.sampling.stop_token_ids.contains(&token)
                || (!seq.sampling.ignore_eos && self.eos_token_ids.contains(&token));
            let finish = if stop {
                Some(Finish::Stop)
            } else if seq.new_tokens >= seq.max_new || seq.tokens.len() >= self.limits.max_context {
                Some(Finish::Length)
            } else {
                None
            };
            let req = seq.req;
            // A whole response's first token here goes at once (time to first token);
            // the others in groups, and whatever is held when it ends.
            let send_now = seq.delivery == Delivery::Stream
                || seq.new_tokens == 1
                || finish.is_some()
                || seq.held.len() + 1 >= Delivery::GROUP;
            let logprob = logprobs.get(n).cloned().flatten();
            if !send_now {
                seq.held.push(token);
                seq.held_logprobs.extend(logprob);
                continue;
            }
            let mut tokens = std::mem::take(&mut seq.held);
            tokens.push(token);
            let mut token_logprobs = std::mem::take(&mut seq.held_logprobs);
            token_logprobs.extend(logprob);
            if finish.is_some() {
                let seq = self.running.remove(i);
                self.retire(seq, pool);
                next = i;
            }
            out.push(Emitted { request_id, req, tokens, finish, logprobs: token_logprobs });
        }
        out
    }

    /// Tokens still to be computed across all sequences (the chip's queue depth).
    pub fn queued_tokens(&self) -> usize {
        self.running.iter().chain(&self.waiting).map(|s| s.pending() + s.max_new.saturating_sub(s.new_tokens)).sum()
    }
}

fn blocks_needed(seq: &Seq, extra: usize, bs: usize) -> usize {
    (seq.cached + extra).div_ceil(bs).saturating_sub(seq.blocks.len())
}

/// The longest chunk of at most `want` tokens whose blocks fit in `free` blocks.
fn fit_chunk(seq: &Seq, want: usize, bs: usize, free: usize) -> usize {
    let room = (seq.blocks.len() + free) * bs;
    want.min(room.saturating_sub(seq.cached))
}

/// Releases last block first: a prefix's first blocks then stay cached longest (a
/// parent is never evicted before its child), so what survives pressure is still a
/// usable prefix.
fn release_blocks(seq: &mut Seq, pool: &mut KvPool) {
    // Forks planned but not made (the sequence left mid-step): their copies go back;
    // their request actors hear from this one's, which routes them again.
    let copies = seq.forking.drain(..).filter_map(|(_, copy)| copy);
    for b in seq.blocks.drain(..).rev().chain(copies) {
        if let Err(e) = pool.release(b) {
            // A bookkeeping bug, not an input error: say so loudly, keep serving.
            tracing::error!(error = %e, request_id = seq.request_id, "KV block release failed");
        }
    }
    seq.hashes.clear();
    seq.reused = 0;
    seq.table = Arc::from([]);
}

/// Takes the leading full blocks of `seq`'s prompt that `pool` holds (never the block
/// of the last position it must compute), and marks their positions cached.
fn reuse_prefix(seq: &mut Seq, bs: usize, pool: &mut KvPool) {
    if seq.sampling.prompt_logprobs.is_some() {
        return; // a scoring request needs every prompt position's logits
    }
    let compute_to = match seq.mode {
        Mode::Local => seq.tokens.len(),
        Mode::PrefillFor { kv_tokens } => kv_tokens,
        Mode::Receiving { .. } => return,
    };
    let mut parent = seq.salt;
    for block in seq.tokens[..compute_to.saturating_sub(1)].chunks_exact(bs) {
        let hash = chained_block_hash(parent, block);
        let Some(b) = pool.acquire(hash) else { break };
        seq.blocks.push(b);
        seq.hashes.push(hash);
        parent = Some(hash);
    }
    seq.cached = seq.blocks.len() * bs;
    seq.reused = seq.cached;
}

/// Reserves blocks for the next `n` pending tokens of `seq` and describes the chunk.
/// The caller has checked that the blocks are free.
fn schedule(seq: &mut Seq, n: usize, bs: usize, pool: &mut KvPool) -> PlannedSeq {
    let start = seq.cached;
    let end = start + n;
    pool.alloc_run(seq.request_id, end.div_ceil(bs).saturating_sub(seq.blocks.len()), &mut seq.blocks);
    let mut slots = Slots::with_capacity(n);
    cache_slots(&mut slots, &seq.blocks, start..end, bs);
    seq.cached = end;
    seal_full_blocks(seq, bs, pool);
    let stage = matches!(seq.mode, Mode::PrefillFor { .. });
    let samples = seq.samples();
    let new_sampler = (!seq.sampler_live && samples).then(|| {
        let generated = seq.generated_before + seq.new_tokens;
        let (prompt, output) = if seq.sampling.needs_history() {
            let split = seq.tokens.len().saturating_sub(generated);
            (seq.tokens[..split].to_vec(), seq.tokens[split..].to_vec())
        } else {
            (Vec::new(), Vec::new())
        };
        Box::new(NewSampler { spec: seq.sampling.clone(), skip: generated as u64, prompt, output })
    });
    // Rows start..end predict tokens start+1..=end; those that are prompt tokens (of the
    // prompt as the client sent it, replayed output aside) are scored.
    let prompt_len = seq.tokens.len().saturating_sub(seq.generated_before + seq.new_tokens);
    let score = seq.sampling.prompt_logprobs.and_then(|k| {
        let last = end.min(prompt_len.saturating_sub(1));
        (start < last).then(|| {
            Box::new(Score {
                req: seq.req,
                forks: seq.forks.iter().map(|f| (f.request_id, f.req)).collect(),
                k,
                targets: seq.tokens[start + 1..=last].to_vec(),
            })
        })
    });
    seq.sampler_live |= samples;
    PlannedSeq {
        request_id: seq.request_id,
        tokens: Tokens::from_slice(&seq.tokens[start..end]),
        start_pos: start,
        block_table: shared_table(seq),
        slots,
        sample: end == seq.tokens.len(),
        new_sampler,
        score,
        stage,
        stage_from: if start == seq.reused { 0 } else { start },
        forks: Vec::new(),
    }
}

/// Appends to `out` the cache slot of each of `positions` of a sequence holding `blocks`
/// (of `bs` tokens each): each block's run of positions at once, as a prompt spans many.
fn cache_slots(out: &mut impl Extend<i32>, blocks: &[BlockRef], positions: std::ops::Range<usize>, bs: usize) {
    let (mut pos, end) = (positions.start, positions.end);
    while pos < end {
        let (block, offset) = (pos / bs, pos % bs);
        let first = blocks[block].slot as usize * bs + offset;
        let run = (end - pos).min(bs - offset);
        out.extend((first..first + run).map(|slot| slot as i32));
        pos += run;
    }
}

/// `seq`'s block table, shared with the last plan's when no block was added since. A
/// sequence's blocks only grow at the end or are all released (`release_blocks`, which
/// drops the table), so an equal length means equal blocks.
fn shared_table(seq: &mut Seq) -> Arc<[u32]> {
    if seq.table.len() != seq.blocks.len() {
        seq.table = seq.blocks.iter().map(|b| b.slot).collect();
    }
    debug_assert!(seq.table.iter().zip(&seq.blocks).all(|(t, b)| *t == b.slot), "a stale block table");
    seq.table.clone()
}

/// Seals every block the cached tokens fill.
fn seal_full_blocks(seq: &mut Seq, bs: usize, pool: &mut KvPool) {
    let (from, to) = (seq.hashes.len(), seq.cached / bs);
    if to <= from {
        return;
    }
    let parent = seq.hashes.last().copied().or(seq.salt);
    let tokens = &seq.tokens[from * bs..to * bs];
    for e in pool.seal_run(&seq.blocks[from..to], parent, tokens, &mut seq.hashes) {
        tracing::error!(error = %e, request_id = seq.request_id, "KV block seal failed");
    }
}

#[cfg(test)]
mod tests;
