//! `kvgate-bench connections`: what idle and slow clients cost a gateway, against nginx
//! in the same run. Each shape opens `count` client connections that each send a few bytes and
//! then wait, and reads the server's resident memory and descriptors before, while they are
//! held, and after they close:
//! - `idle`: connected, nothing sent;
//! - `partial`: half a request head (the slowloris opening);
//! - `trickle`: half a head, then one more header byte per connection every second;
//! - `body`: a whole head announcing 1,000 body bytes, and 10 of them;
//! - `oversized`: a head past the gateway's 64 KiB limit, which must be refused and closed.
//!
//! With `max_connections` at its default (10,000) and `count` at it, one connection more is
//! tried too: it must be closed unanswered.

use crate::cluster::{LISTEN_ANY, ports_for_peers, spawn_kvgate};
use crate::procfs;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Also measure nginx (Debian's) as a reverse proxy, one worker.
    pub nginx: bool,
    /// Connections per shape.
    pub count: usize,
    /// Shapes to run.
    pub shapes: Vec<Shape>,
    /// Seconds the connections are held before the memory is read.
    pub hold_s: u64,
    /// kvgate's `threads`.
    pub threads: usize,
    /// Where configs go.
    pub out: PathBuf,
}

/// How each client behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Connected, nothing sent.
    Idle,
    /// Half a request head.
    Partial,
    /// Half a head, then a byte more every second.
    Trickle,
    /// A whole head and the first 10 of 1,000 body bytes.
    Body,
    /// A head over the 64 KiB limit.
    Oversized,
}

impl Shape {
    /// Every shape, in report order.
    pub const ALL: [Shape; 5] = [Shape::Idle, Shape::Partial, Shape::Trickle, Shape::Body, Shape::Oversized];

    /// Its name on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Idle => "idle",
            Shape::Partial => "partial",
            Shape::Trickle => "trickle",
            Shape::Body => "body",
            Shape::Oversized => "oversized",
        }
    }

    /// The shape named `s`.
    pub fn parse(s: &str) -> Result<Shape, String> {
        Shape::ALL.into_iter().find(|x| x.name() == s).ok_or_else(|| format!("unknown shape {s:?} (idle, partial, trickle, body, oversized)"))
    }

    /// What each client sends first.
    fn opening(self) -> Vec<u8> {
        const HALF: &[u8] = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n";
        match self {
            Shape::Idle => Vec::new(),
            Shape::Partial | Shape::Trickle => HALF.to_vec(),
            Shape::Body => [HALF, b"Content-Length: 1000\r\n\r\n{\"model\":"].concat(),
            Shape::Oversized => {
                let mut head = HALF.to_vec();
                for i in 0..80 {
                    head.extend_from_slice(format!("x-pad-{i}: {}\r\n", "a".repeat(1000)).as_bytes());
                }
                head
            }
        }
    }
}

/// One target and shape's figures.
#[derive(Debug, Clone)]
pub struct Figure {
    /// `kvgate` or `nginx`.
    pub target: &'static str,
    /// The shape.
    pub shape: Shape,
    /// Connections opened.
    pub opened: usize,
    /// Of them, still open when the memory was read.
    pub open: usize,
    /// Resident memory before, while held, a few seconds after they closed, and after 200
    /// requests more (KiB).
    pub rss_kib: [u64; 4],
    /// Descriptors before and while held.
    pub fds: [usize; 2],
    /// Whether one connection past `max_connections` was closed unanswered (kvgate, at the cap).
    pub past_cap_closed: Option<bool>,
}

impl Figure {
    /// Memory added per connection that was held (bytes).
    pub fn per_connection(&self) -> f64 {
        (self.rss_kib[1] as f64 - self.rss_kib[0] as f64) * 1024.0 / self.opened.max(1) as f64
    }
}

/// A server under test.
struct Server {
    name: &'static str,
    child: Child,
    port: u16,
    /// How to stop it so it stops its own children (nginx's master its workers).
    stop: Option<Command>,
}

impl Drop for Server {
    fn drop(&mut self) {
        match self.stop.as_mut() {
            Some(stop) => drop(stop.status()),
            None => drop(Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status()),
        }
        let _ = self.child.wait();
    }
}

/// The servers compared.
#[derive(Clone, Copy)]
enum Kind {
    Kvgate,
    Nginx,
}

/// Starts one kind of server.
async fn start(kind: Kind, o: &Options) -> Result<Server, String> {
    match kind {
        Kind::Kvgate => start_kvgate_server(o).await,
        Kind::Nginx => start_nginx(o),
    }
}

/// Runs every shape on kvgate, then on nginx.
pub async fn run(o: &Options) -> Result<Vec<Figure>, String> {
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let mut figures = Vec::new();
    let mut servers = vec![Kind::Kvgate];
    if o.nginx {
        servers.push(Kind::Nginx);
    }
    for kind in servers {
        for &shape in &o.shapes {
            // A fresh server per shape: what one shape left behind does not count for the next.
            let server = start(kind, o).await?;
            wait_listening(server.port).await?;
            figures.push(measure(o, &server, shape).await?);
        }
    }
    Ok(figures)
}

