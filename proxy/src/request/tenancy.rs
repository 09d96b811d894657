//! A request's tenant and what it has been charged: the prompt tokens at admission, the
//! output tokens as they stream, and the counts the worker's `usage` reports, which settle
//! both at the end.

use crate::tenants::Tenant;
use kvgate_filters::tenant::Admitted;
use std::sync::Arc;

/// The tenant's side of one request.
pub struct TenantUse {
    /// Whose request it is.
    pub tenant: Arc<Tenant>,
    /// Its place in the tenant's concurrency (held from admission to the end).
    admitted: Option<Admitted>,
    /// Output tokens charged so far.
    output: u64,
    /// Whether it left the router queue to be served (else what admission took is given back).
    served: bool,
    /// What the worker's `usage` said, when it said it.
    usage: UsageScan,
}

impl TenantUse {
    /// A request of `tenant`, not admitted yet.
    pub fn new(tenant: Arc<Tenant>) -> Self {
        Self { tenant, admitted: None, output: 0, served: false, usage: UsageScan::default() }
    }

    /// The request passed its tenant's limits.
    pub fn admitted(&mut self, a: Admitted) {
        self.admitted = Some(a);
    }

    /// Whether it passed its tenant's limits and has not ended.
    pub fn is_admitted(&self) -> bool {
        self.admitted.is_some()
    }

    /// The request starts being served: its prompt counts towards its tenant's fair share.
    pub fn serving(&mut self) {
        if let Some(a) = &self.admitted {
            self.served = true;
            self.tenant.account.fair().serve(a.input_tokens);
        }
    }

    /// `n` tokens streamed to the client.
    pub fn streamed(&mut self, n: u64) {
        if self.admitted.is_some() {
            self.output += n;
            self.tenant.account.charge_output(n);
        }
    }

    /// Reads a `usage` object in what the worker sent.
    pub fn scan(&mut self, bytes: &[u8]) {
        if self.admitted.is_some() {
            self.usage.feed(bytes);
        }
    }

    /// Settles the charges with the worker's counts (when it gave them) and gives back the
    /// request's place; a request never served gets back what admission took. Returns the
    /// prompt and output tokens finally charged.
    pub fn settle(&mut self) -> (u64, u64) {
        let Some(admitted) = self.admitted.take() else { return (0, 0) };
        let account = &self.tenant.account;
        if !self.served {
            account.refund(admitted.input_tokens);
            return (0, 0);
        }
        let input = match self.usage.prompt {
            Some(p) => {
                account.correct_input(p.cast_signed().saturating_sub(admitted.input_tokens.cast_signed()));
                p
            }
            None => admitted.input_tokens,
        };
        if let Some(c) = self.usage.completion {
            account.correct_output(c.cast_signed().saturating_sub(self.output.cast_signed()));
            self.output = c;
        }
        (input, self.output)
    }
}

/// Finds a `usage` object's counts in a response, across the chunks it arrives in: OpenAI's
/// `prompt_tokens` / `completion_tokens` or Anthropic's and the Responses API's
/// `input_tokens` / `output_tokens`. The last values seen win (a stream with continuous usage
/// reports running totals). Inside a JSON string a quote is escaped, so a generated text cannot
/// look like one of these keys.
#[derive(Debug, Default)]
pub struct UsageScan {
    /// The prompt tokens reported.
    pub prompt: Option<u64>,
    /// The output tokens reported.
    pub completion: Option<u64>,
    /// The end of the previous chunk, for a key cut between two chunks.
    tail: Vec<u8>,
}

/// Long enough for a key, its colon, spaces and a count.
const TAIL: usize = 48;

impl UsageScan {
    /// Reads one chunk.
    pub fn feed(&mut self, bytes: &[u8]) {
        if !self.tail.is_empty() {
            let mut joined = std::mem::take(&mut self.tail);
            joined.extend_from_slice(&bytes[..bytes.len().min(TAIL)]);
            self.read(&joined);
        }
        self.read(bytes);
        self.tail.extend_from_slice(&bytes[bytes.len().saturating_sub(TAIL)..]);
    }

    fn read(&mut self, b: &[u8]) {
        if memchr::memmem::find(b, b"_tokens\"").is_none() {
            return;
        }
        for key in [&b"\"prompt_tokens\""[..], b"\"input_tokens\""] {
            if let Some(n) = last_count(b, key) {
                self.prompt = Some(n);
            }
        }
        for key in [&b"\"completion_tokens\""[..], b"\"output_tokens\""] {
            if let Some(n) = last_count(b, key) {
                self.completion = Some(n);
            }
        }
    }
}

/// The number after the last `key:` in `b` whose number is whole (followed by a non-digit).
fn last_count(b: &[u8], key: &[u8]) -> Option<u64> {
    let mut found = None;
    for at in memchr::memmem::find_iter(b, key) {
        let Some(rest) = b[at + key.len()..].trim_ascii_start().strip_prefix(b":") else { continue };
        let rest = rest.trim_ascii_start();
        let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
        if digits > 0 && digits < rest.len() {
            found = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok().or(found);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_either_dialect_and_across_chunks() {
        let mut u = UsageScan::default();
        u.feed(br#"{"id":"x","choices":[{"text":"\"prompt_tokens\": 999"}],"usage":{"prompt_tokens":12,"total_tokens":20,"complet"#);
        assert_eq!((u.prompt, u.completion), (Some(12), None));
        u.feed(br#"ion_tokens":8}}"#);
        assert_eq!((u.prompt, u.completion), (Some(12), Some(8)));
        let mut a = UsageScan::default();
        a.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\": 30, \"output_tokens\": 7}}\n\n");
        assert_eq!((a.prompt, a.completion), (Some(30), Some(7)));
        let mut schema = UsageScan::default();
        schema.feed(br#"{"tools":[{"required":["output_tokens"]}],"usage":{"input_tokens":5,"output_tokens":3}}"#);
        assert_eq!((schema.prompt, schema.completion), (Some(5), Some(3)), "a key named in a list is skipped, not the scan");
        let mut cut = UsageScan::default();
        cut.feed(br#"{"usage":{"completion_tokens":12"#);
        assert_eq!(cut.completion, None, "a count cut at the chunk's end is not whole yet");
        cut.feed(br#"3}}"#);
        assert_eq!(cut.completion, Some(123));
    }
}
