//! The cluster task (docs/replicas.md): with `cluster:` set, connects to NATS and keeps this
//! replica's part in its deployment, in four loops that end together (the supervisor then
//! starts the task again):
//!
//! - load: publishes this replica's own bookings when they change and all of them every
//!   heartbeat, applies its peers' to the ledger (`WorkerCounters::peers`), drops silent peers,
//!   and after a reconnection asks every peer for its whole picture (a resync);
//! - lease: takes or renews the leader's lease ([`crate::cluster::lease`]);
//! - affinity: shares the stored responses this replica relayed and learns the peers';
//! - asks: answers the admin requests peers forward about requests this replica holds;
//! - decisions: shares approximate mode's routing decisions and records the peers';
//! - chains: shares the prompt chains this replica books and releases, and applies the peers'
//!   to each model's ledger ([`crate::cluster::chains`]);
//! - tenants: shares what this replica's tenants used and hold, and charges the peers' to the
//!   tenants' accounts ([`crate::cluster::tenants`]).
//!
//! Without `cluster:` the task waits forever and costs nothing.

use crate::cluster::wire::{Ask, Chains, Decisions, LoadMessage, WorkerLoad, unix_us};
use crate::cluster::{Shared, affinity, chains};
use crate::gateway::Gateway;
use async_nats::connection::State;
use async_nats::jetstream::{self, kv};
use futures_util::StreamExt;
use kvgate_filters::ledger::clock_us;
use kvgate_filters::ledger::peers::OwnLoad;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs until the task is aborted, or until a loop ends (NATS refused a subscription).
pub async fn run(gw: Arc<Gateway>) {
    let Some(s) = gw.cluster.shared().cloned() else { return std::future::pending().await };
    let client = match connect(&s).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cluster: cannot use nats_url");
            return;
        }
    };
    *s.client.lock() = Some(client.clone());
    tokio::select! {
        () = load(&gw, &s, &client) => {}
        () = lease(&s, &client) => {}
        () = share_affinity(&gw, &s, &client) => {}
        () = answer_asks(&gw, &s, &client) => {}
        () = share_decisions(&gw, &s, &client) => {}
        () = share_chains(&gw, &s, &client) => {}
        () = share_tenants(&gw, &s, &client) => {}
    }
}

/// A client that connects in the background and reconnects for ever, soon after NATS is back.
async fn connect(s: &Shared) -> Result<async_nats::Client, async_nats::ConnectError> {
    let servers: Vec<async_nats::ServerAddr> = s.cfg.servers().iter().filter_map(|u| u.parse().ok()).collect();
    async_nats::ConnectOptions::new()
        .name(format!("kvgate {}", s.replica))
        .retry_on_initial_connect()
        // A replica's own messages are of no use to it: not sent back, not parsed.
        .no_echo()
        .max_reconnects(None)
        .reconnect_delay_callback(|attempts| Duration::from_millis((100 * attempts as u64).min(1_000)))
        .connect(servers)
        .await
}

fn connected(client: &async_nats::Client) -> bool {
    client.connection_state() == State::Connected
}

