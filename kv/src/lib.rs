//! The KV-cache index: for any token sequence, how many of its leading blocks each worker
//! already holds in its KV cache, kept current from vLLM's own KV events.
//!
//! - [`hash`]: kvgate's chained block hash (the same function for requests and events);
//! - [`id_list`]: a JSON list of token ids read straight from the bytes (long prompts);
//! - [`event`]: decoding vLLM's msgpack event batches (both encodings);
//! - [`index`]: the [`index::KvIndex`] trait, a reference tree and the lock-free flat index;
//! - [`applier`]: per-worker ingestion state (engine hash → our hash, sequence tracking);
//! - [`subscriber`]: the ZMQ SUB task per worker endpoint, with replay;
//! - [`approx`]: approximate mode (no events): routing decisions with a TTL and size pruning.

pub mod applier;
pub mod approx;
pub mod event;
pub mod hash;
pub mod id_list;
pub mod index;
pub mod metrics;
pub mod subscriber;
