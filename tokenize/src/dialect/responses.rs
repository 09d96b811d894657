//! OpenAI Responses requests (`/v1/responses`) as the chat request vLLM 0.32 renders for them
//! (non-Harmony models: `construct_input_messages`, `construct_tool_dicts`,
//! `ResponsesRequest.build_chat_params`). This module is kvgate's one conversion of Responses
//! input into chat messages; two requests are built on it:
//! - [`to_chat`]: the chat request vLLM renders, for the prompt's tokens (kv routing, vllm-sim);
//! - [`stream::to_chat`]: the streamed chat request a worker generates the same tokens for, sent
//!   instead of a Responses stream so that the stream can move, or why there is none
//!   ([`stream::Refusal`]).
//!
//! The conversion, in vLLM's order:
//! - `instructions` (when not empty) is a leading system message; instructions of earlier turns
//!   are not carried over.
//! - The history of `previous_response_id` ([`history`]: the earlier turn's chat messages without
//!   system ones, then one assistant message per text part of its output messages; its
//!   reasoning and function-call outputs are not replayed).
//! - `input`: a string is one user message. Items: messages with a role are kept (content parts
//!   `input_text`/`output_text` are text); an assistant message contributes the text of its
//!   *first* content part (an output message's, `type: "message"` with `output_text` or
//!   `refusal` parts, or an input message's, `input_text` first); `function_call` items become
//!   tool calls (`namespace__name` for a namespaced call) and `reasoning` items become
//!   `reasoning` (the first `content` text, else the first `summary` text) — both merged into
//!   the assistant message just before them when it has none yet; `function_call_output` items
//!   become `tool` messages.
//! - Function tools (namespaced ones flattened, custom tools as a one-string-argument function)
//!   go to the template; other tool types (web search, MCP, …) do not.
//! - A final assistant message or reasoning item with status `in_progress` or `incomplete` is
//!   continued (`continue_final_message`) instead of answered (`add_generation_prompt`).
//!
//! Items vLLM's request model rejects (a missing or mistyped field, parts of output and input
//! messages mixed) are refused as vLLM refuses them. Two forms vLLM would pass on as a raw chat
//! message are not converted: an assistant message whose first part is not text (an image), and
//! an untyped assistant message with no parts.

pub mod stream;

use super::python;
use super::{DialectError, function_definition};
use serde_json::{Map, Value, json};

/// The key of a custom tool's single string argument.
const CUSTOM_INPUT_KEY: &str = "input";

/// Message roles an input item may have.
const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// The chat request vLLM renders for a `/v1/responses` body. `previous` is the [`history`] of
/// the response named by `previous_response_id`; without it such a request is unsupported.
pub fn to_chat(body: &Value, previous: Option<&[Value]>) -> Result<Value, DialectError> {
    let req = body.as_object().ok_or_else(|| invalid("the body must be a JSON object"))?;
    check_fields(req, previous.is_some())?;
    let tool_choice = checked_tool_choice(req)?;
    let (messages, continue_final) = chat_messages::<InputError>(req, previous.unwrap_or_default(), |_| Ok(()))?;
    let mut chat = Map::new();
    copy(req, &mut chat, &["model"]);
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = tool_dicts(req)? {
        chat.insert("tools".into(), tools);
        chat.insert("tool_choice".into(), chat_tool_choice(&tool_choice));
    }
    chat.insert("add_generation_prompt".into(), (!continue_final).into());
    chat.insert("continue_final_message".into(), continue_final.into());
    sampling_fields(req, &mut chat);
    Ok(Value::Object(chat))
}

/// The chat messages a stored response contributes to the next turn: `messages` (the chat
/// messages its request was rendered from) without system messages, then `output` (its output
/// items) as assistant messages, one per text part of each output message.
pub fn history(messages: &[Value], output: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = messages.iter().filter(|m| m.get("role").and_then(Value::as_str) != Some("system")).cloned().collect();
    for item in output.iter().filter(|i| i.get("type").and_then(Value::as_str) == Some("message")) {
        for part in item.get("content").and_then(Value::as_array).into_iter().flatten() {
            if let Some(text) = part.get("text").and_then(Value::as_str) {
                out.push(json!({"role": "assistant", "content": text}));
            }
        }
    }
    out
}

