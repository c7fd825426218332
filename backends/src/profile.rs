//! Where a forward step's time goes: the wall time of every kernel op a [`Device`]
//! issues, summed per op, kept only while enabled (`tessera bench engine --profile`).
//! The CPU kernel library runs each op before it returns, so an op's wall time is its
//! cost; a library that queues work would be timed at its launch only.
//!
//! [`Device`]: crate::device::Device

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

static ENABLED: AtomicBool = AtomicBool::new(false);
static OPS: Mutex<BTreeMap<&'static str, (u64, Duration)>> = Mutex::new(BTreeMap::new());

/// Calls of one op and the wall time they took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpTime {
    pub op: String,
    pub calls: u64,
    pub seconds: f64,
}

/// Starts (or stops) keeping op times; what was kept stays until [`take`].
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// The op times kept since the last call, most time first; the record starts empty.
pub fn take() -> Vec<OpTime> {
    let taken = std::mem::take(&mut *OPS.lock().unwrap_or_else(|e| e.into_inner()));
    let mut out: Vec<OpTime> = taken
        .into_iter()
        .map(|(op, (calls, t))| OpTime { op: op.to_owned(), calls, seconds: t.as_secs_f64() })
        .collect();
    out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then_with(|| a.op.cmp(&b.op)));
    out
}

/// Times `op` until dropped, when profiling is on.
pub fn timed(op: &'static str) -> Timed {
    Timed { op, start: ENABLED.load(Ordering::Relaxed).then(Instant::now) }
}

pub struct Timed {
    op: &'static str,
    start: Option<Instant>,
}

impl Drop for Timed {
    fn drop(&mut self) {
        if let Some(start) = self.start {
            let mut ops = OPS.lock().unwrap_or_else(|e| e.into_inner());
            let entry = ops.entry(self.op).or_default();
            entry.0 += 1;
            entry.1 += start.elapsed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_timed_only_while_enabled_and_taken_once() {
        // The record is global: other tests' device ops may land in it while it is on,
        // so only this test's own op names are looked at.
        let own = |ops: Vec<OpTime>| -> Vec<(String, u64)> {
            ops.into_iter().filter(|o| o.op.starts_with("test_")).map(|o| (o.op, o.calls)).collect()
        };
        drop(timed("test_off"));
        enable(true);
        for _ in 0..3 {
            let _t = timed("test_a");
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(timed("test_b"));
        enable(false);
        drop(timed("test_later"));
        let got = take();
        let slept = got.iter().find(|o| o.op == "test_a").map_or(0.0, |o| o.seconds);
        assert!(slept >= 0.006, "{got:?}");
        assert_eq!(own(got), vec![("test_a".to_string(), 3), ("test_b".to_string(), 1)]);
        assert!(own(take()).is_empty(), "taken once");
    }
}
