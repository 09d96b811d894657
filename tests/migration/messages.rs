//! Anthropic Messages streams move too (docs/migration.md "Anthropic Messages
//! streams"): the gateway sends a movable `/v1/messages` stream to its worker as the chat request
//! vLLM builds from it and turns the chat events back into Anthropic events. The unmoved stream
//! is the worker's own `/v1/messages` stream (the message id aside, which both make from the
//! request id), and a stream moved by the admin or by its worker's death is the unmoved one:
//! byte for byte on vllm-sim; on real vLLM, whose events group tokens as its engine's timing
//! has them (two direct runs differ there too), the same message, blocks and text, stop reason
//! and usage ([`essence`]). Streams that cannot be translated exactly, or whose chat form could
//! not move, go to `/v1/messages` untranslated and say why; so does every Messages stream with
//! migration off.

use super::{bookings_are_zero, pair, sim};
use futures_util::StreamExt;
use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::target::unique_text;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The events of an Anthropic stream (`event: <type>` + `data: <json>`), each checked to name
/// its own type.
pub(super) fn events(raw: &str) -> Vec<Value> {
    raw.split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|b| {
            let (name, data) = b.split_once('\n').unwrap_or_else(|| panic!("an event without data: {b:?}"));
            let v: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap_or_else(|| panic!("{b:?}"))).unwrap();
            assert_eq!(name.strip_prefix("event: "), v["type"].as_str(), "{b}");
            v
        })
        .collect()
}

/// `raw` with its message id (made from the request id) written as `ID`, checked to be a whole
/// Anthropic stream: one `message_start` first, one `message_stop` last.
fn normalised(raw: &str) -> String {
    let ev = events(raw);
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap_or_default()).collect();
    assert_eq!((kinds.first(), kinds.last()), (Some(&"message_start"), Some(&"message_stop")), "{raw}");
    assert_eq!(kinds.iter().filter(|k| **k == "message_start").count(), 1, "{raw}");
    let id = ev[0]["message"]["id"].as_str().expect("a message id");
    raw.replace(&format!("\"{id}\""), "\"ID\"")
}

/// What an Anthropic client reassembles from a stream: the message it starts (id written as
/// `ID`), each content block's start and its deltas joined, the message's delta and usage, and
/// that it stopped.
pub(super) fn essence(raw: &str) -> Value {
    let mut out = json!({"blocks": [], "stopped": false});
    for e in events(&normalised(raw)) {
        match e["type"].as_str().unwrap_or_default() {
            "message_start" => out["message"] = e["message"].clone(),
            "content_block_start" => out["blocks"].as_array_mut().unwrap().push(json!({"start": e["content_block"], "text": ""})),
            "content_block_delta" => {
                let block = &mut out["blocks"][e["index"].as_u64().unwrap() as usize];
                let piece = ["text", "thinking", "partial_json"].iter().find_map(|k| e["delta"][k].as_str()).unwrap_or_default();
                block["text"] = json!(format!("{}{piece}", block["text"].as_str().unwrap()));
            }
            "message_delta" => out["end"] = json!({"delta": e["delta"], "usage": e["usage"]}),
            "message_stop" => out["stopped"] = json!(true),
            _ => out["other"] = e,
        }
    }
    out
}

/// Asserts that two streams are the same: byte for byte (the message id aside) when `exact`,
/// else in their [`essence`]; shows the first events where they differ.
fn same_stream(got: &str, want: &str, exact: bool, what: &str) {
    if exact {
        same(&normalised(got), &normalised(want), what);
    } else {
        assert_eq!(essence(got), essence(want), "{what}");
    }
}

/// Asserts two streams are byte for byte equal, showing the first events where they differ.
fn same(got: &str, want: &str, what: &str) {
    if got == want {
        return;
    }
    let (g, w): (Vec<&str>, Vec<&str>) = (got.split("\n\n").collect(), want.split("\n\n").collect());
    let at = g.iter().zip(&w).position(|(a, b)| a != b).unwrap_or(g.len().min(w.len()));
    let near = |v: &[&str]| v[at.saturating_sub(1)..(at + 3).min(v.len())].join("\n\n");
    panic!("{what}: event {at} of {} / {} differs\n got: {}\nwant: {}", g.len(), w.len(), near(&g), near(&w));
}

fn request(model: &str, max: u64) -> Value {
    json!({"model": model, "max_tokens": max, "temperature": 0, "stream": true, "system": [{"type": "text", "text": "You answer briefly."}],
           "messages": [{"role": "user", "content": unique_text(30)}, {"role": "assistant", "content": [{"type": "text", "text": "Sure."}]},
                        {"role": "user", "content": [{"type": "text", "text": unique_text(10)}]}]})
}

