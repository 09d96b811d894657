//! What a proxy adds on top of a fast upstream: requests/s and latency percentiles, direct and
//! through each proxy, measured in one run, interleaved.
//!
//! The upstream is a minimal keep-alive HTTP/1.1 server inside this process that answers every
//! POST with a fixed OpenAI-shaped completion (unary) or an SSE stream of `--stream-chunks`
//! token events, so the proxies' own cost dominates. The proxies:
//! - `kvgate`: the release binary (`--kvgate-bin`) in `round_robin` mode;
//! - `kvgate-kv` (`--kv-tokenizer DIR`): the same binary in `kv` mode (approximate, no events)
//!   with a real tokenizer, so every request's text prompt is tokenized, hashed and looked up;
//! - `baseline` (`--baseline-bin`): another kvgate build, e.g. the previous commit's;
//! - `nginx` (`--compare-nginx`): Debian's nginx (`apt-get install nginx`) as a keep-alive
//!   reverse proxy with buffering off, `--nginx-workers` worker processes (default 1);
//! - `nginx-N` (`--compare-nginx --nginx-workers-also N`): a second nginx with N workers, e.g.
//!   one per core as its packaged `worker_processes auto` gives, beside the first;
//! - `floor` (`--floor-bin target/release/floor-proxy`): the least a tokio HTTP/1 forwarder
//!   does (`floor_proxy.rs`), to tell the runtime's share of a gap to nginx from the gateway's;
//! - `floor+N` (`--floor-bin … --floor-work-us N`): the same forwarder spinning N µs on each
//!   request (`--work-us`), a stand-in for a gateway of that cost on the same engine.
//!
//! The load comes from the built-in client (reqwest, closed loop, one connection per concurrent
//! request) or, with `--wrk`, from wrk (`apt-get install wrk`; 1 thread), which costs far less
//! CPU per request and so leaves more of the shared cores to the proxies.
//!
//! `--rounds N` measures each path N times per row, the paths taking turns, so that the shared
//! machine's slow spells (on a shared VM even nginx's own rate swings widely from one window to
//! the next) are spread over every path instead of landing on whichever ran then.
//!
//! By default the proxies share every core with the load and the upstream, so the scheduler's
//! placement of four busy threads on a small machine moves the figures from run to run.
//! `--proxy-cpus 1` starts each proxy under `taskset -c 1` (util-linux); run the bench itself
//! under `taskset -c 0` so that the load and the upstream keep to the other core. Each proxy then
//! has the same core to itself, and sizes itself to it: kvgate's default thread count is the
//! cores its process may use, nginx runs `--nginx-workers`.
//!
//!   cargo build --release -p kvgate -p kvgate-bench
//!   target/release/proxy-overhead --seconds 10
//!   target/release/proxy-overhead --wrk --compare-nginx --concurrency 1,64 --rounds 5 \
//!       --kv-tokenizer ../shared/data/tokenizers/<dir>

use clap::Parser;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
    /// Also measure kvgate in kv mode with this tokenizer directory (text prompts tokenized).
    #[arg(long)]
    kv_tokenizer: Option<PathBuf>,
    /// Also measure nginx as a reverse proxy in front of the same upstream.
    #[arg(long)]
    compare_nginx: bool,
    /// nginx worker processes.
    #[arg(long, default_value_t = 1)]
    nginx_workers: usize,
    /// Also measure a second nginx with this many worker processes (path `nginx-N`).
    #[arg(long, requires = "compare_nginx", value_parser = clap::value_parser!(u16).range(1..))]
    nginx_workers_also: Option<u16>,
    /// Worker threads of kvgate and of `floor-proxy` (default: their own default, the number
    /// of CPUs they may use).
    #[arg(long)]
    kvgate_threads: Option<usize>,
    /// Also measure `floor-proxy` (this binary's sibling), a bare tokio forwarder.
    #[arg(long)]
    floor_bin: Option<String>,
    /// Also measure `floor-proxy` spinning this many µs on each request (path `floor+N`).
    #[arg(long, requires = "floor_bin", value_parser = clap::value_parser!(u64).range(1..))]
    floor_work_us: Option<u64>,
    /// Start each proxy under `taskset -c <CPUS>` (e.g. `1`), so it has these cores to itself;
    /// run the bench itself under `taskset -c` with the other cores.
    #[arg(long)]
    proxy_cpus: Option<String>,
    /// Rounds per row: each path is measured this many times for `--seconds`, the paths taking
    /// turns (each round starting one path further on; a multiple of the path count gives each
    /// path every place in the order equally often), so a slow spell of the shared machine is
    /// spread over the paths. A row sums its rounds, so its CPU per request covers them all; its
    /// latencies are the rounds' medians, so one slow round does not set them; its ratio to
    /// nginx also shows the range of the rounds' own ratios.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Generate the load with wrk (1 thread) instead of the built-in client.
    #[arg(long)]
    wrk: bool,
    /// SSE chunks per streamed response.
    #[arg(long, default_value_t = 16)]
    stream_chunks: usize,
    /// Paced streams for the per-token delay (0 = skip): requests per target.
    #[arg(long, default_value_t = 200)]
    token_delay_requests: usize,
    /// Only these request kinds (unary, stream, chat: a unary chat request on
    /// /v1/chat/completions, rendered with the tokenizer's chat template in kv mode).
    #[arg(long, value_delimiter = ',', default_value = "unary,stream")]
    kinds: Vec<String>,
}

