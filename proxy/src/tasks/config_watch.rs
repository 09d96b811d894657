//! Hot reload: SIGHUP, a watch on the config file's *directory* (editors and Kubernetes
//! ConfigMaps replace files by rename or symlink swap, which a watch on the file itself
//! misses), and `POST /reload` on the admin listener all end in [`Gateway::reload`], which keeps
//! the old configuration when the new one does not validate.
//!
//! The watch is installed by [`ConfigWatch::install`] before the listeners open, so an edit
//! made as soon as the gateway answers is seen; the task only consumes its events, and a
//! restarted task picks up the same watch. `install` also takes SIGHUP's default action
//! (terminate) away before the listeners open: a SIGHUP sent as soon as the gateway answers,
//! before the task listens for it, must not stop the gateway. Such a signal reloads nothing,
//! which loses nothing: the configuration was read moments before, and an edit made since is
//! seen by the watch.

use crate::gateway::Gateway;
use crate::or_never::or_never;
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Mutex, mpsc};

/// Events closer together than this are one change (editors write in several steps).
const DEBOUNCE: Duration = Duration::from_millis(200);

/// A watch on the config file's directory, alive as long as this value.
pub struct ConfigWatch {
    _watcher: Option<RecommendedWatcher>,
    changes: Mutex<mpsc::UnboundedReceiver<()>>,
}

impl ConfigWatch {
    /// Starts watching `path`'s directory. Without a working watch (no inotify, unreadable
    /// directory) it warns and the gateway still reloads on SIGHUP and `POST /reload`.
    pub fn install(path: &Path) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel::<()>();
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).map(|p| p.to_path_buf()).unwrap_or_else(|| ".".into());
        let file_name = path.file_name().map(|f| f.to_owned());
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(ev) = res else { return };
            if ev.kind.is_access() {
                return;
            }
            // Our file, or a ConfigMap's `..data` symlink swap, which changes no path we name.
            let relevant = ev.paths.iter().any(|p| p.file_name() == file_name.as_deref() || p.to_string_lossy().contains("..data"));
            if relevant {
                let _ = tx.send(());
            }
        });
        let watcher = match watcher {
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
        keep_hangup_from_terminating();
        Arc::new(Self { _watcher: watcher, changes: Mutex::new(rx) })
    }
}

/// Installs the process-wide SIGHUP handler that the task's listener later uses, so SIGHUP's
/// default action (terminate) no longer applies. Tokio keeps that handler for the life of the
/// process once a listener is made, even from a runtime dropped right after.
fn keep_hangup_from_terminating() {
    let listen = || tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).map(drop);
    // The gateway installs before any runtime runs; a caller inside one uses it (a runtime may
    // not be dropped there).
    let installed = match tokio::runtime::Handle::try_current() {
        Ok(_) => listen(),
        Err(_) => tokio::runtime::Builder::new_current_thread().enable_io().build().and_then(|rt| {
            let _in_runtime = rt.enter();
            listen()
        }),
    };
    if let Err(e) = installed {
        tracing::warn!(error = %e, "cannot handle SIGHUP yet: one sent before the reload task starts stops the gateway");
    }
}

/// Reloads on SIGHUP and on the watch's changes until the task is aborted; returns at once when
/// the gateway has no config file (`watch` is `None`).
pub async fn run(gw: Arc<Gateway>, watch: Option<Arc<ConfigWatch>>) {
    let Some(watch) = watch else { return };
    let mut changes = watch.changes.lock().await;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        tokio::select! {
            Some(()) = changes.recv() => {}
            Some(()) = or_never(hup.as_mut().map(|h| h.recv())) => {
                tracing::info!("SIGHUP: reloading configuration");
            }
        }
        tokio::time::sleep(DEBOUNCE).await;
        while changes.try_recv().is_ok() {}
        // Reloading may compile plugins and load tokenizers: not on an async worker.
        let gw2 = gw.clone();
        let _ = tokio::task::spawn_blocking(move || gw2.reload()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_edit_right_after_install_is_seen() {
        let dir = std::env::temp_dir().join(format!("kvgate-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kvgate.yaml");
        std::fs::write(&path, "a").unwrap();
        let watch = ConfigWatch::install(&path);
        std::fs::write(&path, "b").unwrap();
        let seen = tokio::time::timeout(Duration::from_secs(5), async { watch.changes.lock().await.recv().await }).await;
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(seen, Ok(Some(())), "the write after install returned was reported");
    }

    /// Runs in a child process (its own signal dispositions): after `install`, a SIGHUP with
    /// no listener yet must not terminate the process.
    #[test]
    fn a_hangup_right_after_install_does_not_terminate() {
        const CHILD: &str = "KVGATE_HANGUP_CHILD";
        let name = "tasks::config_watch::tests::a_hangup_right_after_install_does_not_terminate";
        if std::env::var_os(CHILD).is_some() {
            let dir = std::env::temp_dir().join(format!("kvgate-hup-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let _watch = ConfigWatch::install(&dir.join("kvgate.yaml"));
            let sent = std::process::Command::new("sh").args(["-c", &format!("kill -HUP {}", std::process::id())]).status().unwrap();
            // A signal whose action is to terminate ends the process as it is sent, before this
            // thread returns from waiting for the shell: reaching the next line is the proof.
            assert!(sent.success());
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap()).args(["--exact", name, "--test-threads", "1"]).env(CHILD, "1").output().unwrap();
        assert!(out.status.success(), "child: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stdout));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran the test");
    }
}
