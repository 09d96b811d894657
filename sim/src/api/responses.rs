//! The OpenAI Responses API as vLLM 0.32 serves it for models without Harmony
//! (`vllm/entrypoints/openai/responses/serving.py` and `streaming_events.py`, no reasoning or
//! tool parser): `POST /v1/responses` (unary, `stream`, `background`), `GET /v1/responses/{id}`
//! and `POST /v1/responses/{id}/cancel`.
//!
//! - The request becomes a chat request ([`kvgate_tokenize::dialect::responses`]) and is
//!   rendered and generated as chat is; `max_output_tokens` is capped at what the context has
//!   left (vLLM does not refuse a larger one), a prompt of `max_model_len` tokens or more is a
//!   400 naming `input`.
//! - The response: id `resp_<16 hex>` (or the request's `request_id`), one `message` output
//!   item `msg_<16 hex>` with one `output_text` part (no part when the text is empty), status
//!   `incomplete` with `incomplete_details.reason = "max_output_tokens"` when the length limit
//!   stopped it, usage with input/output token details (`cached_tokens` = prefix-cache hits).
//! - A stream is `event: <type>` + `data: {…}` pairs numbered by `sequence_number` from 0:
//!   `response.created`, `response.in_progress`, then at the first text
//!   `response.output_item.added` and `response.content_part.added`, one
//!   `response.output_text.delta` per token with text, `response.output_text.done`,
//!   `response.content_part.done`, `response.output_item.done`, and one `response.completed`
//!   carrying the whole response. No `[DONE]`.
//! - The store ([`crate::config::SimConfig::responses_store`], vLLM's
//!   `VLLM_ENABLE_RESPONSES_API_STORE=1`) keeps each response with `store` (default true) and
//!   the chat messages it was rendered from: `previous_response_id` continues that
//!   conversation, `GET` returns it, `cancel` stops a `background` one (a finished or
//!   synchronous one: 400). Off, nothing is kept and every id is vLLM's 404
//!   `Response with id '…' not found.`; `background` is a 400 asking for the variable.
//!   vllm-sim does not stream background responses.

use super::error::{ApiError, json_response};
use super::generate::{Generation, PreparedPrompt};
use super::protocol::{GenParams, check_cache_salt, parse_body};
use super::response::{ChoiceState, ChunkFormat, Meta, collect, delivery_text, json_str, sse};
use super::{AppState, render_dialect_chat};
use crate::engine::Delivery;
use crate::ids::random_id;
use crate::scheduler::FinishReason;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvgate_tokenize::dialect::responses as dialect;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::sync::Arc;

/// vLLM's 404 for an id the store does not hold.
fn not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("Response with id '{id}' not found."),
        kind: "invalid_request_error",
        param: Some("response_id".into()),
    }
}

fn invalid_request(message: impl Into<String>, param: &str) -> ApiError {
    ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: Some(param.into()) }
}

/// `POST /v1/responses`.
pub async fn create(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        let req: Value = parse_body(&body)?;
        run(&st, &headers, req).await
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match st.response_store.get(&id) {
        Some((response, _)) => json_response(StatusCode::OK, &response),
        None => not_found(&id).into_response(),
    }
}

/// `POST /v1/responses/{id}/cancel`: only a queued or running background response.
pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let mut map = st.response_store.map.lock();
    let Some(stored) = map.get_mut(&id) else { return not_found(&id).into_response() };
    if !matches!(stored.response["status"].as_str(), Some("queued" | "in_progress")) {
        return invalid_request("Cannot cancel a synchronous response.", "response_id").into_response();
    }
    stored.response["status"] = "cancelled".into();
    if let Some(task) = stored.task.take() {
        // Dropping the task's generation aborts its engine request.
        task.abort();
    }
    json_response(StatusCode::OK, &stored.response)
}

/// One request, from its checks to the response that describes it.
struct Turn {
    id: String,
    created: u64,
    req: Value,
    model: String,
    max_output_tokens: usize,
    prompt_len: usize,
    /// Kept in the store (the request's `store`, with the store on).
    store: bool,
    /// The chat messages the prompt was rendered from.
    messages: Vec<Value>,
}

