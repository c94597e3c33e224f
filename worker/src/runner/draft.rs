//! Draft-model proposals (`--speculative-method draft`): a small model with
//! the target's vocabulary proposes k tokens, greedily, for each request the
//! scheduler lets speculate; the target verifies them in its own step (see
//! `engine_core::spec`).
//!
//! The draft's paged KV cache mirrors the target's: its own block pools for
//! its own layers, indexed by the target's block ids. The scheduler
//! allocates every slot a proposal needs (positions up to the last
//! proposal) before the draft runs, so the draft writes into blocks the
//! request owns, and whatever frees or reuses a block for the target does
//! the same for the draft. Per request the runner remembers how far the
//! draft's KV is computed from real tokens, and the guesses it computed
//! after that: the next round keeps the guesses the target accepted and
//! recomputes from the first one it did not.
//!
//! A request that starts drafting computes its whole prompt through the
//! draft, prefix-cache hits included: a cached block was filled by the
//! target, and maybe never by the draft. Requests that share such a block
//! write the same values into it; two of them never write the same slot in
//! one pass (the kernels refuse that), so such requests go in separate
//! passes.
//!
//! Why greedy: a point-mass proposal is verified by the target's own seeded
//! draw (accepted exactly when the draw equals it), so the output is the
//! non-speculative output token for token, for greedy and seeded sampling
//! alike, across preemption and re-dispatch. Rejection sampling against
//! the draft's full distribution accepts more often at high temperature,
//! but its accept/reject coins would make a seeded output depend on what
//! was proposed.

use std::collections::{HashMap, HashSet};

use candle_core::{Device, Tensor};
use common::RequestId;
use engine_core::{DRAFT_PENDING, Request, SchedulerOutput};
use kernels::AttentionMetadata;

use crate::error::Result;
use crate::models::CausalLm;
use crate::runner::kv_cache::LayerKvCache;

pub struct DraftRunner {
    model: CausalLm,
    kv_caches: Vec<LayerKvCache>,
    block_size: usize,
    device: Device,
    progress: HashMap<RequestId, DraftProgress>,
}

/// How far one request's draft KV is computed.
#[derive(Clone, Debug, Default)]
struct DraftProgress {
    /// Positions `0..computed` hold the KV of the request's real tokens.
    computed: usize,
    /// The guesses whose KV sits at positions `computed..`: real as far as
    /// the target accepted them.
    guessed: Vec<u32>,
}

/// One request's part of a draft pass.
struct Job<'a> {
    /// Index in the step's `scheduled`.
    sched: usize,
    id: RequestId,
    /// The request's tokens (borrowed: no copy per step).
    known: &'a [u32],
    /// The guesses made this round, at the positions after `known`.
    guesses: Vec<u32>,
    /// The first position this round's next pass computes.
    start: usize,
    /// Proposals wanted.
    k: usize,
}

impl Job<'_> {
    /// Tokens in the draft's context after this round's guesses so far.
    fn len(&self) -> usize {
        self.known.len() + self.guesses.len()
    }

    fn token(&self, pos: usize) -> u32 {
        self.known.get(pos).copied().unwrap_or_else(|| self.guesses[pos - self.known.len()])
    }
}

