//! `tinyvllm-worker serve`: the QUIC service shell around the engine and
//! the Prometheus metrics it records.

pub mod metrics;
pub mod metrics_server;
pub mod service;
