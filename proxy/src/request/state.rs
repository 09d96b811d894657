//! The per-request state carried through the phases (Pingora's `CTX` for a proxied request):
//! who asked what, the parsed view of the body, the KV inputs, the booking, the worker chosen
//! and the workers tried, the request's registration in the in-flight registry, and the
//! follower of a stream that may move.

use super::attempts::Attempts;
use super::kv_inputs::KvInputs;
use super::track::Tracker;
use super::view::RequestView;
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::fleet::{Model, Worker};
use crate::h1::request_head::RequestHead;
use crate::inflight::{Registered, RequestEntry};
use crate::kv_routing::KvRouting;
use bytes::Bytes;
use kvgate_filters::cancel::RequestContext;
use kvgate_filters::migrate::reply::Reply;
use kvgate_plugins::RoutingPlugin;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

/// The method and request target a request is forwarded with: the client's, in origin form
/// (path and query). Served endpoints' usual `POST` to a catalogued path borrows the
/// catalogue's text, so the usual request allocates nothing for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    /// The method.
    pub method: Cow<'static, str>,
    /// The target: path and query.
    pub target: Cow<'static, str>,
}

impl Forward {
    /// The client's method and target, as `head` has them.
    pub fn of(head: &RequestHead) -> Self {
        let method = if head.method_is("POST") { Cow::Borrowed("POST") } else { Cow::Owned(head.method().to_string()) };
        let target = head.origin_target();
        let target = match crate::endpoint::catalogued(target) {
            Some(path) => Cow::Borrowed(path),
            None => Cow::Owned(target.to_string()),
        };
        Self { method, target }
    }

    /// A `POST` to one of the catalogue's paths (a request sent in another API than its
    /// client's).
    pub fn post(path: &'static str) -> Self {
        Self { method: Cow::Borrowed("POST"), target: Cow::Borrowed(path) }
    }
}

/// The routing plugin a request is placed by, and what it may read of the request: taken at
/// admission, so a hot swap never changes the policy mid-request.
pub struct PluginInputs {
    /// The plugin.
    pub plugin: Arc<RoutingPlugin>,
    /// Request headers it may see (lower-case names).
    pub headers: Vec<(String, String)>,
    /// The request's `nvext` as JSON text (serialized only for a plugin: other modes never
    /// read it).
    pub nvext: Option<String>,
}

impl PluginInputs {
    /// The inputs of `plugin` for a request of `view` with `head`.
    pub fn of(plugin: Arc<RoutingPlugin>, head: &RequestHead, view: &RequestView) -> Self {
        let headers = plugin.headers().iter().filter_map(|name| head.header_str(name).map(|v| (name.clone(), v.to_string()))).collect();
        let nvext = view.nvext.as_ref().map(ToString::to_string);
        Self { plugin, headers, nvext }
    }
}

