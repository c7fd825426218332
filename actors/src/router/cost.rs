//! The kv-aware policy's cost of a candidate chip, in predicted seconds (lower wins),
//! so that a fast and a slow chip are compared by what they would do, not by how much
//! work each holds:
//!
//! ```text
//! compute leg (the chip that computes the prompt): when its first token comes
//!   cost = steps × decode_s(running + 1) + (queued + uncached) × prefill_s_per_token
//!        + kv_pressure,   steps = ⌈(queued + uncached) / CHUNK_TOKENS⌉ (at least 1)
//! decode leg (a decode chip taking a hand-off): how long its output takes there
//!   cost = queued × prefill_s_per_token + running × decode_s_per_seq + output
//!        + kv_pressure
//! both (a colocated request: one chip computes the prompt and decodes)
//!   cost = compute leg + output
//!
//! output = new_tokens × (decode_step_s(running + 1) + running × decode_s_per_seq)
//!
//! kv_pressure = need_tokens × prefill_s_per_token × u² / (1 − u)
//!               u = (blocks held + blocks the request needs) / blocks total, at most 0.99
//! ```
//!
//! `queued` is the prompt tokens placed on the chip and not computed yet, `uncached` the
//! request's prompt less the prefix the chip holds, `running` the sequences decoding
//! there. Running sequences do not make a new prompt wait for their end: continuous
//! batching carries them in the same steps, so every step the prompt's chunks ride
//! (`CHUNK_TOKENS` a step, the default batch budget) costs a whole step of that batch —
//! its fixed part (reading the weights, launching) and each running sequence's part — on
//! top of the prompt's own tokens. A cached prefix saves only the tokens, never the step:
//! where a step's fixed part outweighs a prompt, a busy chip holding the prefix loses to
//! an idle one that does not. The output is the request's own decode steps at the batch
//! it joins, and what its place in each of those steps costs the sequences running
//! there: the cost of a placement to every request it touches, so that a chip holding
//! a shared prefix does not collect every sequence that shares it while another idles
//! (a prefix saves prompt tokens once; a batch grown by one slows every step after).
//! The KV term is nothing on an empty pool, a quarter of the
//! request's own prefill time at half full, 3.2 times it at 80%: what recomputing
//! preempted work risks as the pool fills.
//!
//! `prefill_s_per_token` (the marginal cost of a prompt token) and `decode_step_s(b) =
//! decode_step_s + (b − 1) × decode_s_per_seq` come from the chip kind's performance
//! model of the served model (its roofline on the kind's figures, paced like its
//! emulation; the reference model when the served one is not known), times a correction
//! factor: observed over modelled for a chip that has run steps (each step compared with
//! the model's time for a step of its shape), and for one that has not, the geometric
//! mean of the observed chips' factors (the model's error is mostly common to every
//! chip). A chip's own factor is kept within [`MAX_DEVIATION`] times of that mean either
//! way: the model's ratios between kinds are trusted that far, so that a stalled step
//! cannot make a chip look too slow to ever get the work that would show otherwise.

use crate::msg::StepSpeed;
use tessera_topology::perf::{ModelShape, StepShape};
use tessera_topology::{ChipKind, EmulationSpec};

/// Context of the decode steps a modelled pace assumes.
const PACE_CONTEXT: usize = 1024;

/// How far (a factor, either way) one chip's correction may stray from the mean of all.
pub const MAX_DEVIATION: f64 = 3.0;

/// Correction factors are kept within this range of the model.
const FACTOR_RANGE: (f64, f64) = (1e-9, 1e9);

/// A chip's pace: what one prompt token and one decode step take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace {
    pub prefill_s_per_token: f64,
    /// A decode step of one sequence ...
    pub decode_step_s: f64,
    /// ... and what each further sequence of the batch adds to it.
    pub decode_s_per_seq: f64,
}

