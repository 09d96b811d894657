//! How the planner gets workers and gives them back: one [`Connector`] per planned model,
//! built from its `planner.connector` section.
//! - [`local`]: worker processes on this machine, from a command template;
//! - [`kubernetes`]: a Deployment or StatefulSet scaled through its `scale` subresource, its
//!   workers discovered from EndpointSlices.
//!
//! A connector only starts and stops workers; the planner decides when, waits for a new one to
//! answer before it joins routing, and drains one before it is stopped.

pub mod kubernetes;
pub mod local;
pub mod output;
pub mod select;

pub use select::build;

use crate::config::{Origin, UpstreamUrl};

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
    /// How `GET /workers` names where it came from.
    pub origin: Origin,
}

impl Managed {
    /// It as a worker of the model's fleet.
    pub fn worker_config(&self) -> crate::config::WorkerConfig {
        crate::config::WorkerConfig::added(self.url.clone(), self.kv_events, self.origin.clone())
    }
}

/// Why a connector could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ConnectorError {
    /// Every port of its range, or every GPU of its pool, is taken.
    #[error("no room for another worker: {0}")]
    Exhausted(String),
    /// The cluster refused or failed a call.
    #[error("kubernetes: {0}")]
    Cluster(String),
    /// A new worker did not appear, or a removed one did not go, in time.
    #[error("{0}")]
    Timeout(String),
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
    /// Whether [`Connector::list`] is what the cluster reports ready (discovery): the planner
    /// then keeps routing equal to it, and the cluster's own controller replaces workers that
    /// die.
    fn discovers(&self) -> bool {
        false
    }
    /// Whether worker `name` is one [`Connector::remove`] can remove (a StatefulSet only ever
    /// removes its highest ordinal).
    fn can_remove(&self, _name: &str) -> bool {
        true
    }
    /// Seconds a new worker has to come up.
    fn ready_timeout(&self) -> std::time::Duration;
    /// How worker `name`, which exited on its own, ended, and what it last wrote, when known.
    fn last_words(&self, _name: &str) -> Option<String> {
        None
    }
}
