//! What the other replicas of a deployment have booked on one worker (docs/replicas.md).
//!
//! Replicas that share their load publish their own bookings per worker ([`OwnLoad`], read by
//! [`super::Ledger::own`]); each replica sums its peers' figures for a worker and sets the sum
//! here whole ([`PeerLoad::set`]). The ledger adds it to its own bookings wherever it tells a
//! worker's load (routing candidates, shedding, the router queue, the admin API), so a worker's
//! load as any replica sees it is the sum over all of them. Without replicas it stays zero.

use kvgate_kv::hash::BlockHash;
use kvgate_kv::index::WorkerId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Where a ledger sends the prompt chains it books, to reach the replica's peers: a prefix a
/// request in flight is computing is as good as cached to a request that shares it, whichever
/// replica placed either ([`super::Ledger::share_chains`]). Called on the request path: it must
/// not wait.
pub trait ChainSink: Send + Sync {
    /// `chain` was booked on worker `w` under `key` (unique in this process).
    fn booked(&self, key: u64, w: WorkerId, chain: &Arc<[BlockHash]>);
    /// The booking `key` on worker `w` was released.
    fn released(&self, key: u64, w: WorkerId);
}

/// One replica's own bookings on one worker, or a sum of several replicas'; as published, the
/// backlog is the one predicted when it was sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OwnLoad {
    /// Requests in flight.
    pub requests: u32,
    /// Requests with their prefill outstanding.
    pub prefilling: u32,
    /// Prefill tokens booked and not started decoding.
    pub prefill_tokens: u64,
    /// Active KV blocks booked.
    pub active_blocks: u64,
    /// Blocks expected to be held while the booked requests run.
    pub expected_blocks: u64,
    /// Σ 1 / expected output tokens over the requests decoding there.
    pub decode_sensitivity: f64,
    /// Predicted time until the booked prefill is computed, ms.
    pub prefill_backlog_ms: f64,
    /// Predicted prefill time booked per second.
    pub prefill_load: f64,
}

impl OwnLoad {
    /// Adds `o`: the load of two replicas together. Their prefill backlogs queue one after the
    /// other on the worker, so they add up.
    pub fn add(&mut self, o: &OwnLoad) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prefilling = self.prefilling.saturating_add(o.prefilling);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
        self.active_blocks = self.active_blocks.saturating_add(o.active_blocks);
        self.expected_blocks = self.expected_blocks.saturating_add(o.expected_blocks);
        self.decode_sensitivity += o.decode_sensitivity;
        self.prefill_backlog_ms += o.prefill_backlog_ms;
        self.prefill_load += o.prefill_load;
    }

    /// Whether `self` and `o` differ enough to publish: any count, or a figure by more than
    /// rounding (the backlog runs down on its own; a change under a ms is not news).
    pub fn differs(&self, o: &OwnLoad) -> bool {
        (self.requests, self.prefilling, self.prefill_tokens, self.active_blocks, self.expected_blocks)
            != (o.requests, o.prefilling, o.prefill_tokens, o.active_blocks, o.expected_blocks)
            || (self.decode_sensitivity - o.decode_sensitivity).abs() > 1e-6
            || (self.prefill_load - o.prefill_load).abs() > 0.01
    }

    /// Nothing booked.
    pub fn is_idle(&self) -> bool {
        self.requests == 0 && self.prefill_tokens == 0 && self.active_blocks == 0 && self.expected_blocks == 0
    }
}

/// The sum of the peers' [`OwnLoad`] on one worker, as the ledger reads it.
#[derive(Debug, Default)]
pub struct PeerLoad {
    requests: AtomicU32,
    prefilling: AtomicU32,
    prefill_tokens: AtomicU64,
    active_blocks: AtomicU64,
    expected_blocks: AtomicU64,
    /// Millionths.
    decode_sensitivity: AtomicU64,
    /// When the peers' booked prefill is predicted done, µs on [`super::clock_us`]'s clock.
    prefill_done_at: AtomicU64,
    /// Millionths.
    prefill_load: AtomicU64,
}

