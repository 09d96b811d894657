//! Anthropic Messages requests (`/v1/messages`, `/v1/messages/count_tokens`) as the chat request
//! vLLM 0.32 builds from them (`AnthropicServingMessages.to_chat_completion_request`).
//!
//! The conversion, in vLLM's order:
//! - `system` (a string, or text blocks concatenated without a separator; a block starting with
//!   Claude Code's `x-anthropic-billing-header` is dropped) becomes one leading system message.
//!   With [`MessagesOptions::merge_inline_system`], system messages inside `messages` are
//!   appended to it; otherwise each stays where it is.
//! - A string `content` is kept. Blocks: `text` (empty ones skipped) become content parts, a
//!   single text part collapses to a string; `thinking` joins into the assistant's `reasoning`;
//!   `redacted_thinking` and `tool_reference` are skipped; `tool_use` becomes a tool call
//!   (`arguments` = Python's `json.dumps` of `input`); a user's `tool_result` becomes a `tool`
//!   message placed *before* the user message that carried it (text blocks joined with `"\n"`,
//!   `is_error` ignored), an assistant's becomes the text `"Tool result: …"` (Python's `str()`
//!   of the content). A user message left without content is dropped; an assistant one is kept.
//! - `cache_control` and other unknown keys are ignored, as pydantic ignores them.
//! - `max_tokens` → `max_tokens` and `max_completion_tokens`; `stop_sequences` → `stop`;
//!   sampling fields as they are; `stream` adds `stream_options` with usage in every chunk.
//! - `output_config.effort` → `reasoning_effort`; `thinking.type`: `enabled` →
//!   `thinking_token_budget`, `disabled` → `reasoning_effort` =
//!   [`MessagesOptions::disabled_thinking_effort`] (after `output_config`, so it wins).
//! - `tool_choice`: `auto`/`any`/`none`/`tool` → `"auto"`/`"required"`/`"none"`/named, and
//!   `parallel_tool_calls` = not `disable_parallel_tool_use`; tools (after the system messages'
//!   `tool_addition`/`tool_removal` blocks) become function tools, with `tool_choice` `"auto"`
//!   when none was given. vLLM then refuses `"auto"` unless it was started with
//!   `--enable-auto-tool-choice` and a tool parser.
//!
//! vLLM sets neither `add_generation_prompt` nor `continue_final_message`: a final assistant
//! message is rendered closed, followed by a new generation prompt.

use super::python;
use super::{DialectError, function_definition};
use crate::chat_template::ChatInput;
use crate::tokenizer::ModelTokenizer;
use serde_json::{Map, Value, json};

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Block types vLLM's `AnthropicContentBlock` accepts.
const BLOCK_TYPES: [&str; 9] = ["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking", "tool_addition", "tool_removal"];

/// Efforts vLLM tries when it probes what a template does with `reasoning_effort: "none"`.
const EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

/// Server-side choices vLLM makes once, from the chat template, for every Messages request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesOptions {
    /// Merge system messages found inside `messages` into the leading system prompt.
    pub merge_inline_system: bool,
    /// `reasoning_effort` for `thinking: {"type": "disabled"}`: `"none"`, or `"low"` for
    /// templates that cannot turn thinking off.
    pub disabled_thinking_effort: String,
}

impl Default for MessagesOptions {
    /// vLLM's defaults when nothing is probed.
    fn default() -> Self {
        Self { merge_inline_system: false, disabled_thinking_effort: "none".into() }
    }
}

impl MessagesOptions {
    /// Probes `tok`'s chat template as vLLM does at start-up (`_should_merge_inline_system`) and
    /// on the first disabled-thinking request (`_probe_disabled_thinking_effort`).
    pub fn for_tokenizer(tok: &ModelTokenizer) -> Self {
        Self { merge_inline_system: merges_inline_system(tok), disabled_thinking_effort: probe_disabled_effort(tok).into() }
    }
}

