//! `tinyvllm-worker serve`: join a cluster. The engine runs on its own
//! thread (on the kernels' pool); a tokio current-thread runtime runs the
//! QUIC session (`worker::serve::service`) and, optionally, the metrics
//! endpoint; SIGTERM drains.

use anyhow::Context;
use clap::Args;

use super::engine_args::{EngineArgs, build_engine, on_the_kernel_pool};

#[derive(Args)]
pub struct ServeArgs {
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

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    use worker::serve::service::{self, ServeConfig};
    // Under 16 bytes is refused; short, or readable by others, is warned about.
    let read = common::transport::read_secret_file(&args.cluster_secret_file)?;
    for warning in &read.warnings {
        eprintln!("worker: warning: {warning}");
    }
    let secret = read.secret;
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
            .block_on(worker::serve::metrics_server::bind(addr))
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        let model_name =
            args.served_model_name.clone().unwrap_or_else(|| common::model::default_served_name(&args.engine.model));
        let engine_metrics = worker::serve::metrics::EngineMetrics::new(&model_name, &name);
        let registry = engine_metrics.registry().clone();
        runtime.spawn(worker::serve::metrics_server::serve_metrics(
            listener,
            std::sync::Arc::new(move || worker::serve::metrics::render(&registry)),
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
        block_size: args.engine.block_size,
        max_model_len: engine.scheduler().config().max_model_len as u64,
        metrics_address,
        device,
    };
    // Structured outputs' vocabulary scan, now rather than at the first
    // constrained request; a model without one refuses such requests.
    if let Err(e) = engine.grammar_compiler() {
        eprintln!("worker {}: {e}", config.name);
    }
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
