//! Circuit breakers: which chips take no new requests for now.
//!
//! - **KV**: a chip whose pool holds more than the threshold (default 90%) of its blocks
//!   for running sequences takes nothing new until a heartbeat shows it below again.
//! - **Errors**: a chip that failed requests [`ErrorBreaker::FAILURES`] times within
//!   [`ErrorBreaker::WINDOW`] (it went down under them, or its requests left it for
//!   another chip) opens: no requests for a cooldown (5 s, doubling on each failed
//!   probe up to 60 s). Then it is half-open: it takes one request, the probe. The
//!   probe's success (it left the chip released, not failed) closes the breaker; its
//!   failure opens it again.

use std::collections::VecDeque;
use std::time::Duration;
use tessera_actor_core::Moment;

/// Where an error breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    /// No new requests until the cooldown is over.
    Open {
        until: Moment,
    },
    /// One request (`probe`, once placed) decides.
    HalfOpen {
        probe: Option<u64>,
    },
}

impl BreakerState {
    /// As the `tessera_router_breaker_state` gauge shows it.
    pub fn gauge(&self) -> f64 {
        match self {
            BreakerState::Closed => 0.0,
            BreakerState::Open { .. } => 1.0,
            BreakerState::HalfOpen { .. } => 2.0,
        }
    }
}

/// One chip's error breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorBreaker {
    state: BreakerState,
    /// When recent failures happened (within the window).
    failures: VecDeque<Moment>,
    /// The cooldown of the next opening.
    cooldown: Duration,
}

impl Default for ErrorBreaker {
    fn default() -> Self {
        ErrorBreaker { state: BreakerState::Closed, failures: VecDeque::new(), cooldown: Self::COOLDOWN }
    }
}

impl ErrorBreaker {
    /// Failures within [`Self::WINDOW`] that open the breaker.
    pub const FAILURES: usize = 3;
    pub const WINDOW: Duration = Duration::from_secs(30);
    /// The first cooldown, and the longest.
    pub const COOLDOWN: Duration = Duration::from_secs(5);
    pub const MAX_COOLDOWN: Duration = Duration::from_secs(60);

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether the chip may take a new request now (as of the last [`Self::poll`]).
    pub fn admits(&self) -> bool {
        matches!(self.state, BreakerState::Closed | BreakerState::HalfOpen { probe: None })
    }

    /// A request failed on the chip at `now`. True when the state changed.
    pub fn failure(&mut self, now: Moment) -> bool {
        match self.state {
            BreakerState::Open { .. } => false,
            BreakerState::HalfOpen { .. } => {
                // The probe (or anything placed before the opening) failed: back off longer.
                self.cooldown = (self.cooldown * 2).min(Self::MAX_COOLDOWN);
                self.state = BreakerState::Open { until: now.after(self.cooldown) };
                true
            }
            BreakerState::Closed => {
                self.failures.push_back(now);
                while self.failures.front().is_some_and(|&t| now.since(t) > Self::WINDOW) {
                    self.failures.pop_front();
                }
                if self.failures.len() < Self::FAILURES {
                    return false;
                }
                self.failures.clear();
                self.state = BreakerState::Open { until: now.after(self.cooldown) };
                true
            }
        }
    }

    /// Request `request_id` left the chip without failing. True when the state changed.
    pub fn success(&mut self, request_id: u64) -> bool {
        if self.state != (BreakerState::HalfOpen { probe: Some(request_id) }) {
            return false;
        }
        self.state = BreakerState::Closed;
        self.cooldown = Self::COOLDOWN;
        true
    }

    /// Request `request_id` was placed on the chip: a half-open breaker's probe.
    pub fn placed(&mut self, request_id: u64) {
        if self.state == (BreakerState::HalfOpen { probe: None }) {
            self.state = BreakerState::HalfOpen { probe: Some(request_id) };
        }
    }

    /// Moves an open breaker whose cooldown is over to half-open. True when it did.
    pub fn poll(&mut self, now: Moment) -> bool {
        match self.state {
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen { probe: None };
                true
            }
            _ => false,
        }
    }

    /// When an open breaker's cooldown ends.
    pub fn reopens_at(&self) -> Option<Moment> {
        match self.state {
            BreakerState::Open { until } => Some(until),
            _ => None,
        }
    }
}

/// Whether a pool holding `used` of `total` blocks is at or past `percent` percent full
/// (a pool of no known size never is).
pub fn kv_full(used: usize, total: usize, percent: u32) -> bool {
    total > 0 && used as u128 * 100 >= total as u128 * percent as u128
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Moment {
        Moment(ms * 1_000_000)
    }

    #[test]
    fn error_breaker_transitions() {
        use BreakerState::*;
        let mut b = ErrorBreaker::default();
        // Two failures, and one more after the window: still closed.
        assert!(!b.failure(at(0)));
        assert!(!b.failure(at(1_000)));
        assert!(!b.failure(at(31_500)));
        assert_eq!(b.state(), Closed);
        assert!(b.admits());
        // A third within 30 s of two others opens it for 5 s.
        assert!(!b.failure(at(32_000)));
        assert!(b.failure(at(33_000)));
        assert_eq!(b.state(), Open { until: at(38_000) });
        assert!(!b.admits());
        assert!(!b.failure(at(34_000)), "open: failures change nothing");
        assert!(!b.poll(at(37_999)));
        assert!(b.poll(at(38_000)));
        assert_eq!(b.state(), HalfOpen { probe: None });
        assert!(b.admits(), "half-open takes one probe");
        b.placed(7);
        assert!(!b.admits(), "and only one");
        b.placed(8);
        assert_eq!(b.state(), HalfOpen { probe: Some(7) });
        // The probe fails: open again, for twice as long.
        assert!(b.failure(at(39_000)));
        assert_eq!(b.state(), Open { until: at(49_000) });
        assert!(b.poll(at(49_000)));
        b.placed(10);
        assert!(!b.success(8), "only the probe decides");
        assert!(b.success(10));
        assert_eq!(b.state(), Closed);
        // Closed again with the cooldown reset.
        for t in [50_000, 50_001, 50_002] {
            b.failure(at(t));
        }
        assert_eq!(b.state(), Open { until: at(55_002) });
    }

    #[test]
    fn cooldown_doubles_up_to_a_minute() {
        let mut b = ErrorBreaker::default();
        let mut now = at(0);
        for _ in 0..ErrorBreaker::FAILURES {
            b.failure(now);
        }
        let mut cooldowns = Vec::new();
        for _ in 0..6 {
            let until = b.reopens_at().expect("open");
            cooldowns.push(until.since(now).as_secs());
            now = until;
            assert!(b.poll(now));
            b.placed(1);
            assert!(b.failure(now));
        }
        assert_eq!(cooldowns, vec![5, 10, 20, 40, 60, 60]);
    }

    #[test]
    fn kv_breaker_threshold() {
        let table = [
            (0, 0, 90, false),
            (89, 100, 90, false),
            (90, 100, 90, true),
            (8, 8, 90, true),
            (7, 8, 90, false),
            (usize::MAX, usize::MAX, 100, true),
        ];
        for (used, total, percent, full) in table {
            assert_eq!(kv_full(used, total, percent), full, "{used}/{total} at {percent}%");
        }
    }
}