impl Pace {
    /// The pace assumed for a chip of no known kind: a modest accelerator's.
    pub const UNKNOWN: Pace = Pace { prefill_s_per_token: 1e-4, decode_step_s: 1e-2, decode_s_per_seq: 1e-4 };

    /// The roofline pace of `model` on `kind`, derated and scaled by `emu` (an emulated
    /// chip's pacing; a real chip passes a time scale of 1). A prompt token costs the
    /// slope of prefill steps between a short and a full chunk, so that a step's fixed
    /// part is counted once a step, not once a token.
    pub fn modelled(kind: &ChipKind, emu: &EmulationSpec, model: &ModelShape) -> Pace {
        let step = |shape: StepShape| emu.roofline(kind, model, &shape).time_s;
        let (short, full) = (CHUNK_TOKENS / 8, CHUNK_TOKENS);
        let one = step(StepShape::decode(1, PACE_CONTEXT));
        let nine = step(StepShape::decode(9, PACE_CONTEXT));
        let slope = (step(StepShape::prefill(full)) - step(StepShape::prefill(short))) / (full - short) as f64;
        Pace {
            // A roofline turning from memory to compute bound inside the range can make
            // the slope vanish; a token is never free.
            prefill_s_per_token: slope.max(step(StepShape::prefill(full)) / full as f64 / 16.0),
            decode_step_s: one,
            decode_s_per_seq: ((nine - one) / 8.0).max(0.0),
        }
    }

    /// Tokens a step carries before its compute outweighs its fixed part (the weights'
    /// read, a one-sequence decode step): the roofline's knee. Below it a token more
    /// rides the step almost free; past it each lengthens the step by its own compute.
    pub fn knee_tokens(&self) -> usize {
        let knee = self.decode_step_s / self.prefill_s_per_token;
        if knee.is_finite() && knee > 0.0 { knee.ceil().min(usize::MAX as f64) as usize } else { usize::MAX }
    }

    /// A decode step of `batch` sequences.
    pub fn decode_s(&self, batch: f64) -> f64 {
        self.decode_step_s + (batch - 1.0).max(0.0) * self.decode_s_per_seq
    }

    /// This pace with its prefill scaled by `prefill` and its decode by `decode`.
    pub fn scaled(&self, prefill: f64, decode: f64) -> Pace {
        Pace {
            prefill_s_per_token: self.prefill_s_per_token * prefill,
            decode_step_s: self.decode_step_s * decode,
            decode_s_per_seq: self.decode_s_per_seq * decode,
        }
    }

    /// A step computing `prompt_tokens` prompt tokens beside `seqs` decoding sequences,
    /// at this pace.
    pub fn step_s(&self, prompt_tokens: f64, seqs: f64) -> f64 {
        self.decode_s(seqs.max(1.0)) + prompt_tokens * self.prefill_s_per_token
    }

    /// Correction factors (prefill, decode) that turn this modelled pace into what
    /// `observed` measured — each phase's average step over the model's time for a
    /// step of that average shape; `None` for a phase not observed yet.
    pub fn factors(&self, observed: &StepSpeed) -> (Option<f64>, Option<f64>) {
        let ratio = |seen: f64, model: f64| {
            (seen > 0.0 && model > 0.0 && (seen / model).is_finite())
                .then(|| (seen / model).clamp(FACTOR_RANGE.0, FACTOR_RANGE.1))
        };
        // A step with prompt tokens: those and (as the model's step) one sequence.
        (
            ratio(observed.prefill_step_s, self.step_s(observed.prefill_step_tokens, 1.0)),
            ratio(observed.decode_step_s, self.decode_s(observed.decode_batch.max(1.0))),
        )
    }
}

/// A pace rounded down to a class: its prefill time per token and its one-sequence
/// decode step, each in steps of 2^(1/8) (9%). Each of a class's figures is at most that
/// of any pace in it, so a search that walks chips class by class can end a class's walk
/// once the work ahead alone, plus the class's own figures, costs more than its best.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PaceClass {
    prefill: i32,
    decode: i32,
}

