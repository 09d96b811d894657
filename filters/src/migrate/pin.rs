//! Which requests can move mid-stream. A continuation re-sends prompt + generated ids as a
//! plain completion, so anything whose result depends on state the continuation cannot carry
//! is pinned to its worker: the server's parsers (tools, structured output), several choices,
//! log-probabilities, echo, beam search, penalties that count only output tokens (after a
//! move the output so far is part of the prompt, so they would count differently), and stop
//! strings (the server holds back text that may begin one), images and other media (the ids of
//! their placeholder tokens do not carry the media), a thinking budget (the server counts the
//! thinking tokens). Three more reasons are found only once the stream runs (`NoTokenIds`,
//! `ServerParsed`, see `stream`; `ContextTooLong`).
//!
//! An Anthropic Messages stream moves as the chat stream it is translated into (`anthropic`):
//! [`messages_pin_reason`] says which cannot be translated exactly, the chat request's
//! [`pin_reason`] which of the others cannot move. An OpenAI Responses stream moves the same
//! way; why one is not translated (`kvgate_tokenize::dialect::responses::stream::Refusal`) is
//! told as one of these reasons by the gateway (`proxy/src/request/track.rs`).

use serde_json::Value;

/// Why a request stays on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinReason {
    /// Not streamed: the client waits for one body (a move would gain nothing it can see).
    Unary,
    /// `n` or `best_of` above 1: several choices share one request.
    SeveralChoices,
    /// A completions batch (several prompts).
    SeveralPrompts,
    /// `response_format`, `structured_outputs` or `guided_*`: the grammar state is not carried.
    StructuredOutput,
    /// Chat with tools the server may call: its tool-call parser holds state.
    Tools,
    /// `logprobs`, `top_logprobs` or `prompt_logprobs`: not carried over.
    Logprobs,
    /// `echo`: the prompt is part of the output.
    Echo,
    /// `use_beam_search`.
    BeamSearch,
    /// `presence_penalty` / `frequency_penalty`: they count output tokens only.
    OutputPenalties,
    /// `stop` strings: the server holds back text that may start one, so what the client saw
    /// does not tell which tokens it has.
    StopStrings,
    /// The worker did not return token ids (a server without `return_token_ids`).
    NoTokenIds,
    /// The server parsed the output (reasoning or tool calls) with state a move cannot carry.
    ServerParsed,
    /// Prompt + generated + one more token would not fit a worker's context.
    ContextTooLong,
    /// An API whose stream the gateway does not re-wrap after a move (every endpoint but chat,
    /// completions, Anthropic Messages and OpenAI Responses).
    Api,
    /// Images, audio or video in the prompt: a continuation sends token ids, which do not carry
    /// the media behind their placeholder tokens.
    Multimodal,
    /// An Anthropic Messages request whose chat form vLLM decides from its chat template
    /// (system messages inside `messages`, `thinking: {"type": "disabled"}`): the gateway cannot
    /// know it, so it cannot translate the request.
    ServerTemplate,
    /// An Anthropic Messages or OpenAI Responses request the gateway's translation refuses (as
    /// vLLM refuses it, or a form it does not cover): it goes as sent, for the worker's own
    /// answer.
    Untranslatable,
    /// A Responses request whose response the worker stores (`store`, its default, while the
    /// workers may keep a response store; `previous_response_id`; `background`): only the
    /// worker that made it can store it, so it is answered there.
    Stored,
    /// A Responses request to a model that is, or may be, a Harmony model (gpt-oss), whose
    /// Responses vLLM renders and parses with Harmony rather than the chat template.
    Harmony,
}

impl PinReason {
    /// Metric label (`kvgate_migration_pinned_total{reason}`).
    pub fn label(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::SeveralChoices => "n",
            Self::SeveralPrompts => "batch",
            Self::StructuredOutput => "structured_output",
            Self::Tools => "tools",
            Self::Logprobs => "logprobs",
            Self::Echo => "echo",
            Self::BeamSearch => "beam_search",
            Self::OutputPenalties => "output_penalties",
            Self::StopStrings => "stop_strings",
            Self::NoTokenIds => "no_token_ids",
            Self::ServerParsed => "server_parsed",
            Self::ContextTooLong => "context_too_long",
            Self::Api => "api",
            Self::Multimodal => "multimodal",
            Self::ServerTemplate => "server_template",
            Self::Untranslatable => "untranslatable",
            Self::Stored => "stored",
            Self::Harmony => "harmony",
        }
    }
}

fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        Some(_) => true,
    }
}

/// Why the request `body` (chat when `chat`) cannot move, or `None` when it can.
pub fn pin_reason(chat: bool, body: &Value) -> Option<PinReason> {
    let get = |k: &str| body.get(k);
    if !get("stream").and_then(Value::as_bool).unwrap_or(false) {
        return Some(PinReason::Unary);
    }
    if get("n").and_then(Value::as_u64).unwrap_or(1) > 1 || get("best_of").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Some(PinReason::SeveralChoices);
    }
    if !chat && let Some(Value::Array(items)) = get("prompt") {
        let batch = items.first().is_some_and(Value::is_array) && items.len() > 1 || items.first().is_some_and(Value::is_string) && items.len() > 1;
        if batch {
            return Some(PinReason::SeveralPrompts);
        }
    }
    let text_format = get("response_format").and_then(|f| f.get("type")).and_then(Value::as_str) == Some("text");
    let guided = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"].iter().any(|k| truthy(get(k)));
    if (truthy(get("response_format")) && !text_format) || guided {
        return Some(PinReason::StructuredOutput);
    }
    if chat && has_media(get("messages")) {
        return Some(PinReason::Multimodal);
    }
    // The server counts the thinking tokens against the budget as it generates them.
    if truthy(get("thinking_token_budget")) {
        return Some(PinReason::ServerParsed);
    }
    let tools = get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty());
    if chat && tools && get("tool_choice").and_then(Value::as_str) != Some("none") {
        return Some(PinReason::Tools);
    }
    if ["logprobs", "top_logprobs", "prompt_logprobs"].iter().any(|k| truthy(get(k))) {
        return Some(PinReason::Logprobs);
    }
    if truthy(get("echo")) {
        return Some(PinReason::Echo);
    }
    if truthy(get("use_beam_search")) {
        return Some(PinReason::BeamSearch);
    }
    if truthy(get("presence_penalty")) || truthy(get("frequency_penalty")) {
        return Some(PinReason::OutputPenalties);
    }
    let stop = match get("stop") {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    if stop {
        return Some(PinReason::StopStrings);
    }
    None
}

