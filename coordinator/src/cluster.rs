//! The coordinator's view of the cluster: registered workers, requests in
//! flight, and the QUIC side that connects them.
//!
//! One lock guards the state (TGI's router keeps it in one task; a short
//! critical section is as simple here). Each worker connection has a writer
//! task fed by a channel and a reader loop that routes token deltas to the
//! HTTP handler waiting on each request. When a worker is lost (its
//! connection closes, or it misses 3 stats intervals) its requests are sent
//! to another worker with the prompt plus the tokens already streamed, so
//! the client's stream goes on with no token lost or repeated.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::protocol::{
    CoordinatorMessage, Handshake, HandshakeReply, ModelIdentity, PROTOCOL_VERSION, WireFinishReason, WireLogprobs,
    WorkerMessage, WorkerStats,
};
use common::transport::{self, Role};
use common::{RequestId, SamplingParams};
use serde::Serialize;
use tokio::sync::mpsc;

/// A worker that misses this many stats intervals is declared lost.
pub const MISSED_STATS_LIMIT: u32 = 3;
pub const STATS_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    Ready,
    Draining,
}

/// What `GET /v1/workers` shows of a worker.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerInfo {
    pub id: u64,
    pub name: String,
    pub address: String,
    pub state: WorkerState,
    pub in_flight_requests: usize,
    pub stats: WorkerStats,
    pub seconds_since_stats: f64,
}

/// What an HTTP handler receives for its request.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    Tokens {
        ids: Vec<u32>,
        logprobs: Vec<WireLogprobs>,
    },
    /// `worker` names the worker that finished it (it changes on re-dispatch).
    Finished {
        reason: WireFinishReason,
        prompt_tokens: u32,
        cached_tokens: u32,
        worker: String,
    },
    Failed {
        message: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("no worker is available")]
    NoWorker,
    #[error("too many requests in flight ({0}); retry later")]
    Overloaded(usize),
}

struct WorkerEntry {
    name: String,
    address: SocketAddr,
    tx: mpsc::UnboundedSender<CoordinatorMessage>,
    state: WorkerState,
    stats: WorkerStats,
    last_stats: Instant,
    in_flight: usize,
}

struct InFlight {
    /// The prompt as the client sent it (for usage and re-dispatch).
    prompt: Vec<u32>,
    params: SamplingParams,
    generated: Vec<u32>,
    worker: u64,
    events: mpsc::UnboundedSender<RequestEvent>,
    /// Prompt tokens the first worker found cached (kept across re-dispatch).
    cached_tokens: Option<u32>,
}

#[derive(Default)]
struct State {
    workers: BTreeMap<u64, WorkerEntry>,
    requests: HashMap<RequestId, InFlight>,
    next_worker_id: u64,
    next_request_id: u64,
    redispatches: u64,
}

#[derive(Clone)]
pub struct Cluster {
    state: Arc<Mutex<State>>,
    secret: Arc<String>,
    model: ModelIdentity,
    max_in_flight: usize,
}

impl Cluster {
    pub fn new(secret: String, model: ModelIdentity, max_in_flight: usize) -> Self {
        Self { state: Arc::default(), secret: Arc::new(secret), model, max_in_flight }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way later requests could not live with; keep serving.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn is_ready(&self) -> bool {
        self.lock().workers.values().any(|w| w.state == WorkerState::Ready)
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        let state = self.lock();
        state
            .workers
            .iter()
            .map(|(&id, w)| WorkerInfo {
                id,
                name: w.name.clone(),
                address: w.address.to_string(),
                state: w.state,
                in_flight_requests: w.in_flight,
                stats: w.stats.clone(),
                seconds_since_stats: w.last_stats.elapsed().as_secs_f64(),
            })
            .collect()
    }

    pub fn in_flight(&self) -> usize {
        self.lock().requests.len()
    }

    pub fn redispatches(&self) -> u64 {
        self.lock().redispatches
    }

    /// The worker's name, for responses.
    pub fn worker_name(&self, id: u64) -> Option<String> {
        self.lock().workers.get(&id).map(|w| w.name.clone())
    }

    /// Sends a request to the least-loaded ready worker. Returns its id, the
    /// worker chosen, and the stream of its events.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestId, u64, mpsc::UnboundedReceiver<RequestEvent>), SubmitError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.lock();
        if state.requests.len() >= self.max_in_flight {
            return Err(SubmitError::Overloaded(state.requests.len()));
        }
        let worker = pick_worker(&state, None).ok_or(SubmitError::NoWorker)?;
        let id = RequestId(state.next_request_id);
        state.next_request_id += 1;
        let message =
            CoordinatorMessage::Generate { request_id: id, prompt_token_ids: prompt.clone(), params: params.clone() };
        let entry = state.workers.get_mut(&worker).expect("picked worker exists");
        if entry.tx.send(message).is_err() {
            return Err(SubmitError::NoWorker);
        }
        entry.in_flight += 1;
        state
            .requests
            .insert(id, InFlight { prompt, params, generated: Vec::new(), worker, events: tx, cached_tokens: None });
        Ok((id, worker, rx))
    }

