//! Types and functions shared by the coordinator and the workers: ids, the
//! chained block hash (the single source of truth for prefix caching and
//! routing), sampling parameters, the wire protocol, and what a model is
//! (its source, files, config and GGUF metadata) short of its tensors.

pub mod block_hash;
#[cfg(feature = "transport")]
pub mod discovery;
pub mod ids;
#[cfg(feature = "transport")]
pub mod join;
pub mod kv_events;
pub mod log;
pub mod model;
pub mod pipeline;
pub mod protocol;
pub mod sampling;
#[cfg(feature = "structured")]
pub mod structured;
#[cfg(feature = "transport")]
pub mod transport;

pub use block_hash::{BlockHash, hash_block_tokens, hash_prompt_blocks};
pub use ids::{BlockId, RequestId, WorkerId};
pub use kv_events::{KvEvent, KvEventRecord};
pub use protocol::FinishReason;
pub use sampling::{
    MAX_SPECULATIVE_TOKENS, SampledToken, SamplingParams, SamplingParamsError, Speculative, StructuredOutput,
    TokenLogprobs,
};
