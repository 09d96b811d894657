//! The gateway's Prometheus metrics (`kvgate_*`), in one registry served on `/metrics` of both
//! listeners. Where Dynamo's cancellation design names a metric
//! (`dynamo_frontend_model_cancellation_total`), the kvgate equivalent keeps its labels.

pub mod cluster;
pub mod disaggregation;
pub mod planner;
pub mod tenants;

use prometheus::{Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

const LATENCY_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0];
/// Prompt blocks, for the routing histograms (a prefix of up to 16k tokens in blocks of 16).
const BLOCK_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// All gateway metrics.
pub struct Metrics {
    registry: Registry,
    /// `kvgate_requests_total{model,endpoint,status}`.
    pub requests: IntCounterVec,
    /// `kvgate_request_duration_seconds{model,endpoint}`.
    pub duration: HistogramVec,
    /// `kvgate_time_to_first_token_seconds{model,endpoint}` (streams).
    pub ttft: HistogramVec,
    /// `kvgate_inter_token_latency_seconds{model,endpoint}` (streams).
    pub itl: HistogramVec,
    /// `kvgate_requests_in_flight{model}`.
    pub requests_in_flight: IntGaugeVec,
    /// `kvgate_upstream_errors_total{model,worker,kind}`.
    pub upstream_errors: IntCounterVec,
    /// `kvgate_retries_total{model}`.
    pub retries: IntCounterVec,
    /// `kvgate_frontend_model_cancellation_total{model,endpoint,request_type}`.
    pub cancellations: IntCounterVec,
    /// `kvgate_worker_healthy{model,worker}` (1/0).
    pub worker_healthy: IntGaugeVec,
    /// `kvgate_worker_requests_in_flight{model,worker}`.
    pub worker_in_flight: IntGaugeVec,
    /// `kvgate_config_reloads_total{result}`.
    pub reloads: IntCounterVec,
    /// `kvgate_plugin_failures_total{plugin,kind}`: calls answered by the fallback because
    /// the plugin timed out, trapped, hit its memory cap or answered nonsense.
    pub plugin_failures: IntCounterVec,
    /// `kvgate_plugin_reloads_total{plugin,result}`: module swaps (`ok`) and refused modules.
    pub plugin_reloads: IntCounterVec,
    /// `kvgate_routing_decisions_total{model,worker}`.
    pub decisions: IntCounterVec,
    /// `kvgate_routing_overlap_blocks{model}`: cached blocks of the chosen worker.
    pub overlap: HistogramVec,
    /// `kvgate_routing_forgone_blocks{model}`: blocks the best-cached candidate held and the
    /// chosen one did not, what a choice gave up of the cache for load (0: it took the best).
    pub forgone: HistogramVec,
    /// `kvgate_routing_decision_seconds{model}`: tokenize excluded.
    pub decision_time: HistogramVec,
    /// `kvgate_routing_slo_total{model,predicted}`: placements of requests with latency
    /// objectives, by whether the chosen worker was predicted to meet them (`met`, `missed`).
    pub slo: IntCounterVec,
    /// `kvgate_worker_active_prefill_tokens{model,worker}`.
    pub active_prefill: IntGaugeVec,
    /// `kvgate_worker_active_blocks{model,worker}`.
    pub active_blocks: IntGaugeVec,
    /// `kvgate_worker_prefill_factor{model,worker}`: the worker's measured prefill time over
    /// the `time` cost's prior (1 until measured).
    pub prefill_factor: GaugeVec,
    /// `kvgate_worker_step_factor{model,worker}`: its measured step time over the prior.
    pub step_factor: GaugeVec,
    /// `kvgate_frontend_model_rejection_total{model,endpoint}`: 503s because every worker was busy.
    pub rejections: IntCounterVec,
    /// `kvgate_tasks_issued_total{model}`: requests sent to a worker.
    pub issued: IntCounterVec,
    /// `kvgate_worker_busy{model,worker}` (1/0), as of the last request.
    pub worker_busy: IntGaugeVec,
    /// `kvgate_queued_requests{model}`: requests held in the router queue.
    pub queued: IntGaugeVec,
    /// `kvgate_queue_wait_seconds{model}`.
    pub queue_wait: HistogramVec,
    /// `kvgate_prefill_gate_wait_seconds{model}`.
    pub gate_wait: HistogramVec,
    /// `kvgate_tasks_rejected_total{model,reason}` (reason: busy | queue_full | queue_timeout).
    pub rejected: IntCounterVec,
    /// `kvgate_migrations_total{model,reason,outcome}`: moves of running or waiting requests
    /// (reason: failover | admin; outcome: ok | failed | limit | pinned | finished).
    pub migrations: IntCounterVec,
    /// `kvgate_migration_pinned_total{model,reason}`: streams that could not move, by reason.
    pub migration_pinned: IntCounterVec,
    /// `kvgate_migration_pause_seconds{model}`: the gap the client saw between the last event
    /// from the old worker and the first from the new one.
    pub migration_pause: HistogramVec,
    /// `kvgate_migration_recomputed_tokens_total{model}`: continuation prompt tokens the
    /// destination did not hold (as far as the gateway knows).
    pub migration_recomputed: IntCounterVec,
    /// `kvgate_rescheduling_failed_total{model,policy}`: rescheduler moves that failed.
    pub rescheduling_failed: IntCounterVec,
    /// `kvgate_refused_connections_total{reason}`: client connections answered and closed
    /// before any routing (reason: malformed | connect | max_connections).
    pub refused_connections: IntCounterVec,
    /// `kvgate_client_limited_total`: requests refused with 429 because their client had
    /// `per_client.max_concurrent` in flight.
    pub client_limited: IntCounter,
    /// `kvgate_tls_reloads_total{listener,result}`: TLS certificate pairs read again (ok) or
    /// refused, the previous pair staying in use (rejected).
    pub tls_reloads: IntCounterVec,
    /// `kvgate_client_connections{listener}`: client connections open now (public | admin);
    /// `max_connections` caps each listener's.
    pub client_connections: IntGaugeVec,
    /// `kvgate_refused_paths_total{reason}`: public-listener requests refused for their path
    /// (reason: control | not_passed_through).
    pub refused_paths: IntCounterVec,
    /// `kvgate_render_fallback_total{endpoint,reason}`: Messages and Responses prompts kv
    /// routing could not render exactly as vLLM does, placed by load instead.
    pub render_fallback: IntCounterVec,
    /// The planner's (`kvgate_planner_*`).
    pub planner: planner::PlannerMetrics,
    /// Prefill/decode disaggregation's (`kvgate_disagg_*`).
    pub disagg: disaggregation::DisaggMetrics,
    /// Replicas' (`kvgate_cluster_*`).
    pub cluster: cluster::ClusterMetrics,
    /// Tenants' (`kvgate_tenant_*`).
    pub tenants: tenants::TenantMetrics,
    /// `kvgate_admin_unauthorized_total`: admin requests refused for a missing or wrong token.
    pub admin_unauthorized: IntCounter,
}

