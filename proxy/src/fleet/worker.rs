//! One vLLM server as the gateway tracks it: its address, health, the load it reports on its
//! `/metrics`, and the counters of what the gateway booked on it (written through the ledgers
//! of the models it serves, so they survive reloads and add up across models).

use super::cards::ModelCards;
use crate::config::UpstreamUrl;
use kvgate_filters::ledger::WorkerCounters;
use parking_lot::RwLock;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// One vLLM server.
#[derive(Debug)]
pub struct Worker {
    /// Base URL.
    pub url: UpstreamUrl,
    /// `Host` header value.
    pub host_header: String,
    /// The URL as text (metric label, logs), made once.
    pub label: String,
    /// Its name for clients (`x-kvgate-worker` with `worker_header: name`), set when it is
    /// first configured.
    pub name: String,
    /// What the gateway booked on it (read through a model's ledger).
    pub booked: Arc<WorkerCounters>,
    healthy: AtomicBool,
    consecutive_failures: AtomicU32,
    consecutive_successes: AtomicU32,
    /// Load the worker reports, per DP rank (from its `/metrics`), and when.
    reported: RwLock<(Vec<ReportedLoad>, Option<Instant>)>,
    /// Inter-token latency the gateway measures on its streams, µs (EWMA; 0: none yet).
    itl_us: AtomicU64,
    /// Its context length (`max_model_len` from `/v1/models`; 0: not known yet).
    max_model_len: AtomicU32,
    /// What its `/v1/models` said, and when (`None`: not read yet).
    cards: RwLock<(Option<Arc<ModelCards>>, Option<Instant>)>,
    /// Paused by a fleet operation (`POST /pause` on the admin listener) until `/resume`.
    paused: AtomicBool,
    /// Put to sleep by a fleet operation (`POST /sleep`) until a whole `/wake_up`.
    asleep: AtomicBool,
    /// Last resolved address; refreshed by the health task so DNS changes are followed without
    /// a lookup (a blocking-pool hop) on the request path.
    addr: RwLock<Option<SocketAddr>>,
    /// Idle keep-alive connections of the request legs (docs/architecture.md, "Upstream
    /// connections").
    pub idle: Arc<crate::upstream::pool::IdlePool>,
    /// Idle keep-alive connections of its health and metrics probes, apart from the legs'.
    pub probe_idle: Arc<crate::upstream::pool::IdlePool>,
    /// How fast it prefills and steps against the `time` cost's priors, as measured.
    pub calibration: super::calibration::Calibration,
    /// The KV-event publishers its `GET /kv_event_sources` named (`kv_events: auto`; `None`:
    /// not read since it started or came back).
    kv_sources: RwLock<Option<Arc<[FoundKvSource]>>>,
}

/// A KV-event publisher a worker named in its `GET /kv_event_sources`, for one DP rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundKvSource {
    /// The DP rank.
    pub rank: u32,
    /// Its PUB endpoint, as the gateway connects to it.
    pub endpoint: String,
    /// Its replay ROUTER endpoint.
    pub replay: Option<String>,
    /// The topic it publishes under.
    pub topic: String,
}

impl Worker {
    /// A worker at `url`, healthy until its first check says otherwise.
    pub fn new(url: UpstreamUrl) -> Self {
        Self::named(url, String::new())
    }

    /// A worker at `url` shown to clients as `name`.
    pub fn named(url: UpstreamUrl, name: String) -> Self {
        Self {
            host_header: url.authority.clone(),
            label: url.to_string(),
            name,
            booked: Arc::default(),
            url,
            // Optimistic until the first check: a fresh gateway serves at once.
            healthy: AtomicBool::new(true),
            consecutive_failures: AtomicU32::new(0),
            consecutive_successes: AtomicU32::new(0),
            reported: RwLock::new((Vec::new(), None)),
            itl_us: AtomicU64::new(0),
            max_model_len: AtomicU32::new(0),
            cards: RwLock::new((None, None)),
            paused: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            addr: RwLock::new(None),
            idle: Arc::default(),
            probe_idle: Arc::default(),
            calibration: Default::default(),
            kv_sources: RwLock::new(None),
        }
    }

    /// The KV-event publishers it named, once read.
    pub fn kv_sources(&self) -> Option<Arc<[FoundKvSource]>> {
        self.kv_sources.read().clone()
    }

    /// Records the KV-event publishers it named.
    pub fn set_kv_sources(&self, found: Vec<FoundKvSource>) {
        *self.kv_sources.write() = Some(found.into());
    }

    /// The worker's address: the cached one, or a fresh lookup (then cached).
    pub async fn addr(&self) -> std::io::Result<SocketAddr> {
        if let Some(a) = *self.addr.read() {
            return Ok(a);
        }
        self.resolve().await
    }

