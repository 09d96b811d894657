//! Keeps one KV event subscriber per event source (worker DP rank) of the fleet in force, and
//! finds the sources of `kv_events: auto` workers by reading their `GET /kv_event_sources`
//! (again after a worker comes back from being unhealthy: it may have restarted elsewhere).
//!
//! A subscriber is keyed by its index, index id and endpoint, so a fleet rebuilt around the
//! same index (workers added or removed) keeps the subscribers of the workers that stayed and
//! loses no event; a model given a new index gets new subscribers. They live in this task's
//! `JoinSet`, so stopping the task stops them all.

use crate::config::KvEvents;
use crate::fleet::{FoundKvSource, Worker};
use crate::gateway::Gateway;
use crate::kv_routing::{Cache, source_label};
use kvgate_kv::index::{FlatIndex, WorkerId};
use kvgate_kv::subscriber::Source;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::{AbortHandle, JoinSet};

/// How often the fleet is checked for changed KV sources.
const EVERY: Duration = Duration::from_millis(200);
/// Pause between two reads of one worker's `/kv_event_sources` that found nothing usable.
const RETRY_DISCOVERY: Duration = Duration::from_secs(2);
/// Longest a `/kv_event_sources` read may take.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// (index address, index id, PUB endpoint).
type Key = (usize, WorkerId, String);

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    // Holding each index's Arc keeps its address from being reused by a newer index while a
    // subscriber is keyed by it.
    let mut running: HashMap<Key, (Arc<FlatIndex>, AbortHandle)> = HashMap::new();
    let mut subscribers = JoinSet::new();
    let mut reads = JoinSet::new();
    let mut read_at: HashMap<String, Instant> = HashMap::new();
    loop {
        let mut wanted: HashMap<Key, (Arc<FlatIndex>, Source)> = HashMap::new();
        for m in gw.fleet().models.values() {
            let Some(kv) = &m.kv else { continue };
            let Cache::Events(index) = &kv.cache else { continue };
            let key = |s: &Source| (Arc::as_ptr(index) as usize, s.worker, s.endpoint.clone());
            for src in &kv.sources {
                wanted.insert(key(src), (index.clone(), src.clone()));
            }
            if !m.cfg.routing.uses_cache() {
                continue;
            }
            for ((w, wc), ids) in m.workers.iter().zip(&m.cfg.workers).zip(&kv.rank_ids) {
                if wc.kv_events != Some(KvEvents::Auto) {
                    continue;
                }
                let Some(found) = w.kv_sources() else {
                    let due = read_at.get(&w.label).is_none_or(|t| t.elapsed() >= RETRY_DISCOVERY);
                    if w.is_healthy() && due {
                        read_at.insert(w.label.clone(), Instant::now());
                        reads.spawn(read_sources(gw.clone(), w.clone()));
                    }
                    continue;
                };
                for f in found.iter() {
                    let Some(&id) = ids.get(f.rank as usize) else {
                        tracing::warn!(worker = %w.url, rank = f.rank, "KV events: the worker names more DP ranks than its dp_size; the extra ones are not followed");
                        continue;
                    };
                    let src = Source {
                        endpoint: f.endpoint.clone(),
                        replay: f.replay.clone(),
                        topic: f.topic.clone(),
                        worker: id,
                        hasher: kv.hasher,
                        label: source_label(&w.url, f.rank),
                    };
                    wanted.insert(key(&src), (index.clone(), src));
                }
            }
        }
        running.retain(|key, (_, handle)| {
            let keep = wanted.contains_key(key);
            if !keep {
                handle.abort();
            }
            keep
        });
        for (key, (index, src)) in wanted {
            if running.contains_key(&key) {
                continue;
            }
            let idx: Arc<dyn kvgate_kv::index::KvIndex> = index.clone();
            let handle = subscribers.spawn(kvgate_kv::subscriber::run(src, idx, gw.kv_metrics.clone()));
            running.insert(key, (index, handle));
        }
        while subscribers.try_join_next().is_some() {}
        while reads.try_join_next().is_some() {}
        tokio::time::sleep(EVERY).await;
    }
}