    /// Stops a request (client gone, or a stop string matched): the worker
    /// frees its blocks within a step.
    pub fn abort(&self, id: RequestId) {
        let mut state = self.lock();
        if let Some(req) = state.requests.remove(&id) {
            if let Some(w) = state.workers.get_mut(&req.worker) {
                w.in_flight = w.in_flight.saturating_sub(1);
                let _ = w.tx.send(CoordinatorMessage::Abort { request_id: id });
            }
        }
    }

    /// Which worker a request is on now (it changes on re-dispatch).
    pub fn request_worker(&self, id: RequestId) -> Option<u64> {
        self.lock().requests.get(&id).map(|r| r.worker)
    }

    /// Asks every worker to drain (finish in-flight work, take no more).
    pub fn drain_all(&self) {
        let mut state = self.lock();
        for w in state.workers.values_mut() {
            w.state = WorkerState::Draining;
            let _ = w.tx.send(CoordinatorMessage::Drain);
        }
    }

    fn on_worker_message(&self, worker: u64, message: WorkerMessage) {
        let mut state = self.lock();
        match message {
            WorkerMessage::TokenDelta {
                request_id,
                new_token_ids,
                logprobs,
                finish_reason,
                num_prompt_tokens: _,
                num_cached_tokens,
            } => {
                let label = finish_reason.map(|_| worker_label(&state, worker));
                let Some(req) = state.requests.get_mut(&request_id) else { return };
                if req.worker != worker {
                    return; // a late delta from a worker we gave up on
                }
                req.cached_tokens.get_or_insert(num_cached_tokens);
                req.generated.extend_from_slice(&new_token_ids);
                if !new_token_ids.is_empty() {
                    let _ = req.events.send(RequestEvent::Tokens { ids: new_token_ids, logprobs });
                }
                if let Some(reason) = finish_reason {
                    let event = RequestEvent::Finished {
                        reason,
                        prompt_tokens: req.prompt.len() as u32,
                        cached_tokens: req.cached_tokens.unwrap_or(0),
                        worker: label.unwrap_or_default(),
                    };
                    let _ = req.events.send(event);
                    state.requests.remove(&request_id);
                    if let Some(w) = state.workers.get_mut(&worker) {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                }
            }
            WorkerMessage::Rejected { request_id, message } => {
                if let Some(req) = state.requests.remove(&request_id) {
                    let _ = req.events.send(RequestEvent::Failed { message });
                    if let Some(w) = state.workers.get_mut(&worker) {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                }
            }
            WorkerMessage::Stats(stats) => {
                if let Some(w) = state.workers.get_mut(&worker) {
                    w.stats = stats;
                    w.last_stats = Instant::now();
                }
            }
            WorkerMessage::KvEvents(_) | WorkerMessage::KvSnapshot { .. } => {}
        }
    }

    /// Drops a worker and moves its requests elsewhere.
    fn remove_worker(&self, worker: u64, why: &str) {
        let mut state = self.lock();
        let Some(entry) = state.workers.remove(&worker) else { return };
        eprintln!("coordinator: worker {} ({}) lost: {why}", entry.name, entry.address);
        let orphans: Vec<RequestId> =
            state.requests.iter().filter(|(_, r)| r.worker == worker).map(|(&id, _)| id).collect();
        for id in orphans {
            let target = pick_worker(&state, Some(worker));
            let req = state.requests.get_mut(&id).expect("orphan exists");
            let Some(target) = target else {
                let _ = req.events.send(RequestEvent::Failed {
                    message: "the worker serving this request was lost and no other worker is available".into(),
                });
                state.requests.remove(&id);
                continue;
            };
            // Continue from what the client already has: the prompt plus the
            // streamed tokens, with the remaining budget.
            let mut prompt = req.prompt.clone();
            prompt.extend_from_slice(&req.generated);
            let done = req.generated.len() as u32;
            let mut params = req.params.clone();
            params.max_tokens = params.max_tokens.saturating_sub(done).max(1);
            params.min_tokens = params.min_tokens.saturating_sub(done);
            req.worker = target;
            let message = CoordinatorMessage::Generate { request_id: id, prompt_token_ids: prompt, params };
            state.redispatches += 1;
            if let Some(w) = state.workers.get_mut(&target) {
                w.in_flight += 1;
                let _ = w.tx.send(message);
            }
        }
    }

    /// Accepts worker connections until the endpoint closes.
    pub async fn accept_workers(self, endpoint: quinn::Endpoint) {
        while let Some(incoming) = endpoint.accept().await {
            let cluster = self.clone();
            tokio::spawn(async move {
                let address = incoming.remote_address();
                match incoming.await {
                    Ok(conn) => {
                        if let Err(e) = cluster.handle_worker(conn).await {
                            eprintln!("coordinator: worker at {address}: {e}");
                        }
                    }
                    Err(e) => eprintln!("coordinator: QUIC handshake with {address} failed: {e}"),
                }
            });
        }
    }

    /// Marks workers that stopped reporting as lost.
    pub async fn watchdog(self) {
        let mut tick = tokio::time::interval(STATS_INTERVAL);
        loop {
            tick.tick().await;
            let stale: Vec<u64> = {
                let state = self.lock();
                state
                    .workers
                    .iter()
                    .filter(|(_, w)| w.last_stats.elapsed() > STATS_INTERVAL * MISSED_STATS_LIMIT)
                    .map(|(&id, _)| id)
                    .collect()
            };
            for id in stale {
                self.remove_worker(id, "missed 3 stats intervals");
            }
        }
    }

    async fn handle_worker(&self, conn: quinn::Connection) -> Result<(), String> {
        let address = conn.remote_address();
        let binding = transport::channel_binding(&conn).map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
        let hello: Handshake = transport::read_frame(&mut recv)
            .await
            .map_err(|e| format!("bad handshake: {e}"))?
            .ok_or("closed before the handshake")?;
        if let Some(reason) = self.refusal(&hello, &binding) {
            eprintln!("coordinator: refusing worker {:?} at {address}: {reason}", hello.worker_name);
            let _ = transport::write_frame(&mut send, &HandshakeReply::Refused { reason: reason.clone() }).await;
            let _ = send.finish();
            // Give the refusal time to arrive before the connection drops.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Err(reason);
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<CoordinatorMessage>();
        let worker_id = {
            let mut state = self.lock();
            let id = state.next_worker_id;
            state.next_worker_id += 1;
            state.workers.insert(
                id,
                WorkerEntry {
                    name: hello.worker_name.clone(),
                    address,
                    tx,
                    state: WorkerState::Ready,
                    stats: WorkerStats { kv_blocks_total: hello.kv_capacity_blocks, ..WorkerStats::default() },
                    last_stats: Instant::now(),
                    in_flight: 0,
                },
            );
            id
        };
        let reply = HandshakeReply::Accepted {
            worker_id,
            auth_tag: transport::auth_tag(self.secret.as_bytes(), Role::Coordinator, &binding),
        };
        transport::write_frame(&mut send, &reply).await.map_err(|e| e.to_string())?;
        eprintln!("coordinator: worker {:?} at {address} registered as {worker_id}", hello.worker_name);
        let writer = tokio::spawn(async move {
            while let Some(message) = rx.recv().await {
                if transport::write_frame(&mut send, &message).await.is_err() {
                    break;
                }
            }
        });
        let why = loop {
            match transport::read_frame::<WorkerMessage>(&mut recv).await {
                Ok(Some(message)) => self.on_worker_message(worker_id, message),
                Ok(None) => break "stream closed".to_string(),
                Err(e) => break e.to_string(),
            }
        };
        writer.abort();
        conn.close(0u32.into(), b"bye");
        self.remove_worker(worker_id, &why);
        Ok(())
    }

    fn refusal(&self, hello: &Handshake, binding: &[u8; 32]) -> Option<String> {
        if hello.protocol_version != PROTOCOL_VERSION {
            return Some(format!(
                "protocol version {} (this coordinator speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            ));
        }
        if !transport::verify_auth_tag(self.secret.as_bytes(), Role::Worker, binding, &hello.auth_tag) {
            return Some("wrong cluster secret".into());
        }
        if hello.model.config_hash != self.model.config_hash {
            return Some(format!("serves model {:?}, the cluster serves {:?}", hello.model.name, self.model.name));
        }
        None
    }
}

/// A worker's name for responses (its id if it is already gone).
fn worker_label(state: &State, worker: u64) -> String {
    state.workers.get(&worker).map_or_else(|| format!("worker-{worker}"), |w| w.name.clone())
}

/// The ready worker with the fewest requests in flight (ties: lowest id).
/// Prefix-aware routing replaces this in the router.
fn pick_worker(state: &State, exclude: Option<u64>) -> Option<u64> {
    state
        .workers
        .iter()
        .filter(|&(&id, w)| w.state == WorkerState::Ready && Some(id) != exclude)
        .min_by_key(|&(&id, w)| (w.in_flight, id))
        .map(|(&id, _)| id)
}
