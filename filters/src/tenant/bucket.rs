//! A per-minute limit as a token bucket: it holds at most the limit, refills continuously at
//! the limit per minute, and a take either fits whole or waits. This is how OpenAI describes
//! its limits (a minute's allowance replenished continuously, not a window that resets), so a
//! client that reads `remaining` and `reset` sees the same arithmetic.

use std::time::{Duration, Instant};

/// One limit's bucket.
#[derive(Debug, Clone)]
pub struct Bucket {
    /// The limit per minute: what a full bucket holds.
    capacity: f64,
    /// What it holds now; below zero after charges taken whatever the level (streamed output).
    level: f64,
    /// When `level` was last brought up to date.
    at: Instant,
}

/// A bucket's state as rate-limit headers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    /// The limit per minute.
    pub limit: u64,
    /// What may still be taken now (never below zero).
    pub remaining: u64,
    /// Until the bucket is full again.
    pub reset: Duration,
}

impl Bucket {
    /// A full bucket of `per_minute`.
    pub fn new(per_minute: u64, now: Instant) -> Self {
        Self { capacity: per_minute as f64, level: per_minute as f64, at: now }
    }

    /// The same bucket with another limit: what was used stays used (a reload does not hand
    /// out a fresh minute).
    pub fn with_limit(&self, per_minute: u64, now: Instant) -> Self {
        let mut b = self.clone();
        b.refill(now);
        let used = b.capacity - b.level;
        b.capacity = per_minute as f64;
        b.level = b.capacity - used;
        b
    }

    fn rate_per_sec(&self) -> f64 {
        self.capacity / 60.0
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.rate_per_sec()).min(self.capacity);
        self.at = self.at.max(now);
    }

    /// How long until `n` fits, `Duration::ZERO` when it fits now; `None` when it never fits
    /// (more than the limit).
    pub fn wait_for(&mut self, n: u64, now: Instant) -> Option<Duration> {
        self.refill(now);
        let n = n as f64;
        if n > self.capacity {
            return None;
        }
        if n <= self.level {
            return Some(Duration::ZERO);
        }
        Some(Duration::from_secs_f64((n - self.level) / self.rate_per_sec()))
    }

    /// Takes `n` whatever the level (a charge for what was already served).
    pub fn charge(&mut self, n: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level - n).min(self.capacity);
    }

    /// The state the headers show.
    #[allow(clippy::cast_sign_loss, reason = "the capacity is a u64 and the level is clamped to 0 or more")]
    pub fn level(&mut self, now: Instant) -> Level {
        self.refill(now);
        let rate = self.rate_per_sec();
        let missing = (self.capacity - self.level).max(0.0);
        Level {
            limit: self.capacity as u64,
            remaining: self.level.max(0.0).floor() as u64,
            reset: if rate > 0.0 { Duration::from_secs_f64(missing / rate) } else { Duration::ZERO },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_fit_whole_refill_by_the_minute_and_over_the_limit_never_fits() {
        let t0 = Instant::now();
        let mut b = Bucket::new(600, t0);
        assert_eq!(b.wait_for(600, t0), Some(Duration::ZERO));
        b.charge(600.0, t0);
        assert_eq!(b.level(t0).remaining, 0);
        // 600 a minute is 10 a second: 5 more need half a second.
        let w = b.wait_for(5, t0).unwrap();
        assert!((w.as_secs_f64() - 0.5).abs() < 1e-9, "{w:?}");
        assert_eq!(b.level(t0 + Duration::from_secs(1)).remaining, 10);
        assert_eq!(b.wait_for(601, t0), None);
        assert_eq!(b.level(t0 + Duration::from_secs(120)), Level { limit: 600, remaining: 600, reset: Duration::ZERO });
    }

    #[test]
    fn charges_may_go_below_zero_and_a_new_limit_keeps_what_was_used() {
        let t0 = Instant::now();
        let mut b = Bucket::new(60, t0);
        b.charge(90.0, t0);
        assert_eq!(b.level(t0).remaining, 0);
        assert_eq!(b.wait_for(1, t0), Some(Duration::from_secs(31)));
        let mut c = b.with_limit(120, t0);
        assert_eq!(c.level(t0).remaining, 30);
    }
}
