//! The conversation a chat request's `messages` become before vLLM applies the chat template
//! (vLLM 0.32 `renderers/chat_utils.py` `parse_chat_messages` with the "string" content format,
//! then `renderers/hf.py` `safe_apply_chat_template`'s developer-role handling).
//!
//! This is what the template really sees, and it differs from the request's messages: text parts
//! are joined with `"\n"` (`input_text`, `output_text`, `refusal`, `thinking` and
//! `tool_reference` parts count as text), a system message's leading Claude Code billing-header
//! line is dropped, an assistant's `reasoning` is also given as `reasoning_content`, tool-call
//! `arguments` strings are parsed into objects (invalid JSON or a non-object becomes `{}`), an
//! empty `tool_calls` list is dropped, and `developer` messages become `system` ones (merged
//! into one leading system message) when the template never names the developer role.
//!
//! Templates that loop over `message.content` as a list (vLLM's "openai" content format, used
//! by multimodal models) are not covered: content is always flattened to a string here.

use super::DialectError;
use serde_json::{Map, Value, json};

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Part types whose content is text.
const TEXT_PARTS: [(&str, &str); 5] = [("text", "text"), ("input_text", "text"), ("output_text", "text"), ("refusal", "refusal"), ("thinking", "thinking")];

/// Media part types vLLM accepts for multimodal models, with the reason kvgate reports.
const MEDIA_PARTS: [(&str, &str); 11] = [
    ("image_url", "image"),
    ("input_image", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("audio_embeds", "audio"),
    ("video_url", "video"),
    ("video_embeds", "video"),
    ("prompt_embeds", "prompt_embeds"),
    ("file", "file"),
];

/// Whether vLLM keeps `developer` messages for this template (it looks for the quoted word).
pub fn template_supports_developer(template_source: Option<&str>) -> bool {
    template_source.is_some_and(|t| t.contains("\"developer\"") || t.contains("'developer'"))
}

/// The messages the chat template is rendered with, from a chat request's `messages`.
pub fn prepare(messages: &[Value], developer_supported: bool) -> Result<Vec<Value>, DialectError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        out.push(message(i, m)?);
    }
    for m in &mut out {
        postprocess_tool_calls(m)?;
    }
    if !developer_supported && out.iter().any(|m| m["role"] == "developer") {
        for m in &mut out {
            if m["role"] == "developer" {
                let obj = m.as_object_mut().expect("built as an object");
                obj.insert("role".into(), "system".into());
                obj.shift_remove("tools");
            }
        }
        out = consolidate_system(out);
    }
    Ok(out)
}

fn message(i: usize, m: &Value) -> Result<Value, DialectError> {
    let Some(obj) = m.as_object() else {
        return Err(DialectError::invalid("invalid", format!("messages[{i}] must be an object")));
    };
    let Some(role) = obj.get("role").and_then(Value::as_str) else {
        return Err(DialectError::invalid("invalid", format!("messages[{i}].role must be a string")));
    };
    let mut parts: Vec<Value> = match obj.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(DialectError::invalid("invalid", format!("messages[{i}].content must be a string or a list of parts"))),
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        if let Some(t) = part_text(p).map_err(|e| e.at(&format!("messages[{i}].content[{j}]")))? {
            texts.push(t);
        }
    }
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    out.insert("content".into(), texts.join("\n").into());
    match role {
        "assistant" => {
            if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), calls.clone());
            }
            if let Some(r) = obj.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "tool" => {
            if let Some(id) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = obj.get(key).filter(|v| v.is_string()) {
            out.insert(key.into(), v.clone());
        }
    }
    if role == "developer" {
        out.insert("tools".into(), obj.get("tools").cloned().unwrap_or(Value::Null));
    }
    Ok(Value::Object(out))
}

