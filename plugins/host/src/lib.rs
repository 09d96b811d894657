//! kvgate's WebAssembly policy host: operators' routing and rescheduling policies run as
//! sandboxed components (plugins/wit/policy.wit), compiled off the request path, bounded per
//! call, and hot-swapped.
//!
//! - [`sandbox`]: the one wasmtime engine, its epoch ticker and the per-store limits.
//! - [`component`]: reading, pinning, compiling and vetting a `.wasm` (no imports allowed).
//! - [`routing`]: a loaded routing policy and its calls; [`rescheduling`] the same for
//!   rescheduling policies.
//! - [`slot`]: the hot-swappable cell a model routes through, and the fallback on failure.
//! - [`failure`]: why a call did not produce a usable answer.

pub mod component;
pub mod failure;
pub mod rescheduling;
pub mod routing;
pub mod sandbox;
pub mod slot;

mod bindings;

pub use component::{Kind, PluginSpec};
pub use failure::{Failure, LoadError};
pub use rescheduling::{ClusterView, Migration, ReschedulingPlugin, Running, SelectOrder, SelectRule, WorkerLoad};
pub use routing::{RouteRequest, RoutingPlugin};
pub use slot::{PluginSlot, ReloadOutcome, Routed, route};
