//! vLLM's NixlConnector protocol (pull mode) between simulated workers: what a request's
//! `kv_transfer_params` ask of the engine, what a prefill worker answers, and the "side
//! channel" a decode worker pulls blocks over.
//!
//! The protocol is vLLM 0.32's, field for field (docs/vllm-sim-pd.md):
//! - a prefill leg carries `{"do_remote_decode": true, …}`; a producer (`kv_producer`,
//!   `kv_both`) runs it, holds its blocks when it finishes, and answers with the
//!   `kv_transfer_params` of [`prefill_reply`] (NixlConnector's `request_finished`,
//!   `vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`);
//! - a decode leg carries that reply; a consumer (`kv_consumer`, `kv_both`) pulls the blocks
//!   and computes only the prompt's last token (`get_num_new_matched_tokens` there, and
//!   `_update_waiting_for_remote_kv` in `vllm/v1/core/sched/scheduler.py`);
//! - parameters missing a field, or for a role the server does not play, are ignored (vLLM
//!   logs "Got invalid KVTransferParams" and serves the request aggregated); a server without a
//!   connector ignores them all, and every response but a held prefill leg's says
//!   `"kv_transfer_params": null`.
//!
//! Where real NIXL reads GPU memory over RDMA after a ZMQ handshake on the prefill worker's
//! side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST`/`PORT`), the sim's side channel is the prefill
//! worker's own HTTP address: the decode worker waits the transfer time of the timing model,
//! then `POST /kv_transfer/pull` ([`PullRequest`]) frees the held blocks there, as NIXL's
//! completion notification does. [`post_json`] is that client, small enough to need nothing
//! beyond hyper.

use crate::config::KvTransferConfig;
use crate::kv_cache::BlockId;
use crate::scheduler::{HeldKv, KvTransfer, RemotePrefill};
use axum::body::Body;
use bytes::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

/// The internal endpoint a decode worker pulls a prefill worker's blocks through.
pub const PULL_PATH: &str = "/kv_transfer/pull";

/// How long a pull may take on the wire before the decode worker gives up (its failure policy
/// then applies).
const PULL_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest answer read.
const MAX_REPLY_BYTES: usize = 64 << 20;

/// The body of `POST /kv_transfer/pull`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequest {
    /// The engine the decode worker thinks it pulls from.
    pub remote_engine_id: String,
    /// The held request.
    pub remote_request_id: String,
    /// The blocks read (per KV cache group; one group).
    pub remote_block_ids: Vec<Vec<BlockId>>,
}

/// Reads a request's `kv_transfer_params` as this server's connector would: `None` (serve
/// aggregated), a prefill leg to hold, or a decode leg to pull. Only the first choice of a
/// request takes part (`choice` 0): its other choices run aggregated.
pub fn plan(cfg: &KvTransferConfig, params: Option<&Value>, choice: usize) -> KvTransfer {
    let Some(p) = params.filter(|_| cfg.enabled() && choice == 0).and_then(Value::as_object) else { return KvTransfer::None };
    let flag = |k: &str| p.get(k).and_then(Value::as_bool) == Some(true);
    if flag("do_remote_decode") && cfg.is_producer() {
        return KvTransfer::Hold;
    }
    if flag("do_remote_prefill") && cfg.is_consumer() {
        return match remote_prefill(p) {
            Some(r) => KvTransfer::Pull(Arc::new(r)),
            None => {
                tracing::warn!(params = %serde_json::Value::Object(p.clone()), "Got invalid KVTransferParams; this request will not utilize KVTransfer");
                KvTransfer::None
            }
        };
    }
    KvTransfer::None
}

