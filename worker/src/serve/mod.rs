//! `tinyvllm-worker serve`: the QUIC service shell around the engine and
//! the Prometheus metrics it records, and the thread that compiles
//! structured-output grammars off the step loop.

pub mod compile;

pub mod metrics;
pub mod metrics_server;
pub mod service;
