//! Active health checking: every `health.interval_ms`, each worker's health path is fetched
//! (GET, `health.timeout_ms`); `unhealthy_threshold` consecutive failures take it out of
//! routing, `healthy_threshold` consecutive successes bring it back. A 200 is healthy; anything
//! else, a timeout or a refused connection is not (vLLM answers 503 when its engine is dead).

use crate::gateway::Gateway;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Runs forever (until the task is dropped).
pub async fn run(gw: Arc<Gateway>) {
    loop {
        let cfg = gw.config();
        let h = cfg.health.clone();
        let fleet = gw.fleet();
        let checks = fleet.all_workers().into_iter().map(|(model, w)| {
            let h = h.clone();
            let gw = gw.clone();
            async move {
                let ok = match w.resolve().await {
                    Ok(addr) => probe(addr, &w.host_header, &h.path, Duration::from_millis(h.timeout_ms)).await,
                    Err(_) => false,
                };
                if let Some(now) = w.observe_health(ok, h.unhealthy_threshold, h.healthy_threshold) {
                    if now {
                        tracing::info!(worker = %w.url, model, "worker healthy again");
                    } else {
                        tracing::warn!(worker = %w.url, model, "worker unhealthy; removed from routing");
                    }
                }
                let url = w.url.to_string();
                gw.metrics.worker_healthy.with_label_values(&[model.as_str(), url.as_str()]).set(i64::from(w.is_healthy()));
                gw.metrics.worker_in_flight.with_label_values(&[model.as_str(), url.as_str()]).set(i64::from(w.in_flight()));
            }
        });
        futures_join_all(checks).await;
        for m in fleet.models.values() {
            let Some(kv) = &m.kv else { continue };
            let expired = kv.active.expire(Duration::from_secs(m.cfg.routing.booking_max_age_s));
            if expired > 0 {
                tracing::warn!(model = %m.cfg.name, expired, "bookings older than routing.booking_max_age_s released (requests still running, or a leak)");
            }
            for (i, w) in m.workers.iter().enumerate() {
                let url = w.url.to_string();
                let labels = [m.cfg.name.as_str(), url.as_str()];
                gw.metrics.active_prefill.with_label_values(&labels).set(kv.active.prefill_tokens(i as u16) as i64);
                gw.metrics.active_blocks.with_label_values(&labels).set(kv.active.active_blocks(i as u16) as i64);
            }
        }
        tokio::time::sleep(Duration::from_millis(h.interval_ms)).await;
    }
}

async fn futures_join_all<F: std::future::Future<Output = ()> + Send + 'static>(futs: impl Iterator<Item = F>) {
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    for h in handles {
        let _ = h.await;
    }
}

/// One GET over a fresh connection; true on HTTP 200.
pub async fn probe(addr: std::net::SocketAddr, host_header: &str, path: &str, timeout: Duration) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\nUser-Agent: kvgate-health\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut buf = [0u8; 32];
        let mut n = 0;
        while n < 12 {
            let r = s.read(&mut buf[n..]).await.ok()?;
            if r == 0 {
                break;
            }
            n += r;
        }
        let head = std::str::from_utf8(&buf[..n]).ok()?;
        Some(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"))
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}

/// Keeps one KV event subscriber task per event source of the fleet in force; a reload that
/// replaces a model's KV state replaces its subscribers.
pub async fn supervise_kv(gw: Arc<Gateway>) {
    // Holding the Arc keeps its address from being reused by a newer state while tracked.
    type Tasks = (Arc<crate::kv_routing::KvRouting>, Vec<tokio::task::JoinHandle<()>>);
    let mut running: std::collections::HashMap<usize, Tasks> = std::collections::HashMap::new();
    loop {
        let fleet = gw.fleet();
        let mut live = std::collections::HashSet::new();
        for m in fleet.models.values() {
            let Some(kv) = &m.kv else { continue };
            let key = Arc::as_ptr(kv) as usize;
            live.insert(key);
            if let crate::kv_routing::Cache::Events(index) = &kv.cache
                && !running.contains_key(&key)
            {
                let tasks = kv
                    .sources
                    .iter()
                    .map(|src| {
                        let index: Arc<dyn kvgate_kv::index::KvIndex> = index.clone();
                        tokio::spawn(kvgate_kv::subscriber::run(src.clone(), index, gw.kv_metrics.clone()))
                    })
                    .collect();
                running.insert(key, (kv.clone(), tasks));
            }
        }
        running.retain(|key, (_, tasks)| {
            let keep = live.contains(key);
            if !keep {
                tasks.iter().for_each(|t| t.abort());
            }
            keep
        });
        drop(fleet);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Releases queued requests as capacity frees: every few milliseconds, one per worker that is
/// under the queue threshold (each released request books its prefill before the next tick).
pub async fn release_queues(gw: Arc<Gateway>) {
    loop {
        let fleet = gw.fleet();
        for m in fleet.models.values() {
            let Some(q) = &m.queue else { continue };
            for _ in 0..m.queue_free_workers() {
                if !q.release() {
                    break;
                }
            }
        }
        drop(fleet);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
