//! KV cache events and their msgpack wire encoding, byte-identical to what vLLM 0.33's
//! msgspec encoder writes (docs/vllm-interface.md, "KV event batches", "Event kinds and fields"
//! and "Map and array encodings").
//!
//! A batch is the positional array `[ts: f64, events, data_parallel_rank]`. Events are tagged
//! maps (`"type"` first; vLLM ≥ #42892) by default, or the older positional arrays. Block hashes
//! are msgpack ints (the digest's last 8 bytes, vLLM's default) or 32-byte `bin` digests, as
//! vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` chooses ([`HashFormat`]). msgspec
//! writes a struct with more than 15 possible fields as a map16/array16 header even when fewer
//! fields are present, so `BlockStored` starts with `de 00 0b` / `dc 00 10`; that is kept here so
//! captures from the simulator and from vLLM can be compared byte for byte.
//!
//! Publishing (ZMQ sockets, sequence numbers, replay) lives in `publisher`.

use crate::block_hash::BlockHash;
use rmp::encode as mp;

/// One KV cache event, as vLLM's `KVCacheEvent` subclasses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// New full blocks were cached; `token_ids` holds all their tokens, concatenated.
    BlockStored {
        /// The blocks' hashes, in chain order.
        block_hashes: Vec<BlockHash>,
        /// The hash of the block before the first one (none: the prompt's start).
        parent_block_hash: Option<BlockHash>,
        /// Every token of the blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The blocks' LoRA adapter and extra hash keys.
        keys: BlockKeys,
    },
    /// Cached blocks were evicted (vLLM sends one hash per event).
    BlockRemoved {
        /// The evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// What a `BlockStored` says about its blocks' extra hash keys (vLLM 0.32's `lora_id`,
/// `lora_name` and `extra_keys`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// The LoRA adapter's id and name; `None` for the base model.
    pub lora: Option<(u32, String)>,
    /// Per block, the untagged extra keys in vLLM's order (the LoRA name, then the
    /// `cache_salt` on the prompt's first block), `None` for a block without any; empty when no
    /// block has any (published as a list of nils, as vLLM does).
    pub extra_keys: Vec<Option<Vec<String>>>,
}

/// Which msgpack layout events use on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// Tagged maps, vLLM ≥ 0.26 (#42892).
    #[default]
    Map,
    /// Positional arrays, vLLM before #42892.
    Array,
}

/// How block hashes go on the wire: vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`
/// (`vllm/envs.py`, read by `maybe_convert_block_hash` in `vllm/v1/core/kv_cache_utils.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashFormat {
    /// `=1`, vLLM's default: a msgpack int, the digest's last 8 bytes read big-endian.
    #[default]
    Int,
    /// `=0`: a msgpack `bin`, the whole 32-byte digest.
    Bytes,
}

impl HashFormat {
    /// The environment variable vLLM reads.
    pub const ENV: &'static str = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES";

    /// Reads the variable's value as vLLM does (`bool(int(value))`, unset = `"1"`); a value
    /// that is not an integer is an error, as it is for vLLM.
    pub fn from_env_value(value: Option<&str>) -> Result<Self, String> {
        let Some(v) = value else { return Ok(Self::Int) };
        match v.trim().parse::<i64>() {
            Ok(0) => Ok(Self::Bytes),
            Ok(_) => Ok(Self::Int),
            Err(_) => Err(format!("{}={v:?}: not an integer (0: 32-byte hashes, 1: 64-bit ints)", Self::ENV)),
        }
    }
}

const MEDIUM_GPU: &str = "GPU";
const SPEC_KIND: &str = "full_attention";

/// Encodes one `KVEventBatch` as vLLM does.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, format: EventFormat, hashes: HashFormat) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    // Writes into a Vec cannot fail.
    let _ = mp::write_array_len(&mut buf, 3);
    let _ = mp::write_f64(&mut buf, ts);
    let _ = mp::write_array_len(&mut buf, events.len() as u32);
    for ev in events {
        match format {
            EventFormat::Map => encode_map(&mut buf, ev, hashes),
            EventFormat::Array => encode_array(&mut buf, ev, hashes),
        }
    }
    let _ = mp::write_uint(&mut buf, u64::from(dp_rank));
    buf
}

fn write_hash(buf: &mut Vec<u8>, h: &BlockHash, format: HashFormat) {
    match format {
        HashFormat::Int => {
            let _ = mp::write_uint(buf, h.wire_id());
        }
        HashFormat::Bytes => {
            let _ = mp::write_bin(buf, &h.0);
        }
    }
}