/// Claude Code's attribution header changes on every request; vLLM drops that line from system
/// text so the rest of the prompt stays cacheable.
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match &part {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => o.get("text").and_then(Value::as_str),
            _ => None,
        };
        let Some(text) = text.filter(|t| t.starts_with(BILLING_HEADER)) else {
            out.push(part);
            continue;
        };
        let rest = text.split_once('\n').map(|(_, r)| r).unwrap_or("");
        if rest.is_empty() {
            continue;
        }
        let rest = rest.to_owned();
        out.push(match part {
            Value::Object(mut o) => {
                o.insert("text".into(), rest.into());
                Value::Object(o)
            }
            _ => Value::String(rest),
        });
    }
    out
}

/// The text a content part contributes, `None` for a skipped part.
fn part_text(p: &Value) -> Result<Option<String>, DialectError> {
    let obj = match p {
        Value::String(s) => return Ok(Some(s.clone())),
        Value::Object(o) => o,
        _ => return Err(DialectError::invalid("invalid", "a content part must be a string or an object")),
    };
    let kind = obj.get("type");
    if kind.is_none_or(Value::is_null) || obj.get("uuid").is_some_and(|u| !u.is_null()) {
        return untyped_part(obj);
    }
    let Some(kind) = kind.and_then(Value::as_str) else {
        return Err(DialectError::invalid("invalid", "Invalid 'type' field in multimodal part."));
    };
    if let Some((_, field)) = TEXT_PARTS.iter().find(|(t, _)| *t == kind) {
        return match obj.get(*field) {
            None | Some(Value::Null) if matches!(kind, "text" | "refusal") => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(DialectError::invalid("invalid", format!("content part of type '{kind}' needs a string '{field}'"))),
        };
    }
    if kind == "tool_reference" {
        return reference_name(obj);
    }
    if let Some((_, reason)) = MEDIA_PARTS.iter().find(|(t, _)| *t == kind) {
        return Err(DialectError::unsupported(reason, format!("content part type '{kind}' needs the model's multimodal processor")));
    }
    let reason = if kind == "input_file" { "file" } else { "unknown_part" };
    Err(DialectError::invalid(reason, format!("Unsupported chat content part type: '{kind}'.")))
}

/// A part without `type` (or with a `uuid`): vLLM infers the type from the keys present.
fn untyped_part(obj: &Map<String, Value>) -> Result<Option<String>, DialectError> {
    if let Some((key, reason)) = MEDIA_PARTS.iter().find(|(k, _)| obj.contains_key(*k)) {
        return Err(DialectError::unsupported(reason, format!("content part with '{key}' needs the model's multimodal processor")));
    }
    if obj.contains_key("tool_reference") {
        return reference_name(obj);
    }
    Err(DialectError::invalid("invalid", "Missing 'type' field in multimodal part."))
}

fn reference_name(obj: &Map<String, Value>) -> Result<Option<String>, DialectError> {
    match obj.get("name") {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        _ => Err(DialectError::invalid("invalid", "a tool_reference part needs a string 'name'")),
    }
}

/// Templates expect tool-call arguments as mappings; vLLM parses the OpenAI JSON strings.
fn postprocess_tool_calls(m: &mut Value) -> Result<(), DialectError> {
    if m["role"] != "assistant" {
        return Ok(());
    }
    let obj = m.as_object_mut().expect("built as an object");
    let Some(Value::Array(calls)) = obj.get_mut("tool_calls") else { return Ok(()) };
    if calls.is_empty() {
        obj.shift_remove("tool_calls");
        return Ok(());
    }
    for call in calls.iter_mut() {
        let Some(call) = call.as_object_mut() else {
            return Err(DialectError::invalid("invalid", "assistant tool_calls entries must be objects."));
        };
        let is_function = call.get("type").is_none_or(|t| t == "function");
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut).filter(|_| is_function) else {
            return Err(DialectError::invalid("invalid", "chat completions only support assistant tool_calls of type 'function'."));
        };
        let parsed = match function.get("arguments") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(o)) => Value::Object(o),
                _ => json!({}),
            },
            _ => json!({}),
        };
        function.insert("arguments".into(), parsed);
    }
    Ok(())
}

