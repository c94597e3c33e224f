//! A later stage's service: it dials the stage after it (if it is not the
//! last), then listens for the stage before it, and passes each step through
//! its compute thread: hidden states on to the next stage, results (from
//! its own sampler, or relayed from the stage after) back. It holds no
//! per-request state, so a stage before that reconnects starts clean; when
//! the stage after goes away it drops the stage before (whose pipeline is
//! then lost) and dials again.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use common::pipeline::LayerRange;
use common::protocol::ModelIdentity;
use tokio::sync::mpsc;

use super::link::{self, Arrived, Downstream, LinkError, Upstream};
use super::metrics::PipelineMetrics;
use super::stage::{StageRunner, StageStep};
use super::wire::{STAGE_PROTOCOL_VERSION, StageHello, StageInfo, StepHeader, StepResult};
use crate::runner::logprobs::LogprobsMode;

pub struct FollowerConfig {
    pub name: String,
    pub secret: String,
    pub model: ModelIdentity,
    pub block_size: usize,
    /// Where to listen for the stage before.
    pub listen: SocketAddr,
    /// Where the bound listen address is written once listening (for a
    /// supervisor that chose port 0).
    pub address_file: Option<PathBuf>,
    /// The stage after this one (none on the last stage).
    pub next_stage: Option<String>,
    /// Return `LinkError::Unlinked` when a connected stage before or after
    /// goes away, instead of waiting for it (a stage the coordinator formed
    /// offers itself again; a pinned one keeps its place).
    pub leave_when_unlinked: bool,
}

