//! How much one vllm-sim process sustains: many concurrent SSE streams, closed loop.
//!
//! Starts the release `vllm-sim` binary pinned to one core (`taskset -c 0`) with a high
//! `--time-scale`, keeps `--streams` streaming completions open against it from this process
//! (pin it elsewhere: `taskset -c 1 sim-throughput ...`), and reports the output tokens/s the
//! clients received, how many streams were open, and the simulator's CPU use over the window.
//!
//!   cargo build --release -p vllm-sim -p kvgate-bench
//!   taskset -c 1 target/release/sim-throughput --streams 1000 --seconds 20

use clap::Parser;
use futures_util::StreamExt;
use serde_json::json;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// Concurrent streams to keep open.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
    /// Measurement window after warm-up.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Simulated time speed-up.
    #[arg(long, default_value_t = 1000.0)]
    time_scale: f64,
    /// CPU to pin the simulator to.
    #[arg(long, default_value_t = 0)]
    sim_cpu: usize,
    /// Path of the vllm-sim binary.
    #[arg(long, default_value = "target/release/vllm-sim")]
    sim_bin: String,
    /// Port for the simulator.
    #[arg(long, default_value_t = 18_731)]
    port: u16,
}

async fn generation_tokens(http: &reqwest::Client, url: &str) -> f64 {
    let text = match http.get(format!("{url}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return 0.0,
    };
    text.lines().filter(|l| l.starts_with("vllm:generation_tokens_total{")).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are at positions 11 and 12 after the comm field.
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0) + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = Args::parse();
    let blocks = (a.streams * (a.max_tokens + 64) / 16 + 1024).max(4096);
    let mut child = Command::new("taskset")
        .args(["-c", &a.sim_cpu.to_string(), &a.sim_bin])
        .args(["--port", &a.port.to_string(), "--host", "127.0.0.1", "--time-scale", &a.time_scale.to_string()])
        .args(["--max-num-seqs", &(a.streams + 16).to_string(), "--max-num-batched-tokens", "131072"])
        .args(["--num-gpu-blocks-override", &blocks.to_string(), "--max-model-len", "4096", "--log", "warn"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start vllm-sim (build it with cargo build --release -p vllm-sim)");
    let url = format!("http://127.0.0.1:{}", a.port);
    let http = reqwest::Client::builder().pool_max_idle_per_host(a.streams).build().unwrap();
    for _ in 0..200 {
        if http.get(format!("{url}/health")).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let tokens = Arc::new(AtomicU64::new(0));
    let open = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let body = json!({"prompt": "the cache router keeps every worker busy with useful work", "max_tokens": a.max_tokens,
                      "ignore_eos": true, "stream": true});
    for _ in 0..a.streams {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        let (tokens, open, errors, stop) = (tokens.clone(), open.clone(), errors.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Ok(r) = http.post(format!("{url}/v1/completions")).json(&body).send().await else {
                    errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                open.fetch_add(1, Ordering::Relaxed);
                let mut s = r.bytes_stream();
                while let Some(chunk) = s.next().await {
                    let Ok(chunk) = chunk else {
                        errors.fetch_add(1, Ordering::Relaxed);
                        break;
                    };
                    // One `data: {` per token chunk; [DONE] does not count.
                    let n = chunk.windows(7).filter(|w| w == b"data: {").count();
                    tokens.fetch_add(n as u64, Ordering::Relaxed);
                }
                open.fetch_sub(1, Ordering::Relaxed);
            }
        });
    }
    // Warm up until every stream is open, then measure.
    let warm = Instant::now();
    while open.load(Ordering::Relaxed) < a.streams as u64 && warm.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let g0 = generation_tokens(&http, &url).await;
    let (t0, c0, k0) = (Instant::now(), cpu_seconds(child.id()), tokens.load(Ordering::Relaxed));
    let (mut min_open, mut sum_open, mut samples) = (u64::MAX, 0u64, 0u64);
    while t0.elapsed() < Duration::from_secs(a.seconds) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let o = open.load(Ordering::Relaxed);
        min_open = min_open.min(o);
        sum_open += o;
        samples += 1;
    }
    let (dt, c1, k1) = (t0.elapsed().as_secs_f64(), cpu_seconds(child.id()), tokens.load(Ordering::Relaxed));
    let g1 = generation_tokens(&http, &url).await;
    stop.store(true, Ordering::Relaxed);
    let tps = (k1 - k0) as f64 / dt;
    let cpu = (c1 - c0) / dt;
    let sim_tps = (g1 - g0) / dt;
    println!(
        "| streams | max_tokens | time scale | open streams (mean / min) | tokens/s received | tokens/s by sim metrics | sim CPU (cores) | tokens/s per sim core | errors |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {} | {:.0} / {} | {:.0} | {:.0} | {:.2} | {:.0} | {} |",
        a.streams,
        a.max_tokens,
        a.time_scale,
        sum_open as f64 / samples.max(1) as f64,
        min_open,
        tps,
        sim_tps,
        cpu,
        tps / cpu.max(1e-9),
        errors.load(Ordering::Relaxed)
    );
    let _ = child.kill();
    let _ = child.wait();
}
