//! Turns a scheduler step into one batched forward pass: the new tokens of
//! every scheduled request flattened into one varlen batch (no padding),
//! with positions, slot mapping and block tables for paged attention.
//! Proposed tokens (speculative decoding) are inputs like any other, and
//! each gets a row of logits so the sampler can verify it. Owns
//! the model and the KV block pools; knows nothing of queues or sockets.

use candle_core::{DType, Device, Tensor};
use common::RequestId;
use kernels::metal::step::{Readback, SampleRow, Sampled, StepInput, StepInputs, StepOutput};
use kernels::{AttentionMetadata, KvCacheDtype};

use crate::error::{Result, WorkerError};
use crate::models::llama::{StageInput, StageOutput};
use crate::models::{CausalLm, ModelConfig};
use crate::runner::device_sampler;
use crate::runner::kv_cache::stage_kv_config;
use crate::runner::kv_cache::{self, LayerKvCache};
use crate::runner::logprobs::LogprobsMode;
use crate::runner::plan::StepExecutor;
use crate::runner::sampler::SamplingRow;
use common::SampledToken;
use common::pipeline::LayerRange;
use engine_core::{Request, SchedulerOutput};

pub struct ModelRunner {
    step: Step,
    config: ModelConfig,
    range: LayerRange,
    block_size: usize,
    device: Device,
    kv_format: KvCacheDtype,
}

/// What runs the forward pass.
enum Step {
    /// candle's ops (and the CPU's fused kernels) over these KV pools.
    Candle { model: Box<CausalLm>, kv_caches: Vec<LayerKvCache> },
    /// One plan of our GPU kernels (Metal, or its emulator), holding its
    /// own weights and KV pools: no candle model is loaded beside it.
    Plan(Box<dyn StepExecutor>),
}

/// The flattened inputs of one step, on the host.
#[derive(Debug, Default, PartialEq)]
pub struct BatchInputs {
    pub input_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub meta: AttentionMetadata,
    /// Rows whose logits are sampled: each sampling request's last new
    /// token, then each of its proposed tokens (speculative decoding).
    pub logits_indices: Vec<u32>,
    /// Rows whose logits give prompt logprobs, in the order of the step's
    /// `prompt_logprob_positions`.
    pub prompt_logprob_rows: Vec<u32>,
}

impl ModelRunner {
    pub fn new(
        model: CausalLm,
        kv_caches: Vec<LayerKvCache>,
        block_size: usize,
        device: Device,
        kv_format: KvCacheDtype,
    ) -> Self {
        let (config, range) = (model.config().clone(), model.layer_range());
        Self { step: Step::Candle { model: Box::new(model), kv_caches }, config, range, block_size, device, kv_format }
    }

