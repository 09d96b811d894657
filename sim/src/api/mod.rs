//! The HTTP API, shaped like vLLM's OpenAI-compatible server: the state every endpoint shares
//! and helpers used by more than one. One file per endpoint family; [`routes`] maps paths to
//! them.

pub mod adapters;
pub mod chat;
pub mod completions;
pub mod control;
pub mod error;
pub mod generate;
pub mod kv_transfer;
pub mod lora;
pub mod messages;
pub mod misc;
pub mod protocol;
pub mod response;
pub mod response_store;
pub mod responses;
pub mod routes;
pub mod sleep;

use crate::config::SimConfig;
use crate::engine::EngineHandle;
use crate::faults::Faults;
use crate::lora::LoraRequest;
use crate::metrics::CacheInfo;
use crate::tokenizer::ModelTokenizer;
use error::ApiError;
use kvgate_tokenize::dialect::{DialectError, messages::MessagesOptions};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

/// Texts longer than this are tokenized on the blocking pool.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

/// State shared by all handlers.
pub struct AppState {
    /// The configuration the server runs with.
    pub cfg: SimConfig,
    /// The tokenizer.
    pub tokenizer: ModelTokenizer,
    /// One handle per DP rank.
    pub engines: Vec<Arc<EngineHandle>>,
    /// Failure injection.
    pub faults: Arc<Faults>,
    /// Unix seconds at start (for `/v1/models`).
    pub created: u64,
    /// Facts for `vllm:cache_config_info`.
    pub cache_info: CacheInfo,
    /// The bound HTTP address.
    pub listen: SocketAddr,
    /// What vLLM probes from the chat template for `/v1/messages`, on first use.
    pub messages_options: OnceLock<MessagesOptions>,
    /// Responses API responses kept for `previous_response_id`, GET and cancel.
    pub response_store: response_store::ResponseStore,
    /// LoRA adapters loaded.
    pub loras: adapters::Loras,
    /// What `/sleep` put to sleep.
    pub sleep: sleep::Sleep,
}

impl AppState {
    /// 404 unless `model` is absent (or empty), one of the served names or a loaded adapter.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        self.resolve_model(model).map(|_| ())
    }

    /// The adapter a request's `model` names (`None`: the base model), or vLLM's 404 listing
    /// the base model's names.
    pub fn resolve_model(&self, model: Option<&str>) -> Result<Option<Arc<LoraRequest>>, ApiError> {
        let Some(m) = model.filter(|m| !m.is_empty()) else { return Ok(None) };
        let names = self.served_names();
        if names.iter().any(|n| n == m) {
            return Ok(None);
        }
        self.loras.get(m).map(Some).ok_or_else(|| ApiError::model_not_found(m, &names))
    }

    /// The `model` a response reports: the adapter's name for a LoRA request, as vLLM's.
    pub fn reported_model<'a>(&'a self, lora: Option<&'a LoraRequest>) -> &'a str {
        lora.map_or_else(|| self.cfg.model_name(), |l| l.name.as_str())
    }

    /// Names accepted in `model`.
    pub fn served_names(&self) -> Vec<String> {
        if self.cfg.served_model_names.is_empty() { vec![self.cfg.model.clone()] } else { self.cfg.served_model_names.clone() }
    }

    /// A request the Messages or Responses conversion refuses, as vLLM answers it: media on
    /// this text-only model get vLLM's "not a multimodal model", the rest a 400.
    pub fn dialect_error(&self, e: &DialectError) -> ApiError {
        if e.is_unsupported() && matches!(e.reason(), "image" | "audio" | "video" | "prompt_embeds" | "file") {
            return ApiError::bad_request(format!("{} is not a multimodal model", self.cfg.model_name()), None);
        }
        ApiError::bad_request(e.message(), None)
    }
}

/// Tokenizes `text`, off the async threads when it is long.
pub async fn encode(tok: &ModelTokenizer, text: String, add_special: bool) -> Result<Vec<u32>, ApiError> {
    let r = if text.len() <= INLINE_TOKENIZE_BYTES {
        tok.encode(&text, add_special)
    } else {
        let tok = tok.clone();
        tokio::task::spawn_blocking(move || tok.encode(&text, add_special)).await.map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
    };
    r.map_err(|m| ApiError::bad_request(m, Some("prompt")))
}

/// Renders a chat request from the Messages or Responses conversion as vLLM renders it and
/// tokenizes it without special tokens (vLLM's chat default).
pub async fn render_dialect_chat(st: &AppState, chat: &Value) -> Result<Vec<u32>, ApiError> {
    let text = kvgate_tokenize::dialect::render_chat(&st.tokenizer, chat).map_err(|e| st.dialect_error(&e))?;
    encode(&st.tokenizer, text, false).await
}

pub use routes::router;
