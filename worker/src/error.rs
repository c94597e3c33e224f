//! The worker library's error type. Binaries wrap it in `anyhow`.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{path}: {message}")]
    ModelFile { path: PathBuf, message: String },
    /// Finding or reading a model's files and config (`common::model`).
    #[error(transparent)]
    Model(#[from] common::model::ModelError),
    #[error("loading weights from {source_desc}: {error}")]
    Weights { source_desc: String, error: candle_core::Error },
    #[error("request {id}: {message}")]
    InvalidRequest { id: common::RequestId, message: String },
    #[error("KV cache: {0}")]
    KvCache(String),
    /// The KV tier's directory (`--kv-offload-dir`).
    #[error("KV tier {path}: {error}")]
    TierDir { path: PathBuf, error: std::io::Error },
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The link to the next pipeline stage is gone: the pipeline must be
    /// formed again (its requests continue elsewhere).
    #[error("pipeline lost: {0}")]
    PipelineLost(String),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, WorkerError>;
