//! Active health checking: every `health.interval_ms`, each worker's health path is fetched
//! (GET, `health.timeout_ms`) over the same pooled HTTP client the request legs use;
//! `unhealthy_threshold` consecutive failures take it out of routing, `healthy_threshold`
//! consecutive successes bring it back. A 200 is healthy; anything else, a timeout or a refused
//! connection is not (vLLM answers 503 when its engine is dead). The address is looked up again
//! each round, so DNS changes are followed off the request path. Each round also closes the
//! worker's idle keep-alive connections past `timeouts.upstream_idle_ms`, and all of them when
//! it turns unhealthy (they are most likely dead).

use crate::gateway::Gateway;
use crate::upstream;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

/// Largest health body read (vLLM's is empty).
const MAX_BODY: usize = 64 * 1024;

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    loop {
        let cfg = gw.config();
        let h = cfg.health.clone();
        let idle = Duration::from_millis(cfg.timeouts.upstream_idle_ms);
        drop(cfg);
        let mut checks = JoinSet::new();
        for (model, w) in gw.fleet().all_workers() {
            let (gw, path) = (gw.clone(), h.path.clone());
            let timeout = Duration::from_millis(h.timeout_ms);
            let (fail_after, ok_after) = (h.unhealthy_threshold, h.healthy_threshold);
            checks.spawn(async move {
                let ok = w.resolve().await.is_ok() && matches!(upstream::get(&gw.config(), &w, &path, timeout, MAX_BODY, false).await, Ok((200, _)));
                match w.observe_health(ok, fail_after, ok_after) {
                    Some(true) => tracing::info!(worker = %w.url, model, "worker healthy again"),
                    Some(false) => {
                        w.idle.clear();
                        w.probe_idle.clear();
                        tracing::warn!(worker = %w.url, model, "worker unhealthy; removed from routing")
                    }
                    None => {}
                }
                w.idle.sweep(idle);
                w.probe_idle.sweep(idle);
                gw.metrics.worker_healthy.with_label_values(&[model.as_str(), w.label.as_str()]).set(i64::from(w.is_healthy()));
            });
        }
        while checks.join_next().await.is_some() {}
        tokio::time::sleep(Duration::from_millis(h.interval_ms)).await;
    }
}
