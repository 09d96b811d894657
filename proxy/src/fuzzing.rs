//! Entry points for the fuzz targets in `fuzz/` (cargo feature `fuzzing`, off in every build
//! of the product). Each runs one parser that sees outside bytes over a whole input, the way
//! the gateway runs it, and either returns what it made of them, for a target to compare with
//! a reference implementation, or checks a property the parser's docs promise and panics when
//! it does not hold (docs/fuzzing.md). Nothing here is API.

use crate::downstream::conn::ClientConn;
use crate::request::{fields, parsed::ParsedBody, track};
use crate::upstream::response::WorkerResponse;
use bytes::Bytes;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// One request a client connection read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientRequest {
    /// Its method.
    pub method: String,
    /// Its request target.
    pub target: String,
    /// Its body, decoded from its framing.
    pub body: Vec<u8>,
}

/// What a client connection read from `bytes`, sent whole and then closed: the requests in
/// order, and `Some(reason)` when reading stopped on a refusal rather than on the client's
/// close or a request's `Connection: close`.
pub async fn client_requests(bytes: &[u8]) -> (Vec<ClientRequest>, Option<String>) {
    let (mut client, server) = tokio::io::duplex(bytes.len() + 1);
    // The pipe holds the whole input: the writes complete at once.
    let _ = client.write_all(bytes).await;
    let _ = client.shutdown().await;
    let mut conn = ClientConn::new(Box::new(server));
    let mut got = Vec::new();
    loop {
        match conn.read_request(Duration::from_secs(5)).await {
            Ok(true) => {}
            Ok(false) => return (got, None),
            Err(e) => return (got, Some(e.to_string())),
        }
        let (method, target) = (conn.req().method().to_string(), conn.req().target().to_string());
        let mut body = Vec::new();
        loop {
            match conn.read_body().await {
                Ok(Some(b)) => body.extend_from_slice(&b),
                Ok(None) => break,
                Err(e) => return (got, Some(e.to_string())),
            }
        }
        got.push(ClientRequest { method, target, body });
        if !conn.keeps_alive() {
            return (got, None);
        }
    }
}

/// What the worker-side reader made of `bytes` as the response to a request (`head_request`:
/// a `HEAD`): the status and the decoded body, or why it was refused.
pub async fn worker_response(bytes: &[u8], head_request: bool) -> Result<(u16, Vec<u8>), String> {
    let (mut worker, gateway) = tokio::io::duplex(bytes.len() + 1);
    let _ = worker.write_all(bytes).await;
    let _ = worker.shutdown().await;
    let mut r = WorkerResponse::read(gateway, head_request).await.map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    while let Some(b) = r.read_body().await.map_err(|e| e.to_string())? {
        body.extend_from_slice(&b);
    }
    Ok((r.status(), body))
}

/// The one-pass reader of a request body's routing fields agrees with serde_json: it accepts
/// exactly the bodies serde_json accepts, with the same fields, and the prompt ids it reads on
/// the way are the ones [`ParsedBody`] reads (the promise in `request/fields.rs`).
pub fn request_fields(body: &[u8]) {
    let fast = fields::read(body, true);
    let reference: Result<crate::request::view::RequestView, _> = serde_json::from_slice(body);
    match (&fast, &reference) {
        (Ok((view, _)), Ok(expected)) => assert_eq!(view, expected, "the fields read differ from serde_json's"),
        (Err(_), Err(_)) => {}
        _ => panic!("accept/refuse differs from serde_json: fast {:?}, serde_json {:?}", fast.as_ref().map(|v| &v.0), reference),
    }
    let Ok((_, ids)) = fast else { return };
    let whole = ParsedBody::parse(body);
    let split = ParsedBody::parse_with(body, ids);
    match (whole, split) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "a body parsed around its prompt ids differs from the whole parse"),
        (Err(_), Err(_)) => {}
        (a, b) => panic!("parse and parse_with disagree: {a:?} / {b:?}"),
    }
}

/// The migration tracker following a worker's stream (`stream`, cut into pieces at `cuts`) for
/// a request `body` (chat or not): whatever the worker sends, it neither panics nor loses
/// bytes it passes through.
pub fn migration_tracker(chat: bool, body: &[u8], stream: &[u8], cuts: &[usize]) {
    let Ok(parsed) = serde_json::from_slice::<serde_json::Value>(body) else { return };
    let Ok((mut tracker, _)) = track::start(chat, &Bytes::copy_from_slice(body), &parsed) else { return };
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&stream.len())) {
        let end = c.clamp(at, stream.len());
        let fed = tracker.feed(&stream[at..end]);
        at = end;
        if fed.failure.is_some() {
            return;
        }
    }
    let _ = tracker.finish();
}

/// A worker's `/metrics` text.
pub fn worker_metrics(text: &str) {
    let _ = crate::tasks::worker_metrics::parse(text);
}

/// A worker's `GET /kv_event_sources` answer.
pub fn kv_event_sources(body: &[u8]) {
    let _ = crate::tasks::kv_subscribers::parse_sources(body, "127.0.0.1:8000");
}

/// A configuration file: loaded, or refused with a line and column, never a panic.
pub fn config(yaml: &str) {
    let _ = crate::config::load::load_str(yaml, "fuzz", Vec::new());
}
