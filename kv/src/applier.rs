//! Ingestion state of one event source (one worker's DP rank): it turns decoded batches into
//! index operations and decides when the stream can no longer be trusted.
//!
//! - Engine hashes are opaque ids: each `BlockStored` is re-hashed from its `token_ids` (and
//!   its blocks' extra keys: LoRA adapter, `cache_salt`, …) with kvgate's own chained hash
//!   (continuing from the parent's *our* hash), and a map
//!   engine hash → (our hash, references) serves later parents and `BlockRemoved`.
//! - Sequence numbers: the next expected is `last + 1`. A jump ahead is a gap (replay from
//!   `last + 1` when a replay endpoint exists). A number at or below the last one means the
//!   engine restarted: its old state is gone, so the worker's index entries are cleared.
//! - A `BlockStored` whose parent we do not know means we missed something: the worker's state
//!   is cleared and rebuilt from a replay (resync).
//! - `AllBlocksCleared` clears the worker. CPU/disk tiers and non-main KV groups are ignored
//!   (counted): only the GPU prefix cache of the full-attention group can serve a hit.

use crate::event::{Batch, Event, decode_batch};
use crate::hash::{BlockHash, Hasher};
use crate::index::{IndexError, KvIndex, WorkerId};
use std::collections::HashMap;

/// Least time between two unknown-parent resyncs of one source.
pub const RESYNC_COOLDOWN: std::time::Duration = std::time::Duration::from_secs(30);

/// What the caller must do after a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing: the message was applied (or counted as bad).
    Continue,
    /// Fetch batches `from..` over the replay socket and feed them to [`Applier::on_replayed`];
    /// then, if the replay did not reach the live message that revealed the gap
    /// (`last_seq() < seq`), call [`Applier::on_message`] with it again.
    Replay {
        /// First sequence number to fetch.
        from: u64,
    },
    /// The worker was cleared; fetch everything still buffered (`Replay { from: 0 }`), then
    /// continue with live messages.
    Resync,
}

/// Counters the subscriber turns into metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Events applied, by type: stored, removed, cleared.
    pub applied: [u64; 3],
    /// Events ignored (other medium or group).
    pub ignored: u64,
    /// Batches that did not decode.
    pub malformed: u64,
    /// Removals of blocks we did not know (benign: e.g. already dropped with their parent).
    pub unknown_removals: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Resyncs: engine restart.
    pub restarts: u64,
    /// Resyncs: unknown parent.
    pub unknown_parents: u64,
    /// Stored events whose block size differs from the model's (misconfiguration).
    pub block_size_mismatch: u64,
    /// Stored events skipped during a replay because their parent predates the buffer.
    pub unknown_parents_skipped: u64,
}

/// One source's state.
pub struct Applier {
    worker: WorkerId,
    hasher: Hasher,
    engine: HashMap<u64, (BlockHash, u32)>,
    /// Highest sequence applied (live or replayed).
    last_seq: Option<u64>,
    /// Highest sequence seen on the live stream: a live number at or below it means the
    /// engine restarted; one above it but at or below `last_seq` was already replayed.
    live_last: Option<u64>,
    /// When the last unknown-parent resync happened: within [`RESYNC_COOLDOWN`] of it, unknown
    /// parents are skipped rather than resynced again (a buffer that starts after long-cached
    /// blocks would otherwise resync on every such event).
    last_resync: Option<std::time::Instant>,
    replay_available: bool,
    counts: Counts,
    last_ts: f64,
}

impl Applier {
    /// State for `worker`, hashing with `hasher`; `replay_available` when a replay endpoint is
    /// configured.
    pub fn new(worker: WorkerId, hasher: Hasher, replay_available: bool) -> Self {
        Self {
            worker,
            hasher,
            engine: HashMap::new(),
            last_seq: None,
            live_last: None,
            last_resync: None,
            replay_available,
            counts: Counts::default(),
            last_ts: 0.0,
        }
    }

