//! The actor runtime: the sans-IO `Behavior`/`Effects` model every actor is written
//! against, the actix host that runs behaviors in real time, the ZeroMQ bus between
//! hosts and its MessagePack codec, and the KV transfer engine (the data plane). Only this crate knows actix and ZeroMQ; it knows
//! nothing of models, chips or HTTP.

pub mod actor;
pub mod addr;
pub mod bus;
pub mod codec;
#[cfg(test)]
mod fuzz_tests;
pub mod host;
pub mod security;
pub mod transfer;

pub use addr::{Addr, HostId};
