//! The floor of a proxy on tokio: the least an HTTP/1 forwarder can do per request on this
//! machine, for `benches/scripts/cost-per-request.sh` (`FLOOR=target/release/floor-proxy`) to
//! put beside nginx and kvgate. Each client connection gets its own keep-alive connection to
//! the one upstream; a request is read whole (Content-Length bodies only), sent on as it came,
//! and the response is relayed as its bytes arrive (Content-Length or chunked framing). It routes,
//! rewrites, counts and checks nothing, and closes the connection on anything it does not understand, so
//! it is not a proxy anyone should run: it answers "how fast could any tokio proxy go here?",
//! which tells how much of the gap to nginx is the engine and how much is the gateway.
//!
//! ```text
//! floor-proxy --listen 127.0.0.1:8080 --upstream 127.0.0.1:9000 [--threads N] [--ports-file F]
//! ```

use clap::Parser;
use std::io;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Args {
    /// Where to listen.
    #[arg(long)]
    listen: SocketAddr,
    /// The upstream every request goes to.
    #[arg(long)]
    upstream: SocketAddr,
    /// Worker threads (default: the CPUs available).
    #[arg(long)]
    threads: Option<usize>,
    /// Time to spin on each request before forwarding it (µs of wall-clock time, so a little
    /// less CPU when the thread is preempted meanwhile): a model of a gateway's own per-request
    /// work, to see how added latency grows with it at one engine.
    #[arg(long, default_value_t = 0)]
    work_us: u64,
    /// Once listening, write `{"listen": "host:port"}` here (for `--listen 127.0.0.1:0`).
    #[arg(long)]
    ports_file: Option<std::path::PathBuf>,
}

fn main() -> io::Result<()> {
    let a = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = a.threads {
        rt.worker_threads(n.max(1));
    }
    rt.enable_all().build()?.block_on(async move {
        let listener = TcpListener::bind(a.listen).await?;
        if let Some(path) = &a.ports_file {
            let tmp = path.with_extension("partial");
            std::fs::write(&tmp, format!("{{\"listen\":\"{}\"}}", listener.local_addr()?))?;
            std::fs::rename(&tmp, path)?;
        }
        loop {
            let (client, _) = listener.accept().await?;
            let (upstream, work) = (a.upstream, std::time::Duration::from_micros(a.work_us));
            tokio::spawn(async move {
                let _ = serve(client, upstream, work).await;
            });
        }
    })
}

/// Where a message's head ends and how long its body is, once the head is in `buf`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    /// `Content-Length: n`.
    Length(usize),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// The head's length and the body's framing, or `None` while the head is incomplete.
fn head(buf: &[u8]) -> io::Result<Option<(usize, Framing)>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { return Ok(None) };
    let mut framing = Framing::Length(0);
    for line in buf[..end].split(|&b| b == b'\n').skip(1) {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok()).ok_or_else(|| bad("content-length"))?;
            framing = Framing::Length(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") && value.eq_ignore_ascii_case(b"chunked") {
            framing = Framing::Chunked;
        }
    }
    Ok(Some((end + 4, framing)))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// Reads into `buf` until `done(buf)` says how many bytes make the message; returns that.
async fn read_until(s: &mut TcpStream, buf: &mut Vec<u8>, done: impl Fn(&[u8]) -> io::Result<Option<usize>>) -> io::Result<Option<usize>> {
    loop {
        if let Some(n) = done(buf)? {
            return Ok(Some(n));
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(8192);
        }
        if s.read_buf(buf).await? == 0 {
            return if buf.is_empty() { Ok(None) } else { Err(bad("connection closed mid-message")) };
        }
    }
}

/// The length of a whole chunked body at the start of `b`, once it is all there.
fn chunked_len(b: &[u8]) -> io::Result<Option<usize>> {
    let mut at = 0;
    loop {
        let Some(eol) = b[at..].windows(2).position(|w| w == b"\r\n") else { return Ok(None) };
        let size = std::str::from_utf8(&b[at..at + eol]).ok().and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok());
        let size = size.ok_or_else(|| bad("chunk size"))?;
        at += eol + 2 + size + 2;
        if at > b.len() {
            return Ok(None);
        }
        if size == 0 {
            return Ok(Some(at));
        }
    }
}

/// One client connection: requests in turn, each over the same upstream connection.
async fn serve(mut client: TcpStream, upstream: SocketAddr, work: std::time::Duration) -> io::Result<()> {
    client.set_nodelay(true)?;
    let mut up: Option<TcpStream> = None;
    let (mut req, mut resp) = (Vec::with_capacity(8192), Vec::with_capacity(8192));
    loop {
        let Some(n) = read_until(&mut client, &mut req, |b| Ok(head(b)?.map(|(h, f)| h + if let Framing::Length(n) = f { n } else { 0 }))).await? else {
            return Ok(());
        };
        spin(work);
        let u = match &mut up {
            Some(u) => u,
            None => {
                let s = TcpStream::connect(upstream).await?;
                s.set_nodelay(true)?;
                up.insert(s)
            }
        };
        u.write_all(&req[..n]).await?;
        req.drain(..n);
        relay(u, &mut client, &mut resp).await?;
    }
}

/// Keeps the thread busy for `work` of wall-clock time (the time a gateway would spend on the
/// request).
fn spin(work: std::time::Duration) {
    if work.is_zero() {
        return;
    }
    let start = std::time::Instant::now();
    while start.elapsed() < work {
        std::hint::spin_loop();
    }
}

/// Relays one response from `up` to `client` as its bytes arrive, until its framing says it
/// ended.
async fn relay(up: &mut TcpStream, client: &mut TcpStream, resp: &mut Vec<u8>) -> io::Result<()> {
    let mut sent = 0;
    loop {
        let total = match head(resp)? {
            Some((h, Framing::Length(n))) => Some(h + n),
            Some((h, Framing::Chunked)) => chunked_len(&resp[h..])?.map(|n| h + n),
            None => None,
        };
        let upto = total.unwrap_or(resp.len()).min(resp.len());
        if upto > sent {
            client.write_all(&resp[sent..upto]).await?;
            sent = upto;
        }
        if total == Some(sent) {
            resp.drain(..sent);
            return Ok(());
        }
        resp.reserve(8192);
        if up.read_buf(resp).await? == 0 {
            return Err(bad("upstream closed mid-response"));
        }
    }
}
