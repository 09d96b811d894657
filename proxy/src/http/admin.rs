//! The admin listener: `/metrics`, `/health`, `GET /workers` (each worker's health and load),
//! `POST /reload` (re-read the config file; a bad file is refused and the old config stays).

use super::errors::ClientError;
use super::io::{respond_error, respond_json};
use super::local;
use crate::gateway::Gateway;
use pingora::proxy::Session;
use serde_json::json;
use std::sync::Arc;

/// Dispatches an admin request.
pub async fn serve(gw: &Arc<Gateway>, session: &mut Session, method: &str, path: &str) {
    match (method, path) {
        ("GET", "/metrics") => local::metrics(gw, session).await,
        ("GET", "/health") => local::health(gw, session).await,
        ("GET", "/workers") => workers(gw, session).await,
        ("POST", "/reload") => reload(gw, session).await,
        (_, "/metrics" | "/health" | "/workers" | "/reload") => {
            respond_error(session, &ClientError::method_not_allowed(method, path), &[]).await
        }
        _ => respond_error(session, &ClientError::not_found(path), &[]).await,
    }
}

async fn workers(gw: &Arc<Gateway>, session: &mut Session) {
    let fleet = gw.fleet();
    let models: Vec<_> = fleet
        .order
        .iter()
        .map(|name| {
            let m = &fleet.models[name];
            let workers: Vec<_> = m
                .workers
                .iter()
                .enumerate()
                .map(|(i, w)| json!({"id": i, "url": w.url.to_string(), "healthy": w.is_healthy(), "in_flight": w.in_flight()}))
                .collect();
            json!({"model": name, "routing": m.policy.name(), "workers": workers})
        })
        .collect();
    respond_json(session, 200, &json!({"draining": gw.is_draining(), "in_flight": gw.in_flight(), "models": models})).await;
}

async fn reload(gw: &Arc<Gateway>, session: &mut Session) {
    let _ = session.drain_request_body().await;
    match gw.reload() {
        Ok(()) => respond_json(session, 200, &json!({"status": "ok"})).await,
        Err(e) => {
            let ce = ClientError::bad_request(format!("configuration rejected, the previous one stays in force: {e}"), None);
            respond_error(session, &ce, &[]).await
        }
    }
}
