//! The gateway's YAML configuration: types with their defaults (this file), validating value
//! types (`values`), and loading with line/column errors and `KVGATE_…` overrides (`load`).
//!
//! Every key is documented in conf/kvgate.yaml. Unknown keys are errors.

mod admin_token;
pub mod cluster;
mod disaggregation;
pub mod load;
mod passthrough;
mod planner;
mod plugin;
mod rescheduling;
pub mod tenants;
pub mod tracing;
mod values;

pub use admin_token::AdminToken;
pub use disaggregation::{Disaggregation, Role};
pub use passthrough::{Passthrough, PathPattern};
pub use planner::{ConnectorConfig, DrainMode, KubernetesConnector, LocalConnector, PlanMode, PlanParams, Planner, WorkloadKind};
pub use plugin::PluginConfig;
pub use rescheduling::{LoadMetric, Rescheduling};
pub use values::{ByteSize, KvEvents, UpstreamUrl, ZmqEndpoint};

use kvgate_filters::route::Mode;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// A listener's certificate chain and private key (PEM files).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// How many inference requests one client may have in the gateway at once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerClient {
    /// The most at once; one more gets 429 with `Retry-After: 1`. 0 (default): no limit.
    #[serde(default)]
    pub max_concurrent: u32,
    /// A request header that tells clients apart (an API key, e.g. `authorization`); a request
    /// without it counts by address. Unset (default): clients are told apart by IP address.
    #[serde(default)]
    pub header: Option<String>,
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where clients connect (OpenAI API).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Admin endpoints (`/metrics`, `/workers`, `/reload`, …); loopback by default.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    /// A file holding the bearer token every admin endpoint but `/metrics` and `/health`
    /// requires (`KVGATE_ADMIN_TOKEN` gives it too, and wins). Unset: no token.
    #[serde(default)]
    pub admin_token_file: Option<PathBuf>,
    /// The token itself, read from `admin_token_file` or `KVGATE_ADMIN_TOKEN` at load.
    #[serde(skip)]
    pub admin_token: Option<AdminToken>,
    /// TLS on the public listener: PEM certificate chain and key, re-read without a restart
    /// when they change (docs/hardening.md, "TLS"). Unset: plain HTTP.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// TLS on the admin listener, the same way.
    #[serde(default)]
    pub admin_tls: Option<TlsFiles>,
    /// Client connections open at once on each listener; the next one is closed at once
    /// (`kvgate_refused_connections_total{reason="max_connections"}`).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Concurrent inference requests per client (off by default).
    #[serde(default)]
    pub per_client: PerClient,
    /// What the `x-kvgate-worker` response header shows: the worker's `name` (default), its
    /// `url`, or nothing (`off`).
    #[serde(default)]
    pub worker_header: WorkerHeader,
    /// Worker threads of the proxy service.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Largest request body accepted (413 above).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: ByteSize,
    /// Timeouts.
    #[serde(default)]
    pub timeouts: Timeouts,
    /// Retries before the first response byte.
    #[serde(default)]
    pub retries: Retries,
    /// Moving running streams to another worker (failover, admin moves).
    #[serde(default)]
    pub migration: Migration,
    /// The rescheduler (Llumnix's): moves running and waiting requests between workers.
    #[serde(default)]
    pub rescheduling: Rescheduling,
    /// Active health checks.
    #[serde(default)]
    pub health: HealthCheck,
    /// Graceful shutdown.
    #[serde(default)]
    pub shutdown: Shutdown,
    /// Polling of the workers' own load (`/metrics`).
    #[serde(default)]
    pub load: LoadPolling,
    /// Paths outside the gateway's catalogue, forwarded unchanged (docs/endpoints.md).
    #[serde(default)]
    pub passthrough: Passthrough,
    /// The Responses API's stored responses (which worker holds each).
    #[serde(default)]
    pub responses: ResponsesApi,
    /// Replicas of one deployment acting as one router over NATS (docs/replicas.md); read at
    /// start. Unset: this gateway runs alone.
    #[serde(default)]
    pub cluster: Option<cluster::Cluster>,
    /// Tenants: client API keys, their limits and their share of the router queue
    /// (docs/tenants.md). Unset: no key is read and nothing is limited per tenant.
    #[serde(default)]
    pub tenants: Option<tenants::Tenants>,
    /// OpenTelemetry traces of requests, exported over OTLP/HTTP (docs/operations.md). Unset:
    /// no spans.
    #[serde(default)]
    pub tracing: Option<tracing::Tracing>,
    /// WebAssembly routing policies models may use (`routing.mode: plugin`).
    #[serde(default)]
    pub plugins: Vec<PluginConfig>,
    /// Served models and their workers.
    pub models: Vec<ModelConfig>,
}

