//! One task per event source (a worker's DP rank): a ZMQ SUB socket that connects to the
//! engine's PUB endpoint (or binds, for engines configured to connect to the router), decodes
//! `[topic, seq, payload]` messages, and feeds an [`Applier`]; gaps and resyncs are served from
//! the engine's replay ROUTER over a DEALER socket (`["", start_seq]` → `["", topic, seq,
//! payload]`… then the end marker `seq = 0xff×8`; 2-frame replies of older vLLM accepted).
//!
//! zmq.rs's initial `connect` waits for the peer, so it runs here, never on a startup path.
//! When the publisher disconnects (engine crash or restart, network failure) the worker's index
//! state is cleared (a restarted engine starts empty and may publish nothing for a while) and
//! rebuilt from the replay buffer once reconnected.

use crate::applier::{Action, Applier};
use crate::hash::Hasher;
use crate::index::{KvIndex, WorkerId};
use crate::metrics::KvMetrics;
use bytes::Bytes;
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const END_SEQ: [u8; 8] = [0xff; 8];
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where events come from and where they go.
#[derive(Debug, Clone)]
pub struct Source {
    /// PUB endpoint, `tcp://host:port` (connect) or `tcp://*:port` (bind).
    pub endpoint: String,
    /// Replay ROUTER endpoint.
    pub replay: Option<String>,
    /// Topic prefix to subscribe to (`""` = all).
    pub topic: String,
    /// The worker's slot in the index.
    pub worker: WorkerId,
    /// The model's block hasher.
    pub hasher: Hasher,
    /// Metrics label.
    pub label: String,
}

/// The endpoint of DP rank `rank` of an engine whose rank 0 uses `endpoint`: vLLM offsets the
/// TCP port by the rank (port 0 and rank 0 unchanged), for PUB and replay alike.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    let (head, port) = endpoint.rsplit_once(':').ok_or_else(|| format!("{endpoint:?} has no port"))?;
    let port: u16 = port.parse().map_err(|_| format!("{endpoint:?}: bad port"))?;
    if port == 0 {
        return Ok(endpoint.to_string());
    }
    let p = u16::try_from(u32::from(port) + rank).map_err(|_| format!("{endpoint:?}: port + rank {rank} overflows"))?;
    Ok(format!("{head}:{p}"))
}

/// How long a connect may wait for a publisher before the operator is warned.
const CONNECT_WARN_AFTER: Duration = Duration::from_secs(5);

/// Runs the subscriber until the task is aborted.
pub async fn run(src: Source, index: Arc<dyn KvIndex>, metrics: KvMetrics) {
    let mut applier = Applier::new(src.worker, src.hasher, src.replay.is_some());
    let mut backoff = Duration::from_millis(100);
    let mut resync_on_connect = false;
    let mut replay_failed_at: Option<std::time::Instant> = None;
    loop {
        let mut sock = SubSocket::new();
        let bound = if src.endpoint.contains('*') {
            sock.bind(&src.endpoint.replace('*', "0.0.0.0")).await.map(|_| ())
        } else {
            // zeromq's connect retries a refused endpoint by itself (growing pauses, giving up
            // after 30 s with an error, which the loop below retries). Let it, but tell the
            // operator early why no events arrive.
            let connect = sock.connect(&src.endpoint);
            tokio::pin!(connect);
            match tokio::time::timeout(CONNECT_WARN_AFTER, &mut connect).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(
                        source = %src.label,
                        endpoint = %src.endpoint,
                        "KV events: nothing listens on the endpoint yet; still trying (is the engine up, and does its endpoint bind, with `*`?)"
                    );
                    connect.await
                }
            }
        };
        if let Err(e) = bound {
            tracing::warn!(source = %src.label, endpoint = %src.endpoint, error = %e, "KV events: cannot connect; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
            continue;
        }
        backoff = Duration::from_millis(100);
        if let Err(e) = sock.subscribe(&src.topic).await {
            tracing::warn!(source = %src.label, error = %e, "KV events: subscribe failed; retrying");
            continue;
        }
        tracing::info!(source = %src.label, endpoint = %src.endpoint, "KV events: subscribed");
        if resync_on_connect {
            // After losing the publisher, rebuild from whatever the engine still buffers.
            let _ = replay(&src, &mut applier, index.as_ref(), &metrics, 0).await;
            resync_on_connect = false;
        }
        // A connecting SUB rebuilds its socket when the engine goes away, so a restarted engine
        // on the same endpoint is picked up at once.
        let mut monitor = sock.monitor();
        let connecting = !src.endpoint.contains('*');
        loop {
            let msg = tokio::select! {
                r = sock.recv() => match r {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(source = %src.label, error = %e, "KV events: receive failed; reconnecting");
                        break;
                    }
                },
                Some(ev) = monitor.next() => {
                    if connecting && matches!(ev, zeromq::SocketEvent::Disconnected(_)) {
                        // The engine died or the network broke: what it held may be gone (a
                        // restarted engine starts empty and may publish nothing for a while),
                        // so forget the worker and rebuild once reconnected.
                        tracing::warn!(source = %src.label, "KV events: publisher disconnected; clearing the worker and reconnecting");
                        applier.reset(index.as_ref());
                        metrics.resyncs.with_label_values(&[src.label.as_str(), "disconnect"]).inc();
                        metrics.blocks.with_label_values(&[src.label.as_str()]).set(0);
                        resync_on_connect = src.replay.is_some();
                        break;
                    }
                    continue;
                }
            };
            let before = applier.counts();
            handle(&src, &mut applier, index.as_ref(), &metrics, msg.into_vec(), &mut replay_failed_at).await;
            metrics.record(&src.label, &before, &applier.counts());
            metrics.blocks.with_label_values(&[src.label.as_str()]).set(i64::try_from(index.block_count(src.worker)).unwrap_or(i64::MAX));
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
            if applier.last_ts() > 0.0 {
                metrics.lag.with_label_values(&[src.label.as_str()]).set((now - applier.last_ts()).max(0.0));
            }
        }
    }
}

