//! Phase 3, placement: shedding, then routing. Workers that are unhealthy or already tried are
//! left out; busy ones too while some worker is not busy (on the first attempt, all busy is a
//! 503 with Dynamo's load-shedding body). The built-in mode, or the plugin in front of it, picks among the
//! rest; the request's booking moves onto the chosen worker, and the decision is written to the
//! request's route receipt.

use super::RequestState;
use super::pd::LegRole;
use crate::error::GatewayError;
use crate::fleet::{Model, Worker};
use crate::gateway::Gateway;
use crate::receipt::{DecidedBy, Exclusion, OutputOutlook, Placement};
use kvgate_filters::ledger::Footprint;
use kvgate_filters::route::time::Prediction;
use kvgate_filters::route::{Candidate, Decision, Policy, RequestSummary, Terms};
use std::sync::Arc;
use std::time::Duration;

/// Who may take the next attempt.
#[derive(Debug, Clone, Copy)]
pub enum Among<'a> {
    /// Any healthy worker not in the list (a first attempt or a retry: the workers tried).
    Except(&'a [usize]),
    /// This worker only (a move an operator aimed), if it is healthy; shedding does not apply.
    Only(usize),
}

/// Chooses a worker for the next attempt (any healthy worker not tried yet) and books the
/// request on it.
pub fn place(gw: &Gateway, req: &mut RequestState) -> Result<Arc<Worker>, GatewayError> {
    let tried = req.attempts.tried().to_vec();
    match next_among(gw, req, &tried)? {
        Some(among) => place_among(gw, req, among),
        None => Err(GatewayError::NoHealthyWorker(req.model.cfg.name.clone())),
    }
}

/// Who may take the request's next attempt: the worker that stored the response it refers to
/// alone, and none once that one was tried (a stored response is served there or nowhere);
/// else any worker not `tried` yet.
fn next_among<'t>(gw: &Gateway, req: &RequestState, tried: &'t [usize]) -> Result<Option<Among<'t>>, GatewayError> {
    match req.stored.as_ref().and_then(|refs| super::stored::home(gw, &req.model, refs)).transpose()? {
        Some(i) if tried.contains(&i) => Ok(None),
        Some(i) => Ok(Some(Among::Only(i))),
        None => Ok(Some(Among::Except(tried))),
    }
}

/// A placement's summary, as its span shows it (the receipt has the whole).
fn placement_attrs(p: &Placement, worker: &str) -> Vec<opentelemetry::KeyValue> {
    use opentelemetry::KeyValue;
    let decided_by = match &p.decided_by {
        DecidedBy::Builtin(mode) => (*mode).to_string(),
        DecidedBy::Plugin(name) => format!("plugin:{name}"),
        DecidedBy::Fallback { mode, .. } => format!("fallback:{mode}"),
        DecidedBy::Pinned => "pinned".to_string(),
    };
    let chosen = p.chosen.and_then(|c| p.candidates.iter().find(|x| x.id == c));
    vec![
        KeyValue::new("kvgate.attempt", i64::from(p.attempt)),
        KeyValue::new("kvgate.worker", worker.to_string()),
        KeyValue::new("kvgate.decided_by", decided_by),
        KeyValue::new("kvgate.candidates", i64::try_from(p.candidates.len()).unwrap_or(i64::MAX)),
        KeyValue::new("kvgate.prompt_tokens", i64::from(p.prompt.0)),
        KeyValue::new("kvgate.overlap_blocks", chosen.map_or(0, |c| i64::from(c.overlap_blocks))),
        KeyValue::new("kvgate.worker_in_flight", chosen.map_or(0, |c| i64::from(c.in_flight))),
    ]
}

/// Whether the request's next placement would wait for a pause to end: of the workers that
/// could take its next attempt, none is eligible, and one is out only because it is paused.
/// The same predicate as [`place`]'s, so the two never disagree.
pub fn held_by_pause(gw: &Gateway, req: &RequestState) -> bool {
    let Ok(Some(among)) = next_among(gw, req, req.attempts.tried()) else { return false };
    let adapter = crate::fleet::Fleet::adapter(&req.model, req.view.model.as_deref());
    let (eligible, excluded) = eligible(&req.model, among, adapter, LegRole::Answer);
    eligible.is_empty() && excluded.iter().any(|(_, e)| *e == Exclusion::Paused)
}

/// [`place`] among the workers `among` allows.
pub fn place_among(gw: &Gateway, req: &mut RequestState, among: Among<'_>) -> Result<Arc<Worker>, GatewayError> {
    place_leg(gw, req, among, LegRole::Answer)
}

