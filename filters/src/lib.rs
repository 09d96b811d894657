//! kvgate's request filters, one module per job:
//! - [`cancel`]: the per-request cancellation context tree (stop / kill, linked children);
//! - [`route`]: the worker-selection interface every routing mode implements, and the baseline
//!   modes (`round_robin`, `random`), the KV cost (`kv`) and active-sequence bookings;
//! - [`shed`]: busy detection (seed 000) and the 503 body sent when every worker is busy.
//!
//! Nothing here knows about HTTP or Pingora; the proxy crate calls these filters.

pub mod cancel;
pub mod route;
pub mod shed;
