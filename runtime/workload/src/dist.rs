//! Length distributions for prompts and outputs (`128`, `uniform:64-256`, `normal:128,32`)
//! and the seeded generator they are sampled from. Same seed, same run: the generator is
//! our own SplitMix64 so that no dependency upgrade can change a benchmark's requests.

use std::fmt;
use std::str::FromStr;

/// A token-length distribution. Every sample is at least 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LengthDist {
    Fixed(u32),
    /// Inclusive on both ends.
    Uniform {
        lo: u32,
        hi: u32,
    },
    /// Rounded to the nearest integer and clamped to at least 1.
    Normal {
        mean: f64,
        std: f64,
    },
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("bad length distribution {input:?}: {reason} (expected `128`, `uniform:64-256` or `normal:128,32`)")]
pub struct DistParseError {
    input: String,
    reason: &'static str,
}

impl FromStr for LengthDist {
    type Err = DistParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| DistParseError { input: s.to_string(), reason };
        let s_trim = s.trim();
        let (kind, params) = match s_trim.split_once(':') {
            Some((k, p)) => (k.trim(), p.trim()),
            None => ("fixed", s_trim),
        };
        let positive = |v: &str| match v.trim().parse::<u32>() {
            Ok(0) => Err(err("lengths must be at least 1")),
            Ok(n) => Ok(n),
            Err(_) => Err(err("not a positive integer")),
        };
        match kind {
            "fixed" => Ok(LengthDist::Fixed(positive(params)?)),
            "uniform" => {
                let (lo, hi) = params.split_once('-').ok_or_else(|| err("uniform needs LO-HI"))?;
                let (lo, hi) = (positive(lo)?, positive(hi)?);
                if lo > hi {
                    return Err(err("uniform needs LO <= HI"));
                }
                Ok(LengthDist::Uniform { lo, hi })
            }
            "normal" => {
                let (mean, std) = params.split_once(',').ok_or_else(|| err("normal needs MEAN,STD"))?;
                let mean: f64 = mean.trim().parse().map_err(|_| err("mean is not a number"))?;
                let std: f64 = std.trim().parse().map_err(|_| err("std is not a number"))?;
                if !(mean.is_finite() && std.is_finite() && mean >= 1.0 && std >= 0.0) {
                    return Err(err("normal needs MEAN >= 1 and STD >= 0"));
                }
                Ok(LengthDist::Normal { mean, std })
            }
            _ => Err(err("unknown distribution")),
        }
    }
}

impl fmt::Display for LengthDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LengthDist::Fixed(n) => write!(f, "{n}"),
            LengthDist::Uniform { lo, hi } => write!(f, "uniform:{lo}-{hi}"),
            LengthDist::Normal { mean, std } => write!(f, "normal:{mean},{std}"),
        }
    }
}

impl LengthDist {
    pub fn sample(&self, rng: &mut SeededRng) -> u32 {
        match *self {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { lo, hi } => lo + rng.below(u64::from(hi - lo) + 1) as u32,
            LengthDist::Normal { mean, std } => {
                let x = (mean + std * rng.standard_normal()).round();
                // `as` saturates, so huge draws land on u32::MAX rather than wrapping.
                (x.max(1.0) as u32).max(1)
            }
        }
    }
}

/// SplitMix64: tiny, fast, and good enough for choosing lengths, words and arrival gaps.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: never 0, so `ln` of it is finite.
    pub fn unit_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n); `n` must be positive. The modulo bias is below 2^-40 for the
    /// small ranges used here.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Box–Muller; one of the pair is dropped, which costs nothing that matters here.
    pub fn standard_normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit_open0(), self.unit_open0());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Exponential with the given rate (mean `1 / rate`): Poisson-process inter-arrival gaps.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -self.unit_open0().ln() / rate
    }

    /// Gamma with shape `k` > 0 and scale 1 (Marsaglia and Tsang's method; a shape below
    /// 1 is drawn at `k + 1` and scaled by `U^(1/k)`).
    pub fn gamma(&mut self, k: f64) -> f64 {
        if k < 1.0 {
            let u = self.unit_open0();
            return self.gamma(k + 1.0) * u.powf(1.0 / k);
        }
        let d = k - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.standard_normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.unit_open0();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms_and_rejects_the_rest() {
        let cases: &[(&str, Option<LengthDist>)] = &[
            ("128", Some(LengthDist::Fixed(128))),
            (" 7 ", Some(LengthDist::Fixed(7))),
            ("fixed:5", Some(LengthDist::Fixed(5))),
            ("uniform:64-256", Some(LengthDist::Uniform { lo: 64, hi: 256 })),
            ("uniform:8-8", Some(LengthDist::Uniform { lo: 8, hi: 8 })),
            ("normal:128,32", Some(LengthDist::Normal { mean: 128.0, std: 32.0 })),
            ("normal:100.5, 0", Some(LengthDist::Normal { mean: 100.5, std: 0.0 })),
            ("0", None),
            ("-3", None),
            ("abc", None),
            ("", None),
            ("uniform:256-64", None),
            ("uniform:0-10", None),
            ("uniform:64", None),
            ("normal:128", None),
            ("normal:128,-1", None),
            ("normal:0.5,1", None),
            ("normal:nan,1", None),
            ("zipf:1.1", None),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<LengthDist>().ok(), *want, "input {input:?}");
        }
    }

    #[test]
    fn display_round_trips() {
        for s in ["128", "uniform:64-256", "normal:128,32"] {
            assert_eq!(s.parse::<LengthDist>().map(|d| d.to_string()), Ok(s.to_string()));
        }
    }

    #[test]
    fn samples_stay_in_range() {
        let mut rng = SeededRng::new(7);
        let uniform = LengthDist::Uniform { lo: 3, hi: 6 };
        let mut seen = [false; 4];
        for _ in 0..1000 {
            let x = uniform.sample(&mut rng);
            assert!((3..=6).contains(&x), "{x}");
            seen[(x - 3) as usize] = true;
        }
        assert_eq!(seen, [true; 4], "both ends of a uniform range are reachable");
        assert_eq!(LengthDist::Fixed(9).sample(&mut rng), 9);
        // A normal far below 1 is clamped, not wrapped.
        let low = LengthDist::Normal { mean: 1.0, std: 1000.0 };
        assert!((0..1000).all(|_| low.sample(&mut rng) >= 1));
    }

    #[test]
    fn normal_and_exponential_have_the_asked_moments() {
        let mut rng = SeededRng::new(42);
        let n = 20_000;
        let normal = LengthDist::Normal { mean: 128.0, std: 32.0 };
        let xs: Vec<f64> = (0..n).map(|_| f64::from(normal.sample(&mut rng))).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let std = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
        assert!((mean - 128.0).abs() < 1.0, "mean {mean}");
        assert!((std - 32.0).abs() < 1.0, "std {std}");
        let gaps_mean = (0..n).map(|_| rng.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((gaps_mean - 0.25).abs() < 0.01, "mean gap {gaps_mean}");
    }

    #[test]
    fn same_seed_same_sequence() {
        let (mut a, mut b) = (SeededRng::new(1), SeededRng::new(1));
        let sa: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        let sb: Vec<u64> = (0..5).map(|_| b.next_u64()).collect();
        assert_eq!(sa, sb);
        let mut c = SeededRng::new(2);
        assert_ne!(sa, (0..5).map(|_| c.next_u64()).collect::<Vec<_>>());
    }
}
