//! Model architectures and their loading. What a model is (source, files,
//! config, GGUF metadata) lives in `common::model`; this crate adds the
//! tensors.

pub mod gguf;
pub mod linear;
pub mod llama;
pub mod loader;
mod workspace;

pub use common::model::config;
pub use common::model::{Architecture, ModelConfig, ModelFiles, ModelSource, Need};
pub use llama::CausalLm;
