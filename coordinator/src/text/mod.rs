//! Text handling in the coordinator: tokenizer, incremental detokenizer,
//! stop strings, chat templates.

pub mod chat_template;
pub mod detokenizer;
mod jinja_compat;
pub mod stop;
pub mod tokenizer;

pub use chat_template::{ChatTemplate, RenderOptions, TemplateError};
pub use detokenizer::IncrementalDetokenizer;
pub use stop::{StopOutput, StopStrings, held_prefix};
pub use tokenizer::{Tokenizer, TokenizerError};
