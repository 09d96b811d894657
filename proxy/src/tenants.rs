//! Who a request belongs to: the tenants of the configuration, their client API keys (kept as
//! SHA-256 digests) and their accounts, which outlive reloads by name so that a reload does
//! not hand anyone a fresh minute. docs/tenants.md describes the whole feature.
//!
//! A key is looked up by its digest: every request's key is hashed once, whatever it is, and
//! the digest is the map's key, so a refused key costs what an accepted one does and its
//! lookup time says nothing about the stored keys (finding which digest is near another's
//! would take a preimage of SHA-256).

use crate::config::tenants::{DEFAULT_TENANT, Tenants, digest_of};
use crate::h1::request_head::RequestHead;
use arc_swap::ArcSwapOption;
use kvgate_filters::tenant::{Account, Limits};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// One tenant as requests see it.
pub struct Tenant {
    /// Its name (metrics, logs, receipts).
    pub name: String,
    /// Its limits, usage and fair share.
    pub account: Arc<Account>,
    /// Its priority band.
    pub band: u8,
    /// How long its band waits in a router queue, when the configuration says.
    pub max_wait: Option<Duration>,
}

/// The tenants in force.
pub struct Table {
    by_digest: HashMap<[u8; 32], Arc<Tenant>>,
    /// Requests without a known key, unless keys are required.
    default: Option<Arc<Tenant>>,
    /// Every tenant, in configuration order (the default one last when it is not listed).
    pub all: Vec<Arc<Tenant>>,
    /// Whether the client's key goes on to the workers.
    pub forward_key: bool,
}

/// Why a request has no tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unauthorized {
    /// No `Authorization: Bearer` or `x-api-key` header.
    Missing,
    /// A key no tenant has.
    Unknown,
}

/// The tenants of the configuration in force and every account made so far.
#[derive(Default)]
pub struct Registry {
    table: ArcSwapOption<Table>,
    accounts: Mutex<HashMap<String, Arc<Account>>>,
}

impl Registry {
    /// The tenants in force; `None` without a `tenants` section.
    pub fn table(&self) -> Option<Arc<Table>> {
        self.table.load_full()
    }

    /// Puts `cfg` in force. Accounts are kept by name (their limits and weights updated), so
    /// requests in flight and the minute's usage carry over.
    pub fn apply(&self, cfg: Option<&Tenants>) {
        let Some(cfg) = cfg else {
            self.table.store(None);
            return;
        };
        let mut accounts = self.accounts.lock();
        let mut tenant = |t: Option<&crate::config::tenants::Tenant>| {
            let name = t.map_or(DEFAULT_TENANT, |t| t.name.as_str()).to_string();
            let limits = t.map(|t| Limits {
                requests_per_minute: t.requests_per_minute,
                input_tokens_per_minute: t.input_tokens_per_minute,
                output_tokens_per_minute: t.output_tokens_per_minute,
                max_concurrent: t.max_concurrent,
            });
            let (limits, weight, band) = (limits.unwrap_or_default(), t.map_or(1.0, |t| t.weight), t.map_or(0, |t| t.priority));
            let account =
                accounts.entry(name.clone()).and_modify(|a| a.update(limits, weight)).or_insert_with(|| Arc::new(Account::new(limits, weight))).clone();
            let max_wait = cfg.bands.get(&band).map(|b| Duration::from_millis(b.queue_max_wait_ms));
            Arc::new(Tenant { name, account, band, max_wait })
        };
        let mut all: Vec<Arc<Tenant>> = cfg.list.iter().map(|t| tenant(Some(t))).collect();
        if !all.iter().any(|t| t.name == DEFAULT_TENANT) {
            all.push(tenant(None));
        }
        let by_digest = cfg.list.iter().zip(&all).flat_map(|(t, tenant)| t.digests.iter().map(move |d| (*d, tenant.clone()))).collect();
        let default = (!cfg.require_key).then(|| all.iter().find(|t| t.name == DEFAULT_TENANT).cloned()).flatten();
        self.table.store(Some(Arc::new(Table { by_digest, default, all, forward_key: cfg.forward_key })));
    }
}

impl Table {
    /// The tenant of a request with this head: its key's, else the default tenant (unless keys
    /// are required).
    pub fn identify(&self, head: &RequestHead) -> Result<Arc<Tenant>, Unauthorized> {
        let found = match client_key(head) {
            Some(key) => self.by_digest.get(&digest_of(key)).cloned().ok_or(Unauthorized::Unknown),
            None => Err(Unauthorized::Missing),
        };
        found.or_else(|why| self.default.clone().ok_or(why))
    }
}

