//! Simulator configuration: the `vllm serve`-like command line, the `--kv-events-config` JSON
//! (same keys as vLLM's `KVEventsConfig`), the `--kv-transfer-config` JSON (same keys as vLLM's
//! `KVTransferConfig`), simulator knobs, and their validation.
//!
//! [`SimConfig`] is what the library takes; [`SimArgs`] is the CLI that produces one.

use crate::faults::FaultConfig;
use crate::lora::LoraModule;
use crate::timing::TimingModel;
use clap::Parser;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// vLLM's `KVEventsConfig`, parsed from `--kv-events-config '<JSON>'`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Master switch.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; derived from the switch when absent.
    pub publisher: Option<String>,
    /// PUB endpoint; binds when it contains `*` or `::` (or is `ipc://`/`inproc://`), else connects.
    pub endpoint: String,
    /// ROUTER endpoint for replay (always bound); `None` disables replay.
    pub replay_endpoint: Option<String>,
    /// Past batches kept for replay.
    pub buffer_steps: usize,
    /// PUB high-water mark (accepted for compatibility; the PUB socket drops for slow peers).
    pub hwm: usize,
    /// Queue in front of the publisher (batches beyond it are dropped and counted).
    pub max_queue_size: usize,
    /// First frame of every message.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Whether a ZMQ publisher should run.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref().unwrap_or("zmq") == "zmq"
    }
}

/// vLLM's `KVTransferConfig` (`vllm/config/kv_transfer.py`), parsed from
/// `--kv-transfer-config '<JSON>'`: every key vLLM 0.32 accepts, and, like vLLM's pydantic
/// config, nothing else. Only `NixlConnector` is simulated (pull mode, docs/vllm-sim-pd.md).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvTransferConfig {
    /// The connector; `"NixlConnector"` is the one simulated.
    pub kv_connector: Option<String>,
    /// This engine's id in transfers; vLLM draws a uuid when absent, and so does the sim.
    pub engine_id: Option<String>,
    /// Buffer device (accepted; nothing is buffered).
    pub kv_buffer_device: Option<String>,
    /// Buffer size in bytes (accepted for compatibility).
    pub kv_buffer_size: f64,
    /// `"kv_producer"`, `"kv_consumer"` or `"kv_both"`; required with a connector.
    pub kv_role: Option<String>,
    /// Rank in the transfer group (accepted for compatibility).
    pub kv_rank: Option<u64>,
    /// Instances in the transfer group (accepted for compatibility).
    pub kv_parallel_size: u64,
    /// Connector IP (accepted; the sim's side channel is its HTTP address).
    pub kv_ip: String,
    /// Connector port (accepted; the sim's side channel is its HTTP address).
    pub kv_port: u16,
    /// Connector options. The sim reads `kv_lease_duration` (seconds a prefill worker holds a
    /// finished request's blocks for the decode worker, vLLM's NIXL default 30).
    pub kv_connector_extra_config: serde_json::Map<String, serde_json::Value>,
    /// Python module of a custom connector (accepted; refused with a connector other than Nixl).
    pub kv_connector_module_path: Option<String>,
    /// Accepted for compatibility.
    pub enable_permute_local_kv: bool,
    /// What a decode worker does when pulling KV fails: `"recompute"` (the prompt is computed
    /// locally) or `"fail"` (the request errors).
    pub kv_load_failure_policy: String,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        Self {
            kv_connector: None,
            engine_id: None,
            kv_buffer_device: Some("cuda".into()),
            kv_buffer_size: 1e9,
            kv_role: None,
            kv_rank: None,
            kv_parallel_size: 1,
            kv_ip: "127.0.0.1".into(),
            kv_port: 14579,
            kv_connector_extra_config: serde_json::Map::new(),
            kv_connector_module_path: None,
            enable_permute_local_kv: false,
            kv_load_failure_policy: "recompute".into(),
        }
    }
}

/// vLLM NIXL's default lease on a prefill worker's held blocks, seconds.
pub const DEFAULT_KV_LEASE_SECS: f64 = 30.0;

