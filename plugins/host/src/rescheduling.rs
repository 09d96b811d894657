//! A loaded rescheduling policy: given the cluster's load, it proposes migrations of running
//! requests between workers (Llumnix's pair selection). The host validates the pairs (known
//! workers, no self-moves, no A→B together with B→A, a finite non-negative value); executing
//! them belongs to the rescheduler, not here.

use crate::bindings::rescheduler::kvgate::policy::types as wit;
use crate::bindings::rescheduler::{Rescheduler, ReschedulerPre};
use crate::component::{self, Compiled, Kind};
use crate::failure::{Failure, LoadError};
use crate::sandbox::{self, HostState, Limits};
use parking_lot::Mutex;
use wasmtime::Store;

/// A request running (or waiting) on a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Running {
    /// Request id.
    pub id: String,
    /// Prompt plus generated tokens so far.
    pub tokens: u32,
    /// Time since dispatch, ms.
    pub age_ms: u64,
    /// Higher is more important.
    pub priority: i32,
    /// Has not produced a first token yet.
    pub waiting: bool,
}

/// One worker's load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WorkerLoad {
    /// Worker id within the model.
    pub id: u32,
    /// The balanced metric, in [0, 1].
    pub load: f64,
    /// Reported KV usage.
    pub kv_usage: f64,
    /// KV capacity in blocks.
    pub total_blocks: u64,
    /// Booked KV blocks.
    pub active_blocks: u64,
    /// Reported waiting requests.
    pub waiting: u32,
    /// Passing health checks.
    pub healthy: bool,
    /// Its requests.
    pub running: Vec<Running>,
}

/// One rescheduling round's input.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClusterView {
    /// Model name.
    pub model: String,
    /// Its workers.
    pub workers: Vec<WorkerLoad>,
}

/// How much a migration moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectRule {
    /// `value` requests.
    NumReq,
    /// `value` tokens.
    Token,
    /// `value` percent of the source's KV cache.
    Ratio,
}

/// Which requests move first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectOrder {
    /// Last come running.
    Lcr,
    /// First come running.
    Fcr,
    /// Longest running.
    Lr,
    /// Shortest running.
    Sr,
    /// First come waiting.
    Fcw,
    /// First come waiting, else shortest running.
    Fcwsr,
}

/// A proposed move.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Migration {
    /// From this worker id.
    pub source: u32,
    /// To this worker id.
    pub destination: u32,
    /// Unit of `value`.
    pub rule: SelectRule,
    /// Which requests first.
    pub order: SelectOrder,
    /// How much.
    pub value: f64,
}

struct Live {
    store: Store<HostState>,
    rescheduler: Rescheduler,
}

/// A rescheduling policy ready to call. Rounds are rare (seconds apart), so one instance is
/// kept and calls are serialized.
pub struct ReschedulingPlugin {
    compiled: Compiled,
    pre: ReschedulerPre<HostState>,
    live: Mutex<Option<Live>>,
}

impl ReschedulingPlugin {
    /// Links `compiled` and runs its `init` once.
    pub fn new(compiled: Compiled) -> Result<Self, LoadError> {
        let name = compiled.spec.name.clone();
        let err = |message: String| LoadError { plugin: name.clone(), message };
        let pre =
            ReschedulerPre::new(component::link(&compiled, Kind::Rescheduler)?).map_err(|e| err(format!("does not match the rescheduler world: {e:#}")))?;
        let plugin = Self { compiled, pre, live: Mutex::new(None) };
        let live = plugin.instantiate(plugin.compiled.spec.limits.at_load()).map_err(|f| err(format!("init failed: {f}")))?;
        *plugin.live.lock() = Some(live);
        Ok(plugin)
    }

    /// Name from the config.
    pub fn name(&self) -> &str {
        &self.compiled.spec.name
    }

    /// A fresh instance, its `init` run under `limits`.
    fn instantiate(&self, limits: Limits) -> Result<Live, Failure> {
        let mut store = sandbox::store(limits);
        sandbox::arm(&mut store, limits);
        let rescheduler = match self.pre.instantiate(&mut store) {
            Ok(r) => r,
            Err(e) => return Err(sandbox::classify(&store, limits, &e)),
        };
        match rescheduler.kvgate_policy_rescheduling().call_init(&mut store, &self.compiled.spec.config) {
            Ok(Ok(())) => Ok(Live { store, rescheduler }),
            Ok(Err(msg)) => Err(Failure::Invalid(format!("init refused its config: {msg}"))),
            Err(e) => Err(sandbox::classify(&store, limits, &e)),
        }
    }

