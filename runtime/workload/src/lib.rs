//! The workload model of a serving benchmark: token-length distributions, arrival
//! processes (open-loop Poisson or a closed loop of fixed concurrency), synthetic prompts,
//! and a seeded plan of every request decided before a run starts (of a multi-turn chat,
//! every user message and answer length; the answers' text is the server's). `tessera bench serve`
//! drives it over HTTP; the simulator replays the same plan in virtual time.
//!
//! Pure: it must not depend on any I/O, async runtime, HTTP client or clock — a plan is a
//! function of its seed and options alone.
#![forbid(unsafe_code)]

mod dist;
pub mod multiturn;
mod stats;
pub mod trace;

use std::sync::LazyLock;

pub use dist::{DistParseError, LengthDist, SeededRng};
pub use multiturn::{Conversation, MultiTurn};
pub use stats::percentile;

/// Requests in flight when neither a rate nor a concurrency is given.
pub const DEFAULT_CONCURRENCY: usize = 8;

/// Options that describe no workload.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct WorkloadError(pub String);

/// How requests are released.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Open loop: Poisson arrivals at this many requests per second, whatever the server does.
    Poisson { rate_rps: f64 },
    /// Closed loop: a new request as soon as one of this many in flight finishes.
    Closed { concurrency: usize },
}

impl Load {
    /// From the `--rate` / `--concurrency` flags: at most one of them, default closed loop
    /// with [`DEFAULT_CONCURRENCY`].
    pub fn from_flags(rate_rps: Option<f64>, concurrency: Option<usize>) -> Result<Load, WorkloadError> {
        let bad = |m: String| Err(WorkloadError(m));
        match (rate_rps, concurrency) {
            (Some(_), Some(_)) => bad("give --rate or --concurrency, not both".into()),
            (Some(r), None) if r.is_finite() && r > 0.0 => Ok(Load::Poisson { rate_rps: r }),
            (Some(r), None) => bad(format!("--rate must be positive, got {r}")),
            (None, Some(0)) => bad("--concurrency must be at least 1".into()),
            (None, Some(c)) => Ok(Load::Closed { concurrency: c }),
            (None, None) => Ok(Load::Closed { concurrency: DEFAULT_CONCURRENCY }),
        }
    }
}

/// A benchmark's requests, from its seed: the measured ones, the warm-up ones and the
/// arrival times each come from their own stream, so that changing `--warmup` or `--rate`
/// leaves the measured prompts alone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    pub isl: LengthDist,
    pub osl: LengthDist,
    pub load: Load,
    pub seed: u64,
    /// Requests in groups that share a system prompt (`None`: every prompt its own).
    pub shared: Option<SharedPrefix>,
}

/// `groups` system prompts of `words` words each; every request starts with one of them
/// (uniformly chosen) before its own `isl` words — what a prefix cache and a KV-aware
/// router have to find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedPrefix {
    pub groups: u32,
    pub words: u32,
}

impl Workload {
    /// The `n` measured requests.
    pub fn measured(&self, n: usize) -> Vec<PlannedRequest> {
        self.plan(n, &mut SeededRng::new(self.seed))
    }

    /// The `n` warm-up requests.
    pub fn warmup(&self, n: usize) -> Vec<PlannedRequest> {
        self.plan(n, &mut SeededRng::new(self.seed ^ 0x5741_524D_5550))
    }

    /// Release times in seconds from the start of the `n` measured requests of an open-loop
    /// load (the first at 0); empty for a closed loop, whose releases follow completions.
    pub fn arrivals_s(&self, n: usize) -> Vec<f64> {
        let Load::Poisson { rate_rps } = self.load else { return Vec::new() };
        self.times_after_gaps(n, |rng| rng.exponential(rate_rps))
    }

    /// Release times in seconds of `n` requests whose gaps are gamma distributed with mean
    /// `1 / rate_rps` and coefficient of variation `cv` (1 is Poisson; above 1, bursts), the
    /// first at 0; from the same stream as [`Self::arrivals_s`], so prefix-stable in `n`.
    pub fn gamma_arrivals_s(&self, n: usize, rate_rps: f64, cv: f64) -> Vec<f64> {
        let shape = 1.0 / (cv * cv);
        self.times_after_gaps(n, |rng| rng.gamma(shape) / (shape * rate_rps))
    }