impl KvTransferConfig {
    /// Parses the flag's JSON and checks it as vLLM does at start-up; an absent `engine_id`
    /// gets a fresh one, as vLLM's `__post_init__` gives it a uuid.
    pub fn parse(json: &str) -> Result<Self, String> {
        let mut c: Self = serde_json::from_str(json).map_err(|e| format!("--kv-transfer-config: {e}"))?;
        if c.engine_id.is_none() {
            c.engine_id = Some(crate::ids::random_uuid());
        }
        c.validate()?;
        Ok(c)
    }

    /// vLLM's checks (a known role, a role with a connector, a known failure policy), then
    /// the sim's: NixlConnector only, a usable lease.
    pub fn validate(&self) -> Result<(), String> {
        const ROLES: [&str; 3] = ["kv_producer", "kv_consumer", "kv_both"];
        if let Some(r) = &self.kv_role
            && !ROLES.contains(&r.as_str())
        {
            return Err(format!("--kv-transfer-config: Unsupported kv_role: {r}. Supported roles are {ROLES:?}"));
        }
        if self.kv_connector.is_some() && self.kv_role.is_none() {
            return Err(format!("--kv-transfer-config: Please specify kv_role when kv_connector is set, supported roles are {ROLES:?}"));
        }
        if !matches!(self.kv_load_failure_policy.as_str(), "recompute" | "fail") {
            return Err(format!("--kv-transfer-config: kv_load_failure_policy must be \"recompute\" or \"fail\", got {:?}", self.kv_load_failure_policy));
        }
        if let Some(c) = self.kv_connector.as_deref()
            && c != "NixlConnector"
        {
            return Err(format!("--kv-transfer-config: vllm-sim simulates only kv_connector \"NixlConnector\", got {c:?}"));
        }
        let lease = self.lease_secs()?;
        if !(lease.is_finite() && lease > 0.0) {
            return Err(format!("--kv-transfer-config: kv_connector_extra_config.kv_lease_duration must be a positive number of seconds, got {lease}"));
        }
        Ok(())
    }

    /// Whether a connector is configured (the engine takes part in P/D).
    pub fn enabled(&self) -> bool {
        self.kv_connector.is_some()
    }

    /// Whether this engine holds a prefill leg's blocks for a decode worker (vLLM's
    /// `is_kv_producer`: `kv_producer` or `kv_both`).
    pub fn is_producer(&self) -> bool {
        self.enabled() && matches!(self.kv_role.as_deref(), Some("kv_producer" | "kv_both"))
    }

    /// Whether this engine pulls a decode leg's prompt KV (vLLM's `is_kv_consumer`:
    /// `kv_consumer` or `kv_both`).
    pub fn is_consumer(&self) -> bool {
        self.enabled() && matches!(self.kv_role.as_deref(), Some("kv_consumer" | "kv_both"))
    }

    /// Whether a failed pull makes the request fail rather than recompute its prompt.
    pub fn fails_on_load_error(&self) -> bool {
        self.kv_load_failure_policy == "fail"
    }

    /// The lease on held blocks, seconds of simulated time (`kv_lease_duration`, default 30).
    pub fn lease_secs(&self) -> Result<f64, String> {
        match self.kv_connector_extra_config.get("kv_lease_duration") {
            None => Ok(DEFAULT_KV_LEASE_SECS),
            Some(v) => v.as_f64().ok_or_else(|| format!("--kv-transfer-config: kv_connector_extra_config.kv_lease_duration must be a number, got {v}")),
        }
    }

    /// The engine id (set by [`KvTransferConfig::parse`]; `"vllm-sim"` if built by hand without).
    pub fn engine_id(&self) -> &str {
        self.engine_id.as_deref().unwrap_or("vllm-sim")
    }
}

