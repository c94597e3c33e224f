//! tinyvllm's coordinator: HTTP front door, tokenization and detokenization,
//! and the cluster of workers behind it.

pub mod api;
pub mod app;
pub mod cluster;
pub mod connections;
/// Fuzz targets' entry points (the `fuzz/` crate and the corpus replay
/// test turn it on); not part of the production build.
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod harmony;
pub mod http;
pub mod idempotency;
pub mod join_token;
pub mod local_pipelines;
pub mod local_workers;
pub mod metrics;
pub mod page;
pub mod reasoning;
pub mod router;
pub mod text;
pub mod tool_parser;
