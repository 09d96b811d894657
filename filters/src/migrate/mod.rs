//! Moving a running stream to another worker by continuation (issue #13): the pure decisions
//! and transformations, without HTTP.
//!
//! - [`pin`]: whether a request may move at all, and if not, why (counted and documented);
//! - [`continuation`]: the `/v1/completions` request that continues a stream on another worker
//!   from its prompt ids and the ids generated so far;
//! - [`stream`]: what a moving stream remembers, and the destination's events re-wrapped in
//!   the client's shape;
//! - [`events`]: whole server-sent events out of body chunks, and token id fields stripped.
//!
//! The request path (`proxy/src/request/track.rs`, `proxy/src/request/migrate.rs`) drives them.

pub mod continuation;
pub mod events;
pub mod pin;
pub mod stream;

pub use continuation::{Continuation, ContinuationError};
pub use pin::{PinReason, pin_reason};
pub use stream::{ClientShape, Observed, StreamRecord};
