use super::*;
use crate::migrate::events::typed_events as events;

/// Real vLLM 0.32 (the tiny test model, greedy): a chat stream asked as vLLM's `/v1/messages`
/// asks it (`stream_options` with continuous usage; token ids stripped, as the gateway strips
/// them), and that server's own `/v1/messages` stream for the same Messages request. Both were
/// sent with one `X-Request-Id`, which vLLM makes both ids from.
const VLLM_CHAT: &str = include_str!("vllm_chat.sse");
const VLLM_MESSAGES: &str = include_str!("vllm_messages.sse");

fn convert(chat: &str) -> String {
    String::from_utf8(MessagesStream::default().feed(chat.as_bytes())).unwrap()
}

fn chunk(delta: &Value, finish: Option<&str>) -> String {
    format!("data: {}\n\n", json!({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
}

const START: &str = "data: {\"id\":\"chatcmpl-1\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":0}}\n\n";

fn end(completion: u64) -> String {
    format!(
        "data: {}\n\ndata: [DONE]\n\n",
        json!({"id": "chatcmpl-1", "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": completion}})
    )
}

#[test]
fn a_vllm_chat_stream_becomes_vllms_own_messages_stream_byte_for_byte() {
    assert_eq!(convert(VLLM_CHAT), VLLM_MESSAGES);
    // Cut anywhere, the same bytes come out.
    for cut in [1, 7, 100, 333, 1000] {
        let mut s = MessagesStream::default();
        let (a, b) = VLLM_CHAT.as_bytes().split_at(cut.min(VLLM_CHAT.len()));
        let out = [s.feed(a), s.feed(b)].concat();
        assert_eq!(String::from_utf8(out).unwrap(), VLLM_MESSAGES, "cut at {cut}");
    }
}

