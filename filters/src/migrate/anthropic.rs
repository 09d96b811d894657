//! An Anthropic Messages stream served by a chat-completions stream, as vLLM 0.32 serves
//! `/v1/messages` itself (`vllm/entrypoints/anthropic/serving.py`): vLLM turns a Messages
//! request into a chat request, runs chat, and converts the chat chunks into Anthropic events
//! (`message_stream_converter`). The gateway does the same for a Messages stream that may move,
//! so that the stream it follows is a chat stream with token ids (docs/migration.md).
//!
//! [`MessagesStream`] is that converter: chat events (the source worker's, ids stripped, or a
//! continuation's re-wrapped in chat's shape) in, Anthropic events out, byte for byte what
//! vLLM's own `/v1/messages` sends for the same chat events:
//! - the first chunk (the role chunk) becomes `message_start`, with the chunk's `id` and
//!   `model` (vLLM reuses the chat completion's id) and its usage;
//! - text and reasoning deltas open a `text` / `thinking` block (`content_block_start`) and
//!   become `text_delta` / `thinking_delta`; a block ends (`content_block_stop`, a thinking
//!   block after a `signature_delta` with a fresh signature) when another kind starts or the
//!   message ends; tool-call deltas open `tool_use` blocks with `input_json_delta`s (text that
//!   arrives inside a tool call is held and sent as a text block after it);
//! - the usage-only chunk (`choices: []`) becomes `message_delta` with the stop reason
//!   (`_to_anthropic_stop_reason`) and the usage; `[DONE]` becomes `message_stop`.
//!
//! An error event from the worker becomes an Anthropic `error` event, after which nothing more
//! is sent (vLLM's converter stops at the first chunk it cannot read; its message is then
//! pydantic's validation text, here the worker's own message). [`error_body`] is vLLM's
//! `translate_error_response` for an error status; [`MessagesReply`] applies one or the other
//! to whatever the worker answers.

use super::events::EventSplitter;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value, json};
use std::collections::HashMap;

/// What vLLM's chat endpoint streams, as far as the converter reads it.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    id: Option<String>,
    model: String,
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Delta,
    #[serde(default)]
    finish_reason: Option<String>,
    #[serde(default)]
    stop_reason: Option<Value>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    id: Option<String>,
    index: i64,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: i64,
    #[serde(default)]
    completion_tokens: Option<i64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<i64>,
    #[serde(default)]
    created_cache_tokens: Option<i64>,
}

/// The kind of the content block open now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Text,
    Thinking,
    ToolUse,
}

/// The open content block (vLLM's `_ActiveBlockState`).
#[derive(Debug, Default)]
struct Blocks {
    /// The index the next block gets.
    next: u64,
    /// The open block's kind and index.
    open: Option<(BlockKind, u64)>,
    /// A thinking block's signature, until it is sent.
    signature: Option<String>,
    /// The open `tool_use` block's id.
    tool_use_id: Option<String>,
    /// Text that came while a `tool_use` block was open.
    pending: String,
}

/// Converts one chat stream into the Anthropic Messages events vLLM sends for it.
#[derive(Debug, Default)]
pub struct MessagesStream {
    splitter: EventSplitter,
    started: bool,
    finish_reason: Option<String>,
    /// The finishing choice's `stop_reason`: a matched stop string, a stop token id, or null.
    stop_reason: Option<Value>,
    tool_used: bool,
    /// The arguments of the latest `tool_use` block.
    last_tool_args: String,
    tool_ids: HashMap<i64, String>,
    blocks: Blocks,
    /// An error event went out: vLLM's converter stops there.
    over: bool,
}

impl MessagesStream {
    /// Converts a piece of the chat stream (whole events or not: an unfinished one waits for
    /// its end) into Anthropic events.
    pub fn feed(&mut self, chat: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        if self.over {
            return out;
        }
        if self.splitter.push(chat).is_err() {
            self.error(&mut out, "the worker sent an oversized event");
            return out;
        }
        while !self.over
            && let Some(ev) = self.splitter.next_event()
        {
            self.event(&ev, &mut out);
        }
        out
    }

