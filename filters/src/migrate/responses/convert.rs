//! The Responses events vLLM 0.32 streams for a request, made from the chat stream of its
//! translation (`kvgate_tokenize::dialect::responses::stream::to_chat`): vLLM's non-Harmony
//! `/v1/responses` stream (`serving.py` `responses_stream_generator`, `streaming_events.py`
//! `SimpleStreamingEventProcessor`), event for event and field for field.
//!
//! [`ResponsesStream`] takes the chat chunks one at a time ([`ResponsesStream::chunk`], or SSE
//! bytes with [`ResponsesStream::feed`]), from the worker and then, after a move, from the
//! continuation re-wrapped as chat chunks; it is one object for the whole client stream, so ids
//! and `sequence_number`s simply continue across a move and `response.completed` is sent once.
//! What it sends:
//! - at the first chunk, `response.created` and `response.in_progress` with the response object
//!   (`ResponsesResponse.from_request`: status `in_progress`, no output, no usage);
//! - non-empty text opens a message item (`response.output_item.added`, then
//!   `response.content_part.added` of an empty `output_text`) and each chunk's text is one
//!   `response.output_text.delta`; reasoning text (a worker with a reasoning parser) opens a
//!   reasoning item the same way (`response.reasoning_text.delta`); a change of kind closes the
//!   open item first;
//! - at the end (the usage-only chunk after a finish, `[DONE]`, or [`ResponsesStream::finish`]),
//!   the open item is closed (`response.output_text.done`, `response.content_part.done`,
//!   `response.output_item.done`) and `response.completed` carries the whole response: status
//!   `completed`, or `incomplete` with `incomplete_details.reason` `max_output_tokens` after a
//!   `length` finish (vLLM sends `response.completed` in both cases), the done items as
//!   `output`, and the usage from the chat usage.
//!
//! Every event is framed as vLLM frames it, `event: <type>` then `data: <json>`, its fields in
//! vLLM's order, `sequence_number` from 0 up by one.
//!
//! What cannot be vLLM's own, and why:
//! - the item ids (`msg_…`, `rs_…`): vLLM makes each from a fresh random 64-bit value; here too
//!   (16 hex digits), so they differ from any run of vLLM's, as two runs of vLLM differ;
//! - `created_at`: vLLM's clock when its stream starts; here the chat chunk's `created` (the
//!   chat request's start on the worker, kept by a continuation), unless the setup names one;
//! - `usage.input_tokens_details.cached_tokens` and `cache_write_tokens`: vLLM's engine counts,
//!   which a chat stream reports (`prompt_tokens_details.cached_tokens`,
//!   `created_cache_tokens`) only from a worker run with `--enable-prompt-tokens-details`; then
//!   they are vLLM's own (fixtures `multi_turn`, `cached`), else 0 here (fixture `no_details`:
//!   vLLM says 64 written); after a move, what the continuation's usage says;
//! - `usage.output_tokens_details.reasoning_tokens`: the chat usage's count, when a reasoning
//!   parser reports it, else 0 (vLLM's Responses path counts with its own parser);
//! - the echoed `temperature`, `top_p`, `presence_penalty`, `frequency_penalty` and
//!   `max_output_tokens` of a request that leaves them out: vLLM echoes the model's
//!   generation-config defaults, which the gateway knows only as [`ModelDefaults`]; the default
//!   `max_output_tokens` also needs `max_model_len` (null without it);
//! - the grouping of text into deltas: vLLM's engine merges the deltas of several tokens when its
//!   consumer is slower than the engine, so two runs of vLLM (and its chat and Responses
//!   endpoints) may cut the same text differently; here each chat chunk's text is one delta;
//! - a worker error: vLLM 0.32's Responses stream fails on its own error path
//!   (`_convert_generation_error_to_streaming_response` output is not a stream event); here it
//!   is an OpenAI `error` event, after which nothing more is sent;
//! - `metrics` (vLLM's `--enable-per-request-metrics`) is never sent.

use super::super::events::{EventSplitter, is_done, payload};
use serde_json::{Map, Value, json};

