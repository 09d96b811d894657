//! Tokenization as vLLM does it, shared by the gateway (KV routing needs the prompt's token
//! ids) and the simulator (which must tokenize like a real server):
//! - [`tokenizer`]: a HF `tokenizer.json` with special tokens and the chat template from
//!   `tokenizer_config.json`, or the small tokenizer shipped in `assets/`;
//! - [`chat_template`]: rendering OpenAI messages with the model's Jinja template;
//! - [`segmented`]: a cache that tokenizes only what a request does not share with earlier ones;
//! - [`dialect`]: Anthropic Messages and OpenAI Responses requests as the chat request vLLM
//!   builds from them, and chat rendering with vLLM's message handling.

pub mod chat_template;
pub mod dialect;
pub mod segmented;
pub mod tokenizer;

pub use chat_template::{ChatInput, ChatTemplate, normalize_messages};
pub use segmented::SegmentCache;
pub use tokenizer::{ModelTokenizer, TokenizerError};
