//! `tinyvllm-worker`: run a model locally (`generate`), or measure it (`bench`).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, bail};
use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand, ValueEnum};
use common::model::{ModelFiles, ModelSource, Need, default_served_name};
use common::{RequestId, SamplingParams};
use worker::device::DeviceChoice;
use worker::kv_cache::KvBudget;
use worker::{Engine, EngineConfig};

#[derive(Parser)]
#[command(name = "tinyvllm-worker", version, about = "tinyvllm worker: a vLLM-style engine on candle")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of one prompt, streamed to stdout.
    Generate(GenerateArgs),
    /// Offline throughput benchmark (vLLM's benchmark_throughput style).
    Bench(BenchArgs),
    /// Join a cluster: dial the coordinator over QUIC and serve its requests.
    Serve(ServeArgs),
    /// Write a Hugging Face directory with seeded random weights at a real
    /// model's shape and another model's tokenizer (for cluster benchmarks
    /// that need realistic compute without downloading a model).
    ExportRandom(ExportRandomArgs),
    /// Write a model (a HF directory or random:<preset>) as one GGUF file,
    /// so llama.cpp and this engine can run the same weights.
    ExportGguf(ExportGgufArgs),
}

#[derive(Args)]
struct ExportGgufArgs {
    /// A Hugging Face model directory or random:<preset>.
    #[arg(long)]
    model: String,
    #[arg(long)]
    out: std::path::PathBuf,
    /// Storage of the linear weights (norms stay f32, the embedding f16).
    #[arg(long, value_enum, default_value = "f16")]
    r#type: GgufTypeArg,
    /// Seed of random:<preset> weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum GgufTypeArg {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

#[derive(Args)]
struct ExportRandomArgs {
    /// smollm-135m, tinyllama-1.1b, qwen3-0.6b or llama-3.2-1b.
    #[arg(long)]
    preset: String,
    /// A model directory whose tokenizer (and vocabulary size, BOS/EOS) to use.
    #[arg(long)]
    tokenizer_from: std::path::PathBuf,
    #[arg(long)]
    out: std::path::PathBuf,
    #[arg(long, value_enum, default_value = "f16")]
    dtype: DTypeArg,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The coordinator's QUIC address, HOST:PORT.
    #[arg(long)]
    coordinator: String,
    /// This worker's name in logs, metrics and /v1/workers (default: host name and pid).
    #[arg(long)]
    name: Option<String>,
    /// File holding the cluster secret (the coordinator writes one at start).
    #[arg(long, env = "TINYVLLM_CLUSTER_SECRET_FILE")]
    cluster_secret_file: std::path::PathBuf,
    /// Serve Prometheus metrics (vLLM's names) on HOST:PORT; port 0 picks a
    /// free one. The coordinator lists it at /v1/prometheus/targets.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// The model name in metric labels (default: the model directory's name,
    /// as the coordinator's default --served-model-name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Exit when the process that started this worker exits (set by the
    /// coordinator for its local workers, so none outlive it).
    #[arg(long)]
    exit_with_parent: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    Auto,
    F32,
    F16,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceArg {
    Auto,
    Cpu,
    Metal,
}

#[derive(Args)]
struct EngineArgs {
    /// A Hugging Face model directory, a hub id (e.g. Qwen/Qwen3-0.6B), or random:<preset>
    /// (tinyllama-1.1b, qwen3-0.6b, llama-3.2-1b) for seeded random weights.
    #[arg(long)]
    model: String,
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DTypeArg,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// KV cache size in bytes (default: a quarter of the available memory).
    #[arg(long)]
    kv_cache_memory: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    /// Context length (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long)]
    no_prefix_caching: bool,
    /// Quantize linear weights at load time, in GGML's formats (CPU only):
    /// q8_0 (8.5 bits per weight) or q4_0 (4.5 bits).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeArg>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum QuantizeArg {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Prompt text (tokenized with the model's tokenizer.json, BOS added as configured).
    #[arg(long, conflicts_with = "prompt_token_ids", required_unless_present = "prompt_token_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,403,407.
    #[arg(long, value_delimiter = ',')]
    prompt_token_ids: Option<Vec<u32>>,
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    #[arg(long, default_value_t = 16)]
    num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    input_len: usize,
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also print where a decode step's time goes (matmuls, attention,
    /// other model ops, sampling, scheduler, other).
    #[arg(long)]
    profile: bool,
    /// Score each prompt as well: the logprob of every prompt token and of
    /// this many top tokens at each position (vLLM's `prompt_logprobs`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=20))]
    prompt_logprobs: Option<u32>,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Generate(args) => generate(args),
        Command::Bench(args) => bench(args),
        Command::Serve(args) => serve(args),
        Command::ExportRandom(args) => export_random(args),
        Command::ExportGguf(args) => export_gguf(args),
    }
}

fn build_engine(args: &EngineArgs) -> anyhow::Result<(Engine, ModelFiles, String)> {
    let files = ModelFiles::resolve(&ModelSource::parse(&args.model)?, Need::Weights)?;
    if files.random_weights {
        eprintln!("note: {} has RANDOM weights: outputs are meaningless, use it for speed only", files.name);
    }
    let selected = worker::device::select(match args.device {
        DeviceArg::Auto => DeviceChoice::Auto,
        DeviceArg::Cpu => DeviceChoice::Cpu,
        DeviceArg::Metal => DeviceChoice::Metal,
    })?;
    eprintln!("device: {}", selected.description);
    let device = selected.device.clone();
    let dtype = resolve_dtype(args.dtype, &files, &device);
    let config = EngineConfig {
        device,
        dtype,
        block_size: args.block_size,
        kv_budget: args.kv_cache_memory.map_or(KvBudget::FractionOfAvailable(0.25), KvBudget::Bytes),
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        max_model_len: args.max_model_len,
        enable_prefix_caching: !args.no_prefix_caching,
        quantization: args.quantize.map(|q| match q {
            QuantizeArg::Q8_0 => worker::Quantization::Q8_0,
            QuantizeArg::Q4_0 => worker::Quantization::Q4_0,
        }),
        ..EngineConfig::default()
    };
    let engine = Engine::new(&files, config).with_context(|| format!("loading {}", files.name))?;
    let stats = engine.stats();
    eprintln!("loaded {} ({dtype:?}), KV cache: {} blocks of {}", files.name, stats.kv_blocks_total, args.block_size);
    Ok((engine, files, selected.description))
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

fn load_tokenizer(files: &ModelFiles) -> anyhow::Result<tokenizers::Tokenizer> {
    let path = files.tokenizer_json.as_deref().with_context(|| format!("{} has no tokenizer.json", files.name))?;
    tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", Path::new(path).display()))
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let (mut engine, files, _device) = build_engine(&args.engine)?;
    let tokenizer = if files.tokenizer_json.is_some() { Some(load_tokenizer(&files)?) } else { None };
    let prompt_ids = match (&args.prompt, &args.prompt_token_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = tokenizer.as_ref().context("--prompt needs a tokenizer.json; use --prompt-token-ids")?;
            tok.encode(text.as_str(), true)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()
        }
        (None, None) => bail!("give --prompt or --prompt-token-ids"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        ..SamplingParams::default()
    };
    engine.add_request(RequestId(0), prompt_ids, params, 0)?;
    let mut generated = Vec::new();
    let mut printed = 0; // bytes of decoded text already written
    let mut stdout = std::io::stdout();
    while engine.has_unfinished() {
        for out in engine.step()? {
            generated.extend_from_slice(&out.new_token_ids);
        }
        if let (Some(tok), false) = (&tokenizer, args.json) {
            // Re-decode and print what is new; hold back a trailing partial
            // UTF-8 character (shown as U+FFFD) until its last byte arrives.
            let text = tok.decode(&generated, false).map_err(|e| anyhow::anyhow!("{e}"))?;
            if text.len() > printed && !text.ends_with('\u{FFFD}') {
                if let Some(new) = text.get(printed..) {
                    write!(stdout, "{new}")?;
                    stdout.flush()?;
                }
                printed = text.len();
            }
        }
    }
    let text = match &tokenizer {
        Some(tok) => tok.decode(&generated, true).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => String::new(),
    };
    if args.json {
        println!("{}", serde_json::json!({ "token_ids": generated, "text": text }));
    } else if tokenizer.is_none() {
        println!("{generated:?}");
    } else {
        println!();
    }
    Ok(())
}

/// Runs `f` (the engine's step loop) on one of the threads of rayon's
/// global pool, the pool the CPU kernels split their work over. From a
/// thread outside the pool every kernel call hands its work to the pool and
/// sleeps until it is done: two cross-thread wake-ups per call, ~90 calls
/// per decode step. On a pool thread the caller works on its share at once
/// and takes back what a sleeping sibling has not yet started.
fn on_the_kernel_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let (mut engine, files, _device) = build_engine(&args.engine)?;
    let bench_args = worker::bench::BenchArgs {
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        seed: args.seed,
        profile: args.profile,
        prompt_logprobs: args.prompt_logprobs,
    };
    let report = on_the_kernel_pool(|| worker::bench::run(&mut engine, &bench_args))?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": files.name, "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                "elapsed_s": report.elapsed.as_secs_f64(), "requests_per_s": report.requests_per_s,
                "output_tok_per_s": report.output_tok_per_s, "total_tok_per_s": report.total_tok_per_s,
                "ttft_ms": {"mean": report.ttft.mean_ms, "p50": report.ttft.p50_ms, "p99": report.ttft.p99_ms},
                "tpot_ms": {"mean": report.tpot.mean_ms, "p50": report.tpot.p50_ms, "p99": report.tpot.p99_ms},
                "peak_kv_blocks_used": report.peak_kv_blocks_used, "kv_blocks_total": report.kv_blocks_total,
            })
        );
    } else {
        println!("model: {}{}", files.name, if files.random_weights { " (random weights)" } else { "" });
        println!("{report}");
    }
    Ok(())
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use worker::service::{self, ServeConfig};
    let secret = std::fs::read_to_string(&args.cluster_secret_file)
        .with_context(|| format!("reading the cluster secret from {}", args.cluster_secret_file.display()))?
        .trim()
        .to_string();
    anyhow::ensure!(!secret.is_empty(), "{} is empty", args.cluster_secret_file.display());
    if args.exit_with_parent {
        watch_parent();
    }
    let (engine, files, device) = build_engine(&args.engine)?;
    let name = args.name.clone().unwrap_or_else(|| {
        let host =
            std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", std::process::id())
    });
    let stats = engine.stats();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut metrics = None;
    let mut metrics_address = None;
    if let Some(addr) = args.metrics {
        let listener = runtime
            .block_on(worker::metrics::bind(addr))
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        let model_name = args.served_model_name.clone().unwrap_or_else(|| default_served_name(&args.engine.model));
        let engine_metrics = worker::metrics::EngineMetrics::new(&model_name, &name);
        let registry = engine_metrics.registry().clone();
        runtime.spawn(worker::metrics::serve_metrics(
            listener,
            std::sync::Arc::new(move || worker::metrics::render(&registry)),
        ));
        eprintln!("worker {name}: metrics on http://{bound}/metrics");
        metrics = Some(engine_metrics);
        metrics_address = Some(bound.to_string());
    }
    let config = ServeConfig {
        coordinator: args.coordinator.clone(),
        name,
        secret,
        model: files.identity(),
        block_size: args.engine.block_size as u32,
        max_model_len: engine.scheduler().config().max_model_len as u64,
        metrics_address,
        device,
    };
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
    let (out_tx, out_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine_thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || on_the_kernel_pool(|| service::engine_loop(engine, cmd_rx, out_tx, metrics)))?;
    let drain = cmd_tx.clone();
    let result = runtime.block_on(async move {
        // SIGTERM drains: running requests finish and stream out, new ones
        // are refused, then the engine stops and serve() returns.
        tokio::spawn(async move {
            common::transport::shutdown_signal().await;
            eprintln!("signal received: draining");
            let _ = drain.send(service::EngineCommand::Drain);
        });
        service::serve(config, stats.kv_blocks_total as u64, cmd_tx, out_rx).await
    });
    // Dropping the runtime drops the signal task's sender too, so the engine
    // thread sees its channel close and stops.
    drop(runtime);
    let _ = engine_thread.join();
    Ok(result?)
}

