//! Errors as the client sees them: OpenAI's error object plus the HTTP status to send it with.

use serde_json::{Value, json};

/// An error as the client sees it: OpenAI's error JSON with an HTTP status.
///
/// `message` is public: it must not carry diagnostics meant for the operator only.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's `type` field.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds after which a retry may succeed, sent as `Retry-After` (429 and 503).
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    /// 400: the request itself is wrong; `param` names the offending field.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after_s: None,
        }
    }

    /// 404 for a model this server does not serve, listing the ones it does.
    pub fn not_found_model(model: &str, available: &[String]) -> Self {
        let served = if available.is_empty() {
            "This server serves no model at the moment.".to_owned()
        } else {
            format!("This server serves: {}.", available.join(", "))
        };
        Self {
            status: 404,
            message: format!("The model `{model}` does not exist. {served}"),
            kind: "invalid_request_error",
            param: Some("model".to_owned()),
            code: Some("model_not_found".to_owned()),
            retry_after_s: None,
        }
    }

    /// 413: the prompt alone does not fit the model's context.
    pub fn prompt_too_long(prompt_tokens: usize, max_context: usize) -> Self {
        Self {
            status: 413,
            message: format!(
                "This model's maximum context length is {max_context} tokens, but the prompt has \
                 {prompt_tokens} tokens. Please shorten the prompt."
            ),
            kind: "invalid_request_error",
            param: None,
            // OpenAI's code for the same condition, which clients already match on.
            code: Some("context_length_exceeded".to_owned()),
            retry_after_s: None,
        }
    }

    /// 413 before tokenizing: the prompt's text is longer than any prompt that fits the
    /// model's context could be (`max_bytes`: the context times the longest token).
    pub fn prompt_text_too_long(bytes: usize, max_bytes: usize, max_context: usize) -> Self {
        Self {
            status: 413,
            message: format!(
                "The prompt has {bytes} bytes of text; this model's context of {max_context} tokens holds \
                 at most {max_bytes}. Please shorten the prompt."
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("context_length_exceeded".to_owned()),
            retry_after_s: None,
        }
    }

    /// 413: the request body is over the gateway's limit.
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self {
            status: 413,
            message: format!("The request body is larger than this server accepts ({limit_bytes} bytes)."),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large".to_owned()),
            retry_after_s: None,
        }
    }

    /// 404 for a path this server does not serve.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self {
            status: 404,
            message: format!(
                "Unknown request URL: {method} {path}. This server serves /v1/completions, \
                 /v1/chat/completions, /v1/models, /health and /metrics."
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url".to_owned()),
            retry_after_s: None,
        }
    }

    /// 405: the path exists, the method does not.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self {
            status: 405,
            message: format!("Method {method} is not allowed for {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed".to_owned()),
            retry_after_s: None,
        }
    }

    /// 429: every queue is full; the client should retry later (OpenAI's SDKs back off on 429).
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: 429,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded".to_owned()),
            retry_after_s: None,
        }
    }

    /// 401: no key, or not a valid one; `reason` (`missing`, `invalid`, `revoked`)
    /// becomes the code.
    pub fn unauthorized(message: impl Into<String>, reason: &str) -> Self {
        Self {
            status: 401,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some(if reason == "missing" { "missing_api_key" } else { "invalid_api_key" }.to_owned()),
            retry_after_s: None,
        }
    }

    /// 403: a valid key that may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self {
            status: 403,
            message: message.into(),
            kind: "permission_error",
            param: None,
            code: Some("forbidden".to_owned()),
            retry_after_s: None,
        }
    }

    /// 404: the caller's tenant may not use the served model.
    pub fn model_not_allowed(model: &str) -> Self {
        Self {
            status: 404,
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            kind: "invalid_request_error",
            param: Some("model".to_owned()),
            code: Some("model_not_found".to_owned()),
            retry_after_s: None,
        }
    }

    /// 429: the caller's tenant is over a quota; the message names the limit.
    pub fn quota_exceeded(message: impl Into<String>) -> Self {
        Self {
            status: 429,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded".to_owned()),
            retry_after_s: None,
        }
    }

    /// 503: no healthy chip can serve the request right now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: 503,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: Some("no_healthy_chip".to_owned()),
            retry_after_s: None,
        }
    }

    /// 500: our fault; the message should be generic, the details go to the log.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`, absent fields as `null` as OpenAI sends them.
    pub fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_set_status_type_and_code() {
        let served = vec!["qwen-0.5b".to_owned(), "tiny".to_owned()];
        // (error, status, type, param, code, message fragments)
        type Case = (ApiError, u16, &'static str, Option<&'static str>, Option<&'static str>, &'static [&'static str]);
        let cases: Vec<Case> = vec![
            (
                ApiError::bad_request("bad", Some("temperature")),
                400,
                "invalid_request_error",
                Some("temperature"),
                None,
                &["bad"],
            ),
            (
                ApiError::not_found_model("gpt-4", &served),
                404,
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
                &["The model `gpt-4` does not exist.", "qwen-0.5b, tiny"],
            ),
            (
                ApiError::not_found_model("gpt-4", &[]),
                404,
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
                &["`gpt-4`", "no model"],
            ),
            (
                ApiError::prompt_too_long(5000, 4096),
                413,
                "invalid_request_error",
                None,
                Some("context_length_exceeded"),
                &["4096", "5000"],
            ),
            (ApiError::overloaded("queues full"), 429, "rate_limit_error", None, Some("overloaded"), &["queues full"]),
            (ApiError::unavailable("no chip"), 503, "service_unavailable", None, Some("no_healthy_chip"), &["no chip"]),
            (ApiError::internal("oops"), 500, "server_error", None, None, &["oops"]),
        ];
        for (err, status, kind, param, code, fragments) in cases {
            assert_eq!(err.status, status, "{err:?}");
            assert_eq!(err.kind, kind, "{err:?}");
            assert_eq!(err.param.as_deref(), param, "{err:?}");
            assert_eq!(err.code.as_deref(), code, "{err:?}");
            for fragment in fragments {
                assert!(err.message.contains(fragment), "{:?} lacks {fragment:?}", err.message);
            }
        }
    }

    #[test]
    fn json_shape_is_openai_error_object() {
        let v = ApiError::bad_request("`n` must be 1", Some("n")).to_json();
        assert_eq!(
            v,
            json!({"error": {"message": "`n` must be 1", "type": "invalid_request_error", "param": "n", "code": null}})
        );
        let v = ApiError::overloaded("busy").to_json();
        assert_eq!(
            v,
            json!({"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": "overloaded"}})
        );
    }
}
