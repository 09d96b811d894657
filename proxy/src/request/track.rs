//! Following a movable stream event by event, so it can continue on another worker
//! (docs/migration.md). The source worker was asked for token ids (`return_token_ids`); the
//! tracker keeps what a continuation needs (`StreamRecord`), strips the ids the client did not
//! ask for, notices an error the worker reports inside the stream, and after a move re-wraps
//! the destination's completion events in the client's shape. Only whole events are passed on,
//! so what the client saw and what the record holds never disagree.
//!
//! An Anthropic Messages stream is followed as the chat stream vLLM itself makes of it: its
//! worker gets the chat request vLLM's `/v1/messages` builds ([`follow`]), and the relay turns
//! the chat events back into Anthropic ones (`MessagesReply`). An OpenAI Responses stream that
//! the worker would not store is followed the same way: its worker gets the chat request that
//! renders and samples as the Responses request (`dialect::responses::stream::to_chat`, its
//! refusals told as pin reasons), and the relay makes vLLM's Responses events of the chat
//! events (`ResponsesStream`).

use crate::endpoint::Endpoint;
use bytes::{Bytes, BytesMut};
use kvgate_filters::migrate::anthropic::MessagesReply;
use kvgate_filters::migrate::events::{self, EventSplitter};
use kvgate_filters::migrate::reply::Reply;
use kvgate_filters::migrate::responses::{ResponsesStream, StreamSetup};
use kvgate_filters::migrate::{ClientShape, PinReason, StreamRecord, messages_pin_reason, pin_reason};
use kvgate_tokenize::dialect::messages::{self, MessagesOptions};
use kvgate_tokenize::dialect::responses::stream::{self as responses_stream, Refusal, ServerFacts};
use serde_json::Value;
use std::fmt::Write as _;

/// A stream followed from admission on.
#[derive(Debug)]
pub struct Followed {
    /// Its tracker.
    pub tracker: Tracker,
    /// The body its worker gets.
    pub body: Bytes,
    /// For a request sent in another API than the client's: the path it goes to, and the
    /// converter of its answer back into the client's API.
    pub translated: Option<(&'static str, Reply)>,
}

/// What admission knows of the model that decides how a Responses stream is followed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelFacts {
    /// The model is, or may be, a Harmony model (gpt-oss).
    pub harmony: bool,
    /// The workers' context length, when known (the echoed `max_output_tokens` is bounded by
    /// what the prompt leaves of it).
    pub max_model_len: Option<u32>,
}

/// At admission: how a stream of `endpoint` that may move is followed (`parsed`: its body,
/// parsed), or why it may not move. A Messages or Responses stream is sent as chat, unless it
/// cannot be translated exactly or its chat form could not move either: it then goes as it is,
/// pinned.
pub fn follow(endpoint: Endpoint, body: &Bytes, parsed: &Value, model: ModelFacts) -> Result<Followed, PinReason> {
    let (chat, reply) = match endpoint {
        Endpoint::Messages => (messages_as_chat(parsed)?, Reply::Messages(MessagesReply::default())),
        Endpoint::Responses => {
            // Whether the workers keep a response store is theirs to know: a response that may
            // be stored is made by its worker.
            let chat = responses_stream::to_chat(parsed, ServerFacts { harmony: model.harmony, store_enabled: true }).map_err(responses_pin_reason)?;
            let setup = StreamSetup { max_model_len: model.max_model_len.map(u64::from), ..StreamSetup::default() };
            (chat, Reply::Responses(Box::new(ResponsesStream::new(parsed, setup))))
        }
        _ => {
            let (tracker, body) = start(endpoint == Endpoint::Chat, body, parsed)?;
            return Ok(Followed { tracker, body, translated: None });
        }
    };
    let (tracker, body) = start(true, &Bytes::from(chat.to_string()), &chat)?;
    Ok(Followed { tracker, body, translated: Some(("/v1/chat/completions", reply)) })
}

