//! A request as the engine core sees it: token ids and progress counters,
//! no tensors. Like vLLM v1 there is no prefill or decode "phase": a request
//! has `num_tokens` (prompt + output) of which `num_computed_tokens` already
//! have KV in the cache, and each step computes some of the rest.

use common::{BlockHash, FinishReason, RequestId, SamplingParams, hash_block_tokens};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Lost its blocks to a higher-priority request; waits to recompute.
    Preempted,
    Finished(FinishReason),
}

#[derive(Clone, Debug)]
pub struct Request {
    pub id: RequestId,
    pub params: SamplingParams,
    /// Lower values are served first (vLLM's convention); ties by arrival.
    pub priority: i32,
    /// Order of arrival, set when the scheduler queues the request.
    pub arrival: u64,
    /// Prompt then output token ids.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is in the cache (or will be once this step runs).
    pub num_computed_tokens: usize,
    /// Prompt tokens found in the prefix cache when first scheduled.
    pub num_cached_tokens: Option<usize>,
    /// Chained hashes of every full block of `token_ids`, grown lazily.
    pub block_hashes: Vec<BlockHash>,
    /// Seed of this request's sampling stream.
    pub sampling_seed: u64,
    pub status: RequestStatus,
    pub num_preemptions: u32,
    /// With `params.prompt_logprobs`: the next prompt position whose
    /// log-probability is still owed (1 at first: the first token has
    /// none). Position p's comes from the logits at p - 1.
    pub next_prompt_logprob: usize,
    /// The step computing this request's last scheduled tokens while its
    /// result is not back (a pipeline keeps several steps in flight): the
    /// request is not scheduled again, nor preempted, until then.
    pub in_flight_step: Option<u64>,
}

impl Request {
    /// A request not yet queued; `sampling_seed` seeds its sampling stream.
    pub fn new(id: RequestId, prompt: Vec<u32>, params: SamplingParams, priority: i32, sampling_seed: u64) -> Self {
        Self {
            id,
            params,
            priority,
            arrival: 0,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            block_hashes: Vec::new(),
            sampling_seed,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            next_prompt_logprob: 1,
            in_flight_step: None,
        }
    }

    /// The same request resumed after `output`, tokens it generated before
    /// (on a worker that was lost): they count as its output, so sampling
    /// goes on exactly as if it had never stopped.
    pub fn with_output(mut self, output: &[u32]) -> Self {
        self.token_ids.extend_from_slice(output);
        self
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.token_ids[..self.num_prompt_tokens]
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens..]
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Whether some prompt token's log-probability is asked for and not yet computed.
    pub fn owes_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.next_prompt_logprob < self.num_prompt_tokens
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Extends `block_hashes` to cover every full block of `token_ids`.
    pub fn update_block_hashes(&mut self, block_size: usize) {
        let full = self.token_ids.len() / block_size;
        while self.block_hashes.len() < full {
            let i = self.block_hashes.len();
            let parent = i.checked_sub(1).map(|p| self.block_hashes[p]);
            let tokens = &self.token_ids[i * block_size..(i + 1) * block_size];
            self.block_hashes.push(hash_block_tokens(parent, tokens, &[]));
        }
    }
}