/// Whether chat `messages` hold a content part with media (an image, audio or video, by URL,
/// data or embeddings).
fn has_media(messages: Option<&Value>) -> bool {
    let parts = messages.and_then(Value::as_array).into_iter().flatten().filter_map(|m| m.get("content")?.as_array()).flatten();
    parts.filter_map(|p| p.get("type")?.as_str()).any(|t| ["image", "audio", "video"].iter().any(|m| t.contains(m)))
}

/// Why an Anthropic Messages request `body` cannot be translated into a chat request exactly
/// as vLLM translates it, before the translation is tried: what vLLM decides from its chat
/// template. `None` when it does not depend on the template.
pub fn messages_pin_reason(body: &Value) -> Option<PinReason> {
    // vLLM merges them into the leading system prompt or keeps them in place, as its template
    // accepts (`_should_merge_inline_system`).
    let inline_system =
        body.get("messages").and_then(Value::as_array).is_some_and(|m| m.iter().any(|m| m.get("role").and_then(Value::as_str) == Some("system")));
    // `reasoning_effort` "none", or "low" for a template that cannot turn thinking off.
    let thinking_off = body.get("thinking").and_then(|t| t.get("type")).and_then(Value::as_str) == Some("disabled");
    (inline_system || thinking_off).then_some(PinReason::ServerTemplate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_streams_may_move() {
        assert_eq!(pin_reason(true, &json!({"messages": [], "stream": true, "temperature": 0})), None);
        assert_eq!(pin_reason(false, &json!({"prompt": [1, 2, 3], "stream": true, "seed": 7, "stop": [], "stop_token_ids": [2]})), None);
        assert_eq!(pin_reason(false, &json!({"prompt": [[1, 2]], "stream": true})), None, "a batch of one");
        assert_eq!(pin_reason(true, &json!({"stream": true, "response_format": {"type": "text"}, "logprobs": false})), None);
        assert_eq!(pin_reason(true, &json!({"stream": true, "tools": [{"type": "function"}], "tool_choice": "none"})), None);
        assert_eq!(pin_reason(true, &json!({"stream": true, "presence_penalty": 0.0})), None);
        assert_eq!(pin_reason(true, &json!({"stream": true, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})), None);
    }

    #[test]
    fn messages_that_depend_on_the_servers_template_are_not_translated() {
        let plain = json!({"system": "s", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "adaptive"}});
        assert_eq!(messages_pin_reason(&plain), None);
        let inline = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "reminder"}]});
        assert_eq!(messages_pin_reason(&inline), Some(PinReason::ServerTemplate));
        let off = json!({"messages": [], "thinking": {"type": "disabled"}});
        assert_eq!(messages_pin_reason(&off), Some(PinReason::ServerTemplate));
    }

    #[test]
    fn each_unsafe_case_is_pinned_with_its_reason() {
        let cases = [
            (true, json!({"messages": []}), PinReason::Unary),
            (true, json!({"stream": true, "n": 2}), PinReason::SeveralChoices),
            (false, json!({"stream": true, "best_of": 3}), PinReason::SeveralChoices),
            (false, json!({"stream": true, "prompt": ["a", "b"]}), PinReason::SeveralPrompts),
            (true, json!({"stream": true, "response_format": {"type": "json_object"}}), PinReason::StructuredOutput),
            (false, json!({"stream": true, "guided_regex": "a+"}), PinReason::StructuredOutput),
            (true, json!({"stream": true, "tools": [{"type": "function"}]}), PinReason::Tools),
            (true, json!({"stream": true, "logprobs": true}), PinReason::Logprobs),
            (false, json!({"stream": true, "logprobs": 5}), PinReason::Logprobs),
            (false, json!({"stream": true, "echo": true}), PinReason::Echo),
            (false, json!({"stream": true, "use_beam_search": true}), PinReason::BeamSearch),
            (true, json!({"stream": true, "frequency_penalty": 0.5}), PinReason::OutputPenalties),
            (true, json!({"stream": true, "stop": "\n"}), PinReason::StopStrings),
            (false, json!({"stream": true, "stop": ["END"]}), PinReason::StopStrings),
            (
                true,
                json!({"stream": true, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
                PinReason::Multimodal,
            ),
            (true, json!({"stream": true, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}), PinReason::Multimodal),
            (true, json!({"stream": true, "thinking_token_budget": 2048}), PinReason::ServerParsed),
        ];
        for (chat, body, want) in cases {
            assert_eq!(pin_reason(chat, &body), Some(want), "{body}");
        }
    }
}
