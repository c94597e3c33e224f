//! What runs a step on the device: the model runner (a scheduler step in,
//! one batched forward pass out), the draft model's proposer, the KV cache's tensors, the samplers
//! (on the host and on the device), the structured-output grammars that
//! mask them, and the choice of device.

pub mod device;
pub mod device_sampler;
pub mod draft;
pub mod grammar;
pub mod kv_cache;
pub mod logprobs;
pub mod model_runner;
pub mod plan;
pub mod plan_sampling;
mod plan_weights;
pub mod sampler;

pub use model_runner::{BatchInputs, ModelRunner};
