//! Answers the gateway gives itself: the model list, its health, its metrics.

use crate::downstream::conn::ClientConn;
use crate::downstream::io::{respond, respond_json};
use crate::fleet::Fleet;
use crate::gateway::Gateway;
use bytes::Bytes;
use serde_json::{Value, json};
use std::sync::Arc;

/// `GET /v1/models`: what the workers' own `/v1/models` say, merged ([`merged_cards`]).
pub async fn models(gw: &Arc<Gateway>, session: &mut ClientConn) {
    respond_json(session, 200, &json!({"object": "list", "data": merged_cards(&gw.fleet())})).await;
}

/// Each configured model's card and its LoRA adapters' cards, as the workers wrote them
/// (`root`, `max_model_len`, `parent`, permissions), in config order: a card's first healthy
/// worker speaks for it. A model no healthy worker described yet gets a minimal card of the
/// gateway's, so every model a client may name is listed.
pub fn merged_cards(fleet: &Fleet) -> Vec<Value> {
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut out: Vec<Value> = Vec::new();
    let listed = |out: &[Value], id: &str| out.iter().any(|c| c.get("id").and_then(Value::as_str) == Some(id));
    for name in &fleet.order {
        let cards: Vec<_> = fleet.models[name].workers.iter().filter(|w| w.is_healthy()).filter_map(|w| w.cards()).collect();
        match cards.iter().find_map(|c| c.card(name)) {
            Some(card) if !listed(&out, name) => out.push(card.clone()),
            None if !listed(&out, name) => out.push(json!({"id": name, "object": "model", "created": created, "owned_by": "kvgate"})),
            Some(_) | None => {}
        }
        for c in &cards {
            for id in &c.adapters {
                if !listed(&out, id)
                    && let Some(card) = c.card(id)
                {
                    out.push(card.clone());
                }
            }
        }
    }
    out
}

/// `GET /health`: 200 while some worker of every model is healthy, else 503 (load balancers
/// should stop sending); 503 while draining. The body names this gateway's instance.
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
    respond_json(session, status, &json!({"status": state, "instance": gw.instance(), "models_without_healthy_workers": unavailable})).await;
}

/// `GET /metrics`.
pub async fn metrics(gw: &Arc<Gateway>, session: &mut ClientConn) {
    respond(session, 200, "text/plain; version=0.0.4; charset=utf-8", Bytes::from(gw.metrics.render()), &[]).await;
}
