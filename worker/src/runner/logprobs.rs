//! What a step reports as a token's "logprobs" (vLLM's `logprobs_mode`):
//! the log-softmax the sampler computed, or the raw logits in the same
//! order. Shared by the single worker and a pipeline's last stage.

use engine_core::TokenLogprobs;

/// What the values returned as "logprobs" are (vLLM's `logprobs_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogprobsMode {
    /// log-softmax of the model's logits, before any sampling processing.
    #[default]
    RawLogprobs,
    /// The model's logits themselves (for checking against a reference).
    RawLogits,
}

/// `token`'s logprob and the top list as `mode` reports them; `raw` is the
/// row of logits they were computed from.
pub fn reported_logprobs(
    mode: LogprobsMode,
    raw: &[f32],
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
) -> TokenLogprobs {
    match mode {
        LogprobsMode::RawLogprobs => TokenLogprobs { logprob, top },
        // Same order as logprobs (softmax is monotonic), other values.
        LogprobsMode::RawLogits => {
            let logit = |id: u32| raw.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
            TokenLogprobs { logprob: logit(token), top: top.iter().map(|&(id, _)| (id, logit(id))).collect() }
        }
    }
}
