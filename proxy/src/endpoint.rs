//! What the gateway does with each path a client may ask for on the public listener: the
//! catalogue of vLLM's paths (docs/endpoints.md is its table, and the real-vLLM suite diffs a
//! live server's `openapi.json` against it).
//!
//! A path is one of four kinds ([`PathKind`]):
//! - an [`Endpoint`]: a model-scoped request served by the request phases (admit → place → leg
//!   → relay), with the model read from the body, shedding, the router queue for inference,
//!   cancellation, retries and metrics by endpoint;
//! - local: answered by the gateway itself (`/v1/models`, `/health`, `/metrics`);
//! - control: one of vLLM's operator endpoints (pause a worker, load weights or LoRA files,
//!   profile, …), never reachable from the public listener: a client must not be able to pause
//!   a fleet or make a worker read files;
//! - passthrough: anything else, forwarded unchanged (method, path, query, body) to a healthy
//!   worker of the request's model, as a served endpoint with no inference bookkeeping.
//!
//! A leaf module: it imports nothing of the gateway's, so the request phases, metrics and the
//! configuration can all name an endpoint.

/// A model-scoped endpoint served by the request phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/messages` (Anthropic Messages).
    Messages,
    /// `/v1/responses` (OpenAI Responses).
    Responses,
    /// `/v1/chat/completions/batch`.
    ChatBatch,
    /// `/invocations` (SageMaker: chat, completion or pooling, told apart by the body).
    Invocations,
    /// `/inference/v1/generate` (token ids in, token ids out).
    Generate,
    /// `/v1/embeddings`, `/v2/embed`.
    Embeddings,
    /// `/pooling`.
    Pooling,
    /// `/classify`.
    Classify,
    /// `/score`, `/v1/score`.
    Score,
    /// `/rerank`, `/v1/rerank`, `/v2/rerank`.
    Rerank,
    /// `/v1/audio/transcriptions`, `/v1/audio/translations` (multipart form bodies).
    Audio,
    /// Any other generating endpoint vLLM serves (`/cohere/v2/chat`, `/generative_scoring`,
    /// `/v1/systemone`).
    OtherInference,
    /// `/v1/messages/count_tokens`.
    CountTokens,
    /// `/tokenize`.
    Tokenize,
    /// `/detokenize`.
    Detokenize,
    /// A path the gateway does not know, forwarded unchanged.
    Passthrough,
}

/// How the public listener handles a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    /// Served by the request phases.
    Served(Endpoint),
    /// Answered by the gateway itself.
    Local,
    /// One of vLLM's operator endpoints: refused here (the admin listener's fleet operations).
    Control,
}

/// The paths of [`Endpoint`]s, exactly as clients send them.
const SERVED: &[(&str, Endpoint)] = &[
    ("/v1/chat/completions", Endpoint::Chat),
    ("/v1/completions", Endpoint::Completions),
    ("/v1/messages", Endpoint::Messages),
    ("/v1/responses", Endpoint::Responses),
    ("/v1/chat/completions/batch", Endpoint::ChatBatch),
    ("/invocations", Endpoint::Invocations),
    ("/inference/v1/generate", Endpoint::Generate),
    ("/v1/embeddings", Endpoint::Embeddings),
    ("/v2/embed", Endpoint::Embeddings),
    ("/pooling", Endpoint::Pooling),
    ("/classify", Endpoint::Classify),
    ("/score", Endpoint::Score),
    ("/v1/score", Endpoint::Score),
    ("/rerank", Endpoint::Rerank),
    ("/v1/rerank", Endpoint::Rerank),
    ("/v2/rerank", Endpoint::Rerank),
    ("/v1/audio/transcriptions", Endpoint::Audio),
    ("/v1/audio/translations", Endpoint::Audio),
    ("/cohere/v2/chat", Endpoint::OtherInference),
    ("/generative_scoring", Endpoint::OtherInference),
    ("/v1/systemone", Endpoint::OtherInference),
    ("/v1/messages/count_tokens", Endpoint::CountTokens),
    ("/tokenize", Endpoint::Tokenize),
    ("/detokenize", Endpoint::Detokenize),
];

/// The catalogue's entry for `path`, when the request phases serve it.
fn served(path: &str) -> Option<&'static (&'static str, Endpoint)> {
    SERVED.iter().find(|(p, _)| *p == path)
}

/// The catalogue's own text for `path`, when the request phases serve it (so a request to it
/// borrows the text instead of copying it).
pub fn catalogued(path: &str) -> Option<&'static str> {
    served(path).map(|&(p, _)| p)
}

