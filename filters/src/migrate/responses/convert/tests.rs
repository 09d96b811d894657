use super::*;
use crate::migrate::events::strip_token_ids;
use crate::migrate::events::typed_events as events;
use std::fmt::Write as _;

/// Real vLLM 0.32 (the tiny test model on CPU, `tests/real-vllm/run.sh` with
/// `--enable-prompt-tokens-details` and the fixtures' `template.jinja`): for each request of
/// `requests.json` (`stream`), its `/v1/responses` stream and the `/v1/chat/completions` stream of
/// its translation with `return_token_ids` (as the gateway sends it), captured by `capture.py`
/// after a prefix-cache reset each, until both cut the text alike (see the module doc on delta
/// grouping); `cached`: the `multi_turn` request again with its prompt cached; `no_details`: the
/// `multi_turn` request on a server without `--enable-prompt-tokens-details` and with the
/// model's own template.
const REQUESTS: &str = include_str!("../../../../tests/fixtures/responses/requests.json");

fn fixture(name: &str) -> (Value, String, String) {
    let all: Value = serde_json::from_str(REQUESTS).unwrap();
    let request = if name == "cached" || name == "no_details" { "multi_turn" } else { name };
    let case = all["stream"].as_array().unwrap().iter().find(|c| c["name"] == request).unwrap();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/responses");
    let read = |kind: &str| std::fs::read_to_string(format!("{dir}/{name}.{kind}.sse")).unwrap();
    (case["responses"].clone(), read("chat"), read("responses"))
}

const CASES: [&str; 6] = ["short", "instructions_stop", "multi_turn", "empty", "defaults", "cached"];

/// The tiny model's context length.
fn setup() -> StreamSetup {
    StreamSetup { max_model_len: Some(2048), ..StreamSetup::default() }
}

fn convert(request: &Value, chat: &str) -> String {
    String::from_utf8(ResponsesStream::new(request, setup()).feed(chat.as_bytes())).unwrap()
}

