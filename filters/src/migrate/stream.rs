//! What a moving stream must remember, and how the destination's events are made to look like
//! the source's. [`StreamRecord::observe`] follows the source worker's events (asked with
//! `return_token_ids`) and keeps the prompt ids, the generated ids, the text, the client's `id`,
//! `model` and `created`; [`StreamRecord::continue_event`] follows a destination completion
//! event and returns it in the client's shape (chat chunk or completion chunk), so the client
//! sees one stream.
//!
//! A server's detokenizer holds back the text of a token that ends inside a UTF-8 character:
//! its event carries the id and no text. Such trailing ids are "unseen"; a move rolls them back
//! ([`StreamRecord::roll_back_unseen`]) so the destination generates them again, with their text.

use super::events::EventIds;
use super::pin::PinReason;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::borrow::Cow;

/// The shape the client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientShape {
    /// `chat.completion.chunk` with `delta.content`.
    Chat,
    /// `text_completion` with `text`.
    Completion,
}

impl ClientShape {
    /// The `object` of its stream chunks.
    pub fn object(self) -> &'static str {
        match self {
            Self::Chat => "chat.completion.chunk",
            Self::Completion => "text_completion",
        }
    }
}

/// A stream as seen so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamRecord {
    /// The response id the client sees (`chatcmpl-…` / `cmpl-…`).
    pub id: Option<String>,
    /// `model` as the client sees it.
    pub model: Option<String>,
    /// `created` as the client sees it.
    pub created: Option<u64>,
    /// The prompt's token ids (`prompt_token_ids`, first event).
    pub prompt_ids: Vec<u32>,
    /// Generated token ids, in order (`token_ids` deltas).
    pub generated_ids: Vec<u32>,
    /// Trailing generated ids whose text the server has not sent yet.
    pub unseen: usize,
    /// Text streamed to the client so far.
    pub text: String,
    /// Whether an event carried a `finish_reason`.
    pub finished: bool,
    /// Whether the first event was seen.
    pub started: bool,
    /// Whether a usage event went to the client.
    pub usage_seen: bool,
    /// Rolled-back ids the client already received (with `return_token_ids`): the
    /// continuation's copies of them are not sent again.
    pub resent: usize,
}

/// What one event meant.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    /// Generated tokens it carried.
    pub tokens: usize,
    /// The worker reported an error in the stream (`{"error": …}`): the leg failed.
    pub error: Option<String>,
    /// The stream turned out not to be movable.
    pub pin: Option<PinReason>,
}

#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    created: Option<u64>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(borrow, default)]
    choices: Option<Vec<ChoiceView<'a>>>,
    #[serde(default)]
    error: Option<Value>,
    #[serde(default)]
    usage: Option<Value>,
}

#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    delta: Option<DeltaView<'a>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    finish_reason: Option<Value>,
    #[serde(default)]
    stop_reason: Option<Value>,
}

#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow, default)]
    content: Option<Cow<'a, str>>,
    #[serde(default)]
    reasoning_content: Option<Value>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Value>,
}

fn set(v: Option<&Value>) -> bool {
    v.is_some_and(|v| !v.is_null())
}

fn error_text(e: &Value) -> String {
    e.get("message").and_then(Value::as_str).map_or_else(|| e.to_string(), str::to_owned)
}

impl StreamRecord {
    /// Follows one event of the source stream (its JSON payload, chat or completion).
    pub fn observe(&mut self, json: &[u8]) -> Result<Observed, serde_json::Error> {
        Ok(self.observe_chunk(serde_json::from_slice(json)?))
    }

    /// [`Self::observe`] for an event whose id lists were stripped and read already
    /// ([`strip_and_read_ids`](super::events::strip_and_read_ids)): `json` is what is left.
    pub fn observe_read(&mut self, json: &[u8], ids: EventIds) -> Result<Observed, serde_json::Error> {
        let mut chunk: ChunkView<'_> = serde_json::from_slice(json)?;
        // Where the prompt's ids were (top level for chat, the choice for completions) does not
        // matter: either is read. A list the strip did not take (a key written `"token_ids" :`)
        // is still in `json`, and kept.
        chunk.prompt_token_ids = ids.prompt.or(chunk.prompt_token_ids.take());
        if let Some(choice) = chunk.choices.as_mut().and_then(|c| c.first_mut()) {
            choice.token_ids = ids.generated.or(choice.token_ids.take());
        }
        Ok(self.observe_chunk(chunk))
    }

