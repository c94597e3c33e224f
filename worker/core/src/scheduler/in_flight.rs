//! Steps in flight. A single worker takes each step's result before it
//! schedules the next, but the first stage of a pipeline sends a step down
//! the pipeline and schedules the next one while the later stages compute
//! (vLLM's pipeline-parallel virtual engines, SGLang's micro-batches), so
//! several steps are in flight at once. Three rules keep that exact:
//!
//! - a request whose last step has no result yet is not scheduled again
//!   (its next token is not known), so steps in flight hold disjoint
//!   requests;
//! - with `micro_batches` steps in flight, a step takes at most
//!   1/`micro_batches` of the requests, so the others make the next one;
//! - a request in flight is never preempted: a stage after this one may
//!   still be writing its KV blocks, and its result is on the way.
//!
//! A result is matched to its step by `step_id`: a request aborted (and
//! maybe queued again under the same id) since then ignores it. Every stage
//! computes steps in the order they were sent, so blocks freed or reused by
//! a later step are written after the earlier step's writes, as in a single
//! worker.

use common::RequestId;

use super::Scheduler;

impl Scheduler {
    /// Lets `n` steps be in flight (a pipeline's micro-batches; at least 1).
    pub fn set_micro_batches(&mut self, n: usize) {
        self.config.micro_batches = n.max(1);
    }

    /// Most requests one step takes: all of them with one step in flight.
    pub(super) fn step_seq_limit(&self) -> usize {
        self.requests.len().div_ceil(self.config.micro_batches.max(1))
    }

    /// The request to preempt when the running one at `i` needs blocks,
    /// removed from `running`: the lowest-priority one not yet scheduled
    /// this step (after `i`) and not in flight. `None` when that would be
    /// the one at `i` itself while others are in flight: their results are
    /// coming, after which they can give blocks back, so it waits rather
    /// than throw its own KV away.
    pub(super) fn take_victim(&mut self, i: usize) -> Option<RequestId> {
        let idle = |r: &RequestId| self.requests[r].in_flight_step.is_none();
        let j = i + self.running[i..].iter().rposition(idle)?;
        if j == i && !self.running.iter().all(idle) {
            return None;
        }
        Some(self.running.remove(j))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet, VecDeque};

    use common::SamplingParams;

    use crate::config::SchedulerConfig;
    use crate::output::{SampledToken, ScheduledRequest, SchedulerOutput};
    use crate::request::Request;

    use super::*;

    fn params(max_tokens: u32) -> SamplingParams {
        SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
    }

    /// The next token given every token before it.
    fn model(tokens: &[u32]) -> u32 {
        let s: u32 = tokens.iter().rev().take(5).fold(7, |h, &t| h.wrapping_mul(31).wrapping_add(t));
        s % 50 + 3
    }

    /// What the last stage would sample for `out`, from the tokens known
    /// when it was scheduled.
    fn sample(s: &Scheduler, out: &SchedulerOutput) -> Vec<SampledToken> {
        let token = |id| model(&s.request(id).expect("scheduled request exists").token_ids);
        out.scheduled
            .iter()
            .filter(|r| r.samples)
            .map(|r| SampledToken { token_id: token(r.id), logprobs: None })
            .collect()
    }

    /// Runs every request to the end with up to `depth` steps in flight,
    /// results coming back in order; checks that steps in flight never
    /// share a request and that the pool stays consistent.
    fn run(s: &mut Scheduler, depth: usize) -> HashMap<RequestId, Vec<u32>> {
        run_verifying(s, depth, |s, out| sample(s, out).into_iter().map(|t| vec![t]).collect())
    }

    /// [`run`] with `verify` giving each step's result, per sampling request.
    fn run_verifying(
        s: &mut Scheduler,
        depth: usize,
        verify: impl Fn(&Scheduler, &SchedulerOutput) -> Vec<Vec<SampledToken>>,
    ) -> HashMap<RequestId, Vec<u32>> {
        s.set_micro_batches(depth);
        let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut in_flight: VecDeque<(SchedulerOutput, Vec<Vec<SampledToken>>)> = VecDeque::new();
        for _ in 0..100_000 {
            if !s.has_unfinished() {
                assert!(in_flight.is_empty());
                return tokens;
            }
            let out = s.schedule();
            s.check_invariants();
            let sent = !out.scheduled.is_empty();
            if sent {
                let mut ids: HashSet<RequestId> = HashSet::new();
                for (o, _) in &in_flight {
                    ids.extend(o.scheduled.iter().map(|r| r.id));
                }
                assert!(out.scheduled.iter().all(|r| !ids.contains(&r.id)), "a request in two steps in flight");
                let sampled = verify(s, &out);
                in_flight.push_back((out, sampled));
            }
            if in_flight.len() >= depth || (!sent && !in_flight.is_empty()) {
                let (out, sampled) = in_flight.pop_front().expect("a step in flight");
                for o in s.update_from_verified(&out, sampled) {
                    tokens.entry(o.id).or_default().extend(o.new_token_ids);
                }
                s.check_invariants();
            }
        }
        panic!("requests never finished");
    }

