//! `tinyvllm-worker serve`: join a cluster. The engine runs on its own
//! thread (on the kernels' pool); a tokio current-thread runtime runs the
//! QUIC session (`worker::serve::service`) and, optionally, the metrics
//! endpoint; SIGTERM drains.

use anyhow::Context;
use clap::Args;

use common::pipeline::{LayerRange, StageInfo};
use common::protocol::{JoinedBy, PROTOCOL_VERSION, Preparing};
use worker::serve::prepare::Reporter;

use worker::pipeline::metrics::PipelineMetrics;

use super::engine_args::{EngineArgs, build_engine_from, fetch_weights, on_the_kernel_pool, resolve_config};
use super::offer::Offer;
use super::stage::StageArgs;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The coordinator's QUIC address, HOST:PORT (every worker but a later
    /// pipeline stage, which talks to the stages beside it only). Default:
    /// the one a join token names, else this cluster's coordinator found on
    /// the local network (mDNS).
    #[arg(long)]
    coordinator: Option<String>,
    /// Hold only decoder layers FIRST-LAST (inclusive, e.g. 0-11): one stage
    /// of a pipeline. The stage with layer 0 joins the coordinator and
    /// schedules; the others serve the stage before them. `auto`: offer this
    /// worker's memory to the coordinator first, which assigns the layers
    /// (every layer when the model fits) and the next stage.
    #[arg(long)]
    layers: Option<String>,
    /// Bytes of memory this worker may give the model, weights and KV cache
    /// (default: the memory available at start). With --layers auto it is
    /// what is offered; without --kv-cache-memory the KV cache takes a
    /// quarter of it.
    #[arg(long)]
    memory_limit: Option<u64>,
    /// The next pipeline stage's address, HOST:PORT (every stage but the last).
    #[arg(long)]
    next_stage: Option<String>,
    /// Where a later pipeline stage listens for the stage before it,
    /// HOST:PORT (port 0 picks one; it is logged). With --layers auto the
    /// default is 0.0.0.0:0, and an unspecified host is advertised as the
    /// address the coordinator sees this worker at.
    #[arg(long)]
    stage_listen: Option<std::net::SocketAddr>,
    /// With --layers auto, the address the stage before this one is told
    /// to dial, HOST:PORT, when it is not the one --stage-listen binds: a
    /// machine behind NAT or with several interfaces, or a proxy in between.
    #[arg(long, requires = "stage_listen")]
    advertise: Option<std::net::SocketAddr>,
    /// Write the bound --stage-listen address to this file once listening.
    #[arg(long)]
    stage_address_file: Option<std::path::PathBuf>,
    /// Steps the first stage of a pipeline keeps in flight, each with its
    /// share of the running requests, so the stages compute at once
    /// (default: the number of stages; 1 makes them take turns).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pipeline_micro_batches: Option<u16>,
    /// This worker's name in logs, metrics and /v1/workers (default: host
    /// name and the start of its stable id).
    #[arg(long)]
    name: Option<String>,
    /// Where this worker keeps its stable id, one file per --name (default:
    /// $XDG_STATE_HOME/tinyvllm, else ~/.local/state/tinyvllm). A directory
    /// copied from another machine is noticed and the id renewed.
    #[arg(long, env = "TINYVLLM_STATE_DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// File holding the cluster secret (the coordinator writes one at start).
    #[arg(long, env = "TINYVLLM_CLUSTER_SECRET_FILE", required_unless_present = "join")]
    cluster_secret_file: Option<std::path::PathBuf>,
    /// A join token (`tinyvllm-coordinator join-token` prints one): the
    /// cluster secret and, unless --coordinator says otherwise, the
    /// coordinator's address. Instead of --cluster-secret-file.
    #[arg(long, env = "TINYVLLM_JOIN_TOKEN", conflicts_with = "cluster_secret_file", hide_env_values = true)]
    join: Option<String>,
    /// Set when --coordinator came from the join token (not a flag).
    #[arg(skip)]
    coordinator_from_token: bool,
    /// The stable id, once read from the state directory (not a flag).
    #[arg(skip)]
    instance_id: String,
    /// Serve Prometheus metrics (vLLM's names) on HOST:PORT (a host name or
    /// an IP address); port 0 picks a free one. The coordinator lists it at
    /// /v1/prometheus/targets.
    #[arg(long)]
    metrics: Option<String>,
    /// The model name in metric labels (default: the model directory's name,
    /// as the coordinator's default --served-model-name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Exit when the process that started this worker exits (set by the
    /// coordinator for its local workers, so none outlive it).
    #[arg(long)]
    exit_with_parent: bool,
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    let state_dir = args.state_dir.clone().unwrap_or_else(super::identity::default_state_dir);
    let key = args.name.clone().unwrap_or_else(|| "default".into());
    let identity = match super::identity::load_or_create(&state_dir, &key) {
        Ok(identity) => identity,
        Err(e) => {
            // A read-only home must not stop a worker: it runs with an id for this run only.
            eprintln!("warning: cannot keep this worker's id in {}: {e}", state_dir.display());
            super::identity::Identity { id: common::transport::generate_secret()[..16].to_string(), copied_from: None }
        }
    };
    let name = args.name.clone().unwrap_or_else(|| {
        let host =
            std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "worker".into());
        format!("{host}-{}", &identity.id[..6])
    });
    // Every log line from here on says which worker wrote it.
    common::log::set_process_name(format!("worker {name}"));
    if let Some(machine) = &identity.copied_from {
        tracing::warn!(
            "{} was made on another machine ({machine}): this worker takes a new id ({}), so the two never join as one",
            state_dir.display(),
            identity.id
        );
    }
    args.instance_id = identity.id;
    let secret = match (&args.join, &args.cluster_secret_file) {
        (Some(token), _) => {
            let token = common::join::JoinToken::decode(token)?;
            if args.coordinator.is_none() && token.coordinator.is_some() {
                args.coordinator = token.coordinator;
                args.coordinator_from_token = true;
            }
            token.secret
        }
        (None, Some(path)) => {
            // Under 16 bytes is refused; short, or readable by others, is warned about.
            let read = common::transport::read_secret_file(path)?;
            for warning in &read.warnings {
                tracing::warn!("{warning}");
            }
            read.secret
        }
        (None, None) => anyhow::bail!("--cluster-secret-file or --join is required"),
    };
    if secret.len() < common::transport::MIN_SECRET_BYTES {
        anyhow::bail!("the cluster secret is under {} bytes", common::transport::MIN_SECRET_BYTES);
    }
    if args.exit_with_parent {
        watch_parent();
    }
    if let Some(limit) = args.memory_limit {
        args.engine.memory_limit(limit);
    }
    if args.layers.as_deref() == Some("auto") {
        // Offer, serve what is assigned, and offer again if the pipeline
        // breaks (a stage before or after it was lost).
        loop {
            // The weights wait for the layers: a stage fetches only its own.
            let mut resolved = resolve_config(&args.engine)?;
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let Some((layers, coordinator)) = runtime.block_on(offer_and_wait(&mut args, &name, &secret, &resolved))?
            else {
                return Ok(());
            };
            drop(runtime);
            let report = prepare(&args, &name, &secret, &mut resolved, Some(layers), Some(&coordinator))?;
            let prepared = Prepared { resolved, layers: Some(layers), coordinator: Some(coordinator), report };
            match serve_layers(&args, name.clone(), secret.clone(), prepared) {
                Err(e) if pipeline_lost(&e) => tracing::warn!("{e}; offering this worker again"),
                other => return other,
            }
            args.next_stage = None;
        }
    }
    let mut resolved = resolve_config(&args.engine)?;
    let layers = args.layers.as_deref().map(|l| LayerRange::parse(l, resolved.files.config.num_layers)).transpose()?;
    // A later stage talks to the stage before it, not to the coordinator.
    let coordinator = match layers.filter(|l| !l.is_first()) {
        Some(_) => None,
        None => Some(coordinator_address(&args, &secret)?),
    };
    let report = prepare(&args, &name, &secret, &mut resolved, layers, coordinator.as_ref())?;
    serve_layers(&args, name, secret, Prepared { resolved, layers, coordinator, report })
}