    fn observe_chunk(&mut self, mut chunk: ChunkView<'_>) -> Observed {
        if let Some(e) = &chunk.error {
            return Observed { error: Some(error_text(e)), ..Observed::default() };
        }
        self.usage_seen |= set(chunk.usage.as_ref());
        let first = !self.started;
        if first {
            self.started = true;
            self.id = chunk.id.map(Cow::into_owned);
            self.model = chunk.model.map(Cow::into_owned);
            self.created = chunk.created;
        }
        // Chat puts the prompt ids at the top level, completions in the choice.
        let in_choice = chunk.choices.as_mut().and_then(|c| c.first_mut()).and_then(|c| c.prompt_token_ids.take());
        if let Some(ids) = chunk.prompt_token_ids.take().or(in_choice) {
            self.prompt_ids = ids;
        }
        let choice = chunk.choices.as_ref().and_then(|c| c.first());
        if first && self.prompt_ids.is_empty() {
            return Observed { pin: Some(PinReason::NoTokenIds), ..Observed::default() };
        }
        let Some(choice) = choice else { return Observed::default() };
        if let Some(d) = &choice.delta
            && (set(d.reasoning_content.as_ref()) || set(d.reasoning.as_ref()) || set(d.tool_calls.as_ref()))
        {
            return Observed { pin: Some(PinReason::ServerParsed), ..Observed::default() };
        }
        let text = choice.text.as_deref().or_else(|| choice.delta.as_ref().and_then(|d| d.content.as_deref()));
        // Text without ids: the server hides them (vLLM does behind a reasoning parser), so the
        // record would miss tokens.
        if choice.token_ids.is_none() && text.is_some_and(|t| !t.is_empty()) {
            return Observed { pin: Some(PinReason::NoTokenIds), ..Observed::default() };
        }
        Observed { tokens: self.follow(choice, text), ..Observed::default() }
    }

    /// Notes a choice's ids, text and finish; returns the tokens it carried.
    fn follow(&mut self, choice: &ChoiceView<'_>, text: Option<&str>) -> usize {
        let ids = choice.token_ids.as_deref().unwrap_or_default();
        self.generated_ids.extend_from_slice(ids);
        match text {
            Some(t) if !t.is_empty() => {
                self.text.push_str(t);
                self.unseen = 0;
            }
            _ => self.unseen += ids.len(),
        }
        if set(choice.finish_reason.as_ref()) {
            self.finished = true;
        }
        ids.len()
    }

    /// Forgets the trailing ids whose text was never sent, so a continuation generates them
    /// again; returns how many.
    pub fn roll_back_unseen(&mut self) -> usize {
        let n = std::mem::take(&mut self.unseen).min(self.generated_ids.len());
        self.generated_ids.truncate(self.generated_ids.len() - n);
        self.resent += n;
        n
    }

    /// Follows one event of a continuation (a `/v1/completions` stream) and returns it as the
    /// client's event payload: its shape, its id, model and created; token ids only if the
    /// client asked for them; usage counting the original prompt and every generated token.
    pub fn continue_event(&mut self, json: &[u8], shape: ClientShape, keep_ids: bool) -> Result<(Observed, Value), serde_json::Error> {
        let chunk: ChunkView<'_> = serde_json::from_slice(json)?;
        if let Some(e) = &chunk.error {
            return Ok((Observed { error: Some(error_text(e)), ..Observed::default() }, Value::Null));
        }
        let mut out = Map::new();
        out.insert("id".into(), json!(self.id));
        out.insert("object".into(), json!(shape.object()));
        out.insert("created".into(), json!(self.created));
        out.insert("model".into(), json!(self.model));
        let mut observed = Observed::default();
        let choices = match chunk.choices.as_ref().and_then(|c| c.first()) {
            None => json!([]),
            Some(c) => {
                let text = c.text.as_deref().unwrap_or_default();
                observed.tokens = self.follow(c, Some(text));
                let ids = c.token_ids.as_deref().unwrap_or_default();
                let skip = self.resent.min(ids.len());
                self.resent -= skip;
                json!([Self::choice(c, text, shape, keep_ids.then_some(&ids[skip..]))])
            }
        };
        out.insert("choices".into(), choices);
        if set(chunk.usage.as_ref()) {
            self.usage_seen = true;
            out.insert("usage".into(), self.usage());
        }
        Ok((observed, Value::Object(out)))
    }