/// The chat request vLLM's `/v1/messages` builds from the Messages request `body` (streaming
/// options included), when the gateway can build it exactly: not when vLLM decides part of it
/// from its chat template, nor for images (they need the model's processor, and a continuation
/// could not carry them), nor for a request the translation refuses.
fn messages_as_chat(body: &Value) -> Result<Value, PinReason> {
    if let Some(reason) = messages_pin_reason(body) {
        return Err(reason);
    }
    // The options are vLLM's template-dependent choices, which the request does not reach.
    messages::to_chat(body, &MessagesOptions::default()).map_err(|e| if e.reason() == "image" { PinReason::Multimodal } else { PinReason::Untranslatable })
}

/// Why a Responses stream that is not translated (`refusal`) stays on its worker.
fn responses_pin_reason(refusal: Refusal) -> PinReason {
    match refusal {
        Refusal::Unary => PinReason::Unary,
        Refusal::Harmony => PinReason::Harmony,
        Refusal::PreviousResponse | Refusal::Store | Refusal::Background => PinReason::Stored,
        Refusal::Tools => PinReason::Tools,
        Refusal::Reasoning => PinReason::ServerParsed,
        Refusal::StructuredOutput => PinReason::StructuredOutput,
        Refusal::Logprobs => PinReason::Logprobs,
        Refusal::Multimodal => PinReason::Multimodal,
        Refusal::ResponseMessages | Refusal::KvTransfer | Refusal::Invalid | Refusal::Untranslatable => PinReason::Untranslatable,
    }
}

/// At admission: a tracker for a stream that may move, and the body to send its worker (the
/// client's, asking for token ids); or why it may not move.
pub fn start(chat: bool, body: &Bytes, parsed: &Value) -> Result<(Tracker, Bytes), PinReason> {
    if let Some(reason) = pin_reason(chat, parsed) {
        return Err(reason);
    }
    let asked = parsed.get("return_token_ids").and_then(Value::as_bool);
    let shape = if chat { ClientShape::Chat } else { ClientShape::Completion };
    let tracker = Tracker::new(shape, asked == Some(true));
    if asked == Some(true) {
        return Ok((tracker, body.clone()));
    }
    // Appended last so it wins over a `false` the client sent (the last duplicate key wins in
    // the server's JSON parser). The body parsed as an object, so it ends with `}`.
    let end = body.iter().rposition(|&b| b == b'}').ok_or(PinReason::NoTokenIds)?;
    let empty = body[..end].iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let mut out = BytesMut::with_capacity(body.len() + 26);
    out.extend_from_slice(&body[..end]);
    out.extend_from_slice(if empty { &b"\"return_token_ids\":true}"[..] } else { &b",\"return_token_ids\":true}"[..] });
    Ok((tracker, out.freeze()))
}

/// Which worker's events are being followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The worker the request was placed on: its events go out in their own shape.
    Source,
    /// A continuation: `/v1/completions` events re-wrapped in the client's shape.
    Continuation,
    /// No longer movable: events pass, ids stripped when `strip`.
    Pinned { strip: bool },
}

/// What one body chunk gave.
#[derive(Debug, Default)]
pub struct Fed {
    /// Bytes for the client (possibly empty: an event is still incomplete).
    pub out: Bytes,
    /// The worker reported an error in the stream: the leg failed (nothing after it was kept).
    pub failure: Option<String>,
    /// The stream just turned out not to be movable.
    pub pinned: Option<PinReason>,
}

/// A movable stream's follower.
#[derive(Debug)]
pub struct Tracker {
    /// What the stream has produced so far.
    pub record: StreamRecord,
    /// The client's shape.
    pub shape: ClientShape,
    /// The client asked for token ids itself: they are passed on.
    pub keep_ids: bool,
    splitter: EventSplitter,
    mode: Mode,
    done: bool,
    /// The error event a failing worker sent, held back while the stream may still move.
    withheld: Option<Bytes>,
}

impl Tracker {
    /// A tracker for a stream the client asked in `shape`.
    pub fn new(shape: ClientShape, keep_ids: bool) -> Self {
        Self { record: StreamRecord::default(), shape, keep_ids, splitter: EventSplitter::default(), mode: Mode::Source, done: false, withheld: None }
    }