    /// Whether the stream ended with an error event.
    pub fn failed(&self) -> bool {
        self.over
    }

    fn event(&mut self, ev: &[u8], out: &mut Vec<u8>) {
        let Some(data) = ev.strip_prefix(b"data:") else {
            // vLLM answers an item that is not a data line with this error and goes on.
            out.extend_from_slice(&frame("error", &error_event("Invalid data format received")));
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.stop_and_flush(out);
            out.extend_from_slice(&frame("message_stop", &json!({"type": "message_stop"})));
            return;
        }
        match serde_json::from_slice::<Chunk>(data) {
            Ok(chunk) => self.chunk(chunk, out),
            Err(e) => {
                let message = serde_json::from_slice::<Value>(data)
                    .ok()
                    .and_then(|v| v.get("error").map(|e| e.get("message").and_then(Value::as_str).map_or_else(|| e.to_string(), str::to_owned)));
                self.error(out, &message.unwrap_or_else(|| format!("unreadable chat event: {e}")));
            }
        }
    }

    fn error(&mut self, out: &mut Vec<u8>, message: &str) {
        out.extend_from_slice(&frame("error", &error_event(message)));
        self.over = true;
    }

    fn chunk(&mut self, chunk: Chunk, out: &mut Vec<u8>) {
        if !self.started {
            self.started = true;
            // vLLM's chunks always carry one (the chat completion's, which the message reuses).
            let id = chunk.id.unwrap_or_else(|| format!("chatcmpl-{}", signature()));
            let message = json!({"id": id, "type": "message", "role": "assistant", "content": [], "model": chunk.model,
                                 "stop_reason": null, "stop_sequence": null, "usage": usage(chunk.usage.as_ref())});
            out.extend_from_slice(&frame("message_start", &json!({"type": "message_start", "message": message})));
            return;
        }
        let Some(choice) = chunk.choices.into_iter().next() else {
            self.message_delta(chunk.usage.as_ref(), out);
            return;
        };
        if let Some(f) = choice.finish_reason {
            self.finish_reason = Some(f);
            self.stop_reason = choice.stop_reason;
        }
        let Delta { content, reasoning, tool_calls } = choice.delta;
        if let Some(r) = reasoning.filter(|r| !r.is_empty()) {
            if self.blocks.open.map(|b| b.0) != Some(BlockKind::Thinking) {
                self.stop_and_flush(out);
                self.start_block(BlockKind::Thinking, &json!({"type": "thinking", "thinking": ""}), out);
            }
            self.delta(&json!({"type": "thinking_delta", "thinking": r}), out);
        }
        if let Some(text) = content.filter(|c| !c.is_empty()) {
            match self.blocks.open.map(|b| b.0) {
                Some(BlockKind::ToolUse) => self.blocks.pending.push_str(&text),
                kind => {
                    if kind != Some(BlockKind::Text) {
                        self.stop_and_flush(out);
                        self.start_block(BlockKind::Text, &json!({"type": "text", "text": ""}), out);
                    }
                    self.delta(&json!({"type": "text_delta", "text": text}), out);
                }
            }
        }
        for call in tool_calls.unwrap_or_default() {
            self.tool_call(call, out);
        }
    }

