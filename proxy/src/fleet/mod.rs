//! The live set of models and their workers, built from a validated config and swapped as a
//! whole on reload:
//! - [`worker`]: one vLLM server (health, resolved address, the load it reports, paused or not);
//! - [`cards`]: what a worker's `/v1/models` says it serves (model cards, LoRA adapters);
//! - [`calibration`]: how fast a worker prefills and steps, as the gateway measured it;
//! - [`model`]: a served model (its workers, routing policy, booking ledger, queue);
//! - [`registry`]: keeps workers across reloads, keyed by URL, and builds the next fleet;
//! - [`stored_responses`]: which worker stored each Responses-API response.
//!
//! A request holds `Arc`s to the model and worker it started with, so a reload that removes
//! them never disturbs it.

pub mod calibration;
mod cards;
mod model;
pub(crate) mod registry;
mod stored_responses;
mod worker;

pub use cards::ModelCards;
pub use model::Model;
pub use stored_responses::StoredResponses;
pub use worker::{FoundKvSource, ReportedLoad, Worker};

use std::collections::HashMap;
use std::sync::Arc;

/// A map by model name. Every request looks its model up in one, so it hashes with foldhash
/// rather than SipHash (far fewer instructions per lookup). The keys come from the
/// config, never from clients, so no client can fill a bucket.
pub type ByName<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// Every served model.
pub struct Fleet {
    /// By name.
    pub models: ByName<Arc<Model>>,
    /// Names in config order.
    pub order: Vec<String>,
}

impl Fleet {
    /// Every (model, worker) pair, in config order.
    pub fn all_workers(&self) -> Vec<(String, Arc<Worker>)> {
        let mut out = Vec::new();
        for name in &self.order {
            for w in self.models[name].workers.iter() {
                out.push((name.clone(), w.clone()));
            }
        }
        out
    }

    /// The model clients address as `name`.
    pub fn model(&self, name: &str) -> Option<&Arc<Model>> {
        self.models.get(name)
    }

    /// The model a request names, or the only one when it names none (as vLLM does). A name
    /// that is no configured model may be a LoRA adapter: it resolves to the first model (in
    /// config order) one of whose workers lists it.
    pub fn resolve(&self, name: Option<&str>) -> Option<&Arc<Model>> {
        match name {
            Some(n) => self.model(n).or_else(|| self.adapter_base(n)),
            None if self.order.len() == 1 => self.model(&self.order[0]),
            None => None,
        }
    }

    /// The model whose workers serve LoRA adapter `name`.
    pub fn adapter_base(&self, name: &str) -> Option<&Arc<Model>> {
        self.order.iter().map(|n| &self.models[n]).find(|m| m.workers.iter().any(|w| w.has_adapter(name)))
    }

    /// The LoRA adapter a request for `model` names as `named` (`None`: the base model).
    pub fn adapter<'a>(model: &Model, named: Option<&'a str>) -> Option<&'a str> {
        named.filter(|n| *n != model.cfg.name)
    }
}
