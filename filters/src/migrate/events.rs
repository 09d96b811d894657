//! Server-Sent Events as a moving stream needs them: whole events out of arbitrary body chunks
//! ([`EventSplitter`]), the JSON payload of an event ([`payload`]), and the token id fields the
//! gateway asked for removed from an event the client did not ask them for
//! ([`strip_token_ids`]), byte for byte otherwise, reading them on the way when asked
//! ([`strip_and_read_ids`]).
//!
//! vLLM frames every event as one `data: <json>` line followed by a blank line.

use bytes::{Bytes, BytesMut};

/// Longest event kept while waiting for its end (a runaway worker cannot grow it further).
pub const MAX_EVENT: usize = 4 * 1024 * 1024;

/// Cuts a byte stream into whole events (each ending with its blank line).
#[derive(Debug, Default)]
pub struct EventSplitter {
    buf: BytesMut,
}

/// An event longer than [`MAX_EVENT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a server-sent event exceeded {MAX_EVENT} bytes")]
pub struct EventTooLong;

impl EventSplitter {
    /// Appends a body chunk.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), EventTooLong> {
        if self.buf.len() + chunk.len() > MAX_EVENT && end_of_event(&self.buf).is_none() && end_of_event(chunk).is_none() {
            return Err(EventTooLong);
        }
        self.buf.extend_from_slice(chunk);
        Ok(())
    }

    /// The next whole event, terminator included.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = end_of_event(&self.buf)?;
        Some(self.buf.split_to(end).freeze())
    }

    /// Bytes of an unfinished event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Takes whatever is left (an unfinished event at the end of a body).
    pub fn take_rest(&mut self) -> Bytes {
        self.buf.split().freeze()
    }
}

/// Where the first event in `b` ends (just past its blank line: a line end, `\n` or `\r\n`,
/// followed by an empty line). One pass over the bytes: a chunk can hold many events, and this
/// runs once per event.
fn end_of_event(b: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &b[from..]).map(|i| from + i) {
        match (b.get(i + 1), b.get(i + 2)) {
            (Some(b'\n'), _) => return Some(i + 2),
            (Some(b'\r'), Some(b'\n')) => return Some(i + 3),
            _ => from = i + 1,
        }
    }
    None
}

/// The text after `data:` (one optional space) in an event, without the line end.
pub fn payload(event: &[u8]) -> Option<&[u8]> {
    let line = event.strip_prefix(b"data:")?;
    let line = line.strip_prefix(b" ").unwrap_or(line);
    let end = memchr::memchr2(b'\n', b'\r', line).unwrap_or(line.len());
    Some(&line[..end])
}

/// Whether an event is the end marker `data: [DONE]` (blanks around it allowed). Looks only
/// at the event's start: this runs once per event.
pub fn is_done(event: &[u8]) -> bool {
    let Some(rest) = event.strip_prefix(b"data:").map(<[u8]>::trim_ascii_start).and_then(|p| p.strip_prefix(b"[DONE]")) else { return false };
    rest.iter().take_while(|&&b| b != b'\n' && b != b'\r').all(u8::is_ascii_whitespace)
}

/// `event` without its `"prompt_token_ids"` and `"token_ids"` members (and their comma).
/// JSON escapes every quote inside a string, so `"token_ids":` can only be a key.
pub fn strip_token_ids(event: &[u8]) -> Vec<u8> {
    strip(event, None).unwrap_or_default()
}

/// The token id lists an event carried, as [`strip_and_read_ids`] read them, wherever they were
/// in it (vLLM puts the prompt's at the top level for chat and in the one choice for
/// completions, the generated ones in the choice).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventIds {
    /// `prompt_token_ids` (`None`: absent or `null`).
    pub prompt: Option<Vec<u32>>,
    /// `token_ids` (`None`: absent or `null`).
    pub generated: Option<Vec<u32>>,
}

/// [`strip_token_ids`], and the lists it removed, read on the way: a first event carries the
/// whole prompt's ids, which a JSON parse took several times as long to read. `None` when
/// a list is neither `null` nor plain decimal `u32`s, or a key comes twice (several choices):
/// such an event is for a JSON parser to read whole.
pub fn strip_and_read_ids(event: &[u8]) -> Option<(Vec<u8>, EventIds)> {
    let mut ids = EventIds::default();
    strip(event, Some(&mut ids)).map(|out| (out, ids))
}

