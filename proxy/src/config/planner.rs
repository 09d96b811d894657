//! A model's `planner` section: Dynamo's planner knobs with their defaults
//! ([`PlanParams`], the rules' own type), plus what only the gateway needs: the connector that
//! starts and stops workers, how long a drain may take, and where the decision log goes.

pub use kvgate_filters::plan::{PlanMode, PlanParams};
use serde::{Deserialize, Deserializer, de};
use std::path::PathBuf;

/// The `planner` section.
#[derive(Debug, Clone, PartialEq)]
pub struct Planner {
    /// Dynamo's planner knobs (`enabled`, `mode`, intervals, budgets, thresholds, grace period).
    pub rules: PlanParams,
    /// What adds and removes workers (`None`: observe only).
    pub connector: Option<ConnectorConfig>,
    /// Longest a scale-down waits for the victim's requests (moved or finished) before it
    /// stops the worker anyway. Default 120.
    pub drain_timeout_s: f64,
    /// Where each pull and decision is appended as one JSON line (`None`: nowhere).
    pub log: Option<PathBuf>,
    /// How a scale-down empties its worker. Default `migrate`.
    pub drain: DrainMode,
}

/// How a scale-down empties the worker it removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainMode {
    /// Move its streams to other workers by continuation (docs/migration.md), wait for the
    /// requests that cannot move.
    #[default]
    Migrate,
    /// Wait for its requests to finish where they are (Dynamo's way).
    Wait,
}

impl Default for Planner {
    fn default() -> Self {
        Self { rules: PlanParams::default(), connector: None, drain_timeout_s: 120.0, log: None, drain: DrainMode::Migrate }
    }
}

/// The keys of the section that Dynamo's planner does not have.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GatewayKeys {
    #[serde(default)]
    connector: Option<ConnectorConfig>,
    #[serde(default)]
    drain_timeout_s: Option<f64>,
    #[serde(default)]
    log: Option<PathBuf>,
    #[serde(default)]
    drain: DrainMode,
}

impl<'de> Deserialize<'de> for Planner {
    /// Dynamo's knobs and the gateway's sit side by side in one mapping; each half is read by
    /// its own type, both refusing unknown keys.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut map = serde_yaml::Mapping::deserialize(d)?;
        let mut ours = serde_yaml::Mapping::new();
        for key in ["connector", "drain_timeout_s", "log", "drain"] {
            if let Some(v) = map.remove(key) {
                ours.insert(key.into(), v);
            }
        }
        let rules = PlanParams::deserialize(serde_yaml::Value::Mapping(map)).map_err(de::Error::custom)?;
        let keys = GatewayKeys::deserialize(serde_yaml::Value::Mapping(ours)).map_err(de::Error::custom)?;
        Ok(Self { rules, connector: keys.connector, drain_timeout_s: keys.drain_timeout_s.unwrap_or(120.0), log: keys.log, drain: keys.drain })
    }
}

/// How the planner gets and gives back workers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ConnectorConfig {
    /// Worker processes on this machine, started from a command template.
    Local(LocalConnector),
    /// A Deployment or StatefulSet scaled through its `scale` subresource, its workers found
    /// from EndpointSlices.
    Kubernetes(KubernetesConnector),
}

/// The `kubernetes` connector.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConnector {
    /// `Deployment/<name>` or `StatefulSet/<name>`: what is scaled.
    pub workload: String,
    /// Label selector of the workers' EndpointSlices (e.g.
    /// `kubernetes.io/service-name=vllm-llama`).
    pub selector: String,
    /// The name of the workers' HTTP port in the EndpointSlices. Default `http`.
    #[serde(default = "default_port_name")]
    pub port_name: String,
    /// The namespace. Default: the kubeconfig context's, or the pod's own in a cluster.
    #[serde(default)]
    pub namespace: Option<String>,
    /// A kubeconfig file. Default: in-cluster credentials when in a pod, else `$KUBECONFIG`
    /// or `~/.kube/config`.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Seconds a new replica has to appear ready in the EndpointSlices, and a removed one to
    /// leave them. Default 600.
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: f64,
    /// Whether the workers publish KV events, found through their `GET /kv_event_sources`.
    /// Default true.
    #[serde(default = "default_true")]
    pub kv_events: bool,
}

