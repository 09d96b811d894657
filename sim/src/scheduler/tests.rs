use super::*;
use crate::block_hash::{hash_block, hash_block_from, none_hash, root_hash};
use crate::scheduler::RemotePrefill;

fn cfg(blocks: usize, budget: usize, seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: blocks,
        max_num_seqs: seqs,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        enable_prefix_caching: true,
        hash_root: none_hash(),
        max_loras: 1,
    }
}

fn sched(c: SchedulerConfig) -> Scheduler {
    Scheduler::new(c, Sampler::new((100..200).collect::<Vec<u32>>().into(), Some(2), 0.0))
}

fn req(id: ReqId, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest { id, prompt, max_tokens, min_tokens: 0, ignore_eos: true, seed: 0, cache_salt: None, lora: None, kv: KvTransfer::None }
}

/// Runs steps until idle; returns tokens per request in order.
fn run(s: &mut Scheduler) -> HashMap<ReqId, Vec<u32>> {
    let mut out: HashMap<ReqId, Vec<u32>> = HashMap::new();
    for _ in 0..10_000 {
        if !s.has_work() {
            return out;
        }
        let step = s.schedule();
        for t in s.update(&step) {
            out.entry(t.id).or_default().push(t.token);
        }
    }
    panic!("scheduler did not drain");
}

