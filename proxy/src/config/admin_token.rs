//! The admin listener's bearer token (`admin_token_file`, or the `KVGATE_ADMIN_TOKEN`
//! environment variable): kept out of logs and `Debug`, compared in constant time.

use std::fmt;

/// A secret the admin API requires as `Authorization: Bearer <token>`.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl AdminToken {
    /// The token in `text` (surrounding whitespace, such as a file's last newline, removed);
    /// an error when nothing is left.
    pub fn new(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.is_empty() {
            return Err("the admin token is empty".into());
        }
        if t.chars().any(|c| c.is_control() || c == ' ') {
            return Err("the admin token must not contain spaces or control characters".into());
        }
        Ok(Self(t.to_string()))
    }

    /// Whether an `Authorization` header value carries this token. The comparison takes the
    /// same time wherever the first difference is, so the token cannot be guessed byte by byte
    /// from response times.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(given) = authorization.and_then(|v| v.strip_prefix(b"Bearer ").or_else(|| v.strip_prefix(b"bearer "))) else { return false };
        let want = self.0.as_bytes();
        let mut diff = (given.len() ^ want.len()) as u8 | u8::from(given.len() != want.len());
        for (i, &w) in want.iter().enumerate() {
            diff |= w ^ given.get(i).copied().unwrap_or(!w);
        }
        diff == 0
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_token_is_admitted_and_it_is_never_printed() {
        let t = AdminToken::new("s3cret-token\n").unwrap();
        assert!(t.admits(Some(b"Bearer s3cret-token")));
        for bad in [&b"Bearer s3cret-toke"[..], b"Bearer s3cret-tokenX", b"Bearer ", b"s3cret-token", b"Basic s3cret-token", b"Bearer S3cret-token"] {
            assert!(!t.admits(Some(bad)), "{}", String::from_utf8_lossy(bad));
        }
        assert!(!t.admits(None));
        assert!(!format!("{t:?}").contains("s3cret"));
        assert!(AdminToken::new(" \n").is_err());
        assert!(AdminToken::new("a b").is_err());
    }
}
