//! tinyvllm's coordinator: HTTP front door, tokenization and detokenization,
//! and the cluster of workers behind it.

pub mod api;
pub mod app;
pub mod cluster;
pub mod connections;
pub mod fuzzing;
pub mod http;
pub mod loadgen;
pub mod local_pipelines;
pub mod metrics;
pub mod router;
pub mod sim;
pub mod text;
pub mod tool_parser;
