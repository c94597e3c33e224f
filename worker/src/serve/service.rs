//! `tinyvllm-worker serve`: the service shell around the engine. The
//! engine runs on its own thread and owns its state; the network side (a
//! tokio current-thread runtime, the lowest-latency choice for one QUIC
//! connection) talks to it through channels. If the coordinator goes away,
//! in-flight requests are aborted (the coordinator re-dispatches them) and
//! the worker dials again with exponential backoff.

use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::protocol::{
    CoordinatorMessage, Handshake, HandshakeReply, ModelIdentity, PROTOCOL_VERSION, WorkerHello, WorkerMessage,
    WorkerStats,
};
use common::transport::{self, Role};
use common::{RequestId, SamplingParams};
use tokio::sync::mpsc;

use crate::engine::Engine;
use crate::error::WorkerError;
use crate::serve::compile::{PendingCompiles, Waiting};
use crate::serve::metrics::{EngineMetrics, RequestTimings};
use engine_core::{RequestOutput, SchedulerStats};

/// How often stats are reported (the coordinator declares a worker lost after 3 missed).
pub use common::protocol::STATS_INTERVAL;

pub struct ServeConfig {
    pub coordinator: String,
    /// How `coordinator` was found.
    pub joined_by: common::protocol::JoinedBy,
    /// The worker's stable id (from its state directory).
    pub instance_id: String,
    pub name: String,
    pub secret: String,
    pub model: ModelIdentity,
    /// Tokens per KV block (a u32 on the wire).
    pub block_size: usize,
    pub max_model_len: u64,
    /// The bound address of the worker's metrics endpoint, if any.
    pub metrics_address: Option<String>,
    /// What the engine runs on, in words (shown in the coordinator's /v1/workers).
    pub device: String,
    /// This worker's pipeline, itself first (see `Handshake::stages`).
    pub stages: Vec<common::pipeline::StageInfo>,
    /// Set by the engine loop when its pipeline is lost (see `engine_loop`).
    pub pipeline_lost: Arc<OnceLock<String>>,
    /// The engine's KV identity, and whether it takes a peer's blocks.
    pub kv_identity: u64,
    pub kv_block_bytes: u64,
    pub kv_tier: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("coordinator address {0:?}: {1}")]
    Address(String, String),
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
    #[error("the coordinator failed to prove it knows the cluster secret")]
    CoordinatorNotAuthenticated,
    #[error(transparent)]
    Transport(#[from] common::transport::TransportError),
    #[error("connection: {0}")]
    Connection(String),
    #[error("engine thread stopped")]
    EngineStopped,
    #[error("a block size of {0} tokens does not fit the protocol")]
    BlockSize(usize),
    #[error("{0}")]
    PipelineLost(String),
}

/// Commands from the network side to the engine thread.
// `Generate` is the large and the common one (see `CoordinatorMessage`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum EngineCommand {
    Generate {
        request_id: RequestId,
        prompt: Vec<u32>,
        /// Tokens generated before, on a worker that was lost.
        output: Vec<u32>,
        params: SamplingParams,
        /// Scheduling priority (lower first, under `--scheduling-policy priority`).
        priority: i32,
    },
    Abort(RequestId),
    /// Send every cached block hash (the router missed events).
    KvSnapshot,
    /// Send a peer these blocks (see `CoordinatorMessage::ExportKv`).
    ExportKv {
        transfer: u64,
        hashes: Vec<common::BlockHash>,
    },
    /// Keep a peer's blocks (see `CoordinatorMessage::ImportKv`).
    ImportKv {
        identity: u64,
        blocks: Vec<common::protocol::KvBlock>,
    },
    /// The coordinator connection dropped: abort everything in flight.
    AbortAll,
    Drain,
    Shutdown,
}

