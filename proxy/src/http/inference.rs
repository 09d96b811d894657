//! `/v1/chat/completions` and `/v1/completions`: read the body (capped), parse just what routing
//! needs, pick a worker, run the upstream leg with bounded retries, then stream the response to
//! the client chunk by chunk while watching for a disconnect.
//!
//! Cancellation (seed 003): each request gets a [`RequestContext`]; a client that disconnects
//! before the response starts or mid-stream stops it, the upstream connection is dropped (not
//! pooled) so vLLM aborts the request, and the cancellation metric counts the request once.

use super::client::client_closed;
use super::errors::ClientError;
use super::io::{read_body, respond_error};
use super::sse::SseEventCounter;
use super::upstream::{Attempt, Outgoing, attempt, client_response_header, release};
use crate::fleet::Model;
use crate::gateway::Gateway;
use bytes::Bytes;
use kvgate_filters::cancel::RequestContext;
use kvgate_filters::route::{Candidate, Decision, Load, RequestSummary};
use pingora::proxy::Session;
use serde::Deserialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which model-scoped endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/tokenize`, passed through to a healthy worker of the model.
    Tokenize,
    /// `/detokenize`, passed through to a healthy worker of the model.
    Detokenize,
}

impl Endpoint {
    /// Metric label (seed 003's values for the inference endpoints).
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
        }
    }

    /// The worker path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
        }
    }
}

/// The fields routing reads; everything else is forwarded untouched.
#[derive(Deserialize)]
struct RequestView {
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// The request's `nvext` object (agent hints), kept whole for plugins.
    #[serde(default)]
    nvext: Option<serde_json::Value>,
}

impl RequestView {
    /// Router-queue priority jump (seconds of head start): `nvext.agent_hints.priority`, else
    /// `latency_sensitivity`.
    fn priority_jump(&self) -> f64 {
        let hint = |name: &str| self.nvext.as_ref().and_then(|n| n.get("agent_hints")?.get(name)?.as_f64());
        hint("priority").or_else(|| hint("latency_sensitivity")).unwrap_or(0.0).max(0.0)
    }
}

/// How a request ended, for metrics and logs.
enum Outcome {
    /// A complete response went out with this status.
    Served(u16),
    /// The worker died mid-response; the client connection must be closed abruptly so the
    /// client sees an error, not a clean end of a truncated body.
    Truncated(u16),
    /// The gateway answered with an error.
    Refused(u16),
    /// The client went away.
    Cancelled,
}

/// A request id: the client's X-Request-Id when it is sane, else a fresh one.
pub fn request_id(session: &Session) -> String {
    session
        .req_header()
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(new_id)
}

fn new_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("kvg-{:016x}", kvgate_kv::hash::mix(t ^ N.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)))
}

/// Serves one request end to end. Returns true when the client connection must be aborted
/// (the response was cut by a failing worker).
pub async fn serve(gw: &Arc<Gateway>, session: &mut Session, endpoint: Endpoint) -> bool {
    let start = Instant::now();
    let rid = request_id(session);
    let rid_header = [("x-request-id", rid.clone())];
    if gw.is_draining() {
        respond_error(session, &ClientError::draining(), &[("connection", "close".into()), rid_header[0].clone()]).await;
        return false;
    }
    let _tracked = gw.track();
    let cfg = gw.config();
    let body = match read_body(session, cfg.max_body_bytes.0, Duration::from_millis(cfg.timeouts.request_body_ms)).await {
        Ok(b) => b,
        Err(e) => {
            if let Some(ce) = e.client_error() {
                respond_error(session, &ce, &rid_header).await;
            }
            return false;
        }
    };
    let view: RequestView = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let ce = ClientError::bad_request(format!("Invalid request body: {e}"), None);
            respond_error(session, &ce, &rid_header).await;
            gw.metrics.requests.with_label_values(&["", endpoint.label(), "400"]).inc();
            return false;
        }
    };
    let fleet = gw.fleet();
    let model = match view.model.as_deref() {
        Some(name) => fleet.model(name).cloned(),
        // As vLLM, a request without `model` goes to the only model when there is one.
        None if fleet.order.len() == 1 => fleet.model(&fleet.order[0]).cloned(),
        None => {
            let ce = ClientError::bad_request("`model` is required when the gateway serves several models", Some("model"));
            respond_error(session, &ce, &rid_header).await;
            return false;
        }
    };
    let Some(model) = model else {
        let name = view.model.unwrap_or_default();
        respond_error(session, &ClientError::unknown_model(&name, &fleet.order), &rid_header).await;
        gw.metrics.requests.with_label_values(&["", endpoint.label(), "404"]).inc();
        return false;
    };
    let name = model.cfg.name.clone();
    let stream = view.stream.unwrap_or(false);
    // The whole body is parsed only when kv routing tokenizes it.
    let parsed: Option<serde_json::Value> = match endpoint {
        Endpoint::Chat | Endpoint::Completions if model.kv.is_some() => serde_json::from_slice(&body).ok(),
        _ => None,
    };
    let ctx = RequestContext::new(rid.clone());
    let in_flight = gw.metrics.in_flight.with_label_values(&[name.as_str()]);
    in_flight.inc();
    let outcome = match wait_in_queue(gw, session, &model, endpoint, view.priority_jump(), &ctx, stream).await {
        Some(refused) => refused,
        None => proxy(gw, session, &model, endpoint, &body, parsed.as_ref(), view.nvext.as_ref(), &ctx, stream, start).await,
    };
    in_flight.dec();
    let (status, label) = match &outcome {
        Outcome::Served(s) | Outcome::Refused(s) | Outcome::Truncated(s) => (*s, s.to_string()),
        Outcome::Cancelled => (499, "499".to_string()),
    };
    gw.metrics.requests.with_label_values(&[name.as_str(), endpoint.label(), label.as_str()]).inc();
    gw.metrics.duration.with_label_values(&[name.as_str(), endpoint.label()]).observe(start.elapsed().as_secs_f64());
    tracing::debug!(request_id = %rid, model = %name, endpoint = endpoint.label(), status, stream, elapsed_ms = start.elapsed().as_millis() as u64, "request done");
    matches!(outcome, Outcome::Truncated(_))
}

/// Holds the request in the router queue while every worker is past the queue threshold.
/// `Some(outcome)` when it was refused or the client left meanwhile.
async fn wait_in_queue(
    gw: &Arc<Gateway>,
    session: &mut Session,
    model: &Arc<Model>,
    endpoint: Endpoint,
    jump: f64,
    ctx: &Arc<RequestContext>,
    stream: bool,
) -> Option<Outcome> {
    let queue = model.queue.as_ref()?;
    if !matches!(endpoint, Endpoint::Chat | Endpoint::Completions) || (model.queue_free_workers() > 0 && queue.is_empty()) {
        return None;
    }
    let name = model.cfg.name.as_str();
    let depth = gw.metrics.queued.with_label_values(&[name]);
    depth.inc();
    let r = tokio::select! {
        r = queue.wait(jump) => Some(r),
        _ = client_closed(session) => None,
    };
    depth.dec();
    let rid = [("x-request-id", ctx.id().to_string())];
    match r {
        None => {
            cancel(gw, ctx, name, endpoint, stream);
            Some(Outcome::Cancelled)
        }
        Some(Ok(waited)) => {
            gw.metrics.queue_wait.with_label_values(&[name]).observe(waited.as_secs_f64());
            None
        }
        Some(Err(kvgate_filters::route::QueueError::Full)) => {
            gw.metrics.rejected.with_label_values(&[name, "queue_full"]).inc();
            let ce = ClientError { status: 429, kind: "rate_limit_exceeded", message: format!("The router queue of model `{name}` is full; retry later."), param: None };
            respond_error(session, &ce, &rid).await;
            Some(Outcome::Refused(429))
        }
        Some(Err(kvgate_filters::route::QueueError::TimedOut)) => {
            gw.metrics.rejected.with_label_values(&[name, "queue_timeout"]).inc();
            let ce = ClientError {
                status: 503,
                kind: "service_unavailable",
                message: format!("Timed out waiting in the router queue of model `{name}`; retry later."),
                param: None,
            };
            respond_error(session, &ce, &rid).await;
            Some(Outcome::Refused(503))
        }
    }
}

/// Counts a cancellation once per request, however many signals arrive.
fn cancel(gw: &Gateway, ctx: &RequestContext, model: &str, endpoint: Endpoint, stream: bool) {
    if ctx.kill() {
        let kind = if stream { "stream" } else { "unary" };
        gw.metrics.cancellations.with_label_values(&[model, endpoint.label(), kind]).inc();
        tracing::info!(request_id = ctx.id(), model, endpoint = endpoint.label(), "client disconnected; upstream request cancelled");
    }
}

#[allow(clippy::too_many_arguments)]
async fn proxy(
    gw: &Arc<Gateway>,
    session: &mut Session,
    model: &Arc<Model>,
    endpoint: Endpoint,
    body: &Bytes,
    parsed: Option<&serde_json::Value>,
    nvext: Option<&serde_json::Value>,
    ctx: &Arc<RequestContext>,
    stream: bool,
    start: Instant,
) -> Outcome {
    let cfg = gw.config();
    // KV routing inputs, once per request: tokens → chained hashes → cached / booked overlap.
    let kv = match (&model.kv, parsed) {
        (Some(kv), Some(v)) => {
            let tokens = super::prompt::tokens(v, endpoint == Endpoint::Chat, kv.tokenizer.as_ref(), kv.max_tokens()).await.unwrap_or_default();
            let t0 = Instant::now();
            let chain = kv.chain(&tokens);
            // overlap_score_weight 0: pure load balancing, the cache is not consulted.
            let cached = if kv.policy.params().overlap_score_weight > 0.0 {
                kv.cached(&chain).to_dense(kv.slot_count())
            } else {
                vec![0; kv.slot_count()]
            };
            let active = kv.active.overlap(&chain).to_dense(model.workers.len());
            Some((kv.clone(), tokens.len(), chain, cached, active, t0.elapsed()))
        }
        _ => None,
    };
    // The client's expected output length, for output-block tracking.
    let expected_output = nvext.and_then(|v| v.pointer("/agent_hints/osl")).and_then(serde_json::Value::as_u64);
    let name = model.cfg.name.as_str();
    let rid = ctx.id().to_string();
    let rid_header = [("x-request-id", rid.clone())];
    let out = Outgoing { path: endpoint.path(), body, request_id: &rid };
    // A plugin is taken once and kept for the whole request (retries included), so a hot swap
    // never changes the policy under a request in flight.
    let plugin = model.plugin.as_ref().map(|slot| slot.current());
    // Serialized only for a plugin: other modes never read it.
    let plugin_nvext = plugin.as_ref().and(nvext).map(|v| v.to_string());
    let headers: Vec<(String, String)> = plugin.as_ref().map_or_else(Vec::new, |p| {
        let h = &session.req_header().headers;
        p.headers().iter().filter_map(|name| h.get(name.as_str()).and_then(|v| v.to_str().ok()).map(|v| (name.clone(), v.to_string()))).collect()
    });
    let summary = RequestSummary {
        model: name,
        endpoint: endpoint.label(),
        request_id: &rid,
        prompt_tokens: kv.as_ref().map_or(0, |k| k.1 as u32),
        prompt_blocks: kv.as_ref().map_or(0, |k| k.2.len() as u32),
        block_size: model.cfg.block_size,
        headers: &headers,
        nvext: plugin_nvext.as_deref(),
    };
    let mut tried: Vec<usize> = Vec::new();
    let mut last_error = String::from("no healthy worker");
    let attempts = cfg.retries.max_attempts as usize;
    // What this request adds to a worker: its uncached prompt (kv mode) or an estimate from the
    // body (4 bytes per token) for shedding in the other modes.
    let est_tokens = kv.as_ref().map_or(body.len() as u64 / 4, |k| k.1 as u64);
    let est_blocks = est_tokens / u64::from(model.cfg.block_size.max(1));
    let thresholds = gw.thresholds(name);
    for n in 0..attempts {
        let mut eligible: Vec<usize> = (0..model.workers.len()).filter(|i| model.workers[*i].is_healthy() && !tried.contains(i)).collect();
        if eligible.is_empty() {
            break;
        }
        let mut busy_now: Vec<usize> = Vec::new();
        if thresholds.enabled() {
            let (free, over): (Vec<usize>, Vec<usize>) = eligible.iter().partition(|&&i| !busy(gw, model, i, &thresholds, kv.as_ref().map(|k| &k.0)));
            busy_now = over;
            if free.is_empty() && tried.is_empty() {
                gw.metrics.rejections.with_label_values(&[name, endpoint.label()]).inc();
                gw.metrics.rejected.with_label_values(&[name, "busy"]).inc();
                super::io::respond(
                    session,
                    503,
                    "application/json",
                    Bytes::from_static(kvgate_filters::shed::REJECTION_BODY.as_bytes()),
                    &[("x-request-id", rid.clone()), ("retry-after", "1".into())],
                )
                .await;
                return Outcome::Refused(503);
            }
            if !free.is_empty() {
                eligible = free;
            }
        }
        let t_decide = Instant::now();
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|&i| {
                let w = &model.workers[i];
                let base = match &kv {
                    Some((k, _, _, cached, active, _)) => k.candidate(i, w.in_flight(), cached, active),
                    None => Candidate {
                        id: i as u32,
                        in_flight: w.in_flight(),
                        active_prefill_tokens: w.booked_prefill(),
                        active_blocks: w.booked_blocks(),
                        ..Default::default()
                    },
                };
                with_reported(base, w, busy_now.contains(&i))
            })
            .collect();
        let builtin: &dyn kvgate_filters::route::Policy = match &kv {
            Some((k, ..)) => &k.policy,
            None => model.policy.as_ref(),
        };
        let decision = match &plugin {
            Some(p) => {
                let routed = kvgate_plugins::route(p, &summary, &candidates, builtin);
                if let Some(f) = &routed.failure {
                    gw.metrics.plugin_failures.with_label_values(&[p.name(), f.kind()]).inc();
                    // One warning per trip of the breaker, not one per request.
                    match (f, p.skipped_for()) {
                        (kvgate_plugins::Failure::Skipped(_), _) => {}
                        (_, Some(skip)) => tracing::warn!(plugin = p.name(), error = %f, skip_s = skip.as_secs(), "plugin keeps failing; the fallback mode decides until the skip period ends"),
                        _ => tracing::debug!(request_id = rid.as_str(), plugin = p.name(), error = %f, "plugin failed; the fallback mode decided"),
                    }
                }
                routed.decision
            }
            None => builtin.choose(&summary, &candidates),
        };
        let idx = match decision {
            Decision::Worker(k) if k < eligible.len() => eligible[k],
            Decision::Worker(_) => eligible[0],
            Decision::Reject { status, message } => {
                let kind = match status {
                    429 => "rate_limit_exceeded",
                    503 => "service_unavailable",
                    500..=599 => "internal_server_error",
                    _ => "invalid_request_error",
                };
                let ce = ClientError { status, kind, message, param: None };
                respond_error(session, &ce, &rid_header).await;
                return Outcome::Refused(status);
            }
        };
        tried.push(idx);
        if n > 0 {
            gw.metrics.retries.with_label_values(&[name]).inc();
        }
        let worker = model.workers[idx].clone();
        gw.metrics.issued.with_label_values(&[name]).inc();
        let wurl = worker.url.to_string();
        gw.metrics.decisions.with_label_values(&[name, wurl.as_str()]).inc();
        // The load this request puts on the chosen worker, until it ends (guard).
        let chosen = &candidates[eligible.iter().position(|&e| e == idx).unwrap_or(0)];
        let cached_tokens = (u64::from(chosen.overlap_blocks) * u64::from(model.cfg.block_size)).min(est_tokens);
        let worker_booking = worker.book(est_tokens - cached_tokens, est_blocks);
        let mut kv_booking = kv.as_ref().map(|(k, n_tokens, chain, _, _, hash_time)| {
            gw.metrics.overlap.with_label_values(&[name]).observe(f64::from(chosen.overlap_blocks));
            gw.metrics.decision_time.with_label_values(&[name]).observe((t_decide.elapsed() + *hash_time).as_secs_f64());
            let prompt_tokens = *n_tokens as u64;
            let cached_tokens = (u64::from(chosen.overlap_blocks) * u64::from(model.cfg.block_size)).min(prompt_tokens);
            k.active.book(idx as u16, Load { prefill_tokens: prompt_tokens - cached_tokens, chain: chain.clone(), prompt_tokens, expected_output })
        });
        match attempt(gw, session, &worker, &out).await {
            Attempt::ClientGone => {
                cancel(gw, ctx, name, endpoint, stream);
                return Outcome::Cancelled;
            }
            Attempt::TimedOut => {
                gw.metrics.upstream_errors.with_label_values(&[name, wurl.as_str(), "first_byte_timeout"]).inc();
                respond_error(session, &ClientError::upstream_timeout(name), &rid_header).await;
                return Outcome::Refused(504);
            }
            Attempt::Retry { kind, detail } => {
                gw.metrics.upstream_errors.with_label_values(&[name, wurl.as_str(), kind]).inc();
                if kind == "connect" {
                    // A refused connection is a health signal; don't wait for the next probe.
                    worker.observe_health(false, cfg.health.unhealthy_threshold, cfg.health.healthy_threshold);
                }
                tracing::warn!(request_id = %rid, worker = %wurl, kind, detail, "upstream attempt failed");
                last_error = detail;
            }
            Attempt::Responded(mut up) => {
                let status = up.header.status.as_u16();
                let more = n + 1 < attempts && tried.len() < model.workers.len();
                if cfg.retries.on_5xx && status >= 500 && more {
                    gw.metrics.upstream_errors.with_label_values(&[name, wurl.as_str(), "status_5xx"]).inc();
                    tracing::warn!(request_id = %rid, worker = %wurl, status, "worker answered 5xx before any byte was sent; retrying elsewhere");
                    last_error = format!("{wurl} answered {status}");
                    continue; // dropping `up` closes that connection
                }
                // The client's header waits for the worker's first body bytes: vLLM sends a
                // stream's 200 at once, and a worker that dies before its first token can still
                // be replaced without the client noticing.
                // vLLM sends a stream's header at once and its first token after the prefill:
                // that wait is bounded by first_byte_ms (0 = none), like the header's.
                let first_byte = cfg.timeouts.first_byte_ms;
                let first_read = async {
                    if first_byte == 0 {
                        up.session.read_response_body().await
                    } else {
                        tokio::time::timeout(Duration::from_millis(first_byte), up.session.read_response_body())
                            .await
                            .unwrap_or_else(|_| Err(pingora::Error::explain(pingora::ErrorType::ReadTimedout, "no first byte within timeouts.first_byte_ms")))
                    }
                };
                let first = tokio::select! {
                    biased;
                    r = first_read => r,
                    _ = client_closed(session) => {
                        cancel(gw, ctx, name, endpoint, stream);
                        return Outcome::Cancelled;
                    }
                };
                match first {
                    Ok(first) => {
                        // Approximate mode learns from requests the worker took on (2xx).
                        if (200..300).contains(&status)
                            && let Some((k, _, chain, ..)) = &kv
                        {
                            k.record_decision(idx, chain);
                        }
                        let bookings = Bookings { worker: worker_booking, kv: kv_booking.take() };
                        return stream_response(gw, session, up, first, bookings, ctx, name, endpoint, stream, start).await;
                    }
                    Err(e) => {
                        gw.metrics.upstream_errors.with_label_values(&[name, wurl.as_str(), "before_first_byte"]).inc();
                        tracing::warn!(request_id = %rid, worker = %wurl, error = %e, "worker failed before its first byte; retrying elsewhere");
                        last_error = format!("{wurl}: {e}");
                    }
                }
            }
        }
    }
    let ce = if tried.is_empty() { ClientError::no_healthy_worker(name) } else { ClientError::upstream_failed(name, &last_error) };
    respond_error(session, &ce, &rid_header).await;
    Outcome::Refused(ce.status)
}

#[allow(clippy::too_many_arguments)]
async fn stream_response(
    gw: &Arc<Gateway>,
    session: &mut Session,
    mut up: Box<super::upstream::Upstream>,
    first: Option<bytes::Bytes>,
    mut booking: Bookings,
    ctx: &Arc<RequestContext>,
    name: &str,
    endpoint: Endpoint,
    stream: bool,
    start: Instant,
) -> Outcome {
    let status = up.header.status.as_u16();
    let header = match client_response_header(&up.header, ctx.id()) {
        Ok(h) => h,
        Err(_) => return Outcome::Refused(502),
    };
    if session.write_response_header(Box::new(header), false).await.is_err() {
        cancel(gw, ctx, name, endpoint, stream);
        return Outcome::Cancelled;
    }
    let ttft = gw.metrics.ttft.with_label_values(&[name, endpoint.label()]);
    let itl = gw.metrics.itl.with_label_values(&[name, endpoint.label()]);
    let mut last: Option<Instant> = None;
    let mut events = (stream && booking.tracks_output()).then(SseEventCounter::default);
    let mut pending = Some(Ok(first));
    loop {
        let idle = Duration::from_millis(gw.config().timeouts.upstream_read_idle_ms);
        let chunk = match pending.take() {
            Some(c) => c,
            None => tokio::select! {
                biased;
                r = tokio::time::timeout(idle, up.session.read_response_body()) => {
                    r.unwrap_or_else(|_| Err(pingora::Error::explain(pingora::ErrorType::ReadTimedout, "worker stalled past timeouts.upstream_read_idle_ms")))
                }
                _ = client_closed(session) => {
                    cancel(gw, ctx, name, endpoint, stream);
                    return Outcome::Cancelled; // `up` is dropped, not pooled: vLLM sees the close and aborts
                }
            },
        };
        match chunk {
            Ok(Some(bytes)) => {
                // The first token ends the request's prefill on the worker.
                booking.prefill_done();
                if let Some(counter) = events.as_mut() {
                    booking.generated(counter.feed(&bytes));
                }
                let now = Instant::now();
                if stream && status == 200 {
                    match last {
                        None => ttft.observe(now.duration_since(start).as_secs_f64()),
                        Some(prev) => itl.observe(now.duration_since(prev).as_secs_f64()),
                    }
                }
                last = Some(now);
                // When the worker's body is complete, end the client's in the same write.
                let end = up.session.response_done();
                if session.write_response_body(Some(bytes), end).await.is_err() {
                    cancel(gw, ctx, name, endpoint, stream);
                    return Outcome::Cancelled;
                }
                if end {
                    release(gw, up).await;
                    return Outcome::Served(status);
                }
            }
            Ok(None) => break,
            Err(e) => {
                // The worker died mid-response: the client gets a truncated body (the chunked
                // stream is not terminated, so clients see an error rather than a clean end).
                let wurl = format!("{}", up.peer);
                gw.metrics.upstream_errors.with_label_values(&[name, wurl.as_str(), "midstream"]).inc();
                tracing::warn!(request_id = ctx.id(), error = %e, "worker failed mid-response");
                return Outcome::Truncated(status);
            }
        }
    }
    if session.write_response_body(None, true).await.is_err() {
        cancel(gw, ctx, name, endpoint, stream);
        return Outcome::Cancelled;
    }
    release(gw, up).await;
    Outcome::Served(status)
}

/// Adds what the worker reports about itself (summed over DP ranks; usage of the fullest) and
/// its health and busy state to a candidate.
fn with_reported(mut c: Candidate, w: &crate::fleet::Worker, busy: bool) -> Candidate {
    let ranks = w.reported();
    c.total_blocks = ranks.iter().map(|r| r.total_blocks).sum();
    c.kv_usage = ranks.iter().map(|r| r.kv_usage).fold(0.0, f64::max);
    c.waiting = ranks.iter().map(|r| r.waiting).sum::<u64>().min(u64::from(u32::MAX)) as u32;
    c.healthy = w.is_healthy();
    c.busy = busy;
    c
}

/// What a request holds on its worker until it ends.
struct Bookings {
    worker: crate::fleet::InFlight,
    kv: Option<kvgate_filters::route::Booking>,
}

impl Bookings {
    fn prefill_done(&mut self) {
        self.worker.prefill_done();
        if let Some(k) = self.kv.as_mut() {
            k.prefill_done();
        }
    }

    /// Whether output tokens change the booking (kv mode with output-block tracking).
    fn tracks_output(&self) -> bool {
        self.kv.as_ref().is_some_and(|k| k.tracks_output())
    }

    fn generated(&self, tokens: u64) {
        if let Some(k) = self.kv.as_ref() {
            k.generated(tokens);
        }
    }
}

/// Whether worker `i` is over a busy threshold. Per DP rank: the worker's reported KV usage and
/// capacity, and the gateway's bookings spread evenly over the ranks (vLLM balances its ranks).
fn busy(
    gw: &Gateway,
    model: &Model,
    i: usize,
    t: &kvgate_filters::shed::Thresholds,
    kv: Option<&Arc<crate::kv_routing::KvRouting>>,
) -> bool {
    use kvgate_filters::shed::{RankLoad, worker_busy};
    let w = &model.workers[i];
    let (prefill, blocks) = match kv {
        Some(k) => (k.active.prefill_tokens(i as u16), k.active.active_blocks(i as u16)),
        None => (w.booked_prefill(), w.booked_blocks()),
    };
    let reported = w.reported();
    let dp = model.cfg.workers.get(i).map_or(1, |c| c.dp_size.max(1)) as usize;
    let ranks: Vec<RankLoad> = (0..dp)
        .map(|r| {
            let rep = reported.get(r).copied();
            RankLoad {
                booked_prefill_tokens: prefill / dp as u64,
                booked_blocks: blocks / dp as u64,
                total_blocks: rep.map_or(0, |x| x.total_blocks),
                reported_kv_usage: rep.map(|x| x.kv_usage),
                max_num_batched_tokens: model.cfg.shedding.max_num_batched_tokens.unwrap_or(0),
            }
        })
        .collect();
    let b = worker_busy(t, &ranks);
    let url = w.url.to_string();
    gw.metrics.worker_busy.with_label_values(&[model.cfg.name.as_str(), url.as_str()]).set(i64::from(b));
    b
}