    /// The stream every arrival process draws from: the arrivals' own, so that changing
    /// lengths or warm-up leaves them alone.
    fn arrivals_rng(&self) -> SeededRng {
        SeededRng::new(self.seed ^ 0x4152_5249_5641_4C53)
    }

    /// `n` times, the first at 0, each the last plus a `gap` drawn from the arrivals' stream.
    fn times_after_gaps(&self, n: usize, mut gap: impl FnMut(&mut SeededRng) -> f64) -> Vec<f64> {
        let mut rng = self.arrivals_rng();
        let mut t = 0.0;
        (0..n)
            .map(|_| {
                let at = t;
                t += gap(&mut rng);
                at
            })
            .collect()
    }

    /// Release times in seconds of `n` requests of a Poisson process whose rate follows
    /// `schedule`: (from second, requests per second) steps, the first from 0, in time
    /// order, each held until the next (the last for ever); the first request at 0. Exact:
    /// unit-rate exponential gaps mapped through the inverse of the cumulative rate.
    pub fn scheduled_arrivals_s(&self, n: usize, schedule: &[(f64, f64)]) -> Vec<f64> {
        let mut rng = self.arrivals_rng();
        let (mut step, mut at_step, mut total) = (0, 0.0, 0.0);
        (0..n)
            .map(|_| {
                // Whole steps the cumulative rate `total` has passed.
                while let (Some(&(from, rate)), Some(&(to, _))) = (schedule.get(step), schedule.get(step + 1)) {
                    let capacity = rate * (to - from);
                    if at_step + capacity > total {
                        break;
                    }
                    at_step += capacity;
                    step += 1;
                }
                let at = schedule.get(step).map_or(0.0, |&(from, rate)| from + (total - at_step) / rate.max(1e-12));
                total += rng.exponential(1.0);
                at
            })
            .collect()
    }

    /// The measured requests one at a time, as [`Self::measured`] plans them (its first
    /// `n` are `measured(n)`): for runs too long to hold every prompt at once.
    pub fn stream(&self) -> impl Iterator<Item = PlannedRequest> + Send + 'static {
        let workload = *self;
        let mut rng = SeededRng::new(self.seed);
        std::iter::repeat_with(move || workload.next_request(&mut rng))
    }

    /// [`Self::stream`]'s requests as their words' indices into [`vocabulary`] (with
    /// their output lengths), never made into text: what a simulator that gives each
    /// word one token id needs, at a fraction of the cost.
    pub fn stream_words(&self) -> impl Iterator<Item = (Vec<u16>, u32)> + Send + 'static {
        let workload = *self;
        let mut rng = SeededRng::new(self.seed);
        std::iter::repeat_with(move || {
            let (words, _, osl) = workload.next_words(&mut rng);
            (words, osl)
        })
    }

    fn plan(&self, n: usize, rng: &mut SeededRng) -> Vec<PlannedRequest> {
        (0..n).map(|_| self.next_request(rng)).collect()
    }

    fn next_request(&self, rng: &mut SeededRng) -> PlannedRequest {
        let (words, isl, osl) = self.next_words(rng);
        PlannedRequest { prompt: text_of(&words), isl, osl }
    }

    /// The next request's words (its group's shared prefix first, if any), its nominal
    /// prompt length and its output length.
    fn next_words(&self, rng: &mut SeededRng) -> (Vec<u16>, u32, u32) {
        let (isl, osl) = (self.isl.sample(rng), self.osl.sample(rng));
        let own = word_indices(isl, rng);
        let Some(shared) = self.shared else { return (own, isl, osl) };
        let group = rng.below(shared.groups.max(1) as u64);
        let mut words = self.system_prompt(group, shared.words);
        words.extend(own);
        (words, isl + shared.words, osl)
    }

    /// The system prompt of `group`: `words` words drawn from the seed and the group alone.
    fn system_prompt(&self, group: u64, words: u32) -> Vec<u16> {
        word_indices(words, &mut SeededRng::new(self.seed ^ ((group + 1) * 0x9e37_79b9)))
    }
}

