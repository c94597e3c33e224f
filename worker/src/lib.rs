//! tinyvllm's worker: a vLLM-style engine on candle tensors. Models load
//! from Hugging Face directories, GGUF files or seeded random presets; the
//! engine core (`engine_core`: a paged KV cache with automatic prefix
//! caching, a continuous-batching scheduler) decides each step, the runner
//! computes it in one batched forward pass and samples, and the service
//! shell serves a coordinator over QUIC.
//!
//! - `engine`: the step loop (schedule -> run -> sample -> update);
//! - `runner/`: model runner, KV cache tensors, samplers, device choice;
//! - `models/`: layers, the Llama-family architecture, linear weights, loading;
//! - `serve/`: the QUIC service and Prometheus metrics;
//! - `bench`, `profile`: the offline benchmark and its step profile.

pub mod bench;
pub mod engine;
pub mod error;
pub mod models;
pub mod pipeline;
pub mod profile;
pub mod runner;
pub mod serve;
pub mod tier;

pub use engine::{Engine, EngineConfig, LogprobsMode};
pub use error::{Result, WorkerError};
pub use models::Quantization;
