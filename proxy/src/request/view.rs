//! The fields of a request body that routing reads (filled by [`super::fields::read`]); the
//! rest of the body is forwarded untouched.

use serde::Deserialize;

/// The fields routing reads.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct RequestView {
    /// `model`.
    pub model: Option<String>,
    /// `stream`.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The request's `nvext` object (agent hints), kept whole for plugins.
    #[serde(default)]
    pub nvext: Option<serde_json::Value>,
    /// `stream_options`.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
}

/// The part of `stream_options` the gateway reads.
#[derive(Debug, Default, PartialEq, Deserialize)]
pub struct StreamOptions {
    /// `include_usage`: a final usage event.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

impl RequestView {
    /// Router-queue priority jump (seconds of head start): `nvext.agent_hints.priority`, else
    /// `latency_sensitivity`.
    pub fn priority_jump(&self) -> f64 {
        let hint = |name: &str| self.nvext.as_ref().and_then(|n| n.get("agent_hints")?.get(name)?.as_f64());
        hint("priority").or_else(|| hint("latency_sensitivity")).unwrap_or(0.0).max(0.0)
    }

    /// Whether the client asked for a final usage event.
    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }

    /// The client's expected output length (`nvext.agent_hints.osl`).
    pub fn expected_output(&self) -> Option<u64> {
        self.nvext.as_ref().and_then(|v| v.pointer("/agent_hints/osl")).and_then(serde_json::Value::as_u64)
    }
}
