//! Reading `text/event-stream` bodies the way an OpenAI client does, while keeping the raw
//! framing so tests can check it.

use futures_util::StreamExt;
use serde_json::Value;

/// One streamed response, fully read.
#[derive(Debug)]
pub struct SseBody {
    /// The raw bytes as received.
    pub raw: String,
    /// Parsed `data:` payloads before `[DONE]`.
    pub events: Vec<Value>,
    /// Whether `data: [DONE]` terminated the stream.
    pub done: bool,
}

impl SseBody {
    /// What a client reassembles from the stream, for comparing two streams: the text (or chat
    /// content) and token ids concatenated, the finish reason, the usage, whether `[DONE]` came.
    pub fn essence(&self) -> Value {
        let mut text = String::new();
        let mut ids = Vec::new();
        let mut finish = Value::Null;
        let mut usage = Value::Null;
        for e in &self.events {
            if let Some(c) = e["choices"].as_array().and_then(|c| c.first()) {
                text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or(""));
                ids.extend(c["token_ids"].as_array().cloned().unwrap_or_default());
                if !c["finish_reason"].is_null() {
                    finish = c["finish_reason"].clone();
                }
            }
            if !e["usage"].is_null() {
                usage = e["usage"].clone();
            }
        }
        serde_json::json!({"text": text, "ids": ids, "finish": finish, "usage": usage, "done": self.done})
    }
}

/// Splits a raw SSE body into events; panics on framing errors (tests want to see them).
pub fn parse(raw: &str) -> SseBody {
    let mut events = Vec::new();
    let mut done = false;
    for block in raw.split("\n\n") {
        if block.is_empty() {
            continue;
        }
        if block.starts_with(':') {
            continue; // comment / keep-alive
        }
        let data = block.strip_prefix("data: ").unwrap_or_else(|| panic!("SSE block without 'data: ': {block:?}"));
        assert!(!done, "event after [DONE]: {data}");
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("bad JSON in SSE event {data:?}: {e}")));
        }
    }
    SseBody { raw: raw.to_string(), events, done }
}

/// Posts a streaming request and reads the whole body.
pub async fn stream(http: &reqwest::Client, url: &str, body: &Value) -> (u16, String, SseBody) {
    let r = http.post(url).json(body).send().await.expect("request sent");
    let status = r.status().as_u16();
    let ctype = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let mut raw = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("stream chunk"));
    }
    let raw = String::from_utf8(raw).expect("utf-8 body");
    let parsed = if status == 200 { parse(&raw) } else { SseBody { raw: raw.clone(), events: vec![], done: false } };
    (status, ctype, parsed)
}
