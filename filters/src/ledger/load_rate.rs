//! How busy the prefill booked on a worker keeps it: the predicted prefill time booked per
//! second of wall time, averaged with exponential decay. The `time` cost reads the mean over
//! the candidates as the utilisation `ρ` of the fleet's prefill (docs/routing.md, "The time
//! cost").

use std::sync::atomic::{AtomicU64, Ordering};

/// Seconds over which bookings are averaged: long enough to hold tens of bookings at the
/// rates a worker serves, short enough to follow a change of load within seconds.
pub const WINDOW_S: f64 = 5.0;

/// An exponentially decayed sum of booked prefill time. Approximate under concurrent
/// bookings (two that race may decay the few microseconds between them twice), which a load
/// estimate tolerates; it never blocks.
#[derive(Debug, Default)]
pub struct LoadRate {
    /// The decayed sum, µs, as `f64` bits.
    sum_us: AtomicU64,
    /// When the sum was last decayed, µs on the ledger's clock.
    at_us: AtomicU64,
}

/// What a sum decays by from `from` to `to` (µs on the ledger's clock).
fn decay(from: u64, to: u64) -> f64 {
    let dt = to.saturating_sub(from) as f64 / 1e6;
    (-dt / WINDOW_S).exp()
}

impl LoadRate {
    /// Adds `time_us` of predicted prefill booked at `now` (µs on the ledger's clock).
    pub fn add(&self, time_us: u64, now: u64) {
        let k = decay(self.at_us.fetch_max(now, Ordering::Relaxed), now);
        let _ = self.sum_us.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) * k + time_us as f64).to_bits()));
    }

    /// The predicted prefill time booked per second of wall time as of `now`: 0.5 means the
    /// worker's prefill is predicted to keep it busy half the time.
    pub fn at(&self, now: u64) -> f64 {
        let sum = f64::from_bits(self.sum_us.load(Ordering::Relaxed));
        sum * decay(self.at_us.load(Ordering::Relaxed), now) / (WINDOW_S * 1e6)
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    const S: u64 = 1_000_000;

    #[test]
    fn a_steady_load_reads_as_its_busy_fraction() {
        let r = LoadRate::default();
        // 100 ms of prefill booked every 200 ms for a minute: busy half the time.
        for i in 0..300 {
            r.add(100_000, i * 200_000);
        }
        let rho = r.at(60 * S);
        assert!((0.45..0.55).contains(&rho), "{rho}");
    }

    #[test]
    fn it_decays_once_bookings_stop() {
        let r = LoadRate::default();
        for i in 0..300 {
            r.add(100_000, i * 200_000);
        }
        let (then, later) = (r.at(60 * S), r.at(60 * S + 5 * S));
        assert!((later / then - (-1.0f64).exp()).abs() < 1e-9, "{then} {later}");
        assert_eq!(LoadRate::default().at(S), 0.0);
    }
}
