//! Continuous batching in the style of vLLM v1: every step hands each
//! request some of its not-yet-computed tokens under a token budget. Prompts
//! longer than what is left of the budget are computed in chunks over
//! several steps (chunked prefill) while running requests keep decoding,
//! because running requests are served first. When blocks run out, the
//! lowest-priority running request gives its blocks back and later
//! recomputes (preemption by recompute). A request asking for prompt
//! logprobs keeps a row of logits per prompt position: its chunks are cut
//! to a per-step row limit, and each position is reported once, even when a
//! preemption makes it compute the prompt again.
//!
//! Speculative decoding (`spec`): a decode also computes its n-gram
//! proposal, and the KV slots of rejected proposals are rolled back.
//!
//! A pipeline keeps several steps in flight (`in_flight`): a request is
//! scheduled again only once its last step's result is back.
//!
//! No tensors and no I/O here: `schedule()` says what to compute, the model
//! runner computes it, `update_from_output()` takes the sampled tokens.
//! One file per half of that contract: `schedule` (the step's tokens,
//! admission, preemption) and `update` (appending tokens, stop checks,
//! freeing), with `in_flight` for the rules of steps in flight.

mod in_flight;
mod schedule;
#[cfg(test)]
mod tier_tests;
mod update;

use std::collections::{BTreeMap, HashMap};

use common::RequestId;

use crate::config::{SchedulerConfig, SchedulingPolicy};
use crate::error::AddRequestError;
use crate::kv_cache_manager::KvCacheManager;
use crate::kv_tier::TierStats;
use crate::output::{RequestOutput, SchedulerStats};
use common::FinishReason;

use crate::request::Request;
use crate::spec::SpecDecodingStats;

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Request>,
    /// Keyed by (priority, arrival): iteration order is service order.
    waiting: BTreeMap<(i32, u64), RequestId>,
    /// Sorted by (priority, arrival), so the last one is the preemption victim.
    running: Vec<RequestId>,
    next_arrival: u64,
    num_preemptions: u64,
    spec_stats: SpecDecodingStats,
    next_step_id: u64,
}

