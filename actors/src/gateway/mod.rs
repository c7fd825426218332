//! OpenAI-compatible HTTP gateway: the protocol (pure) and the axum server.
pub mod openai;
pub mod server;
