//! The writers' per-worker bookkeeping: which blocks a worker holds, with their reference
//! count, held-children count and parent. Writer only (behind the index's writer mutex);
//! readers never touch it.
//!
//! One 16-byte entry per held block in an ordered linear-probing table (Amble and Knuth's
//! ordered hash table, or Robin Hood hashing with ties broken by key): each block is stored as
//! `x` = its bytes reversed (a bijection, as the shared table's homes), its home slot is
//! `x × homes / 2^64`, and the entries are kept
//! sorted by `x` with no gap between an entry's home and its slot. So:
//! - a lookup starts at the home slot and stops at the key, an empty slot, or a larger `x`
//!   (absent keys cost about as much as present ones, with no per-slot arithmetic);
//! - removal shifts the following displaced entries back (no tombstones);
//! - growing is one ordered pass (each entry goes to `max(its new home, next free slot)`);
//! - there is no wrap-around: entries displaced past the last home slot go into a short tail.
//!
//! Any number of home slots (not only powers of two), grown by 1.5× at 85% load, so a map runs
//! between 57% and 85% full. The fields are narrow on purpose: the parent is the parent's slot
//! in the shared table (the owner rewrites these when it rebuilds that table), and the counts
//! are 16 bits; see [`Entry`] for what happens at their limits.

use super::table::{scale, spread};
use crate::hash::BlockHash;

/// No parent (the first block of a chain).
pub const NO_PARENT: u32 = u32::MAX;

/// Highest load before growing.
const MAX_LOAD: f64 = 0.85;
/// Growth factor: a grown map is `MAX_LOAD / GROWTH` (57%) full.
const GROWTH: f64 = 1.5;
/// Fewest home slots once anything is stored.
const MIN_HOMES: usize = 8;
/// Room reserved for the tail at a time (it rarely holds more than a few entries).
const TAIL: usize = 16;

/// Home slots for a map grown to hold `len` entries.
#[allow(clippy::cast_sign_loss, reason = "a count times positive constants: not negative")]
fn homes_for(len: usize) -> usize {
    (len as f64 * GROWTH / MAX_LOAD).ceil() as usize
}

/// Entries a map of `homes` home slots holds before it grows.
#[allow(clippy::cast_sign_loss, reason = "a count times positive constants: not negative")]
fn grow_at(homes: usize) -> usize {
    (homes as f64 * MAX_LOAD) as usize
}

/// A held block.
///
/// `refs` is exact: at `u16::MAX` the owner counts further references elsewhere (a spill map),
/// so only a count that reaches 65,535 pays for it. `children` is sticky: once it reaches
/// `u16::MAX` it is never decremented, which only means "may have held children", and a
/// removal then looks for them (the rare, slower path), so it never drops too few blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Entry {
    /// The block, bytes reversed (0: empty slot).
    x: u64,
    /// The parent's slot in the shared table, or [`NO_PARENT`].
    pub parent: u32,
    /// References (vLLM may store a block more than once), 1.. (see above at `u16::MAX`).
    pub refs: u16,
    /// Held children, exact below `u16::MAX`, sticky at it.
    pub children: u16,
}

impl Entry {
    /// The block.
    #[inline]
    pub fn key(&self) -> BlockHash {
        spread(self.x)
    }
}

/// A worker's held blocks.
#[derive(Debug, Default)]
pub struct BlockMap {
    /// `homes` home slots, then a tail for entries displaced past the last one.
    slots: Vec<Entry>,
    homes: usize,
    len: usize,
    /// Grow before holding more than this (`homes × MAX_LOAD`).
    grow_at: usize,
}

