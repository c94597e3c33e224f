//! The engine: `step()` = schedule -> run the model -> sample -> update
//! (nano-vllm's loop). A synchronous library API with no I/O; the service
//! shell runs it on its own thread and talks to it through channels.
//! On the first stage of a pipeline a step's hidden states go down the
//! pipeline instead (`pipelined`).

mod loading;
mod logprobs;
mod on_device;
mod pipelined;
mod plan;
mod tier;

use std::borrow::Cow;

use candle_core::{DType, Device};
use common::pipeline::LayerRange;
use common::{KvEventRecord, RequestId, SamplingParams};
use kernels::KvCacheDtype;

use crate::error::{Result, WorkerError};
use crate::models::{CausalLm, ModelFiles, Quantization};
use crate::profile::{self, Section};

use crate::runner::device::PlanTarget;
use crate::runner::draft::DraftRunner;
use crate::runner::grammar::{Grammars, RequestGrammar, Vocabulary};
use crate::runner::kv_cache::{self, KvBudget, stage_kv_config};
pub use crate::runner::logprobs::LogprobsMode;
use crate::runner::model_runner::ModelRunner;
use crate::runner::sampler::{self, SamplingRow};
use engine_core::{
    Request, RequestOutput, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats,
    SchedulingPolicy, SpecMethod, SpeculativeConfig,
};

/// Most logits a step keeps for prompt logprobs (128 MiB of f32): 1,000
/// rows of a 32k vocabulary, 220 of a 152k one.
pub(crate) const MAX_PROMPT_LOGPROB_LOGITS: usize = 32 << 20;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub device: Device,
    pub dtype: DType,
    pub block_size: usize,
    pub kv_budget: KvBudget,
    /// Overrides `kv_budget` with an exact block count (tests use it to force preemption).
    pub num_blocks: Option<usize>,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// Defaults to the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    pub logprobs_mode: LogprobsMode,
    /// Quantize linear weights at load time to a block format (CPU only).
    pub quantization: Option<Quantization>,
    /// Where tokens are drawn: `None` means on the device for GPUs (only ids
    /// come back) and on the host for the CPU, where the logits already are.
    pub device_sampling: Option<bool>,
    /// The decoder layers this engine holds: all (`None`), or the first
    /// stage of a pipeline (`start == 0`; see `attach_next_stage`).
    pub layers: Option<LayerRange>,
    /// Speculative decoding (proposals verified in the step's pass).
    pub speculative: SpeculativeConfig,
    /// The draft model of `--speculative-method draft` (the target's vocabulary).
    pub draft_model: Option<ModelFiles>,
    /// How the KV cache stores values; `None` is auto (the activations' dtype).
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// The step as one plan of our GPU kernels (`--device metal-emulated`)
    /// instead of candle's ops on `device`.
    pub plan: Option<PlanTarget>,
    /// The prefix cache's second tier (`--kv-offload-bytes`, `--kv-offload-dir`).
    pub kv_tier: crate::tier::TierConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
            block_size: kv_cache::DEFAULT_BLOCK_SIZE,
            kv_budget: KvBudget::FractionOfAvailable(0.25),
            num_blocks: None,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: None,
            enable_prefix_caching: true,
            policy: SchedulingPolicy::Fcfs,
            logprobs_mode: LogprobsMode::RawLogprobs,
            quantization: None,
            device_sampling: None,
            layers: None,
            speculative: SpeculativeConfig::default(),
            draft_model: None,
            kv_cache_dtype: None,
            plan: None,
            kv_tier: crate::tier::TierConfig::default(),
        }
    }
}

pub struct Engine {
    scheduler: Scheduler,
    runner: ModelRunner,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    logprobs_mode: LogprobsMode,
    /// Where a step's tokens are drawn, chosen once.
    backend: StepBackend,
    /// Structured outputs: each constrained request's matcher.
    grammars: Grammars,
    last_step: StepInfo,
    /// The draft model, when one proposes (`--speculative-method draft`).
    draft: Option<DraftRunner>,
    /// The second tier's bytes, when one is configured.
    tier: Option<crate::tier::TierStore>,
    /// The KV blocks' identity (`tier::Identity`'s fingerprint).
    kv_identity: u64,
}