/// Everything needed to run one simulated vLLM server.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// HTTP listen address (port 0 = ephemeral).
    pub listen: SocketAddr,
    /// `--model`: the model path/name; also the first served name when none is given.
    pub model: String,
    /// Names accepted in the `model` field (first = reported).
    pub served_model_names: Vec<String>,
    /// Tokenizer directory or file; `None` = the built-in tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks per engine (including vLLM's reserved null block).
    pub num_gpu_blocks: usize,
    /// Running-batch cap.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Context limit.
    pub max_model_len: usize,
    /// Prefix caching.
    pub enable_prefix_caching: bool,
    /// KV event publishing.
    pub kv_events: KvEventsConfig,
    /// Prefill/decode disaggregation (`--kv-transfer-config`); the default has no connector.
    pub kv_transfer: KvTransferConfig,
    /// Events as tagged maps (vLLM ≥ 0.26) or positional arrays (older vLLM).
    pub kv_events_format: crate::events::EventFormat,
    /// Block hashes in events as 64-bit ints or 32-byte digests (vLLM's
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, read by [`SimArgs::into_config`]).
    pub kv_events_hash_format: crate::events::HashFormat,
    /// vLLM's `PYTHONHASHSEED`: the seed of every block-hash chain (`None`: vLLM's fixed
    /// `"vllm-none-hash"`), read by [`SimArgs::into_config`].
    pub python_hash_seed: Option<String>,
    /// Number of engines behind the one HTTP server (DP ranks).
    pub data_parallel_size: usize,
    /// Seed of token generation.
    pub seed: u64,
    /// Step-time model.
    pub timing: TimingModel,
    /// Simulated time runs this many times faster than wall time.
    pub time_scale: f64,
    /// Probability that a generated token is EOS (when EOS is allowed).
    pub eos_probability: f64,
    /// vLLM's `--max-num-queued-reqs`: waiting requests beyond this get HTTP 503.
    pub max_num_queued_reqs: Option<usize>,
    /// Echo `X-Request-Id` in responses (vLLM's `--enable-request-id-headers`).
    pub enable_request_id_headers: bool,
    /// Keep Responses API responses in memory (`store`, `previous_response_id`, `GET` and
    /// `cancel` of `/v1/responses/{id}`, `background`), as vLLM does with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`; read by [`SimArgs::into_config`].
    pub responses_store: bool,
    /// Serve LoRA adapters (`--enable-lora`).
    pub enable_lora: bool,
    /// Adapters loaded at start-up (`--lora-modules`).
    pub lora_modules: Vec<LoraModule>,
    /// Most adapters in one running batch (`--max-loras`, vLLM's default 1).
    pub max_loras: usize,
    /// `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist, as vLLM's
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING` makes them; read by [`SimArgs::into_config`].
    pub runtime_lora_updating: bool,
    /// vLLM's development endpoints exist (`/pause`, `/resume`, `/is_paused`, `/sleep`,
    /// `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`), as `VLLM_SERVER_DEV_MODE=1` makes
    /// them. On in the default configuration (the library's users are tests that drive them);
    /// the binary follows the variable or `--dev-mode` ([`SimArgs::into_config`]), off otherwise,
    /// like vLLM.
    pub dev_mode: bool,
    /// Failure injection.
    pub faults: FaultConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model: "sim-model".into(),
            served_model_names: Vec::new(),
            tokenizer: None,
            block_size: 16,
            num_gpu_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32_768,
            enable_prefix_caching: true,
            kv_events: KvEventsConfig::default(),
            kv_transfer: KvTransferConfig::default(),
            kv_events_format: crate::events::EventFormat::Map,
            kv_events_hash_format: crate::events::HashFormat::Int,
            python_hash_seed: None,
            data_parallel_size: 1,
            seed: 0,
            timing: TimingModel::default(),
            time_scale: 1.0,
            eos_probability: 0.0,
            max_num_queued_reqs: None,
            enable_request_id_headers: false,
            responses_store: false,
            enable_lora: false,
            lora_modules: Vec::new(),
            max_loras: 1,
            runtime_lora_updating: false,
            dev_mode: true,
            faults: FaultConfig::default(),
        }
    }
}

impl SimConfig {
    /// The model name reported in responses and metrics.
    pub fn model_name(&self) -> &str {
        self.served_model_names.first().map(String::as_str).unwrap_or(&self.model)
    }

    /// Checks the limits are consistent, as vLLM does at start-up.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |name: &str, v: usize| if v == 0 { Err(format!("{name} must be at least 1")) } else { Ok(()) };
        pos("--block-size", self.block_size)?;
        pos("--max-num-seqs", self.max_num_seqs)?;
        pos("--max-num-batched-tokens", self.max_num_batched_tokens)?;
        pos("--max-model-len", self.max_model_len)?;
        pos("--data-parallel-size", self.data_parallel_size)?;
        pos("--max-loras", self.max_loras)?;
        if !self.lora_modules.is_empty() && !self.enable_lora {
            return Err("--lora-modules: LoRA is not enabled. Use --enable-lora to enable LoRA.".into());
        }
        if self.num_gpu_blocks < 2 {
            return Err("--num-gpu-blocks-override must be at least 2 (block 0 is reserved)".into());
        }
        let capacity = (self.num_gpu_blocks - 1) * self.block_size;
        if self.max_model_len > capacity {
            return Err(format!(
                "The model's max seq len ({}) is larger than the maximum number of tokens that can be stored in KV cache ({capacity}). Increase --num-gpu-blocks-override or decrease --max-model-len.",
                self.max_model_len
            ));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(format!("--time-scale must be a positive number, got {}", self.time_scale));
        }
        if !(0.0..=1.0).contains(&self.eos_probability) {
            return Err(format!("--eos-probability must be within [0, 1], got {}", self.eos_probability));
        }
        self.timing.validate()?;
        self.faults.validate()?;
        self.kv_transfer.validate()?;
        if let Some(p) = self.kv_events.publisher.as_deref()
            && p != "zmq"
            && p != "null"
        {
            return Err(format!("kv-events-config: publisher must be \"zmq\" or \"null\", got {p:?}"));
        }
        Ok(())
    }
}

/// `vllm-sim` command line. Flags named like `vllm serve`'s keep their meaning.
#[derive(Debug, Parser)]
#[command(name = "vllm-sim", version, about = "A vLLM-faithful OpenAI server simulator")]
pub struct SimArgs {
    /// Model name or path (as `vllm serve MODEL`).
    #[arg(value_name = "MODEL")]
    pub model_pos: Option<String>,
    /// Model name or path.
    #[arg(long)]
    pub model: Option<String>,
    /// Names the API accepts for the model (default: the model).
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Host to bind.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// HTTP port (0 = ephemeral).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// HF tokenizer directory (tokenizer.json + tokenizer_config.json) or tokenizer.json file.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks_override: usize,
    /// Maximum running sequences per engine.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget per engine step.
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Maximum context length.
    #[arg(long, default_value_t = 32_768)]
    pub max_model_len: usize,
    /// Enable prefix caching (the default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Disable prefix caching.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Block hash algorithm. vllm-sim computes `sha256_cbor` only (vLLM's default `sha256`
    /// pickles Python objects and cannot be reproduced outside Python; the xxhash variants are
    /// not simulated), so the others are refused. Events carry 64-bit ints unless the
    /// environment has VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (32-byte digests); PYTHONHASHSEED
    /// seeds the chains, as in vLLM.
    #[arg(long, default_value = "sha256_cbor", value_parser = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])]
    pub prefix_caching_hash_algo: String,
    /// KV events config as JSON, with vLLM's keys.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// KV transfer config as JSON, with vLLM's keys (prefill/decode disaggregation), e.g.
    /// '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'; only NixlConnector is simulated.
    /// `kv_connector_extra_config.kv_lease_duration` (seconds, default 30) bounds how long a
    /// prefill worker holds blocks nobody pulls.
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// Engines (DP ranks) behind this server; rank r publishes on port + r.
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: usize,
    /// Seed of token generation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Waiting requests beyond this are refused with HTTP 503, as vLLM's admission control.
    #[arg(long)]
    pub max_num_queued_reqs: Option<usize>,
    /// Echo X-Request-Id in responses.
    #[arg(long)]
    pub enable_request_id_headers: bool,
    /// Keep Responses API responses in memory (`previous_response_id`, GET and cancel of
    /// `/v1/responses/{id}`, `background`); also on when the environment has
    /// VLLM_ENABLE_RESPONSES_API_STORE=1, vLLM's switch for it.
    #[arg(long)]
    pub enable_responses_store: bool,
    /// Serve LoRA adapters.
    #[arg(long)]
    pub enable_lora: bool,
    /// LoRA adapters to load at start-up: `name=path`, or JSON `{"name": …, "path": …,
    /// "base_model_name": …}`. The simulator reads no weights, but a path must be a directory
    /// holding an `adapter_config.json`, as vLLM requires.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Most LoRA adapters in one running batch.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Highest adapter rank (accepted for compatibility; no weights are simulated).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// [sim] Serve vLLM's development endpoints (/pause, /sleep, /reset_prefix_cache, …), as
    /// VLLM_SERVER_DEV_MODE=1 does (the environment variable is honoured too).
    #[arg(long)]
    pub dev_mode: bool,

    /// [sim] Run simulated time this many times faster than wall time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// [sim] Event encoding: `map` (vLLM ≥ 0.26) or `array` (older vLLM).
    #[arg(long, default_value = "map", value_parser = ["map", "array"])]
    pub kv_events_format: String,
    /// [sim] Probability that a generated token is EOS, when EOS is allowed.
    #[arg(long, default_value_t = 0.0)]
    pub eos_probability: f64,
    /// [sim] Fixed cost of a step, ms.
    #[arg(long)]
    pub step_overhead_ms: Option<f64>,
    /// [sim] Cost per prefill token, ms.
    #[arg(long)]
    pub prefill_ms_per_token: Option<f64>,
    /// [sim] Cost per (prefill token × attended token), ms.
    #[arg(long)]
    pub prefill_attn_ms_per_pair: Option<f64>,
    /// [sim] Cost per decoding sequence, ms.
    #[arg(long)]
    pub decode_ms_per_seq: Option<f64>,
    /// [sim] Cost per context token read while decoding, ms.
    #[arg(long)]
    pub decode_ms_per_ctx_token: Option<f64>,
    /// [sim] KV transfer time per token pulled from a prefill worker, ms (a block costs
    /// block_size times this).
    #[arg(long)]
    pub kv_transfer_ms_per_token: Option<f64>,

    /// [fault] Crash (close all connections, exit 1) after this many generated tokens.
    #[arg(long)]
    pub fail_crash_after_tokens: Option<u64>,
    /// [fault] Crash this many seconds after start.
    #[arg(long)]
    pub fail_crash_after_secs: Option<f64>,
    /// [fault] Fraction of inference requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_error_rate: f64,
    /// [fault] Extra delay before each request's first token, ms.
    #[arg(long, default_value_t = 0.0)]
    pub fail_first_token_delay_ms: f64,
    /// [fault] Fraction of inference requests that hang (never answered).
    #[arg(long, default_value_t = 0.0)]
    pub fail_hang_rate: f64,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `vllm_sim=debug`.
    #[arg(long, default_value = "info", env = "VLLM_SIM_LOG")]
    pub log: String,
    /// [sim] Once every socket is bound, write the addresses they got to this file as JSON
    /// (`{"url": "http://host:port", "kv_events": [...], "replay": [...]}`), so a caller that asked for
    /// port 0 learns the ports without guessing free ones beforehand.
    #[arg(long, value_name = "FILE")]
    pub ports_file: Option<PathBuf>,
}