/// Classes per doubling of a pace.
const CLASSES_PER_DOUBLING: f64 = 8.0;

impl PaceClass {
    pub const FASTEST: PaceClass = PaceClass { prefill: i32::MIN, decode: i32::MIN };
    pub const SLOWEST: PaceClass = PaceClass { prefill: i32::MAX, decode: i32::MAX };

    pub fn of(pace: &Pace) -> PaceClass {
        PaceClass { prefill: class_step(pace.prefill_s_per_token), decode: class_step(pace.decode_step_s) }
    }

    /// A pace no slower than any of the class, in both figures (and none per sequence).
    pub fn floor(self) -> Pace {
        Pace {
            prefill_s_per_token: class_floor(self.prefill),
            decode_step_s: class_floor(self.decode),
            decode_s_per_seq: 0.0,
        }
    }
}

/// The class step of a time: its log2 rounded down to eighths. Zero, negative or
/// non-finite times take the lowest step, which bounds nothing.
fn class_step(seconds: f64) -> i32 {
    if seconds > 0.0 && seconds.is_finite() { (seconds.log2() * CLASSES_PER_DOUBLING).floor() as i32 } else { i32::MIN }
}

/// The least time of a class step, a hair lower still, so that rounding in `log2` and
/// `exp2` can never put it above a time of the class.
fn class_floor(step: i32) -> f64 {
    if step == i32::MIN {
        return 0.0;
    }
    (f64::from(step) / CLASSES_PER_DOUBLING).exp2() * (1.0 - 1e-9)
}

/// Prompt tokens a step computes, as the router assumes it (the default batch budget).
pub const CHUNK_TOKENS: usize = 512;

/// The work placed on a chip and not yet done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Prompt tokens the chip is to compute for requests placed there ...
    pub prompt_tokens: usize,
    /// ... and the sequences it decodes (or will).
    pub seqs: usize,
}

impl Work {
    /// Seconds before anything new placed there can start, at the least: the queued
    /// prompts, and one step's worth of the running sequences. Every cost is at least
    /// this (the search's order relies on it).
    pub fn seconds(&self, pace: &Pace) -> f64 {
        self.prompt_tokens as f64 * pace.prefill_s_per_token + self.seqs as f64 * pace.decode_s_per_seq
    }

    pub fn add(&mut self, other: Work) {
        self.prompt_tokens += other.prompt_tokens;
        self.seqs += other.seqs;
    }

    pub fn remove(&mut self, other: Work) {
        self.prompt_tokens = self.prompt_tokens.saturating_sub(other.prompt_tokens);
        self.seqs = self.seqs.saturating_sub(other.seqs);
    }
}

/// The KV-pressure term: `need_tokens` of KV (`need_blocks` blocks) on a pool holding
/// `used` of `total` blocks (see the module doc). A pool of no known size costs nothing.
pub fn kv_pressure_s(pace: &Pace, need_tokens: usize, need_blocks: usize, used: usize, total: usize) -> f64 {
    if total == 0 {
        return 0.0;
    }
    let u = ((used + need_blocks) as f64 / total as f64).min(0.99);
    need_tokens as f64 * pace.prefill_s_per_token * u * u / (1.0 - u)
}

/// What the kv-aware cost needs of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub prompt_tokens: usize,
    /// Prompt and output tokens: the KV it may come to hold.
    pub total_tokens: usize,
    pub block_size: usize,
}

/// The cost of a chip of `pace`, with `work` ahead and `used` of `total` KV blocks held,
/// for `ask`'s compute leg with `cached` of its prompt tokens already there.
pub fn compute_cost(pace: &Pace, work: &Work, used: usize, total: usize, ask: &Ask, cached: usize) -> f64 {
    let prompt = work.prompt_tokens + ask.prompt_tokens.saturating_sub(cached);
    let steps = prompt.div_ceil(CHUNK_TOKENS).max(1);
    // The prompt's chunk takes a sequence's place in each step it rides.
    steps as f64 * pace.decode_s((work.seqs + 1) as f64)
        + prompt as f64 * pace.prefill_s_per_token
        + kv_pressure(pace, used, total, ask)
}

