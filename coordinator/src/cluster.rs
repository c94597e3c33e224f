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
//!
//! Where a request goes is the router's decision (`crate::router`): the
//! cluster feeds it the workers' KV events, stats and every dispatch, first
//! token and finish, and asks it for a worker under the same lock.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::protocol::{
    CoordinatorMessage, Handshake, HandshakeReply, ModelIdentity, PROTOCOL_VERSION, WireFinishReason, WireLogprobs,
    WorkerMessage, WorkerStats,
};
use common::transport::{self, Role};
use common::{BlockHash, RequestId, SamplingParams};
use prometheus::{IntCounter, IntCounterVec, Opts};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::router::{EventOutcome, Policy, Router};

/// A worker that misses this many stats intervals is declared lost.
pub const MISSED_STATS_LIMIT: u32 = 3;
pub use common::protocol::STATS_INTERVAL;

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
    /// Where the worker serves Prometheus metrics, if it does.
    pub metrics_address: Option<String>,
    /// What the worker's engine runs on, as it reported it.
    pub device: String,
    pub state: WorkerState,
    pub in_flight_requests: usize,
    pub stats: WorkerStats,
    pub seconds_since_stats: f64,
}

/// What an HTTP handler receives for its request.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    /// Log-probabilities of the next prompt tokens (`prompt_logprobs`), in
    /// order from the second prompt token, each once, all before `Tokens`.
    PromptLogprobs(Vec<WireLogprobs>),
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
    metrics_address: Option<String>,
    device: String,
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
    /// Prompt logprobs passed on so far, and how many of the next worker's
    /// to drop because an earlier worker sent them already.
    prompt_logprobs_sent: usize,
    prompt_logprobs_to_skip: usize,
}

struct State {
    workers: BTreeMap<u64, WorkerEntry>,
    requests: HashMap<RequestId, InFlight>,
    router: Router,
    next_worker_id: u64,
    next_request_id: u64,
    redispatches: u64,
}

/// The routing counters the coordinator exports (registered by `Metrics`).
#[derive(Clone)]
pub struct RoutingMetrics {
    pub decisions: IntCounterVec,
    pub predicted_cached_tokens: IntCounterVec,
    pub actual_cached_tokens: IntCounterVec,
    pub redispatches: IntCounter,
}

impl RoutingMetrics {
    fn new() -> Self {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        Self {
            decisions: counter(
                "tinyvllm_router_decisions_total",
                "Routing decisions by policy and worker",
                &["policy", "worker"],
            ),
            predicted_cached_tokens: counter(
                "tinyvllm_router_predicted_cached_tokens_total",
                "Prompt tokens the router expected the chosen worker to have cached",
                &["worker"],
            ),
            actual_cached_tokens: counter(
                "tinyvllm_router_actual_cached_tokens_total",
                "Prompt tokens the worker reported as cache hits",
                &["worker"],
            ),
            redispatches: IntCounter::new(
                "tinyvllm_redispatches_total",
                "Requests moved to another worker after theirs was lost",
            )
            .expect("valid metric"),
        }
    }
}

#[derive(Clone)]
pub struct Cluster {
    state: Arc<Mutex<State>>,
    secret: Arc<String>,
    model: ModelIdentity,
    max_in_flight: usize,
    block_size: usize,
    metrics: RoutingMetrics,
}

impl Cluster {
    /// `block_size` must equal the workers' (they are refused otherwise):
    /// the router hashes prompts in blocks of that size.
    pub fn new(secret: String, model: ModelIdentity, max_in_flight: usize, policy: Policy, block_size: usize) -> Self {
        let state = State {
            workers: BTreeMap::new(),
            requests: HashMap::new(),
            router: Router::new(policy, block_size),
            next_worker_id: 0,
            next_request_id: 0,
            redispatches: 0,
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            secret: Arc::new(secret),
            model,
            max_in_flight,
            block_size,
            metrics: RoutingMetrics::new(),
        }
    }

    pub fn routing_metrics(&self) -> &RoutingMetrics {
        &self.metrics
    }