#[test]
fn text_opens_one_block_and_the_stop_reason_follows_the_finish() {
    let stream = [
        START.to_string(),
        chunk(&json!({"content": "Hel"}), None),
        chunk(&json!({"content": ""}), None),
        chunk(&json!({"content": "lo"}), Some("stop")),
        end(3),
    ]
    .concat();
    let ev = events(&convert(&stream));
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    );
    assert_eq!(ev[0]["message"]["usage"], json!({"input_tokens": 5, "output_tokens": 0}));
    assert_eq!(ev[0]["message"]["id"], "chatcmpl-1", "the message id is the chat completion's");
    assert_eq!(ev[3]["delta"], json!({"type": "text_delta", "text": "lo"}));
    assert_eq!(ev[5]["delta"], json!({"stop_reason": "end_turn", "stop_sequence": null}));
    assert_eq!(ev[5]["usage"], json!({"input_tokens": 5, "output_tokens": 3}));
    // A length finish is max_tokens; a matched stop string is a stop sequence.
    let length = [START.to_string(), chunk(&json!({"content": "a"}), Some("length")), end(1)].concat();
    assert_eq!(events(&convert(&length))[4]["delta"]["stop_reason"], "max_tokens");
    let stop = format!(
        "{START}data: {}\n\n{}",
        json!({"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop", "stop_reason": "END"}]}),
        end(1)
    );
    assert_eq!(events(&convert(&stop))[1]["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "END"}));
    // An empty answer: no block at all.
    let empty = [START.to_string(), chunk(&json!({"content": ""}), Some("stop")), end(1)].concat();
    let kinds: Vec<String> = events(&convert(&empty)).iter().map(|e| e["type"].as_str().unwrap().to_owned()).collect();
    assert_eq!(kinds, ["message_start", "message_delta", "message_stop"]);
}

#[test]
fn reasoning_is_a_thinking_block_with_a_signature_before_the_text_block() {
    let stream = [
        START.to_string(),
        chunk(&json!({"reasoning": "hm"}), None),
        chunk(&json!({"reasoning": " ok"}), None),
        chunk(&json!({"content": "Yes"}), Some("stop")),
        end(3),
    ]
    .concat();
    let ev = events(&convert(&stream));
    assert_eq!(ev[1], json!({"type": "content_block_start", "content_block": {"type": "thinking", "thinking": ""}, "index": 0}));
    assert_eq!(ev[3]["delta"], json!({"type": "thinking_delta", "thinking": " ok"}));
    assert_eq!(ev[4]["delta"]["type"], "signature_delta");
    assert_eq!(ev[4]["delta"]["signature"].as_str().map(str::len), Some(32));
    assert_eq!(ev[5], json!({"type": "content_block_stop", "index": 0}));
    assert_eq!(ev[6], json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 1}));
    assert_eq!(ev[7], json!({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Yes"}, "index": 1}));
    assert_eq!(ev[8], json!({"type": "content_block_stop", "index": 1}));
}

#[test]
fn tool_calls_open_tool_use_blocks_and_text_inside_them_follows_after() {
    let call =
        |id: Option<&str>, name: Option<&str>, args: &str| json!({"tool_calls": [{"index": 0, "id": id, "function": {"name": name, "arguments": args}}]});
    let stream = [
        START.to_string(),
        chunk(&json!({"content": "Let me look."}), None),
        chunk(&call(Some("call_1"), Some("get"), "{\"q\":"), None),
        chunk(&json!({"content": "aside"}), None),
        chunk(&call(None, None, " 1}"), Some("tool_calls")),
        end(4),
    ]
    .concat();
    let ev = events(&convert(&stream));
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(ev[4]["content_block"], json!({"type": "tool_use", "id": "call_1", "name": "get", "input": {}}));
    assert_eq!((ev[5]["delta"]["partial_json"].as_str(), ev[6]["delta"]["partial_json"].as_str()), (Some("{\"q\":"), Some(" 1}")));
    assert_eq!((ev[8]["index"].as_u64(), ev[9]["delta"]["text"].as_str()), (Some(2), Some("aside")), "held text follows the tool call");
    assert_eq!(ev[11]["delta"]["stop_reason"], "tool_use");
}

#[test]
fn an_error_event_ends_the_stream() {
    let stream =
        format!("{START}{}data: {{\"error\":{{\"message\":\"engine dead\",\"code\":500}}}}\n\ndata: [DONE]\n\n", chunk(&json!({"content": "a"}), None));
    let mut s = MessagesStream::default();
    let out = String::from_utf8(s.feed(stream.as_bytes())).unwrap();
    let ev = events(&out);
    assert_eq!(ev.last().unwrap(), &json!({"type": "error", "error": {"type": "internal_error", "message": "engine dead"}}));
    assert!(s.failed());
    assert!(s.feed(b"data: [DONE]\n\n").is_empty(), "nothing after the error");
}

#[test]
fn usage_counts_cached_tokens_as_anthropic_does() {
    let u: Usage = serde_json::from_value(json!({"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}})).unwrap();
    assert_eq!(usage(Some(&u)).to_string(), r#"{"input_tokens":36,"output_tokens":7,"cache_read_input_tokens":64}"#);
    let u: Usage = serde_json::from_value(
        json!({"prompt_tokens": 10, "completion_tokens": null, "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 8}}),
    )
    .unwrap();
    assert_eq!(usage(Some(&u)).to_string(), r#"{"input_tokens":0,"output_tokens":0,"cache_creation_input_tokens":8,"cache_read_input_tokens":4}"#);
    assert_eq!(usage(None), json!({"input_tokens": 0, "output_tokens": 0}));
}

#[test]
fn error_bodies_take_the_anthropic_shape() {
    let chat = br#"{"error":{"message":"This model's maximum context length is 2048 tokens.","type":"BadRequestError","param":null,"code":400}}"#;
    assert_eq!(
        String::from_utf8(error_body(chat).unwrap()).unwrap(),
        r#"{"type":"error","error":{"type":"BadRequestError","message":"This model's maximum context length is 2048 tokens."}}"#
    );
    assert_eq!(error_body(b"Internal Server Error"), None);
    assert_eq!(error_body(br#"{"detail":"x"}"#), None);
}

#[test]
fn a_reply_converts_streams_and_reshapes_error_answers_at_their_end() {
    let mut r = MessagesReply::default();
    assert!(String::from_utf8(r.answer(START.as_bytes(), false)).unwrap().starts_with("event: message_start\n"));
    let mut r = MessagesReply::default();
    r.error_status();
    let body = br#"{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#;
    let (a, b) = body.split_at(10);
    assert!(r.answer(a, false).is_empty(), "held until the end");
    assert_eq!(r.answer(b, true), br#"{"type":"error","error":{"type":"BadRequestError","message":"bad"}}"#);
    let mut r = MessagesReply::default();
    r.error_status();
    assert_eq!(r.answer(b"Internal Server Error", true), b"Internal Server Error", "not an error body: unchanged");
    let mut r = MessagesReply::default();
    r.error_status();
    let big = vec![b'x'; MAX_ERROR_BODY + 1];
    assert_eq!(r.answer(&big, false), big, "too long to gather: passed on");
    assert_eq!(r.answer(b"y", true), b"y");
}
