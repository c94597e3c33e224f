//! Paged attention and the KV write on Apple GPUs, with our own Metal
//! kernels beside this file: `cache.metal` (reshape_and_cache),
//! `paged_attention.metal` (decode, partitioned like vLLM's
//! paged_attention_v2, plus its reduce) and `prefill_attention.metal`
//! (flash-attention-style chunked prefill).
//!
//! The host side is split in two. [`plan`] is platform-neutral: it checks
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

pub use plan::{HEAD_DIMS, PARTITION_SIZE};

#[cfg(target_os = "macos")]
mod device;
#[cfg(target_os = "macos")]
pub mod gpu;
#[cfg(target_os = "macos")]
pub use device::{paged_attention, reshape_and_cache, supports, supports_dtype};
