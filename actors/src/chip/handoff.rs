//! The chip's side of prefill/decode disaggregation.
//!
//! Prefill chip P: a `Prefill` request computes every position of the prompt, samples
//! the first new token and sends it to the request at once, so a first token never
//! waits for the hand-off nor for D's step in flight (as vLLM's and Dynamo's prefill
//! workers do). It offers the positions to decode chip D at once (`KvOffer`, under a
//! lease). After every layer of every step, P's worker stages that layer's blocks into
//! a registered memory region; it tells P in groups of layers (`KvStaged`, one per
//! group of `executor::stage_groups`). Once D has claimed the offer, P tells D what is
//! staged (`KvReady`), and the first token once sampled (`KvFirstToken`). When the
//! prefill is done its blocks stay held until D acknowledges (`KvDone`), the lease runs
//! out, or the request goes away. A request that forks siblings where its first token
//! is sampled (`n` > 1) is the exception: P computes all but the last position, and D
//! runs that one, samples and forks.
//!
//! Decode chip D: an offer is checked (same model and shapes, sane format), its blocks
//! reserved (or it waits for free blocks; P's lease bounds the wait) and claimed. Each
//! `KvReady` becomes an install job on D's worker: read the bytes from P's region (shm
//! or tcp), convert them to D's block size, layout and dtype, write them into D's
//! cache. When every layer is in and P's first token has come, the sequence decodes
//! from that token here (or, for a forking request, runs its last prompt token and
//! samples).
//!
//! Invariant: every block held for a hand-off is freed exactly once — on `KvDone`,
//! `KvCancel`, `Abort`, lease expiry or a crash — on both chips.

use super::Chip;
use super::executor::{KvInstall, StepExecutor};
use crate::batcher::Prefilled;
use crate::kv::BlockRef;
use crate::msg::{ChipState, ErrorKind, KvFormatDesc, KvOffer, Msg, Retry, SeqRequest, ServeError, StepOutcome};
use crate::msg::{KvCapability, KvRegionDesc};
use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use tessera_actor_core::Addr;
use tessera_actor_core::{Effects, Job, JobCtx, Moment};

/// KV this chip (as P) computes and holds for a decode chip.
#[derive(Debug)]
struct Outgoing {
    req: Addr,
    decode: Addr,
    claimed: bool,
    /// Per layer: positions staged so far, and told to D so far.
    staged: Vec<usize>,
    told: Vec<usize>,
    /// Set once the prefill ran to its end (the blocks left the batcher), with their
    /// table as D is told it.
    blocks: Option<Vec<BlockRef>>,
    table: Option<Arc<[u32]>>,
    /// This hand-off's lease: its number (a timer of an earlier hand-off of the same
    /// request names another), when it runs out, and whether a timer is set for it.
    lease: u64,
    lease_until: Moment,
    lease_timer: bool,
    /// What lets D read the staged blocks (from the worker, on a secured cluster).
    capability: Option<KvCapability>,
    /// The first token, once sampled here (when this chip samples it), until D is
    /// told it.
    first_token: Option<u32>,
}

/// KV this chip (as D) receives.
#[derive(Debug)]
struct Incoming {
    prefill: Addr,
    /// Shared with every layer's install job.
    region: Arc<KvRegionDesc>,
    format: Arc<KvFormatDesc>,
    kv_tokens: usize,
    /// This chip's cache slot of each position 0..kv_tokens.
    slots: Arc<[i32]>,
    /// Per layer: positions asked of the worker, and installed.
    requested: Vec<usize>,
    installed: Vec<usize>,
    /// When (on this chip's clock) P said its last layer was staged.
    last_ready_at: Option<Moment>,
    /// P samples the first token (the offer holds every position), and it has come.
    awaits_first: bool,
    first_token: Option<u32>,
}

#[derive(Debug, Default)]
pub(super) struct Handoffs {
    outgoing: BTreeMap<u64, Outgoing>,
    incoming: BTreeMap<u64, Incoming>,
    /// Offers waiting for free blocks, in arrival order.
    waiting: VecDeque<KvOffer>,
    leases: u64,
    /// Request id -> when this chip heard P's last layer was staged: for the hand-off
    /// gap metric, measured on this chip's clock alone.
    first_step: BTreeMap<u64, Moment>,
    /// Fault drill: ignore the next offer.
    pub drop_next_claim: bool,
    pub last_gap_s: Option<f64>,
}

