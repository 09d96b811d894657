//! Peers' admin requests about requests this replica holds (`super::forward` asks them),
//! answered as this replica's own admin listener would answer them.

use crate::cluster::wire::{Answer, Ask};
use crate::downstream::errors::ClientError;
use crate::gateway::Gateway;
use std::sync::Arc;

/// A peer's `ask`, answered as this replica would answer it on its own admin listener (404
/// for a request it does not hold).
pub async fn answer(gw: &Arc<Gateway>, ask: Ask) -> Answer {
    let replica = gw.cluster.shared().map(|s| s.replica.clone()).unwrap_or_default();
    let unknown = || (404, ClientError::unknown_request(&ask.id).body());
    let (status, body) = match ask.what.as_str() {
        "request" => gw.requests.find(&ask.id).map_or_else(unknown, |e| (200, e.to_json(true).to_string())),
        "migrate" if gw.requests.find(&ask.id).is_some() => super::migrate::answer(gw, ask.body.as_bytes(), false).await,
        "migrate" => unknown(),
        other => (400, ClientError::bad_request(format!("unknown ask {other:?}"), None).body()),
    };
    Answer { status, body, replica }
}
