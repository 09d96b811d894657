//! Value types that validate while they are deserialized, so a bad value is reported with the
//! line and column where it appears in the YAML.

use serde::{Deserialize, Deserializer, de};
use std::fmt;

/// A worker base URL: `http://host:port` (no path, no TLS: kvgate talks plain HTTP/1.1 to vLLM).
/// Made by [`UpstreamUrl::parse`] only, which checks every byte: the gateway writes the
/// authority and the URL into HTTP heads as they are.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UpstreamUrl {
    /// `host:port`, as given.
    pub authority: String,
    /// Host part.
    pub host: String,
    /// Port.
    pub port: u16,
}

impl UpstreamUrl {
    /// Parses `http://host:port[/]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let rest = s.strip_prefix("http://").ok_or_else(|| {
            if s.starts_with("https://") {
                format!("{s:?}: https upstreams are not supported; vLLM workers are reached over plain http://")
            } else {
                format!("{s:?}: expected http://host:port")
            }
        })?;
        let authority = rest.trim_end_matches('/');
        if authority.contains('/') || authority.contains('?') {
            return Err(format!("{s:?}: a worker URL is http://host:port, without a path"));
        }
        let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("{s:?}: missing :port"))?;
        let port: u16 = port
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| port.parse().ok())
            .flatten()
            .ok_or_else(|| format!("{s:?}: port must be a number between 1 and 65535"))?;
        if host.is_empty() || port == 0 {
            return Err(format!("{s:?}: expected http://host:port with a host and a non-zero port"));
        }
        if !host_ok(host) {
            return Err(format!("{s:?}: the host must be a name of letters, digits, '.', '-' and '_', or an IP literal ([::1])"));
        }
        Ok(Self { authority: authority.to_string(), host: host.trim_start_matches('[').trim_end_matches(']').to_string(), port })
    }

    /// Whether `url` is this URL as it is written (`Display`: `http://` and the authority), as
    /// peers name workers on the wire; without writing it out.
    pub fn is(&self, url: &str) -> bool {
        url.strip_prefix("http://") == Some(self.authority.as_str())
    }
}

/// Whether `host` is a host name (letters, digits, `.`, `-`, `_`) or an IPv6 literal in
/// brackets (hex digits, `:`, `.`, and a zone after `%`). Nothing else, so the authority can go
/// into a `Host` header and the URL into `x-kvgate-worker` as they are, unchecked per request.
fn host_ok(host: &str) -> bool {
    let name = |b: u8| b.is_ascii_alphanumeric() || b".-_".contains(&b);
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => !v6.is_empty() && v6.bytes().all(|b| name(b) || b == b':' || b == b'%'),
        None => host.bytes().all(name),
    }
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(de::Error::custom)
    }
}

/// A ZeroMQ TCP endpoint, `tcp://host:port` (`*` as host means bind).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ZmqEndpoint(pub String);

impl<'de> Deserialize<'de> for ZmqEndpoint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let rest = s.strip_prefix("tcp://").ok_or_else(|| de::Error::custom(format!("{s:?}: expected tcp://host:port")))?;
        let ok = rest.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !ok {
            return Err(de::Error::custom(format!("{s:?}: expected tcp://host:port")));
        }
        Ok(Self(s))
    }
}

/// Where a worker's KV events come from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KvEvents {
    /// Its PUB endpoint.
    At(ZmqEndpoint),
    /// Whatever its `GET /kv_event_sources` names (vLLM and vllm-sim serve it), read again
    /// after the worker restarts.
    Auto,
}

impl<'de> Deserialize<'de> for KvEvents {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "auto" {
            return Ok(Self::Auto);
        }
        ZmqEndpoint::deserialize(de::value::StrDeserializer::<D::Error>::new(&s))
            .map(Self::At)
            .map_err(|_| de::Error::custom(format!("{s:?}: expected tcp://host:port or auto")))
    }
}

/// A byte count: an integer, or a string with a unit (`512KiB`, `32MiB`, `1GiB`, `10MB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `123`, `64KiB`, `32MiB`, `1GiB`, `10kB`, `5MB`, `1GB`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number of bytes like 32MiB"))?;
        let mult = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "kB" | "KB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            u => return Err(format!("{s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, kB, MB, GB)")),
        };
        n.checked_mul(mult).map(ByteSize).ok_or_else(|| format!("{s:?}: too large"))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => ByteSize::parse(&s).map_err(de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = UpstreamUrl::parse("http://10.0.0.1:8000/").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.authority.as_str()), ("10.0.0.1", 8000, "10.0.0.1:8000"));
        assert_eq!(u.to_string(), "http://10.0.0.1:8000");
        assert!(u.is(&u.to_string()) && !u.is("http://10.0.0.1:8001") && !u.is("10.0.0.1:8000"));
        assert!(UpstreamUrl::parse("https://x:1").unwrap_err().contains("https"));
        assert!(UpstreamUrl::parse("http://x").is_err());
        assert!(UpstreamUrl::parse("http://x:0").is_err());
        assert!(UpstreamUrl::parse("http://x:8000/v1").is_err());
        assert_eq!(UpstreamUrl::parse("http://[::1]:80").unwrap().host, "::1");
        assert_eq!(UpstreamUrl::parse("http://vllm-0.vllm.svc_x:8000").unwrap().host, "vllm-0.vllm.svc_x");
        assert_eq!(UpstreamUrl::parse("http://[fe80::1%eth0]:80").unwrap().host, "fe80::1%eth0");
        for bad in ["http://a\r\nX-Injected: 1:80", "http://a b:80", "http://a\u{0}:80", "http://é:80", "http://::1:80", "http://a]b[:80", "http://[]:80"] {
            assert!(UpstreamUrl::parse(bad).unwrap_err().contains("the host must be"), "{bad:?}");
        }
        assert!(UpstreamUrl::parse("http://a:+80").unwrap_err().contains("port must be"));
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(ByteSize::parse("32MiB").unwrap(), ByteSize(32 << 20));
        assert_eq!(ByteSize::parse("10kB").unwrap(), ByteSize(10_000));
        assert_eq!(ByteSize::parse("77").unwrap(), ByteSize(77));
        assert!(ByteSize::parse("12 parsecs").is_err());
    }
}
