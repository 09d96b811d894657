//! Moving a running stream to another worker by continuation (issue #13, groundwork): the
//! pure decisions, without HTTP.
//!
//! - [`pin`]: whether a request may move at all, and if not, why (counted and documented);
//! - [`continuation`]: the `/v1/completions` request that continues a stream on another worker
//!   from its prompt ids and the ids generated so far;
//! - [`stream`]: what a moving stream remembers, and the destination's chunks re-wrapped in the
//!   client's shape.
//!
//! The request path (`proxy/src/request/`) does not call these yet.

pub mod continuation;
pub mod pin;
pub mod stream;

pub use continuation::{Continuation, ContinuationError};
pub use pin::{PinReason, pin_reason};
pub use stream::{ClientShape, StreamRecord};
