//! The gateway's shared state: the live configuration and fleet (swapped atomically on reload),
//! the upstream connector, metrics, the in-flight registry, the loaded
//! plugins and the drain switch.

use crate::config::Config;
use crate::config::load::ConfigError;
use crate::fleet::Fleet;
use crate::fleet::registry::WorkerRegistry;
use crate::metrics::Metrics;
use arc_swap::ArcSwap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Everything request handlers and background tasks share.
pub struct Gateway {
    /// This process's gateway among others: fresh at every start (see [`Gateway::instance`]).
    instance: String,
    config: ArcSwap<Config>,
    fleet: ArcSwap<Fleet>,
    registry: WorkerRegistry,
    config_path: Option<PathBuf>,
    draining: AtomicBool,
    open: AtomicUsize,
    /// Busy thresholds per model, settable at run time (`/busy_threshold`).
    thresholds: parking_lot::RwLock<crate::fleet::ByName<kvgate_filters::shed::Thresholds>>,
    /// Metrics.
    pub metrics: Metrics,
    /// KV ingestion metrics (same registry).
    pub kv_metrics: kvgate_kv::metrics::KvMetrics,
    /// Loaded WebAssembly plugins.
    pub plugins: crate::plugins::PluginRegistry,
    /// Every inference request past admission, and the recently finished ones.
    pub requests: Arc<crate::inflight::RequestRegistry>,
    /// Which worker stored each Responses-API response (kept across reloads).
    pub stored_responses: crate::fleet::StoredResponses,
    /// Moves in progress at once (`migration.max_concurrent`).
    pub migrations: tokio::sync::Semaphore,
    /// Bumped whenever a fleet operation resumes workers: requests waiting for a paused
    /// model watch it (phase 2).
    pub resumed: tokio::sync::watch::Sender<u64>,
    /// Each planner's state, for `GET /planner`.
    pub planner_status: parking_lot::Mutex<Vec<crate::status::PlannerStatus>>,
    /// The rescheduler's last cycle, for `GET /rescheduling`.
    pub rescheduling_last: parking_lot::Mutex<Option<Vec<crate::status::CycleReport>>>,
    /// Workers added at run time (the planner's), by model; each rebuild of the fleet adds
    /// them to the file's, so they survive reloads.
    added: parking_lot::Mutex<crate::fleet::ByName<Vec<crate::config::WorkerConfig>>>,
    /// One apply at a time: prepare plugins → build the fleet → swap → commit must not
    /// interleave with another reload's, or the fleet and the plugin registry would disagree.
    applying: parking_lot::Mutex<()>,
    /// The TLS listeners' certificates, read again on reloads and when their files change.
    pub tls: crate::tls::Certificates,
    /// Requests in flight per client, for `per_client.max_concurrent`.
    pub client_limits: crate::downstream::client_limit::ClientLimits,
    /// This replica's part in its deployment (`cluster:`; empty without it).
    pub cluster: crate::cluster::Cluster,
    /// The tenants in force and their accounts (kept across reloads).
    pub tenants: crate::tenants::Registry,
    /// The trace exporter in force (`tracing:`), if any.
    pub traces: crate::traces::Exporter,
}

impl Gateway {
    /// State for a validated config; `path` is where reloads read from. Fails when a model's
    /// routing state cannot be built (e.g. its tokenizer does not load).
    pub fn new(cfg: Config, path: Option<PathBuf>) -> Result<Arc<Self>, String> {
        let registry = WorkerRegistry::default();
        let plugins = crate::plugins::PluginRegistry::default();
        let slots = plugins.prepare(&cfg.plugins)?;
        let fleet = registry.build(&cfg, None, &slots)?;
        plugins.commit(slots);
        let metrics = Metrics::new();
        let kv_metrics = kvgate_kv::metrics::KvMetrics::new(metrics.registry());
        let thresholds = cfg.models.iter().map(|m| (m.name.clone(), m.shedding.thresholds)).collect();
        let max_moves = cfg.migration.max_concurrent;
        let stored_responses = crate::fleet::StoredResponses::new(cfg.responses.remembered_ids);
        let tls = crate::tls::Certificates::load(&cfg)?;
        let instance = new_instance_id();
        let cluster = crate::cluster::Cluster::new(cfg.cluster.as_ref(), &instance, &metrics.cluster);
        let tenants = crate::tenants::Registry::default();
        tenants.apply(cfg.tenants.as_ref());
        let traces = crate::traces::Exporter::default();
        traces.apply(cfg.tracing.as_ref())?;
        Ok(Arc::new(Self {
            instance,
            tenants,
            traces,
            cluster,
            tls,
            client_limits: Default::default(),
            thresholds: parking_lot::RwLock::new(thresholds),
            config: ArcSwap::from_pointee(cfg),
            fleet: ArcSwap::from_pointee(fleet),
            registry,
            config_path: path,
            draining: AtomicBool::new(false),
            open: AtomicUsize::new(0),
            metrics,
            kv_metrics,
            plugins,
            requests: Arc::new(crate::inflight::RequestRegistry::default()),
            stored_responses,
            migrations: tokio::sync::Semaphore::new(max_moves),
            resumed: tokio::sync::watch::Sender::new(0),
            rescheduling_last: parking_lot::Mutex::new(None),
            planner_status: parking_lot::Mutex::new(Vec::new()),
            added: parking_lot::Mutex::new(Default::default()),
            applying: parking_lot::Mutex::new(()),
        }))
    }

