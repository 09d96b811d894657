//! The HTTP API, shaped like vLLM's OpenAI-compatible server: routes, shared state, and
//! helpers used by more than one endpoint. One file per endpoint family.

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
pub mod sleep;

use crate::config::SimConfig;
use crate::engine::EngineHandle;
use crate::faults::Faults;
use crate::lora::LoraRequest;
use crate::metrics::CacheInfo;
use crate::tokenizer::ModelTokenizer;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use error::ApiError;
use kvgate_tokenize::dialect::{DialectError, messages::MessagesOptions};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

/// Texts longer than this are tokenized on the blocking pool.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;
/// vLLM (uvicorn) sets no body limit; this one only protects the simulator's memory.
const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

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

    /// The `kv_transfer_params` of a unary response, as vLLM answers: a held prefill leg's
    /// reply ([`crate::kv_connector::prefill_reply`]), else null (aggregated requests, decode
    /// legs, a prefill leg that was not held, any request to a server without a connector).
    pub async fn kv_transfer_reply(&self, hold: Option<generate::PendingHold>) -> Value {
        let Some(h) = hold else { return Value::Null };
        match h.rx.await {
            Ok(r) => crate::kv_connector::prefill_reply(&self.cfg.kv_transfer, &h.request_id, self.listen, &r.kv, r.expiry_unix),
            Err(_) => Value::Null,
        }
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

/// All routes: vLLM's, with `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` only where
/// runtime LoRA updating is allowed and the development endpoints only in dev mode, as in vLLM;
/// and the sim's KV side channel on a KV producer.
pub fn router(state: Arc<AppState>) -> Router {
    let mut r = Router::new();
    if state.cfg.runtime_lora_updating {
        r = r.route("/v1/load_lora_adapter", post(lora::load)).route("/v1/unload_lora_adapter", post(lora::unload));
    }
    if state.cfg.kv_transfer.is_producer() {
        r = r.route(crate::kv_connector::PULL_PATH, post(kv_transfer::pull));
    }
    if state.cfg.dev_mode {
        r = r
            .route("/pause", post(control::pause))
            .route("/resume", post(control::resume))
            .route("/is_paused", get(control::is_paused))
            .route("/sleep", post(control::sleep))
            .route("/wake_up", post(control::wake_up))
            .route("/is_sleeping", get(control::is_sleeping))
            .route("/reset_prefix_cache", post(control::reset_prefix_cache))
            .route("/reset_mm_cache", post(control::reset_other_cache))
            .route("/reset_encoder_cache", post(control::reset_other_cache));
    }
    r.route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/models", get(misc::models))
        .route("/health", get(misc::health))
        .route("/ping", get(misc::health).post(misc::health))
        .route("/version", get(misc::version))
        .route("/load", get(misc::load))
        .route("/metrics", get(misc::metrics))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/kv_event_sources", get(misc::kv_event_sources))
        .route("/sim/faults", get(misc::get_faults).post(misc::set_faults))
        .fallback(misc::not_found)
        .method_not_allowed_fallback(misc::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}
