//! LoRA adapters as the engine sees them: the adapter a request runs with ([`LoraRequest`]) and
//! the `--lora-modules` syntaxes that name them at start-up ([`parse_lora_modules`]).
//!
//! The simulator loads no weights: an adapter is a name, a path and an id. What vLLM does with
//! one and routers can observe is kept: its requests hash their KV blocks in a space of their
//! own (the name and path are extra keys of every block), their `BlockStored` events carry
//! `lora_id`, `lora_name` and the name first in `extra_keys`, and at most `--max-loras` adapters
//! run in one batch. Serving them (`/v1/models`, load and unload) is `api::lora`'s business.

use serde::Deserialize;

/// An adapter a request runs with (vLLM's `LoRARequest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraRequest {
    /// vLLM's `lora_int_id`: 1, 2, … in load order (published as `lora_id`).
    pub id: u32,
    /// The name requests give as `model`.
    pub name: String,
    /// Where it was loaded from (`root` in `/v1/models`; part of every block's hash).
    pub path: String,
    /// The base model it belongs to (`parent` in `/v1/models`), when one was named.
    pub base_model_name: Option<String>,
}

/// One `--lora-modules` entry (vLLM's `LoRAModulePath`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraModule {
    /// Adapter name.
    pub name: String,
    /// Adapter path.
    pub path: String,
    /// The base model it belongs to.
    #[serde(default)]
    pub base_model_name: Option<String>,
    /// Accepted for compatibility; the simulator has no weights.
    #[serde(default)]
    pub is_3d_lora_weight: bool,
}

/// Parses `--lora-modules` values as vLLM's `LoRAParserAction`: `name=path` (an item with `=`
/// and no `,`), else a JSON object `{"name", "path", "base_model_name"}`; empty items skipped.
pub fn parse_lora_modules(items: &[String]) -> Result<Vec<LoraModule>, String> {
    let mut out = Vec::with_capacity(items.len());
    for item in items.iter().filter(|i| !i.is_empty()) {
        if let Some((name, path)) = item.split_once('=').filter(|_| !item.contains(',')) {
            out.push(LoraModule { name: name.to_owned(), path: path.to_owned(), base_model_name: None, is_3d_lora_weight: false });
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(item).map_err(|_| format!("Invalid JSON format for --lora-modules: {item}"))?;
        out.push(serde_json::from_value(value).map_err(|e| format!("Invalid fields for --lora-modules: {item} - {e}"))?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_of_vllms_syntaxes_parse() {
        let items: Vec<String> =
            ["sql=/lora/sql", "", r#"{"name": "chat", "path": "/lora/chat", "base_model_name": "tiny"}"#, "eq=/lora/a=b"].map(String::from).to_vec();
        let m = parse_lora_modules(&items).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!((m[0].name.as_str(), m[0].path.as_str(), m[0].base_model_name.as_deref()), ("sql", "/lora/sql", None));
        assert_eq!((m[1].name.as_str(), m[1].path.as_str(), m[1].base_model_name.as_deref()), ("chat", "/lora/chat", Some("tiny")));
        assert_eq!((m[2].name.as_str(), m[2].path.as_str()), ("eq", "/lora/a=b"));
        assert!(parse_lora_modules(&["nope".into()]).unwrap_err().starts_with("Invalid JSON format for --lora-modules"));
        assert!(parse_lora_modules(&[r#"{"name": "x"}"#.into()]).unwrap_err().starts_with("Invalid fields for --lora-modules"));
        assert!(parse_lora_modules(&[r#"{"name": "x", "path": "p", "rank": 8}"#.into()]).unwrap_err().contains("rank"));
    }
}
