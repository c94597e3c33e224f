//! A later pipeline stage's compute: its layers over the step the stage
//! before sent, then either the hidden states for the next stage or, on the
//! last stage, the logits and the sampled tokens. It keeps no per-request
//! state: everything comes in the step's header. Synchronous, no I/O.

use std::borrow::Cow;

use candle_core::{DType, Device, Tensor};
use common::SampledToken;
use common::pipeline::LayerRange;
use engine_core::spec;
use kernels::KvCacheDtype;
use kernels::metal::step::{Readback, StepInput, StepInputs, StepOutput, TokenEdit, padded_head_dim};

use super::wire::{
    StageInfo, StageShape, StepHeader, StepResult, f32_to_bytes, hidden_from_bytes, hidden_to_bytes,
    penalties_read_output,
};
use crate::engine::MAX_PROMPT_LOGPROB_LOGITS;
use crate::error::{Result, WorkerError};
use crate::models::llama::{StageInput, StageOutput};
use crate::models::{CausalLm, ModelConfig, ModelFiles, Quantization};
use crate::runner::device::PlanTarget;
use crate::runner::kv_cache::{self, KvBudget, LayerKvCache, stage_kv_config};
use crate::runner::logprobs::LogprobsMode;
use crate::runner::plan::{self, StepExecutor};
use crate::runner::plan_sampling;
use crate::runner::sampler::{self, SamplingRow};

