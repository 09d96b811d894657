//! Other request dialects turned into the chat-completions request vLLM 0.32 builds from them,
//! so that their prompt renders to the same token ids as vLLM's own `/render` endpoints give:
//! - [`messages`]: Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`), after
//!   `vllm/entrypoints/anthropic/serving.py` `to_chat_completion_request`;
//! - [`responses`]: OpenAI Responses (`/v1/responses`), after
//!   `vllm/entrypoints/openai/responses/utils.py` `construct_input_messages` and
//!   `construct_tool_dicts`; also the streamed chat request the gateway sends a worker instead
//!   of a Responses stream, so that the stream can move ([`responses::stream`]);
//! - [`conversation`]: what any chat request's messages become before the template is applied
//!   (vLLM's `parse_chat_messages`), used by [`render_chat`].
//!
//! The converters return the chat request vLLM builds (OpenAI shapes: tool-call `arguments` as
//! JSON strings, `reasoning` on assistant messages, `reasoning_effort` as a request field);
//! [`render_chat`] then renders it as vLLM does: the [`conversation`] step, the template
//! variables of [`template_kwargs`], tools as vLLM dumps them ([`template_tools`]),
//! `continue_final_message` cut where transformers cuts it. Tokenize the text without special
//! tokens (vLLM's chat default). Content is always flattened to a string (vLLM's "string"
//! content format); templates that loop over content parts are not covered.
//!
//! Checked against real vLLM 0.32 (CPU, the tiny test model, `--enable-scale-out`): the token
//! ids of 71 Messages, count_tokens, Responses and chat requests (system strings and blocks,
//! billing headers, multi-turn, thinking, tool use and results, tool choice, inline system
//! messages, items of every supported type, partial final messages, tools) equal those of
//! vLLM's `/render` endpoints, both with the model's own template and with one that prints
//! tools, tool calls, reasoning, tool-call ids and the template variables; the 7 requests vLLM
//! refuses are refused here too. That needed the template environment transformers uses
//! (`trim_blocks`, `lstrip_blocks`, Python's `json.dumps` as `tojson`: see `chat_template`).
//!
//! What depends on the model's chat template:
//! - Anthropic inline `system` messages (Claude Code's per-turn reminders) are merged into the
//!   leading system prompt when the template fails on `[system, user, system, user]` (Qwen's
//!   `loop.first` guard) or there is no template; otherwise they stay in place
//!   ([`messages::MessagesOptions::for_tokenizer`] runs the same probe).
//! - Anthropic `thinking: {"type": "disabled"}` sets `reasoning_effort` to `"none"`, or to
//!   `"low"` when the template fails on or ignores `"none"` (it renders the same as a real
//!   effort), which is the case of any template that does not read `reasoning_effort`.
//! - `developer` messages become `system` ones unless the template names the role.
//! - Tools are rendered only by templates that read `tools`; tool calls, `reasoning` and
//!   `tool_call_id` only by templates that read them.
//!
//! What is not rendered here, and why ([`DialectError::reason`] names it for metrics):
//! images, audio, video and embeddings (`image`, `audio`, …: the model's multimodal processor
//! inserts its own placeholder tokens), and requests vLLM itself refuses (`document`,
//! `unknown_block`, `unknown_item`, `file`, `encrypted_reasoning`, `invalid`). A Responses
//! request with `previous_response_id` needs the stored conversation (`previous_response`).
//! gpt-oss (Harmony) models render Responses requests without a chat template; not covered.

pub mod conversation;
pub mod messages;
pub(crate) mod python;
pub mod responses;

use crate::chat_template::ChatInput;
use crate::tokenizer::ModelTokenizer;
use serde_json::{Map, Value, json};

/// Why a request cannot be converted or rendered exactly as vLLM would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DialectError {
    reason: &'static str,
    unsupported: bool,
    message: String,
}

