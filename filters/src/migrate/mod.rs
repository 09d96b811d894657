//! Moving a running stream to another worker by continuation: the pure decisions
//! and transformations, without HTTP.
//!
//! - [`pin`]: whether a request may move at all, and if not, why (counted and documented);
//! - [`continuation`]: the `/v1/completions` request that continues a stream on another worker
//!   from its prompt ids and the ids generated so far;
//! - [`stream`]: what a moving stream remembers, and the destination's events re-wrapped in
//!   the client's shape;
//! - [`events`]: whole server-sent events out of body chunks, and token id fields stripped;
//! - [`anthropic`]: a chat stream turned into the Anthropic Messages stream vLLM makes of it,
//!   for a Messages stream the gateway sends its worker as chat so that it can move;
//! - [`responses`]: the same for an OpenAI Responses stream (the chat request that renders and
//!   samples as the Responses request, and vLLM's Responses events from the chat stream);
//! - [`reply`]: either converter behind one face, for the relay.
//!
//! The request path (`proxy/src/request/track.rs`, `proxy/src/request/migrate.rs`) drives them.

pub mod anthropic;
pub mod continuation;
pub mod events;
pub mod pin;
pub mod reply;
pub mod responses;
pub mod stream;

pub use continuation::{Continuation, ContinuationError};
pub use pin::{PinReason, messages_pin_reason, pin_reason};
pub use stream::{ClientShape, Observed, StreamRecord};
