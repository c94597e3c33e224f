//! What a model is, without running it: where `--model` points
//! ([`ModelSource`]), which of its files a side reads ([`ModelFiles`], with
//! [`Need`] saying whether the weights are wanted), its normalised
//! `config.json` ([`ModelConfig`]), the configs of the `random:` presets, and
//! the metadata of a GGUF file. The coordinator needs all of this to tokenize
//! and to check that workers serve the same model; the worker adds the
//! tensors on top (with candle). Nothing here links a tensor library.

pub mod builtin;
pub mod config;
pub mod files;
pub mod gguf;
pub mod hub;
pub mod presets;
pub mod rope;

use std::path::PathBuf;

pub use builtin::DEFAULT_MODEL;
pub use config::{Activation, Architecture, LayerAttention, ModelConfig, MoeConfig, RouterScoring, truncate_layers};
pub use files::{ModelFiles, ModelSource, Need, default_served_name};
pub use gguf::{GgufInfo, read_info};
pub use presets::{random_preset, random_preset_json};
pub use rope::RopeScaling;

/// Why a model's files could not be found or understood.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    ModelFile { path: PathBuf, message: String },
    #[error(
        "unsupported architecture {0:?}: supported are LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )]
    UnsupportedArchitecture(String),
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("unknown random model preset {0:?}: try {list}", list = presets::PRESETS.join(", "))]
    UnknownPreset(String),
    #[error("downloading {repo} from the Hugging Face hub: {message}")]
    Hub { repo: String, message: String },
}

impl ModelError {
    /// A problem with one file, named by its path.
    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::ModelFile { path: path.into(), message: message.into() }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
