//! The rescheduler (Llumnix's; docs/migration.md), every `rescheduling_interval_ms` while
//! `enable_rescheduling` is on: per model, the cluster view (per worker: the load metric, health,
//! staleness of its polled metrics, node and unit labels, the TPOT the gateway measures on its
//! streams, the requests booked on it), the configured policies' pairs (validated: no A→B with
//! B→A), and for each pair the requests that move (rule and order over the source's movable
//! requests), executed as moves (`POST /migrate`'s path, warmed first): pairs concurrently, a
//! pair's requests one after the other, all under `llumlet_grpc_timeout_seconds`. Failed moves are counted in
//! `kvgate_rescheduling_failed_total`; the last cycle is shown by `GET /rescheduling`.
//!
//! The TPOT predictor: the mean inter-token gap the gateway measured on the worker's streams
//! (an EWMA over recent gaps), which already includes the effect of its current batch; a worker
//! with no stream has nothing to predict and counts as idle.

use crate::config::{LoadMetric, Rescheduling};
use crate::fleet::Model;
use crate::gateway::Gateway;
use crate::inflight::{Phase, RequestEntry};
use crate::move_order::{MoveOrder, MoveReason};
use crate::status::{CycleReport, MoveDone, PlannedPair};
use kvgate_filters::reschedule::select::{Candidate, select};
use kvgate_filters::reschedule::{Instance, Order, Pair, Rule, Take, validate};
use kvgate_plugins::ReschedulingPlugin;
use std::sync::Arc;
use std::time::Duration;

/// Runs until the task is aborted.
pub async fn run(gw: Arc<Gateway>) {
    let mut turn = 0usize;
    let mut plugin = PluginState::default();
    loop {
        let cfg = gw.config();
        let r = &cfg.rescheduling;
        tokio::time::sleep(Duration::from_millis(r.rescheduling_interval_ms)).await;
        if !r.enable_rescheduling {
            continue;
        }
        let wasm = plugin.current(&gw, r.plugin.as_ref()).await;
        let fleet = gw.fleet();
        let mut report = Vec::new();
        for name in &fleet.order {
            let model = fleet.models[name].clone();
            report.extend(cycle(&gw, &model, r, wasm.clone(), &mut turn).await);
        }
        *gw.rescheduling_last.lock() = Some(report);
    }
}

/// The rescheduling plugin as last loaded: reloaded when its config entry or its file's
/// modification time changes; a module that does not load is logged and counted once, and the
/// built-in policies go on alone.
#[derive(Default)]
struct PluginState {
    key: Option<(kvgate_plugins::PluginSpec, Option<std::time::SystemTime>)>,
    loaded: Option<Arc<ReschedulingPlugin>>,
}

impl PluginState {
    async fn current(&mut self, gw: &Gateway, entry: Option<&crate::config::PluginConfig>) -> Option<Arc<ReschedulingPlugin>> {
        let Some(entry) = entry else {
            self.key = None;
            self.loaded = None;
            return None;
        };
        let spec = crate::plugins::spec(entry);
        let mtime = std::fs::metadata(&spec.path).and_then(|m| m.modified()).ok();
        let key = Some((spec.clone(), mtime));
        if key != self.key {
            self.key = key;
            let name = spec.name.clone();
            let loaded = tokio::task::spawn_blocking(move || kvgate_plugins::component::compile(&spec).and_then(ReschedulingPlugin::new)).await;
            match loaded {
                Ok(Ok(p)) => {
                    tracing::info!(plugin = name.as_str(), "rescheduling plugin loaded");
                    gw.metrics.plugin_reloads.with_label_values(&[name.as_str(), "ok"]).inc();
                    self.loaded = Some(Arc::new(p));
                }
                Ok(Err(e)) => {
                    tracing::error!(plugin = name.as_str(), error = %e, "rescheduling plugin rejected; the built-in policies run without it");
                    gw.metrics.plugin_reloads.with_label_values(&[name.as_str(), "rejected"]).inc();
                    self.loaded = None;
                }
                Err(e) => tracing::error!(plugin = name.as_str(), error = %e, "rescheduling plugin load panicked"),
            }
        }
        self.loaded.clone()
    }
}

