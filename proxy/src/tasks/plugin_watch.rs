//! Watches plugin files (size, inode, modification and change time, every [`POLL`]) and
//! reloads the ones that changed. Polling rather than inotify: a plugin file may sit anywhere,
//! be replaced by rename, or live on a volume without notifications.

use crate::gateway::Gateway;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

/// How often plugin files are checked for changes.
pub const POLL: Duration = Duration::from_millis(250);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    let mut seen: HashMap<String, Option<(u64, u64, i64, i64)>> = HashMap::new();
    loop {
        tokio::time::sleep(POLL).await;
        for (name, slot) in gw.plugins.slots() {
            // Inode and change time too: a rename over the file, or a copy that keeps size and
            // modification time, still shows.
            let stamp = std::fs::metadata(&slot.spec().path)
                .ok()
                .map(|m| (m.len(), m.ino(), m.mtime_nsec() + m.mtime() * 1_000_000_000, m.ctime_nsec() + m.ctime() * 1_000_000_000));
            let before = seen.insert(name.clone(), stamp);
            // First sight of a slot: compare contents once (cheap when unchanged), which also
            // catches a change made between its load and this first look.
            if before == Some(stamp) || stamp.is_none() {
                continue;
            }
            // Compiling blocks: not on an async worker.
            match tokio::task::spawn_blocking(move || slot.reload().map_err(|e| e.to_string())).await {
                Ok(r) => crate::plugins::record(&gw.metrics, &name, &r),
                Err(e) => tracing::error!(plugin = name.as_str(), error = %e, "plugin reload task failed"),
            }
        }
    }
}