/// Sampling defaults of the model's generation config (vLLM's `get_diff_sampling_param`,
/// `--generation-config`), which vLLM echoes for a request that leaves the field out. All
/// `None` (vLLM's neutral defaults: 1.0, 1.0, 0.0, 0.0, no limit) unless known.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelDefaults {
    /// Default `temperature`.
    pub temperature: Option<f64>,
    /// Default `top_p`.
    pub top_p: Option<f64>,
    /// Default `presence_penalty`.
    pub presence_penalty: Option<f64>,
    /// Default `frequency_penalty`.
    pub frequency_penalty: Option<f64>,
    /// Default output limit (`max_new_tokens`), for a request without `max_output_tokens`.
    pub max_tokens: Option<u64>,
}

/// What the converter needs besides the request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamSetup {
    /// The model's context length (the workers' `max_model_len`): the echoed
    /// `max_output_tokens` is at most what remains of it after the prompt.
    pub max_model_len: Option<u64>,
    /// The model's generation-config defaults.
    pub defaults: ModelDefaults,
    /// `created_at`; `None`: the first chat chunk's `created`.
    pub created_at: Option<u64>,
    /// The prompt's length in tokens; `None`: read from the first chat chunk (its `usage`, or
    /// its `prompt_token_ids`).
    pub prompt_tokens: Option<u64>,
}

/// The kind of the output item open now (vLLM's `_StateType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Reasoning,
}

/// The open output item.
#[derive(Debug)]
struct Open {
    kind: Kind,
    id: String,
    text: String,
}

/// The chat usage, as far as the response's usage needs it.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
    cache_write: u64,
    reasoning: u64,
}

/// Converts one chat stream into the Responses events vLLM sends for the request.
#[derive(Debug)]
pub struct ResponsesStream {
    /// The response object's fields taken from the request, in vLLM's order, with
    /// placeholders for those known only later.
    echo: Map<String, Value>,
    request_max: Option<u64>,
    setup: StreamSetup,
    splitter: EventSplitter,
    seq: u64,
    started: bool,
    open: Option<Open>,
    output_index: u64,
    /// The items done, the response's `output`.
    output: Vec<Value>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    completed: bool,
    failed: bool,
}

impl ResponsesStream {
    /// A converter for the Responses request `body` (the client's, as translated). The response
    /// id is its `request_id` (vLLM names the response after it), or a fresh `resp_…` id.
    pub fn new(body: &Value, setup: StreamSetup) -> Self {
        let get = |k: &str| body.get(k).filter(|v| !v.is_null());
        let float = |k: &str, default: Option<f64>, neutral: f64| get(k).and_then(Value::as_f64).or(default).unwrap_or(neutral);
        let d = setup.defaults;
        // `SamplingParams.__post_init__`: a temperature below 0.01 is raised to it, and greedy
        // sampling (below 1e-5) sets top_p to 1.
        let mut temperature = float("temperature", d.temperature, 1.0);
        if temperature > 0.0 && temperature < 1e-2 {
            temperature = 1e-2;
        }
        let top_p = if temperature < 1e-5 { 1.0 } else { float("top_p", d.top_p, 1.0) };
        let id = get("request_id").and_then(Value::as_str).map_or_else(|| format!("resp_{}", fresh_hex()), str::to_owned);
        let text = get("text").map(|t| {
            let format = t.get("format").filter(|f| !f.is_null()).map_or(Value::Null, |f| json!({"type": f.get("type").cloned().unwrap_or(Value::Null)}));
            json!({"format": format, "verbosity": t.get("verbosity").cloned().unwrap_or(Value::Null)})
        });
        let or_null = |k: &str| get(k).cloned().unwrap_or(Value::Null);
        let echo = json!({
            "id": id,
            "created_at": null,
            "incomplete_details": null,
            "instructions": or_null("instructions"),
            "metadata": or_null("metadata"),
            "model": or_null("model"),
            "object": "response",
            "output": [],
            "parallel_tool_calls": get("parallel_tool_calls").cloned().unwrap_or(Value::Bool(true)),
            "temperature": temperature,
            // The translation takes only `auto` / `none` without tools, which vLLM makes `none`.
            "tool_choice": "none",
            "tools": [],
            "top_p": top_p,
            "background": get("background").cloned().unwrap_or(Value::Bool(false)),
            "max_output_tokens": null,
            "max_tool_calls": or_null("max_tool_calls"),
            "previous_response_id": null,
            "prompt": null,
            "reasoning": null,
            "service_tier": get("service_tier").cloned().unwrap_or_else(|| "auto".into()),
            "status": "in_progress",
            "text": text,
            "top_logprobs": null,
            "truncation": get("truncation").cloned().unwrap_or_else(|| "disabled".into()),
            "usage": null,
            "user": or_null("user"),
            "presence_penalty": float("presence_penalty", d.presence_penalty, 0.0),
            "frequency_penalty": float("frequency_penalty", d.frequency_penalty, 0.0),
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "input_messages": null,
            "output_messages": null,
        });
        let Value::Object(echo) = echo else { unreachable!("a JSON object literal") };
        Self {
            echo,
            request_max: get("max_output_tokens").and_then(Value::as_u64),
            setup,
            splitter: EventSplitter::default(),
            seq: 0,
            started: false,
            open: None,
            output_index: 0,
            output: Vec::new(),
            finish_reason: None,
            usage: None,
            completed: false,
            failed: false,
        }
    }

