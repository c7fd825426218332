//! The roofline perf model: how long one batched step of a dense decoder-only model
//! (Llama family) takes on a chip kind, from the chip's peak FLOPS and memory bandwidth
//! derated by [`EmulationSpec`]'s efficiencies. It paces emulated chips
//! ([`crate::Backend::Emu`]) and lets planners and sims compare chips. Pure arithmetic:
//! no I/O, no clock, no other tessera crate.
//!
//! What a step costs, per sequence of the batch (`new` tokens computed, `ctx` tokens of
//! context after the step):
//! - FLOPs: `2 x linear_params x new` (every projection and MLP matrix of every layer),
//!   plus `2 x vocab x hidden` for the LM head of the one row that is sampled, plus
//!   causal attention `4 x heads x head_dim x layers` per (query, key) pair, with
//!   `new x (ctx - new) + new x (new + 1) / 2` pairs. Norms, RoPE and activations are
//!   left out (well under 1% of a step).
//! - Bytes: the weights once per step (`weight_bytes`, shared by the whole batch), plus
//!   the KV of all `ctx` tokens read by attention, plus the KV of the `new` tokens
//!   written. Activations are left out.
//!
//! Time is `max(FLOPs / (peak x MFU), bytes / (bandwidth x MBU))`: whichever roof the
//! step hits.
//!
//! Invariant: whatever the model, step and figures, the paced (scaled) times of a
//! [`Roofline`] are finite and at most [`MAX_STEP_S`], so that a pacer can always turn
//! them into a `Duration` and add that to an `Instant`. Costs are summed in `f64`, which
//! cannot overflow where `u64` would (a large model times a large batch passes 1.8e19
//! FLOPs).

use crate::{ChipKind, EmulationSpec};

/// The longest a paced step may take, in seconds (one day). [`roofline`] never paces a
/// step longer; topology validation refuses pacings whose [`reference_step`] takes longer,
/// so that a real configuration never comes near it.
pub const MAX_STEP_S: f64 = 86_400.0;

/// The model [`reference_step`] costs: Llama-2-7B in f16 (6,738,415,616 parameters,
/// f16 KV). A topology names its model by path or builtin name, not by shape, so
/// validation bounds an emulated chip's pace on this one instead.
pub const REFERENCE_MODEL: ModelShape = ModelShape {
    num_layers: 32,
    hidden_size: 4096,
    num_heads: 32,
    num_kv_heads: 32,
    head_dim: 128,
    intermediate_size: 11008,
    vocab_size: 32000,
    weight_bytes: 13_476_831_232,
    kv_bytes_per_elem: 2,
};

/// Tokens of context of [`reference_step`].
pub const REFERENCE_CONTEXT: usize = 4096;

/// The shape of a dense decoder-only model, as far as cost is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    pub num_layers: usize,
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (fewer than `num_heads` under grouped-query attention).
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// MLP width (gate, up and down projections).
    pub intermediate_size: usize,
    pub vocab_size: usize,
    /// Bytes of weights a step reads: every weight of the model in its dtype.
    pub weight_bytes: u64,
    /// Bytes of one KV cache element (4 for f32, 2 for f16/bf16).
    pub kv_bytes_per_elem: usize,
}

impl ModelShape {
    /// Parameters of one layer's matrices: q, k, v, o projections and the gated MLP.
    pub fn layer_linear_params(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden_size as u64,
            (self.num_heads * self.head_dim) as u64,
            (self.num_kv_heads * self.head_dim) as u64,
        );
        h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size as u64
    }

    /// Parameters every token multiplies through: all layers' matrices (not the
    /// embedding table, which is only indexed, nor the LM head, which only sampled rows
    /// pass through).
    pub fn linear_params(&self) -> u64 {
        self.num_layers as u64 * self.layer_linear_params()
    }

    pub fn lm_head_params(&self) -> u64 {
        (self.vocab_size * self.hidden_size) as u64
    }

    /// KV cache bytes of one token: K and V, every layer, every KV head.
    pub fn kv_bytes_per_token(&self) -> u64 {
        (2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem) as u64
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqStep {
    /// Tokens computed in this step: 1 for decode, the chunk length for prefill.
    pub new_tokens: usize,
    /// Tokens of context after the step, the new ones included (at least
    /// `new_tokens`; a smaller value is read as `new_tokens`).
    pub context: usize,
}

/// One batched step: the sequences it advances.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepShape {
    pub seqs: Vec<SeqStep>,
}

