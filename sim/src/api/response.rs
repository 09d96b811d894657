//! What the inference endpoints share once tokens flow: response ids, the SSE driver (one
//! `data: {...}\n\n` chunk per token, an optional usage chunk, then `data: [DONE]\n\n`; the
//! Anthropic and Responses formats write their own events through the same hooks), and
//! collection of all choices for unary responses.

use super::generate::Generation;
use crate::engine::Delivery;
use crate::scheduler::FinishReason;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use std::convert::Infallible;

/// Identity of a response.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `cmpl-…` / `chatcmpl-…`.
    pub id: String,
    /// `id` as a JSON string literal.
    pub id_json: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name as a JSON string literal (already escaped).
    pub model_json: String,
    /// X-Request-Id to echo, if enabled.
    pub echo_request_id: Option<String>,
}

impl Meta {
    /// Builds the id from X-Request-Id (or the body's `request_id`), else a random one.
    pub fn new(prefix: &str, headers: &HeaderMap, body_request_id: Option<&str>, model: &str, echo: bool) -> Self {
        let base = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| body_request_id.map(str::to_owned))
            .unwrap_or_else(crate::ids::random_id);
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let id = format!("{prefix}-{base}");
        Self { id_json: json_str(&id), id, created, model_json: json_str(model), echo_request_id: if echo { Some(base) } else { None } }
    }
}

/// A JSON string literal for `s`.
pub fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Per-choice state while streaming.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChoiceState {
    /// Tokens generated so far.
    pub generated: usize,
    /// Prompt length.
    pub prompt: usize,
    /// Finished.
    pub done: bool,
}

/// Writes `"usage":{"prompt_tokens":..,"total_tokens":..,"completion_tokens":..}` as vLLM
/// orders it, for per-token and final usage alike.
pub fn write_usage(out: &mut String, prompt: usize, completion: usize) {
    use std::fmt::Write as _;
    let _ = write!(out, "\"usage\":{{\"prompt_tokens\":{prompt},\"total_tokens\":{},\"completion_tokens\":{completion}}}", prompt + completion);
}

/// Formats the chunks of one endpoint.
pub trait ChunkFormat: Send + 'static {
    /// What goes out before the first token (nothing for the OpenAI formats; the Responses
    /// API's `response.created`).
    fn head(&mut self, _meta: &Meta, _out: &mut String) {}
    /// The chunk(s) for one token. `state` already counts this token.
    fn token_chunk(&mut self, meta: &Meta, d: &Delivery, state: &ChoiceState, out: &mut String);
    /// The final usage chunk.
    fn usage_chunk(&mut self, meta: &Meta, prompt: usize, completion: usize, out: &mut String);
    /// What ends the stream: `data: [DONE]` for the OpenAI formats; nothing written ends it
    /// right there.
    fn done(&mut self, out: &mut String) {
        out.push_str("data: [DONE]\n\n");
    }
    /// A request that failed in the engine: vLLM's streaming error event (then [`Self::done`]).
    fn error_chunk(&mut self, out: &mut String) {
        let _ = std::fmt::Write::write_fmt(out, format_args!("data: {}\n\n", super::error::ApiError::generation_failed().body()));
    }
}

/// Streams a generation as SSE.
pub fn sse(meta: Meta, generation: Generation, prompt_lens: Vec<usize>, include_usage: bool, fmt: impl ChunkFormat) -> Response {
    // The head first, so the stream can own `meta`.
    let mut r = Response::new(Body::empty());
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    echo_header(&mut r, &meta);
    let choices = vec![ChoiceState::default(); generation.choices];
    let mut state = SseState { meta, generation, choices, prompt_lens, include_usage, fmt, phase: Phase::Head };
    for (i, c) in state.choices.iter_mut().enumerate() {
        c.prompt = state.prompt_lens.get(i).copied().unwrap_or(0);
    }
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let bytes = s.next().await?;
        Some((Ok::<_, Infallible>(bytes), s))
    });
    *r.body_mut() = Body::from_stream(stream);
    r
}

