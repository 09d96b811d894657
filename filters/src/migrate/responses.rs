//! An OpenAI Responses stream (`/v1/responses`) served by a chat-completions stream, so that it
//! can move. vLLM 0.32's `/v1/responses` returns no token ids, so the gateway cannot
//! continue its stream on another worker; its `/v1/chat/completions` does (`return_token_ids`).
//! For a Responses request whose chat form is exactly what vLLM generates from, the gateway can
//! send the worker that chat request instead and turn the chat stream into the Responses events
//! vLLM would have sent (vLLM's non-Harmony path, `SimpleContext`, does the same internally: it
//! builds a chat prompt and streams engine deltas as Responses events).
//!
//! - The request: which Responses requests translate exactly, that chat request, and why the
//!   others do not, is `kvgate_tokenize::dialect::responses::stream` (`to_chat`, `Refusal`),
//!   built on the same conversion of Responses input into chat messages as the prompt kvgate
//!   renders for routing; the gateway calls it when it admits a stream (`request/track.rs`).
//! - [`convert`]: the chat stream (the worker's, then a continuation's re-wrapped as chat
//!   chunks) turned into the Responses events ([`ResponsesStream`]).
//!
//! Both were compared with real vLLM 0.32 (the tiny test model on CPU, `--enable-scale-out`,
//! with the model's template and with `filters/tests/fixtures/responses/template.jinja`, which
//! prints reasoning, tool calls, tool results and the template variables): the token ids and
//! sampling parameters of `/v1/responses/render` and of `/v1/chat/completions/render` for the
//! translated request (10 requests), and `/v1/responses` streams against the converted chat
//! streams of their translations (6 streams, byte for byte but for item ids and `created_at`;
//! fixtures and `capture.py` in `filters/tests/fixtures/responses/`).

pub mod convert;

pub use convert::{ModelDefaults, ResponsesStream, StreamSetup};
