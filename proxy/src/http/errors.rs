//! Client-facing errors: OpenAI-shaped JSON (`{"error":{"message","type","param","code"}}`),
//! one constructor per situation so status codes and types are decided in one place.

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
}

impl ClientError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status, kind, message: message.into(), param }
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

    /// 405.
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

    /// The JSON body.
    pub fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}).to_string()
    }
}
