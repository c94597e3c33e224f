//! The options every engine-running subcommand shares (`generate`, `bench`,
//! `serve`), and the engine they build.

use anyhow::Context;
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use common::pipeline::LayerRange;
use common::protocol::DownloadProgress;
use engine_core::{SchedulingPolicy, SpecMethod, SpeculativeConfig};
use kernels::KvCacheDtype;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::pipeline::stage::StageConfig;
use worker::runner::device::{DeviceChoice, PlanTarget};
use worker::runner::kv_cache::KvBudget;
use worker::tier::TierConfig;
use worker::{Engine, EngineConfig, Quantization};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DTypeArg {
    Auto,
    F32,
    F16,
    Bf16,
}

/// `--kv-cache-dtype`, vLLM's name for how the KV cache stores values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeArg {
    /// The activations' dtype (f32 on the CPU).
    Auto,
    /// Half the bytes of f32: twice the tokens in the same memory.
    F16,
    /// int8 values with one f32 scale per token and kv head (CPU only):
    /// ~3.8x the tokens of f32 for head_dim 64, ~3.9x for 128.
    #[value(name = "q8_0")]
    Q8_0,
}

impl KvCacheDtypeArg {
    pub fn format(self) -> Option<KvCacheDtype> {
        match self {
            Self::Auto => None,
            Self::F16 => Some(KvCacheDtype::F16),
            Self::Q8_0 => Some(KvCacheDtype::Q8_0),
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DeviceArg {
    Auto,
    Cpu,
    Metal,
    /// The Metal step plan in the CPU emulator of our Metal kernels (Linux
    /// tests of what a Mac runs; slow).
    MetalEmulated,
}

#[derive(Args)]
pub struct EngineArgs {
    /// A Hugging Face model directory, a hub id (e.g. Qwen/Qwen3-0.6B), a GGUF file, random:<preset>
    /// (smollm-135m, tinyllama-1.1b, qwen3-0.6b, llama-3.2-1b, qwen3-30b-a3b, gpt-oss-20b,
    /// gemma3-4b, mixtral-8x7b) for seeded random weights, or builtin:stories260K (the default:
    /// a 1 MB trained model in the binary).
    #[arg(long, default_value = common::model::DEFAULT_MODEL)]
    pub model: String,
    /// Precision of the weights: auto keeps the checkpoint's (bf16 loads as f32
    /// on CPUs other than x86-64; random presets use f16).
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DTypeArg,
    /// Where the model runs: auto is Metal on Apple Silicon with macOS 15 or newer, else the CPU;
    /// metal-emulated runs the Metal step in the CPU emulator of our kernels (for tests).
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// KV cache size in bytes (default: a quarter of the available memory).
    #[arg(long)]
    kv_cache_memory: Option<u64>,
    /// How the KV cache stores keys and values: auto (the activations'
    /// dtype), f16, or q8_0 (CPU only); a narrower cache holds more tokens
    /// in the same --kv-cache-memory.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtypeArg,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// The prefix cache's second tier, in bytes: blocks evicted from the
    /// KV cache keep their keys and values here and are copied back when a
    /// prompt reuses them (an agent's history), instead of recomputed. In
    /// host memory, or in --kv-offload-dir (default there: 8 GiB).
    #[arg(long)]
    kv_offload_bytes: Option<u64>,
    /// Keep the second tier in this directory (an SSD): it outlives the
    /// worker, and a restarted worker serves and announces what it holds.
    #[arg(long)]
    kv_offload_dir: Option<std::path::PathBuf>,
    /// Token budget of one step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Context length (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Turn off automatic prefix caching (every prompt is computed in full).
    #[arg(long)]
    no_prefix_caching: bool,
    /// Which waiting request runs next: fcfs (arrival order; a request's
    /// `priority` is ignored) or priority (vLLM's: lowest `priority` first,
    /// then arrival; when blocks run out, the least urgent running request
    /// is preempted).
    #[arg(long, value_enum, default_value = "fcfs")]
    scheduling_policy: SchedulingPolicyArg,
    /// Quantize linear weights at load time, in GGML's formats (CPU only):
    /// q8_0 (8.5 bits per weight) or q4_0 (4.5 bits).
    #[arg(long, value_parser = super::weight_format(&Quantization::BLOCK_FORMATS))]
    quantize: Option<Quantization>,
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// A tokenizer.json to read the vocabulary from (for structured
    /// outputs, and text), for a model that has none, such as a random:<preset>
    /// (tinyllama-1.1b has Llama 2's 32,000 tokens, as tests/models/tiny-qwen3 does).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SchedulingPolicyArg {
    Fcfs,
    Priority,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SpeculativeMethod {
    Off,
    /// Prompt lookup: the tokens that followed the latest n-gram's earlier occurrence.
    Ngram,
    /// A small model with the same tokenizer proposes (--draft-model).
    Draft,
}

/// Speculative decoding, with vLLM's names.
#[derive(Args, Clone, Debug)]
pub struct SpeculativeArgs {
    /// Propose tokens and verify them in the step's forward pass (requests
    /// may still turn it on or off for themselves).
    #[arg(long, value_enum, default_value = "off")]
    pub speculative_method: SpeculativeMethod,
    /// The draft model of --speculative-method draft: a Hugging Face directory,
    /// hub id or random:<preset> with the target's vocabulary (its KV cache
    /// shares the target's budget). Requests may choose "draft" only where one is loaded.
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Tokens proposed per step (1-16).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=common::MAX_SPECULATIVE_TOKENS as i64))]
    pub num_speculative_tokens: u32,
    /// Shortest suffix the n-gram proposer matches.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub prompt_lookup_min: u32,
    /// Longest suffix the n-gram proposer matches.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub prompt_lookup_max: u32,
    /// A step stops proposing once its running requests times (k + 1)
    /// exceed this many tokens: the pass is then compute-bound.
    #[arg(long, default_value_t = engine_core::spec::DEFAULT_MAX_BATCH_TOKENS)]
    pub speculative_max_batch_tokens: usize,
}

impl SpeculativeArgs {
    pub fn config(&self) -> anyhow::Result<SpeculativeConfig> {
        anyhow::ensure!(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            "--prompt-lookup-min ({}) is above --prompt-lookup-max ({})",
            self.prompt_lookup_min,
            self.prompt_lookup_max
        );
        anyhow::ensure!(
            (self.speculative_method == SpeculativeMethod::Draft) <= self.draft_model.is_some(),
            "--speculative-method draft needs --draft-model"
        );
        Ok(SpeculativeConfig {
            enabled_by_default: self.speculative_method != SpeculativeMethod::Off,
            default_method: match self.speculative_method {
                SpeculativeMethod::Draft => SpecMethod::Draft,
                SpeculativeMethod::Off | SpeculativeMethod::Ngram => SpecMethod::Ngram,
            },
            has_draft_model: self.draft_model.is_some(),
            num_speculative_tokens: self.num_speculative_tokens as usize,
            prompt_lookup_min: self.prompt_lookup_min as usize,
            prompt_lookup_max: self.prompt_lookup_max as usize,
            max_batch_tokens: self.speculative_max_batch_tokens,
        })
    }
}

/// A model's files, where it runs (and that in words), and in what dtype.
pub struct Resolved {
    pub files: ModelFiles,
    pub device: Device,
    pub description: String,
    pub dtype: DType,
    /// The step as a plan of our GPU kernels (`metal-emulated`).
    pub plan: Option<PlanTarget>,
}

/// Finds the model's files and picks the device and dtype.
pub fn resolve(args: &EngineArgs) -> anyhow::Result<Resolved> {
    resolve_need(args, Need::Weights)
}

/// As [`resolve`] without the weights (a hub model's config and tokenizer
/// files only): what a worker reads before it knows its layers. Then
/// [`fetch_weights`].
pub fn resolve_config(args: &EngineArgs) -> anyhow::Result<Resolved> {
    resolve_need(args, Need::Tokenizer)
}

/// Finds (or downloads) the weights of `layers` (every layer if `None`):
/// of sharded weights only the shards a pipeline stage reads. `progress`
/// hears how a download goes.
pub fn fetch_weights(
    args: &EngineArgs,
    resolved: &mut Resolved,
    layers: Option<LayerRange>,
    progress: &mut dyn FnMut(&DownloadProgress),
) -> anyhow::Result<()> {
    let need = match layers.filter(|l| !l.is_full()) {
        Some(layers) => Need::Layers(layers),
        None => Need::Weights,
    };
    let mut files = ModelFiles::resolve_reporting(&ModelSource::parse(&args.model)?, need, progress)?;
    files.tokenizer_json = resolved.files.tokenizer_json.take();
    resolved.files = files;
    Ok(())
}

fn resolve_need(args: &EngineArgs, need: Need) -> anyhow::Result<Resolved> {
    let mut files = ModelFiles::resolve(&ModelSource::parse(&args.model)?, need)?;
    if let Some(tokenizer) = &args.tokenizer {
        anyhow::ensure!(tokenizer.is_file(), "--tokenizer {}: no such file", tokenizer.display());
        files.tokenizer_json = Some(tokenizer.clone());
    }
    if files.random_weights {
        tracing::warn!("note: {} has RANDOM weights: outputs are meaningless, use it for speed only", files.name);
    }
    let selected = worker::runner::device::select(match args.device {
        DeviceArg::Auto => DeviceChoice::Auto,
        DeviceArg::Cpu => DeviceChoice::Cpu,
        DeviceArg::Metal => DeviceChoice::Metal,
        DeviceArg::MetalEmulated => DeviceChoice::MetalEmulated,
    })?;
    tracing::info!("device: {}", selected.description);
    let device = selected.device.clone();
    let dtype = resolve_dtype(args.dtype, &files, &device);
    Ok(Resolved { files, device, description: selected.description, dtype, plan: selected.plan })
}

/// The loaded engine, its model's files, and the device in words.
pub fn build_engine(args: &EngineArgs) -> anyhow::Result<(Engine, ModelFiles, String)> {
    build_engine_from(args, resolve(args)?, None)
}

/// As [`build_engine`], holding only `layers` (the first stage of a pipeline).
pub fn build_engine_from(
    args: &EngineArgs,
    resolved: Resolved,
    layers: Option<LayerRange>,
) -> anyhow::Result<(Engine, ModelFiles, String)> {
    let Resolved { files, device, description, dtype, plan } = resolved;
    let config = EngineConfig {
        device,
        dtype,
        block_size: args.block_size,
        kv_budget: kv_budget(args),
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        enable_prefix_caching: !args.no_prefix_caching,
        policy: match args.scheduling_policy {
            SchedulingPolicyArg::Fcfs => SchedulingPolicy::Fcfs,
            SchedulingPolicyArg::Priority => SchedulingPolicy::Priority,
        },
        quantization: args.quantize,
        layers,
        speculative: args.speculative.config()?,
        draft_model: match &args.speculative.draft_model {
            Some(spec) => Some(
                ModelFiles::resolve(&ModelSource::parse(spec)?, Need::Weights)
                    .with_context(|| format!("--draft-model {spec}"))?,
            ),
            None => None,
        },
        kv_cache_dtype: args.kv_cache_dtype.format(),
        plan,
        kv_tier: TierConfig {
            bytes: args.kv_offload_bytes.unwrap_or(if args.kv_offload_dir.is_some() { 8 << 30 } else { 0 }),
            dir: args.kv_offload_dir.clone(),
        },
        ..EngineConfig::default()
    };
    let engine = Engine::new(&files, config).with_context(|| format!("loading {}", files.name))?;
    let stats = engine.stats();
    tracing::info!(
        "loaded {} ({dtype:?}), KV cache: {} blocks of {} ({} tokens), {}, {:.1} MiB",
        files.name,
        stats.kv_blocks_total,
        args.block_size,
        stats.kv_blocks_total * args.block_size,
        engine.kv_cache_dtype(),
        engine.kv_cache_bytes() as f64 / (1u64 << 20) as f64
    );
    Ok((engine, files, description))
}

/// How a later pipeline stage (one without layer 0) is built.
pub fn stage_config(args: &EngineArgs, resolved: &Resolved, layers: LayerRange) -> StageConfig {
    StageConfig {
        device: resolved.device.clone(),
        dtype: resolved.dtype,
        layers,
        block_size: args.block_size,
        kv_budget: kv_budget(args),
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        quantization: args.quantize,
        kv_cache_dtype: args.kv_cache_dtype.format(),
        plan: resolved.plan,
        max_num_batched_tokens: args.max_num_batched_tokens,
        num_speculative_tokens: args.speculative.num_speculative_tokens as usize,
    }
}

fn kv_budget(args: &EngineArgs) -> KvBudget {
    args.kv_cache_memory.map_or(KvBudget::FractionOfAvailable(0.25), KvBudget::Bytes)
}

impl EngineArgs {
    /// `serve --memory-limit`: without `--kv-cache-memory` the KV cache
    /// takes a quarter of `bytes`, as it would of the available memory.
    pub fn memory_limit(&mut self, bytes: u64) {
        self.kv_cache_memory.get_or_insert(bytes / 4);
    }