fn invalid(message: impl Into<String>) -> DialectError {
    DialectError::invalid("invalid", message)
}

fn check_fields(req: &Map<String, Value>, have_previous: bool) -> Result<(), DialectError> {
    if req.get("prompt").is_some_and(|p| !p.is_null()) {
        return Err(invalid("prompt template is not supported"));
    }
    if req.get("previous_response_id").is_some_and(|p| !p.is_null()) {
        if req.get("previous_input_messages").is_some_and(|p| !p.is_null()) {
            return Err(invalid("Only one of `previous_input_messages` and `previous_response_id` can be set."));
        }
        if !have_previous {
            return Err(DialectError::unsupported("previous_response", "previous_response_id needs the stored conversation of that response"));
        }
    }
    if req.get("background").and_then(Value::as_bool) == Some(true) && req.get("store").and_then(Value::as_bool) == Some(false) {
        return Err(invalid("background can only be used when `store` is true"));
    }
    Ok(())
}

fn tools_of(req: &Map<String, Value>) -> Result<&[Value], DialectError> {
    match req.get("tools") {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(t)) => Ok(t),
        Some(_) => Err(invalid("tools must be a list")),
    }
}

/// `tool_choice` after vLLM's `check_tool_usage`: `"none"` without tools, a named choice
/// resolved to its flat `namespace__name`.
fn checked_tool_choice(req: &Map<String, Value>) -> Result<Value, DialectError> {
    let tools = tools_of(req)?;
    let choice = req.get("tool_choice").cloned().unwrap_or_else(|| json!("auto"));
    let named = choice.get("type").and_then(Value::as_str).is_some_and(|t| t == "function" || t == "custom");
    if tools.is_empty() {
        return match choice.as_str() {
            Some("auto" | "none") => Ok(json!("none")),
            Some("required") => Err(invalid("Tool choice 'required' must be specified with 'tools' parameter.")),
            _ if named => Err(invalid("Tool choice 'function' not found in 'tools' parameter.")),
            _ => Ok(choice),
        };
    }
    if !named {
        return Ok(choice);
    }
    let name = choice
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid("Tool choice 'function' not found in 'tools' parameter."))?;
    let resolved = resolve_named_choice(name, tools)?;
    let mut choice = choice.clone();
    choice["name"] = resolved.into();
    Ok(choice)
}

