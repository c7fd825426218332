//! Fitting a [`PerfModel`] to measured steps: the calibration of a real chip. Given
//! steps of known shape and the seconds each took, find the overhead and the four
//! efficiency curves that predict them best, by the sum of squared log errors (a step
//! predicted 10% long weighs as much as one 10% short, whatever its size).
//!
//! The search is a deterministic pattern search over the eleven figures in log space:
//! each figure is tried a factor up and down, a move kept when it lowers the error, and
//! the factor halved when no figure moves. It starts from peaks at the most any sample
//! shows (each roof binding on its best sample, so that no figure starts on a plateau
//! where moving it changes nothing). Eleven figures and a few hundred samples take
//! milliseconds. A roof a chip never hits in the samples (the memory roof of a
//! compute-bound CPU prefill, say) cannot be told from them; its figures stay at the
//! starting values, which are the plain roofline's defaults.

use crate::{Curve, Efficiency, ModelShape, PerfModel, Roof, StepShape, roofline};

/// One measured step.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub step: StepShape,
    /// Wall seconds the step took, more than 0.
    pub seconds: f64,
    /// How many steps it stands for in the loss (1 for one measured step; a class of
    /// like served steps counts as its size), more than 0.
    pub weight: f64,
}

impl Sample {
    /// One measured step.
    pub fn new(step: StepShape, seconds: f64) -> Sample {
        Sample { step, seconds, weight: 1.0 }
    }
}

/// A fitted model and how well it predicts its own samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub model: PerfModel,
    /// Median of |predicted / measured - 1| over the samples.
    pub median_error: f64,
    /// The largest of them.
    pub max_error: f64,
}

/// Why no model could be fitted.
#[derive(Debug, Clone, PartialEq)]
pub enum FitError {
    NoSamples,
    /// A sample took no time, a negative time or not a number of seconds, is empty, or
    /// weighs nothing.
    BadSample(usize),
}

impl std::fmt::Display for FitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FitError::NoSamples => f.write_str("no samples to fit"),
            FitError::BadSample(i) => {
                write!(
                    f,
                    "sample {i} has no tokens, took no time or weighs nothing (seconds and weight must be finite and more than 0)"
                )
            }
        }
    }
}

impl std::error::Error for FitError {}

/// Bounds of the figures the search moves.
const PEAK: (f64, f64) = (1e-4, 1.0);
const HALF: (f64, f64) = (0.0, 1e6);
const OVERHEAD: (f64, f64) = (0.0, 1.0);

