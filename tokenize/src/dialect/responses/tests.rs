//! Expected chat requests written by reading vLLM 0.32's `construct_input_messages`,
//! `_construct_message_from_response_item`, `construct_tool_dicts` and the request's
//! validators; the comments say which rule each case pins.

use super::*;
use crate::dialect::render_chat;
use crate::tokenizer::ModelTokenizer;

fn chat(body: &Value) -> Value {
    to_chat(body, None).unwrap()
}

#[test]
fn string_input_and_instructions() {
    let out = chat(&json!({"model": "m", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 16, "temperature": 0.0, "store": true}));
    assert_eq!(
        out,
        json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
               "add_generation_prompt": true, "continue_final_message": false, "max_tokens": 16, "temperature": 0.0})
    );
    // Empty instructions add nothing.
    assert_eq!(chat(&json!({"instructions": "", "input": "x"}))["messages"], json!([{"role": "user", "content": "x"}]));
}

#[test]
fn items_merge_into_assistant_messages() {
    let out = chat(&json!({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "sum"}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}, {"type": "output_text", "text": "not read"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "now", "namespace": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"type": "function_call", "call_id": "c3", "name": "get", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "again"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "developer", "content": "dev note"}]}));
    assert_eq!(
        out["messages"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"role": "assistant", "reasoning": "sum", "content": "Let me check.", "tool_calls": [
                {"id": "c1", "function": {"name": "get", "arguments": "{\"city\":\"Paris\"}"}, "type": "function"},
                {"id": "c2", "function": {"name": "clock__now", "arguments": "{}"}, "type": "function"}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            // The reasoning after a call merges into that message (it had none); the next one
            // cannot, so it starts a new assistant message.
            {"role": "assistant", "content": "It is sunny.", "tool_calls": [{"id": "c3", "function": {"name": "get", "arguments": "{}"}, "type": "function"}], "reasoning": "again"},
            {"role": "assistant", "reasoning": ""},
            {"role": "developer", "content": "dev note"},
        ])
    );
}

#[test]
fn custom_tool_calls_wrap_their_input() {
    let out = chat(&json!({"input": [{"type": "custom_tool_call", "call_id": "k", "name": "shell", "input": "ls é"},
                                    {"type": "custom_tool_call_output", "call_id": "k", "output": "a b"}]}));
    assert_eq!(out["messages"][0]["tool_calls"][0]["function"]["arguments"], "{\"input\": \"ls é\"}");
    assert_eq!(out["messages"][1], json!({"role": "tool", "content": "a b", "tool_call_id": "k"}));
}

#[test]
fn previous_turns_replay_messages_and_output_text() {
    let stored = [json!({"role": "system", "content": "old"}), json!({"role": "user", "content": "hi"})];
    let output = [
        json!({"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}),
        json!({"type": "message", "id": "msg", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "hello", "annotations": []}]}),
        json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
    ];
    let prev = history(&stored, &output);
    assert_eq!(prev, vec![json!({"role": "user", "content": "hi"}), json!({"role": "assistant", "content": "hello"})]);
    let body = json!({"instructions": "new", "input": "again", "previous_response_id": "resp_1"});
    let out = to_chat(&body, Some(&prev)).unwrap();
    assert_eq!(
        out["messages"],
        json!([{"role": "system", "content": "new"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}])
    );
    let e = to_chat(&body, None).unwrap_err();
    assert_eq!((e.reason(), e.is_unsupported()), ("previous_response", true));
}

#[test]
fn tools_as_the_template_sees_them() {
    let out = chat(&json!({"input": "x", "tools": [
        {"type": "function", "name": "get", "parameters": {"type": "object"}, "strict": true},
        {"type": "namespace", "name": "clock", "tools": [{"type": "function", "name": "now", "description": "time"}]},
        {"type": "custom", "name": "shell", "description": "run"},
        {"type": "web_search_preview"}],
        "tool_choice": {"type": "function", "name": "now"}}));
    assert_eq!(
        out["tools"],
        json!([
            {"type": "function", "function": {"name": "get", "description": null, "parameters": {"type": "object"}, "strict": true}},
            {"type": "function", "function": {"name": "clock__now", "description": "time", "parameters": null}},
            {"type": "function", "function": {"name": "shell", "description": "run", "parameters": {"type": "object", "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}}, "required": ["input"], "additionalProperties": false}}},
        ])
    );
    // A namespaced tool chosen by its local name resolves to the flat name.
    assert_eq!(out["tool_choice"], json!({"function": {"name": "clock__now"}, "type": "function"}));
    let none = chat(&json!({"input": "x"}));
    assert!(none.get("tools").is_none() && none.get("tool_choice").is_none());
    assert_eq!(to_chat(&json!({"input": "x", "tool_choice": "required"}), None).unwrap_err().reason(), "invalid");
    let grammar = json!({"input": "x", "tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark", "definition": ""}}]});
    assert!(to_chat(&grammar, None).is_err());
}