async fn start_kvgate_server(o: &Options) -> Result<Server, String> {
    // The worker's port is closed (a privileged one nothing binds): no request here ever
    // reaches one.
    let config = format!("{LISTEN_ANY}threads: {}\nmodels:\n  - name: m\n    workers:\n      - url: http://127.0.0.1:1\n", o.threads);
    let path = o.out.join(format!("kvgate-connections-{}.yaml", std::process::id()));
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let (child, at) = spawn_kvgate(&o.kvgate_bin, &path).await?;
    let port = at.url.rsplit(':').next().and_then(|p| p.parse().ok()).ok_or_else(|| format!("no port in {}", at.url))?;
    Ok(Server { name: "kvgate", child, port, stop: None })
}

fn start_nginx(o: &Options) -> Result<Server, String> {
    let port = ports_for_peers(1)[0];
    let prefix = std::path::absolute(o.out.join(format!("nginx-{port}"))).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(prefix.join("logs")).map_err(|e| e.to_string())?;
    let conns = o.count + 64;
    let conf = format!(
        "worker_processes 1;\nworker_rlimit_nofile {files};\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log crit;\nevents {{ worker_connections {conns}; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n  fastcgi_temp_path {p}/fcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
           server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://127.0.0.1:1;\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
        files = conns + 64,
        p = prefix.display()
    );
    let conf_path = prefix.join("nginx.conf");
    std::fs::write(&conf_path, conf).map_err(|e| e.to_string())?;
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = vec!["-p".to_string(), prefix.display().to_string(), "-c".to_string(), conf_path.display().to_string()];
        a.extend(extra.iter().map(|s| (*s).to_string()));
        a
    };
    let child = Command::new("nginx")
        .args(args(&["-g", "daemon off;"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("nginx: {e} (apt-get install nginx)"))?;
    let mut stop = Command::new("nginx");
    stop.args(args(&["-s", "stop"])).stdout(Stdio::null()).stderr(Stdio::null());
    Ok(Server { name: "nginx", child, port, stop: Some(stop) })
}

async fn wait_listening(port: u16) -> Result<(), String> {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if start.elapsed() > Duration::from_secs(20) {
            return Err(format!("nothing listens on {port} after 20 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The probe's own connection is gone before the baseline is read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

async fn measure(o: &Options, server: &Server, shape: Shape) -> Result<Figure, String> {
    let pid = server.child.id();
    let before = (procfs::rss_kib(pid), procfs::fds(pid));
    let mut conns = open_all(server.port, o.count, &shape.opening()).await?;
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(o.hold_s.max(1)) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if shape == Shape::Trickle {
            for c in &mut conns {
                let _ = c.write_all(b"x").await;
            }
        }
    }
    let during = (procfs::rss_kib(pid), procfs::fds(pid));
    let open = conns.iter().filter(|c| still_open(c)).count();
    let past_cap_closed = if server.name == "kvgate" && o.count == 10_000 && open == o.count { Some(past_cap(server.port).await) } else { None };
    drop(conns);
    // Closed connections' memory goes back with the allocator's purge delay.
    let gone = Instant::now();
    while procfs::fds(pid) > before.1 + 2 && gone.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = procfs::rss_kib(pid);
    // An allocator that returns freed memory lazily (kvgate's mimalloc, after its purge delay,
    // on its next call in the thread that freed) does so once requests come again.
    for _ in 0..200 {
        let _ = past_cap(server.port).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = procfs::rss_kib(pid);
    Ok(Figure { target: server.name, shape, opened: o.count, open, rss_kib: [before.0, during.0, after, later], fds: [before.1, during.1], past_cap_closed })
}

/// Opens `n` connections, 250 at a time, each sending `opening`.
async fn open_all(port: u16, n: usize, opening: &[u8]) -> Result<Vec<TcpStream>, String> {
    let mut all = Vec::with_capacity(n);
    while all.len() < n {
        let batch = (n - all.len()).min(250);
        let opened = futures_util::future::join_all((0..batch).map(|_| async move {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| format!("connect: {e}"))?;
            // A server that refuses a head may close before all of it is written: not an error here.
            let _ = s.write_all(opening).await;
            Ok::<_, String>(s)
        }))
        .await;
        for s in opened {
            all.push(s?);
        }
    }
    Ok(all)
}

/// Whether the server still holds `c` open: nothing to read, no end of stream.
fn still_open(c: &TcpStream) -> bool {
    let mut buf = [0u8; 1];
    matches!(c.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Whether one more connection, past the cap, is closed without an answer.
async fn past_cap(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else { return true };
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

/// The report as a Markdown table.
pub fn table(figures: &[Figure]) -> String {
    let mut t = String::from(
        "| server | shape | connections | still open | RSS before | RSS held | per connection | RSS after close | after 200 requests | fds held | past the cap |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for f in figures {
        let mib = |k: u64| format!("{:.1} MiB", k as f64 / 1024.0);
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {} | {} | {:.1} KiB | {} | {} | {} | {} |",
            f.target,
            f.shape.name(),
            f.opened,
            f.open,
            mib(f.rss_kib[0]),
            mib(f.rss_kib[1]),
            f.per_connection() / 1024.0,
            mib(f.rss_kib[2]),
            mib(f.rss_kib[3]),
            f.fds[1],
            match f.past_cap_closed {
                Some(true) => "closed",
                Some(false) => "ANSWERED",
                None => "-",
            }
        );
    }
    t
}