impl DraftRunner {
    pub fn new(model: CausalLm, kv_caches: Vec<LayerKvCache>, block_size: usize, device: Device) -> Self {
        Self { model, kv_caches, block_size, device, progress: HashMap::new() }
    }

    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// Bytes of the draft's KV block pools.
    pub fn kv_cache_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        self.kv_caches.iter().map(|c| bytes(&c.k) + bytes(&c.v)).sum()
    }

    /// Allocates the draft's pools anew with `num_blocks` blocks, as the
    /// target's were (a pipeline runs with its stages' least count); only
    /// while no request runs.
    pub fn reallocate_kv(&mut self, num_blocks: usize, format: kernels::KvCacheDtype) -> Result<()> {
        self.progress.clear();
        self.kv_caches.clear(); // before allocating the new ones
        self.kv_caches =
            crate::runner::kv_cache::allocate(self.model.config(), num_blocks, self.block_size, format, &self.device)?;
        Ok(())
    }

    /// Drops what is known of `id`'s draft KV: it finished, or lost its
    /// blocks (preemption), so its next round starts from position 0.
    pub fn forget(&mut self, id: RequestId) {
        self.progress.remove(&id);
    }

    /// Fills in the proposals of every request of `step` whose
    /// `spec_token_ids` wait for the draft model: k greedy draft passes,
    /// all such requests batched in each.
    pub fn propose<'a>(
        &mut self,
        step: &mut SchedulerOutput,
        request: impl Fn(RequestId) -> &'a Request,
    ) -> Result<()> {
        let mut jobs: Vec<Job> = Vec::new();
        for (i, sched) in step.scheduled.iter().enumerate().filter(|(_, s)| s.draft_pending) {
            let req = request(sched.id);
            let known = req.token_ids.len();
            let progress = self.progress.entry(sched.id).or_default();
            // Guesses the target accepted are real tokens now.
            let mut computed = progress.computed.min(known);
            for &guess in &progress.guessed {
                if computed < known && req.token_ids[computed] == guess {
                    computed += 1;
                } else {
                    break;
                }
            }
            // The last real token always runs: its logits give the first guess.
            let start = computed.min(known - 1);
            jobs.push(Job {
                sched: i,
                id: sched.id,
                known: &req.token_ids,
                guesses: Vec::with_capacity(sched.spec_token_ids.len()),
                start,
                k: sched.spec_token_ids.len(),
            });
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let rounds = jobs.iter().map(|j| j.k).max().unwrap_or(0);
        for round in 0..rounds {
            let active: Vec<usize> = (0..jobs.len()).filter(|&j| jobs[j].k > round).collect();
            for pass in self.disjoint_passes(step, &jobs, &active) {
                let guesses = self.pass(step, &jobs, &pass)?;
                for (&j, guess) in pass.iter().zip(guesses) {
                    let job = &mut jobs[j];
                    job.guesses.push(guess);
                    // The next pass computes only the new guess.
                    job.start = job.len() - 1;
                }
            }
        }
        for job in jobs {
            let guesses = &job.guesses;
            let sched = &mut step.scheduled[job.sched];
            sched.spec_token_ids.copy_from_slice(guesses);
            sched.draft_pending = false;
            debug_assert!(!sched.spec_token_ids.contains(&DRAFT_PENDING));
            // KV now holds the real tokens and every guess but the last.
            let progress = self.progress.entry(job.id).or_default();
            progress.computed = job.known.len();
            progress.guessed = guesses[..guesses.len() - 1].to_vec();
        }
        Ok(())
    }

    /// `active` split into groups whose jobs write no slot in common (one
    /// group unless requests recompute a shared prefix block together).
    fn disjoint_passes(&self, step: &SchedulerOutput, jobs: &[Job], active: &[usize]) -> Vec<Vec<usize>> {
        let bs = self.block_size;
        let mut passes: Vec<(HashSet<u32>, Vec<usize>)> = Vec::new();
        for &j in active {
            let job = &jobs[j];
            let blocks = &step.scheduled[job.sched].block_ids;
            let slots: Vec<u32> =
                (job.start..job.len()).map(|pos| blocks[pos / bs].0 * bs as u32 + (pos % bs) as u32).collect();
            match passes.iter_mut().find(|(taken, _)| slots.iter().all(|s| !taken.contains(s))) {
                Some((taken, members)) => {
                    taken.extend(slots);
                    members.push(j);
                }
                None => passes.push((slots.into_iter().collect(), vec![j])),
            }
        }
        passes.into_iter().map(|(_, members)| members).collect()
    }

    /// One batched draft forward over `active` jobs' tokens from their
    /// `start`; returns each job's greedy next token.
    fn pass(&mut self, step: &SchedulerOutput, jobs: &[Job], active: &[usize]) -> Result<Vec<u32>> {
        let bs = self.block_size;
        let mut meta = AttentionMetadata {
            query_start_loc: vec![0],
            block_size: bs,
            sliding_window: self.model.config().uniform_window(),
            ..AttentionMetadata::default()
        };
        let (mut input_ids, mut positions, mut last_rows) = (Vec::new(), Vec::new(), Vec::new());
        for &j in active {
            let job = &jobs[j];
            let blocks = &step.scheduled[job.sched].block_ids;
            for pos in job.start..job.len() {
                input_ids.push(job.token(pos));
                positions.push(pos as u32);
                meta.slot_mapping.push(blocks[pos / bs].0 * bs as u32 + (pos % bs) as u32);
            }
            meta.query_start_loc.push(input_ids.len() as u32);
            meta.context_lens.push(job.len() as u32);
            meta.block_tables.push(blocks.iter().map(|b| b.0).collect());
            last_rows.push(input_ids.len() as u32 - 1);
        }
        let t = input_ids.len();
        let input_ids = Tensor::from_slice(&input_ids, t, &self.device)?;
        let positions = Tensor::from_slice(&positions, t, &self.device)?;
        let rows = Tensor::from_slice(&last_rows, last_rows.len(), &self.device)?;
        // [active, vocab]
        let logits = self.model.forward(&input_ids, &positions, &self.kv_caches, &meta, &rows)?;
        let guesses = logits.argmax_keepdim(candle_core::D::Minus1)?.flatten_all()?.to_vec1::<u32>()?;
        Ok(guesses)
    }
}