/// The cost of a decode chip of `pace` for `ask`'s decode leg.
pub fn decode_cost(pace: &Pace, work: &Work, used: usize, total: usize, ask: &Ask) -> f64 {
    work.seconds(pace) + output_s(pace, work, ask) + kv_pressure(pace, used, total, ask)
}

/// The cost of a chip that both computes `ask`'s prompt and decodes its output: the
/// compute leg, then the output.
pub fn colocated_cost(pace: &Pace, work: &Work, used: usize, total: usize, ask: &Ask, cached: usize) -> f64 {
    compute_cost(pace, work, used, total, ask, cached) + output_s(pace, work, ask)
}

/// What decoding `ask`'s output on a chip with `work` costs: its own steps at the
/// batch it joins, and the part of a step that each running sequence loses to it on
/// each of them (the decode's cost to everyone, not to it alone — which keeps a chip
/// holding a prefix from collecting every sequence that shares it).
pub fn output_s(pace: &Pace, work: &Work, ask: &Ask) -> f64 {
    let new_tokens = ask.total_tokens.saturating_sub(ask.prompt_tokens) as f64;
    let running = work.seqs as f64;
    new_tokens * (pace.decode_s(running + 1.0) + running * pace.decode_s_per_seq)
}

fn kv_pressure(pace: &Pace, used: usize, total: usize, ask: &Ask) -> f64 {
    kv_pressure_s(pace, ask.total_tokens, ask.total_tokens.div_ceil(ask.block_size.max(1)), used, total)
}

/// Seconds as the comparable integer the placement search ranks by (whole nanoseconds,
/// saturating; not-a-number ranks last).
pub fn rank(seconds: f64) -> i64 {
    // `as` saturates: no clamp needed.
    if seconds.is_nan() { i64::MAX } else { (seconds * 1e9) as i64 }
}

/// The geometric mean of correction factors, kept as a running sum of logarithms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MeanFactor {
    log_sum: f64,
    n: usize,
}

impl MeanFactor {
    pub fn add(&mut self, factor: f64) {
        self.log_sum += factor.ln();
        self.n += 1;
    }

    pub fn remove(&mut self, factor: f64) {
        self.log_sum -= factor.ln();
        self.n = self.n.saturating_sub(1);
        if self.n == 0 {
            self.log_sum = 0.0;
        }
    }

    /// The mean; 1 (the model as it is) when nothing was observed.
    pub fn get(&self) -> f64 {
        if self.n == 0 { 1.0 } else { (self.log_sum / self.n as f64).exp() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A class's figures bound every pace in it from below, and closely (one class
        /// step, 2^(1/8)); a pace that is no time bounds nothing.
        #[test]
        fn a_pace_class_bounds_its_paces_from_below(prefill in 1e-12..1e3f64, decode in 1e-12..1e3f64) {
            let pace = Pace { prefill_s_per_token: prefill, decode_step_s: decode, decode_s_per_seq: 0.0 };
            let floor = PaceClass::of(&pace).floor();
            for (floor, of) in [(floor.prefill_s_per_token, prefill), (floor.decode_step_s, decode)] {
                prop_assert!(floor <= of, "{floor} above {of}");
                prop_assert!(floor * 2f64.powf(1.0 / 8.0) * 1.000_001 > of, "{floor} too far below {of}");
            }
        }
    }

    #[test]
    fn a_pace_of_no_time_bounds_nothing() {
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let floor =
                PaceClass::of(&Pace { prefill_s_per_token: t, decode_step_s: t, decode_s_per_seq: 0.0 }).floor();
            assert_eq!((floor.prefill_s_per_token, floor.decode_step_s), (0.0, 0.0));
        }
    }
}
