//! The workers the coordinator knows: how to reach each one (a channel to
//! its connection's writer task), its state, its last stats and the
//! requests it is serving. Plain data under the cluster's lock; the
//! watchdog asks it which workers fell silent.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::WorkerId;
use common::pipeline::StageInfo;
use common::protocol::{CoordinatorMessage, Handshake, JoinedBy, WorkerStats};
use serde::Serialize;
use tokio::sync::mpsc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    Ready,
    Draining,
}

impl WorkerState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
        }
    }
}

/// What `GET /v1/workers` shows of a worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerInfo {
    pub id: WorkerId,
    pub name: String,
    pub address: String,
    /// Where the worker serves Prometheus metrics, if it does.
    pub metrics_address: Option<String>,
    /// What the worker's engine runs on, as it reported it.
    pub device: String,
    /// How it found the coordinator: local, address, join token or discovery.
    pub joined_by: &'static str,
    /// Its stable id (kept in its state directory).
    pub instance_id: String,
    /// Its pipeline, first stage (this worker) first, with each stage's
    /// layers and resident bytes; one stage for a worker that is no pipeline.
    pub stages: Vec<StageInfo>,
    /// How its KV cache stores values (f32, f16, bf16, q8_0), and the
    /// tokens it holds (its pipeline's blocks x block size).
    pub kv_cache_dtype: String,
    pub kv_capacity_tokens: u64,
    pub state: WorkerState,
    /// Requests dispatched to it and not finished, counted at dispatch.
    pub in_flight_requests: usize,
    /// The router's ledger of its load, updated at every dispatch, first
    /// token and finish (so a burst shows at once, not at the next stats).
    pub load: WorkerLoadInfo,
    /// The worker's own last report (up to a stats interval old).
    pub stats: WorkerStats,
    pub seconds_since_stats: f64,
}

/// `WorkerInfo::load`: what the router counts against the worker now.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WorkerLoadInfo {
    /// Requests in flight that have produced their first token.
    pub running: u32,
    /// Requests in flight still waiting for their first token.
    pub waiting: u32,
    pub pending_prefill_tokens: u64,
    pub active_blocks: u64,
}

pub(super) struct WorkerEntry {
    pub name: String,
    pub address: SocketAddr,
    metrics_address: Option<String>,
    device: String,
    joined_by: JoinedBy,
    instance_id: String,
    stages: Vec<StageInfo>,
    block_size: u64,
    tx: mpsc::UnboundedSender<CoordinatorMessage>,
    state: WorkerState,
    stats: WorkerStats,
    last_stats: Instant,
    /// Requests dispatched to it and not finished.
    pub in_flight: usize,
    /// Its KV blocks' identity and size, and whether it keeps a peer's
    /// blocks (peer fetch moves blocks between workers of one identity).
    pub kv_identity: u64,
    pub kv_block_bytes: u64,
    pub kv_tier: bool,
}

impl WorkerEntry {
    /// Its measured prefill rate, tokens a second (0 before it reported one).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        f64::from(self.stats.prefill_tokens_per_s)
    }
}

impl WorkerEntry {
    /// Queues `message` for the worker; false if its connection is gone.
    pub fn send(&self, message: CoordinatorMessage) -> bool {
        self.tx.send(message).is_ok()
    }
}

#[derive(Default)]
pub(super) struct Registry {
    workers: BTreeMap<WorkerId, WorkerEntry>,
    next_id: u64,
}

impl Registry {
    /// Lists a worker that passed the handshake; `tx` reaches it.
    pub fn register(
        &mut self,
        hello: &Handshake,
        address: SocketAddr,
        tx: mpsc::UnboundedSender<CoordinatorMessage>,
    ) -> WorkerId {
        let id = WorkerId(self.next_id);
        self.next_id += 1;
        self.workers.insert(
            id,
            WorkerEntry {
                name: hello.worker_name.clone(),
                address,
                metrics_address: hello.metrics_address.as_deref().map(|m| metrics_address(m, address)),
                device: hello.device.clone(),
                joined_by: hello.joined_by,
                instance_id: hello.instance_id.clone(),
                stages: hello.stages.clone(),
                block_size: hello.block_size.into(),
                tx,
                state: WorkerState::Ready,
                stats: WorkerStats { kv_blocks_total: hello.kv_capacity_blocks, ..WorkerStats::default() },
                last_stats: Instant::now(),
                in_flight: 0,
                kv_identity: hello.kv_identity,
                kv_block_bytes: hello.kv_block_bytes,
                kv_tier: hello.kv_tier,
            },
        );
        id
    }

    /// Every registered worker, ready or draining.
    pub fn all(&self) -> impl Iterator<Item = (WorkerId, &WorkerEntry)> {
        self.workers.iter().map(|(&id, w)| (id, w))
    }