/// Adds X-Request-Id to a response when echoing is on.
pub fn echo_header(r: &mut Response, meta: &Meta) {
    if let Some(id) = &meta.echo_request_id
        && let Ok(v) = HeaderValue::from_str(id)
    {
        r.headers_mut().insert("x-request-id", v);
    }
}

enum Phase {
    Head,
    Tokens,
    Usage,
    Done,
    End,
}

struct SseState<F> {
    meta: Meta,
    generation: Generation,
    choices: Vec<ChoiceState>,
    prompt_lens: Vec<usize>,
    include_usage: bool,
    fmt: F,
    phase: Phase,
}

impl<F: ChunkFormat> SseState<F> {
    async fn next(&mut self) -> Option<Bytes> {
        let mut out = String::with_capacity(256);
        loop {
            match self.phase {
                Phase::Head => {
                    self.phase = Phase::Tokens;
                    self.fmt.head(&self.meta, &mut out);
                }
                Phase::Tokens => {
                    let Some(d) = self.generation.recv().await else {
                        // The engine stopped (crash): end the body without [DONE], like a dying server.
                        self.phase = Phase::End;
                        return None;
                    };
                    if d.out.finish == Some(FinishReason::Error) {
                        self.phase = Phase::Done;
                        self.fmt.error_chunk(&mut out);
                        continue;
                    }
                    let c = &mut self.choices[d.choice];
                    c.generated += d.out.ids().len();
                    c.done = d.out.finish.is_some();
                    let snapshot = *c;
                    self.fmt.token_chunk(&self.meta, &d, &snapshot, &mut out);
                    if self.choices.iter().all(|c| c.done) {
                        self.phase = if self.include_usage { Phase::Usage } else { Phase::Done };
                    }
                }
                Phase::Usage => {
                    self.phase = Phase::Done;
                    let prompt: usize = self.prompt_lens.iter().sum::<usize>();
                    let completion: usize = self.choices.iter().map(|c| c.generated).sum();
                    self.fmt.usage_chunk(&self.meta, prompt, completion, &mut out);
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    self.fmt.done(&mut out);
                }
                Phase::End => return None,
            }
            // A phase that wrote nothing (a token without text) goes on to the next one.
            if !out.is_empty() {
                return Some(Bytes::from(out));
            }
        }
    }
}

/// The outcome of one choice of a unary request.
#[derive(Debug, Clone, Default)]
pub struct ChoiceResult {
    /// Generated token ids (EOS included if the request stopped on it).
    pub tokens: Vec<u32>,
    /// Why it finished.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// Waits for every choice to finish: a 500 if the engine stopped first or a choice failed in
/// it, as vLLM answers a request that finished with an error.
pub async fn collect(mut generation: Generation) -> Result<Vec<ChoiceResult>, super::error::ApiError> {
    let mut res = vec![ChoiceResult::default(); generation.choices];
    let mut left = generation.choices;
    while left > 0 {
        let d = generation.recv().await.ok_or_else(|| super::error::ApiError::internal("engine stopped"))?;
        if d.out.finish == Some(FinishReason::Error) {
            return Err(super::error::ApiError::generation_failed());
        }
        let r = &mut res[d.choice];
        r.tokens.extend_from_slice(d.out.ids());
        r.cached_tokens = d.out.num_cached_tokens;
        if d.out.finish.is_some() {
            r.finish = d.out.finish;
            left -= 1;
        }
    }
    Ok(res)
}

/// `"stop"`/`"length"`/`"abort"` as a JSON literal, or `null`.
pub fn finish_json(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Stop) => "\"stop\"",
        Some(FinishReason::Length) => "\"length\"",
        Some(FinishReason::Abort) => "\"abort\"",
        Some(FinishReason::Error) => "\"error\"",
        None => "null",
    }
}

/// The text of a delivery: its token's, or nothing for an abort.
pub fn delivery_text<'a>(tok: &'a crate::tokenizer::ModelTokenizer, d: &Delivery) -> &'a str {
    d.out.ids().first().map_or("", |&t| tok.token_text(t))
}

/// A delivery's token ids as a JSON list.
pub fn delivery_ids_json(d: &Delivery) -> String {
    serde_json::to_string(d.out.ids()).unwrap_or_else(|_| "[]".into())
}