fn write_hashes(buf: &mut Vec<u8>, hashes: &[BlockHash], format: HashFormat) {
    let _ = mp::write_array_len(buf, hashes.len() as u32);
    for h in hashes {
        write_hash(buf, h, format);
    }
}

fn write_tokens(buf: &mut Vec<u8>, tokens: &[u32]) {
    let _ = mp::write_array_len(buf, tokens.len() as u32);
    for &t in tokens {
        let _ = mp::write_uint(buf, u64::from(t));
    }
}

fn write_parent(buf: &mut Vec<u8>, parent: Option<&BlockHash>, format: HashFormat) {
    match parent {
        Some(h) => write_hash(buf, h, format),
        None => {
            let _ = mp::write_nil(buf);
        }
    }
}

fn write_opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => key(buf, s),
        None => {
            let _ = mp::write_nil(buf);
        }
    }
}

fn write_lora_id(buf: &mut Vec<u8>, keys: &BlockKeys) {
    match &keys.lora {
        Some((id, _)) => {
            let _ = mp::write_uint(buf, u64::from(*id));
        }
        None => {
            let _ = mp::write_nil(buf);
        }
    }
}

/// `extra_keys`: one entry per block, nil or the list of its untagged keys.
fn write_extra_keys(buf: &mut Vec<u8>, keys: &BlockKeys, blocks: usize) {
    let _ = mp::write_array_len(buf, blocks as u32);
    for i in 0..blocks {
        match keys.extra_keys.get(i).and_then(Option::as_ref) {
            Some(list) => {
                let _ = mp::write_array_len(buf, list.len() as u32);
                list.iter().for_each(|k| key(buf, k));
            }
            None => {
                let _ = mp::write_nil(buf);
            }
        }
    }
}

fn key(buf: &mut Vec<u8>, k: &str) {
    let _ = mp::write_str(buf, k);
}

fn encode_map(buf: &mut Vec<u8>, ev: &KvEvent, hashes: HashFormat) {
    match ev {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, keys } => {
            buf.extend_from_slice(&[0xde, 0x00, 11]);
            key(buf, "type");
            key(buf, "BlockStored");
            key(buf, "block_hashes");
            write_hashes(buf, block_hashes, hashes);
            key(buf, "parent_block_hash");
            write_parent(buf, parent_block_hash.as_ref(), hashes);
            key(buf, "token_ids");
            write_tokens(buf, token_ids);
            key(buf, "block_size");
            let _ = mp::write_uint(buf, u64::from(*block_size));
            key(buf, "lora_id");
            write_lora_id(buf, keys);
            key(buf, "medium");
            key(buf, MEDIUM_GPU);
            key(buf, "lora_name");
            write_opt_str(buf, keys.lora.as_ref().map(|(_, n)| n.as_str()));
            key(buf, "extra_keys");
            write_extra_keys(buf, keys, block_hashes.len());
            key(buf, "group_idx");
            let _ = mp::write_uint(buf, 0);
            key(buf, "kv_cache_spec_kind");
            key(buf, SPEC_KIND);
        }
        KvEvent::BlockRemoved { block_hashes } => {
            let _ = mp::write_map_len(buf, 4);
            key(buf, "type");
            key(buf, "BlockRemoved");
            key(buf, "block_hashes");
            write_hashes(buf, block_hashes, hashes);
            key(buf, "medium");
            key(buf, MEDIUM_GPU);
            key(buf, "group_idx");
            let _ = mp::write_uint(buf, 0);
        }
        KvEvent::AllBlocksCleared => {
            let _ = mp::write_map_len(buf, 1);
            key(buf, "type");
            key(buf, "AllBlocksCleared");
        }
    }
}

