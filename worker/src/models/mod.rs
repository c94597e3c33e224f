//! Model architectures and their loading: the Llama family's layers
//! (`layers`) and decoder (`llama`), linear weights in every representation
//! (`linear`, `quant`), and the files they come from (`loader`, `gguf`).

pub mod config;
pub mod gguf;
mod layers;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod quant;
mod workspace;

pub use config::{Architecture, ModelConfig};
pub use llama::CausalLm;
pub use loader::{ModelFiles, ModelSource};
pub use quant::Quantization;