    /// One tool-call delta: a new call (an id and a name) opens a `tool_use` block; arguments
    /// go to the open block if they belong to it.
    fn tool_call(&mut self, call: ToolCallDelta, out: &mut Vec<u8>) {
        let (name, arguments) = call.function.map_or((None, None), |f| (f.name, f.arguments));
        let id = match call.id {
            Some(id) => {
                self.tool_ids.insert(call.index, id.clone());
                if let Some(name) = name.filter(|_| self.blocks.tool_use_id.as_deref() != Some(id.as_str())) {
                    self.stop_and_flush(out);
                    self.tool_used = true;
                    self.last_tool_args.clear();
                    self.start_block(BlockKind::ToolUse, &json!({"type": "tool_use", "id": id, "name": name, "input": {}}), out);
                    self.blocks.tool_use_id = Some(id.clone());
                }
                Some(id)
            }
            None => self.tool_ids.get(&call.index).cloned(),
        };
        if let Some(args) = arguments.filter(|a| !a.is_empty())
            && id.is_some()
            && self.blocks.tool_use_id == id
        {
            self.last_tool_args.push_str(&args);
            self.delta(&json!({"type": "input_json_delta", "partial_json": args}), out);
        }
    }

    /// The usage-only chunk: the message's end, its stop reason and usage.
    fn message_delta(&mut self, u: Option<&Usage>, out: &mut Vec<u8>) {
        self.stop_and_flush(out);
        let tool_complete = self.tool_used && serde_json::from_str::<IgnoredAny>(&self.last_tool_args).is_ok();
        let (reason, sequence) =
            stop_reason(self.finish_reason.as_deref().filter(|f| !f.is_empty()).unwrap_or("stop"), self.stop_reason.as_ref(), self.tool_used, tool_complete);
        let ev = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(u)});
        out.extend_from_slice(&frame("message_delta", &ev));
    }

    fn start_block(&mut self, kind: BlockKind, block: &Value, out: &mut Vec<u8>) {
        let index = self.blocks.next;
        out.extend_from_slice(&frame("content_block_start", &json!({"type": "content_block_start", "content_block": block, "index": index})));
        self.blocks.open = Some((kind, index));
        self.blocks.signature = (kind == BlockKind::Thinking).then(signature);
        self.blocks.tool_use_id = None;
    }

    fn delta(&self, delta: &Value, out: &mut Vec<u8>) {
        let index = self.blocks.open.map_or(self.blocks.next, |b| b.1);
        out.extend_from_slice(&frame("content_block_delta", &json!({"type": "content_block_delta", "delta": delta, "index": index})));
    }

    /// Ends the open block, a thinking block after its signature.
    fn stop_block(&mut self, out: &mut Vec<u8>) {
        let Some((_, index)) = self.blocks.open.take() else { return };
        if let Some(sig) = self.blocks.signature.take() {
            out.extend_from_slice(&frame(
                "content_block_delta",
                &json!({"type": "content_block_delta", "delta": {"type": "signature_delta", "signature": sig}, "index": index}),
            ));
        }
        out.extend_from_slice(&frame("content_block_stop", &json!({"type": "content_block_stop", "index": index})));
        self.blocks.tool_use_id = None;
        self.blocks.next += 1;
    }

    /// Ends the open block; text held while a tool call was open follows as a block of its own.
    fn stop_and_flush(&mut self, out: &mut Vec<u8>) {
        let held = std::mem::take(&mut self.blocks.pending);
        self.stop_block(out);
        if held.is_empty() {
            return;
        }
        self.start_block(BlockKind::Text, &json!({"type": "text", "text": ""}), out);
        self.delta(&json!({"type": "text_delta", "text": held}), out);
        self.stop_block(out);
    }
}

/// `event: <name>` and `data: <json>`, as vLLM's `wrap_data_with_event` frames them.
fn frame(name: &str, data: &Value) -> Vec<u8> {
    format!("event: {name}\ndata: {data}\n\n").into_bytes()
}

fn error_event(message: &str) -> Value {
    json!({"type": "error", "error": {"type": "internal_error", "message": message}})
}