/// Places the leg of `role` among the workers `among` allows: the worker is booked and the
/// decision written to the receipt; an answering leg is also one more attempt, the worker the
/// request runs on.
pub fn place_leg(gw: &Gateway, req: &mut RequestState, among: Among<'_>, role: LegRole) -> Result<Arc<Worker>, GatewayError> {
    let model = req.model.clone();
    // Read only for the trace: the clock is not free.
    let began = req.trace.is_some().then(std::time::Instant::now);
    let Offer { eligible, busy, excluded } = offered(gw, req, among, role)?;
    let now = kvgate_filters::ledger::clock_us();
    let candidates: Vec<Candidate> = eligible.iter().map(|&i| candidate(req, role, i, busy.contains(&i), now)).collect();
    let summary = summary(req, now).among(&candidates);
    // A request pinned to one worker is not a routing decision: asking the policy would count
    // it, and advance a round robin's turn past the next request that is one.
    let (decision, decided_by) = match among {
        Among::Only(_) => (Decision::Worker(0), DecidedBy::Pinned),
        Among::Except(_) => decide(gw, req, &summary, &candidates),
    };
    let k = match decision {
        Decision::Worker(k) if k < eligible.len() => k,
        Decision::Worker(_) => 0,
        Decision::Reject { status, message } => return Err(GatewayError::PluginRejected { status, message }),
    };
    let predicted = predicted(gw, req, &summary, &candidates[k]);
    let idx = eligible[k];
    if model.disaggregates() {
        gw.metrics.disagg.decisions.with_label_values(&[model.cfg.name.as_str(), model.role(idx).label()]).inc();
    }
    let by_plugin = matches!(decided_by, DecidedBy::Plugin(_) | DecidedBy::Fallback { .. });
    let output = OutputOutlook::of(&summary);
    let decided = Decided { best_overlap: summary.fleet_overlap_blocks, began: now, by_plugin, expected_output: output.expected_tokens, predicted, role };
    book(gw, req, idx, &candidates[k], decided);
    let placement = Placement {
        attempt: req.attempts.count() as u32 + 1,
        workers: model.workers.clone(),
        decided_by,
        candidates,
        excluded,
        chosen: Some(idx as u32),
        kv: model.kv.as_ref().map(|k| k.policy.params()),
        prompt: req.kv.as_ref().map_or((0, 0), |k| (k.tokens as u32, k.chain.len() as u32)),
        output,
        slo: req.slo,
        gate: None,
        outcome: None,
    };
    if let (Some(t), Some(began)) = (&req.trace, began) {
        t.phase("kvgate.place", began, || placement_attrs(&placement, &model.workers[idx].label));
    }
    req.entry().receipt.lock().placements.push(placement);
    let worker = model.workers[idx].clone();
    // A prefill leg is not where the request runs: the registry (and a move order) sees the
    // request on its decode worker only.
    if role == LegRole::Answer {
        req.attempts.placed(idx, predicted);
        req.entry().placed(&worker, req.prompt_tokens());
    }
    Ok(worker)
}

/// The workers a leg is offered.
struct Offer {
    /// Indices into the model's workers.
    eligible: Vec<usize>,
    /// Those of them over a busy threshold (offered because every one is).
    busy: Vec<usize>,
    /// The others, and why they are out.
    excluded: Vec<(u32, Exclusion)>,
}

/// The workers to offer the leg. None eligible: paused workers come back, so the request
/// waits for them (phase 2) rather than failing.
fn offered(gw: &Gateway, req: &RequestState, among: Among<'_>, role: LegRole) -> Result<Offer, GatewayError> {
    let model = &req.model;
    let adapter = crate::fleet::Fleet::adapter(model, req.view.model.as_deref());
    let (eligible, mut excluded) = eligible(model, among, adapter, role);
    if eligible.is_empty() {
        if excluded.iter().any(|(_, e)| *e == Exclusion::Paused) {
            return Err(GatewayError::Paused(model.cfg.name.clone()));
        }
        return Err(GatewayError::NoHealthyWorker(model.cfg.name.clone()));
    }
    let (eligible, busy) = match among {
        Among::Except(_) => shed(gw, req, role, eligible, &mut excluded)?,
        Among::Only(_) => (eligible, Vec::new()),
    };
    Ok(Offer { eligible, busy, excluded })
}