/// How a step turns the scheduler's output into sampled tokens. Chosen once:
/// `Host` or `Device` when the engine is built, `Pipelined` when a next
/// stage attaches. One `match` in [`Engine::step`] picks the path.
enum StepBackend {
    /// The forward pass's logits come to the host and the host sampler
    /// draws (the CPU, where the logits already are).
    Host,
    /// The device samples and only token ids come back (GPUs).
    Device,
    /// The first stage of a pipeline: hidden states go to the next stage
    /// and the last stage samples. Holds the link and the steps in flight.
    Pipelined(Box<pipelined::FirstStage>),
}

impl StepBackend {
    fn local(device_sampling: bool) -> Self {
        if device_sampling { Self::Device } else { Self::Host }
    }
}

/// The requests one step computed, and how many tokens in all.
#[derive(Clone, Debug, Default)]
pub struct StepInfo {
    pub scheduled: Vec<RequestId>,
    pub num_batched_tokens: usize,
    /// Rows a step plan's GPU sampler drew (0: the host sampler drew).
    pub drawn_on_plan: usize,
}

impl Engine {
    /// Loads the model and allocates the KV cache.
    pub fn new(files: &ModelFiles, config: EngineConfig) -> Result<Self> {
        let layers = config.layers.unwrap_or(LayerRange::full(files.config.num_layers));
        if !layers.is_first() {
            return Err(WorkerError::Unsupported(format!(
                "an engine runs the first stage; layers {layers} are a later stage's"
            )));
        }
        // A step plan uploads the weights itself: no candle model beside it.
        let model = match config.plan {
            Some(_) => None,
            None => {
                let mut model = crate::models::loader::load_stage(files, config.dtype, &config.device, layers)?;
                loading::prepare_weights(&mut model, &config)?;
                Some(model)
            }
        };
        let cfg = model.as_ref().map_or_else(|| files.config.clone(), |m| m.config().clone());
        // The plan's activations are f32 (its KV cache f32 or f16).
        let act = model.as_ref().map_or(DType::F32, CausalLm::activation_dtype);
        let kv_format = kv_cache::resolve_format(config.kv_cache_dtype, act, &config.device)?;
        let max_model_len =
            config.max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let max_useful = 2 * config.max_num_seqs * max_model_len.div_ceil(config.block_size);
        // The cache holds this stage's layers only; a plan pads small head
        // dims to its attention kernels' (their rows take that room).
        let mut kv_cfg = stage_kv_config(&cfg, layers);
        if config.plan.is_some() {
            kv_cfg.head_dim = kernels::metal::step::padded_head_dim(cfg.head_dim).unwrap_or(cfg.head_dim);
        }
        let draft_model = match &config.draft_model {
            Some(draft_files) => Some(loading::load_draft(draft_files, &config, files, max_model_len)?),
            None => None,
        };
        // The draft's pools use the target's cache format.
        let kv_budget = crate::runner::plan::kv_budget(config.plan, config.kv_budget);
        let kv_budget = match &draft_model {
            Some(draft) => loading::target_share(kv_budget, &kv_cfg, kv_format, draft, config.block_size),
            None => kv_budget,
        };
        let budget = || kv_cache::num_blocks_for_budget(&kv_cfg, config.block_size, kv_format, kv_budget, max_useful);
        let num_blocks = config.num_blocks.map_or_else(budget, Ok)?;
        let plan = match config.plan {
            Some(target) => {
                Some(loading::build_plan(target, files, &config, kv_format, num_blocks, max_model_len, layers)?)
            }
            None => None,
        };
        let draft = match draft_model {
            Some(model) => {
                let pools =
                    kv_cache::allocate(model.config(), num_blocks, config.block_size, kv_format, &config.device)?;
                Some(DraftRunner::new(model, pools, config.block_size, config.device.clone()))
            }
            None => None,
        };
        let speculative = SpeculativeConfig { has_draft_model: draft.is_some(), ..config.speculative.clone() };
        if speculative.enabled_by_default && speculative.default_method == SpecMethod::Draft && draft.is_none() {
            return Err(WorkerError::Unsupported("--speculative-method draft needs a --draft-model".into()));
        }
        let runner = match (plan, model) {
            (Some(plan), _) => {
                ModelRunner::with_plan(plan, (cfg.clone(), layers), config.block_size, config.device.clone(), kv_format)
            }
            (None, Some(model)) => {
                let caches = kv_cache::allocate(&kv_cfg, num_blocks, config.block_size, kv_format, &config.device)?;
                ModelRunner::new(model, caches, config.block_size, config.device.clone(), kv_format)
            }
            (None, None) => return Err(WorkerError::Unsupported("no model was loaded for the step".into())),
        };
        let identity = tier::identity(files, &config, runner.kv_block_bytes())?;
        let tier = tier::open(&identity, &config, layers.is_last(), runner.kv_block_bytes())?;
        let tier_blocks = tier.as_ref().map_or(0, |(_, blocks, _)| *blocks);
        let scheduler = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs: config.max_num_seqs,
            max_model_len,
            block_size: config.block_size,
            num_blocks,
            enable_prefix_caching: config.enable_prefix_caching,
            policy: config.policy,
            eos_token_ids: files.eos_token_ids.clone(),
            max_prompt_logprob_rows: (MAX_PROMPT_LOGPROB_LOGITS / cfg.vocab_size.max(1)).max(1),
            // On a pipeline too: its last stage verifies (`pipelined`).
            speculative,
            // A draft model writes its own KV into the same block tables and
            // may catch up from positions the window has left: it keeps them.
            sliding_window: if draft.is_some() { None } else { cfg.uniform_window() },
            // One step in flight until a next stage is attached.
            micro_batches: 1,
            tier_blocks,
        });
        let vocabulary = match &files.tokenizer_json {
            Some(path) => Vocabulary::TokenizerJson(path.clone()),
            None => Vocabulary::Missing(format!(
                "structured outputs need the model's tokenizer.json for its vocabulary, and {} has none",
                files.name
            )),
        };
        let (tier, found) = tier.map_or((None, Vec::new()), |(store, _, found)| (Some(store), found));
        let mut engine = Self {
            scheduler,
            runner,
            vocab_size: cfg.vocab_size,
            eos_token_ids: files.eos_token_ids.clone(),
            logprobs_mode: config.logprobs_mode,
            // The plan brings logits back and the host samples (for now).
            backend: StepBackend::local(
                config.plan.is_none() && config.device_sampling.unwrap_or(!config.device.is_cpu()),
            ),
            grammars: Grammars::new(vocabulary, &files.eos_token_ids, cfg.vocab_size),
            last_step: StepInfo::default(),
            draft,
            tier,
            kv_identity: identity.fingerprint,
        };
        engine.adopt_tier_blocks(found);
        Ok(engine)
    }

    /// Queues a request. Fails (and queues nothing) on an empty or too long
    /// prompt, a duplicate id, invalid parameters, or a token id outside the vocabulary.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        priority: i32,
    ) -> Result<()> {
        self.resume_request(id, prompt, &[], params, priority)
    }

    /// Queues a request that already generated `output` elsewhere (a lost
    /// worker's): it continues after those tokens as if it had made them
    /// here. Penalties and `min_tokens` count them, a seeded draw goes on at
    /// their position, and the prefix cache serves prompt and output alike.
    pub fn resume_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        output: &[u32],
        params: SamplingParams,
        priority: i32,
    ) -> Result<()> {
        let grammar = match &params.structured_output {
            Some(constraint) => Some(
                self.grammars
                    .prepare(constraint, output)
                    .map_err(|e| WorkerError::InvalidRequest { id, message: e.to_string() })?,
            ),
            None => None,
        };
        self.resume_request_with_grammar(id, prompt, output, params, priority, grammar)
    }

    /// [`resume_request`](Self::resume_request) with the request's grammar
    /// compiled already (off the engine's thread, with
    /// [`grammar_compiler`](Self::grammar_compiler)); `None` for an
    /// unconstrained request.
    pub fn resume_request_with_grammar(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        output: &[u32],
        params: SamplingParams,
        priority: i32,
        grammar: Option<RequestGrammar>,
    ) -> Result<()> {
        if params.structured_output.is_some() != grammar.is_some() {
            let message = "a constrained request needs its grammar (and only it)".to_string();
            return Err(WorkerError::InvalidRequest { id, message });
        }
        if grammar.is_some() && self.is_pipelined() {
            let message = "structured outputs are not served by pipelines yet (the last stage samples unmasked)";
            return Err(WorkerError::InvalidRequest { id, message: message.to_string() });
        }
        if matches!(params.speculative, Some(common::Speculative::Draft { .. })) && self.draft.is_none() {
            let message = "this worker has no draft model (it runs with --speculative-method draft --draft-model)";
            return Err(WorkerError::InvalidRequest { id, message: message.to_string() });
        }
        if output.len() >= params.max_tokens as usize {
            let message = format!("{} tokens already generated of max_tokens {}", output.len(), params.max_tokens);
            return Err(WorkerError::InvalidRequest { id, message });
        }
        if let Some(bad) = prompt.iter().chain(output).find(|&&t| t as usize >= self.vocab_size) {
            return Err(WorkerError::InvalidRequest {
                id,
                message: format!("token id {bad} is outside the vocabulary (size {})", self.vocab_size),
            });
        }
        let seed = params.seed.unwrap_or_else(random_seed);
        self.scheduler
            .add_request(Request::new(id, prompt, params, priority, seed).with_output(output))
            .map_err(|e| WorkerError::InvalidRequest { id, message: e.to_string() })?;
        if let Some(grammar) = grammar {
            self.grammars.insert(id, grammar);
        }
        Ok(())
    }

    /// What compiles structured-output constraints for this model (built on
    /// first use), to share with threads that compile ahead of
    /// [`resume_request_with_grammar`](Self::resume_request_with_grammar);
    /// `Err` says why this model takes none.
    pub fn grammar_compiler(
        &self,
    ) -> std::result::Result<std::sync::Arc<common::structured::GrammarCompiler>, common::structured::StructuredError>
    {
        self.grammars.compiler().cloned()
    }

    /// Stops a request and frees its blocks now; `None` if it is unknown (or already finished).
    pub fn abort(&mut self, id: RequestId) -> Option<RequestOutput> {
        self.grammars.remove(id);
        if let Some(draft) = &mut self.draft {
            draft.forget(id);
        }
        self.scheduler.abort(id)
    }

    /// Stops every request and frees their blocks; their outputs (finish
    /// reason `Abort`), in id order.
    pub fn abort_all(&mut self) -> Vec<RequestOutput> {
        let outputs = self.scheduler.abort_all();
        for o in &outputs {
            self.grammars.remove(o.id);
            if let Some(draft) = &mut self.draft {
                draft.forget(o.id);
            }
        }
        outputs
    }

    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    pub fn stats(&self) -> SchedulerStats {
        self.scheduler.stats()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Rows the CPU step's reused activation buffers hold (0 before the
    /// first step, and on other devices).
    pub fn activation_workspace_rows(&self) -> usize {
        self.runner.workspace_rows()
    }

    /// Bytes of weights this engine holds (its stage's share on a
    /// pipeline), the draft model's included.
    pub fn resident_weight_bytes(&self) -> usize {
        let draft = self.draft.as_ref().map_or(0, |d| d.model().resident_weight_bytes());
        self.runner.resident_weight_bytes() + draft
    }

    /// Bytes of its KV cache's block pools, the draft model's included.
    pub fn kv_cache_bytes(&self) -> u64 {
        self.runner.kv_cache_bytes() + self.draft.as_ref().map_or(0, DraftRunner::kv_cache_bytes)
    }

    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.runner.kv_cache_dtype()
    }

    /// Bytes of weights a decode step streams (see `CausalLm`).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.runner.weight_bytes_per_token()
    }

    pub fn device(&self) -> &candle_core::Device {
        self.runner.device()
    }

    pub fn model_config(&self) -> &crate::models::ModelConfig {
        self.runner.config()
    }

    pub fn drain_kv_events(&mut self) -> Vec<KvEventRecord> {
        self.scheduler.kv_cache_manager_mut().drain_events()
    }

    /// What the last `step` scheduled (for per-request timing metrics).
    pub fn last_step(&self) -> &StepInfo {
        &self.last_step
    }

    /// The prefix cache's content, for a router that missed events.
    pub fn kv_snapshot(&self) -> (Option<u64>, Vec<(common::BlockHash, Option<common::BlockHash>)>) {
        self.scheduler.kv_cache_manager().kv_snapshot()
    }

    /// One step: computes the scheduled tokens of all running requests in
    /// one forward pass and returns each sampling request's new token.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let device_sampling = match self.backend {
            StepBackend::Pipelined(_) => return self.step_pipelined(),
            StepBackend::Device => true,
            StepBackend::Host => false,
        };
        let sched_timer = profile::scope(Section::Scheduler);
        let step = self.schedule_step()?;
        if step.scheduled.is_empty() {
            return Ok(Vec::new());
        }
        let batch = self.runner.prepare(&step, |id| self.scheduler.request(id).expect("scheduled request exists"));
        drop(sched_timer);
        if device_sampling {
            return self.step_sampling_on_device(&step, &batch);
        }
        let outputs = sampling_rows(&self.scheduler, &step);
        let sampling = (&self.eos_token_ids[..], self.logprobs_mode);
        if let Some(sampled) = plan::sample_on_plan(&mut self.runner, &mut self.grammars, &batch, &outputs, sampling)? {
            drop(outputs);
            self.last_step.drawn_on_plan = sampled.len();
            return Ok(self.finish_step(&step, per_request(&step, sampled), &[]));
        }
        let (logits, masks) = {
            let _t = profile::scope(Section::Forward);
            let runner = &mut self.runner;
            self.grammars.masks_beside(&grammar_rows(&outputs), || runner.execute(&batch))?
        };
        let sampling_timer = profile::scope(Section::Sampling);
        let rows = rows_of(&outputs, &masks, &self.eos_token_ids);
        let (sampling_logits, prompt_logits) = logits.split_at(rows.len() * self.vocab_size);
        let sampled = sampler::sample_batch(sampling_logits, self.vocab_size, &rows, self.logprobs_mode);
        drop(rows);
        drop(outputs);
        drop(sampling_timer);
        Ok(self.finish_step(&step, per_request(&step, sampled), prompt_logits))
    }

    /// The scheduler's next step with the draft's proposals filled in,
    /// recorded as the last step (single worker and first stage alike).
    fn schedule_step(&mut self) -> Result<SchedulerOutput> {
        self.poll_tier(false);
        let mut step = self.scheduler.schedule();
        self.apply_transfers(&step.kv_transfers)?;
        if step.scheduled.is_empty() {
            // Requests waiting on disk loads: wait for one rather than spin.
            self.poll_tier(true);
        }
        self.propose_drafts(&mut step)?;
        self.last_step.scheduled.clear();
        self.last_step.scheduled.extend(step.scheduled.iter().map(|s| s.id));
        self.last_step.num_batched_tokens = step.num_batched_tokens;
        self.last_step.drawn_on_plan = 0;
        Ok(step)
    }

    /// Has the draft model fill in `step`'s pending proposals, after
    /// forgetting the draft KV of the requests it preempted.
    fn propose_drafts(&mut self, step: &mut SchedulerOutput) -> Result<()> {
        let Some(draft) = &mut self.draft else { return Ok(()) };
        for &id in &step.preempted {
            draft.forget(id); // its blocks are gone, the draft's KV with them
        }
        if step.scheduled.iter().any(|s| s.draft_pending) {
            let _t = profile::scope(Section::Forward);
            let scheduler = &self.scheduler;
            draft.propose(step, |id| scheduler.request(id).expect("scheduled request exists"))?;
        }
        Ok(())
    }

    /// The end of every step: the prompt logprobs from their rows of
    /// logits, then the scheduler takes the sampled tokens (each sampling
    /// request's apart: all its rows, or those its verifier kept) and
    /// finishes the requests that stop.
    fn finish_step(
        &mut self,
        step: &SchedulerOutput,
        sampled: Vec<Vec<SampledToken>>,
        prompt_logits: &[f32],
    ) -> Vec<RequestOutput> {
        let prompt_logprobs = {
            let _t = profile::scope(Section::Sampling);
            self.prompt_logprobs(step, prompt_logits)
        };
        let _t = profile::scope(Section::Scheduler);
        let outputs = self.scheduler.update_from_verified(step, sampled);
        for o in outputs.iter().filter(|o| o.finish_reason.is_some()) {
            self.grammars.remove(o.id);
            if let Some(draft) = &mut self.draft {
                draft.forget(o.id);
            }
        }
        self.with_prompt_logprobs(outputs, prompt_logprobs)
    }
}

