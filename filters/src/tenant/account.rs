//! One tenant's account: its limits, the buckets that enforce them, the requests it has in
//! flight, and what it has used (for `/tenants`, metrics and the replicas it shares them with).
//!
//! A request is admitted whole or not at all: every limit is checked under one lock, and only
//! when all of them fit is anything taken. Output tokens cannot be known in advance, so
//! admission only needs some of the output allowance left; the tokens are charged as they
//! stream and settled against the worker's `usage` at the end.

use super::bucket::{Bucket, Level};
use super::fair::FairShare;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// What a tenant may use; 0 is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Requests admitted per minute.
    pub requests_per_minute: u64,
    /// Prompt tokens per minute.
    pub input_tokens_per_minute: u64,
    /// Generated tokens per minute.
    pub output_tokens_per_minute: u64,
    /// Requests in flight at once (across replicas, as far as they have told each other).
    pub max_concurrent: u32,
}

/// The limit a refused request met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dimension {
    /// `requests_per_minute`.
    Requests,
    /// `input_tokens_per_minute`.
    InputTokens,
    /// `output_tokens_per_minute`.
    OutputTokens,
    /// `max_concurrent`.
    Concurrent,
}

impl Dimension {
    /// Its name in metrics, messages and `/tenants`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::InputTokens => "input_tokens",
            Self::OutputTokens => "output_tokens",
            Self::Concurrent => "concurrent",
        }
    }
}

/// Every limit's state, as the rate-limit headers and `/tenants` show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Requests per minute, when limited.
    pub requests: Option<Level>,
    /// Input tokens per minute, when limited.
    pub input: Option<Level>,
    /// Output tokens per minute, when limited.
    pub output: Option<Level>,
    /// Requests in flight here and at the peers, and the limit (0: none).
    pub concurrent: (u32, u32),
}

/// A refusal: which limit, how long until the request would fit (`None`: it never fits, being
/// larger than the limit itself), and every limit's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exceeded {
    /// The limit that refused it (the one with the longest wait when several did).
    pub dimension: Dimension,
    /// What the request asked of that limit.
    pub requested: u64,
    /// Until it would fit.
    pub retry_after: Option<Duration>,
    /// The limits' state when it was refused.
    pub snapshot: Snapshot,
}

struct Buckets {
    requests: Option<Bucket>,
    input: Option<Bucket>,
    output: Option<Bucket>,
}

/// Monotonic totals of what this replica's requests used.
#[derive(Debug, Default)]
pub struct Totals {
    requests: AtomicU64,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    /// How far the counts at admission were from the workers' (`usage`), summed.
    input_corrected: AtomicU64,
}

/// One tenant's account. Shared by its requests (an `Arc`), kept across reloads by name.
pub struct Account {
    limits: Mutex<Limits>,
    buckets: Mutex<Buckets>,
    in_flight: Arc<AtomicU32>,
    peer_in_flight: AtomicU32,
    totals: Totals,
    fair: Arc<FairShare>,
}

impl Account {
    /// A fresh account under `limits`, weighted `weight` in the queue.
    pub fn new(limits: Limits, weight: f64) -> Self {
        let now = Instant::now();
        Self {
            buckets: Mutex::new(Buckets::new(&limits, None, now)),
            limits: Mutex::new(limits),
            in_flight: Default::default(),
            peer_in_flight: Default::default(),
            totals: Totals::default(),
            fair: Arc::new(FairShare::new(weight)),
        }
    }

    /// Changes the limits and weight (a reload); what was used this minute stays used.
    pub fn update(&self, limits: Limits, weight: f64) {
        let now = Instant::now();
        let mut b = self.buckets.lock();
        *b = Buckets::new(&limits, Some(&b), now);
        *self.limits.lock() = limits;
        self.fair.set_weight(weight);
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        *self.limits.lock()
    }

    /// The tenant's share of the router queue.
    pub fn fair(&self) -> &Arc<FairShare> {
        &self.fair
    }

