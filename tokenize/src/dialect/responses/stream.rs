//! Which OpenAI Responses streams the gateway may send a worker as a chat-completions request,
//! and that chat request: one that vLLM 0.32 renders to the same prompt and samples with the same
//! parameters as the Responses request itself, so the worker generates the same tokens and the
//! stream can move (the gateway turns the chat stream back into Responses events:
//! `kvgate_filters::migrate::responses::ResponsesStream`).
//!
//! How vLLM serves a Responses request on its non-Harmony path (`serving.py`
//! `_create_responses`, `OnlineRenderer.render_responses`, `utils.py`
//! `construct_input_messages`, `protocol.py` `build_chat_params` / `to_sampling_params`):
//! - the chat messages: the parent module's conversion ([`super`]); input text parts are chat's
//!   `text` parts here (vLLM's chat parser reads both alike; chat's request schema does not
//!   take `input_text`);
//! - the chat template kwargs: `add_generation_prompt` (false, with `continue_final_message`
//!   true, when the last item is a message or reasoning item with status `in_progress` or
//!   `incomplete`), the request's `chat_template_kwargs`, and `reasoning_effort` /
//!   `enable_thinking` from `reasoning` (refused here); no tools without `tools`;
//! - the sampling parameters: `max_output_tokens` is the chat limit (both capped at
//!   `max_model_len` − prompt), and `temperature`, `top_p`, `top_k`, `min_p`,
//!   `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `seed`, `stop`,
//!   `stop_token_ids`, `ignore_eos`, `logit_bias`, `skip_special_tokens`,
//!   `include_stop_str_in_output`, `watermarking`, `vllm_xargs` with the same defaults as chat;
//!   `priority`, `cache_salt`, `session_id`, `mm_processor_kwargs`, `media_io_kwargs` as chat
//!   reads them; `truncation: "auto"` is chat's `truncate_prompt_tokens: -1`.
//!
//! [`to_chat`] builds that chat request (streamed, with usage in every chunk, which
//! `ResponsesStream` reads) or says why it cannot ([`Refusal`]). Besides the request options
//! a moved stream cannot carry and the input vLLM refuses, it leaves to the worker input that
//! vLLM converts but this translation was not checked to send alike: custom tool calls and
//! their output, and tool output given as parts or without a `call_id` (chat's request schema
//! takes neither `input_text` parts in a tool message nor one without `tool_call_id`). Fields
//! vLLM ignores on this path (`user`, `metadata`, `service_tier`, `max_tool_calls`,
//! `parallel_tool_calls` without tools, `top_logprobs` without the logprobs `include`,
//! `include` entries other than logprobs, unknown fields such as `n`) only shape the response
//! object (`ResponsesStream` echoes them).
//!
//! Checked against real vLLM 0.32 (`--enable-scale-out`, the model's template and the fixtures'
//! `template.jinja`): for every request of `filters/tests/fixtures/responses/requests.json`
//! (instructions, multi-turn items of every supported kind, partial final messages, every
//! sampling field) the token ids and the sampling parameters of `/v1/responses/render` equal
//! those of `/v1/chat/completions/render` for the translation (the ignored test
//! `live_vllm_renders_each_translation_as_its_request`).

use super::{Fault, InputError, chat_messages};
use serde_json::{Map, Value, json};

/// What the gateway knows of the model and its workers that decides whether a Responses request
/// may be translated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerFacts {
    /// The model is a Harmony model (gpt-oss): vLLM renders its Responses requests with the
    /// Harmony encoding, not the chat template, and parses its output with Harmony's parser.
    pub harmony: bool,
    /// The workers may run with vLLM's response store on (`VLLM_ENABLE_RESPONSES_API_STORE=1`):
    /// a request with `store` true (its default) must then be answered by the worker itself,
    /// which stores the response for `previous_response_id` and `GET /v1/responses/{id}`.
    pub store_enabled: bool,
}

