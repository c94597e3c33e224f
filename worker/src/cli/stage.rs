//! `tinyvllm-worker serve --layers ...`: the pipeline-stage side of `serve`.
//! The first stage (layer 0) dials the next stage before joining the
//! coordinator; a later stage serves the stage before it
//! (`worker::pipeline::follower`) and never talks to the coordinator.

use anyhow::Context;
use common::pipeline::LayerRange;
use kernels::KvCacheDtype;
use worker::models::ModelFiles;
use worker::pipeline::follower::{self, Compute, FollowerConfig};
use worker::pipeline::link::{self, Downstream};
use worker::pipeline::metrics::PipelineMetrics;
use worker::pipeline::stage::StageRunner;
use worker::pipeline::wire::{STAGE_PROTOCOL_VERSION, StageHello, StageInfo};

use super::engine_args::{EngineArgs, Resolved, on_the_kernel_pool, stage_config};

/// The `serve` options a later stage uses.
pub struct StageArgs {
    pub name: String,
    pub secret: String,
    pub listen: Option<std::net::SocketAddr>,
    pub address_file: Option<std::path::PathBuf>,
    pub next_stage: Option<String>,
    /// Where to serve this stage's Prometheus metrics (HOST:PORT).
    pub metrics: Option<String>,
    pub served_model_name: Option<String>,
    /// Formed by the coordinator (`--layers auto`): leave when unlinked.
    pub formed: bool,
}

/// Runs a later stage (one without layer 0) until SIGTERM or a fatal error.
pub fn run_later_stage(
    engine: &EngineArgs,
    resolved: Resolved,
    layers: LayerRange,
    args: StageArgs,
    runtime: tokio::runtime::Runtime,
    report: Option<worker::serve::prepare::Reporter>,
) -> anyhow::Result<()> {
    let listen = args.listen.with_context(|| {
        format!("layers {layers} are a later pipeline stage: give --stage-listen HOST:PORT for the stage before")
    })?;
    let runner = StageRunner::new(&resolved.files, &stage_config(engine, &resolved, layers))
        .with_context(|| format!("loading layers {layers} of {}", resolved.files.name))?;
    // Loaded: the coordinator shows this stage in its pipeline from now on.
    drop(report);
    let mut info = runner.info(&args.name);
    tracing::info!(
        "stage {} (layers {layers} of {}): weights {:.1} MiB, KV cache {} blocks ({} tokens), {}, {:.1} MiB",
        args.name,
        resolved.files.name,
        mib(info.weight_bytes),
        runner.num_blocks(),
        info.kv_capacity_tokens,
        info.kv_cache_dtype,
        mib(info.kv_bytes)
    );
    let mut metrics = None;
    if let Some(addr) = &args.metrics {
        let listener = runtime
            .block_on(worker::serve::metrics_server::bind(addr))
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr()?;
        let model_name =
            args.served_model_name.clone().unwrap_or_else(|| common::model::default_served_name(&engine.model));
        // No engine series: this stage schedules nothing.
        let registry = worker::serve::metrics::labelled_registry(&model_name, &args.name);
        metrics = Some(PipelineMetrics::new(&registry, &layers.to_string(), false)?);
        runtime.spawn(worker::serve::metrics_server::serve_metrics(
            listener,
            std::sync::Arc::new(move || worker::serve::metrics::render(&registry)),
        ));
        tracing::info!("metrics on http://{bound}/metrics");
        info.metrics_address = Some(bound.to_string());
    }
    let compute = Compute::start(runner, info, metrics, on_the_kernel_pool)?;
    let config = FollowerConfig {
        name: args.name,
        secret: args.secret,
        model: resolved.files.identity(),
        block_size: engine.block_size,
        listen,
        address_file: args.address_file,
        next_stage: args.next_stage,
        leave_when_unlinked: args.formed,
    };
    runtime.block_on(async move {
        tokio::select! {
            result = follower::serve(config, compute) => result.map_err(anyhow::Error::from),
            () = common::transport::shutdown_signal() => Ok(()),
        }
    })
}

/// The first stage's dial of the next stage, retried until it is up.
pub async fn dial_next(
    name: &str,
    secret: &str,
    files: &ModelFiles,
    engine: &EngineArgs,
    layers: LayerRange,
    kv_cache_dtype: KvCacheDtype,
    address: &str,
) -> anyhow::Result<Downstream> {
    let hello = StageHello {
        version: STAGE_PROTOCOL_VERSION,
        name: name.to_string(),
        model: files.identity(),
        block_size: engine.block_size as u32,
        kv_cache_dtype: kv_cache_dtype.to_string(),
        next_layer: layers.end as u32,
        raw_logits: false,
        auth_tag: Vec::new(),
    };
    link::dial_until_up(address, secret, hello).await.with_context(|| format!("joining the next stage at {address}"))
}

/// The pipeline as the first stage sees it, one line per stage.
pub fn log_pipeline(stages: &[StageInfo]) {
    for (i, s) in stages.iter().enumerate() {
        tracing::info!(
            "pipeline stage {i} of {}: {} (layers {}): weights {:.1} MiB, KV cache {:.1} MiB ({}, {} tokens)",
            stages.len(),
            s.name,
            s.layers,
            mib(s.weight_bytes),
            mib(s.kv_bytes),
            s.kv_cache_dtype,
            s.kv_capacity_tokens
        );
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
