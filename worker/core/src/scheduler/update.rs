//! A step's result (vLLM v1's `update_from_output`, with `check_stop` kept
//! in the scheduler as vLLM keeps it): each sampling request's verified
//! tokens are appended, a stop condition finishes the request and frees its
//! blocks, and the blocks of rejected proposals are given back.

use common::FinishReason;

use super::Scheduler;
use crate::config::SchedulerConfig;
use crate::output::{RequestOutput, SampledToken, ScheduledRequest, SchedulerOutput};
use crate::request::{Request, RequestStatus};
use crate::spec;

impl Scheduler {
    /// Takes step `out`'s result: appends the sampled tokens
    /// (`num_sampled_rows` per scheduled request, in order; see
    /// [`append_verified`]), finishes requests that hit a stop
    /// condition and frees their blocks, and the blocks of rejected
    /// proposals. The step's requests may be scheduled again.
    pub fn update_from_output(&mut self, out: &SchedulerOutput, sampled: Vec<SampledToken>) -> Vec<RequestOutput> {
        debug_assert_eq!(out.scheduled.iter().map(ScheduledRequest::num_sampled_rows).sum::<usize>(), sampled.len());
        let mut sampled = sampled.into_iter();
        let rows = out
            .scheduled
            .iter()
            .filter(|s| s.samples)
            .map(|s| sampled.by_ref().take(s.num_sampled_rows()).collect())
            .collect();
        self.update_from_verified(out, rows)
    }

    /// [`update_from_output`](Self::update_from_output) with each sampling
    /// request's rows apart, in the step's order: every row it sampled, or
    /// only those a verifier kept (the draws that equal their proposals and
    /// the one after them; a pipeline's last stage sends back no more).
    /// Either way the same tokens are appended.
    pub fn update_from_verified(&mut self, out: &SchedulerOutput, rows: Vec<Vec<SampledToken>>) -> Vec<RequestOutput> {
        let mut outputs = Vec::with_capacity(out.scheduled.len());
        let mut rows = rows.into_iter();
        for sched in &out.scheduled {
            let rows: Vec<SampledToken> = if sched.samples { rows.next().unwrap_or_default() } else { Vec::new() };
            let Some(req) = self.requests.get_mut(&sched.id) else { continue };
            if req.in_flight_step != Some(out.step_id) {
                continue; // aborted and queued again since: not this step's request
            }
            req.in_flight_step = None;
            if !sched.samples {
                continue;
            }
            let (output, accepted) = append_verified(req, &sched.spec_token_ids, rows, &self.config);
            self.spec_stats.observe(sched.spec_token_ids.len(), accepted);
            let id = req.id;
            if let Some(reason) = output.finish_reason {
                req.status = RequestStatus::Finished(reason);
                self.requests.remove(&id);
                self.running.retain(|&r| r != id);
                self.kv.free(id);
            } else if !sched.spec_token_ids.is_empty() {
                self.kv.free_blocks_past(id, req.num_tokens());
            }
            outputs.push(output);
        }
        outputs
    }
}

/// Appends what a step drew for this request: one row per verified
/// position, the first for its last real token, then one per token of
/// `proposed`. Proposals equal to the draws are kept, plus the draw
/// after them; a stop condition ends the run at its token. The KV of
/// the rejected proposals counts as not computed again. Returns this
/// step's output and how many proposals were accepted.
fn append_verified(
    req: &mut Request,
    proposed: &[u32],
    rows: Vec<SampledToken>,
    config: &SchedulerConfig,
) -> (RequestOutput, usize) {
    let drawn: Vec<u32> = rows.iter().map(|r| r.token_id).collect();
    let accepted = spec::num_accepted(proposed, &drawn);
    req.num_computed_tokens -= proposed.len() - accepted;
    let mut output = RequestOutput::empty(req);
    for row in rows.into_iter().take(accepted + 1) {
        req.token_ids.push(row.token_id);
        output.new_token_ids.push(row.token_id);
        output.logprobs.extend(row.logprobs);
        output.finish_reason = stop_reason(req, row.token_id, config);
        if output.finish_reason.is_some() {
            break;
        }
    }
    req.update_block_hashes(config.block_size);
    (output, accepted)
}

/// Why the request stops after appending `token`, if it does.
fn stop_reason(req: &Request, token: u32, config: &SchedulerConfig) -> Option<FinishReason> {
    let params = &req.params;
    let generated = req.num_output_tokens();
    if generated >= params.min_tokens as usize {
        if !params.ignore_eos && config.eos_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if params.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
    }
    if generated >= params.max_tokens as usize || req.num_tokens() >= config.max_model_len {
        return Some(FinishReason::Length);
    }
    None
}
