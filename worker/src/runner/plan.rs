//! A model's step as one plan of our GPU kernels (`kernels::metal::step`):
//! the weights uploaded once, the step's buffers allocated once, and each
//! step encoded into one command buffer. The model runner hands it the
//! step's flattened batch and gets the wanted rows' logits back.
//!
//! The plan is generic over the GPU ([`Gpu`]); `--device metal-emulated`
//! runs it in the CPU emulator of our Metal kernels.

use candle_core::DType;
use common::pipeline::LayerRange;
use kernels::KvCacheDtype;
use kernels::metal::step::{
    Gpu, MAX_EXPERTS, ModelShape, Readback, SampleRow, StepInputs, StepLimits, StepOutput, StepPlan, WeightFormat,
    padded_head_dim,
};

use crate::error::{Result, WorkerError};
use crate::models::{ModelConfig, ModelFiles, Quantization};
use crate::runner::device::PlanTarget;
use crate::runner::kv_cache::KvBudget;
use crate::runner::plan_weights::{self, Source};

/// What a model runner needs of a plan, whatever its GPU.
pub trait StepExecutor: Send {
    /// Runs a step: one command buffer, one wait, and what `readback` asks
    /// for (the wanted rows' logits, their tokens drawn on the GPU with one
    /// sampler dispatch, or a pipeline stage's hidden states).
    fn run(&mut self, inputs: &StepInputs, readback: Readback) -> Result<StepOutput>;
    /// Whether a step may sample these rows on the GPU (a plan holding the
    /// head, whose sampler's buffers hold them).
    fn samples(&self, params: &[SampleRow]) -> bool;
    /// Bytes of weights the GPU holds.
    fn weight_bytes(&self) -> usize;
    /// Bytes of the KV pools.
    fn kv_bytes(&self) -> usize;
    /// Starts or stops measuring each step's device-memory traffic; false
    /// where the GPU cannot count (only the emulator can).
    fn count_traffic(&mut self, on: bool) -> bool;
    /// The last step's traffic, while counting.
    fn last_traffic(&self) -> Option<Traffic>;
    /// Bytes of one KV block across the plan's layers, K and V.
    fn kv_block_bytes(&self) -> usize;
    /// Appends block `block`'s KV to `out` (the second tier's offload).
    fn read_kv_block(&mut self, block: usize, out: &mut Vec<u8>) -> Result<()>;
    /// Writes a block's KV as `read_kv_block` gave it (a restore).
    fn write_kv_block(&mut self, block: usize, bytes: &[u8]) -> Result<()>;
}

/// What one step did to device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes the step's dispatches touched, each byte once per dispatch.
    pub touched: u64,
    /// Bytes it must read: weights, and K and V of every context token.
    pub must_read: u64,
}

impl Traffic {
    /// touched / must_read: 1.0 when no dispatch reads what another did.
    pub fn ratio(&self) -> f64 {
        self.touched as f64 / self.must_read.max(1) as f64
    }
}

struct PlanExecutor<G: Gpu> {
    gpu: G,
    plan: StepPlan<G::Buffer>,
    counting: bool,
    last_traffic: Option<Traffic>,
}

impl<G: Gpu> PlanExecutor<G> {
    fn new(gpu: G, plan: StepPlan<G::Buffer>) -> Self {
        Self { gpu, plan, counting: false, last_traffic: None }
    }
}

impl<G> StepExecutor for PlanExecutor<G>
where
    G: Gpu + Send,
    G::Buffer: Send,
{
    /// One step, its traffic recorded while counting.
    fn run(&mut self, inputs: &StepInputs, readback: Readback) -> Result<StepOutput> {
        let before = self.gpu.traffic_bytes();
        let out = self.plan.run(&mut self.gpu, inputs, readback)?;
        if self.counting
            && let (Some(before), Some(after)) = (before, self.gpu.traffic_bytes())
        {
            let must_read = self.plan.weight_bytes() + self.plan.kv_read_bytes(inputs.meta);
            self.last_traffic = Some(Traffic { touched: after - before, must_read: must_read as u64 });
        }
        Ok(out)
    }

    fn samples(&self, params: &[SampleRow]) -> bool {
        self.plan.samples(params)
    }

    fn count_traffic(&mut self, on: bool) -> bool {
        let can = self.gpu.count_traffic(on);
        self.counting = on && can;
        can
    }

    fn last_traffic(&self) -> Option<Traffic> {
        self.last_traffic
    }

    fn weight_bytes(&self) -> usize {
        self.plan.weight_bytes()
    }

    fn kv_bytes(&self) -> usize {
        self.plan.kv_bytes()
    }

    fn kv_block_bytes(&self) -> usize {
        self.plan.kv_block_bytes()
    }

    fn read_kv_block(&mut self, block: usize, out: &mut Vec<u8>) -> Result<()> {
        Ok(self.plan.read_kv_block(&mut self.gpu, block, out)?)
    }

    fn write_kv_block(&mut self, block: usize, bytes: &[u8]) -> Result<()> {
        Ok(self.plan.write_kv_block(&mut self.gpu, block, bytes)?)
    }
}

/// How a plan is built: the weights' dtype and block format, the KV
/// cache's dtype, the layers it holds (a pipeline stage's share, with the
/// embedding on the first stage and the head on the last) and the limits
/// its buffers are sized for.
#[derive(Clone, Copy, Debug)]
pub struct PlanSpec {
    pub dtype: DType,
    pub quantize: Option<WeightFormat>,
    pub cache: DType,
    pub layers: LayerRange,
    pub limits: StepLimits,
}

