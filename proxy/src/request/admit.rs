//! Phase 1, admission: refuse while draining, read the body (capped, with a deadline), parse
//! the fields routing reads, find the model, and register the request in the in-flight
//! registry. Every refusal here is a [`GatewayError`] answered before any worker is involved.

use super::attempts::Attempts;
use super::outcome::Outcome;
use super::state::{Forward, PluginInputs};
use super::tenancy::TenantUse;
use super::track;
use super::view::RequestView;
use super::{RequestState, record};
use crate::config::Config;
use crate::downstream::conn::ClientConn;
use crate::downstream::io::{BodyError, read_body};
use crate::endpoint::Endpoint;
use crate::error::GatewayError;
use crate::fleet::{Fleet, Model};
use crate::gateway::Gateway;
use crate::inflight::RequestEntry;
use bytes::Bytes;
use kvgate_filters::cancel::RequestContext;
use kvgate_filters::migrate::PinReason;
use kvgate_filters::migrate::reply::Reply;
use kvgate_filters::route::Slo;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request id: the client's X-Request-Id when it is sane, else a fresh one.
pub fn request_id(session: &ClientConn) -> String {
    session
        .req()
        .header_str("x-request-id")
        .filter(|s| !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| crate::ids::hex_id("kvg-", crate::ids::fresh_bits()))
}

/// The routing fields of `body` (and a completion's prompt ids, with `ids`). A JSON endpoint's
/// body must be a JSON object; an audio form names its model in a `model` field; a
/// passthrough's body is read when it is a JSON object and otherwise names no model.
fn view_of(endpoint: Endpoint, content_type: Option<&str>, body: &[u8], ids: bool) -> Result<(RequestView, Option<super::fields::PromptIds>), Outcome> {
    if endpoint == Endpoint::Audio {
        let model = content_type.and_then(|ct| super::fields::form_field(body, ct, "model"));
        return Ok((RequestView { model, ..RequestView::default() }, None));
    }
    match super::fields::read(body, ids) {
        Ok(read) => Ok(read),
        Err(_) if !endpoint.json_body() => Ok((RequestView::default(), None)),
        Err(e) => Err(Outcome::Refused(GatewayError::BadRequest { message: format!("Invalid request body: {e}"), param: None })),
    }
}

/// The latency objectives a request sets for itself (`x-slo-ttft-ms`, `x-slo-tpot-ms`): a
/// positive number of milliseconds each, or a 400 naming the header.
fn slo_headers(session: &ClientConn) -> Result<Slo, Outcome> {
    let bound = |name: &'static str| -> Result<Option<f64>, Outcome> {
        let Some(v) = session.req().header_str(name) else { return Ok(None) };
        match v.trim().parse::<f64>() {
            Ok(ms) if ms.is_finite() && ms > 0.0 => Ok(Some(ms)),
            _ => Err(Outcome::Refused(GatewayError::BadRequest {
                message: format!("Invalid {name} header {v:?}: expected a positive number of milliseconds"),
                param: Some(name),
            })),
        }
    };
    Ok(Slo { ttft_ms: bound("x-slo-ttft-ms")?, tpot_ms: bound("x-slo-tpot-ms")? })
}

/// Whether a stream of `endpoint` would move but for its API (so it is pinned with reason
/// `api`): never while migration is off, when nothing moves.
fn movable_api(cfg: &Config, stream: bool, endpoint: Endpoint) -> bool {
    stream && cfg.migration.limit > 0 && endpoint.infers() && !endpoint.moves()
}

