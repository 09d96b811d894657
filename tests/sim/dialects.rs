//! vllm-sim's Responses store (on and off, as `VLLM_ENABLE_RESPONSES_API_STORE` sets it in
//! vLLM), `previous_response_id`, GET and cancel, background responses, and Messages answers
//! that end on EOS.

use kvgate_tests::Target;
use kvgate_tests::cluster::wait_until;
use kvgate_tests::target::{test_sim_config, unique_text};
use serde_json::{Value, json};
use std::time::Duration;

async fn store_on() -> Target {
    Target::sim(vllm_sim::SimConfig { responses_store: true, ..test_sim_config() }).await
}

async fn get_json(t: &Target, path: &str) -> (u16, Value) {
    let (s, body) = t.get(path).await;
    (s, serde_json::from_str(&body).unwrap())
}

fn output_text(v: &Value) -> &str {
    v["output"][0]["content"][0]["text"].as_str().unwrap_or("")
}

#[tokio::test]
async fn previous_response_id_continues_the_stored_conversation() {
    let t = store_on().await;
    let (first, second) = (unique_text(8), unique_text(6));
    let (s, one) = t.post("/v1/responses", &json!({"instructions": "be brief", "input": first, "max_output_tokens": 4})).await;
    assert_eq!(s, 200, "{one}");
    let id = one["id"].as_str().unwrap();
    let (s, got) = get_json(&t, &format!("/v1/responses/{id}")).await;
    assert_eq!((s, &got), (200, &one), "GET returns the stored response");
    let body = json!({"instructions": "new rules", "input": second, "max_output_tokens": 3, "previous_response_id": id});
    let (s, two) = t.post("/v1/responses", &body).await;
    assert_eq!(s, 200, "{two}");
    assert_eq!(two["previous_response_id"], id);
    // The earlier instructions are not carried over; its answer is.
    let (s, chat) = t
        .post(
            "/v1/chat/completions",
            &json!({"max_tokens": 1, "messages": [
        {"role": "system", "content": "new rules"}, {"role": "user", "content": first},
        {"role": "assistant", "content": output_text(&one)}, {"role": "user", "content": second}]}),
        )
        .await;
    assert_eq!(s, 200, "{chat}");
    assert_eq!(two["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    // A third turn sees both earlier turns.
    let (s, three) = t.post("/v1/responses", &json!({"input": "more", "max_output_tokens": 1, "previous_response_id": two["id"]})).await;
    assert_eq!(s, 200, "{three}");
    assert!(three["usage"]["input_tokens"].as_u64() > two["usage"]["input_tokens"].as_u64());
    // A finished response is not cancellable.
    let (s, v) = t.post(&format!("/v1/responses/{id}/cancel"), &json!({})).await;
    assert_eq!((s, v["error"]["message"].as_str()), (400, Some("Cannot cancel a synchronous response.")));
}

#[tokio::test]
async fn streamed_responses_are_stored_as_completed() {
    let t = store_on().await;
    let r =
        t.http.post(format!("{}/v1/responses", t.url)).json(&json!({"input": unique_text(5), "max_output_tokens": 3, "stream": true})).send().await.unwrap();
    let raw = r.text().await.unwrap();
    let last = raw.trim_end().rsplit("data: ").next().unwrap();
    let completed: Value = serde_json::from_str(last).unwrap();
    assert_eq!(completed["type"], "response.completed");
    let id = completed["response"]["id"].as_str().unwrap();
    let (s, got) = get_json(&t, &format!("/v1/responses/{id}")).await;
    assert_eq!((s, &got), (200, &completed["response"]));
}

#[tokio::test]
async fn store_false_and_store_off_keep_nothing() {
    let t = store_on().await;
    let (_, v) = t.post("/v1/responses", &json!({"input": "x", "max_output_tokens": 1, "store": false})).await;
    let (s, _) = t.get(&format!("/v1/responses/{}", v["id"].as_str().unwrap())).await;
    assert_eq!(s, 404, "store: false is not kept");

    let off = Target::sim(test_sim_config()).await;
    let (s, v) = off.post("/v1/responses", &json!({"input": "x", "max_output_tokens": 1})).await;
    assert_eq!(s, 200, "store defaults to true and is silently ignored: {v}");
    let id = v["id"].as_str().unwrap();
    let (s, got) = get_json(&off, &format!("/v1/responses/{id}")).await;
    assert_eq!((s, got["error"]["message"].as_str()), (404, Some(format!("Response with id '{id}' not found.").as_str())));
    let (s, v) = off.post("/v1/responses", &json!({"input": "y", "previous_response_id": id})).await;
    assert_eq!((s, v["error"]["type"].as_str()), (404, Some("invalid_request_error")));
    let (s, v) = off.post("/v1/responses", &json!({"input": "y", "background": true})).await;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("background")));
    assert!(v["error"]["message"].as_str().unwrap().contains("VLLM_ENABLE_RESPONSES_API_STORE=1"));
}

