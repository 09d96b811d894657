//! The small endpoints: models, health, version, load, metrics, tokenize/detokenize, KV event
//! discovery, and the simulator's own `/sim/faults`.

use super::AppState;
use super::chat::render_prompt;
use super::encode;
use super::error::{ApiError, json_response};
use super::protocol::{check_token_ids, parse_body};
use crate::faults::FaultConfig;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

/// `GET /v1/models`: the base model's cards (one per served name), then the adapters'.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    super::lora::models_response(&st)
}

/// `GET /health`: 200 with an empty body.
pub async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /version`.
pub async fn version() -> Response {
    json_response(StatusCode::OK, &json!({"version": concat!(env!("CARGO_PKG_VERSION"), "+vllm-sim")}))
}

/// `GET /load`: in-flight requests.
pub async fn load(State(st): State<Arc<AppState>>) -> Response {
    let n: i64 = st.engines.iter().map(|e| e.in_flight()).sum();
    json_response(StatusCode::OK, &json!({"server_load": n}))
}

/// `GET /metrics`.
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let engines: Vec<&crate::metrics::EngineMetrics> = st.engines.iter().map(|e| e.metrics.as_ref()).collect();
    let text = crate::metrics::render(st.cfg.model_name(), &engines, &st.cache_info);
    let mut r = (StatusCode::OK, text).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    return_token_strs: bool,
    tools: Option<Value>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `POST /tokenize` (completion form with `prompt`, chat form with `messages`).
pub async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = async {
        let req: TokenizeRequest = parse_body(&body)?;
        st.check_model(req.model.as_deref())?;
        let tokens = match (req.prompt, req.messages) {
            (Some(p), None) => encode(&st.tokenizer, p, req.add_special_tokens.unwrap_or(true)).await?,
            (None, Some(m)) => {
                let text = render_prompt(
                    &st.tokenizer,
                    &m,
                    req.add_generation_prompt,
                    req.continue_final_message,
                    req.tools.as_ref(),
                    req.chat_template_kwargs.as_ref(),
                )?;
                encode(&st.tokenizer, text, req.add_special_tokens.unwrap_or(false)).await?
            }
            _ => return Err(ApiError::validation("exactly one of `prompt` or `messages` is required", "body")),
        };
        let strs: Option<Vec<String>> = req.return_token_strs.then(|| tokens.iter().map(|&t| st.tokenizer.decode(&[t]).unwrap_or_default()).collect());
        Ok(json!({"count": tokens.len(), "max_model_len": st.cfg.max_model_len, "tokens": tokens, "token_strs": strs}))
    };
    match run.await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

/// `POST /detokenize`.
pub async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Value, ApiError> {
        let req: DetokenizeRequest = parse_body(&body)?;
        st.check_model(req.model.as_deref())?;
        let ids = check_token_ids(&req.tokens, st.tokenizer.vocab_size())?;
        let text = st.tokenizer.decode(&ids).map_err(|m| ApiError::bad_request(m, Some("tokens")))?;
        Ok(json!({"prompt": text}))
    };
    match run() {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

/// `GET /kv_event_sources`: per DP rank, the resolved event endpoints.
pub async fn kv_event_sources(State(st): State<Arc<AppState>>) -> Response {
    let kv = &st.cfg.kv_events;
    let mut map = serde_json::Map::new();
    for e in &st.engines {
        let (endpoint, replay) = match &e.publisher {
            Some(p) => (Value::from(p.endpoint.clone()), p.replay_endpoint.clone().map(Value::from).unwrap_or(Value::Null)),
            None => (Value::from(kv.endpoint.clone()), Value::Null),
        };
        map.insert(
            e.rank().to_string(),
            json!({"enable_kv_cache_events": kv.enable_kv_cache_events, "publisher": if kv.publishes() { "zmq" } else { "null" },
                   "endpoint": endpoint, "replay_endpoint": replay, "buffer_steps": kv.buffer_steps, "hwm": kv.hwm,
                   "max_queue_size": kv.max_queue_size, "topic": kv.topic}),
        );
    }
    json_response(StatusCode::OK, &Value::Object(map))
}

/// `GET /sim/faults`.
pub async fn get_faults(State(st): State<Arc<AppState>>) -> Response {
    json_response(StatusCode::OK, &serde_json::to_value(st.faults.get()).unwrap_or(Value::Null))
}

/// `POST /sim/faults`: replaces the failure-injection knobs.
pub async fn set_faults(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = parse_body::<FaultConfig>(&body).and_then(|c| st.faults.set(c).map_err(|m| ApiError::bad_request(m, None)));
    match r {
        Ok(()) => json_response(StatusCode::OK, &serde_json::to_value(st.faults.get()).unwrap_or(Value::Null)),
        Err(e) => e.into_response(),
    }
}

/// Unknown path: FastAPI's body.
pub async fn not_found() -> Response {
    json_response(StatusCode::NOT_FOUND, &json!({"detail": "Not Found"}))
}

/// Known path, wrong method.
pub async fn method_not_allowed() -> Response {
    json_response(StatusCode::METHOD_NOT_ALLOWED, &json!({"detail": "Method Not Allowed"}))
}
