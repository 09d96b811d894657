//! `random`: a uniformly random candidate (xorshift per policy; no shared lock).

use super::{Candidate, Decision, Policy, RequestSummary};
use std::sync::atomic::AtomicU64;

/// Picks uniformly at random.
#[derive(Debug)]
pub struct Random {
    state: AtomicU64,
}

impl Default for Random {
    fn default() -> Self {
        let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
        Self::with_seed(seed)
    }
}

impl Random {
    /// A deterministic stream (tests).
    pub fn with_seed(seed: u64) -> Self {
        Self { state: AtomicU64::new(seed | 1) }
    }

    fn next(&self) -> u64 {
        kvgate_kv::hash::next_shared(&self.state)
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn choose(&self, _req: &RequestSummary<'_>, candidates: &[Candidate]) -> Decision {
        Decision::Worker((self.next() % candidates.len().max(1) as u64) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_over_all_candidates() {
        let r = Random::with_seed(7);
        let c = vec![Candidate::default(); 4];
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            let Decision::Worker(i) = r.choose(&RequestSummary::default(), &c) else { panic!() };
            counts[i] += 1;
        }
        assert!(counts.iter().all(|&n| (800..1200).contains(&n)), "{counts:?}");
    }
}
