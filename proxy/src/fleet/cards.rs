//! What a worker's `/v1/models` says it serves: its model cards as vLLM writes them (`id`,
//! `root`, `max_model_len`, `parent` for a LoRA adapter, permissions…), the adapters among
//! them, and its context length. The gateway answers its own `/v1/models` from these, and
//! sends a request naming an adapter only to workers that list it.

use serde_json::Value;

/// One worker's model cards, as last read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelCards {
    /// The cards, in the worker's order, unchanged.
    pub cards: Vec<Value>,
    /// Ids of the cards that name a `parent`: LoRA adapters.
    pub adapters: Vec<String>,
    /// The largest `max_model_len` of the cards (vLLM names it per served model).
    pub max_model_len: Option<u32>,
}

impl ModelCards {
    /// Reads a `/v1/models` answer; `None` when it is not one.
    pub fn parse(body: &[u8]) -> Option<Self> {
        let v: Value = serde_json::from_slice(body).ok()?;
        let cards: Vec<Value> = v.get("data")?.as_array()?.iter().filter(|c| c.get("id").is_some_and(Value::is_string)).cloned().collect();
        let adapters = cards.iter().filter(|c| c.get("parent").is_some_and(Value::is_string)).filter_map(|c| Some(c.get("id")?.as_str()?.to_owned())).collect();
        let max_model_len = cards.iter().filter_map(|c| c.get("max_model_len")?.as_u64()).max().and_then(|n| u32::try_from(n).ok());
        Some(Self { cards, adapters, max_model_len })
    }

    /// Whether the worker serves LoRA adapter `name`.
    pub fn has_adapter(&self, name: &str) -> bool {
        self.adapters.iter().any(|a| a == name)
    }

    /// The card with id `id`.
    pub fn card(&self, id: &str) -> Option<&Value> {
        self.cards.iter().find(|c| c.get("id").and_then(Value::as_str) == Some(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cards_adapters_and_the_context_length() {
        let body = br#"{"object":"list","data":[
            {"id":"tiny","object":"model","root":"/m/tiny","parent":null,"max_model_len":2048},
            {"id":"sql","object":"model","root":"/lora/sql","parent":"tiny","max_model_len":2048},
            {"id":"big","max_model_len":4096},
            {"object":"model"}]}"#;
        let c = ModelCards::parse(body).unwrap();
        assert_eq!(c.cards.len(), 3, "a card without an id is left out");
        assert_eq!(c.adapters, vec!["sql".to_string()]);
        assert_eq!(c.max_model_len, Some(4096));
        assert!(c.has_adapter("sql") && !c.has_adapter("tiny"));
        assert_eq!(c.card("sql").unwrap()["root"], "/lora/sql");
        assert_eq!(ModelCards::parse(br#"{"data":[{"id":"a"}]}"#).unwrap().max_model_len, None);
        assert!(ModelCards::parse(b"not json").is_none() && ModelCards::parse(b"{}").is_none());
    }
}
