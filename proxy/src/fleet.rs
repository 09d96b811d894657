//! The live set of models and their workers, built from a validated [`Config`] and swapped as a
//! whole on reload.
//!
//! Workers are kept in a registry by URL, so one that survives a reload keeps its health state
//! and in-flight count; a request holds `Arc`s to the model and worker it started with, so a
//! reload that removes them never disturbs it.

use crate::config::{Config, ModelConfig, UpstreamUrl};
use kvgate_filters::route::Policy;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// One vLLM server as the gateway tracks it.
#[derive(Debug)]
pub struct Worker {
    /// Base URL.
    pub url: UpstreamUrl,
    /// `Host` header value.
    pub host_header: String,
    healthy: AtomicBool,
    consecutive_failures: AtomicU32,
    consecutive_successes: AtomicU32,
    in_flight: AtomicU32,
    booked_prefill: AtomicU64,
    booked_blocks: AtomicU64,
    /// Load the worker reports, per DP rank (from its `/metrics`).
    reported: RwLock<Vec<ReportedLoad>>,
    /// Last resolved address; refreshed by the health loop so DNS changes are followed without
    /// a lookup (a blocking-pool hop) on the request path.
    addr: RwLock<Option<SocketAddr>>,
}

impl Worker {
    fn new(url: UpstreamUrl) -> Self {
        Self {
            host_header: url.authority.clone(),
            url,
            // Optimistic until the first check: a fresh gateway serves at once.
            healthy: AtomicBool::new(true),
            consecutive_failures: AtomicU32::new(0),
            consecutive_successes: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            booked_prefill: AtomicU64::new(0),
            booked_blocks: AtomicU64::new(0),
            reported: RwLock::new(Vec::new()),
            addr: RwLock::new(None),
        }
    }

    /// The worker's address: the cached one, or a fresh lookup (then cached).
    pub async fn addr(&self) -> std::io::Result<SocketAddr> {
        if let Some(a) = *self.addr.read() {
            return Ok(a);
        }
        self.resolve().await
    }

    /// Looks the address up now and caches it.
    pub async fn resolve(&self) -> std::io::Result<SocketAddr> {
        let a = match self.url.host.parse::<std::net::IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, self.url.port),
            Err(_) => tokio::net::lookup_host((self.url.host.as_str(), self.url.port))
                .await?
                .next()
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} does not resolve", self.url)))?,
        };
        *self.addr.write() = Some(a);
        Ok(a)
    }

    /// Passes health checks.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health observation; returns `Some(new_state)` when the state flips.
    pub fn observe_health(&self, ok: bool, unhealthy_after: u32, healthy_after: u32) -> Option<bool> {
        if ok {
            self.consecutive_failures.store(0, Ordering::Relaxed);
            let n = self.consecutive_successes.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= healthy_after && !self.healthy.swap(true, Ordering::Relaxed) {
                return Some(true);
            }
        } else {
            self.consecutive_successes.store(0, Ordering::Relaxed);
            let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= unhealthy_after && self.healthy.swap(false, Ordering::Relaxed) {
                return Some(false);
            }
        }
        None
    }

    /// Requests in flight to this worker.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Books one request on the worker until the guard drops: its prefill tokens (until
    /// [`InFlight::prefill_done`]) and its KV blocks.
    pub fn book(self: &Arc<Self>, prefill_tokens: u64, blocks: u64) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.booked_prefill.fetch_add(prefill_tokens, Ordering::Relaxed);
        self.booked_blocks.fetch_add(blocks, Ordering::Relaxed);
        InFlight { worker: self.clone(), prefill: prefill_tokens, blocks, prefill_done: false }
    }

    /// Prefill tokens booked and not started decoding.
    pub fn booked_prefill(&self) -> u64 {
        self.booked_prefill.load(Ordering::Relaxed)
    }

    /// KV blocks booked.
    pub fn booked_blocks(&self) -> u64 {
        self.booked_blocks.load(Ordering::Relaxed)
    }

    /// Records what the worker's `/metrics` say (one entry per DP rank).
    pub fn set_reported(&self, ranks: Vec<ReportedLoad>) {
        *self.reported.write() = ranks;
    }

    /// The worker's reported load per DP rank (empty until polled).
    pub fn reported(&self) -> Vec<ReportedLoad> {
        self.reported.read().clone()
    }
}

