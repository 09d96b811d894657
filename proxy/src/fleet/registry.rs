//! Keeps workers alive across reloads, keyed by URL, so one that survives a reload keeps its
//! health state; builds the next [`Fleet`] from a validated config.

use super::{Fleet, Model, Worker};
use crate::config::{Config, ModelConfig, UpstreamUrl};
use kvgate_filters::route::Policy;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

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
        // Only its workers changed (the planner, discovery, or a reload that only adds or removes
        // workers): its KV index and router queue go on.
        let regrouped = |m: &ModelConfig| {
            let o = old.and_then(|f| f.models.get(&m.name))?;
            let without_workers = |c: &ModelConfig| ModelConfig { workers: Vec::new(), ..c.clone() };
            (without_workers(&o.cfg) == without_workers(m)).then(|| o.clone())
        };
        let kv: Vec<Option<Arc<crate::kv_routing::KvRouting>>> = cfg
            .models
            .iter()
            .map(|m| {
                if same_cfg(m).is_some() {
                    return Ok(None); // not needed: the model's state is reused below
                }
                if m.routing.builtin() != kvgate_filters::route::Mode::Kv {
                    return Ok(None);
                }
                let regrouped = regrouped(m).and_then(|o| o.kv.as_ref().and_then(|kv| crate::kv_routing::KvRouting::regroup(kv, &o.cfg.workers, m)));
                regrouped.map_or_else(|| crate::kv_routing::KvRouting::build(m), Ok).map(|kv| Some(Arc::new(kv)))
            })
            .collect::<Result<_, _>>()?;
        let mut known = self.by_url.lock();
        let mut next: HashMap<UpstreamUrl, Arc<Worker>> = HashMap::new();
        let mut models = super::ByName::default();
        let mut order = Vec::new();
        for (m, kv) in cfg.models.iter().zip(kv) {
            if let Some(same) = unchanged(m) {
                for w in same.workers.iter() {
                    next.insert(w.url.clone(), w.clone());
                }
                order.push(m.name.clone());
                models.insert(m.name.clone(), same);
                continue;
            }
            if let Some(prev) = same_cfg(m) {
                // Only its plugin changed: keep the KV index, bookings and queue waiters.
                for w in prev.workers.iter() {
                    next.insert(w.url.clone(), w.clone());
                }
                order.push(m.name.clone());
                let model = Model { plugin: slot(m), ..Model::clone(&prev) };
                models.insert(m.name.clone(), Arc::new(model));
                continue;
            }
            let workers: Arc<[Arc<Worker>]> = m
                .workers
                .iter()
                .map(|w| {
                    let worker = known.get(&w.url).cloned().unwrap_or_else(|| Arc::new(Worker::named(w.url.clone(), w.shown_name())));
                    next.insert(w.url.clone(), worker.clone());
                    worker
                })
                .collect::<Vec<_>>()
                .into();
            order.push(m.name.clone());
            let queue = regrouped(m)
                .and_then(|o| o.queue.clone())
                // A tenant back from idle may go ahead of a backlog by one engine step's tokens.
                .or_else(|| {
                    m.routing
                        .router_queue_threshold()
                        .map(|_| Arc::new(kvgate_filters::route::RouterQueue::new(m.routing.queue_max_len, m.shedding.prefill_budget() as f64)))
                });
            let policy: Arc<dyn Policy> = Arc::from(m.routing.builtin().policy());
            let ledger = Model::new_ledger(m, &workers);
            models.insert(
                m.name.clone(),
                Arc::new(Model {
                    cfg: m.clone(),
                    name: m.name.as_str().into(),
                    workers,
                    policy,
                    plugin: slot(m),
                    kv,
                    queue,
                    ledger,
                    metrics: Default::default(),
                }),
            );
        }
        *known = next;
        Ok(Fleet { models, order })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_keeps_worker_state_across_rebuilds() {
        let cfg = |urls: &[&str]| {
            let workers: String = urls.iter().flat_map(|&u| ["      - url: ", u, "\n"]).collect();
            crate::config::load::load_str(&format!("models:\n  - name: m\n    workers:\n{workers}"), "t", Vec::new()).unwrap()
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
