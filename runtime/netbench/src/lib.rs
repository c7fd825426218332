//! The network benchmarks of the runtime, as an I/O adapter over its public API:
//! `tessera bench bus` (the ZeroMQ bus between two host processes against plain TCP
//! ping-pong), `tessera bench transfer` (the KV transfer engine against a plain
//! socket and memcpy) and `tessera bench relay` (an added-latency link for measuring
//! them, or a cluster, over a slow network where the kernel has no netem). Each runs a peer process (this binary re-executed) or, in tests, a
//! peer thread, and measures both sides of every ratio in the same run.
//!
//! Nothing depends on this crate but the `tessera` binary; the runtime knows nothing of it.
#![forbid(unsafe_code)]

pub mod bus;
mod peer;
pub mod relay;
mod secured;
pub mod stream;
pub mod transfer;
