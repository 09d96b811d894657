//! Decoding vLLM's KV event batches, robustly (docs/vllm-interface.md: "KV event batches",
//! "Map and array encodings", "Block hashes on the wire"):
//! - a batch is `[ts, events]` or `[ts, events, dp_rank]` (or, defensively, a map with those
//!   keys); `dp_rank` may be nil;
//! - an event is a tagged map (`"type"`, vLLM ≥ 0.26) or a positional array with the tag first
//!   (older vLLM); unknown keys and extra trailing elements are ignored;
//! - block hashes are msgpack ints (any width; negative i64 from old Python `hash()` kept as
//!   their bits) or byte strings (the last 8 bytes, big-endian, as vLLM converts them);
//! - `extra_keys` (vLLM's per-block extra hash keys: the LoRA name first when `lora_name` is set,
//!   then `(mm_identifier, offset)` pairs, the `cache_salt` string, prompt-embeddings digests)
//!   becomes one extra digest per block ([`Stored::extras`], crate::hash's module doc): a salt
//!   alone digests as a request's `cache_salt` does; anything else, and an `extra_keys` whose
//!   shape is not vLLM's (a length other than the block count, an entry that is not a list),
//!   gives opaque digests, so those blocks stay in the index as chain links yet match no text
//!   request;
//! - anything else is a [`DecodeError`]: the caller counts it and skips the batch, never panics.

use rmpv::Value;

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Publish time (seconds since the epoch).
    pub ts: f64,
    /// Events in order.
    pub events: Vec<Event>,
    /// DP rank that published it.
    pub dp_rank: Option<u64>,
}

/// One event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Full blocks were cached.
    Stored(Stored),
    /// Blocks were evicted.
    Removed {
        /// Engine hashes.
        hashes: Vec<u64>,
        /// `"GPU"`, `"CPU"`, … (None = GPU in old versions).
        medium: Option<String>,
        /// KV cache group (None = 0).
        group_idx: Option<u64>,
    },
    /// The whole cache was dropped.
    AllCleared,
}

/// A `BlockStored` event.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// Engine hashes of the stored blocks.
    pub hashes: Vec<u64>,
    /// Engine hash of the block before the first one.
    pub parent: Option<u64>,
    /// Tokens of all stored blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter name (None = base model).
    pub lora_name: Option<String>,
    /// Storage medium.
    pub medium: Option<String>,
    /// KV cache group.
    pub group_idx: Option<u64>,
    /// Attention kind of the group (`full_attention`, `sliding_window`, …).
    pub spec_kind: Option<String>,
    /// Per block, the digest of its extra hash keys other than the LoRA name (`None`: none);
    /// empty when the event has no `extra_keys` at all.
    pub extras: Vec<Option<u64>>,
}

impl Event {
    /// Whether the event is about the GPU prefix cache of the main (full-attention) group, the
    /// only one kvgate indexes. CPU/disk offload tiers and sliding-window groups are ignored:
    /// their blocks do not form prefixes a request can hit on the GPU.
    pub fn is_main_gpu(&self) -> bool {
        let gpu = |m: &Option<String>| m.as_deref().is_none_or(|m| m.eq_ignore_ascii_case("gpu"));
        let main = |g: &Option<u64>| g.is_none_or(|g| g == 0);
        match self {
            Event::Stored(s) => gpu(&s.medium) && main(&s.group_idx) && s.spec_kind.as_deref().is_none_or(|k| matches!(k, "full_attention" | "mla_attention")),
            Event::Removed { medium, group_idx, .. } => gpu(medium) && main(group_idx),
            Event::AllCleared => true,
        }
    }

    /// Event type label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Stored(_) => "stored",
            Event::Removed { .. } => "removed",
            Event::AllCleared => "cleared",
        }
    }
}

/// Why a batch could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KV event batch: {0}")]
pub struct DecodeError(pub String);

fn err<T>(m: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(m.into()))
}

/// Decodes one batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut cur = payload;
    let v = rmpv::decode::read_value(&mut cur).map_err(|e| DecodeError(format!("not msgpack: {e}")))?;
    let (ts, events, rank) = match &v {
        Value::Array(a) if a.len() >= 2 => (&a[0], &a[1], a.get(2)),
        Value::Map(m) => (
            get(m, "ts").ok_or_else(|| DecodeError("batch map without ts".into()))?,
            get(m, "events").ok_or_else(|| DecodeError("batch map without events".into()))?,
            get(m, "data_parallel_rank"),
        ),
        _ => return err("a batch must be [ts, events, dp_rank]"),
    };
    let ts = ts.as_f64().or_else(|| ts.as_i64().map(|i| i as f64)).ok_or_else(|| DecodeError("ts is not a number".into()))?;
    let events = events.as_array().ok_or_else(|| DecodeError("events is not an array".into()))?;
    Ok(Batch { ts, events: events.iter().map(decode_event).collect::<Result<_, _>>()?, dp_rank: rank.and_then(Value::as_u64) })
}

