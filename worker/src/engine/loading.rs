//! Loading what an engine runs: a model's weights prepared for the device
//! (quantized, packed), and the draft model of speculative decoding, which
//! must fit the target and shares its KV-cache budget.

use candle_core::DType;
use common::pipeline::LayerRange;
use kernels::KvCacheDtype;
use kernels::metal::step::{StepLimits, WeightFormat};

use super::{EngineConfig, MAX_PROMPT_LOGPROB_LOGITS};
use crate::error::{Result, WorkerError};
use crate::models::{CausalLm, ModelConfig, ModelFiles, Quantization};
use crate::runner::device::PlanTarget;
use crate::runner::kv_cache::{self, KvBudget};
use crate::runner::plan::{self, StepExecutor};

/// The KV pools of `--device metal-emulated` unless `--kv-cache-memory`
/// says otherwise: the emulator is for tests, and fills what it maps.
pub(super) const EMULATED_KV_BYTES: u64 = 64 << 20;

/// The step plan of `files` on `target`, its buffers sized for the engine's
/// limits: the step's token budget, its sequences, the rows of logits a
/// step can want (each sequence's sampled rows and proposals, plus the
/// prompt-logprob rows the scheduler allows) and the longest context.
pub(super) fn build_plan(
    target: PlanTarget,
    files: &ModelFiles,
    config: &EngineConfig,
    kv_format: KvCacheDtype,
    num_blocks: usize,
    max_model_len: usize,
    layers: LayerRange,
) -> Result<Box<dyn StepExecutor>> {
    if layers != LayerRange::full(files.config.num_layers) {
        return Err(WorkerError::Unsupported("pipeline stages do not run on the Metal step plan yet".into()));
    }
    let quantize = match config.quantization {
        None => None,
        Some(Quantization::Q8_0) => Some(WeightFormat::Q8_0),
        Some(Quantization::Q4_0) => Some(WeightFormat::Q4_0),
        Some(Quantization::Q4K) => Some(WeightFormat::Q4K),
        Some(q) => {
            return Err(WorkerError::Unsupported(format!(
                "--quantize {q:?} on the Metal step plan (q8_0, q4_0, q4_k)"
            )));
        }
    };
    let cache = match kv_format {
        KvCacheDtype::F32 => DType::F32,
        KvCacheDtype::F16 => DType::F16,
        other => return Err(WorkerError::Unsupported(format!("a {other} KV cache on the Metal step plan"))),
    };
    let vocab = files.config.vocab_size.max(1);
    let sampled = config.max_num_seqs * (1 + config.speculative.num_speculative_tokens);
    let prompt = (MAX_PROMPT_LOGPROB_LOGITS / vocab).max(1);
    let limits = StepLimits {
        max_tokens: config.max_num_batched_tokens,
        max_seqs: config.max_num_seqs,
        max_logit_rows: (sampled + prompt).min(config.max_num_batched_tokens),
        max_sampled_rows: sampled.min(config.max_num_batched_tokens),
        max_model_len,
        num_blocks,
        block_size: config.block_size,
    };
    plan::build(target, &config.device, files, (config.dtype, quantize), cache, limits)
}

/// Quantizes (`--quantize`) and lays out a loaded model's weights for the
/// device: packed for the CPU kernels, in huge pages.
pub(super) fn prepare_weights(model: &mut CausalLm, config: &EngineConfig) -> Result<()> {
    if let Some(q) = config.quantization {
        if !q.is_block_format() {
            return Err(WorkerError::Unsupported(format!("{q:?} is not a quantization to apply at load time")));
        }
        if !config.device.is_cpu() {
            return Err(WorkerError::Unsupported(format!("{q:?} quantization runs on the CPU only")));
        }
        let (quantized, total) = model.quantize(q)?;
        tracing::info!(
            "quantized {quantized} of {total} linear layers to {q:?} (the rest have in-features not a multiple of \
             32, or were quantized already)"
        );
    }
    if config.device.is_cpu() {
        model.pack_weights()?;
        model.place_weights_in_huge_pages();
    }
    Ok(())
}

/// Loads the draft model, prepared as the target is, after checking that it
/// can propose for `target`: the same vocabulary, and positions up to the
/// target's context.
pub(super) fn load_draft(
    draft: &ModelFiles,
    config: &EngineConfig,
    target: &ModelFiles,
    max_model_len: usize,
) -> Result<CausalLm> {
    // On a pipeline the draft runs whole on the first stage, which
    // schedules (a later stage never gets here: `Engine::new` is stage 0's).
    let (ours, theirs) = (&target.config, &draft.config);
    if ours.vocab_size != theirs.vocab_size {
        return Err(WorkerError::Unsupported(format!(
            "draft model {} has a vocabulary of {} tokens and {} one of {}: a draft needs the target's tokenizer",
            draft.name, theirs.vocab_size, target.name, ours.vocab_size
        )));
    }
    if theirs.max_position_embeddings < max_model_len {
        return Err(WorkerError::Unsupported(format!(
            "draft model {} reaches {} positions, under the context of {max_model_len}: lower --max-model-len",
            draft.name, theirs.max_position_embeddings
        )));
    }
    let mut model = crate::models::loader::load(draft, config.dtype, &config.device)?;
    prepare_weights(&mut model, config)?;
    tracing::info!(
        "draft model {}: {} layers, {} bytes of weights",
        draft.name,
        theirs.num_layers,
        model.resident_weight_bytes()
    );
    Ok(model)
}

/// The part of `budget` the target's pools get when a draft model's pools
/// hold as many blocks beside them: shared in proportion to their bytes per
/// block.
pub(super) fn target_share(
    budget: KvBudget,
    target: &ModelConfig,
    format: KvCacheDtype,
    draft: &CausalLm,
    block_size: usize,
) -> KvBudget {
    let ours = kv_cache::bytes_per_block(target, block_size, format) as f64;
    let theirs = kv_cache::bytes_per_block(draft.config(), block_size, format) as f64;
    let share = ours / (ours + theirs);
    match budget {
        KvBudget::Bytes(b) => KvBudget::Bytes((b as f64 * share) as u64),
        KvBudget::FractionOfAvailable(f) => KvBudget::FractionOfAvailable(f * share),
    }
}