impl Handoffs {
    pub fn len(&self) -> usize {
        self.outgoing.len() + self.incoming.len() + self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This chip prefills `request_id` for a decode chip.
    pub fn is_prefilling(&self, request_id: u64) -> bool {
        self.outgoing.contains_key(&request_id)
    }
}

impl Chip {
    fn refuse(&self, seq: &SeqRequest, error: ServeError, retry: Retry, fx: &mut dyn Effects<Msg>) {
        let msg = Msg::Refused { request_id: seq.request_id, chip: fx.me(), error, retry };
        let _ = fx.send(seq.req, msg);
    }

    /// The lease runs `kv_lease` from now. One timer per hand-off, not one per renewal
    /// (a renewal comes with every layer told): when it fires early it is set again for
    /// the rest.
    fn renew_lease(&mut self, request_id: u64, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { return };
        h.lease_until = fx.now().after(self.config.kv_lease);
        if !h.lease_timer {
            h.lease_timer = true;
            fx.timer(self.config.kv_lease, Msg::KvLeaseExpired { request_id, lease: h.lease });
        }
    }

    // ---- Prefill chip ----

    pub(super) fn prefill(&mut self, seq: SeqRequest, decode: Addr, fx: &mut dyn Effects<Msg>) {
        let (Some(info), Some(batcher), ChipState::Up, None) =
            (&self.info, &self.batcher, self.state, &self.draining_to)
        else {
            self.refuse(&seq, self.unavailable(), Retry::Unavailable, fx);
            return;
        };
        if batcher.contains(seq.request_id) || self.handoffs.outgoing.contains_key(&seq.request_id) {
            return; // a duplicate
        }
        // A request forking its siblings samples where they fork from its sequence: on D.
        let samples_here = seq.forks.is_empty();
        let kv_tokens = if samples_here { seq.tokens.len() } else { seq.tokens.len().saturating_sub(1) };
        if let Some(error) = self.check_fits(&seq, info, batcher.blocks_for(kv_tokens)) {
            self.refuse(&seq, error, Retry::No, fx);
            return;
        }
        let Some(region) = info.staging.clone() else {
            let why = format!("chip {} has no KV staging region (no transfer engine)", self.config.id);
            self.refuse(&seq, ServeError::new(ErrorKind::Unavailable, why), Retry::Elsewhere, fx);
            return;
        };
        if seq.tokens.len() < 2 {
            let why = "a one-token prompt has nothing to prefill".to_string();
            self.refuse(&seq, ServeError::new(ErrorKind::Unavailable, why), Retry::Elsewhere, fx);
            return;
        }
        let layers = info.format.num_layers;
        let offer = KvOffer {
            seq: seq.clone(),
            prefill: fx.me(),
            prefill_id: self.config.id.clone(),
            kv_tokens,
            format: info.format.clone(),
            compat: info.compat.clone(),
            region,
        };
        let out = Outgoing {
            req: seq.req,
            decode,
            claimed: false,
            staged: vec![0; layers],
            told: vec![0; layers],
            blocks: None,
            table: None,
            lease: self.handoffs.leases,
            lease_until: fx.now(),
            lease_timer: false,
            capability: None,
            first_token: None,
        };
        self.handoffs.leases += 1;
        let request_id = seq.request_id;
        self.handoffs.outgoing.insert(request_id, out);
        if let Some(b) = self.batcher.as_mut() {
            b.enqueue_prefill(seq.clone(), kv_tokens);
        }
        self.renew_lease(request_id, fx);
        if fx.send(decode, Msg::KvOffer { offer: Box::new(offer) }).is_err() {
            let why = format!("chip {}: decode chip {decode} is unreachable", self.config.id);
            self.drop_outgoing(request_id, fx);
            // The decode chip is at fault: the request should avoid it, not this chip.
            let error = ServeError::new(ErrorKind::Unavailable, why);
            let _ = fx.send(seq.req, Msg::Refused { request_id, chip: decode, error, retry: Retry::Elsewhere });
        }
        self.settle(fx);
    }

