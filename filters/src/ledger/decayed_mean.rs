//! An exponentially weighted mean shared between threads without a lock: what the gateway
//! learns from a stream of measurements (a worker's step lengths in [`super::step_phase`], the
//! proxy's per-worker calibration factors). The first sample sets it; each later one moves it a
//! fixed fraction of the way. Relaxed atomics: two racing samples lose one, which a mean
//! shrugs off.

use std::sync::atomic::{AtomicU64, Ordering};

/// The bits of "no sample yet": a NaN no arithmetic on samples produces.
const UNSET: u64 = u64::MAX;

/// The mean (`f64` bits), never below `floor`.
#[derive(Debug)]
pub struct DecayedMean {
    bits: AtomicU64,
    floor: f64,
}

impl Default for DecayedMean {
    fn default() -> Self {
        Self::at_least(f64::NEG_INFINITY)
    }
}

impl DecayedMean {
    /// A mean that never goes below `floor`.
    pub fn at_least(floor: f64) -> Self {
        Self { bits: AtomicU64::new(UNSET), floor }
    }

    /// The mean; `None` before the first sample.
    pub fn get(&self) -> Option<f64> {
        match self.bits.load(Ordering::Relaxed) {
            UNSET => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    /// Moves the mean `weight` of the way toward `sample` (the first sample sets it).
    pub fn observe(&self, sample: f64, weight: f64) {
        let next = match self.get() {
            None => sample,
            Some(old) => old + weight * (sample - old),
        };
        self.bits.store(next.max(self.floor).to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_sample_sets_it_and_later_ones_move_it() {
        let m = DecayedMean::default();
        assert_eq!(m.get(), None);
        m.observe(0.0, 0.5);
        assert_eq!(m.get(), Some(0.0), "zero is a value, not 'unset'");
        m.observe(8.0, 0.25);
        assert_eq!(m.get(), Some(2.0));
        let floored = DecayedMean::at_least(1.0);
        floored.observe(0.5, 0.5);
        assert_eq!(floored.get(), Some(1.0));
    }
}
