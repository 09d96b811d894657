//! Turns validated prompts into engine requests and hands back a [`Generation`]: the stream of
//! tokens for all choices of one HTTP request.
//!
//! The [`Generation`] owns an abort guard: when it is dropped before every choice finished
//! (the client disconnected, so hyper dropped the handler future or the SSE body), the engine
//! is told to abort the unfinished requests, which frees their blocks at the next step, the
//! way vLLM aborts a request whose HTTP connection closed.
//!
//! With a KV connector, the request's `kv_transfer_params` decide its part in prefill/decode
//! disaggregation ([`crate::kv_connector::plan`]); a prefill leg's [`Generation`] carries the
//! promise of its held blocks' report, which its response turns into `kv_transfer_params`.

use super::AppState;
use super::error::ApiError;
use super::protocol::GenParams;
use crate::engine::{Delivery, EngineHandle, HeldReport, HoldReply};
use crate::faults::RequestFault;
use crate::scheduler::{KvTransfer, NewRequest, ReqId};
use axum::http::HeaderMap;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// One prompt ready for the engine.
#[derive(Debug, Clone)]
pub struct PreparedPrompt {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Resolved max_tokens.
    pub max_tokens: usize,
}

/// The tokens of one HTTP request's choices, as they are generated.
pub struct Generation {
    rx: mpsc::UnboundedReceiver<Delivery>,
    guard: AbortGuard,
    first_delay: Duration,
    delayed: bool,
    /// Number of choices.
    pub choices: usize,
    /// The engine serving it.
    pub rank: u32,
    /// A prefill leg's held blocks, reported when it finishes.
    pub hold: Option<PendingHold>,
}

/// A prefill leg's report to come: its internal id and the engine's answer.
#[derive(Debug)]
pub struct PendingHold {
    /// `remote_request_id`.
    pub request_id: String,
    /// The report, sent once the blocks are held (closed if they are not).
    pub rx: oneshot::Receiver<HeldReport>,
}

/// The `kv_transfer_params` of a unary response, as vLLM answers: a held prefill leg's
/// reply ([`crate::kv_connector::prefill_reply`]), else null (aggregated requests, decode
/// legs, a prefill leg that was not held, any request to a server without a connector).
pub async fn kv_transfer_reply(st: &AppState, hold: Option<PendingHold>) -> Value {
    let Some(h) = hold else { return Value::Null };
    match h.rx.await {
        Ok(r) => crate::kv_connector::prefill_reply(&st.cfg.kv_transfer, &h.request_id, st.listen, &r.kv, r.expiry_unix),
        Err(_) => Value::Null,
    }
}

impl Generation {
    /// The next token of any choice; `None` when the engine stopped.
    pub async fn recv(&mut self) -> Option<Delivery> {
        let d = self.rx.recv().await?;
        if !self.delayed {
            self.delayed = true;
            if !self.first_delay.is_zero() {
                tokio::time::sleep(self.first_delay).await;
            }
        }
        if d.out.finish.is_some()
            && let Some(f) = self.guard.finished.get_mut(d.choice)
        {
            *f = true;
        }
        Some(d)
    }
}

struct AbortGuard {
    engine: Arc<EngineHandle>,
    ids: Vec<ReqId>,
    finished: Vec<bool>,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        for (id, done) in self.ids.iter().zip(&self.finished) {
            if !done {
                self.engine.abort(*id);
            }
        }
    }
}

impl AppState {
    /// Applies failure injection and admission control, picks an engine (DP rank) and submits
    /// `n` choices per prompt. Choice index = prompt index × n + sample index.
    pub async fn generate(&self, headers: &HeaderMap, prompts: Vec<PreparedPrompt>, p: &GenParams) -> Result<Generation, ApiError> {
        match self.faults.roll_request() {
            RequestFault::None => {}
            RequestFault::Error => return Err(ApiError::internal("Simulated internal server error (vllm-sim failure injection)")),
            RequestFault::Hang => std::future::pending::<()>().await,
        }
        let engine = self.pick_engine(headers)?;
        if let Some(limit) = self.cfg.max_num_queued_reqs
            && engine.metrics.waiting.get() >= limit as f64
        {
            engine.metrics.admission_rejections.add(1);
            return Err(ApiError::busy());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let choices = prompts.len() * p.n;
        let mut ids = Vec::with_capacity(choices);
        let mut pending = None;
        for (i, prompt) in prompts.into_iter().enumerate() {
            for s in 0..p.n {
                let id = engine.next_id();
                let seed = if s == 0 { self.cfg.seed } else { self.cfg.seed ^ crate::sampler::mix(s as u64) };
                let kv = crate::kv_connector::plan(&self.cfg.kv_transfer, p.kv_transfer_params.as_ref(), i * p.n + s);
                let hold = (kv == KvTransfer::Hold).then(|| {
                    let (tx, rx) = oneshot::channel();
                    let request_id = internal_id(headers);
                    pending = Some(PendingHold { request_id: request_id.clone(), rx });
                    HoldReply { request_id, tx }
                });
                let req = NewRequest {
                    id,
                    prompt: prompt.tokens.clone(),
                    max_tokens: prompt.max_tokens,
                    min_tokens: p.min_tokens.min(prompt.max_tokens),
                    ignore_eos: p.ignore_eos,
                    seed,
                    cache_salt: p.cache_salt.clone(),
                    lora: p.lora.clone(),
                    kv,
                };
                if !engine.submit(req, i * p.n + s, tx.clone(), hold) {
                    return Err(ApiError::internal("engine is not running"));
                }
                ids.push(id);
            }
        }
        Ok(Generation {
            rx,
            guard: AbortGuard { engine: engine.clone(), finished: vec![false; ids.len()], ids },
            first_delay: self.faults.first_token_delay(),
            delayed: false,
            choices,
            rank: engine.rank(),
            hold: pending,
        })
    }

    /// `X-data-parallel-rank` pins the rank; otherwise the least-loaded engine.
    fn pick_engine(&self, headers: &HeaderMap) -> Result<&Arc<EngineHandle>, ApiError> {
        if let Some(v) = headers.get("x-data-parallel-rank") {
            let rank = v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok());
            return match rank {
                Some(r) if r < self.engines.len() => Ok(&self.engines[r]),
                _ => Err(ApiError::bad_request(format!("X-data-parallel-rank must be an integer in [0, {})", self.engines.len()), None)),
            };
        }
        Ok(self.engines.iter().min_by_key(|e| e.in_flight()).expect("at least one engine"))
    }
}

/// A request's internal id, as vLLM's engine names it: the request id (`X-Request-Id`, else a
/// random one) with 8 random hex digits appended, unique even when a client reuses its id for
/// both legs.
fn internal_id(headers: &HeaderMap) -> String {
    let base = headers.get("x-request-id").and_then(|v| v.to_str().ok()).map_or_else(crate::ids::random_id, str::to_owned);
    format!("{base}-{}", &crate::ids::random_id()[..8])
}
