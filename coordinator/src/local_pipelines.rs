//! `--local-workers N --pipeline-parallel-size P`: the coordinator starts
//! `N / P` pipelines of `P` local worker processes each, the model's layers
//! split over the stages in proportion to memory (`common::pipeline::
//! split_layers`; equal on one host). See docs/pipeline-parallel.md.
//!
//! Stages start last first: each later stage listens on a loopback port of
//! its choosing and writes it to a file, which the supervisor passes to the
//! stage before (`--next-stage`). Only the first stage joins the cluster
//! (as `local-I`), so to the router a pipeline is one worker. If any stage
//! exits, the whole pipeline is stopped and formed again: the coordinator
//! re-dispatches its requests meanwhile, as for any lost worker.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::pipeline::LayerRange;
use tokio::process::{Child, Command};

use crate::cluster::Cluster;

/// How long a stage may take to load and listen.
const STAGE_START_TIMEOUT: Duration = Duration::from_secs(120);
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What every stage process of every pipeline shares.
#[derive(Clone)]
pub struct PipelineLaunch {
    /// The `tinyvllm-worker` binary.
    pub exe: PathBuf,
    pub model: String,
    pub coordinator: SocketAddr,
    pub secret_file: PathBuf,
    /// Extra `serve` arguments for every stage.
    pub extra: Vec<String>,
    /// Each stage's layers, in order.
    pub stages: Vec<LayerRange>,
}

/// Keeps `pipelines` pipelines running until `stop` changes; then stops the
/// first stages with SIGTERM (they drain) and the rest after them.
pub async fn supervise(
    cluster: Cluster,
    pipelines: usize,
    launch: PipelineLaunch,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let tasks: Vec<_> =
        (0..pipelines).map(|i| tokio::spawn(keep_pipeline(cluster.clone(), i, launch.clone(), stop.clone()))).collect();
    for t in tasks {
        let _ = t.await;
    }
}

async fn keep_pipeline(
    cluster: Cluster,
    index: usize,
    launch: PipelineLaunch,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let name = format!("local-{index}");
    let dir = std::env::temp_dir().join(format!("tinyvllm-pipeline-{}-{index}", std::process::id()));
    let mut backoff = FIRST_BACKOFF;
    loop {
        let started = tokio::time::Instant::now();
        let mut children = Vec::new();
        let formed = tokio::select! {
            formed = start_stages(&launch, &name, &dir, &mut children) => formed,
            _ = stop.changed() => {
                stop_all(&mut children).await;
                break;
            }
        };
        let why = match formed {
            Err(why) => why,
            Ok(()) => {
                tokio::select! {
                    why = first_exit(&mut children) => why,
                    _ = stop.changed() => {
                        stop_all(&mut children).await;
                        break;
                    }
                }
            }
        };
        cluster.worker_process_exited(&name, &why);
        stop_all(&mut children).await;
        if started.elapsed() >= Duration::from_secs(60) {
            backoff = FIRST_BACKOFF;
        }
        tracing::warn!("pipeline {name}: {why}; forming it again in {backoff:?}");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts the stages last first, each given the address of the one after.
async fn start_stages(
    launch: &PipelineLaunch,
    name: &str,
    dir: &Path,
    children: &mut Vec<Child>,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut next: Option<String> = None;
    for (k, layers) in launch.stages.iter().enumerate().rev() {
        let mut command = Command::new(&launch.exe);
        command
            .args(["serve", "--exit-with-parent", "--model", &launch.model, "--layers", &layers.to_string()])
            .arg("--cluster-secret-file")
            .arg(&launch.secret_file)
            .args(&launch.extra)
            .env(common::log::FORMAT_ENV, common::log::format().name())
            .kill_on_drop(true);
        if let Some(address) = &next {
            command.args(["--next-stage", address]);
        }
        let address_file = dir.join(format!("stage-{k}.addr"));
        if k == 0 {
            command.args(["--coordinator", &launch.coordinator.to_string(), "--name", name]);
        } else {
            let _ = std::fs::remove_file(&address_file);
            command.args(["--name", &format!("{name}-stage-{k}"), "--stage-listen", "127.0.0.1:0"]);
            command.arg("--stage-address-file").arg(&address_file);
        }
        children.push(command.spawn().map_err(|e| format!("starting stage {k}: {e}"))?);
        if k > 0 {
            let child = children.last_mut().expect("just pushed");
            next = Some(wait_for_address(&address_file, child, k).await?);
        }
    }
    Ok(())
}

/// The address stage `k` listens on, once it wrote it.
async fn wait_for_address(path: &Path, child: &mut Child, k: usize) -> Result<String, String> {
    let deadline = tokio::time::Instant::now() + STAGE_START_TIMEOUT;
    loop {
        if let Ok(address) = std::fs::read_to_string(path) {
            return Ok(address.trim().to_string());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("stage {k} exited while starting ({status})"));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!("stage {k} did not listen within {STAGE_START_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until any stage exits; says which and how.
async fn first_exit(children: &mut [Child]) -> String {
    // Started last first: child i is stage n - 1 - i.
    let n = children.len();
    let waits = children.iter_mut().enumerate().map(|(i, c)| {
        let k = n - 1 - i;
        Box::pin(async move {
            let status = c.wait().await.map_or_else(|e| e.to_string(), |s| s.to_string());
            format!("stage {k} exited ({status})")
        })
    });
    futures_select_all(waits).await
}

/// The first of several futures to finish.
async fn futures_select_all<F: std::future::Future<Output = String> + Unpin>(
    futures: impl Iterator<Item = F>,
) -> String {
    let mut futures: Vec<F> = futures.collect();
    std::future::poll_fn(|cx| {
        for f in &mut futures {
            if let std::task::Poll::Ready(out) = std::pin::Pin::new(f).poll(cx) {
                return std::task::Poll::Ready(out);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// SIGTERM to the first stage, which drains its requests through the
/// pipeline, then to the later stages; whatever does not exit in time is
/// killed.
async fn stop_all(children: &mut Vec<Child>) {
    // Started last first: the first stage is the last child.
    for child in children.iter_mut().rev() {
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        if tokio::time::timeout(Duration::from_secs(8), child.wait()).await.is_err() {
            let _ = child.kill().await;
        }
    }
    children.clear();
}
