//! The model-scoped endpoints the gateway serves.

/// Which model-scoped endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/tokenize`, passed through to a healthy worker of the model.
    Tokenize,
    /// `/detokenize`, passed through to a healthy worker of the model.
    Detokenize,
}

impl Endpoint {
    /// Every endpoint, in [`Endpoint::index`] order.
    pub const ALL: [Endpoint; 4] = [Endpoint::Chat, Endpoint::Completions, Endpoint::Tokenize, Endpoint::Detokenize];

    /// Position in [`Endpoint::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The endpoint a client path names.
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Self::Chat),
            "/v1/completions" => Some(Self::Completions),
            "/tokenize" => Some(Self::Tokenize),
            "/detokenize" => Some(Self::Detokenize),
            _ => None,
        }
    }

    /// Metric label (seed 003's values for the inference endpoints).
    pub fn label(self) -> &'static str {
        match self {
            Self::Chat => "chat_completions",
            Self::Completions => "completions",
            Self::Tokenize => "tokenize",
            Self::Detokenize => "detokenize",
        }
    }

    /// The worker path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
            Self::Tokenize => "/tokenize",
            Self::Detokenize => "/detokenize",
        }
    }

    /// Whether it generates tokens (and so is queued, booked and counted as inference).
    pub fn generates(self) -> bool {
        matches!(self, Self::Chat | Self::Completions)
    }
}
