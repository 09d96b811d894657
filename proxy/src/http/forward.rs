//! Admin requests about a request another replica holds (docs/replicas.md, "Any replica
//! answers"): `GET /requests/{id}` and `POST /migrate` for a request not in this replica's
//! registry are asked of every peer over NATS (request-reply on the deployment's `ask`
//! subject); the peer holding it answers as it would itself, the others answer 404
//! (`super::asks`, run by the cluster task).

use crate::cluster::wire::{Answer, Ask};
use crate::gateway::Gateway;
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// Asks the peers for the answer to `what` (`request` or `migrate`) about request `id`, with
/// the admin request's `body`: the holder's answer, or `None` when no peer holds it (or there
/// is no cluster, or NATS is unreachable). `wait` bounds a holder's work (a move) on top of
/// `forward_timeout_ms`.
pub async fn ask(gw: &Arc<Gateway>, what: &str, id: &str, body: &[u8], wait: Duration) -> Option<(u16, String)> {
    let s = gw.cluster.shared()?;
    let client = s.client()?;
    let peers = s.members.lock().len();
    if peers == 0 {
        return None;
    }
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.ok()?;
    let ask = Ask { from: s.replica.clone(), what: what.to_string(), id: id.to_string(), body: String::from_utf8_lossy(body).into_owned() };
    let payload = serde_json::to_vec(&ask).ok()?;
    if client.publish_with_reply(s.subjects.ask.clone(), inbox, payload.into()).await.is_err() {
        s.metrics.publish_failures.inc();
        return None;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(s.cfg.forward_timeout_ms) + wait;
    let mut not_found = 0;
    while let Ok(Some(m)) = tokio::time::timeout_at(deadline, replies.next()).await {
        let Ok(a) = serde_json::from_slice::<Answer>(&m.payload) else { continue };
        if a.status != 404 {
            s.metrics.forwarded.with_label_values(&[what, "answered"]).inc();
            return Some((a.status, a.body));
        }
        not_found += 1;
        if not_found >= peers {
            break;
        }
    }
    s.metrics.forwarded.with_label_values(&[what, "not_found"]).inc();
    None
}
