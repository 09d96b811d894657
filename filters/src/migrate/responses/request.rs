//! Which OpenAI Responses requests the gateway may send a worker as a chat-completions request,
//! and that chat request: one that vLLM 0.32 renders to the same prompt and samples with the same
//! parameters as the Responses request itself, so the worker generates the same tokens.
//!
//! How vLLM serves a Responses request on its non-Harmony path (`serving.py`
//! `_create_responses`, `OnlineRenderer.render_responses`, `utils.py`
//! `construct_input_messages`, `protocol.py` `build_chat_params` / `to_sampling_params`):
//! - the chat messages: `instructions`, when not empty, as a leading `system` message; then
//!   `input`, a string as one `user` message, or its items (messages keep their role and
//!   content; an assistant output message contributes the text of its first part; a
//!   `function_call` becomes a tool call and a `reasoning` item the `reasoning` of the assistant
//!   message before it when that has none; a `function_call_output` a `tool` message);
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
//! [`to_chat`] builds that chat request (streamed, with usage in every chunk, which the
//! [`super::convert`] side reads) or says why it cannot ([`Refusal`]). Fields vLLM ignores on this
//! path (`user`, `metadata`, `service_tier`, `max_tool_calls`, `parallel_tool_calls` without
//! tools, `top_logprobs` without the logprobs `include`, `include` entries other than logprobs,
//! unknown fields such as `n`) only shape the response object ([`super::convert`] echoes them).
//!
//! Checked against real vLLM 0.32 (`--enable-scale-out`, the model's template and the fixtures'
//! `template.jinja`): for every request of `filters/tests/fixtures/responses/requests.json`
//! (instructions, multi-turn items of every supported kind, partial final messages, every
//! sampling field) the token ids and the sampling parameters of `/v1/responses/render` equal
//! those of `/v1/chat/completions/render` for the translation (the ignored test
//! `live_vllm_renders_each_translation_as_its_request`).

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
    let mut messages = Vec::new();
    match get("instructions") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(Refusal::Invalid),
    }
    let input = get("input").ok_or(Refusal::Invalid)?;
    let continue_final = continues_final_message(input);
    messages.extend(input_messages(input)?);

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
        None => {}
        Some(Value::Array(inc)) if inc.iter().any(|i| i == "message.output_text.logprobs") => return Err(Refusal::Logprobs),
        Some(Value::Array(_)) => {}
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

/// `should_continue_final_message`: the last input item is a message or reasoning item that is
/// still in progress or incomplete.
fn continues_final_message(input: &Value) -> bool {
    let Some(last) = input.as_array().and_then(|items| items.last()) else { return false };
    let kind = last.get("type").and_then(Value::as_str).unwrap_or("message");
    matches!(kind, "message" | "reasoning") && matches!(last.get("status").and_then(Value::as_str), Some("in_progress" | "incomplete"))
}

/// `construct_input_messages` for `input` (without instructions).
fn input_messages(input: &Value) -> Result<Vec<Value>, Refusal> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        _ => return Err(Refusal::Invalid),
    };
    let mut out = Vec::new();
    for item in items {
        add_item(item, &mut out)?;
    }
    Ok(out)
}

