//! Phase 3a, the prefill leg of a disaggregated request (Dynamo's disaggregated serving, on
//! vLLM's own `kv_transfer_params` protocol; docs/disaggregation.md has the protocol and its
//! sources).
//!
//! On a model with `role: prefill` workers, a request runs in two legs:
//! 1. the prefill leg: the request with `kv_transfer_params: {do_remote_decode: true, …}`,
//!    `stream: false` and `max_tokens: 1`, to the prefill worker the routing mode picks among
//!    the prefill workers (their caches; no active-block tracking, prefill tokens booked only);
//!    its answer carries the parameters of the KV it holds for the decode worker;
//! 2. the decode leg: the request plus those parameters, placed among the decode workers as
//!    any request is (the placement prices the prompt as present there: its KV is
//!    transferred, not computed), and relayed to the client as usual.
//!
//! A request falls back to aggregated serving on a decode worker, counted by reason, when its
//! prompt is shorter than `min_prefill_tokens`, its endpoint is not chat or completions, it
//! brings its own `kv_transfer_params`, no prefill worker is healthy or every one is busy, or
//! the prefill leg fails. A client that leaves during the prefill leg cancels it at once (the
//! leg is a child of the request's context, and dropping it closes its connection, which
//! aborts the request in vLLM), and its decode leg never starts.

use super::RequestState;
use super::outcome::Outcome;
use super::pd::{LegRole, Pd};
use super::place;
use crate::downstream::closed::client_closed;
use crate::downstream::conn::ClientConn;
use crate::error::GatewayError;
use crate::fleet::Worker;
use crate::gateway::Gateway;
use crate::receipt::LegOutcome;
use bytes::Bytes;
use kvgate_filters::cancel::RequestContext;
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Instant;

/// Why a request of a disaggregating model ran aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Its prompt is shorter than `min_prefill_tokens`.
    ShortPrompt,
    /// Not chat or completions (vLLM's prefill leg protocol is theirs).
    Endpoint,
    /// The client sent its own `kv_transfer_params`: it runs the legs itself.
    ClientParams,
    /// Its body is not a JSON object.
    NotJson,
    /// No prefill worker is healthy.
    NoPrefillWorker,
    /// Every prefill worker is over its busy thresholds.
    PrefillBusy,
    /// The prefill leg failed: an error status, a failed connection, no answer within
    /// `disaggregation.prefill_timeout_ms`, an answer that is not JSON or is too large.
    PrefillFailed,
    /// A routing plugin refused the prefill leg.
    PrefillRefused,
    /// It asks for what a transferred prompt cannot give: several choices (`n`, `best_of`),
    /// the prompt's logprobs or its echo.
    Fields,
    /// Every decode worker is over its busy thresholds: a prefill leg would be wasted on a
    /// request that gets the load-shedding 503.
    DecodeBusy,
}

impl Fallback {
    /// Its `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::ShortPrompt => "short_prompt",
            Self::Endpoint => "endpoint",
            Self::ClientParams => "client_params",
            Self::NotJson => "not_json",
            Self::NoPrefillWorker => "no_prefill_worker",
            Self::PrefillBusy => "prefill_busy",
            Self::PrefillFailed => "prefill_failed",
            Self::PrefillRefused => "prefill_refused",
            Self::Fields => "fields",
            Self::DecodeBusy => "decode_busy",
        }
    }
}

/// The forward targets whose requests take `kv_transfer_params` and `max_tokens`.
const TWO_LEG_TARGETS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// Runs the prefill leg when the request's model disaggregates, leaving the decode leg's body
/// in `req.pd`; `Err` ends the request (its client left, or it was cancelled, meanwhile).
pub async fn run(gw: &Arc<Gateway>, session: &mut ClientConn, req: &mut RequestState) -> Result<(), Outcome> {
    if !req.model.disaggregates() || !req.endpoint.infers() {
        return Ok(());
    }
    let (worker, wire) = match prefill_leg(gw, session, req) {
        Ok(leg) => leg,
        Err(why) => {
            aggregated(gw, req, why);
            return Ok(());
        }
    };
    let child = RequestContext::new(req.id());
    req.ctx.link_child(&child);
    let sent = Instant::now();
    let answer = tokio::select! {
        biased;
        () = child.killed() => None,
        () = client_closed(session) => None,
        a = prefill(req, &worker, &wire) => Some(a),
    };
    // The prefill booking ends with the leg; the decode placement books the request anew.
    req.attempts.release();
    let Some(answer) = answer else { return Err(super::record::cancelled(gw, req)) };
    match answer.and_then(|a| decode_body(&req.body, &a)) {
        Ok(decode) => {
            let now = Instant::now();
            gw.metrics.disagg.prefill_leg.with_label_values(&[req.model_name()]).observe(now.duration_since(sent).as_secs_f64());
            gw.metrics.disagg.requests.with_label_values(&[req.model_name(), "disaggregated", "prefilled"]).inc();
            req.pd = Pd { decode_body: decode, transferred: true, prefilled_at: Some(now) };
            req.entry().receipt.lock().leg_ended(LegOutcome::Prefilled);
            if let Some(t) = &req.trace {
                t.leg_ended("prefilled", false);
            }
            Ok(())
        }
        Err(detail) => {
            tracing::warn!(request_id = req.id(), worker = %worker.url, detail = detail.as_str(), "prefill leg failed; serving the request aggregated");
            req.entry().receipt.lock().leg_ended(LegOutcome::PrefillFailed);
            if let Some(t) = &req.trace {
                t.leg_ended("prefill_failed", true);
            }
            aggregated(gw, req, Fallback::PrefillFailed);
            Ok(())
        }
    }
}

