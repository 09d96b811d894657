use super::*;
use crate::event::Stored;
use crate::hash::DEFAULT_SEED;
use crate::index::{FlatIndex, KvIndex};

const BS: usize = 4;

fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> Event {
    Event::Stored(Stored {
        hashes: hashes.to_vec(),
        parent,
        token_ids: (0..(hashes.len() * BS) as u32).map(|t| first_token + t).collect(),
        block_size: BS,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        spec_kind: None,
        extras: Vec::new(),
    })
}

fn payload(events: Vec<Event>) -> Vec<u8> {
    // Re-encode through the simulator's encoder would couple crates; build msgpack by hand.
    let mut b = Vec::new();
    rmp::encode::write_array_len(&mut b, 3).unwrap();
    rmp::encode::write_f64(&mut b, 1.0).unwrap();
    rmp::encode::write_array_len(&mut b, events.len() as u32).unwrap();
    for e in events {
        match e {
            Event::Stored(s) => {
                rmp::encode::write_array_len(&mut b, 5).unwrap();
                rmp::encode::write_str(&mut b, "BlockStored").unwrap();
                rmp::encode::write_array_len(&mut b, s.hashes.len() as u32).unwrap();
                for h in s.hashes {
                    rmp::encode::write_uint(&mut b, h).unwrap();
                }
                match s.parent {
                    Some(p) => rmp::encode::write_uint(&mut b, p).map(|_| ()).unwrap(),
                    None => rmp::encode::write_nil(&mut b).unwrap(),
                }
                rmp::encode::write_array_len(&mut b, s.token_ids.len() as u32).unwrap();
                for t in s.token_ids {
                    rmp::encode::write_uint(&mut b, u64::from(t)).unwrap();
                }
                rmp::encode::write_uint(&mut b, s.block_size as u64).unwrap();
            }
            Event::Removed { hashes, .. } => {
                rmp::encode::write_array_len(&mut b, 2).unwrap();
                rmp::encode::write_str(&mut b, "BlockRemoved").unwrap();
                rmp::encode::write_array_len(&mut b, hashes.len() as u32).unwrap();
                for h in hashes {
                    rmp::encode::write_uint(&mut b, h).unwrap();
                }
            }
            Event::AllCleared => {
                rmp::encode::write_array_len(&mut b, 1).unwrap();
                rmp::encode::write_str(&mut b, "AllBlocksCleared").unwrap();
            }
        }
    }
    rmp::encode::write_uint(&mut b, 0).unwrap();
    b
}

fn chain_of(first_token: u32, blocks: usize) -> Vec<u64> {
    let toks: Vec<u32> = (0..(blocks * BS) as u32).map(|t| first_token + t).collect();
    Hasher::new(BS, DEFAULT_SEED).chain(None, &toks)
}

fn setup(replay: bool) -> (Applier, FlatIndex) {
    (Applier::new(3, Hasher::new(BS, DEFAULT_SEED), replay), FlatIndex::new(8, 64))
}

#[test]
fn stores_are_rehashed_from_tokens_and_removals_follow_engine_hashes() {
    let (mut a, idx) = setup(true);
    // Engine hashes 100, 101 are opaque: the index sees our own chained hashes.
    assert_eq!(a.on_message(0, &payload(vec![stored(&[100, 101], None, 0)]), &idx), Action::Continue);
    let ours = chain_of(0, 2);
    assert_eq!(idx.find_matches(&ours).get(3), 2);
    // A continuation under engine parent 101 extends the chain.
    let toks: Vec<u32> = (0..3 * BS as u32).collect();
    let full = Hasher::new(BS, DEFAULT_SEED).chain(None, &toks);
    a.on_message(1, &payload(vec![stored(&[102], Some(101), 2 * BS as u32)]), &idx);
    assert_eq!(idx.find_matches(&full).get(3), 3);
    a.on_message(2, &payload(vec![Event::Removed { hashes: vec![101], medium: None, group_idx: None }]), &idx);
    assert_eq!(idx.find_matches(&full).get(3), 1, "removing 101 drops it and its child");
    a.on_message(3, &payload(vec![Event::AllCleared]), &idx);
    assert_eq!(idx.block_count(3), 0);
    assert_eq!(a.counts().applied, [2, 1, 1]);
}