/// Fit a model of `model` on a chip of peaks `roof` to `samples`.
pub fn fit(roof: Roof, model: &ModelShape, samples: &[Sample]) -> Result<Fit, FitError> {
    if samples.is_empty() {
        return Err(FitError::NoSamples);
    }
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if let Some(bad) = samples.iter().position(|s| s.step.tokens() == 0 || !positive(s.seconds) || !positive(s.weight))
    {
        return Err(FitError::BadSample(bad));
    }
    let loss = |p: &PerfModel| -> f64 {
        samples
            .iter()
            .map(|s| {
                let t = roofline(roof, model, &s.step, p, 1.0).unscaled_s;
                let e = (t / s.seconds).ln();
                s.weight * if e.is_finite() { e * e } else { 1e6 }
            })
            .sum()
    };
    // Start with each roof binding on the sample that achieves the most of it, in each
    // phase, and a tenth of the fastest step as the overhead.
    let fastest = samples.iter().map(|s| s.seconds).fold(f64::INFINITY, f64::min);
    let achieved = |prefill: bool, amount: fn(&ModelShape, &StepShape) -> f64, peak: f64| {
        let best = samples
            .iter()
            .filter(|s| s.step.is_prefill() == prefill)
            .map(|s| amount(model, &s.step) / (peak * s.seconds))
            .fold(0.0, f64::max);
        if best > 0.0 { clamp(1, best) } else { 0.5 }
    };
    let flops_peak = roof.fp16_tflops * 1e12;
    let bytes_peak = roof.memory_bw_gbs * 1e9;
    let start = PerfModel {
        prefill: Efficiency {
            compute: Curve::flat(achieved(true, crate::step_flops, flops_peak)),
            memory: Curve::flat(achieved(true, crate::step_bytes, bytes_peak)),
        },
        decode: Efficiency {
            compute: Curve::flat(achieved(false, crate::step_flops, flops_peak)),
            memory: Curve::flat(achieved(false, crate::step_bytes, bytes_peak)),
        },
        overhead_s: (fastest * 0.1).min(OVERHEAD.1),
        overlap: 1.0,
        attention: 1.0,
    };
    let mut figures = to_figures(&start);
    let mut best = loss(&start);
    // Converged searches restart from factor 2 until a restart finds nothing better:
    // a figure stuck against another (an overhead traded for a curve) gets out that way.
    let mut factor = 2.0_f64;
    let mut restart_from = f64::INFINITY;
    for _ in 0..20_000 {
        if factor < 1.0 + 1e-4 {
            if best >= restart_from * (1.0 - 1e-9) {
                break;
            }
            (restart_from, factor) = (best, 2.0);
        }
        let mut moved = false;
        for i in 0..figures.len() {
            for candidate in [figures[i] * factor, figures[i] / factor, seed(i, figures[i])] {
                let mut trial = figures;
                trial[i] = clamp(i, candidate);
                if trial[i] == figures[i] {
                    continue;
                }
                let l = loss(&from_figures(&trial));
                if l < best {
                    (best, figures, moved) = (l, trial, true);
                }
            }
        }
        if !moved {
            factor = factor.sqrt();
        }
    }
    let model_fit = from_figures(&figures);
    let mut errors: Vec<f64> = samples
        .iter()
        .map(|s| (roofline(roof, model, &s.step, &model_fit, 1.0).unscaled_s / s.seconds - 1.0).abs())
        .collect();
    errors.sort_by(f64::total_cmp);
    Ok(Fit { model: model_fit, median_error: errors[errors.len() / 2], max_error: errors[errors.len() - 1] })
}

/// The figures in a fixed order: overhead, then (peak, half) of prefill compute,
/// prefill memory, decode compute, decode memory, then the overlap and attention's
/// relative efficiency.
const FIGURES: usize = 11;
const OVERLAP_AT: usize = 9;
const ATTENTION_AT: usize = 10;

fn to_figures(p: &PerfModel) -> [f64; FIGURES] {
    let c = [p.prefill.compute, p.prefill.memory, p.decode.compute, p.decode.memory];
    let f = p.overhead_s;
    [f, c[0].peak, c[0].half, c[1].peak, c[1].half, c[2].peak, c[2].half, c[3].peak, c[3].half, p.overlap, p.attention]
}

fn from_figures(f: &[f64; FIGURES]) -> PerfModel {
    let curve = |i: usize| Curve { peak: f[i], half: f[i + 1] };
    PerfModel {
        overhead_s: f[0],
        prefill: Efficiency { compute: curve(1), memory: curve(3) },
        decode: Efficiency { compute: curve(5), memory: curve(7) },
        overlap: f[OVERLAP_AT],
        attention: f[ATTENTION_AT],
    }
}

/// Figure `i` within its bounds.
fn clamp(i: usize, v: f64) -> f64 {
    let (lo, hi) = match i {
        0 => OVERHEAD,
        OVERLAP_AT => (0.0, 1.0),
        ATTENTION_AT => (1e-3, 1.0),
        i if i % 2 == 1 => PEAK,
        _ => HALF,
    };
    v.clamp(lo, hi)
}