/// Paths the gateway answers itself.
pub const LOCAL: &[&str] = &["/v1/models", "/health", "/metrics"];

/// vLLM's operator endpoints (the dev-mode, RL, elastic-scaling, fault-tolerance, profiling
/// and LoRA routers, and the engine's abort), never forwarded from the public listener. Those
/// that read rather than change (`/is_paused`, `/server_info`, …) are here too: they describe
/// one worker's internals (its engine arguments, its KV-event sockets) to whoever asks.
pub const CONTROL: &[&str] = &[
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/release_kv_cache_memory",
    "/start_profile",
    "/stop_profile",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/update_weights",
    "/start_weight_update",
    "/finish_weight_update",
    "/start_draft_weight_update",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/weight_checker",
    "/weight_info",
    "/get_world_size",
    "/server_info",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/fault_tolerance/apply",
    "/fault_tolerance/status",
    "/abort_requests",
    "/inference/v1/abort_requests",
    "/kv_event_sources",
];

/// A stored response's own paths, `/v1/responses/{id}` and `/v1/responses/{id}/cancel`: passed
/// through, to the worker that stored it.
const RESPONSE_PREFIX: &str = "/v1/responses/";

impl PathKind {
    /// The kind as docs/endpoints.md's table writes it: `served:<endpoint label>` (a
    /// passthrough is `passthrough`), `local` or `control`.
    pub fn label(self) -> String {
        match self {
            Self::Served(Endpoint::Passthrough) => "passthrough".into(),
            Self::Served(ep) => format!("served:{}", ep.label()),
            Self::Local => "local".into(),
            Self::Control => "control".into(),
        }
    }

    /// How `path` (without its query) is handled, before the configuration's `passthrough`
    /// rules (which may refuse a [`Endpoint::Passthrough`]).
    pub fn of(path: &str) -> Self {
        if let Some(&(_, ep)) = served(path) {
            return Self::Served(ep);
        }
        if LOCAL.contains(&path) {
            Self::Local
        } else if is_control(path) {
            Self::Control
        } else {
            Self::Served(Endpoint::Passthrough)
        }
    }
}

/// Whether `path` is one of vLLM's operator endpoints ([`CONTROL`]), compared as the worker
/// would route it: uvicorn percent-decodes the path before Starlette matches it (`/pa%75se`
/// is `/pause`), and Starlette redirects `/pause/` to `/pause`. Empty and dot segments are
/// dropped and case ignored too, so no spelling of a control path slips through.
pub fn is_control(path: &str) -> bool {
    let path = normalized(path);
    CONTROL.iter().any(|c| c.eq_ignore_ascii_case(&path))
}

/// `path` percent-decoded, with empty, `.` and `..` segments resolved (what a lenient server
/// could route it as).
fn normalized(path: &str) -> String {
    let decoded = percent_decoded(path);
    let mut segments: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() { "/".into() } else { out }
}