const UNARY: &str = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}"#;

async fn serve_conn(mut s: TcpStream, chunks: usize) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(8192);
    let mut tmp = [0u8; 8192];
    let stream_response = stream_body(chunks);
    let unary_response = format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{UNARY}", UNARY.len());
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
        let body = &buf[head_end..head_end + len];
        let stream = body.windows(13).any(|w| w == b"\"stream\":true");
        let paced = body.windows(11).any(|w| w == b"\"pace\":true");
        let get = buf.starts_with(b"GET ");
        buf.drain(..head_end + len);
        let ok = if paced {
            paced_stream(&mut s, chunks).await
        } else if get {
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await
        } else if stream {
            s.write_all(stream_response.as_bytes()).await
        } else {
            s.write_all(unary_response.as_bytes()).await
        };
        if ok.is_err() {
            return;
        }
    }
}

/// When the harness started: token events carry their send time as nanoseconds since then.
static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn now_ns() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A stream whose token events leave one by one, 1 ms apart, each stamped with its send time.
async fn paced_stream(s: &mut TcpStream, chunks: usize) -> std::io::Result<()> {
    s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").await?;
    for i in 0..chunks {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let ev = format!("data: {{\"id\":\"cmpl-1\",\"t\":{},\"choices\":[{{\"index\":0,\"text\":\" t{i}\"}}]}}\n\n", now_ns());
        s.write_all(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes()).await?;
    }
    let done = "data: [DONE]\n\n";
    s.write_all(format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len()).as_bytes()).await
}

/// Per-token delay at concurrency 1: for each token event of `n` paced streams per URL, the time
/// from the upstream's write to the client's read. The URLs take turns stream by stream, each
/// round starting one further on, so a burst from the shared machine (or whatever comes with a
/// place in the order) falls on every path alike. Returns each URL's delays, each marked whether
/// it is a stream's first token (the one after the response head).
///
/// The client runs on a thread and runtime of its own, apart from the upstream's, as a client
/// and a worker are apart in a deployment: sharing the upstream's runtime, the direct path's
/// tokens were read by the thread that had just written them, without the wake-up every
/// proxied token costs the client, and that wake-up was counted as the proxy's.
async fn token_delays(urls: &[String], n: usize) -> Vec<Vec<(Duration, bool)>> {
    let urls = urls.to_vec();
    let client = move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("the per-token client's runtime");
        rt.block_on(async {
            let http = reqwest::Client::new();
            let mut out = vec![Vec::new(); urls.len()];
            for i in taking_turns(n, urls.len()) {
                stream_delays(&http, &urls[i], &mut out[i]).await;
            }
            out
        })
    };
    tokio::task::spawn_blocking(client).await.expect("the per-token client panicked")
}

/// The order in which `paths` paths are measured over `rounds` rounds: every path once per
/// round, each round starting one path further on, so that whatever comes with a place in the
/// order (a slow spell of the machine, following a given path) falls on every path alike.
fn taking_turns(rounds: usize, paths: usize) -> impl Iterator<Item = usize> {
    (0..rounds).flat_map(move |round| (0..paths).map(move |k| (round + k) % paths))
}