/// One cycle for one model; returns what it decided and how it went.
async fn cycle(gw: &Gateway, model: &Model, r: &Rescheduling, wasm: Option<Arc<ReschedulingPlugin>>, turn: &mut usize) -> Option<CycleReport> {
    // Validated when the config loaded.
    let policies = r.policies().ok()?;
    let live: Vec<Arc<RequestEntry>> = gw.requests.snapshot().into_iter().filter(|e| *e.model == *model.cfg.name).collect();
    let mut pairs = Vec::new();
    for c in &policies {
        let view = view(model, r, c.metric.unwrap_or(LoadMetric::KvCacheUsageRatioProjected));
        pairs.extend(c.policy.pairs(&view, turn).into_iter().map(|(src, dst)| Pair { policy: c.name.to_string(), src, dst, take: r.take(&c.policy) }));
    }
    if let Some(p) = wasm {
        pairs.extend(plugin_pairs(gw, model, r, &live, p).await);
    }
    let pairs = validate(pairs);
    // Pairs run at once; within a pair the requests move one after the other (as a llumlet
    // migrates a pair's requests), so a destination warms and takes one continuation at a time
    // and no move's pause includes another's prefill. One deadline covers the cycle.
    let until = tokio::time::Instant::now() + Duration::from_secs(r.llumlet_grpc_timeout_seconds);
    let mut runs = tokio::task::JoinSet::new();
    // A request moves at most once per cycle, whichever pairs would take it.
    let mut taken = std::collections::HashSet::new();
    for p in &pairs {
        let policy = policies.iter().find(|c| c.name == p.policy).map_or("plugin", |c| c.name);
        let ids: Vec<String> = chosen(model, &live, p, gw.config().migration.limit).into_iter().filter(|id| taken.insert(id.clone())).collect();
        let entries: Vec<Arc<RequestEntry>> = ids.iter().filter_map(|id| live.iter().find(|e| e.id() == id).cloned()).collect();
        let (src, dst, to) = (p.src, p.dst, model.workers[p.dst as usize].clone());
        runs.spawn(async move {
            let mut out = Vec::with_capacity(entries.len());
            for entry in entries {
                let outcome = move_one(&entry, &to, policy, until).await;
                out.push((policy, src, dst, entry.id().to_string(), outcome));
            }
            out
        });
    }
    let mut results = Vec::new();
    while let Some(r) = runs.join_next().await {
        results.extend(r.unwrap_or_default());
    }
    let mut done = Vec::new();
    for (policy, src, dst, id, outcome) in results {
        if outcome != "ok" {
            gw.metrics.rescheduling_failed.with_label_values(&[model.cfg.name.as_str(), policy]).inc();
        }
        done.push(MoveDone { policy, from: src, to: dst, request_id: id, outcome });
    }
    let planned = pairs.iter().map(|p| PlannedPair { policy: p.policy.clone(), from: p.src, to: p.dst }).collect();
    Some(CycleReport { model: model.cfg.name.clone(), pairs: planned, moves: done })
}

/// Orders one request to `to` and waits for the answer until `until`.
async fn move_one(entry: &RequestEntry, to: &Arc<crate::fleet::Worker>, policy: &'static str, until: tokio::time::Instant) -> String {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let order = MoveOrder { to: Some(to.clone()), reason: MoveReason::Rescheduler(policy), reply: tx };
    if tokio::time::Instant::now() >= until {
        return "the cycle's deadline passed".into();
    }
    let Ok(ticket) = entry.mailbox.post(order) else { return "another move is pending, or the request ended".into() };
    match tokio::time::timeout_at(until, rx).await {
        Ok(Ok(Ok(_))) => "ok".into(),
        Ok(Ok(Err(e))) => e.to_string(),
        Ok(Err(_)) => "the request ended".into(),
        Err(_) => {
            entry.mailbox.withdraw(ticket, crate::move_order::MoveRefused::NotNow("timed out"));
            "timed out".into()
        }
    }
}

/// The workers as the policies see them: those that serve answers (a prefill worker holds no
/// stream and takes none, so rescheduling runs between decode workers only).
fn view(model: &Model, r: &Rescheduling, metric: LoadMetric) -> Vec<Instance> {
    let stale_after = Duration::from_secs(r.instance_staleness_seconds);
    let now = kvgate_filters::ledger::clock_us();
    model
        .workers
        .iter()
        .enumerate()
        .filter(|&(i, _)| model.role(i).answers())
        .map(|(i, w)| {
            // What routing sees of it: reported usage (fullest rank), capacity, bookings.
            let c = model.candidate(i, false, now);
            let tpot_ms = model.predicted_tpot_ms(i, &c);
            let load = match (metric, c.total_blocks) {
                // Prefill the gateway booked and the worker has not cached yet.
                (LoadMetric::KvCacheUsageRatioProjected, t) if t > 0 => {
                    c.kv_usage + c.active_prefill_tokens as f64 / (t as f64 * f64::from(model.cfg.block_size.max(1)))
                }
                (LoadMetric::PredictedTpotRatio, _) => tpot_ms.unwrap_or(0.0) / r.tpot_slo,
                _ => c.kv_usage,
            };
            let wc = model.cfg.workers.get(i);
            Instance {
                id: i as u32,
                load,
                // A paused or sleeping worker takes no stream: to the rescheduler it is down.
                healthy: c.healthy && !w.is_paused(),
                stale: w.report_age().is_some_and(|a| a > stale_after),
                node: wc.and_then(|c| c.node.clone()),
                unit: wc.and_then(|c| c.unit.clone()),
                tpot_ms,
                decode_batch: f64::from(c.in_flight),
            }
        })
        .collect()
}

