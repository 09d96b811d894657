//! What a moving stream must remember, and how the destination's chunks are made to look like
//! the source's: [`StreamRecord`] follows the source worker's chunks (asked with
//! `return_token_ids`) and keeps the prompt ids, the generated ids, the client's `id`, `model`
//! and `created`; [`StreamRecord::rewrap`] turns a destination completion chunk into the
//! client's shape (chat chunk or completion chunk), so the client sees one stream.

use serde_json::{Value, json};

/// The shape the client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientShape {
    /// `chat.completion.chunk` with `delta.content`.
    Chat,
    /// `text_completion` with `text`.
    Completion,
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
    /// The prompt's token ids (`prompt_token_ids`, first chunk).
    pub prompt_ids: Vec<u32>,
    /// Generated token ids, in order (`token_ids` deltas).
    pub generated_ids: Vec<u32>,
    /// Text streamed to the client so far.
    pub text: String,
    /// Whether a chunk carried a `finish_reason`.
    pub finished: bool,
}

fn ids(v: Option<&Value>) -> impl Iterator<Item = u32> + '_ {
    v.and_then(Value::as_array).into_iter().flatten().filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
}

impl StreamRecord {
    /// Follows one chunk of the source stream (chat or completion).
    pub fn observe(&mut self, chunk: &Value) {
        if self.id.is_none() {
            self.id = chunk.get("id").and_then(Value::as_str).map(str::to_owned);
            self.model = chunk.get("model").and_then(Value::as_str).map(str::to_owned);
            self.created = chunk.get("created").and_then(Value::as_u64);
        }
        // Completions put prompt ids in the choice, chat at the top level.
        self.prompt_ids.extend(ids(chunk.get("prompt_token_ids")));
        let Some(choice) = chunk.get("choices").and_then(Value::as_array).and_then(|c| c.first()) else { return };
        self.prompt_ids.extend(ids(choice.get("prompt_token_ids")));
        self.generated_ids.extend(ids(choice.get("token_ids")));
        let text = choice.get("text").or_else(|| choice.get("delta").and_then(|d| d.get("content")));
        if let Some(t) = text.and_then(Value::as_str) {
            self.text.push_str(t);
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
    }

    /// A destination completion chunk in the client's shape, with the client's id, model and
    /// created; token ids are kept only if the client asked for them. Usage (the final chunk)
    /// counts the original prompt and every generated token.
    pub fn rewrap(&self, dest: &Value, shape: ClientShape, keep_ids: bool) -> Value {
        let choice = dest.get("choices").and_then(Value::as_array).and_then(|c| c.first());
        let mut out = json!({
            "id": self.id, "created": self.created, "model": self.model,
            "object": match shape { ClientShape::Chat => "chat.completion.chunk", ClientShape::Completion => "text_completion" },
        });
        out["choices"] = match choice {
            None => json!([]),
            Some(c) => {
                let mut ch = match shape {
                    ClientShape::Chat => json!({"index": 0, "delta": {"content": c.get("text").cloned().unwrap_or(json!(""))}, "logprobs": null}),
                    ClientShape::Completion => json!({"index": 0, "text": c.get("text").cloned().unwrap_or(json!("")), "logprobs": null}),
                };
                ch["finish_reason"] = c.get("finish_reason").cloned().unwrap_or(Value::Null);
                if shape == ClientShape::Completion {
                    ch["stop_reason"] = c.get("stop_reason").cloned().unwrap_or(Value::Null);
                }
                if keep_ids && let Some(t) = c.get("token_ids") {
                    ch["token_ids"] = t.clone();
                }
                json!([ch])
            }
        };
        // The destination's usage counts the continuation's prompt; the client's counts its own.
        if dest.get("usage").is_some_and(|u| !u.is_null()) {
            let completion = self.generated_ids.len() as u64;
            let prompt = self.prompt_ids.len() as u64;
            out["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion});
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_stream_is_followed_and_the_destination_looks_like_it() {
        let mut r = StreamRecord::default();
        r.observe(&json!({"id": "chatcmpl-1", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
        r.observe(&json!({"id": "chatcmpl-1", "choices": [{"delta": {"content": "Hel"}, "token_ids": [10]}]}));
        r.observe(&json!({"id": "chatcmpl-1", "choices": [{"delta": {"content": "lo"}, "token_ids": [11]}]}));
        assert_eq!((r.prompt_ids.clone(), r.generated_ids.clone(), r.text.as_str()), (vec![1, 2], vec![10, 11], "Hello"));
        // The destination continues as a completion.
        let dest = json!({"id": "cmpl-x", "created": 99, "model": "m", "choices": [{"index": 0, "text": " world", "token_ids": [12], "finish_reason": null}]});
        r.observe(&dest);
        let out = r.rewrap(&dest, ClientShape::Chat, false);
        assert_eq!(out["id"], "chatcmpl-1");
        assert_eq!(out["created"], 5);
        assert_eq!(out["object"], "chat.completion.chunk");
        assert_eq!(out["choices"][0]["delta"]["content"], " world");
        assert!(out["choices"][0].get("token_ids").is_none(), "ids the client did not ask for are stripped");
        let usage = json!({"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}});
        let u = r.rewrap(&usage, ClientShape::Chat, false);
        assert_eq!(u["usage"], json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}), "the original prompt, every generated token");
        assert_eq!(u["choices"], json!([]));
    }

    #[test]
    fn a_completion_stream_keeps_ids_when_asked_and_notes_the_finish() {
        let mut r = StreamRecord::default();
        r.observe(&json!({"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"text": "a", "prompt_token_ids": [1], "token_ids": [5]}]}));
        let dest = json!({"choices": [{"text": "b", "token_ids": [6], "finish_reason": "length", "stop_reason": null}]});
        r.observe(&dest);
        let out = r.rewrap(&dest, ClientShape::Completion, true);
        assert_eq!((out["id"].clone(), out["choices"][0]["text"].clone()), (json!("cmpl-1"), json!("b")));
        assert_eq!(out["choices"][0]["token_ids"], json!([6]));
        assert_eq!(out["choices"][0]["finish_reason"], "length");
        assert!(r.finished);
        assert_eq!((r.prompt_ids.clone(), r.generated_ids.clone()), (vec![1], vec![5, 6]));
    }
}
