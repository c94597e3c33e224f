//! Drives the choices of one HTTP request: submits each to the cluster,
//! turns the worker's token deltas into text (incremental detokenization,
//! stop strings with hold-back) and hands updates to the response writer.
//! If the writer goes away (the client disconnected), the request is
//! aborted on its worker, which frees its blocks within a step.

use std::sync::Arc;

use common::FinishReason;
use common::protocol::TokenLogprobs;
use common::{RequestId, SamplingParams, WorkerId};
use tokio::sync::mpsc;

use super::error::ApiError;
use crate::app::AppState;
use crate::cluster::{Cluster, RequestEvent, SubmitError};
use crate::text::{IncrementalDetokenizer, StopStrings};

pub struct ChoiceSpec {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub stops: Vec<String>,
    /// Scheduling priority on the worker (lower first).
    pub priority: i32,
    /// Special tokens decode to nothing (true, as by default in vLLM), or
    /// to their text where a parser reads them (`[TOOL_CALLS]`,
    /// `<|channel|>`); EOS is never text.
    pub skip_special_tokens: bool,
}

#[derive(Debug)]
pub enum Update {
    /// Log-probabilities of the next prompt tokens (see `RequestEvent::PromptLogprobs`).
    PromptLogprobs {
        index: usize,
        logprobs: Vec<TokenLogprobs>,
    },
    Delta {
        index: usize,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    End(ChoiceEnd),
    /// `rejected`: by the worker, as invalid (a 400, not a 503).
    Failed {
        index: usize,
        message: String,
        rejected: bool,
    },
}

#[derive(Debug, Clone)]
pub struct ChoiceEnd {
    pub index: usize,
    pub finish_reason: FinishReason,
    /// The stop string that ended the choice, if one did.
    pub stop: Option<String>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    pub worker: String,
}

/// Aborts the request on its worker unless disarmed (dropped early = the
/// client is gone).
struct AbortGuard {
    cluster: Cluster,
    id: RequestId,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.cluster.abort(self.id);
        }
    }
}

/// Submits every choice; fails as a whole (429/503) before anything streams.
pub fn launch(
    app: &Arc<AppState>,
    endpoint: &'static str,
    specs: Vec<ChoiceSpec>,
) -> Result<mpsc::UnboundedReceiver<Update>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut submitted = Vec::with_capacity(specs.len());
    for spec in specs {
        match app.cluster.submit(spec.prompt_ids.clone(), spec.params.clone(), spec.priority) {
            Ok((id, worker, events)) => submitted.push((spec, id, worker, events)),
            Err(e) => {
                for (_, id, _, _) in submitted {
                    app.cluster.abort(id);
                }
                return Err(match e {
                    SubmitError::Overloaded(_) => ApiError::overloaded(e.to_string()),
                    SubmitError::NoWorker => ApiError::unavailable(match app.cluster.formation_status() {
                        // Workers wait to be formed into a pipeline: say what they lack.
                        Some(status) => format!("{e}: {}", status.problem),
                        None => e.to_string(),
                    }),
                });
            }
        }
    }
    for (index, (spec, id, worker, events)) in submitted.into_iter().enumerate() {
        let app = app.clone();
        let tx = tx.clone();
        tokio::spawn(drive_choice(app, endpoint, index, spec, id, worker, events, tx));
    }
    Ok(rx)
}

