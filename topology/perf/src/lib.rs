//! Performance models as data, one crate for emulated chips, the simulator, the router
//! and the solver: how long one batched step of a dense decoder-only model (Llama
//! family) takes on a chip, how long KV takes over a link, and how much power a chip
//! draws in each phase. Pure arithmetic: no I/O, no clock, no other tessera crate.
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
//! Time is `overhead + max(FLOPs / (peak x compute efficiency), bytes / (bandwidth x
//! memory efficiency))`: a fixed cost per step plus whichever roof the step hits (plus,
//! for a chip that does not overlap the two, the part of the other that
//! [`PerfModel::overlap`] leaves exposed). The
//! efficiencies are [`Curve`]s of the step's size, fitted per chip ([`fit`]): a chip
//! reaches a smaller fraction of its peak on a small step than on a large one. A step
//! that carries prompt tokens (a prefill chunk) uses the [`PerfModel::prefill`] curves,
//! of the tokens in the step; a decode-only step the [`PerfModel::decode`] curves, of the
//! batch size. A flat model ([`PerfModel::flat`]: constant efficiencies, no overhead)
//! is the plain roofline that emulated chips are paced by unless calibrated.
//!
//! Invariant: whatever the model, step and figures, the paced (scaled) times of a
//! [`Roofline`] are finite and at most [`MAX_STEP_S`], so that a pacer can always turn
//! them into a `Duration` and add that to an `Instant`. Costs are summed in `f64`, which
//! cannot overflow where `u64` would (a large model times a large batch passes 1.8e19
//! FLOPs).

use serde::{Deserialize, Serialize};

pub mod fit;
pub mod parallel;

/// The longest a paced step may take, in seconds (one day). [`roofline`] never paces a
/// step longer; topology validation refuses pacings whose [`reference_step`] takes longer,
/// so that a real configuration never comes near it.
pub const MAX_STEP_S: f64 = 86_400.0;

/// Tessera's `builtin:tiny` test model: 1,000,576 parameters in f32, f32 KV (2,048
/// bytes a token).
pub const BUILTIN_TINY: ModelShape = ModelShape {
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

    /// Whether the step carries prompt tokens (a sequence computing more than one): it
    /// runs on a chip's prefill curves, otherwise on its decode curves.
    pub fn is_prefill(&self) -> bool {
        self.seqs.iter().any(|seq| seq.new_tokens > 1)
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
    let (matmul, attention) = step_flops_by_kind(model, step);
    matmul + attention
}

/// FLOPs of `step` in matrix products (projections, MLP, LM head) and in attention.
pub fn step_flops_by_kind(model: &ModelShape, step: &StepShape) -> (f64, f64) {
    let per_pair = 4.0 * model.num_heads as f64 * model.head_dim as f64 * model.num_layers as f64;
    let (linear, lm_head) = (model.linear_params() as f64, model.lm_head_params() as f64);
    step.seqs.iter().fold((0.0, 0.0), |(matmul, attention), seq| {
        let head = if seq.new_tokens > 0 { 2.0 * lm_head } else { 0.0 };
        (matmul + 2.0 * linear * seq.new_tokens as f64 + head, attention + per_pair * seq.attention_pairs())
    })
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

/// The peaks of a chip that a step's time is measured against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roof {
    /// Dense FP16/BF16 peak, TFLOPS.
    pub fp16_tflops: f64,
    /// Peak device-memory bandwidth, GB/s.
    pub memory_bw_gbs: f64,
}

/// The fraction of a peak a step achieves as a function of its size `n` (tokens in a
/// prefill step, sequences in a decode step): `peak x n / (n + half)`. It rises with
/// `n` and reaches half of `peak` at `n = half`; `half = 0` is a constant `peak`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Curve {
    /// The fraction approached by large steps, in `(0, 1]`.
    pub peak: f64,
    /// The size at which half of `peak` is reached, `>= 0`.
    #[serde(default)]
    pub half: f64,
}

impl Curve {
    /// A constant fraction.
    pub const fn flat(peak: f64) -> Curve {
        Curve { peak, half: 0.0 }
    }

    /// The fraction at size `n` (at least 1).
    pub fn at(&self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        if self.half > 0.0 { self.peak * n / (n + self.half) } else { self.peak }
    }

    fn check(&self, name: &str) -> Result<(), String> {
        if !(self.peak > 0.0 && self.peak <= 1.0) {
            return Err(format!("{name}.peak must be more than 0 and at most 1, not {}", self.peak));
        }
        if !(0.0..=1e9).contains(&self.half) {
            return Err(format!("{name}.half must be from 0 to 1e9, not {}", self.half));
        }
        Ok(())
    }
}

