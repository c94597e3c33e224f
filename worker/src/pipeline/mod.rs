//! Pipeline parallelism: a model's decoder layers split over workers, one
//! contiguous range per stage (see docs/pipeline-parallel.md).
//!
//! - `wire`: the stage-to-stage messages (bincode headers, raw activations);
//! - `link`: the authenticated QUIC link between two stages;
//! - `stage`: a later stage's compute (its layers; sampling on the last);
//! - `follower`: a later stage's service loop;
//! - `metrics`: each stage's step, transfer and bubble metrics.
//!
//! The first stage is an ordinary `Engine` with a next stage attached
//! (`engine::pipelined`): it schedules, and its requests' tokens reach the
//! coordinator from it, so to the coordinator a pipeline is one worker.

pub mod follower;
pub mod link;
pub mod metrics;
pub mod stage;
pub mod wire;