fn stored(events: &[KvEvent]) -> Vec<(Vec<u64>, Option<u64>, Vec<u32>)> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } => {
                Some((block_hashes.iter().map(BlockHash::wire_id).collect(), parent_block_hash.map(|p| p.wire_id()), token_ids.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn prefix_reuse_hits_all_but_the_last_token() {
    let mut s = sched(cfg(64, 1024, 8));
    let prompt: Vec<u32> = (1..=16).collect(); // 4 full blocks
    s.add(req(1, prompt.clone(), 2));
    run(&mut s);
    s.add(req(2, prompt.clone(), 2));
    let step = s.schedule();
    // 16 tokens → at most 15 may hit → 3 blocks (12 tokens); the 4 remaining are computed.
    assert_eq!(step.scheduled, vec![(2, 4)]);
    assert_eq!(step.shape.prefill_tokens, 4);
    let c = s.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (32, 12));
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = sched(cfg(128, 32, 8));
    s.add(req(1, (0..100).collect(), 3));
    s.add(req(2, (500..510).collect(), 3));
    let mut firsts = Vec::new();
    let mut sizes = Vec::new();
    for _ in 0..6 {
        let step = s.schedule();
        let total: usize = step.scheduled.iter().map(|&(_, n)| n).sum();
        assert!(total <= 32, "budget exceeded: {total}");
        sizes.push(step.scheduled.clone());
        for t in s.update(&step) {
            if t.first {
                firsts.push(t.id);
            }
        }
    }
    // Request 1 takes the whole budget for 3 steps, then its 4-token tail shares with request 2.
    assert_eq!(sizes[0], vec![(1, 32)]);
    assert_eq!(sizes[1], vec![(1, 32)]);
    assert_eq!(sizes[2], vec![(1, 32)]);
    assert_eq!(sizes[3], vec![(1, 4), (2, 10)]);
    assert_eq!(firsts, vec![1, 2]);
    assert_eq!(sizes[4], vec![(1, 1), (2, 1)], "then both decode");
}

#[test]
fn max_num_seqs_caps_the_running_batch() {
    let mut s = sched(cfg(128, 1024, 2));
    for id in 0..5 {
        s.add(req(id, vec![id as u32 + 1; 5], 4));
    }
    let _ = s.schedule();
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.num_waiting(), 3);
}

#[test]
fn preemption_recomputes_and_output_is_unchanged() {
    // Reference: plenty of blocks, no preemption.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| (i * 50..i * 50 + 8).collect()).collect();
    let mut big = sched(cfg(256, 1024, 8));
    for (i, p) in prompts.iter().enumerate() {
        big.add(req(i as ReqId, p.clone(), 24));
    }
    let want = run(&mut big);
    assert_eq!(big.counters().preemptions, 0);

    // 3 requests of 8 + 24 tokens need 8 blocks each; 16 usable blocks force preemption.
    let mut small = sched(cfg(17, 1024, 8));
    for (i, p) in prompts.iter().enumerate() {
        small.add(req(i as ReqId, p.clone(), 24));
    }
    let got = run(&mut small);
    assert!(small.counters().preemptions > 0, "expected preemption");
    assert_eq!(got, want, "recompute must not change any token");
    assert_eq!(small.pool().num_free(), 16, "every block is back");
}

#[test]
fn preemption_takes_the_last_running_request() {
    let mut s = sched(cfg(9, 1024, 8)); // 8 usable blocks
    s.add(req(1, (0..12).collect(), 100)); // 3 blocks
    s.add(req(2, (100..112).collect(), 100)); // 3 blocks
    let st = s.schedule();
    let _ = s.update(&st);
    // Decode until a block is needed that is not there.
    let mut preempted = Vec::new();
    for _ in 0..40 {
        let step = s.schedule();
        preempted.extend(step.preempted.iter().copied());
        let _ = s.update(&step);
        if !preempted.is_empty() {
            break;
        }
    }
    assert_eq!(preempted, vec![2], "LIFO: the newest running request is preempted");
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn events_cover_prompt_and_decode_blocks_with_chained_parents() {
    let mut s = sched(cfg(64, 1024, 8));
    let prompt: Vec<u32> = (1..=10).collect(); // 2 full blocks + 2 tokens
    s.add(req(1, prompt.clone(), 7)); // 17 tokens total → block 3 fills during decode
    let step = s.schedule();
    let _ = s.update(&step);
    let ev = s.take_events();
    let st = stored(&ev);
    let b0 = hash_block(None, &prompt[0..4]);
    let b1 = hash_block(Some(&b0), &prompt[4..8]);
    assert_eq!(st, vec![(vec![b0.wire_id(), b1.wire_id()], None, prompt[..8].to_vec())]);

    let mut all = Vec::new();
    while s.has_work() {
        let step = s.schedule();
        let _ = s.update(&step);
        all.extend(s.take_events());
    }
    // The third block (tokens 9..12: two prompt tokens + two generated) was stored with
    // parent b1; the fourth (12..16) with parent b2. Finishing emits no BlockRemoved.
    let st = stored(&all);
    assert_eq!(st.len(), 2, "{all:?}");
    assert_eq!(st[0].1, Some(b1.wire_id()));
    assert_eq!(&st[0].2[..2], &prompt[8..10]);
    assert!(all.iter().all(|e| matches!(e, KvEvent::BlockStored { .. })));
}

#[test]
fn a_python_hash_seed_roots_every_chain() {
    let root = root_hash(Some("0"));
    let mut s = sched(SchedulerConfig { hash_root: root, ..cfg(64, 1024, 8) });
    let prompt: Vec<u32> = (1..=8).collect();
    s.add(req(1, prompt.clone(), 1));
    run(&mut s);
    let b0 = hash_block_from(&root, &prompt[0..4]);
    let b1 = hash_block_from(&b0, &prompt[4..8]);
    assert_eq!(stored(&s.take_events())[0].0, vec![b0.wire_id(), b1.wire_id()]);
    assert_ne!(b0, hash_block(None, &prompt[0..4]));
}

#[test]
fn eviction_emits_one_removed_per_hash_tail_blocks_first() {
    let mut s = sched(cfg(5, 1024, 8)); // 4 usable blocks
    s.add(req(1, (1..=13).collect(), 1)); // 3 full + 1 partial block, then done
    run(&mut s);
    let first = s.take_events();
    let hashes = match &stored(&first)[..] {
        [(h, None, _)] => h.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(hashes.len(), 3);
    // A new 8-token prompt needs 2 fresh blocks: the free block, then request 1's last cached one.
    s.add(req(2, (500..508).collect(), 1));
    run(&mut s);
    let ev = s.take_events();
    let removed: Vec<u64> = ev
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes } => Some(block_hashes.iter().map(BlockHash::wire_id).collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(removed, vec![hashes[2]], "the deepest block goes first");
}

#[test]
fn abort_frees_blocks_and_leaves_cache_entries() {
    let mut s = sched(cfg(32, 1024, 8));
    s.add(req(7, (0..20).collect(), 100));
    let step = s.schedule();
    let _ = s.update(&step);
    assert!(s.blocks_of(7).is_some());
    assert!(s.abort(7));
    assert!(!s.abort(7));
    assert_eq!(s.pool().num_free(), 31);
    assert_eq!(s.pool().num_cached_hashes(), 5);
    assert!(!s.has_work());
}

#[test]
fn stop_on_eos_only_after_min_tokens() {
    let c = cfg(64, 1024, 8);
    // Vocabulary of only EOS-free tokens, EOS probability 1: stops as soon as allowed.
    let mut s = Scheduler::new(c, Sampler::new(vec![50u32].into(), Some(2), 1.0));
    s.add(NewRequest { min_tokens: 3, ignore_eos: false, ..req(1, vec![1, 2, 3], 10) });
    let mut toks = Vec::new();
    let mut fin = None;
    while s.has_work() {
        let step = s.schedule();
        for t in s.update(&step) {
            toks.push(t.token);
            fin = t.finish;
        }
    }
    assert_eq!(toks, vec![50, 50, 50, 2]);
    assert_eq!(fin, Some(FinishReason::Stop));
}

/// Prefix-cache hits (tokens) of a request added to `s` after the ones before it ran.
fn hits_of(s: &mut Scheduler, r: NewRequest) -> u64 {
    let before = s.counters().prefix_cache_hits;
    s.add(r);
    run(s);
    s.counters().prefix_cache_hits - before
}

#[test]
fn a_cache_salt_separates_prefixes_as_in_vllm() {
    let mut s = sched(cfg(64, 1024, 8));
    let prompt: Vec<u32> = (1..=17).collect(); // 4 full blocks, all may hit
    let salted = |id, salt: &str| NewRequest { cache_salt: Some(salt.into()), ..req(id, prompt.clone(), 1) };
    assert_eq!(hits_of(&mut s, req(1, prompt.clone(), 1)), 0);
    assert_eq!(hits_of(&mut s, salted(2, "a")), 0, "a salted request does not hit unsalted blocks");
    assert_eq!(hits_of(&mut s, salted(3, "a")), 16, "the same salt hits");
    assert_eq!(hits_of(&mut s, salted(4, "b")), 0, "another salt does not");
    assert_eq!(hits_of(&mut s, req(5, prompt.clone(), 1)), 16, "unsalted still hits unsalted");
    // The salted store carries the salt on block 0 only, and its hashes are vLLM's.
    let events = s.take_events();
    let keys: Vec<&BlockKeys> = events.iter().filter_map(|e| if let KvEvent::BlockStored { keys, .. } = e { Some(keys) } else { None }).collect();
    assert_eq!(keys[0], &BlockKeys::default());
    assert_eq!(keys[1].extra_keys, vec![Some(vec!["a".to_string()]), None, None, None]);
    let b0 = hash_block_with(&none_hash(), &prompt[..4], &[ExtraKey::CacheSalt("a")]);
    assert_eq!(stored(&events)[1].0[..2], [b0.wire_id(), hash_block(Some(&b0), &prompt[4..8]).wire_id()]);
}

fn adapter(id: u32, name: &str) -> Arc<LoraRequest> {
    Arc::new(LoraRequest { id, name: name.into(), path: format!("/lora/{name}"), base_model_name: None })
}

#[test]
fn a_lora_request_hashes_in_its_adapters_space_and_publishes_it() {
    let mut s = sched(cfg(64, 1024, 8));
    let prompt: Vec<u32> = (1..=17).collect();
    let on = |id, name: &str| NewRequest { lora: Some(adapter(1, name)), ..req(id, prompt.clone(), 1) };
    assert_eq!(hits_of(&mut s, req(1, prompt.clone(), 1)), 0);
    assert_eq!(hits_of(&mut s, on(2, "sql")), 0, "the adapter does not hit the base model's blocks");
    assert_eq!(hits_of(&mut s, on(3, "sql")), 16, "its own repeat does");
    let salted = NewRequest { cache_salt: Some("a".into()), ..on(4, "sql") };
    assert_eq!(hits_of(&mut s, salted), 0, "a salt separates within the adapter too");
    let events = s.take_events();
    let keys: Vec<&BlockKeys> = events.iter().filter_map(|e| if let KvEvent::BlockStored { keys, .. } = e { Some(keys) } else { None }).collect();
    let name = |n: &str| Some(vec![n.to_string()]);
    assert_eq!(keys[1].lora, Some((1, "sql".to_string())));
    assert_eq!(keys[1].extra_keys, vec![name("sql"); 4]);
    assert_eq!(keys[2].extra_keys[0], Some(vec!["sql".to_string(), "a".to_string()]), "the name first, then the salt");
    let l = ExtraKey::Lora { name: "sql", path: "/lora/sql" };
    let b0 = hash_block_with(&none_hash(), &prompt[..4], &[l]);
    assert_eq!(stored(&events)[1].0[..2], [b0.wire_id(), hash_block_with(&b0, &prompt[4..8], &[l]).wire_id()]);
}

#[test]
fn at_most_max_loras_adapters_run_and_the_others_wait_their_turn() {
    let mut s = sched(cfg(64, 1024, 8));
    s.add(NewRequest { lora: Some(adapter(1, "a")), ..req(1, vec![1, 2, 3], 3) });
    s.add(NewRequest { lora: Some(adapter(2, "b")), ..req(2, vec![4, 5, 6], 3) });
    s.add(NewRequest { lora: Some(adapter(1, "a")), ..req(3, vec![7, 8, 9], 3) });
    s.add(req(4, vec![10, 11, 12], 3));
    let step = s.schedule();
    let ids: Vec<ReqId> = step.scheduled.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, vec![1, 3, 4], "b waits while a runs; the base model does not count");
    let out = run(&mut s);
    assert_eq!(out[&2].len(), 3, "b runs once a is done");
}

fn remote(blocks: Vec<BlockId>) -> Arc<RemotePrefill> {
    Arc::new(RemotePrefill { engine_id: "p".into(), request_id: "cmpl-1-abcd0123".into(), host: "127.0.0.1".into(), port: 1, block_ids: blocks })
}

fn pull(id: ReqId, prompt: Vec<u32>, max_tokens: usize, blocks: Vec<BlockId>) -> NewRequest {
    NewRequest { kv: KvTransfer::Pull(remote(blocks)), ..req(id, prompt, max_tokens) }
}

/// Runs steps until idle; every output in order.
fn outputs(s: &mut Scheduler) -> Vec<TokenOutput> {
    let mut out = Vec::new();
    while s.has_work() {
        let step = s.schedule();
        out.extend(s.update(&step));
    }
    out
}

#[test]
fn a_prefill_leg_holds_its_blocks_until_released() {
    let mut s = sched(cfg(64, 1024, 8));
    s.add(NewRequest { kv: KvTransfer::Hold, ..req(1, (1..=10).collect(), 1) });
    assert_eq!(run(&mut s)[&1].len(), 1);
    let held = s.held(1).expect("held after it finished");
    assert_eq!((held.block_ids.len(), held.num_tokens, held.num_cached_tokens), (3, 10, 0), "10 tokens in blocks of 4");
    assert_eq!((s.num_held(), s.num_running()), (1, 0));
    assert!((s.kv_usage() - 3.0 / 63.0).abs() < 1e-9, "held blocks are used KV");
    assert!(!s.reset_prefix_cache(false), "blocks in use");
    assert_eq!(s.release_held(1), Some(3));
    assert_eq!((s.kv_usage(), s.num_held(), s.release_held(1)), (0.0, 0, None));
    // A repeat hits the released blocks: they stay cached, as a finished request's.
    s.add(NewRequest { kv: KvTransfer::Hold, ..req(2, (1..=10).collect(), 1) });
    run(&mut s);
    assert_eq!(s.held(2).unwrap().num_cached_tokens, 8);
}

#[test]
fn a_decode_leg_pulls_its_prompt_and_computes_only_the_last_token() {
    let prompt: Vec<u32> = (1..=10).collect();
    let mut agg = sched(cfg(64, 1024, 8));
    agg.add(req(1, prompt.clone(), 5));
    let want = run(&mut agg)[&1].clone();
    let agg_stored = stored(&agg.take_events());

    let mut s = sched(cfg(64, 1024, 8));
    s.add(pull(1, prompt.clone(), 5, vec![7, 8, 9]));
    let step = s.schedule();
    assert!(step.scheduled.is_empty(), "nothing to compute while the KV is pulled");
    assert_eq!(step.loads, vec![LoadStart { id: 1, remote: remote(vec![7, 8, 9]), blocks: Some(vec![7, 8, 9]) }]);
    assert_eq!((s.num_waiting(), s.has_work(), s.pool().num_free()), (1, false, 60), "three blocks taken, out of the queue");
    assert!(s.take_events().is_empty(), "blocks are cached once their KV arrived");
    assert_eq!(s.finish_load(1, LoadOutcome::Loaded), None);
    assert_eq!(stored(&s.take_events()), vec![agg_stored[0].clone()].into_iter().map(|(h, p, t)| (h[..2].to_vec(), p, t[..8].to_vec())).collect::<Vec<_>>());
    let step = s.schedule();
    assert_eq!(step.scheduled, vec![(1, 1)], "only the last prompt token is computed");
    assert_eq!((step.shape.prefill_tokens, step.shape.prefill_attn_pairs), (1, 9.5));
    let mut outs = s.update(&step);
    outs.extend(outputs(&mut s));
    assert_eq!(outs.iter().map(|o| o.token).collect::<Vec<_>>(), want, "the same tokens as aggregated serving");
    assert_eq!((outs[0].num_cached_tokens, outs[0].num_external_tokens, outs[0].num_prompt_tokens), (9, 10, 10));
    let c = s.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (10, 0), "looked up once");
    assert_eq!(s.pool().num_free(), 63);
}

#[test]
fn a_decode_leg_pulls_only_what_its_prefix_cache_lacks() {
    let prompt: Vec<u32> = (1..=10).collect();
    let mut s = sched(cfg(64, 1024, 8));
    s.add(req(1, vec![1, 2, 3, 4, 99], 1));
    run(&mut s);
    s.add(pull(2, prompt, 2, vec![7, 8, 9]));
    let step = s.schedule();
    assert_eq!(step.loads[0].blocks, Some(vec![8, 9]), "the first block hit locally");
    assert_eq!(s.finish_load(2, LoadOutcome::Loaded), None);
    let outs = outputs(&mut s);
    assert_eq!((outs[0].num_cached_tokens, outs[0].num_external_tokens), (9, 6));
    assert_eq!(s.counters().prefix_cache_hits, 4);
    // Remote blocks that do not cover the prompt cannot be pulled.
    s.add(pull(3, (20..30).collect(), 1, vec![7, 8]));
    assert_eq!(s.schedule().loads[0].blocks, None);
}

#[test]
fn a_failed_pull_recomputes_or_fails_as_the_policy_says() {
    let prompt: Vec<u32> = (1..=10).collect();
    let mut agg = sched(cfg(64, 1024, 8));
    agg.add(req(1, prompt.clone(), 3));
    let want = run(&mut agg)[&1].clone();

    let mut s = sched(cfg(64, 1024, 8));
    s.add(pull(1, prompt.clone(), 3, vec![7, 8, 9]));
    s.schedule();
    assert_eq!(s.finish_load(1, LoadOutcome::Recompute), None);
    let step = s.schedule();
    assert_eq!(step.scheduled, vec![(1, 10)], "the whole prompt is computed here");
    let mut outs = s.update(&step);
    outs.extend(outputs(&mut s));
    assert_eq!(outs.iter().map(|o| o.token).collect::<Vec<_>>(), want);
    assert_eq!((outs[0].num_cached_tokens, outs[0].num_external_tokens), (0, 0));
    assert_eq!((s.counters().prefix_cache_queries, s.pool().num_free()), (10, 63));

    s.add(pull(2, prompt, 3, vec![7, 8, 9]));
    s.schedule();
    let out = s.finish_load(2, LoadOutcome::Fail).expect("the request fails");
    assert_eq!((out.finish, out.ids().len()), (Some(FinishReason::Error), 0));
    assert_eq!((s.num_waiting(), s.has_work(), s.pool().num_free()), (0, false, 63));
    assert_eq!(s.finish_load(2, LoadOutcome::Loaded), None, "a pull ending after its request is gone changes nothing");
}

#[test]
fn an_aborted_decode_leg_frees_its_blocks_during_the_pull() {
    let mut s = sched(cfg(64, 1024, 8));
    s.add(pull(1, (1..=10).collect(), 3, vec![7, 8, 9]));
    s.schedule();
    assert!(s.abort(1));
    assert_eq!((s.num_waiting(), s.pool().num_free()), (0, 63));
    assert_eq!(s.finish_load(1, LoadOutcome::Loaded), None);
    s.add(pull(2, (1..=10).collect(), 3, vec![7, 8, 9]));
    s.schedule();
    let aborted = s.abort_all();
    assert_eq!(aborted.len(), 1, "pause in abort mode takes it too");
}
