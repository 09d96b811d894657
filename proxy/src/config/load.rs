//! Loading a configuration: YAML → [`Config`], with errors that name the file, line and
//! column; then `KVGATE_…` environment overrides; then cross-field validation.
//!
//! Environment overrides address a key by its path, upper-cased, segments joined by `__`, list
//! items by index: `KVGATE_LISTEN=0.0.0.0:8000`, `KVGATE_TIMEOUTS__CONNECT_MS=500`,
//! `KVGATE_MODELS__0__ROUTING__MODE=random`. Values are read as YAML scalars. Variables whose
//! first segment is not a top-level key (e.g. `KVGATE_LOG`) are not overrides.

use super::{Config, ModelConfig};
use serde_yaml::Value;
use std::fmt;
use std::path::Path;

/// Top-level keys an environment variable may override.
const TOP_LEVEL_KEYS: &[&str] = &[
    "listen",
    "admin_listen",
    "threads",
    "max_body_bytes",
    "timeouts",
    "retries",
    "health",
    "shutdown",
    "load",
    "passthrough",
    "responses",
    "migration",
    "rescheduling",
    "plugins",
    "tenants",
    "tracing",
    "models",
];

/// A configuration that cannot be used, with where the problem is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// File name (or `<env>` for an override).
    pub origin: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, "{}:{l}:{c}: {}", self.origin, self.message),
            (Some(l), None) => write!(f, "{}:{l}: {}", self.origin, self.message),
            _ => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Reads and validates a configuration file, applying the process's `KVGATE_…` overrides.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError { origin: origin.clone(), line: None, column: None, message: e.to_string() })?;
    load_str(&text, &origin, std::env::vars())
}

