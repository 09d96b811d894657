//! Fleet operations on the admin listener: vLLM's control endpoints (`/pause`, `/resume`,
//! `/sleep`, `/wake_up`, `/reset_prefix_cache`, `/v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`), which the public listener never forwards, sent to every worker
//! of a model (or of every model) at once, with one result per worker. Each also does the
//! gateway's share of the operation:
//! - `/pause` marks the workers paused *before* asking them, so no request is placed on one
//!   while it pauses; requests arriving meanwhile wait in the router queue
//!   (`request::queue::wait_resumed`). The gateway asks vLLM for `mode=keep` (requests in
//!   flight freeze and continue on `/resume`) unless the operator names a mode: vLLM's own
//!   default, `abort`, would fail every stream in flight;
//! - `/resume` unpauses the workers that resumed, then wakes the waiting requests;
//! - `/sleep` holds requests off the workers the same way (a sleeping worker has no KV cache
//!   and must not be sent requests) and forgets their cached prefixes; a whole `/wake_up`
//!   (without `tags`, which wake only part of a worker) lets them take requests again. Sleep
//!   and pause are apart: `/resume` does not wake a sleeping worker, nor `/wake_up` resume a
//!   paused one;
//! - `/reset_prefix_cache` forgets the cached prefixes of the workers that reset theirs;
//! - loading or unloading a LoRA adapter re-reads the workers' model cards at once, so requests
//!   naming the adapter reach exactly the workers that have it.
//!
//! Query: `model=<name>` picks one model (default: all); `timeout_ms` bounds each worker's
//! answer (default 60 000); every other parameter, and a JSON body, go to the workers as they
//! came. A worker serving several models is asked once. The answer is 200 when every worker
//! succeeded (2xx, and no `{"success": false}`), else 502, with `{"operation", "results": [{"models", "worker", "status",
//! "body", "succeeded"} | {"models", "worker", "error", "succeeded": false}]}`.

use crate::downstream::conn::ClientConn;
use crate::downstream::errors::ClientError;
use crate::downstream::io::{read_body, respond_error, respond_json};
use crate::fleet::{Model, Worker};
use crate::gateway::Gateway;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The vLLM control paths the admin listener turns into fleet operations.
pub const OPERATIONS: &[&str] = &["/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"];

/// Largest body read from the operator, and from each worker's answer.
const MAX_BODY: usize = 64 * 1024;

/// Longest a worker may take to answer when the operator does not say (a pause with
/// `mode=wait` lasts as long as the longest request in flight).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What the gateway does around the workers' part of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    Pause,
    Resume,
    Sleep,
    WakeUp,
    ResetCache,
    Adapters,
}

impl Effect {
    fn of(path: &str) -> Option<Self> {
        Some(match path {
            "/pause" => Self::Pause,
            "/resume" => Self::Resume,
            "/sleep" => Self::Sleep,
            "/wake_up" => Self::WakeUp,
            "/reset_prefix_cache" => Self::ResetCache,
            "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" => Self::Adapters,
            _ => return None,
        })
    }
}

/// The operator's request, read from its target and body.
#[derive(Debug, PartialEq)]
struct Order {
    /// The model picked, or all.
    model: Option<String>,
    /// The query the workers get (the gateway's own parameters removed).
    query: String,
    timeout: Duration,
    /// A `/wake_up` with `tags`: part of the worker (its weights, say) wakes, not all of it.
    partial: bool,
}

