//! Running the gateway: a Pingora server with two HTTP services (public API, admin) and one
//! background service (the task supervisor, `crate::tasks`), stopped by a draining shutdown.
//!
//! SIGTERM (or [`GatewayHandle::shutdown`]) starts draining: new inference requests get 503 and
//! `/health` reports `draining`, in-flight requests and streams run to completion for up to
//! `shutdown.drain_timeout_s`, then the process stops. SIGINT stops at once.

use crate::config::Config;
use crate::gateway::Gateway;
use crate::http::{GatewayApp, Role};
use async_trait::async_trait;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{BackgroundService, background_service};
use pingora::services::listening::Service;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How a stop was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Drain in-flight requests, then stop.
    Drain,
    /// Stop now.
    Fast,
}

struct Signals {
    gw: Arc<Gateway>,
    manual: watch::Receiver<Option<Stop>>,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        use crate::or_never::or_never;
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).ok();
        let mut int = signal(SignalKind::interrupt()).ok();
        let mut manual = self.manual.clone();
        let stop = tokio::select! {
            Some(()) = or_never(term.as_mut().map(|s| s.recv())) => Stop::Drain,
            Some(()) = or_never(int.as_mut().map(|s| s.recv())) => Stop::Fast,
            Ok(stop) = async { manual.wait_for(Option::is_some).await.map(|s| s.unwrap_or(Stop::Fast)) } => stop,
        };
        if stop == Stop::Fast {
            tracing::info!("stopping now");
            return ShutdownSignal::FastShutdown;
        }
        let deadline = Duration::from_secs(self.gw.config().shutdown.drain_timeout_s);
        tracing::info!(in_flight = self.gw.open_requests(), deadline_s = deadline.as_secs(), "draining: refusing new requests, finishing in-flight ones");
        self.gw.start_draining();
        let start = Instant::now();
        while self.gw.open_requests() > 0 && start.elapsed() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if self.gw.open_requests() > 0 {
            tracing::warn!(in_flight = self.gw.open_requests(), "drain deadline reached; cutting the remaining requests");
        } else {
            tracing::info!("drained");
        }
        ShutdownSignal::GracefulTerminate
    }
}

/// The supervised background tasks, with the config watch they consume.
struct Background(Arc<Gateway>, Option<Arc<crate::tasks::ConfigWatch>>);

#[async_trait]
impl BackgroundService for Background {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let tasks = crate::tasks::Supervisor::start(self.0.clone(), self.1.clone());
        tasks
            .run_until(async move {
                let _ = shutdown.changed().await;
            })
            .await;
    }
}

/// Pingora's own buffers in front of a client socket: none. `ClientConn` keeps its own read
/// buffer and gathers each send in its own write buffer, both borrowed from the thread only
/// while bytes move; Pingora's defaults (64 KiB read, allocated for every connection as it is
/// accepted, and a write buffer) cost an idle client ~100 KB for nothing (#36,
/// docs/hardening.md, "Memory per connection").
fn client_buffers() -> L4BufferSettings {
    L4BufferSettings::unbuffered()
}

/// A listener on `addr`, speaking TLS with `certs` when given.
fn listener(addr: std::net::SocketAddr, certs: Option<&Arc<crate::tls::CertStore>>) -> ListenerConfig {
    let l = ListenerConfig::tcp(addr.to_string()).l4_buffer(client_buffers());
    match certs {
        Some(c) => l.tls(c.settings()),
        None => l,
    }
}

