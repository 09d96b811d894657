//! Expected chat requests written by reading vLLM 0.32's `to_chat_completion_request` and the
//! helpers it calls; the comments say which rule each case pins.

use super::*;
use crate::dialect::render_chat;

fn chat(body: &Value) -> Value {
    to_chat(body, &MessagesOptions::default()).unwrap()
}

#[test]
fn system_string_and_blocks() {
    let out = chat(&json!({"model": "m", "max_tokens": 10, "system": "S", "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(
        out,
        json!({"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], "max_tokens": 10, "max_completion_tokens": 10})
    );
    // Text blocks join without a separator; the billing header block and cache_control go.
    let out = chat(&json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
        {"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},
        {"type": "text", "text": "helpful."}]}));
    assert_eq!(out["messages"][0], json!({"role": "system", "content": "You are helpful."}));
    // An empty system adds nothing.
    let out = chat(&json!({"model": "m", "max_tokens": 1, "system": "", "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(out["messages"], json!([{"role": "user", "content": "hi"}]));
}

#[test]
fn blocks_tool_use_and_tool_result() {
    let out = chat(&json!({"model": "m", "max_tokens": 64, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "text", "text": "in Paris"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need a tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"city": "Paris", "days": [1, 2.5]}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu_1", "is_error": true, "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}]},
            {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_2", "content": "done"}]},
        {"role": "assistant", "content": []}]}));
    assert_eq!(
        out["messages"],
        json!([
            // Several text parts stay a list (vLLM's renderer joins them with "\n").
            {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "text", "text": "in Paris"}]},
            {"role": "assistant", "reasoning": "need a tool",
             "tool_calls": [{"id": "tu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": [1, 2.5]}"}}],
             "content": "Checking."},
            // The tool message comes before the user message that carried the result; is_error is ignored.
            {"role": "tool", "tool_call_id": "tu_1", "content": "sunny\n20C"},
            {"role": "user", "content": "thanks"},
            // A user message with nothing but tool results is dropped...
            {"role": "tool", "tool_call_id": "tu_2", "content": "done"},
            // ...an empty assistant message is not.
            {"role": "assistant"},
        ])
    );
    let keys: Vec<&String> = out["messages"][1].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["role", "reasoning", "tool_calls", "content"]);
}

#[test]
fn tool_result_details() {
    let out = chat(&json!({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
            {"type": "tool_reference", "tool_name": "search"}, {"type": "text", "text": "x"}]}]},
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "it's"}]},
                                          {"type": "tool_use", "id": "", "name": "f"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c"}]}]}));
    let msgs = out["messages"].as_array().unwrap();
    assert_eq!(msgs[0], json!({"role": "tool", "tool_call_id": "a", "content": "x"}));
    assert_eq!(msgs[1], json!({"role": "tool", "tool_call_id": "a", "content": [{"type": "tool_reference", "name": "search"}]}));
    // An assistant's tool_result is Python's str() of its content.
    assert_eq!(msgs[2]["content"], r#"Tool result: [{'type': 'text', 'text': "it's"}]"#);
    // A call without id is named after the clock; without input its arguments are "{}".
    assert!(msgs[2]["tool_calls"][0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(msgs[2]["tool_calls"][0]["function"]["arguments"], "{}");
    assert_eq!(msgs[3], json!({"role": "tool", "tool_call_id": "c", "content": ""}));
}

#[test]
fn inline_system_messages_stay_or_merge() {
    let body = json!({"model": "m", "max_tokens": 8, "system": "S", "messages": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "x-anthropic-billing-header: 1"}]},
        {"role": "system", "content": "x-anthropic-billing-header: 2"},
        {"role": "user", "content": "b"}]});
    let kept = to_chat(&body, &MessagesOptions::default()).unwrap();
    assert_eq!(
        kept["messages"],
        json!([{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "system", "content": "<reminder>"}, {"role": "user", "content": "b"}])
    );
    let opts = MessagesOptions { merge_inline_system: true, ..MessagesOptions::default() };
    let merged = to_chat(&body, &opts).unwrap();
    assert_eq!(merged["messages"], json!([{"role": "system", "content": "S<reminder>"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]));
}