/// The ids a pair moves: the source's streams that may move, by the pair's rule and order.
fn chosen(model: &Model, live: &[Arc<RequestEntry>], p: &Pair, limit: u32) -> Vec<String> {
    let src = &model.workers[p.src as usize];
    let candidates: Vec<Candidate> = live
        .iter()
        .enumerate()
        .filter(|(_, e)| e.stream && e.pinned().is_none() && e.moves() < u64::from(limit))
        .filter(|(_, e)| matches!(e.phase(), Phase::Running | Phase::Waiting) && e.worker().is_some_and(|w| Arc::ptr_eq(&w, src)))
        .map(|(i, e)| Candidate { id: e.id().to_string(), tokens: e.tokens(), arrival: i as u64, waiting: e.phase() == Phase::Waiting })
        .collect();
    let kv_tokens = model.candidate(p.src as usize, false, kvgate_filters::ledger::clock_us()).total_blocks * u64::from(model.cfg.block_size);
    select(&candidates, p.take, kv_tokens)
}

/// The plugin's pairs for this cycle, on the blocking pool (a call is bounded by the plugin's
/// `timeout_ms`). A failing call yields none, and is counted as the routing plugins' are.
async fn plugin_pairs(gw: &Gateway, model: &Model, r: &Rescheduling, live: &[Arc<RequestEntry>], p: Arc<ReschedulingPlugin>) -> Vec<Pair> {
    let instances = view(model, r, r.rescheduling_neutral_load_metric);
    let now = kvgate_filters::ledger::clock_us();
    let workers = instances
        .iter()
        .map(|i| {
            let w = &model.workers[i.id as usize];
            let c = model.candidate(i.id as usize, false, now);
            let running = live
                .iter()
                .filter(|e| e.worker().is_some_and(|cur| Arc::ptr_eq(&cur, w)))
                .map(|e| kvgate_plugins::Running {
                    id: e.id().to_string(),
                    tokens: e.tokens().min(u64::from(u32::MAX)) as u32,
                    age_ms: e.age().as_millis() as u64,
                    priority: e.priority as i32,
                    waiting: e.phase() == Phase::Waiting,
                })
                .collect();
            kvgate_plugins::WorkerLoad {
                id: i.id,
                load: i.load,
                kv_usage: c.kv_usage,
                total_blocks: c.total_blocks,
                active_blocks: c.active_blocks,
                waiting: c.waiting,
                healthy: i.healthy && !i.stale,
                running,
            }
        })
        .collect();
    let view = kvgate_plugins::ClusterView { model: model.cfg.name.clone(), workers };
    let name = p.name().to_string();
    let answer = tokio::task::spawn_blocking(move || p.reschedule(&view)).await;
    match answer {
        Ok(Ok(migrations)) => migrations
            .into_iter()
            .map(|m| Pair {
                policy: "plugin".into(),
                src: m.source,
                dst: m.destination,
                take: Take::Amount { rule: rule(m.rule), order: order(m.order), value: m.value },
            })
            .collect(),
        Ok(Err(f)) => {
            gw.metrics.plugin_failures.with_label_values(&[name.as_str(), f.kind()]).inc();
            tracing::debug!(plugin = name.as_str(), error = %f, "rescheduling plugin failed; its pairs are skipped this cycle");
            Vec::new()
        }
        Err(_) => Vec::new(),
    }
}

fn rule(r: kvgate_plugins::SelectRule) -> Rule {
    match r {
        kvgate_plugins::SelectRule::NumReq => Rule::NumReq,
        kvgate_plugins::SelectRule::Token => Rule::Token,
        kvgate_plugins::SelectRule::Ratio => Rule::Ratio,
    }
}

fn order(o: kvgate_plugins::SelectOrder) -> Order {
    match o {
        kvgate_plugins::SelectOrder::Lcr => Order::Lcr,
        kvgate_plugins::SelectOrder::Fcr => Order::Fcr,
        kvgate_plugins::SelectOrder::Lr => Order::Lr,
        kvgate_plugins::SelectOrder::Sr => Order::Sr,
        kvgate_plugins::SelectOrder::Fcw => Order::Fcw,
        kvgate_plugins::SelectOrder::Fcwsr => Order::Fcwsr,
    }
}