impl StepShape {
    /// `batch` sequences decoding one token each, each with `context` tokens after the step.
    pub fn decode(batch: usize, context: usize) -> Self {
        StepShape { seqs: vec![SeqStep { new_tokens: 1, context }; batch] }
    }

    /// One sequence prefilling `tokens` prompt tokens from scratch.
    pub fn prefill(tokens: usize) -> Self {
        StepShape { seqs: vec![SeqStep { new_tokens: tokens, context: tokens }] }
    }

    /// Tokens computed in the step, over all sequences.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|seq| seq.new_tokens).sum()
    }
}

impl SeqStep {
    fn context(&self) -> usize {
        self.context.max(self.new_tokens)
    }

    /// Causal (query, key) pairs: each new token attends to everything before it and itself.
    fn attention_pairs(&self) -> f64 {
        let (new, ctx) = (self.new_tokens as f64, self.context() as f64);
        new * (ctx - new) + new * (new + 1.0) / 2.0
    }
}

/// FLOPs of `step` (see the module doc). A step with no sequences costs nothing.
pub fn step_flops(model: &ModelShape, step: &StepShape) -> f64 {
    let per_pair = 4.0 * model.num_heads as f64 * model.head_dim as f64 * model.num_layers as f64;
    let (linear, lm_head) = (model.linear_params() as f64, model.lm_head_params() as f64);
    step.seqs
        .iter()
        .map(|seq| {
            let head = if seq.new_tokens > 0 { 2.0 * lm_head } else { 0.0 };
            2.0 * linear * seq.new_tokens as f64 + head + per_pair * seq.attention_pairs()
        })
        .sum()
}

/// Bytes of memory traffic of `step` (see the module doc). A step with no sequences
/// costs nothing.
pub fn step_bytes(model: &ModelShape, step: &StepShape) -> f64 {
    if step.seqs.is_empty() {
        return 0.0;
    }
    let kv = model.kv_bytes_per_token() as f64;
    let kv_traffic: f64 = step.seqs.iter().map(|seq| kv * (seq.context() as f64 + seq.new_tokens as f64)).sum();
    model.weight_bytes as f64 + kv_traffic
}

/// Which roof a step hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bound {
    Compute,
    Memory,
}

/// A step's predicted time. The scaled times are finite and at most [`MAX_STEP_S`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// FLOPs / (peak x compute_efficiency), x time_scale.
    pub compute_s: f64,
    /// Bytes / (bandwidth x memory_efficiency), x time_scale.
    pub memory_s: f64,
    /// The larger of the two: how long the emulated step takes.
    pub time_s: f64,
    /// `time_s` without the time scale: the step on the real chip.
    pub unscaled_s: f64,
    /// Compute when `compute_s > memory_s`, memory otherwise.
    pub bound: Bound,
}

/// The predicted time of `step` of `model` on a chip of `kind`, derated by `emu`'s
/// efficiencies and multiplied by its time scale; a scaled time past [`MAX_STEP_S`] is
/// paced as [`MAX_STEP_S`].
pub fn roofline(kind: &ChipKind, model: &ModelShape, step: &StepShape, emu: &EmulationSpec) -> Roofline {
    let compute = step_flops(model, step) / (kind.fp16_tflops * 1e12 * emu.compute_efficiency);
    let memory = step_bytes(model, step) / (kind.memory_bw_gbs * 1e9 * emu.memory_efficiency);
    let (unscaled_s, bound) = if compute > memory { (compute, Bound::Compute) } else { (memory, Bound::Memory) };
    Roofline {
        compute_s: paced(compute * emu.time_scale),
        memory_s: paced(memory * emu.time_scale),
        time_s: paced(unscaled_s * emu.time_scale),
        unscaled_s,
        bound,
    }
}

