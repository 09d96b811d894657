//! Hot reload: SIGHUP, a watch on the config file's *directory* (editors and Kubernetes
//! ConfigMaps replace files by rename or symlink swap, which a watch on the file itself
//! misses), and `POST /reload` on the admin listener all end in [`Gateway::reload`], which keeps
//! the old configuration when the new one does not validate.

use crate::gateway::Gateway;
use notify::{RecursiveMode, Watcher};
use std::sync::Arc;
use std::time::Duration;

/// Events closer together than this are one change (editors write in several steps).
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Watches for SIGHUP and file changes until the task is aborted; returns at once when the
/// gateway has no config file.
pub async fn run(gw: Arc<Gateway>) {
    let Some(path) = gw.config_path().cloned() else { return };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).map(|p| p.to_path_buf()).unwrap_or_else(|| ".".into());
    let file_name = path.file_name().map(|f| f.to_owned());
    let watch_tx = tx.clone();
    let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        if ev.kind.is_access() {
            return;
        }
        // Our file, or a ConfigMap's `..data` symlink swap, which changes no path we name.
        let relevant = ev.paths.iter().any(|p| p.file_name() == file_name.as_deref() || p.to_string_lossy().contains("..data"));
        if relevant {
            let _ = watch_tx.send(());
        }
    });
    let _watcher = match watcher {
        Ok(mut w) => match w.watch(&dir, RecursiveMode::NonRecursive) {
            Ok(()) => Some(w),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the config directory; use SIGHUP or POST /reload");
                None
            }
        },
        Err(e) => {
            tracing::warn!(error = %e, "file watching unavailable; use SIGHUP or POST /reload");
            None
        }
    };
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        tokio::select! {
            Some(()) = rx.recv() => {}
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                tracing::info!("SIGHUP: reloading configuration");
            }
        }
        tokio::time::sleep(DEBOUNCE).await;
        while rx.try_recv().is_ok() {}
        // Reloading may compile plugins and load tokenizers: not on an async worker.
        let gw2 = gw.clone();
        let _ = tokio::task::spawn_blocking(move || gw2.reload()).await;
    }
}