/// The decode leg's view of a prefill worker's reply, if every field NIXL needs is there.
fn remote_prefill(p: &serde_json::Map<String, Value>) -> Option<RemotePrefill> {
    let text = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_owned);
    // A list per KV cache group (vLLM ≥ 0.11); a flat list from older workers.
    let ids = p.get("remote_block_ids")?.as_array()?;
    let group = match ids.first() {
        Some(Value::Array(g)) => g,
        _ => ids,
    };
    let block_ids: Vec<BlockId> = group.iter().map(|v| v.as_u64().and_then(|b| BlockId::try_from(b).ok())).collect::<Option<_>>()?;
    if block_ids.is_empty() {
        return None;
    }
    Some(RemotePrefill {
        engine_id: text("remote_engine_id")?,
        request_id: text("remote_request_id")?,
        host: text("remote_host")?,
        port: p.get("remote_port")?.as_u64().and_then(|v| u16::try_from(v).ok())?,
        block_ids,
    })
}

/// Where this server can be reached for pulls: its HTTP address (loopback when bound to every
/// interface; bind a routable `--host` for workers on other machines).
pub fn side_channel(listen: std::net::SocketAddr) -> (String, u16) {
    let ip = if listen.ip().is_unspecified() { "127.0.0.1".to_owned() } else { listen.ip().to_string() };
    (ip, listen.port())
}

/// The `kv_transfer_params` of a held prefill leg's response, NixlConnector's
/// `request_finished` reply field for field.
pub fn prefill_reply(cfg: &KvTransferConfig, request_id: &str, listen: std::net::SocketAddr, held: &HeldKv, expiry_unix: f64) -> Value {
    let (host, port) = side_channel(listen);
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [held.block_ids],
        "remote_engine_id": cfg.engine_id(),
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": held.num_tokens,
        "remote_blocks_expiry_time": expiry_unix,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": held.num_cached_tokens,
    })
}

/// Pulls `blocks` of a held request from the prefill worker: frees them there. `Ok` with the
/// number of blocks freed, or why the pull failed (unreachable, unknown or expired request).
pub async fn pull(remote: &RemotePrefill, blocks: &[BlockId]) -> Result<usize, String> {
    let body =
        PullRequest { remote_engine_id: remote.engine_id.clone(), remote_request_id: remote.request_id.clone(), remote_block_ids: vec![blocks.to_vec()] };
    let body = serde_json::to_value(&body).map_err(|e| e.to_string())?;
    let call = post_json(&remote.host, remote.port, PULL_PATH, &body);
    let (status, bytes) = tokio::time::timeout(PULL_TIMEOUT, call).await.map_err(|_| format!("no answer in {PULL_TIMEOUT:?}"))??;
    let reply: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if status != StatusCode::OK {
        let why = reply.pointer("/error/message").and_then(Value::as_str).map_or_else(|| String::from_utf8_lossy(&bytes).into_owned(), str::to_owned);
        return Err(format!("HTTP {status}: {why}"));
    }
    reply["released_blocks"].as_u64().map(|n| n as usize).ok_or_else(|| format!("unexpected answer: {reply}"))
}

/// POSTs a JSON body to `http://host:port{path}`; the status and the whole body. The side
/// channel's client.
pub async fn post_json(host: &str, port: u16, path: &str, body: &Value) -> Result<(StatusCode, Bytes), String> {
    http_request(hyper::Method::POST, host, port, path, Some(body)).await
}