/// Admits a request, or says how it ended.
pub async fn admit(gw: &Arc<Gateway>, session: &mut ClientConn, endpoint: Endpoint, ctx: Arc<RequestContext>, start: Instant) -> Result<RequestState, Outcome> {
    if gw.is_draining() {
        return Err(Outcome::Refused(GatewayError::Draining));
    }
    let cfg = gw.config();
    // Before the body is read: a request without a valid key costs no more than its head.
    let (tenant, forward_key) = tenant(gw, session)?;
    let body = body(session, &cfg).await?;
    let fleet = gw.fleet();
    // A completion's prompt of token ids is read on the way when the body may be parsed whole
    // below (kv routing, or a stream that may move), so the ids are parsed once.
    let ids = endpoint == Endpoint::Completions && (cfg.migration.limit > 0 || fleet.models.values().any(|m| m.kv.is_some()));
    let (view, prompt) = view_of(endpoint, session.req().header_str("content-type"), &body, ids)?;
    let model = model_of(&fleet, endpoint, &view)?;
    let stream = view.stream.unwrap_or(false);
    // The whole body is parsed only when kv routing tokenizes it or a stream may move.
    let movable = stream && endpoint.moves() && cfg.migration.limit > 0;
    let mut parsed = ((endpoint.renders() && model.kv.is_some()) || movable).then(|| super::parsed::ParsedBody::parse_with(&body, prompt).ok()).flatten();
    let followed = followed(&cfg, endpoint, &model, stream, parsed.as_ref().filter(|_| movable), body);
    let (forward, reply) = forward(session, followed.translated);
    let output_limit = parsed.as_ref().and_then(|p| super::parsed::output_limit(&p.fields));
    let slo = model.cfg.slo.overridden_by(slo_headers(session)?);
    if model.kv.is_none() {
        parsed = None;
    }
    // A Responses stream sent as chat makes no stored response (the translation refuses those).
    let (stored, body) = if reply.is_some() { (None, followed.body) } else { super::stored::read(endpoint, session.req().path(), followed.body) };
    let entry = RequestEntry::new(model.name.clone(), endpoint.label(), stream, view.priority_jump(), ctx.clone(), start);
    let registered = gw.requests.register(entry);
    if let Some(t) = &tenant {
        registered.entry().receipt.lock().tenant = Some(t.tenant.name.clone());
    }
    if let Some(reason) = followed.pinned {
        record::pinned(gw, registered.entry(), &model.cfg.name, reason);
    }
    // Taken once and kept for the whole request (retries included).
    let plugin = model.plugin.as_ref().map(|slot| PluginInputs::of(slot.current(), session.req(), &view));
    let trace = gw.traces.start(session.req(), start);
    if let Some(t) = &trace {
        t.describe(|| describe(ctx.id(), &model.cfg.name, endpoint, stream, tenant.as_ref()));
    }
    Ok(RequestState {
        cfg,
        endpoint,
        forward,
        start,
        ctx,
        body,
        stored,
        view,
        parsed,
        output_limit,
        slo,
        stream,
        model,
        kv: None,
        plugin,
        attempts: Attempts::default(),
        registered,
        track: followed.tracker,
        reply,
        ttft: None,
        pd: Default::default(),
        tenant,
        prompt: None,
        forward_key,
        trace,
    })
}

/// The root span's attributes: what the request is.
fn describe(id: &str, model: &str, endpoint: Endpoint, stream: bool, tenant: Option<&TenantUse>) -> Vec<opentelemetry::KeyValue> {
    use opentelemetry::KeyValue;
    let mut attrs = vec![
        KeyValue::new("kvgate.request_id", id.to_string()),
        KeyValue::new("gen_ai.request.model", model.to_string()),
        KeyValue::new("kvgate.endpoint", endpoint.label()),
        KeyValue::new("kvgate.stream", stream),
    ];
    if let Some(t) = tenant {
        attrs.push(KeyValue::new("kvgate.tenant", t.tenant.name.clone()));
    }
    attrs
}

/// The request's tenant (none without tenants) and whether its key goes on to the workers;
/// 401 without a valid key where keys are required.
fn tenant(gw: &Gateway, session: &ClientConn) -> Result<(Option<TenantUse>, bool), Outcome> {
    let Some(table) = gw.tenants.table() else { return Ok((None, true)) };
    match table.identify(session.req()) {
        Ok(t) => Ok((Some(TenantUse::new(t)), table.forward_key)),
        Err(why) => {
            gw.metrics.tenants.unauthorized.inc();
            Err(Outcome::Refused(GatewayError::Unauthorized(why == crate::tenants::Unauthorized::Missing)))
        }
    }
}