/// Worker `i` as the routing policy sees it for this leg at `now`: its load, and in kv mode
/// the prompt blocks it holds.
fn candidate(req: &RequestState, role: LegRole, i: usize, busy: bool, now: u64) -> Candidate {
    let c = req.model.candidate(i, busy, now);
    let c = match (&req.model.kv, &req.kv) {
        (Some(kv), Some(inputs)) => kv.with_prefix(c, &inputs.cached, &inputs.booked),
        _ => c,
    };
    req.pd.candidate(role, c, req.kv.as_ref().map(|k| k.chain.len() as u32))
}

/// What the `time` cost predicts of the request on `chosen`, and whether that meets the
/// request's latency objectives (counted, when it has some).
fn predicted(gw: &Gateway, req: &RequestState, summary: &RequestSummary<'_>, chosen: &Candidate) -> Option<Prediction> {
    let predicted = req.model.kv.as_ref().and_then(|kv| match kv.policy.cost(summary, chosen).1 {
        Terms::Time(p) => Some(p),
        Terms::Blocks { .. } => None,
    });
    if let (true, Some(p)) = (req.slo.is_set(), predicted) {
        let met = req.slo.violation(p.ttft_ms(), p.tpot_ms) <= 0.0;
        req.model.metrics(&gw.metrics).slo[usize::from(!met)].inc();
    }
    predicted
}

/// [`adopt_current_model`] for a move: where the worker it leaves (`leaving`) and the worker an
/// order aims at (`to`) stand in the fleet in force (`None`: not in it).
pub fn adopt_for_move(gw: &Gateway, req: &mut RequestState, leaving: Option<&Arc<Worker>>, to: Option<&Arc<Worker>>) -> (Option<usize>, Option<usize>) {
    adopt_current_model(gw, req);
    let at = |w: &Arc<Worker>| req.model.workers.iter().position(|x| Arc::ptr_eq(x, w));
    (leaving.and_then(at), to.and_then(at))
}

/// Whether every worker that could serve the request's answer (what [`place`]'s first attempt
/// would offer) is over the model's busy thresholds, so that the request would get the
/// load-shedding 503 (a prefill leg for it would be wasted).
pub fn answers_all_busy(gw: &Gateway, req: &RequestState) -> bool {
    let model = &req.model;
    let thresholds = gw.thresholds(&model.cfg.name);
    let adapter = crate::fleet::Fleet::adapter(model, req.view.model.as_deref());
    let (serving, _) = eligible(model, Among::Except(req.attempts.tried()), adapter, LegRole::Answer);
    thresholds.enabled() && !serving.is_empty() && serving.iter().all(|&i| model.busy(i, &thresholds))
}

/// Moves `req` onto the fleet in force when a reload rebuilt its model since it arrived, so a
/// move can reach workers added since: its attempts are carried over ([`Attempts::rebase`]:
/// the booking is made again at the next placement), and so are its KV inputs while the new
/// model hashes blocks as the old one did; otherwise it routes without them, as a request
/// whose prompt was not tokenized does.
///
/// [`Attempts::rebase`]: super::attempts::Attempts::rebase
fn adopt_current_model(gw: &Gateway, req: &mut RequestState) {
    let fleet = gw.fleet();
    let Some(now) = fleet.models.get(req.model_name()).cloned() else { return };
    if Arc::ptr_eq(&now, &req.model) {
        return;
    }
    let old = std::mem::replace(&mut req.model, now);
    req.attempts.rebase(&old.workers, &req.model.workers);
    req.kv = match (req.kv.take(), &old.kv, &req.model.kv) {
        (Some(inputs), Some(was), Some(kv)) if was.hasher == kv.hasher => Some(inputs.rebased(&req.model, kv)),
        _ => None,
    };
}

/// Healthy, unpaused workers `among` allows that serve `adapter` (when the request names a
/// LoRA adapter) and the leg (prefill workers for a prefill leg, the others for an answer),
/// and why the others are out.
fn eligible(model: &Model, among: Among<'_>, adapter: Option<&str>, role: LegRole) -> (Vec<usize>, Vec<(u32, Exclusion)>) {
    let mut ok = Vec::with_capacity(model.workers.len());
    let mut out = Vec::new();
    for (i, w) in model.workers.iter().enumerate() {
        let left_out = match among {
            Among::Except(list) => list.contains(&i),
            Among::Only(j) => i != j,
        };
        if left_out {
            out.push((i as u32, if matches!(among, Among::Only(_)) { Exclusion::NotTheTarget } else { Exclusion::Tried }));
        } else if model.role(i).answers() != (role == LegRole::Answer) {
            out.push((i as u32, Exclusion::Role));
        } else if !w.is_healthy() {
            out.push((i as u32, Exclusion::Unhealthy));
        } else if adapter.is_some_and(|a| !w.has_adapter(a)) {
            out.push((i as u32, Exclusion::NoAdapter));
        } else if w.is_paused() {
            out.push((i as u32, Exclusion::Paused));
        } else {
            ok.push(i);
        }
    }
    (ok, out)
}

