//! Rate-limit headers as the APIs clients expect them write them: OpenAI's
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (reset as a Go-style duration,
//! `6m0s`), and Anthropic's `anthropic-ratelimit-{requests,input-tokens,output-tokens,tokens}-
//! {limit,remaining,reset}` (reset as an RFC 3339 time). Both SDKs read `retry-after` (and
//! `retry-after-ms`) to wait before their own retry, and `x-should-retry: false` to give up.

use kvgate_filters::tenant::{Level, Snapshot};
use std::time::{Duration, SystemTime};

/// The headers for a tenant's limits, in OpenAI's form. Input tokens are the `tokens` limit
/// (what OpenAI's TPM is checked against when a request arrives); output tokens, which OpenAI
/// does not limit apart, are `output-tokens`.
pub fn openai(s: &Snapshot) -> Vec<(&'static str, String)> {
    let mut h = Vec::with_capacity(9);
    let mut put = |names: [&'static str; 3], l: Option<Level>| {
        if let Some(l) = l {
            h.push((names[0], l.limit.to_string()));
            h.push((names[1], l.remaining.to_string()));
            h.push((names[2], go_duration(l.reset)));
        }
    };
    put(["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"], s.requests);
    put(["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"], s.input);
    put(["x-ratelimit-limit-output-tokens", "x-ratelimit-remaining-output-tokens", "x-ratelimit-reset-output-tokens"], s.output);
    h
}

/// The headers for a tenant's limits, in Anthropic's form; `tokens` is whichever of the input
/// and output limits has less left.
pub fn anthropic(s: &Snapshot, now: SystemTime) -> Vec<(&'static str, String)> {
    let mut h = Vec::with_capacity(12);
    let mut put = |names: [&'static str; 3], l: Option<Level>| {
        if let Some(l) = l {
            h.push((names[0], l.limit.to_string()));
            h.push((names[1], l.remaining.to_string()));
            h.push((names[2], rfc3339(now + l.reset)));
        }
    };
    put(["anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"], s.requests);
    put(["anthropic-ratelimit-input-tokens-limit", "anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"], s.input);
    put(["anthropic-ratelimit-output-tokens-limit", "anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"], s.output);
    let tightest = [s.input, s.output].into_iter().flatten().min_by_key(|l| l.remaining);
    put(["anthropic-ratelimit-tokens-limit", "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"], tightest);
    h
}

/// A duration as Go prints one, to the millisecond: `20ms`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s_ms) = (ms / 3_600_000, ms / 60_000 % 60, ms % 60_000);
    let secs = if s_ms % 1000 == 0 { format!("{}s", s_ms / 1000) } else { format!("{}s", format!("{:.3}", s_ms as f64 / 1000.0).trim_end_matches('0')) };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

/// A time as RFC 3339 in UTC, to the second (`2026-11-29T21:02:28Z`).
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, d) = civil(i64::try_from(days).unwrap_or(0));
    format!("{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The calendar date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_times_are_written_as_the_apis_write_them() {
        assert_eq!(go_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(go_duration(Duration::from_secs(3723)), "1h2m3s");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_000_548)), "2026-11-30T01:02:28Z");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn only_the_limits_a_tenant_has_are_shown() {
        let l = Level { limit: 10_000, remaining: 2_500, reset: Duration::from_secs(45) };
        let s = Snapshot { input: Some(l), ..Snapshot::default() };
        let o = openai(&s);
        assert_eq!(
            o,
            vec![("x-ratelimit-limit-tokens", "10000".into()), ("x-ratelimit-remaining-tokens", "2500".into()), ("x-ratelimit-reset-tokens", "45s".into())]
        );
        let a = anthropic(&s, SystemTime::UNIX_EPOCH);
        assert!(a.contains(&("anthropic-ratelimit-input-tokens-reset", "1970-01-01T00:00:45Z".into())));
        assert!(a.contains(&("anthropic-ratelimit-tokens-remaining", "2500".into())));
        assert_eq!(a.len(), 6);
    }
}
