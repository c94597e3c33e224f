//! How the scheduler is configured: the step's token budget, the pool it
//! allocates from, the order it serves requests in, when they stop.

use crate::spec::SpeculativeConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served; `priority` is ignored.
    Fcfs,
    /// Lowest `priority` value first, then arrival.
    Priority,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    /// Generation stops on these unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Most prompt positions per step whose logits are kept for
    /// `prompt_logprobs` (each is a row of vocabulary size); requests that
    /// ask for them are computed in chunks of at most this many tokens.
    pub max_prompt_logprob_rows: usize,
    /// Speculative decoding (n-gram proposals); off unless enabled.
    pub speculative: SpeculativeConfig,
    /// The window every layer of the model attends within, if they all
    /// slide (Mistral): a request's blocks wholly before the window of
    /// its next query are handed back to the pool as it moves on (vLLM's
    /// sliding-window manager). Models that mix windowed and full layers
    /// (Gemma 3, gpt-oss) keep every block: their full layers read them.
    pub sliding_window: Option<usize>,
    /// Steps a pipeline keeps in flight: each step takes at most
    /// 1/`micro_batches` of the requests, so the rest can make the next one
    /// (1 for a single worker: every step takes every request).
    pub micro_batches: usize,
    /// Blocks the prefix cache's second tier holds (0: no tier): evicted
    /// blocks go there, and prompts hitting it copy them back (`kv_tier`).
    pub tier_blocks: usize,
}

impl SchedulerConfig {
    pub fn new(max_model_len: usize, block_size: usize, num_blocks: usize) -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len,
            block_size,
            num_blocks,
            enable_prefix_caching: true,
            policy: SchedulingPolicy::Fcfs,
            eos_token_ids: Vec::new(),
            max_prompt_logprob_rows: 512,
            speculative: SpeculativeConfig::default(),
            sliding_window: None,
            micro_batches: 1,
            tier_blocks: 0,
        }
    }
}
