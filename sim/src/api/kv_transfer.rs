//! `POST /kv_transfer/pull`: the sim's KV side channel, served by a KV producer. A decode
//! worker that has "read" a held prefill leg's blocks (waited their transfer time) names the
//! request and the blocks; the engine holding them frees them, as NIXL's completion
//! notification makes a vLLM prefill worker free them (`docs/vllm-sim-pd.md`).
//!
//! Answers `200 {"remote_request_id", "released_blocks"}`; `404` when nothing is held under
//! that id (unknown, already pulled, or the lease ended); `400` for a body that does not parse,
//! another engine's id, or blocks the request does not hold. Errors are in vLLM's shape.

use super::AppState;
use super::error::{ApiError, json_response};
use super::protocol::parse_body;
use crate::engine::ReleaseError;
use crate::kv_connector::PullRequest;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;
use std::sync::Arc;

/// Handler.
pub async fn pull(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(&st, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(st: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: PullRequest = parse_body(body)?;
    let engine_id = st.cfg.kv_transfer.engine_id();
    if req.remote_engine_id != engine_id {
        return Err(ApiError::bad_request(format!("remote_engine_id {:?} is not this engine ({engine_id:?})", req.remote_engine_id), Some("remote_engine_id")));
    }
    let blocks: Vec<_> = req.remote_block_ids.into_iter().flatten().collect();
    // The request is held by one of the DP ranks; the others answer NotHeld.
    for engine in &st.engines {
        match engine.release_held(req.remote_request_id.clone(), blocks.clone()).await {
            Ok(n) => return Ok(json_response(StatusCode::OK, &json!({"remote_request_id": req.remote_request_id, "released_blocks": n}))),
            Err(ReleaseError::NotHeld) => continue,
            Err(ReleaseError::NotItsBlocks(b)) => {
                return Err(ApiError::bad_request(format!("request {} does not hold blocks {b:?}", req.remote_request_id), Some("remote_block_ids")));
            }
            Err(ReleaseError::Stopped) => return Err(ApiError::internal("engine stopped")),
        }
    }
    Err(ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no KV blocks are held for request {} (unknown, already pulled, or its lease expired)", req.remote_request_id),
        kind: "NotFoundError",
        param: Some("remote_request_id".into()),
    })
}
