//! A tenant's fair share of the router queue: the Virtual Token Counter of Sheng et al.,
//! "Fairness in Serving Large Language Models" (OSDI 2024). Every token a tenant is served
//! (prompt tokens when its request leaves the queue, output tokens as they stream) adds
//! `1 / weight` to its counter; the queue serves the waiting tenant with the smallest counter,
//! and lifts a tenant that starts waiting again to the smallest counter among those already
//! waiting, so that time spent idle is not banked as credit.

use std::sync::atomic::{AtomicU64, Ordering};

/// One tenant's counter (tokens served, here and as the peers report) and weight.
#[derive(Debug)]
pub struct FairShare {
    served: AtomicU64,
    peer_served: AtomicU64,
    /// The weight's bits (an `f64`), settable on reload.
    weight: AtomicU64,
}

impl FairShare {
    /// A share of `weight` (a positive number; a tenant of weight 3 is served three times the
    /// tokens of one of weight 1 while both wait).
    pub fn new(weight: f64) -> Self {
        Self { served: AtomicU64::new(0), peer_served: AtomicU64::new(0), weight: AtomicU64::new(sane(weight).to_bits()) }
    }

    /// Changes the weight.
    pub fn set_weight(&self, weight: f64) {
        self.weight.store(sane(weight).to_bits(), Ordering::Relaxed);
    }

    /// The weight.
    pub fn weight(&self) -> f64 {
        f64::from_bits(self.weight.load(Ordering::Relaxed))
    }

    /// Counts `tokens` served by this replica.
    pub fn serve(&self, tokens: u64) {
        self.served.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Counts `tokens` the peers served.
    pub fn serve_peer(&self, tokens: u64) {
        self.peer_served.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Tokens served by this replica.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// The counter: every replica's tokens over the weight.
    pub fn virtual_tokens(&self) -> f64 {
        (self.served.load(Ordering::Relaxed) + self.peer_served.load(Ordering::Relaxed)) as f64 / self.weight()
    }
}

fn sane(weight: f64) -> f64 {
    if weight.is_finite() && weight > 0.0 { weight } else { 1.0 }
}
