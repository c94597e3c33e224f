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

use super::wire::{
    StageInfo, StageShape, StepHeader, StepResult, f32_to_bytes, hidden_from_bytes, hidden_to_bytes,
    penalties_read_output,
};
use crate::error::{Result, WorkerError};
use crate::models::llama::{StageInput, StageOutput};
use crate::models::{CausalLm, ModelConfig, ModelFiles, Quantization};
use crate::runner::kv_cache::{self, KvBudget, LayerKvCache, stage_kv_config};
use crate::runner::logprobs::LogprobsMode;
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
}

pub struct StageRunner {
    model: CausalLm,
    kv_caches: Vec<LayerKvCache>,
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
        let mut model = crate::models::loader::load_stage(files, config.dtype, &config.device, config.layers)?;
        if let Some(q) = config.quantization {
            if !q.is_block_format() || !config.device.is_cpu() {
                return Err(WorkerError::Unsupported(format!("{q:?} quantization at load time runs on the CPU only")));
            }
            model.quantize(q)?;
        }
        if config.device.is_cpu() {
            model.pack_weights()?;
            model.place_weights_in_huge_pages();
        }
        let kv_cfg = stage_kv_config(model.config(), config.layers);
        let cfg = model.config();
        let max_model_len =
            config.max_model_len.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let max_useful = 2 * config.max_num_seqs * max_model_len.div_ceil(config.block_size);
        let kv_format = kv_cache::resolve_format(config.kv_cache_dtype, model.activation_dtype(), &config.device)?;
        let num_blocks =
            kv_cache::num_blocks_for_budget(&kv_cfg, config.block_size, kv_format, config.kv_budget, max_useful)?;
        let kv_caches = kv_cache::allocate(&kv_cfg, num_blocks, config.block_size, kv_format, &config.device)?;
        let kv_bytes = kv_cache::bytes_per_block(&kv_cfg, config.block_size, kv_format) * num_blocks as u64;
        Ok(Self {
            model,
            kv_caches,
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
        self.model.layer_range()
    }

    pub fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// This stage as the stage before sees it.
    pub fn info(&self, name: &str) -> StageInfo {
        StageInfo {
            name: name.to_string(),
            layers: self.layers().to_string(),
            weight_bytes: self.model.resident_weight_bytes() as u64,
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
        let cfg = self.model.config();
        let last = self.layers().is_last();
        let shape = StageShape {
            block_size: self.block_size,
            sliding_window: cfg.sliding_window,
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
        let rows = Tensor::from_slice(&wanted, wanted.len(), &self.device)?;
        let input = StageInput::Hidden(&hidden);
        match self.model.forward_stage(input, &positions, &self.kv_caches, meta, &rows)? {
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
    /// single worker does, and verifies each sequence's proposals: it
    /// keeps the draws that equal their proposals and the one after them
    /// (`engine_core::spec`). Returns the kept tokens per sequence and the
    /// prompt-logprob rows' logits.
    fn sample<'l>(&self, header: &StepHeader, logits: &'l [f32]) -> (Vec<Vec<SampledToken>>, &'l [f32]) {
        let vocab = self.model.config().vocab_size;
        // Each row's output as the sampler sees it (only a penalty reads it).
        let outputs: Vec<Cow<[u32]>> = header
            .sampling
            .iter()
            .flat_map(|seq| match penalties_read_output(&seq.params).0 {
                true => sampler::verified_outputs(&seq.output_token_ids, &seq.proposed).collect(),
                false => vec![Cow::Borrowed(&[][..]); seq.num_rows()],
            })
            .collect();
        let mut outputs = outputs.iter();
        let mut inputs = Vec::with_capacity(outputs.len());
        for seq in &header.sampling {
            for (i, output) in outputs.by_ref().take(seq.num_rows()).enumerate() {
                inputs.push(SamplingRow {
                    params: &seq.params,
                    prompt_token_ids: &seq.prompt_token_ids,
                    output_token_ids: output,
                    num_output_tokens: seq.num_output_tokens as usize + i,
                    seed: seq.seed,
                    eos_token_ids: &self.eos_token_ids,
                    // Pipelines refuse structured outputs (`Engine::add_request`).
                    allowed: None,
                });
            }
        }
        let (sampling_logits, prompt_logits) = logits.split_at(inputs.len() * vocab);
        let mut drawn = sampler::sample_batch(sampling_logits, vocab, &inputs, self.logprobs_mode).into_iter();
        let sampled = header
            .sampling
            .iter()
            .map(|seq| {
                let mut rows: Vec<SampledToken> = drawn.by_ref().take(seq.num_rows()).collect();
                let tokens: Vec<u32> = rows.iter().map(|s| s.token_id).collect();
                rows.truncate(spec::num_accepted(&seq.proposed, &tokens) + 1);
                rows
            })
            .collect();
        (sampled, prompt_logits)
    }
}
