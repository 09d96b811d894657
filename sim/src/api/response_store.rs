//! The Responses API's stored responses, kept in the server's state (the endpoints:
//! `responses.rs`).

use parking_lot::Mutex;
use serde_json::Value;
use std::collections::HashMap;

/// Responses kept while the store is on: the response as last answered, the chat messages it
/// was rendered from, and the task of a background one still running.
#[derive(Default)]
pub struct ResponseStore {
    pub(super) map: Mutex<HashMap<String, Stored>>,
}

pub(super) struct Stored {
    pub(super) response: Value,
    pub(super) messages: Vec<Value>,
    pub(super) task: Option<tokio::task::AbortHandle>,
}

impl ResponseStore {
    pub(super) fn put(&self, id: &str, response: Value, messages: Vec<Value>) {
        self.map.lock().insert(id.to_owned(), Stored { response, messages, task: None });
    }

    /// Replaces a stored response unless it was cancelled meanwhile (vLLM keeps the cancel).
    pub(super) fn finish(&self, id: &str, response: Value) {
        if let Some(s) = self.map.lock().get_mut(id)
            && s.response["status"] != "cancelled"
        {
            s.response = response;
            s.task = None;
        }
    }

    pub(super) fn get(&self, id: &str) -> Option<(Value, Vec<Value>)> {
        self.map.lock().get(id).map(|s| (s.response.clone(), s.messages.clone()))
    }
}