/// What the kubernetes connector scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// `apps/v1` Deployment (the replica removed is steered by `pod-deletion-cost`).
    Deployment,
    /// `apps/v1` StatefulSet (the replica removed is always the highest ordinal).
    StatefulSet,
}

impl KubernetesConnector {
    /// The workload's kind and name.
    pub fn workload(&self) -> Result<(WorkloadKind, &str), String> {
        match self.workload.split_once('/') {
            Some(("Deployment", n)) if !n.is_empty() => Ok((WorkloadKind::Deployment, n)),
            Some(("StatefulSet", n)) if !n.is_empty() => Ok((WorkloadKind::StatefulSet, n)),
            _ => Err(format!("connector.workload {:?}: expected Deployment/<name> or StatefulSet/<name>", self.workload)),
        }
    }
}

fn default_port_name() -> String {
    "http".into()
}

/// The `local` connector: `command` is run by `sh -c` in a process group of its own, with
/// `{port}`, `{kv_port}`, `{gpu}`, `{name}` and `{model}` replaced.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalConnector {
    /// The command template (`vllm serve … --port {port}` or `vllm-sim …`).
    pub command: String,
    /// The first HTTP port handed out (`{port}`); each worker takes the lowest one free.
    pub ports_from: u16,
    /// The first KV-event port (`{kv_port}`); a worker's is `kv_ports_from + (port - ports_from)`.
    /// Default `ports_from + 1000`.
    #[serde(default)]
    pub kv_ports_from: Option<u16>,
    /// The host the workers listen on, as the gateway reaches them. Default 127.0.0.1.
    #[serde(default = "default_host")]
    pub host: String,
    /// GPU ids handed out (`{gpu}`: a worker's, comma-separated; also its
    /// `CUDA_VISIBLE_DEVICES`). Empty (the default): no GPUs are assigned.
    #[serde(default)]
    pub gpus: Vec<u32>,
    /// Where the running workers are recorded, so a restarted gateway adopts them. Optional.
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// Where each worker's output goes (`<name>.log`). Default: discarded.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    /// Seconds a started worker has to pass its first health check. Default 600.
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: f64,
    /// Seconds between SIGTERM and SIGKILL when a worker is stopped. Default 30.
    #[serde(default = "default_stop_timeout")]
    pub stop_timeout_s: f64,
    /// Whether the started workers publish KV events, found through their
    /// `GET /kv_event_sources` (`kv_events: auto`). Default true.
    #[serde(default = "default_true")]
    pub kv_events: bool,
}

fn default_host() -> String {
    "127.0.0.1".into()
}
fn default_ready_timeout() -> f64 {
    600.0
}
fn default_stop_timeout() -> f64 {
    30.0
}
fn default_true() -> bool {
    true
}

impl LocalConnector {
    /// The KV-event port paired with HTTP port `port`.
    pub fn kv_port(&self, port: u16) -> u16 {
        let base = self.kv_ports_from.unwrap_or(self.ports_from.saturating_add(1000));
        base.saturating_add(port - self.ports_from)
    }
}

