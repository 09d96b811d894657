//! Client-facing errors: OpenAI-shaped JSON (`{"error":{"message","type","param","code"}}`),
//! except Dynamo's load-shedding body for "every worker is busy", with one constructor per
//! situation so status codes and types are decided in one place. Nothing else builds a
//! `ClientError`.

use serde_json::json;

/// An error to answer a client with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientError {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error type.
    pub kind: &'static str,
    /// Message.
    pub message: String,
    /// Offending parameter.
    pub param: Option<&'static str>,
    /// Seconds the client should wait before retrying (`Retry-After`), if any.
    pub retry_after: Option<u32>,
    /// A fixed body that replaces the OpenAI shape (Dynamo's load-shedding rejection body).
    fixed_body: Option<&'static str>,
    /// Written in the Anthropic API's error shape (a `/v1/messages` client's SDK reads that).
    anthropic: bool,
    /// A tenant's limits, shown as the API's rate-limit headers.
    limits: Option<Box<kvgate_filters::tenant::Snapshot>>,
    /// Whether the client should not retry (`x-should-retry: false`): nothing will change by
    /// waiting.
    final_: bool,
    /// The exact wait behind `retry_after`, ms (`retry-after-ms`), when a limit gave one.
    wait_ms: Option<u64>,
}

