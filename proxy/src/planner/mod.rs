//! Dynamo's planner acting on one model's fleet (docs/planner.md). Every
//! `metric_pulling_interval_s` it pulls the load the gateway already holds, every
//! `adjustment_interval_s` it asks the rules (`kvgate_filters::plan`) for a decision, and in
//! `act` mode it carries the decision out through the model's connector, one change at a time:
//! - [`change`]: a scale-up (start, wait until it answers, join routing) and a scale-down
//!   (leave routing, move its streams, wait for the rest, stop it);
//! - [`record`]: the decision log (JSON lines) and the `kvgate_planner_*` metrics.
//!
//! Workers the connector reports dead are taken out of routing and replaced.

pub mod change;
pub mod record;

use crate::config::{Planner as PlannerConfig, WorkerConfig};
use crate::connector::{Connector, Managed};
use crate::fleet::Model;
use crate::gateway::Gateway;
use kvgate_filters::plan::{Change, Decision, PlanMode, Planner, Pull, Workers};
use record::Recorder;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One planned model.
pub struct ModelPlanner {
    model: String,
    cfg: PlannerConfig,
    rules: Planner,
    connector: Option<Arc<dyn Connector>>,
    recorder: Recorder,
    /// The change under way; pulls and decisions wait for it (as Dynamo's planner blocks them).
    change: Option<tokio::task::JoinHandle<change::Outcome>>,
    /// Workers wanted: the running count when planning started, then each decision's.
    desired: Option<u32>,
    next_pull: Instant,
    next_adjust: Instant,
    last: Option<Decision>,
    /// After a failed change, no replacement is started before this (a worker that cannot
    /// start is not restarted in a tight loop).
    retry_at: Instant,
    /// Workers being drained: out of routing even while discovery still lists them.
    draining: change::Draining,
}

impl ModelPlanner {
    /// Starts planning `model` with `cfg`: the connector adopts what its state file lists;
    /// those workers join routing at once, and workers an earlier planner left in routing that
    /// the connector does not run leave it.
    pub fn start(gw: &Arc<Gateway>, model: &str, cfg: PlannerConfig) -> Self {
        let now = Instant::now();
        let mut me = Self {
            model: model.to_string(),
            rules: Planner::new(cfg.rules),
            recorder: Recorder::new(model, cfg.log.as_deref(), &gw.metrics),
            connector: None,
            change: None,
            desired: None,
            next_pull: now,
            next_adjust: now + secs(cfg.rules.adjustment_interval_s),
            last: None,
            retry_at: now,
            draining: Default::default(),
            cfg,
        };
        me.connect(gw, true);
        me
    }

    /// Builds the connector and puts the workers it already runs into routing once they
    /// answer. `prune`: workers an earlier planner left in routing that this connector does
    /// not run leave it (not on a reconfigure: the old connector's are being drained).
    fn connect(&mut self, gw: &Arc<Gateway>, prune: bool) {
        let connector: Option<Arc<dyn Connector>> =
            self.cfg.connector.as_ref().map(|c| Arc::from(crate::connector::build(c, &self.model, self.cfg.rules.decode_engine_num_gpu)));
        self.connector = connector.clone();
        let running = connector.as_ref().map(|c| c.list()).unwrap_or_default();
        if prune {
            let (gw, model, keep) = (gw.clone(), self.model.clone(), running.clone());
            tokio::spawn(async move {
                if let Err(e) = change::edit_routing(&gw, &model, move |l| l.retain(|w| keep.iter().any(|m| m.url == w.url))).await {
                    tracing::error!(model, error = %e, "planner: cannot take stale workers out of routing");
                }
            });
        }
        let Some(connector) = connector.filter(|c| !c.discovers()) else { return };
        for m in running {
            // Adopted from a state file: one still loading joins when it answers.
            let (gw, model, connector) = (gw.clone(), self.model.clone(), connector.clone());
            tokio::spawn(async move {
                match change::ready(&gw, &m, connector.as_ref(), connector.ready_timeout()).await {
                    Ok(()) => {
                        if let Err(e) = change::join(&gw, &model, &m).await {
                            tracing::error!(error = %e, "planner: cannot add an adopted worker to routing");
                        }
                    }
                    Err(e) => tracing::error!(error = %e, "planner: an adopted worker does not answer; it stays out of routing"),
                }
            });
        }
    }