/// One HTTP/1.1 request on a fresh connection (with a JSON body, if any); the status and the
/// whole body. Small enough to need nothing beyond hyper; tests use it too.
pub async fn http_request(method: hyper::Method, host: &str, port: u16, path: &str, body: Option<&Value>) -> Result<(StatusCode, Bytes), String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("{what} {host}:{port}{path}: {e}");
    let stream = tokio::net::TcpStream::connect((host, port)).await.map_err(|e| fail("cannot connect to", &e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| fail("handshake with", &e))?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, format!("{host}:{port}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .map_err(|e| fail("cannot build a request to", &e))?;
    let resp = sender.send_request(req).await.map_err(|e| fail("no answer from", &e))?;
    let status = resp.status();
    let bytes = axum::body::to_bytes(Body::new(resp.into_body()), MAX_REPLY_BYTES).await.map_err(|e| fail("cannot read the answer of", &e))?;
    Ok((status, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(role: &str) -> KvTransferConfig {
        KvTransferConfig { kv_connector: Some("NixlConnector".into()), kv_role: Some(role.into()), engine_id: Some("e".into()), ..Default::default() }
    }

    fn decode_params() -> Value {
        json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3, 4]], "remote_engine_id": "p",
               "remote_request_id": "cmpl-1-abc", "remote_host": "127.0.0.1", "remote_port": 8001, "tp_size": 1})
    }

    #[test]
    fn requests_are_planned_by_role() {
        let prefill = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                             "remote_host": null, "remote_port": null});
        assert_eq!(plan(&cfg("kv_producer"), Some(&prefill), 0), KvTransfer::Hold);
        assert_eq!(plan(&cfg("kv_both"), Some(&prefill), 0), KvTransfer::Hold);
        assert_eq!(plan(&cfg("kv_consumer"), Some(&prefill), 0), KvTransfer::None);
        assert_eq!(plan(&cfg("kv_both"), Some(&prefill), 1), KvTransfer::None, "only the first choice takes part");
        assert_eq!(plan(&KvTransferConfig::default(), Some(&prefill), 0), KvTransfer::None, "no connector: ignored");
        assert_eq!(plan(&cfg("kv_both"), None, 0), KvTransfer::None);
        let KvTransfer::Pull(r) = plan(&cfg("kv_consumer"), Some(&decode_params()), 0) else { panic!("a pull") };
        assert_eq!(
            (r.engine_id.as_str(), r.request_id.as_str(), r.host.as_str(), r.port, r.block_ids.clone()),
            ("p", "cmpl-1-abc", "127.0.0.1", 8001, vec![3, 4])
        );
        assert_eq!(plan(&cfg("kv_producer"), Some(&decode_params()), 0), KvTransfer::None);
    }

    #[test]
    fn incomplete_decode_params_are_served_aggregated() {
        for drop in ["remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"] {
            let mut p = decode_params();
            p.as_object_mut().unwrap().remove(drop);
            assert_eq!(plan(&cfg("kv_both"), Some(&p), 0), KvTransfer::None, "{drop}");
        }
        let mut flat = decode_params();
        flat["remote_block_ids"] = json!([7, 8]);
        assert!(matches!(plan(&cfg("kv_both"), Some(&flat), 0), KvTransfer::Pull(r) if r.block_ids == vec![7, 8]));
        let mut empty = decode_params();
        empty["remote_block_ids"] = json!([[]]);
        assert_eq!(plan(&cfg("kv_both"), Some(&empty), 0), KvTransfer::None);
    }

    #[test]
    fn prefill_reply_has_nixls_fields() {
        let held = HeldKv { block_ids: vec![5, 6, 7], num_tokens: 40, num_cached_tokens: 16 };
        let v = prefill_reply(&cfg("kv_producer"), "cmpl-x-1", "0.0.0.0:9000".parse().unwrap(), &held, 12.5);
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "do_remote_prefill",
                "do_remote_decode",
                "remote_block_ids",
                "remote_engine_id",
                "remote_request_id",
                "remote_host",
                "remote_port",
                "tp_size",
                "dcp_size",
                "pp_size",
                "remote_num_tokens",
                "remote_blocks_expiry_time",
                "transfer_mode",
                "remote_prefill_cached_tokens"
            ]
        );
        assert_eq!(v["remote_block_ids"], json!([[5, 6, 7]]));
        assert_eq!((v["remote_host"].as_str(), v["remote_port"].as_u64()), (Some("127.0.0.1"), Some(9000)));
        assert_eq!((v["remote_num_tokens"].as_u64(), v["remote_prefill_cached_tokens"].as_u64()), (Some(40), Some(16)));
    }
}
