//! One fleet change, from the decision to its end:
//! - up: the connector starts a worker; once its health path answers 200 it joins routing
//!   (a worker that exits or stays silent past the ready timeout is stopped: the change failed);
//! - down: the victim leaves routing at once (no new request reaches it), its streams move by
//!   continuation (the destination chosen by the model's routing, KV-aware) or, with
//!   `drain: wait`, finish where they are; requests that cannot move (unary, pinned) are waited
//!   for; after `drain_timeout_s` the worker is stopped whatever is left.

use super::Managed;
use crate::config::WorkerConfig;
use crate::connector::Connector;
use crate::gateway::Gateway;
use crate::inflight::Phase;
use crate::move_order::{MoveOrder, MoveReason};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a change looks at its worker.
const POLL: Duration = Duration::from_millis(50);
/// How long a scale-down waits after its worker left routing before it looks for requests on
/// it.
const SETTLE: Duration = Duration::from_millis(250);

/// Which way a change went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A worker added.
    Up,
    /// A worker removed.
    Down,
}

/// How a scale-down empties its victim.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    /// Longest wait for its requests.
    pub timeout: Duration,
    /// Move its streams (else wait for them).
    pub migrate: bool,
}

/// Workers a scale-down is emptying (discovery must not put them back into routing).
pub type Draining = Arc<parking_lot::Mutex<HashSet<crate::config::UpstreamUrl>>>;

/// What a change did.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Up or down.
    pub kind: Kind,
    /// The worker, when one was started or chosen.
    pub worker: Option<String>,
    /// From the decision to the end (the worker in routing, or its exit).
    pub took: Duration,
    /// Down: from leaving routing until no request was left on it.
    pub drained_in: Duration,
    /// Down: requests moved away, and moves that failed.
    pub moved: (u64, u64),
    /// Down: requests still there when `drain_timeout_s` ran out.
    pub left_behind: usize,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl Outcome {
    /// A change of `kind` on `worker` that took `took` and drained nothing.
    fn new(kind: Kind, worker: Option<String>, took: Duration) -> Self {
        Self { kind, worker, took, drained_in: Duration::ZERO, moved: (0, 0), left_behind: 0, error: None }
    }

    /// A change that failed.
    pub fn failed(kind: Kind, took: Duration, error: String) -> Self {
        Self { error: Some(error), ..Self::new(kind, None, took) }
    }
}

/// Starts a worker and puts it into routing once it answers.
pub async fn scale_up(gw: &Arc<Gateway>, model: &str, connector: &dyn Connector, ready_timeout: Duration) -> Outcome {
    let t0 = Instant::now();
    let m = match connector.add().await {
        Ok(m) => m,
        Err(e) => return Outcome::failed(Kind::Up, t0.elapsed(), e.to_string()),
    };
    let fail = |e: String| Outcome { worker: Some(m.name.clone()), ..Outcome::failed(Kind::Up, t0.elapsed(), e) };
    if let Err(e) = ready(gw, &m, connector, ready_timeout).await {
        let _ = connector.remove(&m.name).await;
        return fail(e);
    }
    // It may have died since it answered: a dead one must not join (the reaper already took
    // it out).
    if !connector.list().iter().any(|x| x.name == m.name) {
        return fail(format!("worker {} exited after it answered", m.name));
    }
    match join(gw, model, &m).await {
        Ok(()) => Outcome::new(Kind::Up, Some(m.name.clone()), t0.elapsed()),
        Err(e) => {
            let _ = connector.remove(&m.name).await;
            fail(e)
        }
    }
}

