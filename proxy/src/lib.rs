//! kvgate: a Pingora gateway in front of plain vLLM servers.
//!
//! - [`config`]: the YAML configuration, validation, environment overrides;
//! - [`gateway`]: shared state (config and fleet swapped on reload, connector, metrics);
//! - [`fleet`]: models and workers as routing sees them;
//! - [`http`]: the Pingora services (public API, admin) and the upstream leg;
//! - [`health`], [`reload`]: background tasks;
//! - [`server`]: starting and stopping (drain on SIGTERM).

pub mod config;
pub mod demo;
pub mod fleet;
pub mod gateway;
pub mod health;
pub mod http;
pub mod kv_routing;
pub mod load;
pub mod metrics;
pub mod plugins;
pub mod reload;
pub mod server;

pub use gateway::Gateway;
pub use server::{GatewayHandle, Stop};