/// Timeouts, in milliseconds.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect to a worker.
    pub connect_ms: u64,
    /// How long an idle pooled upstream connection is kept. Keep it below the workers'
    /// keep-alive (uvicorn: 5 s) so a reused connection is never already closed.
    pub upstream_idle_ms: u64,
    /// How long a client's kept-alive connection may wait idle for its next request (whole
    /// seconds, rounded up): without it an idle HTTP/1.1 connection would be held forever.
    pub client_idle_ms: u64,
    /// How long a client may take to send its request body.
    pub request_body_ms: u64,
    /// How long a client may go without accepting any of a response's bytes before it is taken
    /// as gone (its request cancelled, as on a disconnect); at least a second.
    pub client_write_ms: u64,
    /// Upper bound on the wait for a worker's response header and first body byte (0 = none:
    /// long prefills are legitimate). On expiry: 504, or a retry elsewhere if the header came.
    pub first_byte_ms: u64,
    /// Longest silence between two body chunks of a worker's response (a stalled worker):
    /// the response is cut. The wait for the first byte is `first_byte_ms`'s.
    pub upstream_read_idle_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect_ms: 2_000,
            upstream_idle_ms: 4_000,
            client_idle_ms: 60_000,
            request_body_ms: 30_000,
            client_write_ms: 60_000,
            first_byte_ms: 0,
            upstream_read_idle_ms: 300_000,
        }
    }
}

/// Retries on another worker, only before anything was sent to the client.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retries {
    /// Total attempts per request (1 = no retry).
    pub max_attempts: u32,
    /// Retry when a worker answers 5xx before any byte reached the client.
    pub on_5xx: bool,
}

impl Default for Retries {
    fn default() -> Self {
        Self { max_attempts: 3, on_5xx: true }
    }
}

/// Moving a running stream to another worker by continuation (docs/migration.md).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Migration {
    /// Moves allowed per request (Dynamo's `migration_limit`); 0 turns migration and
    /// mid-stream failover off.
    #[serde(alias = "migration_limit")]
    pub limit: u32,
    /// Moves in progress at once across the gateway (read at start); more wait their turn.
    pub max_concurrent: usize,
}

impl Default for Migration {
    fn default() -> Self {
        Self { limit: 3, max_concurrent: 64 }
    }
}

/// Active health checking of every worker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheck {
    /// Path polled with GET.
    pub path: String,
    /// Poll period.
    pub interval_ms: u64,
    /// Per-poll timeout.
    pub timeout_ms: u64,
    /// Consecutive failures that mark a worker unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive successes that mark it healthy again.
    pub healthy_threshold: u32,
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self { path: "/health".into(), interval_ms: 1_000, timeout_ms: 1_000, unhealthy_threshold: 2, healthy_threshold: 1 }
    }
}

/// SIGTERM behaviour.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Shutdown {
    /// How long in-flight requests (streams) may run after SIGTERM before the process exits.
    pub drain_timeout_s: u64,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self { drain_timeout_s: 300 }
    }
}

/// How often the workers' `/metrics` are read (KV usage, waiting requests, KV capacity).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoadPolling {
    /// Poll period.
    pub interval_ms: u64,
    /// Per-poll timeout.
    pub timeout_ms: u64,
}

impl Default for LoadPolling {
    fn default() -> Self {
        Self { interval_ms: 500, timeout_ms: 500 }
    }
}

/// The router queue's threshold in kv mode when none is configured. A worker with more than
/// one engine step of prefill booked and not yet answering has a prompt in its prefill now, and
/// a newcomer sent there either fills that prompt's last step or waits behind it; holding the
/// newcomer while every worker is so, and sending it where a prefill ends first, keeps the
/// long prompts' first tokens off that extra step at little cost to the decodes.
pub const DEFAULT_KV_QUEUE_THRESHOLD: f64 = 1.25;

