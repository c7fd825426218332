//! A tenant's quotas over sliding 60 s windows: requests per minute, tokens per minute
//! (prompt + output), sequences in flight, and the largest `max_tokens`.
//!
//! A request reserves its worst case when admitted — its prompt plus `max_tokens` for
//! each sequence — and gets back what it did not use when it ends, so the tokens charged
//! in any window never exceed the limit: a tenant can overshoot only by what the window
//! cannot see (nothing, as charges are made before the work).

use std::collections::VecDeque;
use std::time::Duration;
use tessera_actor_core::Moment;
use tessera_topology::TenantLimits;

/// The window every per-minute limit is counted over.
pub const WINDOW: Duration = Duration::from_secs(60);

/// What an admission asks of a tenant's quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub sequences: usize,
    pub prompt_tokens: usize,
    /// Per sequence.
    pub max_tokens: usize,
}

impl Ask {
    /// The tokens it reserves: the prompt once (its KV is shared by its sequences) and
    /// `max_tokens` per sequence.
    pub fn worst_case_tokens(&self) -> u64 {
        self.prompt_tokens as u64 + self.max_tokens as u64 * self.sequences as u64
    }
}

/// Which limit refused a request, and what the client may read of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// A bounded label: `max_tokens`, `max_concurrent`, `requests_per_min`,
    /// `tokens_per_min`.
    pub limit: &'static str,
    pub message: String,
    /// Seconds until the same request would fit; `None`: it never will (it asks more
    /// than the limit allows at all).
    pub retry_after_s: Option<u32>,
}

/// One charge in the tokens window.
#[derive(Debug, Clone, Copy)]
struct Charge {
    at: Moment,
    request_id: u64,
    tokens: u64,
}

/// A tenant's use of its limits.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    inflight: usize,
    /// Admissions in the window: when, and how many sequences.
    requests: VecDeque<(Moment, u64)>,
    requests_in_window: u64,
    tokens: VecDeque<Charge>,
    tokens_in_window: u64,
}

/// Whole seconds from `now` until `at`, at least 1.
fn seconds_until(now: Moment, at: Moment) -> u32 {
    let wait = at.since(now).as_secs_f64().ceil();
    (wait as u32).max(1)
}

impl Ledger {
    fn expire(&mut self, now: Moment) {
        while let Some(&(at, n)) = self.requests.front() {
            if now.since(at) < WINDOW {
                break;
            }
            self.requests.pop_front();
            self.requests_in_window -= n;
        }
        while let Some(charge) = self.tokens.front() {
            if now.since(charge.at) < WINDOW {
                break;
            }
            self.tokens_in_window -= charge.tokens;
            self.tokens.pop_front();
        }
    }

    /// Checks `ask` against `limits` at `now` (`tenant` names the tenant in messages).
    pub fn check(&mut self, limits: &TenantLimits, tenant: &str, ask: Ask, now: Moment) -> Result<(), Refusal> {
        self.expire(now);
        if let Some(max) = limits.max_tokens.filter(|&max| ask.max_tokens > max) {
            return Err(Refusal {
                limit: "max_tokens",
                message: format!(
                    "max_tokens {} is over tenant `{tenant}`'s limit of {max} tokens per request; lower max_tokens",
                    ask.max_tokens
                ),
                retry_after_s: None,
            });
        }
        if let Some(max) = limits.max_concurrent.filter(|&max| self.inflight + ask.sequences > max) {
            return Err(Refusal {
                limit: "max_concurrent",
                message: if ask.sequences > max {
                    format!("{} sequences at once are over tenant `{tenant}`'s limit of {max}", ask.sequences)
                } else {
                    format!(
                        "tenant `{tenant}` has {} sequences in flight, its limit is {max}; retry when one ends",
                        self.inflight
                    )
                },
                retry_after_s: (ask.sequences <= max).then_some(1),
            });
        }
        let sequences = ask.sequences as u64;
        if let Some(max) = limits.requests_per_min.filter(|&max| self.requests_in_window + sequences > max) {
            let retry_after_s = (sequences <= max).then(|| {
                // When enough of the oldest admissions leave the window.
                let mut left = self.requests_in_window;
                let due = self.requests.iter().find(|&&(_, n)| {
                    left -= n;
                    left + sequences <= max
                });
                due.map_or(1, |&(at, _)| seconds_until(now, at.after(WINDOW)))
            });
            return Err(Refusal {
                limit: "requests_per_min",
                message: format!(
                    "tenant `{tenant}` reached its limit of {max} requests per minute ({} in the last 60 s){}",
                    self.requests_in_window,
                    retry_after_s.map_or_else(String::new, |s| format!("; retry in {s} s"))
                ),
                retry_after_s,
            });
        }
        let tokens = ask.worst_case_tokens();
        if let Some(max) = limits.tokens_per_min.filter(|&max| self.tokens_in_window + tokens > max) {
            let retry_after_s = (tokens <= max).then(|| {
                let mut left = self.tokens_in_window;
                let due = self.tokens.iter().find(|c| {
                    left -= c.tokens;
                    left + tokens <= max
                });
                due.map_or(1, |c| seconds_until(now, c.at.after(WINDOW)))
            });
            return Err(Refusal {
                limit: "tokens_per_min",
                message: format!(
                    "tenant `{tenant}` reached its limit of {max} tokens per minute: {} reserved in the last 60 s, \
                     this request reserves {tokens} (its prompt and max_tokens){}",
                    self.tokens_in_window,
                    retry_after_s.map_or_else(
                        || "; lower max_tokens or shorten the prompt".to_owned(),
                        |s| format!("; retry in {s} s")
                    )
                ),
                retry_after_s,
            });
        }
        Ok(())
    }

