//! Tenants of a shared fleet, without HTTP: what each may use ([`Limits`], enforced by the
//! [`Account`]'s token buckets and concurrency count) and what each has been served (its
//! [`FairShare`], the Virtual Token Counter the router queue orders tenants by).
//!
//! Who a request belongs to (API keys) and how a refusal is answered are the gateway's; this
//! module decides only whether a request fits and when it would.

mod account;
mod bucket;
mod fair;

pub use account::{Account, Admitted, Dimension, Exceeded, Limits, Snapshot};
pub use bucket::{Bucket, Level};
pub use fair::FairShare;