    /// A runner whose steps run as `plan` (which holds weights and KV pools)
    /// for `range` of the model of `config` (the whole model, or a
    /// pipeline's first stage).
    pub fn with_plan(
        plan: Box<dyn StepExecutor>,
        (config, range): (ModelConfig, LayerRange),
        block_size: usize,
        device: Device,
        kv_format: KvCacheDtype,
    ) -> Self {
        Self { step: Step::Plan(plan), config, range, block_size, device, kv_format }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs the step on the plan and draws every sampled row
    /// (`logits_indices`, one of `params` each) on the GPU; None without a
    /// plan, or where its sampler cannot hold `params`.
    pub fn execute_sampled(&mut self, batch: &BatchInputs, params: &[SampleRow]) -> Option<Result<Vec<Sampled>>> {
        match &mut self.step {
            Step::Plan(plan) if plan.samples(params) => {
                let inputs = plan_inputs(batch, &batch.logits_indices);
                Some(plan.run(&inputs, Readback::Sample(params)).and_then(|out| match out {
                    StepOutput::Sampled(sampled) => Ok(sampled),
                    _ => Err(WorkerError::Unsupported("the plan did not sample".into())),
                }))
            }
            _ => None,
        }
    }

    /// Whether [`execute_sampled`](Self::execute_sampled) would take `params`.
    pub fn samples_on_plan(&self, params: &[SampleRow]) -> bool {
        matches!(&self.step, Step::Plan(plan) if plan.samples(params))
    }

    /// The step plan, when one runs the step.
    pub fn plan_mut(&mut self) -> Option<&mut (dyn StepExecutor + 'static)> {
        match &mut self.step {
            Step::Plan(plan) => Some(plan.as_mut()),
            Step::Candle { .. } => None,
        }
    }

    /// Bytes of one KV block across this runner's layers, K and V: what
    /// the second tier keeps per block.
    pub fn kv_block_bytes(&self) -> usize {
        match &self.step {
            Step::Plan(plan) => plan.kv_block_bytes(),
            Step::Candle { .. } => {
                let cfg = kv_cache::stage_kv_config(&self.config, self.range);
                kv_cache::bytes_per_block(&cfg, self.block_size, self.kv_format) as usize
            }
        }
    }

    /// Appends block `block`'s KV, every layer's K and V, to `out`.
    pub fn read_kv_block(&mut self, block: usize, out: &mut Vec<u8>) -> Result<()> {
        match &mut self.step {
            Step::Plan(plan) => plan.read_kv_block(block, out),
            Step::Candle { kv_caches, .. } => kv_caches.iter().try_for_each(|layer| layer.read_block(block, out)),
        }
    }

    /// Writes a block's KV as [`read_kv_block`](Self::read_kv_block) gave it.
    pub fn write_kv_block(&mut self, block: usize, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.kv_block_bytes() {
            return Err(WorkerError::KvCache(format!(
                "a KV block of {} bytes, where blocks take {}",
                bytes.len(),
                self.kv_block_bytes()
            )));
        }
        match &mut self.step {
            Step::Plan(plan) => plan.write_kv_block(block, bytes),
            Step::Candle { kv_caches, .. } => {
                let per_layer = bytes.len() / kv_caches.len().max(1);
                kv_caches.iter().zip(bytes.chunks_exact(per_layer)).try_for_each(|(l, b)| l.write_block(block, b))
            }
        }
    }

    /// The decoder layers this runner holds.
    pub fn layer_range(&self) -> LayerRange {
        self.range
    }

    /// Rows the CPU step's reused activation buffers hold (0 elsewhere).
    pub fn workspace_rows(&self) -> usize {
        match &self.step {
            Step::Candle { model, .. } => model.workspace_rows(),
            Step::Plan(_) => 0,
        }
    }

    /// Bytes of weights held for the step.
    pub fn resident_weight_bytes(&self) -> usize {
        match &self.step {
            Step::Candle { model, .. } => model.resident_weight_bytes(),
            Step::Plan(plan) => plan.weight_bytes(),
        }
    }

    /// Bytes of weights one decode step reads.
    pub fn weight_bytes_per_token(&self) -> usize {
        match &self.step {
            Step::Candle { model, .. } => model.weight_bytes_per_token(),
            Step::Plan(plan) => plan.weight_bytes(),
        }
    }

    /// How the KV cache stores its values.
    pub fn kv_cache_dtype(&self) -> KvCacheDtype {
        self.kv_format
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Builds the step's flattened batch from the scheduler's decisions.
    pub fn prepare<'a>(&self, step: &SchedulerOutput, request: impl Fn(RequestId) -> &'a Request) -> BatchInputs {
        let bs = self.block_size;
        let mut b = BatchInputs {
            meta: AttentionMetadata {
                query_start_loc: vec![0],
                block_size: bs,
                sliding_window: self.config.uniform_window(),
                ..AttentionMetadata::default()
            },
            ..BatchInputs::default()
        };
        for sched in &step.scheduled {
            let req = request(sched.id);
            let end = sched.num_computed_tokens + sched.num_new_tokens;
            // Positions past the known tokens hold this step's proposals.
            let known = req.token_ids.len();
            for pos in sched.num_computed_tokens..end {
                b.input_ids.push(if pos < known { req.token_ids[pos] } else { sched.spec_token_ids[pos - known] });
                b.positions.push(pos as u32);
                b.meta.slot_mapping.push(sched.block_ids[pos / bs].0 * bs as u32 + (pos % bs) as u32);
            }
            let first_row = b.input_ids.len() - sched.num_new_tokens;
            b.prompt_logprob_rows.extend(
                sched.prompt_logprob_positions.clone().map(|pos| (first_row + pos - sched.num_computed_tokens) as u32),
            );
            b.meta.query_start_loc.push(b.input_ids.len() as u32);
            b.meta.context_lens.push(end as u32);
            b.meta.block_tables.push(sched.block_ids.iter().map(|blk| blk.0).collect());
            // The last real token's row, then one per proposal.
            let rows = sched.num_sampled_rows() as u32;
            b.logits_indices.extend(b.input_ids.len() as u32 - rows..b.input_ids.len() as u32);
        }
        b
    }

    /// Runs the model on a prepared batch; returns the logits of the
    /// sampled rows, then of the prompt-logprob rows, row-major
    /// [logits_indices.len() + prompt_logprob_rows.len(), vocab] in f32.
    pub fn execute(&mut self, batch: &BatchInputs) -> Result<Vec<f32>> {
        if let Step::Plan(plan) = &mut self.step {
            if batch.input_ids.is_empty() {
                return Ok(Vec::new());
            }
            let mut rows = batch.logits_indices.clone();
            rows.extend_from_slice(&batch.prompt_logprob_rows);
            // A step of prompt chunks only fills the KV cache: the plan then
            // skips the final norm and lm_head.
            return match plan.run(&plan_inputs(batch, &rows), Readback::Logits)? {
                StepOutput::Logits(logits) => Ok(logits),
                _ => Err(WorkerError::Unsupported("the plan brought no logits back".into())),
            };
        }
        match self.forward(batch)? {
            Some(logits) => Ok(logits.flatten_all()?.to_vec1::<f32>()?),
            None => Ok(Vec::new()),
        }
    }

    /// Runs the model and keeps the logits on the device, for
    /// [`sample_on_device`](Self::sample_on_device).
    pub fn forward_on_device(&mut self, batch: &BatchInputs) -> Result<Option<Tensor>> {
        self.forward(batch)
    }

    /// Samples on the device from [`forward_on_device`](Self::forward_on_device)'s
    /// logits, one row per sampled sequence: only token ids and requested
    /// logprobs cross to the host, plus the prompt-logprob rows' logits
    /// (row-major, f32) if any.
    pub fn sample_on_device(
        &self,
        logits: Option<Tensor>,
        batch: &BatchInputs,
        rows: &[SamplingRow],
        mode: LogprobsMode,
    ) -> Result<(Vec<SampledToken>, Vec<f32>)> {
        let Some(logits) = logits else { return Ok((Vec::new(), Vec::new())) };
        let s = batch.logits_indices.len();
        let sampled = if s == 0 { Vec::new() } else { device_sampler::sample(&logits.narrow(0, 0, s)?, rows, mode)? };
        let p = batch.prompt_logprob_rows.len();
        let prompt = if p == 0 { Vec::new() } else { logits.narrow(0, s, p)?.flatten_all()?.to_vec1::<f32>()? };
        Ok((sampled, prompt))
    }

    /// The first pipeline stage's step: the hidden states `[T, hidden]` its
    /// layers leave for the next stage.
    pub fn execute_first_stage(&mut self, batch: &BatchInputs) -> Result<Tensor> {
        let (model, kv_caches) = match &mut self.step {
            Step::Candle { model, kv_caches } => (model, kv_caches),
            Step::Plan(plan) => {
                let t = batch.input_ids.len();
                return match plan.run(&plan_inputs(batch, &[]), Readback::Hidden)? {
                    StepOutput::Hidden(h) => Ok(Tensor::from_vec(h, (t, self.config.hidden_size), &Device::Cpu)?),
                    _ => Err(WorkerError::Unsupported("the plan brought no hidden states back".into())),
                };
            }
        };
        let t = batch.input_ids.len();
        let input_ids = Tensor::from_slice(&batch.input_ids, t, &self.device)?;
        let positions = Tensor::from_slice(&batch.positions, t, &self.device)?;
        // Only the last stage computes logits; this stage reads no rows.
        let rows = Tensor::zeros(0, DType::U32, &self.device)?;
        match model.forward_stage(StageInput::Tokens(&input_ids), &positions, kv_caches, &batch.meta, &rows)? {
            StageOutput::Hidden(hidden) => Ok(hidden),
            StageOutput::Logits(_) => Err(WorkerError::Unsupported("the whole model runs here: no next stage".into())),
        }
    }

    /// Bytes of the KV cache's block pools.
    pub fn kv_cache_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        match &self.step {
            Step::Candle { kv_caches, .. } => kv_caches.iter().map(|c| bytes(&c.k) + bytes(&c.v)).sum(),
            Step::Plan(plan) => plan.kv_bytes() as u64,
        }
    }

