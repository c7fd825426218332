//! Token sampling on the host: greedy, temperature, top-k and top-p with a seeded
//! generator, so that a request with a seed samples the same tokens on every run and
//! every chip.

use crate::error::{BackendError, Result};

/// How one request picks its tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
    /// 1.0 = no nucleus cut.
    pub top_p: f32,
    /// Seed of the sampling generator; None = fresh entropy.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Changes to the logits before a token is picked (greedy or not).
    pub penalties: Penalties,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            penalties: Penalties::default(),
        }
    }
}

/// What a request does to the logits before a token is picked, in this order (as vLLM
/// applies them): `logit_bias` added; the `suppress` tokens ruled out until `min_tokens`
/// tokens are generated; the repetition penalty on every token of the prompt and the
/// output (a positive logit divided by it, a negative one multiplied); then, per output
/// token seen `c` times, `frequency × c + presence` subtracted (OpenAI's definition).
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1 = off.
    pub repetition: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub min_tokens: usize,
    /// Tokens that would end the sequence (stop ids and end-of-sequence).
    pub suppress: Vec<u32>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            suppress: Vec::new(),
        }
    }
}

impl Penalties {
    /// Changes no logit.
    pub fn is_neutral(&self) -> bool {
        self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
            && self.logit_bias.is_empty()
            && (self.min_tokens == 0 || self.suppress.is_empty())
    }

    /// Whether a sampler must know the tokens before it (the prompt, the output).
    pub fn needs_history(&self) -> bool {
        self.repetition != 1.0 || self.frequency != 0.0 || self.presence != 0.0
    }
}

/// The tokens a sampler has seen: counts of each output token, and every prompt token
/// (for the repetition penalty).
#[derive(Debug, Clone, Default)]
struct History {
    prompt: std::collections::HashSet<u32>,
    output: std::collections::HashMap<u32, u32>,
    generated: usize,
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams { max_tokens, ..Default::default() }
    }

    /// Refuses parameters outside their domain, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(BackendError::Request(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(BackendError::Request(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if self.max_tokens == 0 {
            return Err(BackendError::Request("max_tokens must be at least 1".into()));
        }
        let p = &self.penalties;
        if !(p.repetition > 0.0 && p.repetition.is_finite()) {
            return Err(BackendError::Request(format!("repetition penalty must be > 0, got {}", p.repetition)));
        }
        if !(p.presence.is_finite() && p.frequency.is_finite() && p.logit_bias.iter().all(|(_, b)| b.is_finite())) {
            return Err(BackendError::Request("penalties and logit biases must be finite".into()));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// xoshiro256** seeded through SplitMix64: small, fast, and stable forever (results
/// must not change with a dependency's version).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn seeded(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(u64::from(std::process::id()));
        Rng::seeded(h.finish())
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Index of the largest logit; the lowest index wins ties and NaNs are skipped (as the
/// kernels' argmax). 0 for a row without a number.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Log-probabilities under one row of raw logits (a log-softmax in f64): `token`'s, and
/// the `k` most likely tokens' (highest first, ties to the lower id). A NaN logit has
/// probability 0 (log-probability -inf).
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return (f32::NEG_INFINITY, Vec::new());
    }
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { (l as f64 - lse) as f32 };
    let own = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    // The k best by a bounded insertion: k is at most a few dozen.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() || (top.len() == k && top.last().is_some_and(|&(_, worst)| l <= worst)) {
                continue;
            }
            let at = top.partition_point(|&(_, v)| v >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    (own, top.into_iter().map(|(i, l)| (i, lp(l))).collect())
}

