//! Speculative decoding's integer side: the n-gram (prompt lookup)
//! proposer, how many tokens a request may propose in a step, greedy
//! acceptance of a verified run, and the acceptance counters behind
//! vLLM's `vllm:spec_decode_*` metrics.
//!
//! A proposal costs nothing to make and little to verify at batch 1: the
//! k proposed tokens ride in the same forward pass as the request's real
//! next position (vLLM v1's `scheduled_spec_decode_tokens`), and the
//! sampler draws the target's token at each of the k + 1 positions as if
//! the proposals before it were real. The longest run of proposals equal
//! to those draws is accepted, plus the draw after it (the bonus token).
//! Because every draw is the target's own (seeded per position, see the
//! sampler), the output is the non-speculative output token for token, for
//! greedy and sampling alike; for a point-mass proposal x this is rejection
//! sampling itself: x is kept with probability p(x), and on a rejection the
//! draw is distributed as p with x removed and renormalised.

use common::{SamplingParams, Speculative};

use crate::request::Request;

/// Where proposals come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup, here in the scheduler (`propose_ngram`).
    #[default]
    Ngram,
    /// The worker's draft model: the scheduler reserves the k slots and
    /// the model runner fills in the tokens before the step runs
    /// (`ScheduledRequest::draft_pending`).
    Draft,
}

/// Speculation the worker applies to requests that do not choose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Whether requests speculate unless they turn it off (`--speculative-method`).
    pub enabled_by_default: bool,
    /// The method of requests that do not choose one.
    pub default_method: SpecMethod,
    /// Whether a draft model is loaded: requests may only choose `Draft` then.
    pub has_draft_model: bool,
    /// Tokens proposed per step (vLLM's `num_speculative_tokens`).
    pub num_speculative_tokens: usize,
    /// Shortest and longest suffix matched against earlier tokens (vLLM's
    /// `prompt_lookup_min` / `prompt_lookup_max`).
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// Adaptive cut-off: a step whose running requests times (k + 1)
    /// exceed this many tokens proposes nothing. Past it the forward pass
    /// is compute-bound, so verifying tokens that may be rejected costs
    /// real time instead of riding on the weights' memory traffic.
    pub max_batch_tokens: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            enabled_by_default: false,
            default_method: SpecMethod::Ngram,
            has_draft_model: false,
            num_speculative_tokens: 4,
            prompt_lookup_min: 2,
            prompt_lookup_max: 5,
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
        }
    }
}

/// Speculation stops once a step would verify more tokens than this (see
/// `SpeculativeConfig::max_batch_tokens`; BENCHMARKS.md has the measurement).
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 24;

impl SpeculativeConfig {
    /// Whether a step whose running requests have these parameters
    /// proposes: only while verifying every proposal stays within
    /// `max_batch_tokens` (past it rejected guesses cost real time).
    pub fn speculates<'a>(&self, running: impl Iterator<Item = &'a SamplingParams>) -> bool {
        let (mut tokens, mut any) = (0, false);
        for params in running {
            let k = self.tokens_for(params);
            any |= k > 0;
            tokens += 1 + k;
        }
        any && tokens <= self.max_batch_tokens
    }

    /// The proposal of a decoding request, at most `room` tokens, and never
    /// more than it can use: the token after the last proposal is always
    /// drawn, and no position may reach `max_model_len`. A draft-model
    /// proposal is `k` placeholders ([`DRAFT_PENDING`]) for the runner to
    /// fill.
    pub fn proposal(&self, req: &Request, room: usize, max_model_len: usize) -> Proposal {
        let Some((method, k)) = self.plan_for(&req.params) else { return Proposal::default() };
        let left = (req.params.max_tokens as usize).saturating_sub(req.num_output_tokens() + 1);
        let k = k.min(room).min(left).min(max_model_len.saturating_sub(req.num_tokens() + 1));
        match method {
            SpecMethod::Ngram => Proposal {
                tokens: propose_ngram(&req.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k).to_vec(),
                draft_pending: false,
            },
            SpecMethod::Draft => Proposal { tokens: vec![DRAFT_PENDING; k], draft_pending: k > 0 },
        }
    }

    /// How many tokens a request with `params` proposes per step when
    /// speculation is on for the step (0: it does not speculate).
    pub fn tokens_for(&self, params: &SamplingParams) -> usize {
        self.plan_for(params).map_or(0, |(_, k)| k)
    }

    /// The method and k of a request with `params`; `None`: it does not speculate.
    pub fn plan_for(&self, params: &SamplingParams) -> Option<(SpecMethod, usize)> {
        // Grammar masks are computed per position from the accepted
        // tokens; a constrained request decodes one token at a time.
        if params.structured_output.is_some() {
            return None;
        }
        let k = |own: Option<u8>| own.map_or(self.num_speculative_tokens, usize::from);
        let plan = match params.speculative {
            Some(Speculative::Off) => return None,
            Some(Speculative::Ngram { num_speculative_tokens }) => (SpecMethod::Ngram, k(num_speculative_tokens)),
            Some(Speculative::Draft { num_speculative_tokens }) => (SpecMethod::Draft, k(num_speculative_tokens)),
            None if self.enabled_by_default => (self.default_method, self.num_speculative_tokens),
            None => return None,
        };
        // The engine refuses `Draft` requests on a worker without a draft model.
        (plan.0 != SpecMethod::Draft || self.has_draft_model).then_some(plan)
    }
}

