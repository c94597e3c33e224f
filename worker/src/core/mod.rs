//! The engine core: requests, the block pool, the KV cache manager and the
//! scheduler. Synchronous, no tensors, no I/O: tested on plain integers.

pub mod block_pool;
pub mod kv_cache_manager;
pub mod request;
pub mod scheduler;

pub use block_pool::BlockPool;
pub use kv_cache_manager::{KvCacheManager, PrefixCacheStats};
pub use request::{FinishReason, Request, RequestStatus};
pub use scheduler::{
    AddRequestError, RequestOutput, SampledToken, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput,
    SchedulerStats, SchedulingPolicy, TokenLogprobs,
};
