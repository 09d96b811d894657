//! Polls every worker's `/metrics` (vLLM's Prometheus text), over the same pooled HTTP client
//! the request legs use, for the load the worker itself reports, per DP rank (`engine` label):
//! `vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`, and the KV capacity from
//! `vllm:cache_config_info`'s `num_gpu_blocks` label. Shedding and routing combine them with
//! the gateway's own bookings. Every [`CARDS_EVERY`] (and at once after a fleet operation
//! loads or unloads an adapter) its `/v1/models` is read again: the model cards the gateway's
//! own `/v1/models` merges, the LoRA adapters it serves, and its context length
//! (`max_model_len`), which bounds what a moving stream may send it.

use crate::fleet::{ModelCards, ReportedLoad, Worker};
use crate::gateway::Gateway;
use crate::upstream;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

/// Largest `/metrics` body read.
const MAX_BODY: usize = 8 << 20;

/// How often a worker's model cards are read again. Adapters change only when someone loads
/// or unloads one, and a fleet operation that does re-reads them at once.
pub const CARDS_EVERY: Duration = Duration::from_secs(10);

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
                match upstream::get(&gw.config(), &w, "/metrics", timeout, MAX_BODY, true).await {
                    Ok((200, body)) => {
                        w.set_reported(parse(&String::from_utf8_lossy(&body)));
                        if w.cards_age().is_none_or(|age| age >= CARDS_EVERY) {
                            refresh_cards(&gw, &w, timeout).await;
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

/// Reads `w`'s `/v1/models` again; false when it gave no usable answer (the old cards stay).
pub async fn refresh_cards(gw: &Gateway, w: &Worker, timeout: Duration) -> bool {
    match upstream::get(&gw.config(), w, "/v1/models", timeout, MAX_BODY, true).await {
        Ok((200, body)) => match ModelCards::parse(&body) {
            Some(cards) => {
                w.set_cards(cards);
                true
            }
            None => {
                tracing::debug!(worker = %w.url, "worker /v1/models is not a model list");
                false
            }
        },
        Ok((status, _)) => {
            tracing::debug!(worker = %w.url, status, "worker /v1/models answered non-200");
            false
        }
        Err(e) => {
            tracing::debug!(worker = %w.url, error = %e, "worker /v1/models read failed");
            false
        }
    }
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
            #[allow(clippy::cast_sign_loss, reason = "the cast saturates, as a count wants: a negative or NaN one reads 0")]
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
}
