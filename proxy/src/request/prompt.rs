//! The prompt's token ids, as the worker will see them, for KV routing:
//! - `/v1/completions` with token ids (`[1, 2, …]` or a batch `[[…], …]`, as benchmark clients
//!   send): used as is (the first prompt of a batch);
//! - text, or chat messages rendered with the model's chat template: the model's HF tokenizer
//!   through its segment cache (only segments not seen before are tokenized, and only up to the
//!   tokens routing uses), on the blocking pool unless every segment is cached (completions add special tokens by default, chat
//!   does not, as vLLM);
//! - no tokenizer configured: a character-block fallback, every 4 bytes of text one pseudo-token.
//!   It is approximate: requests sharing a text prefix still share leading blocks, but block
//!   boundaries do not line up with the worker's, so the index (fed by real token ids) cannot
//!   match them; use it with approximate mode (`kv_events: false`).

use super::RequestState;
use super::kv_inputs::{KvInputs, PromptTokens};
use super::parsed::ParsedBody;
use crate::endpoint::Endpoint;
use crate::gateway::Gateway;
use crate::kv_routing::KvRouting;
use kvgate_tokenize::{SegmentCache, dialect};
use serde_json::Value;
use std::sync::Arc;

/// Tokenizes the prompt when the model routes on the KV cache: as far as routing reads it, or
/// whole when the request's tenant is limited by input tokens (which are counted from it). A
/// Messages or Responses prompt that cannot be rendered exactly is placed by load alone (no
/// prefix), and counted (`kvgate_render_fallback_total{endpoint,reason}`).
pub async fn tokenize(gw: &Gateway, req: &mut RequestState) {
    let (Some(kv), Some(body)) = (req.model.kv.clone(), req.parsed.take()) else { return };
    let whole = req.tenant.as_ref().is_some_and(|t| t.tenant.account.limits().input_tokens_per_minute > 0);
    let cap = if whole { usize::MAX } else { kv.max_tokens() };
    let salt = KvInputs::salt_of(&body.fields);
    // A batch of prompts is routed on its first; the worker counts them all.
    let batch = matches!(body.fields.get("prompt"), Some(Value::Array(items)) if items.len() > 1 && !items[0].is_number());
    let tokens = match req.endpoint {
        Endpoint::Messages | Endpoint::Responses => dialect_tokens(body.fields, req.endpoint, &kv, cap).await.unwrap_or_else(|reason| {
            gw.metrics.render_fallback.with_label_values(&[req.endpoint.label(), reason]).inc();
            Vec::new()
        }),
        ep => tokens(body, ep == Endpoint::Chat, kv.tokenizer.as_ref(), cap).await.unwrap_or_default(),
    };
    let whole = tokens.len() < cap && !batch;
    req.prompt = Some(PromptTokens { tokens, salt, whole });
}

/// Fills `req.kv` from the prompt's tokens when the model routes on the KV cache: after the
/// router queue, so the overlaps and bookings are those of the moment it is placed.
pub fn prepare_kv(req: &mut RequestState) {
    let (Some(kv), Some(p)) = (req.model.kv.clone(), req.prompt.take()) else { return };
    req.kv = Some(req.kv_inputs(&kv, &p.tokens, p.salt));
}

/// Extracts the routing tokens from a parsed request body, which it consumes (a prompt's ids
/// are taken, not copied, and a long conversation moves to the blocking pool whole); `None`
/// when there is no prompt to route on (the worker will answer the error).
pub async fn tokens(parsed: ParsedBody, chat: bool, tokenizer: Option<&Arc<SegmentCache>>, max_tokens: usize) -> Option<Vec<u32>> {
    let ParsedBody { fields: body, prompt_ids } = parsed;
    if !chat {
        if prompt_ids.is_some() {
            return prompt_ids;
        }
        match body.get("prompt")? {
            Value::Array(items) if items.first().is_some_and(Value::is_number) => return ids(items),
            Value::Array(items) if items.first().is_some_and(Value::is_array) => return ids(items[0].as_array()?),
            Value::Array(items) => return text_tokens(items.first()?.as_str()?.to_string(), true, tokenizer, max_tokens).await,
            Value::String(s) => {
                let add = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
                return text_tokens(s.clone(), add, tokenizer, max_tokens).await;
            }
            _ => return None,
        }
    }
    let messages = body.get("messages")?.as_array()?;
    match tokenizer {
        // A short conversation is rendered right here (the template costs less than the hop to
        // the blocking pool); its ids too when every segment is cached.
        Some(tok) if chat_bytes(messages) <= INLINE_CHAT_BYTES => {
            let text = render_chat(tok, &body)?;
            let add = body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(false);
            if let Some(ids) = tok.encode_cached(&text, add, Some(max_tokens)) {
                return Some(ids);
            }
            let tok = tok.clone();
            tokio::task::spawn_blocking(move || tok.encode(&text, add, Some(max_tokens)).ok()).await.ok()?
        }
        Some(tok) => {
            let tok = tok.clone();
            tokio::task::spawn_blocking(move || {
                let text = render_chat(&tok, &body)?;
                tok.encode(&text, body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(false), Some(max_tokens)).ok()
            })
            .await
            .ok()?
        }
        None => {
            let mut text = String::new();
            for m in messages {
                text.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
                text.push('\n');
                match m.get("content") {
                    Some(Value::String(s)) => text.push_str(s),
                    Some(other) => text.push_str(&other.to_string()),
                    None => {}
                }
                text.push('\n');
            }
            Some(char_blocks(&text))
        }
    }
}