    pub fn policy(&self) -> Policy {
        self.lock().router.policy()
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
                metrics_address: w.metrics_address.clone(),
                device: w.device.clone(),
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

    /// Sends a request to the worker the router picks. Returns its id, the
    /// worker chosen, and the stream of its events.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestId, u64, mpsc::UnboundedReceiver<RequestEvent>), SubmitError> {
        // Hashing is pure: do it before taking the lock.
        let chain = common::hash_prompt_blocks(&prompt, self.block_size);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.lock();
        if state.requests.len() >= self.max_in_flight {
            return Err(SubmitError::Overloaded(state.requests.len()));
        }
        let id = RequestId(state.next_request_id);
        let worker = self.dispatch(&mut state, id, &prompt, &chain, params.clone(), None)?;
        state.next_request_id += 1;
        state.requests.insert(
            id,
            InFlight {
                prompt,
                params,
                generated: Vec::new(),
                worker,
                events: tx,
                cached_tokens: None,
                prompt_logprobs_sent: 0,
                prompt_logprobs_to_skip: 0,
            },
        );
        Ok((id, worker, rx))
    }

    /// Routes `prompt` (whose hash chain is `chain`) among the ready workers
    /// other than `exclude`, sends it, and records the dispatch.
    fn dispatch(
        &self,
        state: &mut State,
        id: RequestId,
        prompt: &[u32],
        chain: &[BlockHash],
        params: SamplingParams,
        exclude: Option<u64>,
    ) -> Result<u64, SubmitError> {
        let eligible: Vec<u64> = state
            .workers
            .iter()
            .filter(|&(&w, entry)| entry.state == WorkerState::Ready && Some(w) != exclude)
            .map(|(&w, _)| w)
            .collect();
        // A request scoring its prompt reads no cache on the worker: only load counts.
        let reads_cache = params.prompt_logprobs.is_none();
        let route_chain = if reads_cache { chain } else { &[] };
        let decision = state.router.route(prompt.len(), route_chain, &eligible).ok_or(SubmitError::NoWorker)?;
        let entry = state.workers.get_mut(&decision.worker).ok_or(SubmitError::NoWorker)?;
        let message = CoordinatorMessage::Generate { request_id: id, prompt_token_ids: prompt.to_vec(), params };
        if entry.tx.send(message).is_err() {
            return Err(SubmitError::NoWorker);
        }
        entry.in_flight += 1;
        let name = entry.name.clone();
        state.router.on_dispatch(id, decision.worker, prompt.len(), chain, decision.predicted_cached_tokens);
        let policy = state.router.policy().as_str();
        self.metrics.decisions.with_label_values(&[policy, &name]).inc();
        self.metrics
            .predicted_cached_tokens
            .with_label_values(&[&name])
            .inc_by(decision.predicted_cached_tokens.into());
        Ok(decision.worker)
    }

    /// Stops a request (client gone, or a stop string matched): the worker
    /// frees its blocks within a step.
    pub fn abort(&self, id: RequestId) {
        let mut state = self.lock();
        if let Some(req) = state.requests.remove(&id) {
            state.router.on_finish(id);
            if let Some(w) = state.workers.get_mut(&req.worker) {
                w.in_flight = w.in_flight.saturating_sub(1);
                let _ = w.tx.send(CoordinatorMessage::Abort { request_id: id });
            }
        }
    }

    /// Prompt tokens the request's worker found cached, once it reported.
    pub fn request_cached_tokens(&self, id: RequestId) -> Option<u32> {
        self.lock().requests.get(&id).and_then(|r| r.cached_tokens)
    }