/// The load loop (module doc).
async fn load(gw: &Arc<Gateway>, s: &Arc<Shared>, client: &async_nats::Client) {
    let (Ok(mut loads), Ok(mut hellos)) = (client.subscribe(s.subjects.load.clone()).await, client.subscribe(s.subjects.hello.clone()).await) else {
        return;
    };
    let heartbeat = Duration::from_millis(s.cfg.heartbeat_ms);
    let mut tick = tokio::time::interval(Duration::from_millis(s.cfg.publish_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut out = Outgoing {
        fleet: None,
        workers: Vec::new(),
        published: Vec::new(),
        admin: gw.config().admin_listen.to_string(),
        last_full: None,
        full_due: true,
        was_connected: false,
        ever_connected: false,
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {
                out.tick(gw, s, client, heartbeat).await;
                expire(gw, s);
            }
            m = loads.next() => match m {
                Some(m) => apply(gw, s, &m.payload),
                None => return,
            },
            h = hellos.next() => match h {
                Some(h) if *h.payload != *s.replica.as_bytes() => out.full_due = true,
                Some(_) => {}
                None => return,
            },
        }
    }
}

/// What this replica has published of its own bookings.
struct Outgoing {
    /// The fleet `workers` was read from.
    fleet: Option<Arc<crate::fleet::Fleet>>,
    /// Each distinct worker URL of that fleet, the ledger it is read from and its index there
    /// (a worker several models share counts once, with the first model's ledger).
    workers: Vec<(String, Arc<kvgate_filters::ledger::Ledger>, u16)>,
    /// Per entry of `workers`, as last published.
    published: Vec<OwnLoad>,
    /// This replica's admin listener, as its peers show it.
    admin: String,
    last_full: Option<Instant>,
    /// Publish everything at the next tick (a heartbeat, a peer's hello, a reconnection).
    full_due: bool,
    was_connected: bool,
    ever_connected: bool,
}

impl Outgoing {
    async fn tick(&mut self, gw: &Gateway, s: &Shared, client: &async_nats::Client, heartbeat: Duration) {
        let up = connected(client);
        s.metrics.connected.set(i64::from(up));
        if up && !self.was_connected {
            // Joined or back: every peer's whole picture, and ours to them.
            if self.ever_connected {
                s.metrics.resyncs.inc();
            }
            self.ever_connected = true;
            self.full_due = true;
            send(s, client, &s.subjects.hello, s.replica.clone().into_bytes()).await;
        }
        self.was_connected = up;
        if !up {
            return;
        }
        if self.last_full.is_none_or(|t| t.elapsed() >= heartbeat) {
            self.full_due = true;
        }
        // A new fleet: what the peers hold of the old one is replaced by a whole picture.
        self.full_due |= self.refresh(gw, s);
        let now = clock_us();
        let own: Vec<OwnLoad> = self.workers.iter().map(|(_, ledger, i)| ledger.own(*i, now)).collect();
        let full = std::mem::take(&mut self.full_due);
        let workers: Vec<WorkerLoad> = self
            .workers
            .iter()
            .zip(&own)
            .zip(&self.published)
            .filter(|((_, load), was)| if full { **load != OwnLoad::default() } else { load.differs(was) })
            .map(|(((url, _, _), load), _)| WorkerLoad { url: url.clone(), load: *load })
            .collect();
        if !full && workers.is_empty() {
            return;
        }
        let m = LoadMessage { replica: s.replica.clone(), instance: s.instance.clone(), full, sent_us: unix_us(), admin: self.admin.clone(), workers };
        let Ok(payload) = serde_json::to_vec(&m) else { return };
        if send(s, client, &s.subjects.load, payload).await {
            if full {
                self.published = own;
                self.last_full = Some(Instant::now());
            } else {
                // Only what went out: a drift below the threshold adds up until it is news.
                for (was, now) in self.published.iter_mut().zip(own) {
                    if now.differs(was) {
                        *was = now;
                    }
                }
            }
        } else {
            self.full_due = full;
        }
    }

    /// Reads the fleet's workers again when the fleet was replaced, and has each model's
    /// ledger share the chains it books; whether the fleet was replaced.
    fn refresh(&mut self, gw: &Gateway, s: &Shared) -> bool {
        let fleet = gw.fleet();
        if self.fleet.as_ref().is_some_and(|f| Arc::ptr_eq(f, &fleet)) {
            return false;
        }
        let mut seen = HashSet::new();
        self.workers.clear();
        for name in &fleet.order {
            let m = &fleet.models[name];
            let sink = chains::Sink {
                model: m.name.clone(),
                workers: m.workers.iter().map(|w| Arc::from(w.url.to_string())).collect(),
                outbox: s.chains.clone(),
                dropped: s.metrics.chains_dropped.clone(),
            };
            m.ledger.share_chains(Arc::new(sink));
            for (i, w) in m.workers.iter().enumerate() {
                let url = w.url.to_string();
                if seen.insert(url.clone()) {
                    self.workers.push((url, m.ledger.clone(), i as u16));
                }
            }
        }
        self.published = vec![OwnLoad::default(); self.workers.len()];
        self.fleet = Some(fleet);
        true
    }
}

/// Applies a peer's load message.
fn apply(gw: &Gateway, s: &Shared, payload: &[u8]) {
    let Ok(m) = serde_json::from_slice::<LoadMessage>(payload) else { return };
    if m.replica == s.replica {
        if m.instance != s.instance && !s.name_clash.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::error!(replica = %m.replica, "cluster: another process publishes under this replica's name; its bookings are not counted (names must differ)");
        }
        return;
    }
    let lag = unix_us().saturating_sub(m.sent_us) as f64 / 1e6;
    s.metrics.lag.observe(lag);
    let changed = s.members.lock().apply(m, Instant::now());
    set_sums(gw, s, &changed);
}

