//! The flat index's storage: an open-addressing hash table from block hash to a worker bitset,
//! with atomic keys and atomic bitset words stored inline (no allocation per block, no
//! pointer chasing): one array of keys (probing scans 8 bytes per slot) and one of bitsets.
//!
//! Any number of slots (not only powers of two): a key's home slot is `k × capacity / 2^64`
//! where `k` is the key with its bytes reversed (multiply-shift, "fastrange"), then linear
//! probing, wrapping at the end. The owner can therefore size the table for a target load
//! instead of rounding up to a power of two, which used to leave it anywhere between 17% and
//! 70% full.
//!
//! Concurrency contract: any number of readers, one writer at a time (the caller serializes
//! writers). Readers never lock: a key, once written, never changes and never moves; bitset
//! words are replaced whole with release stores (the single writer reads, sets or clears a
//! bit, and stores). A slot whose bitset empties keeps its key (it reads as
//! "no worker") and is reused if the block comes back; the owner rebuilds into a fresh table
//! when dead slots pile up or the table fills.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bitset words per slot, at most (256 workers).
pub const MAX_WORDS: usize = 4;

/// A worker bitset as read from the table.
pub type Bits = [u64; MAX_WORDS];

/// Fewest slots in a table.
pub const MIN_CAPACITY: usize = 16;

/// The table.
pub struct Table {
    cap: usize,
    words: usize,
    keys: Box<[AtomicU64]>,
    /// `words` per slot.
    bits: Box<[AtomicU64]>,
}

/// Where a key's home is computed from: its bytes reversed. A bijection that costs one
/// instruction; block hashes are already well mixed, and keys that are not (tests use small
/// integers) get their varying low bits moved to the high bits that pick the slot.
#[inline]
pub fn spread(key: u64) -> u64 {
    key.swap_bytes()
}

/// Where `x` falls among `n` slots: `x × n / 2^64` (multiply-shift, "fastrange"; monotone in `x`).
#[inline]
pub fn scale(x: u64, n: usize) -> usize {
    ((u128::from(x) * n as u128) >> 64) as usize
}

/// `key`'s home slot among `n`.
#[inline]
pub fn home(key: u64, n: usize) -> usize {
    scale(spread(key), n)
}