fn export_random(args: ExportRandomArgs) -> anyhow::Result<()> {
    use worker::models::loader::{random_preset_json, random_weights};
    let source: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(args.tokenizer_from.join("config.json"))
            .with_context(|| format!("reading {}/config.json", args.tokenizer_from.display()))?,
    )?;
    let mut config: serde_json::Value = serde_json::from_str(random_preset_json(&args.preset)?)?;
    for key in ["vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = source.get(key) {
            config[key] = v.clone();
        }
    }
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 | DTypeArg::Auto => DType::F16,
    };
    config["torch_dtype"] = serde_json::json!(match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        _ => "float16",
    });
    let cfg = worker::models::ModelConfig::from_json(&config.to_string())?;
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let weights = random_weights(&cfg, dtype, &Device::Cpu, args.seed)?;
    candle_core::safetensors::save(&weights, args.out.join("model.safetensors"))?;
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "tokenizer.model"] {
        let from = args.tokenizer_from.join(file);
        if from.exists() {
            std::fs::copy(&from, args.out.join(file))?;
        }
    }
    let params: usize = weights.values().map(|t| t.elem_count()).sum();
    println!("wrote {} ({} parameters, {:?})", args.out.display(), params, dtype);
    Ok(())
}

/// Exits once this process is re-parented (its parent died).
fn watch_parent() {
    #[cfg(unix)]
    {
        let parent = std::os::unix::process::parent_id();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(std::time::Duration::from_millis(500));
                if std::os::unix::process::parent_id() != parent {
                    eprintln!("parent process exited; stopping");
                    std::process::exit(0);
                }
            }
        });
    }
}

