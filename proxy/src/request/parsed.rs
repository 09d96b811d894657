//! A request body parsed once, for kv routing and for following the stream: every top-level
//! field as a JSON value, except a prompt of token ids, which is read straight into a vector.
//! A `Value` per id costs a 32-byte value each and a parse far slower than reading the ids
//! alone, and a long prompt of ids is most of its body.
//!
//! What it accepts, and the values it holds, are what a `serde_json::Value` parse of the same
//! body gives: a prompt that is not a non-empty list of `u32` (text, a batch, a list with
//! anything else in it) stays a value in `fields`, and a key given twice keeps its last value.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

use super::fields::PromptIds;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;

/// A parsed request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBody {
    /// Its top-level fields (an object), `prompt` among them unless it is token ids.
    pub fields: Value,
    /// The prompt, when it is a list of token ids.
    pub prompt_ids: Option<Vec<u32>>,
}

impl ParsedBody {
    /// Parses a JSON object.
    pub fn parse(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    /// Parses a JSON object whose one `prompt`, a list of token ids, was read already: only
    /// the rest of the body is parsed, and the ids are taken as they are. The same value as
    /// [`Self::parse`], or an error where it has one (whose position may differ).
    pub fn parse_with(body: &[u8], prompt: Option<PromptIds>) -> Result<Self, serde_json::Error> {
        let Some(PromptIds { ids, span }) = prompt else { return Self::parse(body) };
        let mut rest = Vec::with_capacity(body.len() - span.len() + 4);
        rest.extend_from_slice(&body[..span.start]);
        rest.extend_from_slice(b"null");
        rest.extend_from_slice(&body[span.end..]);
        let mut parsed = Self::parse(&rest)?;
        // The `null` stood in for the ids; the other fields keep their order.
        if let Value::Object(fields) = &mut parsed.fields {
            fields.shift_remove("prompt");
        }
        parsed.prompt_ids = Some(ids);
        Ok(parsed)
    }
}

impl<'de> Deserialize<'de> for ParsedBody {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = ParsedBody;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ParsedBody, A::Error> {
        let mut fields = Map::new();
        let mut prompt_ids = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != "prompt" {
                fields.insert(key, map.next_value()?);
                continue;
            }
            // The last `prompt` wins, whichever form each one had.
            match map.next_value::<Prompt>()?.0 {
                Piece::Ids(ids) => {
                    fields.shift_remove("prompt");
                    prompt_ids = Some(ids);
                }
                other => {
                    prompt_ids = None;
                    fields.insert(key, other.into_value());
                }
            }
        }
        Ok(ParsedBody { fields: Value::Object(fields), prompt_ids })
    }
}

/// A prompt, or one element of a prompt list: token ids, one token id, or any other JSON value.
enum Piece {
    Ids(Vec<u32>),
    Id(u32),
    Other(Value),
}

/// A prompt (`list: true`: a list is read as ids while it holds only ids) or one element of a
/// prompt list (a number that fits a `u32` is an id).
struct PieceVisitor {
    list: bool,
}

/// `prompt`'s value.
struct Prompt(Piece);

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PieceVisitor { list: true }).map(Prompt)
    }
}

/// An element of a prompt list.
struct Item(Piece);

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PieceVisitor { list: false }).map(Item)
    }
}