/// Parses and validates `text`; `env` supplies the override variables.
pub fn load_str(text: &str, origin: &str, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, ConfigError> {
    let err = |line: Option<usize>, column: Option<usize>, message: String| ConfigError { origin: origin.to_string(), line, column, message };
    let mut cfg: Config = serde_yaml::from_str(text).map_err(|e| {
        let loc = e.location();
        err(loc.as_ref().map(|l| l.line()), loc.as_ref().map(|l| l.column()), strip_location(&e.to_string()))
    })?;

    let env: Vec<(String, String)> = env.into_iter().collect();
    let env_all = env.clone();
    let token_var = env.iter().find(|(k, _)| k == "KVGATE_ADMIN_TOKEN").map(|(_, v)| v.clone());
    let overrides: Vec<(String, Vec<String>, String)> = env
        .into_iter()
        .filter_map(|(k, v)| {
            let path = k.strip_prefix("KVGATE_")?;
            let segs: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
            TOP_LEVEL_KEYS.contains(&segs[0].as_str()).then_some((k, segs, v))
        })
        .collect();
    if !overrides.is_empty() {
        let mut tree: Value = serde_yaml::from_str(text).map_err(|e| err(None, None, e.to_string()))?;
        for (var, segs, val) in &overrides {
            let scalar: Value = serde_yaml::from_str(val).unwrap_or_else(|_| Value::String(val.clone()));
            set_path(&mut tree, segs, scalar).map_err(|m| ConfigError {
                origin: format!("environment variable {var}"),
                line: None,
                column: None,
                message: m,
            })?;
        }
        cfg = serde_yaml::from_value(tree).map_err(|e| {
            let names: Vec<&str> = overrides.iter().map(|(k, _, _)| k.as_str()).collect();
            ConfigError { origin: format!("environment overrides ({})", names.join(", ")), line: None, column: None, message: strip_location(&e.to_string()) }
        })?;
    }
    validate(&cfg).map_err(|(msg, needle)| {
        let (line, column) = locate(text, &needle).map(|(l, c)| (Some(l), Some(c))).unwrap_or((None, None));
        err(line, column, msg)
    })?;
    cfg.admin_token = admin_token(&cfg, token_var.as_deref()).map_err(|(msg, from_file)| match from_file {
        true => {
            let (line, column) = locate(text, &("admin_token_file".to_string(), 1)).map(|(l, c)| (Some(l), Some(c))).unwrap_or((None, None));
            err(line, column, msg)
        }
        false => ConfigError { origin: "environment variable KVGATE_ADMIN_TOKEN".into(), line: None, column: None, message: msg },
    })?;
    if let Some(t) = cfg.tenants.as_mut() {
        t.load_keys(&env_all).map_err(|e| {
            let (line, column) = locate(text, &("tenants".to_string(), 1)).map(|(l, c)| (Some(l), Some(c))).unwrap_or((None, None));
            err(line, column, format!("tenants: {e}"))
        })?;
    }
    Ok(cfg)
}

/// The admin token: `KVGATE_ADMIN_TOKEN` when set, else `admin_token_file`'s contents. The
/// error says whether the file was at fault. The token itself is never put in a message.
fn admin_token(cfg: &Config, var: Option<&str>) -> Result<Option<super::AdminToken>, (String, bool)> {
    if let Some(v) = var {
        return super::AdminToken::new(v).map(Some).map_err(|e| (e, false));
    }
    let Some(path) = &cfg.admin_token_file else { return Ok(None) };
    let in_file = |e: String| (format!("admin_token_file {}: {e}", path.display()), true);
    let text = std::fs::read_to_string(path).map_err(|e| in_file(e.to_string()))?;
    super::AdminToken::new(&text).map(Some).map_err(in_file)
}

/// serde_yaml appends " at line L column C"; the location is reported separately.
/// Dynamo router flags with no kvgate equivalent, and why: an operator porting a Dynamo
/// configuration gets the reason instead of a bare "unknown field".
const DYNAMO_ONLY: &[(&str, &str)] = &[
    ("router_replica_sync", "kvgate runs one gateway per fleet; replicas of it do not share bookings"),
    ("router_durable_kv_events", "KV events come straight from vLLM over ZeroMQ (no JetStream); a restarted gateway rebuilds its index from vLLM's replay"),
    ("router_reset_states", "there is no JetStream state to reset: the index is rebuilt from vLLM's replay"),
    ("router_snapshot_threshold", "there is no JetStream stream to snapshot: the index is rebuilt from vLLM's replay"),
    ("router_event_threads", "the KV index is always concurrent (lock-free reads, one writer per event source)"),
];

fn strip_location(msg: &str) -> String {
    let msg = match msg.rfind(" at line ") {
        Some(i) => &msg[..i],
        None => msg,
    };
    let unknown = |flag: &str| msg.find(&format!("unknown field `{flag}`"));
    match DYNAMO_ONLY.iter().find_map(|(flag, why)| unknown(flag).map(|at| (at, flag, why))) {
        // Keep the key path serde put in front ("models[0].routing: ").
        Some((at, flag, why)) => format!("{}`{flag}` is a Dynamo option kvgate does not have: {why}", &msg[..at]),
        None => msg.to_string(),
    }
}

fn set_path(node: &mut Value, segs: &[String], val: Value) -> Result<(), String> {
    let Some((head, rest)) = segs.split_first() else {
        *node = val;
        return Ok(());
    };
    if node.is_null() {
        *node = Value::Mapping(Default::default());
    }
    match node {
        Value::Mapping(m) => {
            let child = m.entry(Value::String(head.clone())).or_insert(Value::Null);
            set_path(child, rest, val)
        }
        Value::Sequence(s) => {
            let i: usize = head.parse().map_err(|_| format!("{head:?} is not a list index"))?;
            let len = s.len();
            let child = s.get_mut(i).ok_or_else(|| format!("index {i} is out of range (the list has {len} items)"))?;
            set_path(child, rest, val)
        }
        _ => Err(format!("cannot set {head:?} inside a scalar value")),
    }
}

/// Finds the n-th occurrence (1-based in `needle.1`) of a text in the YAML, as line/column.
fn locate(text: &str, needle: &(String, usize)) -> Option<(usize, usize)> {
    let (pat, nth) = needle;
    let mut seen = 0;
    for (i, line) in text.lines().enumerate() {
        if let Some(col) = line.find(pat.as_str()) {
            seen += 1;
            if seen == *nth {
                return Some((i + 1, col + 1));
            }
        }
    }
    None
}

/// A failed check: its message and where to point at ([`at`]).
type Invalid = (String, (String, usize));

/// Cross-field checks. On failure: the message and a text to locate it by.
fn validate(cfg: &Config) -> Result<(), Invalid> {
    for (key, files) in [("tls", &cfg.tls), ("admin_tls", &cfg.admin_tls)] {
        if let Some(f) = files {
            crate::tls::read(f).map_err(|e| (format!("{key}: {e}"), at(key.into(), 1)))?;
        }
    }
    plugins(cfg)?;
    top_level(cfg)?;
    let mut names = std::collections::HashSet::new();
    for m in &cfg.models {
        if m.name.trim().is_empty() {
            return Err(("models: a model name must not be empty".into(), at("name:".into(), 1)));
        }
        if !names.insert(m.name.as_str()) {
            return Err((format!("models: duplicate model name {:?}", m.name), at(m.name.clone(), 2)));
        }
        model(cfg, m)?;
    }
    Ok(())
}

/// Where to point at: the `nth` line holding `pat`.
fn at(pat: String, nth: usize) -> (String, usize) {
    (pat, nth)
}

/// The plugins: names, digests and limits.
fn plugins(cfg: &Config) -> Result<(), Invalid> {
    for (i, p) in cfg.plugins.iter().enumerate() {
        let here = || at(format!("name: {}", p.name), 1);
        if p.name.is_empty() || !p.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err((format!("plugins: name {:?} must be letters, digits, '-' or '_'", p.name), here()));
        }
        if cfg.plugins[..i].iter().any(|q| q.name == p.name) {
            return Err((format!("plugins: duplicate name {:?}", p.name), at(format!("name: {}", p.name), 2)));
        }
        if let Some(sha) = &p.sha256
            && (sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err((format!("plugin {:?}: sha256 must be 64 hex digits", p.name), at("sha256".into(), 1)));
        }
        if !(1..=1000).contains(&p.timeout_ms) || !(1..=4096).contains(&p.memory_mib) {
            return Err((format!("plugin {:?}: timeout_ms must be within 1..=1000 and memory_mib within 1..=4096", p.name), here()));
        }
        if let Some(h) = p.headers.iter().find(|h| h.is_empty() || !h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')) {
            return Err((format!("plugin {:?}: header {h:?} must be a lower-case header name", p.name), at(h.clone(), 1)));
        }
    }
    Ok(())
}