/// A figure at 0 cannot move by a factor: halves, the overhead and the overlap restart
/// from a small value instead.
fn seed(i: usize, v: f64) -> f64 {
    match (i, v) {
        (0, 0.0) => 1e-6,
        (OVERLAP_AT, 0.0) => 0.01,
        (i, 0.0) if i % 2 == 0 => 1.0,
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: Roof = Roof { fp16_tflops: 14.7, memory_bw_gbs: 460.8 };
    /// SmolLM2-135M's shape in f32: steps of milliseconds on a CPU, where a fixed
    /// overhead shows.
    const SMALL: ModelShape = ModelShape {
        num_layers: 30,
        hidden_size: 576,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        intermediate_size: 1536,
        vocab_size: 49152,
        weight_bytes: 538_090_408,
        kv_bytes_per_elem: 4,
    };

    fn grid() -> Vec<StepShape> {
        let mut steps = Vec::new();
        for tokens in [16, 64, 128, 256, 512, 1024] {
            steps.push(StepShape::prefill(tokens));
        }
        for batch in [1, 2, 4, 8, 16, 32, 64] {
            for context in [128, 1024] {
                steps.push(StepShape::decode(batch, context));
            }
        }
        steps
    }

    #[test]
    fn recovers_the_model_that_made_its_samples() {
        let truth = PerfModel {
            prefill: Efficiency { compute: Curve { peak: 0.4, half: 96.0 }, memory: Curve::flat(0.8) },
            decode: Efficiency { compute: Curve::flat(0.5), memory: Curve { peak: 0.7, half: 3.0 } },
            overhead_s: 0.004,
            overlap: 1.0,
            attention: 1.0,
        };
        let samples: Vec<Sample> = grid()
            .into_iter()
            .map(|step| {
                let seconds = roofline(CPU, &SMALL, &step, &truth, 1.0).unscaled_s;
                Sample::new(step, seconds)
            })
            .collect();
        let Ok(got) = fit(CPU, &SMALL, &samples) else { panic!("fit") };
        // Not exact: attention's relative efficiency trades against the compute curves
        // on shapes this few.
        assert!(got.median_error < 0.005 && got.max_error < 0.02, "{got:?}");
        // It predicts shapes it never saw as well.
        for step in [StepShape::prefill(384), StepShape::decode(12, 512)] {
            let want = roofline(CPU, &SMALL, &step, &truth, 1.0).unscaled_s;
            let predicted = roofline(CPU, &SMALL, &step, &got.model, 1.0).unscaled_s;
            assert!((predicted / want - 1.0).abs() < 0.03, "{step:?}: {predicted} vs {want}");
        }
        assert_eq!(got.model.check(), Ok(()));
    }

    #[test]
    fn a_chip_that_does_not_overlap_compute_and_memory_is_fitted_as_one() {
        // A CPU-like chip: low efficiencies, compute and memory one after the other.
        let truth = PerfModel { overhead_s: 1e-4, overlap: 0.0, attention: 0.2, ..PerfModel::flat(0.003, 0.01) };
        let samples: Vec<Sample> = grid()
            .into_iter()
            .map(|step| Sample::new(step.clone(), roofline(CPU, &SMALL, &step, &truth, 1.0).unscaled_s))
            .collect();
        let Ok(got) = fit(CPU, &SMALL, &samples) else { panic!("fit") };
        assert!(got.max_error < 0.03, "{got:?}");
        assert!(got.model.overlap < 0.5, "{got:?}");
    }

    #[test]
    fn noisy_samples_fit_within_their_noise_and_the_fit_is_deterministic() {
        let truth = PerfModel { overhead_s: 0.002, ..PerfModel::flat(0.3, 0.6) };
        // +-5% noise from a fixed sequence.
        let samples: Vec<Sample> = grid()
            .into_iter()
            .enumerate()
            .map(|(i, step)| {
                let noise = 1.0 + 0.05 * (((i * 7919) % 21) as f64 / 10.0 - 1.0);
                Sample::new(step.clone(), roofline(CPU, &SMALL, &step, &truth, 1.0).unscaled_s * noise)
            })
            .collect();
        let (Ok(a), Ok(b)) = (fit(CPU, &SMALL, &samples), fit(CPU, &SMALL, &samples)) else { panic!("fit") };
        assert_eq!(a, b);
        assert!(a.median_error < 0.05 && a.max_error < 0.08, "{a:?}");
    }

    #[test]
    fn bad_samples_are_named() {
        assert_eq!(fit(CPU, &SMALL, &[]), Err(FitError::NoSamples));
        let good = Sample::new(StepShape::prefill(8), 0.1);
        let cases = [
            Sample { seconds: 0.0, ..good.clone() },
            Sample { seconds: f64::NAN, ..good.clone() },
            Sample { step: StepShape::default(), ..good.clone() },
            Sample { weight: 0.0, ..good.clone() },
        ];
        for bad in cases {
            let got = fit(CPU, &SMALL, &[good.clone(), bad.clone()]);
            assert_eq!(got, Err(FitError::BadSample(1)), "{bad:?}");
        }
    }
}