/// Load shedding of a model (Dynamo's request rejection): thresholds, and the workers' prefill
/// budget for the fractional threshold.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Shedding {
    /// Busy thresholds (any crossed → busy; all workers busy → 503).
    #[serde(flatten)]
    pub thresholds: kvgate_filters::shed::Thresholds,
    /// The workers' `--max-num-batched-tokens`, for `active_prefill_tokens_threshold_frac`
    /// (vLLM does not publish it).
    pub max_num_batched_tokens: Option<u64>,
}

impl Shedding {
    /// The workers' prefill tokens per engine step: `max_num_batched_tokens`, else vLLM's
    /// default ([`kvgate_filters::route::time::DEFAULT_CHUNK_TOKENS`]).
    pub fn prefill_budget(&self) -> u64 {
        self.max_num_batched_tokens.unwrap_or(kvgate_filters::route::time::DEFAULT_CHUNK_TOKENS)
    }
}

/// The Responses API: a stored response lives on the worker that made it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesApi {
    /// How many response ids the gateway remembers the worker of (the oldest are forgotten
    /// first); read at start.
    pub remembered_ids: usize,
}

impl Default for ResponsesApi {
    fn default() -> Self {
        Self { remembered_ids: 100_000 }
    }
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients put in `model`.
    pub name: String,
    /// HF tokenizer directory (tokenizer.json + tokenizer_config.json), for KV routing;
    /// `builtin` is the small tokenizer shipped with kvgate (vllm-sim's).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block; must equal the workers' `--block-size`.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// How a worker is chosen.
    #[serde(default)]
    pub routing: Routing,
    /// When workers are too busy for new requests.
    #[serde(default)]
    pub shedding: Shedding,
    /// Scaling its fleet (Dynamo's planner).
    #[serde(default)]
    pub planner: Planner,
    /// Prefill/decode disaggregation, for a model with `role: prefill` workers.
    #[serde(default)]
    pub disaggregation: Disaggregation,
    /// Latency objectives (`ttft_ms`, `tpot_ms`) the `time` cost routes to meet; a request's
    /// `x-slo-ttft-ms` / `x-slo-tpot-ms` headers override them.
    #[serde(default)]
    pub slo: kvgate_filters::route::Slo,
    /// The vLLM servers serving it.
    pub workers: Vec<WorkerConfig>,
}