    /// Whether the stream's `[DONE]` went out.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Whether it may still move.
    pub fn movable(&self) -> bool {
        !matches!(self.mode, Mode::Pinned { .. })
    }

    /// The next events come from a continuation. An unfinished event of the old worker is
    /// dropped: the client never saw it, and the continuation regenerates its tokens.
    pub fn continuing(&mut self) {
        self.splitter.take_rest();
        self.mode = Mode::Continuation;
    }

    /// Whether chunks now pass as they come (pinned, with nothing to strip): the caller may
    /// then hand them on without feeding them.
    pub fn passes_through(&self) -> bool {
        self.mode == (Mode::Pinned { strip: false })
    }

    /// Follows one body chunk.
    pub fn feed(&mut self, chunk: &[u8]) -> Fed {
        if self.passes_through() {
            return Fed { out: Bytes::copy_from_slice(chunk), ..Fed::default() };
        }
        let mut fed = Fed::default();
        if self.splitter.push(chunk).is_err() {
            fed.failure = Some("the worker sent an oversized event".into());
            return fed;
        }
        let mut out = BytesMut::new();
        while let Some(ev) = self.splitter.next_event() {
            if let Err(failure) = self.event(&ev, &mut out, &mut fed) {
                fed.failure = Some(failure);
                self.withheld = Some(ev);
                break;
            }
        }
        // Pinned without stripping, later chunks pass as they come: what is left of an
        // unfinished event goes first, so nothing is lost or reordered.
        if self.mode == (Mode::Pinned { strip: false }) {
            out.extend_from_slice(&self.splitter.take_rest());
        }
        fed.out = out.freeze();
        fed
    }

    /// The end of the worker's body: whatever is left goes out as it is.
    pub fn finish(&mut self) -> Bytes {
        self.splitter.take_rest()
    }

