//! `round_robin`: the n-th decision takes the (n mod k)-th candidate.

use super::{Candidate, Decision, Policy, RequestSummary};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Cycles through the candidates.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&self, _req: &RequestSummary<'_>, candidates: &[Candidate]) -> Decision {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        Decision::Worker(n % candidates.len().max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_evenly() {
        let rr = RoundRobin::default();
        let c = vec![Candidate::default(); 3];
        let picks: Vec<Decision> = (0..6).map(|_| rr.choose(&RequestSummary::default(), &c)).collect();
        let want: Vec<Decision> = [0, 1, 2, 0, 1, 2].into_iter().map(Decision::Worker).collect();
        assert_eq!(picks, want);
    }
}