/// A Responses stream with what vLLM randomises or stamps replaced: item ids (`"msg_…"`,
/// `"rs_…"`, numbered in order of appearance) and the digits of `created_at`.
fn normalized(stream: &str) -> String {
    let mut ids: Vec<&str> = Vec::new();
    let mut out = String::with_capacity(stream.len());
    let mut i = 0;
    while i < stream.len() {
        let rest = &stream[i..];
        let prefix = ["\"msg_", "\"rs_", "\"created_at\":"].into_iter().find(|p| rest.starts_with(p));
        match prefix {
            Some(p) if p.starts_with("\"created") => {
                out.push_str(p);
                out.push('T');
                i += p.len() + rest[p.len()..].find(|c: char| !c.is_ascii_digit()).unwrap();
            }
            Some(p) => {
                let end = 1 + rest[1..].find('"').unwrap();
                let id = &rest[1..end];
                let n = ids.iter().position(|x| *x == id).unwrap_or_else(|| {
                    ids.push(id);
                    ids.len() - 1
                });
                let _ = write!(out, "\"{}ITEM{n}", &p[1..]);
                i += end;
            }
            None => {
                let c = rest.chars().next().unwrap();
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
    out
}

fn kinds(stream: &str) -> Vec<String> {
    events(stream).iter().map(|e| e["type"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn real_vllm_chat_streams_become_vllms_own_responses_streams() {
    for name in CASES {
        let (request, chat, responses) = fixture(name);
        let ours = convert(&request, &chat);
        assert_eq!(normalized(&ours), normalized(&responses), "{name}");
        // The time is the chat stream's own.
        let first: Value = serde_json::from_str(chat.lines().next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(events(&ours)[0]["response"]["created_at"], first["created"], "{name}");
        // One item id throughout, sequence numbers from 0 up by one.
        let ev = events(&ours);
        for (i, e) in ev.iter().enumerate() {
            assert_eq!(e["sequence_number"], i, "{name}");
        }
        let item_ids: std::collections::BTreeSet<&str> = ev.iter().filter_map(|e| e["item_id"].as_str()).collect();
        assert!(item_ids.len() <= 1 && item_ids.iter().all(|id| id.starts_with("msg_") && id.len() == 20), "{name}: {item_ids:?}");
    }
}

#[test]
fn without_prompt_details_the_cache_counts_are_zero() {
    let (request, chat, responses) = fixture("no_details");
    let ours = normalized(&convert(&request, &chat));
    let theirs = normalized(&responses);
    assert_ne!(ours, theirs);
    assert_eq!(ours, theirs.replace("\"cache_write_tokens\":64", "\"cache_write_tokens\":0"));
}

#[test]
fn events_stripped_of_token_ids_cut_anywhere_or_given_as_values_convert_the_same() {
    for name in CASES {
        let (request, chat, responses) = fixture(name);
        let stripped: String = chat.split_inclusive("\n\n").map(|e| String::from_utf8(strip_token_ids(e.as_bytes())).unwrap()).collect();
        assert!(!stripped.contains("token_ids"));
        assert_eq!(normalized(&convert(&request, &stripped)), normalized(&responses), "{name} stripped");
        for cut in [1, 10, 333, 1000, 2500] {
            let mut s = ResponsesStream::new(&request, setup());
            let (a, b) = stripped.as_bytes().split_at(cut.min(stripped.len()));
            let out = String::from_utf8([s.feed(a), s.feed(b)].concat()).unwrap();
            assert_eq!(normalized(&out), normalized(&responses), "{name} cut at {cut}");
        }
        let mut s = ResponsesStream::new(&request, setup());
        let mut out = Vec::new();
        for data in chat.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
            match data {
                "[DONE]" => out.extend(s.finish()),
                _ => out.extend(s.chunk(&serde_json::from_str(data).unwrap())),
            }
        }
        assert_eq!(normalized(&String::from_utf8(out).unwrap()), normalized(&responses), "{name} as values");
    }
}

/// The chat stream of a request moved after `k` events: the first worker's events (ids
/// stripped), then the continuation's re-wrapped in chat's shape by the gateway (the client's
/// id, model and created; usage counting the original prompt and every generated token).
fn moved(chat: &str, k: usize) -> String {
    let ev: Vec<&str> = chat.split_inclusive("\n\n").collect();
    let mut out = String::new();
    for (i, e) in ev.iter().enumerate() {
        let e = String::from_utf8(strip_token_ids(e.as_bytes())).unwrap();
        if i < k {
            out.push_str(&e);
            continue;
        }
        let Some(data) = e.strip_prefix("data: ").map(str::trim_end).filter(|d| *d != "[DONE]") else {
            out.push_str(&e);
            continue;
        };
        let mut v: Value = serde_json::from_str(data).unwrap();
        // What the continuation worker does not send: a system fingerprint, logprobs members.
        v.as_object_mut().unwrap().remove("system_fingerprint");
        for c in v["choices"].as_array_mut().unwrap() {
            c.as_object_mut().unwrap().remove("logprobs");
        }
        let _ = write!(out, "data: {v}\n\n");
    }
    out
}

#[test]
fn a_moved_stream_continues_ids_and_sequence_numbers_and_completes_once() {
    for name in ["short", "multi_turn", "defaults"] {
        let (request, chat, responses) = fixture(name);
        let n = chat.split_inclusive("\n\n").count();
        for k in [1, 2, n / 2, n - 2] {
            let mut s = ResponsesStream::new(&request, setup());
            let whole = moved(&chat, k);
            let out = String::from_utf8([s.feed(whole.as_bytes()), s.finish(), s.feed(b"data: [DONE]\n\n")].concat()).unwrap();
            assert_eq!(normalized(&out), normalized(&responses), "{name} moved after {k} events");
            assert_eq!(kinds(&out).iter().filter(|k| *k == "response.completed").count(), 1);
            assert!(s.is_completed() && !s.failed());
        }
    }
}

#[test]
fn text_grouped_differently_is_the_same_text_in_other_deltas() {
    let (request, chat, responses) = fixture("defaults");
    // Two chat chunks merged into one, as vLLM's engine merges deltas under load.
    let ev: Vec<Value> = chat.split("\n\n").filter_map(|e| e.strip_prefix("data: {")).map(|d| serde_json::from_str(&format!("{{{d}")).unwrap()).collect();
    let mut merged = Vec::new();
    let mut it = ev.into_iter().peekable();
    while let Some(mut c) = it.next() {
        let has_text = |c: &Value| c["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty());
        if has_text(&c)
            && let Some(next) = it.peek()
            && has_text(next)
            && next["choices"][0]["finish_reason"].is_null()
        {
            let next = it.next().unwrap();
            let text = format!("{}{}", c["choices"][0]["delta"]["content"].as_str().unwrap(), next["choices"][0]["delta"]["content"].as_str().unwrap());
            c["choices"][0]["delta"]["content"] = text.into();
            c["usage"] = next["usage"].clone();
        }
        merged.push(c);
    }
    let mut s = ResponsesStream::new(&request, setup());
    let mut out: Vec<u8> = merged.iter().flat_map(|c| s.chunk(c)).collect();
    out.extend(s.finish());
    let (ours, theirs) = (events(&String::from_utf8(out).unwrap()), events(&responses));
    assert!(ours.len() < theirs.len());
    let done = |ev: &[Value]| ev.iter().find(|e| e["type"] == "response.output_text.done").unwrap()["text"].clone();
    assert_eq!(done(&ours), done(&theirs));
    let last = |ev: &[Value]| ev.last().unwrap()["response"]["usage"].clone();
    assert_eq!(last(&ours), last(&theirs));
}

fn chunk(delta: &Value, finish: Option<&str>) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

fn usage_chunk(prompt: u64, completion: u64, details: &Value) -> Value {
    let mut usage = json!({"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion});
    usage.as_object_mut().unwrap().extend(details.as_object().unwrap().clone());
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": [], "usage": usage})
}

fn run(request: &Value, setup: StreamSetup, chunks: &[Value]) -> Vec<Value> {
    let mut s = ResponsesStream::new(request, setup);
    let mut out: Vec<u8> = chunks.iter().flat_map(|c| s.chunk(c)).collect();
    out.extend(s.finish());
    events(&String::from_utf8(out).unwrap())
}

#[test]
fn reasoning_opens_its_own_item_before_the_message() {
    let first = {
        let mut c = chunk(&json!({"role": "assistant", "content": ""}), None);
        c["usage"] = json!({"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5});
        c
    };
    let chunks = [
        first,
        chunk(&json!({"reasoning": "Let me"}), None),
        chunk(&json!({"reasoning": " think"}), None),
        chunk(&json!({"reasoning": ".", "content": "Hi"}), None),
        chunk(&json!({"content": "!"}), Some("stop")),
        usage_chunk(5, 6, &json!({"completion_tokens_details": {"reasoning_tokens": 3}})),
    ];
    let ev = run(&json!({"input": "x", "stream": true}), StreamSetup::default(), &chunks);
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let rs = ev[2]["item"]["id"].as_str().unwrap();
    assert!(rs.starts_with("rs_") && rs.len() == 19);
    assert_eq!(ev[2]["item"], json!({"id": rs, "summary": [], "type": "reasoning", "content": null, "encrypted_content": null, "status": "in_progress"}));
    assert_eq!(ev[3]["part"], json!({"text": "", "type": "reasoning_text"}));
    assert_eq!(ev[7]["text"], "Let me think.");
    assert_eq!(ev[9]["item"]["content"], json!([{"text": "Let me think.", "type": "reasoning_text"}]));
    assert_eq!((ev[9]["output_index"].as_u64(), ev[10]["output_index"].as_u64()), (Some(0), Some(1)));
    let done = &ev[17]["response"];
    assert_eq!(done["status"], "completed");
    assert_eq!(done["output"].as_array().unwrap().len(), 2);
    assert_eq!(done["output"][1]["content"][0]["text"], "Hi!");
    assert_eq!(done["usage"]["output_tokens_details"]["reasoning_tokens"], 3);
    assert_eq!(done["usage"]["total_tokens"], 11);
    assert_eq!(done["max_output_tokens"], Value::Null, "no context length known");
}

#[test]
fn usage_carries_the_cache_counts_a_worker_reports() {
    let chunks = [
        chunk(&json!({"role": "assistant", "content": ""}), None),
        chunk(&json!({"content": "a"}), Some("length")),
        usage_chunk(100, 1, &json!({"prompt_tokens_details": {"cached_tokens": 64, "created_cache_tokens": 4}})),
    ];
    let ev = run(&json!({"input": "x", "stream": true, "max_output_tokens": 1}), StreamSetup { prompt_tokens: Some(100), ..setup() }, &chunks);
    let done = &ev.last().unwrap()["response"];
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(
        done["usage"]["input_tokens_details"],
        json!({"cached_tokens": 64, "cache_write_tokens": 4, "input_tokens_per_turn": [], "cached_tokens_per_turn": []})
    );
    assert_eq!(done["max_output_tokens"], 1);
}

#[test]
fn the_echo_follows_vllms_sampling_params() {
    let first = |prompt: u64| {
        let mut c = chunk(&json!({"role": "assistant", "content": ""}), None);
        c["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt});
        c
    };
    let created = |request: Value, setup: StreamSetup| {
        let mut s = ResponsesStream::new(&request, setup);
        events(&String::from_utf8(s.chunk(&first(48))).unwrap())[0]["response"].clone()
    };
    // A temperature under 0.01 is raised to it; greedy sampling makes top_p 1.
    let r = created(json!({"temperature": 0.001, "top_p": 0.5, "stream": true}), setup());
    assert_eq!((r["temperature"].as_f64(), r["top_p"].as_f64()), (Some(0.01), Some(0.5)));
    let r = created(json!({"temperature": 0, "top_p": 0.5, "stream": true}), setup());
    assert_eq!((r["temperature"].as_f64(), r["top_p"].as_f64()), (Some(0.0), Some(1.0)));
    // The limit: what remains of the context, the request's within it, the model's default.
    assert_eq!(created(json!({"stream": true}), setup())["max_output_tokens"], 2000);
    assert_eq!(created(json!({"stream": true, "max_output_tokens": 5000}), setup())["max_output_tokens"], 2000);
    let defaults = ModelDefaults { temperature: Some(0.6), top_p: Some(0.95), presence_penalty: Some(0.5), frequency_penalty: None, max_tokens: Some(300) };
    let r = created(json!({"stream": true}), StreamSetup { defaults, ..setup() });
    assert_eq!(
        (r["temperature"].as_f64(), r["top_p"].as_f64(), r["presence_penalty"].as_f64(), r["frequency_penalty"].as_f64(), r["max_output_tokens"].as_u64()),
        (Some(0.6), Some(0.95), Some(0.5), Some(0.0), Some(300))
    );
    let r = created(json!({"stream": true, "max_output_tokens": 700, "temperature": 1}), StreamSetup { defaults, ..setup() });
    assert_eq!((r["temperature"].to_string(), r["max_output_tokens"].as_u64()), ("1.0".to_owned(), Some(700)));
    // Without a request id the response gets vLLM's form of one; the setup's time wins.
    let r = created(json!({"stream": true}), StreamSetup { created_at: Some(42), ..setup() });
    let id = r["id"].as_str().unwrap();
    assert!(id.starts_with("resp_") && id.len() == 21 && id[5..].bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    assert_eq!(r["created_at"], 42);
    assert_eq!(r["model"], "m", "the worker's model name");
    // Echoed as vLLM normalises them.
    let r = created(json!({"stream": true, "text": {"format": {"type": "text"}}, "metadata": {"z": "1", "a": "2"}, "instructions": ""}), setup());
    assert_eq!(r["text"], json!({"format": {"type": "text"}, "verbosity": null}));
    assert_eq!(r["metadata"].to_string(), r#"{"z":"1","a":"2"}"#);
    assert_eq!(r["instructions"], "");
}

#[test]
fn a_worker_error_ends_the_stream_with_an_error_event() {
    let mut s = ResponsesStream::new(&json!({"stream": true}), setup());
    let mut out = s.chunk(&chunk(&json!({"role": "assistant", "content": ""}), None));
    out.extend(s.chunk(&chunk(&json!({"content": "a"}), None)));
    out.extend(s.feed(b"data: {\"error\": {\"message\": \"boom\", \"type\": \"InternalServerError\", \"code\": 500}}\n\n"));
    out.extend(s.feed(b"data: [DONE]\n\n"));
    out.extend(s.finish());
    let ev = events(&String::from_utf8(out).unwrap());
    let last = ev.last().unwrap();
    assert_eq!(last, &json!({"code": null, "message": "boom", "param": null, "sequence_number": 5, "type": "error"}));
    assert!(s.failed() && !s.is_completed());
    assert_eq!(s.next_sequence_number(), 6);
}

#[test]
fn an_end_without_any_chunk_still_completes_the_response() {
    let mut s = ResponsesStream::new(&json!({"stream": true, "model": "tiny", "request_id": "resp_x"}), setup());
    let ev = events(&String::from_utf8(s.finish()).unwrap());
    assert_eq!(ev.iter().map(|e| e["type"].as_str().unwrap()).collect::<Vec<_>>(), ["response.created", "response.in_progress", "response.completed"]);
    assert_eq!(ev[2]["response"]["id"], "resp_x");
    assert_eq!(ev[2]["response"]["output"], json!([]));
    assert!(s.finish().is_empty() && s.chunk(&chunk(&json!({"content": "late"}), None)).is_empty());
}