    /// The response id (`resp_…`).
    pub fn response_id(&self) -> &str {
        self.echo["id"].as_str().unwrap_or_default()
    }

    /// The `sequence_number` the next event gets (the number of events sent so far).
    pub fn next_sequence_number(&self) -> u64 {
        self.seq
    }

    /// Whether `response.completed` was sent.
    pub fn is_completed(&self) -> bool {
        self.completed
    }

    /// Whether the stream ended with an `error` event.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// Converts a piece of a chat SSE stream (whole events or not: an unfinished one waits for
    /// its end). `data: [DONE]` ends the response.
    pub fn feed(&mut self, chat: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        if self.over() {
            return out;
        }
        if self.splitter.push(chat).is_err() {
            self.error(&mut out, "the worker sent an oversized event");
            return out;
        }
        while !self.over()
            && let Some(ev) = self.splitter.next_event()
        {
            if is_done(&ev) {
                self.complete(&mut out);
                continue;
            }
            let Some(data) = payload(&ev) else { continue };
            match serde_json::from_slice::<Value>(data) {
                Ok(chunk) => self.chunk_into(&chunk, &mut out),
                Err(e) => self.error(&mut out, &format!("unreadable chat event: {e}")),
            }
        }
        out
    }

    /// Converts one chat chunk (a `chat.completion.chunk` object, or an `{"error": …}` event).
    pub fn chunk(&mut self, chunk: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        self.chunk_into(chunk, &mut out);
        out
    }

