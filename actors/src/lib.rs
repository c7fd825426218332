//! The behaviors of a Tessera cluster — admission, request, router, chip (with its
//! batcher and KV pool), supervisor — written against the actor core's
//! `Behavior`/`Effects` traits (never actix or ZeroMQ), so the same code serves real
//! traffic and runs in virtual time; plus, for now, the OpenAI-compatible HTTP gateway
//! and the load generator in front of them.
#![forbid(unsafe_code)]

pub mod admission;
pub mod batcher;
pub mod chip;
pub mod gateway;
pub mod kv;
pub mod loadgen;
pub mod msg;
pub mod request;
pub mod router;
pub mod supervisor;

#[cfg(test)]
mod test_fx;
#[cfg(test)]
mod virtual_cluster;