fn export_gguf(args: ExportGgufArgs) -> anyhow::Result<()> {
    use worker::models::gguf::{ExportType, Vocab};
    let files = ModelFiles::resolve(&ModelSource::parse(&args.model)?, Need::Weights)?;
    let tensors = if files.random_weights {
        worker::models::loader::random_weights(&files.config, DType::F32, &Device::Cpu, args.seed)?
    } else {
        anyhow::ensure!(files.gguf.is_none(), "{} already is a GGUF file", files.name);
        let mut all = std::collections::HashMap::new();
        for path in &files.weights {
            all.extend(candle_core::safetensors::load(path, &Device::Cpu)?);
        }
        all
    };
    let vocab = Vocab::from_tokenizer_json(
        files.tokenizer_json.as_deref(),
        files.config.vocab_size,
        files.bos_token_id.unwrap_or(1),
        files.eos_token_ids.first().copied().unwrap_or(2),
    )?;
    let ty = match args.r#type {
        GgufTypeArg::F32 => ExportType::F32,
        GgufTypeArg::F16 => ExportType::F16,
        GgufTypeArg::Q8_0 => ExportType::Q8_0,
        GgufTypeArg::Q4_0 => ExportType::Q4_0,
    };
    worker::models::gguf::write(&args.out, &files.config, &tensors, ty, &vocab)?;
    eprintln!("wrote {} ({ty:?}) from {}", args.out.display(), files.name);
    Ok(())
}
