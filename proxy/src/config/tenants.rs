//! The `tenants` section: who may use the gateway (client API keys, stored as SHA-256 digests
//! only), what each tenant may use, and its place in the router queue. Absent, every request is
//! served as before: no key is read and nothing is limited. Applied again on every reload.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The tenants and how requests are told apart.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenants {
    /// Refuse (401) a request without a key that names a tenant. Unset (default): such a
    /// request is the `default` tenant's.
    #[serde(default)]
    pub require_key: bool,
    /// Pass the client's `Authorization` / `x-api-key` on to the workers. Default: they stay
    /// at the gateway.
    #[serde(default)]
    pub forward_key: bool,
    /// Per priority band: how long its requests may wait in a router queue, ms (default: the
    /// model's `routing.queue_max_wait_ms`).
    #[serde(default)]
    pub bands: BTreeMap<u8, Band>,
    /// The tenants. One named `default` (with no keys) sets the limits of requests without a
    /// known key; without one they are not limited.
    #[serde(default)]
    pub list: Vec<Tenant>,
}

/// A priority band's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Band {
    /// The longest its requests wait in a router queue, ms.
    pub queue_max_wait_ms: u64,
}

/// One tenant.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Its name in metrics, logs, receipts and `/tenants`.
    pub name: String,
    /// SHA-256 digests of its keys, 64 hex digits each (`printf %s "$KEY" | sha256sum`).
    #[serde(default)]
    pub keys_sha256: Vec<String>,
    /// A file of its keys, one per line: a key, or `sha256:<digest>`; `#` starts a comment.
    /// Read at load and on every reload; only the digests are kept.
    #[serde(default)]
    pub keys_file: Option<PathBuf>,
    /// An environment variable holding its keys, comma-separated (a mounted secret); only the
    /// digests are kept.
    #[serde(default)]
    pub keys_env: Option<String>,
    /// Requests per minute (0: no limit).
    #[serde(default)]
    pub requests_per_minute: u64,
    /// Prompt tokens per minute, counted as vLLM counts them (0: no limit).
    #[serde(default)]
    pub input_tokens_per_minute: u64,
    /// Generated tokens per minute, charged as they stream (0: no limit).
    #[serde(default)]
    pub output_tokens_per_minute: u64,
    /// Requests in flight at once (0: no limit).
    #[serde(default)]
    pub max_concurrent: u32,
    /// Its priority band: a higher band leaves the router queue first and a lower one is shed
    /// first from a full queue.
    #[serde(default)]
    pub priority: u8,
    /// Its weight among the tenants of its band: backlogged tenants are served tokens in
    /// proportion to their weights.
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// The digests of every key, filled at load.
    #[serde(skip)]
    pub digests: Vec<[u8; 32]>,
}

fn default_weight() -> f64 {
    1.0
}

/// The name of the tenant requests without a known key belong to.
pub const DEFAULT_TENANT: &str = "default";