/// The compute and memory efficiencies of one kind of step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    /// Fraction of peak FLOPS (MFU).
    pub compute: Curve,
    /// Fraction of peak memory bandwidth (MBU).
    pub memory: Curve,
}

/// How one chip kind turns a step's FLOPs and bytes into time (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerfModel {
    /// Steps that carry prompt tokens: curves of the tokens in the step.
    pub prefill: Efficiency,
    /// Decode-only steps: curves of the sequences in the batch.
    pub decode: Efficiency,
    /// Seconds every non-empty step costs beside its roofline (kernel launches,
    /// scheduling, sampling), `>= 0`.
    #[serde(default)]
    pub overhead_s: f64,
    /// How much of the shorter roof's time hides under the longer one's, in `[0, 1]`:
    /// 1 (the default) is the roofline, compute and memory traffic fully overlapped as
    /// on an accelerator; 0 adds them, as a CPU core that computes and then waits.
    #[serde(default = "one")]
    pub overlap: f64,
    /// Attention's efficiency relative to the matrix products', in `(0, 1]`: an
    /// attention FLOP costs `1 / attention` of a matmul FLOP. 1 (the default) counts
    /// them alike; a chip whose attention kernels lag its GEMMs (a CPU at long
    /// contexts) is fitted lower.
    #[serde(default = "one")]
    pub attention: f64,
}

fn one() -> f64 {
    1.0
}

impl PerfModel {
    /// The plain roofline: constant efficiencies, no overhead.
    pub const fn flat(compute_efficiency: f64, memory_efficiency: f64) -> PerfModel {
        let e = Efficiency { compute: Curve::flat(compute_efficiency), memory: Curve::flat(memory_efficiency) };
        PerfModel { prefill: e, decode: e, overhead_s: 0.0, overlap: 1.0, attention: 1.0 }
    }

    /// Whether every figure is in range: peaks in `(0, 1]`, halves and the overhead
    /// from 0 to their bounds. The message names the bad figure.
    pub fn check(&self) -> Result<(), String> {
        self.prefill.compute.check("prefill.compute")?;
        self.prefill.memory.check("prefill.memory")?;
        self.decode.compute.check("decode.compute")?;
        self.decode.memory.check("decode.memory")?;
        if !(0.0..=1.0).contains(&self.overhead_s) {
            return Err(format!("overhead_s must be from 0 to 1 second, not {}", self.overhead_s));
        }
        if !(0.0..=1.0).contains(&self.overlap) {
            return Err(format!("overlap must be from 0 to 1, not {}", self.overlap));
        }
        if !(self.attention > 0.0 && self.attention <= 1.0) {
            return Err(format!("attention must be more than 0 and at most 1, not {}", self.attention));
        }
        Ok(())
    }

    /// The efficiencies `step` runs at, and its size on their curves.
    fn efficiency(&self, step: &StepShape) -> (f64, f64) {
        if step.is_prefill() {
            let n = step.tokens();
            (self.prefill.compute.at(n), self.prefill.memory.at(n))
        } else {
            let n = step.seqs.len();
            (self.decode.compute.at(n), self.decode.memory.at(n))
        }
    }
}

/// A step's predicted time. The scaled times are finite and at most [`MAX_STEP_S`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// FLOPs / (peak x compute efficiency), x time_scale.
    pub compute_s: f64,
    /// Bytes / (bandwidth x memory efficiency), x time_scale.
    pub memory_s: f64,
    /// The overhead plus the larger of the two, x time_scale: how long the step takes.
    pub time_s: f64,
    /// `time_s` without the time scale: the step on the real chip.
    pub unscaled_s: f64,
    /// Compute when `compute_s > memory_s`, memory otherwise.
    pub bound: Bound,
}

