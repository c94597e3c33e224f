//! What the next step computes (vLLM v1's `schedule()`): running requests
//! first, highest priority first, each some of its not-yet-computed tokens
//! under the step's token budget (chunked prefill), then waiting requests
//! admitted with their prefix-cache hits. When blocks run out, proposals go
//! first, then the lowest-priority running request is preempted (by
//! recompute).

use common::RequestId;

use super::Scheduler;
use crate::output::{ScheduledRequest, SchedulerOutput};
use crate::request::RequestStatus;
use crate::spec::Proposal;

impl Scheduler {
    /// Decides what the next step computes.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput { step_id: self.next_step_id, ..SchedulerOutput::default() };
        self.next_step_id += 1;
        self.kv.begin_step();
        let (max_seqs, mut stalled) = (self.step_seq_limit(), false);
        let mut budget = self.config.max_num_batched_tokens;
        let mut logprob_rows = self.config.max_prompt_logprob_rows;
        let speculate = self.config.speculative.speculates(self.running.iter().map(|id| &self.requests[id].params));

        // 1. Running requests first, highest priority first; those in flight wait.
        let mut i = 0;
        while i < self.running.len() && budget > 0 && out.scheduled.len() < max_seqs {
            let id = self.running[i];
            let req = &self.requests[&id];
            // In flight, a speculating request counts its proposals as
            // computed (more than its tokens) until the result comes.
            if req.in_flight_step.is_some() {
                i += 1;
                continue;
            }
            let remaining = req.num_tokens() - req.num_computed_tokens;
            let mut num_new = remaining.min(budget);
            if req.owes_prompt_logprobs() {
                num_new = num_new.min(logprob_rows);
            }
            if num_new == 0 {
                i += 1;
                continue;
            }
            let spec = &self.config.speculative;
            let max_len = self.config.max_model_len;
            let mut proposal =
                if speculate && remaining == 1 { spec.proposal(req, budget - 1, max_len) } else { Proposal::default() };
            num_new += proposal.tokens.len();
            let mut preempted_self = false;
            while self.kv.allocate_slots(&self.requests[&id], num_new, &[], &[]).is_none() {
                // Short of blocks: drop the guesses before taking anyone's blocks.
                if !proposal.tokens.is_empty() {
                    num_new -= proposal.tokens.len();
                    proposal = Proposal::default();
                    continue;
                }
                // Out of blocks: a lower-priority request gives its blocks back.
                let Some(victim) = self.take_victim(i) else {
                    stalled = true;
                    break;
                };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self || stalled {
                break;
            }
            logprob_rows -= self.push_scheduled(&mut out, id, num_new, proposal);
            budget -= num_new;
            i += 1;
        }

        // 2. Admit waiting requests, unless this step already had to preempt.
        // Those whose prefix is being loaded from disk wait for it (passed over).
        let mut passed_over = 0;
        while out.preempted.is_empty() && !stalled && budget > 0 && out.scheduled.len() < max_seqs {
            if self.running.len() >= self.config.max_num_seqs {
                break;
            }
            let Some((&key, &id)) = self.waiting.iter().nth(passed_over) else { break };
            let req = &self.requests[&id];
            let prefix = self.kv.get_computed_blocks(req);
            if prefix.loading {
                passed_over += 1;
                continue;
            }
            let num_hit_tokens = prefix.num_tokens;
            let mut num_new = (req.num_tokens() - num_hit_tokens).min(budget);
            if req.owes_prompt_logprobs() {
                num_new = num_new.min(logprob_rows);
            }
            if num_new == 0 {
                break; // this step's prompt-logprob rows are spent; it goes first next step
            }
            if self.kv.allocate_slots(req, num_new, &prefix.blocks, &prefix.restore).is_none() {
                break;
            }
            self.waiting.remove(&key);
            // A request that may not read the cache did not query it (as in vLLM).
            if !req.owes_prompt_logprobs() {
                self.kv.prefix_stats.queries += req.num_tokens() as u64;
                self.kv.prefix_stats.hits += (prefix.blocks.len() * self.config.block_size) as u64;
                if self.kv.tier().is_some() {
                    self.kv.tier_stats.queried_tokens += req.num_tokens() as u64;
                }
            }
            let req = self.requests.get_mut(&id).expect("waiting request exists");
            req.num_computed_tokens = num_hit_tokens;
            req.num_cached_tokens.get_or_insert(num_hit_tokens);
            req.status = RequestStatus::Running;
            let pos = self.running.partition_point(|r| {
                let other = &self.requests[r];
                (other.priority, other.arrival) < key
            });
            self.running.insert(pos, id);
            logprob_rows -= self.push_scheduled(&mut out, id, num_new, Proposal::default());
            budget -= num_new;
        }
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget;
        out.kv_transfers = self.kv.take_transfers();
        out
    }

    /// Records `num_new` tokens of `id` in this step, the last
    /// `spec.tokens.len()` of them proposed; returns how many prompt-logprob
    /// rows they take.
    fn push_scheduled(&mut self, out: &mut SchedulerOutput, id: RequestId, num_new: usize, spec: Proposal) -> usize {
        let req = self.requests.get_mut(&id).expect("scheduled request exists");
        let start = req.num_computed_tokens;
        req.num_computed_tokens += num_new;
        req.in_flight_step = Some(out.step_id);
        // Logits at p give the log-probability of prompt token p + 1; rows
        // owed start at `next_prompt_logprob - 1` (later after a preemption
        // recomputes positions already reported).
        let mut logprob_positions = 0..0;
        if req.owes_prompt_logprobs() {
            let first = start.max(req.next_prompt_logprob - 1);
            let end = req.num_computed_tokens.min(req.num_prompt_tokens - 1);
            if first < end {
                logprob_positions = first..end;
                req.next_prompt_logprob = end + 1;
            }
        }
        out.scheduled.push(ScheduledRequest {
            id,
            num_computed_tokens: start,
            num_new_tokens: num_new,
            block_ids: self.kv.block_table(id).to_vec(),
            samples: req.num_computed_tokens == req.num_tokens() + spec.tokens.len(),
            prompt_logprob_positions: logprob_positions.clone(),
            spec_token_ids: spec.tokens,
            draft_pending: spec.draft_pending,
        });
        logprob_positions.len()
    }

    fn preempt(&mut self, id: RequestId) {
        self.kv.free(id);
        let req = self.requests.get_mut(&id).expect("running request exists");
        req.num_computed_tokens = 0;
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.insert((req.priority, req.arrival), id);
    }
}
