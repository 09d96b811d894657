//! One streamed request, timed from the client's side: time to the first token event, the
//! gaps between token events, end to end, the status, and the output token count from the
//! usage chunk (or the token events when the server sends no usage). OpenAI streams (a token
//! event is a chunk with text, delta content or token ids; the end is `[DONE]`) and Anthropic
//! Messages streams (a token event is a `content_block_delta` with text; usage comes in
//! `message_delta`, the end is `message_stop`).

use std::time::{Duration, Instant};

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// HTTP status (0: no response).
    pub status: u16,
    /// Time to the first token, if one came.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive token events.
    pub itl: Vec<Duration>,
    /// Send to last byte.
    pub e2e: Duration,
    /// Output tokens.
    pub output_tokens: u64,
    /// Prompt tokens, from the usage chunk (0 when the server sends none).
    pub prompt_tokens: u64,
    /// When it was due, from the start of the run (set by the runner).
    pub due: Duration,
    /// Chat replies: the assistant's text (multi-turn sessions send it back).
    pub text: String,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl Sample {
    /// A complete response with at least one token.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.ttft.is_some()
    }
}

/// Sends `body` (which must ask for a stream) to `url` and reads the whole stream. Latencies
/// count from `scheduled`, when the request was due: a request that left late (the generator
/// was at its in-flight bound) is not flattered by its delay.
pub async fn send(http: &reqwest::Client, url: &str, body: &serde_json::Value, scheduled: Instant) -> Sample {
    send_with(http, url, body, scheduled, &[]).await
}

/// [`send`] with extra request headers (an `x-request-id` to find the request's route receipt
/// by, say).
pub async fn send_with(http: &reqwest::Client, url: &str, body: &serde_json::Value, scheduled: Instant, headers: &[(&str, &str)]) -> Sample {
    let start = scheduled.min(Instant::now());
    let mut s = Sample::default();
    let mut req = http.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(format!("request failed: {e}"));
            s.e2e = start.elapsed();
            return s;
        }
    };
    s.status = resp.status().as_u16();
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut events = 0u64;
    let mut usage: Option<u64> = None;
    let mut prompt_tokens = 0;
    let mut done = false;
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => {
                // Bytes until an event is complete, so a character split across chunks stays whole.
                buf.extend_from_slice(&bytes);
                while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                    let raw: Vec<u8> = buf.drain(..end + 2).collect();
                    let event = String::from_utf8_lossy(&raw);
                    for line in event.lines() {
                        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                        if data == "[DONE]" {
                            done = true;
                            continue;
                        }
                        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else { continue };
                        if let Some(n) = v.pointer("/usage/completion_tokens").and_then(|n| n.as_u64()) {
                            usage = Some(n);
                            prompt_tokens = v.pointer("/usage/prompt_tokens").and_then(|n| n.as_u64()).unwrap_or(0);
                        }
                        // Anthropic Messages: text in `content_block_delta`, usage in
                        // `message_delta`, the end in `message_stop` (no `[DONE]`).
                        let piece = match v["type"].as_str() {
                            Some("content_block_delta") => v["delta"]["text"].as_str(),
                            Some("message_delta") => {
                                if let Some(n) = v.pointer("/usage/output_tokens").and_then(|n| n.as_u64()) {
                                    usage = Some(n);
                                    prompt_tokens = v.pointer("/usage/input_tokens").and_then(|n| n.as_u64()).unwrap_or(0);
                                }
                                None
                            }
                            Some("message_stop") => {
                                done = true;
                                None
                            }
                            Some("error") => {
                                s.error = Some(format!("error event: {}", v["error"]));
                                None
                            }
                            _ => {
                                let choice = &v["choices"][0];
                                choice["text"].as_str().or_else(|| choice["delta"]["content"].as_str())
                            }
                        };
                        let choice = &v["choices"][0];
                        let is_token = piece.is_some_and(|p| !p.is_empty()) || choice["token_ids"].as_array().is_some_and(|t| !t.is_empty());
                        if is_token {
                            let now = Instant::now();
                            match last {
                                None => s.ttft = Some(now - start),
                                Some(prev) => s.itl.push(now - prev),
                            }
                            last = Some(now);
                            events += 1;
                            s.text.push_str(piece.unwrap_or(""));
                        }
                    }
                }
            }
            Ok(None) => break,
            Err(e) => {
                s.error = Some(format!("stream broke: {e}"));
                break;
            }
        }
    }
    s.e2e = start.elapsed();
    s.output_tokens = usage.unwrap_or(events);
    s.prompt_tokens = prompt_tokens;
    if s.status == 200 && s.error.is_none() && !done {
        s.error = Some("stream ended without [DONE] or message_stop".into());
    }
    if s.status != 200 && s.error.is_none() {
        // An error answer is one JSON body, left whole in the buffer: its start says why.
        let why = String::from_utf8_lossy(&buf[..buf.len().min(200)]).to_string();
        s.error = Some(format!("HTTP {}: {why}", s.status));
    }
    s
}