/// Drops busy workers while some are not; all busy on the first attempt refuses the request.
/// Returns the workers to offer and which of them are busy.
fn shed(
    gw: &Gateway,
    req: &RequestState,
    role: LegRole,
    eligible: Vec<usize>,
    excluded: &mut Vec<(u32, Exclusion)>,
) -> Result<(Vec<usize>, Vec<usize>), GatewayError> {
    let model = &req.model;
    let name = model.cfg.name.as_str();
    let thresholds = match (role, model.cfg.disaggregation.prefill_shedding) {
        (LegRole::Prefill, Some(t)) => t,
        _ => gw.thresholds(name),
    };
    if !thresholds.enabled() {
        return Ok((eligible, Vec::new()));
    }
    let (free, busy): (Vec<usize>, Vec<usize>) = eligible.iter().partition(|&&i| {
        let b = model.busy(i, &thresholds);
        gw.metrics.worker_busy.with_label_values(&[name, model.workers[i].label.as_str()]).set(i64::from(b));
        !b
    });
    if free.is_empty() && role == LegRole::Prefill {
        // Not a refusal: the request runs aggregated instead (counted by the caller).
        return Err(GatewayError::AllBusy(name.to_string()));
    }
    if free.is_empty() && req.attempts.count() == 0 {
        gw.metrics.rejections.with_label_values(&[name, req.endpoint.label()]).inc();
        gw.metrics.rejected.with_label_values(&[name, "busy"]).inc();
        return Err(GatewayError::AllBusy(name.to_string()));
    }
    if free.is_empty() {
        return Ok((eligible, busy));
    }
    excluded.extend(busy.iter().map(|&i| (i as u32, Exclusion::Busy)));
    Ok((free, Vec::new()))
}

/// What routing knows about `req` at `now` (µs on the ledger's clock, the decision's one read).
fn summary(req: &RequestState, now: u64) -> RequestSummary<'_> {
    let model = &req.model;
    RequestSummary {
        model: model.cfg.name.as_str(),
        endpoint: req.endpoint.label(),
        request_id: req.id(),
        prompt_tokens: req.prompt_tokens() as u32,
        prompt_blocks: req.kv.as_ref().map_or(0, |k| k.chain.len() as u32),
        block_size: model.cfg.block_size,
        fleet_overlap_blocks: 0,
        fleet_active_overlap_blocks: 0,
        fleet_prefill_load: 0.0,
        arrivals_per_worker_s: model.ledger.arrivals_per_worker_at(now),
        expected_output_tokens: expected_output(req),
        mean_output_tokens: model.ledger.mean_output().unwrap_or(0.0),
        tpot_weight: req.tpot_weight(),
        e2e_weight: model.ledger.e2e_weight().unwrap_or(0.0),
        slo: req.slo,
        headers: req.plugin.as_ref().map_or(&[], |p| &p.headers[..]),
        nvext: req.plugin.as_ref().and_then(|p| p.nvext.as_deref()),
    }
}

/// The output tokens `req` is expected to generate (0: unknown): the client's hint
/// (`nvext.agent_hints.osl`), else its output limit (`max_tokens`, `max_completion_tokens`,
/// `max_output_tokens`) within four times what the model's streams have generated on average
/// (a limit is often a generous cap), else that average.
fn expected_output(req: &RequestState) -> f64 {
    if let Some(osl) = req.view.expected_output() {
        return osl as f64;
    }
    match (req.output_limit, req.model.ledger.mean_output()) {
        (Some(l), Some(m)) => (l as f64).min(4.0 * m),
        (Some(l), None) => l as f64,
        (None, Some(m)) => m,
        (None, None) => 0.0,
    }
}

