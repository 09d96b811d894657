//! Request cancellation, as Dynamo's `AsyncEngineContext`: every request gets a
//! [`RequestContext`] with an id; a client disconnect stops it (`stop_generating`) or kills it
//! (`kill`); linked child contexts (upstream legs, sub-requests) receive the same call, in the
//! order they were linked; anyone can check the state or wait for it.

mod context;

pub use context::{CancelState, RequestContext};
