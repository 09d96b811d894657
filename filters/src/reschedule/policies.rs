//! The rescheduling policies of Llumnix's rescheduler, each metrics → filters → selector:
//!
//! - load balance (`decode_load`, `neutral_load`): sources at or above the threshold,
//!   destinations below it; metricBalanceSelector pairs the highest source with the lowest
//!   destination, the next with the next, while their difference is at least
//!   `load_balance_threshold`; within the whole cluster or per unit;
//! - failover (`*_failover`): unhealthy or stale workers are sources; destinations are healthy
//!   workers outside the failure domain; roundRobinSelector spreads sources over them;
//! - `binpacking_mitigation`: the worker whose predicted TPOT is highest, at or above
//!   `ceil × tpot_slo`, to the one with the lowest, below `dispatch × tpot_slo`; one pair;
//! - `binpacking_consolidation`: the least loaded worker below `floor × tpot_slo` with decodes
//!   running, emptied into the busiest one still below `dispatch × tpot_slo`; one pair.
//!
//! kvgate has no prefill/decode split yet: every worker is "neutral", and the decode and
//! neutral variants of a policy see the same workers.

use super::Instance;
use serde::Deserialize;

/// Where load balancing pairs workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Any source with any destination.
    Cluster,
    /// Sources with destinations of the same unit.
    Unit,
}

/// The failure domain a failover keeps its destinations out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Domain {
    /// The failed worker only.
    Instance,
    /// Every worker on its node.
    Node,
    /// Every worker of its unit.
    InstanceUnit,
    /// Every worker sharing a unit with any worker on its node.
    NodeUnit,
}

/// One configured policy.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// `decode_load` / `neutral_load`.
    LoadBalance {
        /// Sources: load ≥ threshold; destinations: load < threshold.
        threshold: f64,
        /// Least load difference between a pair.
        min_difference: f64,
        /// Cluster-wide or per unit.
        scope: Scope,
    },
    /// `*_failover`.
    Failover {
        /// What destinations stay out of.
        domain: Domain,
    },
    /// `binpacking_mitigation`.
    Mitigation {
        /// TPOT SLO, ms.
        slo_ms: f64,
        /// Sources: TPOT ≥ ceil × SLO.
        ceil: f64,
        /// Destinations: TPOT < dispatch × SLO.
        dispatch: f64,
    },
    /// `binpacking_consolidation`.
    Consolidation {
        /// TPOT SLO, ms.
        slo_ms: f64,
        /// Sources: TPOT < floor × SLO.
        floor: f64,
        /// Destinations: TPOT < dispatch × SLO.
        dispatch: f64,
    },
}

/// The smallest decode batch that counts as "has decodes" (Llumnix's 0.1).
const MIN_BATCH: f64 = 0.1;

impl Policy {
    /// (source, destination) pairs for this cycle. `turn` advances the failover round robin
    /// from cycle to cycle.
    pub fn pairs(&self, all: &[Instance], turn: &mut usize) -> Vec<(u32, u32)> {
        match *self {
            Self::LoadBalance { threshold, min_difference, scope } => match scope {
                Scope::Cluster => balance(&all.iter().collect::<Vec<_>>(), threshold, min_difference),
                Scope::Unit => {
                    let mut units: Vec<Option<&String>> = all.iter().map(|i| i.unit.as_ref()).collect();
                    units.sort();
                    units.dedup();
                    units
                        .into_iter()
                        .flat_map(|u| balance(&all.iter().filter(|i| i.unit.as_ref() == u).collect::<Vec<_>>(), threshold, min_difference))
                        .collect()
                }
            },
            Self::Failover { domain } => failover(all, domain, turn),
            Self::Mitigation { slo_ms, ceil, dispatch } => {
                let src = usable(all).filter(|i| i.tpot_ms.is_some_and(|t| t >= ceil * slo_ms)).max_by(|a, b| tpot(a).total_cmp(&tpot(b)));
                let dst = usable(all).filter(|i| tpot(i) < dispatch * slo_ms).min_by(|a, b| tpot(a).total_cmp(&tpot(b)));
                src.zip(dst).filter(|(s, d)| s.id != d.id).map(|(s, d)| (s.id, d.id)).into_iter().collect()
            }
            Self::Consolidation { slo_ms, floor, dispatch } => {
                let src = usable(all).filter(|i| i.decode_batch > MIN_BATCH && tpot(i) < floor * slo_ms).min_by(|a, b| tpot(a).total_cmp(&tpot(b)));
                let Some(src) = src else { return Vec::new() };
                let dst = usable(all)
                    .filter(|i| i.id != src.id && i.decode_batch > MIN_BATCH && tpot(i) < dispatch * slo_ms)
                    .max_by(|a, b| tpot(a).total_cmp(&tpot(b)));
                dst.map(|d| (src.id, d.id)).into_iter().collect()
            }
        }
    }
}