/// Drops silent peers, and every heartbeat sets every worker's sum again (workers a reload
/// added, backlogs run down).
fn expire(gw: &Gateway, s: &Shared) {
    let now = Instant::now();
    let (gone, urls) = s.members.lock().expire(Duration::from_millis(s.cfg.peer_timeout_ms), now);
    if gone > 0 {
        tracing::warn!(peers = gone, "cluster: peers fell silent; their bookings leave this replica's view");
        s.metrics.expired.inc_by(gone as u64);
        set_sums(gw, s, &urls);
    }
    s.metrics.peers.set(i64::try_from(s.members.lock().len()).unwrap_or(i64::MAX));
}

/// Sets, on every worker of the fleet whose URL is in `urls`, what the peers booked there.
fn set_sums(gw: &Gateway, s: &Shared, urls: &HashSet<String>) {
    if urls.is_empty() {
        return;
    }
    let fleet = gw.fleet();
    let members = s.members.lock();
    let (now, at) = (Instant::now(), clock_us());
    for name in &fleet.order {
        for w in fleet.models[name].workers.iter() {
            let url = w.url.to_string();
            if urls.contains(&url) {
                w.booked.peers().set(&members.sum(&url, now), at);
            }
        }
    }
}

/// The lease loop (module doc).
async fn lease(s: &Shared, client: &async_nats::Client) {
    let js = jetstream::new(client.clone());
    let max_age = Duration::from_millis(s.cfg.lease_ms);
    let mut store = None;
    let mut tick = tokio::time::interval(Duration::from_millis(s.cfg.heartbeat_ms));
    loop {
        tick.tick().await;
        if !connected(client) {
            s.lease.lock().drop_held();
            store = None;
        } else {
            if store.is_none() {
                store = bucket(&js, &s.subjects.lease_bucket, max_age).await.inspect_err(|e| tracing::warn!(error = %e, "cluster: lease bucket")).ok();
            }
            if let Some(kv) = &store {
                let mut lease = s.lease.lock().clone();
                let reached = lease.step(kv, &s.replica).await;
                *s.lease.lock() = lease;
                if !reached {
                    // The bucket is gone (a NATS without storage restarted): make it again.
                    store = None;
                }
            }
        }
        s.metrics.leader.set(i64::from(s.acts(Instant::now())));
    }
}

