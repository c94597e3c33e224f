//! Incremental detokenization (vLLM/TGI's prefix/read offsets): decode a
//! window of recent tokens and emit only the text past what was already
//! emitted, so SentencePiece's leading spaces survive mid-text and a UTF-8
//! character split over byte-fallback tokens is held back until complete.

use std::sync::Arc;

use super::Tokenizer;

pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    /// Start of the context window decoded before the new tokens.
    prefix_offset: usize,
    /// End of the tokens whose text was already emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

/// Tokens of context decoded before the new ones.
const WINDOW: usize = 6;

impl IncrementalDetokenizer {
    /// `prompt_ids` give the context of the first generated token.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_ids: &[u32], skip_special_tokens: bool) -> Self {
        let start = prompt_ids.len().saturating_sub(WINDOW);
        let ids = prompt_ids[start..].to_vec();
        let n = ids.len();
        Self { tokenizer, ids, prefix_offset: 0, read_offset: n, skip_special_tokens }
    }

    /// Adds tokens; returns the newly completed text.
    pub fn push(&mut self, new_ids: &[u32]) -> String {
        self.ids.extend_from_slice(new_ids);
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens);
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let new_text = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            new_text
        } else {
            String::new()
        }
    }

    /// Whatever is still held back (e.g. an incomplete character at the end).
    pub fn flush(&mut self) -> String {
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens);
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        full.strip_prefix(prefix.as_str()).map(String::from).unwrap_or_default()
    }
}
