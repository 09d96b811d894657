//! The gateway's background work, each a task in its own file, run under one [`Supervisor`]
//! (a `JoinSet`): started together when the server starts, stopped together when it stops, and
//! a task that panics is logged and restarted (after 1 s, doubling up to 30 s while it keeps
//! failing), so one bug never silently stops health checks or event ingestion.
//!
//! - [`health`]: health probes of every worker (`health.*`);
//! - [`worker_metrics`]: polling each worker's `/metrics` for the load it reports (`load.*`);
//! - [`kv_subscribers`]: one KV event subscriber per worker rank of the fleet in force;
//! - [`queue_release`]: releasing router-queue waiters as capacity frees;
//! - [`ledger_upkeep`]: booking expiry and the ledger gauges;
//! - [`config_watch`]: config file watch and SIGHUP → reload;
//! - [`plugin_watch`]: plugin file polling → hot swap;
//! - [`rescheduler`]: Llumnix's rescheduling loop (moves requests between workers);
//! - [`planner`]: Dynamo's planner for every planned model (scales its fleet);
//! - [`tls_reload`]: TLS certificate files read again when they change;
//! - [`cluster`]: this replica's part in its deployment over NATS (`cluster:`).

pub mod cluster;
pub mod config_watch;
pub mod health;
pub mod kv_subscribers;
pub mod ledger_upkeep;
pub mod planner;
pub mod plugin_watch;
pub mod queue_release;
pub mod rescheduler;
pub mod tls_reload;
pub mod worker_metrics;

use crate::gateway::Gateway;
pub use config_watch::ConfigWatch;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::{Id, JoinSet};

/// First restart delay of a failed task.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest restart delay.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A task that ran this long before failing starts again from [`FIRST_BACKOFF`].
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// One kind of background task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// [`health`].
    Health,
    /// [`worker_metrics`].
    WorkerMetrics,
    /// [`kv_subscribers`].
    KvSubscribers,
    /// [`queue_release`].
    QueueRelease,
    /// [`ledger_upkeep`].
    LedgerUpkeep,
    /// [`config_watch`].
    ConfigWatch,
    /// [`plugin_watch`].
    PluginWatch,
    /// [`rescheduler`].
    Rescheduler,
    /// [`planner`].
    Planner,
    /// [`tls_reload`].
    TlsReload,
    /// [`cluster`].
    Cluster,
}

impl Task {
    /// Every task, in start order.
    pub const ALL: [Task; 11] = [
        Task::Health,
        Task::WorkerMetrics,
        Task::KvSubscribers,
        Task::QueueRelease,
        Task::LedgerUpkeep,
        Task::ConfigWatch,
        Task::PluginWatch,
        Task::Rescheduler,
        Task::Planner,
        Task::TlsReload,
        Task::Cluster,
    ];

    /// Name for logs.
    pub fn name(self) -> &'static str {
        match self {
            Task::Health => "health",
            Task::WorkerMetrics => "worker_metrics",
            Task::KvSubscribers => "kv_subscribers",
            Task::QueueRelease => "queue_release",
            Task::LedgerUpkeep => "ledger_upkeep",
            Task::ConfigWatch => "config_watch",
            Task::PluginWatch => "plugin_watch",
            Task::Rescheduler => "rescheduler",
            Task::Planner => "planner",
            Task::TlsReload => "tls_reload",
            Task::Cluster => "cluster",
        }
    }

    /// Starts the task after `delay`.
    fn spawn(self, set: &mut JoinSet<()>, gw: Arc<Gateway>, watch: Option<Arc<ConfigWatch>>, delay: Duration) -> Id {
        let run: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> = match self {
            Task::Health => Box::pin(health::run(gw)),
            Task::WorkerMetrics => Box::pin(worker_metrics::run(gw)),
            Task::KvSubscribers => Box::pin(kv_subscribers::run(gw)),
            Task::QueueRelease => Box::pin(queue_release::run(gw)),
            Task::LedgerUpkeep => Box::pin(ledger_upkeep::run(gw)),
            Task::ConfigWatch => Box::pin(config_watch::run(gw, watch)),
            Task::Rescheduler => Box::pin(rescheduler::run(gw)),
            Task::PluginWatch => Box::pin(plugin_watch::run(gw)),
            Task::Planner => Box::pin(planner::run(gw)),
            Task::TlsReload => Box::pin(tls_reload::run(gw)),
            Task::Cluster => Box::pin(cluster::run(gw)),
        };
        set.spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            run.await
        })
        .id()
    }
}

