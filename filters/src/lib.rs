//! kvgate's request filters, one module per job:
//! - [`cancel`]: the per-request cancellation context tree (stop / kill, linked children);
//! - [`route`]: the worker-selection interface every routing mode implements, the baseline
//!   modes (`round_robin`, `random`), the KV cost (`kv`) and the router queue;
//! - [`ledger`]: the booking ledger, the load each worker carries from requests in flight,
//!   read by every routing mode and by shedding;
//! - [`migrate`]: which streams may move to another worker, the continuation request that
//!   moves them, and the re-wrapping of its events;
//! - [`plan`]: the planner's scaling decisions (Dynamo's planner) from the load it pulls;
//! - [`reschedule`]: the rescheduler's policies (Llumnix's), pair validation and request
//!   selection;
//! - [`tenant`]: what each tenant may use (rate limits, concurrency) and its fair share of
//!   the router queue;
//! - [`shed`]: busy detection (Dynamo's load shedding) and the 503 body sent when every worker
//!   is busy.
//!
//! Nothing here knows about HTTP or Pingora; the proxy crate calls these filters.

pub mod cancel;
pub mod ledger;
pub mod migrate;
pub mod plan;
pub mod reschedule;
pub mod route;
pub mod shed;
pub mod tenant;