    pub(super) fn claimed(&mut self, request_id: u64, decode: Addr, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else {
            // Freed already (lease, abort): let D free its side too.
            let reason = format!("chip {} no longer holds this request's KV", self.config.id);
            let _ = fx.send(decode, Msg::KvCancel { request_id, reason });
            return;
        };
        if h.decode != decode {
            return;
        }
        h.claimed = true;
        self.renew_lease(request_id, fx);
        let layers = self.handoffs.outgoing.get(&request_id).map_or(0, |h| h.staged.len());
        self.tell(request_id, 0..layers, fx);
        self.tell_first_token(request_id, fx);
    }

    /// This chip sampled a hand-off's first token (and sent it to the request). Ended
    /// there (a stop token, or its only token), its hand-off is off; otherwise D is told
    /// once it has claimed.
    pub(super) fn first_token_sampled(
        &mut self,
        request_id: u64,
        token: u32,
        finished: bool,
        fx: &mut dyn Effects<Msg>,
    ) {
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { return };
        if finished {
            let decode = h.decode;
            metrics::counter!("tessera_kv_handoffs_total", "chip" => self.config.id.clone(), "outcome" => "ended_at_first_token")
                .increment(1);
            self.drop_outgoing(request_id, fx);
            let reason = format!("the request ended at its first token, sampled on chip {}", self.config.id);
            let _ = fx.send(decode, Msg::KvCancel { request_id, reason });
            return;
        }
        h.first_token = Some(token);
        self.tell_first_token(request_id, fx);
    }

    fn tell_first_token(&mut self, request_id: u64, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { return };
        if !h.claimed {
            return;
        }
        let Some(token) = h.first_token.take() else { return };
        let decode = h.decode;
        if fx.send(decode, Msg::KvFirstToken { request_id, token }).is_err() {
            self.lost_decode(request_id, format!("decode chip {decode} is unreachable"), fx);
        }
    }

    pub(super) fn declined(
        &mut self,
        request_id: u64,
        decode: Addr,
        error: ServeError,
        retry: Retry,
        fx: &mut dyn Effects<Msg>,
    ) {
        let Some(h) = self.handoffs.outgoing.get(&request_id) else { return };
        if h.decode != decode {
            return;
        }
        let req = h.req;
        tracing::warn!(chip = %self.config.id, request_id, error = %error.message, "decode chip declined the KV");
        self.drop_outgoing(request_id, fx);
        // D declined: the request should avoid D, not this chip.
        let _ = fx.send(req, Msg::Refused { request_id, chip: decode, error, retry });
        self.settle(fx);
    }

    /// The worker staged `layers` of these sequences up to the given positions.
    pub(super) fn staged(
        &mut self,
        layers: Range<usize>,
        staged: Vec<(u64, usize)>,
        capabilities: Vec<(u64, KvCapability)>,
        fx: &mut dyn Effects<Msg>,
    ) {
        for (request_id, capability) in capabilities {
            if let Some(h) = self.handoffs.outgoing.get_mut(&request_id) {
                h.capability = Some(capability);
            }
        }
        for (request_id, upto) in staged {
            let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { continue };
            for w in h.staged.get_mut(layers.clone()).unwrap_or_default() {
                *w = (*w).max(upto);
            }
            self.tell(request_id, layers.clone(), fx);
        }
    }

