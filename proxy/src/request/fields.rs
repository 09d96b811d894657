//! The request body's routing fields ([`RequestView`]) read in one pass over the bytes, and,
//! when asked, a completion prompt's token ids ([`PromptIds`]) read on the way past them.
//!
//! serde_json, deserializing the view, spent most of its work on a small body checking every
//! string it read. This reader validates the whole body as JSON as strictly as serde_json does,
//! or more so, and reads the few top-level fields routing needs. Whatever it does not handle
//! itself (a key or `model` with escapes, a repeated field, a value of the wrong type, nesting
//! deeper than serde_json allows, anything malformed) it hands to serde_json, so a body it
//! accepts is one serde_json accepts with the same fields, and every refusal carries
//! serde_json's message.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

use super::view::RequestView;
use std::ops::Range;

/// serde_json's own nesting limit: deeper bodies are its to refuse.
const MAX_DEPTH: u32 = 128;

/// A prompt of token ids, read on the way past it: `/v1/completions` bodies of long id prompts
/// are mostly their ids, and parsing them a second time cost more than the rest of admission.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptIds {
    /// The ids.
    pub ids: Vec<u32>,
    /// Where the list is in the body.
    pub span: Range<usize>,
}

/// The view of `body`, or serde_json's reason it is not a valid request body; and with `ids`,
/// the body's one top-level `prompt` when it is a non-empty list of plain decimal `u32`s (what
/// [`ParsedBody`](super::parsed::ParsedBody) reads as ids).
pub fn read(body: &[u8], ids: bool) -> Result<(RequestView, Option<PromptIds>), serde_json::Error> {
    match scan(body, ids) {
        Some(read) => Ok(read),
        None => serde_json::from_slice(body).map(|view| (view, None)),
    }
}

