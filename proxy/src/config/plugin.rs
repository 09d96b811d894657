//! A WebAssembly policy plugin's entry in `plugins:`, which models and the rescheduler name.

use serde::Deserialize;
use std::path::PathBuf;

/// A WebAssembly policy plugin (plugins/README.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Name models refer to (`routing.plugin`) and metrics label it with.
    pub name: String,
    /// The component (`.wasm`); relative paths are relative to the working directory. A change
    /// to the file is picked up within a second.
    pub path: PathBuf,
    /// Expected sha256 of the file (64 hex digits); a file that differs is refused.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Text passed to the plugin's `init`.
    #[serde(default)]
    pub config: String,
    /// Request headers the plugin may see (others are never passed).
    #[serde(default)]
    pub headers: Vec<String>,
    /// Deadline of one call, ms; past it the request uses the fallback.
    #[serde(default = "default_plugin_timeout_ms")]
    pub timeout_ms: u64,
    /// Memory cap of one instance, MiB.
    #[serde(default = "default_plugin_memory_mib")]
    pub memory_mib: u64,
}

fn default_plugin_timeout_ms() -> u64 {
    5
}

fn default_plugin_memory_mib() -> u64 {
    32
}