/// After a failed replay, live messages are applied directly for this long before trying again.
const REPLAY_BACKOFF: Duration = Duration::from_secs(5);

async fn handle(
    src: &Source,
    applier: &mut Applier,
    index: &dyn KvIndex,
    metrics: &KvMetrics,
    frames: Vec<Bytes>,
    replay_failed_at: &mut Option<std::time::Instant>,
) {
    let parsed = match frames.as_slice() {
        [_topic, seq, payload] => <[u8; 8]>::try_from(seq.as_ref()).ok().map(|s| (u64::from_be_bytes(s), payload.clone())),
        _ => None,
    };
    let Some((seq, payload)) = parsed else {
        metrics.malformed.with_label_values(&[src.label.as_str()]).inc();
        return;
    };
    let from = match applier.on_message(seq, &payload, index) {
        Action::Continue => return,
        Action::Replay { from } => from,
        Action::Resync => 0,
    };
    if replay_failed_at.is_some_and(|t| t.elapsed() < REPLAY_BACKOFF) {
        let _ = applier.on_message_after_failed_replay(seq, &payload, index);
        return;
    }
    if !replay(src, applier, index, metrics, from).await {
        *replay_failed_at = Some(std::time::Instant::now());
    }
    if applier.last_seq().is_none_or(|l| l < seq) {
        // The replay failed or stopped short of the live message: apply it anyway, so
        // ingestion never stalls behind an unreachable replay socket.
        let _ = applier.on_message_after_failed_replay(seq, &payload, index);
    } else {
        // Covered by the replay: record it as seen live.
        let _ = applier.on_message(seq, &payload, index);
    }
}

/// Fetches buffered batches from `from` and applies them; false if the replay failed.
async fn replay(src: &Source, applier: &mut Applier, index: &dyn KvIndex, metrics: &KvMetrics, from: u64) -> bool {
    let Some(ep) = &src.replay else { return false };
    let result = tokio::time::timeout(REPLAY_TIMEOUT, async {
        let mut sock = DealerSocket::new();
        sock.connect(ep).await.map_err(|e| e.to_string())?;
        let req = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]).map_err(|e| e.to_string())?;
        sock.send(req).await.map_err(|e| e.to_string())?;
        let mut n = 0u64;
        loop {
            let f = sock.recv().await.map_err(|e| e.to_string())?.into_vec();
            // ["", topic, seq, payload] (vLLM ≥ #45177) or ["", seq, payload] (older).
            let (seq, payload) = match f.as_slice() {
                [_, _, seq, payload] | [_, seq, payload] => (seq.clone(), payload.clone()),
                _ => return Err(format!("unexpected replay frame count {}", f.len())),
            };
            if seq.as_ref() == END_SEQ {
                return Ok(n);
            }
            let Ok(s) = <[u8; 8]>::try_from(seq.as_ref()) else { return Err("bad seq frame".into()) };
            let _ = applier.on_replayed(u64::from_be_bytes(s), &payload, index);
            n += 1;
        }
    })
    .await;
    match result {
        Ok(Ok(n)) => {
            tracing::info!(source = %src.label, from, batches = n, "KV events: replayed");
            metrics.replays.with_label_values(&[src.label.as_str(), "ok"]).inc();
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(source = %src.label, from, error = %e, "KV events: replay failed");
            metrics.replays.with_label_values(&[src.label.as_str(), "failed"]).inc();
            false
        }
        Err(_) => {
            tracing::warn!(source = %src.label, from, "KV events: replay timed out");
            metrics.replays.with_label_values(&[src.label.as_str(), "timeout"]).inc();
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_ranks_use_port_plus_rank() {
        assert_eq!(rank_endpoint("tcp://10.0.0.1:5557", 0).unwrap(), "tcp://10.0.0.1:5557");
        assert_eq!(rank_endpoint("tcp://10.0.0.1:5557", 3).unwrap(), "tcp://10.0.0.1:5560");
        assert_eq!(rank_endpoint("tcp://*:0", 2).unwrap(), "tcp://*:0");
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
        assert!(rank_endpoint("tcp://h", 1).is_err());
    }
}