fn resolve_named_choice(name: &str, tools: &[Value]) -> Result<String, DialectError> {
    let mut exact = Vec::new();
    let mut local: Vec<(String, String)> = Vec::new();
    for t in tools {
        if t.get("type").and_then(Value::as_str) == Some("namespace") {
            let (Some(ns), Some(inner)) = (t.get("name").and_then(Value::as_str), t.get("tools").and_then(Value::as_array)) else {
                return Ok(name.to_owned());
            };
            for n in inner.iter().filter_map(|i| i.get("name").and_then(Value::as_str)) {
                exact.push(format!("{ns}__{n}"));
                local.push((n.to_owned(), format!("{ns}__{n}")));
            }
        } else if let Some(n) = t.get("name").and_then(Value::as_str) {
            exact.push(n.to_owned());
        }
    }
    if exact.iter().any(|e| e == name) {
        return Ok(name.to_owned());
    }
    let candidates: Vec<&String> = local.iter().filter(|(l, _)| l == name).map(|(_, flat)| flat).collect();
    match candidates.as_slice() {
        [one] => Ok((*one).clone()),
        [] => Err(invalid("Tool choice 'function' not found in 'tools' parameter.")),
        many => Err(invalid(format!(
            "Tool choice '{name}' is ambiguous: it is defined in more than one namespace ({}). Select it by its full '<namespace>__<name>' name.",
            many.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// The Responses `tool_choice` in chat-completions terms (for the record; templates of the
/// models vLLM serves this way do not read it).
fn chat_tool_choice(choice: &Value) -> Value {
    match choice.get("type").and_then(Value::as_str) {
        Some("function" | "custom") => json!({"function": {"name": choice["name"]}, "type": "function"}),
        _ => choice.clone(),
    }
}

/// `construct_tool_dicts`: the function tools as the template sees them, `None` without tools.
fn tool_dicts(req: &Map<String, Value>) -> Result<Option<Value>, DialectError> {
    let tools = tools_of(req)?;
    if tools.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        for f in function_tools(t).map_err(|e| e.at(&format!("tools[{i}]")))? {
            out.push(json!({"type": "function", "function": function_definition(&f)?}));
        }
    }
    Ok(Some(Value::Array(out)))
}

/// The functions one Responses tool shows the model (`get_function_tools`).
fn function_tools(t: &Value) -> Result<Vec<Map<String, Value>>, DialectError> {
    let t = t.as_object().ok_or_else(|| invalid("a tool must be an object"))?;
    match t.get("type").and_then(Value::as_str) {
        Some("function") => Ok(vec![t.clone()]),
        Some("custom") => {
            if t.get("format").and_then(|f| f.get("type")).and_then(Value::as_str) == Some("grammar") {
                return Err(invalid("Custom tools with a grammar format are not supported; only free-form text custom tools are accepted."));
            }
            let mut f = Map::new();
            f.insert("name".into(), t.get("name").cloned().unwrap_or(Value::Null));
            f.insert("description".into(), t.get("description").cloned().unwrap_or(Value::Null));
            f.insert(
                "parameters".into(),
                json!({"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
                       "required": [CUSTOM_INPUT_KEY], "additionalProperties": false}),
            );
            Ok(vec![f])
        }
        Some("namespace") => {
            let ns = t.get("name").and_then(Value::as_str).ok_or_else(|| invalid("a namespace tool needs a name"))?;
            let inner = t.get("tools").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
            Ok(inner
                .iter()
                .filter_map(Value::as_object)
                .filter(|f| f.get("type").and_then(Value::as_str) == Some("function"))
                .map(|f| {
                    let mut f = f.clone();
                    let flat = format!("{ns}__{}", f.get("name").and_then(Value::as_str).unwrap_or(""));
                    f.insert("name".into(), flat.into());
                    f
                })
                .collect())
        }
        Some(_) => Ok(Vec::new()),
        None => Err(invalid("a tool needs a type")),
    }
}

/// Why the input could not be converted: the error [`to_chat`] reports, and what kind of fault
/// it is, which [`stream::to_chat`] names its own way ([`stream::Refusal`]).
#[derive(Debug)]
struct InputError {
    fault: Fault,
    error: DialectError,
}

/// What is wrong with the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The request is invalid for vLLM: the input's or an item's shape, a role, a content part,
    /// encrypted reasoning.
    Request,
    /// An item of a type vLLM converts, in a form its request model rejects or its conversion
    /// fails on (a missing or mistyped field, an assistant message's parts).
    Item,
    /// An item of a type vLLM does not convert.
    ItemType,
    /// Images, audio or files in a message.
    Media,
}

impl InputError {
    fn new(fault: Fault, error: DialectError) -> Self {
        Self { fault, error }
    }

    fn request(message: impl Into<String>) -> Self {
        Self::new(Fault::Request, invalid(message))
    }

    fn item(message: impl Into<String>) -> Self {
        Self::new(Fault::Item, invalid(message))
    }

    fn at(self, path: &str) -> Self {
        Self { error: self.error.at(path), ..self }
    }
}

impl From<InputError> for DialectError {
    fn from(e: InputError) -> Self {
        e.error
    }
}

/// The chat messages vLLM makes of `instructions`, the `previous` turn's history and `input`
/// (`construct_input_messages`), and whether the final one is continued
/// (`should_continue_final_message`). `covered` is the caller's own scope: each input item
/// object is put to it, in order, before it is converted.
fn chat_messages<E: From<InputError>>(
    req: &Map<String, Value>,
    previous: &[Value],
    mut covered: impl FnMut(&Map<String, Value>) -> Result<(), E>,
) -> Result<(Vec<Value>, bool), E> {
    let input = req.get("input").ok_or_else(|| InputError::request("input is required"))?;
    let mut messages = Vec::new();
    match req.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(InputError::request("instructions must be a string").into()),
    }
    messages.extend(previous.iter().cloned());
    let items = match input {
        Value::String(s) => {
            messages.push(json!({"role": "user", "content": s}));
            return Ok((messages, false));
        }
        Value::Array(items) => items,
        _ => return Err(InputError::request("input must be a string or a list of items").into()),
    };
    for (i, item) in items.iter().enumerate() {
        let at = |e: InputError| e.at(&format!("input[{i}]"));
        let obj = item.as_object().ok_or_else(|| at(InputError::request("an input item must be an object")))?;
        covered(obj)?;
        add_item(obj, &mut messages).map_err(at)?;
    }
    Ok((messages, continues_final_message(items)))
}

/// `should_continue_final_message`: the last input item is a partial assistant message.
fn continues_final_message(items: &[Value]) -> bool {
    let Some(last) = items.last() else { return false };
    let kind = last.get("type").and_then(Value::as_str).unwrap_or("message");
    matches!(kind, "message" | "reasoning") && matches!(last.get("status").and_then(Value::as_str), Some("in_progress" | "incomplete"))
}

/// One item into the message list: a new message, or merged into the assistant message
/// before it (`_construct_message_from_response_item`).
fn add_item(obj: &Map<String, Value>, out: &mut Vec<Value>) -> Result<(), InputError> {
    let kind = obj.get("type").and_then(Value::as_str);
    match kind {
        Some("function_call") | Some("custom_tool_call") => {
            let call = tool_call(obj)?;
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
            let text = reasoning_text(obj)?;
            merge_or_push("reasoning", text, out);
        }
        Some("function_call_output") | Some("custom_tool_call_output") => out.push(tool_output(obj)?),
        Some("message") | None if obj.contains_key("role") => message_item(obj, kind.is_some(), out)?,
        Some(other) => {
            let reason = if other == "input_file" { "file" } else { "unknown_item" };
            return Err(InputError::new(Fault::ItemType, DialectError::invalid(reason, format!("Unsupported input item type: {other}"))));
        }
        None => return Err(InputError::item("an input item needs a type or a role")),
    }
    Ok(())
}

/// The message before, when it is the assistant's.
fn last_assistant(out: &mut [Value]) -> Option<&mut Map<String, Value>> {
    out.last_mut().filter(|m| m["role"] == "assistant").and_then(Value::as_object_mut)
}

/// Sets `key` on the assistant message before, when it has none, else starts a new one.
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

fn tool_call(obj: &Map<String, Value>) -> Result<Value, InputError> {
    let field = |k: &str| obj.get(k).and_then(Value::as_str).ok_or_else(|| InputError::item(format!("a {} item needs a string '{k}'", obj["type"])));
    let call_id = field("call_id")?;
    let name = field("name")?;
    let (name, arguments) = if obj["type"] == "function_call" {
        let name = match obj.get("namespace").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            Some(ns) => format!("{ns}__{name}"),
            None => name.to_owned(),
        };
        (name, field("arguments")?.to_owned())
    } else {
        (name.to_owned(), python::json_dumps(&json!({CUSTOM_INPUT_KEY: field("input")?}), false))
    };
    Ok(json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}))
}