/// The routing tokens of an Anthropic Messages or OpenAI Responses request: the chat request
/// vLLM builds from it (`kvgate_tokenize::dialect`), rendered with the model's chat template as
/// vLLM renders it and tokenized without special tokens, on the blocking pool (agents' requests
/// carry long tool lists). `Err` names why it cannot be rendered exactly (an image, a stored
/// conversation the gateway does not hold, …): the request is then placed by load alone.
pub async fn dialect_tokens(body: Value, endpoint: Endpoint, kv: &KvRouting, max_tokens: usize) -> Result<Vec<u32>, &'static str> {
    let chat = match endpoint {
        Endpoint::Messages => dialect::messages::to_chat(&body, &kv.messages),
        Endpoint::Responses => dialect::responses::to_chat(&body, None),
        _ => return Err("endpoint"),
    }
    .map_err(|e| e.reason())?;
    let Some(tok) = kv.tokenizer.clone() else {
        // Approximate mode: the conversation's text in character blocks, as for chat.
        let parsed = ParsedBody { fields: chat, prompt_ids: None };
        return tokens(parsed, true, None, max_tokens).await.ok_or("invalid");
    };
    tokio::task::spawn_blocking(move || {
        let text = dialect::render_chat(tok.tokenizer(), &chat).map_err(|e| e.reason())?;
        tok.encode(&text, false, Some(max_tokens)).map_err(|_| "tokenizer")
    })
    .await
    .map_err(|_| "tokenizer")?
}

/// Conversations up to this much message text are rendered on the async worker.
const INLINE_CHAT_BYTES: usize = 8 * 1024;

/// Message text of a conversation, roughly (structured content counts as large).
fn chat_bytes(messages: &[Value]) -> usize {
    messages
        .iter()
        .map(|m| match m.get("content") {
            Some(Value::String(s)) => s.len(),
            None | Some(Value::Null) => 0,
            Some(_) => INLINE_CHAT_BYTES,
        })
        .sum()
}

/// The conversation rendered with the model's chat template, as vLLM renders it (its message
/// clean-up, template variables and tools: `kvgate_tokenize::dialect::render_chat`).
fn render_chat(tok: &SegmentCache, body: &Value) -> Option<String> {
    dialect::render_chat(tok.tokenizer(), body).ok()
}

fn ids(items: &[Value]) -> Option<Vec<u32>> {
    items.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

async fn text_tokens(text: String, add_special: bool, tokenizer: Option<&Arc<SegmentCache>>, max_tokens: usize) -> Option<Vec<u32>> {
    match tokenizer {
        // Every segment seen before: no tokenizer work, so no hop to the blocking pool (the hop
        // and its thread wake-ups cost more than the lookups).
        Some(tok) if let Some(ids) = tok.encode_cached(&text, add_special, Some(max_tokens)) => Some(ids),
        Some(tok) => {
            let tok = tok.clone();
            tokio::task::spawn_blocking(move || tok.encode(&text, add_special, Some(max_tokens)).ok()).await.ok()?
        }
        None => Some(char_blocks(&text)),
    }
}

/// The fallback: 4 bytes of text per pseudo-token.
pub fn char_blocks(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    use kvgate_tokenize::{ChatInput, ModelTokenizer};

    fn p(body: &Value) -> ParsedBody {
        ParsedBody::parse(body.to_string().as_bytes()).unwrap()
    }

    #[tokio::test]
    async fn token_ids_are_used_as_is() {
        assert_eq!(tokens(p(&json!({"prompt": [5, 6, 7]})), false, None, 100).await, Some(vec![5, 6, 7]));
        assert_eq!(tokens(p(&json!({"prompt": [[1, 2], [3]]})), false, None, 100).await, Some(vec![1, 2]));
        assert_eq!(tokens(p(&json!({"prompt": [-1]})), false, None, 100).await, None);
    }

    #[tokio::test]
    async fn text_uses_the_tokenizer_or_the_fallback() {
        let tok = ModelTokenizer::builtin();
        let cache = Arc::new(SegmentCache::new(tok.clone(), 64));
        let with = tokens(p(&json!({"prompt": "the cache router"})), false, Some(&cache), 10_000).await.unwrap();
        assert_eq!(with, tok.encode("the cache router", true).unwrap());
        let fallback = tokens(p(&json!({"prompt": "abcdefgh"})), false, None, 10_000).await.unwrap();
        assert_eq!(fallback.len(), 2);
        let chat = tokens(p(&json!({"messages": [{"role": "user", "content": "hi"}]})), true, Some(&cache), 10_000).await.unwrap();
        let text = tok
            .render_chat(&ChatInput { messages: &[json!({"role": "user", "content": "hi"})], add_generation_prompt: true, tools: None, kwargs: None })
            .unwrap();
        assert_eq!(chat, tok.encode(&text, false).unwrap(), "chat tokenizes like vLLM: template, no special tokens");
        let again = tokens(p(&json!({"messages": [{"role": "user", "content": "hi"}]})), true, Some(&cache), 10_000).await.unwrap();
        assert_eq!(again, chat, "the cached, inline path gives the same ids");
        let long = "many words ".repeat(1_000);
        let body = json!({"messages": [{"role": "user", "content": long}]});
        let via_pool = tokens(p(&body), true, Some(&cache), 100_000).await.unwrap();
        let text = tok
            .render_chat(&ChatInput { messages: &[json!({"role": "user", "content": long})], add_generation_prompt: true, tools: None, kwargs: None })
            .unwrap();
        assert_eq!(via_pool, tok.encode(&text, false).unwrap(), "a long conversation is rendered on the blocking pool, same ids");
    }
}
