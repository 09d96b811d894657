//! Active sequences: the load each worker carries from requests in flight, as the gateway booked
//! it. Per worker, prefill tokens (released when the request's first token arrives) and active
//! blocks, kept as a prefix index of the booked chains with reference counts, so a prefix shared
//! by several requests counts once (`assume_kv_reuse`) and "how much of this request is
//! already active here" is one `find_matches`.
//!
//! Every booking is a [`Booking`] guard: completion, error, cancellation or a panic drop it,
//! and dropping releases exactly what it booked, so totals return to zero when load stops. As
//! a safety net, [`ActiveSequences::expire`] releases bookings older than a limit (a request
//! that never ends, or a guard leaked by a bug); the guard's own release then does nothing.

use kvgate_kv::hash::BlockHash;
use kvgate_kv::index::{FlatIndex, KvIndex, Matches, WorkerId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Per-worker load booked by the gateway.
pub struct ActiveSequences {
    blocks: FlatIndex,
    prefill: Box<[AtomicU64]>,
    /// Blocks booked without dedup (when `assume_kv_reuse` is off).
    raw_blocks: Box<[AtomicUsize]>,
    assume_kv_reuse: bool,
    next_salt: AtomicU64,
    live: Mutex<HashMap<u64, (Instant, Arc<Release>)>>,
    expired: AtomicU64,
}

/// What a booking holds, released once (by the guard or by expiry).
struct Release {
    worker: WorkerId,
    prefill: u64,
    chain: Vec<BlockHash>,
    prefill_released: AtomicBool,
    released: AtomicBool,
}

impl ActiveSequences {
    /// Tracking for `workers` workers (≤ 256).
    pub fn new(workers: usize, assume_kv_reuse: bool) -> Arc<Self> {
        Arc::new(Self {
            blocks: FlatIndex::new(workers.max(1), 4096),
            prefill: (0..workers.max(1)).map(|_| AtomicU64::new(0)).collect(),
            raw_blocks: (0..workers.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            assume_kv_reuse,
            next_salt: AtomicU64::new(1),
            live: Mutex::new(HashMap::new()),
            expired: AtomicU64::new(0),
        })
    }

    /// Releases bookings older than `max_age`; returns how many.
    pub fn expire(&self, max_age: Duration) -> usize {
        let now = Instant::now();
        let old: Vec<Arc<Release>> = {
            let mut live = self.live.lock();
            let ids: Vec<u64> = live.iter().filter(|(_, (t, _))| now.duration_since(*t) > max_age).map(|(&id, _)| id).collect();
            ids.into_iter().filter_map(|id| live.remove(&id).map(|(_, r)| r)).collect()
        };
        for r in &old {
            self.release(r);
        }
        self.expired.fetch_add(old.len() as u64, Ordering::Relaxed);
        old.len()
    }

    /// Bookings released by expiry so far.
    pub fn expired_count(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    fn release_prefill(&self, r: &Release) {
        if !r.prefill_released.swap(true, Ordering::AcqRel)
            && let Some(p) = self.prefill.get(r.worker as usize)
        {
            p.fetch_sub(r.prefill, Ordering::Relaxed);
        }
    }

    fn release(&self, r: &Release) {
        if r.released.swap(true, Ordering::AcqRel) {
            return;
        }
        self.release_prefill(r);
        if let Some(b) = self.raw_blocks.get(r.worker as usize) {
            b.fetch_sub(r.chain.len(), Ordering::Relaxed);
        }
        // Deepest first: a shared prefix loses one reference per block, never a subtree.
        for h in r.chain.iter().rev() {
            let _ = self.blocks.remove(r.worker, std::slice::from_ref(h));
        }
    }

    /// Prefill tokens booked on `w` and not started decoding.
    pub fn prefill_tokens(&self, w: WorkerId) -> u64 {
        self.prefill.get(w as usize).map_or(0, |p| p.load(Ordering::Relaxed))
    }

    /// Distinct blocks booked on `w` (or all booked blocks when shared prefixes are not assumed
    /// to be reused).
    pub fn active_blocks(&self, w: WorkerId) -> u64 {
        if self.assume_kv_reuse {
            self.blocks.block_count(w) as u64
        } else {
            self.raw_blocks.get(w as usize).map_or(0, |b| b.load(Ordering::Relaxed)) as u64
        }
    }

    /// How many leading blocks of `chain` are already booked, per worker.
    pub fn overlap(&self, chain: &[BlockHash]) -> Matches {
        if self.assume_kv_reuse { self.blocks.find_matches(chain) } else { Matches::default() }
    }

    /// Books a request on `w`: `prefill_tokens` to compute and its block `chain`.
    pub fn book(self: &Arc<Self>, w: WorkerId, prefill_tokens: u64, chain: Vec<BlockHash>) -> Booking {
        if (w as usize) < self.prefill.len() {
            self.prefill[w as usize].fetch_add(prefill_tokens, Ordering::Relaxed);
            self.raw_blocks[w as usize].fetch_add(chain.len(), Ordering::Relaxed);
        }
        let chain = if self.assume_kv_reuse {
            chain
        } else {
            // Unique per booking: no two requests share blocks.
            let salt = self.next_salt.fetch_add(1, Ordering::Relaxed);
            chain.iter().map(|h| h.rotate_left(17) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1).collect()
        };
        let _ = self.blocks.insert(w, None, &chain);
        let id = self.next_salt.fetch_add(1, Ordering::Relaxed);
        let release = Arc::new(Release {
            worker: w,
            prefill: prefill_tokens,
            chain,
            prefill_released: AtomicBool::new(false),
            released: AtomicBool::new(false),
        });
        self.live.lock().insert(id, (Instant::now(), release.clone()));
        Booking { seqs: self.clone(), id, release }
    }
}

/// One request's booking; released on drop.
pub struct Booking {
    seqs: Arc<ActiveSequences>,
    id: u64,
    release: Arc<Release>,
}

impl Booking {
    /// The request produced its first token: its prefill load is gone.
    pub fn prefill_done(&mut self) {
        self.seqs.release_prefill(&self.release);
    }

    /// The worker it is booked on.
    pub fn worker(&self) -> WorkerId {
        self.release.worker
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.seqs.live.lock().remove(&self.id);
        self.seqs.release(&self.release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_count_once_and_everything_returns_to_zero() {
        let s = ActiveSequences::new(2, true);
        let a = s.book(0, 100, vec![1, 2, 3]);
        let mut b = s.book(0, 50, vec![1, 2, 4, 5]);
        assert_eq!(s.prefill_tokens(0), 150);
        assert_eq!(s.active_blocks(0), 5, "blocks 1 and 2 shared");
        assert_eq!(s.overlap(&[1, 2, 4, 9]).get(0), 3);
        b.prefill_done();
        b.prefill_done();
        assert_eq!(s.prefill_tokens(0), 100);
        drop(a);
        assert_eq!(s.active_blocks(0), 4);
        drop(b);
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
    }

    #[test]
    fn without_reuse_every_booking_counts_in_full() {
        let s = ActiveSequences::new(1, false);
        let a = s.book(0, 10, vec![1, 2]);
        let b = s.book(0, 10, vec![1, 2]);
        assert_eq!(s.active_blocks(0), 4);
        assert_eq!(s.overlap(&[1, 2]).get(0), 0);
        drop((a, b));
        assert_eq!(s.active_blocks(0), 0);
    }

    #[test]
    fn expiry_releases_old_bookings_exactly_once() {
        let s = ActiveSequences::new(1, true);
        let b = s.book(0, 40, vec![1, 2]);
        assert_eq!(s.expire(Duration::from_secs(3600)), 0);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(Duration::from_millis(1)), 1);
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
        drop(b); // the guard's release is now a no-op: nothing goes negative
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
        assert_eq!(s.expired_count(), 1);
    }

    #[test]
    fn a_panic_releases_the_booking() {
        let s = ActiveSequences::new(1, true);
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _b = s2.book(0, 77, vec![7, 8]);
            panic!("handler failed");
        }));
        assert!(r.is_err());
        assert_eq!((s.prefill_tokens(0), s.active_blocks(0)), (0, 0));
    }
}