/// A tool's output as a `tool` message: its `output` (a string or parts) for the call
/// `call_id`.
fn tool_output(obj: &Map<String, Value>) -> Result<Value, InputError> {
    let output = obj.get("output").filter(|o| o.is_string() || o.is_array());
    let output = output.ok_or_else(|| InputError::item(format!("a {} item needs an output string or list", obj["type"])))?;
    let call_id = obj.get("call_id").cloned().unwrap_or(Value::Null);
    if !(call_id.is_string() || call_id.is_null()) {
        return Err(InputError::item(format!("the call_id of a {} item must be a string", obj["type"])));
    }
    Ok(json!({"role": "tool", "content": output, "tool_call_id": call_id}))
}

fn reasoning_text(obj: &Map<String, Value>) -> Result<String, InputError> {
    let Some(Value::Array(summary)) = obj.get("summary") else {
        return Err(InputError::item("a reasoning item needs a summary list"));
    };
    if obj.get("encrypted_content").is_some_and(|e| !e.is_null()) {
        return Err(InputError::new(Fault::Request, DialectError::invalid("encrypted_reasoning", "Encrypted content is not supported.")));
    }
    let first_text = |list: &[Value], what: &str| match list.first() {
        None => Ok(String::new()),
        Some(part) => part.get("text").and_then(Value::as_str).map(str::to_owned).ok_or_else(|| InputError::item(format!("reasoning {what} needs text"))),
    };
    match obj.get("content").and_then(Value::as_array).filter(|c| !c.is_empty()) {
        Some(content) => first_text(content, "content"),
        None => first_text(summary, "summary"),
    }
}

