//! Entry points for fuzzing (issue 31): one function per target, taking
//! the fuzzer's bytes and panicking only when the code under test breaks a
//! promise. The cargo-fuzz targets in `fuzz/` call them, and so does the
//! corpus replay test (`tests/fuzz_corpus.rs`), so every checked-in input
//! is rerun by `cargo test` on stable Rust.
//!
//! * [`wire_frame`]: the bincode frame decoder of the QUIC protocol.
//! * [`http_request`]: the `/generate`, `/v1/completions` and
//!   `/v1/chat/completions` handlers on a coordinator without workers.
//! * [`detokenizer`]: the incremental detokenizer and stop strings as a
//!   request streams them.
//! * [`chat_template`]: real chat templates on arbitrary conversations.
//!
//! The targets that need a tokenizer use the test models in `tests/`
//! beside the repository (as every test does), loaded once per process.

mod chat;
mod detok;
mod request;
mod wire;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

pub use chat::{ChatInput, chat_template};
pub use detok::{DetokInput, StopSpec, detokenizer};
pub use request::http_request;
pub use wire::{wire_frame, wire_seeds};

use crate::text::{ChatTemplate, Tokenizer};

/// The test models, smallest vocabulary first; `tiny-qwen3` has the chat template.
pub const MODELS: [&str; 5] = ["stories260K", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"];

/// Tokenizers and chat templates the targets share.
pub struct Fixtures {
    /// In the order of [`MODELS`].
    pub tokenizers: Vec<Arc<Tokenizer>>,
    /// `tiny-qwen3`'s own template, then the real-world ones the chat
    /// template tests check against Jinja2 (Qwen2.5, Llama 2, Llama 3.1).
    pub templates: Vec<(String, ChatTemplate)>,
}

/// The test models (`models/`) and transformers' reference outputs (`golden/`), in the repository's `tests/`.
pub fn test_data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests")
}

/// Loaded on first use; a missing model is a setup error, so it panics.
pub fn fixtures() -> &'static Fixtures {
    static FIXTURES: OnceLock<Fixtures> = OnceLock::new();
    FIXTURES.get_or_init(|| {
        let models = test_data_dir().join("models");
        let tokenizers: Vec<Arc<Tokenizer>> = MODELS
            .iter()
            .map(|m| Arc::new(Tokenizer::from_dir(&models.join(m)).unwrap_or_else(|e| panic!("fixture {m}: {e}"))))
            .collect();
        let qwen3 = &tokenizers[MODELS.len() - 1];
        let own = ChatTemplate::for_tokenizer(qwen3).unwrap_or_else(|e| panic!("tiny-qwen3 template: {e}"));
        let mut templates = vec![("tiny-qwen3".to_string(), own)];
        let mut sources = std::collections::HashSet::new();
        let cases: serde_json::Value = serde_json::from_str(include_str!("../text/testdata/chat_templates.json"))
            .unwrap_or_else(|e| panic!("chat_templates.json: {e}"));
        for case in cases.as_array().into_iter().flatten() {
            let (Some(id), Some(source)) = (case["id"].as_str(), case["template"].as_str()) else { continue };
            // Cases share templates; one copy of each is enough.
            if !sources.insert(source) {
                continue;
            }
            let template = ChatTemplate::new(source, case["bos_token"].as_str(), case["eos_token"].as_str())
                .unwrap_or_else(|e| panic!("template {id}: {e}"));
            templates.push((id.to_string(), template));
        }
        Fixtures { tokenizers, templates }
    })
}

/// Reads little-endian fields off the front of a fuzzer input; past the end
/// every read is zero, so any byte string is a valid input.
pub(crate) struct Bytes<'a>(pub &'a [u8]);

impl<'a> Bytes<'a> {
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