    /// Records an admitted sequence: `tokens` reserved for it.
    pub fn charge(&mut self, request_id: u64, tokens: u64, new_request: Option<u64>, now: Moment) {
        if let Some(sequences) = new_request {
            self.requests.push_back((now, sequences));
            self.requests_in_window += sequences;
        }
        self.tokens.push_back(Charge { at: now, request_id, tokens });
        self.tokens_in_window += tokens;
        self.inflight += 1;
    }

    /// A sequence ended: `unused` of its reserved tokens go back, if its charge is still
    /// in the window.
    pub fn refund(&mut self, request_id: u64, unused: u64) {
        self.inflight = self.inflight.saturating_sub(1);
        if let Some(charge) = self.tokens.iter_mut().rev().find(|c| c.request_id == request_id) {
            let back = unused.min(charge.tokens);
            charge.tokens -= back;
            self.tokens_in_window -= back;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: f64) -> Moment {
        Moment::default().after(Duration::from_secs_f64(s))
    }

    fn ask(prompt: usize, max_tokens: usize) -> Ask {
        Ask { sequences: 1, prompt_tokens: prompt, max_tokens }
    }

    /// (time s, ask or an end, expected: "ok" or the limit with its Retry-After)
    #[test]
    fn limits_refuse_with_the_time_until_the_request_fits() {
        let limits = TenantLimits {
            requests_per_min: Some(3),
            tokens_per_min: Some(1000),
            max_concurrent: Some(2),
            max_tokens: Some(500),
        };
        enum Step {
            Admit(u64, Ask),
            End(u64, u64),
        }
        use Step::*;
        let table: Vec<(f64, Step, &str)> = vec![
            (0.0, Admit(1, ask(100, 600)), "max_tokens never"),
            (0.0, Admit(1, ask(100, 300)), "ok"),
            (1.0, Admit(2, ask(100, 300)), "ok"),
            (2.0, Admit(3, ask(10, 10)), "max_concurrent 1"),
            (3.0, End(1, 250), ""), // used 50 of 300: 250 back, 150 stay charged
            (4.0, Admit(3, ask(100, 300)), "ok"),
            (5.0, End(2, 0), ""),
            (5.0, End(3, 0), ""),
            // Three admitted in the window: the fourth waits until the first leaves it.
            (10.0, Admit(4, ask(1, 1)), "requests_per_min 50"),
            (60.5, Admit(4, ask(100, 300)), "tokens_per_min 1"),
            (61.0, Admit(4, ask(100, 300)), "ok"),
            (61.0, Admit(5, ask(600, 500)), "tokens_per_min never"),
        ];
        let mut ledger = Ledger::default();
        for (i, (t, step, want)) in table.into_iter().enumerate() {
            match step {
                Admit(id, ask) => {
                    let got = match ledger.check(&limits, "a", ask, at(t)) {
                        Ok(()) => {
                            ledger.charge(id, ask.worst_case_tokens(), Some(1), at(t));
                            "ok".to_owned()
                        }
                        Err(r) => {
                            assert!(r.message.contains("tenant `a`"), "{}", r.message);
                            format!("{} {}", r.limit, r.retry_after_s.map_or("never".into(), |s| s.to_string()))
                        }
                    };
                    assert_eq!(got, want, "row {i}");
                }
                End(id, unused) => ledger.refund(id, unused),
            }
        }
    }

    #[test]
    fn charges_in_any_window_stay_within_the_limit() {
        let limits = TenantLimits { tokens_per_min: Some(2000), ..TenantLimits::default() };
        let mut ledger = Ledger::default();
        let mut admitted: Vec<(f64, u64)> = Vec::new();
        let mut t = 0.0;
        let mut id = 0;
        while t < 240.0 {
            let a = ask(50 + (id as usize * 37) % 200, 100);
            if ledger.check(&limits, "a", a, at(t)).is_ok() {
                ledger.charge(id, a.worst_case_tokens(), Some(1), at(t));
                // Each uses a third of its max_tokens.
                ledger.refund(id, 66);
                admitted.push((t, a.worst_case_tokens() - 66));
            }
            id += 1;
            t += 0.25;
        }
        for &(start, _) in &admitted {
            let used: u64 = admitted.iter().filter(|(s, _)| *s >= start && *s < start + 60.0).map(|(_, n)| n).sum();
            assert!(used <= 2000, "{used} tokens in the window from {start}");
        }
        assert!(admitted.iter().map(|(_, n)| n).sum::<u64>() > 3 * 2000, "the limit is used, not starved");
    }
}
