//! OpenTelemetry traces of requests (`tracing:` in the config, docs/operations.md): one span
//! per request, continuing the client's `traceparent`, with a child per phase (admission, the
//! router queue, each placement with its receipt's summary, each leg to a worker, each move,
//! a disaggregated request's prefill leg). Each leg's `traceparent` names the leg's span, so
//! a vLLM started with `--otlp-traces-endpoint` puts its own spans under it.
//!
//! - [`export`]: the exporter in force (built and replaced as the config says) and the
//!   OTLP/HTTP client it posts with, off the request path;
//! - [`request`]: one request's spans while it runs.
//!
//! Off (no `otlp_endpoint`), a request costs one atomic load and carries no trace (a `None`
//! where its state would hold one).

pub mod export;
pub mod request;

pub use export::Exporter;
pub use request::RequestTrace;
