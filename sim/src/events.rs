//! KV cache events and their msgpack wire encoding, byte-identical to what vLLM 0.33's
//! msgspec encoder writes (docs/vllm-interface.md, "KV event batches", "Event kinds and fields"
//! and "Map and array encodings").
//!
//! A batch is the positional array `[ts: f64, events, data_parallel_rank]`. Events are tagged
//! maps (`"type"` first; vLLM ≥ #42892) by default, or the older positional arrays. msgspec
//! writes a struct with more than 15 possible fields as a map16/array16 header even when fewer
//! fields are present, so `BlockStored` starts with `de 00 0b` / `dc 00 10`; that is kept here so
//! captures from the simulator and from vLLM can be compared byte for byte.
//!
//! Publishing (ZMQ sockets, sequence numbers, replay) lives in `publisher`.

use rmp::encode as mp;

/// One KV cache event, as vLLM's `KVCacheEvent` subclasses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// New full blocks were cached; `token_ids` holds all their tokens, concatenated.
    BlockStored {
        /// The blocks' hashes, in chain order.
        block_hashes: Vec<u64>,
        /// The hash of the block before the first one (none: the prompt's start).
        parent_block_hash: Option<u64>,
        /// Every token of the blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Cached blocks were evicted (vLLM sends one hash per event).
    BlockRemoved {
        /// The evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
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

const MEDIUM_GPU: &str = "GPU";
const SPEC_KIND: &str = "full_attention";

/// Encodes one `KVEventBatch` as vLLM does.
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32, format: EventFormat) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    // Writes into a Vec cannot fail.
    let _ = mp::write_array_len(&mut buf, 3);
    let _ = mp::write_f64(&mut buf, ts);
    let _ = mp::write_array_len(&mut buf, events.len() as u32);
    for ev in events {
        match format {
            EventFormat::Map => encode_map(&mut buf, ev),
            EventFormat::Array => encode_array(&mut buf, ev),
        }
    }
    let _ = mp::write_uint(&mut buf, u64::from(dp_rank));
    buf
}

fn write_hashes(buf: &mut Vec<u8>, hashes: &[u64]) {
    let _ = mp::write_array_len(buf, hashes.len() as u32);
    for &h in hashes {
        let _ = mp::write_uint(buf, h);
    }
}

fn write_tokens(buf: &mut Vec<u8>, tokens: &[u32]) {
    let _ = mp::write_array_len(buf, tokens.len() as u32);
    for &t in tokens {
        let _ = mp::write_uint(buf, u64::from(t));
    }
}

fn write_opt_u64(buf: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => {
            let _ = mp::write_uint(buf, v);
        }
        None => {
            let _ = mp::write_nil(buf);
        }
    }
}

fn write_nil_list(buf: &mut Vec<u8>, n: usize) {
    let _ = mp::write_array_len(buf, n as u32);
    for _ in 0..n {
        let _ = mp::write_nil(buf);
    }
}

fn key(buf: &mut Vec<u8>, k: &str) {
    let _ = mp::write_str(buf, k);
}

fn encode_map(buf: &mut Vec<u8>, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            buf.extend_from_slice(&[0xde, 0x00, 11]);
            key(buf, "type");
            key(buf, "BlockStored");
            key(buf, "block_hashes");
            write_hashes(buf, block_hashes);
            key(buf, "parent_block_hash");
            write_opt_u64(buf, *parent_block_hash);
            key(buf, "token_ids");
            write_tokens(buf, token_ids);
            key(buf, "block_size");
            let _ = mp::write_uint(buf, u64::from(*block_size));
            key(buf, "lora_id");
            let _ = mp::write_nil(buf);
            key(buf, "medium");
            key(buf, MEDIUM_GPU);
            key(buf, "lora_name");
            let _ = mp::write_nil(buf);
            key(buf, "extra_keys");
            write_nil_list(buf, block_hashes.len());
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
            write_hashes(buf, block_hashes);
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

fn encode_array(buf: &mut Vec<u8>, ev: &KvEvent) {
    match ev {
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
            buf.extend_from_slice(&[0xdc, 0x00, 16]);
            key(buf, "BlockStored");
            write_hashes(buf, block_hashes);
            write_opt_u64(buf, *parent_block_hash);
            write_tokens(buf, token_ids);
            let _ = mp::write_uint(buf, u64::from(*block_size));
            let _ = mp::write_nil(buf); // lora_id
            key(buf, MEDIUM_GPU);
            let _ = mp::write_nil(buf); // lora_name
            write_nil_list(buf, block_hashes.len()); // extra_keys
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
            write_hashes(buf, block_hashes);
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

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn vector_events() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored { block_hashes: vec![9561501211280363793], parent_block_hash: None, token_ids: vec![1, 2, 3, 4], block_size: 4 },
            KvEvent::BlockRemoved { block_hashes: vec![9561501211280363793] },
            KvEvent::AllBlocksCleared,
        ]
    }

    // The two hex strings are msgspec's output for the same batch (docs/vllm-interface.md, "Test vectors").
    #[test]
    fn map_encoding_is_byte_identical_to_vllm() {
        let want = "93cb41d954fc4010000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf84b146b151d55111a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&encode_batch(1700000000.25, &vector_events(), 0, EventFormat::Map)), want);
    }

    #[test]
    fn array_encoding_is_byte_identical_to_vllm() {
        let want = "93cb41d954fc4010000093dc0010ab426c6f636b53746f72656491cf84b146b151d55111c0940102030404c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0c0c0c0c096ac426c6f636b52656d6f76656491cf84b146b151d55111a347505500c0c091b0416c6c426c6f636b73436c656172656400";
        assert_eq!(hex(&encode_batch(1700000000.25, &vector_events(), 0, EventFormat::Array)), want);
    }
}