/// Intervals positive, each threshold pair ordered, budgets that fit one engine, a connector
/// to act with.
pub fn validate(p: &Planner) -> Result<(), String> {
    let r = &p.rules;
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(r.metric_pulling_interval_s) || !positive(r.adjustment_interval_s) {
        return Err("metric_pulling_interval_s and adjustment_interval_s must be positive".into());
    }
    if r.metric_pulling_interval_s > r.adjustment_interval_s {
        return Err("metric_pulling_interval_s must not exceed adjustment_interval_s".into());
    }
    let ordered = |down: f64, up: f64| down.is_finite() && up.is_finite() && 0.0 <= down && down < up;
    if !ordered(r.decode_kv_scale_down_threshold, r.decode_kv_scale_up_threshold) {
        return Err("decode_kv_scale_down_threshold must be >= 0 and below decode_kv_scale_up_threshold".into());
    }
    if !ordered(r.prefill_queue_scale_down_threshold, r.prefill_queue_scale_up_threshold) {
        return Err("prefill_queue_scale_down_threshold must be >= 0 and below prefill_queue_scale_up_threshold".into());
    }
    if r.decode_engine_num_gpu == 0 || r.prefill_engine_num_gpu == 0 {
        return Err("decode_engine_num_gpu and prefill_engine_num_gpu must be at least 1".into());
    }
    if r.min_gpu_budget > r.max_gpu_budget || r.max_gpu_budget < r.decode_engine_num_gpu {
        return Err("min_gpu_budget must not exceed max_gpu_budget, which must fit one decode engine".into());
    }
    if !positive(p.drain_timeout_s) {
        return Err("drain_timeout_s must be positive".into());
    }
    if r.enabled && r.mode == PlanMode::Act && p.connector.is_none() {
        return Err("mode act needs a connector (e.g. {kind: local, command: …, ports_from: …}); use mode: observe_only to only record decisions".into());
    }
    match &p.connector {
        Some(ConnectorConfig::Local(l)) => local(l, r),
        Some(ConnectorConfig::Kubernetes(k)) => kubernetes(k),
        None => Ok(()),
    }
}

fn local(l: &LocalConnector, r: &PlanParams) -> Result<(), String> {
    if !l.command.contains("{port}") {
        return Err("connector.command must contain {port} (the gateway must know where the worker listens)".into());
    }
    let workers = r.max_gpu_budget / r.decode_engine_num_gpu;
    let fits = |from: u16| u16::try_from(u32::from(from) + workers).is_ok();
    if l.ports_from == 0 || !fits(l.ports_from) || !fits(l.kv_ports_from.unwrap_or(l.ports_from.saturating_add(1000))) || l.ports_from > u16::MAX - 1000 {
        return Err(format!("connector.ports_from (and kv_ports_from) must leave room for {workers} workers below port 65536"));
    }
    let (ports, kv) = (l.ports_from..l.ports_from + workers as u16, l.kv_port(l.ports_from)..l.kv_port(l.ports_from) + workers as u16);
    if ports.start < kv.end && kv.start < ports.end {
        return Err("connector.ports_from and kv_ports_from ranges overlap".into());
    }
    if crate::config::UpstreamUrl::parse(&format!("http://{}:1", l.host)).is_err() {
        return Err(format!("connector.host {:?} is not a host name or IP literal", l.host));
    }
    if !l.gpus.is_empty() && (l.gpus.len() as u32) < r.decode_engine_num_gpu {
        return Err("connector.gpus must hold at least one engine's GPUs (decode_engine_num_gpu)".into());
    }
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(l.ready_timeout_s) || !positive(l.stop_timeout_s) {
        return Err("connector.ready_timeout_s and stop_timeout_s must be positive".into());
    }
    Ok(())
}