#[test]
fn a_gap_asks_for_replay_then_applies() {
    let (mut a, idx) = setup(true);
    a.on_message(0, &payload(vec![stored(&[100], None, 0)]), &idx);
    let live = payload(vec![stored(&[102], Some(101), 2 * BS as u32)]);
    assert_eq!(a.on_message(2, &live, &idx), Action::Replay { from: 1 });
    // The replay delivers seq 1 (and the live one again), then the live message is re-offered.
    assert_eq!(a.on_replayed(1, &payload(vec![stored(&[101], Some(100), BS as u32)]), &idx), Action::Continue);
    assert_eq!(a.on_replayed(2, &live, &idx), Action::Continue);
    assert_eq!(a.last_seq(), Some(2), "the replay covered the live message: no re-offer needed");
    assert_eq!(idx.block_count(3), 3);
    assert_eq!(a.counts().gaps, 1);
}

#[test]
fn sequence_going_back_is_a_restart_and_clears_the_worker() {
    let (mut a, idx) = setup(false);
    a.on_message(0, &payload(vec![stored(&[100, 101], None, 0)]), &idx);
    a.on_message(1, &payload(vec![stored(&[200], None, 50)]), &idx);
    assert_eq!(idx.block_count(3), 3);
    assert_eq!(a.on_message(0, &payload(vec![stored(&[300], None, 90)]), &idx), Action::Continue);
    assert_eq!(idx.block_count(3), 1, "only the restarted engine's block remains");
    assert_eq!(a.counts().restarts, 1);
}

#[test]
fn an_unknown_parent_clears_and_resyncs() {
    let (mut a, idx) = setup(true);
    a.on_message(0, &payload(vec![stored(&[100], None, 0)]), &idx);
    assert_eq!(a.on_message(1, &payload(vec![stored(&[501], Some(500), 7)]), &idx), Action::Resync);
    assert_eq!(idx.block_count(3), 0);
    assert_eq!(a.counts().unknown_parents, 1);
    assert_eq!(a.last_seq(), None, "the resync replays from the start");
}

#[test]
fn malformed_and_foreign_events_are_counted_not_applied() {
    let (mut a, idx) = setup(false);
    assert_eq!(a.on_message(0, b"\xc1garbage", &idx), Action::Continue);
    let mut cpu = match stored(&[100], None, 0) {
        Event::Stored(s) => s,
        _ => unreachable!(),
    };
    cpu.medium = Some("CPU".into());
    let batch = Batch { ts: 1.0, events: vec![Event::Stored(cpu)], dp_rank: None };
    a.apply_batch(&batch, &idx).unwrap();
    let mut wrong = match stored(&[100], None, 0) {
        Event::Stored(s) => s,
        _ => unreachable!(),
    };
    wrong.block_size = 2;
    wrong.token_ids.truncate(2);
    a.apply_batch(&Batch { ts: 1.0, events: vec![Event::Stored(wrong)], dp_rank: None }, &idx).unwrap();
    let c = a.counts();
    assert_eq!((c.malformed, c.ignored, c.block_size_mismatch), (1, 1, 1));
    assert_eq!(idx.block_count(3), 0);
}

#[test]
fn a_replay_overlapping_the_live_stream_is_not_a_restart() {
    let (mut a, idx) = setup(true);
    a.on_message(0, &payload(vec![stored(&[100], None, 0)]), &idx);
    let m = |h: u64, p: u64, t: u32| payload(vec![stored(&[h], Some(p), t)]);
    // Live seq 2 reveals a gap; the replay returns 1..=3 (3 was also sent live meanwhile).
    assert_eq!(a.on_message(2, &m(102, 101, 8), &idx), Action::Replay { from: 1 });
    a.on_replayed(1, &m(101, 100, 4), &idx);
    a.on_replayed(2, &m(102, 101, 8), &idx);
    a.on_replayed(3, &m(103, 102, 12), &idx);
    // The queued live messages 2 and 3 arrive: already applied, not an engine restart.
    assert_eq!(a.on_message(2, &m(102, 101, 8), &idx), Action::Continue);
    assert_eq!(a.on_message(3, &m(103, 102, 12), &idx), Action::Continue);
    assert_eq!(a.on_message(4, &m(104, 103, 16), &idx), Action::Continue);
    assert_eq!(a.counts().restarts, 0);
    assert_eq!(idx.block_count(3), 5);
}

