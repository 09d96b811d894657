//! `kvgate-bench replicas`: several kvgate processes in front of one fleet, each request sent
//! to one of them at random as an L4 load balancer does (docs/replicas.md). Each case runs the
//! same workload on fresh workers:
//!
//! - `one`: a single kvgate, the reference;
//! - `shared`: replicas sharing their bookings over a real `nats-server` (`cluster:`);
//! - `unshared`: the same replicas without `cluster:`, each seeing only its own bookings;
//! - `kill`: `shared`, and halfway through the leader is killed (SIGKILL) and taken out of the
//!   balancer;
//! - `kill-follower`: the same with a replica that does not lead;
//! - `nats`: `shared`, and halfway through `nats-server` is killed and started again 2 s later.
//!
//! While a shared case runs, every replica's view of each worker's requests in flight is
//! sampled against the sum of the replicas' own bookings, and after it every view must be
//! exactly zero.

use crate::cluster::{SimOptions, SimWorker, spawn_kvgate_for, start_sims};
use crate::load::report::{Report, Slo};
use crate::load::workload::{Api, Workload};
use crate::load::{RunOptions, Spread, run};
use kvgate_tests::nats::NatsServer;
use kvgate_tests::prom::Metrics;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One case (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// One kvgate.
    One,
    /// Replicas sharing over NATS.
    Shared,
    /// Replicas without sharing.
    Unshared,
    /// Shared; the leader killed halfway.
    Kill,
    /// Shared; a replica that does not lead killed halfway.
    KillFollower,
    /// Shared; NATS killed halfway and restarted.
    Nats,
}

impl Case {
    /// Its name on the command line.
    pub fn parse(s: &str) -> Result<Case, String> {
        Ok(match s {
            "one" => Case::One,
            "shared" => Case::Shared,
            "unshared" => Case::Unshared,
            "kill" => Case::Kill,
            "kill-follower" => Case::KillFollower,
            "nats" => Case::Nats,
            _ => return Err(format!("unknown case {s:?} (one, shared, unshared, kill, kill-follower, nats)")),
        })
    }

    fn label(self, n: usize) -> String {
        match self {
            Case::One => "1 replica".into(),
            Case::Shared => format!("{n} replicas, shared"),
            Case::Unshared => format!("{n} replicas, not shared"),
            Case::Kill => format!("{n} replicas, shared, leader killed"),
            Case::KillFollower => format!("{n} replicas, shared, a follower killed"),
            Case::Nats => format!("{n} replicas, shared, NATS restarted"),
        }
    }

    fn shares(self) -> bool {
        matches!(self, Case::Shared | Case::Kill | Case::KillFollower | Case::Nats)
    }
}

/// What the cases run on.
pub struct Options {
    /// Workers.
    pub workers: usize,
    /// Replicas in the multi-replica cases.
    pub replicas: usize,
    /// The workers.
    pub sims: SimOptions,
    /// The kvgate binary.
    pub kvgate_bin: PathBuf,
    /// The model, and extra lines of the model's entry (its tokenizer).
    pub model: String,
    /// More lines of the model's entry.
    pub model_extra: String,
    /// Goodput's objective.
    pub slo: Slo,
    /// A progress bar.
    pub progress: bool,
    /// The sessions' API.
    pub api: Api,
    /// Where each replica's log goes.
    pub logs: PathBuf,
}

/// Runs every case in turn; the reports and a note per case.
pub async fn run_cases(o: &Options, cases: &[Case], w: &Workload, halfway: Duration) -> Result<(Vec<Report>, Vec<String>), String> {
    let mut reports = Vec::new();
    let mut notes = Vec::new();
    for &case in cases {
        let (report, note) = run_case(o, case, w, halfway).await?;
        eprintln!("kvgate-bench: {note}");
        reports.push(report);
        notes.push(note);
    }
    Ok((reports, notes))
}

/// The replicas of one case, and the NATS server they share.
struct Fleet {
    nats: parking_lot::Mutex<Option<NatsServer>>,
    /// Per replica: its process, public and admin URLs, name.
    replicas: Vec<Replica>,
    _sims: crate::cluster::Procs,
    workers: Vec<SimWorker>,
}