/// Routing section of a model. Dynamo's `--router-*` flag names are accepted as aliases.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Routing {
    /// `kv`, `round_robin`, `random` or `plugin`.
    #[serde(alias = "router_mode")]
    pub mode: Mode,
    /// plugin: the name of a `plugins` entry that decides.
    pub plugin: Option<String>,
    /// plugin: the built-in mode used when the plugin fails or has no opinion (`kv` also gives
    /// the plugin each worker's cache overlap).
    pub fallback: Mode,
    /// kv: the cost minimized: `time` (predicted time to first token, calibrated per worker)
    /// or `blocks` (Dynamo's `overlap_score_weight · prefill_blocks + decode_blocks`).
    pub cost: kvgate_filters::route::Cost,
    /// kv, `time` cost: a prefix being computed on a worker for a request in flight counts as
    /// cached there.
    pub credit_in_flight_prefix: bool,
    /// kv, `time` cost: add the stall a prefill causes the decodes running on the worker.
    pub price_slowdown: bool,
    /// kv, `time` cost: add the delay a prefill causes the requests that queue behind it.
    pub price_queue: bool,
    /// kv, `time` cost: add the prefill of a second copy of a prefix another worker holds
    /// (what the fleet's caches lose to the copy).
    pub price_duplicates: bool,
    /// kv, `time` cost: add the request's own decode there and the step time it adds to the
    /// requests decoding there (by its expected output length).
    pub price_decode: bool,
    /// kv, `time` cost: weigh the stall by how busy prefill keeps the worker against the
    /// fleet's mean.
    pub price_stall_share: bool,
    /// kv, `time` cost: price the stall in the stalled requests' end to end as well.
    pub price_stall_e2e: bool,
    /// kv, `time` cost: price the delay to the first token queued ahead by the room left in
    /// that one's last engine step, which the request's first chunk fills.
    pub price_shared_step: bool,
    /// kv, `time` cost: send each worker one long streamed prompt at a time, holding the next
    /// at the gateway until the one ahead has begun its last engine step or produced its first
    /// token.
    pub prefill_gate: bool,
    /// kv, `time` cost: the most predicted time to first token a request gives up for the
    /// time it saves others, as a share of the least among the workers (0: no bound).
    pub ttft_trade_ratio: f64,
    /// kv, `time` cost: the bound's least slack, ms.
    pub ttft_trade_floor_ms: f64,
    /// kv, `time` cost: costs at most this many times the cheapest worker's decode step above
    /// the least are equal; the fewest requests in flight decides among them.
    pub tie_steps: f64,
    /// kv, `blocks` cost: weight of the prefill term; 0 = ignore the cache (pure load
    /// balancing).
    #[serde(alias = "router_kv_overlap_score_weight", alias = "kv_overlap_score_weight")]
    pub overlap_score_weight: f64,
    /// kv: softmax temperature over costs; 0 = always the cheapest worker.
    #[serde(alias = "router_temperature")]
    pub temperature: f64,
    /// kv: follow workers' KV events (`true`), or predict caches from routing decisions
    /// (`false`, approximate mode; no `kv_events` endpoints needed).
    #[serde(alias = "router_kv_events")]
    pub kv_events: bool,
    /// kv: requests sharing a prefix on one worker share its KV blocks (count them once).
    #[serde(alias = "router_assume_kv_reuse")]
    pub assume_kv_reuse: bool,
    /// kv: count the decode load of requests in flight (`false` for prefill-only workers).
    #[serde(alias = "router_track_active_blocks")]
    pub track_active_blocks: bool,
    /// kv: book the KV blocks a streamed response fills as tokens arrive, weighted down toward
    /// the client's expected length (`nvext.agent_hints.osl`).
    #[serde(alias = "router_track_output_blocks")]
    pub track_output_blocks: bool,
    /// kv, approximate mode: how long a routing decision is believed, seconds.
    #[serde(alias = "router_ttl_secs")]
    pub ttl_secs: f64,
    /// kv, approximate mode: most blocks kept before pruning.
    #[serde(alias = "router_max_tree_size")]
    pub max_tree_size: usize,
    /// kv, approximate mode: prune down to this fraction of `max_tree_size`.
    #[serde(alias = "router_prune_target_ratio")]
    pub prune_target_ratio: f64,
    /// kv: hash at most this many leading blocks of a prompt (longer prompts route on their
    /// prefix; matching beyond it rarely changes the choice).
    pub max_prefix_blocks: usize,
    /// Hold requests while every worker's booked prefill exceeds this fraction of its
    /// prefill budget ([`Shedding::prefill_budget`]); 0 = no queue; unset = the mode's default
    /// ([`Routing::router_queue_threshold`]).
    #[serde(alias = "router_queue_threshold")]
    pub queue_threshold: Option<f64>,
    /// Most requests held; beyond it new ones get 429.
    pub queue_max_len: usize,
    /// Longest a request is held before it gets 503, ms.
    pub queue_max_wait_ms: u64,
    /// kv: bookings older than this no longer count as load (a safety net against requests
    /// that never end and leaked bookings), seconds.
    pub booking_max_age_s: u64,
}

impl Routing {
    /// The built-in mode behind this section: `mode`, or `fallback` when a plugin decides.
    pub fn builtin(&self) -> Mode {
        if self.mode == Mode::Plugin { self.fallback } else { self.mode }
    }

    /// The router queue's threshold in effect: the configured one (none at 0), else
    /// [`DEFAULT_KV_QUEUE_THRESHOLD`] in kv mode and none in the others, which place requests
    /// without reading load and so could not send a released request where room freed.
    pub fn router_queue_threshold(&self) -> Option<f64> {
        match self.queue_threshold {
            Some(q) => (q > 0.0).then_some(q),
            None => (self.mode == Mode::Kv).then_some(DEFAULT_KV_QUEUE_THRESHOLD),
        }
    }

    /// kv: whether the cost reads the workers' KV caches (the `blocks` cost at weight 0 does
    /// not, so it needs no event subscribers).
    pub fn uses_cache(&self) -> bool {
        self.cost == kvgate_filters::route::Cost::Time || self.overlap_score_weight > 0.0
    }
}