    /// Admits a request of `input_tokens` prompt tokens, or says which limit refuses it.
    pub fn admit(&self, input_tokens: u64) -> Result<Admitted, Box<Exceeded>> {
        let limits = self.limits();
        let now = Instant::now();
        let mut guard = self.buckets.lock();
        let b = &mut *guard;
        let concurrent = self.in_flight.load(Ordering::Relaxed) + self.peer_in_flight.load(Ordering::Relaxed);
        // The longest wait decides what the client is told; never fitting is the longest.
        let mut worst: Option<(Dimension, u64, Option<Duration>)> = None;
        let long = |w: Option<Duration>| w.unwrap_or(Duration::MAX);
        let mut consider = |d: Dimension, n: u64, wait: Option<Duration>| {
            if wait != Some(Duration::ZERO) && worst.is_none_or(|(_, _, w)| long(wait) > long(w)) {
                worst = Some((d, n, wait));
            }
        };
        if limits.max_concurrent > 0 && concurrent >= limits.max_concurrent {
            // A slot frees when a request ends: no time can be promised, a second is a fair guess.
            consider(Dimension::Concurrent, 1, Some(Duration::from_secs(1)));
        }
        for (d, bucket, n) in
            [(Dimension::Requests, &mut b.requests, 1), (Dimension::InputTokens, &mut b.input, input_tokens), (Dimension::OutputTokens, &mut b.output, 1)]
        {
            if let Some(bucket) = bucket {
                consider(d, n, bucket.wait_for(n, now));
            }
        }
        if let Some((dimension, requested, retry_after)) = worst {
            let snapshot = self.snapshot_locked(b, now);
            return Err(Box::new(Exceeded { dimension, requested, retry_after, snapshot }));
        }
        if let Some(r) = b.requests.as_mut() {
            r.charge(1.0, now);
        }
        if let Some(i) = b.input.as_mut() {
            i.charge(input_tokens as f64, now);
        }
        // Counted before the lock is let go: another admission checks concurrency under it.
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        drop(guard);
        self.totals.requests.fetch_add(1, Ordering::Relaxed);
        self.totals.input_tokens.fetch_add(input_tokens, Ordering::Relaxed);
        Ok(Admitted { in_flight: self.in_flight.clone(), input_tokens })
    }

    /// Charges `n` generated tokens (as they stream).
    pub fn charge_output(&self, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(o) = self.buckets.lock().output.as_mut() {
            o.charge(n as f64, Instant::now());
        }
        self.totals.output_tokens.fetch_add(n, Ordering::Relaxed);
        self.fair.serve(n);
    }

    /// Corrects the prompt tokens charged at admission to what the worker counted (`delta`
    /// more, or fewer when negative).
    pub fn correct_input(&self, delta: i64) {
        if delta == 0 {
            return;
        }
        self.totals.input_corrected.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        if let Some(i) = self.buckets.lock().input.as_mut() {
            i.charge(delta as f64, Instant::now());
        }
        if delta > 0 {
            self.totals.input_tokens.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        } else {
            take_back(&self.totals.input_tokens, delta.unsigned_abs());
        }
    }

    /// Gives back what a request that was never served took at admission (one request and
    /// its prompt tokens): refused by the queue, or its client gone before a worker took it.
    pub fn refund(&self, input_tokens: u64) {
        let now = Instant::now();
        let mut guard = self.buckets.lock();
        let b = &mut *guard;
        if let Some(r) = b.requests.as_mut() {
            r.charge(-1.0, now);
        }
        if let Some(i) = b.input.as_mut() {
            i.charge(-(input_tokens as f64), now);
        }
        drop(guard);
        let t = &self.totals;
        take_back(&t.requests, 1);
        take_back(&t.input_tokens, input_tokens);
    }

    /// Corrects the output tokens charged as they streamed to what the worker counted.
    pub fn correct_output(&self, delta: i64) {
        if delta > 0 {
            self.charge_output(delta.unsigned_abs());
        } else if delta < 0 {
            if let Some(o) = self.buckets.lock().output.as_mut() {
                o.charge(delta as f64, Instant::now());
            }
            take_back(&self.totals.output_tokens, delta.unsigned_abs());
        }
    }

    /// What other replicas' requests of this tenant used since they last said (taken from the
    /// buckets whatever their level: it was already served).
    pub fn charge_peer(&self, requests: i64, input_tokens: i64, output_tokens: i64) {
        let now = Instant::now();
        let mut guard = self.buckets.lock();
        let b = &mut *guard;
        for (bucket, n) in [(&mut b.requests, requests), (&mut b.input, input_tokens), (&mut b.output, output_tokens)] {
            if let (Some(bucket), true) = (bucket.as_mut(), n != 0) {
                bucket.charge(n as f64, now);
            }
        }
    }

    /// Sets the requests the peers have in flight for this tenant.
    pub fn set_peer_in_flight(&self, n: u32) {
        self.peer_in_flight.store(n, Ordering::Relaxed);
    }

    /// This replica's requests in flight.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Totals of what this replica's requests used: requests, input and output tokens.
    pub fn totals(&self) -> (u64, u64, u64) {
        let t = &self.totals;
        (t.requests.load(Ordering::Relaxed), t.input_tokens.load(Ordering::Relaxed), t.output_tokens.load(Ordering::Relaxed))
    }

