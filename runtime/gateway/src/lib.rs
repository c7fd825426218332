//! The OpenAI-compatible HTTP gateway of a Tessera cluster: the protocol (pure: bodies in,
//! JSON and SSE chunks out, chat templates, stop strings), the axum routes that turn HTTP
//! requests into Request actors on this host, and the HTTP/1.1 listener with its
//! connection limits.
//!
//! An I/O adapter over the actor host (tokio, axum, hyper): behaviors never depend on it,
//! and it holds no scheduling or placement decision of its own — admission, routing and
//! retries are the actors' (`tessera-actors`).
#![forbid(unsafe_code)]

pub mod access;
pub mod listener;
pub mod openai;
pub mod probe;
pub mod server;