fn message_item(obj: &Map<String, Value>, typed: bool, out: &mut Vec<Value>) -> Result<(), InputError> {
    let role = obj
        .get("role")
        .and_then(Value::as_str)
        .filter(|r| ROLES.contains(r))
        .ok_or_else(|| InputError::request("role must be 'user', 'assistant', 'system' or 'developer'"))?;
    let content = obj.get("content").ok_or_else(|| InputError::request("a message needs content"))?;
    if role != "assistant" {
        check_input_parts(content)?;
        out.push(json!({"role": role, "content": content}));
        return Ok(());
    }
    let text = match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => assistant_text(parts, typed)?,
        _ => return Err(InputError::request("content must be a string or a list of parts")),
    };
    merge_or_push("content", text, out);
    Ok(())
}

/// The text of an assistant message's parts, as vLLM reads them: an output message
/// (`type: "message"`, `output_text` and `refusal` parts: `ResponseOutputMessage`) or an input
/// message (`input_text`, `input_image`, `input_file` parts: `EasyInputMessageParam`) gives the
/// text of its first part. vLLM's request model rejects other parts and mixes of the two kinds;
/// its conversion fails on an output message without parts or that starts with a refusal.
fn assistant_text(parts: &[Value], typed: bool) -> Result<String, InputError> {
    fn kind(p: &Value) -> Option<&str> {
        p.get("type").and_then(Value::as_str)
    }
    let has = |p: &Value, key: &str| p.get(key).is_some_and(Value::is_string);
    let output = |p: &Value| match kind(p) {
        Some("output_text") => has(p, "text"),
        Some("refusal") => has(p, "refusal"),
        _ => false,
    };
    let input = |p: &Value| match kind(p) {
        Some("input_text") => has(p, "text"),
        Some("input_image" | "input_file") => true,
        _ => false,
    };
    let readable = (typed && parts.iter().all(output)) || parts.iter().all(input);
    match parts.first() {
        Some(first) if readable && matches!(kind(first), Some("output_text" | "input_text")) => Ok(first["text"].as_str().unwrap_or_default().to_owned()),
        _ => Err(InputError::item("an assistant message's parts must be output text (type \"message\") or input parts, the first one text")),
    }
}

/// Input message content: a string, or parts vLLM's renderer accepts.
fn check_input_parts(content: &Value) -> Result<(), InputError> {
    let parts = match content {
        Value::String(_) => return Ok(()),
        Value::Array(p) => p,
        _ => return Err(InputError::request("content must be a string or a list of parts")),
    };
    let media = |e: DialectError| Err(InputError::new(Fault::Media, e));
    for p in parts {
        match p.get("type").and_then(Value::as_str) {
            Some("input_text") if p.get("text").is_some_and(Value::is_string) => {}
            Some("input_image") => return media(DialectError::unsupported("image", "input_image parts need the model's multimodal processor")),
            Some("input_audio") => return media(DialectError::unsupported("audio", "input_audio parts need the model's multimodal processor")),
            Some("input_file") => return media(DialectError::invalid("file", "input_file parts are not supported by vLLM")),
            _ => return Err(InputError::request("message content parts must be input_text, input_image or input_file")),
        }
    }
    Ok(())
}

fn copy(req: &Map<String, Value>, chat: &mut Map<String, Value>, keys: &[&str]) {
    for k in keys {
        if let Some(v) = req.get(*k).filter(|v| !v.is_null()) {
            chat.insert((*k).into(), v.clone());
        }
    }
}

fn sampling_fields(req: &Map<String, Value>, chat: &mut Map<String, Value>) {
    if let Some(m) = req.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_tokens".into(), m.clone());
    }
    copy(
        req,
        chat,
        &[
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "stop",
            "ignore_eos",
            "logit_bias",
            "parallel_tool_calls",
            "cache_salt",
            "kv_transfer_params",
            "vllm_xargs",
            "chat_template_kwargs",
            "stream",
        ],
    );
    if let Some(effort) = req.get("reasoning").and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
}

#[cfg(test)]
mod tests;
