//! tinyvllm's worker: a vLLM-style engine on candle tensors. Models load
//! from Hugging Face directories; a paged KV cache with automatic prefix
//! caching, a continuous-batching scheduler and a batched sampler serve many
//! requests at once.

pub mod bench;
pub mod core;
pub mod device;
pub mod device_sampler;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod metrics;
pub mod model_runner;
pub mod models;
pub mod profile;
pub mod sampler;
pub mod service;

pub use engine::{Engine, EngineConfig, LogprobsMode, Quantization};
pub use error::{Result, WorkerError};