/// The settings outside models.
fn top_level(cfg: &Config) -> Result<(), Invalid> {
    if cfg.models.is_empty() {
        return Err(("models: at least one model is required".into(), at("models".into(), 1)));
    }
    if cfg.listen == cfg.admin_listen && cfg.listen.port() != 0 {
        return Err((format!("admin_listen must differ from listen ({})", cfg.listen), at("admin_listen".into(), 1)));
    }
    if let Some(c) = &cfg.cluster {
        c.validate().map_err(|e| (format!("cluster: {e}"), at("cluster".into(), 1)))?;
    }
    if let Some(t) = &cfg.tenants {
        t.validate().map_err(|e| (format!("tenants: {e}"), at("tenants".into(), 1)))?;
    }
    if let Some(t) = &cfg.tracing {
        t.validate().map_err(|e| (format!("tracing: {e}"), at("tracing".into(), 1)))?;
    }
    if cfg.threads == 0 {
        return Err(("threads must be at least 1".into(), at("threads".into(), 1)));
    }
    if cfg.max_body_bytes.0 < 1024 {
        return Err(("max_body_bytes must be at least 1KiB".into(), at("max_body_bytes".into(), 1)));
    }
    if cfg.timeouts.upstream_read_idle_ms == 0 {
        return Err(("timeouts.upstream_read_idle_ms must be at least 1".into(), at("upstream_read_idle_ms".into(), 1)));
    }
    if cfg.timeouts.connect_ms == 0 {
        return Err(("timeouts.connect_ms must be at least 1".into(), at("connect_ms".into(), 1)));
    }
    if cfg.retries.max_attempts == 0 {
        return Err(("retries.max_attempts must be at least 1 (1 = no retry)".into(), at("max_attempts".into(), 1)));
    }
    cfg.rescheduling.validate().map_err(|m| (m, at("rescheduling".into(), 1)))?;
    if !(1..=100_000).contains(&cfg.migration.max_concurrent) {
        return Err(("migration.max_concurrent must be within 1..=100000".into(), at("max_concurrent".into(), 1)));
    }
    if cfg.max_connections == 0 {
        return Err(("max_connections must be at least 1".into(), at("max_connections".into(), 1)));
    }
    let h = &cfg.health;
    if h.interval_ms == 0 || h.timeout_ms == 0 || h.unhealthy_threshold == 0 || h.healthy_threshold == 0 {
        return Err(("health: interval_ms, timeout_ms and both thresholds must be at least 1".into(), at("health".into(), 1)));
    }
    if cfg.load.interval_ms == 0 || cfg.load.timeout_ms == 0 {
        return Err(("load.interval_ms and load.timeout_ms must be at least 1".into(), at("load".into(), 1)));
    }
    if !h.path.starts_with('/') {
        return Err((format!("health.path must start with '/', got {:?}", h.path), at("path".into(), 1)));
    }
    Ok(())
}

