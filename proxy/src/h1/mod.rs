//! HTTP/1.1 wire pieces both sides of the gateway share: chunked coding, read as it arrives.
//! The client side's connection is `downstream::conn`, the workers' responses
//! `upstream::response`; both parse heads with `httparse` and build no header maps.

pub mod chunked;
