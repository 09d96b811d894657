//! The Anthropic Messages and OpenAI Responses endpoints: shapes, event order and usage, the
//! same on vllm-sim and real vLLM. Usage is checked against the chat endpoint for the same
//! conversation, which is how vLLM renders both. Nothing here depends on the response store.

use kvgate_tests::Target;
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};

/// `event: <name>` / `data: <json>` pairs of a named-event stream.
async fn named_events(t: &Target, path: &str, body: &Value) -> Vec<(String, Value)> {
    let r = t.http.post(format!("{}{path}", t.url)).json(body).send().await.expect("request sent");
    assert_eq!(r.status().as_u16(), 200);
    let ctype = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    let raw = r.text().await.expect("body read");
    raw.split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|block| {
            let (event, data) = block.split_once('\n').unwrap_or_else(|| panic!("one-line SSE block: {block:?}"));
            let name = event.strip_prefix("event: ").unwrap_or_else(|| panic!("no event line: {block:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data line: {block:?}"));
            (name.to_owned(), serde_json::from_str(data).unwrap_or_else(|e| panic!("bad JSON {data:?}: {e}")))
        })
        .collect()
}

/// Prompt tokens of a chat request with `messages`, as the chat endpoint counts them.
async fn chat_prompt_tokens(t: &Target, messages: Value) -> u64 {
    let (s, v) = t.post("/v1/chat/completions", &json!({"model": t.model, "messages": messages, "max_tokens": 1})).await;
    assert_eq!(s, 200, "{v}");
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn messages_unary_shape_and_usage_match_chat() {
    let t = Target::start().await;
    let (system, user) = (unique_text(6), unique_text(10));
    let body = json!({"model": t.model, "max_tokens": 5, "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}]});
    let (s, v) = t.post("/v1/messages", &body).await;
    assert_eq!(s, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!((v["type"].as_str(), v["role"].as_str(), v["model"].as_str()), (Some("message"), Some("assistant"), Some(t.model.as_str())));
    assert_eq!(v["content"][0]["type"], "text");
    let out = v["usage"]["output_tokens"].as_u64().unwrap();
    assert!((1..=5).contains(&out), "{v}");
    assert_eq!(v["stop_reason"], if out == 5 { "max_tokens" } else { "end_turn" });
    assert!(v.get("stop_sequence").is_none(), "null fields are dropped: {v}");
    let chat = chat_prompt_tokens(&t, json!([{"role": "system", "content": system}, {"role": "user", "content": user}])).await;
    assert_eq!(v["usage"]["input_tokens"].as_u64(), Some(chat));
    let (s, c) = t.post("/v1/messages/count_tokens", &json!({"model": t.model, "system": system, "messages": [{"role": "user", "content": user}]})).await;
    assert_eq!(s, 200, "{c}");
    assert_eq!(c, json!({"input_tokens": chat, "context_management": {"original_input_tokens": chat}}));
}

#[tokio::test]
async fn messages_tool_turns_count_like_the_chat_they_become() {
    let t = Target::start().await;
    let body = json!({"model": t.model, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "checking"}, {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "sunny"}], "is_error": false}, {"type": "text", "text": "thanks"}]}]});
    let (s, c) = t.post("/v1/messages/count_tokens", &body).await;
    assert_eq!(s, 200, "{c}");
    let chat = chat_prompt_tokens(&t, json!([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "checking", "tool_calls": [{"id": "tu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "tu_1", "content": "sunny"},
        {"role": "user", "content": "thanks"}])).await;
    assert_eq!(c["input_tokens"].as_u64(), Some(chat));
}

#[tokio::test]
async fn messages_stream_events_in_vllm_order() {
    let t = Target::start().await;
    let user = unique_text(8);
    let events =
        named_events(&t, "/v1/messages", &json!({"model": t.model, "max_tokens": 6, "stream": true, "messages": [{"role": "user", "content": user}]})).await;
    for (name, data) in &events {
        assert_eq!(data["type"].as_str(), Some(name.as_str()), "event name is the data's type");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert!(!names.contains(&"ping"));
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!((start["content"].clone(), start["usage"]["output_tokens"].clone()), (json!([]), json!(0)));
    let middle = &names[1..names.len() - 2];
    if !middle.is_empty() {
        assert_eq!((middle[0], middle[middle.len() - 1]), ("content_block_start", "content_block_stop"));
        assert!(middle[1..middle.len() - 1].iter().all(|n| *n == "content_block_delta"), "{names:?}");
    }
    let delta = &events[events.len() - 2].1;
    let chat = chat_prompt_tokens(&t, json!([{"role": "user", "content": user}])).await;
    assert_eq!(delta["usage"]["input_tokens"].as_u64(), Some(chat));
    assert_eq!(start["usage"]["input_tokens"].as_u64(), Some(chat));
    let out = delta["usage"]["output_tokens"].as_u64().unwrap();
    assert_eq!(delta["delta"], json!({"stop_reason": if out == 6 { "max_tokens" } else { "end_turn" }, "stop_sequence": null}));
}

#[tokio::test]
async fn messages_errors_are_anthropic_shaped() {
    let t = Target::start().await;
    let (s, v) = t.post("/v1/messages", &json!({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 404, "{v}");
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("NotFoundError")));
    let (s, v) = t.post("/v1/messages", &json!({"model": t.model, "max_tokens": 1_000_000, "messages": [{"role": "user", "content": "x"}]})).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["type"], "error");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_completion_tokens"), "{v}");
}

#[tokio::test]
async fn responses_unary_shape_and_usage_match_chat() {
    let t = Target::start().await;
    let (instructions, input) = (unique_text(5), unique_text(9));
    let (s, v) =
        t.post("/v1/responses", &json!({"model": t.model, "instructions": instructions, "input": input, "max_output_tokens": 4, "store": false})).await;
    assert_eq!(s, 200, "{v}");
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("resp_") && id.len() == 21, "{id}");
    assert_eq!(
        (v["object"].as_str(), v["instructions"].as_str(), v["model"].as_str()),
        (Some("response"), Some(instructions.as_str()), Some(t.model.as_str()))
    );
    assert_eq!((v["tool_choice"].clone(), v["tools"].clone(), v["max_output_tokens"].clone()), (json!("none"), json!([]), json!(4)));
    let item = &v["output"][0];
    assert_eq!((item["type"].as_str(), item["role"].as_str(), item["status"].as_str()), (Some("message"), Some("assistant"), Some("completed")));
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    let u = &v["usage"];
    let out = u["output_tokens"].as_u64().unwrap();
    assert_eq!(v["status"], if out == 4 { "incomplete" } else { "completed" });
    if out == 4 {
        assert_eq!(v["incomplete_details"], json!({"reason": "max_output_tokens"}));
    }
    let chat = chat_prompt_tokens(&t, json!([{"role": "system", "content": instructions}, {"role": "user", "content": input}])).await;
    assert_eq!(u["input_tokens"].as_u64(), Some(chat));
    assert_eq!(u["total_tokens"].as_u64(), Some(chat + out));
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64() && u["output_tokens_details"]["reasoning_tokens"] == 0);
}

