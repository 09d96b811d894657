//! Running the gateway: a Pingora server with two HTTP services (public API, admin) and one
//! background service (the task supervisor, `crate::tasks`), stopped by a draining shutdown.
//!
//! SIGTERM (or [`GatewayHandle::shutdown`]) starts draining: new inference requests get 503 and
//! `/health` reports `draining`, in-flight requests and streams run to completion for up to
//! `shutdown.drain_timeout_s`, then the process stops. SIGINT stops at once.

use crate::config::Config;
use crate::downstream::accept::PlainListener;
use crate::gateway::Gateway;
use crate::http::{GatewayApp, Role};
use async_trait::async_trait;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use pingora::server::{Fds, ListenFds, RunArgs, ShutdownSignal, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{BackgroundService, background_service};
use pingora::services::listening::Service;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::IntoRawFd;
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
        // The last requests' spans go out before the process does.
        let gw = self.gw.clone();
        let _ = tokio::time::timeout(Duration::from_secs(5), tokio::task::spawn_blocking(move || gw.traces.shutdown())).await;
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
/// accepted, and a write buffer) would cost every idle client that much for nothing
/// (docs/hardening.md).
fn client_buffers() -> L4BufferSettings {
    L4BufferSettings::unbuffered()
}

/// The gateway's two listening sockets, bound before its server starts.
///
/// A port is bound once, by the process that serves it: a taken address fails the start with
/// the system's reason (Pingora would retry for half a minute, then panic), and port 0 gets a
/// port the caller reads back instead of one guessed free and bound later, which another
/// program may take in between. Neither socket sets `SO_REUSEPORT`, so no other listener can
/// share the port and take a share of its connections.
#[derive(Debug)]
pub(crate) struct Listeners {
    public: TcpListener,
    admin: TcpListener,
}

impl Listeners {
    /// Binds `listen` and `admin_listen`; an error names the address that failed.
    pub(crate) fn bind(cfg: &Config) -> std::io::Result<Self> {
        let bind = |what: &str, addr: SocketAddr| listen(addr).map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr} ({what}): {e}")));
        Ok(Self { public: bind("listen", cfg.listen)?, admin: bind("admin_listen", cfg.admin_listen)? })
    }

    /// The addresses bound: the public listener's and the admin listener's.
    pub(crate) fn addrs(&self) -> std::io::Result<(SocketAddr, SocketAddr)> {
        Ok((self.public.local_addr()?, self.admin.local_addr()?))
    }
}

/// Connections the system may hold complete for a listener before the gateway accepts them:
/// as many as it allows (it caps the figure at `net.core.somaxconn`), as Pingora asks for on
/// the sockets it binds. A burst of clients beyond a short queue would have its handshakes
/// dropped and completed only by the system's retries, seconds later.
const BACKLOG: i32 = 65_535;

/// A non-blocking TCP socket listening on `addr` (the accept loops run on tokio), with the
/// address reusable at once after an earlier process's close, as std's `bind` sets it, and a
/// backlog of [`BACKLOG`].
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.nonblocking(), Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// A Pingora listening service (TLS) over a socket bound already: when the server starts it, the
/// socket's descriptor passes to Pingora in a table of its own (the way Pingora takes sockets
/// inherited across an upgrade) instead of the server's, where Pingora would bind the address
/// itself. A service the server never starts closes its socket when dropped.
struct Prebound<S> {
    inner: S,
    socket: Option<(SocketAddr, TcpListener)>,
}

