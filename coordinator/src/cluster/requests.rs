//! The request table: every request in flight, the worker serving it and
//! what it has streamed so far. Dispatch asks the router for a worker;
//! token deltas are passed on to the HTTP handler waiting on the request;
//! a lost worker's requests are dispatched again elsewhere, with the prompt
//! and, as the request's own output, the tokens already streamed, so the
//! client's stream goes on with no token lost or repeated, and the next
//! tokens are the ones the lost worker would have made: penalties count
//! the streamed tokens and a seeded draw goes on at the same position.

use common::protocol::{CoordinatorMessage, TokenLogprobs};
use common::{BlockHash, FinishReason, RequestId, SamplingParams, WorkerId};
use tokio::sync::mpsc;

use super::{Cluster, InFlight, RequestEvent, State, SubmitError, peer_fetch};

/// The least time a prefix fetch is waited for before the prompt is
/// computed instead (the deadline is 4x the expected transfer, at least this).
const FETCH_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// A `WorkerMessage::TokenDelta`'s fields that the table uses.
pub(super) struct Delta {
    pub prompt_logprobs: Vec<TokenLogprobs>,
    pub new_token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    pub num_cached_tokens: u32,
}

impl Cluster {
    /// Sends a request to the worker the router picks, with its scheduling
    /// `priority` there. Returns its id, the worker chosen, and the stream
    /// of its events.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        mut params: SamplingParams,
        priority: i32,
    ) -> Result<(RequestId, WorkerId, mpsc::UnboundedReceiver<RequestEvent>), SubmitError> {
        // A sampled request without a seed gets one here, not on the worker:
        // should the worker be lost, the next one goes on with the same stream.
        if !params.is_greedy() && params.seed.is_none() {
            params.seed = Some(random_seed());
        }
        // Hashing is pure: do it before taking the lock.
        let chain = common::hash_prompt_blocks(&prompt, self.block_size);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut state = self.lock();
        if state.requests.len() >= self.max_in_flight {
            return Err(SubmitError::Overloaded(state.requests.len()));
        }
        let id = RequestId(state.next_request_id);
        let worker = self.dispatch(&mut state, id, (&prompt, &[]), &chain, (params.clone(), priority), None)?;
        state.next_request_id += 1;
        state.requests.insert(
            id,
            InFlight {
                prompt,
                params,
                priority,
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

    /// Routes a request among the ready workers other than `exclude`,
    /// sends it, and records the dispatch. `tokens` is its prompt and the
    /// output it already has (empty unless it is re-dispatched); `chain` is
    /// the hash chain of both together, which is what the worker's prefix
    /// cache matches.
    fn dispatch(
        &self,
        state: &mut State,
        id: RequestId,
        tokens: (&[u32], &[u32]),
        chain: &[BlockHash],
        (params, priority): (SamplingParams, i32),
        exclude: Option<WorkerId>,
    ) -> Result<WorkerId, SubmitError> {
        let (prompt, output) = tokens;
        let len = prompt.len() + output.len();
        let eligible = state.registry.ready_except(exclude);
        // A request scoring its prompt reads no cache on the worker: only load counts.
        let reads_cache = params.prompt_logprobs.is_none();
        let route_chain = if reads_cache { chain } else { &[] };
        let decision = state.router.route(len, route_chain, &eligible).ok_or(SubmitError::NoWorker)?;
        let message = CoordinatorMessage::Generate {
            request_id: id,
            prompt_token_ids: prompt.to_vec(),
            output_token_ids: output.to_vec(),
            params,
            priority,
        };
        // The part of the prefix it lacks and a peer holds comes over first, when that is cheaper.
        let usable = &route_chain[..route_chain.len().min(len.saturating_sub(1) / self.block_size)];
        let fetch =
            if self.peer_fetch { peer_fetch::plan(state, decision.worker, usable, self.block_size) } else { None };
        let entry = state.registry.get_mut(decision.worker).ok_or(SubmitError::NoWorker)?;
        let identity = entry.kv_identity;
        entry.in_flight += 1;
        let asked = fetch.and_then(|plan| {
            let transfer = state.fetches.next_id();
            let holder = state.registry.get(plan.from)?;
            holder
                .send(CoordinatorMessage::ExportKv { transfer, hashes: plan.hashes.clone() })
                .then_some((transfer, plan))
        });
        match asked {
            Some((transfer, plan)) => {
                tracing::debug!(blocks = plan.hashes.len(), from = plan.from.0, "fetching a prefix from a peer");
                let now = std::time::Instant::now();
                state.fetches.start(
                    transfer,
                    peer_fetch::Transfer {
                        request: id,
                        from: plan.from,
                        to: decision.worker,
                        identity,
                        generate: message,
                        bytes: 0,
                        started: now,
                        deadline: now + (plan.expected * 4).max(FETCH_GRACE),
                    },
                );
            }
            None => {
                let sent = state.registry.get(decision.worker).is_some_and(|w| w.send(message));
                if !sent {
                    if let Some(w) = state.registry.get_mut(decision.worker) {
                        w.in_flight -= 1;
                    }
                    return Err(SubmitError::NoWorker);
                }
            }
        }
        let entry = state.registry.get(decision.worker).ok_or(SubmitError::NoWorker)?;
        let name = entry.name.clone();
        let _span = tracing::debug_span!("request", id = id.0, worker = %name).entered();
        tracing::debug!(cached = decision.predicted_cached_tokens, "dispatched");
        state.router.on_dispatch(id, decision.worker, len, chain, decision.predicted_cached_tokens);
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
            if let Some(w) = state.registry.get_mut(req.worker) {
                w.in_flight = w.in_flight.saturating_sub(1);
                w.send(CoordinatorMessage::Abort { request_id: id });
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
    pub fn request_worker(&self, id: RequestId) -> Option<WorkerId> {
        self.lock().requests.get(&id).map(|r| r.worker)
    }

    /// New prompt logprobs and tokens of a request from `worker`; the last
    /// delta ends it.
    pub(super) fn on_token_delta(&self, state: &mut State, worker: WorkerId, request_id: RequestId, delta: Delta) {
        let Delta { prompt_logprobs, new_token_ids, logprobs, finish_reason, num_cached_tokens } = delta;
        let label = state.registry.label(worker);
        let Some(req) = state.requests.get_mut(&request_id) else { return };
        if req.worker != worker {
            return; // a late delta from a worker we gave up on
        }
        if !prompt_logprobs.is_empty() {
            let skip = req.prompt_logprobs_to_skip.min(prompt_logprobs.len());
            req.prompt_logprobs_to_skip -= skip;
            let owed = req.prompt.len().saturating_sub(1).saturating_sub(req.prompt_logprobs_sent);
            let fresh: Vec<TokenLogprobs> = prompt_logprobs.into_iter().skip(skip).take(owed).collect();
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
            state.registry.release(worker);
        }
    }

    /// `worker` refused a request. A draining worker's refusal sends it
    /// elsewhere; any other (bad input) fails it.
    pub(super) fn on_rejected(&self, state: &mut State, worker: WorkerId, request_id: RequestId, message: String) {
        if state.requests.get(&request_id).is_none_or(|r| r.worker != worker) {
            return;
        }
        if state.registry.is_draining(worker) {
            state.registry.release(worker);
            let label = format!("{} (draining)", state.registry.label(worker));
            self.redispatch(state, request_id, worker, &label);
            return;
        }
        if let Some(req) = state.requests.remove(&request_id) {
            state.router.on_finish(request_id);
            let _ = req.events.send(RequestEvent::Failed { message, rejected: true });
            state.registry.release(worker);
        }
    }

    /// Moves the requests of `lost` (already out of the registry and the
    /// router) to other workers; those no worker can take fail.
    pub(super) fn redispatch_orphans(&self, state: &mut State, lost: WorkerId, lost_name: &str) {
        let orphans: Vec<RequestId> =
            state.requests.iter().filter(|(_, r)| r.worker == lost).map(|(&id, _)| id).collect();
        for id in orphans {
            self.redispatch(state, id, lost, lost_name);
        }
    }

    /// Sends request `id` (which was on `from`) to another worker: the
    /// prompt as the client sent it, what was streamed as its output, and
    /// the parameters unchanged (the new worker counts that output against
    /// `max_tokens` and `min_tokens` itself). Fails the request when no
    /// worker can take it.
    fn redispatch(&self, state: &mut State, id: RequestId, from: WorkerId, from_label: &str) {
        let _span = tracing::info_span!("request", id = id.0).entered();
        let Some(req) = state.requests.get(&id) else { return };
        let (prompt, output) = (req.prompt.clone(), req.generated.clone());
        let (mut params, priority) = (req.params.clone(), req.priority);
        // The new worker scores the prompt from its start again: what the
        // client has is dropped, and nothing is asked once all came.
        let prompt_logprobs_sent = req.prompt_logprobs_sent;
        if prompt_logprobs_sent >= prompt.len().saturating_sub(1) {
            params.prompt_logprobs = None;
        }
        let chain = common::hash_prompt_blocks(&[prompt.as_slice(), output.as_slice()].concat(), self.block_size);
        state.router.on_finish(id);
        match self.dispatch(state, id, (&prompt, &output), &chain, (params, priority), Some(from)) {
            Ok(target) => {
                state.redispatches += 1;
                self.metrics.redispatches.inc();
                tracing::info!(
                    "request {id} moved from worker {from_label} to {} after {} streamed tokens",
                    state.registry.label(target),
                    output.len()
                );
                if let Some(req) = state.requests.get_mut(&id) {
                    req.worker = target;
                    req.prompt_logprobs_to_skip = prompt_logprobs_sent;
                }
            }
            Err(_) => {
                tracing::error!("request {id} from worker {from_label} failed: no other worker can take it");
                if let Some(req) = state.requests.remove(&id) {
                    let _ = req.events.send(RequestEvent::Failed {
                        message: "the worker serving this request was lost and no other worker is available".into(),
                        rejected: false,
                    });
                }
            }
        }
    }
}

/// A seed for a sampled request that gave none: different per request and per run.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