/// What a stage hands on after computing a step.
pub enum StageStep {
    /// To the next stage: the header and this stage's output hidden states.
    Forward(StepHeader<'static>, Vec<u8>),
    /// Back to the stage before (last stage): the result and its raw bytes.
    Result(StepResult, Vec<u8>),
}

/// How a stage that does not hold layer 0 is built.
pub struct StageConfig {
    pub device: Device,
    pub dtype: DType,
    pub layers: LayerRange,
    pub block_size: usize,
    pub kv_budget: KvBudget,
    /// Caps the KV cache as the first stage's scheduler would use it.
    pub max_num_seqs: usize,
    pub max_model_len: Option<usize>,
    /// Quantize linear weights at load time to a block format (CPU only).
    pub quantization: Option<Quantization>,
    /// `--kv-cache-dtype` (`None`: auto); every stage of a pipeline runs the same.
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// The step as a plan of our GPU kernels (`--device metal`,
    /// `metal-emulated`), sized for the first stage's scheduler: its token
    /// budget and proposals per sequence.
    pub plan: Option<PlanTarget>,
    pub max_num_batched_tokens: usize,
    pub num_speculative_tokens: usize,
}

/// What computes a stage's layers.
enum StageModel {
    /// candle's model and its KV pools.
    Candle { model: Box<CausalLm>, kv_caches: Vec<LayerKvCache> },
    /// A step plan of our GPU kernels (its weights and KV pools inside).
    Plan { plan: Box<dyn StepExecutor>, config: Box<ModelConfig>, layers: LayerRange },
}

pub struct StageRunner {
    model: StageModel,
    num_blocks: usize,
    block_size: usize,
    device: Device,
    eos_token_ids: Vec<u32>,
    kv_bytes: u64,
    kv_format: KvCacheDtype,
    /// How logprobs are reported, as the first stage asked.
    pub logprobs_mode: LogprobsMode,
}

impl StageRunner {
    /// Loads this stage's share of the weights (only its tensors are read)
    /// and allocates the KV cache of its layers from its own budget.
    pub fn new(files: &ModelFiles, config: &StageConfig) -> Result<Self> {
        // A plan uploads its weights itself: no candle model beside it.
        let mut model = match config.plan {
            Some(_) => None,
            None => Some(crate::models::loader::load_stage(files, config.dtype, &config.device, config.layers)?),
        };
        if let Some(model) = &mut model {
            if let Some(q) = config.quantization {
                if !q.is_block_format() || !config.device.is_cpu() {
                    return Err(WorkerError::Unsupported(format!(
                        "{q:?} quantization at load time runs on the CPU only"
                    )));
                }
                model.quantize(q)?;
            }
            if config.device.is_cpu() {
                model.pack_weights()?;
                model.place_weights_in_huge_pages();
            }
        }
        let cfg = model.as_ref().map_or_else(|| files.config.clone(), |m| m.config().clone());
        let mut kv_cfg = stage_kv_config(&cfg, config.layers);
        if config.plan.is_some() {
            // The plan's rows take its attention kernels' head dim.
            kv_cfg.head_dim = padded_head_dim(cfg.head_dim).unwrap_or(cfg.head_dim);
        }
        let max_model_len =
            config.max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let max_useful = 2 * config.max_num_seqs * max_model_len.div_ceil(config.block_size);
        // The plan's activations are f32 (its KV cache f32 or f16).
        let act = model.as_ref().map_or(DType::F32, CausalLm::activation_dtype);
        let kv_format = kv_cache::resolve_format(config.kv_cache_dtype, act, &config.device)?;
        let kv_budget = plan::kv_budget(config.plan, config.kv_budget);
        let num_blocks = kv_cache::num_blocks_for_budget(&kv_cfg, config.block_size, kv_format, kv_budget, max_useful)?;
        let kv_bytes = kv_cache::bytes_per_block(&kv_cfg, config.block_size, kv_format) * num_blocks as u64;
        let model = match (config.plan, model) {
            (Some(target), _) => {
                let limits = plan::PlanSizing {
                    max_num_batched_tokens: config.max_num_batched_tokens,
                    max_num_seqs: config.max_num_seqs,
                    num_speculative_tokens: config.num_speculative_tokens,
                    max_prompt_logprob_rows: (MAX_PROMPT_LOGPROB_LOGITS / cfg.vocab_size.max(1)).max(1),
                    max_model_len,
                    num_blocks,
                    block_size: config.block_size,
                }
                .limits();
                let spec = plan::PlanSpec::new(config.dtype, config.quantization, kv_format, config.layers, limits)?;
                let plan = plan::build(target, &config.device, files, spec)?;
                StageModel::Plan { plan, config: Box::new(cfg), layers: config.layers }
            }
            (None, Some(model)) => {
                let kv_caches = kv_cache::allocate(&kv_cfg, num_blocks, config.block_size, kv_format, &config.device)?;
                StageModel::Candle { model: Box::new(model), kv_caches }
            }
            (None, None) => return Err(WorkerError::Unsupported("no model was loaded for the stage".into())),
        };
        Ok(Self {
            model,
            num_blocks,
            block_size: config.block_size,
            device: config.device.clone(),
            eos_token_ids: files.eos_token_ids.clone(),
            kv_bytes,
            kv_format,
            logprobs_mode: LogprobsMode::RawLogprobs,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn layers(&self) -> LayerRange {
        match &self.model {
            StageModel::Candle { model, .. } => model.layer_range(),
            StageModel::Plan { layers, .. } => *layers,
        }
    }

    pub fn model_config(&self) -> &ModelConfig {
        match &self.model {
            StageModel::Candle { model, .. } => model.config(),
            StageModel::Plan { config, .. } => config,
        }
    }

    /// This stage as the stage before sees it.
    pub fn info(&self, name: &str) -> StageInfo {
        StageInfo {
            name: name.to_string(),
            layers: self.layers().to_string(),
            weight_bytes: match &self.model {
                StageModel::Candle { model, .. } => model.resident_weight_bytes() as u64,
                StageModel::Plan { plan, .. } => plan.weight_bytes() as u64,
            },
            kv_bytes: self.kv_bytes,
            metrics_address: None,
            kv_cache_dtype: self.kv_format.to_string(),
            kv_capacity_tokens: (self.num_blocks * self.block_size) as u64,
        }
    }

    /// Computes one step; a step that fails becomes a `Failed` result for
    /// the first stage (its requests fail; the pipeline goes on).
    pub fn run(&mut self, header: StepHeader<'static>, hidden: Vec<u8>) -> StageStep {
        let step = header.step;
        self.try_run(header, &hidden).unwrap_or_else(|e| {
            StageStep::Result(StepResult::Failed { step, message: format!("stage {}: {e}", self.layers()) }, Vec::new())
        })
    }

    fn try_run(&mut self, mut header: StepHeader<'static>, hidden: &[u8]) -> Result<StageStep> {
        let cfg = self.model_config();
        let last = self.layers().is_last();
        let shape = StageShape {
            block_size: self.block_size,
            sliding_window: cfg.uniform_window(),
            hidden_size: cfg.hidden_size,
            max_positions: cfg.max_position_embeddings,
        };
        header.check(self.num_blocks, &shape, last)?;
        let t = header.positions.len();
        let hidden = hidden_from_bytes(header.dtype, hidden, t, cfg.hidden_size, &self.device)?;
        let positions = Tensor::from_slice(&header.positions, t, &self.device)?;
        let meta = &header.meta;
        let mut wanted = header.logits_indices.to_vec();
        wanted.extend_from_slice(&header.prompt_logprob_rows);
        // A step of prompt chunks only still computes one row nobody reads.
        let none_wanted = wanted.is_empty();
        if none_wanted {
            wanted.push(t as u32 - 1);
        }
        let output = match &mut self.model {
            StageModel::Candle { model, kv_caches } => {
                let rows = Tensor::from_slice(&wanted, wanted.len(), &self.device)?;
                model.forward_stage(StageInput::Hidden(&hidden), &positions, kv_caches, meta, &rows)?
            }
            StageModel::Plan { plan, config, .. } => {
                let hidden = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let inputs = |rows| StepInputs {
                    input: StepInput::Hidden(&hidden),
                    positions: &header.positions,
                    meta,
                    logit_rows: rows,
                };
                // The last stage draws on the GPU unless the step wants
                // prompt logprobs (their logits go back) or nothing.
                if last && !none_wanted && header.prompt_logprob_rows.is_empty() {
                    let outputs = sampled_outputs(&header);
                    let rows = sampling_rows(&header, &outputs, &self.eos_token_ids);
                    let edits: Vec<Vec<TokenEdit>> = rows.iter().map(plan_sampling::edits_of).collect();
                    let params = plan_sampling::sample_rows(&rows, &edits);
                    if plan.samples(&params) {
                        let out = plan.run(&inputs(&header.logits_indices), Readback::Sample(&params))?;
                        let StepOutput::Sampled(drawn) = out else {
                            return Err(WorkerError::Unsupported("the plan did not sample".into()));
                        };
                        let mode = self.logprobs_mode;
                        let drawn = drawn.into_iter().map(|s| plan_sampling::sampled_token(s, mode)).collect();
                        let sampled = keep_verified(&header, drawn);
                        let (step, stage_micros) = (header.step, header.stage_micros);
                        let result = StepResult::Sampled { step, sampled, prompt_logits_bytes: 0, stage_micros };
                        return Ok(StageStep::Result(result, Vec::new()));
                    }
                }
                let rows: &[u32] = if last { &wanted } else { &[] };
                match plan.run(&inputs(rows), if last { Readback::Logits } else { Readback::Hidden })? {
                    StepOutput::Hidden(h) => {
                        StageOutput::Hidden(Tensor::from_vec(h, (t, config.hidden_size), &Device::Cpu)?)
                    }
                    StepOutput::Logits(l) => {
                        StageOutput::Logits(Tensor::from_vec(l, (wanted.len(), config.vocab_size), &Device::Cpu)?)
                    }
                    StepOutput::Sampled(_) => return Err(WorkerError::Unsupported("the plan sampled".into())),
                }
            }
        };
        match output {
            StageOutput::Hidden(out) => {
                let (dtype, bytes) = hidden_to_bytes(&out)?;
                header.dtype = dtype;
                header.hidden_bytes = bytes.len() as u64;
                Ok(StageStep::Forward(header, bytes))
            }
            StageOutput::Logits(_) if none_wanted => {
                let (step, stage_micros) = (header.step, header.stage_micros);
                let result = StepResult::Sampled { step, sampled: Vec::new(), prompt_logits_bytes: 0, stage_micros };
                Ok(StageStep::Result(result, Vec::new()))
            }
            StageOutput::Logits(logits) => {
                let logits = logits.flatten_all()?.to_vec1::<f32>()?;
                let (sampled, prompt_logits) = self.sample(&header, &logits);
                let bytes = f32_to_bytes(prompt_logits);
                let result = StepResult::Sampled {
                    step: header.step,
                    sampled,
                    prompt_logits_bytes: bytes.len() as u64,
                    stage_micros: header.stage_micros,
                };
                Ok(StageStep::Result(result, bytes))
            }
        }
    }

    /// Samples the header's rows from `logits` (`[S + P, vocab]`) as a
    /// single worker does, and verifies each sequence's proposals
    /// ([`keep_verified`]). Returns the kept tokens per sequence and the
    /// prompt-logprob rows' logits.
    fn sample<'l>(&self, header: &StepHeader, logits: &'l [f32]) -> (Vec<Vec<SampledToken>>, &'l [f32]) {
        let vocab = self.model_config().vocab_size;
        let outputs = sampled_outputs(header);
        let inputs = sampling_rows(header, &outputs, &self.eos_token_ids);
        let (sampling_logits, prompt_logits) = logits.split_at(inputs.len() * vocab);
        let drawn = sampler::sample_batch(sampling_logits, vocab, &inputs, self.logprobs_mode);
        (keep_verified(header, drawn), prompt_logits)
    }
}

/// Each sampled row's output as the sampler sees it (only a penalty reads
/// it): a sequence's rows take its proposals one by one.
fn sampled_outputs<'h>(header: &'h StepHeader) -> Vec<Cow<'h, [u32]>> {
    header
        .sampling
        .iter()
        .flat_map(|seq| match penalties_read_output(&seq.params).0 {
            true => sampler::verified_outputs(&seq.output_token_ids, &seq.proposed).collect(),
            false => vec![Cow::Borrowed(&[][..]); seq.num_rows()],
        })
        .collect()
}

/// The header's sampling rows, as a single worker builds them.
fn sampling_rows<'a>(header: &'a StepHeader, outputs: &'a [Cow<'a, [u32]>], eos: &'a [u32]) -> Vec<SamplingRow<'a>> {
    let mut outputs = outputs.iter();
    let mut rows = Vec::with_capacity(outputs.len());
    for seq in &header.sampling {
        for (i, output) in outputs.by_ref().take(seq.num_rows()).enumerate() {
            rows.push(SamplingRow {
                params: &seq.params,
                prompt_token_ids: &seq.prompt_token_ids,
                output_token_ids: output,
                num_output_tokens: seq.num_output_tokens as usize + i,
                seed: seq.seed,
                eos_token_ids: eos,
                // Pipelines refuse structured outputs (`Engine::add_request`).
                allowed: None,
            });
        }
    }
    rows
}

/// Each sequence's draws that equal its proposals, and the one after them
/// (`engine_core::spec`).
fn keep_verified(header: &StepHeader, drawn: Vec<SampledToken>) -> Vec<Vec<SampledToken>> {
    let mut drawn = drawn.into_iter();
    header
        .sampling
        .iter()
        .map(|seq| {
            let mut rows: Vec<SampledToken> = drawn.by_ref().take(seq.num_rows()).collect();
            let tokens: Vec<u32> = rows.iter().map(|s| s.token_id).collect();
            rows.truncate(spec::num_accepted(&seq.proposed, &tokens) + 1);
            rows
        })
        .collect()
}