/// How long the stage before has to prove the secret once it connected.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A step for the compute thread, tagged with the link it came on and
/// when it arrived.
type ComputeInput = (u64, LogprobsMode, StepHeader<'static>, Vec<u8>, Instant);

/// The compute thread's ends.
pub struct Compute {
    inputs: std_mpsc::Sender<ComputeInput>,
    outputs: mpsc::UnboundedReceiver<(u64, StageStep, Instant)>,
    layers: LayerRange,
    num_blocks: u64,
    info: StageInfo,
    metrics: Option<PipelineMetrics>,
}

impl Compute {
    /// Runs `runner` on a thread of its own; `on_pool` puts the loop on
    /// the kernels' thread pool (as the engine's step loop). `info` is this
    /// stage as the stages before see it; `metrics` records its steps.
    pub fn start(
        mut runner: StageRunner,
        info: StageInfo,
        metrics: Option<PipelineMetrics>,
        on_pool: impl FnOnce(Box<dyn FnOnce() + Send>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (inputs, rx) = std_mpsc::channel::<ComputeInput>();
        let (tx, outputs) = mpsc::unbounded_channel();
        let (layers, num_blocks) = (runner.layers(), runner.num_blocks() as u64);
        let recorder = metrics.clone();
        std::thread::Builder::new().name("stage".into()).spawn(move || {
            on_pool(Box::new(move || {
                let mut last_end: Option<Instant> = None;
                while let Ok((generation, mode, header, hidden, arrived)) = rx.recv() {
                    let (start, continues) = (Instant::now(), header.continues);
                    runner.logprobs_mode = mode;
                    let out = runner.run(header, hidden);
                    let end = Instant::now();
                    if let Some(m) = &recorder {
                        // The wait since the last step is a bubble only
                        // while the first stage had requests running.
                        let idle = last_end.filter(|_| continues).map_or(Duration::ZERO, |e| start - e);
                        m.computed(end - start);
                        m.busy_period(end - start + idle, idle);
                    }
                    last_end = Some(end);
                    if tx.send((generation, out, arrived)).is_err() {
                        return;
                    }
                }
            }))
        })?;
        Ok(Self { inputs, outputs, layers, num_blocks, info, metrics })
    }
}

/// Serves as a later stage until a fatal error (the stage after refused
/// this one, or the listen address is unusable).
pub async fn serve(config: FollowerConfig, mut compute: Compute) -> Result<(), LinkError> {
    let endpoint = link::listen(config.listen)?;
    let bound = endpoint.local_addr().map_err(|e| LinkError::Connection(e.to_string()))?;
    tracing::info!("stage {} (layers {}): listening for the stage before on {bound}", config.name, compute.layers);
    if let Some(path) = &config.address_file {
        // Written whole, then renamed: a reader never sees half an address.
        let partial = path.with_extension("partial");
        std::fs::write(&partial, bound.to_string())
            .and_then(|()| std::fs::rename(&partial, path))
            .map_err(|e| LinkError::Connection(format!("writing {}: {e}", path.display())))?;
    }
    let mut generation = 0u64;
    loop {
        let mut downstream = match &config.next_stage {
            Some(address) => {
                let hello = StageHello {
                    version: STAGE_PROTOCOL_VERSION,
                    name: config.name.clone(),
                    model: config.model.clone(),
                    block_size: config.block_size as u32,
                    kv_cache_dtype: compute.info.kv_cache_dtype.clone(),
                    next_layer: compute.layers.end as u32,
                    raw_logits: false,
                    auth_tag: Vec::new(),
                };
                let d = link::dial_until_up(address, &config.secret, hello).await?;
                tracing::info!("stage: connected to the next stage at {address}");
                Some(d)
            }
            None => None,
        };
        let (num_blocks, stages) = match &downstream {
            Some(d) => {
                let stages = std::iter::once(compute.info.clone()).chain(d.stages.iter().cloned()).collect();
                (compute.num_blocks.min(d.num_blocks), stages)
            }
            None => (compute.num_blocks, vec![compute.info.clone()]),
        };
        loop {
            let check = |hello: &StageHello| check_hello(hello, &config, &compute.info, compute.layers);
            let incoming = tokio::select! {
                incoming = endpoint.accept() => incoming,
                () = lost(&mut downstream) => {
                    if config.leave_when_unlinked {
                        return Err(LinkError::Unlinked("lost the next stage".into()));
                    }
                    break;
                }
            };
            let Some(incoming) = incoming else { return Err(LinkError::Closed) };
            // A peer that stalls in the handshake does not hold the port.
            let handshake = link::accept(incoming, &config.secret, check, num_blocks, stages.clone());
            let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
                .await
                .unwrap_or_else(|_| Err(LinkError::Connection("no handshake within 10 s".into())));
            let up = match accepted {
                Ok(up) => up,
                Err(LinkError::Closed) => return Err(LinkError::Closed),
                Err(e) => {
                    tracing::warn!("stage: refused a stage before: {e}");
                    continue;
                }
            };
            generation += 1;
            tracing::info!("stage: the stage before ({}) connected", up.hello.name);
            match serve_link(up, &mut downstream, &mut compute, generation).await {
                LinkEnd::UpstreamGone(why) if config.leave_when_unlinked => {
                    return Err(LinkError::Unlinked(format!("the stage before left ({why})")));
                }
                LinkEnd::DownstreamGone if config.leave_when_unlinked => {
                    return Err(LinkError::Unlinked("lost the next stage".into()));
                }
                LinkEnd::UpstreamGone(why) => tracing::warn!("stage: the stage before left ({why})"),
                LinkEnd::DownstreamGone => {
                    tracing::info!(
                        "stage {}: lost the next stage; dropping the stage before and dialling again",
                        config.name
                    );
                    break;
                }
                LinkEnd::ComputeStopped => return Err(LinkError::Connection("the compute thread stopped".into())),
            }
        }
    }
}

/// Why the stage before may not connect, in words naming both sides.
fn check_hello(hello: &StageHello, config: &FollowerConfig, own: &StageInfo, layers: LayerRange) -> Result<(), String> {
    if hello.version != STAGE_PROTOCOL_VERSION {
        return Err(format!("stage protocol {} there, {STAGE_PROTOCOL_VERSION} here", hello.version));
    }
    if hello.model != config.model {
        return Err(format!(
            "model files differ: stage {} serves {} (config.json hash {:016x}), stage {} serves {} (config.json hash \
             {:016x})",
            hello.name,
            hello.model.name,
            hello.model.config_hash,
            config.name,
            config.model.name,
            config.model.config_hash
        ));
    }
    if hello.block_size as usize != config.block_size {
        return Err(format!("block size {} there, {} here", hello.block_size, config.block_size));
    }
    if hello.kv_cache_dtype != own.kv_cache_dtype {
        return Err(format!(
            "KV cache dtype {} there, {} here: every stage needs the same --kv-cache-dtype",
            hello.kv_cache_dtype, own.kv_cache_dtype
        ));
    }
    if hello.next_layer as usize != layers.start {
        return Err(format!(
            "stage {} ends before layer {}, but stage {} holds layers {layers}",
            hello.name, hello.next_layer, config.name
        ));
    }
    Ok(())
}

enum LinkEnd {
    UpstreamGone(String),
    DownstreamGone,
    ComputeStopped,
}

/// Resolves when the link to the stage after is lost (never without one).
/// Results that arrive while no stage before is connected are stale.
async fn lost(downstream: &mut Option<Downstream>) {
    match downstream {
        Some(d) => while d.results.recv().await.is_some() {},
        None => std::future::pending().await,
    }
}

async fn next_result(downstream: &mut Option<Downstream>) -> Option<Arrived<StepResult>> {
    match downstream {
        Some(d) => d.results.recv().await,
        None => std::future::pending().await,
    }
}

/// One connected stage before: steps in, through compute, on or back.
async fn serve_link(
    up: Upstream,
    downstream: &mut Option<Downstream>,
    compute: &mut Compute,
    generation: u64,
) -> LinkEnd {
    let Upstream { conn, mut send, mut recv, hello } = up;
    let mode = if hello.raw_logits { LogprobsMode::RawLogits } else { LogprobsMode::RawLogprobs };
    let (frame_tx, mut frames) = mpsc::channel(4);
    let reader = tokio::spawn(async move {
        loop {
            let frame = link::read_framed(&mut recv, StepHeader::raw_bytes).await;
            let last = !matches!(frame, Ok(Some(_)));
            if frame_tx.send(frame).await.is_err() || last {
                return;
            }
        }
    });
    let end = loop {
        tokio::select! {
            frame = frames.recv() => match frame {
                Some(Ok(Some(step))) => {
                    if let Some(m) = &compute.metrics {
                        m.received(step.bytes);
                    }
                    if compute.inputs.send((generation, mode, step.frame, step.raw, step.at)).is_err() {
                        break LinkEnd::ComputeStopped;
                    }
                }
                Some(Ok(None)) | None => break LinkEnd::UpstreamGone("it closed the link".into()),
                Some(Err(e)) => break LinkEnd::UpstreamGone(e.to_string()),
            },
            out = compute.outputs.recv() => match out {
                None => break LinkEnd::ComputeStopped,
                Some((g, ..)) if g != generation => {} // a step of a link already gone
                Some((_, StageStep::Forward(mut header, hidden), arrived)) => {
                    let Some(d) = downstream.as_ref() else { break LinkEnd::DownstreamGone };
                    header.stage_micros += arrived.elapsed().as_micros() as u64;
                    match d.send(&header, hidden) {
                        Ok(bytes) => compute.metrics.iter().for_each(|m| m.sent(bytes)),
                        Err(_) => break LinkEnd::DownstreamGone,
                    }
                }
                Some((_, StageStep::Result(mut result, raw), arrived)) => {
                    result.add_stage_micros(arrived.elapsed().as_micros() as u64);
                    match link::write_framed(&mut send, &result, &raw).await {
                        Ok(bytes) => compute.metrics.iter().for_each(|m| m.sent(bytes)),
                        Err(e) => break LinkEnd::UpstreamGone(e.to_string()),
                    }
                }
            },
            result = next_result(downstream) => match result {
                Some(result) => {
                    if let Err(e) = link::write_framed(&mut send, &result.frame, &result.raw).await {
                        break LinkEnd::UpstreamGone(e.to_string());
                    }
                }
                None => break LinkEnd::DownstreamGone,
            },
        }
    };
    reader.abort();
    conn.close(0u32.into(), b"stage link closed");
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stages share the first stage's block ids and budget: one whose KV
    /// cache stores values otherwise is refused, naming both dtypes.
    #[test]
    fn a_stage_with_another_kv_cache_dtype_is_refused() {
        let model = ModelIdentity { name: "m".into(), config_hash: 1 };
        let config = FollowerConfig {
            name: "stage-1".into(),
            secret: String::new(),
            model: model.clone(),
            block_size: 16,
            listen: "127.0.0.1:0".parse().expect("an address"),
            address_file: None,
            next_stage: None,
            leave_when_unlinked: false,
        };
        let own = StageInfo {
            name: "stage-1".into(),
            layers: "4-7".into(),
            weight_bytes: 1,
            kv_bytes: 1,
            metrics_address: None,
            kv_cache_dtype: "q8_0".into(),
            kv_capacity_tokens: 16,
        };
        let layers = LayerRange { start: 4, end: 8, total: 8 };
        let mut hello = StageHello {
            version: STAGE_PROTOCOL_VERSION,
            name: "stage-0".into(),
            model,
            block_size: 16,
            kv_cache_dtype: "q8_0".into(),
            next_layer: 4,
            raw_logits: false,
            auth_tag: Vec::new(),
        };
        assert_eq!(check_hello(&hello, &config, &own, layers), Ok(()));
        hello.kv_cache_dtype = "f32".into();
        let refusal = check_hello(&hello, &config, &own, layers).expect_err("refused");
        assert!(refusal.contains("f32 there, q8_0 here"), "{refusal}");
    }
}
