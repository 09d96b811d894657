//! Why a plugin did not produce a usable answer. Every failure of a call is answered by the
//! model's built-in fallback and counted under its [`Failure::kind`].

use thiserror::Error;

/// A failed call.
#[derive(Debug, Clone, Error, PartialEq)]
pub enum Failure {
    /// Ran past its deadline (epoch interruption).
    #[error("ran past its {0} ms deadline")]
    Timeout(u64),
    /// Tried to grow memory past its cap.
    #[error("exceeded its {0} MiB memory cap")]
    Memory(u64),
    /// Trapped (a panic, `unreachable`, an out-of-bounds access...).
    #[error("trapped: {0}")]
    Trap(String),
    /// Answered something the host cannot use (an unknown worker, a bad score list...).
    #[error("invalid answer: {0}")]
    Invalid(String),
    /// Not called: it failed [`crate::routing::TRIP_AFTER`] times in a row and is skipped
    /// until the backoff ends.
    #[error("skipped after repeated failures; next try in {0:?}")]
    Skipped(std::time::Duration),
}

impl Failure {
    /// Metric label: `timeout`, `memory`, `trap`, `invalid` or `skipped`.
    pub fn kind(&self) -> &'static str {
        match self {
            Failure::Timeout(_) => "timeout",
            Failure::Memory(_) => "memory",
            Failure::Trap(_) => "trap",
            Failure::Invalid(_) => "invalid",
            Failure::Skipped(_) => "skipped",
        }
    }
}

/// Why a plugin could not be loaded; the previous one (if any) stays in place.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("plugin {plugin:?}: {message}")]
pub struct LoadError {
    /// The plugin's configured name.
    pub plugin: String,
    /// What is wrong, for an operator.
    pub message: String,
}