/// A worker with nothing measured runs nothing: its predicted TPOT is 0.
fn tpot(i: &Instance) -> f64 {
    i.tpot_ms.unwrap_or(0.0)
}

fn usable(all: &[Instance]) -> impl Iterator<Item = &Instance> {
    all.iter().filter(|i| !i.failing())
}

/// metricBalanceSelector over one group.
fn balance(group: &[&Instance], threshold: f64, min_difference: f64) -> Vec<(u32, u32)> {
    let mut src: Vec<&Instance> = group.iter().copied().filter(|i| !i.failing() && i.load >= threshold).collect();
    let mut dst: Vec<&Instance> = group.iter().copied().filter(|i| !i.failing() && i.load < threshold).collect();
    src.sort_by(|a, b| b.load.total_cmp(&a.load));
    dst.sort_by(|a, b| a.load.total_cmp(&b.load));
    src.iter().zip(&dst).take_while(|(s, d)| s.load - d.load >= min_difference).map(|(s, d)| (s.id, d.id)).collect()
}

/// Whether `i` lies in the failure domain of the failed worker `f`, given every worker.
fn in_domain(i: &Instance, f: &Instance, all: &[Instance], domain: Domain) -> bool {
    let same = |a: &Option<String>, b: &Option<String>| a.is_some() && a == b;
    match domain {
        Domain::Instance => i.id == f.id,
        Domain::Node => i.id == f.id || same(&i.node, &f.node),
        Domain::InstanceUnit => i.id == f.id || same(&i.unit, &f.unit),
        Domain::NodeUnit => i.id == f.id || all.iter().any(|n| (n.id == f.id || same(&n.node, &f.node)) && same(&n.unit, &i.unit)),
    }
}