    /// Prompt tokens by which the counts at admission differed from the workers' `usage`,
    /// summed over this replica's requests: 0 when the gateway counts as the workers do.
    pub fn input_corrected(&self) -> u64 {
        self.totals.input_corrected.load(Ordering::Relaxed)
    }

    /// Every limit's state now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_locked(&mut self.buckets.lock(), Instant::now())
    }

    fn snapshot_locked(&self, b: &mut Buckets, now: Instant) -> Snapshot {
        let concurrent = self.in_flight.load(Ordering::Relaxed) + self.peer_in_flight.load(Ordering::Relaxed);
        Snapshot {
            requests: b.requests.as_mut().map(|x| x.level(now)),
            input: b.input.as_mut().map(|x| x.level(now)),
            output: b.output.as_mut().map(|x| x.level(now)),
            concurrent: (concurrent, self.limits.lock().max_concurrent),
        }
    }
}

impl Buckets {
    /// Buckets for `limits`, carrying over what `old` had used.
    fn new(limits: &Limits, old: Option<&Buckets>, now: Instant) -> Self {
        let one = |limit: u64, old: Option<&Bucket>| (limit > 0).then(|| old.map_or_else(|| Bucket::new(limit, now), |o| o.with_limit(limit, now)));
        Self {
            requests: one(limits.requests_per_minute, old.and_then(|o| o.requests.as_ref())),
            input: one(limits.input_tokens_per_minute, old.and_then(|o| o.input.as_ref())),
            output: one(limits.output_tokens_per_minute, old.and_then(|o| o.output.as_ref())),
        }
    }
}

/// Takes `n` back from a total, down to 0 at most, in one atomic step.
fn take_back(total: &AtomicU64, n: u64) {
    let _ = total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(n)));
}

/// An admitted request's place in its tenant's concurrency, given back when it is dropped.
#[derive(Debug)]
pub struct Admitted {
    in_flight: Arc<AtomicU32>,
    /// The prompt tokens charged at admission.
    pub input_tokens: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: u64, itpm: u64, otpm: u64, conc: u32) -> Limits {
        Limits { requests_per_minute: rpm, input_tokens_per_minute: itpm, output_tokens_per_minute: otpm, max_concurrent: conc }
    }

    #[test]
    fn the_request_that_would_pass_the_input_limit_is_refused_and_nothing_is_taken() {
        let a = Account::new(limits(0, 10_000, 0, 0), 1.0);
        let _one = a.admit(6_000).unwrap();
        let e = a.admit(4_500).unwrap_err();
        assert_eq!((e.dimension, e.requested), (Dimension::InputTokens, 4_500));
        let wait = e.retry_after.unwrap().as_secs_f64();
        // 500 short at 10,000 a minute: three seconds, less what refilled meanwhile.
        assert!(wait > 2.9 && wait <= 3.0, "{wait}");
        assert!(e.snapshot.input.unwrap().remaining >= 4_000);
        let _two = a.admit(3_900).unwrap();
        assert_eq!(a.admit(10_001).unwrap_err().retry_after, None, "larger than the limit never fits");
        assert_eq!(a.totals(), (2, 9_900, 0));
        // A request that was never served gets its prompt tokens back.
        a.refund(3_900);
        assert_eq!(a.totals(), (1, 6_000, 0));
        assert!(a.admit(3_900).is_ok());
    }

    #[test]
    fn concurrency_is_held_until_the_request_ends_and_output_is_charged_as_it_streams() {
        let a = Account::new(limits(100, 0, 50, 1), 1.0);
        let one = a.admit(10).unwrap();
        assert_eq!(a.admit(10).unwrap_err().dimension, Dimension::Concurrent);
        drop(one);
        let two = a.admit(10).unwrap();
        a.charge_output(60);
        drop(two);
        let e = a.admit(10).unwrap_err();
        assert_eq!(e.dimension, Dimension::OutputTokens, "no output allowance left");
        assert_eq!(a.snapshot().output.unwrap().remaining, 0);
        assert_eq!(a.fair().served(), 60);
    }

    #[test]
    fn peers_use_the_same_allowance_and_a_reload_keeps_what_was_used() {
        let a = Account::new(limits(10, 0, 0, 2), 1.0);
        a.charge_peer(10, 0, 0);
        assert_eq!(a.admit(1).unwrap_err().dimension, Dimension::Requests);
        a.update(limits(20, 0, 0, 2), 1.0);
        let _x = a.admit(1).unwrap();
        a.set_peer_in_flight(1);
        assert_eq!(a.admit(1).unwrap_err().dimension, Dimension::Concurrent);
    }
}