/// Some templates need the system message first; after developer messages became system ones,
/// vLLM merges every system message into one at the start.
fn consolidate_system(conversation: Vec<Value>) -> Vec<Value> {
    let mut texts = Vec::new();
    let mut rest = Vec::new();
    let mut needed = false;
    for (i, m) in conversation.iter().enumerate() {
        if m["role"] != "system" {
            rest.push(m.clone());
            continue;
        }
        needed |= i > 0 || !texts.is_empty();
        if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
            texts.push(t.to_owned());
        }
    }
    if !needed {
        return conversation;
    }
    let mut out = vec![json!({"role": "system", "content": texts.join("\n\n")})];
    out.extend(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattens_parts_and_keeps_what_vllm_keeps() {
        let msgs = [
            json!({"role": "system", "content": "x-anthropic-billing-header: cch=1;\nBe brief."}),
            json!({"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": null}, "b"], "name": "ann"}),
            json!({"role": "assistant", "content": null, "reasoning": "think",
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                                  {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}),
            json!({"role": "assistant", "content": "done", "tool_calls": []}),
        ];
        let conv = prepare(&msgs, false).unwrap();
        assert_eq!(
            Value::Array(conv),
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "a\nb", "name": "ann"},
                {"role": "assistant", "content": "", "reasoning": "think", "reasoning_content": "think",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]},
                {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"},
                {"role": "assistant", "content": "done"},
            ])
        );
        // Key order as vLLM builds the message (role, content, then the rest).
        let again = prepare(&msgs, false).unwrap();
        let keys: Vec<&String> = again[2].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["role", "content", "tool_calls", "reasoning", "reasoning_content"]);
    }

    #[test]
    fn billing_header_alone_is_dropped_and_only_on_system() {
        let conv =
            prepare(&[json!({"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: a"}, {"type": "text", "text": "S"}]})], true)
                .unwrap();
        assert_eq!(conv[0]["content"], "S");
        let conv = prepare(&[json!({"role": "user", "content": "x-anthropic-billing-header: a\nq"})], true).unwrap();
        assert_eq!(conv[0]["content"], "x-anthropic-billing-header: a\nq");
    }

    #[test]
    fn developer_becomes_system_unless_the_template_names_it() {
        let msgs = [json!({"role": "system", "content": "A"}), json!({"role": "user", "content": "u"}), json!({"role": "developer", "content": "B"})];
        let conv = prepare(&msgs, false).unwrap();
        assert_eq!(Value::Array(conv), json!([{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "u"}]));
        let conv = prepare(&msgs, true).unwrap();
        assert_eq!(conv[2], json!({"role": "developer", "content": "B", "tools": null}));
        assert!(template_supports_developer(Some("{% if m.role == 'developer' %}")));
        assert!(!template_supports_developer(Some("{{ developer }}")));
        assert!(!template_supports_developer(None));
    }

    #[test]
    fn media_and_unknown_parts_are_named() {
        let img = [json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]})];
        let e = prepare(&img, true).unwrap_err();
        assert_eq!((e.reason(), e.is_unsupported()), ("image", true));
        let file = [json!({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]})];
        assert_eq!(prepare(&file, true).unwrap_err().reason(), "file");
        let odd = [json!({"role": "user", "content": [{"type": "hologram"}]})];
        let e = prepare(&odd, true).unwrap_err();
        assert_eq!((e.reason(), e.is_unsupported()), ("unknown_part", false));
        let refs = [json!({"role": "tool", "content": [{"type": "tool_reference", "name": "search"}, {"type": "text", "text": "x"}]})];
        assert_eq!(prepare(&refs, true).unwrap()[0]["content"], "search\nx");
    }
}
