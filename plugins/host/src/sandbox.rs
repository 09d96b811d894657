//! The sandbox every plugin runs in: one process-wide wasmtime [`Engine`] with epoch
//! interruption, a ticker thread that advances the epoch every [`TICK`], and per-store limits
//! (memory, tables, instances). A store is used by one call at a time and dropped after any
//! failure, because a trapped instance's state is undefined.

use crate::failure::Failure;
use std::sync::OnceLock;
use std::time::Duration;
use wasmtime::{Config, Engine, ResourceLimiter, Store};

/// Epoch period: the granularity of call deadlines.
pub const TICK: Duration = Duration::from_millis(1);

/// The shared engine (compiled code is tied to it); starts the ticker on first use.
pub fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let mut cfg = Config::new();
        cfg.epoch_interruption(true);
        cfg.wasm_component_model(true);
        // Small guest memories: reserve what the cap allows rather than 4 GiB per instance.
        cfg.memory_reservation(256 << 20);
        cfg.memory_guard_size(64 << 10);
        let engine = Engine::new(&cfg).expect("static wasmtime configuration is valid");
        let ticker = engine.clone();
        std::thread::Builder::new()
            .name("kvgate-wasm-epoch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(TICK);
                    ticker.increment_epoch();
                }
            })
            .expect("spawn the epoch ticker");
        engine
    })
}

/// The least deadline of the `init` a plugin runs when it is loaded, ms. Loading is off the
/// request path, and a deadline of a call's few milliseconds there fails a sound plugin (and
/// the gateway's start) whenever the host is busy for a moment.
pub const LOAD_INIT_MS: u64 = 1_000;

/// Per-call bounds of a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deadline of one call, ms; also of the `init` of an instance made on the request path
    /// (the one made at load gets at least [`LOAD_INIT_MS`]).
    pub timeout_ms: u64,
    /// Linear memory cap, MiB.
    pub memory_mib: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { timeout_ms: 5, memory_mib: 32 }
    }
}

impl Limits {
    /// The limits of the `init` run when the plugin is loaded.
    pub fn at_load(self) -> Self {
        Self { timeout_ms: self.timeout_ms.max(LOAD_INIT_MS), ..self }
    }
}

/// What a store carries: its limiter, which also remembers whether the cap was hit so a
/// resulting trap is reported as a memory failure.
pub struct HostState {
    max_memory: usize,
    /// Bytes of all linear memories of the store (the cap is for their sum).
    memory: usize,
    memory_denied: bool,
}

impl ResourceLimiter for HostState {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        let total = self.memory.saturating_add(desired.saturating_sub(current));
        let ok = total <= self.max_memory;
        if ok {
            self.memory = total;
        }
        self.memory_denied |= !ok;
        Ok(ok)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }

    fn instances(&self) -> usize {
        16
    }

    fn tables(&self) -> usize {
        16
    }

    fn memories(&self) -> usize {
        4
    }
}

/// A fresh store under `limits`.
pub fn store(limits: Limits) -> Store<HostState> {
    let mut store = Store::new(engine(), HostState { max_memory: (limits.memory_mib as usize) << 20, memory: 0, memory_denied: false });
    store.limiter(|s| s as &mut dyn ResourceLimiter);
    store.epoch_deadline_trap();
    store
}

/// Arms the deadline for the next call (and forgets an earlier refused growth, so a later
/// failure is not blamed on memory).
pub fn arm(store: &mut Store<HostState>, limits: Limits) {
    store.data_mut().memory_denied = false;
    // The deadline expires between timeout_ms and timeout_ms + 1 ticks from now.
    store.set_epoch_deadline(limits.timeout_ms.max(1) + 1);
}

/// Classifies an error a call returned.
pub fn classify(store: &Store<HostState>, limits: Limits, err: &wasmtime::Error) -> Failure {
    if let Some(trap) = err.downcast_ref::<wasmtime::Trap>()
        && *trap == wasmtime::Trap::Interrupt
    {
        return Failure::Timeout(limits.timeout_ms);
    }
    if store.data().memory_denied {
        return Failure::Memory(limits.memory_mib);
    }
    Failure::Trap(format!("{err:#}").lines().next().unwrap_or("unknown trap").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_at_load_gets_at_least_a_second_and_keeps_a_longer_deadline() {
        let l = Limits { timeout_ms: 5, memory_mib: 32 };
        assert_eq!(l.at_load(), Limits { timeout_ms: LOAD_INIT_MS, memory_mib: 32 });
        let slow = Limits { timeout_ms: 3_000, ..l };
        assert_eq!(slow.at_load(), slow);
    }
}
