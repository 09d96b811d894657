//! How the planner gets workers and gives them back: one [`Connector`] per planned model,
//! built from its `planner.connector` section.
//! - [`local`]: worker processes on this machine, from a command template.
//!
//! A connector only starts and stops workers; the planner decides when, waits for a new one to
//! answer before it joins routing, and drains one before it is stopped.

pub mod local;

use crate::config::{ConnectorConfig, UpstreamUrl};

/// A worker a connector runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Managed {
    /// Its name (the `{name}` of the local template, and how `/workers` shows its origin).
    pub name: String,
    /// Where it serves.
    pub url: UpstreamUrl,
    /// Its GPUs.
    pub gpus: Vec<u32>,
    /// Whether it publishes KV events, found through its `GET /kv_event_sources`.
    pub kv_events: bool,
}

/// Why a connector could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    /// Every port of its range, or every GPU of its pool, is taken.
    #[error("no room for another worker: {0}")]
    Exhausted(String),
    /// The worker could not be started.
    #[error("cannot start the worker: {0}")]
    Start(#[source] std::io::Error),
    /// It knows no worker of that name.
    #[error("no worker named {0:?}")]
    Unknown(String),
}

/// Starts and stops a model's workers.
#[async_trait::async_trait]
pub trait Connector: Send + Sync {
    /// Its `kind` in the config.
    fn kind(&self) -> &'static str;
    /// Starts one worker and returns it (started, not necessarily answering yet).
    async fn add(&self) -> Result<Managed, ConnectorError>;
    /// Stops worker `name` and returns once it exited (or was killed).
    async fn remove(&self, name: &str) -> Result<(), ConnectorError>;
    /// The workers it runs now.
    fn list(&self) -> Vec<Managed>;
    /// The workers that exited without being removed since the last call (each once); they
    /// are forgotten, their ports and GPUs free again.
    fn reap(&self) -> Vec<Managed>;
}

/// The connector a planned model's section asks for.
pub fn build(cfg: &ConnectorConfig, model: &str, gpus_per_worker: u32) -> Box<dyn Connector> {
    match cfg {
        ConnectorConfig::Local(l) => Box::new(local::Local::new(l.clone(), model, gpus_per_worker)),
    }
}