    /// Tells D what is newly staged of `layers`, if D has claimed: one `KvReady` per run
    /// of layers staged up to the same position.
    fn tell(&mut self, request_id: u64, layers: Range<usize>, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.get(&request_id) else { return };
        if !h.claimed {
            return;
        }
        let end = layers.end.min(h.staged.len());
        let mut news = Vec::new();
        let mut start = layers.start;
        while start < end {
            let upto = h.staged[start];
            let run = start..(start + 1..end).find(|&l| h.staged[l] != upto).unwrap_or(end);
            if h.told[run.clone()].iter().any(|&told| told < upto) {
                news.push((run.clone(), upto));
            }
            start = run.end;
        }
        if news.is_empty() {
            return;
        }
        // The finished prefill's table, or the running sequence's.
        let blocks = match h.table.clone() {
            Some(done) => done,
            None => self.batcher.as_mut().and_then(|b| b.block_table(request_id)).unwrap_or_else(|| Arc::from([])),
        };
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { return };
        let (decode, capability) = (h.decode, h.capability);
        for (layers, upto) in news {
            h.told[layers.clone()].fill(upto);
            let ready = Msg::KvReady { request_id, layers, upto, blocks: blocks.clone(), capability };
            if fx.send(decode, ready).is_err() {
                self.lost_decode(request_id, format!("decode chip {decode} is unreachable"), fx);
                return;
            }
        }
        self.renew_lease(request_id, fx);
    }

    /// The prefill ran to its end; its blocks wait for D.
    pub(super) fn prefill_finished(&mut self, p: Prefilled, fx: &mut dyn Effects<Msg>) {
        match self.handoffs.outgoing.get_mut(&p.request_id) {
            Some(h) => {
                h.table = Some(p.blocks.iter().map(|b| b.slot).collect());
                h.blocks = Some(p.blocks);
                self.renew_lease(p.request_id, fx);
            }
            None => self.release_blocks(p.blocks),
        }
    }

    pub(super) fn kv_done(&mut self, request_id: u64, fx: &mut dyn Effects<Msg>) {
        if self.handoffs.outgoing.contains_key(&request_id) {
            metrics::counter!("tessera_kv_handoffs_total", "chip" => self.config.id.clone(), "outcome" => "done")
                .increment(1);
            self.drop_outgoing(request_id, fx);
            self.settle(fx);
        }
    }

    pub(super) fn lease_expired(&mut self, request_id: u64, lease: u64, fx: &mut dyn Effects<Msg>) {
        let now = fx.now();
        let Some(h) = self.handoffs.outgoing.get_mut(&request_id) else { return };
        if h.lease != lease {
            return; // an earlier hand-off's
        }
        if now < h.lease_until {
            fx.timer(h.lease_until.since(now), Msg::KvLeaseExpired { request_id, lease });
            return; // renewed since
        }
        let what = if h.claimed { "read" } else { "claim" };
        let why = format!(
            "decode chip {} did not {what} the KV within the {} ms lease; chip {} freed it",
            h.decode,
            self.config.kv_lease.as_millis(),
            self.config.id
        );
        tracing::warn!(chip = %self.config.id, request_id, "{why}");
        metrics::counter!("tessera_kv_handoffs_total", "chip" => self.config.id.clone(), "outcome" => "lease_expired")
            .increment(1);
        self.lost_decode(request_id, why, fx);
    }

    /// D failed this hand-off: free the KV, tell D (in case it is alive) and the
    /// request (which re-routes).
    fn lost_decode(&mut self, request_id: u64, why: String, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.get(&request_id) else { return };
        let (req, decode) = (h.req, h.decode);
        self.drop_outgoing(request_id, fx);
        let _ = fx.send(decode, Msg::KvCancel { request_id, reason: why.clone() });
        let error = ServeError::new(ErrorKind::Unavailable, why);
        // D failed it: the request should avoid D, not this chip.
        let _ = fx.send(req, Msg::Refused { request_id, chip: decode, error, retry: Retry::Elsewhere });
        self.settle(fx);
    }

    /// Preemption took these prefills' blocks: their hand-offs are off.
    pub(super) fn prefills_dropped(&mut self, dropped: Vec<(u64, Addr)>, fx: &mut dyn Effects<Msg>) {
        for (request_id, req) in dropped {
            let reason = format!("chip {} needed the KV blocks of this prefill for running sequences", self.config.id);
            if let Some(h) = self.handoffs.outgoing.remove(&request_id) {
                let _ = fx.send(h.decode, Msg::KvCancel { request_id, reason: reason.clone() });
            }
            let error = ServeError::new(ErrorKind::Unavailable, reason);
            let _ = fx.send(req, Msg::Refused { request_id, chip: fx.me(), error, retry: Retry::Elsewhere });
        }
    }