/// The prefill leg's worker (booked) and request, or why the request runs aggregated.
fn prefill_leg(gw: &Gateway, session: &ClientConn, req: &mut RequestState) -> Result<(Arc<Worker>, Vec<u8>), Fallback> {
    let body = two_legs(req)?;
    if place::answers_all_busy(gw, req) {
        return Err(Fallback::DecodeBusy);
    }
    let worker = place_prefill(gw, req)?;
    // The client's headers go with both legs, as with any leg; so does its request id
    // (vLLM's example proxy sends both legs under one `X-Request-Id`).
    let traceparent = req.trace.as_ref().map(|t| t.leg("prefill", &worker.label, 0));
    let passed = req.passed(traceparent.as_deref());
    let wire = crate::h1::request_head::write_forwarded(session.req(), worker.host_header.as_bytes(), "POST", &req.forward.target, &body, req.id(), passed)
        .map_err(|_| Fallback::PrefillFailed)?;
    Ok((worker, wire))
}

/// Counts a request that runs aggregated; it goes on to its (only) placement.
fn aggregated(gw: &Gateway, req: &RequestState, why: Fallback) {
    gw.metrics.disagg.requests.with_label_values(&[req.model_name(), "aggregated", why.label()]).inc();
}

/// The prefill leg's body, or why the request runs aggregated.
fn two_legs(req: &RequestState) -> Result<Bytes, Fallback> {
    if !TWO_LEG_TARGETS.contains(&req.forward.target.as_ref()) {
        return Err(Fallback::Endpoint);
    }
    if req.booked_tokens() < req.model.cfg.disaggregation.min_prefill_tokens {
        return Err(Fallback::ShortPrompt);
    }
    prefill_body(&req.body)
}

/// The request as its prefill leg: vLLM's `toy_proxy_server.py` sends the same body with
/// `kv_transfer_params` asking for a remote decode, no stream, one token (`max_tokens` and,
/// when the client set it, `max_completion_tokens`), and neither `min_tokens`,
/// `min_completion_tokens` nor `stream_options`, which would contradict them.
pub fn prefill_body(body: &[u8]) -> Result<Bytes, Fallback> {
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(body) else { return Err(Fallback::NotJson) };
    if o.get("kv_transfer_params").is_some_and(|p| !p.is_null()) {
        return Err(Fallback::ClientParams);
    }
    if needs_the_prompt_computed_here(&o) {
        return Err(Fallback::Fields);
    }
    let mut params = Map::new();
    params.insert("do_remote_decode".into(), Value::Bool(true));
    params.insert("do_remote_prefill".into(), Value::Bool(false));
    for k in ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port"] {
        params.insert(k.into(), Value::Null);
    }
    o.insert("kv_transfer_params".into(), Value::Object(params));
    o.insert("stream".into(), Value::Bool(false));
    o.insert("max_tokens".into(), Value::from(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), Value::from(1));
    }
    for k in ["min_tokens", "min_completion_tokens", "stream_options"] {
        o.remove(k);
    }
    serde_json::to_vec(&Value::Object(o)).map(Bytes::from).map_err(|_| Fallback::NotJson)
}

/// Whether the request asks for more than one choice, or for the prompt's own logprobs or
/// echo: a decode worker given the prompt's KV computes neither the prompt's logits nor the
/// other choices' prefill, so such a request runs aggregated.
fn needs_the_prompt_computed_here(o: &Map<String, Value>) -> bool {
    let more_than_one = |k: &str| o.get(k).and_then(Value::as_u64).is_some_and(|n| n > 1);
    let set = |k: &str| o.get(k).is_some_and(|v| !v.is_null() && v != &Value::Bool(false));
    more_than_one("n") || more_than_one("best_of") || set("prompt_logprobs") || set("echo")
}

/// The decode leg's body from the prefill leg's answer: the request with the answer's
/// `kv_transfer_params` (`None`: they were null, as a connector that shares storage rather
/// than naming blocks returns them, and the request goes unchanged).
pub fn decode_body(request: &[u8], answer: &[u8]) -> Result<Option<Bytes>, String> {
    let answer: Value = serde_json::from_slice(answer).map_err(|e| format!("prefill answer is not JSON: {e}"))?;
    let params = match answer.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => p.clone(),
        Some(Value::Null) | None => return Ok(None),
        Some(other) => return Err(format!("kv_transfer_params is not an object: {other}")),
    };
    let Ok(Value::Object(mut o)) = serde_json::from_slice::<Value>(request) else { return Err("the request is not a JSON object".into()) };
    o.insert("kv_transfer_params".into(), params);
    Ok(Some(Bytes::from(serde_json::to_vec(&Value::Object(o)).map_err(|e| e.to_string())?)))
}