/// The affinity loop (module doc).
async fn share_affinity(gw: &Gateway, s: &Shared, client: &async_nats::Client) {
    let mut outbox = s.inbox.lock().await;
    let js = jetstream::new(client.clone());
    let max_age = Duration::from_secs(s.cfg.affinity_ttl_s);
    let pause = Duration::from_millis(s.cfg.heartbeat_ms);
    loop {
        let watched = match bucket(&js, &s.subjects.affinity_bucket, max_age).await {
            Ok(kv) => kv.watch_with_history(">").await.map(|w| (kv, w)),
            Err(e) => {
                tracing::debug!(error = %e, "cluster: stored-responses bucket not ready");
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        let Ok((store, mut watch)) = watched else {
            tokio::time::sleep(pause).await;
            continue;
        };
        loop {
            tokio::select! {
                e = watch.next() => match e {
                    Some(Ok(entry)) if entry.operation == kv::Operation::Put => learn(gw, &entry.key, &entry.value),
                    Some(Ok(_)) => {}
                    Some(Err(_)) | None => break,
                },
                Some((id, url)) = outbox.recv() => {
                    let put = tokio::time::timeout(pause, store.put(affinity::key(&id), url.into_bytes().into())).await;
                    if !matches!(put, Ok(Ok(_))) {
                        s.metrics.publish_failures.inc();
                    }
                }
            }
        }
        tokio::time::sleep(pause).await;
    }
}

/// The key-value bucket `name` whose entries expire after `max_age`, made if missing. The
/// stream is made as the client's `create_key_value` would make it (one entry per key, a
/// rolled-up history, direct gets), without first asking for the account's details: the
/// client reads those in a newer server's shape than the 2.9 servers Debian ships.
async fn bucket(js: &jetstream::Context, name: &str, max_age: Duration) -> Result<kv::Store, async_nats::Error> {
    let stream = jetstream::stream::Config {
        name: format!("KV_{name}"),
        subjects: vec![format!("$KV.{name}.>")],
        max_messages_per_subject: 1,
        max_age,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: jetstream::stream::DiscardPolicy::New,
        num_replicas: 1,
        ..Default::default()
    };
    let made = js.get_or_create_stream(stream.clone()).await?;
    // A bucket made earlier with another age (another lease_ms) takes this one: the lease's
    // safety rests on it.
    if made.cached_info().config.max_age != max_age {
        js.update_stream(stream).await?;
    }
    Ok(js.get_key_value(name).await?)
}

/// A stored response a replica shared: remembered here as if this replica had relayed it.
fn learn(gw: &Gateway, key: &str, value: &[u8]) {
    let (Some(id), Ok(url)) = (affinity::id(key), std::str::from_utf8(value)) else { return };
    if let Ok(url) = crate::config::UpstreamUrl::parse(url) {
        gw.stored_responses.remember(&id, &url);
    }
}

/// The asks loop (module doc): each ask is answered in its own task (a move takes a while),
/// all of them ended with the loop.
async fn answer_asks(gw: &Arc<Gateway>, s: &Shared, client: &async_nats::Client) {
    let Ok(mut asks) = client.subscribe(s.subjects.ask.clone()).await else { return };
    let mut running = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            m = asks.next() => {
                let Some(m) = m else { return };
                let (Some(reply), Ok(ask)) = (m.reply, serde_json::from_slice::<Ask>(&m.payload)) else { continue };
                if ask.from == s.replica {
                    continue;
                }
                let (gw, client) = (gw.clone(), client.clone());
                running.spawn(async move {
                    let answer = crate::http::asks::answer(&gw, ask).await;
                    if let Ok(body) = serde_json::to_vec(&answer) {
                        let _ = client.publish(reply, body.into()).await;
                    }
                });
            }
            Some(_) = running.join_next() => {}
        }
    }
}

/// Most decisions in one message.
const DECISIONS_PER_MESSAGE: usize = 256;