/// One request, from admission to its record.
pub struct RequestState {
    /// The configuration in force when it arrived (one load per request).
    pub cfg: Arc<Config>,
    /// Which endpoint.
    pub endpoint: Endpoint,
    /// The method and target sent to the worker.
    pub forward: Forward,
    /// When it arrived.
    pub start: Instant,
    /// Its cancellation context (its id is the request id).
    pub ctx: Arc<RequestContext>,
    /// The body its worker gets: the client's (but for the `request_id` a Responses request
    /// naming none is given, `stored.rs`, and the token ids a movable stream asks for,
    /// `track.rs`), or the chat request a Messages stream is sent as (`track::follow`).
    pub body: Bytes,
    /// The stored response it makes or refers to (Responses API).
    pub stored: Option<super::stored::StoredRefs>,
    /// The fields routing reads.
    pub view: RequestView,
    /// The whole body, parsed only when kv routing tokenizes it.
    pub parsed: Option<super::parsed::ParsedBody>,
    /// The client's output limit (`max_tokens` and its aliases), read where the body was parsed.
    pub output_limit: Option<u64>,
    /// Its latency objectives: the model's, each overridden by the request's own header.
    pub slo: kvgate_filters::route::Slo,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The model it addressed, as of its arrival (a reload never changes it under the request).
    pub model: Arc<Model>,
    /// Tokens, block hashes and per-worker overlaps, in kv mode.
    pub kv: Option<KvInputs>,
    /// The model's routing plugin and what it may read of the request, when it has one.
    pub plugin: Option<PluginInputs>,
    /// The workers it was placed on, the booking it holds and what was predicted there.
    pub attempts: Attempts,
    /// Its entry in the in-flight registry.
    pub registered: Registered,
    /// The stream's follower while it may move to another worker (docs/migration.md).
    pub track: Option<Tracker>,
    /// A Messages stream sent to its worker as chat: its answer, turned back into the
    /// Anthropic API's events (or error shape) for the client.
    pub reply: Option<Reply>,
    /// When the client was sent its first streamed token, after admission.
    pub ttft: Option<std::time::Duration>,
    /// Its legs on a model that disaggregates prefill from decode.
    pub pd: super::pd::Pd,
    /// Its tenant and what it was charged, when the gateway has tenants.
    pub tenant: Option<super::tenancy::TenantUse>,
    /// The prompt's tokens, from tokenizing until the KV inputs are made of them.
    pub prompt: Option<super::kv_inputs::PromptTokens>,
    /// Whether the client's API key goes on to the workers (always, without tenants).
    pub forward_key: bool,
    /// Its spans, when tracing is on.
    pub trace: Option<Box<crate::traces::RequestTrace>>,
}

impl RequestState {
    /// What a leg to a worker passes on of the client's headers, with `traceparent` its own
    /// when traced.
    pub fn passed<'a>(&self, traceparent: Option<&'a str>) -> crate::h1::request_head::Passed<'a> {
        crate::h1::request_head::Passed { keep_key: self.forward_key, traceparent }
    }

    /// The request id.
    pub fn id(&self) -> &str {
        self.ctx.id()
    }

    /// The model's name.
    pub fn model_name(&self) -> &str {
        &self.model.cfg.name
    }

    /// The worker serving it now (the last one tried) and its index among the model's workers.
    pub fn serving(&self) -> Option<(usize, &Arc<Worker>)> {
        let i = self.attempts.current()?;
        Some((i, self.model.workers.get(i)?))
    }

    /// What a ms of time per output token is worth in time to first token to it: its latency
    /// objectives' ratio, else its model's measured one (0 before a stream was timed).
    pub fn tpot_weight(&self) -> f64 {
        self.slo.tpot_weight().or_else(|| self.model.ledger.tpot_weight()).unwrap_or(0.0)
    }

    /// Its registry entry.
    pub fn entry(&self) -> &Arc<RequestEntry> {
        self.registered.entry()
    }

    /// The KV routing inputs of a prompt of `tokens` for this request: keyed by the LoRA
    /// adapter it names, salted by `salt`.
    pub fn kv_inputs(&self, kv: &KvRouting, tokens: &[u32], salt: Option<u64>) -> KvInputs {
        let adapter = crate::fleet::Fleet::adapter(&self.model, self.view.model.as_deref());
        KvInputs::of(&self.model, kv, adapter, tokens, salt)
    }

    /// Prompt tokens routing counted (0 when the prompt was not tokenized).
    pub fn prompt_tokens(&self) -> u64 {
        self.kv.as_ref().map_or(0, |k| k.tokens as u64)
    }

    /// Prompt tokens to book: the tokenized count in kv mode, else an estimate from the body
    /// (4 bytes per token), so shedding sees a load in every mode.
    pub fn booked_tokens(&self) -> u64 {
        self.kv.as_ref().map_or(self.body.len() as u64 / 4, |k| k.tokens as u64)
    }
}
