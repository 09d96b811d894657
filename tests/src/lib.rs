//! Harness for the end-to-end suites: a [`Target`] (an in-process vllm-sim, or an external
//! vLLM-compatible server named by environment variables), an SSE reader, a KV-event
//! subscriber, and a Prometheus text parser. Tests written against these run unchanged on the
//! simulator and on real vLLM.

pub mod cluster;
pub mod events;
pub mod fake_kube;
pub mod guests;
pub mod logs;
pub mod nats;
pub mod otlp;
pub mod ports;
pub mod prom;
pub mod sse;
pub mod target;

pub use target::Target;