    /// One round: the policy's migrations, validated against `view`.
    pub fn reschedule(&self, view: &ClusterView) -> Result<Vec<Migration>, Failure> {
        let mut slot = self.live.lock();
        let mut live = match slot.take() {
            Some(l) => l,
            None => self.instantiate(self.compiled.spec.limits)?,
        };
        let limits = self.compiled.spec.limits;
        sandbox::arm(&mut live.store, limits);
        let answer = match live.rescheduler.kvgate_policy_rescheduling().call_reschedule(&mut live.store, &to_wit(view)) {
            Ok(a) => a,
            Err(e) => return Err(sandbox::classify(&live.store, limits, &e)),
        };
        *slot = Some(live);
        validate(answer, view)
    }
}

fn to_wit(view: &ClusterView) -> wit::ClusterView {
    wit::ClusterView {
        model: view.model.clone(),
        workers: view
            .workers
            .iter()
            .map(|w| wit::WorkerLoad {
                id: w.id,
                load: w.load,
                kv_usage: w.kv_usage,
                total_blocks: w.total_blocks,
                active_blocks: w.active_blocks,
                waiting: w.waiting,
                healthy: w.healthy,
                running: w
                    .running
                    .iter()
                    .map(|r| wit::Running { id: r.id.clone(), tokens: r.tokens, age_ms: r.age_ms, priority: r.priority, waiting: r.waiting })
                    .collect(),
            })
            .collect(),
    }
}

fn validate(answer: Vec<wit::Migration>, view: &ClusterView) -> Result<Vec<Migration>, Failure> {
    let known = |id: u32| view.workers.iter().any(|w| w.id == id);
    if answer.len() > view.workers.len() * view.workers.len() {
        return Err(Failure::Invalid(format!("{} migrations for {} workers", answer.len(), view.workers.len())));
    }
    let mut out: Vec<Migration> = Vec::with_capacity(answer.len());
    for m in answer {
        if !known(m.source) || !known(m.destination) {
            return Err(Failure::Invalid(format!("migration {}→{} names an unknown worker", m.source, m.destination)));
        }
        if m.source == m.destination {
            return Err(Failure::Invalid(format!("migration {0}→{0} moves nothing", m.source)));
        }
        if !m.value.is_finite() || m.value < 0.0 {
            return Err(Failure::Invalid(format!("migration value {} is not a finite non-negative number", m.value)));
        }
        // As Llumnix: a pair that reverses or repeats an earlier one is dropped.
        if out.iter().any(|o| (o.source, o.destination) == (m.destination, m.source) || (o.source, o.destination) == (m.source, m.destination)) {
            continue;
        }
        out.push(Migration { source: m.source, destination: m.destination, rule: rule(m.rule), order: order(m.order), value: m.value });
    }
    Ok(out)
}

fn rule(r: wit::SelectRule) -> SelectRule {
    match r {
        wit::SelectRule::NumReq => SelectRule::NumReq,
        wit::SelectRule::Token => SelectRule::Token,
        wit::SelectRule::Ratio => SelectRule::Ratio,
    }
}

fn order(o: wit::SelectOrder) -> SelectOrder {
    match o {
        wit::SelectOrder::Lcr => SelectOrder::Lcr,
        wit::SelectOrder::Fcr => SelectOrder::Fcr,
        wit::SelectOrder::Lr => SelectOrder::Lr,
        wit::SelectOrder::Sr => SelectOrder::Sr,
        wit::SelectOrder::Fcw => SelectOrder::Fcw,
        wit::SelectOrder::Fcwsr => SelectOrder::Fcwsr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(n: u32) -> ClusterView {
        ClusterView { model: "m".into(), workers: (0..n).map(|id| WorkerLoad { id, healthy: true, ..Default::default() }).collect() }
    }

    fn m(source: u32, destination: u32, value: f64) -> wit::Migration {
        wit::Migration { source, destination, rule: wit::SelectRule::Token, order: wit::SelectOrder::Sr, value }
    }

    #[test]
    fn pairs_are_validated_and_reversals_dropped() {
        let v = view(3);
        let ok = validate(vec![m(0, 1, 10.0), m(1, 0, 5.0), m(0, 1, 1.0), m(2, 1, 3.0)], &v).unwrap();
        assert_eq!(ok.iter().map(|m| (m.source, m.destination)).collect::<Vec<_>>(), vec![(0, 1), (2, 1)]);
        assert_eq!(validate(vec![m(0, 5, 1.0)], &v).unwrap_err().kind(), "invalid");
        assert_eq!(validate(vec![m(1, 1, 1.0)], &v).unwrap_err().kind(), "invalid");
        assert_eq!(validate(vec![m(0, 1, f64::INFINITY)], &v).unwrap_err().kind(), "invalid");
        assert_eq!(validate(vec![m(0, 1, -1.0)], &v).unwrap_err().kind(), "invalid");
    }
}
