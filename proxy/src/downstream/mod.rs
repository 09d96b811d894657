//! The client side of a request ("downstream"), shared by the request phases and the local and
//! admin answers: accepting plain connections, the client's HTTP/1.1 connection, reading a body
//! with a cap and a deadline, writing complete answers, watching for a client that left, the
//! client-facing errors, and the per-client concurrency limit.

// Parses bytes from outside: a narrowing cast here could truncate a peer's value.
#![deny(clippy::cast_possible_truncation)]

pub mod accept;
pub mod client_limit;
pub mod closed;
pub mod conn;
pub mod errors;
pub mod io;
pub mod rate_limit;