/// A running task: what it is, when it started, the delay of its next restart.
struct Running {
    task: Task,
    started: Instant,
    backoff: Duration,
}

/// Runs the background tasks.
pub struct Supervisor {
    set: JoinSet<()>,
    tasks: HashMap<Id, Running>,
    gw: Arc<Gateway>,
    config_watch: Option<Arc<ConfigWatch>>,
}

impl Supervisor {
    /// Starts every task. `config_watch` is the watch on the gateway's config file, installed
    /// before its listeners opened ([`ConfigWatch::install`]); `None` without a config file.
    pub fn start(gw: Arc<Gateway>, config_watch: Option<Arc<ConfigWatch>>) -> Self {
        let mut s = Self { set: JoinSet::new(), tasks: HashMap::new(), gw, config_watch };
        for t in Task::ALL {
            s.start_one(t, Duration::ZERO, FIRST_BACKOFF);
        }
        s
    }

    fn start_one(&mut self, task: Task, delay: Duration, backoff: Duration) {
        let id = task.spawn(&mut self.set, self.gw.clone(), self.config_watch.clone(), delay);
        self.tasks.insert(id, Running { task, started: Instant::now() + delay, backoff });
    }

    /// Tasks running now.
    #[cfg(test)]
    pub fn running(&self) -> Vec<Task> {
        let mut v: Vec<Task> = self.tasks.values().map(|r| r.task).collect();
        v.sort_by_key(|t| Task::ALL.iter().position(|a| a == t));
        v
    }

    /// Supervises until `stop` completes, then stops every task and waits for them.
    pub async fn run_until(mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(done) = self.set.join_next_with_id() => self.ended(done),
            }
        }
        self.shutdown().await;
    }

    /// A task ended on its own: they run forever, so it failed; restart it.
    fn ended(&mut self, done: Result<(Id, ()), tokio::task::JoinError>) {
        let (id, why) = match done {
            Ok((id, ())) => (id, "returned".to_string()),
            Err(e) => (e.id(), if e.is_panic() { "panicked".to_string() } else { e.to_string() }),
        };
        let Some(r) = self.tasks.remove(&id) else { return };
        // A gateway without a config file has nothing to watch: that task ends by design.
        if r.task == Task::ConfigWatch && self.config_watch.is_none() {
            return;
        }
        let delay = if r.started.elapsed() >= HEALTHY_RUN { FIRST_BACKOFF } else { r.backoff };
        tracing::error!(task = r.task.name(), why, restart_in_s = delay.as_secs(), "background task ended; restarting it");
        self.start_one(r.task, delay, (delay * 2).min(MAX_BACKOFF));
    }

    /// Stops every task and waits until they are gone.
    pub async fn shutdown(mut self) {
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
        self.tasks.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_task_starts_and_stops_together() {
        let cfg = crate::config::load::load_str("models:\n  - name: m\n    workers:\n      - url: http://127.0.0.1:9\n", "t", Vec::new()).unwrap();
        let gw = Gateway::new(cfg, None).unwrap();
        let s = Supervisor::start(gw.clone(), None);
        assert_eq!(s.running(), Task::ALL.to_vec());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let run = tokio::spawn(s.run_until(async move {
            let _ = rx.await;
        }));
        tx.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), run).await.expect("stops promptly").unwrap();
        // Every task dropped its handle on the gateway.
        assert_eq!(Arc::strong_count(&gw), 1);
    }
}
