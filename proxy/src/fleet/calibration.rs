//! What the gateway learns about one worker's speed, for `kv` mode's `time` cost
//! (docs/routing.md, "The time cost"): two correction factors on the cost's priors.
//!
//! - `prefill`: from each streamed request's time to first token on its first worker, after
//!   the part the steps explain, against the wait and prefill that were predicted for it. A
//!   least-squares fit through the origin of measured on prior-predicted time (wait and
//!   prefill), over decayed sums: a sample counts by the square of its predicted time, so a
//!   long prefill (or a long predicted wait) tells the worker's speed and a short prompt's few
//!   ms, mostly queueing the gateway could not see, hardly move it.
//! - `step`: from each inter-token gap, against the step time the priors predict for the load
//!   booked on the worker at that moment, an exponentially weighted average of their ratio.
//!
//! A sample's measured time counts at most 4× what was predicted, so a request stuck behind load
//! the gateway did not book (another gateway's, a stalled engine) bends the estimate without
//! breaking it; a long one after many short ones can still move the prefill factor most of the
//! way to its ratio, which is the point of the fit. Each factor is read lock-free from a
//! `DecayedMean` (the ledger's); the prefill fit's sums sit behind a lock taken once per
//! streamed request, never by routing.

use kvgate_filters::ledger::decayed_mean::DecayedMean;
use parking_lot::Mutex;

/// Weight of a new prefill sample in the fit's decayed sums (one per streamed request).
const PREFILL_WEIGHT: f64 = 1.0 / 8.0;
/// Weight of a new step sample (one per token gap, so many more).
const STEP_WEIGHT: f64 = 1.0 / 32.0;
/// A sample's ratio is clamped to [1/CLAMP, CLAMP] of the factor it was predicted with.
const CLAMP: f64 = 4.0;
/// Predictions shorter than this (ms) say too little to learn from: timer and network noise.
const MIN_PREDICTED_MS: f64 = 2.0;

/// The smallest factor either may reach.
const MIN_FACTOR: f64 = 1e-6;

/// The two factors (nothing learned yet: the priors apply as they are).
#[derive(Debug)]
pub struct Calibration {
    /// The prefill factor as last fitted (what routing reads).
    prefill: DecayedMean,
    /// The sums the prefill factor is fitted from; locked once per streamed request.
    prefill_fit: Mutex<Fit>,
    /// The step factor.
    step: DecayedMean,
}

/// Decayed sums of a least-squares fit through the origin, `y ≈ factor · x`.
#[derive(Debug, Default)]
struct Fit {
    xy: f64,
    xx: f64,
}

impl Fit {
    /// Adds `(x, y)` at `weight`, the older samples decayed by `1 − weight`; the factor now,
    /// or `None` (and the sums start over) if they stopped being finite numbers.
    fn add(&mut self, x: f64, y: f64, weight: f64) -> Option<f64> {
        self.xy += weight * (x * y - self.xy);
        self.xx += weight * (x * x - self.xx);
        let factor = self.xy / self.xx;
        if self.xx > 0.0 && factor.is_finite() {
            Some(factor)
        } else {
            *self = Self::default();
            None
        }
    }
}

impl Default for Calibration {
    fn default() -> Self {
        Self { prefill: DecayedMean::at_least(MIN_FACTOR), prefill_fit: Mutex::default(), step: DecayedMean::at_least(MIN_FACTOR) }
    }
}

impl Calibration {
    /// The prefill factor learned so far (1.0 before any sample).
    pub fn prefill(&self) -> f64 {
        self.prefill.get().unwrap_or(1.0)
    }

    /// The step factor learned so far (1.0 before any sample).
    pub fn step(&self) -> f64 {
        self.step.get().unwrap_or(1.0)
    }

    /// Whether any prefill sample was taken.
    pub fn has_prefill(&self) -> bool {
        self.prefill.get().is_some()
    }

    /// Whether any step sample was taken.
    pub fn has_step(&self) -> bool {
        self.step.get().is_some()
    }

    /// A request's first token took `ttft_ms` after it was sent; `predicted_ms` of it was the
    /// wait and prefill predicted with the prefill factor `factor_then` (the one in force when
    /// it was placed), `steps_ms` what the steps explain.
    ///
    /// The sample is the prediction at the priors (`predicted_ms / factor_then`) against the
    /// time measured, not a ratio applied to the current factor: the requests placed together
    /// on a worker before its first token were all predicted with the same factor, and applying
    /// each one's ratio to a factor the earlier ones had already raised compounded one slow
    /// start into a factor far too high, which then kept the worker from ever being chosen
    /// again.
    ///
    /// The fit weighs a sample by its predicted time squared. An average of ratios weighed
    /// every request alike, and on a trace of 16k-token documents among short questions the
    /// short ones' unseen waits (4× their few ms of prefill) swung identical workers' factors
    /// far apart, so the same 16k prefill was predicted well short on some and well over on
    /// others.
    pub fn observe_prefill(&self, ttft_ms: f64, predicted_ms: f64, steps_ms: f64, factor_then: f64) {
        let finite = [ttft_ms, predicted_ms, steps_ms, factor_then].iter().all(|v| v.is_finite());
        if !finite || predicted_ms < MIN_PREDICTED_MS || factor_then <= 0.0 {
            return;
        }
        let at_priors = predicted_ms / factor_then;
        let measured = (ttft_ms - steps_ms).clamp(predicted_ms / CLAMP, predicted_ms * CLAMP);
        // Published under the lock, so a fit that includes a sample never loses to an older one.
        let mut fit = self.prefill_fit.lock();
        if let Some(factor) = fit.add(at_priors, measured, PREFILL_WEIGHT) {
            self.prefill.observe(factor, 1.0);
        }
    }

