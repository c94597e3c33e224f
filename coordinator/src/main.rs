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
use coordinator::text::{ChatTemplate, Tokenizer};

#[derive(Parser)]
#[command(name = "tinyvllm-coordinator", version, about = "tinyvllm coordinator: HTTP front door of a worker cluster")]
struct Args {
    /// A Hugging Face model directory or hub id (workers must serve the same model).
    #[arg(long)]
    model: String,
    /// HTTP listen address.
    #[arg(long, default_value = "0.0.0.0:8080")]
    http: SocketAddr,
    /// QUIC listen address for workers.
    #[arg(long, default_value = "0.0.0.0:7070")]
    quic: SocketAddr,
    /// Start and supervise this many workers on this host.
    #[arg(long, default_value_t = 0)]
    local_workers: usize,
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
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
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

    anyhow::ensure!(args.block_size > 0, "--block-size must be positive");
    let cluster = Cluster::new(secret, files.identity(), args.max_queued_requests, args.policy, args.block_size);
    let (cert, key) = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => common::transport::pem_cert(cert, key)?,
        _ => common::transport::self_signed_cert()?,
    };
    let endpoint = quinn::Endpoint::server(common::transport::server_config(cert, key)?, args.quic)
        .with_context(|| format!("binding QUIC on {}", args.quic))?;
    let quic_addr = endpoint.local_addr()?;
    tokio::spawn(cluster.clone().accept_workers(endpoint.clone()));
    tokio::spawn(cluster.clone().watchdog());

    let listener =
        tokio::net::TcpListener::bind(args.http).await.with_context(|| format!("binding HTTP on {}", args.http))?;
    let http_addr = listener.local_addr()?;
    let limits = http_limits(&args);
    let app = Arc::new(AppState::new(
        cluster.clone(),
        tokenizer,
        chat_template,
        served_model_name.clone(),
        max_model_len,
        args.block_size,
        args.api_key.clone(),
        limits,
    ));
    // One line tests and scripts can parse.
    println!(
        "tinyvllm-coordinator listening http={http_addr} quic={quic_addr} model={served_model_name} policy={}",
        args.policy
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let supervisor = (args.local_workers > 0).then(|| {
        let connect = SocketAddr::new(
            if quic_addr.ip().is_unspecified() { [127, 0, 0, 1].into() } else { quic_addr.ip() },
            quic_addr.port(),
        );
        tokio::spawn(supervise_local_workers(
            args.local_workers,
            args.model.clone(),
            connect,
            args.cluster_secret_file.clone(),
            local_worker_args(&args),
            stop_rx.clone(),
        ))
    });
    let server = tokio::spawn(coordinator::http::serve(listener, app.clone(), stop_rx.clone()));

    common::transport::shutdown_signal().await;
    eprintln!("coordinator: shutting down; finishing in-flight requests");
    app.begin_shutdown();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.shutdown_timeout_secs);
    while cluster.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What is still running ends now, each response whole (see `sse`).
    app.cut_responses();
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    cluster.drain_all();
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
            eprintln!("coordinator: at most {room} HTTP connections (descriptor limit {limit}), not {max_connections}");
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

/// Reads the secret, or creates one readable only by this user.
fn load_or_create_secret(path: &Path) -> anyhow::Result<String> {
    if path.exists() {
        let secret =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?.trim().to_string();
        anyhow::ensure!(!secret.is_empty(), "{} is empty", path.display());
        return Ok(secret);
    }
    let secret = common::transport::generate_secret();
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).with_context(|| format!("creating {}", path.display()))?;
    std::io::Write::write_all(&mut file, secret.as_bytes())?;
    eprintln!("coordinator: wrote a new cluster secret to {} (give this file to remote workers)", path.display());
    Ok(secret)
}

/// Keeps `n` local workers running, restarting any that exit (with backoff),
/// until shutdown; then stops them with SIGTERM (they drain).
async fn supervise_local_workers(
    n: usize,
    model: String,
    coordinator: SocketAddr,
    secret_file: PathBuf,
    extra: Vec<String>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let exe = std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("tinyvllm-worker")));
    let Some(exe) = exe.filter(|p| p.exists()) else {
        eprintln!("coordinator: tinyvllm-worker not found next to this binary; cannot start local workers");
        return;
    };
    let mut tasks = Vec::new();
    for i in 0..n {
        let (exe, model, secret_file, extra, mut stop) =
            (exe.clone(), model.clone(), secret_file.clone(), extra.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut backoff = Duration::from_millis(500);
            loop {
                let mut child = match tokio::process::Command::new(&exe)
                    .args([
                        "serve",
                        "--exit-with-parent",
                        "--model",
                        &model,
                        "--coordinator",
                        &coordinator.to_string(),
                        "--name",
                        &format!("local-{i}"),
                    ])
                    .arg("--cluster-secret-file")
                    .arg(&secret_file)
                    .args(&extra)
                    .kill_on_drop(true)
                    .spawn()
                {
                    Ok(child) => child,
                    Err(e) => {
                        eprintln!("coordinator: starting local worker {i}: {e}");
                        return;
                    }
                };
                tokio::select! {
                    status = child.wait() => {
                        eprintln!("coordinator: local worker {i} exited ({status:?}); restarting in {backoff:?}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                    }
                    _ = stop.changed() => {
                        if let Some(pid) = child.id() {
                            // SIGTERM: the worker drains, then exits.
                            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
                        }
                        let _ = tokio::time::timeout(Duration::from_secs(8), child.wait()).await;
                        return;
                    }
                }
            }
        }));
    }
    let _ = stop.changed().await;
    for t in tasks {
        let _ = t.await;
    }
}
