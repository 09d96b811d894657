//! Host bindings generated from plugins/wit/policy.wit, one module per world.

/// The `router` world.
pub mod router {
    wasmtime::component::bindgen!({ path: "../wit", world: "router" });
}

/// The `rescheduler` world.
pub mod rescheduler {
    wasmtime::component::bindgen!({ path: "../wit", world: "rescheduler" });
}
