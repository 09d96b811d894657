//! Accepting plain-TCP client connections on the gateway's own loop.
//!
//! Pingora's listening service keeps, for every connection it accepts, a task whose future is
//! sized for its TLS handshake and handshake timer even when the listener speaks plain TCP:
//! about 10 KiB a connection before the application's first byte is read, which an idle or
//! slow client holds for as long as it stays (docs/hardening.md, "Memory per connection").
//! [`PlainListener`] is a Pingora service that accepts on a socket bound already and runs the
//! application's connection handler as the only thing in each connection's task. TLS
//! listeners still use Pingora's service, which does the handshake.

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::GetSocketDigest;
use pingora::protocols::SocketDigest;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::server::{ListenFds, ShutdownWatch};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

/// How long accepting pauses after the process or system ran out of descriptors or memory: the
/// error repeats without blocking until connections close, so retrying at once would spin.
const OUT_OF_RESOURCES_PAUSE: Duration = Duration::from_millis(100);

/// A Pingora service accepting plain HTTP connections on `socket` for `app`, on its own runtime
/// of `threads` worker threads (the server's default when `None`).
pub struct PlainListener<A> {
    name: String,
    app: Option<Arc<A>>,
    socket: Option<std::net::TcpListener>,
    threads: Option<usize>,
}

impl<A> PlainListener<A> {
    /// A service named `name` for `socket`, which must be bound, listening and non-blocking.
    pub fn new(name: &str, app: A, socket: std::net::TcpListener, threads: Option<usize>) -> Self {
        Self { name: name.to_string(), app: Some(Arc::new(app)), socket: Some(socket), threads }
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> pingora::services::Service for PlainListener<A> {
    /// Accepts until the server shuts down, then closes the socket and lets the application
    /// clean up; the connections accepted run on until the server's runtime stops.
    async fn start_service(&mut self, _fds: Option<ListenFds>, mut shutdown: ShutdownWatch, _listeners_per_fd: usize) {
        let (Some(app), Some(socket)) = (self.app.take(), self.socket.take()) else { return };
        let socket = match tokio::net::TcpListener::from_std(socket) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(service = %self.name, error = %e, "cannot accept on the listening socket");
                return;
            }
        };
        loop {
            let accepted = tokio::select! {
                accepted = socket.accept() => accepted,
                changed = shutdown.changed() => match changed {
                    Ok(()) if !*shutdown.borrow() => continue,
                    _ => break,
                },
            };
            match accepted {
                Ok((tcp, peer)) => serve(&app, tcp, peer, &shutdown),
                Err(e) => pause_after(&self.name, &e).await,
            }
        }
        drop(socket);
        app.cleanup().await;
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn threads(&self) -> Option<usize> {
        self.threads
    }
}

/// Starts the connection's task: the application's handler, for as long as it hands the
/// connection back for another round.
fn serve<A: ServerApp + Send + Sync + 'static>(app: &Arc<A>, tcp: tokio::net::TcpStream, peer: std::net::SocketAddr, shutdown: &ShutdownWatch) {
    let stream = client_stream(tcp, peer);
    let (app, shutdown) = (app.clone(), shutdown.clone());
    tokio::spawn(async move {
        let mut next = app.process_new(stream, &shutdown).await;
        while let Some(stream) = next {
            next = app.process_new(stream, &shutdown).await;
        }
    });
}

/// The accepted socket as Pingora's stream, set up as Pingora's own accept sets it up: no
/// Nagle delay (a streamed token goes out as it is written), the peer's address recorded for
/// per-client limits and logs, and no buffers of its own (the connection keeps its own).
fn client_stream(tcp: tokio::net::TcpStream, peer: std::net::SocketAddr) -> pingora::protocols::Stream {
    let mut stream = L4Stream::from(tcp);
    let digest = SocketDigest::from_raw_fd(stream.as_raw_fd());
    let _ = digest.peer_addr.set(Some(peer.into()));
    stream.set_socket_digest(digest);
    if let Err(e) = stream.set_nodelay() {
        tracing::debug!(error = %e, "cannot turn off Nagle's delay on a client connection");
    }
    Box::new(stream)
}

/// After a failed accept: a connection that failed before it was taken is skipped, but running
/// out of descriptors or memory pauses accepting, so the loop does not spin while it lasts.
async fn pause_after(service: &str, e: &std::io::Error) {
    use nix::errno::Errno;
    let out_of_resources = matches!(e.raw_os_error().map(Errno::from_raw), Some(Errno::EMFILE | Errno::ENFILE | Errno::ENOBUFS | Errno::ENOMEM));
    if out_of_resources {
        tracing::warn!(service, error = %e, "cannot accept a connection; pausing accepts");
        tokio::time::sleep(OUT_OF_RESOURCES_PAUSE).await;
    } else {
        tracing::debug!(service, error = %e, "a connection failed before it was accepted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::protocols::Stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers each connection with the peer's address as the stream records it, then closes.
    struct Echo;

    #[async_trait]
    impl ServerApp for Echo {
        async fn process_new(self: &Arc<Self>, mut stream: Stream, _shutdown: &ShutdownWatch) -> Option<Stream> {
            let peer = stream.get_socket_digest().and_then(|d| d.peer_addr().cloned());
            let line = format!("{:?}", peer.and_then(|p| p.as_inet().copied()));
            let _ = stream.write_all(line.as_bytes()).await;
            None
        }
    }

    #[tokio::test]
    async fn accepted_streams_know_their_peer_and_shutdown_stops_accepting() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        socket.set_nonblocking(true).unwrap();
        let addr = socket.local_addr().unwrap();
        let mut service = PlainListener::new("test", Echo, socket, None);
        let (stop, watch) = tokio::sync::watch::channel(false);
        let running = tokio::spawn(async move { pingora::services::Service::start_service(&mut service, None, watch, 1).await });

        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.unwrap();
        assert_eq!(answer, format!("Some({})", client.local_addr().unwrap()));

        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), running).await.expect("the accept loop ends on shutdown").unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "the socket closes once the service stops");
    }
}
