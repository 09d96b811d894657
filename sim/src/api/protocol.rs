//! Request bodies of `/v1/completions` and `/v1/chat/completions` (the fields the simulator
//! honours; unknown fields are ignored, as vLLM does) and their validation into [`GenParams`].

use super::error::ApiError;
use serde::Deserialize;
use serde_json::Value;

/// `prompt` in a completion request.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One token-id prompt.
    Tokens(Vec<i64>),
    /// Several token-id prompts.
    TokenBatch(Vec<Vec<i64>>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Final chunk with usage.
    #[serde(default)]
    pub include_usage: bool,
    /// Usage in every chunk.
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// Model name (default: the served model).
    pub model: Option<String>,
    /// SSE or unary.
    #[serde(default)]
    pub stream: bool,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Max tokens to generate.
    pub max_tokens: Option<i64>,
    /// Chat's preferred spelling of max_tokens.
    pub max_completion_tokens: Option<i64>,
    /// Generated sequences per prompt.
    pub n: Option<i64>,
    /// Do not stop on EOS.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Suppress EOS until this many tokens.
    pub min_tokens: Option<i64>,
    /// Return prompt and generated token ids.
    #[serde(default)]
    pub return_token_ids: bool,
    /// Prefill/decode disaggregation parameters (vLLM's NixlConnector protocol,
    /// `kv_connector`); ignored by a server without a KV connector.
    pub kv_transfer_params: Option<Value>,
    /// Request id (X-Request-Id wins).
    pub request_id: Option<String>,
    /// Prefix-cache salt (any JSON value here: vLLM's own check words the refusal).
    pub cache_salt: Option<Value>,
}

/// `/v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// The prompt(s).
    pub prompt: Option<Prompt>,
    /// Apply the tokenizer's post-processor (default true).
    pub add_special_tokens: Option<bool>,
    /// Prepend the prompt to the output text.
    #[serde(default)]
    pub echo: bool,
}

/// `/v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// The conversation.
    pub messages: Vec<Value>,
    /// Append the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last message instead (default false).
    #[serde(default)]
    pub continue_final_message: bool,
    /// Apply the tokenizer's post-processor (default false for chat).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// Tools, passed to the template.
    pub tools: Option<Value>,
    /// Extra template variables.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// Parses a body into `T`, mapping JSON and type errors to vLLM-style 400s.
pub fn parse_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::validation(
            format!("1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body', 'msg': 'JSON decode error', 'ctx': {{'error': \"{e}\"}}}}"),
            "body",
        )
    })?;
    if !v.is_object() {
        return Err(ApiError::validation(
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or object to extract fields from'}",
            "body",
        ));
    }
    serde_json::from_value(v).map_err(|e| ApiError::validation(format!("1 validation error:\n  {{'loc': 'body', 'msg': '{e}'}}"), "body"))
}

/// Validated generation parameters.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Max tokens, or `None` for "up to max_model_len".
    pub max_tokens: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    /// EOS suppressed until this many tokens.
    pub min_tokens: usize,
    /// Never stop on EOS.
    pub ignore_eos: bool,
    /// SSE.
    pub stream: bool,
    /// Final usage chunk.
    pub include_usage: bool,
    /// Usage in every chunk.
    pub continuous_usage: bool,
    /// Token ids in the response.
    pub return_token_ids: bool,
    /// The prefix-cache salt, checked.
    pub cache_salt: Option<String>,
    /// The LoRA adapter `model` names (set by the endpoint, which resolves the name).
    pub lora: Option<std::sync::Arc<crate::lora::LoraRequest>>,
    /// `kv_transfer_params` (an object, or absent).
    pub kv_transfer_params: Option<Value>,
}

/// vLLM's `validate_cache_salt`: absent (or null), or a non-empty string of at most 128
/// characters without `@`, `/`, `\` or NUL; anything else is a 400 naming the parameter.
pub fn check_cache_salt(salt: Option<&Value>) -> Result<Option<String>, ApiError> {
    let refuse = |m: &str| ApiError::bad_request(format!("{m} (parameter=cache_salt)"), Some("cache_salt"));
    match salt {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Err(refuse("Parameter 'cache_salt' must be a non-empty string if provided.")),
        Some(Value::String(s)) => {
            if s.chars().count() > 128 || s.contains(['@', '/', '\\', '\0']) {
                return Err(refuse("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."));
            }
            Ok(Some(s.clone()))
        }
        Some(_) => Err(refuse("Parameter 'cache_salt' must be a non-empty string if provided.")),
    }
}

/// Most choices one request may ask for.
pub const MAX_N: usize = 128;

/// A request's output limit (`field` names where it came from), if within 1..=`max_model_len`.
fn checked_max_tokens(m: i64, field: &str, max_model_len: usize) -> Result<usize, ApiError> {
    if m < 1 {
        return Err(ApiError::bad_request(format!("{field} must be at least 1, got {m}. (parameter={field}, value={m})"), Some(field)));
    }
    match usize::try_from(m) {
        Ok(m) if m <= max_model_len => Ok(m),
        _ => Err(ApiError::bad_request(
            format!("{field}={m} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens. (parameter={field}, value={m})"),
            Some(field),
        )),
    }
}