/// Places the prefill leg among the prefill workers (booked there; no attempt of the
/// request's).
fn place_prefill(gw: &Gateway, req: &mut RequestState) -> Result<Arc<Worker>, Fallback> {
    match place::place_leg(gw, req, place::Among::Except(&[]), LegRole::Prefill) {
        Ok(w) => Ok(w),
        Err(GatewayError::AllBusy(_)) => Err(Fallback::PrefillBusy),
        Err(GatewayError::PluginRejected { .. }) => Err(Fallback::PrefillRefused),
        // Unhealthy, paused or serving another adapter: none can take it now.
        Err(_) => Err(Fallback::NoPrefillWorker),
    }
}

/// Sends the prefill leg and reads its whole answer (`Err`: why it failed), within
/// `disaggregation.prefill_timeout_ms`: a stalled prefill worker costs the request that long,
/// then it runs aggregated.
async fn prefill(req: &RequestState, worker: &Arc<Worker>, wire: &[u8]) -> Result<Bytes, String> {
    use crate::upstream::{Outgoing, ProbeError};
    let (cfg, pd) = (&req.cfg, &req.model.cfg.disaggregation);
    let limit = std::time::Duration::from_millis(pd.prefill_timeout_ms);
    let max = pd.max_prefill_answer_bytes;
    match crate::upstream::whole_answer(cfg, worker, Outgoing::Leg(wire), limit, max).await {
        Ok((200, answer)) => Ok(answer),
        Ok((status, answer)) => Err(format!("prefill worker answered {status}: {}", String::from_utf8_lossy(&answer[..answer.len().min(300)]))),
        Err(ProbeError::Timeout(_)) => Err("no answer within disaggregation.prefill_timeout_ms".into()),
        Err(ProbeError::TooLarge(_)) => Err(format!("prefill answer over disaggregation.max_prefill_answer_bytes ({max})")),
        Err(ProbeError::Exchange(e)) => {
            if e.kind == crate::error::LegErrorKind::Connect {
                // A refused connection is a health signal, as on any leg.
                worker.observe_health(false, cfg.health.unhealthy_threshold, cfg.health.healthy_threshold);
            }
            Err(e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// A disaggregated stream's first token reached the client at `now`: the decode leg's share
/// of its time to first token.
pub fn first_token(gw: &Gateway, req: &RequestState, now: Instant) {
    if let Some(t) = req.pd.prefilled_at {
        gw.metrics.disagg.decode_first_token.with_label_values(&[req.model_name()]).observe(now.duration_since(t).as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_asks_for_a_remote_decode_of_one_token() {
        let body = br#"{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"min_tokens":5,"min_completion_tokens":5,"temperature":0}"#;
        let v: Value = serde_json::from_slice(&prefill_body(body).unwrap()).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert!(["min_tokens", "min_completion_tokens", "stream_options"].iter().all(|k| v.get(k).is_none()));
        assert_eq!(v["temperature"], 0);
        let p = &v["kv_transfer_params"];
        assert_eq!(p["do_remote_decode"], true);
        assert_eq!(p["do_remote_prefill"], false);
        for k in ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port"] {
            assert!(p[k].is_null(), "{k}");
        }
        let plain: Value = serde_json::from_slice(&prefill_body(br#"{"prompt":"x"}"#).unwrap()).unwrap();
        assert!(plain.get("max_completion_tokens").is_none(), "not added where the client had none");
    }

    #[test]
    fn bodies_that_cannot_take_two_legs_say_why() {
        assert_eq!(prefill_body(b"[1]"), Err(Fallback::NotJson));
        assert_eq!(prefill_body(b"not json"), Err(Fallback::NotJson));
        assert_eq!(prefill_body(br#"{"kv_transfer_params":{"do_remote_prefill":true}}"#), Err(Fallback::ClientParams));
        assert!(prefill_body(br#"{"kv_transfer_params":null}"#).is_ok(), "a null is no parameters");
    }

    #[test]
    fn the_decode_leg_carries_what_the_prefill_worker_returned() {
        let answer = br#"{"choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e","remote_host":"h","remote_port":5}}"#;
        let d = decode_body(br#"{"prompt":"p","stream":true,"max_tokens":9}"#, answer).unwrap().unwrap();
        let v: Value = serde_json::from_slice(&d).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["kv_transfer_params"]["remote_block_ids"][0][1], 2);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], true);
        assert_eq!(decode_body(b"{}", br#"{"kv_transfer_params":null}"#), Ok(None), "null parameters: the request goes as is");
        assert!(decode_body(b"{}", b"<html>").is_err());
        assert!(decode_body(b"{}", br#"{"kv_transfer_params":3}"#).is_err());
    }
}