    /// The other chip of a hand-off cancelled it. Only the hand-off is dropped: the same
    /// request may already run here again in a new placement (its id does not change),
    /// and that must go on. Its request is told, naming the other chip (a request that
    /// has moved on ignores it).
    pub(super) fn cancelled(&mut self, request_id: u64, reason: &str, fx: &mut dyn Effects<Msg>) {
        if let Some(h) = self.handoffs.outgoing.get(&request_id) {
            let (req, decode) = (h.req, h.decode);
            self.drop_outgoing(request_id, fx);
            let error = ServeError::new(ErrorKind::Unavailable, format!("decode chip {decode} cancelled: {reason}"));
            let _ = fx.send(req, Msg::Refused { request_id, chip: decode, error, retry: Retry::Elsewhere });
        }
        if let Some(h) = self.handoffs.incoming.remove(&request_id) {
            self.handoffs.first_step.remove(&request_id);
            let req = match (self.pool.as_mut(), self.batcher.as_mut()) {
                (Some(pool), Some(batcher)) => batcher.abort(request_id, pool),
                _ => None,
            };
            if let Some(req) = req {
                let why = format!("prefill chip {} cancelled: {reason}", h.prefill);
                let error = ServeError::new(ErrorKind::Unavailable, why);
                let _ = fx.send(req, Msg::Refused { request_id, chip: h.prefill, error, retry: Retry::Elsewhere });
            }
        }
        self.handoffs.waiting.retain(|o| o.seq.request_id != request_id);
    }

    fn drop_outgoing(&mut self, request_id: u64, _fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.outgoing.remove(&request_id) else { return };
        match h.blocks {
            Some(blocks) => self.release_blocks(blocks),
            None => {
                if let (Some(pool), Some(batcher)) = (self.pool.as_mut(), self.batcher.as_mut()) {
                    batcher.abort(request_id, pool);
                }
            }
        }
    }

    fn release_blocks(&mut self, blocks: Vec<BlockRef>) {
        let Some(pool) = self.pool.as_mut() else { return };
        for b in blocks {
            if let Err(e) = pool.release(b) {
                tracing::error!(error = %e, "KV block release failed");
            }
        }
    }

    // ---- Decode chip ----

    /// Why this chip cannot take `offer`, and whether another decode chip might.
    fn offer_problem(&self, offer: &KvOffer) -> Option<(ServeError, Retry)> {
        let (Some(info), Some(batcher), ChipState::Up, None) =
            (&self.info, &self.batcher, self.state, &self.draining_to)
        else {
            return Some((self.unavailable(), Retry::Unavailable));
        };
        if let Some(why) = info.compat.mismatch(&self.config.id, &offer.compat, &offer.prefill_id) {
            return Some((ServeError::new(ErrorKind::Internal, why), Retry::No));
        }
        let (f, mine) = (&offer.format, &info.format);
        let bad = if (f.num_layers, f.num_kv_heads, f.head_dim) != (mine.num_layers, mine.num_kv_heads, mine.head_dim) {
            Some(format!(
                "KV shape {}x{}x{} (layers x kv heads x head dim) on {} vs {}x{}x{} on {}",
                f.num_layers,
                f.num_kv_heads,
                f.head_dim,
                offer.prefill_id,
                mine.num_layers,
                mine.num_kv_heads,
                mine.head_dim,
                self.config.id
            ))
        } else if f.block_size == 0 || f.num_blocks == 0 {
            Some(format!("block size {} and block count {} must be positive", f.block_size, f.num_blocks))
        } else if offer.kv_tokens == 0 || offer.kv_tokens > offer.seq.tokens.len() {
            Some(format!("{} prefilled positions for a {}-token sequence", offer.kv_tokens, offer.seq.tokens.len()))
        } else {
            None
        };
        if let Some(why) = bad {
            let why = format!("chip {} refuses the KV offer of chip {}: {why}", self.config.id, offer.prefill_id);
            return Some((ServeError::new(ErrorKind::Internal, why), Retry::No));
        }
        self.check(&offer.seq, info, batcher).map(|e| (e, Retry::No))
    }

