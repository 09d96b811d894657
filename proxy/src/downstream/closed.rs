//! Watching the downstream client while we wait on a worker or stream to it.

use super::conn::ClientConn;

/// Completes when the client has gone away (FIN or reset). Call only after the request body was
/// read.
pub async fn client_closed(session: &mut ClientConn) {
    session.closed().await
}