/// A worker with its weights fetched, about to load them.
struct Prepared {
    resolved: super::engine_args::Resolved,
    /// Every layer if `None`.
    layers: Option<LayerRange>,
    /// The coordinator and how it was found (not for a later stage).
    coordinator: Option<(String, JoinedBy)>,
    /// Progress shown at the coordinator until the weights are loaded.
    report: Option<Reporter>,
}

/// Fetches the weights of `layers` (every layer if `None`), reporting the
/// download to the coordinator when there is one (`/v1/workers` shows it);
/// the report, kept until the weights are loaded.
fn prepare(
    args: &ServeArgs,
    name: &str,
    secret: &str,
    resolved: &mut super::engine_args::Resolved,
    layers: Option<LayerRange>,
    coordinator: Option<&(String, JoinedBy)>,
) -> anyhow::Result<Option<Reporter>> {
    let report = match coordinator {
        Some((address, joined_by)) => {
            let preparing = Preparing {
                protocol_version: PROTOCOL_VERSION,
                worker_name: name.to_string(),
                model: resolved.files.identity(),
                block_size: args.engine.block_size as u32,
                layers: layers.unwrap_or(LayerRange::full(resolved.files.config.num_layers)).to_string(),
                joined_by: *joined_by,
                auth_tag: Vec::new(),
            };
            Reporter::start(address, secret, preparing)?
        }
        None => None,
    };
    fetch_weights(&args.engine, resolved, layers, &mut |progress| {
        if let Some(report) = &report {
            report.download(progress);
        }
    })?;
    if let Some(report) = &report {
        report.loading();
    }
    Ok(report)
}