impl PlanSpec {
    /// A plan of `layers` in `dtype` (quantized at load to `quantization`,
    /// when given), its KV cache in `kv_format`.
    pub fn new(
        dtype: DType,
        quantization: Option<Quantization>,
        kv_format: KvCacheDtype,
        layers: LayerRange,
        limits: StepLimits,
    ) -> Result<Self> {
        let quantize = match quantization {
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
        Ok(Self { dtype, quantize, cache, layers, limits })
    }
}

/// What a plan's buffers are sized for: the scheduler it serves (an
/// engine's own, or, for a later pipeline stage, the first stage's).
#[derive(Clone, Copy, Debug)]
pub struct PlanSizing {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub num_speculative_tokens: usize,
    /// Rows of prompt logprobs a step may want.
    pub max_prompt_logprob_rows: usize,
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl PlanSizing {
    /// The step's token budget, its sequences, the rows of logits a step
    /// can want (each sequence's sampled row and proposals, plus the
    /// prompt-logprob rows) and the longest context.
    pub fn limits(&self) -> StepLimits {
        let sampled = self.max_num_seqs * (1 + self.num_speculative_tokens);
        StepLimits {
            max_tokens: self.max_num_batched_tokens,
            max_seqs: self.max_num_seqs,
            max_logit_rows: (sampled + self.max_prompt_logprob_rows).min(self.max_num_batched_tokens),
            max_sampled_rows: sampled.min(self.max_num_batched_tokens),
            max_model_len: self.max_model_len,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }
}

/// The KV budget of a plan on `target`: as asked, except that the
/// emulator, which touches every byte it maps, takes a fixed 64 MiB rather
/// than a fraction of the machine's memory (minutes to fill).
pub fn kv_budget(target: Option<PlanTarget>, budget: KvBudget) -> KvBudget {
    match (target, budget) {
        (Some(PlanTarget::MetalEmulated), KvBudget::FractionOfAvailable(_)) => KvBudget::Bytes(EMULATED_KV_BYTES),
        (_, budget) => budget,
    }
}

/// The KV pools of `--device metal-emulated` unless `--kv-cache-memory`
/// says otherwise: the emulator is for tests.
pub const EMULATED_KV_BYTES: u64 = 64 << 20;

/// Builds the plan of `files` on `target`: uploads the weights and
/// allocates the KV pools and the step's buffers.
pub fn build(
    target: PlanTarget,
    device: &candle_core::Device,
    files: &ModelFiles,
    spec: PlanSpec,
) -> Result<Box<dyn StepExecutor>> {
    match target {
        PlanTarget::Metal => {
            #[cfg(target_os = "macos")]
            {
                let mut gpu = kernels::metal::gpu::MetalGpu::new(device.as_metal_device()?.clone())?;
                let plan = plan_for(&mut gpu, files, spec)?;
                gpu.prepare(plan.kernels())?;
                Ok(Box::new(PlanExecutor::new(gpu, plan)))
            }
            #[cfg(not(target_os = "macos"))]
            {
                let _ = (device, files, spec);
                Err(WorkerError::Unsupported("the Metal step plan runs on macOS".into()))
            }
        }
        PlanTarget::MetalEmulated => {
            #[cfg(feature = "metal-emulated")]
            {
                let _ = device;
                let mut gpu = kernels::metal::emulated::EmulatedGpu::new()?;
                let plan = plan_for(&mut gpu, files, spec)?;
                gpu.prepare(plan.kernels())?;
                let counters = gpu.counters();
                tracing::info!(
                    "metal-emulated: {} buffers, {} bytes allocated at load",
                    counters.allocations,
                    counters.allocated_bytes
                );
                Ok(Box::new(PlanExecutor::new(gpu, plan)))
            }
            #[cfg(not(feature = "metal-emulated"))]
            {
                let _ = (device, files, spec);
                Err(WorkerError::Unsupported("this build has no metal-emulated device".into()))
            }
        }
    }
}

/// The plan of `files` on `gpu`.
pub fn plan_for<G: Gpu>(gpu: &mut G, files: &ModelFiles, spec: PlanSpec) -> Result<StepPlan<G::Buffer>> {
    check_supported(&files.config)?;
    let PlanSpec { dtype, quantize, cache, layers, limits } = spec;
    let (source, cfg) = Source::open(files, dtype, quantize)?;
    let cfg = &cfg;
    let weights = plan_weights::upload(gpu, cfg, &source, limits.max_model_len, layers)?;
    let shape = ModelShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        rotary_dim: cfg.rotary_dim,
        vocab: cfg.vocab_size,
        eps: cfg.rms_norm_eps as f32,
        attention_scale: (1.0 / cfg.query_pre_attn_scalar.sqrt()) as f32,
        embed_scale: if cfg.gemma_norms { (cfg.hidden_size as f32).sqrt() } else { 1.0 },
        activation: crate::models::gate_of(cfg.activation),
        max_positions: limits.max_model_len,
    };
    Ok(StepPlan::new(gpu, shape, weights, limits, cache)?)
}

/// What the plan's kernels do not do yet, refused by name.
fn check_supported(cfg: &ModelConfig) -> Result<()> {
    let refuse = |what: &str| {
        Err(WorkerError::Unsupported(format!("the Metal step plan does not run {what} yet ({:?})", cfg.architecture)))
    };
    if cfg.moe.num_experts > MAX_EXPERTS {
        return refuse(&format!("routers of {} experts (at most {MAX_EXPERTS})", cfg.moe.num_experts));
    }
    if padded_head_dim(cfg.head_dim).is_none() {
        return refuse(&format!("head_dim {} (it takes even head dims up to 256)", cfg.head_dim));
    }
    Ok(())
}