    /// Takes a reloaded section: new rules (a new interval starts); the connector is kept
    /// unless its own settings changed.
    pub fn reconfigure(&mut self, gw: &Arc<Gateway>, cfg: PlannerConfig) {
        let reconnect = cfg.connector != self.cfg.connector;
        if cfg.log != self.cfg.log {
            self.recorder = Recorder::new(&self.model, cfg.log.as_deref(), &gw.metrics);
        }
        self.rules = Planner::new(cfg.rules);
        self.next_adjust = Instant::now() + secs(cfg.rules.adjustment_interval_s);
        self.cfg = cfg;
        if reconnect {
            if let Some(old) = self.connector.take() {
                tokio::spawn(retire(gw.clone(), self.model.clone(), old, self.drain()));
            }
            self.desired = None;
            self.connect(gw, false);
        }
    }

    /// Stops planning: every worker it started is drained (as a scale-down drains one) and
    /// stopped, in the background.
    pub fn stop(self, gw: &Arc<Gateway>) {
        if let Some(c) = self.connector.clone() {
            tokio::spawn(retire(gw.clone(), self.model.clone(), c, self.drain()));
        }
    }

    fn drain(&self) -> change::Drain {
        change::Drain { timeout: secs(self.cfg.drain_timeout_s), migrate: self.cfg.drain == crate::config::DrainMode::Migrate }
    }

    /// Its config section.
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// One step: finish a change that ended, reap dead workers, pull and decide when due, act.
    /// A gateway that is one of several replicas acts only while it holds their lease, asked
    /// at the moment it would act (the steps before await); otherwise it observes, deciding as
    /// the leader would and acting on nothing.
    pub async fn tick(&mut self, gw: &Arc<Gateway>) {
        if self.change.as_ref().is_some_and(|h| h.is_finished()) {
            let outcome = match self.change.take().expect("checked").await {
                Ok(o) => o,
                Err(e) => change::Outcome::failed(change::Kind::Up, Duration::ZERO, format!("the change task failed: {e}")),
            };
            if outcome.error.is_some() {
                self.retry_at = Instant::now() + secs(self.cfg.rules.adjustment_interval_s);
            }
            self.recorder.change(&outcome);
        }
        self.reap(gw).await;
        self.discover(gw).await;
        let Some(model) = gw.fleet().model(&self.model).cloned() else { return };
        let now = Instant::now();
        let adjusting = self.change.is_some();
        let running = model.workers.len() as u32;
        if now >= self.next_pull {
            self.next_pull = now + secs(self.cfg.rules.metric_pulling_interval_s);
            if let Some(pull) = pull(&model) {
                self.rules.observe(pull, adjusting);
                self.recorder.pull(&pull, running, adjusting);
            }
        }
        if now >= self.next_adjust {
            self.next_adjust = now + secs(self.cfg.rules.adjustment_interval_s);
            if let Some(d) = self.rules.adjust(Workers { decode: running, prefill: 0 }, adjusting) {
                let act = self.cfg.rules.mode == PlanMode::Act && self.connector.is_some() && gw.cluster.acts();
                let wanted = match d.decode.0 {
                    Change::Up => running + 1,
                    Change::Down => running - 1,
                    Change::Hold => running,
                };
                if act {
                    self.desired = Some(wanted);
                }
                self.recorder.decision(&d, running, wanted, act);
                self.last = Some(d);
                if act {
                    self.act(gw, &model, d.decode.0);
                }
            }
        }
        // A worker that died is replaced without waiting for a decision (a cluster's own
        // controller replaces those it runs).
        let replaces = self.connector.as_ref().is_some_and(|c| !c.discovers()) && gw.cluster.acts();
        if replaces
            && self.change.is_none()
            && now >= self.retry_at
            && let Some(want) = self.desired
            && running < want
        {
            self.act(gw, &model, Change::Up);
        }
        self.recorder.workers(running, self.desired.unwrap_or(running));
    }

    /// Starts the change `c`.
    fn act(&mut self, gw: &Arc<Gateway>, model: &Model, c: Change) {
        let Some(connector) = self.connector.clone() else { return };
        let gw = gw.clone();
        let name = self.model.clone();
        match c {
            Change::Hold => {}
            Change::Up => {
                let ready = connector.ready_timeout();
                self.change = Some(tokio::spawn(async move { change::scale_up(&gw, &name, connector.as_ref(), ready).await }));
            }
            Change::Down => {
                let Some(victim) = victim(model, connector.as_ref()) else {
                    tracing::info!(model = %self.model, "planner: scale-down held: every worker is in the config file (the planner removes only its own)");
                    self.desired = Some(model.workers.len() as u32);
                    return;
                };
                let (how, draining) = (self.drain(), self.draining.clone());
                self.change = Some(tokio::spawn(async move { change::scale_down(&gw, &name, connector.as_ref(), victim, how, &draining).await }));
            }
        }
    }