    /// This gateway's instance id, fresh at every start and shown by `/health`: a client (or a
    /// test) that waits for a gateway to come up knows it reached this one and not another
    /// server on the same address.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// The fleet in force.
    pub fn fleet(&self) -> Arc<Fleet> {
        self.fleet.load_full()
    }

    /// Applies a validated configuration. Listener addresses and thread counts only change on
    /// restart; everything else (models, workers, timeouts, retries, health) takes effect now.
    /// Requests in flight keep the model, worker and plugin they started with. Compiles
    /// changed plugins: call it off the async workers.
    pub fn apply(&self, cfg: Config) -> Result<(), String> {
        let _one = self.applying.lock();
        self.apply_locked(cfg)
    }

    /// [`Gateway::apply`], with `applying` held by the caller.
    fn apply_locked(&self, mut cfg: Config) -> Result<(), String> {
        let old = self.config();
        if !bound_as(old.listen, cfg.listen)
            || !bound_as(old.admin_listen, cfg.admin_listen)
            || old.threads != cfg.threads
            || old.tls != cfg.tls
            || old.admin_tls != cfg.admin_tls
        {
            tracing::warn!("listen, admin_listen, threads, tls and admin_tls take effect at the next restart");
        }
        // The sockets stay as bound: the live config says where the gateway listens.
        (cfg.listen, cfg.admin_listen) = (old.listen, old.admin_listen);
        let before: std::collections::HashSet<String> = self.fleet().all_workers().iter().map(|(m, w)| format!("{m}@{}", w.url)).collect();
        let old_fleet = self.fleet();
        let slots = self.plugins.prepare(&cfg.plugins)?;
        let fleet = self.registry.build(&self.with_added(&cfg), Some(&old_fleet), &slots)?;
        let traces = self.traces.prepare(cfg.tracing.as_ref())?;

        let after: std::collections::HashSet<String> = fleet.all_workers().iter().map(|(m, w)| format!("{m}@{}", w.url)).collect();
        for added in after.difference(&before) {
            tracing::info!(worker = %added, "worker added");
        }
        for removed in before.difference(&after) {
            tracing::info!(worker = %removed, "worker removed (its in-flight requests finish)");
            if let Some((model, url)) = removed.split_once('@') {
                let _ = self.metrics.worker_healthy.remove_label_values(&[model, url]);
                let _ = self.metrics.worker_in_flight.remove_label_values(&[model, url]);
            }
        }
        {
            // Runtime-set thresholds survive a reload unless the file changed that model's.
            let mut th = self.thresholds.write();
            let mut next = crate::fleet::ByName::default();
            for m in &cfg.models {
                let from_file = m.shedding.thresholds;
                let before = old.model(&m.name).map(|o| o.shedding.thresholds);
                let keep = th.get(&m.name).copied().filter(|_| before == Some(from_file));
                next.insert(m.name.clone(), keep.unwrap_or(from_file));
            }
            *th = next;
        }
        self.traces.commit(traces);
        let fleet = Arc::new(fleet);
        self.fleet.store(fleet.clone());
        self.tenants.apply(cfg.tenants.as_ref());
        self.config.store(Arc::new(cfg));
        self.plugins.commit(slots);
        // After the swap (so no request can still enter them), replaced queues release their
        // waiters, who go on with the model they started with.
        for (name, m) in &old_fleet.models {
            let Some(q) = &m.queue else { continue };
            // A model rebuilt around the same queue (only its plugin changed) keeps its waiters.
            let kept = fleet.models.get(name).and_then(|n| n.queue.as_ref()).is_some_and(|nq| Arc::ptr_eq(nq, q));
            if !kept {
                q.release_all();
            }
        }
        Ok(())
    }

