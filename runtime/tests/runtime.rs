//! The runtime's integration tests in one binary: the ZeroMQ bus between hosts, the
//! real-time host, and the KV transfer engine.

#[path = "runtime/bus.rs"]
mod bus;
#[path = "runtime/host.rs"]
mod host;
#[path = "runtime/transfer.rs"]
mod transfer;
