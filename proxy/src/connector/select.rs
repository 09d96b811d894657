//! Which [`Connector`] a planned model's `planner.connector` section asks for.

use super::Connector;
use super::kubernetes::Kubernetes;
use super::local::Local;
use crate::config::ConnectorConfig;

/// The connector a planned model's section asks for.
pub fn build(cfg: &ConnectorConfig, model: &str, gpus_per_worker: u32) -> Box<dyn Connector> {
    match cfg {
        ConnectorConfig::Local(l) => Box::new(Local::new(l.clone(), model, gpus_per_worker)),
        ConnectorConfig::Kubernetes(k) => Box::new(Kubernetes::new(k.clone())),
    }
}