async fn run(st: &Arc<AppState>, headers: &HeaderMap, req: Value) -> Result<Response, ApiError> {
    let lora = st.resolve_model(req.get("model").and_then(Value::as_str))?;
    let cache_salt = check_cache_salt(req.get("cache_salt"))?;
    let wants_store = req.get("store").and_then(Value::as_bool).unwrap_or(true);
    let background = req.get("background").and_then(Value::as_bool).unwrap_or(false);
    if background && wants_store && !st.cfg.responses_store {
        return Err(invalid_request(
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "background",
        ));
    }
    let previous = previous_history(st, &req)?;
    let chat = dialect::to_chat(&req, previous.as_deref()).map_err(|e| st.dialect_error(&e))?;
    let tokens = render_dialect_chat(st, &chat).await?;
    let max_model_len = st.cfg.max_model_len;
    if tokens.len() >= max_model_len {
        return Err(invalid_request(
            format!("The engine prompt length {} exceeds the max_model_len {max_model_len}. Please reduce prompt.", tokens.len()),
            "input",
        ));
    }
    let room = max_model_len - tokens.len();
    let max_output_tokens = req.get("max_output_tokens").and_then(Value::as_u64).map_or(room, |m| (m as usize).min(room));
    let turn = Turn {
        id: req.get("request_id").and_then(Value::as_str).map_or_else(|| format!("resp_{}", random_id()), str::to_owned),
        created: now(),
        model: st.reported_model(lora.as_deref()).to_owned(),
        max_output_tokens,
        prompt_len: tokens.len(),
        store: wants_store && st.cfg.responses_store,
        messages: chat["messages"].as_array().cloned().unwrap_or_default(),
        req,
    };
    let stream = turn.req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let params = GenParams {
        max_tokens: Some(max_output_tokens),
        n: 1,
        min_tokens: 0,
        ignore_eos: turn.req.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false),
        stream,
        include_usage: true,
        continuous_usage: false,
        return_token_ids: false,
        cache_salt,
        lora,
        kv_transfer_params: None,
    };
    let generation = st.generate(headers, vec![PreparedPrompt { tokens, max_tokens: max_output_tokens }], &params).await?;
    if background {
        if stream {
            return Err(invalid_request("vllm-sim does not stream background responses", "stream"));
        }
        return Ok(start_background(st, turn, generation));
    }
    if stream {
        let meta = Meta::new("resp", &HeaderMap::new(), Some(&turn.id), &turn.model, false);
        let fmt = Events { st: st.clone(), turn, seq: 0, item: None, text: String::new(), finish: None, cached: 0 };
        return Ok(sse(meta, generation, vec![fmt.turn.prompt_len], true, fmt));
    }
    let response = finish_unary(st, &turn, generation).await?;
    if turn.store {
        st.response_store.put(&turn.id, response.clone(), turn.messages.clone());
    }
    Ok(json_response(StatusCode::OK, &response))
}

/// The history `previous_response_id` names (404 when the store does not hold it).
fn previous_history(st: &AppState, req: &Value) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(id) = req.get("previous_response_id").and_then(Value::as_str) else { return Ok(None) };
    if req.get("previous_input_messages").is_some_and(|p| !p.is_null()) {
        return Err(invalid_request("Only one of `previous_input_messages` and `previous_response_id` can be set.", "previous_response_id"));
    }
    let (response, messages) = st.response_store.get(id).ok_or_else(|| not_found(id))?;
    let output = response["output"].as_array().cloned().unwrap_or_default();
    Ok(Some(dialect::history(&messages, &output)))
}

async fn finish_unary(st: &AppState, turn: &Turn, generation: Generation) -> Result<Value, ApiError> {
    let results = collect(generation).await?;
    let r = &results[0];
    let text: String = r.tokens.iter().map(|&t| st.tokenizer.token_text(t)).collect();
    Ok(turn.completed(r.finish, &text, r.tokens.len(), r.cached_tokens))
}