/// Whether the template fails on a system message after the first user turn (vLLM renders
/// `[system, user, system, user]`; an error means "merge"). No template means "merge" too.
fn merges_inline_system(tok: &ModelTokenizer) -> bool {
    if tok.chat_template_source().is_none_or(str::is_empty) {
        return true;
    }
    let probe: Vec<Value> = ["system", "user", "system", "user"].iter().map(|r| json!({"role": r, "content": "t"})).collect();
    tok.render_chat(&ChatInput { messages: &probe, add_generation_prompt: false, tools: None, kwargs: None }).is_err()
}

/// `"low"` when rendering with effort `"none"` fails or gives the same prompt as a real effort.
fn probe_disabled_effort(tok: &ModelTokenizer) -> &'static str {
    let render = |effort: &str| {
        let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort});
        super::render_chat(tok, &chat).ok()
    };
    let Some(none) = render("none") else { return "low" };
    if EFFORTS.iter().any(|e| render(e).as_deref() == Some(none.as_str())) { "low" } else { "none" }
}

/// The chat request vLLM builds from a `/v1/messages` body.
pub fn to_chat(body: &Value, opts: &MessagesOptions) -> Result<Value, DialectError> {
    convert(body, opts, false)
}

/// The chat request vLLM builds from a `/v1/messages/count_tokens` body (no `max_tokens`, no
/// sampling or streaming fields).
pub fn count_tokens_to_chat(body: &Value, opts: &MessagesOptions) -> Result<Value, DialectError> {
    convert(body, opts, true)
}

fn convert(body: &Value, opts: &MessagesOptions, count: bool) -> Result<Value, DialectError> {
    let req = body.as_object().ok_or_else(|| invalid("the body must be a JSON object"))?;
    let model = req.get("model").and_then(Value::as_str).filter(|m| !m.is_empty()).ok_or_else(|| invalid("model is required"))?;
    let messages = parse_messages(req)?;
    let mut chat_messages = Vec::new();
    system_message(req.get("system"), &messages, opts.merge_inline_system, &mut chat_messages)?;
    for m in &messages {
        convert_message(m, opts.merge_inline_system, &mut chat_messages)?;
    }
    let mut chat = Map::new();
    chat.insert("model".into(), model.into());
    chat.insert("messages".into(), Value::Array(chat_messages));
    if count {
        copy(req, &mut chat, &["chat_template_kwargs"]);
    } else {
        base_fields(req, &mut chat)?;
    }
    output_config(req, &mut chat)?;
    thinking(req, &mut chat, opts, count)?;
    tool_choice(req, &mut chat)?;
    tools(req, &messages, &mut chat)?;
    Ok(Value::Object(chat))
}

fn invalid(message: impl Into<String>) -> DialectError {
    DialectError::invalid("invalid", message)
}

/// One message of the request, checked the way vLLM's pydantic model checks it.
struct Message<'a> {
    role: &'a str,
    content: Content<'a>,
}

enum Content<'a> {
    Text(&'a str),
    Blocks(Vec<&'a Map<String, Value>>),
}

fn parse_messages(req: &Map<String, Value>) -> Result<Vec<Message<'_>>, DialectError> {
    let list = req.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("messages must be a list"))?;
    list.iter().enumerate().map(|(i, m)| parse_message(m).map_err(|e| e.at(&format!("messages[{i}]")))).collect()
}

fn parse_message(m: &Value) -> Result<Message<'_>, DialectError> {
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| invalid("role is required"))?;
    if !matches!(role, "user" | "assistant" | "system") {
        return Err(invalid(format!("role must be 'user', 'assistant' or 'system', got '{role}'")));
    }
    let content = parse_content(m.get("content"))?;
    if role != "system"
        && let Content::Blocks(blocks) = &content
        && let Some(b) = blocks.iter().find(|b| matches!(block_type(b), "tool_addition" | "tool_removal"))
    {
        return Err(invalid(format!("{} blocks are only allowed in messages with role \"system\"", block_type(b))));
    }
    Ok(Message { role, content })
}