/// roundRobinSelector: each failing worker to the next destination outside every failed
/// worker's domain.
fn failover(all: &[Instance], domain: Domain, turn: &mut usize) -> Vec<(u32, u32)> {
    let failed: Vec<&Instance> = all.iter().filter(|i| i.failing()).collect();
    let dst: Vec<&Instance> = all.iter().filter(|i| !i.failing() && !failed.iter().any(|f| in_domain(i, f, all, domain))).collect();
    if dst.is_empty() {
        return Vec::new();
    }
    failed
        .iter()
        .map(|f| {
            let d = dst[*turn % dst.len()];
            *turn = turn.wrapping_add(1);
            (f.id, d.id)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(id: u32, load: f64) -> Instance {
        Instance { id, load, healthy: true, stale: false, node: None, unit: None, tpot_ms: None, decode_batch: 0.0 }
    }

    #[test]
    fn the_seeds_load_balance_example() {
        // Loads 0.9, 0.3, 0.8, 0.2, 0.4 at threshold 0.7 → (0.9 → 0.2), (0.8 → 0.3).
        let all: Vec<Instance> = [0.9, 0.3, 0.8, 0.2, 0.4].iter().enumerate().map(|(i, &l)| inst(i as u32, l)).collect();
        let p = Policy::LoadBalance { threshold: 0.7, min_difference: 0.0, scope: Scope::Cluster };
        assert_eq!(p.pairs(&all, &mut 0), vec![(0, 3), (2, 1)]);
        let strict = Policy::LoadBalance { threshold: 0.7, min_difference: 0.55, scope: Scope::Cluster };
        assert_eq!(strict.pairs(&all, &mut 0), vec![(0, 3)], "0.8 - 0.3 is under the minimum difference");
    }

    #[test]
    fn unit_scope_pairs_within_units() {
        let mut all: Vec<Instance> = [0.9, 0.1, 0.8, 0.2].iter().enumerate().map(|(i, &l)| inst(i as u32, l)).collect();
        for (i, u) in ["a", "b", "b", "a"].iter().enumerate() {
            all[i].unit = Some(u.to_string());
        }
        let p = Policy::LoadBalance { threshold: 0.7, min_difference: 0.0, scope: Scope::Unit };
        assert_eq!(p.pairs(&all, &mut 0), vec![(0, 3), (2, 1)]);
    }

    #[test]
    fn failover_with_domain_node_never_picks_the_failed_node() {
        let mut all: Vec<Instance> = (0..6).map(|i| inst(i, 0.1)).collect();
        for (i, n) in ["n1", "n1", "n1", "n2", "n2", "n3"].iter().enumerate() {
            all[i].node = Some(n.to_string());
        }
        all[1].healthy = false; // decode-1 on n1
        let p = Policy::Failover { domain: Domain::Node };
        let mut turn = 0;
        for _ in 0..10 {
            for (src, dst) in p.pairs(&all, &mut turn) {
                assert_eq!(src, 1);
                assert!(dst >= 3, "{dst} is on the failed node");
            }
        }
        let inst_domain = Policy::Failover { domain: Domain::Instance };
        let dsts: Vec<u32> = (0..5).flat_map(|_| inst_domain.pairs(&all, &mut turn)).map(|(_, d)| d).collect();
        assert!(dsts.contains(&0) && dsts.contains(&2) && !dsts.contains(&1), "round robin over everyone else: {dsts:?}");
        // node-unit: units shared with any worker on the failed node are out too.
        for (i, u) in ["u1", "u1", "u2", "u2", "u3", "u3"].iter().enumerate() {
            all[i].unit = Some(u.to_string());
        }
        let nu = Policy::Failover { domain: Domain::NodeUnit };
        for _ in 0..4 {
            assert!(nu.pairs(&all, &mut turn).iter().all(|&(_, d)| d >= 4), "u1 and u2 touch n1");
        }
        all[5].stale = true;
        let srcs: Vec<u32> = Policy::Failover { domain: Domain::Instance }.pairs(&all, &mut turn).iter().map(|p| p.0).collect();
        assert_eq!(srcs, vec![1, 5], "stale workers fail over too");
    }

    fn tp(id: u32, tpot: f64, batch: f64) -> Instance {
        Instance { tpot_ms: Some(tpot), decode_batch: batch, ..inst(id, 0.0) }
    }

    #[test]
    fn the_seeds_binpacking_examples() {
        // Mitigation: D1 at 48 ms ≥ 0.95 × 50 → D2 at 35 ms < 0.85 × 50.
        let m = Policy::Mitigation { slo_ms: 50.0, ceil: 0.95, dispatch: 0.85 };
        assert_eq!(m.pairs(&[tp(1, 48.0, 8.0), tp(2, 35.0, 4.0), tp(3, 45.0, 6.0)], &mut 0), vec![(1, 2)]);
        assert!(m.pairs(&[tp(1, 47.0, 8.0), tp(2, 35.0, 4.0)], &mut 0).is_empty(), "47 < 47.5: no violation");
        // Consolidation: D3 at 25 ms < 0.60 × 50 with decodes → D4 at 40 ms, the busiest under 42.5.
        let c = Policy::Consolidation { slo_ms: 50.0, floor: 0.60, dispatch: 0.85 };
        assert_eq!(c.pairs(&[tp(3, 25.0, 2.0), tp(4, 40.0, 10.0), tp(5, 30.0, 5.0), tp(6, 44.0, 12.0)], &mut 0), vec![(3, 4)]);
        assert!(c.pairs(&[tp(3, 25.0, 0.0), tp(4, 40.0, 10.0)], &mut 0).is_empty(), "an idle worker has nothing to consolidate");
    }
}
