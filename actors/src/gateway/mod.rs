//! OpenAI-compatible HTTP gateway: the protocol (pure), the axum routes and the HTTP
//! listener with its connection limits.
pub mod listener;
pub mod openai;
pub mod server;
