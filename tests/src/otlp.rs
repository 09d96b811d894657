//! An OTLP/HTTP trace receiver for the traces tests: it takes `POST /v1/traces` bodies
//! (protobuf `ExportTraceServiceRequest`, as kvgate and vLLM's Python exporter send them) and
//! keeps every span. Under tests/real-vllm/run-suite.sh the real vLLM exports to a receiver the
//! suite started before it (tests/real-vllm/otlp_receiver.py, `KVGATE_OTLP_URL`), which writes
//! each span as a JSON line to `KVGATE_OTLP_SPANS`; [`Receiver::start`] then reads that file.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use parking_lot::Mutex;
use prost::Message;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// One span as received.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// The exporting service's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits, empty for a root.
    pub parent_span_id: String,
    /// String, integer and boolean attributes, as JSON.
    pub attributes: Value,
}

/// Where spans arrive.
pub struct Receiver {
    /// The URL to configure as `otlp_endpoint`.
    pub url: String,
    source: Source,
}

enum Source {
    Here(Arc<Mutex<Vec<Received>>>),
    File(String),
}

impl Receiver {
    /// The suite's receiver when the environment names one, else one in this process.
    pub async fn start() -> Receiver {
        if let (Ok(url), Ok(file)) = (std::env::var("KVGATE_OTLP_URL"), std::env::var("KVGATE_OTLP_SPANS")) {
            return Receiver { url, source: Source::File(file) };
        }
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().route("/v1/traces", post(take)).with_state(spans.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
        Receiver { url, source: Source::Here(spans) }
    }

    /// Whether the spans come from the suite's receiver (shared with a real vLLM).
    pub fn is_shared(&self) -> bool {
        matches!(self.source, Source::File(_))
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Received> {
        match &self.source {
            Source::Here(s) => s.lock().clone(),
            Source::File(f) => {
                std::fs::read_to_string(f).unwrap_or_default().lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).map(|v| from_json(&v)).collect()
            }
        }
    }

    /// The spans of trace `trace_id` once `done` holds for them, or what came within `limit`.
    pub async fn trace(&self, trace_id: &str, limit: Duration, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let until = tokio::time::Instant::now() + limit;
        loop {
            let spans: Vec<Received> = self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect();
            if done(&spans) || tokio::time::Instant::now() >= until {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn from_json(v: &Value) -> Received {
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    Received {
        service: s("service"),
        name: s("name"),
        trace_id: s("trace_id"),
        span_id: s("span_id"),
        parent_span_id: s("parent_span_id"),
        attributes: v["attributes"].clone(),
    }
}

async fn take(State(spans): State<Arc<Mutex<Vec<Received>>>>, body: Bytes) -> (axum::http::StatusCode, &'static str) {
    // A body that is not an export request is answered 400, as a collector answers it: a
    // change in what kvgate sends shows in its log, not as spans that never arrive.
    let Ok(req) = ExportTraceServiceRequest::decode(body) else { return (axum::http::StatusCode::BAD_REQUEST, "not an ExportTraceServiceRequest") };
    spans.lock().extend(decode(&req));
    (axum::http::StatusCode::OK, "")
}

/// Every span of an export request.
pub fn decode(req: &ExportTraceServiceRequest) -> Vec<Received> {
    let mut out = Vec::new();
    for rs in &req.resource_spans {
        let attrs = rs.resource.as_ref().map(|r| attributes(&r.attributes)).unwrap_or_default();
        let service = attrs["service.name"].as_str().unwrap_or_default().to_string();
        for ss in &rs.scope_spans {
            for span in &ss.spans {
                out.push(Received {
                    service: service.clone(),
                    name: span.name.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: attributes(&span.attributes),
                });
            }
        }
    }
    out
}

fn attributes(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> Value {
    let mut m = json!({});
    for kv in kvs {
        let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
            Some(AnyValue::StringValue(s)) => json!(s),
            Some(AnyValue::IntValue(i)) => json!(i),
            Some(AnyValue::BoolValue(b)) => json!(b),
            Some(AnyValue::DoubleValue(d)) => json!(d),
            _ => Value::Null,
        };
        m[kv.key.as_str()] = v;
    }
    m
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