    /// Ends the response (the chat stream's `[DONE]`, or the gateway ending a stream whose
    /// tokens were all generated): closes the open item and sends `response.completed`, once.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        self.complete(&mut out);
        out
    }

    fn over(&self) -> bool {
        self.completed || self.failed
    }

    fn chunk_into(&mut self, chunk: &Value, out: &mut Vec<u8>) {
        if self.over() {
            return;
        }
        if let Some(e) = chunk.get("error") {
            let message = e.get("message").and_then(Value::as_str).map_or_else(|| e.to_string(), str::to_owned);
            self.error(out, &message);
            return;
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            self.usage = Some(read_usage(u));
        }
        self.start(Some(chunk), out);
        let choices = chunk.get("choices").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        let Some(choice) = choices.iter().find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0) else {
            // The usage-only chunk that follows the finish ends the response.
            if choices.is_empty() && self.finish_reason.is_some() && chunk.get("usage").is_some_and(|u| !u.is_null()) {
                self.complete(out);
            }
            return;
        };
        let delta = choice.get("delta");
        if let Some(reasoning) = delta.and_then(|d| d.get("reasoning")).and_then(Value::as_str) {
            self.delta(Kind::Reasoning, reasoning, out);
        }
        if let Some(text) = delta.and_then(|d| d.get("content")).and_then(Value::as_str).filter(|t| !t.is_empty()) {
            self.delta(Kind::Text, text, out);
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            if f == "error" {
                self.error(out, "the worker failed to generate");
                return;
            }
            self.finish_reason = Some(f.to_owned());
        }
    }

    /// `response.created` and `response.in_progress`, before anything else.
    fn start(&mut self, chunk: Option<&Value>, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        if let Some(model) = chunk.and_then(|c| c.get("model")).filter(|m| m.is_string()) {
            self.echo.insert("model".into(), model.clone());
        }
        let created = self.setup.created_at.or_else(|| chunk.and_then(|c| c.get("created")).and_then(Value::as_u64)).unwrap_or_else(now);
        self.echo.insert("created_at".into(), created.into());
        let prompt = self
            .setup
            .prompt_tokens
            .or_else(|| self.usage.map(|u| u.prompt))
            .or_else(|| chunk.and_then(|c| c.get("prompt_token_ids")).and_then(Value::as_array).map(|ids| ids.len() as u64));
        self.echo.insert("max_output_tokens".into(), self.max_output_tokens(prompt).map_or(Value::Null, Value::from));
        let response = Value::Object(self.echo.clone());
        self.event(out, "response.created", json!({"response": response}));
        self.event(out, "response.in_progress", json!({"response": response}));
    }

    /// vLLM's `sampling_params.max_tokens`: `get_max_tokens` (what remains of the context after
    /// the prompt, the request's or the model's limit) and the request's limit within it.
    fn max_output_tokens(&self, prompt: Option<u64>) -> Option<u64> {
        let room = self.setup.max_model_len.zip(prompt).map(|(len, p)| len.saturating_sub(p));
        let fallback = self.request_max.or(self.setup.defaults.max_tokens);
        [room, fallback].into_iter().flatten().min()
    }

    /// One piece of text of `kind`: the open item continues, or it is closed and one of `kind`
    /// opened.
    fn delta(&mut self, kind: Kind, text: &str, out: &mut Vec<u8>) {
        if self.open.as_ref().map(|o| o.kind) != Some(kind) {
            self.close(out);
            self.open_item(kind, out);
        }
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(text);
        let id = open.id.clone();
        let i = self.output_index;
        match kind {
            Kind::Text => {
                self.event(out, "response.output_text.delta", json!({"content_index": 0, "delta": text, "item_id": id, "logprobs": [], "output_index": i}))
            }
            Kind::Reasoning => self.event(out, "response.reasoning_text.delta", json!({"content_index": 0, "delta": text, "item_id": id, "output_index": i})),
        }
    }

    fn open_item(&mut self, kind: Kind, out: &mut Vec<u8>) {
        let i = self.output_index;
        let (id, item, part) = match kind {
            Kind::Text => {
                let id = format!("msg_{}", fresh_hex());
                let item = json!({"id": id, "content": [], "role": "assistant", "status": "in_progress", "type": "message", "phase": null});
                (id, item, json!({"annotations": [], "text": "", "type": "output_text", "logprobs": []}))
            }
            Kind::Reasoning => {
                let id = format!("rs_{}", fresh_hex());
                let item = json!({"id": id, "summary": [], "type": "reasoning", "content": null, "encrypted_content": null, "status": "in_progress"});
                (id, item, json!({"text": "", "type": "reasoning_text"}))
            }
        };
        self.event(out, "response.output_item.added", json!({"item": item, "output_index": i}));
        self.event(out, "response.content_part.added", json!({"content_index": 0, "item_id": id, "output_index": i, "part": part}));
        self.open = Some(Open { kind, id, text: String::new() });
    }

    /// Closes the open item: its text done, its part done, the item done (and kept as output).
    fn close(&mut self, out: &mut Vec<u8>) {
        let Some(Open { kind, id, text }) = self.open.take() else { return };
        let i = self.output_index;
        let item = match kind {
            Kind::Text => {
                let part = json!({"annotations": [], "text": text, "type": "output_text", "logprobs": null});
                self.event(
                    out,
                    "response.output_text.done",
                    json!({"content_index": 0, "item_id": id, "logprobs": [], "output_index": i, "SEQ": null, "text": text}),
                );
                self.event(out, "response.content_part.done", json!({"content_index": 0, "item_id": id, "output_index": i, "part": part}));
                let content = if text.is_empty() { json!([]) } else { json!([part]) };
                json!({"id": id, "content": content, "role": "assistant", "status": "completed", "type": "message", "phase": null})
            }
            Kind::Reasoning => {
                let part = json!({"text": text, "type": "reasoning_text"});
                self.event(out, "response.reasoning_text.done", json!({"content_index": 0, "item_id": id, "output_index": i, "SEQ": null, "text": text}));
                self.event(out, "response.content_part.done", json!({"content_index": 0, "item_id": id, "output_index": i, "part": part}));
                json!({"id": id, "summary": [], "type": "reasoning", "content": [part], "encrypted_content": null, "status": "completed"})
            }
        };
        self.event(out, "response.output_item.done", json!({"item": item, "output_index": i}));
        self.output.push(item);
        self.output_index += 1;
    }

    /// The end: the open item closed, then `response.completed` with the whole response.
    fn complete(&mut self, out: &mut Vec<u8>) {
        if self.over() {
            return;
        }
        self.start(None, out);
        self.close(out);
        self.completed = true;
        let incomplete = self.finish_reason.as_deref() == Some("length");
        let mut response = self.echo.clone();
        if incomplete {
            response.insert("incomplete_details".into(), json!({"reason": "max_output_tokens"}));
        }
        response.insert("output".into(), Value::Array(std::mem::take(&mut self.output)));
        response.insert("status".into(), if incomplete { "incomplete" } else { "completed" }.into());
        response.insert("usage".into(), self.response_usage());
        self.event(out, "response.completed", json!({"response": response}));
    }

    /// vLLM's `ResponseUsage` (per-turn lists are empty on this path).
    fn response_usage(&self) -> Value {
        let u = self.usage.unwrap_or_default();
        json!({
            "input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": u.cache_write, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": u.completion,
            "output_tokens_details": {"reasoning_tokens": u.reasoning, "tool_output_tokens": 0, "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": u.prompt + u.completion,
        })
    }

    /// An OpenAI `error` event; nothing follows it.
    fn error(&mut self, out: &mut Vec<u8>, message: &str) {
        self.failed = true;
        self.event(out, "error", json!({"code": null, "message": message, "param": null}));
    }

    /// Frames one event: `sequence_number` and `type` go last (vLLM's field order), or where
    /// the body has a `SEQ` placeholder (the `.done` events, whose `text` follows them).
    fn event(&mut self, out: &mut Vec<u8>, kind: &str, body: Value) {
        let Value::Object(body) = body else { return };
        let mut data = Map::with_capacity(body.len() + 2);
        let mut placed = false;
        for (k, v) in body {
            if k == "SEQ" {
                data.insert("sequence_number".into(), self.seq.into());
                placed = true;
            } else {
                data.insert(k, v);
            }
        }
        if !placed {
            data.insert("sequence_number".into(), self.seq.into());
        }
        data.insert("type".into(), kind.into());
        self.seq += 1;
        out.extend_from_slice(format!("event: {kind}\ndata: {}\n\n", Value::Object(data)).as_bytes());
    }
}

/// The chat `usage` object read.
fn read_usage(u: &Value) -> Usage {
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
    let prompt_details = u.get("prompt_tokens_details");
    Usage {
        prompt: n(u.get("prompt_tokens")),
        completion: n(u.get("completion_tokens")),
        cached: n(prompt_details.and_then(|d| d.get("cached_tokens"))),
        cache_write: n(prompt_details.and_then(|d| d.get("created_cache_tokens"))),
        reasoning: n(u.get("completion_tokens_details").and_then(|d| d.get("reasoning_tokens"))),
    }
}

/// The clock, in seconds.
fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// 16 fresh hex digits, as vLLM's `random_uuid()` (a uuid4's low 64 bits).
fn fresh_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    format!("{:016x}", h.finish())
}

#[cfg(test)]
mod tests;
