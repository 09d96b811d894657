//! The request that continues a stream on another worker: a `/v1/completions` request whose
//! prompt is the original prompt's token ids followed by the ids generated so far, asking for
//! what remains of `max_tokens`, with the same sampling parameters. With greedy sampling the
//! destination produces exactly the tokens the source would have (its output is a function of
//! the context); seeded sampling continues validly but restarts its random stream.
//!
//! The destination's chunks are re-wrapped in the client's original shape by the caller.

use serde_json::{Map, Value, json};

/// Sampling and output parameters carried over unchanged (vLLM's names).
const CARRIED: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "length_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "bad_words",
    "logit_bias",
    "allowed_token_ids",
    "priority",
    "cache_salt",
    "vllm_xargs",
    "watermarking",
];

/// `max_tokens`' default for `/v1/completions` in vLLM.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;

/// What is known about a stream when it moves.
#[derive(Debug, Clone, Copy)]
pub struct Continuation<'a> {
    /// The client's request body.
    pub original: &'a Value,
    /// Whether it came to `/v1/chat/completions`.
    pub chat: bool,
    /// The prompt's token ids, as the source worker saw them (`prompt_token_ids`).
    pub prompt_ids: &'a [u32],
    /// The ids generated so far (`token_ids` deltas, in order).
    pub generated_ids: &'a [u32],
    /// The model's context length, if known.
    pub max_model_len: Option<u32>,
}

/// Why no continuation is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ContinuationError {
    /// Every requested token was generated already: the stream is complete.
    #[error("no tokens left to generate")]
    Finished,
    /// The continuation's prompt would not fit the model's context.
    #[error("the continuation needs {needed} tokens of context; the model has {limit}")]
    TooLong {
        /// Prompt + generated + 1.
        needed: u64,
        /// `max_model_len`.
        limit: u32,
    },
}

