//! A model's step as one plan of our GPU kernels (`kernels::metal::step`):
//! the weights uploaded once, the step's buffers allocated once, and each
//! step encoded into one command buffer. The model runner hands it the
//! step's flattened batch and gets the wanted rows' logits back.
//!
//! The plan is generic over the GPU ([`Gpu`]); `--device metal-emulated`
//! runs it in the CPU emulator of our Metal kernels.

use candle_core::DType;
use kernels::metal::step::{
    Gpu, ModelShape, Readback, SampleRow, Sampled, StepInputs, StepLimits, StepOutput, StepPlan, WeightFormat,
    padded_head_dim,
};

use crate::error::{Result, WorkerError};
use crate::models::{ModelConfig, ModelFiles};
use crate::runner::device::PlanTarget;
use crate::runner::model_runner::BatchInputs;
use crate::runner::plan_weights::{self, Source};

/// What a model runner needs of a plan, whatever its GPU.
pub trait StepExecutor: Send {
    /// Runs a step; the logits of `rows` (`[rows, vocab]`), or nothing for no rows.
    fn logits(&mut self, batch: &BatchInputs, rows: &[u32]) -> Result<Vec<f32>>;
    /// Whether [`sample`](Self::sample) takes these rows (the sampler's
    /// buffers hold them).
    fn samples(&self, params: &[SampleRow]) -> bool;
    /// Runs a step and draws each of `rows` on the GPU with `params` (one
    /// sampler dispatch in the step's command buffer): only the tokens, and
    /// what their logprobs need, come back.
    fn sample(&mut self, batch: &BatchInputs, rows: &[u32], params: &[SampleRow]) -> Result<Vec<Sampled>>;
    /// Bytes of weights the GPU holds.
    fn weight_bytes(&self) -> usize;
    /// Bytes of the KV pools.
    fn kv_bytes(&self) -> usize;
    /// Starts or stops measuring each step's device-memory traffic; false
    /// where the GPU cannot count (only the emulator can).
    fn count_traffic(&mut self, on: bool) -> bool;
    /// The last step's traffic, while counting.
    fn last_traffic(&self) -> Option<Traffic>;
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

    /// One step, its traffic recorded while counting.
    fn run(&mut self, batch: &BatchInputs, rows: &[u32], readback: Readback) -> Result<StepOutput> {
        let inputs = StepInputs {
            input_ids: &batch.input_ids,
            positions: &batch.positions,
            meta: &batch.meta,
            logit_rows: rows,
        };
        let before = self.gpu.traffic_bytes();
        let out = self.plan.run(&mut self.gpu, &inputs, readback)?;
        if self.counting
            && let (Some(before), Some(after)) = (before, self.gpu.traffic_bytes())
        {
            let must_read = self.plan.weight_bytes() + self.plan.kv_read_bytes(&batch.meta);
            self.last_traffic = Some(Traffic { touched: after - before, must_read: must_read as u64 });
        }
        Ok(out)
    }
}

impl<G> StepExecutor for PlanExecutor<G>
where
    G: Gpu + Send,
    G::Buffer: Send,
{
    fn logits(&mut self, batch: &BatchInputs, rows: &[u32]) -> Result<Vec<f32>> {
        match self.run(batch, rows, Readback::Logits)? {
            StepOutput::Logits(logits) => Ok(logits),
            StepOutput::Sampled(_) => Err(WorkerError::Unsupported("the plan sampled where logits were asked".into())),
        }
    }

    fn samples(&self, params: &[SampleRow]) -> bool {
        self.plan.samples(params)
    }

    fn sample(&mut self, batch: &BatchInputs, rows: &[u32], params: &[SampleRow]) -> Result<Vec<Sampled>> {
        match self.run(batch, rows, Readback::Sample(params))? {
            StepOutput::Sampled(sampled) => Ok(sampled),
            StepOutput::Logits(_) => {
                Err(WorkerError::Unsupported("the plan read logits where draws were asked".into()))
            }
        }
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
}

/// Builds the plan of `files` on `target`: uploads the weights (in `dtype`)
/// and allocates the KV pools (`cache` dtype) and the step's buffers.
pub fn build(
    target: PlanTarget,
    device: &candle_core::Device,
    files: &ModelFiles,
    (dtype, quantize): (DType, Option<WeightFormat>),
    cache: DType,
    limits: StepLimits,
) -> Result<Box<dyn StepExecutor>> {
    match target {
        PlanTarget::Metal => {
            #[cfg(target_os = "macos")]
            {
                let mut gpu = kernels::metal::gpu::MetalGpu::new(device.as_metal_device()?.clone())?;
                let plan = plan_for(&mut gpu, files, (dtype, quantize), cache, limits)?;
                gpu.prepare(plan.kernels())?;
                Ok(Box::new(PlanExecutor::new(gpu, plan)))
            }
            #[cfg(not(target_os = "macos"))]
            {
                let _ = (device, files, dtype, quantize, cache, limits);
                Err(WorkerError::Unsupported("the Metal step plan runs on macOS".into()))
            }
        }
        PlanTarget::MetalEmulated => {
            #[cfg(feature = "metal-emulated")]
            {
                let _ = device;
                let mut gpu = kernels::metal::emulated::EmulatedGpu::new()?;
                let plan = plan_for(&mut gpu, files, (dtype, quantize), cache, limits)?;
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
                let _ = (device, files, dtype, quantize, cache, limits);
                Err(WorkerError::Unsupported("this build has no metal-emulated device".into()))
            }
        }
    }
}

/// The plan of `files` on `gpu`.
pub fn plan_for<G: Gpu>(
    gpu: &mut G,
    files: &ModelFiles,
    (dtype, quantize): (DType, Option<WeightFormat>),
    cache: DType,
    limits: StepLimits,
) -> Result<StepPlan<G::Buffer>> {
    check_supported(&files.config)?;
    let (source, cfg) = Source::open(files, dtype, quantize)?;
    let cfg = &cfg;
    let weights = plan_weights::upload(gpu, cfg, &source, limits.max_model_len)?;
    let shape = ModelShape {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        heads: cfg.num_heads,
        kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        vocab: cfg.vocab_size,
        eps: cfg.rms_norm_eps as f32,
        max_positions: limits.max_model_len,
    };
    Ok(StepPlan::new(gpu, shape, weights, limits, cache)?)
}

/// What the plan's kernels do not do yet, refused by name.
fn check_supported(cfg: &ModelConfig) -> Result<()> {
    let refuse = |what: &str| {
        Err(WorkerError::Unsupported(format!("the Metal step plan does not run {what} yet ({:?})", cfg.architecture)))
    };
    if padded_head_dim(cfg.head_dim).is_none() {
        return refuse(&format!("head_dim {} (it takes even head dims up to 256)", cfg.head_dim));
    }
    Ok(())
}
