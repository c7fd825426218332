//! The behaviors of a Tessera cluster — chip, KV pool, request, batcher, router,
//! supervisor — written against `tessera-runtime`'s `Behavior`/`Effects` traits only
//! (never actix or ZeroMQ), plus the OpenAI-compatible HTTP gateway in front of them.
#![forbid(unsafe_code)]

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
