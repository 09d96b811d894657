//! Failure injection, for fault-tolerance tests of whatever sits in front of the simulator:
//! crash after N generated tokens or at a time (every connection is closed at once and the
//! server stops), an HTTP 500 rate, a slow first token, requests that hang forever, and an
//! engine that stalls mid-stream.
//!
//! The knobs can be changed at run time (`POST /sim/faults`, or [`Faults::set`] in-process).

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio_util::sync::CancellationToken;

/// What to inject.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultConfig {
    /// Crash once this many tokens were generated (counted from start, all engines).
    pub crash_after_tokens: Option<u64>,
    /// Crash this many seconds after start.
    pub crash_after_secs: Option<f64>,
    /// Fraction of inference requests answered with HTTP 500.
    pub error_rate: f64,
    /// Extra delay before each request's first token, ms.
    pub first_token_delay_ms: f64,
    /// Fraction of inference requests that are never answered.
    pub hang_rate: f64,
    /// The engine stops stepping while set: running streams hang with their connections open
    /// (a frozen GPU), and resume when it is cleared.
    pub stall: bool,
    /// The next N KV event batches are not sent on PUB (they keep their sequence numbers and
    /// stay in the replay buffer), as when a PUB socket over its high-water mark drops them.
    pub drop_kv_batches: u64,
}

impl FaultConfig {
    /// Checks rates are in [0, 1] and durations non-negative.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("error_rate", self.error_rate), ("hang_rate", self.hang_rate)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("fault {name} must be within [0, 1], got {v}"));
            }
        }
        if !(self.first_token_delay_ms.is_finite() && self.first_token_delay_ms >= 0.0) {
            return Err("fault first_token_delay_ms must be >= 0".into());
        }
        if self.crash_after_secs.is_some_and(|s| !(s.is_finite() && s >= 0.0)) {
            return Err("fault crash_after_secs must be >= 0".into());
        }
        Ok(())
    }
}

/// What a request should suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFault {
    /// Serve normally.
    None,
    /// Answer 500.
    Error,
    /// Never answer.
    Hang,
}

/// Live fault state shared by the server's tasks.
#[derive(Debug)]
pub struct Faults {
    cfg: RwLock<FaultConfig>,
    rng: AtomicU64,
    tokens: AtomicU64,
    crashed: AtomicBool,
    kv_drops: AtomicU64,
    stop: CancellationToken,
}

impl Faults {
    /// State for `cfg`, with a deterministic random stream from `seed`. A crash cancels `stop`,
    /// which every connection and engine of the server watches.
    pub fn new(cfg: FaultConfig, seed: u64, stop: CancellationToken) -> Self {
        Self {
            kv_drops: AtomicU64::new(cfg.drop_kv_batches),
            cfg: RwLock::new(cfg),
            rng: AtomicU64::new(seed ^ 0xdead_beef_cafe_f00d),
            tokens: AtomicU64::new(0),
            crashed: AtomicBool::new(false),
            stop,
        }
    }

    /// Replaces the knobs (validated).
    pub fn set(&self, cfg: FaultConfig) -> Result<(), String> {
        cfg.validate()?;
        self.kv_drops.store(cfg.drop_kv_batches, Ordering::SeqCst);
        *self.cfg.write() = cfg;
        Ok(())
    }

    /// Current knobs.
    pub fn get(&self) -> FaultConfig {
        self.cfg.read().clone()
    }

    /// Decides the fate of a new inference request.
    pub fn roll_request(&self) -> RequestFault {
        let (err, hang) = {
            let c = self.cfg.read();
            (c.error_rate, c.hang_rate)
        };
        if err == 0.0 && hang == 0.0 {
            return RequestFault::None;
        }
        let u = self.uniform();
        if u < err {
            RequestFault::Error
        } else if u < err + hang {
            RequestFault::Hang
        } else {
            RequestFault::None
        }
    }

    /// Extra first-token delay.
    pub fn first_token_delay(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.cfg.read().first_token_delay_ms / 1000.0)
    }

    /// Counts generated tokens; triggers the crash when the threshold is crossed.
    pub fn on_tokens(&self, n: u64) {
        let total = self.tokens.fetch_add(n, Ordering::Relaxed) + n;
        if self.cfg.read().crash_after_tokens.is_some_and(|limit| total >= limit) {
            self.crash_now();
        }
    }

    /// Crashes the server: every connection closes and the server stops.
    pub fn crash_now(&self) {
        if !self.crashed.swap(true, Ordering::SeqCst) {
            tracing::warn!("fault injection: crashing now (closing every connection)");
        }
        self.stop.cancel();
    }

    /// True if the next KV event batch must not be sent on PUB (consumes one drop).
    pub fn drop_kv_batch(&self) -> bool {
        self.kv_drops.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }

    /// Whether the engine is stalled.
    pub fn stalled(&self) -> bool {
        self.cfg.read().stall
    }

    /// Whether the server crashed (as opposed to a clean shutdown).
    pub fn is_crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    fn uniform(&self) -> f64 {
        let z = crate::sampler::mix(self.rng.fetch_add(crate::sampler::PHI, Ordering::Relaxed));
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_respected() {
        let f = Faults::new(FaultConfig { error_rate: 0.2, hang_rate: 0.1, ..Default::default() }, 1, CancellationToken::new());
        let (mut e, mut h) = (0, 0);
        for _ in 0..10_000 {
            match f.roll_request() {
                RequestFault::Error => e += 1,
                RequestFault::Hang => h += 1,
                RequestFault::None => {}
            }
        }
        assert!((1700..2300).contains(&e), "{e}");
        assert!((700..1300).contains(&h), "{h}");
    }

    #[test]
    fn crash_after_tokens_fires_once_threshold_is_crossed() {
        let f = Faults::new(FaultConfig { crash_after_tokens: Some(10), ..Default::default() }, 0, CancellationToken::new());
        f.on_tokens(9);
        assert!(!f.is_crashed());
        f.on_tokens(1);
        assert!(f.is_crashed());
    }

    #[test]
    fn invalid_knobs_are_refused() {
        let f = Faults::new(FaultConfig::default(), 0, CancellationToken::new());
        assert!(f.set(FaultConfig { hang_rate: -0.1, ..Default::default() }).is_err());
        assert_eq!(f.get(), FaultConfig::default());
    }
}