    /// `cfg` with the workers added at run time appended to their models' (a URL the file
    /// already lists is the file's).
    fn with_added(&self, cfg: &Config) -> Config {
        let added = self.added.lock();
        let mut out = cfg.clone();
        for m in &mut out.models {
            let Some(extra) = added.get(&m.name) else { continue };
            for w in extra {
                if !m.workers.iter().any(|c| c.url == w.url) {
                    m.workers.push(w.clone());
                }
            }
        }
        out
    }

    /// Changes the workers added at run time to `model` (`change` edits the list) and rebuilds
    /// the fleet around them: routing state, bookings and queue go on (docs/planner.md). On
    /// error nothing changes. Blocks while it builds (a model in approximate mode reloads its
    /// tokenizer): call it off the async workers.
    pub fn update_added_workers(&self, model: &str, change: impl FnOnce(&mut Vec<crate::config::WorkerConfig>)) -> Result<(), String> {
        // The edit and the rebuild under one lock: a reload in between would otherwise be
        // undone by a rebuild from the config read before it, and a failed rebuild puts back
        // exactly this edit.
        let _one = self.applying.lock();
        let before = {
            let mut added = self.added.lock();
            let list = added.entry(model.to_string()).or_default();
            let before = list.clone();
            change(list);
            before
        };
        let r = self.apply_locked((*self.config()).clone());
        if r.is_err() {
            self.added.lock().insert(model.to_string(), before);
        }
        r
    }

    /// The workers added at run time to `model`.
    pub fn added_workers(&self, model: &str) -> Vec<crate::config::WorkerConfig> {
        self.added.lock().get(model).cloned().unwrap_or_default()
    }

    /// Re-reads the config file; on error the running config stays and the error is returned.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let Some(path) = &self.config_path else {
            return Err(ConfigError { origin: "reload".into(), line: None, column: None, message: "no config file to reload".into() });
        };
        // The certificate files are read again on every reload, changed or not.
        self.tls.reload(true, &self.metrics);
        match crate::config::load::load_file(path) {
            Ok(cfg) => {
                if *self.config() != cfg {
                    if let Err(message) = self.apply(cfg) {
                        let e = ConfigError { origin: path.display().to_string(), line: None, column: None, message };
                        tracing::error!(error = %e, "configuration rejected; the previous configuration stays in force");
                        self.metrics.reloads.with_label_values(&["rejected"]).inc();
                        return Err(e);
                    }
                    tracing::info!(path = %path.display(), "configuration reloaded");
                }
                self.metrics.reloads.with_label_values(&["ok"]).inc();
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "configuration rejected; the previous configuration stays in force");
                self.metrics.reloads.with_label_values(&["rejected"]).inc();
                Err(e)
            }
        }
    }

    /// A model's busy thresholds now.
    pub fn thresholds(&self, model: &str) -> kvgate_filters::shed::Thresholds {
        self.thresholds.read().get(model).copied().unwrap_or_default()
    }

    /// Every model's thresholds, in config order.
    pub fn all_thresholds(&self) -> Vec<(String, kvgate_filters::shed::Thresholds)> {
        let th = self.thresholds.read();
        self.fleet().order.iter().map(|m| (m.clone(), th.get(m).copied().unwrap_or_default())).collect()
    }

    /// Replaces a model's thresholds; false if the model is unknown.
    pub fn set_thresholds(&self, model: &str, t: kvgate_filters::shed::Thresholds) -> bool {
        let mut th = self.thresholds.write();
        match th.get_mut(model) {
            Some(slot) => {
                *slot = t;
                true
            }
            None => false,
        }
    }

    /// The config file, if any.
    pub fn config_path(&self) -> Option<&PathBuf> {
        self.config_path.as_ref()
    }

    /// Starts draining: new inference requests are refused with 503.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the gateway is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Inference requests being served, counted from their first byte (the in-flight registry
    /// lists them once admitted).
    pub fn open_requests(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Counts a request in flight until the guard drops.
    pub fn track(self: &Arc<Self>) -> OpenRequest {
        self.open.fetch_add(1, Ordering::SeqCst);
        OpenRequest(self.clone())
    }
}

/// Keeps a request counted in [`Gateway::open_requests`].
pub struct OpenRequest(Arc<Gateway>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// True when a listener bound at `bound` is what `configured` asks for: port 0 asks for any.
fn bound_as(bound: std::net::SocketAddr, configured: std::net::SocketAddr) -> bool {
    bound.ip() == configured.ip() && (configured.port() == 0 || configured.port() == bound.port())
}

/// 16 hex digits, fresh, with the process id mixed in: two gateways started in one process,
/// or in two processes at the same instant, get different ids.
fn new_instance_id() -> String {
    crate::ids::hex_id("", kvgate_kv::hash::mix(crate::ids::fresh_bits() ^ u64::from(std::process::id())))
}