fn encode_array(buf: &mut Vec<u8>, ev: &KvEvent, hashes: HashFormat) {
    match ev {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, keys } => {
            buf.extend_from_slice(&[0xdc, 0x00, 16]);
            key(buf, "BlockStored");
            write_hashes(buf, block_hashes, hashes);
            write_parent(buf, parent_block_hash.as_ref(), hashes);
            write_tokens(buf, token_ids);
            let _ = mp::write_uint(buf, u64::from(*block_size));
            write_lora_id(buf, keys);
            key(buf, MEDIUM_GPU);
            write_opt_str(buf, keys.lora.as_ref().map(|(_, n)| n.as_str()));
            write_extra_keys(buf, keys, block_hashes.len());
            let _ = mp::write_uint(buf, 0); // group_idx
            key(buf, SPEC_KIND);
            for _ in 0..5 {
                // sliding_window, locality, ownership, session_id, lookahead_token_ids
                let _ = mp::write_nil(buf);
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            let _ = mp::write_array_len(buf, 6);
            key(buf, "BlockRemoved");
            write_hashes(buf, block_hashes, hashes);
            key(buf, MEDIUM_GPU);
            let _ = mp::write_uint(buf, 0);
            let _ = mp::write_nil(buf);
            let _ = mp::write_nil(buf);
        }
        KvEvent::AllBlocksCleared => {
            let _ = mp::write_array_len(buf, 1);
            key(buf, "AllBlocksCleared");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hash::hash_block;
    use rmpv::Value;
    use std::fmt::Write as _;

    fn hex(b: &[u8]) -> String {
        b.iter().fold(String::new(), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
    }

    fn vector_events() -> Vec<KvEvent> {
        // hash_block(None, [1, 2, 3, 4]) is the vector's 9561501211280363793 on the wire.
        let h = hash_block(None, &[1, 2, 3, 4]);
        vec![
            KvEvent::BlockStored { block_hashes: vec![h], parent_block_hash: None, token_ids: vec![1, 2, 3, 4], block_size: 4, keys: BlockKeys::default() },
            KvEvent::BlockRemoved { block_hashes: vec![h] },
            KvEvent::AllBlocksCleared,
        ]
    }

    // The two hex strings are msgspec's output for the same batch (docs/vllm-interface.md, "Test vectors").
    #[test]
    fn map_encoding_is_byte_identical_to_vllm() {
        let want = "93cb41d954fc4010000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf84b146b151d55111a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&encode_batch(1700000000.25, &vector_events(), 0, EventFormat::Map, HashFormat::Int)), want);
    }

    #[test]
    fn array_encoding_is_byte_identical_to_vllm() {
        let want = "93cb41d954fc4010000093dc0010ab426c6f636b53746f72656491cf84b146b151d55111c0940102030404c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0c0c0c0c096ac426c6f636b52656d6f76656491cf84b146b151d55111a347505500c0c091b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&encode_batch(1700000000.25, &vector_events(), 0, EventFormat::Array, HashFormat::Int)), want);
    }

    /// A stored event chained to a parent, and a removal, with real digests.
    fn chained_events() -> (Vec<KvEvent>, [BlockHash; 3]) {
        let b0 = hash_block(None, &[1, 2, 3, 4]);
        let b1 = hash_block(Some(&b0), &[5, 6, 7, 8]);
        let b2 = hash_block(Some(&b1), &[9, 10, 11, 12]);
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![b1, b2],
                parent_block_hash: Some(b0),
                token_ids: (5..13).collect(),
                block_size: 4,
                keys: BlockKeys::default(),
            },
            KvEvent::BlockRemoved { block_hashes: vec![b2] },
        ];
        (events, [b0, b1, b2])
    }

    /// The hashes of a decoded event, as (block_hashes, parent_block_hash), from either layout.
    fn decoded_hashes(ev: &Value) -> (Vec<Value>, Option<Value>) {
        match ev {
            Value::Map(m) => {
                let get = |k: &str| m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
                (get("block_hashes").and_then(|v| v.as_array().cloned()).unwrap_or_default(), get("parent_block_hash"))
            }
            Value::Array(a) if a[0].as_str() == Some("BlockStored") => (a[1].as_array().cloned().unwrap_or_default(), Some(a[2].clone())),
            Value::Array(a) => (a[1].as_array().cloned().unwrap_or_default(), None),
            other => panic!("not an event: {other:?}"),
        }
    }

    #[test]
    fn both_hash_formats_carry_the_same_digest_in_both_layouts() {
        let (events, [b0, b1, b2]) = chained_events();
        for layout in [EventFormat::Map, EventFormat::Array] {
            let decode = |hashes| {
                let bytes = encode_batch(1.5, &events, 0, layout, hashes);
                let batch = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
                batch.as_array().unwrap()[1].as_array().unwrap().iter().map(decoded_hashes).collect::<Vec<_>>()
            };
            let ints = decode(HashFormat::Int);
            let full = decode(HashFormat::Bytes);
            // Int: msgpack uints, the digests' last 8 bytes.
            let int = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("{layout:?}: not an int: {v:?}"));
            assert_eq!(ints[0].0.iter().map(int).collect::<Vec<_>>(), vec![b1.wire_id(), b2.wire_id()]);
            assert_eq!(ints[0].1.as_ref().map(int), Some(b0.wire_id()));
            assert_eq!(ints[1].0.iter().map(int).collect::<Vec<_>>(), vec![b2.wire_id()]);
            // Bytes: msgpack bin of 32 bytes, the whole digest; its last 8 bytes are the int form.
            let bin = |v: &Value| match v {
                Value::Binary(b) => b.clone(),
                other => panic!("{layout:?}: not a bin: {other:?}"),
            };
            let stored: Vec<Vec<u8>> = full[0].0.iter().map(bin).collect();
            assert_eq!(stored, vec![b1.0.to_vec(), b2.0.to_vec()]);
            assert!(stored.iter().all(|b| b.len() == 32));
            let parent = full[0].1.as_ref().map(bin).unwrap();
            assert_eq!(parent, b0.0.to_vec());
            assert_eq!(full[1].0.iter().map(bin).collect::<Vec<_>>(), vec![b2.0.to_vec()]);
            for (b, i) in stored.iter().chain([&parent]).zip([b1.wire_id(), b2.wire_id(), b0.wire_id()]) {
                assert_eq!(u64::from_be_bytes(b[24..].try_into().unwrap()), i, "{layout:?}");
            }
        }
        // The 32-byte form is a bin8 (`c4 20`), as msgspec writes `bytes`.
        let bytes = encode_batch(0.0, &events[1..], 0, EventFormat::Map, HashFormat::Bytes);
        let at = bytes.windows(2).position(|w| w == [0xc4, 0x20]).expect("bin8 header");
        assert_eq!(&bytes[at + 2..at + 34], &b2.0);
    }

    // A salted LoRA request's first store, as vLLM 0.32 publishes it (captured from a real
    // server: `lora_id` 1, `lora_name`, `extra_keys` [["tiny-lora", "s1"], ["tiny-lora"]]).
    #[test]
    fn lora_and_salt_keys_are_published_as_vllm_publishes_them() {
        let keys =
            BlockKeys { lora: Some((1, "tiny-lora".into())), extra_keys: vec![Some(vec!["tiny-lora".into(), "s1".into()]), Some(vec!["tiny-lora".into()])] };
        let h = hash_block(None, &[1]);
        let ev = KvEvent::BlockStored { block_hashes: vec![h, h], parent_block_hash: None, token_ids: vec![1, 2], block_size: 1, keys };
        let map = hex(&encode_batch(0.0, std::slice::from_ref(&ev), 0, EventFormat::Map, HashFormat::Int));
        let want = "a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a974696e792d6c6f7261aa65787472615f6b6579739292a974696e792d6c6f7261a2733191a974696e792d6c6f7261";
        assert!(map.contains(want), "{map}");
        // The positional form has them at indices 5, 7 and 8.
        let arr = encode_batch(0.0, &[ev], 0, EventFormat::Array, HashFormat::Int);
        let batch = rmpv::decode::read_value(&mut arr.as_slice()).unwrap();
        let stored = batch[1][0].as_array().unwrap().clone();
        assert_eq!(stored[5], Value::from(1));
        assert_eq!(stored[7], Value::from("tiny-lora"));
        assert_eq!(stored[8], Value::Array(vec![Value::Array(vec!["tiny-lora".into(), "s1".into()]), Value::Array(vec!["tiny-lora".into()])]));
        // A salted base-model request: the salt alone on block 0, nil after it.
        let keys = BlockKeys { lora: None, extra_keys: vec![Some(vec!["s1".into()])] };
        let ev = KvEvent::BlockStored { block_hashes: vec![h, h], parent_block_hash: None, token_ids: vec![1, 2], block_size: 1, keys };
        let map = hex(&encode_batch(0.0, &[ev], 0, EventFormat::Map, HashFormat::Int));
        assert!(map.contains("a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a27331c0"), "{map}");
    }

    #[test]
    fn the_environment_variable_reads_as_vllm_reads_it() {
        assert_eq!(HashFormat::from_env_value(None), Ok(HashFormat::Int));
        assert_eq!(HashFormat::from_env_value(Some("1")), Ok(HashFormat::Int));
        assert_eq!(HashFormat::from_env_value(Some("0")), Ok(HashFormat::Bytes));
        assert_eq!(HashFormat::from_env_value(Some(" 0 ")), Ok(HashFormat::Bytes));
        assert_eq!(HashFormat::from_env_value(Some("2")), Ok(HashFormat::Int));
        assert!(HashFormat::from_env_value(Some("false")).unwrap_err().contains(HashFormat::ENV));
    }
}