/// The client's API key: `Authorization: Bearer <key>` (OpenAI's SDKs), else `x-api-key`
/// (Anthropic's).
pub fn client_key(head: &RequestHead) -> Option<&[u8]> {
    let bearer = head.header("authorization").and_then(|v| {
        let (scheme, rest) = v.split_at(v.iter().position(|&b| b == b' ')?);
        scheme.eq_ignore_ascii_case(b"bearer").then(|| rest.trim_ascii())
    });
    bearer.or_else(|| head.header("x-api-key").map(<[u8]>::trim_ascii)).filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(extra: &str) -> RequestHead {
        RequestHead::parse(bytes::Bytes::from(format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\n{extra}\r\n"))).unwrap()
    }

    fn registry(yaml: &str) -> Registry {
        let mut t: Tenants = serde_yaml::from_str(yaml).unwrap();
        t.validate().unwrap();
        t.load_keys(&[("KEYS_A".into(), "sk-a".into()), ("KEYS_B".into(), "sk-b".into())]).unwrap();
        let r = Registry::default();
        r.apply(Some(&t));
        r
    }

    #[test]
    fn keys_name_tenants_and_the_rest_is_the_default_tenants_unless_keys_are_required() {
        let r = registry("list: [{name: a, keys_env: KEYS_A}, {name: b, keys_env: KEYS_B, priority: 2}]");
        let t = r.table().unwrap();
        let name = |h: &str| t.identify(&head(h)).map(|t| t.name.clone());
        assert_eq!(name("Authorization: Bearer sk-a\r\n"), Ok("a".into()));
        assert_eq!(name("x-api-key: sk-b\r\n"), Ok("b".into()));
        assert_eq!(name("authorization: bearer  sk-b \r\n"), Ok("b".into()));
        assert_eq!(name("Authorization: Bearer sk-zzz\r\n"), Ok(DEFAULT_TENANT.into()));
        assert_eq!(name(""), Ok(DEFAULT_TENANT.into()));
        let strict = registry("require_key: true\nlist: [{name: a, keys_env: KEYS_A}]");
        let t = strict.table().unwrap();
        assert_eq!(t.identify(&head("Authorization: Bearer sk-zzz\r\n")).err(), Some(Unauthorized::Unknown));
        assert_eq!(t.identify(&head("")).err(), Some(Unauthorized::Missing));
        assert_eq!(t.identify(&head("Authorization: Basic sk-a\r\n")).err(), Some(Unauthorized::Missing));
    }

    #[test]
    fn a_reload_keeps_each_tenants_account() {
        let r = registry("list: [{name: a, keys_env: KEYS_A, requests_per_minute: 1}]");
        let a = r.table().unwrap().all[0].account.clone();
        let _held = a.admit(1).unwrap();
        let mut t: Tenants = serde_yaml::from_str("list: [{name: a, keys_env: KEYS_A, requests_per_minute: 2}]").unwrap();
        t.load_keys(&[("KEYS_A".into(), "sk-a".into())]).unwrap();
        r.apply(Some(&t));
        let again = r.table().unwrap().all[0].account.clone();
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(again.in_flight(), 1);
        assert_eq!(again.snapshot().requests.unwrap().remaining, 1, "the minute's use carried over");
    }

    /// A refused key costs no more than an accepted one: both are hashed once and looked up
    /// once. Timed as the fastest of many rounds (the least disturbed), with a wide margin.
    #[test]
    fn an_unknown_key_costs_no_more_than_a_known_one() {
        let r = registry("require_key: true\nlist: [{name: a, keys_env: KEYS_A}]");
        let t = r.table().unwrap();
        let (known, unknown) = (head("Authorization: Bearer sk-a\r\n"), head("Authorization: Bearer sk-q\r\n"));
        let fastest = |h: &RequestHead| {
            (0..60)
                .map(|_| {
                    let start = std::time::Instant::now();
                    for _ in 0..200 {
                        std::hint::black_box(t.identify(std::hint::black_box(h)).is_ok());
                    }
                    start.elapsed()
                })
                .min()
                .unwrap()
        };
        let (k, u) = (fastest(&known), fastest(&unknown));
        assert!(u.as_secs_f64() <= k.as_secs_f64() * 1.5 + 20e-6, "unknown {u:?} against known {k:?}");
    }
}
