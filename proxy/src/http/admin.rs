//! The admin listener: `/metrics`, `/health`, `GET /workers` (each worker's health and load),
//! `GET /requests` (the requests in flight) and `GET /requests/{id}` (one request, in flight or
//! recently finished, with its route receipt), `POST /migrate` (move a request to another
//! worker; `super::migrate`), `GET /rescheduling` (the rescheduler's last cycle), `GET /planner`
//! (each planner's mode, workers wanted, last decision and the workers it started),
//! `GET /cluster` (this replica, its peers and the leader; docs/replicas.md), `GET
//! /responses/{id}` (the worker that stored a Responses-API response), `GET /tenants` (each
//! tenant's limits, what is left of them and what it used; docs/tenants.md),
//! `POST /reload` (re-read the config file; a bad file is refused and the old config stays),
//! `GET /busy_threshold` and `POST /busy_threshold` (Dynamo's shapes: read or set a model's
//! busy thresholds at run time), `GET /plugins` and `POST /plugins/reload` (re-read every
//! plugin file now; a module that does not load is refused and the old one keeps serving),
//! and vLLM's control endpoints as fleet operations (`POST /pause`, `/resume`, `/sleep`,
//! `/wake_up`, `/reset_prefix_cache`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`;
//! `super::fleet_ops`).

use super::local;
use crate::downstream::conn::ClientConn;
use crate::downstream::errors::ClientError;
use crate::downstream::io::{respond_error, respond_json};
use crate::gateway::Gateway;
use serde_json::json;
use std::sync::Arc;

/// Dispatches an admin request. With an admin token configured, every endpoint but
/// `/metrics` and `/health` requires it (`Authorization: Bearer <token>`); others get a 401.
pub async fn serve(gw: &Arc<Gateway>, session: &mut ClientConn, method: &str, path: &str) {
    if !matches!(path, "/metrics" | "/health")
        && let Some(token) = &gw.config().admin_token
        && !token.admits(session.req().header("authorization"))
    {
        gw.metrics.admin_unauthorized.inc();
        let challenge = [("www-authenticate", "Bearer".to_string())];
        return respond_error(session, &ClientError::unauthorized(), &challenge).await;
    }
    match (method, path) {
        ("GET", "/metrics") => local::metrics(gw, session).await,
        ("GET", "/health") => local::health(gw, session).await,
        ("GET", "/workers") => workers(gw, session).await,
        ("GET", "/requests") => requests(gw, session).await,
        ("GET", p) if p.starts_with("/requests/") => request(gw, session, &p["/requests/".len()..]).await,
        ("GET", p) if p.starts_with("/responses/") => stored_response(gw, session, &p["/responses/".len()..]).await,
        ("POST", "/reload") => reload(gw, session).await,
        ("POST", "/migrate") => super::migrate::serve(gw, session).await,
        ("GET", "/rescheduling") => {
            let last = gw.rescheduling_last.lock().clone().map(|models| json!({"models": models}));
            respond_json(session, 200, &json!({"enabled": gw.config().rescheduling.enable_rescheduling, "last_cycle": last})).await
        }
        ("GET", "/cluster") => respond_json(session, 200, &gw.cluster.view()).await,
        ("GET", "/tenants") => respond_json(session, 200, &tenants(gw)).await,
        ("GET", "/planner") => {
            let planners = gw.planner_status.lock().clone();
            respond_json(session, 200, &json!({"planners": planners})).await
        }
        ("GET", "/busy_threshold") => list_thresholds(gw, session).await,
        ("POST", "/busy_threshold") => set_threshold(gw, session).await,
        ("GET", "/plugins") => list_plugins(gw, session).await,
        ("POST", "/plugins/reload") => reload_plugins(gw, session).await,
        ("POST", p) if super::fleet_ops::OPERATIONS.contains(&p) => {
            let query = session.req().target().split_once('?').map(|(_, q)| q.to_string());
            super::fleet_ops::serve(gw, session, p, query.as_deref()).await
        }
        (_, p) if super::fleet_ops::OPERATIONS.contains(&p) => respond_error(session, &ClientError::method_not_allowed(method, path), &[]).await,
        (
            _,
            "/metrics" | "/health" | "/workers" | "/requests" | "/reload" | "/migrate" | "/rescheduling" | "/planner" | "/cluster" | "/busy_threshold"
            | "/plugins" | "/plugins/reload" | "/tenants",
        ) => respond_error(session, &ClientError::method_not_allowed(method, path), &[]).await,
        _ => respond_error(session, &ClientError::not_found(path), &[]).await,
    }
}

