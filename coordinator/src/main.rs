//! `tinyvllm-coordinator`: the cluster's front door. Serves HTTP (OpenAI
//! API, /generate, /health, /metrics), accepts workers over QUIC, and with
//! `--local-workers N` starts and supervises N workers on this host, so one
//! command runs a whole cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use common::model::{ModelFiles, ModelSource, Need, default_served_name};
use coordinator::app::AppState;
use coordinator::cluster::Cluster;
use coordinator::reasoning::ReasoningFormat;
use coordinator::text::{ChatTemplate, Tokenizer};
use coordinator::tool_parser::ToolFormat;

#[derive(Parser)]
#[command(name = "tinyvllm-coordinator", version, about = "tinyvllm coordinator: HTTP front door of a worker cluster")]
#[command(args_conflicts_with_subcommands = true)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// A Hugging Face model directory or hub id (workers must serve the same
    /// model); the default, builtin:stories260K, is a 1 MB trained model in
    /// the binary, served with no download.
    #[arg(long, default_value = common::model::DEFAULT_MODEL)]
    model: String,
    /// HTTP listen address, HOST:PORT (a host name such as localhost, or an IP address).
    #[arg(long, default_value = "0.0.0.0:8080")]
    http: String,
    /// QUIC listen address for workers, HOST:PORT (a host name or an IP address).
    #[arg(long, default_value = "0.0.0.0:7070")]
    quic: String,
    /// Start and supervise this many workers on this host.
    #[arg(long, default_value_t = 0)]
    local_workers: usize,
    /// Log lines as human text or JSON objects (one a line, for log
    /// shippers); RUST_LOG filters them (default info). Local workers log alike.
    #[arg(long, env = common::log::FORMAT_ENV, default_value = "human")]
    log_format: common::log::LogFormat,
    /// Run the model as pipelines of this many workers each, its layers
    /// split over them: local ones (--local-workers a multiple), or remote
    /// ones started with --layers auto (split by the memory they offer).
    #[arg(long, default_value_t = 1)]
    pipeline_parallel_size: usize,
    /// Extra argument for local workers (repeatable), e.g. --worker-arg=--kv-cache-memory=1000000000
    #[arg(long = "worker-arg", allow_hyphen_values = true)]
    worker_args: Vec<String>,
    /// Require `Authorization: Bearer KEY` on the API.
    #[arg(long, env = "TINYVLLM_API_KEY")]
    api_key: Option<String>,
    /// Model name in the API (default: the model directory's base name, or the hub id).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The cluster secret workers must know; created (mode 0600) if missing.
    #[arg(long, default_value = "tinyvllm-cluster-secret")]
    cluster_secret_file: PathBuf,
    /// Most requests in flight before new ones get 429.
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    /// Context length (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// PEM certificate for QUIC (default: a self-signed one generated at start).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key matching --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// How requests are spread over workers: prefix_aware (default; cache
    /// hits weighed against load), least_load, power_of_two, round_robin.
    #[arg(long, default_value = "prefix_aware")]
    policy: coordinator::router::Policy,
    /// Tokens per KV block; workers must use the same (the router hashes
    /// prompts in blocks of this size).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// How long in-flight requests may take to finish on SIGTERM; streams
    /// still running then end with an error event and [DONE].
    #[arg(long, default_value_t = 30)]
    shutdown_timeout_secs: u64,
    /// A request's head must arrive within this many seconds (idle
    /// keep-alive connections close after it too).
    #[arg(long, default_value_t = 10)]
    http_header_timeout_secs: u64,
    /// A request's body must arrive within this many seconds (else 408).
    #[arg(long, default_value_t = 30)]
    http_body_timeout_secs: u64,
    /// Most open HTTP connections (also kept under the descriptor limit);
    /// when full, the oldest idle one is closed for a new one.
    #[arg(long, default_value_t = 1024)]
    http_max_connections: usize,
    /// Requests over 64 KiB parsed and tokenized at once, each on its own
    /// blocking thread (default: half the cores, at least 1).
    #[arg(long)]
    tokenizer_pool_size: Option<usize>,
    /// Never fetch a prompt's cached prefix from the worker holding it: a
    /// worker lacking it computes it (by default a prefix another worker
    /// holds, in its KV cache or its --kv-offload tier, is sent over to a
    /// worker with a --kv-offload tier when that beats computing it).
    #[arg(long)]
    no_peer_fetch: bool,
    /// Do not announce this coordinator on the local network (mDNS/DNS-SD
    /// `_tinyvllm._udp`), which lets workers started without --coordinator
    /// find it. The cluster secret is required either way.
    #[arg(long)]
    no_discovery: bool,
    /// How the model writes tool calls, for `tools` on the chat APIs:
    /// hermes (`<tool_call>` JSON; Hermes, Qwen 2.5/3), llama3_json (Llama
    /// 3.1/3.2 JSON), qwen3_coder (Qwen3-Coder's XML), mistral
    /// (`[TOOL_CALLS]`) or harmony (gpt-oss; also `openai`). Default:
    /// detected from the chat template.
    #[arg(long)]
    tool_call_parser: Option<coordinator::tool_parser::ToolFormat>,
    /// Keep the answers of requests sent with an `Idempotency-Key` (or
    /// `X-Request-Id`) header in this file too, so a client retrying after
    /// a restart gets the answer the first try had (kept 24 h either way;
    /// without a file, for this process's life).
    #[arg(long, value_name = "FILE")]
    idempotency_file: Option<std::path::PathBuf>,
    /// Cap every request's generated tokens at N, whatever its `max_tokens`
    /// (llama.cpp server's --n-predict): bounds each request's work, e.g.
    /// for agents that ask for 32000 tokens a turn.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens_cap: Option<u32>,
    /// How the model writes its thinking, split from the answer (chat's
    /// `reasoning_content`, Messages' thinking blocks, Responses' reasoning
    /// items): qwen3 (`<think>...</think>` when the output opens with it),
    /// deepseek_r1 (the output starts inside it), gpt_oss (Harmony's
    /// analysis channel), or none. Default: detected from the chat template.
    #[arg(long, value_name = "PARSER")]
    reasoning_parser: Option<ReasoningParserArg>,
    /// A structured output (response_format, guided decoding) covers the
    /// thinking too, as vLLM's `enable_in_reasoning`; by default the
    /// thinking is free and the constraint applies once it ends.
    #[arg(long)]
    structured_outputs_in_reasoning: bool,
}

