//! The coordinator's view of the cluster: registered workers, requests in
//! flight, and the QUIC side that connects them.
//!
//! One lock guards the state (TGI's router keeps it in one task; a short
//! critical section is as simple here). The state has three parts, each in
//! its own file: the worker `registry` (state, health, load), the
//! `requests` table (dispatch, token deltas, re-dispatch) and the router.
//! `connection` runs each worker's QUIC link and feeds its frames in. When
//! a worker is lost (its connection closes, or it misses 3 stats intervals)
//! its requests are sent to another worker with the prompt plus the tokens
//! already streamed, so the client's stream goes on with no token lost or
//! repeated.
//!
//! Where a request goes is the router's decision (`crate::router`): the
//! cluster feeds it the workers' KV events, stats and every dispatch, first
//! token and finish, and asks it for a worker under the same lock.

mod connection;
mod offers;
mod peer_fetch;
mod plan;
mod preparing;
mod registry;
mod requests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::protocol::{ModelIdentity, TokenLogprobs};
use common::{FinishReason, RequestId, SamplingParams, WorkerId};
use prometheus::{IntCounter, IntCounterVec, Opts};
use tokio::sync::mpsc;

pub use connection::{AUTH_TIMEOUT, MAX_UNAUTHENTICATED};
pub use offers::{FormationStatus, OfferInfo};
pub use preparing::{FileProgress, PreparingInfo};
pub use registry::{WorkerInfo, WorkerLoadInfo, WorkerState};

use crate::router::{Policy, Router};
use registry::Registry;

/// A worker that misses this many stats intervals is declared lost.
pub const MISSED_STATS_LIMIT: u32 = 3;
pub use common::protocol::STATS_INTERVAL;

/// What an HTTP handler receives for its request.
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    /// Log-probabilities of the next prompt tokens (`prompt_logprobs`), in
    /// order from the second prompt token, each once, all before `Tokens`.
    PromptLogprobs(Vec<TokenLogprobs>),
    Tokens {
        ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    /// `worker` names the worker that finished it (it changes on re-dispatch).
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        cached_tokens: u32,
        worker: String,
    },
    /// `rejected`: the worker refused the request itself (a client error,
    /// such as a draft model asked of a worker without one).
    Failed {
        message: String,
        rejected: bool,
    },
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("no worker is available")]
    NoWorker,
    #[error("too many requests in flight ({0}); retry later")]
    Overloaded(usize),
}

/// A row of the request table.
struct InFlight {
    /// The prompt as the client sent it (for usage and re-dispatch).
    prompt: Vec<u32>,
    params: SamplingParams,
    /// Scheduling priority, sent again on re-dispatch.
    priority: i32,
    generated: Vec<u32>,
    worker: WorkerId,
    events: mpsc::UnboundedSender<RequestEvent>,
    /// Prompt tokens the first worker found cached (kept across re-dispatch).
    cached_tokens: Option<u32>,
    /// Prompt logprobs passed on so far, and how many of the next worker's
    /// to drop because an earlier worker sent them already.
    prompt_logprobs_sent: usize,
    prompt_logprobs_to_skip: usize,
}

struct State {
    registry: Registry,
    requests: HashMap<RequestId, InFlight>,
    router: Router,
    next_request_id: u64,
    redispatches: u64,
    /// Prefix fetches from peer workers in flight (`peer_fetch`).
    fetches: peer_fetch::Fetches,
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
    /// Offers of `--layers auto` workers not yet formed into pipelines.
    formation: Arc<Mutex<offers::Formation>>,
    /// Workers downloading or loading their weights.
    preparing: Arc<Mutex<preparing::PreparingWorkers>>,
    /// Whether a prefix another worker holds is fetched from it (`peer_fetch`).
    peer_fetch: bool,
}

