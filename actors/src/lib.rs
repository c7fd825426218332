//! The behaviors of a Tessera cluster — admission, request, router, chip (with its
//! batcher and KV pool), supervisor — written against the actor core's
//! `Behavior`/`Effects` traits (never actix or ZeroMQ), so the same code serves real
//! traffic and runs in virtual time.
//!
//! Behaviors only: it must not depend on the actor host (`tessera-runtime`: actix,
//! ZeroMQ, tokio), an HTTP server or client, or a device. Those are adapters beside
//! the host (`runtime/gateway`, `runtime/chip-executor`, `runtime/node`).
#![forbid(unsafe_code)]

pub mod admission;
pub mod batcher;
pub mod chip;
pub mod host;
pub mod kv;
pub mod msg;
pub mod request;
pub mod router;
pub mod solver;
pub mod supervisor;

#[cfg(test)]
mod test_fx;
#[cfg(test)]
mod virtual_cluster;
