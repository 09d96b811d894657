//! Certificate reload when the files change: every few seconds the TLS listeners' certificate
//! and key files are checked (modification time and size) and read again when either changed
//! (crate::tls). Reloads of the config (SIGHUP, `POST /reload`) read them regardless.

use crate::gateway::Gateway;
use std::sync::Arc;
use std::time::Duration;

/// How often the files are checked.
const EVERY: Duration = Duration::from_secs(5);

/// Runs until the task is aborted (idle when no listener speaks TLS).
pub async fn run(gw: Arc<Gateway>) {
    if gw.tls.public.is_none() && gw.tls.admin.is_none() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(EVERY).await;
        gw.tls.reload(false, &gw.metrics);
    }
}
