//! kvgate's benchmarks and load tools. The library holds what the binaries share: a
//! deterministic generator and percentiles, Mooncake trace loading ([`trace`]), the load
//! generator behind `kvgate-bench` ([`load`]), processes for clusters of release binaries
//! ([`cluster`]), the peer routers `compare` runs ([`peers`]), and the rescheduler benchmark
//! ([`reschedule`]).

pub mod cluster;
pub mod load;
pub mod peers;
pub mod reschedule;
pub mod trace;

use std::time::Duration;

/// xorshift64*: the same workload from the same seed on every run.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The `p` quantile (0..=1, nearest rank below) of `v`, which it sorts.
pub fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}
