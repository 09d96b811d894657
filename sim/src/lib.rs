//! `vllm-sim`: a server that a client, a router or a load balancer cannot tell apart from
//! `vllm serve` except by its speed knobs.
//!
//! It serves vLLM's OpenAI-compatible API (completions and chat, unary and SSE), runs an engine
//! shaped like vLLM v1 (continuous batching, token budget, chunked prefill, a paged KV cache with
//! prefix caching and preemption; `cache_salt` and LoRA adapters hashed into blocks as vLLM
//! hashes them), publishes KV-cache events on ZeroMQ byte-identical to vLLM's, and exposes
//! vLLM's `vllm:*` Prometheus metrics. LoRA adapters ([`lora`]) are served as vLLM serves them
//! (`--lora-modules`, `/v1/models`, runtime load and unload), and so are its development
//! endpoints in dev mode (`/pause`, `/resume`, `/sleep`, `/wake_up`, `/reset_prefix_cache`, …). Step times come from a [`timing`] model of a
//! mid-size model on one GPU, scaled by `time_scale` for tests.
//!
//! Use it as a binary (`vllm-sim --help`) or in-process with [`SimServer::start`].

pub mod api;
pub mod block_hash;
pub mod config;
pub mod engine;
pub mod events;
pub mod faults;
pub mod ids;
pub mod kv_cache;
pub mod kv_connector;
pub mod lora;
pub mod metrics;
pub mod publisher;
pub mod sampler;
pub mod scheduler;
pub mod server;
pub mod timing;

pub use config::{KvEventsConfig, SimArgs, SimConfig};
pub use server::{SimError, SimServer};

/// Tokenization lives in the shared `kvgate-tokenize` crate.
pub use kvgate_tokenize::{chat_template, dialect, tokenizer};
