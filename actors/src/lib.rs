//! The behaviors of a Tessera cluster — chip, KV pool, request, batcher, router,
//! supervisor — written against `tessera-runtime`'s `Behavior`/`Effects` traits only
//! (never actix or ZeroMQ), plus the OpenAI-compatible HTTP gateway in front of them.

pub mod gateway;
pub mod loadgen;