impl Tenants {
    /// Checks names, weights and digests; the error names the offending tenant.
    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::HashSet::new();
        for t in &self.list {
            if t.name.is_empty() || t.name.len() > 64 || !t.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
                return Err(format!("tenant name {:?} must be 1 to 64 letters, digits, '-', '_' or '.'", t.name));
            }
            if !names.insert(t.name.as_str()) {
                return Err(format!("duplicate tenant name {:?}", t.name));
            }
            if !(t.weight.is_finite() && t.weight > 0.0) {
                return Err(format!("tenant {:?}: weight must be a positive number", t.name));
            }
            if let Some(bad) = t.keys_sha256.iter().find(|d| digest_hex(d).is_none()) {
                return Err(format!("tenant {:?}: keys_sha256 entry {bad:?} is not 64 hex digits", t.name));
            }
            let keyed = !t.keys_sha256.is_empty() || t.keys_file.is_some() || t.keys_env.is_some();
            if t.name == DEFAULT_TENANT && keyed {
                return Err(format!("tenant {DEFAULT_TENANT:?} is for requests without a known key: it has no keys"));
            }
        }
        if let Some((b, _)) = self.bands.iter().find(|(_, band)| band.queue_max_wait_ms == 0) {
            return Err(format!("bands.{b}.queue_max_wait_ms must be at least 1"));
        }
        if self.require_key && !self.list.iter().any(|t| t.name != DEFAULT_TENANT) {
            return Err("require_key is set but no tenant has keys".into());
        }
        Ok(())
    }

    /// Reads every tenant's keys (files and environment) into digests. The error names the
    /// tenant and the source, never a key.
    pub fn load_keys(&mut self, env: &[(String, String)]) -> Result<(), String> {
        let mut owner: std::collections::HashMap<[u8; 32], String> = Default::default();
        for t in &mut self.list {
            let mut digests: Vec<[u8; 32]> = t.keys_sha256.iter().filter_map(|d| digest_hex(d)).collect();
            if let Some(path) = &t.keys_file {
                let text = std::fs::read_to_string(path).map_err(|e| format!("tenant {:?}: keys_file {}: {e}", t.name, path.display()))?;
                for (n, line) in text.lines().enumerate() {
                    let line = line.split('#').next().unwrap_or("").trim();
                    if line.is_empty() {
                        continue;
                    }
                    let d = match line.strip_prefix("sha256:") {
                        Some(hex) => digest_hex(hex)
                            .ok_or_else(|| format!("tenant {:?}: keys_file {} line {}: not 64 hex digits after sha256:", t.name, path.display(), n + 1))?,
                        None => digest_of(line.as_bytes()),
                    };
                    digests.push(d);
                }
            }
            if let Some(var) = &t.keys_env {
                let value =
                    env.iter().find(|(k, _)| k == var).map(|(_, v)| v.as_str()).ok_or_else(|| format!("tenant {:?}: keys_env {var} is not set", t.name))?;
                digests.extend(value.split(',').map(str::trim).filter(|k| !k.is_empty()).map(|k| digest_of(k.as_bytes())));
            }
            for d in &digests {
                if let Some(other) = owner.insert(*d, t.name.clone()).filter(|o| *o != t.name) {
                    return Err(format!("tenants {other:?} and {:?} share a key", t.name));
                }
            }
            digests.sort_unstable();
            digests.dedup();
            t.digests = digests;
        }
        Ok(())
    }
}

/// The SHA-256 digest of a key.
pub fn digest_of(key: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key).into()
}

/// A digest as the 64 lower-case hex digits `keys_sha256` takes.
pub fn to_hex(d: &[u8; 32]) -> String {
    use std::fmt::Write;
    d.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// 64 hex digits as a digest.
fn digest_hex(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(yaml: &str) -> Tenants {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn keys_come_from_digests_files_and_the_environment_and_only_digests_are_kept() {
        let dir = std::env::temp_dir().join(format!("kvgate-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        let b_hex = to_hex(&digest_of(b"key-b2"));
        std::fs::write(&file, format!("# team b\nkey-b1\nsha256:{b_hex}  # rotated\n\n")).unwrap();
        let a_hex = to_hex(&digest_of(b"key-a"));
        let mut t = tenants(&format!("list:\n- {{name: a, keys_sha256: [{a_hex}]}}\n- {{name: b, keys_file: {}, keys_env: B_KEYS}}\n", file.display()));
        t.validate().unwrap();
        t.load_keys(&[("B_KEYS".into(), "key-b3, key-b4".into())]).unwrap();
        assert_eq!(t.list[0].digests, vec![digest_of(b"key-a")]);
        let mut want: Vec<_> = ["key-b1", "key-b2", "key-b3", "key-b4"].iter().map(|k| digest_of(k.as_bytes())).collect();
        want.sort_unstable();
        assert_eq!(t.list[1].digests, want);
        assert!(!format!("{t:?}").contains("key-b"), "no key is kept in the clear");
        let err = t.clone().load_keys(&[]).unwrap_err();
        assert!(err.contains("B_KEYS is not set"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_tenants_are_named() {
        for (yaml, says) in [
            ("list: [{name: 'a b'}]", "tenant name"),
            ("list: [{name: a}, {name: a}]", "duplicate"),
            ("list: [{name: a, weight: 0}]", "weight"),
            ("list: [{name: a, keys_sha256: [abc]}]", "64 hex"),
            ("list: [{name: default, keys_env: X}]", "no keys"),
            ("require_key: true\nlist: [{name: default}]", "no tenant has keys"),
            ("bands: {1: {queue_max_wait_ms: 0}}", "bands.1"),
        ] {
            let e = tenants(yaml).validate().unwrap_err();
            assert!(e.contains(says), "{yaml}: {e}");
        }
        let e = tenants("list: [{name: a, keys_env: K}, {name: b, keys_env: K}]").load_keys(&[("K".into(), "same".into())]).unwrap_err();
        assert!(e.contains("share a key") && !e.contains("same"), "{e}");
    }
}