    /// Replaces the KV cache with one of `num_blocks` blocks (a pipeline
    /// runs with its smallest stage's count).
    /// A plan keeps its pools (sized at load): the scheduler uses their
    /// first `num_blocks`.
    pub fn reallocate_kv(&mut self, num_blocks: usize) -> Result<()> {
        let Step::Candle { kv_caches, .. } = &mut self.step else { return Ok(()) };
        let cfg = stage_kv_config(&self.config, self.range);
        kv_caches.clear(); // before allocating the new ones
        *kv_caches = kv_cache::allocate(&cfg, num_blocks, self.block_size, self.kv_format, &self.device)?;
        Ok(())
    }

    /// The logits [S + P, vocab] of the sampled rows then the prompt-logprob
    /// rows, on the device; None when no row is wanted.
    fn forward(&mut self, batch: &BatchInputs) -> Result<Option<Tensor>> {
        if batch.input_ids.is_empty() {
            return Ok(None);
        }
        let t = batch.input_ids.len();
        let input_ids = Tensor::from_slice(&batch.input_ids, t, &self.device)?;
        let positions = Tensor::from_slice(&batch.positions, t, &self.device)?;
        let mut wanted = batch.logits_indices.clone();
        wanted.extend_from_slice(&batch.prompt_logprob_rows);
        // A step of prompt chunks only still runs the layers to fill the KV
        // cache; it computes one row of logits that nobody reads.
        let none_wanted = wanted.is_empty();
        if none_wanted {
            wanted.push(t as u32 - 1);
        }
        let logits_indices = Tensor::from_slice(&wanted, wanted.len(), &self.device)?;
        let Step::Candle { model, kv_caches } = &self.step else {
            return Err(WorkerError::Unsupported("the step plan brings its logits to the host".into()));
        };
        let logits = model.forward(&input_ids, &positions, kv_caches, &batch.meta, &logits_indices)?;
        Ok((!none_wanted).then_some(logits))
    }
}

/// A step plan's inputs for `batch`, wanting `rows`.
fn plan_inputs<'a>(batch: &'a BatchInputs, rows: &'a [u32]) -> StepInputs<'a> {
    StepInputs {
        input: StepInput::Tokens(&batch.input_ids),
        positions: &batch.positions,
        meta: &batch.meta,
        logit_rows: rows,
    }
}