#[tokio::test]
async fn responses_items_count_like_the_chat_they_become() {
    let t = Target::start().await;
    let input = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]);
    let (s, v) = t.post("/v1/responses", &json!({"model": t.model, "input": input, "max_output_tokens": 1, "store": false})).await;
    assert_eq!(s, 200, "{v}");
    let chat = chat_prompt_tokens(&t, json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])).await;
    assert_eq!(v["usage"]["input_tokens"].as_u64(), Some(chat));
}

#[tokio::test]
async fn responses_stream_events_are_numbered_and_complete_once() {
    let t = Target::start().await;
    let body = json!({"model": t.model, "input": unique_text(8), "max_output_tokens": 5, "stream": true, "store": false});
    let events = named_events(&t, "/v1/responses", &body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!((data["type"].as_str(), data["sequence_number"].as_u64()), (Some(name.as_str()), Some(i as u64)), "{data}");
    }
    assert_eq!(&names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(names.iter().filter(|n| **n == "response.completed").count(), 1);
    assert_eq!(names.last(), Some(&"response.completed"));
    let done = &events.last().unwrap().1["response"];
    let deltas: String = events.iter().filter(|(n, _)| n == "response.output_text.delta").map(|(_, d)| d["delta"].as_str().unwrap()).collect();
    if deltas.is_empty() {
        assert_eq!(done["output"], json!([]));
    } else {
        let middle = &names[2..names.len() - 1];
        assert_eq!(&middle[..2], ["response.output_item.added", "response.content_part.added"]);
        assert_eq!(&middle[middle.len() - 3..], ["response.output_text.done", "response.content_part.done", "response.output_item.done"]);
        assert_eq!(done["output"][0]["content"][0]["text"].as_str(), Some(deltas.as_str()));
        let added = &events[2].1["item"]["id"];
        assert_eq!(&done["output"][0]["id"], added, "the streamed item is the final one");
    }
    assert_eq!(done["id"], events[0].1["response"]["id"]);
    assert!(done["usage"]["output_tokens"].as_u64().unwrap() <= 5);
}

#[tokio::test]
async fn unknown_response_ids_are_404() {
    let t = Target::start().await;
    let (s, body) = t.get("/v1/responses/resp_0000000000000000").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(s, 404, "{v}");
    assert_eq!(
        v["error"],
        json!({"message": "Response with id 'resp_0000000000000000' not found.", "type": "invalid_request_error", "param": "response_id", "code": 404})
    );
    let (s, v) = t.post("/v1/responses/resp_0000000000000000/cancel", &json!({})).await;
    assert_eq!((s, v["error"]["code"].clone()), (404, json!(404)));
    let (s, v) = t.post("/v1/responses", &json!({"model": t.model, "input": "x", "previous_response_id": "resp_0000000000000000"})).await;
    assert_eq!((s, v["error"]["param"].clone()), (404, json!("response_id")));
}

/// kvgate's rendering of each request in `render_cases.jsonl` (Messages, count_tokens,
/// Responses, chat: one `{"kind", "body"}` per line), or the reason it refuses it.
fn kvgate_ids(tok: &vllm_sim::tokenizer::ModelTokenizer, kind: &str, body: &Value) -> Result<Vec<u32>, String> {
    use vllm_sim::dialect::{messages, render_chat, responses};
    let opts = messages::MessagesOptions::for_tokenizer(tok);
    let chat = match kind {
        "messages" => messages::to_chat(body, &opts),
        "count" => messages::count_tokens_to_chat(body, &opts),
        "responses" => responses::to_chat(body, None),
        _ => Ok(body.clone()),
    };
    let text = chat.and_then(|c| render_chat(tok, &c)).map_err(|e| e.to_string())?;
    tok.encode(&text, false)
}

/// vLLM's token ids for one case from its `/render` endpoints (count_tokens: the count only).
async fn vllm_ids(t: &Target, kind: &str, body: &Value) -> Result<Vec<Option<u32>>, String> {
    let path = match kind {
        "messages" => "/v1/messages/render",
        "count" => "/v1/messages/count_tokens",
        "responses" => "/v1/responses/render",
        _ => "/v1/chat/completions/render",
    };
    let (s, v) = t.post(path, body).await;
    if s != 200 {
        return Err(v.to_string());
    }
    if let Some(n) = v["input_tokens"].as_u64() {
        return Ok(vec![None; n as usize]);
    }
    Ok(v["token_ids"].as_array().expect("token_ids").iter().map(|x| x.as_u64().map(|i| i as u32)).collect())
}

/// On real vLLM started with `--enable-scale-out` (it serves `/render`) and with
/// `KVGATE_TARGET_TOKENIZER` naming its model folder: kvgate renders every case to vLLM's token
/// ids, and refuses what vLLM refuses for the request itself. What the server refuses for its
/// own configuration (tool choice without `--enable-auto-tool-choice` and a tool parser) the
/// gateway cannot know: rendering such a request costs nothing (it only routes it), so those
/// cases are not compared. At least 50 cases must be compared and equal. Elsewhere there
/// is nothing to compare with.
#[tokio::test]
async fn rendering_equals_vllms_render_endpoints() {
    let t = Target::start().await;
    let Ok(dir) = std::env::var("KVGATE_TARGET_TOKENIZER") else { return };
    if !t.external || t.post("/v1/chat/completions/render", &json!({"model": t.model, "messages": [{"role": "user", "content": "x"}]})).await.0 != 200 {
        return;
    }
    let tok = vllm_sim::tokenizer::ModelTokenizer::load(std::path::Path::new(&dir)).expect("target tokenizer");
    let (mut mismatches, mut equal, mut server_config) = (Vec::new(), 0, 0);
    for (i, line) in include_str!("render_cases.jsonl").lines().enumerate() {
        let case: Value = serde_json::from_str(line).unwrap();
        let kind = case["kind"].as_str().unwrap();
        let mut body = case["body"].clone();
        body["model"] = t.model.clone().into();
        let ours = kvgate_ids(&tok, kind, &body).map(|ids| if kind == "count" { vec![None; ids.len()] } else { ids.into_iter().map(Some).collect() });
        match (vllm_ids(&t, kind, &body).await, ours) {
            (Ok(a), Ok(b)) if a == b => equal += 1,
            (Err(e), _) if e.contains("requires --") => server_config += 1,
            (Err(_), Err(_)) => {}
            (Ok(a), Ok(b)) => {
                let at = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
                mismatches.push(format!("line {} ({kind}): {} ids from vLLM, {} from kvgate, first difference at {at}", i + 1, a.len(), b.len()));
            }
            (theirs, ours) => mismatches.push(format!("line {} ({kind}): vLLM {:?}, kvgate {:?}", i + 1, theirs.err(), ours.err())),
        }
    }
    assert!(mismatches.is_empty(), "{} of the cases render differently:\n{}", mismatches.len(), mismatches.join("\n"));
    eprintln!("{equal} cases rendered to vLLM's token ids; {server_config} refused by the server's configuration, not compared");
    assert!(equal >= 50, "only {equal} cases compared equal");
}
