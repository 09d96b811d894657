//! Answers the gateway gives itself: the model list, its health, its metrics.

use crate::downstream::conn::ClientConn;
use crate::downstream::io::{respond, respond_json};
use crate::gateway::Gateway;
use bytes::Bytes;
use serde_json::json;
use std::sync::Arc;

/// `GET /v1/models`: the configured models.
pub async fn models(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let fleet = gw.fleet();
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let data: Vec<_> = fleet.order.iter().map(|m| json!({"id": m, "object": "model", "created": created, "owned_by": "kvgate"})).collect();
    respond_json(session, 200, &json!({"object": "list", "data": data})).await;
}

/// `GET /health`: 200 while some worker of every model is healthy, else 503 (load balancers
/// should stop sending); 503 while draining.
pub async fn health(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let fleet = gw.fleet();
    let mut unavailable = Vec::new();
    for name in &fleet.order {
        if !fleet.models[name].workers.iter().any(|w| w.is_healthy()) {
            unavailable.push(name.clone());
        }
    }
    let (status, state) = if gw.is_draining() {
        (503, "draining")
    } else if unavailable.is_empty() {
        (200, "ok")
    } else {
        (503, "degraded")
    };
    respond_json(session, status, &json!({"status": state, "models_without_healthy_workers": unavailable})).await;
}

/// `GET /metrics`.
pub async fn metrics(gw: &Arc<Gateway>, session: &mut ClientConn) {
    respond(session, 200, "text/plain; version=0.0.4; charset=utf-8", Bytes::from(gw.metrics.render()), &[]).await;
}