    pub fn quantization(&self) -> Option<Quantization> {
        self.quantize
    }
}

/// `auto` keeps the checkpoint's precision, except that bf16 runs as f32 on
/// a CPU without our packed kernels (x86-64 has them: bf16 is then widened
/// in registers, exactly, at f16's speed and half f32's memory; elsewhere
/// candle's bf16 matmul would widen the whole weight on every call); random
/// presets use f16, the precision of the llama.cpp baseline.
fn resolve_dtype(arg: DTypeArg, files: &ModelFiles, device: &Device) -> DType {
    match arg {
        DTypeArg::F32 => DType::F32,
        DTypeArg::F16 => DType::F16,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::Auto if files.random_weights => DType::F16,
        DTypeArg::Auto => match files.config.weights_dtype.as_deref() {
            Some("float16") => DType::F16,
            Some("bfloat16") if !device.is_cpu() || kernels::cpu::packed::packing_pays() => DType::BF16,
            _ => DType::F32,
        },
    }
}

/// Runs `f` (the engine's step loop) on one of the threads of rayon's
/// global pool, the pool the CPU kernels split their work over. From a
/// thread outside the pool every kernel call hands its work to the pool and
/// sleeps until it is done: two cross-thread wake-ups per call, ~90 calls
/// per decode step. On a pool thread the caller works on its share at once
/// and takes back what a sleeping sibling has not yet started.
pub fn on_the_kernel_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}
