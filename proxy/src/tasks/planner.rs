//! Runs Dynamo's planner for every model whose `planner.enabled` is set (`crate::planner`):
//! starts one when a model gets a planner, reconfigures it on reload, and when a model loses
//! its planner drains and stops the workers it started. Publishes each planner's state for
//! `GET /planner`.

use crate::gateway::Gateway;
use crate::planner::ModelPlanner;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often each planner looks at its model (its intervals are counted within).
const TICK: Duration = Duration::from_millis(100);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    let mut planners: HashMap<String, ModelPlanner> = HashMap::new();
    loop {
        let cfg = gw.config();
        for m in cfg.models.iter().filter(|m| m.planner.rules.enabled) {
            match planners.get_mut(&m.name) {
                Some(p) if p.config() == &m.planner => {}
                Some(p) => p.reconfigure(&gw, m.planner.clone()),
                None => {
                    planners.insert(m.name.clone(), ModelPlanner::start(&gw, &m.name, m.planner.clone()));
                }
            }
        }
        let gone: Vec<String> = planners.keys().filter(|name| !cfg.models.iter().any(|m| &m.name == *name && m.planner.rules.enabled)).cloned().collect();
        for name in gone {
            if let Some(p) = planners.remove(&name) {
                tracing::info!(model = %name, "planner: off; the workers it started are drained and stopped");
                p.stop(&gw);
            }
        }
        drop(cfg);
        // In a cluster only the leader acts (each planner asks as it would act); the others
        // observe, and take over when its lease lapses.
        for p in planners.values_mut() {
            p.tick(&gw).await;
        }
        let mut status: Vec<_> = planners.values().map(ModelPlanner::status).collect();
        status.sort_by(|a, b| a.model.cmp(&b.model));
        *gw.planner_status.lock() = status;
        tokio::time::sleep(TICK).await;
    }
}