    pub(super) fn offered(&mut self, offer: KvOffer, fx: &mut dyn Effects<Msg>) {
        let request_id = offer.seq.request_id;
        if std::mem::take(&mut self.handoffs.drop_next_claim) {
            tracing::warn!(chip = %self.config.id, request_id, "fault drill: ignoring a KV offer");
            return;
        }
        if self.handoffs.incoming.contains_key(&request_id)
            || self.handoffs.waiting.iter().any(|o| o.seq.request_id == request_id)
        {
            return; // a duplicate
        }
        if let Some((error, retry)) = self.offer_problem(&offer) {
            tracing::warn!(chip = %self.config.id, request_id, error = %error.message, "KV offer declined");
            let _ = fx.send(offer.prefill, Msg::KvDecline { request_id, decode: fx.me(), error, retry });
            return;
        }
        self.handoffs.waiting.push_back(offer);
        self.settle(fx);
    }

    /// Claims waiting offers, in order, while their blocks fit — making room for one by
    /// preemption where its tenant's class or share entitles it (`Batcher::make_room`).
    pub(super) fn admit_offers(&mut self, fx: &mut dyn Effects<Msg>) {
        loop {
            let (Some(pool), Some(batcher)) = (self.pool.as_mut(), self.batcher.as_mut()) else { return };
            let waiting = &self.handoffs.waiting;
            let Some(next) = (0..waiting.len()).min_by(|&a, &b| {
                let (ra, rb) = (batcher.rank(waiting[a].seq.share), batcher.rank(waiting[b].seq.share));
                ra.0.cmp(&rb.0).then(ra.1.total_cmp(&rb.1)).then(a.cmp(&b))
            }) else {
                return;
            };
            let offer = &waiting[next];
            // The request moved on (re-routed) while an older sequence of it is still
            // here: the older one is stale, and two of one request would leak.
            if batcher.contains(offer.seq.request_id) {
                batcher.abort(offer.seq.request_id, pool);
            }
            let mut admitted = batcher.admit_received(offer.seq.clone(), offer.kv_tokens, pool);
            if admitted.is_none()
                && batcher.make_room(offer.seq.share, offer.kv_tokens.div_ceil(pool.block_size()), pool)
            {
                admitted = batcher.admit_received(offer.seq.clone(), offer.kv_tokens, pool);
            }
            let Some(slots) = admitted else { return };
            let Some(offer) = self.handoffs.waiting.remove(next) else { return };
            let request_id = offer.seq.request_id;
            let layers = offer.format.num_layers;
            self.handoffs.incoming.insert(
                request_id,
                Incoming {
                    prefill: offer.prefill,
                    region: Arc::new(offer.region),
                    format: Arc::new(offer.format),
                    kv_tokens: offer.kv_tokens,
                    slots: slots.into(),
                    requested: vec![0; layers],
                    installed: vec![0; layers],
                    last_ready_at: None,
                    awaits_first: offer.kv_tokens == offer.seq.tokens.len(),
                    first_token: None,
                },
            );
            if fx.send(offer.prefill, Msg::KvClaim { request_id, decode: fx.me() }).is_err() {
                self.lost_prefill(request_id, format!("prefill chip {} is unreachable", offer.prefill), fx);
            }
        }
    }