/// Why a Responses request is not translated into a chat request (it goes to its worker as
/// sent, and stays there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    /// Not streamed: nothing to move.
    #[error("the request is not streamed")]
    Unary,
    /// A Harmony model (gpt-oss): no chat template, Harmony's own parser.
    #[error("the model is a Harmony (gpt-oss) model")]
    Harmony,
    /// `previous_response_id` (or `previous_input_messages`): the conversation lives in a
    /// worker's response store.
    #[error("the conversation continues a stored response")]
    PreviousResponse,
    /// `store` true (or left to its default) while the workers' store may be on: the response
    /// must be stored by the worker that makes it.
    #[error("the response is to be stored by the worker")]
    Store,
    /// `background`: the worker runs it and keeps its events.
    #[error("background responses run on the worker")]
    Background,
    /// Tools, or a `tool_choice` other than `auto` / `none`: the worker's tool parser and
    /// vLLM's Responses tool conversion.
    #[error("tools or a tool choice")]
    Tools,
    /// `reasoning` or `include_reasoning: false`: the template's reasoning switches and the
    /// worker's reasoning parser.
    #[error("reasoning options")]
    Reasoning,
    /// `text.format` other than plain text, or `structured_outputs`: the grammar.
    #[error("structured output")]
    StructuredOutput,
    /// `include` asks for `message.output_text.logprobs`.
    #[error("output logprobs")]
    Logprobs,
    /// Images, audio or files in the input.
    #[error("media in the input")]
    Multimodal,
    /// `enable_response_messages`: the response carries the rendered prompt and raw output.
    #[error("the response is to carry its raw messages")]
    ResponseMessages,
    /// `kv_transfer_params` / `ec_transfer_params` (disaggregated serving): the worker's
    /// answer carries transfer parameters back.
    #[error("KV or encoder-cache transfer parameters")]
    KvTransfer,
    /// A request vLLM refuses (a 400 or an error there): sent as is, for vLLM's own answer.
    #[error("the request is invalid for vLLM")]
    Invalid,
    /// Input the translation does not cover (item references, custom tool calls, tool output
    /// given as parts, …).
    #[error("input items the translation does not cover")]
    Untranslatable,
}

impl Refusal {
    /// Metric label (`kvgate_migration_pinned_total{reason}` style).
    pub fn label(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::Harmony => "harmony",
            Self::PreviousResponse => "previous_response",
            Self::Store => "store",
            Self::Background => "background",
            Self::Tools => "tools",
            Self::Reasoning => "reasoning",
            Self::StructuredOutput => "structured_output",
            Self::Logprobs => "logprobs",
            Self::Multimodal => "multimodal",
            Self::ResponseMessages => "response_messages",
            Self::KvTransfer => "kv_transfer",
            Self::Invalid => "invalid",
            Self::Untranslatable => "untranslatable",
        }
    }
}

/// Sampling and engine fields that mean the same in both requests, copied when not null.
const SAME_FIELDS: [&str; 20] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "watermarking",
    "vllm_xargs",
    "priority",
    "cache_salt",
    "session_id",
    "chat_template_kwargs",
];

/// Fields that only matter for media (refused), copied so that vLLM checks them the same way.
const MEDIA_FIELDS: [&str; 2] = ["mm_processor_kwargs", "media_io_kwargs"];

