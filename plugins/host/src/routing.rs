//! A loaded routing policy: its compiled component, pre-linked once, and a pool of live
//! instances so a decision costs one call, not an instantiation. An instance serves one call
//! at a time; one that fails is dropped, never reused. Guest state may persist between calls
//! of an instance, but instances come and go: policies must not rely on it.

use crate::bindings::router::kvgate::policy::types as wit;
use crate::bindings::router::{Router, RouterPre};
use crate::component::{self, Compiled, Kind};
use crate::failure::{Failure, LoadError};
use crate::sandbox::{self, HostState, Limits};
use kvgate_filters::route::{Candidate, Decision, RequestSummary};
use parking_lot::Mutex;
use std::time::{Duration, Instant};
use wasmtime::Store;

/// Idle instances kept per plugin (about one per concurrent decision).
const MAX_IDLE: usize = 64;
/// Consecutive failures after which the plugin is skipped for a while: a module that loops
/// would otherwise cost every request its whole deadline on the gateway's threads.
pub const TRIP_AFTER: u32 = 5;
/// First skip period; it doubles with each trip in a row, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest skip period.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Consecutive failures and the skip period they earned.
#[derive(Default)]
struct Breaker {
    failures: u32,
    backoff: Duration,
    open_until: Option<Instant>,
}
/// Longest rejection message passed to a client.
const MAX_MESSAGE: usize = 1024;

/// The request as a routing plugin sees it.
pub type RouteRequest<'a> = RequestSummary<'a>;

struct Live {
    store: Store<HostState>,
    router: Router,
}

/// A routing policy ready to call.
pub struct RoutingPlugin {
    compiled: Compiled,
    pre: RouterPre<HostState>,
    idle: Mutex<Vec<Live>>,
    breaker: Mutex<Breaker>,
}

impl RoutingPlugin {
    /// Links `compiled` and runs `init` with its config once, to refuse a plugin that cannot
    /// start before it replaces a working one.
    pub fn new(compiled: Compiled) -> Result<Self, LoadError> {
        let name = compiled.spec.name.clone();
        let err = |message: String| LoadError { plugin: name.clone(), message };
        let pre = RouterPre::new(component::link(&compiled, Kind::Router)?).map_err(|e| err(format!("does not match the router world: {e:#}")))?;
        let plugin = Self { compiled, pre, idle: Mutex::new(Vec::new()), breaker: Mutex::new(Breaker::default()) };
        let live = plugin.instantiate(plugin.limits().at_load()).map_err(|f| err(format!("init failed: {f}")))?;
        plugin.idle.lock().push(live);
        Ok(plugin)
    }

    /// Name from the config.
    pub fn name(&self) -> &str {
        &self.compiled.spec.name
    }

    /// sha256 of the file it was loaded from.
    pub fn sha256(&self) -> &str {
        &self.compiled.sha256
    }

    /// Headers it may see.
    pub fn headers(&self) -> &[String] {
        &self.compiled.spec.headers
    }

    fn limits(&self) -> Limits {
        self.compiled.spec.limits
    }

    /// A fresh instance, its `init` run under `limits`.
    fn instantiate(&self, limits: Limits) -> Result<Live, Failure> {
        let mut store = sandbox::store(limits);
        sandbox::arm(&mut store, limits);
        let router = match self.pre.instantiate(&mut store) {
            Ok(r) => r,
            Err(e) => return Err(sandbox::classify(&store, limits, &e)),
        };
        match router.kvgate_policy_routing().call_init(&mut store, &self.compiled.spec.config) {
            Ok(Ok(())) => Ok(Live { store, router }),
            Ok(Err(msg)) => Err(Failure::Invalid(format!("init refused its config: {msg}"))),
            Err(e) => Err(sandbox::classify(&store, limits, &e)),
        }
    }