/// [`strip_token_ids`], reading what it removes into `read` when given (`None` as
/// [`strip_and_read_ids`] says; never without `read`).
fn strip(event: &[u8], mut read: Option<&mut EventIds>) -> Option<Vec<u8>> {
    const KEY: &[u8] = b"\"token_ids\":";
    const PROMPT_KEY: &[u8] = b"\"prompt_token_ids\":";
    let mut out = Vec::with_capacity(event.len());
    let mut seen = (false, false);
    let mut i = 0;
    while i < event.len() {
        // Both keys start with a quote: the bytes up to the next one go over as they are (a
        // first event carries the whole prompt's ids, tens of KiB).
        let quote = memchr::memchr(b'"', &event[i..]).map_or(event.len(), |p| i + p);
        out.extend_from_slice(&event[i..quote]);
        i = quote;
        if i == event.len() {
            break;
        }
        let (key_len, prompt) = if event[i..].starts_with(KEY) {
            (KEY.len(), false)
        } else if event[i..].starts_with(PROMPT_KEY) {
            (PROMPT_KEY.len(), true)
        } else {
            out.push(b'"');
            i += 1;
            continue;
        };
        let value_end = match read.as_deref_mut() {
            None => skip_value(event, i + key_len),
            Some(ids) => {
                let (slot, twice) = if prompt { (&mut ids.prompt, &mut seen.0) } else { (&mut ids.generated, &mut seen.1) };
                if std::mem::replace(twice, true) {
                    return None;
                }
                let (list, end) = kvgate_kv::id_list::read_nullable(event, i + key_len)?;
                *slot = list;
                end
            }
        };
        // Whitespace around the member goes with it, so the comma beside it is found whichever
        // side it is on (the event stays valid JSON with any separators).
        while out.last().is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r')) {
            out.pop();
        }
        let after = kvgate_kv::id_list::skip_ws(event, value_end);
        if out.last() == Some(&b',') {
            // `,"token_ids":[…]` → nothing.
            out.pop();
            i = after;
        } else {
            // `{"token_ids":[…],` → `{`.
            i = if event.get(after) == Some(&b',') { after + 1 } else { after };
        }
    }
    Some(out)
}

