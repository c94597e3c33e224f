//! A model's tokenizer (`tokenizer.json`) with the special tokens and chat
//! template of its `tokenizer_config.json`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<String>,
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_string(value: Option<&serde_json::Value>) -> Option<String> {
    match value? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TokenizerError::File { path: path.clone(), message: e.to_string() })?;
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| TokenizerError::File { path: config_path.clone(), message: e.to_string() })?,
            Err(_) => serde_json::Value::Null,
        };
        let chat_template = match config.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        };
        Ok(Self {
            inner,
            bos_token: token_string(config.get("bos_token")),
            eos_token: token_string(config.get("eos_token")),
            chat_template,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.inner.decode(ids, skip_special_tokens).unwrap_or_default()
    }

    /// One token as text (its piece with SentencePiece's `▁` as a space),
    /// for logprobs.
    pub fn token_text(&self, id: u32) -> String {
        match self.inner.id_to_token(id) {
            Some(piece) => piece.replace('\u{2581}', " "),
            None => String::new(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
