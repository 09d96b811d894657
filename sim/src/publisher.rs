//! Publishes one engine's KV event batches on ZeroMQ exactly as vLLM's `ZmqEventPublisher`:
//! - PUB socket, multipart `[topic, seq (8-byte big-endian), msgpack batch]`, `seq` counting
//!   from 0 at start; bound when the endpoint contains `*`/`::`, connected otherwise;
//! - optional replay ROUTER (always bound): a request `[identity, "", start_seq]` is answered
//!   with `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, then the
//!   end marker `["", "", 0xff×8, ""]`; the buffer keeps the last `buffer_steps` batches;
//! - DP rank `r` uses port + r for both endpoints (port 0 = ephemeral, reported after binding).
//!
//! The engine hands batches over a bounded queue (`max_queue_size`); when it is full the batch
//! is dropped and counted, so a stuck publisher never stalls the engine.

use crate::config::KvEventsConfig;
use crate::events::{EventFormat, HashFormat, KvEvent, encode_batch};
use bytes::Bytes;
use std::collections::VecDeque;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const END_SEQ: [u8; 8] = [0xff; 8];

/// A batch handed to the publisher: wall-clock timestamp and the step's events.
pub type Batch = (f64, Vec<KvEvent>);

/// The engine's side of a running publisher.
#[derive(Debug, Clone)]
pub struct PublisherHandle {
    tx: mpsc::Sender<Batch>,
    /// The PUB endpoint as a subscriber should use it.
    pub endpoint: String,
    /// The replay endpoint as a client should use it.
    pub replay_endpoint: Option<String>,
}

impl PublisherHandle {
    /// Queues a batch; returns false if the queue was full (the batch is dropped).
    pub fn publish(&self, batch: Batch) -> bool {
        self.tx.try_send(batch).is_ok()
    }
}

/// Splits `tcp://host:port` and applies the DP offset; `*` becomes 0.0.0.0 for binding.
fn rank_endpoint(endpoint: &str, rank: u32) -> Result<(String, bool, u16), String> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| format!("kv events endpoint {endpoint:?}: only tcp:// endpoints are supported by vllm-sim"))?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("kv events endpoint {endpoint:?} has no port"))?;
    let port: u16 = port.parse().map_err(|_| format!("kv events endpoint {endpoint:?}: bad port"))?;
    let bind = host.contains('*') || host.contains("::");
    let port = if port == 0 { 0 } else { port.checked_add(rank as u16).ok_or("kv events port overflow")? };
    let host = if host == "*" { "0.0.0.0" } else { host.trim_start_matches('[').trim_end_matches(']') };
    let host = if host.contains(':') { format!("[{host}]") } else { host.to_string() };
    Ok((format!("tcp://{host}:{port}"), bind, port))
}

/// What to report for a bound endpoint: a connectable address.
fn reported(bound: &zeromq::Endpoint) -> String {
    let s = bound.to_string();
    s.replace("0.0.0.0", "127.0.0.1")
}

/// Starts the publisher for DP rank `rank`. Binding happens before this returns, so the
/// reported endpoints are live; a connecting PUB keeps retrying in the background.
pub async fn start(
    cfg: &KvEventsConfig,
    rank: u32,
    format: EventFormat,
    hashes: HashFormat,
    faults: std::sync::Arc<crate::faults::Faults>,
    stop: CancellationToken,
) -> Result<PublisherHandle, String> {
    let (ep, bind, _) = rank_endpoint(&cfg.endpoint, rank)?;
    let mut pub_sock = PubSocket::new();
    let endpoint = if bind {
        let bound = pub_sock.bind(&ep).await.map_err(|e| format!("cannot bind kv events PUB {ep}: {e}"))?;
        reported(&bound)
    } else {
        ep.clone()
    };
    let mut replay_endpoint = None;
    let router = match &cfg.replay_endpoint {
        Some(r) => {
            let (rep, _, _) = rank_endpoint(r, rank)?;
            let mut sock = RouterSocket::new();
            let bound = sock.bind(&rep).await.map_err(|e| format!("cannot bind kv events replay ROUTER {rep}: {e}"))?;
            replay_endpoint = Some(reported(&bound));
            Some(sock)
        }
        None => None,
    };
    let (tx, rx) = mpsc::channel(cfg.max_queue_size.max(1));
    let task = PublisherTask {
        topic: Bytes::from(cfg.topic.clone().into_bytes()),
        rank,
        format,
        hashes,
        buffer: VecDeque::new(),
        buffer_steps: cfg.buffer_steps.max(1),
        seq: 0,
        faults,
    };
    tokio::spawn(task.run(pub_sock, if bind { None } else { Some(ep) }, router, rx, stop));
    Ok(PublisherHandle { tx, endpoint, replay_endpoint })
}