/// One request's sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    history: History,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = params.seed.map_or_else(Rng::from_entropy, Rng::seeded);
        Sampler { params, rng, history: History::default() }
    }

    /// A sampler whose sequence has `prompt` and generated `output` already (a
    /// replay), for the penalties to count; [`Sampler::skip`] then says how many tokens
    /// came before.
    pub fn with_history(params: SamplingParams, prompt: &[u32], output: &[u32]) -> Self {
        let mut s = Sampler::new(params);
        if s.params.penalties.needs_history() {
            s.history.prompt.extend(prompt);
            for &t in output {
                *s.history.output.entry(t).or_default() += 1;
            }
        }
        s
    }

    /// `logits` after this request's penalties (see [`Penalties`]); `None` when they
    /// change nothing.
    pub fn penalized(&self, logits: &[f32]) -> Option<Vec<f32>> {
        let p = &self.params.penalties;
        if p.is_neutral() {
            return None;
        }
        let mut out = logits.to_vec();
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = out.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.history.generated < p.min_tokens {
            for &id in &p.suppress {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition != 1.0 {
            let output_only = self.history.output.keys().filter(|id| !self.history.prompt.contains(id));
            for &id in self.history.prompt.iter().chain(output_only) {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
                }
            }
        }
        if p.frequency != 0.0 || p.presence != 0.0 {
            for (&id, &count) in &self.history.output {
                if let Some(l) = out.get_mut(id as usize) {
                    *l -= p.frequency * count as f32 + p.presence;
                }
            }
        }
        Some(out)
    }

    /// Picks the next token from one row of raw logits, after the penalties, and
    /// counts it.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = match self.penalized(logits) {
            Some(adjusted) => self.pick(&adjusted),
            None => self.pick(logits),
        };
        if self.params.penalties.needs_history() {
            *self.history.output.entry(token).or_default() += 1;
        }
        self.history.generated += 1;
        token
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Advances the generator past `samples` earlier draws, so a request replayed on
    /// another chip continues the random sequence it had (one draw per sampled token),
    /// and counts those tokens as generated (`min_tokens`).
    pub fn skip(&mut self, samples: u64) {
        self.history.generated += samples as usize;
        if !self.params.is_greedy() {
            for _ in 0..samples {
                self.rng.next_f64();
            }
        }
    }

    /// Picks a token from one row of logits.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        // In f64 and relative to the maximum, so that even a tiny temperature gives a
        // finite distribution (its limit: the greedy token) instead of inf - inf.
        let t = self.params.temperature as f64;
        let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, if l.is_nan() { f64::NEG_INFINITY } else { (l as f64 - max as f64) / t }))
            .collect();
        // Highest first; ties by lower id so the order never depends on the sort.
        let by_logit = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit);
            cand.truncate(k);
        }
        cand.sort_unstable_by(by_logit);
        let mut probs: Vec<f64> = cand.iter().map(|c| c.1.exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    cum += p;
                    cum >= self.params.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.next_f64() * total;
        for (i, p) in probs.iter().enumerate() {
            if r < *p {
                return cand[i].0;
            }
            r -= p;
        }
        // Rounding left r at the end: take the last token that had any mass.
        cand[probs.iter().rposition(|&p| p > 0.0).unwrap_or(0)].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each penalty against its definition on a hand-computed table.
    #[test]
    fn penalties_change_the_logits_as_defined() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, 1.0];
        let with = |penalties: Penalties, prompt: &[u32], output: &[u32]| {
            let params = SamplingParams { penalties, ..SamplingParams::greedy(8) };
            Sampler::with_history(params, prompt, output).penalized(&logits)
        };
        assert_eq!(with(Penalties::default(), &[0, 1], &[3]), None, "neutral: unchanged");
        let bias = Penalties { logit_bias: vec![(1, 5.0), (4, -100.0), (99, 1.0)], ..Penalties::default() };
        assert_eq!(with(bias, &[], &[]), Some(vec![2.0, 4.0, 0.5, 3.0, -99.0]), "ids past the vocabulary ignored");
        // Repetition 2 on prompt {0, 1} and output {3}: positives halve, negatives double.
        let rep = Penalties { repetition: 2.0, ..Penalties::default() };
        assert_eq!(with(rep, &[0, 1], &[3]), Some(vec![1.0, -2.0, 0.5, 1.5, 1.0]));
        // Frequency 0.5 and presence 1 on output [3, 3, 2]: 3 seen twice, 2 once; the
        // prompt does not count.
        let fp = Penalties { frequency: 0.5, presence: 1.0, ..Penalties::default() };
        assert_eq!(with(fp, &[0], &[3, 3, 2]), Some(vec![2.0, -1.0, -1.0, 1.0, 1.0]));
        // min_tokens rules out the stop tokens until that many are generated.
        let min = Penalties { min_tokens: 2, suppress: vec![3], ..Penalties::default() };
        let params = SamplingParams { penalties: min, ..SamplingParams::greedy(8) };
        let mut s = Sampler::with_history(params, &[], &[7]);
        s.skip(1);
        assert_eq!(s.sample(&logits), 0, "one generated before: 3 is still ruled out");
        assert_eq!(s.sample(&logits), 3, "two generated: allowed again");
        // Greedy sampling follows the penalties; the counts grow with each token.
        let params = SamplingParams {
            penalties: Penalties { frequency: 1.5, ..Penalties::default() },
            ..SamplingParams::greedy(8)
        };
        let mut s = Sampler::new(params);
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&logits)).collect();
        assert_eq!(picks, vec![3, 0, 3], "3 (3.0), then 0 (2.0 > 1.5), then 3 again (1.5 > 0.5)");
    }

    #[test]
    fn logprobs_are_a_log_softmax_of_the_raw_logits_with_the_best_first() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let (own, top) = logprobs(&logits, 4, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|l| l.exp()).sum();
        let lp = |l: f64| (l - z.ln()) as f32;
        assert!((own - lp(-2.0)).abs() < 1e-6, "{own}");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 0], "ties to the lower id");
        for (id, v) in &top {
            assert!((v - lp(logits[*id as usize] as f64)).abs() < 1e-6);
        }
        let total: f64 = [0usize, 1, 3, 4].iter().map(|&i| (lp(logits[i] as f64) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(logprobs(&logits, 2, 0), (f32::NEG_INFINITY, vec![]), "NaN: no mass; k = 0: no list");
        assert_eq!(logprobs(&logits, 1, 9).1.len(), 4, "at most the tokens with a number");
        // Large logits stay finite (computed relative to the maximum).
        let (big, _) = logprobs(&[1e30, 0.0], 0, 1);
        assert_eq!(big, 0.0);
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            max_tokens: 1,
            stop_token_ids: vec![],
            ignore_eos: false,
            penalties: Penalties::default(),
        }
    }

    #[test]
    fn tiny_temperatures_and_nans_stay_sane() {
        let logits = [0.5, 3.0, f32::NAN, 2.9, -1.0];
        assert_eq!(argmax(&logits), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
        for t in [1e-39, 1e-20, 1e-6] {
            let mut s = Sampler::new(params(t, 0, 1.0, 3));
            for _ in 0..50 {
                assert_eq!(s.sample(&logits), 1, "temperature {t}");
            }
        }
        let mut s = Sampler::new(params(1.0, 0, 0.9, 3));
        for _ in 0..200 {
            assert_ne!(s.sample(&logits), 2, "a NaN logit is never sampled");
        }
    }

    #[test]
    fn greedy_takes_lowest_index_of_max() {
        let mut s = Sampler::new(params(0.0, 0, 1.0, 0));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_seeds_differ() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed));
            (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        // Table: (top_k, top_p, allowed ids). Logits make id 3 > 2 > 1 > 0 > rest.
        let logits = [2.0, 3.0, 4.0, 5.0, -9.0, -9.0];
        let cases: &[(usize, f32, &[u32])] = &[(2, 1.0, &[2, 3]), (0, 0.5, &[3]), (3, 0.9, &[1, 2, 3]), (1, 1.0, &[3])];
        for &(k, p, allowed) in cases {
            let mut s = Sampler::new(params(1.0, k, p, 1));
            for _ in 0..200 {
                let t = s.sample(&logits);
                assert!(allowed.contains(&t), "top_k={k} top_p={p} sampled {t}");
            }
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]
        let logits = [0.0, 3f32.ln()];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 42));
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn validation_names_the_field() {
        let cases = [
            (SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
            (SamplingParams { max_tokens: 0, ..Default::default() }, "max_tokens"),
        ];
        for (p, field) in cases {
            assert!(p.validate().unwrap_err().to_string().contains(field));
        }
    }
}