/// One model: its block size, shedding, routing and workers.
fn model(cfg: &Config, m: &ModelConfig) -> Result<(), Invalid> {
    if !(1..=1024).contains(&m.block_size) {
        return Err((format!("model {:?}: block_size must be within 1..=1024", m.name), at("block_size".into(), 1)));
    }
    m.shedding.thresholds.validate().map_err(|e| (format!("model {:?}: shedding: {e}", m.name), at("shedding".into(), 1)))?;
    m.disaggregation.validate().map_err(|e| (format!("model {:?}: disaggregation: {e}", m.name), at("disaggregation".into(), 1)))?;
    m.slo.validate().map_err(|e| (format!("model {:?}: slo: {e}", m.name), at("slo".into(), 1)))?;
    super::planner::validate(&m.planner).map_err(|e| (format!("model {:?}: planner: {e}", m.name), at("planner".into(), 1)))?;
    routing(cfg, m)?;
    workers(m)
}

/// A model's routing: weights, tree limits, plugin, events and queue.
fn routing(cfg: &Config, m: &ModelConfig) -> Result<(), Invalid> {
    let r = &m.routing;
    let non_negative = |v: f64| v.is_finite() && v >= 0.0;
    if !non_negative(r.overlap_score_weight) || !non_negative(r.temperature) {
        return Err((format!("model {:?}: routing.overlap_score_weight and temperature must be >= 0", m.name), at("routing".into(), 1)));
    }
    if !non_negative(r.tie_steps) {
        return Err((format!("model {:?}: routing.tie_steps must be a number >= 0", m.name), at("routing".into(), 1)));
    }
    if !non_negative(r.ttft_trade_ratio) || !non_negative(r.ttft_trade_floor_ms) {
        return Err((format!("model {:?}: routing.ttft_trade_ratio and ttft_trade_floor_ms must be numbers >= 0", m.name), at("routing".into(), 1)));
    }
    let ratio_ok = r.prune_target_ratio > 0.0 && r.prune_target_ratio <= 1.0;
    if r.ttl_secs.is_nan() || r.ttl_secs <= 0.0 || r.max_tree_size == 0 || !ratio_ok || r.max_prefix_blocks == 0 {
        return Err((
            format!("model {:?}: routing.ttl_secs, max_tree_size, max_prefix_blocks must be > 0 and prune_target_ratio within (0, 1]", m.name),
            at("routing".into(), 1),
        ));
    }
    use kvgate_filters::route::Mode;
    match (r.mode, &r.plugin) {
        (Mode::Plugin, None) => {
            return Err((format!("model {:?}: routing.mode plugin needs routing.plugin (the name of a plugins entry)", m.name), at("plugin".into(), 1)));
        }
        (Mode::Plugin, Some(p)) if !cfg.plugins.iter().any(|q| q.name == *p) => {
            let known: Vec<&str> = cfg.plugins.iter().map(|q| q.name.as_str()).collect();
            return Err((format!("model {:?}: routing.plugin {p:?} is not among the plugins ({})", m.name, known.join(", ")), at(format!("plugin: {p}"), 1)));
        }
        (Mode::Plugin, Some(_)) if r.fallback == Mode::Plugin => {
            return Err((format!("model {:?}: routing.fallback must be a built-in mode (kv, round_robin, random)", m.name), at("fallback".into(), 1)));
        }
        (mode, Some(_)) if mode != Mode::Plugin => {
            return Err((format!("model {:?}: routing.plugin is set but routing.mode is not plugin", m.name), at("plugin:".into(), 1)));
        }
        _ => {}
    }
    if r.builtin() == Mode::Kv && r.kv_events && m.workers.iter().any(|w| w.kv_events.is_none()) {
        return Err((
            format!(
                "model {:?}: routing.mode kv (or fallback kv) with kv_events: true needs a kv_events endpoint on every worker (or set kv_events: false for approximate mode)",
                m.name
            ),
            at("kv_events".into(), 1),
        ));
    }
    if r.queue_threshold.is_some_and(|q| !(q.is_finite() && q >= 0.0)) {
        return Err((format!("model {:?}: routing.queue_threshold must be 0 (no queue) or more", m.name), at("queue_threshold".into(), 1)));
    }
    if r.router_queue_threshold().is_some() && (r.queue_max_len == 0 || r.queue_max_wait_ms == 0) {
        return Err((
            format!(
                "model {:?}: routing.queue_max_len and queue_max_wait_ms must be at least 1 while the router queue is on (queue_threshold: 0 turns it off)",
                m.name
            ),
            at(if r.queue_max_len == 0 { "queue_max_len" } else { "queue_max_wait_ms" }.into(), 1),
        ));
    }
    Ok(())
}