/// `%XX` escapes decoded (repeatedly, so a double-encoded path is seen as its final form);
/// bytes that are not UTF-8 are replaced.
fn percent_decoded(path: &str) -> String {
    let mut cur = path.to_string();
    for _ in 0..4 {
        let b = cur.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let hex = |c: u8| (c as char).to_digit(16);
            match (b[i], b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
                (b'%', Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                }
                (c, _, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        let next = String::from_utf8_lossy(&out).into_owned();
        if next == cur {
            break;
        }
        cur = next;
    }
    cur
}

/// The response id of a stored response's path (`/v1/responses/{id}` or its `/cancel`).
pub fn stored_response_id(path: &str) -> Option<&str> {
    let rest = path.strip_prefix(RESPONSE_PREFIX)?;
    let id = rest.strip_suffix("/cancel").unwrap_or(rest);
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

impl Endpoint {
    /// Every endpoint, in [`Endpoint::index`] order.
    pub const ALL: [Endpoint; 18] = [
        Self::Chat,
        Self::Completions,
        Self::Messages,
        Self::Responses,
        Self::ChatBatch,
        Self::Invocations,
        Self::Generate,
        Self::Embeddings,
        Self::Pooling,
        Self::Classify,
        Self::Score,
        Self::Rerank,
        Self::Audio,
        Self::OtherInference,
        Self::CountTokens,
        Self::Tokenize,
        Self::Detokenize,
        Self::Passthrough,
    ];

    /// Position in [`Endpoint::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Metric label (Dynamo's cancellation metric's values for chat and completions).
    pub fn label(self) -> &'static str {
        match self {
            Self::Chat => "chat_completions",
            Self::Completions => "completions",
            Self::Messages => "messages",
            Self::Responses => "responses",
            Self::ChatBatch => "chat_completions_batch",
            Self::Invocations => "invocations",
            Self::Generate => "generate",
            Self::Embeddings => "embeddings",
            Self::Pooling => "pooling",
            Self::Classify => "classify",
            Self::Score => "score",
            Self::Rerank => "rerank",
            Self::Audio => "audio",
            Self::OtherInference => "other_inference",
            Self::CountTokens => "count_tokens",
            Self::Tokenize => "tokenize",
            Self::Detokenize => "detokenize",
            Self::Passthrough => "passthrough",
        }
    }

    /// Whether it runs the model (and so waits in the router queue, is booked on its worker
    /// and counted as inference). Tokenizing, counting tokens and passthrough do not.
    pub fn infers(self) -> bool {
        !matches!(self, Self::CountTokens | Self::Tokenize | Self::Detokenize | Self::Passthrough)
    }

    /// Whether kvgate renders its prompt to token ids for KV-aware routing (the others are
    /// placed by load).
    pub fn renders(self) -> bool {
        matches!(self, Self::Chat | Self::Completions | Self::Messages | Self::Responses)
    }

    /// Whether its streams can move to another worker mid-way (docs/migration.md): the
    /// continuation is re-wrapped in chat's and completions' shapes, and a Messages or
    /// Responses stream is sent to its worker as chat.
    pub fn moves(self) -> bool {
        matches!(self, Self::Chat | Self::Completions | Self::Messages | Self::Responses)
    }

    /// Whether only `POST` reaches it (a passthrough takes the client's method).
    pub fn post_only(self) -> bool {
        self != Self::Passthrough
    }

    /// Whether its body is JSON whose `model` field names the model (audio bodies are
    /// multipart forms; a passthrough's may be anything).
    pub fn json_body(self) -> bool {
        !matches!(self, Self::Audio | Self::Passthrough)
    }

    /// Whether its clients expect errors in the Anthropic API's shape rather than OpenAI's.
    pub fn anthropic_errors(self) -> bool {
        matches!(self, Self::Messages | Self::CountTokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_has_one_kind() {
        assert_eq!(PathKind::of("/v1/messages"), PathKind::Served(Endpoint::Messages));
        assert_eq!(PathKind::of("/v1/messages/count_tokens"), PathKind::Served(Endpoint::CountTokens));
        assert_eq!(PathKind::of("/v2/rerank"), PathKind::Served(Endpoint::Rerank));
        assert_eq!(PathKind::of("/v1/responses/resp_1"), PathKind::Served(Endpoint::Passthrough));
        assert_eq!(PathKind::of("/v1/responses/resp_1/cancel"), PathKind::Served(Endpoint::Passthrough));
        assert_eq!(PathKind::of("/v1/models"), PathKind::Local);
        assert_eq!(PathKind::of("/pause"), PathKind::Control);
        assert_eq!(PathKind::of("/pause/"), PathKind::Control);
        assert_eq!(PathKind::of("/PAUSE"), PathKind::Control);
        for spelled in ["/pa%75se", "/pa%2575se", "//pause", "/./pause", "/v1/../pause", "/v1%2f..%2fpause", "/v1/load_lora_adapter/"] {
            assert_eq!(PathKind::of(spelled), PathKind::Control, "{spelled}");
        }
        assert_eq!(PathKind::of("/v1/load_lora_adapter"), PathKind::Control);
        assert_eq!(PathKind::of("/version"), PathKind::Served(Endpoint::Passthrough));
        assert_eq!(PathKind::of("/"), PathKind::Served(Endpoint::Passthrough));
        for (p, _) in SERVED {
            assert!(!is_control(p) && !LOCAL.contains(p), "{p} has one kind");
        }
    }

    #[test]
    fn stored_response_paths_name_one_id() {
        assert_eq!(stored_response_id("/v1/responses/resp_a"), Some("resp_a"));
        assert_eq!(stored_response_id("/v1/responses/resp_a/cancel"), Some("resp_a"));
        assert_eq!(stored_response_id("/v1/responses/"), None);
        assert_eq!(stored_response_id("/v1/responses/a/b"), None);
    }

    #[test]
    fn labels_are_distinct_and_indices_dense() {
        let mut labels: Vec<_> = Endpoint::ALL.iter().map(|e| e.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Endpoint::ALL.len());
        assert!(Endpoint::ALL.iter().enumerate().all(|(i, e)| e.index() == i));
    }
}