/// A DP rank's load as the worker reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReportedLoad {
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: u64,
    /// `num_gpu_blocks` from `vllm:cache_config_info`.
    pub total_blocks: u64,
}

/// An in-flight booking on a worker, released on drop (completion, error, cancel or panic).
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
    prefill: u64,
    blocks: u64,
    prefill_done: bool,
}

impl InFlight {
    /// The request's first token arrived: its prefill load is gone.
    pub fn prefill_done(&mut self) {
        if !self.prefill_done {
            self.prefill_done = true;
            self.worker.booked_prefill.fetch_sub(self.prefill, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.prefill_done();
        self.worker.booked_blocks.fetch_sub(self.blocks, Ordering::Relaxed);
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A served model: its config, its workers (in config order) and its routing policy.
#[derive(Clone)]
pub struct Model {
    /// The model's config section.
    pub cfg: ModelConfig,
    /// Workers; a worker's id is its index here.
    pub workers: Vec<Arc<Worker>>,
    /// Selection policy (baseline modes).
    pub policy: Arc<dyn Policy>,
    /// The WebAssembly policy in front of `policy`/`kv`, when `routing.mode` is `plugin`.
    pub plugin: Option<Arc<kvgate_plugins::PluginSlot>>,
    /// KV routing state, when `routing.mode` (or a plugin's fallback) is `kv`.
    pub kv: Option<Arc<crate::kv_routing::KvRouting>>,
    /// The router queue, when `routing.queue_threshold` is set.
    pub queue: Option<Arc<kvgate_filters::route::RouterQueue>>,
}

impl Model {
    /// Whether worker `i` is past the queue threshold (its booked prefill over
    /// `queue_threshold × max_num_batched_tokens`).
    pub fn queue_busy(&self, i: usize) -> bool {
        match (self.cfg.routing.queue_threshold, self.cfg.shedding.max_num_batched_tokens) {
            (Some(q), Some(budget)) => self.workers[i].booked_prefill() as f64 > q * budget as f64,
            _ => false,
        }
    }

    /// Healthy workers not past the queue threshold.
    pub fn queue_free_workers(&self) -> usize {
        (0..self.workers.len()).filter(|&i| self.workers[i].is_healthy() && !self.queue_busy(i)).count()
    }
}

/// Every served model.
pub struct Fleet {
    /// By name.
    pub models: HashMap<String, Arc<Model>>,
    /// Names in config order.
    pub order: Vec<String>,
}

impl Fleet {
    /// All distinct workers across models.
    pub fn all_workers(&self) -> Vec<(String, Arc<Worker>)> {
        let mut out = Vec::new();
        for name in &self.order {
            for w in &self.models[name].workers {
                out.push((name.clone(), w.clone()));
            }
        }
        out
    }

    /// The model clients address as `name`.
    pub fn model(&self, name: &str) -> Option<&Arc<Model>> {
        self.models.get(name)
    }
}

/// Keeps `Worker`s alive across reloads, keyed by URL.
#[derive(Default)]
pub struct WorkerRegistry {
    by_url: Mutex<HashMap<UpstreamUrl, Arc<Worker>>>,
}

impl WorkerRegistry {
    /// Builds the fleet for `cfg`, reusing workers already known by URL and forgetting the rest.
    /// A model whose config is unchanged from `old` is carried over whole (its queue waiters,
    /// bookings and KV index keep going). Fails (changing nothing) when a model's KV routing
    /// state cannot be built.
    pub fn build(&self, cfg: &Config, old: Option<&Fleet>, plugins: &HashMap<String, Arc<kvgate_plugins::PluginSlot>>) -> Result<Fleet, String> {
        let slot = |m: &ModelConfig| m.routing.plugin.as_ref().and_then(|p| plugins.get(p)).cloned();
        let same_slot = |a: &Option<Arc<kvgate_plugins::PluginSlot>>, b: &Option<Arc<kvgate_plugins::PluginSlot>>| match (a, b) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        let same_cfg = |m: &ModelConfig| old.and_then(|f| f.models.get(&m.name)).filter(|o| o.cfg == *m).cloned();
        let unchanged = |m: &ModelConfig| same_cfg(m).filter(|o| same_slot(&o.plugin, &slot(m)));
        let kv: Vec<Option<Arc<crate::kv_routing::KvRouting>>> = cfg
            .models
            .iter()
            .map(|m| {
                if same_cfg(m).is_some() {
                    return Ok(None); // not needed: the model's state is reused below
                }
                (m.routing.builtin() == kvgate_filters::route::Mode::Kv)
                    .then(|| crate::kv_routing::KvRouting::build(m).map(Arc::new))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        let mut known = self.by_url.lock();
        let mut next: HashMap<UpstreamUrl, Arc<Worker>> = HashMap::new();
        let mut models = HashMap::new();
        let mut order = Vec::new();
        for (m, kv) in cfg.models.iter().zip(kv) {
            if let Some(same) = unchanged(m) {
                for w in &same.workers {
                    next.insert(w.url.clone(), w.clone());
                }
                order.push(m.name.clone());
                models.insert(m.name.clone(), same);
                continue;
            }
            if let Some(prev) = same_cfg(m) {
                // Only its plugin changed: keep the KV index, bookings and queue waiters.
                for w in &prev.workers {
                    next.insert(w.url.clone(), w.clone());
                }
                order.push(m.name.clone());
                let model = Model { plugin: slot(m), ..Model::clone(&prev) };
                models.insert(m.name.clone(), Arc::new(model));
                continue;
            }
            let workers = m
                .workers
                .iter()
                .map(|w| {
                    let worker = known.get(&w.url).cloned().unwrap_or_else(|| Arc::new(Worker::new(w.url.clone())));
                    next.insert(w.url.clone(), worker.clone());
                    worker
                })
                .collect();
            order.push(m.name.clone());
            let queue = m.routing.queue_threshold.map(|_| {
                Arc::new(kvgate_filters::route::RouterQueue::new(m.routing.queue_max_len, std::time::Duration::from_millis(m.routing.queue_max_wait_ms)))
            });
            let policy: Arc<dyn Policy> = Arc::from(m.routing.builtin().policy());
            models.insert(m.name.clone(), Arc::new(Model { cfg: m.clone(), workers, policy, plugin: slot(m), kv, queue }));
        }
        *known = next;
        Ok(Fleet { models, order })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_flips_after_thresholds() {
        let w = Worker::new(UpstreamUrl::parse("http://127.0.0.1:1").unwrap());
        assert!(w.is_healthy());
        assert_eq!(w.observe_health(false, 2, 2), None);
        assert_eq!(w.observe_health(false, 2, 2), Some(false));
        assert_eq!(w.observe_health(false, 2, 2), None);
        assert_eq!(w.observe_health(true, 2, 2), None);
        assert_eq!(w.observe_health(true, 2, 2), Some(true));
    }

    #[test]
    fn bookings_release_on_drop() {
        let w = Arc::new(Worker::new(UpstreamUrl::parse("http://127.0.0.1:1").unwrap()));
        let mut a = w.book(100, 7);
        let b = w.book(50, 3);
        assert_eq!((w.in_flight(), w.booked_prefill(), w.booked_blocks()), (2, 150, 10));
        a.prefill_done();
        a.prefill_done();
        assert_eq!(w.booked_prefill(), 50);
        drop(a);
        drop(b);
        assert_eq!((w.in_flight(), w.booked_prefill(), w.booked_blocks()), (0, 0, 0));
    }

    #[test]
    fn registry_keeps_worker_state_across_rebuilds() {
        let cfg = |urls: &[&str]| {
            let workers: String = urls.iter().map(|u| format!("      - url: {u}\n")).collect();
            crate::config::load_str(&format!("models:\n  - name: m\n    workers:\n{workers}"), "t", Vec::new()).unwrap()
        };
        let reg = WorkerRegistry::default();
        let f1 = reg.build(&cfg(&["http://a:1", "http://b:1"]), None, &HashMap::new()).unwrap();
        let a1 = f1.models["m"].workers[0].clone();
        a1.observe_health(false, 1, 1);
        let f2 = reg.build(&cfg(&["http://b:1", "http://a:1", "http://c:1"]), Some(&f1), &HashMap::new()).unwrap();
        let a2 = &f2.models["m"].workers[1];
        assert!(Arc::ptr_eq(&a1, a2));
        assert!(!a2.is_healthy(), "state survives the reload");
        assert_eq!(f2.models["m"].workers.len(), 3);
        // An unchanged model is carried over as is.
        let f3 = reg.build(&cfg(&["http://b:1", "http://a:1", "http://c:1"]), Some(&f2), &HashMap::new()).unwrap();
        assert!(Arc::ptr_eq(&f2.models["m"], &f3.models["m"]));
    }
}
