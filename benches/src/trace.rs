//! Mooncake traces (kvcache-ai/Mooncake FAST'25 format): one JSON object per line,
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [..]}`, where
//! `hash_ids` are prefix-chained ids of 512-token blocks (equal ids = a shared prefix). A
//! request becomes a token-id prompt the way vLLM's `timed_trace` dataset and aiperf build one:
//! each hash id expands to a fixed pseudo-random block of token ids, so equal ids give equal
//! tokens and a shared prefix stays shared. Replayed as text (for a router that takes only
//! text), each block is as many words, one token each in vllm-sim's built-in tokenizer.

use crate::Rng;
use serde::Deserialize;
use std::path::Path;

/// Tokens per hash id in Mooncake traces.
pub const TRACE_BLOCK: usize = 512;

/// One trace line.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: usize,
    /// Prefix-chained block ids.
    pub hash_ids: Vec<u64>,
}

/// Reads a trace; errors name the line.
pub fn load(path: &Path) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let r: TraceRequest = serde_json::from_str(l).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?;
            if r.hash_ids.len() != r.input_length.div_ceil(TRACE_BLOCK) {
                return Err(format!(
                    "{}:{}: {} hash ids for {} input tokens (expected one per {TRACE_BLOCK})",
                    path.display(),
                    i + 1,
                    r.hash_ids.len(),
                    r.input_length
                ));
            }
            Ok(r)
        })
        .collect()
}

/// The prompt of `r`: each hash id's block of token ids in `[10, vocab)`, the last block cut to
/// the input length, the whole cut to `max_tokens` (a prefix, so sharing is kept).
pub fn prompt(r: &TraceRequest, vocab: u32, max_tokens: usize) -> Vec<u32> {
    let len = r.input_length.min(max_tokens);
    let mut out = Vec::with_capacity(len);
    for &id in &r.hash_ids {
        let mut rng = block_rng(id);
        for _ in 0..TRACE_BLOCK {
            if out.len() == len {
                return out;
            }
            out.push(10 + (rng.next_u64() % u64::from(vocab.max(11) - 10)) as u32);
        }
    }
    out
}

/// The generator a hash id's block is drawn from: the same for every request naming the id.
pub fn block_rng(id: u64) -> Rng {
    Rng(id.wrapping_mul(kvgate_kv::hash::PHI) | 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], len: usize) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length: len, output_length: 4, hash_ids: ids.to_vec() }
    }

    #[test]
    fn equal_hash_ids_give_equal_tokens_and_lengths_are_exact() {
        let a = prompt(&req(&[1, 2, 3], 1300), 1000, usize::MAX);
        let b = prompt(&req(&[1, 2, 9], 1100), 1000, usize::MAX);
        assert_eq!((a.len(), b.len()), (1300, 1100));
        assert_eq!(a[..1024], b[..1024], "shared prefix blocks");
        assert_ne!(a[1024..1100], b[1024..1100]);
        assert!(a.iter().all(|&t| (10..1000).contains(&t)));
        assert_eq!(prompt(&req(&[1, 2, 3], 1300), 1000, 600), a[..600]);
    }

    #[test]
    fn the_shipped_trace_loads_and_bad_lines_are_located() {
        let t = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake_synthetic_trace.jsonl")).unwrap();
        assert_eq!(t.len(), 3993);
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp), "arrivals in order");
        let dir = std::env::temp_dir().join(format!("kvgate-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n{\"timestamp\": 1}\n").unwrap();
        let e = load(&bad).unwrap_err();
        assert!(e.contains("bad.jsonl:2:"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