impl Scheduler {
    pub fn new(mut config: SchedulerConfig) -> Self {
        // A sequence can never outgrow the whole pool: it stops there with
        // `Length` rather than preempting itself forever. Under a window on
        // every layer it holds at most the window and a step's tokens (and
        // a block each side), so it may grow past the pool when those fit.
        let bs = config.block_size.max(1);
        let windowed_fits = config
            .sliding_window
            .is_some_and(|w| (w + config.max_num_batched_tokens).div_ceil(bs) + 2 <= config.num_blocks);
        if !windowed_fits {
            config.max_model_len = config.max_model_len.min(config.num_blocks * config.block_size);
        }
        let kv = KvCacheManager::new(config.num_blocks, config.block_size, config.enable_prefix_caching)
            .with_sliding_window(config.sliding_window)
            .with_tier(config.tier_blocks);
        Self {
            config,
            kv,
            requests: HashMap::new(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            next_arrival: 0,
            num_preemptions: 0,
            spec_stats: SpecDecodingStats::default(),
            next_step_id: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues `req` (built by `Request::new`): its arrival is now, and its
    /// priority counts only under `SchedulingPolicy::Priority`.
    pub fn add_request(&mut self, mut req: Request) -> Result<(), AddRequestError> {
        if self.requests.contains_key(&req.id) {
            return Err(AddRequestError::DuplicateId(req.id));
        }
        if req.num_prompt_tokens == 0 {
            return Err(AddRequestError::EmptyPrompt);
        }
        // The model must be able to emit at least one token after the prompt (and any resumed output).
        let max_len = self.config.max_model_len;
        if req.num_tokens() >= max_len {
            return Err(AddRequestError::PromptTooLong { prompt: req.num_tokens(), max_model_len: max_len });
        }
        req.params.validate()?;
        if self.config.policy == SchedulingPolicy::Fcfs {
            req.priority = 0;
        }
        req.arrival = self.next_arrival;
        self.next_arrival += 1;
        req.update_block_hashes(self.config.block_size);
        self.waiting.insert((req.priority, req.arrival), req.id);
        self.requests.insert(req.id, req);
        Ok(())
    }

    /// Removes a request wherever it is and frees its blocks at once.
    pub fn abort(&mut self, id: RequestId) -> Option<RequestOutput> {
        let req = self.requests.remove(&id)?;
        self.waiting.remove(&(req.priority, req.arrival));
        self.running.retain(|&r| r != id);
        self.kv.free(id);
        Some(RequestOutput { finish_reason: Some(FinishReason::Abort), ..RequestOutput::empty(&req) })
    }

    /// Aborts every request, in id order (waiting and running alike), and
    /// frees all their blocks.
    pub fn abort_all(&mut self) -> Vec<RequestOutput> {
        let mut ids: Vec<RequestId> = self.requests.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().filter_map(|id| self.abort(id)).collect()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn kv_cache_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn kv_cache_manager_mut(&mut self) -> &mut KvCacheManager {
        &mut self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kv_blocks_total: self.kv.num_blocks(),
            kv_blocks_used: self.kv.num_used_blocks(),
            kv_blocks_cached: self.kv.pool().num_cached(),
            prefix_cache: self.kv.prefix_stats,
            tier: TierStats { blocks: self.kv.tier().map_or(0, |t| t.len()), ..self.kv.tier_stats },
            num_preemptions: self.num_preemptions,
            spec_decoding: self.spec_stats.clone(),
        }
    }

    /// Every block is free or cached with ref_cnt 0 once no request is alive;
    /// in general, ref counts match the live block tables.
    pub fn check_invariants(&self) {
        self.kv.check_invariants();
        assert_eq!(self.requests.len(), self.running.len() + self.waiting.len(), "requests vs queues");
        if self.requests.is_empty() {
            assert_eq!(self.kv.num_used_blocks(), 0, "blocks leaked with no live request");
        }
    }
}

#[cfg(test)]
mod tests {
    use common::SamplingParams;

    use super::*;
    use crate::output::{SampledToken, SchedulerOutput};
    use crate::spec::SpeculativeConfig;

    fn step(s: &mut Scheduler) -> (SchedulerOutput, Vec<RequestOutput>) {
        step_with(s, |tokens| fake_next_of(*tokens.last().unwrap()))
    }

    fn fake_next_of(last: u32) -> u32 {
        (last * 31 + 7) % 50 + 3
    }

    /// A step with `model` (the next token given all tokens before it)
    /// drawing at every verified position, as the sampler does: at
    /// proposal i, as if proposals 0..i were real.
    fn step_with(s: &mut Scheduler, model: impl Fn(&[u32]) -> u32) -> (SchedulerOutput, Vec<RequestOutput>) {
        step_drafting(s, model, |_| unreachable!("no draft model"))
    }

    /// [`step_with`], where `draft` (greedy, given all tokens before) fills
    /// in the draft model's proposals first, as the model runner does.
    fn step_drafting(
        s: &mut Scheduler,
        model: impl Fn(&[u32]) -> u32,
        draft: impl Fn(&[u32]) -> u32,
    ) -> (SchedulerOutput, Vec<RequestOutput>) {
        let mut out = s.schedule();
        for r in out.scheduled.iter_mut() {
            assert_eq!(r.draft_pending, r.spec_token_ids.contains(&crate::DRAFT_PENDING));
            if r.draft_pending {
                let mut seq = s.request(r.id).unwrap().token_ids.clone();
                for slot in r.spec_token_ids.iter_mut() {
                    *slot = draft(&seq);
                    seq.push(*slot);
                }
            }
        }
        let mut sampled = Vec::new();
        for r in out.scheduled.iter().filter(|r| r.samples) {
            let mut seq = s.request(r.id).unwrap().token_ids.clone();
            for i in 0..r.num_sampled_rows() {
                sampled.push(SampledToken { token_id: model(&seq), logprobs: None });
                seq.extend(r.spec_token_ids.get(i));
            }
        }
        let outputs = s.update_from_output(&out, sampled);
        s.check_invariants();
        (out, outputs)
    }

    fn run_to_end(s: &mut Scheduler) -> HashMap<RequestId, Vec<u32>> {
        let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
        for _ in 0..100_000 {
            if !s.has_unfinished() {
                return tokens;
            }
            for o in step(s).1 {
                tokens.entry(o.id).or_default().extend(o.new_token_ids);
            }
        }
        panic!("requests never finished");
    }

    fn config(num_blocks: usize) -> SchedulerConfig {
        SchedulerConfig::new(8192, 16, num_blocks)
    }

    fn params(max_tokens: u32) -> SamplingParams {
        SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
    }

    #[test]
    fn long_prompt_is_chunked_while_decodes_keep_flowing() {
        let mut s = Scheduler::new(config(1024));
        for i in 0..3 {
            s.add_request(Request::new(RequestId(i), vec![5; 20], params(200), 0, 0)).unwrap();
        }
        step(&mut s); // the three short prompts
        s.add_request(Request::new(RequestId(9), vec![7; 4000], params(4), 0, 0)).unwrap();
        let mut prefill_steps = 0;
        loop {
            let (out, _) = step(&mut s);
            let decodes = out.scheduled.iter().filter(|r| r.id != RequestId(9)).count();
            assert_eq!(decodes, 3, "every running stream gets a token every step");
            let long = out.scheduled.iter().find(|r| r.id == RequestId(9)).unwrap();
            assert!(out.num_batched_tokens <= 2048);
            prefill_steps += 1;
            if long.samples {
                break;
            }
        }
        assert_eq!(prefill_steps, 2, "4000 tokens in chunks of at most 2045");
    }

    #[test]
    fn shared_prefix_hits_the_cache() {
        let mut s = Scheduler::new(config(256));
        let prefix: Vec<u32> = (0..100).map(|i| i % 40 + 3).collect();
        let mut a = prefix.clone();
        a.extend([60, 61, 62]);
        let mut b = prefix.clone();
        b.extend([70, 71]);
        s.add_request(Request::new(RequestId(1), a, params(4), 0, 0)).unwrap();
        run_to_end(&mut s);
        s.add_request(Request::new(RequestId(2), b, params(4), 0, 0)).unwrap();
        let out = s.schedule();
        assert_eq!(out.scheduled[0].num_computed_tokens, 96, "6 full blocks of 16 reused");
        assert_eq!(out.scheduled[0].num_new_tokens, 102 - 96);
        assert_eq!(s.stats().prefix_cache.hits, 96);
        assert_eq!(s.request(RequestId(2)).unwrap().num_cached_tokens, Some(96));
    }

    #[test]
    fn preemption_keeps_every_output_identical() {
        let prompts: Vec<Vec<u32>> =
            (0..8).map(|i| (0..(30 + 7 * i)).map(|t| (t * (i + 1)) % 45 + 3).collect()).collect();
        let reference = {
            let mut s = Scheduler::new(config(1000));
            for (i, p) in prompts.iter().enumerate() {
                s.add_request(Request::new(RequestId(i as u64), p.clone(), params(40), 0, 0)).unwrap();
            }
            run_to_end(&mut s)
        };
        // 8 requests need up to 6 blocks each at the end; 20 blocks forces preemption.
        let mut s = Scheduler::new(config(20));
        for (i, p) in prompts.iter().enumerate() {
            s.add_request(Request::new(RequestId(i as u64), p.clone(), params(40), 0, 0)).unwrap();
        }
        let tokens = run_to_end(&mut s);
        assert!(s.stats().num_preemptions > 0);
        assert_eq!(tokens, reference);
        assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
    }

    /// Each prompt position's logits are kept exactly once, in order, in
    /// chunks under the per-step row limit, through chunked prefill and
    /// preemption (which recomputes positions already reported).
    #[test]
    fn prompt_logprob_positions_cover_each_prompt_once() {
        let mut cfg = config(20);
        cfg.max_num_batched_tokens = 64;
        cfg.max_prompt_logprob_rows = 24;
        let mut s = Scheduler::new(cfg);
        let prompts: Vec<Vec<u32>> =
            (0..6).map(|i| (0..(30 + 11 * i)).map(|t| (t * 7 + i) % 45 + 3).collect()).collect();
        for (i, p) in prompts.iter().enumerate() {
            // Even ids ask for prompt logprobs.
            let lp = (i % 2 == 0).then_some(2);
            s.add_request(Request::new(
                RequestId(i as u64),
                p.clone(),
                SamplingParams { prompt_logprobs: lp, ..params(40) },
                0,
                0,
            ))
            .unwrap();
        }
        let mut seen: HashMap<RequestId, Vec<usize>> = HashMap::new();
        while s.has_unfinished() {
            let (out, _) = step(&mut s);
            let rows: usize = out.scheduled.iter().map(|r| r.prompt_logprob_positions.len()).sum();
            assert!(rows <= 24, "{rows} prompt-logprob rows in one step");
            for r in &out.scheduled {
                let positions = &r.prompt_logprob_positions;
                let computed = r.num_computed_tokens..r.num_computed_tokens + r.num_new_tokens;
                assert!(positions.is_empty() || (computed.contains(&positions.start) && positions.end <= computed.end));
                seen.entry(r.id).or_default().extend(positions.clone());
            }
        }
        assert!(s.stats().num_preemptions > 0, "the pool is small enough to preempt");
        for (i, p) in prompts.iter().enumerate() {
            let got = seen.remove(&RequestId(i as u64)).unwrap_or_default();
            let want: Vec<usize> = if i % 2 == 0 { (0..p.len() - 1).collect() } else { Vec::new() };
            assert_eq!(got, want, "request {i}");
        }
    }

    /// A request preempted in the middle of its prompt recomputes it from 0
    /// but reports only the positions it had not reported.
    #[test]
    fn preemption_mid_prompt_reports_no_position_twice() {
        let mut cfg = config(8); // 128 tokens of KV
        cfg.policy = SchedulingPolicy::Priority;
        cfg.max_num_batched_tokens = 64;
        cfg.max_prompt_logprob_rows = 24;
        let mut s = Scheduler::new(cfg);
        let scoring = SamplingParams { prompt_logprobs: Some(1), ..params(4) };
        s.add_request(Request::new(RequestId(1), (0..100).map(|t| t % 45 + 3).collect(), scoring, 5, 0)).unwrap();
        let mut positions = Vec::new();
        let mut starts = Vec::new();
        let mut record = |out: &SchedulerOutput| {
            for r in out.scheduled.iter().filter(|r| r.id == RequestId(1)) {
                positions.extend(r.prompt_logprob_positions.clone());
                starts.push(r.num_computed_tokens);
            }
        };
        record(&step(&mut s).0);
        // A more important request arrives and, as it grows, takes request 1's blocks.
        s.add_request(Request::new(RequestId(2), vec![4; 100], params(10), 1, 0)).unwrap();
        while s.has_unfinished() {
            record(&step(&mut s).0);
        }
        assert_eq!(s.stats().num_preemptions, 1);
        assert_eq!(
            starts,
            [0, 24, 0, 24, 48, 72, 96, 100, 101, 102],
            "preempted after 48 positions, recomputed from 0"
        );
        assert_eq!(positions, (0..99).collect::<Vec<_>>());
    }

    #[test]
    fn prompt_logprobs_bypass_the_prefix_cache() {
        let mut s = Scheduler::new(config(256));
        let prompt: Vec<u32> = (0..70).map(|i| i % 40 + 3).collect();
        s.add_request(Request::new(RequestId(1), prompt.clone(), params(4), 0, 0)).unwrap();
        run_to_end(&mut s);
        let scoring = SamplingParams { prompt_logprobs: Some(0), ..params(4) };
        s.add_request(Request::new(RequestId(2), prompt.clone(), scoring, 0, 0)).unwrap();
        let out = s.schedule();
        assert_eq!(
            (out.scheduled[0].num_computed_tokens, out.scheduled[0].prompt_logprob_positions.clone()),
            (0, 0..69)
        );
        assert_eq!(s.stats().prefix_cache.queries, 70, "only request 1 queried the cache");
        s.update_from_output(&out, vec![SampledToken { token_id: 5, logprobs: None }]);
        run_to_end(&mut s);
        // Without prompt logprobs the same prompt hits: 4 full blocks of 16.
        s.add_request(Request::new(RequestId(3), prompt, params(4), 0, 0)).unwrap();
        assert_eq!(s.schedule().scheduled[0].num_computed_tokens, 64);
    }

    #[test]
    fn priority_policy_preempts_the_least_important() {
        let mut cfg = config(8);
        cfg.policy = SchedulingPolicy::Priority;
        let mut s = Scheduler::new(cfg);
        s.add_request(Request::new(RequestId(1), vec![3; 40], params(100), 5, 0)).unwrap();
        s.add_request(Request::new(RequestId(2), vec![4; 40], params(100), 1, 0)).unwrap();
        let (out, _) = step(&mut s);
        // Request 2 is more important and goes first though it arrived later.
        assert_eq!(out.scheduled[0].id, RequestId(2));
        let tokens = run_to_end(&mut s);
        assert!(s.stats().num_preemptions > 0);
        // Both finish at the pool's capacity (8 blocks of 16 = 128 tokens);
        // the first step's token was taken above.
        assert_eq!(tokens[&RequestId(1)].len() + 1, 128 - 40);
        assert_eq!(tokens[&RequestId(2)].len() + 1, 128 - 40);
    }

    #[test]
    fn abort_frees_blocks_at_once() {
        let mut s = Scheduler::new(config(64));
        s.add_request(Request::new(RequestId(1), vec![3; 50], params(100), 0, 0)).unwrap();
        step(&mut s);
        assert!(s.kv_cache_manager().num_used_blocks() > 0);
        let out = s.abort(RequestId(1)).unwrap();
        assert_eq!(out.finish_reason, Some(FinishReason::Abort));
        assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        s.check_invariants();
        assert!(s.abort(RequestId(1)).is_none());
    }

    /// A model that mostly repeats a cycle (so n-gram guesses are often
    /// right) but breaks it now and then (so some are rejected).
    fn loopy_model(tokens: &[u32]) -> u32 {
        let last = *tokens.last().unwrap();
        if tokens.len().is_multiple_of(11) {
            (last * 7 + tokens.len() as u32) % 40 + 3
        } else {
            (last * 13 + 5) % 9 + 3
        }
    }

    fn speculative(cfg: &mut SchedulerConfig, k: usize) {
        cfg.speculative = SpeculativeConfig {
            enabled_by_default: true,
            num_speculative_tokens: k,
            prompt_lookup_min: 1,
            prompt_lookup_max: 3,
            max_batch_tokens: 1 << 20,
            ..SpeculativeConfig::default()
        };
    }

    fn run_with(s: &mut Scheduler, model: fn(&[u32]) -> u32) -> HashMap<RequestId, Vec<u32>> {
        let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
        while s.has_unfinished() {
            for o in step_with(s, model).1 {
                assert_eq!(o.logprobs.len(), 0);
                tokens.entry(o.id).or_default().extend(o.new_token_ids);
            }
        }
        tokens
    }

    /// Greedy acceptance gives exactly the tokens one-at-a-time decoding
    /// gives, under pool pressure (preemption) and a small budget too.
    #[test]
    fn speculation_keeps_every_output_identical() {
        let prompts: Vec<Vec<u32>> =
            (0..6).map(|i| (0..(9 + 5 * i)).map(|t| (t * (i + 2)) % 9 + 3).collect()).collect();
        let add_all = |s: &mut Scheduler| {
            for (i, p) in prompts.iter().enumerate() {
                let max_tokens = 30 + 7 * i as u32;
                s.add_request(Request::new(RequestId(i as u64), p.clone(), params(max_tokens), 0, 0)).unwrap();
            }
        };
        let mut plain = Scheduler::new(config(1000));
        add_all(&mut plain);
        let reference = run_with(&mut plain, loopy_model);
        for (num_blocks, budget) in [(1000, 2048), (30, 2048), (1000, 7)] {
            let mut cfg = config(num_blocks);
            cfg.block_size = 4;
            cfg.max_num_batched_tokens = budget;
            speculative(&mut cfg, 4);
            let mut s = Scheduler::new(cfg);
            add_all(&mut s);
            let tokens = run_with(&mut s, loopy_model);
            assert_eq!(tokens, reference, "{num_blocks} blocks, budget {budget}");
            let stats = s.stats();
            let spec = &stats.spec_decoding;
            assert!(spec.num_accepted_tokens > 0 && spec.num_accepted_tokens < spec.num_draft_tokens, "{spec:?}");
            assert_eq!(spec.accepted_per_pos.iter().sum::<u64>(), spec.num_accepted_tokens);
            if num_blocks == 30 {
                assert!(stats.num_preemptions > 0);
            }
            assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }

    /// Draft-model proposals (placeholders the runner fills in) keep every
    /// output identical too, with a draft that is right about half the
    /// time, under preemption and a small budget.
    #[test]
    fn draft_proposals_keep_every_output_identical() {
        let prompts: Vec<Vec<u32>> =
            (0..5).map(|i| (0..(7 + 4 * i)).map(|t| (t * (i + 3)) % 11 + 3).collect()).collect();
        let add_all = |s: &mut Scheduler| {
            for (i, p) in prompts.iter().enumerate() {
                s.add_request(Request::new(RequestId(i as u64), p.clone(), params(25 + 6 * i as u32), 0, 0)).unwrap();
            }
        };
        let mut plain = Scheduler::new(config(1000));
        add_all(&mut plain);
        let reference = run_with(&mut plain, loopy_model);
        let draft = |tokens: &[u32]| if tokens.len().is_multiple_of(2) { loopy_model(tokens) } else { 1 };
        for (num_blocks, budget) in [(1000, 2048), (30, 2048), (1000, 9)] {
            let mut cfg = config(num_blocks);
            cfg.block_size = 4;
            cfg.max_num_batched_tokens = budget;
            speculative(&mut cfg, 3);
            cfg.speculative.default_method = crate::SpecMethod::Draft;
            cfg.speculative.has_draft_model = true;
            let mut s = Scheduler::new(cfg);
            add_all(&mut s);
            let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
            while s.has_unfinished() {
                for o in step_drafting(&mut s, loopy_model, draft).1 {
                    tokens.entry(o.id).or_default().extend(o.new_token_ids);
                }
            }
            assert_eq!(tokens, reference, "{num_blocks} blocks, budget {budget}");
            let spec = s.stats().spec_decoding;
            assert!(spec.num_accepted_tokens > 0 && spec.num_accepted_tokens < spec.num_draft_tokens, "{spec:?}");
            assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }

    /// The prefix cache never holds a block hash over a rejected guess:
    /// every hash it holds, after every step, is the hash of a full block
    /// of some request's final (accepted) tokens.
    #[test]
    fn no_block_hash_covers_a_rejected_token() {
        let mut cfg = config(64);
        cfg.block_size = 4;
        speculative(&mut cfg, 5);
        let mut s = Scheduler::new(cfg);
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| (0..(6 + i)).map(|t| (t * 5 + i) % 7 + 3).collect()).collect();
        for (i, p) in prompts.iter().enumerate() {
            s.add_request(Request::new(RequestId(i as u64), p.clone(), params(40), 0, 0)).unwrap();
        }
        let mut held = std::collections::HashSet::new();
        let mut finals: HashMap<RequestId, Vec<u32>> =
            prompts.iter().enumerate().map(|(i, p)| (RequestId(i as u64), p.clone())).collect();
        while s.has_unfinished() {
            let (out, outputs) = step_with(&mut s, loopy_model);
            for r in out.scheduled.iter().filter(|r| !r.spec_token_ids.is_empty()) {
                // A request that keeps running holds blocks for its tokens only.
                if let Some(req) = s.request(r.id) {
                    assert_eq!(s.kv_cache_manager().block_table(r.id).len(), req.num_tokens().div_ceil(4));
                }
            }
            for o in outputs {
                finals.get_mut(&o.id).unwrap().extend(o.new_token_ids);
            }
            held.extend(s.kv_cache_manager().kv_snapshot().1.into_iter().map(|(hash, _)| hash));
        }
        let spec = s.stats().spec_decoding;
        assert!(spec.num_accepted_tokens > 0 && spec.num_accepted_tokens < spec.num_draft_tokens, "{spec:?}");
        let mut accepted = std::collections::HashSet::new();
        for tokens in finals.values() {
            let mut req = Request::new(RequestId(99), tokens.clone(), params(1), 0, 0);
            req.update_block_hashes(4);
            accepted.extend(req.block_hashes);
        }
        assert!(!held.is_empty());
        assert!(held.is_subset(&accepted), "a cached hash covers a token that was never accepted");
    }

    /// Proposals stop at `max_tokens` and a stop token inside an accepted
    /// run ends the request there.
    #[test]
    fn accepted_runs_stop_where_plain_decoding_stops() {
        let mut cfg = config(64);
        speculative(&mut cfg, 4);
        let mut s = Scheduler::new(cfg);
        // The model repeats the prompt's cycle 3 4 5 6; every guess is right.
        let cycle = |tokens: &[u32]| (tokens.last().unwrap() - 3 + 1) % 4 + 3;
        let prompt = vec![3, 4, 5, 6, 3, 4, 5, 6, 3];
        s.add_request(Request::new(RequestId(1), prompt.clone(), params(5), 0, 0)).unwrap();
        let stop_at_6 = SamplingParams { stop_token_ids: vec![6], ..params(20) };
        s.add_request(Request::new(RequestId(2), prompt, stop_at_6, 0, 0)).unwrap();
        let mut got: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut proposed = Vec::new();
        while s.has_unfinished() {
            let (out, outputs) = step_with(&mut s, cycle);
            proposed.extend(out.scheduled.iter().filter(|r| r.id == RequestId(1)).map(|r| r.spec_token_ids.len()));
            for o in outputs {
                got.entry(o.id).or_default().extend(o.new_token_ids);
            }
        }
        assert_eq!(got[&RequestId(1)], [4, 5, 6, 3, 4]);
        assert_eq!(proposed, [0, 3], "the prompt; then 3 guesses and the bonus make max_tokens");
        assert_eq!(got[&RequestId(2)], [4, 5, 6], "the guesses after the stop token are dropped");
    }

    /// Past `max_batch_tokens` a step proposes nothing; requests that turn
    /// speculation off never propose.
    #[test]
    fn large_batches_and_opted_out_requests_do_not_speculate() {
        let mut cfg = config(256);
        speculative(&mut cfg, 4);
        cfg.speculative.max_batch_tokens = 10;
        let mut s = Scheduler::new(cfg);
        let cycle = |tokens: &[u32]| (tokens.last().unwrap() - 3 + 1) % 3 + 3;
        let prompt = vec![3, 4, 5, 3, 4, 5, 3, 4];
        let off = SamplingParams { speculative: Some(common::Speculative::Off), ..params(50) };
        s.add_request(Request::new(RequestId(1), prompt.clone(), params(50), 0, 0)).unwrap();
        s.add_request(Request::new(RequestId(2), prompt.clone(), off, 0, 0)).unwrap();
        step_with(&mut s, cycle);
        let (out, _) = step_with(&mut s, cycle);
        let spec: Vec<usize> = out.scheduled.iter().map(|r| r.spec_token_ids.len()).collect();
        assert_eq!(spec, [4, 0], "1 + 4 and 1 tokens to verify: under 10");
        for i in 3..6 {
            s.add_request(Request::new(RequestId(i), prompt.clone(), params(50), 0, 0)).unwrap();
        }
        step_with(&mut s, cycle);
        let (out, _) = step_with(&mut s, cycle);
        assert_eq!(out.scheduled.len(), 5);
        assert!(out.scheduled.iter().all(|r| r.spec_token_ids.is_empty()), "4 x (1 + 4) + 1 tokens > 10");
    }

    #[test]
    fn rejects_bad_requests() {
        let mut s = Scheduler::new(SchedulerConfig::new(64, 16, 100));
        assert_eq!(
            s.add_request(Request::new(RequestId(1), vec![], params(1), 0, 0)),
            Err(AddRequestError::EmptyPrompt)
        );
        assert!(matches!(
            s.add_request(Request::new(RequestId(1), vec![3; 64], params(1), 0, 0)),
            Err(AddRequestError::PromptTooLong { prompt: 64, max_model_len: 64 })
        ));
        s.add_request(Request::new(RequestId(1), vec![3; 10], params(1), 0, 0)).unwrap();
        assert_eq!(
            s.add_request(Request::new(RequestId(1), vec![3; 10], params(1), 0, 0)),
            Err(AddRequestError::DuplicateId(RequestId(1)))
        );
        let bad = SamplingParams { top_p: 2.0, ..params(1) };
        assert!(matches!(
            s.add_request(Request::new(RequestId(2), vec![3], bad, 0, 0)),
            Err(AddRequestError::InvalidParams(_))
        ));
    }

    #[test]
    fn stop_conditions() {
        let mut cfg = config(64);
        cfg.eos_token_ids = vec![2];
        let mut s = Scheduler::new(cfg);
        let stop_on = |token: u32, params: SamplingParams, s: &mut Scheduler, id: u64| {
            s.add_request(Request::new(RequestId(id), vec![3, 4], params, 0, 0)).unwrap();
            let out = s.schedule();
            let outputs = s.update_from_output(&out, vec![SampledToken { token_id: token, logprobs: None }]);
            s.abort(RequestId(id));
            outputs[0].finish_reason
        };
        let eos = SamplingParams::greedy(10);
        assert_eq!(stop_on(2, eos.clone(), &mut s, 1), Some(FinishReason::Stop));
        let ignore = SamplingParams { ignore_eos: true, ..eos.clone() };
        assert_eq!(stop_on(2, ignore, &mut s, 2), None);
        let stop_ids = SamplingParams { stop_token_ids: vec![9], ..eos.clone() };
        assert_eq!(stop_on(9, stop_ids, &mut s, 3), Some(FinishReason::Stop));
        assert_eq!(stop_on(5, SamplingParams::greedy(1), &mut s, 4), Some(FinishReason::Length));
    }

    /// With a window on every layer, a long prompt holds only the blocks
    /// its next queries can see: 8-token chunks under a window of 8 keep at
    /// most 5 blocks of 4 where the whole prompt would take 13; they come
    /// back to the pool (still cached) and the request's end frees the rest.
    #[test]
    fn a_sliding_window_hands_back_the_blocks_it_has_left() {
        for window in [None, Some(8)] {
            let mut cfg = SchedulerConfig::new(512, 4, 64);
            cfg.max_num_batched_tokens = 8;
            cfg.sliding_window = window;
            let mut s = Scheduler::new(cfg);
            let prompt: Vec<u32> = (0..50).map(|t| t % 40 + 3).collect();
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(6) };
            s.add_request(Request::new(RequestId(1), prompt, params, 0, 0)).unwrap();
            let mut most = 0;
            loop {
                let (out, outputs) = step(&mut s);
                most = most.max(s.kv_cache_manager().num_used_blocks());
                s.check_invariants();
                if out.scheduled.is_empty() || outputs.iter().any(|o| o.finish_reason.is_some()) {
                    break;
                }
            }
            match window {
                Some(_) => assert!(most <= 5, "window 8: {most} blocks held at once"),
                None => assert_eq!(most, 14, "56 tokens in blocks of 4"),
            }
            assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }
}

#[cfg(test)]
mod proptests {
    //! The block manager against a simple model: random sequences of
    //! requests (with shared prefixes, so cache hits happen), steps, aborts
    //! and pool pressure never double-free, leak, or hand out a block in use
    //! (checked by `check_invariants`: ref counts equal block-table counts).
    use common::SamplingParams;
    use proptest::prelude::*;

    use super::*;
    use crate::output::SampledToken;

    #[derive(Clone, Debug)]
    enum Op {
        Add { prefix: u8, len: u8, max_tokens: u8 },
        Step,
        Abort(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3, 1u8..80, 1u8..20).prop_map(|(prefix, len, max_tokens)| Op::Add { prefix, len, max_tokens }),
            Just(Op::Step),
            Just(Op::Step),
            any::<u8>().prop_map(Op::Abort),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn block_manager_never_leaks_or_double_allocates(
            ops in prop::collection::vec(op(), 1..120),
            num_blocks in 6usize..40,
            window in prop::option::of(1usize..24),
        ) {
            let mut cfg = SchedulerConfig::new(512, 4, num_blocks);
            cfg.max_num_batched_tokens = 64;
            cfg.sliding_window = window;
            let mut s = Scheduler::new(cfg);
            let mut next_id = 0u64;
            let mut live: Vec<RequestId> = Vec::new();
            for op in ops {
                match op {
                    Op::Add { prefix, len, max_tokens } => {
                        let prompt: Vec<u32> = (0..len as u32).map(|t| if t < 24 { prefix as u32 * 100 + t } else { t * 7 + next_id as u32 }).collect();
                        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens as u32) };
                        if s.add_request(Request::new(RequestId(next_id), prompt, params, 0, 0)).is_ok() {
                            live.push(RequestId(next_id));
                        }
                        next_id += 1;
                    }
                    Op::Step => {
                        let out = s.schedule();
                        // No block may appear twice in one table, and two live tables
                        // share a block only if it holds a cached prefix.
                        // (Blocks a window has left are no longer the request's: the pool
                        // may give them back to it for a later position.)
                        for r in &out.scheduled {
                            let mut seen = std::collections::HashSet::new();
                            let released = s.kv_cache_manager().num_released_blocks(r.id);
                            prop_assert!(r.block_ids[released..].iter().all(|b| seen.insert(*b)));
                        }
                        let sampled = out.scheduled.iter().filter(|r| r.samples)
                            .map(|r| SampledToken { token_id: (r.num_computed_tokens as u32 % 17) + 3, logprobs: None })
                            .collect();
                        for o in s.update_from_output(&out, sampled) {
                            if o.finish_reason.is_some() { live.retain(|&id| id != o.id); }
                        }
                    }
                    Op::Abort(k) => {
                        if !live.is_empty() {
                            let id = live.remove(k as usize % live.len());
                            prop_assert!(s.abort(id).is_some());
                        }
                    }
                }
                s.check_invariants();
            }
            for id in live {
                s.abort(id);
            }
            s.check_invariants();
            prop_assert_eq!(s.kv_cache_manager().num_used_blocks(), 0);
        }
    }
}