/// vLLM's `_build_anthropic_usage`: input tokens are the prompt's less what the cache read or
/// wrote (when the worker reports those), output tokens the completion's.
fn usage(u: Option<&Usage>) -> Value {
    let Some(u) = u else { return json!({"input_tokens": 0, "output_tokens": 0}) };
    let mut input = u.prompt_tokens;
    let mut cache = Map::new();
    if let Some(d) = &u.prompt_tokens_details {
        if let Some(created) = d.created_cache_tokens {
            input -= created;
            cache.insert("cache_creation_input_tokens".into(), created.into());
        }
        if let Some(read) = d.cached_tokens {
            input -= read;
            cache.insert("cache_read_input_tokens".into(), read.into());
        }
    }
    let mut out = Map::new();
    out.insert("input_tokens".into(), input.max(0).into());
    out.insert("output_tokens".into(), u.completion_tokens.unwrap_or(0).into());
    out.extend(cache);
    Value::Object(out)
}

/// vLLM's `_to_anthropic_stop_reason`: `max_tokens` always wins; a matched stop string wins
/// unless the tool calls are complete; a tool call otherwise makes it `tool_use`.
fn stop_reason(finish: &str, stop: Option<&Value>, tool_used: bool, tool_complete: bool) -> (Value, Value) {
    match finish {
        "length" => (json!("max_tokens"), Value::Null),
        "stop" | "tool_calls" if tool_complete => (json!("tool_use"), Value::Null),
        "stop" | "tool_calls" => match stop {
            Some(Value::String(s)) => (json!("stop_sequence"), json!(s)),
            _ if finish == "tool_calls" || tool_used => (json!("tool_use"), Value::Null),
            _ => (json!("end_turn"), Value::Null),
        },
        _ => (Value::Null, Value::Null),
    }
}

/// A thinking block's signature: 32 fresh hex digits (vLLM's `uuid.uuid4().hex`).
fn signature() -> String {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let half = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(nanos);
        h.write_u64(salt);
        h.finish()
    };
    format!("{:016x}{:016x}", half(1), half(2))
}

/// Longest error body reshaped (vLLM's are a few hundred bytes); a longer one passes as it is.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The answer to a Messages request its worker was sent as chat, as the client must see it: a
/// stream's events converted ([`MessagesStream`]), an error answer reshaped ([`error_body`]).
#[derive(Debug)]
pub enum MessagesReply {
    /// A stream (a 200). Boxed: the reply lives in every request's state, most without one.
    Stream(Box<MessagesStream>),
    /// An error status's body, gathered whole to be reshaped at its end.
    Error(Vec<u8>),
    /// A body passed on as the worker sent it (an error body too long to gather).
    Raw,
}

impl Default for MessagesReply {
    fn default() -> Self {
        Self::Stream(Box::default())
    }
}

impl MessagesReply {
    /// The worker answered with an error status: its body is an error to reshape.
    pub fn error_status(&mut self) {
        *self = Self::Error(Vec::new());
    }

    /// The client's bytes for a piece of the worker's answer (`end`: the answer is complete).
    pub fn answer(&mut self, bytes: &[u8], end: bool) -> Vec<u8> {
        match self {
            Self::Stream(s) => s.feed(bytes),
            Self::Raw => bytes.to_vec(),
            Self::Error(held) if held.len() + bytes.len() > MAX_ERROR_BODY => {
                let out = [&held[..], bytes].concat();
                *self = Self::Raw;
                out
            }
            Self::Error(held) => {
                held.extend_from_slice(bytes);
                if !end {
                    return Vec::new();
                }
                let body = std::mem::take(held);
                error_body(&body).unwrap_or(body)
            }
        }
    }
}

/// vLLM's `translate_error_response`: the chat endpoint's error body (`{"error": {"message",
/// "type", …}}`) as its Messages endpoint answers the same error, `{"type": "error", "error":
/// {"type", "message"}}`. `None` for a body that is not such an error (passed on unchanged).
pub fn error_body(body: &[u8]) -> Option<Vec<u8>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let e = v.get("error")?;
    let kind = e.get("type")?.as_str()?;
    let message = e.get("message")?.as_str()?;
    Some(json!({"type": "error", "error": {"type": kind, "message": message}}).to_string().into_bytes())
}

#[cfg(test)]
mod tests;
