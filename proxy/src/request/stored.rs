//! The Responses API's stored responses, seen from a request: which stored response it makes
//! (remembered with its worker once that worker answers) and which it refers to
//! (`previous_response_id`, or the id in `GET /v1/responses/{id}` and its `/cancel`), which only
//! the worker that stored it can serve (`crate::fleet::StoredResponses`).
//!
//! vLLM names a response after the body's `request_id` (its default is a fresh
//! `resp_<uuid>`), so a request that names none is given one here, in vLLM's own form, and the
//! gateway knows the id before the worker answers, for a stream as for a unary answer.

use crate::endpoint::{Endpoint, stored_response_id};
use crate::error::GatewayError;
use crate::fleet::Model;
use crate::gateway::Gateway;
use bytes::Bytes;
use serde::Deserialize;

/// The stored responses a request makes and refers to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredRefs {
    /// The id of the response this request makes.
    pub makes: Option<Box<str>>,
    /// The stored response it refers to.
    pub refers_to: Option<Box<str>>,
}

/// The fields read from a Responses request.
#[derive(Deserialize)]
struct Fields {
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
}

/// What a request to `endpoint` at `path` makes and refers to, and its body as the worker is to
/// get it (a `/v1/responses` body naming no `request_id` is given one). `None` for every other
/// request.
pub fn read(endpoint: Endpoint, path: &str, body: Bytes) -> (Option<StoredRefs>, Bytes) {
    match endpoint {
        Endpoint::Passthrough => (stored_response_id(path).map(|id| StoredRefs { makes: None, refers_to: Some(id.into()) }), body),
        // A body that is not a Responses object is the worker's to refuse.
        Endpoint::Responses => match serde_json::from_slice::<Fields>(&body) {
            Ok(f) => {
                let refers_to = f.previous_response_id.filter(|id| !id.is_empty()).map(Into::into);
                match f.request_id {
                    Some(id) => (Some(StoredRefs { makes: Some(id.into()), refers_to }), body),
                    None => {
                        let id = new_response_id();
                        let body = with_request_id(&body, &id).unwrap_or(body);
                        (Some(StoredRefs { makes: Some(id.into()), refers_to }), body)
                    }
                }
            }
            Err(_) => (None, body),
        },
        _ => (None, body),
    }
}

/// The index of the worker of `model` that stored the response `refs` refers to: `None` when
/// the gateway does not know it (any worker is asked, and answers as vLLM does); an error when
/// that worker has left the fleet, since no other worker holds the response.
pub fn home(gw: &Gateway, model: &Model, refs: &StoredRefs) -> Option<Result<usize, GatewayError>> {
    let id = refs.refers_to.as_deref()?;
    let url = gw.stored_responses.home_of(id)?;
    Some(model.workers.iter().position(|w| w.url == url).ok_or_else(|| GatewayError::StoredResponseGone { id: id.to_string(), worker: url.authority }))
}

/// Remembers the worker that answered a request making a stored response, and shares it with
/// the deployment's other replicas.
pub fn answered(gw: &Gateway, refs: Option<&StoredRefs>, worker: &crate::fleet::Worker, status: u16) {
    if let Some(id) = refs.and_then(|r| r.makes.as_deref()).filter(|_| status < 300) {
        gw.stored_responses.remember(id, &worker.url);
        gw.cluster.share_response(id, &worker.url);
    }
}

/// A response id in vLLM 0.32's form: `resp_` and 16 hex digits (64 bits, as its
/// `random_uuid`).
fn new_response_id() -> String {
    crate::ids::hex_id("resp_", crate::ids::fresh_bits())
}

/// `body` (a JSON object) with `"request_id": id` as its first member; `None` when the body
/// does not start as an object.
fn with_request_id(body: &[u8], id: &str) -> Option<Bytes> {
    let open = body.iter().position(|c| !c.is_ascii_whitespace()).filter(|&i| body[i] == b'{')?;
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + id.len() + 16);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(b"\"request_id\":\"");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(if empty { b"\"" } else { b"\"," });
    out.extend_from_slice(rest);
    Some(out.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn a_responses_request_naming_no_id_is_given_one_in_vllms_form() {
        let body = Bytes::from(json!({"model": "m", "input": "hi", "previous_response_id": "resp_a"}).to_string());
        let (refs, sent) = read(Endpoint::Responses, "/v1/responses", body);
        let refs = refs.unwrap();
        let v: Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(v["request_id"].as_str(), refs.makes.as_deref());
        assert_eq!((v["input"].as_str(), v["model"].as_str()), (Some("hi"), Some("m")), "the rest is unchanged");
        let id = refs.makes.unwrap();
        assert!(id.starts_with("resp_") && id.len() == 21 && id[5..].bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
        assert_eq!(refs.refers_to.as_deref(), Some("resp_a"));
    }

    #[test]
    fn a_clients_own_id_is_kept_and_the_body_untouched() {
        let body = Bytes::from_static(br#"{"request_id":"resp_mine","input":"x"}"#);
        let (refs, sent) = read(Endpoint::Responses, "/v1/responses", body.clone());
        assert_eq!(sent, body);
        assert_eq!(refs.unwrap().makes.as_deref(), Some("resp_mine"));
    }

    #[test]
    fn ids_go_into_empty_and_spaced_objects() {
        let v = |b: &[u8]| serde_json::from_slice::<Value>(&with_request_id(b, "resp_1").unwrap()).unwrap();
        assert_eq!(v(b"{}"), json!({"request_id": "resp_1"}));
        assert_eq!(v(b"  { } "), json!({"request_id": "resp_1"}));
        assert_eq!(v(b" {\n\"a\":1}"), json!({"request_id": "resp_1", "a": 1}));
        assert!(with_request_id(b"[1]", "x").is_none());
    }

    #[test]
    fn stored_response_paths_refer_to_their_id() {
        let (refs, _) = read(Endpoint::Passthrough, "/v1/responses/resp_9/cancel", Bytes::new());
        assert_eq!(refs.unwrap().refers_to.as_deref(), Some("resp_9"));
        assert_eq!(read(Endpoint::Passthrough, "/version", Bytes::new()).0, None);
        assert_eq!(read(Endpoint::Chat, "/v1/chat/completions", Bytes::from_static(b"{}")).0, None);
    }
}