impl Default for Routing {
    fn default() -> Self {
        // The time cost's terms default as the filter's own defaults say.
        let pricing = kvgate_filters::route::time::Pricing::default();
        Self {
            mode: Mode::RoundRobin,
            plugin: None,
            fallback: Mode::RoundRobin,
            cost: kvgate_filters::route::Cost::Time,
            credit_in_flight_prefix: pricing.credit_booked,
            price_slowdown: pricing.slowdown,
            price_queue: pricing.queue,
            price_duplicates: pricing.duplicates,
            price_decode: pricing.decode,
            price_stall_share: pricing.stall_share,
            price_stall_e2e: pricing.stall_e2e,
            price_shared_step: pricing.shared_step,
            prefill_gate: false,
            ttft_trade_ratio: kvgate_filters::route::KvParams::default().ttft_trade_ratio,
            ttft_trade_floor_ms: kvgate_filters::route::KvParams::default().ttft_trade_floor_ms,
            tie_steps: kvgate_filters::route::KvParams::default().tie_steps,
            overlap_score_weight: 1.0,
            temperature: 0.0,
            kv_events: true,
            assume_kv_reuse: true,
            track_active_blocks: true,
            track_output_blocks: false,
            ttl_secs: 120.0,
            max_tree_size: 1 << 20,
            prune_target_ratio: 0.8,
            max_prefix_blocks: 4096,
            queue_threshold: None,
            queue_max_len: 1024,
            queue_max_wait_ms: 30_000,
            booking_max_age_s: 600,
        }
    }
}

/// One vLLM server.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL, `http://host:port`.
    pub url: UpstreamUrl,
    /// Its KV events PUB endpoint (`tcp://host:port`), or `auto` (read from its
    /// `GET /kv_event_sources`), if it publishes events.
    #[serde(default)]
    pub kv_events: Option<KvEvents>,
    /// Its KV events replay ROUTER endpoint.
    #[serde(default)]
    pub replay: Option<ZmqEndpoint>,
    /// Data-parallel ranks behind this URL (rank r publishes on port + r).
    #[serde(default = "default_dp_size")]
    pub dp_size: u32,
    /// Its node (the rescheduler's failure domain `node`).
    #[serde(default)]
    pub node: Option<String>,
    /// Its unit (the rescheduler's scope `unit` and failure domains `*-unit`).
    #[serde(default)]
    pub unit: Option<String>,
    /// Its name in the `x-kvgate-worker` response header (`worker_header: name`). Default: the
    /// planner's name for a worker it started, else `w-` and a hash of the URL.
    #[serde(default)]
    pub name: Option<String>,
    /// `prefill`, `decode` or `both` (prefill/decode disaggregation; docs/disaggregation.md).
    #[serde(default)]
    pub role: Role,
    /// Where it came from: the file, or added at run time (never read from the file).
    #[serde(skip)]
    pub origin: Origin,
}

impl WorkerConfig {
    /// Its name in the `x-kvgate-worker` header: `name`, the name its origin gives it, or `w-`
    /// and 8 hex digits of a hash of its URL (stable, and no address in it).
    pub fn shown_name(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        match &self.origin {
            Origin::Planner(n) | Origin::Kubernetes(n) => n.clone(),
            Origin::Config => {
                // FNV-1a: the same name on every gateway and restart.
                let h = self.url.to_string().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
                format!("w-{:08x}", h >> 32)
            }
        }
    }

    /// A worker added at run time at `url`, with its KV events found through the worker.
    pub fn added(url: UpstreamUrl, kv_events: bool, origin: Origin) -> Self {
        Self { url, kv_events: kv_events.then_some(KvEvents::Auto), replay: None, dp_size: 1, node: None, unit: None, name: None, role: Role::Both, origin }
    }
}

/// What the `x-kvgate-worker` response header shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerHeader {
    /// The worker's name: its `name`, or a name made from its URL that does not show it.
    #[default]
    Name,
    /// Its URL (an internal address: for a private deployment).
    Url,
    /// No header.
    Off,
}

/// Where a worker came from (`GET /workers` shows it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Origin {
    /// The config file.
    #[default]
    Config,
    /// Started by the model's planner through its local connector; the connector's name for it.
    Planner(String),
    /// Found in the EndpointSlices of the model's kubernetes connector; its pod.
    Kubernetes(String),
}

impl Origin {
    /// As `GET /workers` shows it.
    pub fn label(&self) -> String {
        match self {
            Self::Config => "config".into(),
            Self::Planner(name) => format!("planner:{name}"),
            Self::Kubernetes(pod) => format!("kubernetes:{pod}"),
        }
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
fn default_max_connections() -> usize {
    10_000
}
fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2)
}
fn default_max_body() -> ByteSize {
    ByteSize(32 * 1024 * 1024)
}
fn default_block_size() -> u32 {
    16
}
fn default_dp_size() -> u32 {
    1
}

impl Config {
    /// The model named `name`.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }
}
