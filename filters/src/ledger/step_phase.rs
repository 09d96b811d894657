//! Where a worker is in its engine step, as the gateway sees it. vLLM adds a waiting request to
//! the batch only between steps, and every running stream gets a token at a step's end, so the
//! last token the gateway relayed from a worker marks when its running step began; the prefills
//! booked on it since then will all run in its next step, together with the next request's.
//! The `time` cost reads both (docs/routing.md, "The time cost"): without them, the worker that
//! just finished a request looks the least loaded exactly when a new request would wait a whole
//! step there.

use super::decayed_mean::DecayedMean;
use std::sync::atomic::{AtomicU64, Ordering};

/// Weight of the newest step in the step averages: about the last 16 steps count.
const STEP_WEIGHT: f64 = 1.0 / 16.0;
/// A token this long after the one before begins a new step even with nothing booked since
/// (a step's tokens reach the gateway together, within a millisecond or so): a quarter of the
/// mean step, within these bounds. The upper one matters: a threshold from a mean inflated by
/// one huge step would hide every shorter step after it, and the mean would never come down.
const MIN_STEP_GAP_US: u64 = 1_000;
const MAX_STEP_GAP_US: u64 = 10_000;

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
    /// When the running step began: the first token of the burst that ended the one before,
    /// or the booking that woke an idle worker ([`StepPhase::starts`]).
    began_us: AtomicU64,
    /// Prefill tokens booked into the running step (those counted when it began).
    running_tokens: AtomicU64,
    /// Decayed mean of its step lengths, µs.
    mean_step_us: DecayedMean,
    /// Decayed mean of the prefill tokens booked into those steps.
    mean_step_tokens: DecayedMean,
}

/// What the gateway has seen of a worker's engine steps: how long they take on average, with
/// how much prefill in them, and how much prefill the running one carries. A step's length is
/// its decodes plus its prefill, so the running step's is predicted as the mean plus the
/// prefill it carries beyond the mean's (`route::time`, `join`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepLengths {
    /// Mean step length, ms.
    pub mean_ms: f64,
    /// Mean prefill tokens per step.
    pub mean_tokens: f64,
    /// Prefill tokens in the running step.
    pub running_tokens: u64,
}

impl StepPhase {
    /// A token was delivered at `now`: a step ended and the next one began. The first token
    /// of a step's burst (one with bookings waiting for it, or one well after the token before)
    /// closes the step that ran until now into the averages. `true` when the token came well
    /// after the one before (or is the first): a step surely ended. A token soon after another
    /// with bookings waiting also closes the step for the averages, but may be a late token of
    /// the same burst, which a count of steps must not take for a new one.
    pub fn step_ended(&self, now: u64) -> bool {
        let now = now.max(1);
        let pending = self.counting();
        let seen = self.step_seen_us.swap(now, Ordering::Relaxed);
        let mean = self.mean_step_us.get();
        #[allow(clippy::cast_sign_loss, reason = "a mean of step durations: not negative")]
        let gap = ((mean.unwrap_or(0.0) / 4.0) as u64).clamp(MIN_STEP_GAP_US, MAX_STEP_GAP_US);
        let boundary = seen == 0 || now.saturating_sub(seen) > gap;
        if !(pending || boundary) {
            return false;
        }
        let began = self.began_us.swap(now, Ordering::Relaxed);
        let tokens = if pending { self.next_step_tokens.load(Ordering::Relaxed) } else { 0 };
        let ran = self.running_tokens.swap(tokens, Ordering::Relaxed);
        if began == 0 || seen == 0 {
            return boundary;
        }
        // Two first tokens racing, or a booking landing mid-burst, time a step of nothing.
        if now.saturating_sub(began) < MIN_STEP_GAP_US {
            return boundary;
        }
        // A step that began after an idle spell started late: at most a few means long.
        let len = now.saturating_sub(began) as f64;
        let len = mean.map_or(len, |mean| len.min(3.0 * mean));
        self.mean_step_us.observe(len, STEP_WEIGHT);
        self.mean_step_tokens.observe(ran as f64, STEP_WEIGHT);
        boundary
    }

