//! The answer to a request whose worker was asked in another API than the client's (a
//! Messages or Responses stream sent as chat, so that it can move), turned back into the
//! client's API: a stream's chat events converted, an error answer reshaped or passed on.

use super::anthropic::MessagesReply;
use super::responses::ResponsesStream;

/// The client's API, and the converter into it.
#[derive(Debug)]
pub enum Reply {
    /// Anthropic Messages.
    Messages(MessagesReply),
    /// OpenAI Responses. Boxed: the reply lives in every request's state, most without one.
    Responses(Box<ResponsesStream>),
    /// An error answer of a Responses request: vLLM's chat and Responses endpoints answer errors
    /// in the same OpenAI shape, so it passes as the worker sent it.
    Raw,
}

impl Reply {
    /// The worker answered with an error status: its body is an error, not events.
    pub fn error_status(&mut self) {
        match self {
            Self::Messages(m) => m.error_status(),
            Self::Responses(_) | Self::Raw => *self = Self::Raw,
        }
    }

    /// The client's bytes for a piece of the worker's answer (`end`: the answer is complete).
    pub fn answer(&mut self, bytes: &[u8], end: bool) -> Vec<u8> {
        match self {
            Self::Messages(m) => m.answer(bytes, end),
            Self::Responses(r) => r.feed(bytes),
            Self::Raw => bytes.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::responses::StreamSetup;
    use serde_json::json;

    #[test]
    fn a_responses_stream_is_converted_and_its_error_answer_passes() {
        let body = json!({"model": "m", "input": "hi", "stream": true, "store": false, "request_id": "resp_0123456789abcdef"});
        let mut r = Reply::Responses(Box::new(ResponsesStream::new(&body, StreamSetup::default())));
        let chunk = br#"data: {"id":"chatcmpl-x","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":{"prompt_tokens":3,"total_tokens":3,"completion_tokens":0}}

"#;
        let out = String::from_utf8(r.answer(chunk, false)).unwrap();
        assert!(out.contains("response.created") && out.contains("resp_0123456789abcdef"), "{out}");
        let mut e = Reply::Responses(Box::new(ResponsesStream::new(&body, StreamSetup::default())));
        e.error_status();
        let err = br#"{"error":{"message":"bad","type":"BadRequestError","code":400}}"#;
        assert_eq!(e.answer(err, true), err.to_vec());
    }
}
