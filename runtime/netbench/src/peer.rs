//! Peer processes of the benchmarks (`bench bus`, `bench transfer`): how they are
//! stopped, whatever way the benchmark ends.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `program prefix.. args..` with piped stdin (closing it stops the peer) and
/// stdout (where it reports what it bound), stderr shared with ours.
pub(crate) fn spawn_peer_process(program: &Path, prefix: &[String], args: Vec<String>) -> std::io::Result<Child> {
    Command::new(program)
        .args(prefix)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
}

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
