//! Latency summaries: mean and percentiles, with linear interpolation between closest
//! ranks (numpy's default, so figures compare with vLLM's benchmark_serving.py).

use serde::Serialize;

/// One latency metric over a run, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LatencySummary {
    pub samples: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

impl LatencySummary {
    /// Summary of latencies given in seconds; `None` when there are none (or none finite).
    pub fn from_seconds(values_s: &[f64]) -> Option<Self> {
        let mut ms: Vec<f64> = values_s.iter().filter(|v| v.is_finite()).map(|v| v * 1e3).collect();
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f64::total_cmp);
        Some(LatencySummary {
            samples: ms.len(),
            mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
            p50_ms: percentile(&ms, 50.0),
            p90_ms: percentile(&ms, 90.0),
            p99_ms: percentile(&ms, 99.0),
        })
    }
}

/// The `p`-th percentile (0..=100) of ascending, non-empty `sorted`: rank `p/100 * (n-1)`,
/// interpolated between its neighbours.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(&last) = sorted.last() else {
        return f64::NAN;
    };
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    match (sorted.get(lo), sorted.get(hi)) {
        (Some(&a), Some(&b)) => a + (b - a) * (rank - lo as f64),
        _ => last,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_hand_computed_values() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        // (sample, p, expected): rank = p/100 * (n - 1), interpolated.
        let cases: &[(&[f64], f64, f64)] = &[
            (&[5.0], 50.0, 5.0),
            (&[5.0], 99.0, 5.0),
            (&[1.0, 3.0], 50.0, 2.0),
            (&[1.0, 3.0], 90.0, 2.8),
            (&[1.0, 2.0, 3.0, 4.0], 50.0, 2.5),
            (&ten, 0.0, 1.0),
            (&ten, 50.0, 5.5),  // rank 4.5
            (&ten, 90.0, 9.1),  // rank 8.1
            (&ten, 99.0, 9.91), // rank 8.91
            (&ten, 100.0, 10.0),
            (&[10.0, 20.0, 30.0, 40.0, 50.0], 90.0, 46.0), // rank 3.6
        ];
        for &(sample, p, want) in cases {
            let got = percentile(sample, p);
            assert!((got - want).abs() < 1e-9, "p{p} of {sample:?}: got {got}, want {want}");
        }
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn summary_is_in_milliseconds_and_ignores_order() {
        let s = LatencySummary::from_seconds(&[0.004, 0.001, 0.003, 0.002]);
        let Some(s) = s else { panic!("four samples give a summary") };
        assert_eq!(s.samples, 4);
        assert!((s.mean_ms - 2.5).abs() < 1e-9);
        assert!((s.p50_ms - 2.5).abs() < 1e-9);
        assert!((s.p90_ms - 3.7).abs() < 1e-9); // rank 2.7
        assert!((s.p99_ms - 3.97).abs() < 1e-9); // rank 2.97
        assert_eq!(LatencySummary::from_seconds(&[]), None);
        assert_eq!(LatencySummary::from_seconds(&[f64::NAN]), None);
    }
}
