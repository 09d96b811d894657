//! Watching the downstream client while we wait on a worker or stream to it.

use pingora::protocols::http::ServerSession;

/// Completes when the client has gone away (FIN or reset). Call only after the request body was
/// read: it then performs Pingora's 1-byte idle probe, which errors when the peer closes.
pub async fn client_closed(session: &mut ServerSession) {
    loop {
        match session.read_body_or_idle(true).await {
            Err(_) => return,
            // Only reachable if body bytes were still unread; keep probing.
            Ok(_) => tokio::task::yield_now().await,
        }
    }
}
