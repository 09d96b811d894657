//! The request legs' keep-alive pool: idle HTTP/1.1 connections to one worker, kept on the
//! worker itself.
//!
//! Why not Pingora's pool: it parks every returned connection behind a mutex, spawns a task per
//! return to watch it, and a reuse must wake that task and wait for it to hand the connection
//! back — two task wake-ups and a timer per request, a large share of the gateway's CPU on a
//! fast upstream. Here a return is a push and a reuse is a pop under a lock held for neither
//! I/O nor allocation; a connection the worker closed while it sat idle is found when it is
//! taken, if the runtime has seen the close (one non-blocking read), and otherwise by the
//! request failing before any response byte, which `exchange` retries once on a fresh
//! connection; an idle one past its time is dropped when met or by [`IdlePool::sweep`].

use parking_lot::Mutex;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

/// Idle connections kept per worker at most; more are closed on return. Pingora's own pool
/// keeps 128 per connector.
pub const MAX_IDLE: usize = 256;

/// Idle keep-alive connections to one worker, most recently used last.
#[derive(Default)]
pub struct IdlePool {
    idle: Mutex<Vec<Idle>>,
}

struct Idle {
    stream: TcpStream,
    since: Instant,
}

impl std::fmt::Debug for IdlePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdlePool").field("idle", &self.idle.lock().len()).finish()
    }
}

impl IdlePool {
    /// The most recently returned connection that is still usable: idle for at most
    /// `max_idle`, and neither closed by the worker nor holding unread bytes.
    pub fn take(&self, max_idle: Duration) -> Option<TcpStream> {
        let now = Instant::now();
        loop {
            let Idle { mut stream, since } = self.idle.lock().pop()?;
            if now.saturating_duration_since(since) <= max_idle && still_open(&mut stream) {
                return Some(stream);
            }
            // Dropped here, outside the lock: closing is a syscall.
        }
    }

    /// Keeps `stream` for reuse, or closes it when [`MAX_IDLE`] are already kept.
    pub fn put(&self, stream: TcpStream) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { stream, since: Instant::now() });
        } else {
            drop(idle);
            drop(stream);
        }
    }

    /// Closes the connections idle for longer than `max_idle`; returns how many.
    pub fn sweep(&self, max_idle: Duration) -> usize {
        let now = Instant::now();
        let expired: Vec<Idle> = {
            let mut idle = self.idle.lock();
            // Oldest first: the expired ones are a prefix.
            let keep_from = idle.iter().position(|c| now.saturating_duration_since(c.since) <= max_idle).unwrap_or(idle.len());
            idle.drain(..keep_from).collect()
        };
        expired.len()
    }

    /// Closes every idle connection (the worker turned unhealthy, or its address changed).
    pub fn clear(&self) {
        let all = std::mem::take(&mut *self.idle.lock());
        drop(all);
    }

    /// Connections kept now.
    pub fn len(&self) -> usize {
        self.idle.lock().len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether an idle connection can carry a request: a read that would block says the worker
/// neither closed it nor sent anything unasked. One poll, never waiting.
fn still_open(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    let mut cx = Context::from_waker(Waker::noop());
    matches!(Pin::new(stream).poll_read(&mut cx, &mut buf), Poll::Pending)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    /// A connected pair: the pooled (gateway) end, and the worker's end.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (client, server)
    }

    /// The connection's identity (its local address, unique among open connections).
    fn id(s: &TcpStream) -> std::net::SocketAddr {
        s.local_addr().unwrap()
    }

    #[tokio::test]
    async fn the_most_recently_returned_connection_is_reused_first() {
        let pool = IdlePool::default();
        let (a, _wa) = pair().await;
        let (b, _wb) = pair().await;
        let (fa, fb) = (id(&a), id(&b));
        pool.put(a);
        pool.put(b);
        assert_eq!(pool.len(), 2);
        let long = Duration::from_secs(60);
        assert_eq!(id(&pool.take(long).unwrap()), fb);
        assert_eq!(id(&pool.take(long).unwrap()), fa);
        assert!(pool.take(long).is_none());
    }

    #[tokio::test]
    async fn a_connection_the_worker_closed_or_wrote_on_is_not_reused() {
        let pool = IdlePool::default();
        let (closed, wc) = pair().await;
        let (chatty, mut wt) = pair().await;
        let (fine, _wf) = pair().await;
        let ff = id(&fine);
        pool.put(fine);
        pool.put(closed);
        pool.put(chatty);
        drop(wc);
        wt.write_all(b"HTTP/1.1 408 Request Timeout\r\n\r\n").await.unwrap();
        // The close and the bytes reach the pool through the runtime's I/O driver: until it has
        // turned, a dead connection still looks idle, so it is put back and the take retried.
        let deadline = Instant::now() + Duration::from_secs(5);
        let taken = loop {
            match pool.take(Duration::from_secs(60)) {
                Some(s) if id(&s) != ff && Instant::now() < deadline => pool.put(s),
                other => break other,
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert_eq!(taken.map(|s| id(&s)), Some(ff));
        assert!(pool.is_empty());
    }

    #[tokio::test]
    async fn idle_past_its_time_is_dropped_on_take_and_on_sweep() {
        let pool = IdlePool::default();
        let (a, _wa) = pair().await;
        let (b, _wb) = pair().await;
        pool.put(a);
        pool.put(b);
        assert!(pool.take(Duration::ZERO).is_none(), "both idle longer than zero");
        assert!(pool.is_empty());
        let (c, _wc) = pair().await;
        pool.put(c);
        assert_eq!(pool.sweep(Duration::from_secs(60)), 0);
        assert_eq!(pool.sweep(Duration::ZERO), 1);
        assert!(pool.is_empty());
    }

    #[tokio::test]
    async fn at_most_max_idle_are_kept() {
        let pool = IdlePool::default();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let mut kept = Vec::new();
            for _ in 0..MAX_IDLE + 3 {
                kept.push(l.accept().await.unwrap().0);
            }
            kept
        });
        for _ in 0..MAX_IDLE + 3 {
            let c = TcpStream::connect(addr).await.unwrap();
            pool.put(c);
        }
        let _servers = accept.await.unwrap();
        assert_eq!(pool.len(), MAX_IDLE);
        pool.clear();
        assert!(pool.is_empty());
    }
}
