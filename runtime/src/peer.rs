//! Peer processes of the benchmarks (`bench bus`, `bench transfer`): how they are
//! stopped, whatever way the benchmark ends.

use std::process::Child;
use std::time::{Duration, Instant};

/// Closes the peer's stdin (which asks it to stop), waits up to 3 s, then kills it.
pub(crate) fn stop_peer_process(child: &mut Child, what: &str) {
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => break,
        }
    }
    if let Err(e) = child.kill() {
        tracing::warn!("cannot kill the {what} (pid {}): {e}", child.id());
    }
    let _ = child.wait();
}
