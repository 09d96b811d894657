//! The rescheduler's decisions (Llumnix's rescheduler), without I/O: per policy,
//! metrics → filters → selector give migration pairs ([`policies`]); pairs are validated
//! against each other ([`validate`]); per pair, the requests that move are picked by a rule
//! and an order ([`select`]). `proxy/src/tasks/rescheduler.rs` builds the cluster view each
//! cycle and executes the pairs as moves (docs/migration.md).

pub mod policies;
pub mod select;

pub use policies::{Domain, Policy, Scope};
pub use select::{Order, Rule, Take};

/// One worker as a rescheduling cycle sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Instance {
    /// Worker id (its position in the model's worker list).
    pub id: u32,
    /// The load metric balanced on (`kv_cache_usage_ratio_projected` by default).
    pub load: f64,
    /// Passing health checks.
    pub healthy: bool,
    /// Its polled metrics are older than `instance_staleness_seconds`.
    pub stale: bool,
    /// Node label (failure domain `node`).
    pub node: Option<String>,
    /// Unit label (scope `unit`, failure domains `*-unit`).
    pub unit: Option<String>,
    /// Predicted time per output token, ms (`None`: nothing measured).
    pub tpot_ms: Option<f64>,
    /// Requests decoding on it.
    pub decode_batch: f64,
}

impl Instance {
    /// Whether it needs failover (unhealthy or stale).
    pub fn failing(&self) -> bool {
        !self.healthy || self.stale
    }
}

/// Move work from `src` to `dst`, as `take` says; decided by `policy`.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    /// The policy's name (metric label).
    pub policy: String,
    /// Source worker id.
    pub src: u32,
    /// Destination worker id.
    pub dst: u32,
    /// How much moves.
    pub take: Take,
}

/// Keeps pairs in order, dropping self-moves, repeats of a kept (source, destination) and
/// reverses of one (B→A for A→B), so one cycle never moves work back and forth.
pub fn validate(pairs: Vec<Pair>) -> Vec<Pair> {
    let mut kept: Vec<Pair> = Vec::with_capacity(pairs.len());
    for p in pairs {
        if p.src != p.dst && !kept.iter().any(|k| (k.src == p.dst && k.dst == p.src) || (k.src == p.src && k.dst == p.dst)) {
            kept.push(p);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(src: u32, dst: u32) -> Pair {
        Pair { policy: "p".into(), src, dst, take: Take::All }
    }

    #[test]
    fn reverse_and_repeated_pairs_and_self_moves_are_dropped() {
        let kept = validate(vec![pair(0, 1), pair(1, 0), pair(2, 2), pair(0, 2), pair(2, 3), pair(0, 1)]);
        assert_eq!(kept.iter().map(|p| (p.src, p.dst)).collect::<Vec<_>>(), vec![(0, 1), (0, 2), (2, 3)]);
    }
}
