//! Releases router-queue waiters as capacity frees: every few milliseconds, one per worker that
//! is under the queue threshold (each released request books its prefill before the next tick).

use crate::gateway::Gateway;
use std::sync::Arc;
use std::time::Duration;

/// Time between release rounds.
const TICK: Duration = Duration::from_millis(5);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    loop {
        let fleet = gw.fleet();
        for m in fleet.models.values() {
            let Some(q) = &m.queue else { continue };
            for _ in 0..m.queue_free_workers() {
                if !q.release() {
                    break;
                }
            }
        }
        drop(fleet);
        tokio::time::sleep(TICK).await;
    }
}