/// The predicted time of `step` of `model` on a chip of peaks `roof` running at `perf`,
/// multiplied by `time_scale` (1 for the real chip; an emulated chip's pacing scale); a
/// scaled time past [`MAX_STEP_S`] is paced as [`MAX_STEP_S`]. An empty step takes no time.
pub fn roofline(roof: Roof, model: &ModelShape, step: &StepShape, perf: &PerfModel, time_scale: f64) -> Roofline {
    let (compute_eff, memory_eff) = perf.efficiency(step);
    let (matmul, attention) = step_flops_by_kind(model, step);
    let compute = (matmul + attention / perf.attention) / (roof.fp16_tflops * 1e12 * compute_eff);
    let memory = step_bytes(model, step) / (roof.memory_bw_gbs * 1e9 * memory_eff);
    let (roof_s, bound) = if compute > memory { (compute, Bound::Compute) } else { (memory, Bound::Memory) };
    let exposed = (1.0 - perf.overlap) * compute.min(memory);
    let unscaled_s = if step.seqs.is_empty() { 0.0 } else { perf.overhead_s + roof_s + exposed };
    Roofline {
        compute_s: paced(compute * time_scale),
        memory_s: paced(memory * time_scale),
        time_s: paced(unscaled_s * time_scale),
        unscaled_s,
        bound,
    }
}

/// The roofline of one decode token of [`REFERENCE_MODEL`] at [`REFERENCE_CONTEXT`]
/// tokens of context: what topology validation paces to keep emulated steps far from
/// [`MAX_STEP_S`]. Its `unscaled_s x time_scale` is the uncapped pace.
pub fn reference_step(roof: Roof, perf: &PerfModel, time_scale: f64) -> Roofline {
    roofline(roof, &REFERENCE_MODEL, &StepShape::decode(1, REFERENCE_CONTEXT), perf, time_scale)
}

/// `seconds` as a pacer can use it: at most [`MAX_STEP_S`]. A time that is not a number
/// (from figures of 0 or NaN, which validation refuses) counts as the longest.
fn paced(seconds: f64) -> f64 {
    if seconds.is_nan() { MAX_STEP_S } else { seconds.clamp(0.0, MAX_STEP_S) }
}

/// A link KV travels over: bandwidth one way and a latency per transfer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// GB/s (10^9 bytes per second), one direction.
    pub bandwidth_gbs: f64,
    pub latency_s: f64,
}

impl Link {
    /// A 100 Gb/s Ethernet fabric: 12.5 GB/s one way, 20 us per transfer.
    pub const ETHERNET_100G: Link = Link { bandwidth_gbs: 12.5, latency_s: 20e-6 };

    /// Seconds `bytes` take over the link: the latency plus the bytes at its bandwidth
    /// (finite: a link without bandwidth takes [`MAX_STEP_S`]).
    pub fn transfer_s(&self, bytes: u64) -> f64 {
        let s = self.latency_s + bytes as f64 / (self.bandwidth_gbs * 1e9);
        if s.is_finite() { s.max(0.0) } else { MAX_STEP_S }
    }
}

/// Board power of a chip by phase, watts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Power {
    pub idle_w: f64,
    pub prefill_w: f64,
    pub decode_w: f64,
}

/// Of the board power (TDP): prefill draws all of it, decode 0.58 of it, both
/// Splitwise's measured per-GPU power (A100 prompt 400 W / token 250 W, H100 700 W /
/// 380 W; the token phase's share is their mean). Idle at 0.25 of it is an estimate (no
/// public figure was found).
pub const PREFILL_POWER_SHARE: f64 = 1.0;
pub const DECODE_POWER_SHARE: f64 = 0.58;
pub const IDLE_POWER_SHARE: f64 = 0.25;

impl Power {
    /// A chip of board power `tdp_w` by the shares above.
    pub fn from_tdp(tdp_w: f64) -> Power {
        Power {
            idle_w: tdp_w * IDLE_POWER_SHARE,
            prefill_w: tdp_w * PREFILL_POWER_SHARE,
            decode_w: tdp_w * DECODE_POWER_SHARE,
        }
    }