    /// One inter-token gap of `gap_ms` where the priors predict a step of `prior_step_ms`.
    pub fn observe_step(&self, gap_ms: f64, prior_step_ms: f64) {
        if prior_step_ms <= 0.0 || !gap_ms.is_finite() {
            return;
        }
        let now = self.step();
        let ratio = (gap_ms / (prior_step_ms * now)).clamp(1.0 / CLAMP, CLAMP);
        self.step.observe(now * ratio, STEP_WEIGHT);
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    #[test]
    fn converges_on_a_worker_three_times_slower_than_the_priors() {
        let c = Calibration::default();
        assert_eq!(c.prefill(), 1.0);
        for _ in 0..60 {
            // The gateway predicts with the factor in force; the worker takes 3× the prior.
            let predicted = 100.0 * c.prefill();
            c.observe_prefill(300.0 + 6.0, predicted, 6.0, c.prefill());
            let prior_step = 10.0;
            c.observe_step(30.0, prior_step);
        }
        assert!((c.prefill() - 3.0).abs() < 0.05, "{}", c.prefill());
        for _ in 0..200 {
            c.observe_step(30.0, 10.0);
        }
        assert!((c.step() - 3.0).abs() < 0.1, "{}", c.step());
    }

    #[test]
    fn one_outlier_bends_the_estimate_without_breaking_it() {
        let c = Calibration::default();
        for _ in 0..20 {
            c.observe_prefill(100.0, 100.0 * c.prefill(), 0.0, c.prefill());
        }
        c.observe_prefill(60_000.0, 100.0 * c.prefill(), 0.0, c.prefill());
        assert!(c.prefill() < 1.5, "{}", c.prefill());
    }

    #[test]
    fn numbers_that_are_not_finite_teach_nothing() {
        let c = Calibration::default();
        c.observe_prefill(300.0, 100.0, 0.0, 1.0);
        for bad in [f64::NAN, f64::INFINITY] {
            c.observe_prefill(300.0, bad, 0.0, 1.0);
            c.observe_prefill(bad, 100.0, 0.0, 1.0);
            c.observe_prefill(300.0, 100.0, bad, 1.0);
            c.observe_prefill(300.0, 100.0, 0.0, bad);
        }
        assert!((c.prefill() - 3.0).abs() < 1e-9, "{}", c.prefill());
        // Sums that overflow start over rather than publish NaN.
        c.observe_prefill(1e300, 1e300, 0.0, 1e-300);
        assert!(c.prefill().is_finite() && c.prefill() > 0.0, "{}", c.prefill());
    }

    #[test]
    fn short_prompts_unseen_waits_do_not_move_what_long_prefills_measure() {
        let c = Calibration::default();
        for _ in 0..40 {
            // A 16k prefill measured as predicted at the priors, then three short prompts
            // that each waited 4× their predicted 5 ms behind load the gateway did not see.
            c.observe_prefill(760.0, 760.0 * c.prefill(), 0.0, c.prefill());
            for _ in 0..3 {
                c.observe_prefill(20.0, 5.0 * c.prefill(), 0.0, c.prefill());
            }
        }
        assert!((c.prefill() - 1.0).abs() < 0.01, "{}", c.prefill());
        // Only short prompts: their ratio is all there is, and the factor follows it.
        let short = Calibration::default();
        for _ in 0..60 {
            short.observe_prefill(10.0, 5.0 * short.prefill(), 0.0, short.prefill());
        }
        assert!((short.prefill() - 2.0).abs() < 0.01, "{}", short.prefill());
    }

    #[test]
    fn requests_placed_together_do_not_compound_a_slow_start() {
        let c = Calibration::default();
        // Fourteen requests placed on a fresh worker before any first token, all predicted at
        // the prior (factor 1), each answered ten times slower than predicted.
        for _ in 0..14 {
            c.observe_prefill(1000.0, 100.0, 0.0, 1.0);
        }
        // The estimate is at most the clamp on one sample (4×), not 4 × 1.375^13.
        assert!((c.prefill() - 4.0).abs() < 1e-9, "{}", c.prefill());
        // Later requests, predicted with that factor, bring it the rest of the way.
        for _ in 0..40 {
            c.observe_prefill(1000.0, 100.0 * c.prefill(), 0.0, c.prefill());
        }
        assert!((c.prefill() - 10.0).abs() < 0.1, "{}", c.prefill());
    }

    #[test]
    fn tiny_predictions_teach_nothing() {
        let c = Calibration::default();
        c.observe_prefill(50.0, 0.5, 0.0, 1.0);
        assert!(!c.has_prefill());
    }
}
