//! Releases router-queue waiters as capacity frees: every few milliseconds, one per worker that
//! is under the queue threshold (each released request books its prefill before the next tick),
//! and all of them when no worker that could take them is healthy (placement answers them).

use crate::gateway::Gateway;
use std::sync::Arc;
use std::time::Duration;

/// Time between release rounds.
const TICK: Duration = Duration::from_millis(5);
/// Time between looks at a fleet without any queue (a reload may add one); an idle gateway
/// should not wake 200 times a second for nothing.
const IDLE_TICK: Duration = Duration::from_millis(250);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    loop {
        let fleet = gw.fleet();
        let mut queues = false;
        for m in fleet.models.values() {
            let Some(q) = &m.queue else { continue };
            queues = true;
            for _ in 0..m.queue_releases() {
                if !q.release() {
                    break;
                }
            }
        }
        drop(fleet);
        tokio::time::sleep(if queues { TICK } else { IDLE_TICK }).await;
    }
}
