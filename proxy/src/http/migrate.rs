//! `POST /migrate` on the admin listener: move a request in flight to another worker
//! (docs/migration.md). Body `{"request_id": "…", "to": "<worker url>"?}`; without `to` the
//! model's routing mode picks the destination. The answer waits for the move: 200 with
//! `{request_id, from, to, how, generated}`; 404 for an unknown request, 400 for an unknown
//! worker or a bad body; 409 when the request cannot move (pinned, with the reason; queued or
//! finished; limit reached; already there; another move pending); 502 when the move failed;
//! 504 when it took too long. In a cluster, a request another replica holds is moved by that
//! replica (`super::forward`).

use crate::downstream::conn::ClientConn;
use crate::downstream::errors::ClientError;
use crate::downstream::io::{read_body, respond, respond_error};
use crate::gateway::Gateway;
use crate::inflight::{Phase, RequestEntry};
use crate::move_order::{MoveOrder, MoveRefused};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Longest wait for a move to be done (a continuation waits for the destination's first
/// token, which may follow a long prefill).
const MOVE_DEADLINE: Duration = Duration::from_secs(120);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    request_id: String,
    #[serde(default)]
    to: Option<String>,
}

/// Handles `POST /migrate`.
pub async fn serve(gw: &Arc<Gateway>, session: &mut ClientConn) {
    let body = match read_body(session, 64 * 1024, Duration::from_secs(10)).await {
        Ok(b) => b,
        Err(e) => {
            if let Some(ce) = e.client_error() {
                respond_error(session, &ce, &[]).await;
            }
            return;
        }
    };
    let (status, answer) = answer(gw, &body, true).await;
    respond(session, status, "application/json", Bytes::from(answer), &[]).await;
}

/// The answer to a move order with body `body`, once the move is done (status and JSON body).
/// `ask_peers`: a request this replica does not hold is asked of its peers (`super::forward`),
/// as a replica asked by a peer does not.
pub async fn answer(gw: &Arc<Gateway>, body: &[u8], ask_peers: bool) -> (u16, String) {
    let req: MoveBody = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return error(&ClientError::bad_request(format!("expected {{\"request_id\": \"…\", \"to\": \"<worker url>\"?}}: {e}"), None)),
    };
    if ask_peers
        && gw.requests.find(&req.request_id).is_none()
        && let Some(theirs) = super::forward::ask(gw, "migrate", &req.request_id, body, MOVE_DEADLINE).await
    {
        return theirs;
    }
    let (entry, ticket, order_rx) = match order(gw, &req) {
        Ok(x) => x,
        Err(ce) => return error(&ce),
    };
    match tokio::time::timeout(MOVE_DEADLINE, order_rx).await {
        Ok(Ok(Ok(r))) => (200, json!({"request_id": entry.id(), "from": r.from, "to": r.to, "how": r.how, "generated": r.generated}).to_string()),
        Ok(Ok(Err(MoveRefused::Failed(m)))) => error(&ClientError::move_failed(m)),
        Ok(Ok(Err(why))) => error(&ClientError::conflict(why.to_string())),
        // The request ended before it read the order.
        Ok(Err(_)) => error(&ClientError::conflict("the request ended before it could move")),
        Err(_) => {
            entry.mailbox.withdraw(ticket, MoveRefused::NotNow("timed out"));
            error(&ClientError::move_timeout(MOVE_DEADLINE.as_secs()))
        }
    }
}

fn error(e: &ClientError) -> (u16, String) {
    (e.status, e.body())
}

type Reply = tokio::sync::oneshot::Receiver<Result<crate::move_order::MoveReport, MoveRefused>>;

/// Checks what can be checked here and posts the order.
fn order(gw: &Gateway, req: &MoveBody) -> Result<(Arc<RequestEntry>, u64, Reply), ClientError> {
    let entry = gw.requests.find(&req.request_id).ok_or_else(|| ClientError::unknown_request(&req.request_id))?;
    if let Some(reason) = entry.pinned() {
        return Err(ClientError::conflict(MoveRefused::Pinned(reason).to_string()));
    }
    if !entry.stream {
        return Err(ClientError::conflict(MoveRefused::Pinned("unary").to_string()));
    }
    match entry.phase() {
        Phase::Waiting | Phase::Running => {}
        p => return Err(ClientError::conflict(format!("the request is {}, not on a worker", p.name()))),
    }
    if entry.moves() >= u64::from(gw.config().migration.limit) {
        return Err(ClientError::conflict("the request reached migration.limit"));
    }
    let to = match &req.to {
        None => None,
        Some(name) => {
            let name = name.trim_end_matches('/');
            // The fleet in force: a worker added since the request arrived is a valid target.
            let fleet = gw.fleet();
            let model = fleet.models.get(&*entry.model).cloned();
            let workers = model.as_ref().map(|m| m.workers.clone()).unwrap_or_default();
            let at = workers.iter().position(|w| w.label == name || w.url.to_string().trim_end_matches('/') == name);
            let at = at.ok_or_else(|| ClientError::bad_request(format!("no worker {name:?} serves model {:?}", entry.model), Some("to")))?;
            if model.as_ref().is_some_and(|m| !m.role(at).answers()) {
                return Err(ClientError::conflict(format!("worker {name} is a prefill worker: it serves no stream")));
            }
            let w = workers[at].clone();
            if entry.worker().is_some_and(|cur| Arc::ptr_eq(&cur, &w)) {
                return Err(ClientError::conflict(format!("the request is already on {name}")));
            }
            if !w.is_healthy() {
                return Err(ClientError::conflict(format!("worker {name} is unhealthy")));
            }
            if w.is_paused() {
                return Err(ClientError::conflict(format!("worker {name} is paused or asleep (a fleet operation)")));
            }
            Some(w)
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let ticket = entry
        .mailbox
        .post(MoveOrder { to, reason: crate::move_order::MoveReason::Admin, reply: tx })
        .map_err(|_| ClientError::conflict("another move of this request is pending, or it ended"))?;
    Ok((entry, ticket, rx))
}
