//! Model architectures and their loading.

pub mod config;
pub mod gguf;
pub mod linear;
pub mod llama;
pub mod loader;
mod workspace;

pub use config::{Architecture, ModelConfig};
pub use llama::CausalLm;
pub use loader::{ModelFiles, ModelSource};