/// The view, when the body is a JSON object this reader handles whole; `None` hands it to
/// serde_json.
fn scan(body: &[u8], ids: bool) -> Option<(RequestView, Option<PromptIds>)> {
    // One pass for the whole body, so strings need no check of their own; a body of ASCII
    // (the usual one) is known valid from a faster word-at-a-time test.
    if !body.is_ascii() {
        std::str::from_utf8(body).ok()?;
    }
    let mut s = Scanner { b: body, i: 0 };
    let mut view = RequestView::default();
    let mut seen = 0u8;
    let mut prompt: Option<PromptIds> = None;
    let mut prompts = 0;
    s.ws();
    s.eat(b'{')?;
    s.ws();
    if s.peek()? == b'}' {
        s.i += 1;
    } else {
        loop {
            s.ws();
            let (key, escaped) = s.string()?;
            if escaped {
                return None;
            }
            s.ws();
            s.eat(b':')?;
            s.ws();
            let start = s.i;
            let mut read_here = false;
            if key == b"prompt" {
                prompts += 1;
                prompt = ids.then(|| s.id_list()).flatten().map(|ids| PromptIds { ids, span: start..s.i });
                read_here = prompt.is_some();
            }
            if !read_here {
                s.i = start;
                s.value(1)?;
            }
            take(&mut view, &mut seen, key, &body[start..s.i])?;
            s.ws();
            match s.next()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    // Two prompts: the last one wins, for the worker as for a parse; not worth reading twice.
    (s.i == body.len()).then_some((view, prompt.filter(|_| prompts == 1)))
}

/// Records member `key` (its value: `raw`) in `view` when the view reads it; `seen` marks the
/// members read. `None` leaves the body to serde_json: a member given twice (an error, its to
/// report) or a value not of the type the view holds.
#[inline]
fn take(view: &mut RequestView, seen: &mut u8, key: &[u8], raw: &[u8]) -> Option<()> {
    let field = match key {
        b"model" => 1,
        b"stream" => 2,
        b"nvext" => 4,
        b"stream_options" => 8,
        _ => return Some(()),
    };
    if *seen & field != 0 {
        return None;
    }
    *seen |= field;
    match field {
        1 => view.model = model(raw).ok()?,
        2 => view.stream = flag(raw).ok()?,
        4 => view.nvext = serde_json::from_slice(raw).ok()?,
        _ => view.stream_options = serde_json::from_slice(raw).ok()?,
    }
    Some(())
}

/// Where the first byte a string cannot simply hold (`"`, `\\` or a control character) is in
/// `s`, eight bytes at a time: most strings are a prompt's plain text.
fn special(s: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let mut at = 0;
    for chunk in s.chunks_exact(8) {
        let w = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        let (quote, slash) = (w ^ (ONES * u64::from(b'"')), w ^ (ONES * u64::from(b'\\')));
        // A byte's high bit is set where it is zero (or below 0x20, for `w` itself); a borrow
        // can only mark bytes above the first true one, so the lowest mark is exact.
        let marks = (quote.wrapping_sub(ONES) & !quote | slash.wrapping_sub(ONES) & !slash | w.wrapping_sub(ONES * 0x20) & !w) & HIGH;
        if marks != 0 {
            return Some(at + (marks.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    s[at..].iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20).map(|k| at + k)
}

/// A field value this reader leaves to serde_json (and with it the whole body).
struct Unhandled;

/// `model`: a string without escapes, or `null`.
fn model(raw: &[u8]) -> Result<Option<String>, Unhandled> {
    match raw {
        b"null" => Ok(None),
        [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => Ok(Some(std::str::from_utf8(inner).map_err(|_| Unhandled)?.to_owned())),
        _ => Err(Unhandled),
    }
}

/// `stream`: a boolean, or `null`.
fn flag(raw: &[u8]) -> Result<Option<bool>, Unhandled> {
    match raw {
        b"true" => Ok(Some(true)),
        b"false" => Ok(Some(false)),
        b"null" => Ok(None),
        _ => Err(Unhandled),
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    fn ws(&mut self) {
        self.i = kvgate_kv::id_list::skip_ws(self.b, self.i);
    }

    /// A value at nesting `depth`.
    fn value(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => self.nested(depth),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    /// An object or an array.
    fn nested(&mut self, depth: u32) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let close = if self.next()? == b'{' { b'}' } else { b']' };
        self.ws();
        if self.peek()? == close {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            if close == b'}' {
                self.string()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
            }
            self.value(depth + 1)?;
            self.ws();
            match self.next()? {
                b',' => {}
                c if c == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// A string; returns its content as written and whether it holds escapes.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        let b: &'a [u8] = self.b;
        loop {
            self.i += special(&b[self.i..])?;
            // A control character must be escaped.
            if b[self.i] < 0x20 {
                return None;
            }
            if b[self.i] == b'"' {
                self.i += 1;
                return Some((&b[start..self.i - 1], escaped));
            }
            escaped = true;
            match *self.b.get(self.i + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
                b'u' => {
                    // Four hex digits exactly (`from_str_radix` alone would take a sign).
                    let hex = self.b.get(self.i + 2..self.i + 6).filter(|h| h.iter().all(u8::is_ascii_hexdigit))?;
                    let n = u16::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
                    // Surrogates (paired or not) are serde_json's to judge.
                    if (0xD800..=0xDFFF).contains(&n) {
                        return None;
                    }
                    self.i += 6;
                }
                _ => return None,
            }
        }
    }

    /// A non-empty list of token ids ([`kvgate_kv::id_list`]); `None` for anything else, with
    /// the position left anywhere: the caller reads the value again as a value.
    fn id_list(&mut self) -> Option<Vec<u32>> {
        let (ids, end) = kvgate_kv::id_list::read(self.b, self.i).filter(|(ids, _)| !ids.is_empty())?;
        self.i = end;
        Some(ids)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.b[self.i..].starts_with(word).then(|| self.i += word.len())
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.digit()?;
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.digit()?;
            self.digits();
        }
        Some(())
    }

    fn digit(&mut self) -> Option<()> {
        self.next().filter(u8::is_ascii_digit).map(drop)
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
    }
}

/// The text of a `multipart/form-data` body's field `name` (an audio request's `model`), or
/// `None` when the body is not such a form or has no such plain field. Only the part headers
/// are looked at; the parts' contents (audio files) are skipped over, never copied.
pub fn form_field(body: &[u8], content_type: &str, name: &str) -> Option<String> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let boundary = params.split(';').find_map(|p| p.trim().strip_prefix("boundary="))?.trim_matches('"');
    let delimiter = format!("--{boundary}");
    let wanted = format!("name=\"{name}\"");
    let mut rest = body;
    while let Some(at) = find(rest, delimiter.as_bytes()) {
        rest = &rest[at + delimiter.len()..];
        let head_end = find(rest, b"\r\n\r\n")?;
        let head = std::str::from_utf8(&rest[..head_end]).ok()?;
        let content = &rest[head_end + 4..];
        let end = find(content, format!("\r\n{delimiter}").as_bytes())?;
        let named = head.lines().any(|l| {
            let l = l.trim();
            l.get(..20).is_some_and(|h| h.eq_ignore_ascii_case("content-disposition:")) && l.split(';').any(|p| p.trim() == wanted)
        });
        if named {
            return std::str::from_utf8(&content[..end]).ok().map(str::to_owned);
        }
        rest = &content[end..];
    }
    None
}

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serde(body: &[u8]) -> Option<RequestView> {
        serde_json::from_slice(body).ok()
    }

    #[test]
    fn usual_bodies_are_read_here_with_serde_jsons_result() {
        let bodies: [&[u8]; 7] = [
            br#"{"model":"m","prompt":"You are a helpful assistant.","max_tokens":16,"stream":false}"#,
            r#" { "model" : "llama-3é" , "messages" : [], "content": "\u00e9", "messages" : [ {"role":"user","content":"hi\nthere \"you\""} ], "stream" : true , "temperature": -0.5e-3 } "#.as_bytes(),
            br#"{"model":null,"stream":null,"n":1,"logit_bias":{"50256":-100},"stop":["\n\n"],"echo":false,"x":[[],{},[1,2.5,-0,1E+2]]}"#,
            br#"{"stream":true,"stream_options":{"include_usage":true},"model":"m"}"#,
            br#"{"model":"m","nvext":{"agent_hints":{"priority":2,"osl":100}},"prompt":[1,2,3]}"#,
            "{\"model\":\"m\",\"prompt\":\"h\u{e9}llo \u{1f600}\"}".as_bytes(),
            b"{}",
        ];
        for b in bodies {
            let here = scan(b, false).map(|r| r.0).unwrap_or_else(|| panic!("not read here: {}", String::from_utf8_lossy(b)));
            assert_eq!(Some(here), serde(b), "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn what_this_reader_leaves_to_serde_json_gets_serde_jsons_answer() {
        let bodies: [&[u8]; 16] = [
            br#"{"model":"m","model":"n"}"#,
            br#"{"mod\u0065l":"m"}"#,
            br#"{"model":"a\"b"}"#,
            br#"{"model":5}"#,
            br#"{"stream":"yes"}"#,
            br#"{"model": "m", "prompt": "#,
            br#"[1, 2]"#,
            br#"{"a":01}"#,
            br#"{"a":1.}"#,
            br#"{"a":"\ud83d\ude00"}"#,
            br#"{"a":"\x"}"#,
            b"{\"a\":\"tab\there\"}",
            br#"{"a":1,}"#,
            br#"{"a":1} x"#,
            b"{\"a\":\"\xff\"}",
            br#"{"a":tru}"#,
        ];
        for b in bodies {
            assert!(scan(b, false).is_none(), "read here: {}", String::from_utf8_lossy(b));
            assert_eq!(read(b, false).ok().map(|r| r.0), serde(b), "{}", String::from_utf8_lossy(b));
        }
        // Deeper than serde_json's limit: its to judge (it skips an ignored value of any depth).
        let deep = |n: usize| format!("{{\"a\":{}{}, \"model\": \"m\"}}", "[".repeat(n), "]".repeat(n));
        assert!(scan(deep(200).as_bytes(), false).is_none());
        assert_eq!(read(deep(200).as_bytes(), false).ok().map(|r| r.0), serde(deep(200).as_bytes()));
        assert_eq!(scan(deep(100).as_bytes(), false).and_then(|v| v.0.model), Some("m".to_string()));
    }

    #[test]
    fn a_prompt_of_ids_is_read_on_the_way_only_when_asked() {
        let body = br#"{"model":"m","prompt": [5, 0,4294967295] ,"stream":true}"#;
        let (view, prompt) = read(body, true).unwrap();
        assert_eq!(view, serde(body).unwrap());
        let prompt = prompt.unwrap();
        assert_eq!(prompt.ids, vec![5, 0, u32::MAX]);
        assert_eq!(&body[prompt.span], b"[5, 0,4294967295]");
        assert_eq!(read(body, false).unwrap().1, None);
        for other in [&br#"{"prompt":"text"}"#[..], br#"{"prompt":[1,2.0]}"#, br#"{"prompt":[]}"#, br#"{"prompt":[[1]]}"#, br#"{"prompt":[1],"prompt":[1]}"#] {
            assert_eq!(read(other, true).unwrap().1, None, "{}", String::from_utf8_lossy(other));
        }
    }

    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn the_word_scan_finds_the_first_special_byte_as_a_byte_loop_does() {
        let mut seq = kvgate_kv::hash::sequence(5);
        let mut next = move || seq() as usize;
        let alphabet = b"ab \"\\\x00\x01\x1f\x20\x21\x7f\x80\xa2\xff\x5b\x5d";
        for _ in 0..100_000 {
            let s: Vec<u8> = (0..next() % 40).map(|_| if next() % 4 == 0 { alphabet[next() % alphabet.len()] } else { b'x' }).collect();
            let want = s.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
            assert_eq!(special(&s), want, "{s:?}");
        }
    }

    /// Valid bodies with a few bytes changed, dropped or added (bytes that matter to JSON's
    /// grammar, control characters, broken UTF-8): accepted here only if serde_json agrees,
    /// whether a prompt's ids are read on the way or not.
    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn a_damaged_body_is_read_here_only_if_serde_json_reads_it_the_same() {
        let seeds: [&[u8]; 3] = [
            br#"{"model":"m","prompt":"a b","max_tokens":16,"stream":false,"t":-0.5e-3,"x":[1,{"y":null}]}"#,
            br#"{"stream":true,"stream_options":{"include_usage":true},"model":"m","s":"q\"\u00e9"}"#,
            br#"{"model":"m","nvext":{"agent_hints":{"priority":2}},"prompt":[1,2,3]}"#,
        ];
        let bytes = b"{}[],:\"0123456789.eE+-tfnul \t\n\x01\x1f\x7f\xc3\xa9\xff\\/u";
        let mut seq = kvgate_kv::hash::sequence(11);
        let mut next = move || seq() as usize;
        for seed in seeds {
            assert!(scan(seed, false).is_some(), "{}", String::from_utf8_lossy(seed));
            for _ in 0..30_000 {
                let mut body = seed.to_vec();
                for _ in 0..=next() % 3 {
                    let at = next() % (body.len() + 1);
                    let b = bytes[next() % bytes.len()];
                    match next() % 3 {
                        0 if at < body.len() => body[at] = b,
                        1 if at < body.len() => drop(body.remove(at)),
                        _ => body.insert(at, b),
                    }
                }
                if let Some((here, _)) = scan(&body, next() % 2 == 0) {
                    assert_eq!(Some(here), serde(&body), "{}", String::from_utf8_lossy(&body));
                }
            }
        }
    }

    /// Bodies made of JSON's pieces in random order, valid or not: whenever this reader accepts
    /// one, serde_json accepts it too, with the same fields; and nothing panics.
    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn whatever_is_read_here_serde_json_reads_the_same() {
        let pieces: [&[u8]; 24] = [
            b"{",
            b"}",
            b"[",
            b"]",
            b",",
            b":",
            b" ",
            b"\"model\"",
            b"\"stream\"",
            b"\"stream_options\"",
            b"\"nvext\"",
            b"\"x\"",
            b"\"m\"",
            b"\"a\\nb\"",
            b"\"\\u00e9\"",
            b"true",
            b"false",
            b"null",
            b"0",
            b"-1.5e3",
            b"12",
            b"\"include_usage\"",
            b"\n",
            b"\"\\\"\"",
        ];
        let mut next = kvgate_kv::hash::sequence(7);
        let mut accepted = 0;
        for _ in 0..200_000 {
            let mut body = b"{".to_vec();
            (0..next() % 14).for_each(|_| body.extend_from_slice(pieces[(next() % pieces.len() as u64) as usize]));
            if !next().is_multiple_of(3) {
                body.push(b'}');
            }
            if let Some((here, _)) = scan(&body, next().is_multiple_of(2)) {
                accepted += 1;
                assert_eq!(Some(here), serde(&body), "{}", String::from_utf8_lossy(&body));
            }
        }
        assert!(accepted > 1000, "the generator made too few valid bodies ({accepted}) to mean anything");
    }

    #[test]
    fn a_forms_model_field_is_read_without_its_files() {
        let ct = "multipart/form-data; boundary=XyZ";
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--\x00\xff\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--XyZ--\r\n";
        assert_eq!(form_field(body, ct, "model").as_deref(), Some("whisper"));
        assert_eq!(form_field(body, ct, "language"), None);
        assert_eq!(form_field(body, "application/json", "model"), None);
        assert_eq!(form_field(b"--XyZ\r\nbroken", ct, "model"), None);
    }
}