    /// With a discovering connector, makes the workers in routing the ones it lists ready,
    /// less those being drained.
    async fn discover(&mut self, gw: &Arc<Gateway>) {
        let Some(c) = self.connector.as_ref().filter(|c| c.discovers()) else { return };
        let draining = self.draining.lock().clone();
        let want: Vec<Managed> = c.list().into_iter().filter(|m| !draining.contains(&m.url)).collect();
        let have: Vec<_> = gw.added_workers(&self.model).into_iter().map(|w| w.url).collect();
        if want.len() == have.len() && want.iter().all(|m| have.contains(&m.url)) {
            return;
        }
        let added: Vec<WorkerConfig> = want.iter().map(Managed::worker_config).collect();
        if let Err(e) = change::edit_routing(gw, &self.model, |l| *l = added).await {
            tracing::error!(model = %self.model, error = %e, "planner: cannot follow the discovered workers");
        }
    }

    /// Takes workers that died out of routing.
    async fn reap(&mut self, gw: &Arc<Gateway>) {
        let Some(c) = &self.connector else { return };
        let dead = c.reap();
        if dead.is_empty() {
            return;
        }
        for d in &dead {
            tracing::warn!(model = %self.model, worker = %d.name, "planner: worker exited without being stopped; it leaves routing and is replaced");
            self.recorder.exit(d);
        }
        let urls: Vec<_> = dead.into_iter().map(|d| d.url).collect();
        if let Err(e) = change::edit_routing(gw, &self.model, move |l| l.retain(|w| !urls.contains(&w.url))).await {
            tracing::error!(model = %self.model, error = %e, "planner: cannot take a dead worker out of routing");
        }
    }

    /// What `GET /planner` shows of it.
    pub fn status(&self) -> crate::status::PlannerStatus {
        let last_decision =
            self.last.map(|d| crate::status::LastDecision { change: record::change_label(d.decode.0), reason: d.decode.1.label(), kv_usage: d.decode_kv });
        let started_workers = self
            .connector
            .as_ref()
            .map(|c| c.list())
            .unwrap_or_default()
            .into_iter()
            .map(|m| crate::status::StartedWorker { name: m.name, url: m.url.to_string(), gpus: m.gpus })
            .collect();
        crate::status::PlannerStatus {
            model: self.model.clone(),
            mode: if self.cfg.rules.mode == PlanMode::Act { "act" } else { "observe_only" },
            connector: self.connector.as_ref().map(|c| c.kind()),
            desired: self.desired,
            changing: self.change.is_some(),
            last_decision,
            started_workers,
        }
    }
}

/// The load now: the average KV utilisation (fullest rank) of the healthy workers that
/// reported theirs, and the requests waiting (router queue + the workers' own) per worker.
/// `None` when no worker reported.
pub fn pull(model: &Model) -> Option<Pull> {
    let mut kv = Vec::new();
    let mut waiting = model.queue.as_ref().map_or(0, |q| q.len()) as f64;
    for w in model.workers.iter().filter(|w| w.is_healthy()) {
        let r = w.reported_summary();
        if r.ranks > 0 {
            kv.push(r.kv_usage);
            waiting += f64::from(r.waiting);
        }
    }
    if kv.is_empty() {
        return None;
    }
    let n = kv.len() as f64;
    Some(Pull { decode_kv: kv.iter().sum::<f64>() / n, prefill_queue: Some(waiting / n) })
}

/// The worker a scale-down removes: one the planner started (never one of the file's), the
/// one with the fewest requests in flight, the newest among equals.
fn victim(model: &Model, connector: &dyn Connector) -> Option<Managed> {
    let started = connector.list();
    model
        .workers
        .iter()
        .enumerate()
        .filter_map(|(i, w)| {
            started.iter().find(|m| m.url == w.url && connector.can_remove(&m.name)).map(|m| (model.ledger.requests(i as u16), std::cmp::Reverse(i), m))
        })
        .min_by_key(|(n, newest, _)| (*n, *newest))
        .map(|(_, _, m)| m.clone())
}

/// Drains and stops every worker `connector` runs, one after another (a connector whose
/// planner was turned off or given another connector).
async fn retire(gw: Arc<Gateway>, model: String, connector: Arc<dyn Connector>, how: change::Drain) {
    let draining = change::Draining::default();
    for m in connector.list() {
        let o = change::scale_down(&gw, &model, connector.as_ref(), m, how, &draining).await;
        tracing::info!(model, worker = ?o.worker, moved = o.moved.0, "planner: worker retired");
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}