/// Runs the engine loop on the current thread until `Shutdown` or until
/// every sender is gone. Messages for the coordinator go to `out`; with
/// `metrics`, the loop also records vLLM's engine metrics.
///
/// On the first stage of a pipeline whose link is lost the loop sets
/// `pipeline_lost` and stops at once, aborting nothing: the service then
/// closes its coordinator connection, and the coordinator re-dispatches
/// the requests with the tokens they already streamed.
pub fn engine_loop(
    mut engine: Engine,
    commands: std_mpsc::Receiver<EngineCommand>,
    out: mpsc::UnboundedSender<WorkerMessage>,
    mut metrics: Option<EngineMetrics>,
    pipeline_lost: &OnceLock<String>,
) {
    let mut timings = RequestTimings::default();
    let mut prefill_rate = PrefillRate::default();
    let mut draining = false;
    let mut last_stats = Instant::now() - STATS_INTERVAL;
    let mut compiling = PendingCompiles::default();
    loop {
        // Block only when idle; otherwise take what arrived and step. A
        // grammar compiling elsewhere is waited for in short naps.
        let first = if engine.has_unfinished() {
            commands.try_recv().ok()
        } else {
            let wait = if compiling.is_empty() { STATS_INTERVAL } else { Duration::from_millis(1) };
            match commands.recv_timeout(wait) {
                Ok(cmd) => Some(cmd),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        for cmd in first.into_iter().chain(std::iter::from_fn(|| commands.try_recv().ok())) {
            match cmd {
                EngineCommand::Generate { request_id, prompt, output, params, priority } => {
                    let _span = tracing::debug_span!("request", id = request_id.0).entered();
                    tracing::debug!(prompt_tokens = prompt.len(), resumed_tokens = output.len(), priority, "arrived");
                    if draining {
                        let _ = out.send(WorkerMessage::Rejected { request_id, message: "worker is draining".into() });
                    } else if params.structured_output.is_some() {
                        match engine.grammar_compiler() {
                            Ok(compiler) => {
                                let request = Waiting { prompt, output, params, priority, arrived: Instant::now() };
                                compiling.start(request_id, compiler, request);
                            }
                            Err(e) => {
                                let _ = out.send(WorkerMessage::Rejected { request_id, message: e.to_string() });
                            }
                        }
                    } else if let Err(e) = engine.resume_request(request_id, prompt, &output, params, priority) {
                        let _ = out.send(WorkerMessage::Rejected { request_id, message: e.to_string() });
                    } else {
                        timings.arrived(request_id, Instant::now());
                    }
                }
                EngineCommand::Abort(id) => {
                    if (compiling.cancel(id) || engine.abort(id).is_some())
                        && let Some(m) = &metrics
                    {
                        timings.aborted(m, id, Instant::now());
                    }
                }
                EngineCommand::AbortAll => {
                    compiling.cancel_all();
                    for o in engine.abort_all() {
                        if let Some(m) = &metrics {
                            timings.aborted(m, o.id, Instant::now());
                        }
                    }
                }
                EngineCommand::KvSnapshot => {
                    // Pending events go first: the snapshot covers them, and
                    // the coordinator skips ids it already has.
                    let events = engine.drain_kv_events();
                    if !events.is_empty() {
                        let _ = out.send(WorkerMessage::KvEvents(events));
                    }
                    let (last_event_id, hashes) = engine.kv_snapshot();
                    let offloaded = engine.tier_snapshot();
                    let _ = out.send(WorkerMessage::KvSnapshot { last_event_id, hashes, offloaded });
                }
                EngineCommand::ExportKv { transfer, hashes } => {
                    let blocks = engine.export_kv_blocks(&hashes).unwrap_or_else(|e| {
                        tracing::warn!("exporting KV blocks: {e}");
                        Vec::new()
                    });
                    for frame in super::handoff::export_frames(transfer, blocks) {
                        let _ = out.send(frame);
                    }
                }
                EngineCommand::ImportKv { identity, blocks } => {
                    let offered = blocks.len();
                    let kept = engine.import_kv_blocks(identity, blocks);
                    tracing::debug!(offered, kept, "KV blocks from a peer");
                }
                EngineCommand::Drain => {
                    if !draining {
                        // The coordinator stops routing here at once.
                        let _ = out.send(WorkerMessage::Draining);
                    }
                    draining = true;
                }
                EngineCommand::Shutdown => return,
            }
        }
        for c in compiling.finished() {
            let Waiting { prompt, output, params, priority, arrived } = c.request;
            let added = c.grammar.map_err(|e| e.to_string()).and_then(|grammar| {
                engine
                    .resume_request_with_grammar(c.id, prompt, &output, params, priority, Some(grammar))
                    .map_err(|e| e.to_string())
            });
            match added {
                Ok(()) => {
                    timings.arrived(c.id, arrived);
                }
                Err(message) => {
                    let _ = out.send(WorkerMessage::Rejected { request_id: c.id, message });
                }
            }
        }
        if engine.has_unfinished() {
            let started = Instant::now();
            match engine.step() {
                Ok(outputs) => {
                    prefill_rate.stepped(engine.last_step().num_batched_tokens, started.elapsed());
                    if let Some(m) = &metrics {
                        let now = Instant::now();
                        let step = engine.last_step();
                        timings.stepped(m, &step.scheduled, step.num_batched_tokens, now);
                        for output in &outputs {
                            timings.output(m, output, now);
                        }
                    }
                    for output in outputs {
                        if let Some(reason) = output.finish_reason {
                            let _span = tracing::debug_span!("request", id = output.id.0).entered();
                            tracing::debug!(?reason, "finished");
                        }
                        let _ = out.send(token_delta(output));
                    }
                }
                Err(WorkerError::PipelineLost(why)) => {
                    tracing::warn!("engine: pipeline lost ({why}); leaving the cluster so its requests move elsewhere");
                    let _ = pipeline_lost.set(why);
                    return;
                }
                Err(e) => {
                    // A failed forward pass fails the requests of that step, not the worker.
                    tracing::error!("engine step failed: {e}; aborting in-flight requests");
                    for o in engine.abort_all() {
                        if let Some(m) = &metrics {
                            timings.output(m, &o, Instant::now());
                        }
                        let _ = out.send(token_delta(o));
                    }
                }
            }
        }
        if !engine.has_unfinished()
            && let Err(WorkerError::PipelineLost(why)) = engine.check_next_stage()
        {
            tracing::warn!("engine: pipeline lost while idle ({why}); leaving the cluster");
            let _ = pipeline_lost.set(why);
            return;
        }
        let events = engine.drain_kv_events();
        if !events.is_empty() {
            let _ = out.send(WorkerMessage::KvEvents(events));
        }
        if let Some(m) = &mut metrics {
            // Cheap (counters only); keeps the gauges fresh at every scrape.
            m.observe_stats(&engine.stats(), engine.tier_store_stats());
        }
        if last_stats.elapsed() >= STATS_INTERVAL {
            last_stats = Instant::now();
            let _ = out.send(WorkerMessage::Stats(wire_stats(&engine.stats(), prefill_rate.tokens_per_s)));
        }
        if draining && !engine.has_unfinished() && compiling.is_empty() {
            super::handoff::hand_off(&mut engine, &out);
            return;
        }
    }
}

fn token_delta(o: RequestOutput) -> WorkerMessage {
    WorkerMessage::TokenDelta {
        request_id: o.id,
        prompt_logprobs: o.prompt_logprobs,
        new_token_ids: o.new_token_ids,
        logprobs: o.logprobs,
        finish_reason: o.finish_reason,
        num_prompt_tokens: o.num_prompt_tokens as u32,
        num_cached_tokens: o.num_cached_tokens as u32,
    }
}

/// Tokens a second of the steps that compute at least `PrefillRate::MIN_TOKENS`
/// (prefill chunks), as a moving average.
#[derive(Default)]
struct PrefillRate {
    tokens_per_s: f32,
}

impl PrefillRate {
    const MIN_TOKENS: usize = 64;

    fn stepped(&mut self, tokens: usize, took: Duration) {
        if tokens < Self::MIN_TOKENS || took.is_zero() {
            return;
        }
        let rate = (tokens as f64 / took.as_secs_f64()) as f32;
        self.tokens_per_s = if self.tokens_per_s == 0.0 { rate } else { 0.8 * self.tokens_per_s + 0.2 * rate };
    }
}

/// The engine's counters for the coordinator, with its measured prefill rate.
pub fn wire_stats(s: &SchedulerStats, prefill_tokens_per_s: f32) -> WorkerStats {
    WorkerStats {
        prefill_tokens_per_s,
        num_running: s.num_running as u32,
        num_waiting: s.num_waiting as u32,
        kv_blocks_total: s.kv_blocks_total as u64,
        kv_blocks_used: s.kv_blocks_used as u64,
        kv_blocks_cached: s.kv_blocks_cached as u64,
        prefix_cache_queries: s.prefix_cache.queries,
        prefix_cache_hits: s.prefix_cache.hits,
        num_preemptions: s.num_preemptions,
    }
}

/// Connects, serves, and reconnects with backoff until the engine stops
/// or the coordinator refuses this worker (wrong secret or version: retrying
/// cannot help).
pub async fn serve(
    config: ServeConfig,
    kv_capacity_blocks: u64,
    commands: std_mpsc::Sender<EngineCommand>,
    mut from_engine: mpsc::UnboundedReceiver<WorkerMessage>,
) -> Result<(), ServiceError> {
    let addr = resolve(&config.coordinator).await?;
    let endpoint = transport::client_endpoint(addr)?;
    let mut backoff = Duration::from_millis(100);
    loop {
        match session(&endpoint, addr, &config, kv_capacity_blocks, &commands, &mut from_engine).await {
            Ok(SessionEnd::EngineStopped) => {
                // Let the close (reason "drained") reach the coordinator,
                // so it logs why this worker left instead of waiting for
                // its stats to stop.
                let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
                return Ok(());
            }
            Ok(SessionEnd::Disconnected(why)) => {
                tracing::warn!("lost the coordinator at {addr} ({why}); reconnecting");
                backoff = Duration::from_millis(100);
            }
            Err(
                e @ (ServiceError::Refused(_) | ServiceError::CoordinatorNotAuthenticated | ServiceError::BlockSize(_)),
            ) => {
                return Err(e);
            }
            Err(e @ ServiceError::PipelineLost(_)) => {
                let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
                return Err(e);
            }
            Err(e) => tracing::warn!("connecting to the coordinator at {addr}: {e}; retrying in {backoff:?}"),
        }
        commands.send(EngineCommand::AbortAll).map_err(|_| ServiceError::EngineStopped)?;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

enum SessionEnd {
    EngineStopped,
    Disconnected(String),
}

async fn session(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    config: &ServeConfig,
    kv_capacity_blocks: u64,
    commands: &std_mpsc::Sender<EngineCommand>,
    from_engine: &mut mpsc::UnboundedReceiver<WorkerMessage>,
) -> Result<SessionEnd, ServiceError> {
    let conn = endpoint
        .connect(addr, transport::SERVER_NAME)
        .map_err(|e| ServiceError::Connection(e.to_string()))?
        .await
        .map_err(|e| ServiceError::Connection(e.to_string()))?;
    let binding = transport::channel_binding(&conn)?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| ServiceError::Connection(e.to_string()))?;
    let hello = Handshake {
        protocol_version: PROTOCOL_VERSION,
        worker_name: config.name.clone(),
        model: config.model.clone(),
        block_size: u32::try_from(config.block_size).map_err(|_| ServiceError::BlockSize(config.block_size))?,
        kv_capacity_blocks,
        max_model_len: config.max_model_len,
        metrics_address: config.metrics_address.clone(),
        device: config.device.clone(),
        stages: config.stages.clone(),
        joined_by: config.joined_by,
        instance_id: config.instance_id.clone(),
        auth_tag: transport::auth_tag(config.secret.as_bytes(), Role::Worker, &binding),
        kv_identity: config.kv_identity,
        kv_block_bytes: config.kv_block_bytes,
        kv_tier: config.kv_tier,
    };
    transport::write_frame(&mut send, &WorkerHello::Register(hello)).await?;
    match transport::read_frame::<HandshakeReply>(&mut recv).await? {
        Some(HandshakeReply::Accepted { worker_id, auth_tag }) => {
            if !transport::verify_auth_tag(config.secret.as_bytes(), Role::Coordinator, &binding, &auth_tag) {
                return Err(ServiceError::CoordinatorNotAuthenticated);
            }
            transport::trust_connection(&conn);
            tracing::info!("registered with the coordinator at {addr} as worker {worker_id}");
        }
        Some(HandshakeReply::Refused { reason }) => return Err(ServiceError::Refused(reason)),
        Some(HandshakeReply::Later { reason }) => return Err(ServiceError::Connection(format!("not yet: {reason}"))),
        None => return Ok(SessionEnd::Disconnected("closed during the handshake".into())),
    }
    // Anything the engine produced while disconnected belongs to aborted requests.
    while from_engine.try_recv().is_ok() {}
    // Frames are read by a task of their own: `read_frame` is not
    // cancel-safe, and the loop below selects over three sources.
    let (frame_tx, mut frames) = mpsc::channel(64);
    let reader = tokio::spawn(async move {
        loop {
            let frame = transport::read_frame::<CoordinatorMessage>(&mut recv).await;
            let last = !matches!(frame, Ok(Some(_)));
            if frame_tx.send(frame).await.is_err() || last {
                return;
            }
        }
    });
    let end = control_loop(&mut send, &mut frames, kv_capacity_blocks, commands, from_engine).await;
    reader.abort();
    if matches!(end, SessionEnd::EngineStopped) {
        if let Some(why) = config.pipeline_lost.get() {
            conn.close(1u32.into(), b"pipeline stage lost");
            return Err(ServiceError::PipelineLost(format!("pipeline lost: {why}")));
        }
        conn.close(0u32.into(), transport::DRAINED_CLOSE_REASON);
    }
    Ok(end)
}

/// The connected session: coordinator frames go to the engine, engine
/// messages and heartbeats go to the coordinator.
async fn control_loop(
    send: &mut quinn::SendStream,
    frames: &mut mpsc::Receiver<Result<Option<CoordinatorMessage>, transport::TransportError>>,
    kv_capacity_blocks: u64,
    commands: &std_mpsc::Sender<EngineCommand>,
    from_engine: &mut mpsc::UnboundedReceiver<WorkerMessage>,
) -> SessionEnd {
    // The engine reports stats between steps, and one long prefill step can
    // outlast the coordinator's patience (3 missed intervals). So the network
    // side repeats the latest stats on its own clock: silence then means the
    // process or its connection died, not that a step is long.
    let mut heartbeat = tokio::time::interval(STATS_INTERVAL);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut latest_stats = WorkerStats { kv_blocks_total: kv_capacity_blocks, ..WorkerStats::default() };
    let mut last_sent = Instant::now();
    let mut handing_off = false;
    loop {
        tokio::select! {
            _ = heartbeat.tick() => {
                if last_sent.elapsed() >= STATS_INTERVAL {
                    last_sent = Instant::now();
                    let message = WorkerMessage::Stats(latest_stats.clone());
                    if let Err(e) = transport::write_frame(send, &message).await {
                        return SessionEnd::Disconnected(e.to_string());
                    }
                }
            }
            frame = frames.recv() => {
                let cmd = match frame {
                    Some(Ok(Some(CoordinatorMessage::Generate {
                        request_id,
                        prompt_token_ids,
                        output_token_ids,
                        params,
                        priority,
                    }))) => EngineCommand::Generate {
                        request_id,
                        prompt: prompt_token_ids,
                        output: output_token_ids,
                        params,
                        priority,
                    },
                    Some(Ok(Some(CoordinatorMessage::Abort { request_id }))) => EngineCommand::Abort(request_id),
                    Some(Ok(Some(CoordinatorMessage::Drain))) => EngineCommand::Drain,
                    Some(Ok(Some(CoordinatorMessage::Shutdown))) => EngineCommand::Shutdown,
                    Some(Ok(Some(CoordinatorMessage::RequestKvSnapshot))) => EngineCommand::KvSnapshot,
                    Some(Ok(Some(CoordinatorMessage::ExportKv { transfer, hashes }))) => {
                        EngineCommand::ExportKv { transfer, hashes }
                    }
                    Some(Ok(Some(CoordinatorMessage::ImportKv { identity, blocks }))) => {
                        EngineCommand::ImportKv { identity, blocks }
                    }
                    Some(Ok(Some(CoordinatorMessage::HandedOff))) => continue,
                    Some(Ok(None)) | None => return SessionEnd::Disconnected("coordinator closed the stream".into()),
                    Some(Err(e)) => return SessionEnd::Disconnected(e.to_string()),
                };
                if commands.send(cmd).is_err() {
                    return SessionEnd::EngineStopped;
                }
            }
            message = from_engine.recv() => {
                let Some(message) = message else {
                    if handing_off {
                        super::handoff::await_handoff(frames).await;
                    }
                    return SessionEnd::EngineStopped;
                };
                if let WorkerMessage::ExportedKv { transfer: common::protocol::KV_HANDOFF, last: true, .. } = &message {
                    handing_off = true;
                }
                if let WorkerMessage::Stats(stats) = &message {
                    latest_stats = stats.clone();
                    last_sent = Instant::now();
                }
                if let Err(e) = transport::write_frame(send, &message).await {
                    return SessionEnd::Disconnected(e.to_string());
                }
            }
        }
    }
}

async fn resolve(host_port: &str) -> Result<SocketAddr, ServiceError> {
    let mut addrs = tokio::net::lookup_host(host_port)
        .await
        .map_err(|e| ServiceError::Address(host_port.to_string(), e.to_string()))?;
    addrs.next().ok_or_else(|| ServiceError::Address(host_port.to_string(), "no address".into()))
}
