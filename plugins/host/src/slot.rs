//! The hot-swappable cell a model routes through. Loading compiles and vets the new module
//! and runs its `init` before one atomic swap; a request takes the current plugin once and
//! keeps it to its end, so a swap never changes policy under a request in flight; a module that
//! does not load leaves the old one serving.

use crate::component::{self, PluginSpec};
use crate::failure::{Failure, LoadError};
use crate::routing::{RouteRequest, RoutingPlugin};
use arc_swap::ArcSwap;
use kvgate_filters::route::{Candidate, Decision, Policy};
use parking_lot::Mutex;
use std::sync::Arc;

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// The file is the one already loaded.
    Unchanged,
    /// A new module now serves.
    Swapped {
        /// sha256 of the new file.
        sha256: String,
    },
}

/// A routing plugin that can be replaced while requests use it.
pub struct PluginSlot {
    spec: PluginSpec,
    current: ArcSwap<RoutingPlugin>,
    /// One reload at a time, so the last file read is the one that ends up serving.
    reloading: Mutex<()>,
}

/// A routing answer and what the plugin had to do with it.
pub struct Routed {
    /// What to do with the request.
    pub decision: Decision,
    /// Why the plugin's answer was not used, if it failed.
    pub failure: Option<Failure>,
    /// Whether the plugin's own answer was used (false: the fallback decided).
    pub by_plugin: bool,
}

impl PluginSlot {
    /// Compiles and starts `spec`'s module. Blocks for milliseconds: not on the request path.
    pub fn load(spec: PluginSpec) -> Result<Self, LoadError> {
        let plugin = RoutingPlugin::new(component::compile(&spec)?)?;
        Ok(Self { spec, current: ArcSwap::from_pointee(plugin), reloading: Mutex::new(()) })
    }

    /// What it was configured with.
    pub fn spec(&self) -> &PluginSpec {
        &self.spec
    }

    /// The plugin serving now; hold it for the whole request.
    pub fn current(&self) -> Arc<RoutingPlugin> {
        self.current.load_full()
    }

    /// Re-reads the file and swaps in the new module if it changed and loads. On error the
    /// serving module stays.
    pub fn reload(&self) -> Result<ReloadOutcome, LoadError> {
        let _one = self.reloading.lock();
        let (_, sha) = component::file_sha256(&self.spec)?;
        if sha == self.current.load().sha256() {
            return Ok(ReloadOutcome::Unchanged);
        }
        let plugin = RoutingPlugin::new(component::compile(&self.spec)?)?;
        let sha256 = plugin.sha256().to_string();
        self.current.store(Arc::new(plugin));
        Ok(ReloadOutcome::Swapped { sha256 })
    }
}

/// Asks `plugin`; when it fails or has no opinion, `fallback` decides.
pub fn route(plugin: &RoutingPlugin, req: &RouteRequest<'_>, candidates: &[Candidate], fallback: &dyn Policy) -> Routed {
    match plugin.choose(req, candidates) {
        Ok(Some(decision)) => Routed { decision, failure: None, by_plugin: true },
        Ok(None) => Routed { decision: fallback.choose(req, candidates), failure: None, by_plugin: false },
        Err(f) => Routed { decision: fallback.choose(req, candidates), failure: Some(f), by_plugin: false },
    }
}
