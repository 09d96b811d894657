//! Worker selection. Every routing mode — the baseline `round_robin` and `random` here, the KV
//! mode and WebAssembly policies later — implements [`Policy`] over the same inputs: a
//! [`RequestSummary`] and one [`Candidate`] per eligible worker. The caller has already removed
//! workers that are unhealthy, busy, or already tried for this request.

mod policy;
mod random;
mod round_robin;

pub use policy::{Candidate, Decision, Policy, RequestSummary};
pub use random::Random;
pub use round_robin::RoundRobin;

/// Built-in routing modes selectable by name in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Cycle through workers.
    RoundRobin,
    /// Uniformly random worker.
    Random,
}

impl Mode {
    /// A fresh policy for this mode.
    pub fn policy(self) -> Box<dyn Policy> {
        match self {
            Mode::RoundRobin => Box::new(RoundRobin::default()),
            Mode::Random => Box::new(Random::default()),
        }
    }
}