struct Replica {
    child: Option<Child>,
    url: String,
    admin: String,
    name: String,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for r in &mut self.replicas {
            if let Some(mut c) = r.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

async fn start(o: &Options, case: Case) -> Result<Fleet, String> {
    let mut sims = crate::cluster::Procs::default();
    let workers = start_sims(&mut sims, &o.sims, o.workers).await?;
    let nats = case.shares().then(NatsServer::start);
    let n = if case == Case::One { 1 } else { o.replicas };
    let mut replicas = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("r{i}");
        let top = nats.as_ref().map_or_else(String::new, |s| format!("cluster:\n  nats_url: {}\n  replica: {name}\n", s.url()));
        let log = o.logs.join(format!("{}-{name}.log", slug(&case.label(n))));
        let (child, gw) = spawn_kvgate_for(&o.kvgate_bin, &top, (&o.model, "mode: kv", &o.model_extra), &workers, Some(&log)).await?;
        replicas.push(Replica { child: Some(child), url: gw.url, admin: gw.admin, name });
    }
    let fleet = Fleet { nats: parking_lot::Mutex::new(nats), replicas, _sims: sims, workers };
    if case.shares() {
        fleet.formed(Duration::from_secs(20)).await?;
    }
    Ok(fleet)
}

fn slug(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

impl Fleet {
    /// Waits until every live replica sees all the others and one leads.
    async fn formed(&self, limit: Duration) -> Result<(), String> {
        let http = reqwest::Client::new();
        let start = Instant::now();
        let live: Vec<&Replica> = self.replicas.iter().filter(|r| r.child.is_some()).collect();
        loop {
            let mut ok = true;
            let mut leaders = 0;
            for r in &live {
                let v = get(&http, &format!("{}/cluster", r.admin)).await;
                ok &= v["peers"].as_array().is_some_and(|p| p.len() + 1 == live.len());
                leaders += usize::from(v["leads"] == true);
            }
            if ok && leaders == 1 {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(format!("the replicas did not form one deployment with one leader within {limit:?}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Requests in flight per worker URL as each live replica sees them, and as it booked them
    /// itself.
    async fn views(&self, http: &reqwest::Client) -> Vec<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        for r in self.replicas.iter().filter(|r| r.child.is_some()) {
            let v = get(http, &format!("{}/workers", r.admin)).await;
            let ws = v["models"][0]["workers"].as_array().cloned().unwrap_or_default();
            out.push(
                ws.iter()
                    .map(|w| {
                        let all = w["in_flight"].as_u64().unwrap_or(0);
                        (all, all.saturating_sub(w["peer_in_flight"].as_u64().unwrap_or(0)))
                    })
                    .collect(),
            );
        }
        out
    }
}

async fn get(http: &reqwest::Client, url: &str) -> Value {
    match http.get(url).send().await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// How the replicas' views of the fleet agreed while the case ran.
#[derive(Debug, Default)]
struct Agreement {
    samples: usize,
    /// Samples where every replica's view of every worker equalled the sum of their own
    /// bookings.
    exact: usize,
    /// The largest difference seen, in requests.
    worst: u64,
}

/// Samples the views every 20 ms until `stop`.
async fn sample(fleet: &Fleet, stop: tokio::sync::watch::Receiver<bool>) -> Agreement {
    let http = reqwest::Client::new();
    let mut a = Agreement::default();
    while !*stop.borrow() {
        let views = fleet.views(&http).await;
        if views.len() > 1 && views.iter().all(|v| v.len() == views[0].len()) {
            let truth: Vec<u64> = (0..views[0].len()).map(|w| views.iter().map(|v| v[w].1).sum()).collect();
            let diff = views.iter().flat_map(|v| v.iter().zip(&truth).map(|((all, _), t)| all.abs_diff(*t))).max().unwrap_or(0);
            a.samples += 1;
            a.exact += usize::from(diff == 0);
            a.worst = a.worst.max(diff);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a
}

async fn run_case(o: &Options, case: Case, w: &Workload, halfway: Duration) -> Result<(Report, String), String> {
    let mut fleet = start(o, case).await?;
    let n = fleet.replicas.len();
    let label = case.label(n);
    let spread = Spread::new(fleet.replicas.iter().map(|r| r.url.clone()).collect());
    let ro = RunOptions {
        label: label.clone(),
        url: fleet.replicas[0].url.clone(),
        model: o.model.clone(),
        worker_urls: fleet.workers.iter().map(|w| w.url.clone()).collect(),
        slo: o.slo,
        progress: o.progress,
        api: o.api,
        spread: Some(spread.clone()),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let fleet_ref = &fleet;
    let agreement = async { if case.shares() { Some(sample(fleet_ref, stop_rx).await) } else { None } };
    let event = async {
        tokio::time::sleep(halfway).await;
        match case {
            Case::Kill => Some(kill(fleet_ref, &spread, true).await),
            Case::KillFollower => Some(kill(fleet_ref, &spread, false).await),
            Case::Nats => Some(restart_nats(fleet_ref).await),
            _ => None,
        }
    };
    let work = async {
        let r = run(&ro, w).await;
        let _ = stop_tx.send(true);
        r
    };
    let (report, agreement, event) = tokio::join!(work, agreement, event);
    let mut note = format!("{label}: {} requests, {} failed", report.requests, report.requests - report.ok);
    let failures = spread.failures();
    if !failures.is_empty() {
        let by: Vec<String> = failures.iter().map(|(u, c)| format!("{c} at {u}")).collect();
        let _ = write!(note, " ({})", by.join(", "));
    }
    if let Some(a) = agreement {
        let _ = write!(
            note,
            "; views equal to the sum of the replicas' own bookings in {} of {} samples (every 20 ms), largest difference {} requests",
            a.exact, a.samples, a.worst
        );
        note.push_str(&lag_and_zero(&mut fleet).await);
    }
    if let Some(Ok(e)) | Some(Err(e)) = event {
        note.push_str("; ");
        note.push_str(&e);
    }
    Ok((report, note))
}

/// After a shared case: each replica's publish-to-apply lag (its histogram, upper bound of
/// the bucket holding the 99th percentile) and whether every view reached exactly zero.
async fn lag_and_zero(fleet: &mut Fleet) -> String {
    let http = reqwest::Client::new();
    let mut lags = Vec::new();
    let mut resyncs = 0.0;
    for r in fleet.replicas.iter().filter(|r| r.child.is_some()) {
        let text = http.get(format!("{}/metrics", r.admin)).send().await.ok();
        let Some(text) = text else { continue };
        let m = Metrics::parse(&text.text().await.unwrap_or_default());
        lags.push(format!("{} {}", r.name, p99_bucket(&m, "kvgate_cluster_lag_seconds").map_or("n/a".into(), |s| format!("≤ {:.1} ms", s * 1000.0))));
        resyncs += m.sum("kvgate_cluster_resyncs_total", &[]);
    }
    let start = Instant::now();
    let zero = loop {
        let views = fleet.views(&http).await;
        if views.iter().all(|v| v.iter().all(|(all, _)| *all == 0)) {
            break Some(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(10) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let zero =
        zero.map_or("NOT every view at zero 10 s after the run".to_string(), |t| format!("every view exactly 0 after the run (within {} ms)", t.as_millis()));
    format!("; publish-to-apply lag p99: {}; resyncs {resyncs}; {zero}", lags.join(", "))
}

/// The upper bound of the histogram bucket holding its 99th percentile, s.
fn p99_bucket(m: &Metrics, name: &str) -> Option<f64> {
    let bucket = format!("{name}_bucket");
    let mut bounds: Vec<(f64, f64)> = Vec::new();
    for s in m.samples.iter().filter(|s| s.name == bucket) {
        let le = s.labels.get("le")?;
        let b = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
        match bounds.iter_mut().find(|(x, _)| x.total_cmp(&b).is_eq()) {
            Some(e) => e.1 += s.value,
            None => bounds.push((b, s.value)),
        }
    }
    bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = bounds.last()?.1;
    if total <= 0.0 {
        return None;
    }
    bounds.iter().find(|(_, c)| *c >= 0.99 * total).map(|(b, _)| *b)
}

/// Kills the leader (`leader`) or a replica that does not lead with SIGKILL, takes it out of
/// the balancer, and times how long its bookings stay in the others' views and how long until
/// exactly one of the others leads.
async fn kill(fleet: &Fleet, spread: &Arc<Spread>, leader: bool) -> Result<String, String> {
    let http = reqwest::Client::new();
    let mut chosen = None;
    for (i, r) in fleet.replicas.iter().enumerate() {
        if (get(&http, &format!("{}/cluster", r.admin)).await["leads"] == true) == leader {
            chosen = Some(i);
        }
    }
    let i = chosen.ok_or("no such replica")?;
    let r = &fleet.replicas[i];
    let pid = r.child.as_ref().map(Child::id).ok_or("not running")?;
    let killed = Instant::now();
    let ok = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().is_ok_and(|s| s.success());
    if !ok {
        return Err(format!("kill -9 {pid} failed"));
    }
    spread.remove(&r.url);
    let others: Vec<&Replica> = fleet.replicas.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, r)| r).collect();
    let (mut dropped, mut led) = (None, None);
    while killed.elapsed() < Duration::from_secs(30) && (dropped.is_none() || led.is_none()) {
        let mut seen_by = 0;
        let mut leads = 0;
        for o in &others {
            let v = get(&http, &format!("{}/cluster", o.admin)).await;
            seen_by += usize::from(v["peers"].as_array().is_some_and(|p| p.iter().any(|p| p["replica"] == r.name.as_str())));
            leads += usize::from(v["leads"] == true);
        }
        if dropped.is_none() && seen_by == 0 {
            dropped = Some(killed.elapsed());
        }
        if led.is_none() && leads == 1 {
            led = Some(killed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ms = |d: Option<Duration>| d.map_or("never (30 s)".into(), |d| format!("{} ms", d.as_millis()));
    let what = if leader { "leader" } else { "follower" };
    Ok(format!(
        "{what} {} killed (SIGKILL) halfway: its bookings left the others' views after {}, one of the others led after {}",
        r.name,
        ms(dropped),
        ms(led)
    ))
}

/// Kills `nats-server`, starts it again 2 s later on the same port, and times until every
/// replica sees all the others again.
async fn restart_nats(fleet: &Fleet) -> Result<String, String> {
    fleet.nats.lock().as_mut().ok_or("no NATS")?.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    fleet.nats.lock().as_mut().ok_or("no NATS")?.restart();
    let back = Instant::now();
    fleet.formed(Duration::from_secs(30)).await?;
    Ok(format!(
        "nats-server killed (SIGKILL) halfway and started again 2 s later: one deployment with one leader again {} ms after it was back",
        back.elapsed().as_millis()
    ))
}
