//! The paths the simulator serves and the endpoint behind each.

use super::{AppState, chat, completions, control, kv_transfer, lora, messages, misc, responses};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use std::sync::Arc;

/// vLLM (uvicorn) sets no body limit; this one only protects the simulator's memory.
const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

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
