//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic Messages requests,
//! converted to a chat request as vLLM 0.32 converts them ([`kvgate_tokenize::dialect::messages`]),
//! generated as chat generates, answered in vLLM's Anthropic shapes
//! (`vllm/entrypoints/anthropic/serving.py`, `messages_full_converter` and
//! `message_stream_converter`).
//!
//! - Unary: `{"id": "chatcmpl-…", "type": "message", "role": "assistant", "content": [{"type":
//!   "text", "text": …}], "model", "stop_reason", "usage": {"input_tokens", "output_tokens"}}`
//!   (vLLM drops null fields; an empty answer is one empty text block). The id is the chat
//!   completion's, as vLLM reuses it.
//! - Stream: `event: <type>` + `data: {…}` pairs: `message_start` (usage with 0 output tokens),
//!   `content_block_start` before the first non-empty text, a `content_block_delta` /
//!   `text_delta` per token with text, `content_block_stop`, `message_delta` (stop reason and
//!   usage), `message_stop`. vLLM sends no `ping` and no `[DONE]`.
//! - Stop reasons: `length` → `max_tokens`, a stop on EOS → `end_turn`.
//! - Errors are Anthropic-shaped, `{"type": "error", "error": {"type", "message"}}`, with vLLM's
//!   status; only a body that is not a JSON object gets the OpenAI shape (FastAPI's validation
//!   handler answers before the Anthropic router). vllm-sim accepts `tools` as a server
//!   started with `--enable-auto-tool-choice` would.

use super::error::{ApiError, json_response};
use super::generate::{PreparedPrompt, kv_transfer_reply};
use super::protocol::{Common, GenParams, check_length, parse_body};
use super::response::{ChoiceState, ChunkFormat, Meta, collect, delivery_text, echo_header, json_str, sse};
use super::{AppState, render_dialect_chat};
use crate::engine::Delivery;
use crate::scheduler::FinishReason;
use crate::tokenizer::ModelTokenizer;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvgate_tokenize::dialect::messages::{self as dialect, MessagesOptions};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::sync::Arc;

/// `POST /v1/messages`.
pub async fn create(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let req: Value = match parse_body(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    match run(&st, &headers, &req).await {
        Ok(r) => r,
        Err(e) => anthropic_error(&e),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n, "context_management":
/// {"original_input_tokens": n}}`.
pub async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: Value = match parse_body(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let counted = async {
        st.check_model(req.get("model").and_then(Value::as_str))?;
        let chat = dialect::count_tokens_to_chat(&req, options(&st)).map_err(|e| st.dialect_error(&e))?;
        render_dialect_chat(&st, &chat).await
    };
    match counted.await {
        Ok(tokens) => json_response(StatusCode::OK, &json!({"input_tokens": tokens.len(), "context_management": {"original_input_tokens": tokens.len()}})),
        Err(e) => anthropic_error(&e),
    }
}

/// What vLLM probes from the chat template once, on first use.
fn options(st: &AppState) -> &MessagesOptions {
    st.messages_options.get_or_init(|| MessagesOptions::for_tokenizer(&st.tokenizer))
}

/// vLLM's `translate_error_response`: the error's type and message, Anthropic-shaped.
pub fn anthropic_error(e: &ApiError) -> Response {
    json_response(e.status, &json!({"type": "error", "error": {"type": e.kind, "message": e.message}}))
}

async fn run(st: &AppState, headers: &HeaderMap, req: &Value) -> Result<Response, ApiError> {
    let lora = st.resolve_model(req.get("model").and_then(Value::as_str))?;
    let chat = dialect::to_chat(req, options(st)).map_err(|e| st.dialect_error(&e))?;
    let common = Common {
        model: chat["model"].as_str().map(str::to_owned),
        stream: chat.get("stream").and_then(Value::as_bool).unwrap_or(false),
        max_completion_tokens: chat["max_completion_tokens"].as_i64(),
        kv_transfer_params: chat.get("kv_transfer_params").cloned(),
        cache_salt: chat.get("cache_salt").cloned(),
        ..Common::default()
    };
    let params = GenParams { lora, ..common.validate(st.cfg.max_model_len)? };
    let model = st.reported_model(params.lora.as_deref());
    let tokens = render_dialect_chat(st, &chat).await?;
    let prompt_len = tokens.len();
    let max_tokens = check_length(prompt_len, params.max_tokens, st.cfg.max_model_len)?;
    let meta = Meta::new("chatcmpl", headers, None, model, st.cfg.enable_request_id_headers);
    let mut generation = st.generate(headers, vec![PreparedPrompt { tokens, max_tokens }], &params).await?;
    if params.stream {
        let fmt = Events { tok: st.tokenizer.clone(), block_open: false, finish: None };
        return Ok(sse(meta, generation, vec![prompt_len], true, fmt));
    }
    let hold = generation.hold.take();
    let results = collect(generation).await?;
    let r = &results[0];
    let text: String = r.tokens.iter().map(|&t| st.tokenizer.token_text(t)).collect();
    let mut body = json!({
        "id": meta.id, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
        "model": model, "stop_reason": stop_reason(r.finish),
        "usage": {"input_tokens": prompt_len, "output_tokens": r.tokens.len()},
    });
    let kv = kv_transfer_reply(st, hold).await;
    if !kv.is_null() {
        body["kv_transfer_params"] = kv;
    }
    let mut resp = json_response(StatusCode::OK, &body);
    echo_header(&mut resp, &meta);
    Ok(resp)
}

/// `_to_anthropic_stop_reason` for text-only generations (an abort has none).
fn stop_reason(f: Option<FinishReason>) -> Option<&'static str> {
    match f {
        Some(FinishReason::Length) => Some("max_tokens"),
        Some(FinishReason::Abort) => None,
        _ => Some("end_turn"),
    }
}

/// The Anthropic event stream of one generation.
struct Events {
    tok: ModelTokenizer,
    block_open: bool,
    finish: Option<FinishReason>,
}

fn event(out: &mut String, name: &str, data: &str) {
    let _ = write!(out, "event: {name}\ndata: {data}\n\n");
}

impl ChunkFormat for Events {
    fn token_chunk(&mut self, meta: &Meta, d: &Delivery, s: &ChoiceState, out: &mut String) {
        if s.generated == 1 {
            let start = format!(
                "{{\"type\":\"message_start\",\"message\":{{\"id\":{},\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":{},\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{{\"input_tokens\":{},\"output_tokens\":0}}}}}}",
                meta.id_json, meta.model_json, s.prompt
            );
            event(out, "message_start", &start);
        }
        if d.out.finish.is_some() {
            self.finish = d.out.finish;
        }
        let text = delivery_text(&self.tok, d);
        if text.is_empty() {
            return;
        }
        if !self.block_open {
            self.block_open = true;
            event(out, "content_block_start", r#"{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#);
        }
        event(
            out,
            "content_block_delta",
            &format!("{{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":{}}},\"index\":0}}", json_str(text)),
        );
    }

    fn usage_chunk(&mut self, _meta: &Meta, prompt: usize, completion: usize, out: &mut String) {
        if self.block_open {
            event(out, "content_block_stop", r#"{"type":"content_block_stop","index":0}"#);
        }
        let delta = format!(
            "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":{},\"stop_sequence\":null}},\"usage\":{{\"input_tokens\":{prompt},\"output_tokens\":{completion}}}}}",
            stop_reason(self.finish).map_or_else(|| "null".to_owned(), json_str)
        );
        event(out, "message_delta", &delta);
    }

    fn done(&mut self, out: &mut String) {
        event(out, "message_stop", r#"{"type":"message_stop"}"#);
    }
}