    /// Usage as the client counts it: its own prompt and every token generated for it.
    pub fn usage(&self) -> Value {
        let (prompt, completion) = (self.prompt_ids.len() as u64, self.generated_ids.len() as u64);
        json!({"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion})
    }

    /// A usage-only event in the client's shape, for a stream the gateway ends itself.
    pub fn usage_event(&self, shape: ClientShape) -> Value {
        json!({"id": self.id, "object": shape.object(), "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})
    }

    /// The prompt ids followed by the generated ids: the context a continuation sends.
    pub fn context_ids(&self) -> Vec<u32> {
        self.prompt_ids.iter().chain(&self.generated_ids).copied().collect()
    }

    fn choice(c: &ChoiceView<'_>, text: &str, shape: ClientShape, ids: Option<&[u32]>) -> Value {
        let finish = c.finish_reason.clone().unwrap_or(Value::Null);
        let mut ch = match shape {
            ClientShape::Chat => json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish}),
            ClientShape::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": c.stop_reason.clone().unwrap_or(Value::Null)})
            }
        };
        if shape == ClientShape::Chat && set(c.stop_reason.as_ref()) {
            ch["stop_reason"] = c.stop_reason.clone().unwrap_or(Value::Null);
        }
        if let Some(t) = ids.filter(|_| c.token_ids.is_some()) {
            ch["token_ids"] = json!(t);
        }
        ch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observe(r: &mut StreamRecord, v: &Value) -> Observed {
        r.observe(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn ids_read_as_they_are_stripped_make_the_record_a_parse_makes() {
        use crate::migrate::events::{payload, strip_and_read_ids};
        let streams = [
            vec![
                json!({"id": "chatcmpl-1", "created": 5, "model": "m", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
                json!({"id": "chatcmpl-1", "prompt_token_ids": null, "choices": [{"delta": {"content": "Hel"}, "token_ids": [10]}]}),
                json!({"id": "chatcmpl-1", "choices": [{"delta": {"content": ""}, "token_ids": [11, 12]}]}),
                json!({"id": "chatcmpl-1", "choices": [{"delta": {"content": "lo"}, "token_ids": [13], "finish_reason": "stop"}]}),
                json!({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}),
            ],
            vec![
                json!({"id": "cmpl-1", "model": "m", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [4, 5], "token_ids": [6], "finish_reason": null}]}),
                json!({"id": "cmpl-1", "choices": [{"index": 0, "text": "b", "token_ids": [7], "finish_reason": "length"}]}),
            ],
            vec![json!({"id": "c", "choices": [{"text": "no ids"}]})],
            vec![json!({"id": "c", "prompt_token_ids": [1], "choices": [{"delta": {"reasoning_content": "hm"}, "token_ids": [2]}]})],
            vec![json!({"error": {"message": "boom"}})],
        ];
        for events in streams {
            let (mut parsed, mut read) = (StreamRecord::default(), StreamRecord::default());
            for e in &events {
                let ev = format!("data: {e}\n\n");
                let (rest, ids) = strip_and_read_ids(ev.as_bytes()).unwrap();
                assert_eq!(read.observe_read(payload(&rest).unwrap(), ids).unwrap(), parsed.observe(e.to_string().as_bytes()).unwrap(), "{e}");
            }
            assert_eq!(read, parsed, "{events:?}");
        }
        // Other JSON separators, and a key the strip does not take (`"token_ids" :`).
        for raw in [
            r#"{"id": "c", "prompt_token_ids": [1, 2], "choices": [{"text": "a", "token_ids": [6]}]}"#,
            r#"{ "choices" : [ { "text" : "a" , "token_ids" : [6] , "prompt_token_ids" :[1] } ] }"#,
        ] {
            let (mut parsed, mut read) = (StreamRecord::default(), StreamRecord::default());
            let (rest, ids) = strip_and_read_ids(format!("data: {raw}\n\n").as_bytes()).unwrap();
            assert_eq!(read.observe_read(payload(&rest).unwrap(), ids).unwrap(), parsed.observe(raw.as_bytes()).unwrap(), "{raw}");
            assert_eq!((read.prompt_ids.clone(), read.generated_ids.clone()), (parsed.prompt_ids.clone(), vec![6]), "{raw}");
            assert_eq!(read, parsed, "{raw}");
        }
    }

    #[test]
    fn a_chat_stream_is_followed_and_the_destination_looks_like_it() {
        let mut r = StreamRecord::default();
        observe(
            &mut r,
            &json!({"id": "chatcmpl-1", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        );
        assert_eq!(observe(&mut r, &json!({"id": "chatcmpl-1", "choices": [{"delta": {"content": "Hel"}, "token_ids": [10]}]})).tokens, 1);
        observe(&mut r, &json!({"id": "chatcmpl-1", "prompt_token_ids": null, "choices": [{"delta": {"content": "lo"}, "token_ids": [11]}]}));
        assert_eq!((r.prompt_ids.clone(), r.generated_ids.clone(), r.text.as_str()), (vec![1, 2], vec![10, 11], "Hello"));
        // The destination continues as a completion, whose first event names its own prompt.
        let dest = json!({"id": "cmpl-x", "created": 99, "model": "m", "choices": [{"index": 0, "text": " world", "prompt_token_ids": [1, 2, 10, 11], "token_ids": [12], "finish_reason": null}]});
        let (seen, out) = r.continue_event(dest.to_string().as_bytes(), ClientShape::Chat, false).unwrap();
        assert_eq!(seen.tokens, 1);
        assert_eq!(r.prompt_ids, vec![1, 2], "the continuation's prompt is not the client's");
        assert_eq!((out["id"].clone(), out["created"].clone(), out["object"].clone()), (json!("chatcmpl-1"), json!(5), json!("chat.completion.chunk")));
        assert_eq!(out["choices"][0]["delta"]["content"], " world");
        assert!(out["choices"][0].get("token_ids").is_none(), "ids the client did not ask for are stripped");
        let usage = json!({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}});
        let (_, u) = r.continue_event(usage.to_string().as_bytes(), ClientShape::Chat, false).unwrap();
        assert_eq!(u["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}), "the original prompt, every generated token");
        assert_eq!(u["choices"], json!([]));
    }

    #[test]
    fn a_completion_stream_keeps_ids_when_asked_and_notes_the_finish() {
        let mut r = StreamRecord::default();
        observe(&mut r, &json!({"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"text": "a", "prompt_token_ids": [1], "token_ids": [5]}]}));
        let dest = json!({"choices": [{"text": "b", "token_ids": [6], "finish_reason": "length", "stop_reason": null}]});
        let (_, out) = r.continue_event(dest.to_string().as_bytes(), ClientShape::Completion, true).unwrap();
        assert_eq!((out["id"].clone(), out["choices"][0]["text"].clone()), (json!("cmpl-1"), json!("b")));
        assert_eq!(out["choices"][0]["token_ids"], json!([6]));
        assert_eq!(out["choices"][0]["finish_reason"], "length");
        assert!(r.finished);
        assert_eq!((r.prompt_ids.clone(), r.generated_ids.clone()), (vec![1], vec![5, 6]));
    }

    #[test]
    fn streams_without_ids_or_with_server_parsing_cannot_move_and_errors_are_seen() {
        let mut r = StreamRecord::default();
        assert_eq!(observe(&mut r, &json!({"id": "c", "choices": [{"text": "a"}]})).pin, Some(PinReason::NoTokenIds));
        let mut r = StreamRecord::default();
        observe(&mut r, &json!({"id": "c", "prompt_token_ids": [1], "choices": [{"delta": {"role": "assistant"}}]}));
        assert_eq!(observe(&mut r, &json!({"choices": [{"delta": {"reasoning_content": "hm"}, "token_ids": [2]}]})).pin, Some(PinReason::ServerParsed));
        assert_eq!(observe(&mut r, &json!({"error": {"message": "engine dead", "code": 500}})).error.as_deref(), Some("engine dead"));
        let mut r = StreamRecord::default();
        observe(&mut r, &json!({"id": "c", "prompt_token_ids": [1], "choices": [{"delta": {"role": "assistant", "content": ""}}]}));
        assert_eq!(observe(&mut r, &json!({"choices": [{"delta": {"content": "hidden ids"}}]})).pin, Some(PinReason::NoTokenIds));
    }

    #[test]
    fn ids_whose_text_was_held_back_are_rolled_back() {
        let mut r = StreamRecord::default();
        observe(&mut r, &json!({"id": "c", "choices": [{"text": "a", "prompt_token_ids": [1], "token_ids": [5]}]}));
        observe(&mut r, &json!({"choices": [{"text": "", "token_ids": [200]}]}));
        observe(&mut r, &json!({"choices": [{"text": "", "token_ids": [201]}]}));
        assert_eq!(r.roll_back_unseen(), 2);
        assert_eq!(r.generated_ids, vec![5]);
        assert_eq!(r.roll_back_unseen(), 0);
        // The client that asked for ids has 200 and 201 already: the continuation's copies
        // are not sent again, and its text (the whole character) is.
        let dest = json!({"choices": [{"text": "é", "token_ids": [200, 201]}]});
        let (_, out) = r.continue_event(dest.to_string().as_bytes(), ClientShape::Completion, true).unwrap();
        assert_eq!((out["choices"][0]["text"].clone(), out["choices"][0]["token_ids"].clone()), (json!("é"), json!([])));
        let dest = json!({"choices": [{"text": "x", "token_ids": [7]}]});
        let (_, out) = r.continue_event(dest.to_string().as_bytes(), ClientShape::Completion, true).unwrap();
        assert_eq!(out["choices"][0]["token_ids"], json!([7]));
        assert_eq!(r.generated_ids, vec![5, 200, 201, 7], "usage counts each token once");
    }
}
