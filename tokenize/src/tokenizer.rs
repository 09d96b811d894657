//! The model's tokenizer as vLLM loads it: a HF `tokenizer.json`, special tokens and the chat
//! template from `tokenizer_config.json` (or `chat_template.jinja`), plus what the simulator
//! derives from it: the EOS id and the "output vocabulary" the sampler draws from.
//!
//! Without `--tokenizer`, a small byte-level BPE tokenizer trained locally and shipped in
//! `tokenize/assets/tokenizer/` is used (see `assets/make_tokenizer.py`), so nothing is downloaded.

use crate::chat_template::ChatTemplate;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokenizers::Tokenizer;

const BUILTIN_TOKENIZER: &str = include_str!("../assets/tokenizer/tokenizer.json");
const BUILTIN_CONFIG: &str = include_str!("../assets/tokenizer/tokenizer_config.json");

/// Errors loading a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// tokenizer.json is not a valid HF tokenizer.
    #[error("invalid tokenizer {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// tokenizer_config.json is not valid JSON, or the chat template does not compile.
    #[error("invalid tokenizer config {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// A loaded tokenizer and everything derived from it. Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct ModelTokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tok: Tokenizer,
    chat: Option<ChatTemplate>,
    /// The chat template's Jinja text, for what vLLM decides by reading it.
    chat_source: Option<String>,
    bos: Option<String>,
    eos: Option<String>,
    eos_id: Option<u32>,
    vocab_size: u32,
    output_vocab: Arc<[u32]>,
    /// Standalone text of every output-vocabulary token, indexed by token id.
    token_text: Vec<Option<Arc<str>>>,
    source: String,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer").field("source", &self.inner.source).field("vocab_size", &self.inner.vocab_size).finish()
    }
}

impl ModelTokenizer {
    /// The tokenizer shipped with the simulator.
    pub fn builtin() -> Self {
        let tok = Tokenizer::from_bytes(BUILTIN_TOKENIZER.as_bytes()).expect("shipped tokenizer.json is valid");
        let cfg: serde_json::Value = serde_json::from_str(BUILTIN_CONFIG).expect("shipped config is valid");
        Self::build(tok, &cfg, None, "builtin".into()).expect("shipped chat template compiles")
    }