fn parse_content(v: Option<&Value>) -> Result<Content<'_>, DialectError> {
    match v {
        Some(Value::String(s)) => Ok(Content::Text(s)),
        Some(Value::Array(items)) => {
            let mut blocks = Vec::with_capacity(items.len());
            for (j, item) in items.iter().enumerate() {
                blocks.push(check_block(item).map_err(|e| e.at(&format!("content[{j}]")))?);
            }
            Ok(Content::Blocks(blocks))
        }
        _ => Err(invalid("content must be a string or a list of blocks")),
    }
}

/// A block with a type vLLM accepts and fields of the types it expects.
fn check_block(v: &Value) -> Result<&Map<String, Value>, DialectError> {
    let b = v.as_object().ok_or_else(|| invalid("a content block must be an object"))?;
    let Some(kind) = b.get("type").and_then(Value::as_str) else {
        return Err(invalid("a content block needs a type"));
    };
    if !BLOCK_TYPES.contains(&kind) {
        let reason = if kind == "document" { "document" } else { "unknown_block" };
        return Err(DialectError::invalid(reason, format!("content block type '{kind}' is not supported by vLLM")));
    }
    let optional = |key: &str, ok: fn(&Value) -> bool| b.get(key).is_none_or(|v| v.is_null() || ok(v));
    let typed = ["text", "id", "tool_use_id", "name", "thinking", "signature", "data", "tool_name"].iter().all(|k| optional(k, Value::is_string))
        && optional("input", Value::is_object)
        && optional("source", Value::is_object)
        && optional("is_error", Value::is_boolean)
        && optional("content", |c| c.is_string() || c.as_array().is_some_and(|a| a.iter().all(Value::is_object)));
    if !typed {
        return Err(invalid(format!("a '{kind}' block has a field of the wrong type")));
    }
    Ok(b)
}

fn block_type(b: &Map<String, Value>) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

fn str_field<'a>(b: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    b.get(key).and_then(Value::as_str)
}

fn system_message(system: Option<&Value>, messages: &[Message<'_>], merge: bool, out: &mut Vec<Value>) -> Result<(), DialectError> {
    let mut parts: Vec<String> = Vec::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            if !s.is_empty() {
                parts.push(s.clone());
            }
        }
        Some(v @ Value::Array(_)) => {
            let Content::Blocks(blocks) = parse_content(Some(v)).map_err(|e| e.at("system"))? else { unreachable!("an array parses to blocks") };
            if let Some(b) = blocks.iter().find(|b| matches!(block_type(b), "tool_addition" | "tool_removal")) {
                return Err(invalid(format!("system: {} blocks are only allowed in messages with role \"system\"", block_type(b))));
            }
            parts.extend(system_texts(&blocks));
        }
        Some(_) => return Err(invalid("system must be a string or a list of blocks")),
    }
    if merge {
        parts.extend(messages.iter().filter(|m| m.role == "system").filter_map(inline_system_text).filter(|t| !t.is_empty()));
    }
    if !parts.is_empty() {
        out.push(json!({"role": "system", "content": parts.concat()}));
    }
    Ok(())
}

/// Non-empty text blocks, without Claude Code's per-request billing header.
fn system_texts(blocks: &[&Map<String, Value>]) -> Vec<String> {
    blocks
        .iter()
        .filter(|b| block_type(b) == "text")
        .filter_map(|b| str_field(b, "text"))
        .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
        .map(str::to_owned)
        .collect()
}

/// The text of a system message inside `messages` (`_extract_system_text`), if any.
fn inline_system_text(m: &Message<'_>) -> Option<String> {
    match &m.content {
        Content::Text(t) => (!t.starts_with(BILLING_HEADER)).then(|| (*t).to_owned()),
        Content::Blocks(blocks) => Some(system_texts(blocks).concat()).filter(|t| !t.is_empty()),
    }
}