    /// Its steps so far, once one has been timed.
    pub fn lengths(&self) -> Option<StepLengths> {
        self.mean_step_us.get().map(|mean_us| StepLengths {
            mean_ms: mean_us / 1000.0,
            mean_tokens: self.mean_step_tokens.get().unwrap_or(0.0),
            running_tokens: self.running_tokens.load(Ordering::Relaxed),
        })
    }

    /// A request with `tokens` of prefill (perhaps none: a cached prompt) was booked at `now` on
    /// a worker with nothing running: it starts a step at once, so that step is timed from now
    /// (not from its last token, before it went idle).
    pub fn starts(&self, tokens: u64, now: u64) {
        self.began_us.store(now.max(1), Ordering::Relaxed);
        self.running_tokens.store(tokens, Ordering::Relaxed);
    }

    /// `tokens` of prefill were booked at `now` on a worker with requests running.
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
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
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

    #[test]
    fn steps_are_timed_from_the_first_token_of_each_burst() {
        let p = StepPhase::default();
        let ms = 1_000;
        // Steps of 100 ms, each delivering three tokens within a millisecond.
        let burst = |at: u64| (0..3).for_each(|i| _ = p.step_ended(at + i * 300));
        burst(10 * ms);
        assert_eq!(p.lengths(), None, "one boundary times nothing yet");
        burst(110 * ms);
        assert_eq!(p.lengths().map(|l| l.mean_ms), Some(100.0));
        // 128 tokens booked into the next step: it carries them.
        p.booked(128, 150 * ms);
        burst(210 * ms);
        let l = p.lengths().unwrap();
        assert_eq!(l.running_tokens, 128);
        assert_eq!(l.mean_tokens, 0.0, "the step that ended carried none");
        // That step took 160 ms: the means move towards it and its tokens.
        burst(370 * ms);
        let l = p.lengths().unwrap();
        assert!((l.mean_ms - (100.0 + (160.0 - 100.0) / 16.0)).abs() < 1e-9, "{l:?}");
        assert!((l.mean_tokens - 8.0).abs() < 1e-9, "{l:?}");
        assert_eq!(l.running_tokens, 0);
        // Idle for a minute, then a request: its step is timed from its booking.
        p.starts(64, 60_000 * ms);
        burst(60_090 * ms);
        let l = p.lengths().unwrap();
        assert!((l.mean_ms - (103.75 + (90.0 - 103.75) / 16.0)).abs() < 1e-9, "{l:?}");
        assert_eq!(l.running_tokens, 0);
        // Whatever else stretched a step counts as at most three mean steps.
        burst(70_000 * ms);
        assert!(p.lengths().unwrap().mean_ms < 120.0, "{:?}", p.lengths());
    }

    #[test]
    fn a_booking_landing_mid_burst_times_no_step() {
        let p = StepPhase::default();
        let ms = 1_000;
        p.step_ended(10 * ms);
        p.step_ended(110 * ms);
        // A booking between two tokens of the next burst makes the second look like a step's
        // first token; a step of 0.2 ms is not counted.
        p.step_ended(210 * ms);
        p.booked(128, 210 * ms + 100);
        p.step_ended(210 * ms + 200);
        assert_eq!(p.lengths().map(|l| l.mean_ms), Some(100.0));
    }

    #[test]
    fn short_steps_after_a_huge_one_bring_the_mean_down() {
        let p = StepPhase::default();
        let ms = 1_000;
        // One 2.5 s step (a burst of long prefills), then 60 ms steps with nothing booked.
        p.step_ended(ms);
        p.step_ended(2_501 * ms);
        assert_eq!(p.lengths().map(|l| l.mean_ms), Some(2_500.0));
        for i in 1..=80 {
            p.step_ended(2_501 * ms + i * 60 * ms);
        }
        assert!(p.lengths().unwrap().mean_ms < 100.0, "{:?}", p.lengths());
    }

    #[test]
    fn only_a_token_well_after_the_one_before_surely_ends_a_step() {
        let p = StepPhase::default();
        let ms = 1_000;
        assert!(p.step_ended(10 * ms), "the first token");
        assert!(!p.step_ended(10 * ms + 200), "the same burst");
        assert!(p.step_ended(110 * ms), "the next burst");
        p.booked(128, 110 * ms + 100);
        assert!(!p.step_ended(110 * ms + 300), "a late token of that burst, a booking waiting");
    }
}
