//! Starting and stopping a simulated server: tokenizer, engines (one per DP rank) with their
//! publishers, the HTTP listener, and the stop switch every connection watches.
//!
//! Each accepted connection is served by hyper's HTTP/1 server inside a `select!` with the stop
//! token, so a crash (failure injection) or a shutdown closes every socket at once, and a
//! client that disconnects makes hyper drop the handler, which aborts its requests.

use crate::api::{AppState, router};
use crate::config::SimConfig;
use crate::engine::{self, EngineHandle, EngineParams};
use crate::faults::Faults;
use crate::metrics::CacheInfo;
use crate::sampler::Sampler;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::tokenizer::ModelTokenizer;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Errors starting a server.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A socket could not be bound.
    #[error("{0}")]
    Bind(String),
}

/// A running simulated vLLM server.
pub struct SimServer {
    state: Arc<AppState>,
    stop: CancellationToken,
    accept: JoinHandle<()>,
}

impl SimServer {
    /// Starts a server (binding its HTTP and ZMQ sockets before returning).
    pub async fn start(cfg: SimConfig) -> Result<Self, SimError> {
        cfg.validate().map_err(SimError::Config)?;
        let tokenizer = match cfg.tokenizer.clone() {
            None => tokio::task::spawn_blocking(ModelTokenizer::builtin).await.map_err(|e| SimError::Config(e.to_string()))?,
            Some(p) => tokio::task::spawn_blocking(move || ModelTokenizer::load(&p)).await.map_err(|e| SimError::Config(e.to_string()))??,
        };
        let stop = CancellationToken::new();
        let faults = Arc::new(Faults::new(cfg.faults.clone(), cfg.seed, stop.clone()));
        let listener = TcpListener::bind(cfg.listen).await.map_err(|e| SimError::Bind(format!("cannot bind HTTP {}: {e}", cfg.listen)))?;
        let listen = listener.local_addr().map_err(|e| SimError::Bind(e.to_string()))?;

        let sched_cfg = SchedulerConfig {
            block_size: cfg.block_size,
            num_gpu_blocks: cfg.num_gpu_blocks,
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_model_len: cfg.max_model_len,
            enable_prefix_caching: cfg.enable_prefix_caching,
            hash_root: crate::block_hash::root_hash(cfg.python_hash_seed.as_deref()),
            max_loras: cfg.max_loras,
        };
        let mut engines: Vec<Arc<EngineHandle>> = Vec::with_capacity(cfg.data_parallel_size);
        for rank in 0..cfg.data_parallel_size as u32 {
            let publisher = if cfg.kv_events.publishes() {
                Some(
                    crate::publisher::start(&cfg.kv_events, rank, cfg.kv_events_format, cfg.kv_events_hash_format, faults.clone(), stop.clone())
                        .await
                        .map_err(SimError::Bind)?,
                )
            } else {
                None
            };
            let sampler = Sampler::new(tokenizer.output_vocab(), tokenizer.eos_id(), cfg.eos_probability);
            let kv = engine::KvParams {
                block_size: cfg.block_size,
                lease_secs: cfg.kv_transfer.lease_secs().map_err(SimError::Config)?,
                fail_on_load_error: cfg.kv_transfer.fails_on_load_error(),
            };
            let params = EngineParams { timing: cfg.timing, time_scale: cfg.time_scale, faults: faults.clone(), stop: stop.clone(), kv };
            engines.push(engine::spawn(Scheduler::new(sched_cfg, sampler), rank, publisher, params));
        }
        if let Some(secs) = cfg.faults.crash_after_secs {
            let f = faults.clone();
            let s = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs_f64(secs)) => f.crash_now(),
                    _ = s.cancelled() => {}
                }
            });
        }
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let state = Arc::new(AppState {
            cache_info: CacheInfo { block_size: cfg.block_size, num_gpu_blocks: cfg.num_gpu_blocks, enable_prefix_caching: cfg.enable_prefix_caching },
            cfg,
            tokenizer,
            engines,
            faults,
            created,
            listen,
            messages_options: Default::default(),
            response_store: Default::default(),
            loras: Default::default(),
            sleep: Default::default(),
        });
        // vLLM loads `--lora-modules` before serving and refuses to start when one fails.
        for m in &state.cfg.lora_modules {
            let req = crate::api::adapters::LoadRequest { lora_name: m.name.clone(), lora_path: m.path.clone(), load_inplace: false };
            if let Err(e) = state.load_lora(&req, m.base_model_name.as_deref()) {
                stop.cancel();
                return Err(SimError::Config(e.message));
            }
        }
        let accept = tokio::spawn(accept_loop(listener, router(state.clone()), stop.clone()));
        tracing::info!(addr = %listen, model = state.cfg.model_name(), dp = state.engines.len(), "vllm-sim listening");
        Ok(Self { state, stop, accept })
    }

    /// The bound HTTP address.
    pub fn addr(&self) -> SocketAddr {
        self.state.listen
    }

    /// `http://host:port` (loopback when bound to all interfaces).
    pub fn url(&self) -> String {
        let a = self.addr();
        if a.ip().is_unspecified() { format!("http://127.0.0.1:{}", a.port()) } else { format!("http://{a}") }
    }

    /// KV event PUB endpoint per DP rank (empty when events are off).
    pub fn kv_event_endpoints(&self) -> Vec<String> {
        self.state.engines.iter().filter_map(|e| e.publisher.as_ref().map(|p| p.endpoint.clone())).collect()
    }

    /// Replay ROUTER endpoint per DP rank (empty when replay is off).
    pub fn replay_endpoints(&self) -> Vec<String> {
        self.state.engines.iter().filter_map(|e| e.publisher.as_ref().and_then(|p| p.replay_endpoint.clone())).collect()
    }

    /// Failure injection controls.
    pub fn faults(&self) -> &Faults {
        &self.state.faults
    }

    /// The configuration in use.
    pub fn config(&self) -> &SimConfig {
        &self.state.cfg
    }

    /// Crashes the server now: every connection is closed, nothing more is served.
    pub fn crash(&self) {
        self.state.faults.crash_now();
    }

    /// Completes when the server stopped (crash or shutdown).
    pub async fn stopped(&self) {
        self.stop.cancelled().await;
    }

    /// Stops the server and waits for the listener to close.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        let accept = std::mem::replace(&mut self.accept, tokio::spawn(async {}));
        let _ = accept.await;
    }
}

impl Drop for SimServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept_loop(listener: TcpListener, app: axum::Router, stop: CancellationToken) {
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}