fn build(gw: Arc<Gateway>, cfg: &Config, manual: watch::Receiver<Option<Stop>>) -> (Server, RunArgs) {
    let conf = ServerConf {
        threads: cfg.threads,
        // Draining happens in `Signals` before Pingora's shutdown starts; after it, stop promptly.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        // Pingora bounds each accepted connection's handshake with its own timer, whose clock
        // thread, once started, wakes every 10 ms for the life of the process; the gateway
        // uses none of its timers otherwise. Every duration above 0 s goes to tokio's timer
        // instead, which costs nothing when the handshake (plain TCP) is done at once.
        fast_timeout_to_tokio_threshold_seconds: Some(0),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut public = Service::new("kvgate".to_string(), GatewayApp::new(gw.clone(), Role::Public));
    public.add_listener(listener(cfg.listen, gw.tls.public.as_ref()));
    let mut admin = Service::new("kvgate-admin".to_string(), GatewayApp::new(gw.clone(), Role::Admin));
    admin.threads = Some(1);
    admin.add_listener(listener(cfg.admin_listen, gw.tls.admin.as_ref()));
    server.add_service(public);
    server.add_service(admin);
    // Watching before the listeners open: an edit made once the gateway answers is never missed.
    let config_watch = gw.config_path().map(|p| crate::tasks::ConfigWatch::install(p));
    server.add_service(background_service("tasks", Background(gw.clone(), config_watch)));
    (server, RunArgs { shutdown_signal: Box::new(Signals { gw, manual }) })
}

/// Runs the gateway in this thread until it stops.
pub fn run(cfg: &Config, path: Option<PathBuf>) {
    let gw = match Gateway::new(cfg.clone(), path) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kvgate: {e}");
            std::process::exit(1);
        }
    };
    let (_tx, rx) = watch::channel(None);
    let (server, args) = build(gw, cfg, rx);
    tracing::info!(listen = %cfg.listen, admin = %cfg.admin_listen, models = cfg.models.len(), "kvgate starting");
    server.run(args);
}

/// A gateway running on its own thread (tests, `kvgate demo`).
pub struct GatewayHandle {
    /// Public listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    /// Shared state.
    pub gateway: Arc<Gateway>,
    stop: watch::Sender<Option<Stop>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl GatewayHandle {
    /// Starts a gateway; listen addresses with port 0 get a free port. Returns once both
    /// listeners accept connections.
    pub fn spawn(mut cfg: Config, path: Option<PathBuf>) -> std::io::Result<Self> {
        if cfg.listen.port() == 0 {
            cfg.listen.set_port(free_port()?);
        }
        if cfg.admin_listen.port() == 0 {
            cfg.admin_listen.set_port(free_port()?);
        }
        let gw = Gateway::new(cfg.clone(), path).map_err(std::io::Error::other)?;
        let (tx, rx) = watch::channel(None);
        // Pingora's server is not Send: build it on the thread that runs it.
        let (gw2, cfg2) = (gw.clone(), cfg.clone());
        let thread = std::thread::Builder::new().name("kvgate".into()).spawn(move || {
            let (server, args) = build(gw2, &cfg2, rx);
            server.run(args)
        })?;
        let connectable = |a: SocketAddr| {
            let a = if a.ip().is_unspecified() { SocketAddr::from(([127, 0, 0, 1], a.port())) } else { a };
            TcpStream::connect_timeout(&a, Duration::from_millis(100)).is_ok()
        };
        let start = Instant::now();
        while !(connectable(cfg.listen) && connectable(cfg.admin_listen)) {
            if start.elapsed() > Duration::from_secs(10) || thread.is_finished() {
                return Err(std::io::Error::other(format!("kvgate did not start listening on {} / {}", cfg.listen, cfg.admin_listen)));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Self { listen: cfg.listen, admin: cfg.admin_listen, gateway: gw, stop: tx, thread: Some(thread) })
    }

    /// `http://127.0.0.1:port` of the public listener.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.listen.port())
    }

    /// `http://127.0.0.1:port` of the admin listener.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin.port())
    }

    /// Asks the gateway to stop (as SIGTERM for `Drain`, SIGINT for `Fast`) without waiting.
    pub fn request_stop(&self, how: Stop) {
        let _ = self.stop.send(Some(how));
    }

    /// Waits until the gateway stops on its own (SIGINT, SIGTERM after draining).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Stops and waits for the server thread to end.
    pub fn shutdown(mut self, how: Stop) {
        self.request_stop(how);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for GatewayHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(Some(Stop::Fast));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
