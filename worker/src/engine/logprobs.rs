//! The logprobs a step reports: each sampled token's (as `logprobs_mode`
//! says) and the prompt positions' rows that prompt logprobs asked for,
//! placed in the requests' outputs.

use common::RequestId;
use engine_core::{RequestOutput, SchedulerOutput, TokenLogprobs};

use super::Engine;
use crate::runner::logprobs::reported_logprobs;
use crate::runner::sampler;

impl Engine {
    /// `token`'s logprob and the top list as `logprobs_mode` reports them;
    /// `raw` is the row of logits they were computed from.
    pub(super) fn reported(&self, raw: &[f32], token: u32, logprob: f32, top: Vec<(u32, f32)>) -> TokenLogprobs {
        reported_logprobs(self.logprobs_mode, raw, token, logprob, top)
    }

    /// The prompt logprobs this step computed, per request: `logits` holds
    /// one row per position of the step's `prompt_logprob_positions`, in order.
    pub(super) fn prompt_logprobs(
        &self,
        step: &SchedulerOutput,
        logits: &[f32],
    ) -> Vec<(RequestId, Vec<TokenLogprobs>)> {
        if logits.is_empty() {
            return Vec::new();
        }
        let vocab = self.vocab_size;
        let mut rows = Vec::new(); // (next prompt token, top n)
        for s in step.scheduled.iter().filter(|s| !s.prompt_logprob_positions.is_empty()) {
            // A request aborted while its step was in flight keeps its rows, unread.
            let req = self.scheduler.request(s.id);
            let n = req.map_or(0, |r| r.params.prompt_logprobs.unwrap_or(0) as usize);
            rows.extend(s.prompt_logprob_positions.clone().map(|p| (req.map_or(0, |r| r.token_ids[p + 1]), n)));
        }
        let values = sampler::token_logprobs(logits, vocab, &rows);
        let mut reported = values
            .into_iter()
            .zip(rows.iter().zip(logits.chunks_exact(vocab)))
            .map(|((logprob, top), (&(token, _), raw))| self.reported(raw, token, logprob, top));
        step.scheduled
            .iter()
            .filter(|s| !s.prompt_logprob_positions.is_empty())
            .map(|s| (s.id, reported.by_ref().take(s.prompt_logprob_positions.len()).collect()))
            .collect()
    }

    /// Puts each request's prompt logprobs in its output of this step, or
    /// in an output of their own when it did not sample (a prompt chunk).
    pub(super) fn with_prompt_logprobs(
        &self,
        mut outputs: Vec<RequestOutput>,
        prompt_logprobs: Vec<(RequestId, Vec<TokenLogprobs>)>,
    ) -> Vec<RequestOutput> {
        for (id, lps) in prompt_logprobs {
            if let Some(o) = outputs.iter_mut().find(|o| o.id == id) {
                o.prompt_logprobs = lps;
            } else if let Some(req) = self.scheduler.request(id) {
                outputs.push(RequestOutput { prompt_logprobs: lps, ..RequestOutput::empty(req) });
            }
        }
        outputs
    }
}