    /// Joules over a run of `span_s` seconds of which `prefill_s` in steps carrying
    /// prompt tokens, `decode_s` in decode-only steps, and the rest idle.
    pub fn energy_j(&self, prefill_s: f64, decode_s: f64, span_s: f64) -> f64 {
        let idle_s = (span_s - prefill_s - decode_s).max(0.0);
        self.prefill_w * prefill_s + self.decode_w * decode_s + self.idle_w * idle_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-2-7B: 6,738,415,616 parameters in f16, f16 KV.
    const LLAMA_7B: ModelShape = REFERENCE_MODEL;

    const TINY: ModelShape = BUILTIN_TINY;

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

    const A100: Roof = Roof { fp16_tflops: 312.0, memory_bw_gbs: 2039.0 };
    const H100: Roof = Roof { fp16_tflops: 989.0, memory_bw_gbs: 3350.0 };
    const C500: Roof = Roof { fp16_tflops: 280.0, memory_bw_gbs: 1800.0 };
    const ASCEND_910B: Roof = Roof { fp16_tflops: 354.0, memory_bw_gbs: 1600.0 };
    const CPU: Roof = Roof { fp16_tflops: 14.7, memory_bw_gbs: 460.8 };
    /// The default efficiencies of emulated chips (MFU 0.5, MBU 0.8).
    const FLAT: PerfModel = PerfModel::flat(0.5, 0.8);

    #[test]
    fn rooflines() {
        // (chip, model, step, time scale, bound, unscaled seconds)
        let table: &[(&str, Roof, ModelShape, StepShape, f64, Bound, f64)] = &[
            // chips.md: a decode step is memory bound at about weights / (2039e9 x 0.8).
            (
                "a100",
                A100,
                LLAMA_7B,
                StepShape::decode(1, 1024),
                1.0,
                Bound::Memory,
                (13_476_831_232.0 + 1025.0 * 524_288.0) / (2039e9 * 0.8),
            ),
            // 2048-token prefill on H100: compute bound at FLOPs / (989e12 x 0.5).
            (
                "h100",
                H100,
                LLAMA_7B,
                StepShape::prefill(2048),
                1.0,
                Bound::Compute,
                (2.0 * 6_476_005_376.0 * 2048.0 + 262_144_000.0 + 2_098_176.0 * 524_288.0) / (989e12 * 0.5),
            ),
            // The default topology's figures (default.toml): tiny decode on the C500 at
            // 128 tokens of context, 2.96 us -> 2.96 ms ...
            (
                "c500",
                C500,
                TINY,
                StepShape::decode(1, 128),
                1000.0,
                Bound::Memory,
                (4_002_304.0 + 129.0 * 2048.0) / (1800e9 * 0.8),
            ),
            // ... and a 512-token prefill chunk on the 910B, 5.79 us -> 5.79 ms.
            (
                "910b",
                ASCEND_910B,
                TINY,
                StepShape::prefill(512),
                1000.0,
                Bound::Compute,
                (2.0 * 737_280.0 * 512.0 + 2.0 * 131_072.0 + 131_328.0 * 2048.0) / (354e12 * 0.5),
            ),
        ];
        for (name, roof, model, step, scale, bound, seconds) in table {
            let r = roofline(*roof, model, step, &FLAT, *scale);
            assert_eq!(r.bound, *bound, "{name}");
            close(r.unscaled_s, *seconds);
            close(r.time_s, *seconds * scale);
            close(r.time_s, r.compute_s.max(r.memory_s));
        }
    }

    #[test]
    fn efficiency_curves_and_the_overhead() {
        let curve = Curve { peak: 0.6, half: 32.0 };
        close(curve.at(32), 0.3);
        close(curve.at(96), 0.45);
        assert_eq!(curve.at(0), curve.at(1));
        assert_eq!(Curve::flat(0.7).at(1), 0.7);
        let perf = PerfModel {
            prefill: Efficiency { compute: Curve { peak: 0.6, half: 256.0 }, memory: Curve::flat(0.8) },
            decode: Efficiency { compute: Curve::flat(0.5), memory: Curve { peak: 0.9, half: 4.0 } },
            overhead_s: 0.002,
            overlap: 1.0,
            attention: 1.0,
        };
        assert_eq!(perf.check(), Ok(()));
        // A 256-token prefill runs at half its peak MFU: 0.3.
        let step = StepShape::prefill(256);
        let r = roofline(H100, &LLAMA_7B, &step, &perf, 1.0);
        assert_eq!(r.bound, Bound::Compute);
        close(r.compute_s, step_flops(&LLAMA_7B, &step) / (989e12 * 0.3));
        close(r.unscaled_s, 0.002 + r.compute_s);
        // A decode batch of 4 at 0.45 MBU, the overhead on top; the time scale scales both.
        let step = StepShape::decode(4, 100);
        let r = roofline(A100, &LLAMA_7B, &step, &perf, 10.0);
        close(r.memory_s, step_bytes(&LLAMA_7B, &step) / (2039e9 * 0.45) * 10.0);
        close(r.time_s, (0.002 + r.memory_s / 10.0) * 10.0);
        // An empty step costs nothing, overhead included.
        assert_eq!(roofline(A100, &LLAMA_7B, &StepShape::default(), &perf, 1.0).time_s, 0.0);
        // Out-of-range figures are named.
        let bad = PerfModel { decode: Efficiency { memory: Curve::flat(1.5), ..perf.decode }, ..perf };
        assert!(bad.check().is_err_and(|e| e.contains("decode.memory.peak")));
        assert!(PerfModel { overhead_s: -1.0, ..perf }.check().is_err_and(|e| e.contains("overhead_s")));
        assert!(PerfModel { overlap: 1.5, ..perf }.check().is_err_and(|e| e.contains("overlap")));
        assert!(PerfModel { attention: 0.0, ..perf }.check().is_err_and(|e| e.contains("attention")));
        // Attention at a quarter of the matmuls' efficiency.
        let step = StepShape::prefill(2048);
        let (matmul, attention) = step_flops_by_kind(&LLAMA_7B, &step);
        assert_eq!(matmul + attention, step_flops(&LLAMA_7B, &step));
        let slow = roofline(H100, &LLAMA_7B, &step, &PerfModel { attention: 0.25, ..perf }, 1.0);
        close(slow.compute_s, (matmul + 4.0 * attention) / (989e12 * perf.prefill.compute.at(2048)));
        // Without overlap, the shorter roof adds to the longer.
        let step = StepShape::prefill(256);
        let serial = roofline(H100, &LLAMA_7B, &step, &PerfModel { overlap: 0.0, ..perf }, 1.0);
        close(serial.unscaled_s, 0.002 + serial.compute_s + serial.memory_s);
        // A model file reads back what was written, and refuses unknown keys.
        let text = toml::to_string(&perf).unwrap_or_default();
        assert_eq!(toml::from_str::<PerfModel>(&text).ok(), Some(perf));
        assert!(toml::from_str::<PerfModel>(&format!("{text}\nspeed = 2\n")).is_err());
    }

    #[test]
    fn links_and_power() {
        let link = Link { bandwidth_gbs: 12.5, latency_s: 20e-6 };
        close(link.transfer_s(12_500_000), 0.001_02);
        assert_eq!(Link { bandwidth_gbs: 0.0, latency_s: 0.0 }.transfer_s(1), MAX_STEP_S);
        // Splitwise's A100: 400 W prompt, ~232 W token (0.58 x 400), idle estimated.
        let power = Power::from_tdp(400.0);
        close(power.decode_w, 232.0);
        // 10 s prefill, 20 s decode, 70 s idle.
        close(power.energy_j(10.0, 20.0, 100.0), 4000.0 + 4640.0 + 7000.0);
    }

    #[test]
    fn a_decode_batch_turns_compute_bound_past_the_ridge() {
        let bound = |batch| roofline(A100, &LLAMA_7B, &StepShape::decode(batch, 1), &FLAT, 1.0).bound;
        // Derated ridge: 156e12 / 1.6312e12 = 95.6 FLOP/byte; a 7B decode row is about
        // 2 x 6.7e9 FLOP against 13.5e9 weight bytes shared by the batch.
        assert_eq!(bound(64), Bound::Memory);
        assert_eq!(bound(128), Bound::Compute);
    }

    #[test]
    fn paced_times_stay_finite_and_at_most_a_day() {
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
        // Figures no validated topology has: 0 and NaN peaks.
        let zero = Roof { fp16_tflops: 0.0, memory_bw_gbs: f64::NAN };
        // (roof, model, step, time scale, paced seconds)
        let table: &[(Roof, ModelShape, StepShape, f64, f64)] = &[
            (CPU, huge, step.clone(), 1e6, MAX_STEP_S),
            (CPU, huge, step, 1e-300, 0.0),
            (zero, TINY, StepShape::decode(1, 1), 1.0, MAX_STEP_S),
        ];
        for (roof, model, step, scale, seconds) in table {
            let r = roofline(*roof, model, step, &FLAT, *scale);
            for paced in [r.compute_s, r.memory_s, r.time_s] {
                assert!(paced.is_finite() && (0.0..=MAX_STEP_S).contains(&paced), "{r:?}");
            }
            assert!((r.time_s - seconds).abs() < 1e-9, "{r:?}");
            let due = std::time::Instant::now().checked_add(std::time::Duration::from_secs_f64(r.time_s));
            assert!(due.is_some(), "{r:?}");
        }
        // The slowest built-in kind, cpu, memory bound: 15,624,839,168 bytes / (460.8e9 x 0.8).
        close(reference_step(CPU, &FLAT, 1.0).unscaled_s, 15_624_839_168.0 / (460.8e9 * 0.8));
    }
}