impl Table {
    /// A table with `capacity` slots (at least [`MIN_CAPACITY`], below `u32::MAX` so slots fit
    /// in 32 bits) and `words` bitset words per slot (1..=4; 3 is rounded up to 4, so lookups
    /// are compiled for each width).
    pub fn new(capacity: usize, words: usize) -> Self {
        assert!((1..=MAX_WORDS).contains(&words));
        let words = words.next_power_of_two();
        let cap = capacity.max(MIN_CAPACITY);
        assert!(cap < u32::MAX as usize, "table slots must fit in 32 bits");
        Self { cap, words, keys: (0..cap).map(|_| AtomicU64::new(0)).collect(), bits: (0..cap * words).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Bitset words per slot.
    pub fn words(&self) -> usize {
        self.words
    }

    /// Bytes of storage.
    pub fn memory_bytes(&self) -> usize {
        (self.keys.len() + self.bits.len()) * 8
    }

    #[inline]
    fn key_cell(&self, slot: usize) -> &AtomicU64 {
        &self.keys[slot]
    }

    #[inline]
    fn bit_cell(&self, slot: usize, word: usize) -> &AtomicU64 {
        &self.bits[slot * self.words + word]
    }

    /// The key in `slot` (0 if the slot was never used).
    #[inline]
    pub fn key_at(&self, slot: usize) -> u64 {
        self.key_cell(slot).load(Ordering::Acquire)
    }

    /// The slot holding `key`, if any (lock-free).
    #[inline]
    pub fn find(&self, key: u64) -> Option<usize> {
        let mut i = home(key, self.cap);
        loop {
            let k = self.key_cell(i).load(Ordering::Acquire);
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i += 1;
            if i == self.cap {
                i = 0;
            }
        }
    }

    /// The workers holding `key`; `N` must be the table's word count (lock-free).
    #[inline]
    pub fn get_n<const N: usize>(&self, key: u64) -> [u64; N] {
        debug_assert_eq!(N, self.words);
        let mut i = home(key, self.cap);
        loop {
            let k = self.keys[i].load(Ordering::Acquire);
            if k == key {
                let bits = &self.bits[i * N..(i + 1) * N];
                return std::array::from_fn(|w| bits[w].load(Ordering::Acquire));
            }
            if k == 0 {
                return [0; N];
            }
            i += 1;
            if i == self.cap {
                i = 0;
            }
        }
    }

    /// Writer only: the slot for `key`, claiming an empty one if needed (true when claimed).
    /// `None` when full.
    pub fn slot_for(&self, key: u64) -> Option<(usize, bool)> {
        let mut i = home(key, self.cap);
        for _ in 0..self.cap {
            let k = self.key_cell(i).load(Ordering::Relaxed);
            if k == key {
                return Some((i, false));
            }
            if k == 0 {
                // Bits of a never-used slot are zero; publish the key after them.
                self.key_cell(i).store(key, Ordering::Release);
                return Some((i, true));
            }
            i += 1;
            if i == self.cap {
                i = 0;
            }
        }
        None
    }

    /// Writer only: adds `worker` to the slot's set; returns true if the set was empty.
    #[inline]
    pub fn set_bit(&self, slot: usize, worker: usize) -> bool {
        let was_empty = (0..self.words).all(|w| self.bit_cell(slot, w).load(Ordering::Relaxed) == 0);
        let cell = self.bit_cell(slot, worker / 64);
        // One writer at a time: a plain store publishes the word (no locked read-modify-write,
        // which would stall the writer on the cache miss).
        cell.store(cell.load(Ordering::Relaxed) | 1 << (worker % 64), Ordering::Release);
        was_empty
    }

    /// Writer only: `worker` is the first in a slot [`Self::slot_for`] has just claimed (its
    /// words are zero: stored without reading them).
    #[inline]
    pub fn set_first_bit(&self, slot: usize, worker: usize) {
        self.bit_cell(slot, worker / 64).store(1 << (worker % 64), Ordering::Release);
    }

    /// Writer only: removes `worker`; returns true if the set is now empty.
    #[inline]
    pub fn clear_bit(&self, slot: usize, worker: usize) -> bool {
        let cell = self.bit_cell(slot, worker / 64);
        cell.store(cell.load(Ordering::Relaxed) & !(1 << (worker % 64)), Ordering::Release);
        (0..self.words).all(|w| self.bit_cell(slot, w).load(Ordering::Relaxed) == 0)
    }

    /// Writer only: every (slot, key, bits) with a non-empty set.
    pub fn live(&self) -> impl Iterator<Item = (usize, u64, Bits)> + '_ {
        (0..self.cap).filter_map(move |i| {
            let k = self.key_cell(i).load(Ordering::Relaxed);
            if k == 0 {
                return None;
            }
            let mut b = [0u64; MAX_WORDS];
            for (w, o) in b.iter_mut().enumerate().take(self.words) {
                *o = self.bit_cell(i, w).load(Ordering::Relaxed);
            }
            b.iter().any(|&x| x != 0).then_some((i, k, b))
        })
    }

    /// Writer only: copies a live entry into a fresh table; its slot there (`None` when full).
    pub fn put(&self, key: u64, bits: &Bits) -> Option<usize> {
        let (slot, _) = self.slot_for(key)?;
        for (w, &v) in bits.iter().enumerate().take(self.words) {
            self.bit_cell(slot, w).store(v, Ordering::Release);
        }
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_capacity_wraps_and_finds_every_key() {
        for cap in [16, 17, 100, 1000, 1023] {
            let t = Table::new(cap, 2);
            assert_eq!(t.capacity(), cap);
            assert_eq!(t.memory_bytes(), cap * 24);
            // Keys whose home is the last slot wrap around to the start.
            let high: Vec<u64> = (1..).filter(|&k| home(k, cap) == cap - 1).take(8).collect();
            for (n, &k) in high.iter().enumerate() {
                let (slot, fresh) = t.slot_for(k).expect("room");
                assert!(fresh);
                assert_eq!(slot, (cap - 1 + n) % cap);
                assert!(t.set_bit(slot, 64 + n));
            }
            for (n, &k) in high.iter().enumerate() {
                assert_eq!(t.get_n::<2>(k), [0, 1 << n]);
                assert_eq!(t.key_at(t.find(k).expect("present")), k);
            }
            assert_eq!(t.find(12345), None);
            // Fill every slot: a full table refuses a new key and still finds the old ones.
            let mut k = 1u64;
            while t.live().count() < cap {
                if let Some((slot, true)) = t.slot_for(k.wrapping_mul(crate::hash::PHI)) {
                    t.set_bit(slot, 0);
                }
                k += 1;
            }
            assert_eq!(t.slot_for(7), None);
            assert!(high.iter().all(|&k| t.find(k).is_some()));
        }
    }

    #[test]
    fn home_spreads_keys_evenly() {
        let n = 1000;
        let mut hits = vec![0u32; n];
        for i in 0..100_000u64 {
            hits[home(crate::hash::mix(i), n)] += 1;
            hits[home(i + 1_000_000, n)] += 1;
        }
        let (lo, hi) = (hits.iter().min().copied(), hits.iter().max().copied());
        assert!(lo >= Some(120) && hi <= Some(280), "{lo:?}..{hi:?}");
    }
}
