//! The flat index's storage: an open-addressing hash table from block hash to a worker bitset,
//! with atomic keys and atomic bitset words stored inline (no allocation per block, no
//! pointer chasing).
//!
//! Concurrency contract: any number of readers, one writer at a time (the caller serializes
//! writers). Readers never lock: a key, once written, never changes; bitset words are updated
//! with atomic or/and. A slot whose bitset empties keeps its key (it reads as "no worker") and
//! is reused if the block comes back; the owner rebuilds into a fresh table when dead slots pile
//! up or the table fills.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bitset words per slot, at most (256 workers).
pub const MAX_WORDS: usize = 4;

/// A worker bitset as read from the table.
pub type Bits = [u64; MAX_WORDS];

/// The table.
pub struct Table {
    mask: usize,
    words: usize,
    keys: Box<[AtomicU64]>,
    bits: Box<[AtomicU64]>,
}

#[inline]
fn start(key: u64, mask: usize) -> usize {
    // Keys are already well-mixed hashes; fold the high half in for small tables.
    ((key ^ (key >> 32)) as usize) & mask
}

impl Table {
    /// A table with `capacity` slots (rounded up to a power of two, at least 16) and `words`
    /// bitset words per slot (1..=4).
    pub fn new(capacity: usize, words: usize) -> Self {
        assert!((1..=MAX_WORDS).contains(&words));
        let cap = capacity.max(16).next_power_of_two();
        Self { mask: cap - 1, words, keys: (0..cap).map(|_| AtomicU64::new(0)).collect(), bits: (0..cap * words).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Bitset words per slot.
    pub fn words(&self) -> usize {
        self.words
    }

    /// Bytes of storage.
    pub fn memory_bytes(&self) -> usize {
        self.capacity() * 8 * (1 + self.words)
    }

    /// The slot holding `key`, if any (lock-free).
    #[inline]
    pub fn find(&self, key: u64) -> Option<usize> {
        let mut i = start(key, self.mask);
        loop {
            let k = self.keys[i].load(Ordering::Acquire);
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The workers holding `key` as `N` words (`N` ≥ the table's word count; lock-free).
    #[inline]
    pub fn get_n<const N: usize>(&self, key: u64) -> [u64; N] {
        let mut out = [0u64; N];
        if let Some(slot) = self.find(key) {
            let base = slot * self.words;
            for (w, o) in out.iter_mut().enumerate().take(self.words) {
                *o = self.bits[base + w].load(Ordering::Acquire);
            }
        }
        out
    }

    /// Writer only: the slot for `key`, claiming an empty one if needed. `None` when full.
    pub fn slot_for(&self, key: u64) -> Option<(usize, bool)> {
        let mut i = start(key, self.mask);
        for _ in 0..=self.mask {
            let k = self.keys[i].load(Ordering::Relaxed);
            if k == key {
                return Some((i, false));
            }
            if k == 0 {
                // Bits of a never-used slot are zero; publish the key after them.
                self.keys[i].store(key, Ordering::Release);
                return Some((i, true));
            }
            i = (i + 1) & self.mask;
        }
        None
    }

    /// Writer only: adds `worker` to the slot's set; returns true if the set was empty.
    #[inline]
    pub fn set_bit(&self, slot: usize, worker: usize) -> bool {
        let was_empty = (0..self.words).all(|w| self.bits[slot * self.words + w].load(Ordering::Relaxed) == 0);
        self.bits[slot * self.words + worker / 64].fetch_or(1 << (worker % 64), Ordering::Release);
        was_empty
    }

    /// Writer only: removes `worker`; returns true if the set is now empty.
    #[inline]
    pub fn clear_bit(&self, slot: usize, worker: usize) -> bool {
        self.bits[slot * self.words + worker / 64].fetch_and(!(1 << (worker % 64)), Ordering::Release);
        (0..self.words).all(|w| self.bits[slot * self.words + w].load(Ordering::Relaxed) == 0)
    }

    /// Writer only: every (key, bits) with a non-empty set.
    pub fn live(&self) -> impl Iterator<Item = (u64, Bits)> + '_ {
        (0..self.capacity()).filter_map(move |i| {
            let k = self.keys[i].load(Ordering::Relaxed);
            if k == 0 {
                return None;
            }
            let mut b = [0u64; MAX_WORDS];
            for (w, o) in b.iter_mut().enumerate().take(self.words) {
                *o = self.bits[i * self.words + w].load(Ordering::Relaxed);
            }
            b.iter().any(|&x| x != 0).then_some((k, b))
        })
    }

    /// Writer only: copies a live entry into a fresh table.
    pub fn put(&self, key: u64, bits: &Bits) -> bool {
        let Some((slot, _)) = self.slot_for(key) else { return false };
        for (w, &v) in bits.iter().enumerate().take(self.words) {
            self.bits[slot * self.words + w].store(v, Ordering::Release);
        }
        true
    }
}