/// What `ScheduledRequest::spec_token_ids` holds until the draft model has
/// proposed (never a real token id: vocabularies are far smaller).
pub const DRAFT_PENDING: u32 = u32::MAX;

/// A request's proposal for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The tokens are [`DRAFT_PENDING`] placeholders for the draft model.
    pub draft_pending: bool,
}

/// vLLM's n-gram proposer: the longest suffix of `tokens` of length in
/// `[min_n, max_n]` that also occurs earlier; the up to `k` tokens that
/// followed its earliest occurrence. Empty if no such suffix exists.
pub fn propose_ngram(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 || min_n == 0 || len < min_n + 1 {
        return &[];
    }
    for n in (min_n..=max_n.min(len - 1)).rev() {
        let suffix = &tokens[len - n..];
        // An occurrence must end before the last token, so something follows it.
        if let Some(start) = (0..len - n).find(|&i| &tokens[i..i + n] == suffix) {
            let from = start + n;
            return &tokens[from..(from + k).min(len)];
        }
    }
    &[]
}

/// How many of `proposed` the target's own draws confirm: `drawn[i]` is
/// the token the target chose at the i-th verified position (given the
/// proposals before it), so proposals are kept while they equal the
/// draws. The tokens to append are `drawn[..=accepted]`.
pub fn num_accepted(proposed: &[u32], drawn: &[u32]) -> usize {
    proposed.iter().zip(drawn).take_while(|(p, d)| p == d).count()
}

/// Whether `kept` is what a verifier keeps of its draws for `proposed`:
/// the draws that equal their proposals, then the one after them (the
/// bonus token, or the target's own choice where it disagreed). A
/// pipeline's first stage checks its last stage's answer with it.
pub fn is_verified_run(proposed: &[u32], kept: &[u32]) -> bool {
    let Some((_, confirmed)) = kept.split_last() else { return false };
    confirmed.len() <= proposed.len() && num_accepted(proposed, kept) == confirmed.len()
}

/// Cumulative counters, as vLLM's `SpecDecodingStats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecDecodingStats {
    /// Steps in which a request verified a proposal.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    /// Proposed tokens accepted (the bonus token is not counted).
    pub num_accepted_tokens: u64,
    /// `accepted_per_pos[i]`: proposals whose i-th token was accepted.
    pub accepted_per_pos: Vec<u64>,
}

impl SpecDecodingStats {
    pub fn observe(&mut self, num_proposed: usize, num_accepted: usize) {
        if num_proposed == 0 {
            return;
        }
        self.num_drafts += 1;
        self.num_draft_tokens += num_proposed as u64;
        self.num_accepted_tokens += num_accepted as u64;
        if self.accepted_per_pos.len() < num_proposed {
            self.accepted_per_pos.resize(num_proposed, 0);
        }
        for slot in &mut self.accepted_per_pos[..num_accepted] {
            *slot += 1;
        }
    }

