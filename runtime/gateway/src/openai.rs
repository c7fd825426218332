//! The OpenAI protocol layer of the gateway: request bodies in, response, streaming-chunk
//! and error JSON out, chat-template rendering and stop-string matching for streams.
//!
//! Pure functions only: no sockets, no runtime, no clock (callers pass ids and `created`),
//! so every shape a client sees is tested here without a server. Whatever a client sent
//! is refused with an [`ApiError`] (never a panic), which names the offending field.

mod error;
mod logprobs;
mod request;
mod response;
mod stop;
mod structured;
mod template;
mod tools;

pub use error::ApiError;
pub use logprobs::{TokenEntry, chat_logprobs, completion_logprobs, echo_completion_logprobs, with_logprobs};
pub use request::{ChatMessage, GenerationRequest, Prompt, Structured, parse_chat, parse_completion};
pub use response::{
    FinishReason, Usage, chat_chunk, chat_response, completion_chunk, completion_response, models_response,
    tool_calls_chunk, usage_chunk, with_tool_calls,
};
pub use stop::StopMatcher;
pub use structured::{GrammarCheck, grammar_of};
pub use template::ChatTemplate;
pub use tools::{Parsed, ToolCall, ToolCallParser, Tools, parse_answer};