    /// Requests dispatched that have not produced their first token.
    pub fn queued(&self) -> usize {
        self.lock().requests.values().filter(|r| r.cached_tokens.is_none()).count()
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
        let mut guard = self.lock();
        let state = &mut *guard;
        match message {
            WorkerMessage::TokenDelta {
                request_id,
                prompt_logprobs,
                new_token_ids,
                logprobs,
                finish_reason,
                num_prompt_tokens: _,
                num_cached_tokens,
            } => {
                let label = worker_label(state, worker);
                let Some(req) = state.requests.get_mut(&request_id) else { return };
                if req.worker != worker {
                    return; // a late delta from a worker we gave up on
                }
                if !prompt_logprobs.is_empty() {
                    let skip = req.prompt_logprobs_to_skip.min(prompt_logprobs.len());
                    req.prompt_logprobs_to_skip -= skip;
                    let owed = req.prompt.len().saturating_sub(1).saturating_sub(req.prompt_logprobs_sent);
                    let fresh: Vec<WireLogprobs> = prompt_logprobs.into_iter().skip(skip).take(owed).collect();
                    req.prompt_logprobs_sent += fresh.len();
                    if !fresh.is_empty() {
                        let _ = req.events.send(RequestEvent::PromptLogprobs(fresh));
                    }
                }
                if new_token_ids.is_empty() && finish_reason.is_none() {
                    return; // a prompt chunk's logprobs: the request has not started generating
                }
                if req.cached_tokens.is_none() {
                    req.cached_tokens = Some(num_cached_tokens);
                    self.metrics.actual_cached_tokens.with_label_values(&[&label]).inc_by(num_cached_tokens.into());
                }
                req.generated.extend_from_slice(&new_token_ids);
                let n = new_token_ids.len();
                if n > 0 {
                    let _ = req.events.send(RequestEvent::Tokens { ids: new_token_ids, logprobs });
                }
                state.router.on_tokens(request_id, n);
                if let Some(reason) = finish_reason {
                    let event = RequestEvent::Finished {
                        reason,
                        prompt_tokens: req.prompt.len() as u32,
                        cached_tokens: req.cached_tokens.unwrap_or(0),
                        worker: label,
                    };
                    let _ = req.events.send(event);
                    state.requests.remove(&request_id);
                    state.router.on_finish(request_id);
                    if let Some(w) = state.workers.get_mut(&worker) {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                }
            }
            WorkerMessage::Rejected { request_id, message } => {
                if let Some(req) = state.requests.remove(&request_id) {
                    state.router.on_finish(request_id);
                    let _ = req.events.send(RequestEvent::Failed { message });
                    if let Some(w) = state.workers.get_mut(&worker) {
                        w.in_flight = w.in_flight.saturating_sub(1);
                    }
                }
            }
            WorkerMessage::Stats(stats) => {
                state.router.on_stats(worker, &stats);
                if let Some(w) = state.workers.get_mut(&worker) {
                    w.stats = stats;
                    w.last_stats = Instant::now();
                }
            }
            WorkerMessage::KvEvents(events) => {
                if state.router.apply_kv_events(worker, &events) == EventOutcome::NeedSnapshot {
                    eprintln!("coordinator: KV event gap from {}; requesting a snapshot", worker_label(state, worker));
                    if let Some(w) = state.workers.get(&worker) {
                        let _ = w.tx.send(CoordinatorMessage::RequestKvSnapshot);
                    }
                }
            }
            WorkerMessage::KvSnapshot { last_event_id, hashes } => {
                state.router.apply_kv_snapshot(worker, last_event_id, hashes.into_iter().map(|(hash, _)| hash));
            }
        }
    }

    /// Drops a worker and moves its requests elsewhere.
    fn remove_worker(&self, worker: u64, why: &str) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(entry) = state.workers.remove(&worker) else { return };
        eprintln!("coordinator: worker {} ({}) lost: {why}", entry.name, entry.address);
        state.router.remove_worker(worker);
        let orphans: Vec<RequestId> =
            state.requests.iter().filter(|(_, r)| r.worker == worker).map(|(&id, _)| id).collect();
        for id in orphans {
            let req = state.requests.get(&id).expect("orphan exists");
            // Continue from what the client already has: the prompt plus the
            // streamed tokens, with the remaining budget.
            let mut prompt = req.prompt.clone();
            prompt.extend_from_slice(&req.generated);
            let done = req.generated.len() as u32;
            let mut params = req.params.clone();
            params.max_tokens = params.max_tokens.saturating_sub(done).max(1);
            params.min_tokens = params.min_tokens.saturating_sub(done);
            // The new worker scores the prompt from its start again: what
            // the client has is dropped, and nothing is asked once all came.
            let prompt_logprobs_sent = req.prompt_logprobs_sent;
            if prompt_logprobs_sent >= req.prompt.len().saturating_sub(1) {
                params.prompt_logprobs = None;
            }
            let chain = common::hash_prompt_blocks(&prompt, self.block_size);
            match self.dispatch(state, id, &prompt, &chain, params, Some(worker)) {
                Ok(target) => {
                    state.redispatches += 1;
                    self.metrics.redispatches.inc();
                    if let Some(req) = state.requests.get_mut(&id) {
                        req.worker = target;
                        req.prompt_logprobs_to_skip = prompt_logprobs_sent;
                    }
                }
                Err(_) => {
                    if let Some(req) = state.requests.remove(&id) {
                        let _ = req.events.send(RequestEvent::Failed {
                            message: "the worker serving this request was lost and no other worker is available".into(),
                        });
                    }
                }
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
        let worker_id = self.register_worker(&hello, address, tx);
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

    /// Lists a worker that passed the handshake; `tx` reaches it.
    fn register_worker(
        &self,
        hello: &Handshake,
        address: SocketAddr,
        tx: mpsc::UnboundedSender<CoordinatorMessage>,
    ) -> u64 {
        let mut state = self.lock();
        let id = state.next_worker_id;
        state.next_worker_id += 1;
        state.workers.insert(
            id,
            WorkerEntry {
                name: hello.worker_name.clone(),
                address,
                metrics_address: hello.metrics_address.as_deref().map(|m| metrics_address(m, address)),
                device: hello.device.clone(),
                tx: tx.clone(),
                state: WorkerState::Ready,
                stats: WorkerStats { kv_blocks_total: hello.kv_capacity_blocks, ..WorkerStats::default() },
                last_stats: Instant::now(),
                in_flight: 0,
            },
        );
        // Its cache may be warm (a reconnect): learn it before trusting events.
        state.router.add_worker(id);
        let _ = tx.send(CoordinatorMessage::RequestKvSnapshot);
        id
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
        if hello.block_size as usize != self.block_size {
            return Some(format!(
                "block size {} (this coordinator routes with {}; start both with the same --block-size)",
                hello.block_size, self.block_size
            ));
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

/// A worker's metrics address as Prometheus can reach it: a worker bound to
/// an unspecified address (0.0.0.0:9101) is reached at the IP it connected from.
fn metrics_address(advertised: &str, peer: SocketAddr) -> String {
    match advertised.parse::<SocketAddr>() {
        Ok(addr) if addr.ip().is_unspecified() => SocketAddr::new(peer.ip(), addr.port()).to_string(),
        _ => advertised.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(logprob: f32) -> WireLogprobs {
        WireLogprobs { logprob, top: Vec::new() }
    }

    fn delta(id: RequestId, prompt_logprobs: Vec<WireLogprobs>, tokens: Vec<u32>) -> WorkerMessage {
        WorkerMessage::TokenDelta {
            request_id: id,
            prompt_logprobs,
            logprobs: Vec::new(),
            new_token_ids: tokens,
            finish_reason: None,
            num_prompt_tokens: 5,
            num_cached_tokens: 0,
        }
    }

    /// Workers on channels instead of QUIC: what the cluster sends each one.
    fn cluster_with_workers(n: usize, policy: Policy) -> (Cluster, Vec<mpsc::UnboundedReceiver<CoordinatorMessage>>) {
        let model = ModelIdentity { name: "m".into(), config_hash: 1 };
        let cluster = Cluster::new(String::new(), model.clone(), 16, policy, 16);
        let mut inboxes = Vec::new();
        for i in 0..n {
            let hello = Handshake {
                protocol_version: PROTOCOL_VERSION,
                worker_name: format!("w{i}"),
                model: model.clone(),
                block_size: 16,
                kv_capacity_blocks: 100,
                max_model_len: 1024,
                metrics_address: None,
                device: "cpu".into(),
                auth_tag: Vec::new(),
            };
            let (tx, rx) = mpsc::unbounded_channel();
            cluster.register_worker(&hello, "127.0.0.1:1".parse().expect("address"), tx);
            inboxes.push(rx);
        }
        (cluster, inboxes)
    }

    /// The `Generate` a worker received last.
    fn generate_sent(inbox: &mut mpsc::UnboundedReceiver<CoordinatorMessage>) -> Option<(Vec<u32>, SamplingParams)> {
        let mut last = None;
        while let Ok(message) = inbox.try_recv() {
            if let CoordinatorMessage::Generate { prompt_token_ids, params, .. } = message {
                last = Some((prompt_token_ids, params));
            }
        }
        last
    }

    fn prompt_logprobs_received(events: &mut mpsc::UnboundedReceiver<RequestEvent>) -> Vec<f32> {
        let mut got = Vec::new();
        while let Ok(event) = events.try_recv() {
            if let RequestEvent::PromptLogprobs(lps) = event {
                got.extend(lps.iter().map(|l| l.logprob));
            }
        }
        got
    }

    /// A worker lost halfway through a prompt's logprobs: the next one
    /// scores the prompt again and the client gets each position once; lost
    /// after all of them came, the next one is not asked for them.
    #[test]
    fn redispatch_reports_each_prompt_logprob_once() {
        let (cluster, mut inboxes) = cluster_with_workers(3, Policy::RoundRobin);
        let scoring = SamplingParams { prompt_logprobs: Some(0), ..SamplingParams::greedy(4) };
        let (id, first, mut events) = cluster.submit(vec![1, 2, 3, 4, 5], scoring.clone()).expect("submitted");
        cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![]));
        cluster.remove_worker(first, "test");
        let second = cluster.request_worker(id).expect("re-dispatched");
        let (prompt, params) = generate_sent(&mut inboxes[second as usize]).expect("sent to the next worker");
        assert_eq!((prompt, params.prompt_logprobs), (vec![1, 2, 3, 4, 5], Some(0)));
        // The next worker sends positions 1.. again, in two chunks; then the first token.
        cluster.on_worker_message(second, delta(id, vec![lp(-1.5), lp(-2.5), lp(-3.0)], vec![]));
        cluster.on_worker_message(second, delta(id, vec![lp(-4.0)], vec![9]));
        assert_eq!(prompt_logprobs_received(&mut events), [-1.0, -2.0, -3.0, -4.0]);

        let (id, first, mut events) = cluster.submit(vec![1, 2, 3], scoring).expect("submitted");
        cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![7]));
        cluster.remove_worker(first, "test");
        let next = cluster.request_worker(id).expect("re-dispatched");
        let (prompt, params) = generate_sent(&mut inboxes[next as usize]).expect("sent to the next worker");
        assert_eq!((prompt, params.prompt_logprobs), (vec![1, 2, 3, 7], None));
        assert_eq!(prompt_logprobs_received(&mut events), [-1.0, -2.0]);
    }

    /// A request scoring its prompt reads no cache on its worker, so the
    /// router expects no hit for it and goes by load alone.
    #[test]
    fn scoring_requests_are_routed_without_expecting_cache_hits() {
        let (cluster, _inboxes) = cluster_with_workers(2, Policy::PrefixAware);
        let prompt: Vec<u32> = (0..40).collect();
        let chain = common::hash_prompt_blocks(&prompt, 16);
        let hashes = chain.iter().map(|&h| (h, None)).collect();
        cluster.on_worker_message(1, WorkerMessage::KvSnapshot { last_event_id: None, hashes });
        let predicted = || cluster.metrics.predicted_cached_tokens.with_label_values(&["w1"]).get();
        let (_, worker, _) = cluster.submit(prompt.clone(), SamplingParams::greedy(4)).expect("submitted");
        assert_eq!((worker, predicted()), (1, 32), "a plain request goes where its 2 blocks are");
        let scoring = SamplingParams { prompt_logprobs: Some(0), ..SamplingParams::greedy(4) };
        let (_, worker, _) = cluster.submit(prompt, scoring).expect("submitted");
        assert_eq!((worker, predicted()), (0, 32), "the scoring one goes to the idle worker");
    }
}
