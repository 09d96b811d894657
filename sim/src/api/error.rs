//! Error responses in vLLM's JSON shape: `{"error":{"message","type","param","code"}}` with the
//! HTTP status equal to `code`. Request-validation failures use the type `"Bad Request"` (the
//! HTTP phrase, as vLLM's FastAPI validation handler does); semantic ones use the OpenAI error
//! class names (`BadRequestError`, `NotFoundError`, ...).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// An error to send to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// `type` field.
    pub kind: &'static str,
    /// `param` field.
    pub param: Option<String>,
}

impl ApiError {
    /// 400 BadRequestError.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "BadRequestError", param: param.map(str::to_owned) }
    }

    /// 400 for a body that does not parse or has wrong types.
    pub fn validation(message: impl Into<String>, param: &str) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "Bad Request", param: Some(param.to_owned()) }
    }

    /// 404 for an unknown model.
    pub fn model_not_found(model: &str, valid: &[String]) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist. Valid aliases: {}.", valid.join(", ")),
            kind: "NotFoundError",
            param: Some("model".into()),
        }
    }

    /// 500, as injected by failure injection or on an engine that stopped.
    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "InternalServerError", param: None }
    }

    /// 500 for a request that finished with an error in the engine (a failed KV pull under
    /// `kv_load_failure_policy: "fail"`): vLLM's `GenerationError`.
    pub fn generation_failed() -> Self {
        Self::internal("Internal server error")
    }

    /// 503 from admission control (`--max-num-queued-reqs`), vLLM's exact message.
    pub fn busy() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance.".into(),
            kind: "Service Unavailable",
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

/// A JSON response with the given status.
pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}
