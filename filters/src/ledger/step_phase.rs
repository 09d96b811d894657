//! Where a worker is in its engine step, as the gateway sees it. vLLM adds a waiting request to
//! the batch only between steps, and every running stream gets a token at a step's end, so the
//! last token the gateway relayed from a worker marks when its running step began; the prefills
//! booked on it since then will all run in its next step, together with the next request's.
//! The `time` cost reads both (docs/routing.md, "The time cost"): without them, the worker that
//! just finished a request looks the least loaded exactly when a new request would wait a whole
//! step there (benches/RESULTS.md, "Joining the next step").

use std::sync::atomic::{AtomicU64, Ordering};

/// One worker's step phase. Relaxed atomics, approximate under races (a booking racing a step's
/// end may be counted in the step it missed), which a prediction tolerates; it never blocks.
#[derive(Debug, Default)]
pub struct StepPhase {
    /// When it last delivered a token, µs on the ledger's clock (0: never).
    step_seen_us: AtomicU64,
    /// Prefill tokens booked since `since_us`.
    next_step_tokens: AtomicU64,
    /// When `next_step_tokens` started counting: the first booking after a step ended.
    since_us: AtomicU64,
}

impl StepPhase {
    /// A token was delivered at `now`: a step ended and the next one began.
    pub fn step_ended(&self, now: u64) {
        self.step_seen_us.store(now.max(1), Ordering::Relaxed);
    }

    /// `tokens` of prefill were booked at `now`.
    pub fn booked(&self, tokens: u64, now: u64) {
        if !self.counting() {
            // The first booking since the running step began: count afresh.
            self.since_us.store(now.max(1), Ordering::Relaxed);
            self.next_step_tokens.store(tokens, Ordering::Relaxed);
        } else {
            self.next_step_tokens.fetch_add(tokens, Ordering::Relaxed);
        }
    }

    /// Prefill tokens booked since the running step began: they share the next step.
    pub fn next_step_tokens(&self) -> u64 {
        if self.counting() { self.next_step_tokens.load(Ordering::Relaxed) } else { 0 }
    }

    /// Whether `next_step_tokens` holds bookings made since the running step began (a token
    /// since the first of them means the step they waited for has begun).
    fn counting(&self) -> bool {
        self.step_seen_us.load(Ordering::Relaxed) < self.since_us.load(Ordering::Relaxed)
    }

    /// Time since its last token at `now`, ms; `None` before its first.
    pub fn since_step_ms(&self, now: u64) -> Option<f64> {
        let seen = self.step_seen_us.load(Ordering::Relaxed);
        (seen > 0).then(|| now.saturating_sub(seen) as f64 / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookings_count_until_the_next_token() {
        let p = StepPhase::default();
        assert_eq!(p.since_step_ms(5_000), None, "no token yet");
        p.booked(100, 1_000);
        p.booked(28, 2_000);
        assert_eq!(p.next_step_tokens(), 128, "both wait for the same step");
        p.step_ended(3_000);
        assert_eq!(p.next_step_tokens(), 0, "that step began: they are in it");
        assert_eq!(p.since_step_ms(10_000), Some(7.0));
        p.booked(64, 4_000);
        assert_eq!(p.next_step_tokens(), 64, "counting starts afresh");
    }
}