/// The `p` quantile (0 to 1) of `sorted`, nearest rank below; zero when empty.
#[allow(clippy::cast_sign_loss, reason = "an empty list's rank, -p, saturates to 0, which `get` then misses")]
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted.get(((sorted.len() as f64 - 1.0) * p) as usize).copied().unwrap_or_default()
}

/// One paced stream from `url`: each token event's delay, and whether it is the stream's first,
/// appended to `out`.
async fn stream_delays(http: &reqwest::Client, url: &str, out: &mut Vec<(Duration, bool)>) {
    let start = out.len();
    let body = r#"{"model":"m","prompt":"hello","max_tokens":16,"stream":true,"pace":true}"#;
    let Ok(mut r) = http.post(url).header("content-type", "application/json").body(body).send().await else { return };
    let mut carry = Vec::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        let at = now_ns();
        carry.extend_from_slice(&chunk);
        // Complete lines only; a stamp split across reads is read with its second half.
        let Some(end) = carry.iter().rposition(|&b| b == b'\n') else { continue };
        let lines: Vec<u8> = carry.drain(..=end).collect();
        for line in lines.split(|&b| b == b'\n') {
            let text = String::from_utf8_lossy(line);
            if let Some(t) = text.split("\"t\":").nth(1).and_then(|v| v.split(',').next()).and_then(|v| v.parse::<u64>().ok()) {
                out.push((Duration::from_nanos(at.saturating_sub(t)), out.len() == start));
            }
        }
    }
}

/// A chunked SSE response of `chunks` token events and `[DONE]`.
fn stream_body(chunks: usize) -> String {
    let mut out = String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n");
    for i in 0..chunks {
        let ev = format!("data: {{\"id\":\"cmpl-1\",\"choices\":[{{\"index\":0,\"text\":\" t{i}\"}}]}}\n\n");
        let _ = write!(out, "{:x}\r\n{ev}\r\n", ev.len());
    }
    let done = "data: [DONE]\n\n";
    let _ = write!(out, "{:x}\r\n{done}\r\n0\r\n\r\n", done.len());
    out
}

/// One measurement.
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
    Run { rps: all.len() as f64 / secs as f64, p50: percentile(&all, 0.50), p99: percentile(&all, 0.99), errors }
}

/// Runs wrk (1 thread) against `url` with `body` POSTed; parses its summary.
async fn measure_wrk(url: &str, body: &str, conc: usize, secs: u64, dir: &Path) -> Run {
    let script = dir.join(format!("post-{}.lua", body.len()));
    let lua = format!("wrk.method = \"POST\"\nwrk.body = '{body}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\n");
    std::fs::write(&script, lua).unwrap();
    let out = tokio::process::Command::new("wrk")
        .args(["-t1", &format!("-c{conc}"), &format!("-d{secs}s"), "--latency", "-s", script.to_str().unwrap(), url])
        .output()
        .await
        .expect("run wrk (apt-get install wrk)");
    parse_wrk(&String::from_utf8_lossy(&out.stdout))
}

/// Reads requests/s, the 50% and 99% latencies and the error counts from wrk's report.
fn parse_wrk(text: &str) -> Run {
    let dur = |v: &str| -> Duration {
        let (num, unit) = v.trim().split_at(v.trim().find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.trim().len()));
        let x: f64 = num.parse().unwrap_or(0.0);
        Duration::from_secs_f64(match unit {
            "us" => x / 1e6,
            "ms" => x / 1e3,
            "s" => x,
            "m" => x * 60.0,
            _ => 0.0,
        })
    };
    let mut run = Run { rps: 0.0, p50: Duration::ZERO, p99: Duration::ZERO, errors: 0 };
    for line in text.lines() {
        let l = line.trim();
        if let Some(v) = l.strip_prefix("Requests/sec:") {
            run.rps = v.trim().parse().unwrap_or(0.0);
        } else if let Some(v) = l.strip_prefix("50%") {
            run.p50 = dur(v);
        } else if let Some(v) = l.strip_prefix("99%") {
            run.p99 = dur(v);
        } else if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            run.errors += v.trim().parse::<u64>().unwrap_or(0);
        } else if let Some(v) = l.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            run.errors += v.split(',').filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok()).sum::<u64>();
        }
    }
    run
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One path's rounds in a row: kept apart for the medians and the range of ratios, summed for
/// the rate and the CPU per request.
struct PathRuns {
    name: &'static str,
    rounds: Vec<Run>,
    /// How long each round ran.
    round_secs: f64,
    /// The proxy's CPU time over its rounds (none for the direct path).
    cpu: Option<Duration>,
}

