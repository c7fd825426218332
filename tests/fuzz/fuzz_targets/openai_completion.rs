//! `POST /v1/completions` bodies (`tessera_gateway::openai::parse_completion`):
//! a 400 naming the field, or a request within the ranges the server relies on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_gateway::openai::{Prompt, parse_completion};

fuzz_target!(|data: &[u8]| {
    match parse_completion(data) {
        Ok(req) => {
            assert!(!req.model.is_empty());
            assert!((0.0..=2.0).contains(&req.temperature));
            assert!(req.top_p > 0.0 && req.top_p <= 1.0, "top_p {} reaches sampling", req.top_p);
            assert!(req.max_tokens.is_some_and(|n| (1..=1 << 20).contains(&n)));
            assert!(req.stop.len() <= 16 && req.stop.iter().all(|s| !s.is_empty()));
            assert!(req.top_k.is_none_or(|k| k >= 1));
            assert!(!req.include_usage || req.stream);
            match &req.prompt {
                Prompt::Text(_) => {}
                Prompt::TokenIds(ids) => assert!(!ids.is_empty()),
                Prompt::Chat(_) => panic!("a chat prompt from the completions endpoint"),
            }
        }
        Err(e) => assert_eq!(e.status, 400),
    }
});