/// `GET /tenants`: each tenant's limits, what is left of each now, its requests in flight and
/// what its requests used (this replica's), and its fair-share counter. Never a key.
fn tenants(gw: &Gateway) -> serde_json::Value {
    let Some(table) = gw.tenants.table() else { return json!({"enabled": false, "tenants": []}) };
    let level =
        |l: Option<kvgate_filters::tenant::Level>| l.map(|l| json!({"limit": l.limit, "remaining": l.remaining, "reset_ms": l.reset.as_millis() as u64}));
    let list: Vec<_> = table
        .all
        .iter()
        .map(|t| {
            let a = &t.account;
            let s = a.snapshot();
            let (requests, input, output) = a.totals();
            json!({
                "name": t.name, "priority": t.band, "weight": a.fair().weight(),
                "queue_max_wait_ms": t.max_wait.map(|d| d.as_millis() as u64),
                "limits": {
                    "requests_per_minute": level(s.requests), "input_tokens_per_minute": level(s.input),
                    "output_tokens_per_minute": level(s.output),
                    "max_concurrent": (s.concurrent.1 > 0).then_some(s.concurrent.1),
                },
                "in_flight": a.in_flight(), "in_flight_with_peers": s.concurrent.0,
                "used": {"requests": requests, "input_tokens": input, "output_tokens": output, "input_tokens_corrected": a.input_corrected()},
                "fair_share": {"served_tokens": a.fair().served(), "virtual_tokens": a.fair().virtual_tokens()},
            })
        })
        .collect();
    json!({"enabled": true, "forward_key": table.forward_key, "tenants": list})
}

async fn workers(gw: &Arc<Gateway>, session: &mut ClientConn) {
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
                .map(|(i, w)| {
                    let reported: Vec<_> =
                        w.reported().iter().map(|r| json!({"kv_usage": r.kv_usage, "waiting": r.waiting, "total_blocks": r.total_blocks})).collect();
                    let id = i as u16;
                    let adapters = w.cards().map(|c| c.adapters.clone()).unwrap_or_default();
                    let origin = m.cfg.workers.get(i).map(|c| c.origin.label());
                    json!({"id": i, "url": w.label, "origin": origin, "role": m.role(i).label(), "healthy": w.is_healthy(), "paused": w.is_paused(), "adapters": adapters, "max_model_len": w.max_model_len(), "in_flight": m.ledger.requests(id), "peer_in_flight": w.booked.peers().requests(),
                           "booked_prefill_tokens": m.ledger.prefill_tokens(id), "booked_blocks": m.ledger.active_blocks(id), "expected_blocks": m.ledger.expected_blocks(id),
                           "queue_busy": m.queue_busy(i), "reported": reported})
                })
                .collect();
            json!({"model": name, "routing": m.policy.name(), "workers": workers})
        })
        .collect();
    respond_json(session, 200, &json!({"draining": gw.is_draining(), "in_flight": gw.open_requests(), "models": models})).await;
}

/// `{"in_flight": n, "requests": [...]}`, oldest first.
async fn requests(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let list: Vec<_> = gw.requests.snapshot().iter().map(|e| e.to_json(false)).collect();
    respond_json(session, 200, &json!({"in_flight": list.len(), "requests": list})).await;
}

/// One request with its route receipt; 404 when it is neither in flight nor kept as finished.
/// In a cluster, a request another replica holds is asked of it (`super::forward`).
async fn request(gw: &Arc<Gateway>, session: &mut ClientConn, id: &str) {
    if let Some(e) = gw.requests.find(id) {
        return respond_json(session, 200, &e.to_json(true)).await;
    }
    match super::forward::ask(gw, "request", id, b"", std::time::Duration::ZERO).await {
        Some((status, body)) => crate::downstream::io::respond(session, status, "application/json", body.into(), &[]).await,
        None => respond_error(session, &ClientError::unknown_request(id), &[]).await,
    }
}

/// Which worker stored a Responses-API response, as this replica knows it (it relayed it, or a
/// peer shared it); 404 when it does not know.
async fn stored_response(gw: &Arc<Gateway>, session: &mut ClientConn, id: &str) {
    match gw.stored_responses.home_of(id) {
        Some(url) => respond_json(session, 200, &json!({"id": id, "worker": url.to_string()})).await,
        None => respond_error(session, &ClientError::not_found(&format!("/responses/{id}")), &[]).await,
    }
}

/// Reads and drops an admin request's body (at most 64 KiB, within 10 s, like the bodies the
/// admin API reads); false when it was refused, which was answered.
async fn drained(session: &mut ClientConn) -> bool {
    match crate::downstream::io::read_body(session, 64 * 1024, std::time::Duration::from_secs(10)).await {
        Ok(_) => true,
        Err(e) => {
            if let Some(ce) = e.client_error() {
                respond_error(session, &ce, &[]).await;
            }
            false
        }
    }
}

async fn reload(gw: &Arc<Gateway>, session: &mut ClientConn) {
    if !drained(session).await {
        return;
    }
    // Reloading may compile plugins and load tokenizers: not on an async worker.
    let gw2 = gw.clone();
    let result = tokio::task::spawn_blocking(move || gw2.reload())
        .await
        .unwrap_or_else(|e| Err(crate::config::load::ConfigError { origin: "reload".into(), line: None, column: None, message: e.to_string() }));
    match result {
        Ok(()) => respond_json(session, 200, &json!({"status": "ok"})).await,
        Err(e) => {
            let ce = ClientError::bad_request(format!("configuration rejected, the previous one stays in force: {e}"), None);
            respond_error(session, &ce, &[]).await
        }
    }
}