impl Metrics {
    /// Creates and registers everything.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let fgauge = |name: &str, help: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let hist = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels).expect("valid metric");
            registry.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        Self {
            requests: counter("kvgate_requests_total", "Inference requests by final HTTP status.", &["model", "endpoint", "status"]),
            duration: hist("kvgate_request_duration_seconds", "Time from request start to the last response byte.", LATENCY_BUCKETS, &["model", "endpoint"]),
            ttft: hist(
                "kvgate_time_to_first_token_seconds",
                "Time to the first streamed response chunk, measured at the gateway.",
                LATENCY_BUCKETS,
                &["model", "endpoint"],
            ),
            itl: hist(
                "kvgate_inter_token_latency_seconds",
                "Time between streamed response chunks, measured at the gateway.",
                ITL_BUCKETS,
                &["model", "endpoint"],
            ),
            requests_in_flight: gauge("kvgate_requests_in_flight", "Inference requests being served.", &["model"]),
            upstream_errors: counter("kvgate_upstream_errors_total", "Failures talking to workers.", &["model", "worker", "kind"]),
            retries: counter("kvgate_retries_total", "Requests retried on another worker before any byte reached the client.", &["model"]),
            cancellations: counter(
                "kvgate_frontend_model_cancellation_total",
                "Requests cancelled because the client disconnected (counted once per request).",
                &["model", "endpoint", "request_type"],
            ),
            worker_healthy: gauge("kvgate_worker_healthy", "1 if the worker passes health checks.", &["model", "worker"]),
            worker_in_flight: gauge("kvgate_worker_requests_in_flight", "Requests the gateway has in flight to the worker.", &["model", "worker"]),
            reloads: counter("kvgate_config_reloads_total", "Configuration reload attempts.", &["result"]),
            plugin_failures: counter(
                "kvgate_plugin_failures_total",
                "Plugin calls answered by the fallback mode, by failure kind (timeout, memory, trap, invalid).",
                &["plugin", "kind"],
            ),
            plugin_reloads: counter(
                "kvgate_plugin_reloads_total",
                "Plugin module reloads: ok (swapped) or rejected (the old one stays).",
                &["plugin", "result"],
            ),
            decisions: counter("kvgate_routing_decisions_total", "Routing decisions per chosen worker.", &["model", "worker"]),
            overlap: hist("kvgate_routing_overlap_blocks", "Prompt blocks already cached on the chosen worker.", BLOCK_BUCKETS, &["model"]),
            forgone: hist(
                "kvgate_routing_forgone_blocks",
                "Prompt blocks cached on the best-cached candidate but not on the chosen worker (0: the choice took the best cache).",
                BLOCK_BUCKETS,
                &["model"],
            ),
            decision_time: hist(
                "kvgate_routing_decision_seconds",
                "Time to choose a worker (hashing, index lookup, cost), tokenization excluded.",
                &[1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3],
                &["model"],
            ),
            active_prefill: gauge("kvgate_worker_active_prefill_tokens", "Prefill tokens booked on the worker (kv routing).", &["model", "worker"]),
            active_blocks: gauge("kvgate_worker_active_blocks", "KV blocks booked on the worker (kv routing).", &["model", "worker"]),
            prefill_factor: fgauge(
                "kvgate_worker_prefill_factor",
                "The worker's measured prefill time over the time cost's prior (kv routing; 1 until measured).",
                &["model", "worker"],
            ),
            step_factor: fgauge(
                "kvgate_worker_step_factor",
                "The worker's measured step time over the time cost's prior (kv routing; 1 until measured).",
                &["model", "worker"],
            ),
            rejections: counter(
                "kvgate_frontend_model_rejection_total",
                "Requests refused with 503 because every worker was busy (also counted in kvgate_tasks_rejected_total).",
                &["model", "endpoint"],
            ),
            migrations: counter("kvgate_migrations_total", "Requests moved to another worker, by reason and outcome.", &["model", "reason", "outcome"]),
            migration_pinned: counter("kvgate_migration_pinned_total", "Streamed requests that could not move, by reason.", &["model", "reason"]),
            migration_pause: hist(
                "kvgate_migration_pause_seconds",
                "Gap between the last event from the old worker and the first from the new one.",
                LATENCY_BUCKETS,
                &["model"],
            ),
            migration_recomputed: counter(
                "kvgate_migration_recomputed_tokens_total",
                "Continuation prompt tokens the destination had to compute (not cached there as far as the gateway knows).",
                &["model"],
            ),
            rescheduling_failed: counter("kvgate_rescheduling_failed_total", "Moves the rescheduler ordered that failed or timed out.", &["model", "policy"]),
            refused_connections: counter(
                "kvgate_refused_connections_total",
                "Client connections answered with an error or closed before any routing (malformed request header, CONNECT, past max_connections).",
                &["reason"],
            ),
            client_limited: {
                let c = IntCounter::new("kvgate_client_limited_total", "Requests refused with 429: their client had per_client.max_concurrent in flight.")
                    .expect("valid metric");
                registry.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            tls_reloads: counter(
                "kvgate_tls_reloads_total",
                "TLS certificate pairs read again (ok) or refused with the previous pair kept (rejected).",
                &["listener", "result"],
            ),
            client_connections: gauge("kvgate_client_connections", "Client connections open now, per listener (public | admin).", &["listener"]),
            refused_paths: counter(
                "kvgate_refused_paths_total",
                "Public-listener requests refused for their path: a vLLM control endpoint, or a path the passthrough rules keep from the workers.",
                &["reason"],
            ),
            render_fallback: counter(
                "kvgate_render_fallback_total",
                "Messages and Responses prompts that kv routing could not render to token ids exactly as vLLM does (an image, a stored conversation, ...), placed by load instead.",
                &["endpoint", "reason"],
            ),
            issued: counter("kvgate_tasks_issued_total", "Requests sent to a worker.", &["model"]),
            slo: counter(
                "kvgate_routing_slo_total",
                "Placements of requests with latency objectives, by whether the chosen worker was predicted to meet them.",
                &["model", "predicted"],
            ),
            worker_busy: gauge("kvgate_worker_busy", "1 if the worker was over a busy threshold at the last decision.", &["model", "worker"]),
            queued: gauge("kvgate_queued_requests", "Requests held in the router queue.", &["model"]),
            queue_wait: hist("kvgate_queue_wait_seconds", "Time requests spent in the router queue.", LATENCY_BUCKETS, &["model"]),
            gate_wait: hist(
                "kvgate_prefill_gate_wait_seconds",
                "Time long prompts were held at their worker's prefill gate for the last step or first token of the one ahead.",
                LATENCY_BUCKETS,
                &["model"],
            ),
            rejected: counter("kvgate_tasks_rejected_total", "Requests refused by shedding or the router queue.", &["model", "reason"]),
            planner: planner::PlannerMetrics::new(&registry),
            disagg: disaggregation::DisaggMetrics::new(&registry),
            cluster: cluster::ClusterMetrics::new(&registry),
            tenants: tenants::TenantMetrics::new(&registry),
            admin_unauthorized: {
                let c = IntCounter::new("kvgate_admin_unauthorized_total", "Admin requests refused with 401: no admin token, or a wrong one.")
                    .expect("valid metric");
                registry.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            registry,
        }
    }

    /// The registry (other crates register their metrics here).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

/// One endpoint's per-request series of a model, resolved once.
#[derive(Clone)]
pub struct EndpointMetrics {
    /// `kvgate_request_duration_seconds{model,endpoint}`.
    pub duration: Histogram,
    /// `kvgate_time_to_first_token_seconds{model,endpoint}`.
    pub ttft: Histogram,
    /// `kvgate_inter_token_latency_seconds{model,endpoint}`.
    pub itl: Histogram,
    /// `kvgate_requests_total{model,endpoint,status="200"}`, the common case.
    pub ok: IntCounter,
}

/// A model's per-request series, resolved once per model so the request path does no label
/// lookups (each `with_label_values` hashes its labels and takes a lock).
#[derive(Clone)]
pub struct ModelMetrics {
    /// `kvgate_requests_in_flight{model}`.
    pub requests_in_flight: IntGauge,
    /// `kvgate_tasks_issued_total{model}`.
    pub issued: IntCounter,
    /// `kvgate_routing_overlap_blocks{model}`.
    pub overlap: Histogram,
    /// `kvgate_routing_forgone_blocks{model}`.
    pub forgone: Histogram,
    /// `kvgate_routing_decision_seconds{model}`.
    pub decision_time: Histogram,
    /// `kvgate_routing_decisions_total{model,worker}`, by worker id.
    pub decisions: Vec<IntCounter>,
    /// `kvgate_routing_slo_total{model,predicted}`: `met` and `missed`.
    pub slo: [IntCounter; 2],
    /// By [`crate::endpoint::Endpoint::index`].
    pub endpoints: Vec<EndpointMetrics>,
}

impl ModelMetrics {
    /// Resolves the series of model `name` with these worker labels.
    pub fn new(m: &Metrics, name: &str, workers: &[String]) -> Self {
        let endpoints = crate::endpoint::Endpoint::ALL
            .iter()
            .map(|e| {
                let l = [name, e.label()];
                EndpointMetrics {
                    duration: m.duration.with_label_values(&l),
                    ttft: m.ttft.with_label_values(&l),
                    itl: m.itl.with_label_values(&l),
                    ok: m.requests.with_label_values(&[name, e.label(), "200"]),
                }
            })
            .collect();
        Self {
            requests_in_flight: m.requests_in_flight.with_label_values(&[name]),
            issued: m.issued.with_label_values(&[name]),
            overlap: m.overlap.with_label_values(&[name]),
            forgone: m.forgone.with_label_values(&[name]),
            decision_time: m.decision_time.with_label_values(&[name]),
            decisions: workers.iter().map(|w| m.decisions.with_label_values(&[name, w.as_str()])).collect(),
            slo: ["met", "missed"].map(|p| m.slo.with_label_values(&[name, p])),
            endpoints,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
