//! Latency objectives: a bound on the time to first token and on the time per output
//! token, per model (`slo:`) or per request (`x-slo-ttft-ms`, `x-slo-tpot-ms`). With one set,
//! the `time` cost adds what each worker's predicted miss costs ([`Slo::excess_ms`]): a worker
//! predicted to meet every bound costs what it did, one predicted to miss pays its excess in ms
//! of time to first token. Ruling out every worker predicted to miss (llm-d's predicted-latency
//! scorer's rule, headroom first) was measured first and lost goodput where predictions sit
//! near the bounds: prefix-heavy traffic left the workers caching its prefix, computed more
//! prefill and missed more. [`Slo::violation`] says whether a placement was
//! predicted to meet them; `kvgate-bench compare` measures the fraction of requests that met
//! both (goodput, as DistServe defines it).

use serde::Deserialize;

/// Latency bounds of a request (unset: no bound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slo {
    /// Time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Time per output token (the mean gap between tokens after the first), ms.
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// Whether any bound is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }

    /// Checks that every bound set is a positive number of milliseconds.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("{name} must be a positive number of milliseconds, got {v}"));
            }
        }
        Ok(())
    }

    /// These bounds, each replaced by `other`'s where it sets one (a request's own over its
    /// model's).
    pub fn overridden_by(self, other: Slo) -> Slo {
        Slo { ttft_ms: other.ttft_ms.or(self.ttft_ms), tpot_ms: other.tpot_ms.or(self.tpot_ms) }
    }

    /// How many ms of time to first token one ms of time per output token is worth under
    /// these bounds, when both are set: their ratio, so that a TPOT excess weighs as much as a
    /// TTFT excess of the same relative size ([`Slo::violation`]'s measure).
    pub fn tpot_weight(&self) -> Option<f64> {
        Some(self.ttft_ms? / self.tpot_ms?)
    }

    /// What predictions of `ttft_ms` and `tpot_ms` missing the bounds cost, in ms of time to
    /// first token: the TTFT excess, and the TPOT excess at `tpot_weight` ms each (the bounds'
    /// own ratio where both are set, so a miss of 10% costs the same on either bound). Added
    /// to the `time` cost, it prices a miss instead of ruling the worker out.
    pub fn excess_ms(&self, ttft_ms: f64, tpot_ms: f64, tpot_weight: f64) -> f64 {
        let excess = |bound: Option<f64>, v: f64| bound.map_or(0.0, |b| (v - b).max(0.0));
        excess(self.ttft_ms, ttft_ms) + tpot_weight * excess(self.tpot_ms, tpot_ms)
    }

    /// How far predictions of `ttft_ms` and `tpot_ms` miss the bounds: the sum of each missed
    /// bound's relative excess (0: every bound met). Relative, so that a miss of 10% weighs the
    /// same on either bound.
    pub fn violation(&self, ttft_ms: f64, tpot_ms: f64) -> f64 {
        let excess = |bound: Option<f64>, v: f64| bound.map_or(0.0, |b| ((v - b) / b).max(0.0));
        excess(self.ttft_ms, ttft_ms) + excess(self.tpot_ms, tpot_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn violation_is_the_relative_excess_over_each_bound() {
        let slo = Slo { ttft_ms: Some(1000.0), tpot_ms: Some(50.0) };
        assert!(slo.violation(900.0, 49.0).abs() < 1e-12, "both met");
        assert!((slo.violation(1500.0, 40.0) - 0.5).abs() < 1e-12);
        assert!((slo.violation(1100.0, 60.0) - 0.3).abs() < 1e-12, "10% and 20% over");
        assert!(Slo { tpot_ms: Some(50.0), ..Slo::default() }.violation(1e9, 50.0).abs() < 1e-12, "no TTFT bound");
        assert!(!Slo::default().is_set());
        assert_eq!(slo.tpot_weight(), Some(20.0));
        assert_eq!(Slo { ttft_ms: Some(1000.0), ..Slo::default() }.tpot_weight(), None, "one bound says no exchange rate");
    }

    #[test]
    fn a_request_bound_overrides_the_models_and_bad_bounds_are_refused() {
        let model = Slo { ttft_ms: Some(2000.0), tpot_ms: Some(100.0) };
        let own = Slo { tpot_ms: Some(30.0), ..Slo::default() };
        assert_eq!(model.overridden_by(own), Slo { ttft_ms: Some(2000.0), tpot_ms: Some(30.0) });
        assert!(Slo { ttft_ms: Some(0.0), ..Slo::default() }.validate().is_err());
        assert!(Slo { tpot_ms: Some(f64::NAN), ..Slo::default() }.validate().is_err());
        assert!(model.validate().is_ok());
    }
}
