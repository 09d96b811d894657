//! LoRA adapters as vLLM 0.32's `OpenAIServingModels` serves them: the adapters loaded (at
//! start-up from `--lora-modules`, at run time through `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, which exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`), their
//! cards in `/v1/models`, and the name a request gives as `model`.
//!
//! Responses, status codes and messages are vLLM's (checked against a real server): a success is
//! a 200 whose body is a bare text line (no content type); refusals are its JSON errors
//! (`InvalidUserInput` 400s, `NotFoundError` 404s). A path must be a directory holding an
//! `adapter_config.json`, as vLLM requires; no weights are read.

use super::AppState;
use super::adapters::LoadRequest;
use super::error::{ApiError, json_response};
use super::protocol::parse_body;
use crate::lora::LoraRequest;
use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use std::sync::Arc;

fn invalid(message: String) -> ApiError {
    ApiError { status: StatusCode::BAD_REQUEST, message, kind: "InvalidUserInput", param: None }
}

fn not_found(message: String) -> ApiError {
    ApiError { status: StatusCode::NOT_FOUND, message, kind: "NotFoundError", param: None }
}

impl AppState {
    /// Loads an adapter as vLLM's `load_lora_adapter`: the checks in its order, then the
    /// engine's (LoRA enabled, an adapter at the path). `base_model_name` names its parent when
    /// it is a served base model. The success message is vLLM's.
    pub fn load_lora(&self, req: &LoadRequest, base_model_name: Option<&str>) -> Result<String, ApiError> {
        let name = req.lora_name.as_str();
        if name.is_empty() || req.lora_path.is_empty() {
            return Err(invalid("Both 'lora_name' and 'lora_path' must be provided.".into()));
        }
        let bases = self.served_names();
        if bases.iter().any(|b| b == name) {
            return Err(invalid(format!("The lora adapter '{name}' conflicts with a served base model.")));
        }
        let mut inner = self.loras.inner.lock();
        let existing = inner.adapters.iter().position(|a| a.name == name);
        if existing.is_some() && !req.load_inplace {
            return Err(invalid(format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            )));
        }
        if !self.cfg.enable_lora {
            return Err(ApiError::internal("LoRA is not enabled. Use --enable-lora to enable LoRA."));
        }
        if !std::path::Path::new(&req.lora_path).join("adapter_config.json").is_file() {
            return Err(not_found(sanitize_paths(&format!("Loading lora {name} failed: No adapter found for {}", req.lora_path))));
        }
        let id = match existing {
            Some(i) => inner.adapters[i].id,
            None => {
                inner.last_id += 1;
                inner.last_id
            }
        };
        let base_model_name = base_model_name.filter(|b| bases.iter().any(|n| n == b)).map(str::to_owned);
        let adapter = Arc::new(LoraRequest { id, name: name.to_owned(), path: req.lora_path.clone(), base_model_name });
        match existing {
            Some(i) => inner.adapters[i] = adapter,
            None => inner.adapters.push(adapter),
        }
        tracing::info!(name, path = req.lora_path.as_str(), "Loaded new LoRA adapter");
        Ok(format!("Success: LoRA adapter '{name}' added successfully."))
    }

    /// Unloads an adapter as vLLM's `unload_lora_adapter` (requests running on it finish).
    pub fn unload_lora(&self, name: &str) -> Result<String, ApiError> {
        if name.is_empty() {
            return Err(invalid("'lora_name' needs to be provided to unload a LoRA adapter.".into()));
        }
        let mut inner = self.loras.inner.lock();
        let Some(i) = inner.adapters.iter().position(|a| a.name == name) else {
            return Err(not_found(format!("The lora adapter '{name}' cannot be found.")));
        };
        inner.adapters.remove(i);
        tracing::info!(name, "Removed LoRA adapter");
        Ok(format!("Success: LoRA adapter '{name}' removed successfully."))
    }

    /// The adapters' `/v1/models` cards: `root` is the path, `parent` the base model (the first
    /// served name unless one was given), no `max_model_len`.
    pub fn lora_cards(&self) -> Vec<Value> {
        let bases = self.served_names();
        self.loras
            .all()
            .iter()
            .map(|a| {
                let parent = a.base_model_name.clone().unwrap_or_else(|| bases[0].clone());
                self.model_card(&a.name, &a.path, Some(&parent), None)
            })
            .collect()
    }

    /// One `/v1/models` card.
    pub fn model_card(&self, id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>) -> Value {
        json!({
            "id": id, "object": "model", "created": self.created, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": max_model_len,
            "permission": [{"id": format!("modelperm-{}", self.created), "object": "model_permission", "created": self.created,
                "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false,
                "allow_view": true, "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false}],
        })
    }
}

/// vLLM's success answer: a 200 with the message as a bare body.
fn success(message: String) -> Response {
    let mut r = Response::new(Body::from(message));
    *r.status_mut() = StatusCode::OK;
    r
}

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "load_inplace"}`.
pub async fn load(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<String, ApiError> {
        let v: Value = parse_body(&body)?;
        let req = LoadRequest {
            lora_name: required_str(&v, &["lora_name", "lora_path"], "lora_name")?,
            lora_path: required_str(&v, &["lora_name", "lora_path"], "lora_path")?,
            load_inplace: v.get("load_inplace").and_then(Value::as_bool).unwrap_or(false),
        };
        st.load_lora(&req, None)
    };
    run().map_or_else(IntoResponse::into_response, success)
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"}`.
pub async fn unload(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<String, ApiError> {
        let v: Value = parse_body(&body)?;
        st.unload_lora(&required_str(&v, &["lora_name"], "lora_name")?)
    };
    run().map_or_else(IntoResponse::into_response, success)
}

