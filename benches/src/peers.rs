//! Peer routers for `kvgate-bench compare`: how a target names a peer and its options, the
//! configurations the peers' own documentation recommends, and what the simulated workers
//! must do for a peer (the "worker contract").
//!
//! A peer target is `vllm-router-<policy>` or `smg-<policy>`, optionally followed by `@` and
//! `;`-separated options: `key=value` is passed as `--key value`, a bare `key` as the flag
//! `--key`, and `docs` expands to the configuration the peer's documentation recommends for
//! that policy ([`documented`]).

/// Which router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    /// vllm-project/router (`vllm-router`, pip `vllm-router`).
    VllmRouter,
    /// SGLang Model Gateway (`smg launch`, pip `sglang-router`).
    Smg,
}

/// A peer target: the router, its policy and the extra command-line arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The router.
    pub router: Router,
    /// `--policy`.
    pub policy: String,
    /// Extra arguments, in the order given (`docs` expanded in place).
    pub args: Vec<String>,
}

/// The configuration a peer's documentation recommends for `policy`, as command-line
/// arguments, if it documents one.
///
/// - vllm-router `cache_aware`: the command its load-balancing guide gives (its table of
///   defaults there lists 0.5 / 32 / 1.1 too, while vllm-router 0.1.17's command line defaults
///   to 0.3 / 64 / 1.5).
/// - SMG `cache_aware`: the "Cache-Aware Policy Tuning" block of the SGLang Model Gateway guide
///   (the command line defaults to 0.3 / 64 / 1.5 / 60 s).
pub fn documented(router: Router, policy: &str) -> Option<&'static [&'static str]> {
    match (router, policy) {
        (Router::VllmRouter, "cache_aware") => Some(&["--cache-threshold", "0.5", "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.1"]),
        (Router::Smg, "cache_aware") => Some(&[
            "--cache-threshold",
            "0.5",
            "--balance-abs-threshold",
            "32",
            "--balance-rel-threshold",
            "1.5",
            "--eviction-interval-secs",
            "120",
            "--max-tree-size",
            "67108864",
        ]),
        _ => None,
    }
}

impl Peer {
    /// Parses a target; `Ok(None)` for a kvgate target, an error for an unknown one.
    pub fn parse(target: &str) -> Result<Option<Peer>, String> {
        let (name, opts) = target.split_once('@').unwrap_or((target, ""));
        let (router, policy) = if let Some(p) = name.strip_prefix("vllm-router-") {
            (Router::VllmRouter, p)
        } else if let Some(p) = name.strip_prefix("smg-") {
            (Router::Smg, p)
        } else if name.starts_with("kvgate-") {
            return Ok(None);
        } else {
            return Err(format!("unknown target {target:?} (kvgate-<mode>, vllm-router-<policy> or smg-<policy>)"));
        };
        if policy.is_empty() {
            return Err(format!("{target:?}: no policy"));
        }
        let mut args = Vec::new();
        for opt in opts.split(';').map(str::trim).filter(|o| !o.is_empty()) {
            if opt == "docs" {
                let d = documented(router, policy).ok_or_else(|| format!("{target:?}: no documented configuration is known for {name}"))?;
                args.extend(d.iter().map(|a| a.to_string()));
                continue;
            }
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (opt, None),
            };
            let key = key.trim_start_matches('-');
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(format!("{target:?}: bad option {opt:?}"));
            }
            args.push(format!("--{key}"));
            args.extend(value.map(String::from));
        }
        Ok(Some(Peer { router, policy: policy.to_string(), args }))
    }

    /// Whether it answers token-id prompts with an error (SMG: HTTP 422), so a token-id run
    /// sends it the same prompts as text.
    pub fn refuses_token_ids(&self) -> bool {
        self.router == Router::Smg
    }

    /// Environment variables the workers need for this peer. vllm-router's `kv_aware` documents
    /// its worker contract as sha256_cbor block hashes published as full 32-byte digests
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) with `PYTHONHASHSEED=0`, block size 16.
    pub fn worker_env(&self) -> Vec<(String, String)> {
        match (self.router, self.policy.as_str()) {
            (Router::VllmRouter, "kv_aware") => {
                vec![("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES".into(), "0".into()), ("PYTHONHASHSEED".into(), "0".into())]
            }
            _ => Vec::new(),
        }
    }

    /// Extra vllm-sim arguments the workers need for this peer.
    pub fn worker_args(&self) -> Vec<String> {
        match (self.router, self.policy.as_str()) {
            (Router::VllmRouter, "kv_aware") => vec!["--prefix-caching-hash-algo".into(), "sha256_cbor".into()],
            _ => Vec::new(),
        }
    }
}

/// The `--block-size` among vllm-sim arguments (16, vLLM's default, when absent).
pub fn block_size(sim_args: &[String]) -> usize {
    sim_args.iter().position(|a| a == "--block-size").and_then(|i| sim_args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_name_a_router_a_policy_and_options() {
        assert_eq!(Peer::parse("kvgate-kv@overlap_score_weight=8"), Ok(None));
        let p = Peer::parse("vllm-router-cache_aware@cache-threshold=0.5;--balance-abs-threshold = 32;dp-aware").unwrap().unwrap();
        assert_eq!((p.router, p.policy.as_str()), (Router::VllmRouter, "cache_aware"));
        assert_eq!(p.args, ["--cache-threshold", "0.5", "--balance-abs-threshold", "32", "--dp-aware"]);
        let s = Peer::parse("smg-cache_aware").unwrap().unwrap();
        assert_eq!((s.router, s.policy.as_str(), s.args.len()), (Router::Smg, "cache_aware", 0));
        assert!(s.refuses_token_ids() && !p.refuses_token_ids());
        assert!(Peer::parse("nginx").is_err());
        assert!(Peer::parse("smg-").is_err());
        assert!(Peer::parse("smg-cache_aware@bad key=1").is_err());
    }

    #[test]
    fn docs_expands_to_the_documented_configuration_where_there_is_one() {
        let p = Peer::parse("vllm-router-cache_aware@docs;max-tree-size=1000").unwrap().unwrap();
        assert_eq!(p.args, ["--cache-threshold", "0.5", "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.1", "--max-tree-size", "1000"]);
        let s = Peer::parse("smg-cache_aware@docs").unwrap().unwrap();
        assert_eq!(s.args.len(), 10);
        assert!(Peer::parse("vllm-router-round_robin@docs").unwrap_err().contains("no documented configuration"));
    }

    #[test]
    fn kv_aware_workers_publish_full_byte_sha256_cbor_hashes() {
        let p = Peer::parse("vllm-router-kv_aware").unwrap().unwrap();
        assert!(p.worker_env().contains(&("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES".into(), "0".into())));
        assert!(p.worker_env().contains(&("PYTHONHASHSEED".into(), "0".into())));
        assert_eq!(p.worker_args(), ["--prefix-caching-hash-algo", "sha256_cbor"]);
        let c = Peer::parse("vllm-router-cache_aware").unwrap().unwrap();
        assert!(c.worker_env().is_empty() && c.worker_args().is_empty());
        assert_eq!(block_size(&["--time-scale".into(), "2".into(), "--block-size".into(), "32".into()]), 32);
        assert_eq!(block_size(&[]), 16);
    }
}
