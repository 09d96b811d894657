//! What kvgate adds on top of a fast upstream: requests/s and latency percentiles, direct vs
//! through the gateway, in the same run.
//!
//! The upstream is a minimal keep-alive HTTP/1.1 server inside this process that answers every
//! POST with a fixed OpenAI-shaped completion (unary) or a short SSE stream, so the gateway's
//! own cost dominates. The gateway is the release `kvgate` binary with a generated config.
//!
//!   cargo build --release -p kvgate -p kvgate-bench
//!   target/release/proxy-overhead --seconds 10
//!
//! `--baseline-bin OTHER_KVGATE` also runs a second gateway (e.g. the previous commit's build)
//! in front of the same upstream and measures it in the same run, interleaved with the first.

use clap::Parser;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrency levels to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    concurrency: Vec<usize>,
    /// Path of the kvgate binary.
    #[arg(long, default_value = "target/release/kvgate")]
    kvgate_bin: String,
    /// A second kvgate binary to measure in the same run (e.g. the previous commit's).
    #[arg(long)]
    baseline_bin: Option<String>,
    /// SSE chunks per streamed response.
    #[arg(long, default_value_t = 16)]
    stream_chunks: usize,
}

const UNARY: &str = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}"#;

async fn serve_conn(mut s: TcpStream, chunks: usize) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(8192);
    let mut tmp = [0u8; 8192];
    loop {
        // Read one request: headers, then Content-Length bytes of body.
        let (head_end, len) = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                let len = head.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok())).unwrap_or(0);
                break (i + 4, len);
            }
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        while buf.len() < head_end + len {
            match s.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
        let stream = buf[head_end..head_end + len].windows(13).any(|w| w == b"\"stream\":true");
        let path_health = buf.starts_with(b"GET /health");
        buf.drain(..head_end + len);
        let ok = if path_health {
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await
        } else if stream {
            let mut out = String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
            for i in 0..chunks {
                let ev = format!("data: {{\"id\":\"cmpl-1\",\"choices\":[{{\"index\":0,\"text\":\" t{i}\"}}]}}\n\n");
                out.push_str(&format!("{:x}\r\n{ev}\r\n", ev.len()));
            }
            let done = "data: [DONE]\n\n";
            out.push_str(&format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len()));
            s.write_all(out.as_bytes()).await
        } else {
            s.write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{UNARY}", UNARY.len()).as_bytes()).await
        };
        if ok.is_err() {
            return;
        }
    }
}

struct Run {
    rps: f64,
    p50: Duration,
    p99: Duration,
    errors: u64,
}

async fn measure(url: &str, body: &'static str, conc: usize, secs: u64) -> Run {
    let http = reqwest::Client::builder().pool_max_idle_per_host(conc).build().unwrap();
    // Warm the pools.
    for _ in 0..conc {
        let _ = http.post(url).header("content-type", "application/json").body(body).send().await.map(|r| r.bytes());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (http, url, stop) = (http.clone(), url.to_string(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match http.post(&url).header("content-type", "application/json").body(body).send().await {
                    Ok(r) if r.status() == 200 => match r.bytes().await {
                        Ok(_) => lat.push(t.elapsed()),
                        Err(_) => errors += 1,
                    },
                    _ => errors += 1,
                }
            }
            (lat, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    all.sort();
    let pct = |p: f64| all.get(((all.len() as f64 - 1.0) * p) as usize).copied().unwrap_or_default();
    Run { rps: all.len() as f64 / secs as f64, p50: pct(0.50), p99: pct(0.99), errors }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    let up = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = up.local_addr().unwrap();
    let chunks = a.stream_chunks;
    let accepted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let acc = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = up.accept().await {
            acc.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(serve_conn(s, chunks));
        }
    });
    let dir = std::env::temp_dir().join(format!("kvgate-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (gw, gw_port) = start_gateway(&a.kvgate_bin, &dir.join("kvgate.yaml"), up_addr);
    let baseline = a.baseline_bin.as_ref().map(|bin| start_gateway(bin, &dir.join("baseline.yaml"), up_addr));
    let unary = r#"{"model":"m","prompt":"hello","max_tokens":1}"#;
    let stream = r#"{"model":"m","prompt":"hello","max_tokens":16,"stream":true}"#;
    println!("| request | concurrency | path | requests/s | p50 | p99 | errors |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    for (kind, body) in [("unary", unary), ("stream (16 chunks)", stream)] {
        for &c in &a.concurrency {
            let direct = measure(&format!("http://{up_addr}/v1/completions"), body, c, a.seconds).await;
            let base = match &baseline {
                Some((_, port)) => Some(measure(&format!("http://127.0.0.1:{port}/v1/completions"), body, c, a.seconds).await),
                None => None,
            };
            let via = measure(&format!("http://127.0.0.1:{gw_port}/v1/completions"), body, c, a.seconds).await;
            for (name, r) in [("direct", Some(&direct)), ("baseline", base.as_ref()), ("kvgate", Some(&via))] {
                let Some(r) = r else { continue };
                println!("| {kind} | {c} | {name} | {:.0} | {:.0} µs | {:.0} µs | {} |", r.rps, us(r.p50), us(r.p99), r.errors);
            }
            println!(
                "| {kind} | {c} | **added by kvgate** | {:.2}× | +{:.0} µs | +{:.0} µs | |",
                via.rps / direct.rps,
                us(via.p50) - us(direct.p50),
                us(via.p99) - us(direct.p99)
            );
            if let Some(b) = &base {
                println!(
                    "| {kind} | {c} | **kvgate vs baseline** | {:.2}× | {:+.0} µs | {:+.0} µs | |",
                    via.rps / b.rps,
                    us(via.p50) - us(b.p50),
                    us(via.p99) - us(b.p99)
                );
            }
        }
    }
    println!("\nupstream connections accepted over the whole run: {}", accepted.load(Ordering::Relaxed));
    for mut child in std::iter::once(gw).chain(baseline.map(|b| b.0)) {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Starts `bin` with a generated config in front of `upstream`; returns it and its port once it
/// accepts connections.
fn start_gateway(bin: &str, cfg: &std::path::Path, upstream: std::net::SocketAddr) -> (std::process::Child, u16) {
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (port, admin_port) = (free(), free());
    let yaml = format!(
        "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin_port}\nthreads: 2\nmodels:\n  - name: m\n    workers:\n      - url: http://{upstream}\n"
    );
    std::fs::write(cfg, yaml).unwrap();
    let child = Command::new(bin)
        .args(["--config", cfg.to_str().unwrap(), "--log", "warn"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin} (cargo build --release -p kvgate): {e}"));
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, port)
}