impl DialectError {
    /// A request vLLM itself rejects (a 400 there too).
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self { reason, unsupported: false, message: message.into() }
    }

    /// A request vLLM serves but kvgate cannot render exactly (e.g. images).
    pub fn unsupported(reason: &'static str, message: impl Into<String>) -> Self {
        Self { reason, unsupported: true, message: message.into() }
    }

    /// A short label for metrics: `image`, `document`, `unknown_block`, `invalid`, …
    pub fn reason(&self) -> &'static str {
        self.reason
    }

    /// True when vLLM would serve the request and only this renderer cannot.
    pub fn is_unsupported(&self) -> bool {
        self.unsupported
    }

    /// The human-readable message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Prefixes the message with where in the request the problem is.
    pub(crate) fn at(mut self, path: &str) -> Self {
        self.message = format!("{path}: {}", self.message);
        self
    }
}

/// The template variables vLLM renders a chat request with (`ChatCompletionRequest.
/// build_chat_params`): the request's `chat_template_kwargs`, then `continue_final_message`,
/// `reasoning_effort` and `enable_thinking` (false for effort `"none"`, unless the request set
/// it) on top. `add_generation_prompt` is left to [`ChatInput`].
pub fn template_kwargs(chat: &Value) -> Map<String, Value> {
    let mut kw = chat.get("chat_template_kwargs").and_then(Value::as_object).cloned().unwrap_or_default();
    let user_sets_thinking = kw.contains_key("enable_thinking");
    let continue_final = chat.get("continue_final_message").and_then(Value::as_bool).unwrap_or(false);
    kw.insert("continue_final_message".into(), continue_final.into());
    // vLLM skips unset values ("auto" and null) when it merges its own variables in.
    if let Some(effort) = chat.get("reasoning_effort").and_then(Value::as_str).filter(|e| *e != "auto") {
        kw.insert("reasoning_effort".into(), effort.into());
        if !user_sets_thinking {
            kw.insert("enable_thinking".into(), (effort != "none").into());
        }
    }
    kw
}

