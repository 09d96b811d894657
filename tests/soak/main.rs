//! The soak's CI variant: two minutes of concurrent streams through a gateway in front
//! of three simulated workers, with clients cancelling mid-stream, a worker crashed and started
//! again on its address every 30 s, and a config change reloaded every 20 s. At the end every
//! booking is back to 0, nothing is left in flight, the process's descriptors are back near
//! where they started, and no stream failed but those running on a crashed worker.
//! `kvgate-bench soak` is the long version (docs/hardening.md, "Soak").

#![allow(clippy::float_cmp, reason = "tests compare exact metric values, counts the target reports as floats")]

use kvgate_tests::cluster::{Cluster, GatewayOpts, wait_until};
use kvgate_tests::target::test_sim_config;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use vllm_sim::{SimConfig, SimServer};

/// How long the load runs (`KVGATE_SOAK_S` overrides, for a longer local run).
fn duration() -> Duration {
    Duration::from_secs(std::env::var("KVGATE_SOAK_S").ok().and_then(|s| s.parse().ok()).unwrap_or(120))
}

const STREAMS: usize = 150;
const TOKENS: u64 = 48;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    cancelled: AtomicU64,
    failed_at_crash: AtomicU64,
    failed: AtomicU64,
    last_crash_ms: AtomicU64,
    crashes: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_minutes_of_streams_with_cancels_crashes_and_reloads_leave_nothing_behind() {
    let sim = SimConfig { time_scale: 2.0, ..test_sim_config() };
    // Crashes are what this soak judges; a probe answered late because the loaded host ran the
    // worker late is not a crash, so a worker goes down after three failed probes, not one.
    let opts = GatewayOpts { extra: "timeouts:\n  client_write_ms: 60000\n".into(), health_timeout: (1_000, 3), ..GatewayOpts::default() };
    // Each worker comes back on its address after a crash, so the addresses are reserved below
    // the ephemeral range, where no connection or port-0 bind takes them while a worker is down.
    let base = kvgate_tests::ports::reserved_run(3);
    let mut sims = Vec::new();
    for k in 0..3 {
        sims.push(SimServer::start(SimConfig { listen: ([127, 0, 0, 1], base + k).into(), ..sim.clone() }).await.expect("sim starts"));
    }
    let mut c = Cluster::front(&sims.iter().map(SimServer::url).collect::<Vec<_>>(), opts).await;
    c.sims = sims;
    let fds_before = open_fds();
    let url = c.url("/v1/completions");
    // The streams' own client, dropped at the end so its pooled connections close.
    let http = reqwest::Client::new();
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let clients: Vec<_> = (0..STREAMS)
        .map(|i| {
            let (http, url, tally, stop) = (http.clone(), url.clone(), tally.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let body = json!({"model": "sim-model", "prompt": format!("soak {i} {n}"), "max_tokens": TOKENS, "ignore_eos": true, "stream": true});
                    let read = async {
                        let resp = http.post(&url).json(&body).send().await.map_err(|e| e.to_string())?;
                        let status = resp.status();
                        let text = resp.text().await.map_err(|e| e.to_string())?;
                        let tokens = text.matches("\"text\":").count() as u64;
                        if status == 200 && text.contains("[DONE]") && tokens >= TOKENS { Ok(()) } else { Err(format!("{status}, {tokens} tokens")) }
                    };
                    // One stream in ten is dropped by its client part-way.
                    let result = if (i as u64 + n).is_multiple_of(10) {
                        match tokio::time::timeout(Duration::from_millis(50 + (n * 37 % 400)), read).await {
                            Ok(r) => r,
                            Err(_) => {
                                tally.cancelled.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                        }
                    } else {
                        read.await
                    };
                    match result {
                        Ok(()) => tally.ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            let since = (t0.elapsed().as_millis() as u64).saturating_sub(tally.last_crash_ms.load(Ordering::Relaxed));
                            if tally.crashes.load(Ordering::Relaxed) > 0 && since < 5_000 {
                                tally.failed_at_crash.fetch_add(1, Ordering::Relaxed)
                            } else {
                                eprintln!("stream failed away from a crash: {e}");
                                tally.failed.fetch_add(1, Ordering::Relaxed)
                            }
                        }
                    };
                }
            })
        })
        .collect();
    let (mut next_crash, mut next_reload) = (Duration::from_secs(30), Duration::from_secs(20));
    let mut reloads = 0u64;
    while t0.elapsed() < duration() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if t0.elapsed() >= next_crash {
            next_crash += Duration::from_secs(30);
            let k = (tally.crashes.load(Ordering::Relaxed) % 3) as usize;
            tally.last_crash_ms.store(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
            tally.crashes.fetch_add(1, Ordering::Relaxed);
            let listen = c.sims[k].addr();
            c.sims[k].crash();
            c.sims[k].stopped().await;
            // Down for a second, as a restarted pod would be.
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.sims[k] = SimServer::start(SimConfig { listen, ..sim.clone() }).await.expect("the worker comes back on its address");
        }
        if t0.elapsed() >= next_reload {
            next_reload += Duration::from_secs(20);
            reloads += 1;
            let text = std::fs::read_to_string(&c.config_path).unwrap();
            let changed = text.replacen(&format!("client_write_ms: {}", 60_000 + reloads - 1), &format!("client_write_ms: {}", 60_000 + reloads), 1);
            std::fs::write(&c.config_path, changed).unwrap();
            assert!(c.http.post(c.admin("/reload")).send().await.unwrap().status().is_success());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in clients {
        h.await.unwrap();
    }
    drop(http);
    // The ledger's gauge, refreshed every health interval (100 ms here).
    let settled = wait_until(Duration::from_secs(20), || async { c.gateway_metrics().await.sum("kvgate_worker_requests_in_flight", &[]) == 0.0 }).await;
    let (ok, cancelled, at_crash, failed) = (
        tally.ok.load(Ordering::Relaxed),
        tally.cancelled.load(Ordering::Relaxed),
        tally.failed_at_crash.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
    );
    eprintln!(
        "soak: {ok} whole streams, {cancelled} cancelled, {at_crash} failed at crashes, {failed} failed otherwise, {reloads} reloads, fds {fds_before} -> {}",
        open_fds()
    );
    assert!(settled.is_some(), "bookings left after the load stopped");
    let m = c.gateway_metrics().await;
    assert_eq!(m.sum("kvgate_requests_in_flight", &[]), 0.0, "requests left in flight");
    assert_eq!(failed, 0, "streams failed away from any crash");
    assert!(ok > STREAMS as u64 * 4, "too few whole streams: {ok}");
    let secs = duration().as_secs();
    assert!(cancelled > 0 && reloads >= secs / 20 && tally.crashes.load(Ordering::Relaxed) >= secs / 30);
    assert!(m.sum("kvgate_config_reloads_total", &[("result", "ok")]) >= reloads as f64);
    // Descriptors: with the clients gone, the gateway closes their connections, and its idle
    // worker connections go after `timeouts.upstream_idle_ms` (4 s).
    let fds = wait_until(Duration::from_secs(30), || async { open_fds() <= fds_before + 16 }).await;
    assert!(fds.is_some(), "descriptors grew: {fds_before} -> {}", open_fds());
}