fn convert_message(m: &Message<'_>, merge: bool, out: &mut Vec<Value>) -> Result<(), DialectError> {
    if m.role == "system" {
        if !merge && let Some(text) = inline_system_text(m).filter(|t| !t.is_empty()) {
            out.push(json!({"role": "system", "content": text}));
        }
        return Ok(());
    }
    let mut msg = Map::new();
    msg.insert("role".into(), m.role.into());
    match &m.content {
        Content::Text(t) => {
            msg.insert("content".into(), (*t).into());
        }
        Content::Blocks(blocks) => convert_blocks(blocks, m.role, &mut msg, out)?,
    }
    // A user message whose blocks were all tool results has nothing left to say.
    if m.role != "user" || msg.contains_key("content") {
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// What the blocks of one message collect.
#[derive(Default)]
struct Collected {
    parts: Vec<Value>,
    tool_calls: Vec<Value>,
    reasoning: Vec<String>,
}

fn convert_blocks(blocks: &[&Map<String, Value>], role: &str, msg: &mut Map<String, Value>, out: &mut Vec<Value>) -> Result<(), DialectError> {
    let mut c = Collected::default();
    for b in blocks {
        convert_block(b, role, &mut c, out)?;
    }
    if !c.reasoning.is_empty() {
        msg.insert("reasoning".into(), c.reasoning.concat().into());
    }
    if !c.tool_calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(c.tool_calls));
    }
    match c.parts.as_slice() {
        [] => {}
        [single] if single["type"] == "text" => {
            msg.insert("content".into(), single["text"].clone());
        }
        _ => {
            msg.insert("content".into(), Value::Array(c.parts));
        }
    }
    Ok(())
}

fn convert_block(b: &Map<String, Value>, role: &str, c: &mut Collected, out: &mut Vec<Value>) -> Result<(), DialectError> {
    match block_type(b) {
        "text" => {
            if let Some(t) = str_field(b, "text").filter(|t| !t.is_empty()) {
                c.parts.push(json!({"type": "text", "text": t}));
            }
        }
        "image" if b.get("source").and_then(Value::as_object).is_some_and(|s| !s.is_empty()) => {
            return Err(DialectError::unsupported("image", "image blocks need the model's multimodal processor"));
        }
        "thinking" => {
            if let Some(t) = str_field(b, "thinking") {
                c.reasoning.push(t.to_owned());
            }
        }
        "tool_use" => c.tool_calls.push(tool_call(b)),
        "tool_result" if role == "user" => user_tool_result(b, out)?,
        "tool_result" => {
            let text = match b.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(v @ Value::Array(a)) if !a.is_empty() => python::repr(v),
                _ => String::new(),
            };
            c.parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
        }
        // redacted_thinking (opaque), tool_reference (expanded inside tool results),
        // tool_addition / tool_removal (read by `tools`), an image without a source.
        _ => {}
    }
    Ok(())
}

fn tool_call(b: &Map<String, Value>) -> Value {
    let id = str_field(b, "id").filter(|i| !i.is_empty()).map(str::to_owned).unwrap_or_else(|| {
        // vLLM names a call without id by the current second.
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        format!("call_{secs}")
    });
    let input = match b.get("input") {
        Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()),
        _ => json!({}),
    };
    json!({"id": id, "type": "function", "function": {"name": str_field(b, "name").unwrap_or(""), "arguments": python::json_dumps(&input, true)}})
}

fn user_tool_result(b: &Map<String, Value>, out: &mut Vec<Value>) -> Result<(), DialectError> {
    let mut references = Vec::new();
    let text = match b.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items.iter().filter_map(Value::as_object) {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(item.get("text").and_then(Value::as_str).unwrap_or("")),
                    Some("image") => return Err(DialectError::unsupported("image", "images in tool results need the model's multimodal processor")),
                    Some("tool_reference") => {
                        if let Some(name) = str_field(item, "tool_name").or_else(|| str_field(item, "name")).filter(|n| !n.is_empty()) {
                            references.push(json!({"type": "tool_reference", "name": name}));
                        }
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    let id = str_field(b, "tool_use_id").unwrap_or("");
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !references.is_empty() {
        out.push(json!({"role": "tool", "tool_call_id": id, "content": references}));
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

fn base_fields(req: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), DialectError> {
    let max_tokens = req.get("max_tokens").and_then(Value::as_i64).ok_or_else(|| invalid("max_tokens is required"))?;
    if max_tokens <= 0 {
        return Err(invalid("max_tokens must be positive"));
    }
    chat.insert("max_tokens".into(), max_tokens.into());
    chat.insert("max_completion_tokens".into(), max_tokens.into());
    if let Some(stop) = req.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), stop.clone());
    }
    copy(
        req,
        chat,
        &["temperature", "top_p", "top_k", "watermarking", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "chat_template_kwargs"],
    );
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        chat.insert("stream".into(), true.into());
        chat.insert("stream_options".into(), json!({"include_usage": true, "continuous_usage_stats": true}));
    }
    Ok(())
}