impl SimArgs {
    /// Builds and validates the configuration, reading vLLM's environment variables
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, `PYTHONHASHSEED`,
    /// `VLLM_ENABLE_RESPONSES_API_STORE`) from the process.
    pub fn into_config(self) -> Result<SimConfig, String> {
        self.into_config_with_env(&|name| std::env::var(name).ok())
    }

    /// [`SimArgs::into_config`] with the environment given by `env`.
    pub fn into_config_with_env(self, env: &dyn Fn(&str) -> Option<String>) -> Result<SimConfig, String> {
        if self.prefix_caching_hash_algo != "sha256_cbor" {
            return Err(format!(
                "--prefix-caching-hash-algo {}: vllm-sim computes only sha256_cbor block hashes (the only algorithm a consumer outside Python can reproduce); use --prefix-caching-hash-algo sha256_cbor",
                self.prefix_caching_hash_algo
            ));
        }
        let kv_events_hash_format = crate::events::HashFormat::from_env_value(env(crate::events::HashFormat::ENV).as_deref())?;
        let responses_store =
            self.enable_responses_store || int_flag_env("VLLM_ENABLE_RESPONSES_API_STORE", env("VLLM_ENABLE_RESPONSES_API_STORE").as_deref())?;
        let dev_mode = self.dev_mode || int_flag_env("VLLM_SERVER_DEV_MODE", env("VLLM_SERVER_DEV_MODE").as_deref())?;
        // vLLM: `.strip().lower() in ("1", "true")`.
        let runtime_lora_updating = env("VLLM_ALLOW_RUNTIME_LORA_UPDATING").is_some_and(|v| matches!(v.trim().to_lowercase().as_str(), "1" | "true"));
        let lora_modules = crate::lora::parse_lora_modules(&self.lora_modules)?;
        let host: std::net::IpAddr = self.host.parse().map_err(|_| format!("--host: not an IP address: {}", self.host))?;
        let model = self.model.or(self.model_pos).unwrap_or_else(|| "sim-model".into());
        let kv_events = match &self.kv_events_config {
            None => KvEventsConfig::default(),
            Some(s) => serde_json::from_str(s).map_err(|e| format!("--kv-events-config: {e}"))?,
        };
        let kv_transfer = match &self.kv_transfer_config {
            None => KvTransferConfig::default(),
            Some(s) => KvTransferConfig::parse(s)?,
        };
        let mut timing = TimingModel::default();
        let overrides = [
            (&mut timing.step_overhead_ms, self.step_overhead_ms),
            (&mut timing.prefill_ms_per_token, self.prefill_ms_per_token),
            (&mut timing.prefill_attn_ms_per_pair, self.prefill_attn_ms_per_pair),
            (&mut timing.decode_ms_per_seq, self.decode_ms_per_seq),
            (&mut timing.decode_ms_per_ctx_token, self.decode_ms_per_ctx_token),
            (&mut timing.kv_transfer_ms_per_token, self.kv_transfer_ms_per_token),
        ];
        for (slot, v) in overrides {
            if let Some(v) = v {
                *slot = v;
            }
        }
        let cfg = SimConfig {
            listen: SocketAddr::new(host, self.port),
            model,
            served_model_names: self.served_model_name,
            tokenizer: self.tokenizer,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks_override,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching || self.enable_prefix_caching,
            kv_events,
            kv_transfer,
            kv_events_format: if self.kv_events_format == "array" { crate::events::EventFormat::Array } else { crate::events::EventFormat::Map },
            kv_events_hash_format,
            python_hash_seed: env("PYTHONHASHSEED"),
            data_parallel_size: self.data_parallel_size,
            seed: self.seed,
            timing,
            time_scale: self.time_scale,
            eos_probability: self.eos_probability,
            max_num_queued_reqs: self.max_num_queued_reqs,
            enable_request_id_headers: self.enable_request_id_headers,
            responses_store,
            enable_lora: self.enable_lora,
            lora_modules,
            max_loras: self.max_loras,
            runtime_lora_updating,
            dev_mode,
            faults: FaultConfig {
                crash_after_tokens: self.fail_crash_after_tokens,
                crash_after_secs: self.fail_crash_after_secs,
                error_rate: self.fail_error_rate,
                first_token_delay_ms: self.fail_first_token_delay_ms,
                hang_rate: self.fail_hang_rate,
                stall: false,
                drop_kv_batches: 0,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// vLLM reads `VLLM_ENABLE_RESPONSES_API_STORE` and `VLLM_SERVER_DEV_MODE` as
/// `bool(int(value))` (unset: off).
fn int_flag_env(name: &str, value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(false),
        Some(v) => v.parse::<i64>().map(|n| n != 0).map_err(|_| format!("{name}={v}: not an integer")),
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp, reason = "tests compare exact values, computed by the same arithmetic as their expectations")]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<SimConfig, String> {
        let mut v = vec!["vllm-sim"];
        v.extend_from_slice(args);
        SimArgs::try_parse_from(v).map_err(|e| e.to_string())?.into_config()
    }

    #[test]
    fn parses_vllm_style_flags() {
        let c = parse(&[
            "my/model",
            "--served-model-name",
            "a",
            "b",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv"}"#,
        ])
        .unwrap();
        assert_eq!(c.model, "my/model");
        assert_eq!(c.model_name(), "a");
        assert_eq!(c.block_size, 32);
        assert!(!c.enable_prefix_caching);
        assert!(c.kv_events.publishes());
        assert_eq!(c.kv_events.topic, "kv");
        assert_eq!(c.kv_events.buffer_steps, 10_000);
    }

    #[test]
    fn hash_settings_follow_vllms_flag_and_environment() {
        let with_env = |args: &[&str], vars: &[(&str, &str)]| {
            let mut v = vec!["vllm-sim"];
            v.extend_from_slice(args);
            let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            SimArgs::try_parse_from(v).map_err(|e| e.to_string())?.into_config_with_env(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let c = with_env(&[], &[]).unwrap();
        assert_eq!((c.kv_events_hash_format, c.python_hash_seed), (crate::events::HashFormat::Int, None));
        let c = with_env(&["--prefix-caching-hash-algo", "sha256_cbor"], &[("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0"), ("PYTHONHASHSEED", "0")]).unwrap();
        assert_eq!((c.kv_events_hash_format, c.python_hash_seed.as_deref()), (crate::events::HashFormat::Bytes, Some("0")));
        assert!(with_env(&[], &[("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")]).unwrap_err().contains("not an integer"));
        assert!(with_env(&["--prefix-caching-hash-algo", "sha256"], &[]).unwrap_err().contains("only sha256_cbor"));
        assert!(!with_env(&[], &[]).unwrap().responses_store);
        assert!(with_env(&[], &[("VLLM_ENABLE_RESPONSES_API_STORE", "1")]).unwrap().responses_store);
        assert!(!with_env(&[], &[("VLLM_ENABLE_RESPONSES_API_STORE", "0")]).unwrap().responses_store);
        assert!(with_env(&["--enable-responses-store"], &[]).unwrap().responses_store);
        assert!(with_env(&[], &[("VLLM_ENABLE_RESPONSES_API_STORE", "yes")]).unwrap_err().contains("not an integer"));
        assert!(with_env(&["--prefix-caching-hash-algo", "md5"], &[]).is_err());
    }

    #[test]
    fn lora_and_dev_settings_follow_vllms_flags_and_environment() {
        let with_env = |args: &[&str], vars: &[(&str, &str)]| {
            let mut v = vec!["vllm-sim"];
            v.extend_from_slice(args);
            let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            SimArgs::try_parse_from(v).map_err(|e| e.to_string())?.into_config_with_env(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        let c =
            with_env(&["--enable-lora", "--lora-modules", "a=/l/a", r#"{"name":"b","path":"/l/b","base_model_name":"m"}"#, "--max-loras", "2"], &[]).unwrap();
        assert_eq!(c.lora_modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!((c.max_loras, c.runtime_lora_updating, c.dev_mode), (2, false, false), "the binary serves no dev endpoints unless asked");
        assert!(with_env(&["--lora-modules", "a=/l/a"], &[]).unwrap_err().contains("--enable-lora"));
        assert!(with_env(&["--max-loras", "0"], &[]).is_err());
        assert!(with_env(&[], &[("VLLM_ALLOW_RUNTIME_LORA_UPDATING", " True ")]).unwrap().runtime_lora_updating);
        assert!(!with_env(&[], &[("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "yes")]).unwrap().runtime_lora_updating);
        assert!(with_env(&[], &[("VLLM_SERVER_DEV_MODE", "1")]).unwrap().dev_mode);
        assert!(!with_env(&[], &[("VLLM_SERVER_DEV_MODE", "0")]).unwrap().dev_mode);
        assert!(with_env(&["--dev-mode"], &[]).unwrap().dev_mode);
        assert!(with_env(&[], &[("VLLM_SERVER_DEV_MODE", "true")]).unwrap_err().contains("not an integer"));
        assert!(SimConfig::default().dev_mode, "in-process servers (tests) serve them");
    }

    #[test]
    fn kv_transfer_config_takes_vllms_keys() {
        let c = parse(&[
            "--kv-transfer-config",
            r#"{"kv_connector":"NixlConnector","engine_id":"p0","kv_role":"kv_producer","kv_buffer_device":"cuda","kv_port":14600,
                "kv_connector_extra_config":{"kv_lease_duration":5},"kv_load_failure_policy":"fail","kv_rank":0,"kv_parallel_size":2,
                "kv_ip":"10.0.0.1","kv_buffer_size":2e9,"kv_connector_module_path":null,"enable_permute_local_kv":false}"#,
            "--kv-transfer-ms-per-token",
            "0.01",
        ])
        .unwrap();
        let kv = &c.kv_transfer;
        assert_eq!((kv.engine_id(), kv.kv_port, kv.is_producer(), kv.is_consumer()), ("p0", 14600, true, false));
        assert_eq!((kv.lease_secs().unwrap(), kv.fails_on_load_error()), (5.0, true));
        assert_eq!(c.timing.kv_transfer_ms_per_token, 0.01);

        let both = parse(&["--kv-transfer-config", r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#]).unwrap().kv_transfer;
        assert!(both.is_producer() && both.is_consumer());
        assert_eq!((both.kv_port, both.lease_secs().unwrap(), both.fails_on_load_error()), (14579, 30.0, false));
        let id = both.engine_id();
        assert_eq!((id.len(), id.as_bytes()[14]), (36, b'4'), "a uuid4 when absent, as vLLM: {id}");
        assert_ne!(id, parse(&["--kv-transfer-config", r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#]).unwrap().kv_transfer.engine_id());

        let none = parse(&[]).unwrap().kv_transfer;
        assert!(!none.enabled() && !none.is_producer() && !none.is_consumer());
    }

    #[test]
    fn kv_transfer_config_refuses_what_vllm_refuses() {
        let err = |json: &str| parse(&["--kv-transfer-config", json]).unwrap_err();
        let e = err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_lease":3}"#);
        assert!(e.contains("--kv-transfer-config") && e.contains("unknown field `kv_lease`"), "{e}");
        assert!(err(r#"{"kv_connector":"NixlConnector"}"#).contains("Please specify kv_role"));
        assert!(err(r#"{"kv_connector":"NixlConnector","kv_role":"prefill"}"#).contains("Unsupported kv_role: prefill"));
        assert!(err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}"#).contains("kv_load_failure_policy"));
        assert!(err(r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#).contains("only kv_connector \"NixlConnector\""));
        assert!(
            err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"kv_lease_duration":0}}"#).contains("kv_lease_duration")
        );
        assert!(
            err(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"kv_lease_duration":"1"}}"#).contains("must be a number")
        );
        assert!(err("[1]").contains("--kv-transfer-config"));
        assert!(parse(&["--kv-transfer-ms-per-token=-1"]).unwrap_err().contains("kv_transfer_ms_per_token"));
    }

    #[test]
    fn rejects_inconsistent_limits_and_bad_json() {
        assert!(parse(&["--max-model-len", "100000", "--num-gpu-blocks-override", "10"]).unwrap_err().contains("KV cache"));
        assert!(parse(&["--kv-events-config", "{\"nope\":1}"]).unwrap_err().contains("unknown field"));
        assert!(parse(&["--time-scale", "0"]).is_err());
        assert!(parse(&["--fail-error-rate", "2"]).is_err());
    }
}
