//! The gateway's WebAssembly plugins: one [`PluginSlot`] per `plugins` entry, kept across
//! config reloads while its entry is unchanged (so a reload elsewhere neither recompiles it nor
//! resets its instances), rebuilt when the entry changes, and swapped in place when its file
//! changes (polled by `tasks::plugin_watch`) or on `POST /plugins/reload`. A module that fails
//! to load never replaces a working one.

use crate::config::PluginConfig;
use crate::metrics::Metrics;
use kvgate_plugins::sandbox::Limits;
use kvgate_plugins::{PluginSlot, PluginSpec, ReloadOutcome};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

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

    /// Re-reads every plugin file and swaps in those that changed; returns each plugin's
    /// result. Blocks while compiling.
    pub fn reload_all(&self, metrics: &Metrics) -> Vec<(String, Result<ReloadOutcome, String>)> {
        self.slots()
            .into_iter()
            .map(|(name, slot)| {
                let r = slot.reload().map_err(|e| e.to_string());
                record(metrics, &name, &r);
                (name, r)
            })
            .collect()
    }
}

/// Logs and counts one plugin's reload.
pub fn record(metrics: &Metrics, name: &str, r: &Result<ReloadOutcome, String>) {
    match r {
        Ok(ReloadOutcome::Swapped { sha256 }) => {
            tracing::info!(plugin = name, sha256 = sha256.as_str(), "plugin reloaded");
            metrics.plugin_reloads.with_label_values(&[name, "ok"]).inc();
        }
        Ok(ReloadOutcome::Unchanged) => {}
        Err(e) => {
            tracing::error!(plugin = name, error = %e, "plugin rejected; the previous module keeps serving");
            metrics.plugin_reloads.with_label_values(&[name, "rejected"]).inc();
        }
    }
}