fn output_config(req: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), DialectError> {
    let Some(cfg) = req.get("output_config").filter(|v| !v.is_null()) else { return Ok(()) };
    let cfg = cfg.as_object().ok_or_else(|| invalid("output_config must be an object"))?;
    if let Some(schema) = cfg.get("format").and_then(|f| f.get("schema")).filter(|s| s.as_object().is_some_and(|o| !o.is_empty())) {
        chat.insert("response_format".into(), json!({"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}));
    }
    if let Some(effort) = cfg.get("effort").filter(|e| !e.is_null()) {
        let effort =
            effort.as_str().filter(|e| EFFORTS.contains(e)).ok_or_else(|| invalid("output_config.effort must be one of low, medium, high, xhigh, max"))?;
        chat.insert("reasoning_effort".into(), effort.into());
    }
    Ok(())
}

fn thinking(req: &Map<String, Value>, chat: &mut Map<String, Value>, opts: &MessagesOptions, count: bool) -> Result<(), DialectError> {
    let Some(t) = req.get("thinking").filter(|v| !v.is_null()) else { return Ok(()) };
    match t.get("type").and_then(Value::as_str) {
        Some("disabled") => {
            chat.insert("reasoning_effort".into(), opts.disabled_thinking_effort.clone().into());
        }
        Some("enabled") => {
            let budget =
                t.get("budget_tokens").and_then(Value::as_i64).filter(|b| *b >= 1024).ok_or_else(|| invalid("thinking.budget_tokens must be at least 1024"))?;
            let remote_decode = req.get("kv_transfer_params").and_then(|k| k.get("do_remote_decode")).and_then(Value::as_bool) == Some(true);
            let max_tokens = req.get("max_tokens").and_then(Value::as_i64).unwrap_or(i64::MAX);
            if !count && !remote_decode && budget >= max_tokens {
                return Err(invalid("thinking.budget_tokens must be less than max_tokens"));
            }
            chat.insert("thinking_token_budget".into(), budget.into());
        }
        Some("adaptive") => {}
        _ => return Err(invalid("thinking.type must be 'enabled', 'disabled' or 'adaptive'")),
    }
    Ok(())
}

fn tool_choice(req: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), DialectError> {
    let Some(tc) = req.get("tool_choice").filter(|v| !v.is_null()) else { return Ok(()) };
    let disable_parallel = tc.get("disable_parallel_tool_use").and_then(Value::as_bool).unwrap_or(false);
    let choice = match tc.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name =
                tc.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| invalid("tool_choice.name is required when type is 'tool'"))?;
            json!({"function": {"name": name}, "type": "function"})
        }
        _ => return Err(invalid("tool_choice.type must be 'auto', 'any', 'tool' or 'none'")),
    };
    chat.insert("parallel_tool_calls".into(), (!disable_parallel).into());
    chat.insert("tool_choice".into(), choice);
    Ok(())
}