#[test]
fn sampling_stream_and_thinking_fields() {
    let out = chat(&json!({"model": "m", "max_tokens": 4096, "stream": true, "stop_sequences": ["\n\nHuman:"], "temperature": 0.2,
        "top_k": 5, "metadata": {"user_id": "u"}, "chat_template_kwargs": {"k": 1}, "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(out["stop"], json!(["\n\nHuman:"]));
    assert_eq!((out["temperature"].clone(), out["top_k"].clone()), (json!(0.2), json!(5)));
    assert_eq!(out["stream_options"], json!({"include_usage": true, "continuous_usage_stats": true}));
    assert_eq!(out["thinking_token_budget"], 2048);
    assert_eq!(out["chat_template_kwargs"], json!({"k": 1}));
    assert!(out.get("metadata").is_none() && out.get("reasoning_effort").is_none());
    // thinking.disabled is applied after output_config.effort, so it wins.
    let body = json!({"model": "m", "max_tokens": 8, "output_config": {"effort": "high"}, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(chat(&body)["reasoning_effort"], "none");
    let low = MessagesOptions { disabled_thinking_effort: "low".into(), ..MessagesOptions::default() };
    assert_eq!(to_chat(&body, &low).unwrap()["reasoning_effort"], "low");
    let adaptive = json!({"model": "m", "max_tokens": 8, "output_config": {"effort": "max"}, "thinking": {"type": "adaptive"}, "messages": []});
    assert_eq!(chat(&adaptive)["reasoning_effort"], "max");
    let over = json!({"model": "m", "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2048}, "messages": []});
    assert_eq!(to_chat(&over, &MessagesOptions::default()).unwrap_err().reason(), "invalid");
}

#[test]
fn tools_and_tool_choice() {
    let tools = json!([{"name": "get", "description": "d", "input_schema": {"properties": {"q": {"type": "string"}}}, "cache_control": {"type": "ephemeral"}},
                       {"name": "put", "input_schema": {"type": "object"}, "strict": true}]);
    let out = chat(&json!({"model": "m", "max_tokens": 8, "tools": tools, "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(out["tool_choice"], "auto");
    assert!(out.get("parallel_tool_calls").is_none());
    assert_eq!(
        out["tools"],
        json!([{"type": "function", "function": {"name": "get", "description": "d", "parameters": {"properties": {"q": {"type": "string"}}, "type": "object"}}},
               {"type": "function", "function": {"name": "put", "description": null, "parameters": {"type": "object"}, "strict": true}}])
    );
    let out = chat(&json!({"model": "m", "max_tokens": 8, "tools": tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": true}, "messages": []}));
    assert_eq!((out["tool_choice"].clone(), out["parallel_tool_calls"].clone()), (json!("required"), json!(false)));
    let out = chat(&json!({"model": "m", "max_tokens": 8, "tools": tools, "tool_choice": {"type": "tool", "name": "get"}, "messages": []}));
    assert_eq!((out["tool_choice"].clone(), out["parallel_tool_calls"].clone()), (json!({"function": {"name": "get"}, "type": "function"}), json!(true)));
    let out = chat(&json!({"model": "m", "max_tokens": 8, "tool_choice": {"type": "none"}, "messages": []}));
    assert_eq!(out["tool_choice"], "none");
    assert!(out.get("tools").is_none());
}

#[test]
fn tool_additions_and_removals_resolve_the_tool_list() {
    let body = json!({"model": "m", "max_tokens": 8,
        "tools": [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}, "defer_loading": true}],
        "messages": [{"role": "system", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "b"}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}},
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {"name": "c", "input_schema": {"type": "object"}}}}]},
            {"role": "user", "content": "hi"}]});
    let out = chat(&body);
    let names: Vec<&str> = out["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["b", "c"]);
    // Added by reference: no longer deferred.
    assert!(out["tools"][0]["function"].get("defer_loading").is_none());
    let bad = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "zz"}}]}]});
    assert!(to_chat(&bad, &MessagesOptions::default()).unwrap_err().message().contains("not declared"));
    let misplaced = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}]}]});
    assert!(to_chat(&misplaced, &MessagesOptions::default()).is_err());
}

#[test]
fn what_cannot_be_rendered_is_named() {
    let opts = MessagesOptions::default();
    let with = |block: Value| json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]});
    let e = to_chat(&with(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}})), &opts).unwrap_err();
    assert_eq!((e.reason(), e.is_unsupported()), ("image", true));
    let e = to_chat(&with(json!({"type": "document", "source": {"type": "text", "data": "x"}})), &opts).unwrap_err();
    assert_eq!((e.reason(), e.is_unsupported()), ("document", false));
    assert_eq!(to_chat(&with(json!({"type": "server_tool_use", "id": "x"})), &opts).unwrap_err().reason(), "unknown_block");
    let image_result = with(json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}));
    assert_eq!(to_chat(&image_result, &opts).unwrap_err().reason(), "image");
    assert_eq!(to_chat(&json!({"model": "m", "messages": []}), &opts).unwrap_err().reason(), "invalid");
    assert_eq!(to_chat(&json!({"model": "m", "max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}), &opts).unwrap_err().reason(), "invalid");
}

#[test]
fn count_tokens_keeps_only_what_renders() {
    let body = json!({"model": "m", "system": "S", "tools": [{"name": "t", "input_schema": {}}], "chat_template_kwargs": {"k": 1},
                      "messages": [{"role": "user", "content": "hi"}]});
    let out = count_tokens_to_chat(&body, &MessagesOptions::default()).unwrap();
    assert!(out.get("max_tokens").is_none() && out.get("stream").is_none());
    assert_eq!(out["chat_template_kwargs"], json!({"k": 1}));
    assert_eq!(out["tools"][0]["function"]["name"], "t");
}

#[test]
fn renders_like_the_equivalent_chat_request() {
    let tok = ModelTokenizer::builtin();
    let body = json!({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}]},
        {"role": "user", "content": "d"}]});
    let text = render_chat(&tok, &chat(&body)).unwrap();
    let plain = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                    {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]});
    assert_eq!(text, render_chat(&tok, &plain).unwrap());
}

#[test]
fn probes_the_template_as_vllm_does() {
    // The shipped template accepts inline system messages and never reads reasoning_effort.
    let opts = MessagesOptions::for_tokenizer(&ModelTokenizer::builtin());
    assert_eq!(opts, MessagesOptions { merge_inline_system: false, disabled_thinking_effort: "low".into() });
}
