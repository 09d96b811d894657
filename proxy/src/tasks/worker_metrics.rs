//! Polls every worker's `/metrics` (vLLM's Prometheus text), over the same pooled HTTP client
//! the request legs use, for the load the worker itself reports, per DP rank (`engine` label):
//! `vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`, and the KV capacity from
//! `vllm:cache_config_info`'s `num_gpu_blocks` label. Shedding and routing combine them with
//! the gateway's own bookings. Once per worker, its `/v1/models` gives its context length
//! (`max_model_len`), which bounds what a moving stream may send it.

use crate::fleet::ReportedLoad;
use crate::gateway::Gateway;
use crate::upstream;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

/// Largest `/metrics` body read.
const MAX_BODY: usize = 8 << 20;

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    loop {
        let cfg = gw.config();
        let every = Duration::from_millis(cfg.load.interval_ms);
        let timeout = Duration::from_millis(cfg.load.timeout_ms);
        let mut polls = JoinSet::new();
        for (_, w) in gw.fleet().all_workers() {
            let gw = gw.clone();
            polls.spawn(async move {
                match upstream::get(&gw, &w, "/metrics", timeout, MAX_BODY, true).await {
                    Ok((200, body)) => {
                        w.set_reported(parse(&String::from_utf8_lossy(&body)));
                        if w.max_model_len().is_none()
                            && let Ok((200, models)) = upstream::get(&gw, &w, "/v1/models", timeout, MAX_BODY, true).await
                            && let Some(n) = max_model_len(&models)
                        {
                            w.set_max_model_len(n);
                        }
                    }
                    Ok((status, _)) => tracing::debug!(worker = %w.url, status, "worker /metrics answered non-200"),
                    Err(e) => tracing::debug!(worker = %w.url, error = %e, "worker /metrics poll failed"),
                }
            });
        }
        while polls.join_next().await.is_some() {}
        drop(cfg);
        tokio::time::sleep(every).await;
    }
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("{key}=\"");
    let start = labels.find(&pat)? + pat.len();
    let end = labels[start..].find('"')? + start;
    Some(&labels[start..end])
}

/// The largest `max_model_len` in a `/v1/models` answer (vLLM names it per served model).
pub fn max_model_len(body: &[u8]) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.get("data")?.as_array()?.iter().filter_map(|m| m.get("max_model_len")?.as_u64()).max().and_then(|n| u32::try_from(n).ok())
}

/// Extracts per-rank load from a Prometheus text exposition.
pub fn parse(text: &str) -> Vec<ReportedLoad> {
    let mut ranks: BTreeMap<usize, ReportedLoad> = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((head, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        let (name, labels) = match head.find('{') {
            Some(i) => (&head[..i], &head[i..]),
            None => (head, ""),
        };
        let rank = label(labels, "engine").and_then(|e| e.parse::<usize>().ok()).unwrap_or(0);
        match name {
            "vllm:kv_cache_usage_perc" => ranks.entry(rank).or_default().kv_usage = v,
            "vllm:num_requests_waiting" => ranks.entry(rank).or_default().waiting = v as u64,
            "vllm:cache_config_info" => {
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|n| n.parse::<u64>().ok()) {
                    ranks.entry(rank).or_default().total_blocks = n;
                }
            }
            _ => {}
        }
    }
    ranks.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_metrics_per_engine() {
        let text = r#"# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.99
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="4096"} 1.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
"#;
        let r = parse(text);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], ReportedLoad { kv_usage: 0.25, waiting: 0, total_blocks: 0 });
        assert_eq!(r[1], ReportedLoad { kv_usage: 0.99, waiting: 3, total_blocks: 4096 });
        assert!(parse("garbage\n{{{ 1\n").is_empty());
    }

    #[test]
    fn the_context_length_comes_from_v1_models() {
        let body = br#"{"object":"list","data":[{"id":"a","max_model_len":2048},{"id":"b","max_model_len":4096}]}"#;
        assert_eq!(max_model_len(body), Some(4096));
        assert_eq!(max_model_len(br#"{"data":[{"id":"a"}]}"#), None);
        assert_eq!(max_model_len(b"not json"), None);
    }
}