#[async_trait]
impl<S: pingora::services::Service> pingora::services::Service for Prebound<S> {
    async fn start_service(&mut self, _server_fds: Option<ListenFds>, shutdown: ShutdownWatch, listeners_per_fd: usize) {
        let mut fds = Fds::new();
        if let Some((addr, socket)) = self.socket.take() {
            fds.add(addr.to_string(), socket.into_raw_fd());
        }
        self.inner.start_service(Some(Arc::new(parking_lot::Mutex::new(fds))), shutdown, listeners_per_fd).await;
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn threads(&self) -> Option<usize> {
        self.inner.threads()
    }

    fn runtime_opts_override(&self, global: &pingora::server::RuntimeOpts) -> Option<pingora::server::RuntimeOpts> {
        self.inner.runtime_opts_override(global)
    }
}

fn build(gw: Arc<Gateway>, cfg: &Config, bound: Listeners, manual: watch::Receiver<Option<Stop>>) -> std::io::Result<(Server, RunArgs)> {
    let conf = ServerConf {
        threads: cfg.threads,
        // Draining happens in `Signals` before Pingora's shutdown starts; after it, stop promptly.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        // Pingora bounds each TLS handshake with its own timer, whose clock thread, once
        // started, wakes every 10 ms for the life of the process; the gateway uses none of its
        // timers otherwise. Every duration above 0 s goes to tokio's timer instead.
        fast_timeout_to_tokio_threshold_seconds: Some(0),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let public = GatewayApp::new(gw.clone(), Role::Public);
    server.add_boxed_service(client_service("kvgate", public, bound.public, gw.tls.public.as_ref(), None)?);
    let admin = GatewayApp::new(gw.clone(), Role::Admin);
    server.add_boxed_service(client_service("kvgate-admin", admin, bound.admin, gw.tls.admin.as_ref(), Some(1))?);
    // Watching before the listeners open: an edit made once the gateway answers is never missed.
    let config_watch = gw.config_path().map(|p| crate::tasks::ConfigWatch::install(p));
    server.add_service(background_service("tasks", Background(gw.clone(), config_watch)));
    Ok((server, RunArgs { shutdown_signal: Box::new(Signals { gw, manual }) }))
}

/// The service answering clients on `socket`: the gateway's own accept loop for plain HTTP
/// (`PlainListener`), Pingora's listening service where the listener speaks TLS.
fn client_service(
    name: &str,
    app: GatewayApp,
    socket: TcpListener,
    certs: Option<&Arc<crate::tls::CertStore>>,
    threads: Option<usize>,
) -> std::io::Result<Box<dyn pingora::services::ServiceWithDependents>> {
    let Some(certs) = certs else { return Ok(Box::new(PlainListener::new(name, app, socket, threads))) };
    let addr = socket.local_addr()?;
    let mut tls = Service::new(name.to_string(), app);
    tls.threads = threads;
    tls.add_listener(ListenerConfig::tcp(addr.to_string()).l4_buffer(client_buffers()).tls(certs.settings()));
    Ok(Box::new(Prebound { inner: tls, socket: Some((addr, socket)) }))
}

/// Runs the gateway in this thread until it stops; exits the process when a listener cannot
/// be bound or the gateway's state cannot be built. With `ports_file`, the addresses bound and
/// the instance id are written there (as JSON) before the gateway serves.
pub fn run(cfg: &Config, path: Option<PathBuf>, ports_file: Option<&std::path::Path>) {
    let fail = |e: &dyn std::fmt::Display| -> ! {
        eprintln!("kvgate: {e}");
        std::process::exit(1);
    };
    // A file left by an earlier run must not pass for this one's while it starts.
    if let Some(p) = ports_file {
        let _ = std::fs::remove_file(p);
    }
    let (gw, cfg, bound) = prepare(cfg.clone(), path).unwrap_or_else(|e| fail(&e));
    let (_tx, rx) = watch::channel(None);
    let (server, args) = build(gw.clone(), &cfg, bound, rx).unwrap_or_else(|e| fail(&e));
    if let Some(p) = ports_file {
        write_ports_file(p, &cfg, gw.instance()).unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", p.display())));
    }
    tracing::info!(listen = %cfg.listen, admin = %cfg.admin_listen, instance = gw.instance(), models = cfg.models.len(), "kvgate starting");
    server.run(args);
}

/// What both ways of starting share: the listeners bound, the addresses they got written into
/// the config (port 0 read back), and the gateway's state built on that config.
fn prepare(mut cfg: Config, path: Option<PathBuf>) -> std::io::Result<(Arc<Gateway>, Config, Listeners)> {
    let bound = Listeners::bind(&cfg)?;
    (cfg.listen, cfg.admin_listen) = bound.addrs()?;
    let gw = Gateway::new(cfg.clone(), path).map_err(std::io::Error::other)?;
    Ok((gw, cfg, bound))
}

/// The addresses bound and the instance id as JSON, written whole (to a temporary name, then
/// renamed), so a reader polling for the file never sees half of it.
fn write_ports_file(path: &std::path::Path, cfg: &Config, instance: &str) -> std::io::Result<()> {
    let v = serde_json::json!({"listen": cfg.listen.to_string(), "admin_listen": cfg.admin_listen.to_string(), "instance": instance});
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, v.to_string())?;
    std::fs::rename(&tmp, path)
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

impl GatewayHandle {
    /// Starts a gateway; listen addresses with port 0 get a port of the system's choosing (see
    /// [`GatewayHandle::listen`]). Returns once this gateway answers `/health` on every plain
    /// HTTP listener with its own instance id, so a caller never mistakes another server for it.
    pub fn spawn(cfg: Config, path: Option<PathBuf>) -> std::io::Result<Self> {
        let (gw, cfg, bound) = prepare(cfg, path)?;
        let (tx, rx) = watch::channel(None);
        // Pingora's server is not Send: build it on the thread that runs it.
        let (gw2, cfg2) = (gw.clone(), cfg.clone());
        let (built_tx, built_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("kvgate".into()).spawn(move || match build(gw2, &cfg2, bound, rx) {
            Ok((server, args)) => {
                let _ = built_tx.send(Ok(()));
                server.run(args);
            }
            Err(e) => {
                let _ = built_tx.send(Err(e));
            }
        })?;
        built_rx.recv().map_err(|_| std::io::Error::other("the gateway's server thread ended before it was built"))??;
        let mut handle = Self { listen: cfg.listen, admin: cfg.admin_listen, gateway: gw, stop: tx, thread: Some(thread) };
        handle.wait_answering()?;
        Ok(handle)
    }

    /// Waits until each plain HTTP listener answers `/health` as this instance. A TLS listener
    /// is not asked: it is ours by construction (bound above) and queues connections until the
    /// server accepts them, but nothing here shows that its service started.
    fn wait_answering(&mut self) -> std::io::Result<()> {
        let plain = [(self.listen, self.gateway.tls.public.is_none()), (self.admin, self.gateway.tls.admin.is_none())];
        let start = Instant::now();
        for (addr, _) in plain.into_iter().filter(|&(_, plain)| plain) {
            while !answers_as(addr, self.gateway.instance()) {
                if self.thread.as_ref().is_none_or(std::thread::JoinHandle::is_finished) {
                    let how = match self.thread.take().map(std::thread::JoinHandle::join) {
                        Some(Err(_)) => "panicked",
                        _ => "ended",
                    };
                    return Err(std::io::Error::other(format!("the gateway's server thread {how} before {addr} answered")));
                }
                // Only a hang ends here: the socket is ours, so no other server can answer.
                if start.elapsed() > Duration::from_secs(30) {
                    return Err(std::io::Error::other(format!("kvgate did not answer /health on {addr} within 30 s")));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
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

impl std::fmt::Debug for GatewayHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayHandle")
            .field("listen", &self.listen)
            .field("admin", &self.admin)
            .field("instance", &self.gateway.instance())
            .finish_non_exhaustive()
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

/// True when the HTTP server at `addr` answers `GET /health` naming `instance` (any status:
/// a gateway without healthy workers answers 503 and is still up).
fn answers_as(addr: SocketAddr, instance: &str) -> bool {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(a) if a.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(a) if a.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    let Ok(mut s) = TcpStream::connect_timeout(&SocketAddr::new(ip, addr.port()), Duration::from_millis(200)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nhost: kvgate\r\nconnection: close\r\n\r\n").is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = s.take(64 * 1024).read_to_end(&mut answer);
    let body = answer.windows(4).position(|w| w == b"\r\n\r\n").map_or(&[][..], |at| &answer[at + 4..]);
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| v["instance"] == instance)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The system's cap on a listener's backlog.
    fn somaxconn() -> usize {
        std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    #[test]
    fn a_burst_of_clients_completes_its_handshakes_before_any_is_accepted() {
        // Past std's 128: a queue that short would drop these handshakes.
        let burst = 600;
        if somaxconn() <= burst {
            eprintln!("skipped: net.core.somaxconn is {} here", somaxconn());
            return;
        }
        let l = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr().unwrap();
        let clients: Vec<TcpStream> =
            (0..burst).map(|i| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).unwrap_or_else(|e| panic!("connection {i}: {e}"))).collect();
        // Each is complete in the queue. The system moves a handshake there when the client's
        // last packet arrives, which on loopback may trail `connect` by a moment: wait for it,
        // within a bound.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut accepted = 0;
        while accepted < clients.len() && Instant::now() < deadline {
            match l.accept() {
                Ok(_) => accepted += 1,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("accept: {e}"),
            }
        }
        assert_eq!(accepted, clients.len());
    }
}