/// Whether serving ended because a stage of this worker's pipeline was lost.
fn pipeline_lost(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(worker::serve::service::ServiceError::PipelineLost(_)))
        || matches!(e.downcast_ref(), Some(worker::pipeline::link::LinkError::Unlinked(_)))
}

/// Serves `layers` (every layer if `None`) until SIGTERM or a fatal error.
fn serve_layers(args: &ServeArgs, name: String, secret: String, prepared: Prepared) -> anyhow::Result<()> {
    use worker::serve::service::{self, ServeConfig};
    let Prepared { resolved, layers, coordinator, report } = prepared;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let num_layers = resolved.files.config.num_layers;
    let layers = layers.filter(|l| !l.is_full());
    if let Some(l) = layers.filter(|l| !l.is_last()) {
        anyhow::ensure!(args.next_stage.is_some(), "--layers {l} end before the model's last layer: give --next-stage");
    }
    anyhow::ensure!(
        args.next_stage.is_none() || layers.is_some(),
        "--next-stage needs --layers: this worker holds every layer"
    );
    if let Some(l) = layers.filter(|l| !l.is_first()) {
        if args.coordinator.is_some() && args.layers.as_deref() != Some("auto") {
            tracing::info!(
                "note: layers {l} are a later pipeline stage, which talks to the stage before it, not to --coordinator"
            );
        }
        let stage = stage_args(args, name, secret);
        return super::stage::run_later_stage(&args.engine, resolved, l, stage, runtime, report);
    }
    let (coordinator, joined_by) = coordinator.context("a first stage needs the coordinator's address")?;
    let (mut engine, files, device) = build_engine_from(&args.engine, resolved, layers)?;
    // Loaded: this worker shows as itself in /v1/workers once it registers.
    drop(report);
    let mut later_stages = Vec::new();
    if let (Some(next), Some(l)) = (&args.next_stage, layers) {
        let downstream = runtime.block_on(super::stage::dial_next(
            &name,
            &secret,
            &files,
            &args.engine,
            l,
            engine.kv_cache_dtype(),
            next,
        ))?;
        later_stages = downstream.stages.clone();
        engine.attach_next_stage(downstream, args.pipeline_micro_batches.map(usize::from))?;
    }
    let stats = engine.stats();
    let mut metrics = None;
    let mut metrics_address = None;
    if let Some(addr) = &args.metrics {
        let listener = runtime
            .block_on(worker::serve::metrics_server::bind(addr))
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        let model_name =
            args.served_model_name.clone().unwrap_or_else(|| common::model::default_served_name(&args.engine.model));
        let engine_metrics = worker::serve::metrics::EngineMetrics::new(&model_name, &name);
        let cache_dtype = engine.kv_cache_dtype().to_string();
        engine_metrics.record_cache_config(&cache_dtype, args.engine.block_size, stats.kv_blocks_total);
        let registry = engine_metrics.registry().clone();
        if let Some(l) = layers.filter(|_| engine.is_pipelined()) {
            engine.set_pipeline_metrics(PipelineMetrics::new(&registry, &l.to_string(), true)?);
        }
        runtime.spawn(worker::serve::metrics_server::serve_metrics(
            listener,
            std::sync::Arc::new(move || worker::serve::metrics::render(&registry)),
        ));
        tracing::info!("metrics on http://{bound}/metrics");
        metrics = Some(engine_metrics);
        metrics_address = Some(bound.to_string());
    }
    let own = StageInfo {
        name: name.clone(),
        layers: layers.unwrap_or(LayerRange::full(num_layers)).to_string(),
        weight_bytes: engine.resident_weight_bytes() as u64,
        kv_bytes: engine.kv_cache_bytes(),
        metrics_address: metrics_address.clone(),
        kv_cache_dtype: engine.kv_cache_dtype().to_string(),
        kv_capacity_tokens: (stats.kv_blocks_total * args.engine.block_size) as u64,
    };
    let stages: Vec<StageInfo> = std::iter::once(own).chain(later_stages).collect();
    if stages.len() > 1 {
        super::stage::log_pipeline(&stages);
    }
    let pipeline_lost = std::sync::Arc::new(std::sync::OnceLock::new());
    let config = ServeConfig {
        coordinator,
        joined_by,
        instance_id: args.instance_id.clone(),
        name,
        secret,
        model: files.identity(),
        block_size: args.engine.block_size,
        max_model_len: engine.scheduler().config().max_model_len as u64,
        metrics_address,
        device,
        stages,
        pipeline_lost: pipeline_lost.clone(),
        kv_identity: engine.kv_identity(),
        kv_block_bytes: engine.kv_block_bytes() as u64,
        kv_tier: engine.takes_kv_imports(),
    };
    // Structured outputs' vocabulary scan, now rather than at the first
    // constrained request; a model without one refuses such requests.
    if let Err(e) = engine.grammar_compiler() {
        tracing::info!("{e}");
    }
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel();
    let (out_tx, out_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine_thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || on_the_kernel_pool(|| service::engine_loop(engine, cmd_rx, out_tx, metrics, &pipeline_lost)))?;
    let drain = cmd_tx.clone();
    let result = runtime.block_on(async move {
        // SIGTERM drains: running requests finish and stream out, new ones
        // are refused, then the engine stops and serve() returns.
        tokio::spawn(async move {
            common::transport::shutdown_signal().await;
            tracing::info!("signal received: draining");
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

/// How long a worker without --coordinator looks for one on the network.
const DISCOVERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `--coordinator` (or the join token's), or the coordinator of this
/// cluster found on the local network (mDNS), for a worker that talks to
/// it; and how it was found.
fn coordinator_address(args: &ServeArgs, secret: &str) -> anyhow::Result<(String, JoinedBy)> {
    if let Some(address) = &args.coordinator {
        let how = match (args.exit_with_parent, args.coordinator_from_token) {
            (true, _) => JoinedBy::Local,
            (false, true) => JoinedBy::Token,
            (false, false) => JoinedBy::Address,
        };
        return Ok((address.clone(), how));
    }
    tracing::info!("no --coordinator: looking for this cluster's coordinator on the local network (mDNS)");
    let found = common::discovery::find_coordinator(secret, DISCOVERY_TIMEOUT)?;
    tracing::info!(
        "found the coordinator at {} (serving {})",
        found.address,
        found.model.as_deref().unwrap_or("an unnamed model")
    );
    Ok((found.address.to_string(), JoinedBy::Discovery))
}

/// `--layers auto`: offers this worker to the coordinator and takes the
/// layers, next stage and listen address it is assigned, and the
/// coordinator (and how it was found); `None` on SIGTERM.
async fn offer_and_wait(
    args: &mut ServeArgs,
    name: &str,
    secret: &str,
    resolved: &super::engine_args::Resolved,
) -> anyhow::Result<Option<(LayerRange, (String, JoinedBy))>> {
    let (coordinator, joined_by) = coordinator_address(args, secret)?;
    anyhow::ensure!(
        args.next_stage.is_none(),
        "--layers auto: the coordinator assigns the next stage, not --next-stage"
    );
    let listen = args.stage_listen.unwrap_or_else(|| "0.0.0.0:0".parse().expect("literal address"));
    let offer = Offer {
        memory_bytes: match args.memory_limit {
            Some(limit) => limit,
            None => worker::runner::kv_cache::available_memory_bytes()
                .context("cannot measure this machine's memory: give --memory-limit BYTES")?,
        },
        model_weight_bytes: super::offer::model_weight_bytes(resolved, args.engine.quantization()),
        stage_listen: super::offer::concrete_listen_address(listen)?,
        block_size: args.engine.block_size,
    };
    args.stage_listen = Some(offer.stage_listen);
    let offer = Offer { stage_listen: args.advertise.unwrap_or(offer.stage_listen), ..offer };
    let Some(assignment) = super::offer::await_assignment(&coordinator, name, secret, resolved, offer).await? else {
        return Ok(None);
    };
    let layers = assignment.layers;
    anyhow::ensure!(
        layers.total == resolved.files.config.num_layers && !layers.is_empty() && layers.end <= layers.total,
        "the coordinator assigned layers {layers} of {}; {} has {}",
        layers.total,
        resolved.files.name,
        resolved.files.config.num_layers
    );
    tracing::info!(
        "assigned layers {layers} of {}: stage {} of {} of pipeline {:?}{}",
        layers.total,
        assignment.stage,
        assignment.stages,
        assignment.pipeline,
        assignment.next_stage.as_deref().map(|n| format!(", next stage at {n}")).unwrap_or_default()
    );
    args.next_stage = assignment.next_stage;
    Ok(Some((layers, (coordinator, joined_by))))
}

fn stage_args(args: &ServeArgs, name: String, secret: String) -> StageArgs {
    StageArgs {
        name,
        secret,
        listen: args.stage_listen,
        address_file: args.stage_address_file.clone(),
        next_stage: args.next_stage.clone(),
        metrics: args.metrics.clone(),
        served_model_name: args.served_model_name.clone(),
        formed: args.layers.as_deref() == Some("auto"),
    }
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
                    tracing::warn!("parent process exited; stopping");
                    std::process::exit(0);
                }
            }
        });
    }
}
