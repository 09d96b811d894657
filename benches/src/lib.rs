//! kvgate's benchmarks and load tools. The library holds what the binaries share: a
//! deterministic generator and percentiles, Mooncake trace loading ([`trace`]) and a trace's
//! TTFT floor and clairvoyant references ([`trace_floor`]), the load generator behind
//! `kvgate-bench` ([`load`]), processes for clusters of release binaries ([`cluster`]), the
//! peer routers `compare` runs ([`peers`]), and the rescheduler benchmark ([`reschedule`]).

pub mod cluster;
pub mod connections;
pub mod disagg;
pub mod load;
pub mod overload;
pub mod peers;
pub mod planner;
pub mod procfs;
pub mod replicas;
pub mod reschedule;
pub mod soak;
pub mod tenants;
pub mod trace;
pub mod trace_floor;

use kvgate_kv::hash::mix;
use std::time::Duration;

/// xorshift64*: the same workload from the same seed on every run.
pub struct Rng(pub u64);

impl Rng {
    /// The generator of a user-given seed. Its state is 2·seed − 41: odd, as xorshift needs a
    /// non-zero state, different for different seeds below 2^63, and 43 for the default seed 42,
    /// the state the workloads have always started from.
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(2).wrapping_sub(41))
    }

    /// An independent generator for the sub-stream `stream` of `seed` (e.g. one per document).
    pub fn stream(seed: u64, stream: u64) -> Rng {
        Rng(mix(seed ^ mix(stream)) | 1)
    }

    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The `p` quantile (0..=1, nearest rank below) of `v`, which it sorts.
#[allow(clippy::cast_sign_loss, reason = "a rank times a quantile in 0..=1: not negative")]
pub fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_give_distinct_generators_and_42_keeps_its_old_state() {
        assert_eq!(Rng::seeded(42).0, 43);
        let firsts: std::collections::HashSet<u64> = (0..1000).map(|s| Rng::seeded(s).next_u64()).collect();
        assert_eq!(firsts.len(), 1000);
        let streams: std::collections::HashSet<u64> =
            (0..1000).map(|d| Rng::stream(42, d).next_u64()).chain((0..1000).map(|d| Rng::stream(43, d).next_u64())).collect();
        assert_eq!(streams.len(), 2000);
    }
}
