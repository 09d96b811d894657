//! The `passthrough` section: which paths outside the gateway's catalogue (docs/endpoints.md)
//! are forwarded to a worker unchanged. vLLM's control endpoints are never forwarded from the
//! public listener, whatever this section says; an `allow` entry naming one is refused at load.

use serde::{Deserialize, Deserializer, de};

/// Paths outside the catalogue, forwarded unchanged to a healthy worker of the request's model.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Passthrough {
    /// When not empty, only the paths matching one of these pass through; others are 404.
    pub allow: Vec<AllowedPath>,
    /// Paths that never pass through (404), on top of vLLM's control endpoints.
    pub deny: Vec<PathPattern>,
}

impl Passthrough {
    /// Whether a path outside the catalogue (not a control path) is forwarded.
    pub fn passes(&self, path: &str) -> bool {
        (self.allow.is_empty() || self.allow.iter().any(|p| p.0.matches(path))) && !self.deny.iter().any(|p| p.matches(path))
    }
}

/// A path, or a path prefix when it ends in `*` (`/v1/custom/*`). Checked when it is read, so a
/// bad entry is reported at its line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    /// The path, or the prefix (without its `*`).
    text: String,
    /// Whether it matches every path that starts with `text`.
    prefix: bool,
}

impl PathPattern {
    /// Parses `/path` or `/prefix*`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (text, prefix) = match s.strip_suffix('*') {
            Some(t) => (t, true),
            None => (s, false),
        };
        if !text.starts_with('/') {
            return Err(format!("{s:?}: a passthrough path starts with '/'"));
        }
        if text.bytes().any(|b| b <= b' ' || b == 0x7f || b == b'*' || b == b'?' || b == b'#') {
            return Err(format!("{s:?}: a passthrough path holds no space, control byte, query or '*' but a final one"));
        }
        Ok(Self { text: text.to_string(), prefix })
    }

    /// Whether `path` is this one, or starts with this prefix.
    pub fn matches(&self, path: &str) -> bool {
        if self.prefix { path.starts_with(&self.text) } else { path == self.text }
    }

    /// A control path this pattern would let through, if any.
    fn opens_control(&self) -> Option<&'static str> {
        crate::endpoint::CONTROL.iter().copied().find(|c| self.matches(c))
    }
}

/// An `allow` entry: a [`PathPattern`] that lets no control endpoint through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPath(pub PathPattern);

impl<'de> Deserialize<'de> for AllowedPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let p = PathPattern::parse(&s).map_err(de::Error::custom)?;
        match p.opens_control() {
            Some(c) => Err(de::Error::custom(format!("{c} is a vLLM control endpoint and is never passed through from the public listener"))),
            None => Ok(Self(p)),
        }
    }
}

impl<'de> Deserialize<'de> for PathPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_paths_and_prefixes() {
        let exact = PathPattern::parse("/version").unwrap();
        assert!(exact.matches("/version") && !exact.matches("/version2"));
        let prefix = PathPattern::parse("/v1/custom/*").unwrap();
        assert!(prefix.matches("/v1/custom/a") && !prefix.matches("/v1/other"));
        for bad in ["version", "/a b", "/a*b*", "/a?x", ""] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn allow_and_deny_adjust_what_passes() {
        let p = |allow: &[&str], deny: &[&str]| Passthrough {
            allow: allow.iter().map(|s| AllowedPath(PathPattern::parse(s).unwrap())).collect(),
            deny: deny.iter().map(|s| PathPattern::parse(s).unwrap()).collect(),
        };
        assert!(Passthrough::default().passes("/version"));
        assert!(!p(&["/ping"], &[]).passes("/version"));
        assert!(p(&["/ping"], &[]).passes("/ping"));
        assert!(!p(&[], &["/ver*"]).passes("/version"));
    }

    #[test]
    fn an_allow_entry_cannot_open_a_control_path() {
        assert!(serde_yaml::from_str::<AllowedPath>("/version").is_ok());
        let e = serde_yaml::from_str::<AllowedPath>("/pa*").unwrap_err().to_string();
        assert!(e.contains("/pause is a vLLM control endpoint"), "{e}");
    }
}