/// Common English words, nearly all one token (with their leading space) in GPT-2-, Llama- and
/// Qwen-style BPE vocabularies, so a prompt of N of them is about N tokens. An approximation:
/// BOS and a chat template add a few, a rare split adds one; the report takes the server's
/// `usage.prompt_tokens`.
const WORDS: &str = "\
    the time people year way day man thing woman life child world school state family student group country \
    problem hand part place case week company system program question work government number night point home \
    water room mother area money story fact month lot right study book eye job word business issue side kind \
    head house service friend father power hour game line end member law car city community name president team \
    minute idea kid body information back parent face others level office door health person art war history \
    party result change morning reason research girl guy moment air teacher force education good new first last \
    long great little own other old big high different small large next early young important few public bad \
    same able make know take see come think look want give use find tell ask feel try leave call keep let begin \
    seem help show hear play run move live believe bring write sit stand lose pay meet include";

/// A request decided before the run starts, so that the load shape cannot change it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRequest {
    pub prompt: String,
    pub isl: u32,
    pub osl: u32,
}

impl PlannedRequest {
    /// A prompt of `isl` words drawn from `rng`, asking for `osl` tokens.
    pub fn new(isl: u32, osl: u32, rng: &mut SeededRng) -> Self {
        PlannedRequest { prompt: words_of(isl, rng), isl, osl }
    }
}

static VOCABULARY: LazyLock<Vec<&str>> = LazyLock::new(|| WORDS.split_whitespace().collect());

/// The words prompts are made of.
pub fn vocabulary() -> &'static [&'static str] {
    &VOCABULARY
}

/// `n` words drawn from `rng`, space-separated.
pub fn words_of(n: u32, rng: &mut SeededRng) -> String {
    text_of(&word_indices(n, rng))
}

/// `n` words drawn from `rng`, as indices into [`vocabulary`] ([`words_of`]'s words).
fn word_indices(n: u32, rng: &mut SeededRng) -> Vec<u16> {
    let len = VOCABULARY.len() as u64;
    (0..n).map(|_| rng.below(len) as u16).collect()
}