impl PathRuns {
    /// Requests/s over every round (the rounds are equally long).
    fn rps(&self) -> f64 {
        self.rounds.iter().map(|r| r.rps).sum::<f64>() / self.rounds.len().max(1) as f64
    }

    /// Requests served over every round, each round's taken as its rate times its length.
    fn requests(&self) -> f64 {
        self.rps() * self.round_secs * self.rounds.len() as f64
    }

    fn errors(&self) -> u64 {
        self.rounds.iter().map(|r| r.errors).sum()
    }

    /// The middle round's value (the upper of the two middle ones for an even count).
    fn median(&self, f: impl Fn(&Run) -> Duration) -> Duration {
        let mut v: Vec<Duration> = self.rounds.iter().map(f).collect();
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    }

    /// Requests/s against `base`'s, over all rounds; with several rounds, also the lowest and
    /// highest of the rounds' own ratios (round k of each path ran in the same round, a few
    /// measurements apart, so the range also holds the noise within a round).
    fn vs(&self, base: &PathRuns) -> String {
        let all = format!("{:.2}×", self.rps() / base.rps().max(f64::MIN_POSITIVE));
        if self.rounds.len() < 2 || std::ptr::eq(self, base) {
            return all;
        }
        let ratios: Vec<f64> = self.rounds.iter().zip(&base.rounds).map(|(x, b)| x.rps / b.rps.max(f64::MIN_POSITIVE)).collect();
        let (lo, hi) = ratios.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        format!("{all} ({lo:.2}–{hi:.2})")
    }
}