impl Continuation<'_> {
    /// The client's token limit, if any (chat: `max_completion_tokens`, else `max_tokens`;
    /// completions default to 16 as vLLM does).
    pub fn max_tokens(&self) -> Option<u64> {
        let o = self.original;
        let chat_limit = || o.get("max_completion_tokens").and_then(Value::as_u64).or_else(|| o.get("max_tokens").and_then(Value::as_u64));
        if self.chat {
            chat_limit()
        } else {
            match o.get("max_tokens") {
                // An explicit null asks the server to fill the context.
                Some(Value::Null) => None,
                Some(v) => v.as_u64(),
                None => Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
            }
        }
    }

    /// The `/v1/completions` body for the destination, for `model`.
    pub fn request(&self, model: &str) -> Result<Value, ContinuationError> {
        let generated = self.generated_ids.len() as u64;
        let remaining = match self.max_tokens() {
            Some(limit) if limit <= generated => return Err(ContinuationError::Finished),
            Some(limit) => Some(limit - generated),
            None => None,
        };
        let context = self.prompt_ids.len() as u64 + generated;
        if let Some(limit) = self.max_model_len
            && context + 1 > u64::from(limit)
        {
            return Err(ContinuationError::TooLong { needed: context + 1, limit });
        }
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        let prompt: Vec<u32> = self.prompt_ids.iter().chain(self.generated_ids).copied().collect();
        body.insert("prompt".into(), json!(prompt));
        // A `/v1/completions` request without `max_tokens` gets 16: an open-ended stream asks
        // for what fills the context (explicit null when the context length is not known, which
        // vLLM reads as the same).
        let max_tokens = match (remaining, self.max_model_len) {
            (Some(r), _) => json!(r),
            (None, Some(limit)) => json!(u64::from(limit).saturating_sub(context)),
            (None, None) => Value::Null,
        };
        body.insert("max_tokens".into(), max_tokens);
        for &k in CARRIED {
            if let Some(v) = self.original.get(k).filter(|v| !v.is_null()) {
                body.insert(k.into(), v.clone());
            }
        }
        if let Some(min) = self.original.get("min_tokens").and_then(Value::as_u64) {
            body.insert("min_tokens".into(), json!(min.saturating_sub(generated)));
        }
        body.insert("stream".into(), json!(true));
        // Usage comes back as the client asked for it (then re-counted for the client).
        if let Some(o) = self.original.get("stream_options").filter(|v| !v.is_null()) {
            body.insert("stream_options".into(), o.clone());
        }
        body.insert("return_token_ids".into(), json!(true));
        // The ids already hold any special tokens the original rendering added.
        body.insert("add_special_tokens".into(), json!(false));
        Ok(Value::Object(body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_continues_with_what_remains_and_the_same_sampling() {
        let original = json!({"model": "m", "prompt": "hello", "max_tokens": 10, "temperature": 0, "stop": ["\n"],
                              "min_tokens": 4, "ignore_eos": true, "stream": true, "logit_bias": null, "user": "x"});
        let c = Continuation { original: &original, chat: false, prompt_ids: &[1, 2, 3], generated_ids: &[7, 8, 9], max_model_len: Some(100) };
        let b = c.request("m").unwrap();
        assert_eq!(b["prompt"], json!([1, 2, 3, 7, 8, 9]));
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["min_tokens"], 1);
        assert_eq!((b["temperature"].clone(), b["stop"].clone(), b["ignore_eos"].clone()), (json!(0), json!(["\n"]), json!(true)));
        assert_eq!((b["stream"].clone(), b["return_token_ids"].clone(), b["add_special_tokens"].clone()), (json!(true), json!(true), json!(false)));
        assert!(b.get("logit_bias").is_none() && b.get("user").is_none(), "nulls and client-only fields are not sent");
    }

    #[test]
    fn chat_limits_and_defaults_follow_vllm() {
        let chat = json!({"messages": [], "max_completion_tokens": 5, "max_tokens": 50});
        let c = Continuation { original: &chat, chat: true, prompt_ids: &[1], generated_ids: &[2, 3], max_model_len: None };
        assert_eq!(c.request("m").unwrap()["max_tokens"], 3, "max_completion_tokens wins");
        let open = json!({"messages": []});
        let c = Continuation { original: &open, chat: true, prompt_ids: &[1], generated_ids: &[2], max_model_len: None };
        assert_eq!(c.request("m").unwrap()["max_tokens"], Value::Null, "no limit: the server fills the context");
        let c = Continuation { original: &open, chat: true, prompt_ids: &[1; 10], generated_ids: &[2; 5], max_model_len: Some(100) };
        assert_eq!(c.request("m").unwrap()["max_tokens"], 85, "no limit: what fills the context, explicitly");
        let null = json!({"prompt": "x", "max_tokens": null});
        let c = Continuation { original: &null, chat: false, prompt_ids: &[1], generated_ids: &[2], max_model_len: Some(50) };
        assert_eq!(c.request("m").unwrap()["max_tokens"], 48, "an explicit null is no limit too");
        let completion = json!({"prompt": "x"});
        let c = Continuation { original: &completion, chat: false, prompt_ids: &[1], generated_ids: &[2; 6], max_model_len: None };
        assert_eq!(c.request("m").unwrap()["max_tokens"], 10, "completions default to 16");
    }

    #[test]
    fn nothing_is_sent_when_the_stream_is_done_or_too_long() {
        let o = json!({"prompt": "x", "max_tokens": 2});
        let c = Continuation { original: &o, chat: false, prompt_ids: &[1], generated_ids: &[2, 3], max_model_len: None };
        assert_eq!(c.request("m"), Err(ContinuationError::Finished));
        let o = json!({"prompt": "x", "max_tokens": 100});
        let c = Continuation { original: &o, chat: false, prompt_ids: &[1; 8], generated_ids: &[2; 2], max_model_len: Some(10) };
        assert_eq!(c.request("m"), Err(ContinuationError::TooLong { needed: 11, limit: 10 }));
    }
}