/// `sampled` (one token per row of sampling logits) split per sampling
/// request, in the step's order.
fn per_request(step: &SchedulerOutput, sampled: Vec<SampledToken>) -> Vec<Vec<SampledToken>> {
    let mut sampled = sampled.into_iter();
    step.scheduled.iter().filter(|s| s.samples).map(|s| sampled.by_ref().take(s.num_sampled_rows()).collect()).collect()
}

/// One entry per row of sampling logits, in the step's order: the request
/// and its output as the sampler sees it at that row. A request verifying
/// proposals has a row per proposal after its first, each seeing the
/// proposals before it as generated, so penalties, `min_tokens` and the
/// seeded draw at that position are exactly those of plain decoding.
fn sampling_rows<'a>(scheduler: &'a Scheduler, step: &'a SchedulerOutput) -> Vec<(&'a Request, Cow<'a, [u32]>)> {
    let mut rows = Vec::with_capacity(step.scheduled.len());
    for s in step.scheduled.iter().filter(|s| s.samples) {
        let req = scheduler.request(s.id).expect("scheduled request exists");
        rows.extend(sampler::verified_outputs(req.output_token_ids(), &s.spec_token_ids).map(|o| (req, o)));
    }
    rows
}

/// Each sampling row's request and output, as the grammars read them: a
/// request verifying proposals has several rows (never a constrained one:
/// it does not speculate).
fn grammar_rows<'a>(outputs: &'a [(&'a Request, Cow<'a, [u32]>)]) -> Vec<(RequestId, &'a [u32])> {
    outputs.iter().map(|(req, output)| (req.id, &output[..])).collect()
}

/// The step's sampling rows, built once from [`sampling_rows`]' outputs and
/// the structured-output masks, for whichever sampler draws.
fn rows_of<'a>(
    outputs: &'a [(&'a Request, Cow<'a, [u32]>)],
    masks: &'a [Option<common::structured::TokenMask>],
    eos_token_ids: &'a [u32],
) -> Vec<SamplingRow<'a>> {
    outputs
        .iter()
        .zip(masks)
        .map(|((req, output), mask)| SamplingRow {
            params: &req.params,
            prompt_token_ids: req.prompt_token_ids(),
            output_token_ids: output,
            num_output_tokens: output.len(),
            seed: req.sampling_seed,
            eos_token_ids,
            allowed: mask.as_ref().map(|m| m.as_slice()),
        })
        .collect()
}

/// A seed for requests that gave none: different per request and per run.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