impl ClientError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status, kind, message: message.into(), param, retry_after: None, fixed_body: None, anthropic: false, limits: None, final_: false, wait_ms: None }
    }

    /// 400: the body is not a JSON object or a field has the wrong type.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::new(400, "invalid_request_error", message, param)
    }

    /// 404: no such model.
    pub fn unknown_model(model: &str, known: &[String]) -> Self {
        Self::new(404, "invalid_request_error", format!("The model `{model}` does not exist. Served models: {}.", known.join(", ")), Some("model"))
    }

    /// 404: no such path.
    pub fn not_found(path: &str) -> Self {
        Self::new(404, "invalid_request_error", format!("No route for {path}"), None)
    }

    /// 403: one of vLLM's operator endpoints, asked for on the public listener.
    pub fn control_path(path: &str) -> Self {
        Self::new(
            403,
            "permission_error",
            format!("{path} is a vLLM control endpoint; kvgate does not forward it from the public listener (fleet operations are on the admin listener)."),
            None,
        )
    }

    /// 404: a path the configuration's `passthrough` rules keep from the workers.
    pub fn not_passed_through(path: &str) -> Self {
        Self::new(404, "invalid_request_error", format!("No route for {path} (not passed through: the gateway's passthrough rules)"), None)
    }

    /// 404: a stored response whose worker has left the fleet (no other worker holds it).
    pub fn stored_response_gone(id: &str, worker: &str) -> Self {
        Self::new(
            404,
            "invalid_request_error",
            format!("Response with id '{id}' not found: it was stored on worker {worker}, which is no longer in the fleet."),
            Some("response_id"),
        )
    }

    /// 404: no request with this id is in flight or kept as finished.
    pub fn unknown_request(id: &str) -> Self {
        Self::new(404, "invalid_request_error", format!("No request `{id}` is in flight or among the recently finished ones."), None)
    }

    /// 409: the request exists but cannot do what was asked now (a move of a pinned request).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, "conflict_error", message, None)
    }

    /// 502: a move was tried and failed.
    pub fn move_failed(message: impl Into<String>) -> Self {
        Self::new(502, "migration_error", message, None)
    }

    /// 504: a move did not finish in time.
    pub fn move_timeout(secs: u64) -> Self {
        Self::new(504, "migration_error", format!("the move did not finish within {secs} s"), None)
    }

    /// 431: the request head is over the gateway's limits.
    pub fn header_too_large() -> Self {
        Self::new(
            431,
            "invalid_request_error",
            format!("The request head is over {} bytes or {} headers.", crate::h1::request_head::MAX_HEAD, crate::h1::request_head::MAX_HEADERS),
            None,
        )
    }

    /// 401: an admin endpoint without the admin token, or with a wrong one.
    pub fn unauthorized() -> Self {
        Self::new(401, "authentication_error", "This admin endpoint requires the admin token: Authorization: Bearer <token>.".to_string(), None)
    }

    /// 405: the path exists, the method does not.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(405, "invalid_request_error", format!("Method {method} is not allowed on {path}"), None)
    }

    /// 413: body over `max_body_bytes`.
    pub fn too_large(limit: u64) -> Self {
        Self::new(413, "invalid_request_error", format!("Request body exceeds the gateway's limit of {limit} bytes."), None)
    }

    /// 503: no worker of the model is healthy.
    pub fn no_healthy_worker(model: &str) -> Self {
        Self::new(503, "service_unavailable", format!("No healthy worker is available for model `{model}`. Retry later."), None)
    }

    /// 503: an operator paused the model's workers (a weight update, say) for longer than a
    /// request may wait.
    pub fn paused(model: &str) -> Self {
        let mut e = Self::new(503, "service_unavailable", format!("The workers of model `{model}` are paused by an operator; retry later."), None);
        e.retry_after = Some(1);
        e
    }

    /// 503: shutting down.
    pub fn draining() -> Self {
        Self::new(503, "service_unavailable", "The gateway is shutting down; retry on another instance.", None)
    }

    /// 502: every attempt failed before a response started.
    pub fn upstream_failed(model: &str, detail: &str) -> Self {
        Self::new(502, "upstream_error", format!("Could not get a response from any worker of model `{model}`: {detail}"), None)
    }

    /// 504: no response header within `timeouts.first_byte_ms`.
    pub fn upstream_timeout(model: &str) -> Self {
        Self::new(504, "upstream_error", format!("A worker of model `{model}` did not start responding in time."), None)
    }

    /// 408: the client did not send its body in time.
    pub fn body_timeout() -> Self {
        Self::new(408, "invalid_request_error", "Timed out reading the request body.", None)
    }

    /// 429 with `Retry-After: 1`: the client has `per_client.max_concurrent` requests in flight.
    pub fn client_limit(max: u32) -> Self {
        let mut e = Self::new(
            429,
            "rate_limit_exceeded",
            format!("This client has {max} requests in flight, the most the gateway allows at once; retry when one ends."),
            None,
        );
        e.retry_after = Some(1);
        e
    }

    /// 401: no API key, or one no tenant has, where keys are required. The key is never
    /// repeated.
    pub fn invalid_key(missing: bool) -> Self {
        let message = if missing {
            "You didn't provide an API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`."
        } else {
            "Incorrect API key provided."
        };
        Self::new(401, "invalid_request_error", message, None)
    }

    /// 429: a tenant's limit refuses the request, with the limits' state as rate-limit headers
    /// and the wait until it would fit as `Retry-After`; a request larger than the limit itself
    /// is told not to retry.
    pub fn rate_limited(tenant: &str, e: &kvgate_filters::tenant::Exceeded) -> Self {
        use kvgate_filters::tenant::Dimension;
        let what = match e.dimension {
            Dimension::Requests => "requests per minute",
            Dimension::InputTokens => "input tokens per minute",
            Dimension::OutputTokens => "output tokens per minute",
            Dimension::Concurrent => "concurrent requests",
        };
        let limit = match e.dimension {
            Dimension::Requests => e.snapshot.requests.map(|l| (l.limit, l.remaining)),
            Dimension::InputTokens => e.snapshot.input.map(|l| (l.limit, l.remaining)),
            Dimension::OutputTokens => e.snapshot.output.map(|l| (l.limit, l.remaining)),
            Dimension::Concurrent => Some((u64::from(e.snapshot.concurrent.1), u64::from(e.snapshot.concurrent.1.saturating_sub(e.snapshot.concurrent.0)))),
        };
        let (limit, remaining) = limit.unwrap_or_default();
        let when = match e.retry_after {
            Some(d) => format!("Please try again in {}.", super::rate_limit::go_duration(d)),
            None => "The request is larger than the limit and will not fit; make it smaller.".to_string(),
        };
        let mut ce = Self::new(
            429,
            "rate_limit_exceeded",
            format!("Rate limit reached for tenant `{tenant}` on {what}: Limit {limit}, Remaining {remaining}, Requested {}. {when}", e.requested),
            None,
        );
        // Whole seconds, rounded up, as `Retry-After` allows; `retry-after-ms` (which both SDKs
        // prefer) says it exactly.
        ce.retry_after = e.retry_after.map(|d| u32::try_from(d.as_secs() + u64::from(d.subsec_nanos() > 0)).unwrap_or(u32::MAX).max(1));
        ce.final_ = e.retry_after.is_none();
        ce.wait_ms = e.retry_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).saturating_add(1));
        ce.limits = Some(Box::new(e.snapshot));
        ce
    }

    /// The headers that go with the body: `retry-after`, the rate-limit headers in the API's
    /// form, `x-should-retry`.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(s) = self.retry_after {
            h.push(("retry-after", s.to_string()));
        }
        if let Some(limits) = &self.limits {
            if let Some(ms) = self.wait_ms {
                h.push(("retry-after-ms", ms.to_string()));
            }
            h.extend(if self.anthropic { super::rate_limit::anthropic(limits, std::time::SystemTime::now()) } else { super::rate_limit::openai(limits) });
        }
        if self.final_ {
            h.push(("x-should-retry", "false".into()));
        }
        h
    }

    /// 429: the router queue of the model is full.
    pub fn queue_full(model: &str) -> Self {
        Self::new(429, "rate_limit_exceeded", format!("The router queue of model `{model}` is full; retry later."), None)
    }

    /// 503: the request waited in the router queue for too long.
    pub fn queue_timeout(model: &str) -> Self {
        Self::new(503, "service_unavailable", format!("Timed out waiting in the router queue of model `{model}`; retry later."), None)
    }

    /// 503 with Dynamo's exact rejection body: every worker of the model is over a busy threshold.
    pub fn all_busy() -> Self {
        let mut e = Self::new(503, "service_unavailable", "All workers are busy, please retry later", None);
        e.retry_after = Some(1);
        e.fixed_body = Some(kvgate_filters::shed::REJECTION_BODY);
        e
    }

    /// A routing plugin's rejection, with the status it chose.
    pub fn rejected(status: u16, message: String) -> Self {
        let kind = match status {
            429 => "rate_limit_exceeded",
            503 => "service_unavailable",
            500..=599 => "internal_server_error",
            _ => "invalid_request_error",
        };
        Self::new(status, kind, message, None)
    }

    /// 502: the worker's response could not be passed on.
    pub fn bad_upstream_response(detail: &str) -> Self {
        Self::new(502, "upstream_error", format!("The worker's response could not be passed on: {detail}"), None)
    }

    /// 500: the gateway failed internally.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal_server_error", message, None)
    }

    /// The same error in the Anthropic API's shape,
    /// `{"type":"error","error":{"type","message"}}`, with Anthropic's type for the status.
    pub fn anthropic(self) -> Self {
        Self { anthropic: true, ..self }
    }

    /// The Anthropic API's error type for this status.
    fn anthropic_kind(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        if self.anthropic {
            return json!({"type": "error", "error": {"type": self.anthropic_kind(), "message": self.message}}).to_string();
        }
        if let Some(fixed) = self.fixed_body {
            return fixed.to_string();
        }
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_openai_shaped_except_the_seed_rejection() {
        let v: serde_json::Value = serde_json::from_str(&ClientError::queue_full("m").body()).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_exceeded");
        assert_eq!(v["error"]["code"], 429);
        let busy = ClientError::all_busy();
        assert_eq!(busy.body(), kvgate_filters::shed::REJECTION_BODY);
        assert_eq!((busy.status, busy.retry_after), (503, Some(1)));
        assert_eq!(ClientError::rejected(418, "no".into()).kind, "invalid_request_error");
        assert_eq!(ClientError::rejected(502, "no".into()).kind, "internal_server_error");
    }

    #[test]
    fn anthropic_clients_get_anthropics_shape() {
        let v: serde_json::Value = serde_json::from_str(&ClientError::unknown_model("m", &["a".into()]).anthropic().body()).unwrap();
        assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("not_found_error")));
        assert!(v["error"]["message"].as_str().unwrap().contains("`m`"));
        let busy: serde_json::Value = serde_json::from_str(&ClientError::all_busy().anthropic().body()).unwrap();
        assert_eq!(busy["error"]["type"], "overloaded_error");
    }
}