/// Tools as vLLM hands them to the template: each `ChatCompletionToolsParam` dumped, i.e.
/// `{"type": "function", "function": {name, description, parameters[, strict][, defer_loading]}}`
/// with absent `description`/`parameters` as null and unknown keys dropped.
pub fn template_tools(tools: &Value) -> Result<Value, DialectError> {
    let Some(list) = tools.as_array() else {
        return Err(DialectError::invalid("invalid", "tools must be a list"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let f = t.get("function").and_then(Value::as_object).ok_or_else(|| DialectError::invalid("invalid", format!("tools[{i}].function is required")))?;
        let mut f = f.clone();
        if let Some(d) = t.get("defer_loading").filter(|d| !d.is_null())
            && f.get("defer_loading").is_none_or(Value::is_null)
        {
            f.insert("defer_loading".into(), d.clone());
        }
        out.push(json!({"type": "function", "function": function_definition(&f).map_err(|e| e.at(&format!("tools[{i}]")))?}));
    }
    Ok(Value::Array(out))
}

/// vLLM's `FunctionDefinition` dumped: name, description, parameters, and strict and
/// defer_loading only when set.
pub(crate) fn function_definition(f: &Map<String, Value>) -> Result<Value, DialectError> {
    let Some(name) = f.get("name").and_then(Value::as_str) else {
        return Err(DialectError::invalid("invalid", "a function needs a string name"));
    };
    let mut out = Map::new();
    out.insert("name".into(), name.into());
    out.insert("description".into(), f.get("description").cloned().unwrap_or(Value::Null));
    out.insert("parameters".into(), f.get("parameters").cloned().unwrap_or(Value::Null));
    for key in ["strict", "defer_loading"] {
        if let Some(v) = f.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    Ok(Value::Object(out))
}

/// transformers marks the end of the final message with this text to find where to cut.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// The prompt text vLLM renders for a chat-completions request `chat` (a converter's output or a
/// client's own body) with `tok`'s chat template.
pub fn render_chat(tok: &ModelTokenizer, chat: &Value) -> Result<String, DialectError> {
    let messages = chat.get("messages").and_then(Value::as_array).ok_or_else(|| DialectError::invalid("invalid", "messages must be a list"))?;
    let continue_final = chat.get("continue_final_message").and_then(Value::as_bool).unwrap_or(false);
    let add_generation_prompt = chat.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true);
    if continue_final && add_generation_prompt {
        return Err(DialectError::invalid(
            "invalid",
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will prompt it to start a new assistant message instead.",
        ));
    }
    let developer = conversation::template_supports_developer(tok.chat_template_source());
    let mut conv = conversation::prepare(messages, developer)?;
    if conv.is_empty() {
        // transformers refuses before the template runs.
        return Err(DialectError::invalid("invalid", "Cannot apply chat template to an empty conversation. Provide at least one message."));
    }
    let tools = match chat.get("tools") {
        None | Some(Value::Null) => None,
        Some(t) => Some(template_tools(t)?),
    };
    let kwargs = template_kwargs(chat);
    let final_text = if continue_final { Some(tag_final_message(&mut conv, tok.chat_template_source())?) } else { None };
    let input = ChatInput { messages: &conv, add_generation_prompt, tools: tools.as_ref(), kwargs: Some(&kwargs) };
    let text = tok.render_chat(&input).map_err(|m| DialectError::invalid("template", m))?;
    match final_text {
        Some(last) => cut_at_tag(text, &last),
        None => Ok(text),
    }
}

/// transformers' `continue_final_message`, first half: the final message's content gets the tag
/// appended. Returns the content as it was.
fn tag_final_message(conv: &mut [Value], template: Option<&str>) -> Result<String, DialectError> {
    let Some(last) = conv.last_mut().and_then(|m| m.as_object_mut()) else {
        return Err(DialectError::invalid("invalid", "continue_final_message is set but there is no message to continue"));
    };
    if !template.is_some_and(|t| t.contains("content")) {
        return Err(DialectError::invalid("template", "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template"));
    }
    let content = last.get("content").and_then(Value::as_str).unwrap_or("").to_owned();
    last.insert("content".into(), format!("{content}{CONTINUE_TAG}").into());
    Ok(content)
}

/// Second half: the prompt ends where the tag starts, so generation continues that message.
fn cut_at_tag(mut text: String, final_message: &str) -> Result<String, DialectError> {
    let tag = CONTINUE_TAG.trim();
    let Some(loc) = text.rfind(tag).filter(|_| text.contains(final_message.trim())) else {
        return Err(DialectError::invalid(
            "template",
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template!",
        ));
    };
    let spaced = text[loc..].starts_with(CONTINUE_TAG);
    text.truncate(loc);
    if !spaced {
        // The template trimmed the message's trailing space; so does transformers.
        text.truncate(text.trim_end().len());
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_kwargs_follow_build_chat_params() {
        let kw = template_kwargs(&json!({"chat_template_kwargs": {"x": 1}, "reasoning_effort": "none"}));
        assert_eq!(Value::Object(kw), json!({"x": 1, "continue_final_message": false, "reasoning_effort": "none", "enable_thinking": false}));
        let kw = template_kwargs(&json!({"chat_template_kwargs": {"enable_thinking": true}, "reasoning_effort": "low"}));
        assert_eq!(kw["enable_thinking"], true);
        assert!(!template_kwargs(&json!({})).contains_key("reasoning_effort"));
    }

    #[test]
    fn tools_are_dumped_as_vllm_does() {
        let t = template_tools(&json!([{"type": "function", "function": {"name": "f", "extra": 1}, "defer_loading": true}])).unwrap();
        assert_eq!(t, json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": null, "defer_loading": true}}]));
    }

    #[test]
    fn renders_and_continues_the_final_message() {
        let tok = ModelTokenizer::builtin();
        let chat = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache "}], "continue_final_message": true, "add_generation_prompt": false});
        let text = render_chat(&tok, &chat).unwrap();
        assert!(text.ends_with("the cache "), "{text}");
        // add_generation_prompt defaults to true, and transformers refuses both.
        let bad = json!({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": true});
        assert_eq!(render_chat(&tok, &bad).unwrap_err().reason(), "invalid");
    }
}
