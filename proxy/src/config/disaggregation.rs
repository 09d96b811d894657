//! Prefill/decode disaggregation keys (Dynamo's disaggregated serving): a worker's
//! [`Role`], and a model's [`Disaggregation`] section (when a request runs in two legs, and the
//! prefill workers' busy thresholds).

use serde::Deserialize;

/// What a worker serves when its model disaggregates prefill from decode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill legs only (a vLLM started with a `kv_producer` KV connector): never a request's
    /// answer, so never a stream's worker, a retry's or a migration's destination.
    Prefill,
    /// Decode legs, and aggregated requests (a `kv_consumer`).
    Decode,
    /// Aggregated requests and decode legs (the default: an ordinary vLLM, or a `kv_both`).
    #[default]
    Both,
}

impl Role {
    /// Whether a request's answer (an aggregated request, or a decode leg) may be served here.
    pub fn answers(self) -> bool {
        self != Self::Prefill
    }

    /// Its name in metrics and `GET /workers`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        }
    }
}

/// How a model with prefill workers runs requests in two legs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Disaggregation {
    /// Prompts shorter than this many tokens run aggregated on a decode worker (conditional
    /// disaggregation: a short prefill costs a decode batch less than a transfer and a second
    /// round trip cost the request). Counted untokenized as 4 bytes per token.
    pub min_prefill_tokens: u64,
    /// Busy thresholds of the prefill workers (load shedding per role; unset = the model's
    /// `shedding` thresholds). Every prefill worker busy sends the request aggregated to a
    /// decode worker, counted, rather than refusing it.
    pub prefill_shedding: Option<kvgate_filters::shed::Thresholds>,
    /// Largest prefill-leg answer read, bytes (it carries one token and the transfer
    /// parameters).
    pub max_prefill_answer_bytes: usize,
    /// Longest a prefill leg may take, from its request to its whole answer, ms; past it the
    /// request runs aggregated (a prefill worker that stalls costs a request this long).
    pub prefill_timeout_ms: u64,
}

impl Default for Disaggregation {
    fn default() -> Self {
        Self { min_prefill_tokens: 0, prefill_shedding: None, max_prefill_answer_bytes: 1 << 20, prefill_timeout_ms: 60_000 }
    }
}

impl Disaggregation {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(t) = &self.prefill_shedding {
            t.validate().map_err(|e| format!("prefill_shedding: {e}"))?;
        }
        if self.max_prefill_answer_bytes < 1024 {
            return Err("max_prefill_answer_bytes must be at least 1024".into());
        }
        if self.prefill_timeout_ms == 0 {
            return Err("prefill_timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}