impl BlockMap {
    /// Blocks held. (tests)
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is held. (tests)
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Home slots. (tests)
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.homes
    }

    /// Bytes of storage.
    pub fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Entry>()
    }

    /// `Ok(slot)` of `x`, or `Err(slot)` where it would go.
    #[inline]
    fn search(&self, x: u64) -> Result<usize, usize> {
        let mut i = scale(x, self.homes);
        while let Some(e) = self.slots.get(i) {
            if e.x == x {
                return Ok(i);
            }
            if e.x == 0 || e.x > x {
                return Err(i);
            }
            i += 1;
        }
        Err(i)
    }

    /// `Ok(slot)` holding `key`, or `Err(position)` to pass to [`Self::insert_at`] (valid until
    /// the map changes).
    #[inline]
    pub fn find(&self, key: BlockHash) -> Result<usize, usize> {
        self.search(spread(key))
    }

    /// The entry in `slot` (from [`Self::find`]).
    #[inline]
    pub fn at(&mut self, slot: usize) -> &mut Entry {
        &mut self.slots[slot]
    }

    /// Whether `key` is held.
    #[inline]
    pub fn contains(&self, key: BlockHash) -> bool {
        self.find(key).is_ok()
    }

    /// The entry for `key`.
    #[inline]
    pub fn get_mut(&mut self, key: BlockHash) -> Option<&mut Entry> {
        self.find(key).ok().map(|i| &mut self.slots[i])
    }

    /// Adds `key` (non-zero, not present) with one reference and no children. (tests)
    #[cfg(test)]
    pub fn insert_new(&mut self, key: BlockHash, parent: u32) {
        let Err(at) = self.find(key) else { panic!("block {key:#x} already present") };
        self.insert_at(at, key, parent);
    }

    /// Adds `key` (non-zero) at `at`, which [`Self::find`] gave for it, with one reference and
    /// no children.
    pub fn insert_at(&mut self, mut at: usize, key: BlockHash, parent: u32) {
        debug_assert!(key != 0 && self.find(key) == Err(at));
        let mut e = Entry { x: spread(key), parent, refs: 1, children: 0 };
        if self.len >= self.grow_at {
            self.resize(homes_for(self.len + 1));
            at = self.search(e.x).expect_err("not present");
        }
        // Shift the run from `at` up by one.
        loop {
            match self.slots.get_mut(at) {
                None => {
                    self.push(e);
                    break;
                }
                Some(s) if s.x == 0 => {
                    *s = e;
                    break;
                }
                Some(s) => e = std::mem::replace(s, e),
            }
            at += 1;
        }
        self.len += 1;
    }

    fn resize(&mut self, homes: usize) {
        let homes = homes.max(MIN_HOMES);
        let mut slots = Vec::with_capacity(homes + TAIL);
        slots.resize(homes, Entry::default());
        let old = std::mem::replace(&mut self.slots, slots);
        self.homes = homes;
        self.grow_at = grow_at(homes);
        // In `x` order, each entry goes to its new home or right after the previous one.
        let mut next = 0;
        for e in old.into_iter().filter(|e| e.x != 0) {
            let i = scale(e.x, homes).max(next);
            match self.slots.get_mut(i) {
                Some(s) => *s = e,
                None => self.push(e),
            }
            next = i + 1;
        }
    }

    /// Appends to the tail (growing it by `TAIL`, not by doubling the whole map).
    fn push(&mut self, e: Entry) {
        if self.slots.len() == self.slots.capacity() {
            self.slots.reserve_exact(TAIL);
        }
        self.slots.push(e);
    }

    /// Removes `key`'s entry.
    pub fn remove(&mut self, key: BlockHash) -> Option<Entry> {
        self.find(key).ok().map(|i| self.remove_at(i))
    }

    /// Removes the entry in `slot` (from [`Self::find`]).
    pub fn remove_at(&mut self, mut slot: usize) -> Entry {
        let out = self.slots[slot];
        // Shift the following displaced entries back by one.
        while let Some(&e) = self.slots.get(slot + 1) {
            if e.x == 0 || scale(e.x, self.homes) > slot {
                break;
            }
            self.slots[slot] = e;
            slot += 1;
        }
        self.slots[slot] = Entry::default();
        self.len -= 1;
        out
    }

    /// Every entry.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> + '_ {
        self.slots.iter().filter(|e| e.x != 0)
    }

    /// Every entry, mutably (for the parent slots).
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Entry> + '_ {
        self.slots.iter_mut().filter(|e| e.x != 0)
    }

    /// Forgets every entry (keeps the home slots, as the worker usually comes back).
    pub fn clear(&mut self) {
        self.slots.truncate(self.homes);
        self.slots.fill(Entry::default());
        self.len = 0;
    }

    /// Checks the layout: sorted by `x`, no entry before its home, no gap between an entry's
    /// home and its slot.
    #[cfg(test)]
    fn check(&self) {
        let mut last = 0;
        let mut run_start = 0;
        for (i, e) in self.slots.iter().enumerate() {
            if e.x == 0 {
                run_start = i + 1;
                continue;
            }
            assert!(e.x > last, "sorted at {i}");
            let h = scale(e.x, self.homes);
            assert!(run_start <= h && h <= i, "slot {i}: home {h}, run from {run_start}");
            last = e.x;
        }
        assert_eq!(self.iter().count(), self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn matches_a_hash_map_through_growth_and_removal() {
        let mut m = BlockMap::default();
        let mut model: HashMap<BlockHash, u16> = HashMap::new();
        assert_eq!((m.capacity(), m.memory_bytes(), m.is_empty()), (0, 0, true));
        assert!(m.get_mut(5).is_none() && m.remove(5).is_none());
        let mut x = 0x1234_5678_u64;
        let mut caps = Vec::new();
        for step in 0..60_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A small key space so keys come back after removal; keys whose reversed bytes are
            // the largest land in the last home slots and spill into the tail.
            let key = match x % 4 {
                0 => (x >> 8) % 3000 + 1,
                1 => ((x >> 8) % 3000 + 1).wrapping_mul(crate::hash::PHI),
                _ => spread(u64::MAX - (x >> 8) % 40),
            };
            if x.is_multiple_of(3) {
                assert_eq!(m.remove(key).map(|e| (e.key(), e.refs)), model.remove(&key).map(|r| (key, r)), "step {step}");
            } else if let Some(e) = m.get_mut(key) {
                e.refs = e.refs.wrapping_add(1);
                *model.get_mut(&key).expect("in model") += 1;
            } else {
                assert!(!model.contains_key(&key));
                m.insert_new(key, NO_PARENT);
                model.insert(key, 1);
            }
            assert_eq!(m.len(), model.len());
            if caps.last() != Some(&m.capacity()) {
                caps.push(m.capacity());
                m.check();
            }
            if step.is_multiple_of(1000) {
                m.check();
            }
            assert!(m.len() as f64 <= m.capacity() as f64 * MAX_LOAD);
            assert_eq!(m.grow_at, grow_at(m.capacity()));
        }
        m.check();
        assert!(caps.len() > 5, "grew across several sizes: {caps:?}");
        assert!(caps.iter().any(|c| !c.is_power_of_two()));
        assert!(m.slots.len() > m.capacity(), "used the tail");
        let mut seen: Vec<(BlockHash, u16)> = m.iter().map(|e| (e.key(), e.refs)).collect();
        let mut want: Vec<(BlockHash, u16)> = model.into_iter().collect();
        seen.sort_unstable();
        want.sort_unstable();
        assert_eq!(seen, want);
        m.clear();
        assert_eq!((m.len(), m.iter().count()), (0, 0));
        assert!(m.capacity() > 0);
        m.check();
    }

    #[test]
    fn load_stays_between_57_and_85_percent_while_growing() {
        let mut m = BlockMap::default();
        for k in 1..=200_000u64 {
            m.insert_new(crate::hash::mix(k).max(1), NO_PARENT);
            if k > 100 {
                let load = m.len() as f64 / m.capacity() as f64;
                assert!((0.56..=MAX_LOAD).contains(&load), "{k}: load {load}");
                assert!(m.slots.len() < m.capacity() + 64, "short tail");
                assert!(m.slots.capacity() <= m.slots.len() + TAIL, "no doubling for the tail");
            }
        }
        m.check();
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }
}
