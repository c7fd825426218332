//! `POST /v1/chat/completions` bodies (`tessera_gateway::openai::parse_chat`),
//! then the accepted conversation through two chat templates (ChatML, and Llama 3's,
//! which raises on roles out of order): a 400, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_gateway::openai::{ChatTemplate, Prompt, parse_chat};

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}";

thread_local! {
    static TEMPLATES: Vec<ChatTemplate> = [CHATML, LLAMA3]
        .iter()
        .map(|source| ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())).expect("template"))
        .collect();
}

fuzz_target!(|data: &[u8]| {
    let req = match parse_chat(data) {
        Ok(req) => req,
        Err(e) => {
            assert_eq!(e.status, 400);
            return;
        }
    };
    assert!(!req.model.is_empty());
    assert!((0.0..=2.0).contains(&req.temperature));
    assert!(req.top_p > 0.0 && req.top_p <= 1.0, "top_p {} reaches sampling", req.top_p);
    assert!(req.max_tokens.is_none_or(|n| (1..=1 << 20).contains(&n)));
    assert!(req.stop.len() <= 16 && req.stop.iter().all(|s| !s.is_empty()));
    let Prompt::Chat(messages) = &req.prompt else { panic!("not a chat prompt from the chat endpoint") };
    assert!(!messages.is_empty());
    assert!(messages.iter().all(|m| ["system", "user", "assistant"].contains(&m.role.as_str())));
    TEMPLATES.with(|templates| {
        for template in templates {
            if let Err(e) = template.render(messages, true) {
                assert_eq!(e.status, 400);
            }
        }
    });
});