fn kubernetes(k: &KubernetesConnector) -> Result<(), String> {
    k.workload()?;
    if k.selector.trim().is_empty() || k.port_name.is_empty() {
        return Err("connector.selector and connector.port_name must not be empty".into());
    }
    if !(k.ready_timeout_s.is_finite() && k.ready_timeout_s > 0.0) {
        return Err("connector.ready_timeout_s must be positive".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<Planner, String> {
        serde_yaml::from_str::<Planner>(yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn the_defaults_are_the_seeds_and_valid() {
        let p = Planner::default();
        let r = p.rules;
        assert_eq!((r.enabled, r.mode, r.adjustment_interval_s, r.max_gpu_budget, r.new_decode_worker_grace_period), (false, PlanMode::Act, 30.0, 8, 3));
        assert_eq!(validate(&p), Ok(()));
        assert_eq!(parse("{}").unwrap(), p);
    }

    #[test]
    fn seed_knobs_and_gateway_keys_share_one_section() {
        let p = parse("enabled: true\nadjustment_interval_s: 5\ndrain_timeout_s: 9\ndrain: wait\nconnector:\n  kind: local\n  command: vllm-sim --port {port}\n  ports_from: 8100\n")
            .unwrap();
        assert_eq!((p.rules.enabled, p.rules.adjustment_interval_s, p.drain_timeout_s, p.drain), (true, 5.0, 9.0, DrainMode::Wait));
        let Some(ConnectorConfig::Local(l)) = &p.connector else { panic!("{p:?}") };
        assert_eq!((l.ports_from, l.kv_port(8102), l.host.as_str(), l.kv_events), (8100, 9102, "127.0.0.1", true));
        assert_eq!(validate(&p), Ok(()));
        assert!(parse("adjustment_interval: 5").unwrap_err().contains("unknown field"), "a seed knob misspelt");
        assert!(parse("connector: {kind: local, command: x, ports_from: 1, nope: 2}").unwrap_err().contains("unknown field"));
        assert!(parse("connector: {kind: cloud}").unwrap_err().contains("unknown variant"));
        let k = parse("enabled: true\nconnector: {kind: kubernetes, workload: StatefulSet/vllm, selector: app=vllm}").unwrap();
        let Some(ConnectorConfig::Kubernetes(c)) = &k.connector else { panic!("{k:?}") };
        assert_eq!((c.workload().unwrap(), c.port_name.as_str()), ((WorkloadKind::StatefulSet, "vllm"), "http"));
        assert_eq!(validate(&k), Ok(()));
        let bad = parse("connector: {kind: kubernetes, workload: Pod/x, selector: a=b}").unwrap();
        assert!(validate(&bad).unwrap_err().contains("Deployment/<name>"));
    }

    #[test]
    fn inconsistent_knobs_are_refused() {
        let with = |rules: PlanParams| Planner { rules, ..Planner::default() };
        let d = PlanParams::default();
        let local = |f: fn(&mut LocalConnector)| {
            let mut l: LocalConnector = serde_yaml::from_str("{command: 'x --port {port}', ports_from: 8100}").unwrap();
            f(&mut l);
            Planner { connector: Some(ConnectorConfig::Local(l)), ..Planner::default() }
        };
        let bad = [
            with(PlanParams { adjustment_interval_s: 0.0, ..d }),
            with(PlanParams { metric_pulling_interval_s: 60.0, ..d }),
            with(PlanParams { decode_kv_scale_down_threshold: 0.95, ..d }),
            with(PlanParams { prefill_queue_scale_up_threshold: 0.1, ..d }),
            with(PlanParams { decode_engine_num_gpu: 0, ..d }),
            with(PlanParams { min_gpu_budget: 9, ..d }),
            with(PlanParams { decode_engine_num_gpu: 16, ..d }),
            with(PlanParams { enabled: true, ..d }),
            Planner { drain_timeout_s: 0.0, ..Planner::default() },
            local(|l| l.command = "vllm serve".into()),
            local(|l| l.ports_from = 65530),
            local(|l| l.kv_ports_from = Some(8101)),
            local(|l| l.host = "a b".into()),
            local(|l| l.stop_timeout_s = -1.0),
        ];
        for p in bad {
            assert!(validate(&p).is_err(), "{p:?}");
        }
        let observe = with(PlanParams { enabled: true, mode: PlanMode::ObserveOnly, ..d });
        assert_eq!(validate(&observe), Ok(()), "observing needs no connector");
    }
}