fn get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

fn hash(v: &Value) -> Result<u64, DecodeError> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(i64::cast_unsigned)).ok_or_else(|| DecodeError("hash out of range".into())),
        Value::Binary(b) if b.len() >= 8 => Ok(u64::from_be_bytes(b[b.len() - 8..].try_into().expect("8 bytes"))),
        other => err(format!("a block hash must be an int or ≥ 8 bytes, got {other}")),
    }
}

fn hashes(v: &Value) -> Result<Vec<u64>, DecodeError> {
    v.as_array().ok_or_else(|| DecodeError("block_hashes is not an array".into()))?.iter().map(hash).collect()
}

fn opt_hash(v: Option<&Value>) -> Result<Option<u64>, DecodeError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => hash(v).map(Some),
    }
}

fn tokens(v: &Value) -> Result<Vec<u32>, DecodeError> {
    v.as_array()
        .ok_or_else(|| DecodeError("token_ids is not an array".into()))?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| DecodeError("token id is not a u32".into())))
        .collect()
}

fn opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

fn opt_u64(v: Option<&Value>) -> Option<u64> {
    v.and_then(Value::as_u64)
}

fn block_size(v: Option<&Value>) -> Result<usize, DecodeError> {
    match v.and_then(Value::as_u64) {
        Some(n) if n > 0 => Ok(n as usize),
        _ => err("block_size must be a positive int"),
    }
}

fn check_stored(mut s: Stored, extra_keys: Option<&Value>) -> Result<Event, DecodeError> {
    // A block size of any u64 may come in: the product must not overflow.
    if s.hashes.len().checked_mul(s.block_size) != Some(s.token_ids.len()) {
        return err(format!("{} token ids for {} blocks of {}", s.token_ids.len(), s.hashes.len(), s.block_size));
    }
    s.extras = extras(extra_keys, s.lora_name.as_deref(), s.hashes.len());
    Ok(Event::Stored(s))
}

/// The per-block extra digests of an event's `extra_keys` (the module doc says how).
fn extras(v: Option<&Value>, lora_name: Option<&str>, blocks: usize) -> Vec<Option<u64>> {
    let entries = match v {
        None | Some(Value::Nil) => return Vec::new(),
        Some(Value::Array(a)) if a.len() == blocks => a,
        // Not vLLM's shape: which block a key belongs to is unknown, so none may match.
        Some(other) => return vec![Some(opaque(std::slice::from_ref(other))); blocks],
    };
    let digests: Vec<Option<u64>> = entries
        .iter()
        .map(|e| match e {
            Value::Nil => None,
            Value::Array(keys) => block_extra(keys, lora_name),
            other => Some(opaque(std::slice::from_ref(other))),
        })
        .collect();
    // Nothing but LoRA names (or nils): the plain chain, without a vector to carry.
    if digests.iter().all(Option::is_none) { Vec::new() } else { digests }
}

/// One block's extra digest: its keys less the leading LoRA name; `None` when nothing is left.
fn block_extra(keys: &[Value], lora_name: Option<&str>) -> Option<u64> {
    let rest = match (keys.first(), lora_name) {
        (Some(Value::String(first)), Some(name)) if first.as_str() == Some(name) => &keys[1..],
        _ => keys,
    };
    match rest {
        [] => None,
        [Value::String(salt)] => Some(match salt.as_str() {
            Some(salt) => crate::hash::salt_digest(salt),
            None => opaque(rest),
        }),
        _ => Some(opaque(rest)),
    }
}

/// The opaque digest of some extra keys, over their msgpack encoding.
fn opaque(keys: &[Value]) -> u64 {
    let mut buf = Vec::new();
    for k in keys {
        // Writing into a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut buf, k);
    }
    crate::hash::opaque_digest(&buf)
}