impl<'de> Visitor<'de> for PieceVisitor {
    type Value = Piece;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Piece, A::Error> {
        if !self.list {
            return Value::deserialize(SeqAccessDeserializer::new(seq)).map(Piece::Other);
        }
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(Item(item)) = seq.next_element()? {
            match item {
                Piece::Id(id) => ids.push(id),
                other => {
                    // Not ids after all: the whole list as values, as a `Value` parse gives it.
                    let mut all: Vec<Value> = ids.into_iter().map(Value::from).collect();
                    all.push(other.into_value());
                    while let Some(v) = seq.next_element::<Value>()? {
                        all.push(v);
                    }
                    return Ok(Piece::Other(Value::Array(all)));
                }
            }
        }
        Ok(if ids.is_empty() { Piece::Other(Value::Array(Vec::new())) } else { Piece::Ids(ids) })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Piece, A::Error> {
        Value::deserialize(MapAccessDeserializer::new(map)).map(Piece::Other)
    }

    fn visit_u64<E: Error>(self, n: u64) -> Result<Piece, E> {
        Ok(match u32::try_from(n) {
            Ok(id) if !self.list => Piece::Id(id),
            _ => Piece::Other(Value::from(n)),
        })
    }

    fn visit_i64<E: Error>(self, n: i64) -> Result<Piece, E> {
        Ok(Piece::Other(Value::from(n)))
    }

    fn visit_f64<E: Error>(self, n: f64) -> Result<Piece, E> {
        Ok(Piece::Other(Value::from(n)))
    }

    fn visit_str<E: Error>(self, s: &str) -> Result<Piece, E> {
        Ok(Piece::Other(Value::String(s.to_owned())))
    }

    fn visit_string<E: Error>(self, s: String) -> Result<Piece, E> {
        Ok(Piece::Other(Value::String(s)))
    }

    fn visit_bool<E: Error>(self, b: bool) -> Result<Piece, E> {
        Ok(Piece::Other(Value::Bool(b)))
    }

    fn visit_unit<E: Error>(self) -> Result<Piece, E> {
        Ok(Piece::Other(Value::Null))
    }
}

impl Piece {
    /// As a JSON value.
    fn into_value(self) -> Value {
        match self {
            Piece::Ids(ids) => Value::from(ids),
            Piece::Id(id) => Value::from(id),
            Piece::Other(v) => v,
        }
    }
}

/// The output limit a request body sets: `max_tokens` (completions, chat, Messages),
/// `max_completion_tokens` (chat) or `max_output_tokens` (Responses), the first one present.
pub fn output_limit(fields: &Value) -> Option<u64> {
    ["max_tokens", "max_completion_tokens", "max_output_tokens"].iter().find_map(|k| fields.get(*k)?.as_u64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What a `Value` parse of `body` gives, in this form.
    fn as_value(p: &ParsedBody) -> Value {
        let mut v = p.fields.clone();
        if let Some(ids) = &p.prompt_ids {
            v["prompt"] = json!(ids);
        }
        v
    }

    #[test]
    fn a_prompt_of_ids_is_read_into_a_vector_and_everything_else_stays_a_value() {
        let p = ParsedBody::parse(br#"{"model":"m","prompt":[5,6,7],"stream":true}"#).unwrap();
        assert_eq!(p.prompt_ids, Some(vec![5, 6, 7]));
        assert_eq!(p.fields.get("prompt"), None);
        assert_eq!(p.fields.get("stream"), Some(&json!(true)));
        for body in [
            json!({"prompt": "text"}),
            json!({"prompt": [[1, 2], [3]]}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": [1, -2, 3]}),
            json!({"prompt": [1, 2, 4294967296u64]}),
            json!({"prompt": [1, 2.5]}),
            json!({"prompt": [1, null, {"a": [1]}, [2]]}),
            json!({"prompt": []}),
            json!({"prompt": null}),
            json!({"prompt": {"x": 1}}),
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}),
        ] {
            let p = ParsedBody::parse(body.to_string().as_bytes()).unwrap();
            assert_eq!(p.prompt_ids, None, "{body}");
            assert_eq!(p.fields, body, "the same values as a Value parse");
        }
    }

    /// Whether `body`'s ids, when the scan reads them on the way, give the parse a whole body
    /// gets; and whether it read them.
    fn same_with_ids_read_on_the_way(body: &[u8]) -> bool {
        let Ok((_, prompt)) = super::super::fields::read(body, true) else { return false };
        let read = prompt.is_some();
        let with = ParsedBody::parse_with(body, prompt);
        assert_eq!(with.ok(), ParsedBody::parse(body).ok(), "{}", String::from_utf8_lossy(body));
        read
    }

    #[test]
    fn ids_read_on_the_way_give_the_same_parse() {
        let prompts = [
            "[1,2,3]",
            "[ 0 , 4294967295 ]",
            "[ 7 ]",
            "[4294967296]",
            "[12345678901]",
            "[1,2.5]",
            "[1e2]",
            "[1E2]",
            "[01]",
            "[00]",
            "[-1]",
            "[1,-0]",
            "[]",
            "[ ]",
            "[1,]",
            "[1 2]",
            "[[1,2]]",
            "[1,\"a\"]",
            "\"text\"",
            "null",
            "[1,2",
        ];
        let others = [r#""model":"m""#, r#""stream":true"#, r#""x":[1,2]"#, r#""n":{"prompt":[5]}"#, r#""prompt":[9]"#, r#""prompt":"t""#];
        let mut read = 0;
        for prompt in prompts {
            for (i, a) in others.iter().enumerate() {
                for b in &others[i..] {
                    for fields in [vec![*a, "PROMPT", *b], vec!["PROMPT", *a], vec![*b, "PROMPT"], vec!["PROMPT"]] {
                        let body = format!("{{{}}}", fields.join(",")).replace("PROMPT", &format!("\"prompt\": {prompt}"));
                        read += usize::from(same_with_ids_read_on_the_way(body.as_bytes()));
                    }
                }
            }
        }
        assert!(read > 50, "ids were read on the way in {read} bodies only");
        assert!(!same_with_ids_read_on_the_way(br#"{"prompt":[1],"prompt":[2]}"#), "a repeated prompt is parsed whole");
    }

    /// Bodies made of JSON's pieces in random order: wherever the scan reads ids, the parse
    /// around them is the whole body's, and nothing panics.
    #[allow(clippy::cast_possible_truncation, reason = "random test data: bytes and indices are the low bits of a hash sequence")]
    #[test]
    fn ids_read_on_the_way_agree_on_random_bodies() {
        let pieces = ["{", "}", "[", "]", ",", ":", " ", "\"prompt\"", "\"model\"", "\"m\"", "1", "42", "0", "01", "-3", "2.5", "4294967296", "null", "[1,2]"];
        let mut seq = kvgate_kv::hash::sequence(3);
        let mut next = move || seq() as usize;
        let mut read = 0;
        for _ in 0..100_000 {
            let mut body = String::from("{\"prompt\":[");
            (0..next() % 12).for_each(|_| body.push_str(pieces[next() % pieces.len()]));
            body.push_str(if next() % 2 == 0 { "]}" } else { "}" });
            read += usize::from(same_with_ids_read_on_the_way(body.as_bytes()));
        }
        assert!(read > 100, "ids were read on the way in {read} bodies only");
    }

    #[test]
    fn it_agrees_with_a_value_parse_on_order_duplicates_and_errors() {
        for raw in [
            r#"{"a":1,"prompt":[1,2],"b":{"c":[1.5,"x"]}}"#,
            r#"{"prompt":"first","prompt":[9,8]}"#,
            r#"{"prompt":[9,8],"prompt":"last"}"#,
            r#"{"prompt":[9,8],"x":1,"prompt":[7]}"#,
            r#"{"n":1,"n":2}"#,
        ] {
            let p = ParsedBody::parse(raw.as_bytes()).unwrap();
            let v: Value = serde_json::from_str(raw).unwrap();
            assert_eq!(as_value(&p), v, "{raw}");
            let keys: Vec<&String> = p.fields.as_object().unwrap().keys().collect();
            let expected: Vec<&String> = v.as_object().unwrap().keys().filter(|k| p.prompt_ids.is_none() || *k != "prompt").collect();
            assert_eq!(keys, expected, "field order kept: {raw}");
        }
        for bad in [&b"[1,2]"[..], b"{\"prompt\":[1,2}", b"{\"prompt\":[1,]}", b"{\"a\":1", b"nope"] {
            assert_eq!(
                ParsedBody::parse(bad).is_err(),
                serde_json::from_slice::<Value>(bad).map_or(true, |v| !v.is_object()),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