impl Common {
    /// Checks the shared fields against the model limits.
    pub fn validate(&self, max_model_len: usize) -> Result<GenParams, ApiError> {
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::bad_request("Stream options can only be defined when `stream=True`. (parameter=stream_options)", Some("stream_options")));
        }
        // vLLM names the field the limit came from.
        let (max_tokens, field) = match self.max_completion_tokens {
            Some(m) => (Some(m), "max_completion_tokens"),
            None => (self.max_tokens, "max_tokens"),
        };
        let max_tokens = max_tokens.map(|m| checked_max_tokens(m, field, max_model_len)).transpose()?;
        let n = self.n.unwrap_or(1);
        let Some(n) = usize::try_from(n).ok().filter(|n| (1..=MAX_N).contains(n)) else {
            return Err(ApiError::bad_request(format!("n must be between 1 and {MAX_N}, got {n}."), Some("n")));
        };
        let min_tokens = self.min_tokens.unwrap_or(0);
        let Some(min_tokens) = usize::try_from(min_tokens).ok().filter(|&min| max_tokens.is_none_or(|m| min <= m)) else {
            return Err(ApiError::bad_request(format!("min_tokens must be >= 0 and <= max_tokens, got {min_tokens}."), Some("min_tokens")));
        };
        let cache_salt = check_cache_salt(self.cache_salt.as_ref())?;
        let kv_transfer_params = match &self.kv_transfer_params {
            None | Some(Value::Null) => None,
            Some(v @ Value::Object(_)) => Some(v.clone()),
            // pydantic's refusal of a non-dict for `dict[str, Any] | None`.
            Some(_) => {
                return Err(ApiError::validation(
                    "1 validation error:\n  {'type': 'dict_type', 'loc': ('body', 'kv_transfer_params'), 'msg': 'Input should be a valid dictionary'}",
                    "body",
                ));
            }
        };
        let so = self.stream_options.clone().unwrap_or_default();
        Ok(GenParams {
            max_tokens,
            n,
            min_tokens,
            ignore_eos: self.ignore_eos,
            stream: self.stream,
            include_usage: so.include_usage,
            continuous_usage: so.continuous_usage_stats,
            return_token_ids: self.return_token_ids,
            cache_salt,
            lora: None,
            kv_transfer_params,
        })
    }
}

/// Checks a prompt's length against the context limit and resolves max_tokens.
pub fn check_length(prompt_len: usize, max_tokens: Option<usize>, max_model_len: usize) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::bad_request("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", Some("prompt")));
    }
    if prompt_len >= max_model_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your prompt contains {prompt_len} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={prompt_len})"
            ),
            Some("input_tokens"),
        ));
    }
    match max_tokens {
        None => Ok(max_model_len - prompt_len),
        Some(m) if prompt_len + m > max_model_len => Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_len} in the messages, {m} in the completion). Please reduce the length of the messages or completion. (parameter=max_tokens, value={m})",
                prompt_len + m
            ),
            Some("max_tokens"),
        )),
        Some(m) => Ok(m),
    }
}

/// Converts token ids from JSON, checking they are in the vocabulary.
pub fn check_token_ids(ids: &[i64], vocab_size: u32) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&t| u32::try_from(t).ok().filter(|&id| id < vocab_size).ok_or_else(|| ApiError::bad_request(format!("Token id {t} is out of vocabulary"), None)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        let r: CompletionRequest = parse_body(br#"{"prompt":[[1,2],[3]]}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::TokenBatch(_))));
        let r: CompletionRequest = parse_body(br#"{"prompt":["a","b"]}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::Texts(_))));
        let r: CompletionRequest = parse_body(br#"{"prompt":[1,2]}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::Tokens(_))));
    }

    #[test]
    fn malformed_bodies_are_400_not_panics() {
        for body in [&b"{"[..], b"[1]", b"{\"prompt\":5}", b"{\"stream\":\"yes\"}", b"\xff\xfe"] {
            let e = parse_body::<CompletionRequest>(body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body:?}");
        }
    }

    // The messages real vLLM 0.32 answers (with `(parameter=cache_salt)` appended).
    #[test]
    fn cache_salts_are_checked_as_vllm_checks_them() {
        use serde_json::json;
        assert_eq!(check_cache_salt(None).unwrap(), None);
        assert_eq!(check_cache_salt(Some(&Value::Null)).unwrap(), None);
        assert_eq!(check_cache_salt(Some(&json!("tenant-a"))).unwrap().as_deref(), Some("tenant-a"));
        assert_eq!(check_cache_salt(Some(&json!("é".repeat(128)))).unwrap().map(|s| s.chars().count()), Some(128));
        for (bad, says) in [
            (json!(""), "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"),
            (json!(5), "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"),
            (json!("a/b"), "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)"),
            (json!("x".repeat(129)), "must be at most 128 characters"),
            (json!("a@b"), "must not contain"),
            (json!("a\u{0}b"), "must not contain"),
        ] {
            let e = check_cache_salt(Some(&bad)).unwrap_err();
            assert_eq!((e.status.as_u16(), e.kind, e.param.as_deref()), (400, "BadRequestError", Some("cache_salt")), "{bad}");
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn length_checks_match_vllm() {
        assert_eq!(check_length(10, None, 100).unwrap(), 90);
        assert!(check_length(0, Some(1), 100).is_err());
        assert_eq!(check_length(100, Some(1), 100).unwrap_err().param.as_deref(), Some("input_tokens"));
        assert_eq!(check_length(90, Some(20), 100).unwrap_err().param.as_deref(), Some("max_tokens"));
        assert!(check_token_ids(&[1, 5000], 4096).is_err());
        assert!(check_token_ids(&[-1], 4096).is_err());
    }
}
