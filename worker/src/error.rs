//! The worker library's error type. Binaries wrap it in `anyhow`.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{path}: {message}")]
    ModelFile { path: PathBuf, message: String },
    #[error(
        "unsupported architecture {0:?}: supported are LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )]
    UnsupportedArchitecture(String),
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    #[error("loading weights from {source_desc}: {error}")]
    Weights { source_desc: String, error: candle_core::Error },
    #[error("unknown random model preset {0:?}: try smollm-135m, tinyllama-1.1b, qwen3-0.6b, llama-3.2-1b")]
    UnknownPreset(String),
    #[error("downloading {repo} from the Hugging Face hub: {message}")]
    Hub { repo: String, message: String },
    #[error("request {id}: {message}")]
    InvalidRequest { id: common::RequestId, message: String },
    #[error("KV cache: {0}")]
    KvCache(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, WorkerError>;