#[tokio::test]
async fn background_responses_finish_in_the_store_or_are_cancelled() {
    let t = store_on().await;
    let (s, v) = t.post("/v1/responses", &json!({"input": "x", "max_output_tokens": 3, "background": true})).await;
    assert_eq!((s, v["status"].as_str(), v["background"].as_bool()), (200, Some("queued"), Some(true)), "{v}");
    let path = format!("/v1/responses/{}", v["id"].as_str().unwrap());
    let finished = wait_until(Duration::from_secs(10), || async { get_json(&t, &path).await.1["status"] == "incomplete" }).await;
    assert!(finished.is_some(), "the background response finishes");
    assert_eq!(get_json(&t, &path).await.1["usage"]["output_tokens"], 3);

    // A slow one (simulated time 50x slower) is still queued when cancelled.
    let slow = Target::sim(vllm_sim::SimConfig { responses_store: true, time_scale: 0.02, ..test_sim_config() }).await;
    let (_, v) = slow.post("/v1/responses", &json!({"input": unique_text(30), "max_output_tokens": 500, "background": true})).await;
    let id = v["id"].as_str().unwrap();
    let (s, c) = slow.post(&format!("/v1/responses/{id}/cancel"), &json!({})).await;
    assert_eq!((s, c["status"].as_str()), (200, Some("cancelled")), "{c}");
    let (_, got) = get_json(&slow, &format!("/v1/responses/{id}")).await;
    assert_eq!(got["status"], "cancelled");
    let idle = wait_until(Duration::from_secs(10), || async { slow.metrics().await.sum("vllm:num_requests_running", &[]) == 0.0 }).await;
    assert!(idle.is_some(), "the cancelled request left the engine");
}

#[tokio::test]
async fn messages_that_end_on_eos_say_end_turn() {
    let t = Target::sim(vllm_sim::SimConfig { eos_probability: 1.0, ..test_sim_config() }).await;
    let body = json!({"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let (s, v) = t.post("/v1/messages", &body).await;
    assert_eq!(s, 200, "{v}");
    // The EOS token has no text: Anthropic's empty answer is one empty text block.
    assert_eq!(
        (v["content"].clone(), v["stop_reason"].clone(), v["usage"]["output_tokens"].clone()),
        (json!([{"type": "text", "text": ""}]), json!("end_turn"), json!(1))
    );
    let mut stream = body.clone();
    stream["stream"] = true.into();
    let raw = t.http.post(format!("{}/v1/messages", t.url)).json(&stream).send().await.unwrap().text().await.unwrap();
    let names: Vec<&str> = raw.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(names, ["message_start", "message_delta", "message_stop"], "no text, no content block");
    assert!(raw.contains(r#""delta":{"stop_reason":"end_turn","stop_sequence":null}"#), "{raw}");
}