/// The decisions loop (module doc): what this replica decided goes out in batches of what has
/// piled up; what the peers decided is recorded as if this replica had decided it.
async fn share_decisions(gw: &Gateway, s: &Shared, client: &async_nats::Client) {
    let Ok(mut theirs) = client.subscribe(s.subjects.decisions.clone()).await else { return };
    let mut ours = s.decisions_inbox.lock().await;
    let mut batch = Vec::with_capacity(DECISIONS_PER_MESSAGE);
    loop {
        tokio::select! {
            n = ours.recv_many(&mut batch, DECISIONS_PER_MESSAGE) => {
                if n == 0 {
                    return;
                }
                for part in by_size(std::mem::take(&mut batch), |d| 96 + 21 * d.chain.len()) {
                    publish(s, client, &s.subjects.decisions, &Decisions { replica: s.replica.clone(), decisions: part }).await;
                }
            }
            m = theirs.next() => match m {
                Some(m) => record_decisions(gw, s, &m.payload),
                None => return,
            },
        }
    }
}

/// Records a peer's decisions in this replica's predicted caches.
fn record_decisions(gw: &Gateway, s: &Shared, payload: &[u8]) {
    let Ok(m) = serde_json::from_slice::<Decisions>(payload) else { return };
    if m.replica == s.replica {
        return;
    }
    let fleet = gw.fleet();
    for d in m.decisions {
        let Some(model) = fleet.models.get(d.model.as_str()) else { continue };
        let (Some(kv), Some(i)) = (&model.kv, model.workers.iter().position(|w| w.url.is(&d.worker))) else { continue };
        if kv.record_decision(i, &d.chain) {
            s.metrics.decisions_applied.inc();
        }
    }
}

/// Most chain bookings and releases in one message.
const CHAIN_OPS_PER_MESSAGE: usize = 256;

/// The chains loop (module doc): what this replica booked and released goes out in batches of
/// what has piled up; what the peers did is applied to the ledgers; every heartbeat, the chains
/// of peers gone and those held past the model's `booking_max_age_s` are let go.
async fn share_chains(gw: &Gateway, s: &Shared, client: &async_nats::Client) {
    let Ok(mut theirs) = client.subscribe(s.subjects.chains.clone()).await else { return };
    let mut ours = s.chains_inbox.lock().await;
    let mut batch = Vec::with_capacity(CHAIN_OPS_PER_MESSAGE);
    let mut sweep = tokio::time::interval(Duration::from_millis(s.cfg.heartbeat_ms));
    loop {
        tokio::select! {
            n = ours.recv_many(&mut batch, CHAIN_OPS_PER_MESSAGE) => {
                if n == 0 {
                    return;
                }
                let ops: Vec<_> = batch.drain(..).map(|o| o.wire()).collect();
                for part in by_size(ops, |o| 96 + 21 * o.chain.as_ref().map_or(0, Vec::len)) {
                    let m = Chains { replica: s.replica.clone(), instance: s.instance.clone(), ops: part };
                    publish(s, client, &s.subjects.chains, &m).await;
                }
            }
            m = theirs.next() => match m {
                Some(m) => apply_chains(gw, s, &m.payload),
                None => return,
            },
            _ = sweep.tick() => {
                let max_age = gw.config().models.iter().map(|m| m.routing.booking_max_age_s).max().unwrap_or(600);
                let members = s.members.lock();
                let mut held = s.held_chains.lock();
                held.sweep(&|r| members.contains(r), Duration::from_millis(s.cfg.peer_timeout_ms), Duration::from_secs(max_age));
                s.metrics.peer_chains.set(i64::try_from(held.len()).unwrap_or(i64::MAX));
            }
        }
    }
}

