//! Keeps one KV event subscriber per event source (worker DP rank) of the fleet in force; a
//! reload that replaces a model's KV state replaces its subscribers. The subscribers live in
//! this task's `JoinSet`s, so stopping the task stops them all.

use crate::gateway::Gateway;
use crate::kv_routing::{Cache, KvRouting};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

/// How often the fleet is checked for changed KV state.
const EVERY: Duration = Duration::from_millis(200);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    // Keyed by the state's address; holding the Arc keeps that address from being reused by a
    // newer state while tracked.
    let mut running: HashMap<usize, (Arc<KvRouting>, JoinSet<()>)> = HashMap::new();
    loop {
        let fleet = gw.fleet();
        let mut live = HashSet::new();
        for m in fleet.models.values() {
            let Some(kv) = &m.kv else { continue };
            let key = Arc::as_ptr(kv) as usize;
            live.insert(key);
            if let Cache::Events(index) = &kv.cache
                && !running.contains_key(&key)
            {
                let mut set = JoinSet::new();
                for src in &kv.sources {
                    let index: Arc<dyn kvgate_kv::index::KvIndex> = index.clone();
                    set.spawn(kvgate_kv::subscriber::run(src.clone(), index, gw.kv_metrics.clone()));
                }
                running.insert(key, (kv.clone(), set));
            }
        }
        // Dropping a JoinSet aborts its subscribers.
        running.retain(|key, _| live.contains(key));
        drop(fleet);
        tokio::time::sleep(EVERY).await;
    }
}
