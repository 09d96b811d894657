//! A KV-event subscriber for tests: ZMQ SUB on a target's PUB endpoint, a generic msgpack
//! decoder that accepts both vLLM encodings (tagged maps and positional arrays, hashes as ints
//! or 32-byte bins), and a replay client (DEALER) speaking vLLM's replay framing.
//!
//! This decoder is deliberately independent of the simulator's encoder, so the conformance
//! suite checks the wire format rather than one implementation against itself.

use bytes::Bytes;
use rmpv::Value as Mp;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// A decoded event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// BlockStored.
    Stored {
        /// Block hashes, in chain order.
        hashes: Vec<u64>,
        /// The parent block's hash.
        parent: Option<u64>,
        /// The blocks' tokens.
        tokens: Vec<u32>,
        /// Tokens per block.
        block_size: u64,
    },
    /// BlockRemoved.
    Removed {
        /// Evicted block hashes.
        hashes: Vec<u64>,
    },
    /// AllBlocksCleared.
    Cleared,
}

/// A decoded multipart message.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Topic frame.
    pub topic: Vec<u8>,
    /// Sequence number.
    pub seq: u64,
    /// Batch timestamp.
    pub ts: f64,
    /// Events.
    pub events: Vec<Event>,
    /// DP rank field.
    pub rank: Option<u64>,
    /// The raw msgpack payload.
    pub payload: Vec<u8>,
}

fn hash(v: &Mp) -> u64 {
    match v {
        Mp::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(i64::cast_unsigned)).expect("int hash"),
        Mp::Binary(b) => {
            let tail: [u8; 8] = b[b.len() - 8..].try_into().expect("≥ 8 bytes");
            u64::from_be_bytes(tail)
        }
        other => panic!("block hash must be int or bin, got {other:?}"),
    }
}

fn hashes(v: &Mp) -> Vec<u64> {
    v.as_array().expect("hash list").iter().map(hash).collect()
}

fn tokens(v: &Mp) -> Vec<u32> {
    v.as_array().expect("token list").iter().map(|t| t.as_u64().expect("token id") as u32).collect()
}

/// Decodes one msgpack event in either encoding.
pub fn decode_event(v: &Mp) -> Event {
    match v {
        Mp::Map(kv) => {
            let get = |k: &str| kv.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v);
            match get("type").and_then(Mp::as_str) {
                Some("BlockStored") => Event::Stored {
                    hashes: hashes(get("block_hashes").expect("block_hashes")),
                    parent: get("parent_block_hash").filter(|p| !p.is_nil()).map(hash),
                    tokens: tokens(get("token_ids").expect("token_ids")),
                    block_size: get("block_size").and_then(Mp::as_u64).expect("block_size"),
                },
                Some("BlockRemoved") => Event::Removed { hashes: hashes(get("block_hashes").expect("block_hashes")) },
                Some("AllBlocksCleared") => Event::Cleared,
                other => panic!("unknown event type {other:?}"),
            }
        }
        Mp::Array(a) => match a.first().and_then(Mp::as_str) {
            Some("BlockStored") => Event::Stored {
                hashes: hashes(&a[1]),
                parent: Some(&a[2]).filter(|p| !p.is_nil()).map(hash),
                tokens: tokens(&a[3]),
                block_size: a[4].as_u64().expect("block_size"),
            },
            Some("BlockRemoved") => Event::Removed { hashes: hashes(&a[1]) },
            Some("AllBlocksCleared") => Event::Cleared,
            other => panic!("unknown event tag {other:?}"),
        },
        other => panic!("event must be a map or an array: {other:?}"),
    }
}

/// Decodes a batch payload `[ts, events, dp_rank?]`.
pub fn decode_batch(topic: &[u8], seq: &[u8], payload: &[u8]) -> Batch {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack batch");
    let a = v.as_array().expect("batch is an array");
    assert!(a.len() == 2 || a.len() == 3, "batch has {} elements", a.len());
    Batch {
        topic: topic.to_vec(),
        seq: u64::from_be_bytes(seq.try_into().expect("8-byte seq")),
        ts: a[0].as_f64().expect("ts is a float"),
        events: a[1].as_array().expect("events array").iter().map(decode_event).collect(),
        rank: a.get(2).and_then(Mp::as_u64),
        payload: payload.to_vec(),
    }
}

/// A SUB socket on a target's event stream.
pub struct EventSub {
    sock: SubSocket,
}

impl EventSub {
    /// Connects and subscribes to `topic`.
    pub async fn connect(endpoint: &str, topic: &str) -> Self {
        let mut sock = SubSocket::new();
        sock.connect(endpoint).await.expect("SUB connects");
        sock.subscribe(topic).await.expect("SUB subscribes");
        Self { sock }
    }

    /// The next batch, or `None` after `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Batch> {
        let msg = tokio::time::timeout(timeout, self.sock.recv()).await.ok()?.expect("SUB recv");
        let frames: Vec<Bytes> = msg.into_vec();
        assert_eq!(frames.len(), 3, "multipart message must be [topic, seq, payload]");
        Some(decode_batch(&frames[0], &frames[1], &frames[2]))
    }

    /// Collects batches until `done` says so or `timeout` passes without one.
    pub async fn collect_until(&mut self, timeout: Duration, mut done: impl FnMut(&[Batch]) -> bool) -> Vec<Batch> {
        let mut out = Vec::new();
        while !done(&out) {
            match self.next(timeout).await {
                Some(b) => out.push(b),
                None => break,
            }
        }
        out
    }
}

/// Asks a replay ROUTER for every buffered batch from `start`; returns (seq, decoded batch)
/// until the end marker.
pub async fn replay(endpoint: &str, start: u64) -> Vec<Batch> {
    let mut sock = DealerSocket::new();
    sock.connect(endpoint).await.expect("DEALER connects");
    let req = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]).expect("frames");
    sock.send(req).await.expect("replay request sent");
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), sock.recv()).await.expect("replay reply in time").expect("recv");
        let f = msg.into_vec();
        assert!(f[0].is_empty(), "replay reply starts with an empty delimiter");
        // [ "", topic, seq, payload ] (vLLM ≥ #45177) or [ "", seq, payload ] (older).
        let (topic, seq, payload) = match f.len() {
            4 => (f[1].clone(), f[2].clone(), f[3].clone()),
            3 => (Bytes::new(), f[1].clone(), f[2].clone()),
            n => panic!("unexpected replay frame count {n}"),
        };
        if seq.as_ref() == [0xff; 8] {
            assert!(payload.is_empty(), "end marker has an empty payload");
            return out;
        }
        out.push(decode_batch(&topic, &seq, &payload));
    }
}