#[test]
fn unknown_parents_inside_a_replay_are_skipped_not_resynced() {
    let (mut a, idx) = setup(true);
    // Joining mid-stream: the buffer starts with a block chaining from one stored before it.
    assert_eq!(a.on_message(5, &payload(vec![stored(&[300], None, 40)]), &idx), Action::Replay { from: 0 });
    assert_eq!(a.on_replayed(3, &payload(vec![stored(&[201], Some(200), 20)]), &idx), Action::Continue);
    assert_eq!(a.on_replayed(4, &payload(vec![stored(&[210], None, 30)]), &idx), Action::Continue);
    assert_eq!(a.counts().unknown_parents_skipped, 1);
    assert_eq!(idx.block_count(3), 1, "the rest of the buffer still applied");
    // After a failed replay the live message is applied anyway.
    assert_eq!(a.on_message_after_failed_replay(5, &payload(vec![stored(&[300], None, 40)]), &idx), Action::Continue);
    assert_eq!(idx.block_count(3), 2);
    assert_eq!(a.on_message(6, &payload(vec![stored(&[301], Some(300), 44)]), &idx), Action::Continue);
    assert_eq!(idx.block_count(3), 3);
}

#[test]
fn unknown_parents_do_not_resync_again_within_the_cooldown() {
    let (mut a, idx) = setup(true);
    a.on_message(0, &payload(vec![stored(&[100], None, 0)]), &idx);
    assert_eq!(a.on_message(1, &payload(vec![stored(&[501], Some(500), 7)]), &idx), Action::Resync);
    // The subscriber's resync replay delivers the next batch; live traffic then continues.
    assert_eq!(a.on_replayed(2, &payload(vec![stored(&[600], None, 80)]), &idx), Action::Continue);
    // Another orphan right after: skipped and counted, the worker is not wiped again.
    assert_eq!(a.on_message(3, &payload(vec![stored(&[701], Some(700), 90)]), &idx), Action::Continue);
    assert_eq!(a.counts().unknown_parents, 1);
    assert_eq!(a.counts().unknown_parents_skipped, 1);
    assert_eq!(idx.block_count(3), 1, "block 600 survived");
}

/// A stored event with per-block extra digests and a LoRA name.
fn stored_with(hashes: &[u64], parent: Option<u64>, first_token: u32, extras: Vec<Option<u64>>, lora: Option<&str>) -> Batch {
    let Event::Stored(mut s) = stored(hashes, parent, first_token) else { unreachable!() };
    s.extras = extras;
    s.lora_name = lora.map(str::to_owned);
    Batch { ts: 1.0, events: vec![Event::Stored(s)], dp_rank: None }
}

#[test]
fn a_salted_prefix_matches_only_requests_with_the_same_salt() {
    use crate::hash::salt_digest;
    let (mut a, idx) = setup(true);
    let h = Hasher::new(BS, DEFAULT_SEED);
    let toks: Vec<u32> = (0..3 * BS as u32).collect();
    let salt = Some(salt_digest("tenant-a"));
    // vLLM publishes the salt on block 0 only; a later event continues the salted chain.
    a.apply_batch(&stored_with(&[100, 101], None, 0, vec![salt, None], None), &idx).unwrap();
    a.apply_batch(&stored_with(&[102], Some(101), 2 * BS as u32, vec![None], None), &idx).unwrap();
    assert_eq!(idx.find_matches(&h.chain_with(None, &toks, &[salt])).get(3), 3, "the same salt hits all three");
    assert_eq!(idx.find_matches(&h.chain(None, &toks)).get(3), 0, "no salt: no hit");
    assert_eq!(idx.find_matches(&h.chain_with(None, &toks, &[Some(salt_digest("tenant-b"))])).get(3), 0, "another salt: no hit");
    // A salted LoRA request: its own space, the salt on top.
    a.apply_batch(&stored_with(&[200], None, 0, vec![salt], Some("sql")), &idx).unwrap();
    let lora = h.with_lora(Some("sql"));
    assert_eq!(idx.find_matches(&lora.chain_with(None, &toks[..BS], &[salt])).get(3), 1);
    assert_eq!(idx.find_matches(&lora.chain(None, &toks[..BS])).get(3), 0);
    // Removals still follow the engine hashes.
    a.apply_batch(&Batch { ts: 2.0, events: vec![Event::Removed { hashes: vec![101], medium: None, group_idx: None }], dp_rank: None }, &idx).unwrap();
    assert_eq!(idx.find_matches(&h.chain_with(None, &toks, &[salt])).get(3), 1);
}