/// The tools in effect at the end of the conversation (`_resolve_tools`): the request's, with
/// the system messages' `tool_addition` / `tool_removal` blocks applied in order.
fn resolve_tools(req: &Map<String, Value>, messages: &[Message<'_>]) -> Result<Option<Vec<Value>>, DialectError> {
    let declared = match req.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => Some(list.clone()),
        Some(_) => return Err(invalid("tools must be a list")),
    };
    let changes: Vec<&Map<String, Value>> = messages
        .iter()
        .filter_map(|m| match &m.content {
            Content::Blocks(b) => Some(b),
            Content::Text(_) => None,
        })
        .flatten()
        .copied()
        .filter(|b| matches!(block_type(b), "tool_addition" | "tool_removal"))
        .collect();
    if changes.is_empty() {
        return Ok(declared);
    }
    let mut tools: Vec<(String, Value)> = Vec::new();
    for t in declared.unwrap_or_default() {
        let name = t.get("name").and_then(Value::as_str).ok_or_else(|| invalid("a tool needs a name"))?.to_owned();
        set_tool(&mut tools, name, t);
    }
    let mut removed: Vec<String> = Vec::new();
    for b in changes {
        let name = apply_change(b, &mut tools)?;
        removed.retain(|n| *n != name);
        if block_type(b) == "tool_removal" {
            removed.push(name);
        }
    }
    Ok(Some(tools.into_iter().filter(|(n, _)| !removed.contains(n)).map(|(_, t)| t).collect()))
}

/// Python's `dict[name] = tool`: replaces in place, or appends.
fn set_tool(tools: &mut Vec<(String, Value)>, name: String, tool: Value) {
    match tools.iter_mut().find(|(n, _)| *n == name) {
        Some(slot) => slot.1 = tool,
        None => tools.push((name, tool)),
    }
}

fn apply_change(b: &Map<String, Value>, tools: &mut Vec<(String, Value)>) -> Result<String, DialectError> {
    let kind = block_type(b);
    let change = b.get("tool").and_then(Value::as_object).ok_or_else(|| invalid(format!("tool is required for {kind} blocks")))?;
    match change.get("type").and_then(Value::as_str) {
        Some("tool_definition") if kind == "tool_addition" => {
            let def = change.get("definition").filter(|d| d.is_object()).ok_or_else(|| invalid("tool_definition needs a definition"))?;
            let name = def.get("name").and_then(Value::as_str).ok_or_else(|| invalid("a tool needs a name"))?.to_owned();
            set_tool(tools, name.clone(), def.clone());
            Ok(name)
        }
        Some("tool_reference") => {
            let name = change.get("name").and_then(Value::as_str).ok_or_else(|| invalid("tool_reference needs a name"))?.to_owned();
            let Some(slot) = tools.iter_mut().find(|(n, _)| *n == name) else {
                return Err(invalid(format!("{kind} references tool '{name}', which is not declared in tools")));
            };
            if kind == "tool_addition"
                && let Some(o) = slot.1.as_object_mut()
            {
                o.insert("defer_loading".into(), Value::Null);
            }
            Ok(name)
        }
        _ => Err(invalid(format!("{kind} only accepts a tool_reference{}", if kind == "tool_addition" { " or a tool_definition" } else { "" }))),
    }
}

fn tools(req: &Map<String, Value>, messages: &[Message<'_>], chat: &mut Map<String, Value>) -> Result<(), DialectError> {
    let Some(list) = resolve_tools(req, messages)? else { return Ok(()) };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        out.push(function_tool(t).map_err(|e| e.at(&format!("tools[{i}]")))?);
    }
    if !chat.contains_key("tool_choice") {
        chat.insert("tool_choice".into(), "auto".into());
    }
    chat.insert("tools".into(), Value::Array(out));
    Ok(())
}

/// An Anthropic tool as vLLM's `ChatCompletionToolsParam` dumps it.
fn function_tool(t: &Value) -> Result<Value, DialectError> {
    let t = t.as_object().ok_or_else(|| invalid("a tool must be an object"))?;
    let Some(Value::Object(schema)) = t.get("input_schema") else {
        return Err(invalid("input_schema must be a dictionary"));
    };
    let mut schema = schema.clone();
    if !schema.contains_key("type") {
        schema.insert("type".into(), "object".into());
    }
    let mut f = Map::new();
    f.insert("name".into(), t.get("name").cloned().unwrap_or(Value::Null));
    f.insert("description".into(), t.get("description").cloned().unwrap_or(Value::Null));
    f.insert("parameters".into(), Value::Object(schema));
    copy(t, &mut f, &["strict", "defer_loading"]);
    Ok(json!({"type": "function", "function": function_definition(&f)?}))
}

#[cfg(test)]
mod tests;