/// One input item: a new message, or merged into the assistant message before it
/// (`_construct_message_from_response_item`).
fn add_item(item: &Value, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let obj = item.as_object().ok_or(Refusal::Invalid)?;
    let str_field = |k: &str| obj.get(k).and_then(Value::as_str).ok_or(Refusal::Untranslatable);
    match obj.get("type").and_then(Value::as_str) {
        Some("function_call") => {
            let name = match obj.get("namespace").and_then(Value::as_str).filter(|n| !n.is_empty()) {
                Some(ns) => format!("{ns}__{}", str_field("name")?),
                None => str_field("name")?.to_owned(),
            };
            let call = json!({"id": str_field("call_id")?, "function": {"name": name, "arguments": str_field("arguments")?}, "type": "function"});
            match last_assistant(out) {
                Some(prev) => match prev.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        prev.insert("tool_calls".into(), json!([call]));
                    }
                },
                None => out.push(json!({"role": "assistant", "tool_calls": [call]})),
            }
        }
        Some("reasoning") => {
            if obj.get("encrypted_content").is_some_and(|e| !e.is_null()) {
                return Err(Refusal::Invalid);
            }
            let Some(Value::Array(summary)) = obj.get("summary") else { return Err(Refusal::Untranslatable) };
            let first_text = |list: &[Value]| list.first().map(|c| c.get("text").and_then(Value::as_str).map(str::to_owned).ok_or(Refusal::Untranslatable));
            let text = match obj.get("content").and_then(Value::as_array).filter(|c| !c.is_empty()) {
                Some(content) => first_text(content).transpose()?.unwrap_or_default(),
                None => first_text(summary).transpose()?.unwrap_or_default(),
            };
            merge_or_push("reasoning", text, out);
        }
        Some("function_call_output") => {
            let output = str_field("output")?;
            out.push(json!({"role": "tool", "content": output, "tool_call_id": str_field("call_id")?}));
        }
        Some("message") | None if obj.contains_key("role") => message_item(obj, out)?,
        _ => return Err(Refusal::Untranslatable),
    }
    Ok(())
}

/// The message before, when it is the assistant's.
fn last_assistant(out: &mut [Value]) -> Option<&mut Map<String, Value>> {
    out.last_mut().filter(|m| m["role"] == "assistant").and_then(Value::as_object_mut)
}

/// Sets `key` on the assistant message before when it has none, else starts a new message.
fn merge_or_push(key: &str, text: String, out: &mut Vec<Value>) {
    if let Some(prev) = last_assistant(out)
        && prev.get(key).is_none_or(Value::is_null)
    {
        prev.insert(key.into(), text.into());
        return;
    }
    let mut m = Map::new();
    m.insert("role".into(), "assistant".into());
    m.insert(key.into(), text.into());
    out.push(Value::Object(m));
}

fn message_item(obj: &Map<String, Value>, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let role = obj.get("role").and_then(Value::as_str).filter(|r| ["user", "assistant", "system", "developer"].contains(r)).ok_or(Refusal::Invalid)?;
    let content = obj.get("content").ok_or(Refusal::Invalid)?;
    if role == "assistant" {
        let text = assistant_text(content, obj.contains_key("type"))?;
        merge_or_push("content", text, out);
        return Ok(());
    }
    let content = match content {
        Value::String(_) => content.clone(),
        Value::Array(parts) => Value::Array(parts.iter().map(input_part).collect::<Result<_, _>>()?),
        _ => return Err(Refusal::Invalid),
    };
    out.push(json!({"role": role, "content": content}));
    Ok(())
}

/// An input message's content part as chat takes it: `input_text` is chat's `text` (vLLM's
/// chat parser reads both alike; chat's request schema does not take `input_text`).
fn input_part(part: &Value) -> Result<Value, Refusal> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text") => match part.get("text") {
            Some(Value::String(text)) => Ok(json!({"type": "text", "text": text})),
            _ => Err(Refusal::Invalid),
        },
        Some("input_image" | "input_audio" | "input_file") => Err(Refusal::Multimodal),
        _ => Err(Refusal::Invalid),
    }
}

/// The text an assistant message item contributes: its string content, or the text of its first
/// part (output text parts of an output message, `type: "message"`, or input text parts).
fn assistant_text(content: &Value, typed: bool) -> Result<String, Refusal> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => return Err(Refusal::Invalid),
    };
    let all = |kind: &str| parts.iter().all(|p| p.get("type").and_then(Value::as_str) == Some(kind) && p.get("text").is_some_and(Value::is_string));
    if parts.is_empty() || !(all("input_text") || typed && all("output_text")) {
        return Err(Refusal::Untranslatable);
    }
    Ok(parts[0]["text"].as_str().unwrap_or_default().to_owned())
}

#[cfg(test)]
mod tests;