    pub(super) fn kv_ready(
        &mut self,
        request_id: u64,
        layers: Range<usize>,
        upto: usize,
        blocks: Arc<[u32]>,
        capability: Option<KvCapability>,
        fx: &mut dyn Effects<Msg>,
    ) {
        let Some(h) = self.handoffs.incoming.get_mut(&request_id) else { return };
        let bs = h.format.block_size;
        // The earliest position any of these layers still needs: a layer that has it
        // already is written again with the same KV.
        let from = h.requested.get(layers.clone()).and_then(|asked| asked.iter().min().copied());
        let (Some(from), true) = (from, upto <= h.kv_tokens) else {
            let why = format!(
                "malformed KvReady from {}: layers {layers:?} of {}, positions ..{upto} of {}",
                h.prefill,
                h.requested.len(),
                h.kv_tokens
            );
            self.lost_prefill(request_id, why, fx);
            return;
        };
        if upto <= from {
            return; // nothing new
        }
        let (first, last) = (from / bs, upto.div_ceil(bs));
        if blocks.len() < last || blocks.iter().any(|&b| b as usize >= h.format.num_blocks) {
            let why = format!(
                "malformed KvReady from {}: {} blocks (of a pool of {}) cannot hold positions ..{upto} in blocks of {bs}",
                h.prefill,
                blocks.len(),
                h.format.num_blocks
            );
            self.lost_prefill(request_id, why, fx);
            return;
        }
        for asked in &mut h.requested[layers.clone()] {
            *asked = (*asked).max(upto);
        }
        if h.last_ready_at.is_none() && h.requested.iter().all(|&asked| asked == h.kv_tokens) {
            h.last_ready_at = Some(fx.now());
        }
        let job = KvInstall {
            layers: layers.clone(),
            positions: from..upto,
            region: h.region.clone(),
            format: h.format.clone(),
            src_table: blocks,
            src_range: first..last,
            first_pos: first * bs,
            slots: h.slots.clone(),
            capability,
        };
        let Some(worker) = self.worker else { return };
        let run = Job {
            label: "kv_install",
            run: Box::new(move |state: &mut dyn std::any::Any, ctx: &mut dyn JobCtx<Msg>| {
                let error = match state.downcast_mut::<Box<dyn StepExecutor>>() {
                    Some(exec) => exec.install(&job, ctx).err(),
                    None => Some("the worker holds no step executor".into()),
                };
                Msg::KvInstalled { request_id, layers, upto, error }
            }),
        };
        if let Err(e) = fx.submit(worker, run) {
            self.crash(format!("the worker is gone: {e}"), fx);
        }
    }

    pub(super) fn installed(
        &mut self,
        request_id: u64,
        layers: Range<usize>,
        upto: usize,
        error: Option<String>,
        fx: &mut dyn Effects<Msg>,
    ) {
        let Some(h) = self.handoffs.incoming.get_mut(&request_id) else { return };
        if let Some(error) = error {
            let why = format!("chip {}: installing KV from {} failed: {error}", self.config.id, h.prefill);
            self.lost_prefill(request_id, why, fx);
            return;
        }
        for w in h.installed.get_mut(layers).unwrap_or_default() {
            *w = (*w).max(upto);
        }
        self.try_receive(request_id, fx);
    }

    /// P's first token for a hand-off.
    pub(super) fn first_token_came(&mut self, request_id: u64, token: u32, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.incoming.get_mut(&request_id) else { return };
        if !h.awaits_first {
            let why = format!("P {} sent a first token for a sequence whose last position runs here", h.prefill);
            self.lost_prefill(request_id, why, fx);
            return;
        }
        h.first_token = Some(token);
        self.try_receive(request_id, fx);
    }

    /// The hand-off is complete once every layer is installed and P's first token (when
    /// P samples it) has come: the sequence runs here, and P frees its side.
    fn try_receive(&mut self, request_id: u64, fx: &mut dyn Effects<Msg>) {
        let Some(h) = self.handoffs.incoming.get(&request_id) else { return };
        if h.installed.iter().any(|&w| w < h.kv_tokens) || (h.awaits_first && h.first_token.is_none()) {
            return;
        }
        let (prefill, ready, first) = (h.prefill, h.last_ready_at, h.first_token);
        self.handoffs.incoming.remove(&request_id);
        if let Some(ready) = ready {
            self.handoffs.first_step.insert(request_id, ready);
        }
        if let (Some(b), Some(pool)) = (self.batcher.as_mut(), self.pool.as_mut()) {
            b.mark_received(request_id, first, pool);
        }
        let _ = fx.send(prefill, Msg::KvDone { request_id });
        self.settle(fx);
    }