fn decode_event(v: &Value) -> Result<Event, DecodeError> {
    match v {
        Value::Map(m) => match get(m, "type").and_then(Value::as_str) {
            Some("BlockStored") => check_stored(
                Stored {
                    hashes: hashes(get(m, "block_hashes").ok_or_else(|| DecodeError("BlockStored without block_hashes".into()))?)?,
                    parent: opt_hash(get(m, "parent_block_hash"))?,
                    token_ids: tokens(get(m, "token_ids").ok_or_else(|| DecodeError("BlockStored without token_ids".into()))?)?,
                    block_size: block_size(get(m, "block_size"))?,
                    lora_name: opt_str(get(m, "lora_name")),
                    medium: opt_str(get(m, "medium")),
                    group_idx: opt_u64(get(m, "group_idx")),
                    spec_kind: opt_str(get(m, "kv_cache_spec_kind")),
                    extras: Vec::new(),
                },
                get(m, "extra_keys"),
            ),
            Some("BlockRemoved") => Ok(Event::Removed {
                hashes: hashes(get(m, "block_hashes").ok_or_else(|| DecodeError("BlockRemoved without block_hashes".into()))?)?,
                medium: opt_str(get(m, "medium")),
                group_idx: opt_u64(get(m, "group_idx")),
            }),
            Some("AllBlocksCleared") => Ok(Event::AllCleared),
            Some(t) => err(format!("unknown event type {t:?}")),
            None => err("event map without a \"type\""),
        },
        // ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
        //  extra_keys, group_idx, kv_cache_spec_kind, ...]
        Value::Array(a) => match a.first().and_then(Value::as_str) {
            Some("BlockStored") => {
                if a.len() < 5 {
                    return err("BlockStored array too short");
                }
                check_stored(
                    Stored {
                        hashes: hashes(&a[1])?,
                        parent: opt_hash(Some(&a[2]))?,
                        token_ids: tokens(&a[3])?,
                        block_size: block_size(Some(&a[4]))?,
                        medium: opt_str(a.get(6)),
                        lora_name: opt_str(a.get(7)),
                        group_idx: opt_u64(a.get(9)),
                        spec_kind: opt_str(a.get(10)),
                        extras: Vec::new(),
                    },
                    a.get(8),
                )
            }
            // ["BlockRemoved", hashes, medium, group_idx, ...]
            Some("BlockRemoved") if a.len() >= 2 => Ok(Event::Removed { hashes: hashes(&a[1])?, medium: opt_str(a.get(2)), group_idx: opt_u64(a.get(3)) }),
            Some("AllBlocksCleared") => Ok(Event::AllCleared),
            Some(t) => err(format!("unknown or short event {t:?}")),
            None => err("event array without a tag"),
        },
        other => err(format!("an event must be a map or an array, got {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn vector_batch() -> Batch {
        Batch {
            ts: 1700000000.25,
            events: vec![
                Event::Stored(Stored {
                    hashes: vec![9561501211280363793],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 4,
                    lora_name: None,
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    spec_kind: Some("full_attention".into()),
                    extras: Vec::new(),
                }),
                Event::Removed { hashes: vec![9561501211280363793], medium: Some("GPU".into()), group_idx: Some(0) },
                Event::AllCleared,
            ],
            dp_rank: Some(0),
        }
    }

    // docs/vllm-interface.md, "Test vectors": msgspec's encoding of the same batch, map and array forms.
    #[test]
    fn decodes_the_vllm_test_vectors() {
        let map = "93cb41d954fc4010000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf84b146b151d55111a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
        let arr = "93cb41d954fc4010000093dc0010ab426c6f636b53746f72656491cf84b146b151d55111c0940102030404c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0c0c0c0c096ac426c6f636b52656d6f76656491cf84b146b151d55111a347505500c0c091b0416c6c426c6f636b73436c656172656400";
        assert_eq!(decode_batch(&unhex(map)).unwrap(), vector_batch());
        assert_eq!(decode_batch(&unhex(arr)).unwrap(), vector_batch());
    }

    #[test]
    fn accepts_bin_and_negative_hashes_short_batches_and_unknown_fields() {
        // [ts, [{"type":"BlockStored","block_hashes":[bin32],"parent_block_hash":-5,"token_ids":[7],"block_size":1,"future":1}]]
        let mut b = Vec::new();
        rmp::encode::write_array_len(&mut b, 2).unwrap();
        rmp::encode::write_f64(&mut b, 1.5).unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        rmp::encode::write_map_len(&mut b, 6).unwrap();
        rmp::encode::write_str(&mut b, "type").unwrap();
        rmp::encode::write_str(&mut b, "BlockStored").unwrap();
        rmp::encode::write_str(&mut b, "block_hashes").unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        let mut digest = [0u8; 32];
        digest[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        rmp::encode::write_bin(&mut b, &digest).unwrap();
        rmp::encode::write_str(&mut b, "parent_block_hash").unwrap();
        rmp::encode::write_sint(&mut b, -5).unwrap();
        rmp::encode::write_str(&mut b, "token_ids").unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        rmp::encode::write_uint(&mut b, 7).unwrap();
        rmp::encode::write_str(&mut b, "block_size").unwrap();
        rmp::encode::write_uint(&mut b, 1).unwrap();
        rmp::encode::write_str(&mut b, "future").unwrap();
        rmp::encode::write_uint(&mut b, 1).unwrap();
        let batch = decode_batch(&b).unwrap();
        assert_eq!(batch.dp_rank, None);
        let Event::Stored(s) = &batch.events[0] else { panic!() };
        assert_eq!(s.hashes, vec![0x0102_0304_0506_0708]);
        assert_eq!(s.parent, Some((-5i64).cast_unsigned()));
        assert!(batch.events[0].is_main_gpu());
    }

    #[test]
    fn a_block_size_whose_product_overflows_is_an_error() {
        // Found by the fuzz smoke: two hashes of a block of 0xcfcfcfcfc1ffff01 tokens.
        let found = [
            0x93, 0xcb, 0x3f, 0xf8, 0xd6, 0xff, 0xff, 0xff, 0x00, 0x00, 0x93, 0x97, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd',
            0x92, 0x7b, 0xfb, 0x77, 0x94, 0x3d, 0x00, 0x00, 0x4f, 0xcf, 0xcf, 0xcf, 0xcf, 0xcf, 0xc1, 0xff, 0xff, 0x01, 0x00, 0xff, 0xff, 0xef, 0x6c, 0x94,
            0x00,
        ];
        let e = decode_batch(&found).unwrap_err();
        assert!(e.0.contains("token ids for 2 blocks"), "{e:?}");
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0xc1],
            vec![0x93, 0xcb],
            unhex("92a17801"),                                   // ["x", 1]
            unhex("92cb41d954fc4010000091a3666f6f"),             // [ts, ["foo"]]
            unhex("92cb41d954fc401000009181a474797065a3426164"), // unknown type
        ];
        for c in cases {
            assert!(decode_batch(&c).is_err(), "{c:?}");
        }
        // token_ids not matching block count
        let mut b = Vec::new();
        rmp::encode::write_array_len(&mut b, 2).unwrap();
        rmp::encode::write_f64(&mut b, 1.0).unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        rmp::encode::write_array_len(&mut b, 5).unwrap();
        rmp::encode::write_str(&mut b, "BlockStored").unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        rmp::encode::write_uint(&mut b, 1).unwrap();
        rmp::encode::write_nil(&mut b).unwrap();
        rmp::encode::write_array_len(&mut b, 1).unwrap();
        rmp::encode::write_uint(&mut b, 1).unwrap();
        rmp::encode::write_uint(&mut b, 16).unwrap();
        assert!(decode_batch(&b).unwrap_err().0.contains("token ids"));
    }

    /// A batch of one `BlockStored` of two 1-token blocks, map form (`array: false`) or
    /// positional, with `extra_keys` and `lora_name` as given.
    fn stored_with_extras(extra_keys: Value, lora_name: Option<&str>, array: bool) -> Vec<u8> {
        let lora = lora_name.map_or(Value::Nil, Value::from);
        let hashes = Value::Array(vec![Value::from(11u64), Value::from(12u64)]);
        let tokens = Value::Array(vec![Value::from(5u64), Value::from(6u64)]);
        let event = if array {
            Value::Array(vec!["BlockStored".into(), hashes, Value::Nil, tokens, 1u64.into(), Value::Nil, "GPU".into(), lora, extra_keys])
        } else {
            Value::Map(vec![
                ("type".into(), "BlockStored".into()),
                ("block_hashes".into(), hashes),
                ("parent_block_hash".into(), Value::Nil),
                ("token_ids".into(), tokens),
                ("block_size".into(), 1u64.into()),
                ("lora_name".into(), lora),
                ("extra_keys".into(), extra_keys),
            ])
        };
        let mut b = Vec::new();
        rmpv::encode::write_value(&mut b, &Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])])).unwrap();
        b
    }

    fn decoded_extras(extra_keys: Value, lora_name: Option<&str>) -> Vec<Option<u64>> {
        let map = decode_batch(&stored_with_extras(extra_keys.clone(), lora_name, false)).unwrap();
        let arr = decode_batch(&stored_with_extras(extra_keys, lora_name, true)).unwrap();
        let extras = |b: Batch| match b.events.into_iter().next() {
            Some(Event::Stored(s)) => s.extras,
            other => panic!("{other:?}"),
        };
        let (m, a) = (extras(map), extras(arr));
        assert_eq!(m, a, "map and array forms agree");
        m
    }

    fn list(items: Vec<Value>) -> Value {
        Value::Array(items)
    }

    // vLLM 0.32's `to_event_extra_keys` of a salted LoRA request is `[("sql", "s1"), ("sql",)]`.
    #[test]
    fn a_salt_digests_as_the_request_side_and_the_lora_name_is_not_an_extra() {
        use crate::hash::salt_digest;
        let salt = Some(salt_digest("s1"));
        assert_eq!(decoded_extras(list(vec![list(vec!["s1".into()]), Value::Nil]), None), vec![salt, None]);
        assert_eq!(decoded_extras(list(vec![list(vec!["sql".into(), "s1".into()]), list(vec!["sql".into()])]), Some("sql")), vec![salt, None]);
        // The LoRA name alone, or nothing: no extras at all.
        assert_eq!(decoded_extras(list(vec![list(vec!["sql".into()]), list(vec!["sql".into()])]), Some("sql")), Vec::<Option<u64>>::new());
        assert_eq!(decoded_extras(list(vec![Value::Nil, Value::Nil]), None), Vec::<Option<u64>>::new());
        assert_eq!(decoded_extras(Value::Nil, None), Vec::<Option<u64>>::new());
        // A salt that happens to equal the adapter's name is still the salt.
        assert_eq!(decoded_extras(list(vec![list(vec!["sql".into(), "sql".into()]), Value::Nil]), Some("sql"))[0], Some(salt_digest("sql")));
    }

    #[test]
    fn multimodal_embeds_and_bad_shapes_are_opaque_never_a_panic() {
        let odd = |v: &[Option<u64>]| v.iter().all(|d| d.is_some_and(|d| d & 1 == 1));
        let mm = list(vec!["a1b2".into(), 0u64.into()]);
        // (mm_identifier, offset) pairs, with or without a salt after them.
        let e = decoded_extras(list(vec![list(vec![mm.clone()]), list(vec![mm.clone(), "s1".into()])]), None);
        assert!(odd(&e), "{e:?}");
        assert_ne!(e[0], e[1]);
        // A prompt-embeddings digest (bytes).
        assert!(odd(&decoded_extras(list(vec![list(vec![Value::Binary(vec![7; 32])]), list(vec![Value::Binary(vec![8; 32])])]), None)));
        // Not vLLM's shape: a length other than the block count, entries that are not lists,
        // `extra_keys` that is not a list, a salt that is not UTF-8.
        for bad in [list(vec![list(vec!["s1".into()])]), list(vec!["s1".into(), Value::Nil]), Value::from(3u64)] {
            let e = decoded_extras(bad.clone(), None);
            assert!(e.first().is_some_and(|d| d.is_some_and(|d| d & 1 == 1)), "{bad}: {e:?}");
        }
        // A salt that is not UTF-8 (the msgpack str `QQ` patched to two invalid bytes).
        let mut b = stored_with_extras(list(vec![list(vec!["QQ".into()]), Value::Nil]), None, false);
        let at = b.windows(3).position(|w| w == [0xa2, b'Q', b'Q']).unwrap();
        b[at + 1..at + 3].copy_from_slice(&[0xff, 0xfe]);
        let Event::Stored(s) = &decode_batch(&b).unwrap().events[0] else { panic!() };
        assert!(s.extras[0].is_some_and(|d| d & 1 == 1), "{:?}", s.extras);
    }

    #[test]
    fn non_gpu_and_non_main_groups_are_not_indexed() {
        let mut s = match &vector_batch().events[0] {
            Event::Stored(s) => s.clone(),
            _ => unreachable!(),
        };
        s.medium = Some("CPU".into());
        assert!(!Event::Stored(s.clone()).is_main_gpu());
        s.medium = None;
        s.group_idx = Some(1);
        assert!(!Event::Stored(s.clone()).is_main_gpu());
        s.group_idx = None;
        s.spec_kind = Some("sliding_window".into());
        assert!(!Event::Stored(s).is_main_gpu());
    }
}