async fn list_plugins(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let list: Vec<_> = gw
        .plugins
        .slots()
        .iter()
        .map(|(name, slot)| json!({"name": name, "path": slot.spec().path.display().to_string(), "sha256": slot.current().sha256()}))
        .collect();
    respond_json(session, 200, &json!({"plugins": list})).await;
}

/// `{"plugins": [{"name", "status": "reloaded" | "unchanged" | "rejected", "sha256" | "error"}]}`;
/// 200 when every plugin is serving its file, 422 when one was rejected.
async fn reload_plugins(gw: &Arc<Gateway>, session: &mut ClientConn) {
    if !drained(session).await {
        return;
    }
    let gw2 = gw.clone();
    let results = match tokio::task::spawn_blocking(move || gw2.plugins.reload_all(&gw2.metrics)).await {
        Ok(r) => r,
        Err(e) => return respond_error(session, &ClientError::internal(format!("plugin reload failed: {e}")), &[]).await,
    };
    let mut ok = true;
    let list: Vec<_> = results
        .into_iter()
        .map(|(name, r)| match r {
            Ok(kvgate_plugins::ReloadOutcome::Swapped { sha256 }) => json!({"name": name, "status": "reloaded", "sha256": sha256}),
            Ok(kvgate_plugins::ReloadOutcome::Unchanged) => json!({"name": name, "status": "unchanged"}),
            Err(e) => {
                ok = false;
                json!({"name": name, "status": "rejected", "error": e})
            }
        })
        .collect();
    respond_json(session, if ok { 200 } else { 422 }, &json!({"plugins": list})).await;
}

fn threshold_json(model: &str, t: &kvgate_filters::shed::Thresholds) -> serde_json::Value {
    json!({"model": model, "active_decode_blocks_threshold": t.active_decode_blocks_threshold,
           "active_prefill_tokens_threshold": t.active_prefill_tokens_threshold,
           "active_prefill_tokens_threshold_frac": t.active_prefill_tokens_threshold_frac})
}

async fn list_thresholds(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let list: Vec<_> = gw.all_thresholds().iter().map(|(m, t)| threshold_json(m, t)).collect();
    respond_json(session, 200, &json!({"thresholds": list})).await;
}

/// `{"model": …, <threshold>: value | null, …}`: a field that is present sets (null clears)
/// that threshold; absent fields stay; only `model` reads the current values.
async fn set_threshold(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let body = match crate::downstream::io::read_body(session, 64 * 1024, std::time::Duration::from_secs(10)).await {
        Ok(b) => b,
        Err(e) => {
            if let Some(ce) = e.client_error() {
                respond_error(session, &ce, &[]).await;
            }
            return;
        }
    };
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        _ => return respond_error(session, &ClientError::bad_request("body must be a JSON object with a \"model\"", None), &[]).await,
    };
    let Some(model) = v.get("model").and_then(|m| m.as_str()).map(str::to_owned) else {
        return respond_error(session, &ClientError::bad_request("\"model\" is required", Some("model")), &[]).await;
    };
    let known: Vec<String> = gw.fleet().order.clone();
    if !known.contains(&model) {
        return respond_error(session, &ClientError::unknown_model(&model, &known), &[]).await;
    }
    let mut t = gw.thresholds(&model);
    let obj = v.as_object().expect("checked");
    for (k, val) in obj {
        let bad = |m: &str| ClientError::bad_request(format!("{k}: {m}"), None);
        match k.as_str() {
            "model" => {}
            "active_decode_blocks_threshold" => match val {
                serde_json::Value::Null => t.active_decode_blocks_threshold = None,
                v => match v.as_f64() {
                    Some(x) => t.active_decode_blocks_threshold = Some(x),
                    None => return respond_error(session, &bad("must be a number or null"), &[]).await,
                },
            },
            "active_prefill_tokens_threshold" => match val {
                serde_json::Value::Null => t.active_prefill_tokens_threshold = None,
                v => match v.as_u64() {
                    Some(x) => t.active_prefill_tokens_threshold = Some(x),
                    None => return respond_error(session, &bad("must be a non-negative integer or null"), &[]).await,
                },
            },
            "active_prefill_tokens_threshold_frac" => match val {
                serde_json::Value::Null => t.active_prefill_tokens_threshold_frac = None,
                v => match v.as_f64() {
                    Some(x) => t.active_prefill_tokens_threshold_frac = Some(x),
                    None => return respond_error(session, &bad("must be a number or null"), &[]).await,
                },
            },
            other => return respond_error(session, &ClientError::bad_request(format!("unknown field {other:?}"), None), &[]).await,
        }
    }
    if let Err(m) = t.validate() {
        return respond_error(session, &ClientError::bad_request(m, None), &[]).await;
    }
    gw.set_thresholds(&model, t);
    respond_json(session, 200, &threshold_json(&model, &t)).await;
}
