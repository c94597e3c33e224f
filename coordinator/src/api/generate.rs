//! `POST /generate`, tinyvllm's simple API: a prompt (text or token ids)
//! in; the completion's text and ids, why it ended, where it ran and its
//! usage out, whole or as server-sent events. Logprob entries name their
//! token by id and text; prompt logprobs come first when asked for.

use std::sync::Arc;

use bytes::Bytes;
use common::FinishReason;
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::logprobs::TokenLogprob;
use super::prepare::{check_prompt, encode_prompt, fit_completion, parse};
use super::reply::Reply;
use super::request::{GenerateRequest, top_n};
use super::run::{self, ChoiceEnd, ChoiceSpec, Update};
use super::sse::{self, Events};
use super::structured::constrain;
use super::validate::Kind as Shape;
use crate::app::AppState;

/// The response, and each streamed event: those carry the text as it
/// comes, and the last one how the request ended.
#[derive(Serialize)]
struct GenerateBody {
    text: String,
    token_ids: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    finish_reason: Option<FinishReason>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<GenerateUsage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    worker: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<TokenLogprob>>,
    /// In the whole response, a `null` first: the first prompt token has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
}

#[derive(Serialize)]
struct GenerateUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
}

/// The event a failed stream ends with.
#[derive(Serialize)]
struct StreamError<'a> {
    error: StreamErrorBody<'a>,
}

#[derive(Serialize)]
struct StreamErrorBody<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
}

impl GenerateBody {
    fn text(text: String, token_ids: Vec<u32>) -> Self {
        Self { text, token_ids, finish_reason: None, usage: None, worker: None, logprobs: None, prompt_logprobs: None }
    }

    fn end(end: &ChoiceEnd) -> Self {
        Self {
            finish_reason: Some(end.finish_reason),
            usage: Some(GenerateUsage {
                prompt_tokens: end.prompt_tokens,
                completion_tokens: end.completion_tokens,
                cached_tokens: end.cached_tokens,
            }),
            worker: Some(end.worker.clone()),
            ..Self::text(String::new(), Vec::new())
        }
    }
}

/// Fields of a /generate body besides the sampling ones.
const FIELDS: &[(&str, Shape)] = &[
    ("prompt", Shape::String),
    ("prompt_token_ids", Shape::TokenIds),
    ("logprobs", Shape::Int),
    ("prompt_logprobs", Shape::Int),
];

/// `POST /generate`. Parsing and tokenizing run on the blocking pool.
pub async fn generate(app: Arc<AppState>, body: Bytes) -> Result<Reply, ApiError> {
    let (req, spec, logprobs) = app.offload(body.len(), move |app| plan(app, &body)).await?;
    let prompt_ids = spec.prompt_ids.clone();
    let rx = run::launch(&app, "/generate", vec![spec])?;
    if req.sampling.stream() {
        return Ok(sse::stream(&app.clone(), |events| write_events(events, app, rx, prompt_ids)));
    }
    let c = run::collect(rx, 1).await?.into_iter().next().ok_or_else(|| ApiError::internal("missing choice"))?;
    let end = c.end.as_ref().ok_or_else(|| ApiError::internal("missing end"))?;
    let tokenizer = &app.tokenizer;
    let out = GenerateBody {
        logprobs: logprobs.map(|_| TokenLogprob::list(tokenizer, &c.token_ids, &c.logprobs)),
        prompt_logprobs: req.prompt_logprobs.map(|_| {
            let entries = TokenLogprob::list(tokenizer, prompt_ids.get(1..).unwrap_or_default(), &c.prompt_logprobs);
            std::iter::once(None).chain(entries.into_iter().map(Some)).collect()
        }),
        ..GenerateBody { text: c.text, token_ids: c.token_ids, ..GenerateBody::end(end) }
    };
    Ok(Reply::json(&out))
}

/// Everything before the request runs: the body read and checked, the
/// prompt tokenized and fitted to the context.
fn plan(app: &AppState, body: &[u8]) -> Result<(GenerateRequest, ChoiceSpec, Option<u32>), ApiError> {
    let req: GenerateRequest = parse(body, &[], FIELDS)?;
    let max_len = app.max_model_len();
    let prompt_ids = match (&req.prompt, &req.prompt_token_ids) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("prompt", "give prompt or prompt_token_ids, not both")),
        (Some(text), None) => encode_prompt(app, text, max_len)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => return Err(ApiError::invalid("prompt", "prompt or prompt_token_ids is required")),
    };
    check_prompt(app, &prompt_ids, max_len)?;
    let logprobs = top_n("logprobs", req.logprobs)?;
    let mut params = req.sampling.to_params(16, logprobs)?;
    constrain(app, &req.sampling.structured, &mut params)?;
    params.prompt_logprobs = top_n("prompt_logprobs", req.prompt_logprobs)?;
    let params = fit_completion(app, max_len, "prompt", prompt_ids.len(), req.sampling.names_max_tokens(), &params)?;
    let spec = ChoiceSpec {
        prompt_ids,
        params,
        stops: req.sampling.stop_strings()?,
        priority: req.sampling.priority()?,
        skip_special_tokens: true,
    };
    Ok((req, spec, logprobs))
}

/// The stream's events; prompt logprobs come first, in events of their
/// own, each entry naming its prompt token.
async fn write_events(
    events: Events,
    app: Arc<AppState>,
    mut rx: mpsc::UnboundedReceiver<Update>,
    prompt_ids: Vec<u32>,
) {
    // The prompt token whose logprob comes next (the first has none).
    let mut next_prompt_token = 1;
    while let Some(update) = rx.recv().await {
        let sent = match update {
            Update::PromptLogprobs { logprobs, .. } => {
                let ids = prompt_ids.get(next_prompt_token..).unwrap_or_default();
                next_prompt_token += logprobs.len();
                let entries = TokenLogprob::list(&app.tokenizer, ids, &logprobs);
                let event = GenerateBody {
                    prompt_logprobs: Some(entries.into_iter().map(Some).collect()),
                    ..GenerateBody::text(String::new(), Vec::new())
                };
                events.send(&event).await
            }
            Update::Delta { text, token_ids, logprobs, .. } => {
                let logprobs =
                    (!logprobs.is_empty()).then(|| TokenLogprob::list(&app.tokenizer, &token_ids, &logprobs));
                events.send(&GenerateBody { logprobs, ..GenerateBody::text(text, token_ids) }).await
            }
            Update::End(end) => {
                let _ = events.send(&GenerateBody::end(&end)).await;
                return;
            }
            Update::Failed { message, .. } => {
                let _ = events
                    .send(&StreamError { error: StreamErrorBody { message: &message, kind: "server_error" } })
                    .await;
                return;
            }
        };
        if sent.is_err() {
            return; // client gone; dropping rx aborts the request
        }
    }
}