/// A required string field of a body, or pydantic's refusal of every missing required field
/// (`fields`), as vLLM words it.
fn required_str(body: &Value, fields: &[&str], field: &str) -> Result<String, ApiError> {
    let missing: Vec<&&str> = fields.iter().filter(|f| body.get(**f).is_none()).collect();
    if let Some(first) = missing.first() {
        let items = body.as_object().map_or(0, |m| m.len());
        let errors: Vec<String> =
            missing.iter().map(|f| format!("{{'type': 'missing', 'loc': 'body.{f}', 'msg': 'Field required', 'input': '<dict of {items} items>'}}")).collect();
        let plural = if errors.len() == 1 { "" } else { "s" };
        return Err(ApiError::validation(format!("{} validation error{plural}:\n  {}", errors.len(), errors.join("\n  ")), &format!("body.{first}")));
    }
    match &body[field] {
        Value::String(s) => Ok(s.clone()),
        other => Err(ApiError::validation(
            format!("1 validation error:\n  {{'type': 'string_type', 'loc': 'body.{field}', 'msg': 'Input should be a valid string', 'input': {other}}}"),
            &format!("body.{field}"),
        )),
    }
}

/// vLLM's `sanitize_message` for paths under the usual system roots: `/tmp/x/y` → `<path>`.
fn sanitize_paths(message: &str) -> String {
    const ROOTS: [&str; 9] = ["home", "usr", "opt", "var", "tmp", "root", "lib", "mnt", "srv"];
    let seg = |c: char| c.is_alphanumeric() || matches!(c, '_' | '.' | '-');
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find('/') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        // A root, then one or more `/segment`s.
        let matched = ROOTS.iter().find_map(|r| {
            let after = tail.strip_prefix(r)?;
            let mut end = 0;
            while let Some(s) = after[end..].strip_prefix('/') {
                let len = s.find(|c: char| !seg(c)).unwrap_or(s.len());
                if len == 0 {
                    break;
                }
                end += 1 + len;
            }
            (end > 0).then_some(1 + r.len() + end)
        });
        match matched {
            Some(len) => {
                out.push_str("<path>");
                rest = &rest[at + len..];
            }
            None => {
                out.push('/');
                rest = tail;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `json_response` for callers outside this module that answer a card list.
pub fn models_response(st: &AppState) -> Response {
    let mut data: Vec<Value> = st.served_names().iter().map(|n| st.model_card(n, &st.cfg.model, None, Some(st.cfg.max_model_len))).collect();
    data.extend(st.lora_cards());
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_hidden_as_vllm_hides_them() {
        assert_eq!(sanitize_paths("No adapter found for /tmp/lora-check"), "No adapter found for <path>");
        assert_eq!(sanitize_paths("No adapter found for /nonexistent/x"), "No adapter found for /nonexistent/x");
        assert_eq!(sanitize_paths("at /root/a/b.c and /tmpx/y and /tmp"), "at <path> and /tmpx/y and /tmp");
        assert_eq!(sanitize_paths("/home/u/x, then"), "<path>, then");
    }

    #[test]
    fn missing_fields_are_refused_as_pydantic_words_it() {
        let e = required_str(&json!({"lora_name": "a"}), &["lora_name", "lora_path"], "lora_name").unwrap_err();
        assert_eq!(e.message, "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field required', 'input': '<dict of 1 items>'}");
        assert_eq!((e.status.as_u16(), e.kind, e.param.as_deref()), (400, "Bad Request", Some("body.lora_path")));
        assert!(required_str(&json!({}), &["lora_name", "lora_path"], "lora_name").unwrap_err().message.starts_with("2 validation errors:"));
        assert!(required_str(&json!({"lora_name": 5}), &["lora_name"], "lora_name").unwrap_err().message.contains("string_type"));
        assert_eq!(required_str(&json!({"lora_name": "a"}), &["lora_name"], "lora_name").unwrap(), "a");
    }
}