    pub fn remove(&mut self, id: WorkerId) -> Option<WorkerEntry> {
        self.workers.remove(&id)
    }

    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    pub fn get_mut(&mut self, id: WorkerId) -> Option<&mut WorkerEntry> {
        self.workers.get_mut(&id)
    }

    pub fn is_ready(&self) -> bool {
        self.workers.values().any(|w| w.state == WorkerState::Ready)
    }

    /// The ready workers other than `exclude`, in ascending id order (as
    /// the router wants them).
    pub fn ready_except(&self, exclude: Option<WorkerId>) -> Vec<WorkerId> {
        self.workers
            .iter()
            .filter(|&(&w, entry)| entry.state == WorkerState::Ready && Some(w) != exclude)
            .map(|(&w, _)| w)
            .collect()
    }

    /// The name of the live worker with stable id `instance_id`, if any.
    pub fn with_instance_id(&self, instance_id: &str) -> Option<&str> {
        self.workers.values().find(|w| !instance_id.is_empty() && w.instance_id == instance_id).map(|w| w.name.as_str())
    }

    /// What `/v1/workers` shows; `load` gives the router's view of each.
    pub fn infos(&self, load: impl Fn(WorkerId) -> WorkerLoadInfo) -> Vec<WorkerInfo> {
        self.workers
            .iter()
            .map(|(&id, w)| WorkerInfo {
                load: load(id),
                id,
                name: w.name.clone(),
                address: w.address.to_string(),
                metrics_address: w.metrics_address.clone(),
                device: w.device.clone(),
                joined_by: w.joined_by.as_str(),
                instance_id: w.instance_id.clone(),
                stages: w.stages.clone(),
                kv_cache_dtype: w.stages.first().map_or_else(String::new, |s| s.kv_cache_dtype.clone()),
                kv_capacity_tokens: w.stats.kv_blocks_total * w.block_size,
                state: w.state,
                in_flight_requests: w.in_flight,
                stats: w.stats.clone(),
                seconds_since_stats: w.last_stats.elapsed().as_secs_f64(),
            })
            .collect()
    }

    /// A worker's name for responses (its id if it is already gone).
    pub fn label(&self, id: WorkerId) -> String {
        self.workers.get(&id).map_or_else(|| format!("worker-{id}"), |w| w.name.clone())
    }

    pub fn on_stats(&mut self, id: WorkerId, stats: WorkerStats) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.stats = stats;
            w.last_stats = Instant::now();
        }
    }

    /// One of the worker's requests finished or moved away.
    pub fn release(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.in_flight = w.in_flight.saturating_sub(1);
        }
    }

    /// Asks the coordinator's own workers (`--local-workers`) to drain
    /// (finish in-flight work, take no more, exit). Workers on other
    /// machines are left running: they reconnect to the coordinator when it
    /// is back, their KV caches warm.
    pub fn drain_local(&mut self) {
        for w in self.workers.values_mut().filter(|w| w.joined_by == JoinedBy::Local) {
            w.state = WorkerState::Draining;
            let _ = w.tx.send(CoordinatorMessage::Drain);
        }
    }

    /// The worker said it is draining: no new requests go to it.
    pub fn set_draining(&mut self, id: WorkerId) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.state = WorkerState::Draining;
        }
    }

    pub fn is_draining(&self, id: WorkerId) -> bool {
        self.workers.get(&id).is_some_and(|w| w.state == WorkerState::Draining)
    }

    /// The workers named `name` (a local worker whose process the
    /// supervisor saw exit).
    pub fn named(&self, name: &str) -> Vec<WorkerId> {
        self.workers.iter().filter(|(_, w)| w.name == name).map(|(&id, _)| id).collect()
    }

    /// Workers whose last stats are older than `limit` at `now`.
    pub fn silent_for(&self, limit: Duration, now: Instant) -> Vec<WorkerId> {
        self.workers
            .iter()
            .filter(|(_, w)| now.saturating_duration_since(w.last_stats) > limit)
            .map(|(&id, _)| id)
            .collect()
    }

    /// The coordinator itself did not run for `stalled` (its thread was
    /// starved, or the process stopped): stats that arrived in that time
    /// could not be read, so that time does not count as the workers'
    /// silence.
    pub fn excuse_stall(&mut self, stalled: Duration, now: Instant) {
        for w in self.workers.values_mut() {
            w.last_stats = (w.last_stats + stalled).min(now);
        }
    }
}

/// A worker's metrics address as Prometheus can reach it: a worker bound to
/// an unspecified address (0.0.0.0:9101) is reached at the IP it connected from.
fn metrics_address(advertised: &str, peer: SocketAddr) -> String {
    match advertised.parse::<SocketAddr>() {
        Ok(addr) if addr.ip().is_unspecified() => SocketAddr::new(peer.ip(), addr.port()).to_string(),
        _ => advertised.to_string(),
    }
}