impl Order {
    /// Splits the query into the gateway's parameters and the workers'.
    fn read(effect: Effect, query: Option<&str>) -> Result<Self, ClientError> {
        let (mut model, mut timeout, mut rest) = (None, DEFAULT_TIMEOUT, Vec::new());
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "model" => model = Some(percent_decoded(v).ok_or_else(|| ClientError::bad_request("model: not valid percent-encoded UTF-8", Some("model")))?),
                "timeout_ms" => match v.parse::<u64>() {
                    Ok(ms) if ms > 0 => timeout = Duration::from_millis(ms),
                    _ => return Err(ClientError::bad_request("timeout_ms: must be a positive integer (milliseconds)", Some("timeout_ms"))),
                },
                _ => rest.push(pair),
            }
        }
        // vLLM's default pause aborts every request in flight; the gateway's keeps them.
        if effect == Effect::Pause && !rest.iter().any(|p| p.starts_with("mode=")) {
            rest.push("mode=keep");
        }
        let partial = rest.iter().any(|p| p.starts_with("tags="));
        Ok(Self { model, query: rest.join("&"), timeout, partial })
    }

    fn target(&self, path: &str) -> String {
        if self.query.is_empty() { path.to_string() } else { format!("{path}?{}", self.query) }
    }
}

/// `%XX` sequences decoded (`+` is kept: model names are path-like, not form text).
fn percent_decoded(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Serves `POST <path>` (one of [`OPERATIONS`]); `query` is the target's query, if any.
pub async fn serve(gw: &Arc<Gateway>, session: &mut ClientConn, path: &str, query: Option<&str>) {
    let Some(effect) = Effect::of(path) else { return respond_error(session, &ClientError::not_found(path), &[]).await };
    let order = match Order::read(effect, query) {
        Ok(o) => o,
        Err(e) => return respond_error(session, &e, &[]).await,
    };
    let body = match read_body(session, MAX_BODY as u64, Duration::from_secs(10)).await {
        Ok(b) => b,
        Err(e) => {
            if let Some(ce) = e.client_error() {
                respond_error(session, &ce, &[]).await;
            }
            return;
        }
    };
    if !body.is_empty() && serde_json::from_slice::<Value>(&body).is_err() {
        return respond_error(session, &ClientError::bad_request("the body must be JSON (it is sent to every worker)", None), &[]).await;
    }
    let targets = match targets(gw, order.model.as_deref()) {
        Ok(t) => t,
        Err(e) => return respond_error(session, &e, &[]).await,
    };
    let results = run(gw, effect, &order, &order.target(path), (!body.is_empty()).then_some(&body[..]), &targets).await;
    let ok = results.iter().all(|r| r["succeeded"] == true);
    tracing::info!(operation = path, model = order.model.as_deref().unwrap_or("*"), workers = results.len(), ok, "fleet operation");
    respond_json(session, if ok { 200 } else { 502 }, &json!({"operation": path, "results": results})).await;
}

/// Each worker once, with the models it serves here and its index among each one's workers.
type Targets = Vec<(Arc<Worker>, Vec<(Arc<Model>, usize)>)>;

/// The workers `model` names (all models' when `None`), each once.
fn targets(gw: &Gateway, model: Option<&str>) -> Result<Targets, ClientError> {
    let fleet = gw.fleet();
    let models: Vec<&Arc<Model>> = match model {
        Some(name) => vec![fleet.model(name).ok_or_else(|| ClientError::unknown_model(name, &fleet.order))?],
        None => fleet.order.iter().map(|n| &fleet.models[n]).collect(),
    };
    let mut out: Targets = Vec::new();
    for m in models {
        for (i, w) in m.workers.iter().enumerate() {
            match out.iter_mut().find(|(t, _)| Arc::ptr_eq(t, w)) {
                Some((_, serving)) => serving.push((m.clone(), i)),
                None => out.push((w.clone(), vec![(m.clone(), i)])),
            }
        }
    }
    Ok(out)
}

/// The operation on every target at once: the gateway's part before and after each worker's.
async fn run(gw: &Arc<Gateway>, effect: Effect, order: &Order, target: &str, body: Option<&[u8]>, targets: &Targets) -> Vec<Value> {
    match effect {
        Effect::Pause => targets.iter().for_each(|(w, _)| w.set_paused(true)),
        Effect::Sleep => targets.iter().for_each(|(w, _)| w.set_asleep(true)),
        _ => {}
    }
    let calls = targets.iter().map(|(w, serving)| async move {
        let answer = crate::upstream::call(&gw.config(), w, "POST", target, body, order.timeout, MAX_BODY).await;
        let succeeded = matches!(&answer, Ok((s, b)) if (200..300).contains(s) && !reports_failure(b));
        after(gw, effect, order, w, serving, succeeded, answer.as_ref().ok().map(|(s, _)| *s)).await;
        let names: Vec<&str> = serving.iter().map(|(m, _)| m.cfg.name.as_str()).collect();
        match answer {
            Ok((status, b)) => {
                let body = serde_json::from_slice::<Value>(&b).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned()));
                json!({"models": names, "worker": w.label, "status": status, "body": body, "succeeded": succeeded})
            }
            Err(e) => json!({"models": names, "worker": w.label, "error": e.to_string(), "succeeded": false}),
        }
    });
    futures_util::future::join_all(calls).await
}

