//! OpenAI-compatible HTTP gateway.
pub mod openai;