/// The roofline of one decode token of [`REFERENCE_MODEL`] at [`REFERENCE_CONTEXT`]
/// tokens of context on `kind`: what validation paces to keep emulated steps far from
/// [`MAX_STEP_S`]. Its `unscaled_s x time_scale` is the uncapped pace.
pub fn reference_step(kind: &ChipKind, emu: &EmulationSpec) -> Roofline {
    roofline(kind, &REFERENCE_MODEL, &StepShape::decode(1, REFERENCE_CONTEXT), emu)
}

/// `seconds` as a pacer can use it: at most [`MAX_STEP_S`]. A time that is not a number
/// (from figures of 0 or NaN, which validation refuses) counts as the longest.
fn paced(seconds: f64) -> f64 {
    if seconds.is_nan() { MAX_STEP_S } else { seconds.clamp(0.0, MAX_STEP_S) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    /// Llama-2-7B: 6,738,415,616 parameters in f16, f16 KV.
    const LLAMA_7B: ModelShape = REFERENCE_MODEL;

    /// Tessera's `builtin:tiny`: 1,000,576 parameters in f32, f32 KV.
    const TINY: ModelShape = ModelShape {
        num_layers: 4,
        hidden_size: 128,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 32,
        intermediate_size: 352,
        vocab_size: 1024,
        weight_bytes: 4_002_304,
        kv_bytes_per_elem: 4,
    };

    #[test]
    fn shape_arithmetic() {
        // Llama-2-7B layer: q, k, v, o 4 x 4096^2 + MLP 3 x 4096 x 11008.
        assert_eq!(LLAMA_7B.layer_linear_params(), 4 * 4096 * 4096 + 3 * 4096 * 11008);
        assert_eq!(LLAMA_7B.linear_params(), 6_476_005_376);
        // 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB (chips.md: 70B is 320 KiB).
        assert_eq!(LLAMA_7B.kv_bytes_per_token(), 512 << 10);
        // Tiny: q 128x128, k and v 128x64, o 128x128, MLP 3 x 128 x 352.
        assert_eq!(TINY.layer_linear_params(), 184_320);
        assert_eq!(TINY.kv_bytes_per_token(), 2048);
        // Weights: embedding and LM head 2 x 1024 x 128, 4 layers of matrices and two
        // norms, the final norm; 4 bytes each.
        assert_eq!(4 * (2 * 1024 * 128 + 4 * (184_320 + 2 * 128) + 128), TINY.weight_bytes);
    }

    #[test]
    fn flops_and_bytes() {
        let table: &[(&str, ModelShape, StepShape, f64, f64)] = &[
            // 7B decode, one sequence at 1024 tokens of context:
            // 2 x 6,476,005,376 + LM head 2 x 32000 x 4096 + 1024 pairs x 4 x 32 x 128 x 32;
            // weights + 1024 tokens of KV read + 1 written, 512 KiB each.
            (
                "7B decode",
                LLAMA_7B,
                StepShape::decode(1, 1024),
                12_952_010_752.0 + 262_144_000.0 + 1024.0 * 524_288.0,
                13_476_831_232.0 + 1025.0 * 524_288.0,
            ),
            // 7B prefill of 2048 tokens: 2048 x 2049 / 2 = 2,098,176 pairs.
            (
                "7B prefill",
                LLAMA_7B,
                StepShape::prefill(2048),
                2.0 * 6_476_005_376.0 * 2048.0 + 262_144_000.0 + 2_098_176.0 * 524_288.0,
                13_476_831_232.0 + 4096.0 * 524_288.0,
            ),
            // A chunk of 512 after 512 tokens: 512 x 512 + 512 x 513 / 2 = 393,472 pairs;
            // KV of 1024 read and 512 written.
            (
                "7B second chunk",
                LLAMA_7B,
                StepShape { seqs: vec![SeqStep { new_tokens: 512, context: 1024 }] },
                2.0 * 6_476_005_376.0 * 512.0 + 262_144_000.0 + 393_472.0 * 524_288.0,
                13_476_831_232.0 + 1536.0 * 524_288.0,
            ),
            // Weights are read once for the whole batch; every sequence has its head and KV.
            (
                "tiny decode x 4",
                TINY,
                StepShape::decode(4, 100),
                4.0 * (2.0 * 737_280.0 + 2.0 * 131_072.0 + 100.0 * 2048.0),
                4_002_304.0 + 4.0 * 101.0 * 2048.0,
            ),
            ("empty step", TINY, StepShape::default(), 0.0, 0.0),
        ];
        for (name, model, step, flops, bytes) in table {
            assert_eq!(step_flops(model, step), *flops, "{name} flops");
            assert_eq!(step_bytes(model, step), *bytes, "{name} bytes");
        }
    }

    #[track_caller]
    fn close(got: f64, want: f64) {
        assert!((got - want).abs() <= want * 1e-9, "got {got}, want {want}");
    }

    #[test]
    fn rooflines() {
        let emu = EmulationSpec::default();
        let scaled = EmulationSpec { time_scale: 1000.0, ..emu };
        // (kind, model, step, emulation, bound, unscaled seconds)
        let table: &[(&str, ModelShape, StepShape, EmulationSpec, Bound, f64)] = &[
            // chips.md: a decode step is memory bound at about weights / (2039e9 x 0.8).
            (
                "nvidia-a100",
                LLAMA_7B,
                StepShape::decode(1, 1024),
                emu,
                Bound::Memory,
                (13_476_831_232.0 + 1025.0 * 524_288.0) / (2039e9 * 0.8),
            ),
            // 2048-token prefill on H100: compute bound at FLOPs / (989e12 x 0.5).
            (
                "nvidia-h100",
                LLAMA_7B,
                StepShape::prefill(2048),
                emu,
                Bound::Compute,
                (2.0 * 6_476_005_376.0 * 2048.0 + 262_144_000.0 + 2_098_176.0 * 524_288.0) / (989e12 * 0.5),
            ),
            // The default topology's figures (default.toml): tiny decode on the C500 at
            // 128 tokens of context, 2.96 us -> 2.96 ms ...
            (
                "metax-c500",
                TINY,
                StepShape::decode(1, 128),
                scaled,
                Bound::Memory,
                (4_002_304.0 + 129.0 * 2048.0) / (1800e9 * 0.8),
            ),
            // ... and a 512-token prefill chunk on the 910B, 5.79 us -> 5.79 ms.
            (
                "ascend-910b",
                TINY,
                StepShape::prefill(512),
                scaled,
                Bound::Compute,
                (2.0 * 737_280.0 * 512.0 + 2.0 * 131_072.0 + 131_328.0 * 2048.0) / (354e12 * 0.5),
            ),
        ];
        for (name, model, step, emu, bound, seconds) in table {
            let Some(kind) = catalog::lookup(name) else { panic!("{name} is not in the catalog") };
            let r = roofline(kind, model, step, emu);
            assert_eq!(r.bound, *bound, "{name}");
            close(r.unscaled_s, *seconds);
            close(r.time_s, *seconds * emu.time_scale);
            close(r.time_s, r.compute_s.max(r.memory_s));
        }
    }

    #[test]
    fn the_default_topology_paces_the_tiny_model_in_milliseconds() {
        let spec = crate::default_topology();
        let time = |kind: &str, step: &StepShape| {
            spec.chip_kind(kind).map(|kind| roofline(kind, &TINY, step, &spec.emulation).time_s)
        };
        let decode = time("metax-c500", &StepShape::decode(1, 128)).unwrap_or(0.0);
        let prefill = time("ascend-910b", &StepShape::prefill(512)).unwrap_or(0.0);
        // 5000 x 2.96 us and 5000 x 5.79 us (see default.toml): slower than one CPU
        // thread computes them, so the pacing, not the CPU, sets the time.
        assert!((0.010..0.020).contains(&decode), "decode {decode} s");
        assert!((0.025..0.035).contains(&prefill), "prefill {prefill} s");
    }

    #[test]
    fn a_decode_batch_turns_compute_bound_past_the_ridge() {
        let emu = EmulationSpec::default();
        let Some(a100) = catalog::lookup("nvidia-a100") else { panic!("no a100") };
        let bound = |batch| roofline(a100, &LLAMA_7B, &StepShape::decode(batch, 1), &emu).bound;
        // Derated ridge: 156e12 / 1.6312e12 = 95.6 FLOP/byte; a 7B decode row is about
        // 2 x 6.7e9 FLOP against 13.5e9 weight bytes shared by the batch.
        assert_eq!(bound(64), Bound::Memory);
        assert_eq!(bound(128), Bound::Compute);
    }

    #[test]
    fn paced_times_stay_finite_and_at_most_a_day() {
        let Some(cpu) = catalog::lookup("cpu") else { panic!("no cpu kind") };
        // The largest model the backends accept (hidden 2^16, MLP 2^18, 2^10 layers and
        // heads, 2^22 vocabulary) in a 2^20-token step at 2^24 tokens of context: its
        // FLOPs pass u64::MAX, and the step would take centuries on one CPU.
        let huge = ModelShape {
            num_layers: 1 << 10,
            hidden_size: 1 << 16,
            num_heads: 1 << 10,
            num_kv_heads: 1 << 10,
            head_dim: 1 << 6,
            intermediate_size: 1 << 18,
            vocab_size: 1 << 22,
            weight_bytes: u64::MAX,
            kv_bytes_per_elem: 4,
        };
        let step = StepShape { seqs: vec![SeqStep { new_tokens: 1 << 20, context: 1 << 24 }] };
        assert!(step_flops(&huge, &step) > u64::MAX as f64);
        let slow = EmulationSpec { time_scale: 1e6, ..EmulationSpec::default() };
        // Figures no validated topology has: 0 and NaN peaks.
        let zero = ChipKind { fp16_tflops: 0.0, memory_bw_gbs: f64::NAN, ..cpu.clone() };
        // (kind, model, step, emulation, paced seconds)
        let table: &[(&ChipKind, ModelShape, StepShape, EmulationSpec, f64)] = &[
            (cpu, huge, step.clone(), slow, MAX_STEP_S),
            (cpu, huge, step, EmulationSpec { time_scale: 1e-300, ..slow }, 0.0),
            (&zero, TINY, StepShape::decode(1, 1), EmulationSpec::default(), MAX_STEP_S),
            (&zero, TINY, StepShape::default(), EmulationSpec::default(), MAX_STEP_S),
        ];
        for (kind, model, step, emu, seconds) in table {
            let r = roofline(kind, model, step, emu);
            for paced in [r.compute_s, r.memory_s, r.time_s] {
                assert!(paced.is_finite() && (0.0..=MAX_STEP_S).contains(&paced), "{r:?}");
            }
            assert!((r.time_s - seconds).abs() < 1e-9, "{r:?}");
            let due = std::time::Instant::now().checked_add(std::time::Duration::from_secs_f64(r.time_s));
            assert!(due.is_some(), "{r:?}");
        }
    }

    #[test]
    fn every_catalog_kind_paces_the_reference_step_under_a_day_at_the_largest_time_scale() {
        // What validation relies on: at the default efficiencies no built-in kind can be
        // refused for its pace, whatever time_scale (at most 1e6) the file sets.
        let emu = EmulationSpec { time_scale: 1e6, ..EmulationSpec::default() };
        for kind in catalog::kinds() {
            let r = reference_step(kind, &emu);
            assert!(r.unscaled_s * emu.time_scale < MAX_STEP_S, "{}: {r:?}", kind.name);
        }
        // The slowest is the cpu kind, memory bound: 15,624,839,168 bytes / (460.8e9 x 0.8).
        let Some(cpu) = catalog::lookup("cpu") else { panic!("no cpu kind") };
        close(reference_step(cpu, &EmulationSpec::default()).unscaled_s, 15_624_839_168.0 / (460.8e9 * 0.8));
    }
}
