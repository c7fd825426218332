//! placeholder (openai helper)
