//! Index structures behind one trait. Both implementations have the same semantics:
//! - a worker holds a block with a reference count (vLLM may store the same content twice and
//!   remove it once); it stops holding it when the count reaches zero;
//! - a block can only be inserted under a parent the worker holds (or as a first block);
//!   otherwise [`IndexError::UnknownParent`] and nothing changes (the caller resyncs);
//! - removing a block (count reaches zero) also removes all of that worker's blocks below it,
//!   so every worker's blocks are prefix-closed;
//! - `find_matches(chain)` gives, per worker, how many leading blocks of the chain it holds.

mod blocks;
mod flat;
mod reference;
mod table;

pub use flat::FlatIndex;
pub use reference::ReferenceTree;

use crate::hash::BlockHash;

/// A worker's slot in an index (dense, small).
pub type WorkerId = u16;

/// Why an index operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The parent block is not held by this worker.
    #[error("parent block {0:#x} is not held by this worker")]
    UnknownParent(BlockHash),
    /// The block is not held by this worker.
    #[error("block {0:#x} is not held by this worker")]
    NotFound(BlockHash),
    /// The worker id is beyond the index's capacity.
    #[error("worker id {0} is beyond this index's capacity")]
    WorkerOutOfRange(WorkerId),
}

/// Result of a lookup: the matched leading blocks per worker (workers with 0 are absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    /// (worker, matched blocks), sorted by worker id.
    pub scores: Vec<(WorkerId, u32)>,
}

impl Matches {
    /// Matched blocks for `w` (0 if none).
    pub fn get(&self, w: WorkerId) -> u32 {
        self.scores.binary_search_by_key(&w, |&(k, _)| k).map(|i| self.scores[i].1).unwrap_or(0)
    }

    /// Matched blocks of workers `0..n` as a dense array (one pass, for per-worker loops).
    pub fn to_dense(&self, n: usize) -> Vec<u32> {
        let mut v = vec![0; n];
        for &(w, m) in &self.scores {
            if let Some(slot) = v.get_mut(w as usize) {
                *slot = m;
            }
        }
        v
    }
}

/// A prefix index over chained block hashes.
pub trait KvIndex: Send + Sync {
    /// Stores `blocks` (a chain continuing from `parent`) for `worker`.
    fn insert(&self, worker: WorkerId, parent: Option<BlockHash>, blocks: &[BlockHash]) -> Result<(), IndexError>;
    /// Drops one reference to each block; a block reaching zero is removed with its subtree.
    /// Blocks the worker does not hold are skipped; the first such is reported.
    fn remove(&self, worker: WorkerId, blocks: &[BlockHash]) -> Result<(), IndexError>;
    /// Forgets everything `worker` holds.
    fn clear(&self, worker: WorkerId);
    /// Matched leading blocks of `chain` per worker.
    fn find_matches(&self, chain: &[BlockHash]) -> Matches;
    /// Distinct blocks `worker` holds.
    fn block_count(&self, worker: WorkerId) -> usize;
}

#[cfg(test)]
mod tests;