impl PeerLoad {
    /// Replaces the peers' load with `sum`, as of `now` on [`super::clock_us`]'s clock (the
    /// backlog runs down from then).
    pub fn set(&self, sum: &OwnLoad, now: u64) {
        self.requests.store(sum.requests, Ordering::Relaxed);
        self.prefilling.store(sum.prefilling, Ordering::Relaxed);
        self.prefill_tokens.store(sum.prefill_tokens, Ordering::Relaxed);
        self.active_blocks.store(sum.active_blocks, Ordering::Relaxed);
        self.expected_blocks.store(sum.expected_blocks, Ordering::Relaxed);
        self.decode_sensitivity.store(micro(sum.decode_sensitivity), Ordering::Relaxed);
        self.prefill_done_at.store(now.saturating_add(micro(sum.prefill_backlog_ms / 1000.0)), Ordering::Relaxed);
        self.prefill_load.store(micro(sum.prefill_load), Ordering::Relaxed);
    }

    /// The peers' load as of `now`: what [`PeerLoad::set`] stored, the backlog run down.
    pub fn get(&self, now: u64) -> OwnLoad {
        OwnLoad {
            requests: self.requests(),
            prefilling: self.prefilling(),
            prefill_tokens: self.prefill_tokens(),
            active_blocks: self.active_blocks(),
            expected_blocks: self.expected_blocks(),
            decode_sensitivity: self.decode_sensitivity(),
            prefill_backlog_ms: self.prefill_backlog_ms(now),
            prefill_load: self.prefill_load(),
        }
    }

    /// Requests in flight.
    pub fn requests(&self) -> u32 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Requests with their prefill outstanding.
    pub fn prefilling(&self) -> u32 {
        self.prefilling.load(Ordering::Relaxed)
    }

    /// Prefill tokens booked.
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }

    /// Active blocks booked.
    pub fn active_blocks(&self) -> u64 {
        self.active_blocks.load(Ordering::Relaxed)
    }

    /// Blocks expected to be held.
    pub fn expected_blocks(&self) -> u64 {
        self.expected_blocks.load(Ordering::Relaxed)
    }

    /// Σ 1 / expected output tokens of their decoding requests.
    pub fn decode_sensitivity(&self) -> f64 {
        self.decode_sensitivity.load(Ordering::Relaxed) as f64 / 1e6
    }

    /// Predicted time until their booked prefill is computed, as of `now`, ms (zero once none
    /// is booked).
    pub fn prefill_backlog_ms(&self, now: u64) -> f64 {
        if self.prefill_tokens() == 0 {
            return 0.0;
        }
        self.prefill_done_at.load(Ordering::Relaxed).saturating_sub(now) as f64 / 1000.0
    }

    /// Predicted prefill time booked per second.
    pub fn prefill_load(&self) -> f64 {
        self.prefill_load.load(Ordering::Relaxed) as f64 / 1e6
    }
}

/// `x` in millionths, rounded; negative figures (and NaN) are taken as zero, those past
/// `u64::MAX` as its maximum.
fn micro(x: f64) -> u64 {
    #[allow(clippy::cast_sign_loss, reason = "clamped to 0 or more first")]
    let m = (x.max(0.0) * 1e6).round() as u64;
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_is_stored_whole_and_its_backlog_runs_down() {
        let mut sum = OwnLoad {
            requests: 2,
            prefilling: 1,
            prefill_tokens: 500,
            active_blocks: 40,
            expected_blocks: 60,
            decode_sensitivity: 0.01,
            prefill_backlog_ms: 30.0,
            prefill_load: 0.25,
        };
        sum.add(&OwnLoad { requests: 1, prefill_tokens: 100, prefill_backlog_ms: 20.0, prefill_load: 0.25, ..Default::default() });
        let p = PeerLoad::default();
        p.set(&sum, 1_000);
        let got = p.get(1_000);
        assert_eq!((got.requests, got.prefilling, got.prefill_tokens, got.active_blocks, got.expected_blocks), (3, 1, 600, 40, 60));
        assert!((got.prefill_backlog_ms - 50.0).abs() < 1e-9, "backlogs queue one after the other: {got:?}");
        assert!((got.prefill_load - 0.5).abs() < 1e-9 && (got.decode_sensitivity - 0.01).abs() < 1e-9);
        assert!((p.prefill_backlog_ms(21_000) - 30.0).abs() < 1e-9, "20 ms later");
        assert!(p.prefill_backlog_ms(90_000).abs() < 1e-12);
        p.set(&OwnLoad::default(), 2_000);
        assert!(p.get(2_000).is_idle());
        assert!(p.prefill_backlog_ms(2_000).abs() < 1e-12);
    }
}