/// Answers `queued` at once and finishes in a task the store can cancel.
fn start_background(st: &Arc<AppState>, turn: Turn, generation: Generation) -> Response {
    let queued = turn.response("queued", json!([]), Value::Null);
    st.response_store.put(&turn.id, queued.clone(), turn.messages.clone());
    let store_st = Arc::clone(st);
    let id = turn.id.clone();
    let task = tokio::spawn(async move {
        if let Ok(done) = finish_unary(&store_st, &turn, generation).await {
            store_st.response_store.finish(&turn.id, done);
        }
    });
    if let Some(s) = st.response_store.map.lock().get_mut(&id)
        && s.response["status"] == "queued"
    {
        s.task = Some(task.abort_handle());
    }
    json_response(StatusCode::OK, &queued)
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Turn {
    /// `ResponsesResponse.from_request`, in vLLM's field order.
    fn response(&self, status: &str, output: Value, usage: Value) -> Value {
        let r = &self.req;
        let or = |key: &str, default: Value| r.get(key).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        let tools = or("tools", json!([]));
        let choice = or("tool_choice", json!("auto"));
        // Without tools vLLM turns "auto" (the default) into "none".
        let tool_choice = if tools.as_array().is_none_or(Vec::is_empty) && (choice == "auto" || choice == "none") { json!("none") } else { choice };
        let float = |key: &str, default: f64| json!(r.get(key).and_then(Value::as_f64).unwrap_or(default));
        let incomplete = if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
        // `output` and `usage` are moved into their places afterwards: `json!` would copy them.
        let mut response = json!({
            "id": self.id, "created_at": self.created, "incomplete_details": incomplete,
            "instructions": or("instructions", Value::Null), "metadata": or("metadata", Value::Null),
            "model": self.model, "object": "response", "output": Value::Null,
            "parallel_tool_calls": or("parallel_tool_calls", json!(true)), "temperature": float("temperature", 1.0),
            "tool_choice": tool_choice, "tools": tools, "top_p": float("top_p", 1.0),
            "background": or("background", json!(false)), "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": or("max_tool_calls", Value::Null), "previous_response_id": or("previous_response_id", Value::Null),
            "prompt": Value::Null, "reasoning": or("reasoning", Value::Null), "service_tier": or("service_tier", json!("auto")),
            "status": status, "text": or("text", Value::Null), "top_logprobs": Value::Null,
            "truncation": or("truncation", json!("disabled")), "usage": Value::Null, "user": or("user", Value::Null),
            "presence_penalty": float("presence_penalty", 0.0), "frequency_penalty": float("frequency_penalty", 0.0),
            "kv_transfer_params": Value::Null, "ec_transfer_params": Value::Null,
            "input_messages": Value::Null, "output_messages": Value::Null,
        });
        response["output"] = output;
        response["usage"] = usage;
        response
    }

    /// The finished response: one output message (without a part when the text is empty).
    fn completed(&self, finish: Option<FinishReason>, text: &str, output_tokens: usize, cached: usize) -> Value {
        let item = message_item(&format!("msg_{}", random_id()), text, true);
        self.completed_with(finish, json!([item]), output_tokens, cached)
    }

    fn completed_with(&self, finish: Option<FinishReason>, output: Value, output_tokens: usize, cached: usize) -> Value {
        let status = match finish {
            Some(FinishReason::Length) => "incomplete",
            // vLLM: an aborted generation (a pause) is a cancelled response.
            Some(FinishReason::Abort) => "cancelled",
            _ => "completed",
        };
        self.response(status, output, usage(self.prompt_len, cached, output_tokens))
    }
}

fn usage(input: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": input + output,
    })
}

/// A completed `output_text` part.
fn text_part(text: &str) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": null})
}