impl Cluster {
    /// `block_size` must equal the workers' (they are refused otherwise):
    /// the router hashes prompts in blocks of that size.
    pub fn new(secret: String, model: ModelIdentity, max_in_flight: usize, policy: Policy, block_size: usize) -> Self {
        let state = State {
            registry: Registry::default(),
            requests: HashMap::new(),
            router: Router::new(policy, block_size),
            next_request_id: 0,
            redispatches: 0,
            fetches: peer_fetch::Fetches::default(),
        };
        Self {
            state: Arc::new(Mutex::new(state)),
            secret: Arc::new(secret),
            model,
            max_in_flight,
            block_size,
            metrics: RoutingMetrics::new(),
            formation: Arc::default(),
            preparing: Arc::default(),
            peer_fetch: true,
        }
    }

    /// Prefixes other workers hold are computed, never fetched (`--no-peer-fetch`).
    pub fn without_peer_fetch(mut self) -> Self {
        self.peer_fetch = false;
        self
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
        self.lock().registry.is_ready()
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        let state = self.lock();
        state.registry.infos(|id| {
            let load = state.router.load(id);
            let (mut running, mut waiting) = (0, 0);
            for r in state.requests.values().filter(|r| r.worker == id) {
                if r.cached_tokens.is_some() { running += 1 } else { waiting += 1 }
            }
            WorkerLoadInfo {
                running,
                waiting,
                pending_prefill_tokens: load.pending_prefill_tokens,
                active_blocks: load.active_blocks,
            }
        })
    }

    pub fn in_flight(&self) -> usize {
        self.lock().requests.len()
    }

    pub fn redispatches(&self) -> u64 {
        self.lock().redispatches
    }

    /// The worker's name for responses (its id if it is already gone).
    pub fn worker_label(&self, id: WorkerId) -> String {
        self.lock().registry.label(id)
    }

    /// Asks the local workers to drain (see `Registry::drain_local`).
    pub fn drain_local(&self) {
        self.lock().registry.drain_local();
    }

    /// Marks workers that stopped reporting as lost.
    ///
    /// Silence is only counted while the coordinator runs: when a tick comes
    /// late (the runtime was starved, or the process stopped), the time it
    /// overslept is excused, since stats that arrived meanwhile could not be
    /// read yet. A dead connection is still closed by QUIC's own idle
    /// timeout, which needs no task of ours to run.
    pub async fn watchdog(self) {
        let mut tick = tokio::time::interval(STATS_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = std::time::Instant::now();
        loop {
            tick.tick().await;
            let now = std::time::Instant::now();
            let overslept = now.saturating_duration_since(last).saturating_sub(STATS_INTERVAL);
            last = now;
            let stale = {
                let mut state = self.lock();
                if overslept > STATS_INTERVAL / 4 {
                    state.registry.excuse_stall(overslept, now);
                }
                self.expire_fetches(&mut state, now);
                state.registry.silent_for(STATS_INTERVAL * MISSED_STATS_LIMIT, now)
            };
            for id in stale {
                self.remove_worker(id, "missed 3 stats intervals");
            }
        }
    }

    /// The supervisor saw the process of local worker `name` exit: it is
    /// dropped now (its requests move elsewhere) rather than when its
    /// stats stop.
    pub fn worker_process_exited(&self, name: &str, status: &str) {
        let ids = self.lock().registry.named(name);
        for id in ids {
            self.remove_worker(id, &format!("its process exited ({status})"));
        }
    }

    /// Drops a worker and moves its requests elsewhere.
    pub(crate) fn remove_worker(&self, worker: WorkerId, why: &str) {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(entry) = state.registry.remove(worker) else { return };
        tracing::info!("worker {} ({}) left: {why}", entry.name, entry.address);
        state.router.remove_worker(worker);
        // Fetches from it release their requests (to compute their prompts).
        self.expire_fetches(state, std::time::Instant::now());
        self.redispatch_orphans(state, worker, &entry.name);
    }
}

#[cfg(test)]
mod tests;