/// The words at `indices` of [`vocabulary`], space-separated.
pub(crate) fn text_of(indices: &[u16]) -> String {
    let mut text = String::with_capacity(indices.len() * 8);
    for (i, &w) in indices.iter().enumerate() {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(VOCABULARY[usize::from(w)]);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words a simulator draws are the text a client sends, request for request,
    /// shared prefixes included.
    #[test]
    fn the_word_stream_is_the_text_stream() {
        for shared in [None, Some(SharedPrefix { groups: 3, words: 40 })] {
            let workload = Workload {
                isl: LengthDist::Uniform { lo: 1, hi: 30 },
                osl: LengthDist::Uniform { lo: 1, hi: 9 },
                load: Load::Poisson { rate_rps: 1.0 },
                seed: 11,
                shared,
            };
            for (text, (words, osl)) in workload.stream().zip(workload.stream_words()).take(50) {
                assert_eq!(text.prompt, text_of(&words));
                assert_eq!(text.osl, osl);
            }
        }
    }

    #[test]
    fn prompts_have_the_asked_word_count_and_differ() {
        let mut rng = SeededRng::new(3);
        let a = PlannedRequest::new(100, 5, &mut rng);
        let b = PlannedRequest::new(100, 5, &mut rng);
        assert_eq!(a.prompt.split(' ').count(), 100);
        assert_ne!(a.prompt, b.prompt);
        assert_eq!((a.isl, a.osl), (100, 5));
    }

    #[test]
    fn the_stream_is_the_plan_one_request_at_a_time() {
        let w = Workload {
            isl: LengthDist::Uniform { lo: 5, hi: 50 },
            osl: LengthDist::Fixed(3),
            load: Load::Poisson { rate_rps: 2.0 },
            seed: 9,
            shared: Some(SharedPrefix { groups: 2, words: 4 }),
        };
        assert_eq!(w.stream().take(40).collect::<Vec<_>>(), w.measured(40));
    }

    #[test]
    fn shared_prefixes_start_the_prompts_of_a_group() {
        let shared = SharedPrefix { groups: 3, words: 50 };
        let w = Workload {
            isl: LengthDist::Fixed(10),
            osl: LengthDist::Fixed(2),
            load: Load::Closed { concurrency: 1 },
            seed: 5,
            shared: Some(shared),
        };
        let plan = w.measured(60);
        let prefixes: std::collections::BTreeSet<String> =
            plan.iter().map(|r| r.prompt.split(' ').take(50).collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(prefixes.len(), 3, "three system prompts");
        assert!(plan.iter().all(|r| r.isl == 60 && r.prompt.split(' ').count() == 60));
        let own: std::collections::BTreeSet<String> =
            plan.iter().map(|r| r.prompt.split(' ').skip(50).collect::<Vec<_>>().join(" ")).collect();
        assert_eq!(own.len(), 60, "each request's own words differ");
        assert_eq!(plan, w.measured(60), "reproducible");
    }

    /// A workload for its arrival times alone.
    fn arrivals_of(seed: u64) -> Workload {
        Workload {
            isl: LengthDist::Fixed(1),
            osl: LengthDist::Fixed(1),
            load: Load::Poisson { rate_rps: 1.0 },
            seed,
            shared: None,
        }
    }

    /// A rate schedule's steps hold their rates: 5/s for 100 s, then 20/s.
    #[test]
    fn scheduled_arrivals_follow_their_steps() {
        let w = arrivals_of(9);
        let schedule = [(0.0, 5.0), (100.0, 20.0)];
        let times = w.scheduled_arrivals_s(4000, &schedule);
        assert_eq!(times[0], 0.0);
        assert!(times.windows(2).all(|p| p[0] <= p[1]), "in time order");
        let first = times.iter().filter(|&&t| t < 100.0).count() as f64;
        let second = times.iter().filter(|&&t| (100.0..200.0).contains(&t)).count() as f64;
        assert!((first / 500.0 - 1.0).abs() < 0.1, "{first} in the first 100 s");
        assert!((second / 2000.0 - 1.0).abs() < 0.1, "{second} in the next 100 s");
        assert_eq!(w.scheduled_arrivals_s(10, &schedule), times[..10], "prefix-stable");
    }

    /// Gamma gaps keep the asked mean rate and coefficient of variation.
    #[test]
    fn gamma_arrivals_have_the_asked_rate_and_burstiness() {
        let w = arrivals_of(4);
        for (rate, cv) in [(10.0, 0.5), (10.0, 1.0), (4.0, 3.0)] {
            let times = w.gamma_arrivals_s(40_000, rate, cv);
            let gaps: Vec<f64> = times.windows(2).map(|p| p[1] - p[0]).collect();
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
            assert!((mean * rate - 1.0).abs() < 0.05, "rate {rate} cv {cv}: mean gap {mean}");
            assert!((var.sqrt() / mean / cv - 1.0).abs() < 0.1, "rate {rate} cv {cv}: cv {}", var.sqrt() / mean);
            assert_eq!(w.gamma_arrivals_s(10, rate, cv), times[..10], "prefix-stable");
        }
    }

    #[test]
    fn load_flags() {
        let cases = [
            (None, None, Some(Load::Closed { concurrency: DEFAULT_CONCURRENCY })),
            (None, Some(2), Some(Load::Closed { concurrency: 2 })),
            (Some(4.5), None, Some(Load::Poisson { rate_rps: 4.5 })),
            (Some(1.0), Some(2), None),
            (Some(0.0), None, None),
            (Some(f64::NAN), None, None),
            (None, Some(0), None),
        ];
        for (rate, concurrency, want) in cases {
            assert_eq!(Load::from_flags(rate, concurrency).ok(), want, "{rate:?} {concurrency:?}");
        }
    }

    #[test]
    fn streams_are_independent_and_reproducible() {
        let w = |load, seed| Workload {
            isl: LengthDist::Uniform { lo: 4, hi: 40 },
            osl: LengthDist::Fixed(3),
            load,
            seed,
            shared: None,
        };
        let open = w(Load::Poisson { rate_rps: 10.0 }, 7);
        let closed = w(Load::Closed { concurrency: 2 }, 7);
        assert_eq!(open.measured(5), closed.measured(5), "the load shape leaves the prompts alone");
        assert_ne!(open.measured(5), open.warmup(5));
        assert_ne!(open.measured(5), w(Load::Closed { concurrency: 2 }, 8).measured(5));
        let arrivals = open.arrivals_s(50);
        assert_eq!(arrivals, open.arrivals_s(50));
        assert_eq!(arrivals[0], 0.0);
        assert!(arrivals.windows(2).all(|p| p[0] <= p[1]));
        // 49 gaps of mean 0.1 s: far from 0 and from 10 s whatever the seed's luck.
        assert!((1.0..10.0).contains(&arrivals[49]), "{}", arrivals[49]);
        assert!(closed.arrivals_s(50).is_empty());
    }
}
