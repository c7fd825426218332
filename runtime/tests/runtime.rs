//! The runtime's integration tests in one binary: the ZeroMQ bus between hosts, the
//! real-time host, and the KV transfer engine.

mod bus;
mod host;
mod transfer;