/// A model's workers: how many ranks, no duplicates, each one's settings.
fn workers(m: &ModelConfig) -> Result<(), Invalid> {
    let slots: u32 = m.workers.iter().map(|w| w.dp_size).sum();
    if slots > 256 {
        return Err((format!("model {:?}: at most 256 worker DP ranks per model", m.name), at(m.name.clone(), 1)));
    }
    // A connector brings workers: the ones it starts, adopts or discovers.
    let planned = m.planner.rules.enabled && m.planner.connector.is_some();
    if m.workers.is_empty() && !planned {
        return Err((format!("model {:?}: at least one worker is required (or a planner with a connector to start them)", m.name), at(m.name.clone(), 1)));
    }
    if m.planner.rules.enabled && m.workers.iter().any(|w| w.role == super::Role::Prefill) {
        return Err((format!("model {:?}: the planner does not scale a disaggregated fleet (workers with role prefill) yet", m.name), at("planner".into(), 1)));
    }
    if !m.workers.is_empty() && !planned && m.workers.iter().all(|w| !w.role.answers()) {
        return Err((
            format!("model {:?}: every worker has role prefill; at least one decode (or both) worker must serve the answers", m.name),
            at("role".into(), 1),
        ));
    }
    let mut urls = std::collections::HashSet::new();
    for w in &m.workers {
        if !urls.insert(&w.url) {
            return Err((format!("model {:?}: duplicate worker {}", m.name, w.url), at(w.url.authority.clone(), 2)));
        }
        if !(1..=64).contains(&w.dp_size) {
            return Err((format!("worker {}: dp_size must be within 1..=64", w.url), at("dp_size".into(), 1)));
        }
        if w.name.as_ref().is_some_and(|n| n.is_empty() || n.len() > 128 || !n.bytes().all(|b| b.is_ascii_graphic())) {
            return Err((format!("worker {}: name must be 1 to 128 visible ASCII characters (it goes into a response header)", w.url), at("name".into(), 1)));
        }
        match (&w.replay, &w.kv_events) {
            (Some(_), None) => return Err((format!("worker {}: replay needs kv_events", w.url), at("replay".into(), 1))),
            (Some(_), Some(super::KvEvents::Auto)) => {
                return Err((
                    format!("worker {}: with kv_events: auto the replay endpoint comes from the worker's /kv_event_sources", w.url),
                    at("replay".into(), 1),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
