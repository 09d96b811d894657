//! How a request ended: what its record counts and its connection does next.

use crate::error::GatewayError;

/// How a request ended.
#[derive(Debug)]
pub enum Outcome {
    /// A complete response went out with this status.
    Served(u16),
    /// The worker died mid-response; the client connection must be closed abruptly so the
    /// client sees an error, not a clean end of a truncated body.
    Truncated(u16),
    /// The gateway answered with an error.
    Refused(GatewayError),
    /// The client went away.
    Cancelled,
}

impl Outcome {
    /// The HTTP status recorded for it (499: the client left).
    pub fn status(&self) -> u16 {
        match self {
            Self::Served(s) | Self::Truncated(s) => *s,
            Self::Refused(e) => e.status(),
            Self::Cancelled => 499,
        }
    }
}