/// Streams `body` to `url` as request `id`; after `after` events, `then` runs once (a move
/// order, a crash) with the worker serving it (`x-kvgate-worker`). Returns the raw stream.
pub(super) async fn stream<F, Fut>(http: &reqwest::Client, url: &str, body: &Value, id: &str, after: usize, then: F) -> String
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let r = http.post(url).header("x-request-id", id).json(body).send().await.expect("sent");
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("content-type").and_then(|v| v.to_str().ok()).is_some_and(|t| t.starts_with("text/event-stream")));
    let serving = r.headers().get("x-kvgate-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let (mut raw, mut then, mut s) = (Vec::new(), Some(then), r.bytes_stream());
    while let Some(chunk) = s.next().await {
        raw.extend_from_slice(&chunk.expect("the stream is never cut"));
        if raw.windows(2).filter(|w| w == b"\n\n").count() >= after
            && let Some(f) = then.take()
        {
            f(serving.clone()).await;
        }
    }
    String::from_utf8(raw).unwrap()
}

pub(super) async fn nothing(_: String) {}

/// What the gateway recorded for request `id`, once it is finished.
pub(super) async fn record(c: &Cluster, id: &str) -> Value {
    let finished = || async {
        let v: Value = c.http.get(c.admin(&format!("/requests/{id}"))).send().await.ok()?.json().await.ok()?;
        (v["status"] == 200).then_some(v)
    };
    wait_until(Duration::from_secs(3), || async { finished().await.is_some() }).await.expect("recorded as finished");
    finished().await.unwrap()
}

#[tokio::test]
async fn a_messages_stream_moved_by_the_admin_is_the_workers_own_stream() {
    let (c, real) = pair(GatewayOpts::default()).await;
    let (model, max) = if real { (std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()), 480) } else { ("sim-model".into(), 48) };
    let worker = match std::env::var("KVGATE_TARGET_URL") {
        Ok(u) if real => u,
        _ => c.sims[0].url(),
    };
    let body = request(&model, max);
    let direct = stream(&c.http, &format!("{}/v1/messages", worker.trim_end_matches('/')), &body, "msg-direct", 0, nothing).await;
    let unmoved = stream(&c.http, &c.url("/v1/messages"), &body, "msg-ref", 0, nothing).await;
    same_stream(&unmoved, &direct, !real, "through the gateway vs the worker's own /v1/messages");
    assert!(record(&c, "msg-ref").await["pinned"].is_null(), "a plain Messages stream may move");
    let answer = Arc::new(parking_lot::Mutex::new(None));
    let order = |_serving: String| {
        let (http, url, answer) = (c.http.clone(), c.admin("/migrate"), answer.clone());
        async move {
            let r = http.post(url).json(&json!({"request_id": "msg-mv"})).send().await.unwrap();
            *answer.lock() = Some((r.status().as_u16(), r.json::<Value>().await.unwrap()));
        }
    };
    // After message_start, content_block_start and four deltas.
    let moved = stream(&c.http, &c.url("/v1/messages"), &body, "msg-mv", 6, order).await;
    let (status, report) = answer.lock().clone().expect("the move was ordered");
    assert_eq!((status, report["how"].as_str()), (200, Some("continuation")), "{report}");
    assert_ne!(report["from"], report["to"]);
    assert!(report["generated"].as_u64().is_some_and(|g| g >= 1), "moved mid-way: {report}");
    same_stream(&moved, &unmoved, !real, "moved vs unmoved");
    assert_eq!(record(&c, "msg-mv").await["moves"], 1);
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_messages_stream_whose_worker_dies_is_the_unmoved_stream() {
    let c = Cluster::sims(2, sim(1.0), GatewayOpts::default()).await;
    let body = request("sim-model", 60);
    let unmoved = stream(&c.http, &c.url("/v1/messages"), &body, "ref", 0, nothing).await;
    let crash = |serving: String| {
        let victim = c.sims.iter().position(|s| s.url().trim_end_matches('/') == serving.trim_end_matches('/')).expect("a known worker");
        c.sims[victim].crash();
        async {}
    };
    let failed_over = stream(&c.http, &c.url("/v1/messages"), &body, "killed", 8, crash).await;
    same(&normalised(&failed_over), &normalised(&unmoved), "failed over vs unmoved");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_migrations_total", &[("reason", "failover"), ("outcome", "ok")]), 1.0);
    bookings_are_zero(&c).await;
}

