//! Percentiles with linear interpolation between closest ranks (numpy's default, so
//! figures compare with vLLM's benchmark_serving.py): the one definition `bench serve`
//! and the simulator both report.

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
}
