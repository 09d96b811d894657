//! The gateway's WebAssembly plugins: one [`PluginSlot`] per `plugins` entry, kept across
//! config reloads while its entry is unchanged (so a reload elsewhere neither recompiles it nor
//! resets its instances), rebuilt when the entry changes, and swapped in place when its file
//! changes (polled, see [`watch`]) or on `POST /plugins/reload`. A module that fails to load
//! never replaces a working one.

use crate::config::PluginConfig;
use crate::gateway::Gateway;
use kvgate_plugins::sandbox::Limits;
use kvgate_plugins::{PluginSlot, PluginSpec, ReloadOutcome};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often plugin files are checked for changes.
pub const POLL: Duration = Duration::from_millis(250);

/// The loaded plugins by name.
#[derive(Default)]
pub struct PluginRegistry {
    slots: Mutex<HashMap<String, Arc<PluginSlot>>>,
}

/// A plugin's spec from its config entry.
pub fn spec(p: &PluginConfig) -> PluginSpec {
    PluginSpec {
        name: p.name.clone(),
        path: p.path.clone(),
        sha256: p.sha256.clone(),
        config: p.config.clone(),
        headers: p.headers.clone(),
        limits: Limits { timeout_ms: p.timeout_ms, memory_mib: p.memory_mib },
    }
}

impl PluginRegistry {
    /// The slots for `plugins`: unchanged entries keep their slot, the others are compiled.
    /// Nothing changes (and the error names the plugin) when one does not load. Blocks while
    /// compiling: call it off the async workers.
    pub fn prepare(&self, plugins: &[PluginConfig]) -> Result<HashMap<String, Arc<PluginSlot>>, String> {
        let current = self.slots.lock().clone();
        plugins
            .iter()
            .map(|p| {
                let spec = spec(p);
                let slot = match current.get(&p.name).filter(|s| *s.spec() == spec) {
                    Some(s) => s.clone(),
                    None => Arc::new(PluginSlot::load(spec).map_err(|e| e.to_string())?),
                };
                Ok((p.name.clone(), slot))
            })
            .collect()
    }

    /// Makes `slots` the registry's (after the config that needs them is in force).
    pub fn commit(&self, slots: HashMap<String, Arc<PluginSlot>>) {
        *self.slots.lock() = slots;
    }

    /// Every slot, by name.
    pub fn slots(&self) -> Vec<(String, Arc<PluginSlot>)> {
        let mut v: Vec<_> = self.slots.lock().iter().map(|(n, s)| (n.clone(), s.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// Re-reads every plugin file and swaps in those that changed; returns each plugin's result.
/// Blocks while compiling.
pub fn reload_all(gw: &Gateway) -> Vec<(String, Result<ReloadOutcome, String>)> {
    gw.plugins
        .slots()
        .into_iter()
        .map(|(name, slot)| {
            let r = slot.reload().map_err(|e| e.to_string());
            record(gw, &name, &r);
            (name, r)
        })
        .collect()
}

fn record(gw: &Gateway, name: &str, r: &Result<ReloadOutcome, String>) {
    match r {
        Ok(ReloadOutcome::Swapped { sha256 }) => {
            tracing::info!(plugin = name, sha256 = sha256.as_str(), "plugin reloaded");
            gw.metrics.plugin_reloads.with_label_values(&[name, "ok"]).inc();
        }
        Ok(ReloadOutcome::Unchanged) => {}
        Err(e) => {
            tracing::error!(plugin = name, error = %e, "plugin rejected; the previous module keeps serving");
            gw.metrics.plugin_reloads.with_label_values(&[name, "rejected"]).inc();
        }
    }
}

/// Watches plugin files (size and modification time, every [`POLL`]) until dropped, and
/// reloads the ones that changed. Polling rather than inotify: a plugin file may sit anywhere,
/// be replaced by rename, or live on a volume without notifications.
pub async fn watch(gw: Arc<Gateway>) {
    use std::os::unix::fs::MetadataExt;
    let mut seen: HashMap<String, Option<(u64, u64, i64, i64)>> = HashMap::new();
    loop {
        tokio::time::sleep(POLL).await;
        for (name, slot) in gw.plugins.slots() {
            // Inode and change time too: a rename over the file, or a copy that keeps size and
            // modification time, still shows.
            let stamp = std::fs::metadata(&slot.spec().path).ok().map(|m| (m.len(), m.ino(), m.mtime_nsec() + m.mtime() * 1_000_000_000, m.ctime_nsec() + m.ctime() * 1_000_000_000));
            let before = seen.insert(name.clone(), stamp);
            // First sight of a slot: compare contents once (cheap when unchanged), which also
            // catches a change made between its load and this first look.
            if before == Some(stamp) || stamp.is_none() {
                continue;
            }
            let gw2 = gw.clone();
            let r = tokio::task::spawn_blocking(move || slot.reload().map_err(|e| e.to_string())).await;
            match r {
                Ok(r) => record(&gw2, &name, &r),
                Err(e) => tracing::error!(plugin = name.as_str(), error = %e, "plugin reload task failed"),
            }
        }
    }
}