    /// Prompts with shared prefixes (cache hits), long enough to be chunked.
    fn add_all(s: &mut Scheduler) {
        for i in 0..10u64 {
            let mut prompt: Vec<u32> = (0..24).map(|t| (t * (i as u32 % 3 + 1)) % 40 + 3).collect();
            prompt.extend((0..(5 + 9 * i as u32)).map(|t| (t * 7 + i as u32) % 45 + 3));
            s.add_request(Request::new(RequestId(i), prompt, params(20 + 3 * i as u32), 0, 0)).unwrap();
        }
    }

    #[test]
    fn steps_in_flight_give_the_tokens_of_one_step_at_a_time() {
        let reference = {
            let mut s = Scheduler::new(SchedulerConfig::new(4096, 4, 1000));
            add_all(&mut s);
            run(&mut s, 1)
        };
        // Plenty of blocks; a small budget (chunked prefill); a small pool (preemption).
        for (num_blocks, budget, depth) in [(1000, 2048, 2), (1000, 16, 3), (40, 2048, 2), (40, 24, 3), (40, 24, 4)] {
            let mut cfg = SchedulerConfig::new(4096, 4, num_blocks);
            cfg.max_num_batched_tokens = budget;
            let mut s = Scheduler::new(cfg);
            add_all(&mut s);
            let tokens = run(&mut s, depth);
            assert_eq!(tokens, reference, "{num_blocks} blocks, budget {budget}, {depth} in flight");
            let stats = s.stats();
            assert!(stats.prefix_cache.hits > 0);
            if num_blocks == 40 {
                assert!(stats.num_preemptions > 0, "the pool is small enough to preempt");
            }
            assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }

    /// Mostly a short cycle (n-gram proposals are often right), broken now
    /// and then (some are rejected).
    fn loopy(tokens: &[u32]) -> u32 {
        let last = *tokens.last().expect("a token");
        match tokens.len() % 11 {
            0 => (last * 7 + tokens.len() as u32) % 40 + 3,
            _ => (last * 13 + 5) % 9 + 3,
        }
    }

    /// What a pipeline's last stage sends back: per sampling request, the
    /// model's draw at each verified position (row i given the first i
    /// proposals), cut after the first that differs from its proposal.
    fn verify_loopy(s: &Scheduler, out: &SchedulerOutput) -> Vec<Vec<SampledToken>> {
        let verify = |r: &ScheduledRequest| {
            let mut tokens = s.request(r.id).expect("scheduled request exists").token_ids.clone();
            let mut drawn = vec![loopy(&tokens)];
            for &p in &r.spec_token_ids {
                tokens.push(p);
                drawn.push(loopy(&tokens));
            }
            let kept = crate::spec::num_accepted(&r.spec_token_ids, &drawn) + 1;
            assert!(crate::spec::is_verified_run(&r.spec_token_ids, &drawn[..kept]));
            drawn[..kept].iter().map(|&token_id| SampledToken { token_id, logprobs: None }).collect()
        };
        out.scheduled.iter().filter(|r| r.samples).map(verify).collect()
    }

    /// Speculation with steps in flight, results cut to the kept draws as
    /// a last stage sends them: one token at a time's output, under
    /// chunking, cache hits and preemption.
    #[test]
    fn speculating_steps_in_flight_give_the_tokens_of_plain_decoding() {
        let reference = {
            let mut s = Scheduler::new(SchedulerConfig::new(4096, 4, 1000));
            add_all(&mut s);
            run_verifying(&mut s, 1, verify_loopy)
        };
        for (num_blocks, budget, depth) in [(1000, 2048, 2), (1000, 16, 3), (40, 2048, 2), (40, 24, 3)] {
            let mut cfg = SchedulerConfig::new(4096, 4, num_blocks);
            cfg.max_num_batched_tokens = budget;
            cfg.speculative = crate::SpeculativeConfig {
                enabled_by_default: true,
                num_speculative_tokens: 4,
                prompt_lookup_min: 1,
                prompt_lookup_max: 3,
                max_batch_tokens: 1 << 20,
                ..crate::SpeculativeConfig::default()
            };
            let mut s = Scheduler::new(cfg);
            add_all(&mut s);
            let tokens = run_verifying(&mut s, depth, verify_loopy);
            assert_eq!(tokens, reference, "{num_blocks} blocks, budget {budget}, {depth} in flight");
            let stats = s.stats();
            let spec = &stats.spec_decoding;
            assert!(spec.num_accepted_tokens > 0 && spec.num_accepted_tokens < spec.num_draft_tokens, "{spec:?}");
            if num_blocks == 40 {
                assert!(stats.num_preemptions > 0, "the pool is small enough to preempt");
            }
            assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }

    #[test]
    fn a_step_takes_its_share_of_the_requests_and_skips_those_in_flight() {
        let mut s = Scheduler::new(SchedulerConfig::new(4096, 4, 1000));
        s.set_micro_batches(2);
        for i in 0..5 {
            s.add_request(Request::new(RequestId(i), vec![3, 4, 5], params(10), 0, 0)).unwrap();
        }
        let ids = |out: &SchedulerOutput| out.scheduled.iter().map(|r| r.id.0).collect::<Vec<_>>();
        let a = s.schedule();
        let b = s.schedule();
        assert_eq!((ids(&a), ids(&b)), (vec![0, 1, 2], vec![3, 4]), "3 then the other 2 of 5");
        assert!(s.schedule().scheduled.is_empty(), "every request is in flight");
        let sampled = sample(&s, &a);
        s.update_from_output(&a, sampled);
        assert_eq!(ids(&s.schedule()), [0, 1, 2], "the first group again, while the second is in flight");
    }

    #[test]
    fn a_late_result_does_not_touch_a_request_aborted_and_queued_again() {
        let mut s = Scheduler::new(SchedulerConfig::new(4096, 4, 1000));
        s.set_micro_batches(2);
        s.add_request(Request::new(RequestId(1), vec![3, 4, 5], params(10), 0, 0)).unwrap();
        let a = s.schedule();
        s.abort(RequestId(1));
        s.add_request(Request::new(RequestId(1), vec![6, 7], params(10), 0, 0)).unwrap();
        let b = s.schedule();
        assert!(s.update_from_output(&a, vec![SampledToken { token_id: 9, logprobs: None }]).is_empty());
        let out = s.update_from_output(&b, vec![SampledToken { token_id: 8, logprobs: None }]);
        assert_eq!(out[0].new_token_ids, [8]);
        assert_eq!(s.request(RequestId(1)).unwrap().token_ids, [6, 7, 8]);
        s.check_invariants();
    }

    #[test]
    fn a_request_short_of_blocks_waits_for_those_in_flight_instead_of_preempting_itself() {
        // 4 blocks of 4 tokens: two requests of 7 tokens fill 2 each.
        let mut s = Scheduler::new(SchedulerConfig::new(4096, 4, 4));
        s.set_micro_batches(2);
        s.add_request(Request::new(RequestId(1), vec![3; 7], params(10), 0, 0)).unwrap();
        s.add_request(Request::new(RequestId(2), vec![4; 7], params(10), 0, 0)).unwrap();
        let a = s.schedule(); // request 1
        let b = s.schedule(); // request 2
        let sampled = sample(&s, &a);
        s.update_from_output(&a, sampled);
        s.schedule(); // request 1's 8th token fills its second block
        let sampled = sample(&s, &b);
        s.update_from_output(&b, sampled);
        let c = s.schedule(); // request 2's 8th token fills its second block too
        assert_eq!(c.scheduled.len(), 1);
        assert_eq!(s.kv_cache_manager().num_used_blocks(), 4);
        // Request 2's 9th token needs a fifth block; request 1 is in flight.
        let sampled = sample(&s, &c);
        s.update_from_output(&c, sampled);
        let d = s.schedule();
        assert!(d.scheduled.is_empty() && d.preempted.is_empty(), "{d:?}");
        assert_eq!(s.stats().num_preemptions, 0);
    }
}