/// `--reasoning-parser`: a format, or `none` to keep the thinking in the
/// answer when the template would have it split.
#[derive(Clone, Copy, Debug)]
enum ReasoningParserArg {
    None,
    Format(ReasoningFormat),
}

impl std::str::FromStr for ReasoningParserArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            other => other.parse().map(Self::Format),
        }
    }
}

#[derive(clap::Subcommand)]
enum Command {
    /// Print the token a worker joins this cluster with (`tinyvllm-worker
    /// serve --join TOKEN`): the cluster secret (created if missing) and the
    /// coordinator's address. Keep it as private as the secret.
    JoinToken(coordinator::join_token::JoinTokenArgs),
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    common::log::init(args.log_format);
    if let Some(Command::JoinToken(join)) = &args.command {
        let secret = load_or_create_secret(&join.cluster_secret_file)?;
        println!("{}", coordinator::join_token::token(join, secret)?);
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // The workers' QUIC links and the liveness watchdog get a runtime of
    // their own: however long HTTP handlers keep the main runtime's threads
    // busy, worker frames are read and stats counted on time.
    let cluster_runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("cluster").enable_all().build()?;
    let result = runtime.block_on(run(args, cluster_runtime.handle().clone()));
    drop(runtime);
    cluster_runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run(args: Args, cluster_runtime: tokio::runtime::Handle) -> anyhow::Result<()> {
    let source = ModelSource::parse(&args.model)?;
    // Tokenizing needs the config and tokenizer files, never the weights.
    let files = tokio::task::spawn_blocking(move || ModelFiles::resolve(&source, Need::Tokenizer)).await??;
    let tokenizer_path =
        files.tokenizer_json.clone().with_context(|| format!("{} has no tokenizer.json", files.name))?;
    let model_dir = tokenizer_path.parent().map(Path::to_path_buf).unwrap_or_default();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
    let chat_template = ChatTemplate::from_tokenizer(&tokenizer)?;
    let served_model_name = served_model_name(&args);
    let max_model_len =
        args.max_model_len.unwrap_or(files.config.max_position_embeddings).min(files.config.max_position_embeddings);
    let secret = load_or_create_secret(&args.cluster_secret_file)?;
    let layer_weights = files.config.layer_parameter_counts();
    let stages = pipeline_stages(&args, &layer_weights)?;

    anyhow::ensure!(args.block_size > 0, "--block-size must be positive");
    let mut cluster =
        Cluster::new(secret.clone(), files.identity(), args.max_queued_requests, args.policy, args.block_size)
            .with_formation(layer_weights, args.pipeline_parallel_size);
    if args.no_peer_fetch {
        cluster = cluster.without_peer_fetch();
    }
    let (cert, key) = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => common::transport::pem_cert(cert, key)?,
        _ => common::transport::self_signed_cert()?,
    };
    let quic_bind = tokio::net::lookup_host(&args.quic)
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .with_context(|| format!("--quic {}: not a HOST:PORT this machine can resolve", args.quic))?;
    let endpoint = {
        // The endpoint's driver task runs on the runtime it is made in.
        let _cluster_context = cluster_runtime.enter();
        quinn::Endpoint::server(common::transport::server_config(cert, key)?, quic_bind)
            .with_context(|| format!("binding QUIC on {} ({quic_bind})", args.quic))?
    };
    let quic_addr = endpoint.local_addr()?;
    cluster_runtime.spawn(cluster.clone().accept_workers(endpoint.clone()));
    cluster_runtime.spawn(cluster.clone().watchdog());

    let listener =
        tokio::net::TcpListener::bind(&args.http).await.with_context(|| format!("binding HTTP on {}", args.http))?;
    let http_addr = listener.local_addr()?;
    let limits = http_limits(&args);
    let grammar_compiler = grammar_compiler(&tokenizer_path, &files);
    if let Err(e) = &grammar_compiler {
        tracing::info!("{e}");
    }
    let mut app = AppState::new(
        cluster.clone(),
        tokenizer,
        chat_template,
        served_model_name.clone(),
        max_model_len,
        args.block_size,
        args.api_key.clone(),
        limits,
    )
    .with_grammar_compiler(grammar_compiler);
    let template_source = app.chat_template.as_ref().map(|t| t.source().to_string()).unwrap_or_default();
    // Detected from the template by default (AppState::new); a named one fits it.
    if let Some(format) = args.tool_call_parser {
        app.tool_format = Some(format.for_template(&template_source));
    }
    app.max_tokens_cap = args.max_tokens_cap;
    if let Some(file) = &args.idempotency_file {
        app.idempotency = coordinator::idempotency::IdempotencyStore::with_file(file.clone())
            .with_context(|| format!("--idempotency-file {}", file.display()))?;
    }
    app.constrain_reasoning = args.structured_outputs_in_reasoning;
    app.reasoning_format = match args.reasoning_parser {
        Some(ReasoningParserArg::None) => None,
        Some(ReasoningParserArg::Format(format)) => Some(format),
        // Harmony's calls come with its channels: the analysis is never the answer.
        None if app.tool_format == Some(ToolFormat::Harmony) => Some(ReasoningFormat::GptOss),
        None => ReasoningFormat::detect(&template_source),
    };
    match app.tool_format {
        Some(format) => tracing::info!("tool calls are read in the {format} format"),
        None => tracing::info!("no tool-call format (see --tool-call-parser); tool_choice \"none\" only"),
    }
    match app.reasoning_format {
        Some(format) => tracing::info!("reasoning is read in the {format} format"),
        None => tracing::info!("no reasoning format (see --reasoning-parser)"),
    }
    let app = Arc::new(app);
    // One line tests and scripts can parse.
    println!(
        "tinyvllm-coordinator listening http={http_addr} quic={quic_addr} model={served_model_name} policy={}",
        args.policy
    );

    // Workers without --coordinator find it by this; kept until shutdown.
    let _announcement = match args.no_discovery {
        true => None,
        false => match common::discovery::Announcement::start(quic_addr, &served_model_name, &secret) {
            Ok(announcement) => {
                tracing::info!("announced on the local network as {}", common::discovery::SERVICE_TYPE);
                Some(announcement)
            }
            Err(e) => {
                tracing::warn!("not announced on the local network ({e}); workers need --coordinator");
                None
            }
        },
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let connect = SocketAddr::new(
        if quic_addr.ip().is_unspecified() { [127, 0, 0, 1].into() } else { quic_addr.ip() },
        quic_addr.port(),
    );
    let pipelines = stages.map(|stages| pipeline_launch(&args, stages, connect)).transpose()?;
    let supervisor = (args.local_workers > 0).then(|| match pipelines {
        Some(launch) => tokio::spawn(coordinator::local_pipelines::supervise(
            cluster.clone(),
            args.local_workers / args.pipeline_parallel_size,
            launch,
            stop_rx.clone(),
        )),
        None => tokio::spawn(coordinator::local_workers::supervise(
            cluster.clone(),
            args.local_workers,
            args.model.clone(),
            connect,
            args.cluster_secret_file.clone(),
            local_worker_args(&args),
            stop_rx.clone(),
        )),
    });
    let server = tokio::spawn(coordinator::http::serve(listener, app.clone(), stop_rx.clone()));

    common::transport::shutdown_signal().await;
    tracing::info!("shutting down; finishing in-flight requests");
    app.begin_shutdown();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.shutdown_timeout_secs);
    while cluster.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What is still running ends now, each response whole (see `sse`).
    app.cut_responses();
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    // Remote workers stay up and reconnect when a coordinator is back.
    cluster.drain_local();
    if let Some(supervisor) = supervisor {
        let _ = tokio::time::timeout(Duration::from_secs(10), supervisor).await;
    }
    endpoint.close(0u32.into(), b"shutdown");
    Ok(())
}

/// The HTTP limits from the flags. The connection cap stays under the
/// descriptor limit (raised to the hard one first), less room for
/// everything else the coordinator opens, so accept never hits EMFILE
/// because of HTTP clients alone.
fn http_limits(args: &Args) -> coordinator::app::HttpLimits {
    const OTHER_DESCRIPTORS: u64 = 64;
    let mut max_connections = args.http_max_connections.max(1);
    if let Some(limit) = raise_fd_limit() {
        let room = limit.saturating_sub(OTHER_DESCRIPTORS).max(16);
        if (max_connections as u64) > room {
            tracing::warn!("at most {room} HTTP connections (descriptor limit {limit}), not {max_connections}");
            max_connections = room as usize;
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    coordinator::app::HttpLimits {
        max_body_bytes: args.max_body_bytes,
        header_timeout: Duration::from_secs(args.http_header_timeout_secs.max(1)),
        body_timeout: Duration::from_secs(args.http_body_timeout_secs.max(1)),
        max_connections,
        tokenizer_pool: args.tokenizer_pool_size.unwrap_or(cores / 2).max(1),
        max_choices: args.max_queued_requests.max(1),
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (as Go's runtime
/// does; macOS starts processes at 256) and returns the soft limit now.
#[cfg(unix)]
fn raise_fd_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into memory we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return None;
    }
    // macOS refuses more than its per-process maximum (OPEN_MAX, 10240).
    for wanted in [limit.rlim_max.min(1 << 20), limit.rlim_max.min(10240)] {
        if wanted <= limit.rlim_cur {
            break;
        }
        let raised = libc::rlimit { rlim_cur: wanted, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads one `rlimit` we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = wanted;
            break;
        }
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux and macOS, not on every unix
    Some(limit.rlim_cur as u64)
}

#[cfg(not(unix))]
fn raise_fd_limit() -> Option<u64> {
    None
}

/// With `--pipeline-parallel-size` over 1 and local workers, each stage's
/// layers: equal shares of the layers' weights (equal counts where every
/// layer weighs the same), since one host's memory is shared by its stages.
/// A split that cannot be made is an error at start.
fn pipeline_stages(args: &Args, layer_weights: &[u64]) -> anyhow::Result<Option<Vec<common::pipeline::LayerRange>>> {
    let p = args.pipeline_parallel_size;
    anyhow::ensure!(p > 0, "--pipeline-parallel-size must be at least 1");
    if p == 1 {
        return Ok(None);
    }
    let stages = common::pipeline::split_layers_by_weight(layer_weights, &vec![1; p])
        .with_context(|| format!("pipelines of {p} stages for {}", args.model))?;
    if args.local_workers == 0 {
        // Remote pipelines are formed from the workers' offers (`--layers auto`).
        return Ok(None);
    }
    anyhow::ensure!(
        args.local_workers.is_multiple_of(p),
        "--pipeline-parallel-size {p} needs --local-workers a multiple of {p}"
    );
    Ok(Some(stages))
}

/// What starting the local pipelines takes.
fn pipeline_launch(
    args: &Args,
    stages: Vec<common::pipeline::LayerRange>,
    coordinator: SocketAddr,
) -> anyhow::Result<coordinator::local_pipelines::PipelineLaunch> {
    let exe = std::env::current_exe()?.parent().map(|d| d.join("tinyvllm-worker")).unwrap_or_default();
    Ok(coordinator::local_pipelines::PipelineLaunch {
        exe,
        model: args.model.clone(),
        coordinator,
        secret_file: args.cluster_secret_file.clone(),
        extra: local_worker_args(args),
        stages,
    })
}

/// Local workers use the coordinator's block size and serve metrics on an
/// ephemeral loopback port (listed at /v1/prometheus/targets), unless the
/// user's --worker-arg says otherwise.
fn local_worker_args(args: &Args) -> Vec<String> {
    let mut extra = Vec::new();
    let given = |flag: &str| args.worker_args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    if !given("--block-size") {
        extra.push(format!("--block-size={}", args.block_size));
    }
    if !given("--metrics") {
        extra.push("--metrics=127.0.0.1:0".to_string());
    }
    if !given("--served-model-name") {
        extra.push(format!("--served-model-name={}", served_model_name(args)));
    }
    extra.extend(args.worker_args.iter().cloned());
    extra
}

fn served_model_name(args: &Args) -> String {
    args.served_model_name.clone().unwrap_or_else(|| default_served_name(&args.model))
}

/// Reads the secret, or creates one readable only by this user. A secret
/// under 16 bytes is refused; a short one or a file others may read is
/// warned about.
fn load_or_create_secret(path: &Path) -> anyhow::Result<String> {
    if path.exists() {
        let read = common::transport::read_secret_file(path)?;
        for warning in &read.warnings {
            tracing::warn!("{warning}");
        }
        return Ok(read.secret);
    }
    let secret = common::transport::generate_secret();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).with_context(|| format!("creating {}", path.display()))?;
    std::io::Write::write_all(&mut file, secret.as_bytes())?;
    tracing::info!("wrote a new cluster secret to {} (give this file to remote workers)", path.display());
    Ok(secret)
}

/// Structured outputs' compiler over the model's vocabulary (the workers
/// build the same one); `Err` says why this model takes no constraints.
fn grammar_compiler(
    tokenizer_json: &Path,
    files: &ModelFiles,
) -> Result<Arc<common::structured::GrammarCompiler>, String> {
    let text = std::fs::read_to_string(tokenizer_json).map_err(|e| format!("{}: {e}", tokenizer_json.display()))?;
    common::structured::GrammarCompiler::from_tokenizer_json(&text, files.config.vocab_size, &files.eos_token_ids)
        .map(Arc::new)
        .map_err(|e| format!("structured outputs are unavailable for this model: {}: {e}", tokenizer_json.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` explains every flag (issue 32: a new user found some bare).
    #[test]
    fn every_flag_has_help_text() {
        use clap::CommandFactory;
        let bare: Vec<_> =
            Args::command().get_arguments().filter(|a| a.get_help().is_none()).map(|a| a.get_id().clone()).collect();
        assert!(bare.is_empty(), "flags without help text: {bare:?}");
    }
}