#[tokio::test]
async fn a_messages_error_answer_is_the_workers_own() {
    // Longer than the worker's context: its chat endpoint refuses it, and the client gets what
    // its /v1/messages would have answered.
    let (c, real) = pair(GatewayOpts::default()).await;
    let (model, worker) = match std::env::var("KVGATE_TARGET_URL") {
        Ok(u) if real => (std::env::var("KVGATE_TARGET_MODEL").unwrap_or_else(|_| "tiny".into()), u),
        _ => ("sim-model".into(), c.sims[0].url()),
    };
    let body = request(&model, 5000);
    let answer = |url: String| {
        let (http, body) = (c.http.clone(), body.clone());
        async move {
            let r = http.post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (direct, through) = (answer(format!("{}/v1/messages", worker.trim_end_matches('/'))).await, answer(c.url("/v1/messages")).await);
    assert_eq!(through, direct);
    assert_eq!(direct.0, 400, "{direct:?}");
    let v: Value = serde_json::from_str(&through.1).unwrap();
    assert_eq!(v["type"], "error", "{v}");
}

/// One request a worker received: its target and body.
type Received = Arc<parking_lot::Mutex<Vec<(String, Value)>>>;

/// A worker that notes every POST it gets and answers it with a short stream in the shape its
/// path asks for (a chat stream with token ids, or an Anthropic one), and every GET with 200.
async fn noting_worker() -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received: Received = Arc::default();
    let noted = received.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            tokio::spawn(serve(conn, noted.clone()));
        }
    });
    (url, received)
}

async fn serve(mut conn: tokio::net::TcpStream, noted: Received) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            let mut more = [0u8; 4096];
            match conn.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&more[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let len = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap())).unwrap_or(0);
        while buf.len() < end + 4 + len {
            let mut more = [0u8; 4096];
            match conn.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&more[..n]),
            }
        }
        let body: Vec<u8> = buf.drain(..end + 4 + len).skip(end + 4).collect();
        let mut words = head.split_whitespace();
        let (method, target) = (words.next().unwrap_or_default().to_string(), words.next().unwrap_or_default().to_string());
        let (ctype, answer) = if method != "POST" {
            ("application/json", r#"{"object":"list","data":[]}"#.to_string())
        } else {
            noted.lock().push((target.clone(), serde_json::from_slice(&body).unwrap_or(Value::Null)));
            ("text/event-stream", canned(&target))
        };
        let reply = format!("HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n\r\n{answer}", answer.len());
        if conn.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The stream a noting worker answers on `target`.
fn canned(target: &str) -> String {
    if target == "/v1/chat/completions" {
        let first = json!({"id": "chatcmpl-x", "model": "m", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 0}});
        let token = json!({"id": "chatcmpl-x", "model": "m", "choices": [{"index": 0, "delta": {"content": "ok"}, "token_ids": [7], "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 1}});
        let usage = json!({"id": "chatcmpl-x", "model": "m", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}});
        return format!("data: {first}\n\ndata: {token}\n\ndata: {usage}\n\ndata: [DONE]\n\n");
    }
    let start = json!({"type": "message_start", "message": {"id": "chatcmpl-x", "type": "message", "role": "assistant", "content": [], "model": "m",
                       "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 2, "output_tokens": 0}}});
    format!("event: message_start\ndata: {start}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n")
}

#[tokio::test]
async fn messages_streams_that_cannot_move_go_untranslated_and_say_why() {
    // The Anthropic SDK's beta features ask with `?beta=true`: an untranslated request keeps it.
    const ASKED: &str = "/v1/messages?beta=true";
    const CHAT: &str = "/v1/chat/completions";
    let cases = [
        // Sent as chat: the request vLLM's /v1/messages builds, asking for token ids.
        ("", json!({}), CHAT, None),
        ("", json!({"stop_sequences": ["\n\n"]}), ASKED, Some("stop_strings")),
        ("", json!({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}), ASKED, Some("tools")),
        ("", json!({"thinking": {"type": "disabled"}}), ASKED, Some("server_template")),
        ("", json!({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}), ASKED, Some("server_template")),
        (
            "",
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
            ASKED,
            Some("multimodal"),
        ),
        ("migration:\n  limit: 0\n", json!({}), ASKED, None),
    ];
    for (i, (extra, overrides, path, pinned)) in cases.into_iter().enumerate() {
        let (url, received) = noting_worker().await;
        let c = Cluster::front(&[url], GatewayOpts { model: "m".into(), extra: extra.into(), ..GatewayOpts::default() }).await;
        let mut body = json!({"model": "m", "max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(overrides.as_object().unwrap().clone());
        let id = format!("case-{i}");
        let raw = stream(&c.http, &c.url(ASKED), &body, &id, 0, nothing).await;
        let got = received.lock().clone();
        assert_eq!(got.len(), 1, "case {i}: {got:?}");
        assert_eq!(got[0].0, path, "case {i}");
        if path == ASKED {
            assert_eq!(got[0].1, body, "case {i}: the client's body, untouched");
        } else {
            assert_eq!(got[0].1["return_token_ids"], true, "{}", got[0].1);
            assert_eq!(got[0].1["messages"], json!([{"role": "user", "content": "hi"}]));
            assert_eq!(events(&raw)[2]["delta"], json!({"type": "text_delta", "text": "ok"}), "{raw}");
        }
        assert!(raw.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"), "case {i}: {raw}");
        assert_eq!(record(&c, &id).await["pinned"].as_str(), pinned, "case {i}");
    }
}
