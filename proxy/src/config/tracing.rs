//! The `tracing` section: OpenTelemetry traces of each request, exported over OTLP/HTTP. Absent
//! (or without `otlp_endpoint`), no span is made and nothing on the request path changes.
//! Applied again on every reload.

use serde::Deserialize;

/// Where and how much to trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tracing {
    /// The OTLP/HTTP receiver, `http://host:port` (a collector's port 4318; `/v1/traces` is
    /// added unless the URL has a path). Unset: tracing is off.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// The share of requests traced, 0 to 1, decided by trace id; a request whose client sent a
    /// `traceparent` follows the client's decision.
    #[serde(default = "one")]
    pub sample_ratio: f64,
    /// `service.name` of the spans.
    #[serde(default = "service")]
    pub service_name: String,
}

fn one() -> f64 {
    1.0
}

fn service() -> String {
    "kvgate".into()
}

impl Tracing {
    /// The URL spans are posted to, when tracing is on.
    pub fn traces_url(&self) -> Option<String> {
        let base = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        let path = base.strip_prefix("http://").and_then(|rest| rest.find('/'));
        Some(if path.is_some() { base.to_string() } else { format!("{base}/v1/traces") })
    }

    /// Checks the endpoint and the ratio.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(format!("sample_ratio must be between 0 and 1, got {}", self.sample_ratio));
        }
        if self.service_name.trim().is_empty() {
            return Err("service_name must not be empty".into());
        }
        let Some(url) = &self.otlp_endpoint else { return Ok(()) };
        let Some(rest) = url.strip_prefix("http://") else {
            return Err(format!("otlp_endpoint must be an http:// URL (an OTLP/HTTP receiver such as a local collector), got `{url}`"));
        };
        let authority = rest.split('/').next().unwrap_or("");
        let (host, port) = match authority.strip_prefix('[') {
            // An IPv6 address: `[addr]` or `[addr]:port`.
            Some(v6) => match v6.split_once(']') {
                Some((h, "")) => (h, None),
                Some((h, tail)) => (h, Some(tail.strip_prefix(':').unwrap_or("?"))),
                None => ("", None),
            },
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
        let clean = !url.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b"?#@\\".contains(&b));
        if host.is_empty() || !port_ok || !clean {
            return Err(format!("otlp_endpoint `{url}` is not a valid URL (http://host[:port][/path], without a query, fragment or user)"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(endpoint: &str) -> Tracing {
        Tracing { otlp_endpoint: Some(endpoint.into()), sample_ratio: 1.0, service_name: service() }
    }

    #[test]
    fn the_traces_path_is_added_unless_given() {
        assert_eq!(with("http://c:4318").traces_url().unwrap(), "http://c:4318/v1/traces");
        assert_eq!(with("http://c:4318/").traces_url().unwrap(), "http://c:4318/v1/traces");
        assert_eq!(with("http://c:4318/custom/traces").traces_url().unwrap(), "http://c:4318/custom/traces");
        assert_eq!(Tracing { otlp_endpoint: None, ..with("http://c") }.traces_url(), None);
    }

    #[test]
    fn bad_endpoints_and_ratios_are_refused() {
        assert!(with("http://c:4318").validate().is_ok());
        assert!(with("https://c:4318").validate().unwrap_err().contains("http://"));
        assert!(with("c:4318").validate().is_err());
        assert!(with("http://").validate().is_err());
        assert!(with("http://c:43 18").validate().is_err());
        assert!(with("http://c:abc").validate().is_err(), "a port that is not a number");
        assert!(with("http://c:0").validate().is_err());
        assert!(with("http://c:4318?x=1").validate().is_err(), "a query would end up before /v1/traces");
        assert!(with("http://user@c:4318").validate().is_err());
        assert!(with("http://[::1]:4318").validate().is_ok());
        assert!(with("http://[::1]").validate().is_ok());
        assert!(with("http://[::1]x").validate().is_err());
        assert!(with("http://collector.monitoring.svc/v1/traces").validate().is_ok());
        assert!(Tracing { sample_ratio: 1.5, ..with("http://c") }.validate().unwrap_err().contains("sample_ratio"));
        assert!(Tracing { sample_ratio: f64::NAN, ..with("http://c") }.validate().is_err());
    }
}