/// Waits until `m`'s health path answers 200.
pub async fn ready(gw: &Gateway, m: &Managed, connector: &dyn Connector, within: Duration) -> Result<(), String> {
    let path = gw.config().health.path.clone();
    let probe = crate::fleet::Worker::new(m.url.clone());
    let deadline = Instant::now() + within;
    loop {
        if !connector.list().iter().any(|x| x.name == m.name) {
            let why = connector.last_words(&m.name).map(|w| format!(" ({w})")).unwrap_or_default();
            return Err(format!("worker {} exited before it answered{why}", m.name));
        }
        if let Ok((200, _)) = crate::upstream::get(&gw.config(), &probe, &path, Duration::from_secs(2), 1 << 16, false).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("worker {} did not answer {path} within {:?}", m.name, within));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Takes `victim` out of routing, empties it and stops it.
pub async fn scale_down(gw: &Arc<Gateway>, model: &str, connector: &dyn Connector, victim: Managed, how: Drain, draining: &Draining) -> Outcome {
    let t0 = Instant::now();
    draining.lock().insert(victim.url.clone());
    let o = drain_and_stop(gw, model, connector, victim.clone(), how, t0).await;
    draining.lock().remove(&victim.url);
    o
}

async fn drain_and_stop(gw: &Arc<Gateway>, model: &str, connector: &dyn Connector, victim: Managed, how: Drain, t0: Instant) -> Outcome {
    let worker = gw.fleet().model(model).and_then(|m| m.workers.iter().find(|w| w.url == victim.url).cloned());
    let url = victim.url.clone();
    if let Err(e) = edit_routing(gw, model, move |l| l.retain(|w| w.url != url)).await {
        return Outcome { worker: Some(victim.name), ..Outcome::failed(Kind::Down, t0.elapsed(), format!("cannot take it out of routing: {e}")) };
    }
    let left_routing = Instant::now();
    // Requests that picked it from the fleet as it was a moment ago may still be on their way
    // to it: they are seen on it, and moved, within this settle time.
    tokio::time::sleep(SETTLE).await;
    let (moved, left_behind) = match worker {
        Some(w) => empty(gw, model, &w, how).await,
        None => ((0, 0), 0),
    };
    let drained_in = left_routing.elapsed();
    let error = connector.remove(&victim.name).await.err().map(|e| e.to_string());
    Outcome { kind: Kind::Down, worker: Some(victim.name), took: t0.elapsed(), drained_in, moved, left_behind, error }
}

/// Moves (or waits for) every request on `w` until none is left or the drain times out;
/// returns (moved, failed moves) and how many were left.
async fn empty(gw: &Gateway, model: &str, w: &Arc<crate::fleet::Worker>, how: Drain) -> ((u64, u64), usize) {
    let deadline = Instant::now() + how.timeout;
    let limit = u64::from(gw.config().migration.limit);
    let mut ordered: HashSet<String> = HashSet::new();
    let mut replies = tokio::task::JoinSet::new();
    let (mut ok, mut failed) = (0u64, 0u64);
    loop {
        let on_it: Vec<_> = gw.requests.snapshot().into_iter().filter(|e| &*e.model == model && e.worker().is_some_and(|x| Arc::ptr_eq(&x, w))).collect();
        if on_it.is_empty() || Instant::now() >= deadline {
            // A moved request leaves the worker before its order's answer is read: collect the
            // answers (a move answers once the continuation streams).
            while let Ok(Some(r)) = tokio::time::timeout_at(deadline.max(Instant::now() + POLL).into(), replies.join_next()).await {
                match r {
                    Ok(true) => ok += 1,
                    _ => failed += 1,
                }
            }
            replies.abort_all();
            let m = &gw.metrics.planner.moved;
            m.with_label_values(&[model, "ok"]).inc_by(ok);
            m.with_label_values(&[model, "failed"]).inc_by(failed);
            return ((ok, failed), on_it.len());
        }
        for e in on_it {
            let movable = how.migrate && e.stream && e.pinned().is_none() && matches!(e.phase(), Phase::Waiting | Phase::Running) && e.moves() < limit;
            if !movable || !ordered.insert(e.id().to_string()) {
                continue;
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            if e.mailbox.post(MoveOrder { to: None, reason: MoveReason::ScaleDown, reply: tx }).is_ok() {
                replies.spawn(async move { matches!(rx.await, Ok(Ok(_))) });
            }
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Puts `m` into routing (once).
pub async fn join(gw: &Arc<Gateway>, model: &str, m: &Managed) -> Result<(), String> {
    let w = m.worker_config();
    edit_routing(gw, model, move |l| {
        if !l.iter().any(|x| x.url == w.url) {
            l.push(w);
        }
    })
    .await
}

/// Edits the workers `model`'s planner put into routing ([`Gateway::update_added_workers`]),
/// on the blocking pool: a rebuild may load a tokenizer.
pub async fn edit_routing(gw: &Arc<Gateway>, model: &str, change: impl FnOnce(&mut Vec<WorkerConfig>) + Send + 'static) -> Result<(), String> {
    let (gw, model) = (gw.clone(), model.to_string());
    tokio::task::spawn_blocking(move || gw.update_added_workers(&model, change)).await.map_err(|e| e.to_string())?
}