/// The streamed chat-completions request a worker generates the same tokens for as for the
/// Responses request `body`, or why there is none. The chat request asks for usage in every
/// chunk (`stream_options.continuous_usage_stats`): the Responses events need the prompt's
/// length from the first chunk. The gateway appends `return_token_ids` as for any chat stream.
pub fn to_chat(body: &Value, server: ServerFacts) -> Result<Value, Refusal> {
    let req = body.as_object().ok_or(Refusal::Invalid)?;
    let get = |k: &str| req.get(k).filter(|v| !v.is_null());
    if server.harmony {
        return Err(Refusal::Harmony);
    }
    if get("stream") != Some(&Value::Bool(true)) {
        return Err(Refusal::Unary);
    }
    refuse_options(req, server)?;
    let (mut messages, continue_final) = chat_messages(req, &[], covered)?;
    messages.iter_mut().for_each(chat_parts);

    let mut chat = Map::new();
    if let Some(model) = get("model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("add_generation_prompt".into(), (!continue_final).into());
    chat.insert("continue_final_message".into(), continue_final.into());
    if let Some(max) = get("max_output_tokens") {
        chat.insert("max_tokens".into(), max.clone());
    }
    for k in SAME_FIELDS.iter().chain(&MEDIA_FIELDS) {
        if let Some(v) = get(k) {
            chat.insert((*k).into(), v.clone());
        }
    }
    if get("truncation").and_then(Value::as_str) == Some("auto") {
        chat.insert("truncate_prompt_tokens".into(), (-1).into());
    }
    chat.insert("stream".into(), true.into());
    chat.insert("stream_options".into(), json!({"include_usage": true, "continuous_usage_stats": true}));
    Ok(Value::Object(chat))
}

/// The request-level options that keep a request on its worker.
fn refuse_options(req: &Map<String, Value>, server: ServerFacts) -> Result<(), Refusal> {
    let get = |k: &str| req.get(k).filter(|v| !v.is_null());
    let is_true = |k: &str| get(k) == Some(&Value::Bool(true));
    if get("prompt").is_some() {
        return Err(Refusal::Invalid);
    }
    if get("previous_response_id").is_some() || get("previous_input_messages").is_some() {
        return Err(Refusal::PreviousResponse);
    }
    if is_true("background") {
        return Err(Refusal::Background);
    }
    // `store` defaults to true; null is false.
    if server.store_enabled && req.get("store").is_none_or(|s| s == &Value::Bool(true)) {
        return Err(Refusal::Store);
    }
    match get("tools") {
        None => {}
        Some(Value::Array(t)) if t.is_empty() => {}
        Some(Value::Array(_)) => return Err(Refusal::Tools),
        Some(_) => return Err(Refusal::Invalid),
    }
    match get("tool_choice") {
        None => {}
        Some(Value::String(c)) if c == "auto" || c == "none" => {}
        Some(_) => return Err(Refusal::Tools),
    }
    if get("reasoning").is_some() || get("include_reasoning") == Some(&Value::Bool(false)) {
        return Err(Refusal::Reasoning);
    }
    if get("structured_outputs").is_some() {
        return Err(Refusal::StructuredOutput);
    }
    if let Some(text) = get("text") {
        match text.get("format").filter(|f| !f.is_null()) {
            None => {}
            Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => return Err(Refusal::StructuredOutput),
        }
    }
    match get("include") {
        Some(Value::Array(inc)) if inc.iter().any(|i| i == "message.output_text.logprobs") => return Err(Refusal::Logprobs),
        None | Some(Value::Array(_)) => {}
        Some(_) => return Err(Refusal::Invalid),
    }
    if is_true("enable_response_messages") {
        return Err(Refusal::ResponseMessages);
    }
    if get("kv_transfer_params").is_some() || get("ec_transfer_params").is_some() {
        return Err(Refusal::KvTransfer);
    }
    match get("truncation").map(Value::as_str) {
        None | Some(Some("auto" | "disabled")) => {}
        Some(_) => return Err(Refusal::Invalid),
    }
    // The response echoes these: of another type, vLLM refuses the request.
    let typed = |k: &str, ok: fn(&Value) -> bool| get(k).is_none_or(ok);
    let echoed = [
        typed("temperature", Value::is_number),
        typed("top_p", Value::is_number),
        typed("presence_penalty", Value::is_number),
        typed("frequency_penalty", Value::is_number),
        typed("max_output_tokens", Value::is_u64),
        typed("max_tool_calls", Value::is_u64),
        typed("parallel_tool_calls", Value::is_boolean),
        typed("background", Value::is_boolean),
        typed("user", Value::is_string),
        typed("service_tier", |v| v.as_str().is_some_and(|t| ["auto", "default", "flex", "scale", "priority"].contains(&t))),
        typed("metadata", |v| v.as_object().is_some_and(|m| m.values().all(Value::is_string))),
        typed("text", Value::is_object),
    ];
    if echoed.contains(&false) {
        return Err(Refusal::Invalid);
    }
    Ok(())
}

impl From<InputError> for Refusal {
    /// Input vLLM refuses is `Invalid`, but an item of a known type in a form vLLM's model
    /// rejects, or of a type it does not convert, is `Untranslatable`, and media `Multimodal`.
    fn from(e: InputError) -> Self {
        match e.fault {
            Fault::Request => Self::Invalid,
            Fault::Item | Fault::ItemType => Self::Untranslatable,
            Fault::Media => Self::Multimodal,
        }
    }
}

/// Whether an input item is one this translation covers: not a custom tool call or its output,
/// nor a tool output given as parts or without a `call_id` (a chat `tool` message needs one).
fn covered(item: &Map<String, Value>) -> Result<(), Refusal> {
    let uncovered = match item.get("type").and_then(Value::as_str) {
        Some("custom_tool_call" | "custom_tool_call_output") => true,
        Some("function_call_output") => !["output", "call_id"].iter().all(|k| item.get(*k).is_some_and(Value::is_string)),
        _ => false,
    };
    if uncovered { Err(Refusal::Untranslatable) } else { Ok(()) }
}

/// A message's `input_text` parts as chat's `text` parts.
fn chat_parts(message: &mut Value) {
    let Some(Value::Array(parts)) = message.get_mut("content") else { return };
    for part in parts.iter_mut().filter(|p| p["type"] == "input_text") {
        *part = json!({"type": "text", "text": part["text"]});
    }
}

#[cfg(test)]
mod tests;
