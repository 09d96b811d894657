//! The LoRA adapters a server has loaded, and what a load asks for (the endpoints and the
//! checks: `lora.rs`).

use crate::lora::LoraRequest;
use parking_lot::Mutex;
use std::sync::Arc;

/// The adapters loaded, in load order (a reload in place keeps its place and id).
#[derive(Debug, Default)]
pub struct Loras {
    pub(super) inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
pub(super) struct Inner {
    pub(super) adapters: Vec<Arc<LoraRequest>>,
    /// The last id handed out (vLLM's `lora_id_counter`).
    pub(super) last_id: u32,
}

impl Loras {
    /// The adapter called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<LoraRequest>> {
        self.inner.lock().adapters.iter().find(|a| a.name == name).cloned()
    }

    /// Every adapter, in load order.
    pub fn all(&self) -> Vec<Arc<LoraRequest>> {
        self.inner.lock().adapters.clone()
    }
}

/// What a load asks for (vLLM's `LoadLoRAAdapterRequest`).
#[derive(Debug, Clone, Default)]
pub struct LoadRequest {
    /// Adapter name.
    pub lora_name: String,
    /// Adapter path.
    pub lora_path: String,
    /// Replace an adapter of that name (keeping its id).
    pub load_inplace: bool,
}