    /// One whole event into `out`; `Err` when the worker reported an error.
    fn event(&mut self, ev: &[u8], out: &mut BytesMut, fed: &mut Fed) -> Result<(), String> {
        let json = match events::payload(ev) {
            Some(p) if !events::is_done(ev) => p,
            // `[DONE]`, comments and anything that is not a data event pass unchanged.
            _ => {
                self.done |= events::is_done(ev);
                out.extend_from_slice(ev);
                return Ok(());
            }
        };
        match self.mode {
            Mode::Pinned { strip } => Self::pass(ev, strip, out),
            Mode::Source => return self.observe(ev, json, out, fed),
            Mode::Continuation => match self.record.continue_event(json, self.shape, self.keep_ids) {
                Ok((seen, _)) if seen.error.is_some() => return Err(seen.error.unwrap_or_default()),
                Ok((_, v)) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(v.to_string().as_bytes());
                    out.extend_from_slice(b"\n\n");
                }
                Err(e) => return Err(format!("unreadable continuation event: {e}")),
            },
        }
        Ok(())
    }

    /// One event of the source worker: noted in the record, and passed on without the ids the
    /// client did not ask for. Those are read as they are stripped (a first event carries the
    /// whole prompt's), unless the event is one a JSON parser must read whole.
    fn observe(&mut self, ev: &[u8], json: &[u8], out: &mut BytesMut, fed: &mut Fed) -> Result<(), String> {
        let read = if self.keep_ids { None } else { events::strip_and_read_ids(ev) };
        // What is left failing to parse (a form the strip does not expect) leaves the record
        // untouched: the whole event is parsed instead.
        let (stripped, seen) = match read.and_then(|(rest, ids)| Some((self.record.observe_read(events::payload(&rest)?, ids).ok()?, rest))) {
            Some((seen, rest)) => (Some(rest), Ok(seen)),
            None => (None, self.record.observe(json)),
        };
        match seen {
            Ok(seen) if seen.error.is_some() => return Err(seen.error.unwrap_or_default()),
            Ok(seen) => {
                if let Some(reason) = seen.pin {
                    self.pin(reason);
                    fed.pinned = Some(reason);
                }
            }
            Err(_) => {
                // Not the JSON we know: it cannot be followed, so the stream stays put.
                self.pin(PinReason::NoTokenIds);
                fed.pinned = Some(PinReason::NoTokenIds);
            }
        }
        match stripped {
            Some(rest) => out.extend_from_slice(&rest),
            None => Self::pass(ev, !self.keep_ids, out),
        }
        Ok(())
    }

    fn pin(&mut self, reason: PinReason) {
        // Without ids from the worker there is nothing to strip.
        self.mode = Mode::Pinned { strip: !self.keep_ids && reason != PinReason::NoTokenIds };
    }

    fn pass(ev: &[u8], strip: bool, out: &mut BytesMut) {
        if strip {
            out.extend_from_slice(&events::strip_token_ids(ev));
        } else {
            out.extend_from_slice(ev);
        }
    }

    /// The error event the failing worker sent, for the client when the stream cannot move.
    pub fn take_withheld(&mut self) -> Option<Bytes> {
        self.withheld.take()
    }

    /// The end of a stream whose tokens were all generated when its worker failed: the usage
    /// event (if the client asked for it and it was not sent yet) and `[DONE]` (nothing once
    /// `[DONE]` went out).
    pub fn synthetic_end(&self, include_usage: bool) -> Bytes {
        if self.done {
            return Bytes::new();
        }
        let mut out = String::new();
        if include_usage && !self.record.usage_seen {
            let _ = write!(out, "data: {}\n\n", self.record.usage_event(self.shape));
        }
        out.push_str("data: [DONE]\n\n");
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn admission_asks_for_ids_unless_the_client_did_and_pins_what_cannot_move() {
        let body = Bytes::from_static(b"{\"prompt\":\"hi\",\"stream\":true,\"return_token_ids\":false} ");
        let v: Value = serde_json::from_slice(&body).unwrap();
        let (t, sent) = start(false, &body, &v).unwrap();
        assert_eq!(&sent[..], b"{\"prompt\":\"hi\",\"stream\":true,\"return_token_ids\":false,\"return_token_ids\":true}");
        assert!(!t.keep_ids);
        let body = Bytes::from_static(b"{\"messages\":[],\"stream\":true,\"return_token_ids\":true}");
        let v: Value = serde_json::from_slice(&body).unwrap();
        let (t, sent) = start(true, &body, &v).unwrap();
        assert!(t.keep_ids && sent == body && t.shape == ClientShape::Chat);
        let body = Bytes::from_static(b"{\"messages\":[],\"stream\":true,\"n\":2}");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(start(true, &body, &v).unwrap_err(), PinReason::SeveralChoices);
    }

    #[test]
    fn a_messages_stream_is_sent_as_the_chat_request_vllm_builds_unless_it_cannot_move() {
        let body = Bytes::from_static(b"{}");
        let m = json!({"model": "m", "max_tokens": 9, "stream": true, "temperature": 0, "system": [{"type": "text", "text": "Be brief."}],
                       "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "metadata": {"user_id": "u"}});
        let f = follow(Endpoint::Messages, &body, &m, ModelFacts::default()).unwrap();
        assert_eq!(f.translated.as_ref().map(|t| t.0), Some("/v1/chat/completions"));
        let sent: Value = serde_json::from_slice(&f.body).unwrap();
        assert_eq!(
            sent,
            json!({"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "max_tokens": 9,
                   "max_completion_tokens": 9, "temperature": 0, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true},
                   "return_token_ids": true})
        );
        assert_eq!((f.tracker.shape, f.tracker.keep_ids), (ClientShape::Chat, false));
        let pinned = |extra: Value| {
            let mut b = m.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            follow(Endpoint::Messages, &body, &b, ModelFacts::default()).unwrap_err()
        };
        assert_eq!(pinned(json!({"stop_sequences": ["END"]})), PinReason::StopStrings);
        assert_eq!(pinned(json!({"tools": [{"name": "f", "input_schema": {}}]})), PinReason::Tools);
        assert_eq!(pinned(json!({"thinking": {"type": "disabled"}})), PinReason::ServerTemplate);
        assert_eq!(pinned(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048})), PinReason::ServerParsed);
        assert_eq!(pinned(json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})), PinReason::StructuredOutput);
        let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}});
        assert_eq!(pinned(json!({"messages": [{"role": "user", "content": [image]}]})), PinReason::Multimodal);
        assert_eq!(pinned(json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]})), PinReason::Untranslatable);
        assert!(
            follow(Endpoint::Chat, &Bytes::from_static(b"{\"stream\":true}"), &json!({"stream": true}), ModelFacts::default()).unwrap().translated.is_none()
        );
    }

    #[test]
    fn a_responses_stream_goes_as_chat_unless_its_worker_stores_it_or_the_model_may_be_harmony() {
        let body = Bytes::from_static(b"{}");
        let r = json!({"model": "m", "input": "hi", "instructions": "Be brief.", "stream": true, "store": false, "max_output_tokens": 5, "temperature": 0});
        let f = follow(Endpoint::Responses, &body, &r, ModelFacts::default()).unwrap();
        assert_eq!(f.translated.as_ref().map(|t| t.0), Some("/v1/chat/completions"));
        assert!(matches!(f.translated, Some((_, Reply::Responses(_)))));
        let sent: Value = serde_json::from_slice(&f.body).unwrap();
        assert_eq!(sent["messages"], json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]));
        assert_eq!((sent["max_tokens"].as_u64(), sent["return_token_ids"].as_bool()), (Some(5), Some(true)));
        let stored = json!({"model": "m", "input": "hi", "stream": true});
        assert_eq!(follow(Endpoint::Responses, &body, &stored, ModelFacts::default()).unwrap_err(), PinReason::Stored);
        let harmony = ModelFacts { harmony: true, max_model_len: None };
        assert_eq!(follow(Endpoint::Responses, &body, &r, harmony).unwrap_err(), PinReason::Harmony);
        let mut stop = r.clone();
        stop["stop"] = json!(["END"]);
        assert_eq!(follow(Endpoint::Responses, &body, &stop, ModelFacts::default()).unwrap_err(), PinReason::StopStrings, "the chat form's own pins apply");
    }

    #[test]
    fn a_responses_refusal_is_told_as_the_pin_reason_it_stands_for() {
        let body = Bytes::from_static(b"{}");
        let r = json!({"model": "m", "input": "hi", "stream": true, "store": false});
        let pinned = |extra: Value| {
            let mut b = r.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            follow(Endpoint::Responses, &body, &b, ModelFacts::default()).unwrap_err()
        };
        assert_eq!(pinned(json!({"stream": false})), PinReason::Unary);
        assert_eq!(pinned(json!({"previous_response_id": "resp_1"})), PinReason::Stored);
        assert_eq!(pinned(json!({"background": true, "store": true})), PinReason::Stored);
        assert_eq!(pinned(json!({"tools": [{"type": "function", "name": "f"}]})), PinReason::Tools);
        assert_eq!(pinned(json!({"reasoning": {"effort": "low"}})), PinReason::ServerParsed);
        assert_eq!(pinned(json!({"text": {"format": {"type": "json_object"}}})), PinReason::StructuredOutput);
        assert_eq!(pinned(json!({"include": ["message.output_text.logprobs"]})), PinReason::Logprobs);
        assert_eq!(pinned(json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]})), PinReason::Multimodal);
        for untranslatable in [
            json!({"enable_response_messages": true}),
            json!({"kv_transfer_params": {}}),
            json!({"prompt": {"id": "p"}}),
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
        ] {
            assert_eq!(pinned(untranslatable), PinReason::Untranslatable);
        }
    }

    #[test]
    fn source_events_lose_their_ids_and_whole_events_only_go_out() {
        let mut t = Tracker::new(ClientShape::Completion, false);
        let a = b"data: {\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\",\"prompt_token_ids\":[1,2],\"token_ids\":[5]}]}\n\ndata: {\"id\":\"c\",\"choi";
        let fed = t.feed(a);
        assert_eq!(&fed.out[..], b"data: {\"id\":\"c\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n");
        let fed = t.feed(b"ces\":[{\"index\":0,\"text\":\"b\",\"token_ids\":[6]}]}\n\n");
        assert_eq!(&fed.out[..], b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"b\"}]}\n\n");
        assert_eq!((t.record.prompt_ids.clone(), t.record.generated_ids.clone()), (vec![1, 2], vec![5, 6]));
        // An unfinished event is dropped when the stream moves; the continuation is re-wrapped.
        t.feed(b"data: {\"id\":\"c\",\"choices\":[{\"te");
        t.continuing();
        let fed =
            t.feed(b"data: {\"id\":\"cmpl-z\",\"choices\":[{\"index\":0,\"text\":\"c\",\"token_ids\":[7],\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n");
        let s = std::str::from_utf8(&fed.out).unwrap();
        assert!(s.starts_with("data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\""), "{s}");
        assert!(s.contains("\"text\":\"c\"") && !s.contains("token_ids") && s.ends_with("data: [DONE]\n\n"), "{s}");
        assert_eq!(t.record.generated_ids, vec![5, 6, 7]);
    }

    #[test]
    fn a_worker_without_ids_pins_the_stream_and_errors_fail_the_leg() {
        let mut t = Tracker::new(ClientShape::Chat, false);
        let ev = b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let fed = t.feed(ev);
        assert_eq!((fed.pinned, &fed.out[..]), (Some(PinReason::NoTokenIds), &ev[..]));
        assert!(!t.movable());
        assert_eq!(&t.feed(b"data: {\"x\":1}").out[..], b"data: {\"x\":1}", "pinned without ids: bytes pass as they come");
        assert!(t.passes_through());
        // An event split across chunks when the pin happens is not lost nor reordered.
        let mut t = Tracker::new(ClientShape::Completion, false);
        let fed = t.feed(b"data: {\"id\":\"x\",\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"id\":\"x\",\"cho");
        assert_eq!(fed.pinned, Some(PinReason::NoTokenIds));
        let rest = t.feed(b"ices\":[]}\n\n");
        assert_eq!(
            [&fed.out[..], &rest.out[..]].concat(),
            b"data: {\"id\":\"x\",\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"id\":\"x\",\"choices\":[]}\n\n".to_vec()
        );
        let mut t = Tracker::new(ClientShape::Chat, false);
        t.feed(b"data: {\"id\":\"x\",\"prompt_token_ids\":[1],\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n");
        let fed = t.feed(b"data: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n");
        assert_eq!(fed.failure.as_deref(), Some("boom"));
        assert!(fed.out.is_empty());
        assert_eq!(&t.take_withheld().unwrap()[..], b"data: {\"error\":{\"message\":\"boom\"}}\n\n", "kept for the client if the stream cannot move");
    }

    #[test]
    fn a_finished_stream_is_ended_with_usage_when_asked() {
        let mut t = Tracker::new(ClientShape::Chat, false);
        t.feed(b"data: {\"id\":\"x\",\"created\":3,\"model\":\"m\",\"prompt_token_ids\":[1,2],\"choices\":[{\"delta\":{\"content\":\"a\"},\"token_ids\":[9],\"finish_reason\":\"stop\"}]}\n\n");
        let end = t.synthetic_end(true);
        let s = std::str::from_utf8(&end).unwrap();
        assert!(s.contains("\"usage\":{\"prompt_tokens\":2,\"total_tokens\":3,\"completion_tokens\":1}") && s.ends_with("data: [DONE]\n\n"), "{s}");
        assert_eq!(&t.synthetic_end(false)[..], b"data: [DONE]\n\n");
        // Once usage went out it is not sent again; once [DONE] went out nothing is.
        t.feed(b"data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":2}}\n\n");
        assert_eq!(&t.synthetic_end(true)[..], b"data: [DONE]\n\n");
        t.feed(b"data: [DONE]\n\n");
        assert!(t.done() && t.synthetic_end(true).is_empty());
    }
}
