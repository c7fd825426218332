//! Latency summaries: mean and percentiles, with linear interpolation between closest
//! ranks (numpy's default, so figures compare with vLLM's benchmark_serving.py).

use serde::Serialize;
/// One definition of a percentile for the benchmark and the simulator, so that their
/// figures compare.
pub use tessera_workload::percentile;

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

#[cfg(test)]
mod tests {
    use super::*;

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