/// Asks the plugin (if any, with the built-in mode as its fallback) or the built-in mode.
fn decide(gw: &Gateway, req: &RequestState, summary: &RequestSummary<'_>, candidates: &[Candidate]) -> (Decision, DecidedBy) {
    let model = &req.model;
    let builtin: &dyn Policy = match &model.kv {
        Some(k) => &k.policy,
        None => model.policy.as_ref(),
    };
    let Some(p) = req.plugin.as_ref().map(|p| &p.plugin) else {
        return (builtin.choose(summary, candidates), DecidedBy::Builtin(builtin.name()));
    };
    let routed = kvgate_plugins::route(p, summary, candidates, builtin);
    let by = match &routed.failure {
        None if routed.by_plugin => DecidedBy::Plugin(p.name().to_string()),
        None => DecidedBy::Fallback { plugin: p.name().to_string(), mode: builtin.name(), failure: "no opinion".into() },
        Some(f) => {
            gw.metrics.plugin_failures.with_label_values(&[p.name(), f.kind()]).inc();
            // One warning per trip of the breaker, not one per request.
            match (f, p.skipped_for()) {
                (kvgate_plugins::Failure::Skipped(_), _) => {}
                (_, Some(skip)) => {
                    tracing::warn!(plugin = p.name(), error = %f, skip_s = skip.as_secs(), "plugin keeps failing; the fallback mode decides until the skip period ends")
                }
                _ => tracing::debug!(request_id = req.id(), plugin = p.name(), error = %f, "plugin failed; the fallback mode decided"),
            }
            DecidedBy::Fallback { plugin: p.name().to_string(), mode: builtin.name(), failure: f.to_string() }
        }
    };
    (routed.decision, by)
}

/// What a decision leaves for the booking.
#[derive(Clone, Copy)]
struct Decided {
    /// The most blocks any candidate held.
    best_overlap: u32,
    /// The decision's read of the ledger's clock (µs), before it began.
    began: u64,
    /// Whether a plugin took part, which may take milliseconds.
    by_plugin: bool,
    /// The output tokens the request was routed as expected to generate (0: unknown).
    expected_output: f64,
    /// What the `time` cost predicted of the request on the chosen worker.
    predicted: Option<Prediction>,
    /// The leg placed.
    role: LegRole,
}

/// Moves (or makes) the request's booking onto worker `idx` and records the decision metrics.
fn book(gw: &Gateway, req: &mut RequestState, idx: usize, chosen: &Candidate, decided: Decided) {
    let Decided { best_overlap, began, by_plugin, expected_output, predicted, role } = decided;
    let model = &req.model;
    // The booking is stamped with the decision's own clock read where the decision took
    // microseconds (round_robin, random); kv routing times itself and a plugin may take long,
    // so they read the clock again.
    let now = if by_plugin || model.kv.is_some() { kvgate_filters::ledger::clock_us() } else { began };
    let mm = model.metrics(&gw.metrics);
    mm.issued.inc();
    if let Some(d) = mm.decisions.get(idx) {
        d.inc();
    }
    let bs = u64::from(model.cfg.block_size.max(1));
    let prompt_tokens = req.booked_tokens();
    let cached_tokens = (u64::from(chosen.overlap_blocks) * bs).min(prompt_tokens);
    // The time cost also counts a prefix being computed there as cached: book what it
    // predicted the worker computes, so a shared prefix is not booked once per follower.
    #[allow(clippy::cast_sign_loss, reason = "a token count clamped to 0 or more")]
    let prefill_tokens = predicted.map_or(prompt_tokens - cached_tokens, |p| (p.new_tokens.max(0.0) as u64).min(prompt_tokens));
    let prefill_time = predicted.map_or(Duration::ZERO, |p| Duration::from_secs_f64(p.own_ms.max(0.0) / 1000.0));
    // Load shedding counts the blocks its output will fill.
    #[allow(clippy::cast_sign_loss, reason = "a token count clamped to 0 or more")]
    let output_estimate = expected_output.max(0.0) as u64;
    let footprint = match &req.kv {
        // `/tokenize` and `/detokenize` compute nothing worth booking: only the request counts.
        _ if !req.endpoint.infers() => Footprint::default(),
        // A prefill worker holds no decode load (as in Dynamo's KV router: no active-block tracking there).
        _ if role == LegRole::Prefill => Footprint { prefill_tokens, prompt_tokens, prefill_time, ..Footprint::default() },
        Some(k) => {
            mm.overlap.observe(f64::from(chosen.overlap_blocks));
            mm.forgone.observe(f64::from(best_overlap.saturating_sub(chosen.overlap_blocks)));
            let decision_time = Duration::from_micros(now.saturating_sub(began));
            mm.decision_time.observe((decision_time + k.lookup_time).as_secs_f64());
            let hint = req.view.expected_output();
            Footprint { prefill_tokens, chain: k.chain.clone(), private_blocks: 0, prompt_tokens, expected_output: hint, output_estimate, prefill_time }
        }
        // Not tokenized: a prediction (made without the prompt's length) does not count.
        None => Footprint {
            prefill_tokens: prompt_tokens - cached_tokens,
            private_blocks: prompt_tokens / bs,
            prompt_tokens,
            output_estimate,
            ..Footprint::default()
        },
    };
    req.attempts.book(&model.ledger, idx as u16, footprint, now);
}
