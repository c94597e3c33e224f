//! Model architectures and their loading. What a model is (source, files,
//! config, GGUF metadata) lives in `common::model`; this module adds the
//! tensors: the Llama family's layers (`layers`, `decoder`, `moe`) and model
//! (`llama`),
//! linear weights in every representation (`linear`, `quant`) and their
//! formats' names (`format`), and loading them (`loader`, `gguf`).

mod decoder;
pub mod format;
pub mod gguf;
pub mod gguf_blocks;
mod gguf_experts;
mod gguf_file;
mod gguf_names;
mod layers;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod moe;
pub mod quant;
mod workspace;

pub use common::model::config;
pub use common::model::{Architecture, ModelConfig, ModelFiles, ModelSource, Need};
pub use format::Quantization;
pub use layers::{gate_of, rope_tables};
pub use llama::CausalLm;
