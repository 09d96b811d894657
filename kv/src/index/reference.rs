//! The reference model: per worker, plain maps of held blocks (with reference counts), parents
//! and children, behind one mutex. Obviously correct rather than fast; property tests hold the
//! flat index to it, and approximate mode (few blocks, routing decisions only) uses it.

use super::{IndexError, KvIndex, Matches, WorkerId};
use crate::hash::BlockHash;
use parking_lot::Mutex;
use std::collections::HashMap;

#[derive(Debug, Default, Clone)]
struct WorkerBlocks {
    refs: HashMap<BlockHash, u32>,
    parent: HashMap<BlockHash, Option<BlockHash>>,
    children: HashMap<BlockHash, Vec<BlockHash>>,
}

impl WorkerBlocks {
    fn drop_subtree(&mut self, root: BlockHash) -> Vec<BlockHash> {
        let mut dropped = Vec::new();
        let mut stack = vec![root];
        while let Some(b) = stack.pop() {
            self.refs.remove(&b);
            dropped.push(b);
            if let Some(Some(p)) = self.parent.remove(&b)
                && let Some(siblings) = self.children.get_mut(&p)
            {
                siblings.retain(|&c| c != b);
            }
            if let Some(kids) = self.children.remove(&b) {
                stack.extend(kids);
            }
        }
        dropped
    }
}

/// The reference index.
#[derive(Debug, Default)]
pub struct ReferenceTree {
    workers: Mutex<HashMap<WorkerId, WorkerBlocks>>,
}

impl ReferenceTree {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes every reference to `block` for `worker` and returns all blocks dropped with it
    /// (the block and its subtree); empty if the worker did not hold it.
    pub fn remove_all(&self, worker: WorkerId, block: BlockHash) -> Vec<BlockHash> {
        let mut all = self.workers.lock();
        match all.get_mut(&worker) {
            Some(w) if w.refs.contains_key(&block) => w.drop_subtree(block),
            _ => Vec::new(),
        }
    }

    /// Blocks `worker` holds (tests).
    pub fn blocks(&self, worker: WorkerId) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self.workers.lock().get(&worker).map(|w| w.refs.keys().copied().collect()).unwrap_or_default();
        v.sort_unstable();
        v
    }
}

impl KvIndex for ReferenceTree {
    fn insert(&self, worker: WorkerId, parent: Option<BlockHash>, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let mut all = self.workers.lock();
        let w = all.entry(worker).or_default();
        if let Some(p) = parent
            && !w.refs.contains_key(&p)
        {
            return Err(IndexError::UnknownParent(p));
        }
        let mut prev = parent;
        for &b in blocks {
            let count = w.refs.entry(b).or_insert(0);
            *count += 1;
            if *count == 1 {
                w.parent.insert(b, prev);
                if let Some(p) = prev {
                    w.children.entry(p).or_default().push(b);
                }
            }
            prev = Some(b);
        }
        Ok(())
    }

    fn remove(&self, worker: WorkerId, blocks: &[BlockHash]) -> Result<(), IndexError> {
        let mut all = self.workers.lock();
        let Some(w) = all.get_mut(&worker) else {
            return blocks.first().map_or(Ok(()), |&b| Err(IndexError::NotFound(b)));
        };
        let mut first_err = None;
        for &b in blocks {
            match w.refs.get_mut(&b) {
                None => {
                    first_err.get_or_insert(IndexError::NotFound(b));
                }
                Some(c) if *c > 1 => *c -= 1,
                Some(_) => {
                    w.drop_subtree(b);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn clear(&self, worker: WorkerId) {
        self.workers.lock().remove(&worker);
    }

    fn find_matches(&self, chain: &[BlockHash]) -> Matches {
        let all = self.workers.lock();
        let mut scores: Vec<(WorkerId, u32)> = all
            .iter()
            .filter_map(|(&id, w)| {
                let n = chain.iter().take_while(|b| w.refs.contains_key(b)).count() as u32;
                (n > 0).then_some((id, n))
            })
            .collect();
        scores.sort_unstable();
        Matches { scores }
    }

    fn block_count(&self, worker: WorkerId) -> usize {
        self.workers.lock().get(&worker).map_or(0, |w| w.refs.len())
    }
}