    /// Asks the policy. `Ok(None)`: it has no opinion (use the fallback). `Err`: it failed, or
    /// is being skipped after [`TRIP_AFTER`] failures in a row; the caller falls back and
    /// counts [`Failure::kind`].
    pub fn choose(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Result<Option<Decision>, Failure> {
        if let Some(until) = self.breaker.lock().open_until {
            let now = Instant::now();
            if now < until {
                return Err(Failure::Skipped(until - now));
            }
        }
        let r = self.call(req, candidates);
        let mut b = self.breaker.lock();
        match &r {
            Err(_) => {
                b.failures += 1;
                if b.failures >= TRIP_AFTER {
                    b.backoff = if b.backoff.is_zero() { FIRST_BACKOFF } else { (b.backoff * 2).min(MAX_BACKOFF) };
                    b.open_until = Some(Instant::now() + b.backoff);
                    b.failures = 0;
                }
            }
            Ok(_) => *b = Breaker::default(),
        }
        r
    }

    /// The skip period that started at the last failure, if the plugin is being skipped now.
    pub fn skipped_for(&self) -> Option<Duration> {
        let b = self.breaker.lock();
        b.open_until.filter(|u| *u > Instant::now()).map(|_| b.backoff)
    }

    fn call(&self, req: &RouteRequest<'_>, candidates: &[Candidate]) -> Result<Option<Decision>, Failure> {
        let mut live = match self.idle.lock().pop() {
            Some(l) => l,
            None => self.instantiate(self.limits())?,
        };
        let limits = self.limits();
        let request = wit::Request {
            id: req.request_id.to_string(),
            model: req.model.to_string(),
            endpoint: req.endpoint.to_string(),
            prompt_tokens: req.prompt_tokens,
            prompt_blocks: req.prompt_blocks,
            block_size: req.block_size,
            headers: req.headers.iter().map(|(name, value)| wit::Header { name: name.clone(), value: value.clone() }).collect(),
            nvext: req.nvext.map(str::to_string),
        };
        let workers = columns(candidates);
        sandbox::arm(&mut live.store, limits);
        let answer = live.router.kvgate_policy_routing().call_choose(&mut live.store, &request, &workers);
        let answer = match answer {
            Ok(a) => a,
            // `live` is dropped: a trapped instance is never reused.
            Err(e) => return Err(sandbox::classify(&live.store, limits, &e)),
        };
        {
            let mut idle = self.idle.lock();
            if idle.len() < MAX_IDLE {
                idle.push(live);
            }
        }
        decision(answer, candidates)
    }
}

/// The candidates as columns (see `workers` in policy.wit: one copy per column).
fn columns(c: &[Candidate]) -> wit::Workers {
    wit::Workers {
        id: c.iter().map(|c| c.id).collect(),
        in_flight: c.iter().map(|c| c.in_flight).collect(),
        overlap_blocks: c.iter().map(|c| c.overlap_blocks).collect(),
        active_overlap_blocks: c.iter().map(|c| c.active_overlap_blocks).collect(),
        active_prefill_tokens: c.iter().map(|c| c.active_prefill_tokens).collect(),
        active_blocks: c.iter().map(|c| c.active_blocks).collect(),
        total_blocks: c.iter().map(|c| c.total_blocks).collect(),
        kv_usage: c.iter().map(|c| c.kv_usage).collect(),
        waiting: c.iter().map(|c| c.waiting).collect(),
        flags: c.iter().map(|c| u8::from(c.busy) | (u8::from(c.healthy) << 1)).collect(),
    }
}

/// Checks an answer against the candidates it was given.
fn decision(answer: wit::Decision, candidates: &[Candidate]) -> Result<Option<Decision>, Failure> {
    match answer {
        wit::Decision::Worker(id) => match candidates.iter().position(|c| c.id == id) {
            Some(i) => Ok(Some(Decision::Worker(i))),
            None => Err(Failure::Invalid(format!("worker {id} is not one of the {} candidates", candidates.len()))),
        },
        wit::Decision::Scores(scores) => {
            if scores.len() != candidates.len() {
                return Err(Failure::Invalid(format!("{} scores for {} candidates", scores.len(), candidates.len())));
            }
            if let Some(bad) = scores.iter().find(|s| !s.is_finite()) {
                return Err(Failure::Invalid(format!("score {bad} is not a finite number")));
            }
            let best = scores.iter().enumerate().fold(0, |best, (i, s)| if *s > scores[best] { i } else { best });
            Ok(Some(Decision::Worker(best)))
        }
        wit::Decision::Reject(r) => {
            if !(400..=599).contains(&r.status) {
                return Err(Failure::Invalid(format!("rejection status {} is not an HTTP error (400-599)", r.status)));
            }
            let mut message = r.message;
            if message.len() > MAX_MESSAGE {
                let cut = (0..=MAX_MESSAGE).rev().find(|&i| message.is_char_boundary(i)).unwrap_or(0);
                message.truncate(cut);
            }
            Ok(Some(Decision::Reject { status: r.status, message }))
        }
        wit::Decision::Fallback => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(ids: &[u32]) -> Vec<Candidate> {
        ids.iter().map(|&id| Candidate { id, ..Default::default() }).collect()
    }

    #[test]
    fn answers_are_checked_against_the_candidates() {
        let c = cands(&[3, 7, 9]);
        assert_eq!(decision(wit::Decision::Worker(7), &c), Ok(Some(Decision::Worker(1))));
        assert_eq!(decision(wit::Decision::Worker(4), &c).unwrap_err().kind(), "invalid");
        assert_eq!(decision(wit::Decision::Scores(vec![0.5, 2.0, 2.0]), &c), Ok(Some(Decision::Worker(1))), "ties go to the first");
        assert_eq!(decision(wit::Decision::Scores(vec![1.0]), &c).unwrap_err().kind(), "invalid");
        assert_eq!(decision(wit::Decision::Scores(vec![1.0, f64::NAN, 0.0]), &c).unwrap_err().kind(), "invalid");
        assert_eq!(decision(wit::Decision::Reject(wit::Rejection { status: 200, message: String::new() }), &c).unwrap_err().kind(), "invalid");
        let long = "é".repeat(2000);
        let Ok(Some(Decision::Reject { status: 429, message })) = decision(wit::Decision::Reject(wit::Rejection { status: 429, message: long }), &c) else {
            panic!("a valid rejection")
        };
        assert!(message.len() <= MAX_MESSAGE);
        assert_eq!(decision(wit::Decision::Fallback, &c), Ok(None));
    }
}
