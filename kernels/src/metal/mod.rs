//! Our kernels for Apple GPUs, beside this file: `cache.metal`
//! (reshape_and_cache), `paged_attention.metal` (decode, one threadgroup per
//! KV head, partitioned like vLLM's paged_attention_v2, plus its reduce),
//! `prefill_attention.metal` (flash-attention-style chunked prefill) and
//! `model.metal` (the rest of a model's step: embedding, RMSNorm, matmuls
//! over float and GGML block weights, RoPE with the KV write, and a mixture
//! of experts' routing and grouped matmuls) and `sample.metal` (sampling).
//!
//! [`step`] runs a whole model step as one plan through the [`step::Gpu`]
//! trait: `gpu.rs` on macOS, `emulated.rs` (the CPU emulator) on Linux.
//! For candle's composed path (pipeline stages, `TINYVLLM_METAL_PLAN=0`)
//! the host side of attention is split in two. [`plan`] is platform-neutral: it checks
//! and plans each call (metadata uploads, bindings, grids, scratch) and
//! encodes it through a small encoder trait, once per step for the
//! metadata. `device.rs` (macOS only) implements that trait with candle's
//! Metal device and command encoder, compiles the sources at run time and
//! exposes [`paged_attention`] and [`reshape_and_cache`]. On Linux the same
//! planning code drives the CPU emulator in kernels/metal-emu
//! (tests/metal.rs), and tools/check_metal_syntax.sh parses the sources.

#[cfg(feature = "metal-emulated")]
pub mod emulated;
pub mod model;
pub mod plan;
pub mod step;
mod step_cache;

pub use plan::{HEAD_DIMS, PARTITION_SIZE};

#[cfg(target_os = "macos")]
mod device;
#[cfg(target_os = "macos")]
pub mod gpu;
#[cfg(target_os = "macos")]
pub use device::{paged_attention, reshape_and_cache, supports, supports_dtype};
