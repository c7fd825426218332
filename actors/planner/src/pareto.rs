//! The Pareto set of scored strategies: those no other beats on one objective without
//! losing on another. Figures are compared at 10 significant bits (about 0.1%), so
//! strategies that differ below the model's own precision count as equal; of equal ones the set
//! keeps the one with the fewest active chips (then the first in strategy order), so
//! the same space gives the same set however it was walked.

use serde::Serialize;

use crate::{Figures, Strategy};

/// A strategy and its figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub strategy: Strategy,
    pub figures: Figures,
}

impl Candidate {
    /// The objectives, each to be minimised, at 10 significant bits.
    fn key(&self) -> [f64; 5] {
        let f = &self.figures;
        [-f.goodput_rps, f.ttft_p90_s, f.tpot_p90_s, f.usd_per_million_tokens, f.joules_per_request].map(coarse)
    }

    fn active(&self) -> u32 {
        self.strategy.roles.iter().map(|r| r.active()).sum()
    }

    /// Which of two with equal figures stays.
    fn preferred_to(&self, other: &Candidate) -> bool {
        (self.active(), &self.strategy) < (other.active(), &other.strategy)
    }
}

/// `x` rounded to 10 significant bits (its mantissa's top 10, to nearest): a relative
/// step of about 0.1%, and cheap.
fn coarse(x: f64) -> f64 {
    const DROP: u32 = 52 - 10;
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let bits = x.to_bits() + (1u64 << (DROP - 1));
    f64::from_bits(bits & !((1u64 << DROP) - 1))
}

/// Whether `a` is at least as good as `b` everywhere and better somewhere.
fn dominates(a: &[f64; 5], b: &[f64; 5]) -> bool {
    a.iter().zip(b).all(|(x, y)| x <= y) && a != b
}

/// A Pareto set, built one candidate at a time.
#[derive(Debug, Clone, Default)]
pub struct Frontier {
    members: Vec<(Candidate, [f64; 5])>,
    /// The member that last turned a candidate away: tried first, as the next
    /// candidate of a scan is likely to lose to it too.
    hint: usize,
}

impl Frontier {
    /// Adds `candidate` unless a member dominates or equals it (and is preferred);
    /// drops the members it dominates.
    pub fn offer(&mut self, candidate: Candidate) {
        let key = candidate.key();
        let beaten_by = |(member, member_key): &(Candidate, [f64; 5])| {
            dominates(member_key, &key) || (*member_key == key && !candidate.preferred_to(member))
        };
        if self.members.get(self.hint).is_some_and(beaten_by) {
            return;
        }
        if let Some(i) = self.members.iter().position(beaten_by) {
            self.hint = i;
            return;
        }
        if self.members.iter().any(|(_, k)| dominates(&key, k) || *k == key) {
            self.members.retain(|(_, k)| !dominates(&key, k) && *k != key);
        }
        self.members.push((candidate, key));
    }

    /// The set, best goodput first (then lowest cost per token, then strategy order).
    pub fn into_sorted(self) -> Vec<Candidate> {
        let mut members: Vec<Candidate> = self.members.into_iter().map(|(c, _)| c).collect();
        members.sort_by(|a, b| {
            b.figures
                .goodput_rps
                .total_cmp(&a.figures.goodput_rps)
                .then(a.figures.usd_per_million_tokens.total_cmp(&b.figures.usd_per_million_tokens))
                .then(a.strategy.cmp(&b.strategy))
        });
        members
    }
}
