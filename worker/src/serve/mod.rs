//! `tinyvllm-worker serve`: the QUIC service shell around the engine and
//! the Prometheus metrics it records, the report of a worker still
//! fetching and loading its weights, and the thread that compiles
//! structured-output grammars off the step loop.

pub mod compile;
mod handoff;

pub mod metrics;
pub mod metrics_server;
pub mod prepare;
pub mod service;
mod tier_metrics;
