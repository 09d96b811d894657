//! Sticky sessions with a KV-cost fallback: requests that carry a session header always go to
//! the same worker while it is healthy, not busy and under a KV-usage ceiling (rendezvous
//! hashing, so losing one worker moves only its own sessions); everything else goes to the
//! cheapest worker by kvgate's `kv` cost. None of the built-in modes can express "pin by
//! header, and fall back to the cache-aware cost".
//!
//! Config (one `key = value` per line, `#` comments):
//! ```text
//! header = x-session-id   # the affinity header (the gateway's `headers` must list it)
//! weight = 1.0            # overlap_score_weight of the fallback cost
//! max_kv_usage = 0.95     # a pinned worker fuller than this is skipped
//! ```

#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use kvgate_policy_sdk::Local;
use kvgate_policy_sdk::routing::{Decision, Policy, Request, Worker, cheapest, header, stable_hash};

struct Settings {
    header: String,
    weight: f64,
    max_kv_usage: f64,
}

static SETTINGS: Local<Option<Settings>> = Local::new(None);

struct SessionAffinity;

impl Policy for SessionAffinity {
    fn init(config: String) -> Result<(), String> {
        let mut s = Settings { header: "x-session-id".to_string(), weight: 1.0, max_kv_usage: 0.95 };
        for (n, line) in config.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else { return Err(format!("line {}: expected key = value", n + 1)) };
            let (k, v) = (k.trim(), v.trim());
            let num = || v.parse::<f64>().map_err(|_| format!("line {}: {k} must be a number, got {v:?}", n + 1));
            match k {
                "header" => s.header = v.to_ascii_lowercase(),
                "weight" => s.weight = num()?,
                "max_kv_usage" => s.max_kv_usage = num()?,
                _ => return Err(format!("line {}: unknown key {k:?} (header, weight, max_kv_usage)", n + 1)),
            }
        }
        SETTINGS.with(|settings| *settings = Some(s));
        Ok(())
    }

    fn choose(req: Request, workers: Vec<Worker>) -> Decision {
        SETTINGS.with(|settings| {
            let Some(s) = settings.as_ref() else { return Decision::Fallback };
            if let Some(session) = header(&req, &s.header) {
                // Rendezvous hashing: the eligible worker with the highest hash(session, id).
                let key = stable_hash(session);
                let pinned = workers
                    .iter()
                    .filter(|w| w.healthy && !w.busy && w.kv_usage <= s.max_kv_usage)
                    .max_by_key(|w| mix(key ^ u64::from(w.id).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
                if let Some(w) = pinned {
                    return Decision::Worker(w.id);
                }
            }
            cheapest(&req, &workers, s.weight)
        })
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

kvgate_policy_sdk::export_router!(SessionAffinity);
