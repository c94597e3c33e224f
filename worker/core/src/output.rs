//! What a scheduler step hands out and takes back: the requests it
//! scheduled (`SchedulerOutput`, for the model runner), the tokens the
//! sampler chose (`SampledToken`), each request's new tokens
//! (`RequestOutput`, for the caller), and the counters behind the metrics.

use std::ops::Range;

use common::{BlockId, RequestId};

use crate::kv_cache_manager::PrefixCacheStats;
use crate::kv_tier::{KvTransfers, TierStats};
use common::FinishReason;

use crate::request::Request;
use crate::spec::SpecDecodingStats;

/// One request's share of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    /// Position of the first token computed this step.
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    /// The request's whole block table after this step's allocation.
    pub block_ids: Vec<BlockId>,
    /// True when this step reaches the last known token, so its logits
    /// give the next token (false for all but the last chunk of a prompt).
    pub samples: bool,
    /// Positions computed this step whose logits give the log-probability
    /// of the prompt token after them (`prompt_logprobs`); empty for most.
    pub prompt_logprob_positions: Range<usize>,
    /// Proposed tokens verified this step, at the positions after the
    /// request's last token: the last `spec_token_ids.len()` of the
    /// `num_new_tokens`. A request with proposals samples at each of them
    /// and at its last real token (vLLM's `scheduled_spec_decode_tokens`).
    pub spec_token_ids: Vec<u32>,
    /// `spec_token_ids` are placeholders the draft model fills in before
    /// the step runs (`spec::SpecMethod::Draft`).
    pub draft_pending: bool,
}

impl ScheduledRequest {
    /// Rows of logits this request samples from: one per verified position.
    pub fn num_sampled_rows(&self) -> usize {
        if self.samples { 1 + self.spec_token_ids.len() } else { 0 }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerOutput {
    /// This step's number, to match its result (`update_from_output`).
    pub step_id: u64,
    pub scheduled: Vec<ScheduledRequest>,
    pub num_batched_tokens: usize,
    pub preempted: Vec<RequestId>,
    /// What moves between the KV pool and the second tier before the
    /// forward pass (empty without a tier).
    pub kv_transfers: KvTransfers,
}

/// One type for a token's logprobs and one for a sampled token, from the
/// samplers to the API (`common::sampling`).
pub use common::{SampledToken, TokenLogprobs};

/// New tokens of one request after a step.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub id: RequestId,
    /// Log-probabilities of prompt tokens computed this step, in order
    /// (see `SamplingParams::prompt_logprobs`); all come before the first new token.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    pub new_token_ids: Vec<u32>,
    /// One entry per new token, when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
}

impl RequestOutput {
    /// An output of `req` with nothing in it yet.
    pub fn empty(req: &Request) -> Self {
        Self {
            id: req.id,
            prompt_logprobs: Vec::new(),
            new_token_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: None,
            num_prompt_tokens: req.num_prompt_tokens,
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    /// Blocks holding a reusable prefix, in use or not.
    pub kv_blocks_cached: usize,
    pub prefix_cache: PrefixCacheStats,
    /// The second tier's counters (zero without one).
    pub tier: TierStats,
    pub num_preemptions: u64,
    pub spec_decoding: SpecDecodingStats,
}
