//! HTTP/1.1 wire pieces both sides of the gateway share: body framing and chunked coding, read
//! as they arrive.
//! The client side's connection is `downstream::conn`, the workers' responses
//! `upstream::response`; both parse heads with `httparse` and build no header maps.

pub mod body;
pub mod chunked;
