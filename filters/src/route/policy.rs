//! The selection interface: what a routing decision sees and what it may answer.

/// What routing knows about the request.
#[derive(Debug, Clone, Default)]
pub struct RequestSummary<'a> {
    /// Model name from the request.
    pub model: &'a str,
    /// `chat_completions` or `completions`.
    pub endpoint: &'a str,
    /// Request id.
    pub request_id: &'a str,
    /// Prompt length in tokens (0 when not tokenized).
    pub prompt_tokens: u32,
    /// Prompt length in full KV blocks.
    pub prompt_blocks: u32,
    /// Tokens per KV block of the model.
    pub block_size: u32,
    /// The longest prefix of the prompt cached on any candidate, in blocks: what a worker
    /// lacking it would compute a second copy of.
    pub fleet_overlap_blocks: u32,
    /// The longest prefix of the prompt booked on any candidate by requests in flight, in
    /// blocks: a prefix in use right now (hot), whose requests keep coming.
    pub fleet_active_overlap_blocks: u32,
    /// The candidates' mean prefill utilisation (their `prefill_load`).
    pub fleet_prefill_load: f64,
    /// Prefills the model's workers are booked per second, each (0: unknown).
    pub arrivals_per_worker_s: f64,
    /// Output tokens the request is expected to generate (0: unknown): the client's hint, or
    /// its `max_tokens` within what the model's requests generate.
    pub expected_output_tokens: f64,
    /// Output tokens the model's requests generate, a recent mean (0: unknown). A request
    /// decoding has half of it left on average.
    pub mean_output_tokens: f64,
    /// How many ms of time to first token one ms of time per output token is worth (0:
    /// unknown): the ratio of the model's objectives where both are set, else of its recent
    /// mean time to first token over its mean time per output token (the ledger's
    /// `tpot_weight`). The `slowdown` term prices a stall at it.
    pub tpot_weight: f64,
    /// How many ms of time to first token one ms of end-to-end time is worth (0: unknown): the
    /// model's recent mean time to first token over its mean end to end (the ledger's
    /// `e2e_weight`).
    pub e2e_weight: f64,
    /// Its latency objectives (the model's, or its own): the `time` cost adds each worker's
    /// predicted miss of them.
    pub slo: super::Slo,
    /// Request headers a plugin policy is allowed to see (lower-case names).
    pub headers: &'a [(String, String)],
    /// The request's `nvext` object as JSON text, if any.
    pub nvext: Option<&'a str>,
}

impl RequestSummary<'_> {
    /// The summary with [`RequestSummary::fleet_overlap_blocks`],
    /// [`RequestSummary::fleet_active_overlap_blocks`] and [`RequestSummary::fleet_prefill_load`] taken
    /// from `candidates`.
    pub fn among(&self, candidates: &[Candidate]) -> Self {
        // One pass: it runs on every decision, over every candidate.
        let (fleet_overlap_blocks, fleet_active_overlap_blocks, load) = candidates
            .iter()
            .fold((0, 0, 0.0), |(cached, booked, load), c| (cached.max(c.overlap_blocks), booked.max(c.active_overlap_blocks), load + c.prefill_load));
        let fleet_prefill_load = load / candidates.len().max(1) as f64;
        Self { fleet_overlap_blocks, fleet_active_overlap_blocks, fleet_prefill_load, ..self.clone() }
    }
}

/// One eligible worker and its load, as the gateway sees it at decision time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidate {
    /// Stable worker id within the model (its position in the config's worker list).
    pub id: u32,
    /// Requests the gateway has in flight to it.
    pub in_flight: u32,
    /// Leading prompt blocks already in its KV cache.
    pub overlap_blocks: u32,
    /// Leading prompt blocks already booked on it by requests in flight (counted once).
    pub active_overlap_blocks: u32,
    /// Prefill tokens booked on it and not yet started decoding.
    pub active_prefill_tokens: u64,
    /// Requests booked on it still waiting for their first token.
    pub prefilling: u32,
    /// Prefill tokens this gateway booked on it since its prefill queue was last empty (0: none
    /// booked now). vLLM computes a queue of prompts in steps of a whole chunk, so the last
    /// one's last step has `⌈q / chunk⌉ · chunk − q` tokens of room, which the next prompt
    /// fills and the last one's first token waits for.
    pub queued_since_idle: u64,
    /// Prefill tokens booked on it since its running engine step began (since it last
    /// delivered a token): they run in its next step, as this request would.
    pub next_step_tokens: u64,
    /// Time since it last delivered a token (the end of its last engine step), ms; `None`
    /// before its first.
    pub since_step_ms: Option<f64>,
    /// Predicted length of the engine step running there now, ms: its measured mean, longer
    /// or shorter by the prefill booked into this one against the mean's (`None`: no steps
    /// timed yet; the `time` cost uses `step_ms`).
    pub running_step_ms: Option<f64>,
    /// Predicted time until it has computed the prefill booked on it, ms (the ledger's
    /// `prefill_backlog`: decays as it makes progress).
    pub prefill_backlog_ms: f64,
    /// How busy the prefill booked on it keeps it: predicted prefill time booked per second
    /// over the last few seconds (the ledger's `prefill_load_at`).
    pub prefill_load: f64,
    /// Its prefill time per uncached prompt token as the gateway measured it, ms (0: not
    /// measured yet; the `time` cost's prior applies).
    pub ms_per_prefill_token: f64,
    /// Its decode step time as the gateway measured it (inter-token latency), ms (0: not yet).
    pub step_ms: f64,
    /// KV blocks booked on it.
    pub active_blocks: u64,
    /// Σ 1 / expected output tokens over the requests decoding there (first token delivered,
    /// not ended; the ledger's): a stall of `s` ms in their steps adds `s · decode_sensitivity`
    /// ms to the sum of their times per output token. A short answer's is large: one prefill
    /// chunk run during its few steps multiplies its time per output token, while a long
    /// one's barely moves.
    pub decode_sensitivity: f64,
    /// Its KV capacity in blocks (0 = unknown).
    pub total_blocks: u64,
    /// Blocks its KV cache can still take without evicting a cached one: its capacity less the
    /// blocks it holds (those its KV events report, at least those its reported usage says are
    /// in use), summed over its data-parallel ranks (`None`: unknown, taken as full).
    pub cache_room_blocks: Option<u64>,
    /// Its reported KV usage in [0, 1].
    pub kv_usage: f64,
    /// Its reported waiting requests.
    pub waiting: u32,
    /// Over a busy threshold (offered only when every worker is).
    pub busy: bool,
    /// Passing health checks.
    pub healthy: bool,
}

/// A routing answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Send to `candidates[index]`.
    Worker(usize),
    /// Refuse the request with this HTTP status and message.
    Reject {
        /// HTTP status.
        status: u16,
        /// Client-facing message.
        message: String,
    },
}

/// A routing mode.
pub trait Policy: Send + Sync {
    /// Mode name for logs and metrics.
    fn name(&self) -> &'static str;
    /// Picks among `candidates` (never empty when called).
    fn choose(&self, req: &RequestSummary<'_>, candidates: &[Candidate]) -> Decision;
}
