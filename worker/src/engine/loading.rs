//! Loading what an engine runs: a model's weights prepared for the device
//! (quantized, packed), and the draft model of speculative decoding, which
//! must fit the target and shares its KV-cache budget.

use common::pipeline::LayerRange;
use kernels::KvCacheDtype;

use super::{EngineConfig, MAX_PROMPT_LOGPROB_LOGITS};
use crate::error::{Result, WorkerError};
use crate::models::{CausalLm, ModelConfig, ModelFiles};
use crate::runner::device::PlanTarget;
use crate::runner::kv_cache::{self, KvBudget};
use crate::runner::plan::{self, StepExecutor};

/// The step plan of `files` on `target` for this engine's `layers` (the
/// whole model, or a pipeline's first stage), its buffers sized for the
/// engine's limits (see [`plan::PlanSizing`]).
pub(super) fn build_plan(
    target: PlanTarget,
    files: &ModelFiles,
    config: &EngineConfig,
    kv_format: KvCacheDtype,
    num_blocks: usize,
    max_model_len: usize,
    layers: LayerRange,
) -> Result<Box<dyn StepExecutor>> {
    let limits = plan::PlanSizing {
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        num_speculative_tokens: config.speculative.num_speculative_tokens,
        max_prompt_logprob_rows: (MAX_PROMPT_LOGPROB_LOGITS / files.config.vocab_size.max(1)).max(1),
        max_model_len,
        num_blocks,
        block_size: config.block_size,
    }
    .limits();
    let spec = plan::PlanSpec::new(config.dtype, config.quantization, kv_format, layers, limits)?;
    plan::build(target, &config.device, files, spec)
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