    /// The hand-off from P failed: free this chip's side, tell P, and send the request
    /// elsewhere.
    fn lost_prefill(&mut self, request_id: u64, why: String, fx: &mut dyn Effects<Msg>) {
        tracing::warn!(chip = %self.config.id, request_id, "{why}");
        let Some(h) = self.handoffs.incoming.remove(&request_id) else { return };
        let _ = fx.send(h.prefill, Msg::KvCancel { request_id, reason: why.clone() });
        let req = match (self.pool.as_mut(), self.batcher.as_mut()) {
            (Some(pool), Some(batcher)) => batcher.abort(request_id, pool),
            _ => None,
        };
        if let Some(req) = req {
            // P failed it: the request should avoid P, not this chip.
            let error = ServeError::new(ErrorKind::Unavailable, why);
            let _ = fx.send(req, Msg::Refused { request_id, chip: h.prefill, error, retry: Retry::Elsewhere });
        }
        self.settle(fx);
    }

    /// Records how long after P's word that its last layer was staged this chip's first
    /// step for a hand-off started — both on this chip's clock (the step started its
    /// model time before `now`, when its outcome arrived).
    pub(super) fn first_steps_after_handoff(&mut self, outcome: &StepOutcome, now: Moment) {
        if self.handoffs.first_step.is_empty() {
            return;
        }
        let done: Vec<u64> =
            outcome.sampled.iter().map(|(id, _)| *id).filter(|id| self.handoffs.first_step.contains_key(id)).collect();
        for id in done {
            if let Some(ready) = self.handoffs.first_step.remove(&id) {
                let started = Moment(now.0.saturating_sub((outcome.elapsed_s.max(0.0) * 1e9) as u64));
                let gap = started.since(ready).as_secs_f64();
                self.handoffs.last_gap_s = Some(gap);
                metrics::histogram!("tessera_kv_handoff_gap_seconds", "chip" => self.config.id.clone()).record(gap);
            }
        }
    }

    // ---- Both ----

    /// Forgets `request_id` wherever it is here, freeing its blocks and telling the
    /// other chip of a hand-off.
    pub(super) fn forget(&mut self, request_id: u64, why: &str, fx: &mut dyn Effects<Msg>) {
        if let Some(h) = self.handoffs.outgoing.get(&request_id) {
            let decode = h.decode;
            self.drop_outgoing(request_id, fx);
            let _ = fx.send(decode, Msg::KvCancel { request_id, reason: why.to_string() });
        }
        if let Some(h) = self.handoffs.incoming.remove(&request_id) {
            let _ = fx.send(h.prefill, Msg::KvCancel { request_id, reason: why.to_string() });
        }
        self.handoffs.waiting.retain(|o| o.seq.request_id != request_id);
        self.handoffs.first_step.remove(&request_id);
        if let (Some(pool), Some(batcher)) = (self.pool.as_mut(), self.batcher.as_mut()) {
            batcher.abort(request_id, pool);
        }
    }

    /// The chip is going down: every hand-off ends; requests and peers are told.
    pub(super) fn handoffs_lost(&mut self, why: &str, fx: &mut dyn Effects<Msg>) {
        let me = fx.me();
        let reason = format!("chip {}: {why}", self.config.id);
        for (request_id, h) in std::mem::take(&mut self.handoffs.outgoing) {
            let _ = fx.send(h.decode, Msg::KvCancel { request_id, reason: reason.clone() });
            // Those still prefilling were handed back with the batcher's sequences.
            if h.blocks.is_some() {
                let error = ServeError::new(ErrorKind::Unavailable, reason.clone());
                let _ = fx.send(h.req, Msg::Refused { request_id, chip: me, error, retry: Retry::Elsewhere });
            }
        }
        for (request_id, h) in std::mem::take(&mut self.handoffs.incoming) {
            let _ = fx.send(h.prefill, Msg::KvCancel { request_id, reason: reason.clone() });
        }
        for offer in self.handoffs.waiting.drain(..) {
            let error = ServeError::new(ErrorKind::Unavailable, reason.clone());
            let request_id = offer.seq.request_id;
            let _ = fx.send(offer.prefill, Msg::KvDecline { request_id, decode: me, error, retry: Retry::Elsewhere });
        }
        self.handoffs.first_step.clear();
    }
}