    /// Looks the address up now and caches it.
    pub async fn resolve(&self) -> std::io::Result<SocketAddr> {
        let a = match self.url.host.parse::<std::net::IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, self.url.port),
            Err(_) => tokio::net::lookup_host((self.url.host.as_str(), self.url.port))
                .await?
                .next()
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} does not resolve", self.url)))?,
        };
        let before = self.addr.write().replace(a);
        if before.is_some_and(|b| b != a) {
            // Pooled connections go to the old address.
            self.idle.clear();
            self.probe_idle.clear();
        }
        Ok(a)
    }

    /// Passes health checks.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health observation; returns `Some(new_state)` when the state flips.
    pub fn observe_health(&self, ok: bool, unhealthy_after: u32, healthy_after: u32) -> Option<bool> {
        if ok {
            self.consecutive_failures.store(0, Ordering::Relaxed);
            let n = self.consecutive_successes.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= healthy_after && !self.healthy.swap(true, Ordering::Relaxed) {
                // It may have restarted with other publishers: read them again.
                *self.kv_sources.write() = None;
                return Some(true);
            }
        } else {
            self.consecutive_successes.store(0, Ordering::Relaxed);
            let n = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= unhealthy_after && self.healthy.swap(false, Ordering::Relaxed) {
                return Some(false);
            }
        }
        None
    }

    /// Records what the worker's `/metrics` say (one entry per DP rank).
    pub fn set_reported(&self, ranks: Vec<ReportedLoad>) {
        *self.reported.write() = (ranks, Some(Instant::now()));
    }

    /// The worker's reported load per DP rank (empty until polled).
    pub fn reported(&self) -> Vec<ReportedLoad> {
        self.reported.read().0.clone()
    }

    /// The worker's reported load over its DP ranks, read in place (routing reads it for every
    /// worker on every decision).
    pub fn reported_summary(&self) -> ReportedSummary {
        let r = self.reported.read();
        let ranks = &r.0;
        ReportedSummary {
            ranks: ranks.len(),
            total_blocks: ranks.iter().map(|r| r.total_blocks).sum(),
            kv_usage: ranks.iter().map(|r| r.kv_usage).fold(0.0, f64::max),
            waiting: ranks.iter().map(|r| r.waiting).sum::<u64>().min(u64::from(u32::MAX)) as u32,
        }
    }

    /// Its context length, once read from `/v1/models`.
    pub fn max_model_len(&self) -> Option<u32> {
        match self.max_model_len.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    /// Records its context length.
    pub fn set_max_model_len(&self, n: u32) {
        self.max_model_len.store(n, Ordering::Relaxed);
    }

    /// What its `/v1/models` said last (`None`: not read yet).
    pub fn cards(&self) -> Option<Arc<ModelCards>> {
        self.cards.read().0.clone()
    }

    /// How old its cards are (`None`: never read).
    pub fn cards_age(&self) -> Option<std::time::Duration> {
        self.cards.read().1.map(|t| t.elapsed())
    }

    /// Records what its `/v1/models` said; its context length comes from there.
    pub fn set_cards(&self, cards: ModelCards) {
        if let Some(n) = cards.max_model_len {
            self.set_max_model_len(n);
        }
        *self.cards.write() = (Some(Arc::new(cards)), Some(Instant::now()));
    }

    /// Whether its cards list LoRA adapter `name` (false while they are unknown).
    pub fn has_adapter(&self, name: &str) -> bool {
        self.cards.read().0.as_ref().is_some_and(|c| c.has_adapter(name))
    }

    /// Whether a fleet operation paused it or put it to sleep: no new request is placed on it
    /// then; requests wait in the router queue instead.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire) || self.asleep.load(Ordering::Acquire)
    }

    /// Pauses it (`/pause`) or resumes it (`/resume`).
    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Release);
    }

    /// Puts it to sleep (`/sleep`) or wakes it (`/wake_up`): apart from a pause, so that a
    /// `/resume` does not wake a sleeping worker, nor a `/wake_up` resume a paused one.
    pub fn set_asleep(&self, asleep: bool) {
        self.asleep.store(asleep, Ordering::Release);
    }

    /// How old its last report is (`None`: never polled).
    pub fn report_age(&self) -> Option<std::time::Duration> {
        self.reported.read().1.map(|t| t.elapsed())
    }

    /// Notes one inter-token gap seen on a stream it serves (EWMA, weight 1/8: a racy
    /// read-modify-write between two streams loses one sample, which an average shrugs off).
    pub fn observe_itl(&self, gap: std::time::Duration) {
        let us = gap.as_micros().min(u128::from(u32::MAX)) as u64;
        let old = self.itl_us.load(Ordering::Relaxed);
        let new = if old == 0 { us } else { (old * 7 + us) / 8 };
        self.itl_us.store(new.max(1), Ordering::Relaxed);
    }

    /// The measured inter-token latency, ms (`None` before any stream).
    pub fn itl_ms(&self) -> Option<f64> {
        match self.itl_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(us as f64 / 1000.0),
        }
    }
}

/// A DP rank's load as the worker reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReportedLoad {
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: u64,
    /// `num_gpu_blocks` from `vllm:cache_config_info`.
    pub total_blocks: u64,
}

/// A worker's reported load summed over its DP ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReportedSummary {
    /// DP ranks reported (0 until polled).
    pub ranks: usize,
    /// KV capacity in blocks, summed.
    pub total_blocks: u64,
    /// KV usage of the fullest rank.
    pub kv_usage: f64,
    /// Waiting requests, summed (saturating at `u32::MAX`).
    pub waiting: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_flips_after_thresholds() {
        let w = Worker::new(UpstreamUrl::parse("http://127.0.0.1:1").unwrap());
        assert!(w.is_healthy());
        assert_eq!(w.observe_health(false, 2, 2), None);
        assert_eq!(w.observe_health(false, 2, 2), Some(false));
        assert_eq!(w.observe_health(false, 2, 2), None);
        assert_eq!(w.observe_health(true, 2, 2), None);
        assert_eq!(w.observe_health(true, 2, 2), Some(true));
    }
}