/// Reads `w`'s `GET /kv_event_sources` and records what it names.
async fn read_sources(gw: Arc<Gateway>, w: Arc<Worker>) {
    match crate::upstream::get(&gw.config(), &w, "/kv_event_sources", DISCOVERY_TIMEOUT, 1 << 20, true).await {
        Ok((200, body)) => match parse_sources(&body, &w.url.authority) {
            Ok(found) => {
                tracing::info!(worker = %w.url, sources = ?found.iter().map(|f| &f.endpoint).collect::<Vec<_>>(), "KV events: found through /kv_event_sources");
                w.set_kv_sources(found);
            }
            Err(e) => tracing::warn!(worker = %w.url, error = %e, "KV events: /kv_event_sources is not what vLLM serves"),
        },
        Ok((status, _)) => {
            tracing::warn!(worker = %w.url, status, "KV events: /kv_event_sources answered non-200 (kv_events: auto needs a vLLM that serves it)")
        }
        Err(e) => tracing::debug!(worker = %w.url, error = %e, "KV events: /kv_event_sources read failed"),
    }
}

/// The publishers in a `/kv_event_sources` answer (vLLM's `KVEventsConfig` per DP rank, keyed
/// by the rank), with a bind-all host (`*`, `0.0.0.0`, `::`) replaced by the worker's
/// (`authority`: its `host:port`). Ranks that publish nothing, or not over TCP, are left out.
pub fn parse_sources(body: &[u8], authority: &str) -> Result<Vec<FoundKvSource>, String> {
    #[derive(serde::Deserialize)]
    struct Rank {
        #[serde(default)]
        enable_kv_cache_events: bool,
        #[serde(default)]
        publisher: Option<String>,
        endpoint: String,
        #[serde(default)]
        replay_endpoint: Option<String>,
        #[serde(default)]
        topic: String,
    }
    let ranks: HashMap<String, Rank> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    let mut out = Vec::new();
    for (rank, r) in ranks {
        let rank: u32 = rank.parse().map_err(|_| format!("rank {rank:?} is not a number"))?;
        if !r.enable_kv_cache_events || r.publisher.as_deref().is_some_and(|p| p != "zmq") {
            continue;
        }
        let Some(endpoint) = connectable(&r.endpoint, host) else {
            tracing::warn!(endpoint = %r.endpoint, "KV events: only tcp:// publishers can be followed");
            continue;
        };
        out.push(FoundKvSource { rank, endpoint, replay: r.replay_endpoint.as_deref().and_then(|e| connectable(e, host)), topic: r.topic });
    }
    out.sort_by_key(|f| f.rank);
    Ok(out)
}

/// `endpoint` as a subscriber connects to it: a bind-all host becomes `host`.
fn connectable(endpoint: &str, host: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (h, port) = rest.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let h = if matches!(h, "*" | "0.0.0.0" | "::" | "[::]" | "") { host } else { h };
    Some(format!("tcp://{h}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_read_as_vllm_serves_them() {
        let body = br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                         "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": "kv"},
                        "1": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.2:5558", "replay_endpoint": null, "topic": ""},
                        "2": {"enable_kv_cache_events": false, "publisher": "null", "endpoint": "tcp://*:5559"},
                        "3": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///tmp/x"}}"#;
        let found = parse_sources(body, "10.0.0.1:8000").unwrap();
        assert_eq!(
            found,
            vec![
                FoundKvSource { rank: 0, endpoint: "tcp://10.0.0.1:5557".into(), replay: Some("tcp://10.0.0.1:5558".into()), topic: "kv".into() },
                FoundKvSource { rank: 1, endpoint: "tcp://10.0.0.2:5558".into(), replay: None, topic: String::new() },
            ]
        );
        assert_eq!(parse_sources(b"{}", "h:1").unwrap(), vec![], "a render-only server names none");
        assert!(parse_sources(b"[1]", "h:1").is_err());
        assert!(parse_sources(br#"{"x": {"endpoint": "tcp://*:1"}}"#, "h:1").is_err());
        assert_eq!(connectable("tcp://0.0.0.0:7", "[::1]").as_deref(), Some("tcp://[::1]:7"));
    }
}
