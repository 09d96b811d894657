//! The gateway's background work, each a task in its own file, run under one [`Supervisor`]
//! (a `JoinSet`): started together when the server starts, stopped together when it stops, and
//! a task that panics is logged and restarted, so one bug never silently stops health checks or
//! event ingestion.
//!
//! - [`health`]: health probes of every worker (`health.*`);
//! - [`worker_metrics`]: polling each worker's `/metrics` for the load it reports (`load.*`);
//! - [`kv_subscribers`]: one KV event subscriber per worker rank of the fleet in force;
//! - [`queue_release`]: releasing router-queue waiters as capacity frees;
//! - [`ledger_upkeep`]: booking expiry and the ledger gauges;
//! - [`config_watch`]: config file watch and SIGHUP → reload;
//! - [`plugin_watch`]: plugin file polling → hot swap.

pub mod config_watch;
pub mod health;
pub mod kv_subscribers;
pub mod ledger_upkeep;
pub mod plugin_watch;
pub mod queue_release;
pub mod worker_metrics;

use crate::gateway::Gateway;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::task::{Id, JoinSet};

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
}

impl Task {
    /// Every task, in start order.
    pub const ALL: [Task; 7] =
        [Task::Health, Task::WorkerMetrics, Task::KvSubscribers, Task::QueueRelease, Task::LedgerUpkeep, Task::ConfigWatch, Task::PluginWatch];

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
        }
    }

    fn spawn(self, set: &mut JoinSet<()>, gw: Arc<Gateway>) -> Id {
        let handle = match self {
            Task::Health => set.spawn(health::run(gw)),
            Task::WorkerMetrics => set.spawn(worker_metrics::run(gw)),
            Task::KvSubscribers => set.spawn(kv_subscribers::run(gw)),
            Task::QueueRelease => set.spawn(queue_release::run(gw)),
            Task::LedgerUpkeep => set.spawn(ledger_upkeep::run(gw)),
            Task::ConfigWatch => set.spawn(config_watch::run(gw)),
            Task::PluginWatch => set.spawn(plugin_watch::run(gw)),
        };
        handle.id()
    }
}

/// Runs the background tasks.
pub struct Supervisor {
    set: JoinSet<()>,
    tasks: HashMap<Id, Task>,
    gw: Arc<Gateway>,
}

impl Supervisor {
    /// Starts every task.
    pub fn start(gw: Arc<Gateway>) -> Self {
        let mut s = Self { set: JoinSet::new(), tasks: HashMap::new(), gw };
        for t in Task::ALL {
            s.start_one(t);
        }
        s
    }

    fn start_one(&mut self, t: Task) {
        let id = t.spawn(&mut self.set, self.gw.clone());
        self.tasks.insert(id, t);
    }

    /// Tasks running now.
    #[cfg(test)]
    pub fn running(&self) -> Vec<Task> {
        let mut v: Vec<Task> = self.tasks.values().copied().collect();
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
        let Some(t) = self.tasks.remove(&id) else { return };
        // A gateway without a config file has nothing to watch: that task ends by design.
        if t == Task::ConfigWatch && self.gw.config_path().is_none() {
            return;
        }
        tracing::error!(task = t.name(), why, "background task ended; restarting it");
        self.start_one(t);
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
        let cfg = crate::config::load_str("models:\n  - name: m\n    workers:\n      - url: http://127.0.0.1:9\n", "t", Vec::new()).unwrap();
        let gw = Gateway::new(cfg, None).unwrap();
        let s = Supervisor::start(gw.clone());
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