/// An assistant message output item; `done` false: the `in_progress` one a stream opens with.
fn message_item(id: &str, text: &str, done: bool) -> Value {
    let content = if done && !text.is_empty() { json!([text_part(text)]) } else { json!([]) };
    let status = if done { "completed" } else { "in_progress" };
    json!({"id": id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": null})
}

/// The Responses event stream of one generation.
struct Events {
    st: Arc<AppState>,
    turn: Turn,
    seq: usize,
    /// The id of the open output message, once text arrived.
    item: Option<String>,
    text: String,
    finish: Option<FinishReason>,
    cached: usize,
}

impl Events {
    /// One event; `body` is the JSON object's fields before `sequence_number` and `type`
    /// (vLLM's field order puts those two last).
    fn event(&mut self, out: &mut String, kind: &str, body: &str) {
        self.event_around(out, kind, body, "");
    }

    /// An event whose fields sort after `sequence_number` (`tail`, with its leading comma).
    fn event_around(&mut self, out: &mut String, kind: &str, body: &str, tail: &str) {
        let _ = write!(out, "event: {kind}\ndata: {{{body},\"sequence_number\":{}{tail},\"type\":\"{kind}\"}}\n\n", self.seq);
        self.seq += 1;
    }

    fn open_item(&mut self, out: &mut String) -> String {
        let id = format!("msg_{}", random_id());
        let item = message_item(&id, "", false);
        self.event(out, "response.output_item.added", &format!("\"item\":{item},\"output_index\":0"));
        let part = json!({"annotations": [], "text": "", "type": "output_text", "logprobs": []});
        self.event(out, "response.content_part.added", &format!("\"content_index\":0,\"item_id\":{},\"output_index\":0,\"part\":{part}", json_str(&id)));
        id
    }

    /// The closing events of the output message; returns the finished item.
    fn close_item(&mut self, id: &str, out: &mut String) -> Value {
        let idj = json_str(id);
        let text = json_str(&self.text);
        self.event_around(
            out,
            "response.output_text.done",
            &format!("\"content_index\":0,\"item_id\":{idj},\"logprobs\":[],\"output_index\":0"),
            &format!(",\"text\":{text}"),
        );
        let part = text_part(&self.text);
        self.event(out, "response.content_part.done", &format!("\"content_index\":0,\"item_id\":{idj},\"output_index\":0,\"part\":{part}"));
        let item = message_item(id, &self.text, true);
        self.event(out, "response.output_item.done", &format!("\"item\":{item},\"output_index\":0"));
        item
    }
}

impl ChunkFormat for Events {
    fn head(&mut self, _meta: &Meta, out: &mut String) {
        let initial = self.turn.response("in_progress", json!([]), Value::Null);
        self.event(out, "response.created", &format!("\"response\":{initial}"));
        self.event(out, "response.in_progress", &format!("\"response\":{initial}"));
    }

    fn token_chunk(&mut self, _meta: &Meta, d: &Delivery, _s: &ChoiceState, out: &mut String) {
        self.cached = d.out.num_cached_tokens;
        if d.out.finish.is_some() {
            self.finish = d.out.finish;
        }
        let delta = delivery_text(&self.st.tokenizer, d).to_owned();
        if delta.is_empty() {
            return;
        }
        let id = match self.item.clone() {
            Some(id) => id,
            None => {
                let id = self.open_item(out);
                self.item = Some(id.clone());
                id
            }
        };
        self.text.push_str(&delta);
        self.event(
            out,
            "response.output_text.delta",
            &format!("\"content_index\":0,\"delta\":{},\"item_id\":{},\"logprobs\":[],\"output_index\":0", json_str(&delta), json_str(&id)),
        );
    }

    fn usage_chunk(&mut self, _meta: &Meta, _prompt: usize, completion: usize, out: &mut String) {
        let output = match self.item.clone() {
            Some(id) => json!([self.close_item(&id, out)]),
            None => json!([]),
        };
        let response = self.turn.completed_with(self.finish, output, completion, self.cached);
        if self.turn.store {
            self.st.response_store.put(&self.turn.id, response.clone(), self.turn.messages.clone());
        }
        self.event(out, "response.completed", &format!("\"response\":{response}"));
    }

    fn done(&mut self, _out: &mut String) {}
}