    /// Counters so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Timestamp of the last applied batch.
    pub fn last_ts(&self) -> f64 {
        self.last_ts
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Forgets everything about the worker (its index entries too).
    pub fn reset(&mut self, index: &dyn KvIndex) {
        index.clear(self.worker);
        self.engine.clear();
        self.last_seq = None;
        self.live_last = None;
    }

    /// A live message `[topic, seq, payload]`.
    pub fn on_message(&mut self, seq: u64, payload: &[u8], index: &dyn KvIndex) -> Action {
        // Already applied by a replay that overlapped the live stream.
        if self.live_last.is_none_or(|l| seq > l) && self.last_seq.is_some_and(|l| seq <= l) {
            self.live_last = Some(seq);
            return Action::Continue;
        }
        match self.live_last {
            Some(last) if seq <= last => {
                // The engine restarted (its counter starts at 0 with an empty cache).
                self.counts.restarts += 1;
                tracing::warn!(worker = self.worker, seq, last, "KV event sequence went back: engine restart; clearing the worker");
                self.reset(index);
                if seq > 0 && self.replay_available {
                    return Action::Resync;
                }
            }
            _ => {}
        }
        match self.last_seq {
            Some(last) if seq > last + 1 => {
                self.counts.gaps += 1;
                if self.replay_available {
                    return Action::Replay { from: last + 1 };
                }
                tracing::warn!(worker = self.worker, missed = seq - last - 1, "KV event gap and no replay endpoint; continuing");
            }
            None if seq > 0 && self.replay_available => {
                // Joined mid-stream: fetch what the engine still buffers.
                return Action::Replay { from: 0 };
            }
            _ => {}
        }
        self.live_last = Some(seq);
        self.apply(seq, payload, index, false)
    }

    /// The live message after a replay that failed or did not reach it: apply it anyway
    /// (what was missed is lost; later unknown parents are skipped) so ingestion never stalls.
    pub fn on_message_after_failed_replay(&mut self, seq: u64, payload: &[u8], index: &dyn KvIndex) -> Action {
        self.live_last = Some(seq);
        self.apply(seq, payload, index, true)
    }

    /// Whether a resync happened within [`RESYNC_COOLDOWN`]: unknown parents are then skipped
    /// rather than trigger another.
    fn resynced_recently(&self) -> bool {
        self.last_resync.is_some_and(|t| t.elapsed() < RESYNC_COOLDOWN)
    }

    /// A batch from a replay: applied if it is newer than what we have. An unknown parent is
    /// skipped here (counted), never a new resync: the buffer may begin after blocks its events
    /// chain from.
    pub fn on_replayed(&mut self, seq: u64, payload: &[u8], index: &dyn KvIndex) -> Action {
        if self.last_seq.is_some_and(|last| seq <= last) {
            return Action::Continue;
        }
        // The buffer may start after blocks that later events chain from.
        self.apply(seq, payload, index, true)
    }

    /// Applies one batch; `skip_orphans` skips (and counts) events with an unknown parent
    /// instead of resyncing.
    fn apply(&mut self, seq: u64, payload: &[u8], index: &dyn KvIndex, skip_orphans: bool) -> Action {
        self.last_seq = Some(seq);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.counts.malformed += 1;
                tracing::warn!(worker = self.worker, seq, error = %e, "skipping malformed KV event batch");
                return Action::Continue;
            }
        };
        match self.apply_decoded(&batch, index, skip_orphans || self.resynced_recently()) {
            Ok(()) => Action::Continue,
            Err(parent) => {
                self.counts.unknown_parents += 1;
                self.last_resync = Some(std::time::Instant::now());
                tracing::warn!(worker = self.worker, seq, parent, "KV event with an unknown parent: resyncing the worker");
                self.reset(index);
                if self.replay_available { Action::Resync } else { Action::Continue }
            }
        }
    }

    /// Applies a decoded batch; `Err(engine_parent)` when a parent is unknown (skipped instead
    /// within the resync cooldown).
    pub fn apply_batch(&mut self, batch: &Batch, index: &dyn KvIndex) -> Result<(), u64> {
        let skip_orphans = self.resynced_recently();
        self.apply_decoded(batch, index, skip_orphans)
    }

    fn apply_decoded(&mut self, batch: &Batch, index: &dyn KvIndex, skip_orphans: bool) -> Result<(), u64> {
        self.last_ts = batch.ts;
        for ev in &batch.events {
            if !ev.is_main_gpu() {
                self.counts.ignored += 1;
                continue;
            }
            match ev {
                Event::Stored(s) => {
                    let parent = match s.parent {
                        None => None,
                        Some(p) => match self.engine.get(&p) {
                            Some(&(ours, _)) => Some(ours),
                            None if skip_orphans => {
                                // Chains from before the replay buffer: skip, keep going.
                                self.counts.unknown_parents_skipped += 1;
                                continue;
                            }
                            None => return Err(p),
                        },
                    };
                    if s.block_size != self.hasher.block_size() {
                        // Misconfiguration: request hashes could never match these blocks.
                        if self.counts.block_size_mismatch == 0 {
                            tracing::error!(
                                worker = self.worker,
                                engine = s.block_size,
                                configured = self.hasher.block_size(),
                                "KV events use a different block size than the model's block_size; events ignored"
                            );
                        }
                        self.counts.block_size_mismatch += 1;
                        continue;
                    }
                    let ours = self.hasher.with_lora(s.lora_name.as_deref()).chain_with(parent, &s.token_ids, &s.extras);
                    match index.insert(self.worker, parent, &ours) {
                        Ok(()) => {}
                        Err(IndexError::UnknownParent(_)) if skip_orphans => {
                            self.counts.unknown_parents_skipped += 1;
                            continue;
                        }
                        Err(IndexError::UnknownParent(_)) => return Err(s.parent.unwrap_or(0)),
                        Err(e) => {
                            tracing::warn!(worker = self.worker, error = %e, "index refused a store");
                            continue;
                        }
                    }
                    for (&e, &o) in s.hashes.iter().zip(&ours) {
                        self.engine.entry(e).and_modify(|v| v.1 += 1).or_insert((o, 1));
                    }
                    self.counts.applied[0] += 1;
                }
                Event::Removed { hashes, .. } => {
                    let mut ours = Vec::with_capacity(hashes.len());
                    for e in hashes {
                        match self.engine.get_mut(e) {
                            Some(v) => {
                                ours.push(v.0);
                                v.1 -= 1;
                                if v.1 == 0 {
                                    self.engine.remove(e);
                                }
                            }
                            None => self.counts.unknown_removals += 1,
                        }
                    }
                    if index.remove(self.worker, &ours).is_err() {
                        self.counts.unknown_removals += 1;
                    }
                    self.counts.applied[1] += 1;
                }
                Event::AllCleared => {
                    index.clear(self.worker);
                    self.engine.clear();
                    self.counts.applied[2] += 1;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