/// The tenants loop (module doc): this replica's tenants' usage goes out when it changes (looked
/// at every `publish_interval_ms`) and whole every heartbeat; the peers' is charged here.
async fn share_tenants(gw: &Gateway, s: &Shared, client: &async_nats::Client) {
    let Ok(mut theirs) = client.subscribe(s.subjects.tenants.clone()).await else { return };
    let mut out = crate::cluster::tenants::Outgoing::default();
    let mut peers = crate::cluster::tenants::PeerTenants::default();
    let mut tick = tokio::time::interval(Duration::from_millis(s.cfg.publish_interval_ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beat = tokio::time::interval(Duration::from_millis(s.cfg.heartbeat_ms));
    loop {
        let whole = tokio::select! {
            _ = tick.tick() => false,
            _ = beat.tick() => true,
            m = theirs.next() => {
                let Some(m) = m else { return };
                if let (Some(table), Ok(m)) = (gw.tenants.table(), serde_json::from_slice::<crate::cluster::tenants::TenantsMessage>(&m.payload))
                    && m.replica != s.replica
                {
                    peers.apply(m, &table, Instant::now());
                }
                continue;
            }
        };
        let Some(table) = gw.tenants.table() else { continue };
        if whole {
            peers.expire(&table, Duration::from_millis(s.cfg.peer_timeout_ms), Instant::now());
        }
        let usage = out.usage(&table, whole);
        if !usage.is_empty() {
            let m = crate::cluster::tenants::TenantsMessage { replica: s.replica.clone(), instance: s.instance.clone(), tenants: usage };
            publish(s, client, &s.subjects.tenants, &m).await;
        }
    }
}

/// Most bytes of one message of batched chains or decisions, well under NATS's default
/// `max_payload` (1 MiB), which the client refuses to exceed (the whole message is lost).
const MESSAGE_BYTES: usize = 256 * 1024;

/// `items` cut into runs whose estimated JSON (`size` each) stays under [`MESSAGE_BYTES`].
fn by_size<T>(items: Vec<T>, size: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut parts = vec![Vec::new()];
    let mut bytes = 0;
    for item in items {
        let n = size(&item);
        if bytes + n > MESSAGE_BYTES && parts.last().is_some_and(|p| !p.is_empty()) {
            parts.push(Vec::new());
            bytes = 0;
        }
        bytes += n;
        parts.last_mut().expect("one part at least").push(item);
    }
    parts
}

/// Publishes `m` as JSON on `subject` ([`send`]).
async fn publish(s: &Shared, client: &async_nats::Client, subject: &str, m: &impl serde::Serialize) {
    match serde_json::to_vec(m) {
        Ok(payload) => {
            send(s, client, subject, payload).await;
        }
        Err(_) => s.metrics.publish_failures.inc(),
    }
}

/// Publishes `payload` on `subject` without waiting long; skipped while NATS is unreachable.
/// Whether it was handed over; a message that was not counts as a publish failure.
async fn send(s: &Shared, client: &async_nats::Client, subject: &str, payload: Vec<u8>) -> bool {
    let sent = connected(client)
        && matches!(tokio::time::timeout(Duration::from_millis(s.cfg.heartbeat_ms), client.publish(subject.to_string(), payload.into())).await, Ok(Ok(())));
    if !sent {
        s.metrics.publish_failures.inc();
    }
    sent
}

/// Applies a peer's chain bookings and releases to the ledgers of the fleet in force.
fn apply_chains(gw: &Gateway, s: &Shared, payload: &[u8]) {
    let Ok(m) = serde_json::from_slice::<Chains>(payload) else { return };
    if m.replica == s.replica {
        return;
    }
    let fleet = gw.fleet();
    let mut held = s.held_chains.lock();
    for op in m.ops {
        // A release needs no target: it undoes what its booking was applied to.
        let target = op.chain.as_ref().and_then(|_| {
            let model = fleet.models.get(op.model.as_str())?;
            let w = model.workers.iter().position(|w| w.url.is(&op.worker))?;
            Some((model.ledger.clone(), u16::try_from(w).ok()?))
        });
        held.apply((&m.replica, &m.instance), op, target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_under_the_message_size_and_keep_their_order() {
        let parts = by_size((0..10).collect(), |_| MESSAGE_BYTES / 3);
        assert_eq!(parts, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6, 7, 8], vec![9]]);
        assert_eq!(by_size(vec![1], |_| 2 * MESSAGE_BYTES), vec![vec![1]], "an item too large alone still goes");
        assert_eq!(by_size(Vec::<u8>::new(), |_| 1), vec![Vec::<u8>::new()]);
    }
}