/// Measures every target at concurrency `c` on `path`, `--rounds` times each. The targets take
/// turns round by round rather than one after the other, so that no target has a slow spell of
/// the machine to itself.
async fn measure_paths(targets: &[Target], path: &str, body: &'static str, c: usize, a: &Args, dir: &Path) -> Vec<PathRuns> {
    let mut out: Vec<PathRuns> = targets
        .iter()
        .map(|t| PathRuns { name: t.name, rounds: Vec::new(), round_secs: a.seconds as f64, cpu: t.child.as_ref().map(|_| Duration::ZERO) })
        .collect();
    for i in taking_turns(a.rounds as usize, targets.len()) {
        let t = &targets[i];
        let url = format!("http://127.0.0.1:{}{path}", t.port);
        let pid = t.child.as_ref().map(Child::id);
        let cpu0 = pid.map(tree_cpu_time);
        let r = if a.wrk { measure_wrk(&url, body, c, a.seconds, dir).await } else { measure(&url, body, c, a.seconds).await };
        let p = &mut out[i];
        if let (Some(pid), Some(c0), Some(total)) = (pid, cpu0, p.cpu.as_mut()) {
            *total += tree_cpu_time(pid).saturating_sub(c0);
        }
        p.rounds.push(r);
    }
    out
}

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat`; threads
/// included. Zero when unreadable.
fn cpu_time(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Duration::ZERO };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of stat, i.e. 11 and 12 after the name.
    Duration::from_secs_f64((ticks(11) + ticks(12)) as f64 / 100.0)
}

/// CPU time of every process whose parent is `pid` or which is `pid` (nginx: master + workers).
fn tree_cpu_time(pid: u32) -> Duration {
    kvgate_bench::procfs::family(pid).into_iter().map(cpu_time).sum()
}

/// A proxy under test: its name, its process and its port.
struct Target {
    name: &'static str,
    child: Option<Child>,
    port: u16,
    /// How to stop it gracefully (nginx: its master must stop its workers itself).
    stop: Option<Command>,
}

impl Drop for Target {
    /// Stops the proxy, also when the run fails part-way (a proxy that did not start).
    fn drop(&mut self) {
        if let Some(stop) = self.stop.as_mut() {
            let _ = stop.status();
        }
        if let Some(mut child) = self.child.take() {
            if self.stop.is_some() {
                // nginx's master exits once its workers have; killed before that, it would
                // leave them running, orphaned, on the cores of the next run.
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port for nginx, which cannot bind port 0 and say which port it got: from below the
/// kernel's ephemeral range, so no connection or port-0 bind takes it before nginx binds it.
fn port_for_peer() -> u16 {
    kvgate_tests::ports::reserved_run(1)
}

/// The port in the `--ports-file` our own binaries write once bound (under `key`), waited for.
fn bound_port(child: &mut std::process::Child, file: &Path, key: &str, what: &str) -> u16 {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let addr = v[key].as_str().unwrap_or_else(|| panic!("{what} wrote no {key}: {v}"));
            return addr.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in {addr}"));
        }
        assert!(matches!(child.try_wait(), Ok(None)), "{what} exited before binding (an older build without --ports-file?)");
        assert!(start.elapsed() < Duration::from_secs(20), "{what} wrote no {} in 20 s", file.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_listening(port: u16, what: &str) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "{what} did not start listening on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A proxy's command, under `taskset -c <cpus>` when the proxies are pinned.
fn proxy_command(bin: &str, cpus: Option<&str>) -> Command {
    match cpus {
        Some(cpus) => {
            let mut c = Command::new("taskset");
            c.args(["-c", cpus, bin]);
            c
        }
        None => Command::new(bin),
    }
}

/// The CPUs this process may run on (`Cpus_allowed_list` of /proc/self/status).
fn own_cpus() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|v| v.trim().to_string())))
        .unwrap_or_else(|| "?".into())
}

/// Starts `bin` with a generated config in front of `upstream` (`extra` goes into the model).
fn start_gateway(name: &'static str, bin: &str, dir: &Path, upstream: std::net::SocketAddr, a: &Args, model_extra: &str) -> Target {
    let threads = a.kvgate_threads.map_or(String::new(), |t| format!("threads: {t}\n"));
    let yaml =
        format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{threads}models:\n  - name: m\n{model_extra}    workers:\n      - url: http://{upstream}\n");
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(&cfg, yaml).unwrap();
    let ports = dir.join(format!("{name}.ports.json"));
    let mut child = proxy_command(bin, a.proxy_cpus.as_deref())
        .args(["--config", cfg.to_str().unwrap(), "--log", "warn", "--ports-file", ports.to_str().unwrap()])
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin} (cargo build --release -p kvgate): {e}"));
    let port = bound_port(&mut child, &ports, "listen", name);
    wait_listening(port, name);
    Target { name, child: Some(child), port, stop: None }
}

/// Starts `floor-proxy` in front of `upstream`, spending `work_us` of CPU per request.
fn start_floor(name: &'static str, bin: &str, dir: &Path, upstream: std::net::SocketAddr, a: &Args, work_us: u64) -> Target {
    let ports = dir.join(format!("{name}.ports.json"));
    let mut cmd = proxy_command(bin, a.proxy_cpus.as_deref());
    cmd.args(["--listen", "127.0.0.1:0", "--upstream", &upstream.to_string(), "--ports-file", ports.to_str().unwrap()]);
    if work_us > 0 {
        cmd.args(["--work-us", &work_us.to_string()]);
    }
    if let Some(t) = a.kvgate_threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    let mut child = cmd.stdout(Stdio::null()).spawn().unwrap_or_else(|e| panic!("start {bin} (cargo build --release -p kvgate-bench): {e}"));
    let port = bound_port(&mut child, &ports, "listen", name);
    wait_listening(port, "floor-proxy");
    Target { name, child: Some(child), port, stop: None }
}

/// Starts nginx as a keep-alive reverse proxy with buffering off (SSE passes through), with
/// `workers` worker processes.
fn start_nginx(name: &'static str, dir: &Path, upstream: std::net::SocketAddr, a: &Args, workers: usize) -> Target {
    let port = port_for_peer();
    let prefix = dir.join(name);
    std::fs::create_dir_all(prefix.join("logs")).unwrap();
    let conf = format!(
        "worker_processes {workers};\npid {p}/nginx.pid;\nerror_log {p}/logs/error.log warn;\nevents {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n  fastcgi_temp_path {p}/fcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
           upstream up {{ server {upstream}; keepalive 256; }}\n\
           server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://up;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
        p = prefix.display()
    );
    let conf_path = prefix.join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let child = proxy_command("nginx", a.proxy_cpus.as_deref())
        .args(["-p", prefix.to_str().unwrap(), "-c", conf_path.to_str().unwrap(), "-g", "daemon off;"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nginx (apt-get install nginx)");
    wait_listening(port, "nginx");
    let mut stop = Command::new("nginx");
    stop.args(["-p", prefix.to_str().unwrap(), "-c", conf_path.to_str().unwrap(), "-s", "stop"]).stdout(Stdio::null()).stderr(Stdio::null());
    Target { name, child: Some(child), port, stop: Some(stop) }
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
    let mut targets = vec![Target { name: "direct", child: None, port: up_addr.port(), stop: None }];
    if a.compare_nginx {
        targets.push(start_nginx("nginx", &dir, up_addr, &a, a.nginx_workers));
        if let Some(n) = a.nginx_workers_also {
            // A path's name lives as long as the run.
            targets.push(start_nginx(Box::leak(format!("nginx-{n}").into_boxed_str()), &dir, up_addr, &a, usize::from(n)));
        }
    }
    if let Some(bin) = &a.floor_bin {
        targets.push(start_floor("floor", bin, &dir, up_addr, &a, 0));
        if let Some(w) = a.floor_work_us {
            targets.push(start_floor(Box::leak(format!("floor+{w}").into_boxed_str()), bin, &dir, up_addr, &a, w));
        }
    }
    if let Some(bin) = &a.baseline_bin {
        targets.push(start_gateway("baseline", bin, &dir, up_addr, &a, ""));
    }
    targets.push(start_gateway("kvgate", &a.kvgate_bin, &dir, up_addr, &a, "    routing:\n      mode: round_robin\n"));
    if let Some(tok) = &a.kv_tokenizer {
        let extra = format!("    tokenizer: {}\n    routing:\n      mode: kv\n      kv_events: false\n", tok.display());
        targets.push(start_gateway("kvgate-kv", &a.kvgate_bin, &dir, up_addr, &a, &extra));
    }
    // A few hundred characters of text, so kv mode has a real prompt to tokenize.
    let unary = r#"{"model":"m","prompt":"You are a helpful assistant. Summarize the following report in three sentences, keeping every figure: the gateway forwarded the request to the worker that already held most of its prompt in its KV cache.","max_tokens":1}"#;
    let stream = r#"{"model":"m","prompt":"You are a helpful assistant. Summarize the following report in three sentences, keeping every figure: the gateway forwarded the request to the worker that already held most of its prompt in its KV cache.","max_tokens":16,"stream":true}"#;
    let load = if a.wrk { "wrk, 1 thread" } else { "built-in client" };
    let cpus = match &a.proxy_cpus {
        Some(p) => format!("; CPUs: load and upstream {}, each proxy {p}", own_cpus()),
        None => format!("; CPUs: all shared ({})", own_cpus()),
    };
    println!("load: {load}; {} s per path and round, {} round(s) per row; chunks per stream: {chunks}{cpus}\n", a.seconds, a.rounds);
    println!("| request | concurrency | path | requests/s | p50 | p99 | errors | vs direct | vs nginx | proxy CPU µs/request |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let chat = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Summarize the following report in three sentences, keeping every figure: the gateway forwarded the request to the worker that already held most of its prompt in its KV cache."}],"max_tokens":1}"#;
    for (kind, body) in [("unary", unary), ("stream", stream), ("chat", chat)] {
        if !a.kinds.iter().any(|k| k == kind) {
            continue;
        }
        for &c in &a.concurrency {
            let path = if kind == "chat" { "/v1/chat/completions" } else { "/v1/completions" };
            let label = if kind == "stream" { format!("stream ({chunks} chunks)") } else { kind.to_string() };
            let runs = measure_paths(&targets, path, body, c, &a, &dir).await;
            let direct = runs[0].rps();
            let nginx = runs.iter().position(|r| r.name == "nginx");
            for r in &runs {
                let vs_nginx = nginx.map_or(String::new(), |n| r.vs(&runs[n]));
                let per_req = r.cpu.map_or(String::new(), |c| format!("{:.1}", us(c) / r.requests().max(1.0)));
                println!(
                    "| {label} | {c} | {} | {:.0} | {:.0} µs | {:.0} µs | {} | {:.2}× | {vs_nginx} | {per_req} |",
                    r.name,
                    r.rps(),
                    us(r.median(|x| x.p50)),
                    us(r.median(|x| x.p99)),
                    r.errors(),
                    r.rps() / direct
                );
            }
        }
    }
    if a.token_delay_requests > 0 {
        println!(
            "\nPer-token delay, concurrency 1: {} paced streams of {chunks} token events 1 ms apart per path, the paths taking turns stream by stream; upstream write → client read.\n",
            a.token_delay_requests
        );
        // A stream's first token follows the response head, which a proxy parses and writes
        // anew (and may hold back until the token); the later ones are the relay's own
        // per-token cost. Each is shown apart too.
        println!("| path | tokens | p50 | p99 | added p50 | added p99 | first tokens: p50 / p99 | later tokens: p50 / p99 | later tokens, added p99 |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut direct: Option<[Duration; 3]> = None;
        let urls: Vec<String> = targets.iter().map(|t| format!("http://127.0.0.1:{}/v1/completions", t.port)).collect();
        let delays = token_delays(&urls, a.token_delay_requests).await;
        for (t, d) in targets.iter().zip(delays) {
            let sorted = |keep: &dyn Fn(bool) -> bool| {
                let mut v: Vec<Duration> = d.iter().filter(|(_, first)| keep(*first)).map(|(x, _)| *x).collect();
                v.sort();
                v
            };
            let (all, first, later) = (sorted(&|_| true), sorted(&|f| f), sorted(&|f| !f));
            let (p50, p99, l99) = (percentile(&all, 0.5), percentile(&all, 0.99), percentile(&later, 0.99));
            let [a50, a99, al99] = direct.map_or([0.0; 3], |[d50, d99, dl99]| [us(p50) - us(d50), us(p99) - us(d99), us(l99) - us(dl99)]);
            direct.get_or_insert([p50, p99, l99]);
            println!(
                "| {} | {} | {:.0} µs | {:.0} µs | {a50:+.0} µs | {a99:+.0} µs | {:.0} / {:.0} µs | {:.0} / {:.0} µs | {al99:+.0} µs |",
                t.name,
                all.len(),
                us(p50),
                us(p99),
                us(percentile(&first, 0.5)),
                us(percentile(&first, 0.99)),
                us(percentile(&later, 0.5)),
                us(l99)
            );
        }
    }
    println!("\nupstream connections accepted over the whole run: {}", accepted.load(Ordering::Relaxed));
    drop(targets);
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    fn run(rps: f64, p50_us: u64) -> Run {
        Run { rps, p50: Duration::from_micros(p50_us), p99: Duration::from_micros(p50_us * 3), errors: 0 }
    }

    fn path(name: &'static str, rounds: Vec<Run>) -> PathRuns {
        PathRuns { name, rounds, round_secs: 1.0, cpu: None }
    }

    #[test]
    fn every_path_takes_every_place_in_the_order_once_per_full_cycle() {
        let order: Vec<usize> = taking_turns(3, 3).collect();
        assert_eq!(order, [0, 1, 2, 1, 2, 0, 2, 0, 1]);
        for place in 0..3 {
            let mut at: Vec<usize> = order.chunks(3).map(|round| round[place]).collect();
            at.sort_unstable();
            assert_eq!(at, [0, 1, 2], "place {place}");
        }
    }

    #[test]
    fn a_row_sums_its_rounds_and_shows_the_range_of_their_ratios() {
        let nginx = path("nginx", vec![run(100.0, 10), run(50.0, 30), run(80.0, 20)]);
        let kvgate = path("kvgate", vec![run(90.0, 12), run(50.0, 25), run(60.0, 40)]);
        assert_eq!(kvgate.rps(), 200.0 / 3.0);
        assert_eq!(kvgate.requests(), 200.0);
        // 200 against 230 over the row; the rounds' own ratios run from 0.75 to 1.00.
        assert_eq!(kvgate.vs(&nginx), "0.87× (0.75–1.00)");
        assert_eq!(kvgate.median(|r| r.p50), Duration::from_micros(25));
        assert_eq!(nginx.vs(&nginx), "1.00×", "a path against itself has no range");
    }

    #[test]
    fn one_round_is_a_plain_ratio() {
        let nginx = path("nginx", vec![run(100.0, 10)]);
        let kvgate = path("kvgate", vec![run(85.0, 12)]);
        assert_eq!(kvgate.vs(&nginx), "0.85×");
        assert_eq!(kvgate.median(|r| r.p99), Duration::from_micros(36));
    }
}