    /// Loads from a directory holding `tokenizer.json` (and optionally `tokenizer_config.json`,
    /// `chat_template.jinja`), or from a `tokenizer.json` file path.
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            (path.parent().map(Path::to_path_buf).unwrap_or_default(), path.to_path_buf())
        };
        let bytes = std::fs::read(&file).map_err(|source| TokenizerError::Io { path: file.clone(), source })?;
        let tok = Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Invalid { path: file.clone(), message: e.to_string() })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| TokenizerError::Config { path: cfg_path.clone(), message: e.to_string() })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => return Err(TokenizerError::Io { path: cfg_path, source }),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(TokenizerError::Io { path: jinja_path, source }),
        };
        Self::build(tok, &cfg, jinja, file.display().to_string()).map_err(|message| TokenizerError::Config { path: cfg_path, message })
    }

    fn build(tok: Tokenizer, cfg: &serde_json::Value, jinja: Option<String>, source: String) -> Result<Self, String> {
        let special = |key: &str| -> Option<String> {
            match cfg.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
                _ => None,
            }
        };
        let bos = special("bos_token");
        let eos = special("eos_token");
        let eos_id = eos.as_deref().and_then(|e| tok.token_to_id(e));
        let template_src = jinja.or_else(|| match cfg.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            // A list of named templates: vLLM uses the one named "default".
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        });
        let chat = template_src.clone().map(ChatTemplate::new).transpose()?;

        let vocab_size = tok.get_vocab_size(true) as u32;
        let specials: std::collections::HashSet<u32> = tok.get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let mut token_text = vec![None; vocab_size as usize];
        let mut output_vocab = Vec::new();
        for id in 0..vocab_size {
            if specials.contains(&id) || Some(id) == eos_id {
                continue;
            }
            let Ok(text) = tok.decode(&[id], false) else { continue };
            let clean = !text.is_empty() && !text.contains('\u{FFFD}') && text.chars().all(|c| !c.is_control()) && !text.trim().is_empty();
            if clean {
                token_text[id as usize] = Some(Arc::from(text.as_str()));
                output_vocab.push(id);
            }
        }
        if output_vocab.is_empty() {
            return Err("the tokenizer has no token that decodes to printable text".into());
        }
        Ok(Self {
            inner: Arc::new(Inner {
                tok,
                chat,
                chat_source: template_src,
                bos,
                eos,
                eos_id,
                vocab_size,
                output_vocab: output_vocab.into(),
                token_text,
                source,
            }),
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        self.inner.tok.encode_fast(text, add_special_tokens).map(|e| e.get_ids().to_vec()).map_err(|e| format!("tokenization failed: {e}"))
    }

    /// Text of `ids`, skipping special tokens as vLLM's default `skip_special_tokens=true`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.tok.decode(ids, true).map_err(|e| format!("detokenization failed: {e}"))
    }

    /// Standalone text of a generated token ("" for EOS and other special tokens).
    pub fn token_text(&self, id: u32) -> &str {
        self.inner.token_text.get(id as usize).and_then(|t| t.as_deref()).unwrap_or("")
    }

    /// Renders a chat conversation with the model's template.
    pub fn render_chat(&self, input: &crate::chat_template::ChatInput<'_>) -> Result<String, String> {
        let chat = self.inner.chat.as_ref().ok_or_else(|| {
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.".to_string()
        })?;
        chat.render(input, self.inner.bos.as_deref(), self.inner.eos.as_deref())
    }

    /// The chat template's Jinja source, if the tokenizer has one (vLLM reads the text to decide
    /// some conversions, e.g. whether the `developer` role is kept).
    pub fn chat_template_source(&self) -> Option<&str> {
        self.inner.chat_source.as_deref()
    }

    /// Added tokens the input may be split on before tokenizing (as HF does): those without
    /// strip or single-word flags, which would move text across the boundary.
    pub fn splittable_added_tokens(&self) -> Vec<(u32, String)> {
        self.inner
            .tok
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty())
            .map(|(&id, t)| (id, t.content.clone()))
            .collect()
    }

    /// Whether the content of any added token (splittable or not) satisfies `f`.
    pub fn any_added_token(&self, f: impl Fn(&str) -> bool) -> bool {
        self.inner.tok.get_added_tokens_decoder().values().any(|t| f(&t.content))
    }

    /// Whether any added token strips the spaces around it or matches whole words only: the
    /// text next to it then tokenizes differently depending on where it is cut.
    pub fn has_space_sensitive_added_tokens(&self) -> bool {
        self.inner.tok.get_added_tokens_decoder().values().any(|t| t.lstrip || t.rstrip || t.single_word)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> u32 {
        self.inner.vocab_size
    }

    /// The EOS token id, if any.
    pub fn eos_id(&self) -> Option<u32> {
        self.inner.eos_id
    }

    /// Ids the sampler may generate.
    pub fn output_vocab(&self) -> Arc<[u32]> {
        self.inner.output_vocab.clone()
    }

    /// Where it was loaded from.
    pub fn source(&self) -> &str {
        &self.inner.source
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_roundtrips_and_has_output_vocab() {
        let t = ModelTokenizer::builtin();
        let ids = t.encode("the cache router sends a request", false).unwrap();
        assert!(!ids.is_empty());
        assert_eq!(t.decode(&ids).unwrap(), "the cache router sends a request");
        assert!(t.output_vocab().len() > 1000);
        assert!(t.eos_id().is_some());
        // Generated text is the concatenation of standalone token texts.
        let generation: Vec<u32> = t.output_vocab().iter().take(50).copied().collect();
        let concat: String = generation.iter().map(|&i| t.token_text(i)).collect();
        assert_eq!(concat, t.decode(&generation).unwrap());
    }

    #[test]
    fn loading_a_missing_path_is_a_clear_error() {
        let e = ModelTokenizer::load(Path::new("/nonexistent/tok")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/tok"), "{e}");
    }
}