/// vLLM answers some failures with a 200 whose body says so (`{"success": false}` from a
/// prefix-cache reset that found blocks still in use).
fn reports_failure(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).ok().and_then(|v| v.get("success")?.as_bool()) == Some(false)
}

/// The gateway's part after worker `w` answered (`status`, `None`: no answer). Requests waiting
/// for a paused model are woken as soon as one worker takes requests again, not when the
/// slowest has answered.
async fn after(gw: &Gateway, effect: Effect, order: &Order, w: &Worker, serving: &[(Arc<Model>, usize)], succeeded: bool, status: Option<u16>) {
    let forget = || serving.iter().for_each(|(m, i)| m.kv.iter().for_each(|kv| kv.forget_worker(*i)));
    // A worker without vLLM's dev endpoints (404) was never paused or asleep there: the
    // gateway's own hold is the whole of it, and lifting it is the whole resume. One that failed
    // otherwise may still be held, so it stays out of routing until a later call succeeds.
    let lifted = succeeded || status == Some(404);
    match effect {
        Effect::Resume if lifted => w.set_paused(false),
        Effect::WakeUp if lifted && !order.partial => w.set_asleep(false),
        Effect::Sleep | Effect::ResetCache if succeeded => forget(),
        Effect::Adapters => {
            crate::tasks::worker_metrics::refresh_cards(gw, w, order.timeout).await;
        }
        _ => return,
    }
    if matches!(effect, Effect::Resume | Effect::WakeUp | Effect::Adapters) {
        gw.resumed.send_modify(|n| *n = n.wrapping_add(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_keeps_its_parameters_and_defaults_a_pause_to_keep() {
        let o = Order::read(Effect::Pause, Some("model=my%2Fmodel&timeout_ms=500&clear_cache=false")).unwrap();
        assert_eq!(
            o,
            Order { model: Some("my/model".into()), query: "clear_cache=false&mode=keep".into(), timeout: Duration::from_millis(500), partial: false }
        );
        assert!(Order::read(Effect::WakeUp, Some("tags=weights")).unwrap().partial);
        assert_eq!(o.target("/pause"), "/pause?clear_cache=false&mode=keep");
        let o = Order::read(Effect::Pause, Some("mode=abort")).unwrap();
        assert_eq!(o.query, "mode=abort", "the operator's mode is sent as given");
        let o = Order::read(Effect::Resume, None).unwrap();
        assert_eq!((o.target("/resume"), o.model, o.timeout), ("/resume".to_string(), None, DEFAULT_TIMEOUT));
        assert_eq!(Order::read(Effect::Sleep, Some("level=2")).unwrap().target("/sleep"), "/sleep?level=2");
        for bad in ["timeout_ms=0", "timeout_ms=soon", "model=%zz"] {
            assert_eq!(Order::read(Effect::Resume, Some(bad)).unwrap_err().status, 400, "{bad}");
        }
    }

    #[test]
    fn every_operation_has_its_effect_and_a_200_can_report_a_failure() {
        assert!(OPERATIONS.iter().all(|p| Effect::of(p).is_some()));
        assert_eq!(Effect::of("/collective_rpc"), None);
        assert!(reports_failure(br#"{"success": false}"#));
        assert!(!reports_failure(br#"{"success": true}"#) && !reports_failure(b"") && !reports_failure(br#"{"status":"paused"}"#));
    }
}