struct PublisherTask {
    topic: Bytes,
    rank: u32,
    format: EventFormat,
    hashes: HashFormat,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
    seq: u64,
    faults: std::sync::Arc<crate::faults::Faults>,
}

impl PublisherTask {
    async fn run(
        mut self,
        mut pub_sock: PubSocket,
        connect_to: Option<String>,
        router: Option<RouterSocket>,
        mut rx: mpsc::Receiver<Batch>,
        stop: CancellationToken,
    ) {
        if let Some(ep) = connect_to {
            tokio::select! {
                r = pub_sock.connect(&ep) => if let Err(e) = r {
                    tracing::error!(endpoint = %ep, error = %e, "kv events PUB cannot connect; events are not published");
                    return;
                },
                _ = stop.cancelled() => return,
            }
        }
        let (mut router_tx, mut router_rx) = match router {
            Some(r) => {
                let (t, rx) = r.split();
                (Some(t), Some(rx))
            }
            None => (None, None),
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                batch = rx.recv() => {
                    let Some((ts, events)) = batch else { break };
                    let payload = Bytes::from(encode_batch(ts, &events, self.rank, self.format, self.hashes));
                    let seq = self.seq;
                    self.seq += 1;
                    let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                    if !self.faults.drop_kv_batch()
                        && let Ok(msg) = ZmqMessage::try_from(frames)
                        && let Err(e) = pub_sock.send(msg).await
                    {
                        tracing::debug!(error = %e, "kv events PUB send failed");
                    }
                    if router_tx.is_some() {
                        if self.buffer.len() == self.buffer_steps {
                            self.buffer.pop_front();
                        }
                        self.buffer.push_back((seq, payload));
                    }
                }
                req = async { match router_rx.as_mut() { Some(r) => r.recv().await, None => std::future::pending().await } } => {
                    match req {
                        Ok(msg) => {
                            if let Some(tx) = router_tx.as_mut() {
                                self.replay(tx, msg).await;
                            }
                        }
                        Err(e) => tracing::debug!(error = %e, "kv events replay recv failed"),
                    }
                }
            }
        }
        // Like a dying process, close every connection so subscribers notice at once.
        drop(router_tx);
        drop(router_rx);
        let _ = pub_sock.close().await;
    }

    async fn replay(&self, tx: &mut zeromq::RouterSendHalf, msg: ZmqMessage) {
        // vLLM ignores anything that is not exactly [identity, "", start_seq].
        if msg.len() != 3 {
            return;
        }
        let frames = msg.into_vec();
        let Ok(start) = <[u8; 8]>::try_from(frames[2].as_ref()) else { return };
        let start = u64::from_be_bytes(start);
        let identity = frames[0].clone();
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let reply = vec![identity.clone(), Bytes::new(), self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
            if let Ok(m) = ZmqMessage::try_from(reply)
                && tx.send(m).await.is_err()
            {
                return;
            }
        }
        let end = vec![identity, Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = tx.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_ranks_offset_ports_and_star_binds() {
        assert_eq!(rank_endpoint("tcp://*:5557", 0).unwrap(), ("tcp://0.0.0.0:5557".into(), true, 5557));
        assert_eq!(rank_endpoint("tcp://*:5557", 2).unwrap(), ("tcp://0.0.0.0:5559".into(), true, 5559));
        assert_eq!(rank_endpoint("tcp://router:6000", 1).unwrap(), ("tcp://router:6001".into(), false, 6001));
        assert_eq!(rank_endpoint("tcp://*:0", 3).unwrap().2, 0);
        assert!(rank_endpoint("ipc:///tmp/x", 0).is_err());
    }
}
