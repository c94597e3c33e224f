//! tinyvllm's engine core: requests, the block pool, the KV cache manager
//! and the scheduler (vLLM v1's `vllm/v1/core`). Synchronous, no tensors, no
//! I/O: the worker's engine drives it step by step, the coordinator's router
//! simulator reuses its block pool, and its tests run on plain integers.

pub mod block_pool;
pub mod config;
pub mod error;
pub mod kv_cache_manager;
pub mod kv_tier;
pub mod output;
pub mod request;
pub mod scheduler;
pub mod spec;

pub use block_pool::BlockPool;
pub use common::FinishReason;
pub use config::{SchedulerConfig, SchedulingPolicy};
pub use error::AddRequestError;
pub use kv_cache_manager::{ComputedPrefix, KvCacheManager, PrefixCacheStats};
pub use kv_tier::{KvTier, KvTransfers, Offload, TierState, TierStats};
pub use output::{RequestOutput, SampledToken, ScheduledRequest, SchedulerOutput, SchedulerStats, TokenLogprobs};
pub use request::{Request, RequestStatus};
pub use scheduler::Scheduler;
pub use spec::{DRAFT_PENDING, SpecDecodingStats, SpecMethod, SpeculativeConfig};
