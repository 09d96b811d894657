//! The `rescheduling` section: Llumnix's flags under their own names (dashes become
//! underscores), with its defaults. docs/migration.md describes the loop.

use kvgate_filters::reschedule::{Domain, Order, Policy, Rule, Scope, Take};
use serde::Deserialize;

/// The rescheduler (off by default, as in Llumnix).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rescheduling {
    /// `--enable-rescheduling`.
    pub enable_rescheduling: bool,
    /// `--rescheduling-policies`, comma-separated.
    pub rescheduling_policies: String,
    /// `--rescheduling-interval-ms`.
    pub rescheduling_interval_ms: u64,
    /// `--rescheduling-decode-load-metric`.
    pub rescheduling_decode_load_metric: LoadMetric,
    /// `--rescheduling-decode-load-threshold`.
    pub rescheduling_decode_load_threshold: f64,
    /// `--rescheduling-neutral-load-metric`.
    pub rescheduling_neutral_load_metric: LoadMetric,
    /// `--rescheduling-neutral-load-threshold`.
    pub rescheduling_neutral_load_threshold: f64,
    /// `--rescheduling-load-balance-threshold`.
    pub rescheduling_load_balance_threshold: f64,
    /// `--rescheduling-load-balance-scope`.
    pub rescheduling_load_balance_scope: Scope,
    /// `--rescheduling-req-select-rule`.
    pub rescheduling_req_select_rule: Rule,
    /// `--rescheduling-req-select-order`.
    pub rescheduling_req_select_order: Order,
    /// `--rescheduling-req-select-value`.
    pub rescheduling_req_select_value: f64,
    /// `--tpot-slo`, ms.
    pub tpot_slo: f64,
    /// `--tpot-slo-dispatch-threshold`.
    pub tpot_slo_dispatch_threshold: f64,
    /// `--tpot-migrate-out-ceil-threshold`.
    pub tpot_migrate_out_ceil_threshold: f64,
    /// `--tpot-migrate-out-floor-threshold`.
    pub tpot_migrate_out_floor_threshold: f64,
    /// `--failover-domain`.
    pub failover_domain: Domain,
    /// `--instance-staleness-seconds`.
    pub instance_staleness_seconds: u64,
    /// `--llumlet-grpc-timeout-seconds`: how long one cycle waits for its moves.
    pub llumlet_grpc_timeout_seconds: u64,
    /// A WebAssembly rescheduling policy (the `rescheduler` world, plugins/README.md) run each
    /// cycle besides the built-in ones; its pairs are executed the same way.
    pub plugin: Option<super::plugin::PluginConfig>,
}

/// A load metric for the load-balance policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMetric {
    /// The worker's reported KV usage plus the prefill the gateway booked on it and the worker
    /// has not started (docs/migration.md).
    KvCacheUsageRatioProjected,
    /// The worker's reported KV usage only.
    KvCacheUsageRatio,
    /// The worker's predicted time per output token (routing's step predictor) over
    /// `tpot_slo`: 1.0 is a worker at its SLO.
    PredictedTpotRatio,
}

impl Default for Rescheduling {
    fn default() -> Self {
        Self {
            enable_rescheduling: false,
            rescheduling_policies: "decode_load,prefill_failover,decode_failover,neutral_failover".into(),
            rescheduling_interval_ms: 500,
            rescheduling_decode_load_metric: LoadMetric::KvCacheUsageRatioProjected,
            rescheduling_decode_load_threshold: 1.0,
            rescheduling_neutral_load_metric: LoadMetric::KvCacheUsageRatioProjected,
            rescheduling_neutral_load_threshold: 1.0,
            rescheduling_load_balance_threshold: 0.0,
            rescheduling_load_balance_scope: Scope::Cluster,
            rescheduling_req_select_rule: Rule::Token,
            rescheduling_req_select_order: Order::Sr,
            rescheduling_req_select_value: 1024.0,
            tpot_slo: 50.0,
            tpot_slo_dispatch_threshold: 0.85,
            tpot_migrate_out_ceil_threshold: 0.95,
            tpot_migrate_out_floor_threshold: 0.60,
            failover_domain: Domain::Instance,
            instance_staleness_seconds: 60,
            llumlet_grpc_timeout_seconds: 5,
            plugin: None,
        }
    }
}

/// Policy names Llumnix defines.
pub const POLICY_NAMES: [&str; 7] =
    ["decode_load", "neutral_load", "prefill_failover", "decode_failover", "neutral_failover", "binpacking_mitigation", "binpacking_consolidation"];

/// One configured policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Configured {
    /// Its Llumnix name (metric label).
    pub name: &'static str,
    /// What it does.
    pub policy: Policy,
    /// The load metric, for the load-balance policies.
    pub metric: Option<LoadMetric>,
}

impl Rescheduling {
    /// The configured policies with their names and metrics, in order; an unknown name is an
    /// error (checked at load).
    pub fn policies(&self) -> Result<Vec<Configured>, String> {
        let mut out = Vec::new();
        for name in self.rescheduling_policies.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some(&name) = POLICY_NAMES.iter().find(|&&n| n == name) else {
                return Err(format!("rescheduling_policies: unknown policy {name:?} (known: {})", POLICY_NAMES.join(", ")));
            };
            let balance = |threshold| Policy::LoadBalance {
                threshold,
                min_difference: self.rescheduling_load_balance_threshold,
                scope: self.rescheduling_load_balance_scope,
            };
            let (policy, metric) = match name {
                "decode_load" => (balance(self.rescheduling_decode_load_threshold), Some(self.rescheduling_decode_load_metric)),
                "neutral_load" => (balance(self.rescheduling_neutral_load_threshold), Some(self.rescheduling_neutral_load_metric)),
                "binpacking_mitigation" => {
                    (Policy::Mitigation { slo_ms: self.tpot_slo, ceil: self.tpot_migrate_out_ceil_threshold, dispatch: self.tpot_slo_dispatch_threshold }, None)
                }
                "binpacking_consolidation" => (
                    Policy::Consolidation { slo_ms: self.tpot_slo, floor: self.tpot_migrate_out_floor_threshold, dispatch: self.tpot_slo_dispatch_threshold },
                    None,
                ),
                _ => (Policy::Failover { domain: self.failover_domain }, None),
            };
            // Without a prefill/decode split the three failover policies see the same workers.
            if matches!(policy, Policy::Failover { .. }) && out.iter().any(|c: &Configured| matches!(c.policy, Policy::Failover { .. })) {
                continue;
            }
            out.push(Configured { name, policy, metric });
        }
        Ok(out)
    }

    /// How much each pair moves: the configured rule, except consolidation (everything).
    pub fn take(&self, policy: &Policy) -> Take {
        match policy {
            Policy::Consolidation { .. } => Take::All,
            _ => Take::Amount { rule: self.rescheduling_req_select_rule, order: self.rescheduling_req_select_order, value: self.rescheduling_req_select_value },
        }
    }

    /// Checks values (called at load).
    pub fn validate(&self) -> Result<(), String> {
        self.policies()?;
        if self.rescheduling_interval_ms == 0 || self.llumlet_grpc_timeout_seconds == 0 || self.instance_staleness_seconds == 0 {
            return Err("rescheduling: rescheduling_interval_ms, llumlet_grpc_timeout_seconds and instance_staleness_seconds must be at least 1".into());
        }
        if !(self.tpot_slo > 0.0 && self.rescheduling_req_select_value >= 0.0) {
            return Err("rescheduling: tpot_slo must be positive and rescheduling_req_select_value not negative".into());
        }
        Ok(())
    }
}