/// The method and target the request is forwarded with, and the translation of its answer.
/// A Messages or Responses stream sent as chat goes to the chat path (the client's query,
/// which vLLM does not read there, stays behind).
fn forward(session: &ClientConn, translated: Option<(&'static str, Reply)>) -> (Forward, Option<Reply>) {
    match translated {
        Some((path, reply)) => (Forward::post(path), Some(reply)),
        None => (Forward::of(session.req()), None),
    }
}

/// The request's body, read whole (capped, with a deadline).
async fn body(session: &mut ClientConn, cfg: &Config) -> Result<Bytes, Outcome> {
    match read_body(session, cfg.max_body_bytes.0, Duration::from_millis(cfg.timeouts.request_body_ms)).await {
        Ok(b) => Ok(b),
        Err(BodyError::TooLarge(limit)) => Err(Outcome::Refused(GatewayError::TooLarge(limit))),
        Err(BodyError::Timeout) => Err(Outcome::Refused(GatewayError::BodyTimeout)),
        Err(BodyError::Malformed(why)) => Err(Outcome::Refused(GatewayError::BadRequest { message: format!("Malformed request body: {why}"), param: None })),
        Err(BodyError::Gone) => Err(Outcome::Cancelled),
    }
}

/// The model the request addresses. A body that cannot name a model (a form without one, a
/// passthrough's GET) goes to the first model's workers rather than being refused: vLLM
/// answers such paths for any model.
fn model_of(fleet: &Fleet, endpoint: Endpoint, view: &RequestView) -> Result<Arc<Model>, Outcome> {
    let named = fleet.resolve(view.model.as_deref());
    let unnamed = || (!endpoint.json_body() && view.model.is_none()).then(|| fleet.order.first().and_then(|n| fleet.model(n))).flatten();
    match named.or_else(unnamed) {
        Some(model) => Ok(model.clone()),
        None => Err(Outcome::Refused(match &view.model {
            Some(name) => GatewayError::UnknownModel { name: name.clone(), served: fleet.order.clone() },
            None => GatewayError::BadRequest { message: "`model` is required when the gateway serves several models".into(), param: Some("model") },
        })),
    }
}

/// How a stream is followed: its tracker and the body its worker gets (the token ids it asks
/// for, or the chat request a Messages or Responses stream is sent as), or why it cannot move.
struct Followed {
    tracker: Option<track::Tracker>,
    body: Bytes,
    pinned: Option<PinReason>,
    translated: Option<(&'static str, Reply)>,
}

/// Follows a stream that may move (`movable`: its parsed body); a stream of another API stays
/// where it starts, and says why.
fn followed(cfg: &Config, endpoint: Endpoint, model: &Model, stream: bool, movable: Option<&super::parsed::ParsedBody>, body: Bytes) -> Followed {
    // Only a Responses stream reads them; the cards' scan stays off every other request's path.
    let facts = if endpoint == Endpoint::Responses && movable.is_some() {
        track::ModelFacts { harmony: model.may_be_harmony(), max_model_len: model.shortest_context() }
    } else {
        track::ModelFacts::default()
    };
    let unfollowed = |body, pinned| Followed { tracker: None, body, pinned, translated: None };
    match movable.map(|p| track::follow(endpoint, &body, &p.fields, facts)) {
        Some(Ok(f)) => Followed { tracker: Some(f.tracker), body: f.body, pinned: None, translated: f.translated },
        Some(Err(reason)) => unfollowed(body, Some(reason)),
        None if movable_api(cfg, stream, endpoint) => unfollowed(body, Some(PinReason::Api)),
        None => unfollowed(body, None),
    }
}