/// The index just past the JSON value (an id list, `null` or a number) starting at `i`.
fn skip_value(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    let mut depth = 0usize;
    while let Some(&c) = b.get(i) {
        match c {
            b'[' | b'{' => depth += 1,
            b']' | b'}' | b',' if depth == 0 => return i,
            b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// The `data:` payloads of a named-event stream (`event: <type>` + `data: <json>`, as the
/// Anthropic and Responses streams are), parsed, each checked against its `event:` name. For
/// the converters' tests.
#[cfg(test)]
pub(crate) fn typed_events(stream: &str) -> Vec<serde_json::Value> {
    stream
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap();
            let v: serde_json::Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(name.strip_prefix("event: "), v["type"].as_str(), "{e}");
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_cut_whole_across_chunks() {
        let mut s = EventSplitter::default();
        s.push(b"data: {\"a\":1}\n\ndata: {\"b\"").unwrap();
        assert_eq!(s.next_event().as_deref(), Some(&b"data: {\"a\":1}\n\n"[..]));
        assert_eq!(s.next_event(), None);
        s.push(b":2}\r\n\r\ndata: [DONE]\n\n").unwrap();
        assert_eq!(s.next_event().as_deref(), Some(&b"data: {\"b\":2}\r\n\r\n"[..]));
        let done = s.next_event().unwrap();
        assert!(is_done(&done));
        assert!(is_done(b"data:[DONE]\r\n\r\n") && is_done(b"data:  [DONE] \n\n") && is_done(b"data: [DONE]"));
        assert!(!is_done(b"data: [DONE]x\n\n") && !is_done(b"data: {\"t\":\"[DONE]\"}\n\n") && !is_done(b": [DONE]\n\n"));
        assert_eq!(payload(&done), Some(&b"[DONE]"[..]));
        assert_eq!(s.pending(), 0);
    }

    #[test]
    fn the_earliest_blank_line_ends_an_event_whatever_its_line_ends() {
        let mut s = EventSplitter::default();
        s.push(b"data: 1\r\n\r\ndata: 2\n\ndata: 3\n\r\ndata: 4\r\n\ndata: 5\n").unwrap();
        let got: Vec<Bytes> = std::iter::from_fn(|| s.next_event()).collect();
        let want: [&[u8]; 4] = [b"data: 1\r\n\r\n", b"data: 2\n\n", b"data: 3\n\r\n", b"data: 4\r\n\n"];
        assert_eq!(got, want);
        assert_eq!(&s.take_rest()[..], b"data: 5\n");
    }

    #[test]
    fn a_runaway_event_is_refused() {
        let mut s = EventSplitter::default();
        assert_eq!(s.push(&vec![b'x'; MAX_EVENT + 1]), Err(EventTooLong));
    }

    #[test]
    fn token_ids_are_stripped_and_nothing_else_changes() {
        let e = br#"data: {"id":"c","choices":[{"index":0,"text":"\"token_ids\": no","logprobs":null,"prompt_token_ids":[1,2],"token_ids":[7]}]}"#;
        let want = br#"data: {"id":"c","choices":[{"index":0,"text":"\"token_ids\": no","logprobs":null}]}"#;
        assert_eq!(String::from_utf8(strip_token_ids(e)).unwrap(), String::from_utf8(want.to_vec()).unwrap());
        let chat = br#"data: {"prompt_token_ids":null,"id":"x","choices":[{"delta":{"content":"a"},"token_ids":[3, 4]}]}"#;
        let want = br#"data: {"id":"x","choices":[{"delta":{"content":"a"}}]}"#;
        assert_eq!(String::from_utf8(strip_token_ids(chat)).unwrap(), String::from_utf8(want.to_vec()).unwrap());
        let plain = b"data: {\"id\":\"x\"}\n\n";
        assert_eq!(strip_token_ids(plain), plain.to_vec());
        let ids: Vec<String> = (0..12_000).map(|i| i.to_string()).collect();
        let long = format!(r#"data: {{"id":"c","choices":[{{"text":"a","prompt_token_ids":[{}],"token_ids":[7]}}]}}"#, ids.join(","));
        assert_eq!(strip_token_ids(long.as_bytes()), br#"data: {"id":"c","choices":[{"text":"a"}]}"#.to_vec());
        assert_eq!(strip_token_ids(b"no quote at all"), b"no quote at all".to_vec());
        assert_eq!(strip_token_ids(b"ends with a quote\""), b"ends with a quote\"".to_vec());
    }

    #[test]
    fn the_stripped_lists_are_read_as_a_json_parser_reads_them() {
        let e = br#"data: {"id":"c","choices":[{"text":"a","prompt_token_ids":[1, 2,4294967295],"token_ids":[ 7 ]}]}"#;
        let (out, ids) = strip_and_read_ids(e).unwrap();
        assert_eq!(out, strip_token_ids(e));
        assert_eq!(ids, EventIds { prompt: Some(vec![1, 2, u32::MAX]), generated: Some(vec![7]) });
        let chat = br#"data: {"prompt_token_ids":null,"choices":[{"delta":{"content":"a"},"token_ids":[]}]}"#;
        assert_eq!(strip_and_read_ids(chat).unwrap().1, EventIds { prompt: None, generated: Some(vec![]) });
        assert_eq!(strip_and_read_ids(b"data: {\"id\":\"x\"}").unwrap().1, EventIds::default());
        // Anything a parser would read otherwise, or two choices' lists: read whole.
        for odd in ["[1,2.0]", "[-1]", "[01]", "[4294967296]", "[1,,2]", "[1,]", "[[1]]", "[\"1\"]", "7", "[1 2]"] {
            let e = format!(r#"data: {{"choices":[{{"text":"a","token_ids":{odd}}}]}}"#);
            assert_eq!(strip_and_read_ids(e.as_bytes()), None, "{odd}");
            assert_eq!(serde_json::from_str::<Option<Vec<u32>>>(odd).ok(), None, "a parser refuses {odd} too");
        }
        let two = br#"data: {"choices":[{"token_ids":[1]},{"token_ids":[2]}]}"#;
        assert_eq!(strip_and_read_ids(two), None);
        // Any JSON separators: what is left is valid JSON either way.
        for (e, want) in [
            (&br#"{"prompt_token_ids":null ,"a":1}"#[..], &br#"{"a":1}"#[..]),
            (br#"{"a":1, "token_ids":[5]}"#, br#"{"a":1}"#),
            (br#"{"a":1 , "token_ids" : [5] }"#, br#"{"a":1 , "token_ids" : [5] }"#),
            (br#"{ "token_ids": [5] , "a": 1 }"#, br#"{ "a": 1 }"#),
        ] {
            assert_eq!(strip_token_ids(e), want.to_vec(), "{}", String::from_utf8_lossy(e));
            assert_eq!(strip_and_read_ids(e).unwrap().0, want.to_vec());
            assert!(serde_json::from_slice::<serde_json::Value>(want).is_ok());
        }
    }
}