#[test]
fn a_partial_final_message_is_continued() {
    let out = chat(&json!({"input": [{"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "the cache "}]}]}));
    assert_eq!((out["add_generation_prompt"].clone(), out["continue_final_message"].clone()), (json!(false), json!(true)));
    let done = chat(&json!({"input": [{"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "x"}]}]}));
    assert_eq!(done["continue_final_message"], false);
}

#[test]
fn reasoning_effort_reaches_the_template() {
    let out = chat(&json!({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}));
    assert_eq!(out["reasoning_effort"], "low");
    assert_eq!(crate::dialect::template_kwargs(&out)["enable_thinking"], true);
}

#[test]
fn what_cannot_be_rendered_is_named() {
    let item = |it: Value| to_chat(&json!({"input": [it]}), None).unwrap_err();
    let e = item(json!({"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}));
    assert_eq!((e.reason(), e.is_unsupported()), ("image", true));
    assert_eq!(item(json!({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]})).reason(), "file");
    assert_eq!(item(json!({"type": "item_reference", "id": "x"})).reason(), "unknown_item");
    assert_eq!(item(json!({"type": "reasoning", "summary": [], "encrypted_content": "zz"})).reason(), "encrypted_reasoning");
    // vLLM's pydantic model wants a summary; an output message needs a first part.
    assert_eq!(item(json!({"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]})).reason(), "invalid");
    assert_eq!(item(json!({"type": "message", "role": "assistant", "content": []})).reason(), "invalid");
    assert_eq!(item(json!({"role": "tool", "content": "x"})).reason(), "invalid");
    assert_eq!(item(json!({"role": "assistant", "content": [{"type": "output_text", "text": "x"}]})).reason(), "invalid");
    assert!(to_chat(&json!({"input": "x", "prompt": {"id": "p"}}), None).is_err());
}

/// Where the gateway's two conversions of Responses input differed before they became this
/// one, vLLM 0.32's request model and `_construct_message_from_response_item`
/// decide: what each case gives there is in its comment.
#[test]
fn item_forms_are_read_as_vllms_request_model_reads_them() {
    let messages = |items: Value| chat(&json!({"input": items}))["messages"].clone();
    // An input message of the assistant's, typed or not: the first part's text (the images
    // after it are dropped).
    assert_eq!(
        messages(json!([{"role": "assistant", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}])),
        json!([{"role": "assistant", "content": "a"}])
    );
    let with_image =
        json!([{"type": "message", "role": "assistant", "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "data:x"}]}]);
    assert_eq!(messages(with_image), json!([{"role": "assistant", "content": "a"}]));
    // An output message may hold refusals after its first text.
    let refused_after =
        json!([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}]}]);
    assert_eq!(messages(refused_after), json!([{"role": "assistant", "content": "a"}]));
    // A tool output without a call id is a tool message without one.
    assert_eq!(messages(json!([{"type": "function_call_output", "output": "x"}])), json!([{"role": "tool", "content": "x", "tool_call_id": null}]));
    let refused = |body: Value| to_chat(&body, None).unwrap_err().reason();
    let item = |it: Value| refused(json!({"input": [it]}));
    // A 400 from the request model: output and input parts mixed, a summary or output part
    // without text, a tool output without output or with a call id of another type, a custom
    // tool call without input, instructions that are not a string.
    assert_eq!(
        item(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}, {"type": "input_text", "text": "b"}]})),
        "invalid"
    );
    assert_eq!(item(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": 5}]})), "invalid");
    assert_eq!(item(json!({"type": "reasoning", "summary": [{"type": "summary_text"}]})), "invalid");
    assert_eq!(item(json!({"type": "function_call_output", "call_id": "c"})), "invalid");
    assert_eq!(item(json!({"type": "function_call_output", "call_id": 5, "output": "x"})), "invalid");
    assert_eq!(item(json!({"type": "custom_tool_call_output", "call_id": "c", "output": null})), "invalid");
    assert_eq!(item(json!({"type": "custom_tool_call", "call_id": "c", "name": "t"})), "invalid");
    assert_eq!(refused(json!({"instructions": 5, "input": "x"})), "invalid");
    // vLLM's conversion fails on an output message that starts with a refusal.
    assert_eq!(item(json!({"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]})), "invalid");
}

#[test]
fn renders_like_the_equivalent_chat_request() {
    let tok = ModelTokenizer::builtin();
    let body = json!({"instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "c"}]},
        {"role": "user", "content": "d"}]});
    let plain = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                    {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]});
    assert_eq!(render_chat(&tok, &chat(&body)).unwrap(), render_chat(&tok, &plain).unwrap());
}