#[allow(clippy::too_many_arguments)]
async fn drive_choice(
    app: Arc<AppState>,
    endpoint: &'static str,
    index: usize,
    spec: ChoiceSpec,
    id: RequestId,
    first_worker: WorkerId,
    mut events: mpsc::UnboundedReceiver<RequestEvent>,
    tx: mpsc::UnboundedSender<Update>,
) {
    let mut guard = AbortGuard { cluster: app.cluster.clone(), id, armed: true };
    let mut detok = IncrementalDetokenizer::new(app.tokenizer.clone(), &spec.prompt_ids, spec.skip_special_tokens);
    // Kept specials are text, but the token that ends the output is not (vLLM's rule).
    let hidden = |token: u32| !spec.skip_special_tokens && app.tokenizer.eos_token_ids().contains(&token);
    let mut stops = StopStrings::new(spec.stops.clone());
    let mut completion_tokens = 0u32;
    let started = std::time::Instant::now();
    while let Some(event) = events.recv().await {
        match event {
            RequestEvent::PromptLogprobs(logprobs) => {
                if tx.send(Update::PromptLogprobs { index, logprobs }).is_err() {
                    return; // client gone: the guard aborts
                }
            }
            RequestEvent::Tokens { mut ids, mut logprobs } => {
                if completion_tokens == 0 {
                    app.metrics.first_token(endpoint, started.elapsed());
                }
                // One token at a time: a delta may carry several (a step
                // that accepted speculative tokens), and a stop string ends
                // the choice at its own token, dropping those after it.
                let (mut text, mut stopped) = (String::new(), None);
                for (n, &token) in ids.iter().enumerate() {
                    let piece = if hidden(token) { String::new() } else { detok.push(&[token]) };
                    let out = stops.push(&piece);
                    text.push_str(&out.text);
                    if out.stopped.is_some() {
                        stopped = out.stopped;
                        ids.truncate(n + 1);
                        logprobs.truncate(n + 1);
                        break;
                    }
                }
                completion_tokens += ids.len() as u32;
                app.metrics.tokens_generated(ids.len());
                if tx.send(Update::Delta { index, text, token_ids: ids, logprobs }).is_err() {
                    return; // client gone: the guard aborts
                }
                if let Some(stop) = stopped {
                    // Looked up before the abort removes the request.
                    let worker = app.cluster.request_worker(id).unwrap_or(first_worker);
                    let worker = app.cluster.worker_label(worker);
                    let cached_tokens = app.cluster.request_cached_tokens(id).unwrap_or(0);
                    app.cluster.abort(id);
                    guard.armed = false;
                    app.metrics.request_finished(endpoint, started.elapsed());
                    let end = ChoiceEnd {
                        index,
                        finish_reason: FinishReason::Stop,
                        stop: Some(stop),
                        prompt_tokens: spec.prompt_ids.len() as u32,
                        completion_tokens,
                        cached_tokens,
                        worker,
                    };
                    let _ = tx.send(Update::End(end));
                    return;
                }
            }
            RequestEvent::Finished { reason, prompt_tokens, cached_tokens, worker } => {
                guard.armed = false;
                app.metrics.request_finished(endpoint, started.elapsed());
                let rest = stops.push(&detok.flush());
                let tail = if rest.stopped.is_some() { rest.text } else { rest.text + &stops.flush() };
                if !tail.is_empty() {
                    let _ = tx.send(Update::Delta { index, text: tail, token_ids: Vec::new(), logprobs: Vec::new() });
                }
                // A stop string the coordinator found ends the choice as "stop",
                // whatever the worker's reason for the last token.
                let finish_reason = if rest.stopped.is_some() { FinishReason::Stop } else { reason };
                let end = ChoiceEnd {
                    index,
                    finish_reason,
                    stop: rest.stopped,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    worker,
                };
                let _ = tx.send(Update::End(end));
                return;
            }
            RequestEvent::Failed { message, rejected } => {
                guard.armed = false;
                let _ = tx.send(Update::Failed { index, message, rejected });
                return;
            }
        }
    }
    guard.armed = false;
    let _ = tx.send(Update::Failed { index, message: "request ended without a result".into(), rejected: false });
}

/// Everything one choice produced, for non-streaming responses.
#[derive(Debug, Default, Clone)]
pub struct Collected {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    /// From the prompt's second token on, when `prompt_logprobs` was asked.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    pub end: Option<ChoiceEnd>,
}

/// Waits for every choice to end.
pub async fn collect(mut rx: mpsc::UnboundedReceiver<Update>, n: usize) -> Result<Vec<Collected>, ApiError> {
    let mut choices = vec![Collected::default(); n];
    let mut ended = 0;
    while ended < n {
        match rx.recv().await {
            Some(Update::PromptLogprobs { index, logprobs }) => choices[index].prompt_logprobs.extend(logprobs),
            Some(Update::Delta { index, text, token_ids, logprobs }) => {
                let c = &mut choices[index];
                c.text.push_str(&text);
                c.token_ids.extend(token_ids);
                c.logprobs.extend(logprobs);
            }
            Some(Update::End(end)) => {
                let index = end.index;
                choices[index].end = Some(end);
                ended += 1;
            }
            Some(Update::Failed { message, rejected: true, .. }) => return Err(ApiError::bad_request(message)),
            Some(Update::Failed { message, .. }) => return Err(ApiError::unavailable(message)),
            None => return Err(ApiError::internal("generation stopped unexpectedly")),
        }
    }
    Ok(choices)
}