    /// What was counted after `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &Self) -> Self {
        let pos = |i: usize| self.accepted_per_pos[i] - earlier.accepted_per_pos.get(i).copied().unwrap_or(0);
        Self {
            num_drafts: self.num_drafts - earlier.num_drafts,
            num_draft_tokens: self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens: self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_pos: (0..self.accepted_per_pos.len()).map(pos).collect(),
        }
    }

    /// Accepted over proposed tokens (0 before any proposal).
    pub fn acceptance_rate(&self) -> f64 {
        if self.num_draft_tokens == 0 { 0.0 } else { self.num_accepted_tokens as f64 / self.num_draft_tokens as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_takes_the_longest_suffix_at_its_earliest_occurrence() {
        // vLLM's docstring example: [4,2,3] never occurred, [2,3] did.
        assert_eq!(propose_ngram(&[1, 2, 3, 4, 2, 3], 2, 3, 4), &[4, 2, 3]);
        // The longer match wins over a shorter, earlier one.
        assert_eq!(propose_ngram(&[7, 3, 9, 1, 2, 3, 5, 6, 1, 2, 3], 1, 3, 2), &[5, 6]);
        // Of equal matches the earliest: after [1,2] came 8 first, then 9.
        assert_eq!(propose_ngram(&[1, 2, 8, 1, 2, 9, 1, 2], 2, 2, 1), &[8]);
        // A repetition loop proposes its own continuation.
        assert_eq!(propose_ngram(&[5, 6, 7, 5, 6, 7, 5, 6], 1, 3, 4), &[7, 5, 6]);
        assert_eq!(propose_ngram(&[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], 1, 3, 4), &[6, 7, 5, 6]);
    }

    #[test]
    fn ngram_proposes_nothing_without_a_match() {
        assert!(propose_ngram(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose_ngram(&[1, 2, 1], 2, 3, 4).is_empty(), "no earlier [2, 1]");
        assert!(propose_ngram(&[1, 1], 1, 3, 0).is_empty(), "k = 0");
        assert!(propose_ngram(&[], 1, 3, 4).is_empty());
        // The suffix itself is no match: [2,1] must occur earlier.
        assert!(propose_ngram(&[3, 2, 1], 2, 2, 4).is_empty());
    }

    #[test]
    fn acceptance_keeps_the_run_that_equals_the_draws() {
        assert_eq!(num_accepted(&[4, 5, 6], &[4, 5, 9, 1]), 2);
        assert_eq!(num_accepted(&[4, 5, 6], &[4, 5, 6, 1]), 3, "all accepted, the fourth draw is the bonus");
        assert_eq!(num_accepted(&[4, 5, 6], &[3, 5, 6, 1]), 0);
        assert_eq!(num_accepted(&[], &[3]), 0);
    }

    #[test]
    fn stats_count_per_position() {
        let mut s = SpecDecodingStats::default();
        s.observe(4, 2);
        s.observe(3, 3);
        s.observe(0, 0);
        assert_eq!((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens), (2, 7, 5));
        assert_eq!(s.accepted_per_pos, [2, 2, 1, 0]);
        assert!((s.acceptance_rate() - 5.0 / 7.0).abs() < 1e-12);
        let before = s.clone();
        s.observe(2, 1);
        let since = s.since(&before);
        assert_eq!((since.num_drafts, since.num_draft_tokens, since.num_accepted_tokens), (1, 2, 1));
        assert_eq!(since.accepted_per_pos, [1, 0, 0, 0]);
    }

    #[test]
    fn requests_choose_or_follow_the_worker() {
        let on = SpeculativeConfig { enabled_by_default: true, ..SpeculativeConfig::default() };
        let off = SpeculativeConfig::default();
        let plain = SamplingParams::greedy(8);
        assert_eq!((on.tokens_for(&plain), off.tokens_for(&plain)), (4, 0));
        let turned_off = SamplingParams { speculative: Some(Speculative::Off), ..plain.clone() };
        assert_eq!(on.tokens_for(&turned_off), 0);
        let own_k = SamplingParams {
            speculative: Some(Speculative::Ngram { num_speculative_tokens: Some(7) }),
            ..plain.clone()
        };
        assert_eq!(off.tokens_for(&own_k), 7);
        let grammar = SamplingParams { structured_output: Some(common::StructuredOutput::JsonObject), ..plain.clone() };
        assert_eq!(on.tokens_for(&grammar), 0);
        // A draft request is planned only where a draft model is loaded.
        let draft = SamplingParams { speculative: Some(Speculative::Draft { num_speculative_tokens: None }), ..plain };
        assert_eq!(off.plan_for(&draft), None);
        let with_draft = SpeculativeConfig { has_draft_model: true, ..SpeculativeConfig::default() };
        assert_eq!(with_draft.plan_for(&draft), Some((SpecMethod::Draft, 4)));
        let default_draft = SpeculativeConfig { default_method: SpecMethod::Draft, ..on };
        assert_eq!(default_draft.plan_for(&SamplingParams::greedy(8)), None, "no draft model loaded");
    }
}
