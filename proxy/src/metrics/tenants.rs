//! Tenant metrics (`kvgate_tenant_*`, docs/tenants.md). The `tenant` label takes only the
//! configured tenants' names and `default`, so its cardinality is the configuration's; keys are
//! never a label.

use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The tenant series.
#[derive(Clone)]
pub struct TenantMetrics {
    /// `kvgate_tenant_requests_total{tenant}`: requests admitted past the tenant's limits.
    pub admitted: IntCounterVec,
    /// `kvgate_tenant_rate_limited_total{tenant,limit}`: requests refused with 429 by a limit
    /// (`requests`, `input_tokens`, `output_tokens`, `concurrent`).
    pub limited: IntCounterVec,
    /// `kvgate_tenant_unauthorized_total`: requests refused with 401 (no key, or an unknown one,
    /// under `require_key`).
    pub unauthorized: IntCounter,
    /// `kvgate_tenant_tokens_total{tenant,kind}`: prompt (`input`) and generated (`output`)
    /// tokens charged.
    pub tokens: IntCounterVec,
    /// `kvgate_tenant_in_flight{tenant}`: requests in flight on this replica.
    pub in_flight: IntGaugeVec,
    /// `kvgate_tenant_queue_wait_seconds{tenant}`: time spent in a router queue.
    pub queue_wait: HistogramVec,
}

impl TenantMetrics {
    /// Creates and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let counters = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let unauthorized = IntCounter::new("kvgate_tenant_unauthorized_total", "Requests refused with 401: no key, or an unknown one, under require_key")
            .expect("valid metric");
        registry.register(Box::new(unauthorized.clone())).expect("unique metric");
        let in_flight =
            IntGaugeVec::new(Opts::new("kvgate_tenant_in_flight", "Requests in flight on this replica per tenant"), &["tenant"]).expect("valid metric");
        registry.register(Box::new(in_flight.clone())).expect("unique metric");
        let queue_wait = HistogramVec::new(
            HistogramOpts::new("kvgate_tenant_queue_wait_seconds", "Time spent in a router queue per tenant")
                .buckets(vec![0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
            &["tenant"],
        )
        .expect("valid metric");
        registry.register(Box::new(queue_wait.clone())).expect("unique metric");
        Self {
            admitted: counters("kvgate_tenant_requests_total", "Requests admitted past their tenant's limits", &["tenant"]),
            limited: counters("kvgate_tenant_rate_limited_total", "Requests refused with 429 by a tenant limit", &["tenant", "limit"]),
            unauthorized,
            tokens: counters("kvgate_tenant_tokens_total", "Prompt (input) and generated (output) tokens charged per tenant", &["tenant", "kind"]),
            in_flight,
            queue_wait,
        }
    }
}
