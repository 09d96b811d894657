//! kvgate: a Pingora gateway in front of plain vLLM servers. docs/architecture.md draws the
//! whole; the modules:
//!
//! - [`config`]: the YAML configuration, validation, environment overrides;
//! - [`cluster`]: replicas of one deployment acting as one router over NATS;
//! - [`gateway`]: shared state (config and fleet swapped on reload, metrics, in-flight
//!   registry, plugins, drain switch);
//! - [`fleet`]: models and workers as routing sees them, and each model's booking ledger;
//! - [`request`]: the life of an inference request as phases (admit, queue, place, leg, relay,
//!   record) over one per-request state;
//! - [`inflight`]: the registry of requests in flight, with their route receipts;
//! - [`move_order`]: orders to move a request to another worker, and their answers;
//! - [`upstream`]: HTTP exchanges with workers over the keep-alive pools;
//! - [`h1`]: HTTP/1.1 wire pieces both sides share (framing, chunked coding, read buffers);
//! - [`idle_timer`]: one re-armed timer for a repeated idle limit;
//! - [`error`]: typed leg errors and the gateway's error answers;
//! - [`kv_routing`]: per-model KV routing state (tokenizer, index, cost);
//! - [`receipt`]: route receipts, why each request went where it went;
//! - [`downstream`]: the client side (its HTTP/1.1 connection, bodies, answers, disconnects,
//!   client-facing errors);
//! - [`sse`]: reading a worker's Server-Sent Events stream;
//! - [`http`]: the Pingora services (public API, admin);
//! - [`tls`]: TLS on the listeners, certificates replaced without a restart;
//! - [`tasks`]: background work under one supervisor;
//! - [`planner`]: Dynamo's planner design acting on a model's fleet (pull, decide, scale up, drain
//!   and stop);
//! - [`connector`]: how the planner starts and stops workers (`local` processes);
//! - [`plugins`]: loaded WebAssembly routing policies;
//! - [`server`]: starting and stopping (drain on SIGTERM);
//! - [`traces`]: OpenTelemetry spans of each request, exported over OTLP;
//! - `demo` (feature `demo`): `kvgate demo` on in-process simulated workers;
//! - `fuzzing` (feature `fuzzing`): entry points for the fuzz targets in `fuzz/`.

pub mod cluster;
pub mod config;
pub(crate) mod connector;
#[cfg(feature = "demo")]
pub mod demo;
pub(crate) mod downstream;
pub mod endpoint;
pub(crate) mod error;
pub(crate) mod fleet;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod gateway;
pub(crate) mod h1;
pub mod http;
pub(crate) mod idle_timer;
pub(crate) mod ids;
pub(crate) mod inflight;
pub(crate) mod kv_routing;
pub(crate) mod metrics;
pub(crate) mod move_order;
pub(crate) mod or_never;
pub(crate) mod planner;
pub mod plugins;
pub(crate) mod receipt;
pub(crate) mod request;
pub mod server;
pub mod sse;
pub(crate) mod status;
pub(crate) mod tasks;
pub(crate) mod tenants;
pub mod tls;
pub(crate) mod traces;
pub(crate) mod upstream;

pub use gateway::Gateway;
pub use server::{GatewayHandle, Stop};
